"""The typed faces of the blocking facades stay in step with the async API they stand for.

A facade (:class:`~runtimes.blocking.Blocking`) restates nothing at run time; its face (a
protocol in :mod:`runtimes.sync_faces` / :mod:`harnesses.session_faces`) gives the type
checker the blocking signatures. Here: every public coroutine method of the async class
has a member of the face with the same parameters (names, kinds, defaults, annotations),
every member of the face is the async class's, and what a facade class defines itself
matches its face. ``tests/sync_usage.py`` is code the type checker verifies.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harnesses.agent_session import AgentSession
from harnesses.session import AgentSessionFactory, SyncAgentSession, SyncAgentSessionFactory
from harnesses.session_faces import NOT_BLOCKING, AgentSessionFace, AgentSessionFactoryFace
from runtimes.base import Runtime
from runtimes.blocking import Blocking, face_only
from runtimes.routes import HostRoute
from runtimes.shell import ShellSession
from runtimes.sync import SyncHostRoute, SyncRuntime, SyncShellSession
from runtimes.sync_faces import HostRouteFace, RuntimeFace, ShellSessionFace

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Face:
    target: type
    face: type
    facade: type[Blocking]
    returns: dict[str, str] = field(default_factory=dict)
    """Members whose result the facade wraps: the face's return annotation."""
    parameters: dict[str, dict[str, str]] = field(default_factory=dict)
    """Parameters the blocking face takes more of: member -> parameter -> annotation."""
    instance_attributes: frozenset[str] = frozenset()
    """Members the async class sets in ``__init__`` (not on the class)."""
    not_blocking: frozenset[str] = frozenset()


FACES = [
    Face(
        Runtime,
        RuntimeFace,
        SyncRuntime,
        returns={"shell": "SyncShellSession", "expose_host": "SyncHostRoute"},
        parameters={"exec": {"stdin": "SyncStdin"}},
    ),
    Face(ShellSession, ShellSessionFace, SyncShellSession, instance_attributes=frozenset({"pid"})),
    Face(HostRoute, HostRouteFace, SyncHostRoute),
    Face(
        AgentSession,
        AgentSessionFace,
        SyncAgentSession,
        instance_attributes=frozenset({"rollout_id"}),
        not_blocking=NOT_BLOCKING,
    ),
    Face(
        AgentSessionFactory,
        AgentSessionFactoryFace,
        SyncAgentSessionFactory,
        returns={"create": "SyncAgentSession"},
    ),
]
IDS = [face.face.__name__ for face in FACES]


def _function(cls: type, name: str) -> Callable[..., Any] | None:
    """The plain function behind ``cls.name`` (unwrapping class and static methods), or
    ``None`` for a property or a data attribute."""
    for klass in cls.__mro__:
        if name in vars(klass):
            member = vars(klass)[name]
            if isinstance(member, classmethod | staticmethod):
                function: Callable[..., Any] = member.__func__
                return function
            return member if inspect.isfunction(member) else None
    return None


def _coroutine_methods(cls: type) -> set[str]:
    return {
        name
        for name in dir(cls)
        if not name.startswith("_") and inspect.iscoroutinefunction(getattr(cls, name))
    }


def _members(face: type) -> set[str]:
    return {
        name
        for klass in face.__mro__
        if klass.__module__.endswith("_faces")
        for name in vars(klass)
        if not name.startswith("_")
    }


def _text(annotation: object) -> str:
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return text.replace("builtins.", "")


def _shape(function: Callable[..., Any]) -> tuple[list[tuple[str, str, object, str]], str]:
    """Parameters (without ``self``/``cls``) as (name, kind, default, annotation), and the
    return annotation."""
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    return (
        [(p.name, p.kind.name, p.default, _text(p.annotation)) for p in parameters],
        _text(signature.return_annotation),
    )


@pytest.mark.parametrize("case", FACES, ids=IDS)
def test_every_coroutine_method_has_a_blocking_face(case: Face) -> None:
    missing = _coroutine_methods(case.target) - case.not_blocking - _members(case.face)
    assert missing == set(), f"{case.face.__name__} lacks {sorted(missing)}"


@pytest.mark.parametrize("case", FACES, ids=IDS)
def test_every_member_of_a_face_is_the_async_classs(case: Face) -> None:
    annotated = {
        name for klass in case.target.__mro__ for name in vars(klass).get("__annotations__", {})
    }
    stale = {
        name
        for name in _members(case.face)
        if not hasattr(case.target, name)
        and name not in annotated
        and name not in case.instance_attributes
    }
    assert stale == set(), (
        f"{case.face.__name__} has {sorted(stale)}, which {case.target.__name__} lacks"
    )


@pytest.mark.parametrize("case", FACES, ids=IDS)
def test_a_faces_methods_take_the_async_parameters(case: Face) -> None:
    checked = 0
    for name in sorted(_members(case.face)):
        face_function = _function(case.face, name)
        if face_function is None:  # a property: the async class has it (the test above)
            assert _function(case.target, name) is None, f"{name} is a method of the target"
            continue
        target_function = _function(case.target, name)
        assert target_function is not None, f"{case.target.__name__}.{name} is not a method"
        face_parameters, face_returns = _shape(face_function)
        target_parameters, target_returns = _shape(target_function)
        widened = case.parameters.get(name, {})
        target_parameters = [
            (p, kind, default, widened.get(p, annotation))
            for p, kind, default, annotation in target_parameters
        ]
        assert face_parameters == target_parameters, f"{case.face.__name__}.{name}"
        assert face_returns == case.returns.get(name, target_returns), f"{name} returns"
        checked += 1
    assert checked >= len(_coroutine_methods(case.target) - case.not_blocking)


@pytest.mark.parametrize("case", FACES, ids=IDS)
def test_what_a_facade_defines_itself_matches_its_face(case: Face) -> None:
    for name in sorted(_members(case.face)):
        own = _function(case.facade, name)
        face_function = _function(case.face, name)
        if own is None or face_function is None or own.__module__.endswith("blocking"):
            continue
        assert _shape(own)[0] == _shape(face_function)[0], f"{case.facade.__name__}.{name}"


@pytest.mark.parametrize("case", FACES, ids=IDS)
def test_a_facade_inherits_its_face_only_while_type_checking(case: Face) -> None:
    # At run time the face's members would hide Blocking's lookup of the async method.
    assert case.face not in case.facade.__mro__
    assert issubclass(case.facade, Blocking)


def test_a_faces_body_is_never_run() -> None:
    with pytest.raises(TypeError):
        face_only()


def test_the_type_checker_accepts_the_typed_usage_and_refuses_a_wrong_one(tmp_path: Path) -> None:
    """mypy on ``tests/sync_usage.py``: clean; on a copy with wrong calls: each
    wrong call is an error."""
    pytest.importorskip("mypy")  # a dev tool: the floors venv lacks it
    usage = ROOT / "tests" / "sync_usage.py"
    wrong = tmp_path / "sync_wrong.py"
    wrong.write_text(
        usage.read_text()
        + "\n\ndef wrong(rt: SyncRuntime) -> None:\n"
        + "    n: int = rt.read('x')\n"  # bytes
        + "    rt.exec('ls', timout=3)\n"  # no such keyword
        + "    rt.shell().run(3)\n"  # command is a str
    )
    command = [sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir"]
    command += [str(tmp_path / "cache"), "--follow-imports=silent", str(usage), str(wrong)]
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert [e for e in errors if "sync_usage.py" in e] == []
    assert len([e for e in errors if "sync_wrong.py" in e]) == 3, done.stdout
