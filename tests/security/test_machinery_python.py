"""Attack class 13: code the policy left where privileged machinery would load it.

The machinery installs an agent harness into the sandbox after the policy ran there: it
creates a venv, runs pip, probes the interpreter and the installed version, and launches
the agent (here as the sandbox's default user, as a judge's install does). The policy has
left, in its workdir and in a directory of its own that the caller's environment names
(``PATH``, ``PYTHONPATH``, ``BASH_ENV``, ``ENV``, ``PIP_CONFIG_FILE``: an image whose
``PYTHONPATH`` is the policy's workspace is common), a ``pip/`` and ``venv/`` and
``ensurepip/`` package, ``platform.py``, ``json.py`` and other stdlib names,
``sitecustomize.py``, ``usercustomize.py``, a ``.pth`` file, a pip configuration pointing
at its own wheels, and ``python3``, ``sh``, ``mkdir``... wrappers first on ``PATH``. Each
planted file writes a marker when it runs. The safe outcome: no marker, the install and
its fingerprint hold, the agent's answer is the model's.

And the sandbox influencing the install itself (simulated: the venv is changed as root
between pip and the check): :class:`~harnesses.errors.HarnessInstallError` from the check
against the wheels' ``RECORD``, never a fingerprint of the changed tree.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from harnesses.base import Budget, Trace
from harnesses.errors import HarnessInstallError
from harnesses.installed import AgentLaunch
from harnesses.scripted import reply
from runtimes import ExecResult, Runtime, SandboxError, open_runtime
from runtimes.machinery import MACHINERY_PATH
from tests.harnesses.conftest import ScriptedFactory
from tests.harnesses.conftest import scripted as scripted
from tests.harnesses.test_installed import TinyConfig, TinyHarness, build_tiny_wheel
from tests.ssh.sshd import SSHServer, image_present, venv_part_mounts

from .conftest import Hostile

pytestmark = pytest.mark.anyio

TARGETS = ["docker-root", "docker-user", "ssh-root", "ssh-user", "modal-fake", "modal-user"]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHServer]:
    """The SSH test host, with what ``python3 -m venv`` needs (Debian's ``python3-venv``)
    copied out of ``vf-sandbox/python`` (same base, same interpreter) and mounted read-only."""
    assert image_present(), "vf-sandbox/sshd is missing: build it with `make images`"
    mounts = venv_part_mounts(tmp_path_factory.mktemp("venv-parts"))
    with SSHServer(tmp_path_factory.mktemp("sshd"), volumes=mounts) as server:
        yield server


# Python modules the machinery's interpreters would import from a directory on sys.path.
MODULES = [
    "pip",
    "venv",
    "ensurepip",
    "platform",
    "json",
    "hashlib",
    "logging",
    "subprocess",
    "shutil",
    "tempfile",
    "zipfile",
    "csv",
    "sitecustomize",
    "usercustomize",
]
# Programs the machinery runs by name: a wrapper first on the caller's PATH.
PROGRAMS = ["python3", "sh", "mkdir", "chown", "flock", "date", "rm", "cat", "tar", "id"]


def marker_code(marks: str, name: str) -> str:
    return (
        f"import os as _os\n"
        f"with open({marks!r} + '/{name}-' + str(_os.getuid()), 'w') as _f:\n"
        f"    _f.write('ran')\n"
    )


# After its marker, a planted module hands over to the real one (so the machinery goes on
# as if nothing happened, and the markers show every step that loaded policy code).
PASS_THROUGH = """
import importlib as _il, sys as _sys
_entry = _os.path.dirname(_os.path.abspath(__file__))
if __file__.endswith("__init__.py"):
    _entry = _os.path.dirname(_entry)
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _entry]
del _sys.modules[__name__]
_real = _il.import_module(__name__)
_sys.modules[__name__] = _real
globals().update({k: v for k, v in vars(_real).items() if not k.startswith("__")})
"""


def plants(pol: str, workdir: str) -> dict[str, str]:
    """path -> content of everything the policy leaves behind."""
    marks = f"{pol}/marks"
    files: dict[str, str] = {}
    for where, tag in ((workdir, "cwd"), (f"{pol}/lib", "pythonpath")):
        for module in MODULES:
            code = marker_code(marks, f"{tag}-{module}")
            if not module.endswith("customize"):
                code += PASS_THROUGH
            if module in ("pip", "venv", "ensurepip"):
                files[f"{where}/{module}/__init__.py"] = code
                files[f"{where}/{module}/__main__.py"] = code
            else:
                files[f"{where}/{module}.py"] = code
        files[f"{where}/x.pth"] = f"import os; open('{marks}/{tag}-pth-' + str(os.getuid()), 'w')\n"
    for program in PROGRAMS:
        real = f"/usr/bin/{program}" if program != "sh" else "/bin/dash"
        files[f"{pol}/bin/{program}"] = (
            f'#!/bin/dash\n: > {marks}/bin-{program}\nexec {real} "$@"\n'
        )
    shell_rc = f": > {marks}/shell-startup\n"
    files[f"{pol}/bashenv"] = shell_rc
    files[f"{pol}/pip.conf"] = (
        f"[global]\nfind-links = {pol}/wheels\nindex-url = file://{pol}/index\n"
    )
    return files


def caller_env(pol: str) -> dict[str, str]:
    """The environment of an image that names the policy's directories."""
    return {
        "PATH": f"{pol}/bin:{MACHINERY_PATH}",
        "PYTHONPATH": f"{pol}/lib",
        "PYTHONSTARTUP": f"{pol}/lib/json.py",
        "PYTHONUSERBASE": f"{pol}/userbase",
        "BASH_ENV": f"{pol}/bashenv",
        "ENV": f"{pol}/bashenv",
        "PIP_CONFIG_FILE": f"{pol}/pip.conf",
        "PIP_FIND_LINKS": f"{pol}/wheels",
    }


def python_config(hostile: Hostile, env: dict[str, str]) -> Any:
    """The target with python3-venv (vf-sandbox/python; SSH: the module's host) and no
    network."""
    if not isinstance(hostile.config, dict):  # SSH: the server's config model
        return hostile.config.model_copy(update={"env": env})
    config: dict[str, Any] = {**hostile.config, "env": env}
    if hostile.backend != "subprocess":
        config["image"] = "vf-sandbox/python:latest"
    if hostile.backend == "docker":
        config["network"] = "none"
    return config


class IsolatedTiny(TinyHarness):
    """The tiny agent launched as the harnesses launch theirs: through ``venv_entry``."""

    def launch(
        self, task: str, *, base_url: str, api_key: str, run_dir: str, budget: Budget
    ) -> AgentLaunch:
        env = {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        return AgentLaunch(argv=[*self.venv_entry("vf-tiny-agent"), task], env=env)


async def policy_plants(rt: Runtime, hostile: Hostile, files: dict[str, str], pol: str) -> None:
    """The policy writes its files as itself (programs last: its own ``sh`` is planted)."""
    script = (
        'mkdir -p -m 0777 "$1/marks" "$1/wheels" "$1/userbase" && '
        'chmod 0777 "$1/marks" && mkdir -p "$(dirname "$2")" && cat > "$2" && chmod a+rx "$2"'
    )
    for path, text in sorted(files.items(), key=lambda item: "/bin/" in item[0]):
        done = await rt.exec(
            ["/bin/sh", "-c", script, "sh", pol, path],
            stdin=text.encode(),
            user=hostile.user,
            env={"PATH": MACHINERY_PATH},
        )
        assert done.exit_code == 0, done.stderr


async def markers(rt: Runtime, pol: str) -> list[str]:
    listed = await rt.exec(["/bin/ls", "-A", f"{pol}/marks"], env={"PATH": MACHINERY_PATH})
    assert listed.exit_code == 0, listed.stderr
    return listed.stdout.split()


@pytest.mark.attack(13)
@pytest.mark.parametrize("hostile", TARGETS, indirect=True)
async def test_planted_python_never_runs_in_the_machinery(
    hostile: Hostile, scripted: ScriptedFactory, tmp_path: Path
) -> None:
    wheelhouse = tmp_path / "wheels"
    build_tiny_wheel(wheelhouse)
    pol = f"/tmp/vf-pol-{secrets.token_hex(4)}"
    async with open_runtime(python_config(hostile, caller_env(pol))) as rt:
        await policy_plants(rt, hostile, plants(pol, rt.workdir), pol)
        # an install root of this test's own (the SSH host is shared by the module's tests)
        root = f"/opt/vf-harness-{pol.rsplit('-', 1)[1]}"
        harness = IsolatedTiny(TinyConfig(wheelhouse=str(wheelhouse), install_root=root))
        server = scripted([reply("the model's own answer")])
        failures: list[Exception] = []
        trace: Trace | None = None
        for step in (
            lambda: harness.setup(rt),
            lambda: harness.installed_version(rt),
            lambda: harness.sandbox_python(rt),
            lambda: harness.run("task", runtime=rt, model=server.endpoint()),
        ):
            try:
                outcome = await step()
            except (HarnessInstallError, SandboxError) as exc:  # the markers say what ran
                failures.append(exc)
                outcome = None
            if isinstance(outcome, Trace):
                trace = outcome
        ran = await markers(rt, pol)
        assert ran == [], f"planted code ran in the machinery: {ran} ({failures})"
        assert failures == []
        assert await harness.installed_version(rt) == "0.1.0"
        assert trace is not None and trace.ok, trace and trace.error
        assert trace.output == "the model's own answer"
        # the fingerprint holds: a second setup reuses the verified venv, installs nothing
        venv = harness.venv
        await harness.setup(rt)
        assert harness.venv == venv
        log = await rt.read(f"{harness.agent_dir}/install.log")
        assert len(log.decode().splitlines()) == 1


Tamper = Literal["rewrite", "symlink", "pth", "extra-dist"]

TAMPER = {
    # the agent's module rewritten after pip wrote it
    "rewrite": 'printf \'print("forged")\\n\' > "$sp/vf_tiny_agent/__init__.py"',
    # replaced by a link to a file the policy owns
    "symlink": (
        "printf 'print(\"forged\")\\n' > /tmp/forged.py && "
        'rm "$sp/vf_tiny_agent/__init__.py" && ln -s /tmp/forged.py "$sp/vf_tiny_agent/__init__.py"'
    ),
    # a .pth file: code every start of the venv's Python runs
    "pth": "printf 'import os\\n' > \"$sp/zz-policy.pth\"",
    # a distribution no wheel of the host's wheelhouse holds
    "extra-dist": (
        'mkdir "$sp/evil-1.0.dist-info" && '
        'printf "Name: evil\\n" > "$sp/evil-1.0.dist-info/METADATA"'
    ),
}


class TamperedTiny(TinyHarness):
    """Installs, then lets "the sandbox" change the venv before the check runs."""

    tamper: str = ""

    async def _run_install(self, runtime: Runtime, argv: list[str]) -> ExecResult:
        result = await super()._run_install(runtime, argv)
        venv = argv[6]
        script = f'set -e; sp=$(echo "$1"/lib/python3*/site-packages); {self.tamper}'
        done = await runtime.exec(["sh", "-c", script, "sh", venv])
        assert done.exit_code == 0, done.stderr
        return result


@pytest.mark.attack(13)
@pytest.mark.parametrize("tamper", sorted(TAMPER))
@pytest.mark.parametrize("hostile", ["subprocess", "docker-root"], indirect=True)
async def test_an_install_the_sandbox_changed_is_refused(
    hostile: Hostile, tamper: str, tmp_path: Path
) -> None:
    wheelhouse = tmp_path / "wheels"
    build_tiny_wheel(wheelhouse)
    config = python_config(hostile, {})
    root = str(tmp_path / "agents") if hostile.backend == "subprocess" else "/opt/vf-harness"
    async with open_runtime(config) as rt:
        harness = TamperedTiny(TinyConfig(wheelhouse=str(wheelhouse), install_root=root))
        harness.tamper = TAMPER[tamper]
        with pytest.raises(HarnessInstallError) as caught:
            await harness.setup(rt)
        expected = {
            "rewrite": "differs from the wheel",
            "symlink": "link",
            "pth": ".pth files no wheel installed",
            "extra-dist": "no wheel of the host's wheelhouse",
        }[tamper]
        assert expected in str(caught.value)
        assert await harness.installed_version(rt) is None


@pytest.mark.attack(13)
def test_mini_never_looks_its_config_up_in_its_working_directory() -> None:
    """mini resolves ``-c mini.yaml`` against its cwd first: a judge whose cwd is the policy's
    workdir would load the policy's ``mini.yaml`` (its prompts). The harness passes the
    built-in config's absolute path in the verified venv instead."""
    from harnesses.mini_swe_agent import MiniSweAgentConfig, MiniSweAgentHarness

    config = MiniSweAgentConfig(config_specs=["mini.yaml", "benchmarks/swebench", "/etc/own.yaml"])
    harness = MiniSweAgentHarness(config)
    harness._venv, harness._site = "/opt/v/venv", "lib/python3.11/site-packages"
    launch = harness.launch("t", base_url="http://x", api_key="k", run_dir="/r", budget=Budget())
    specs = [launch.argv[i + 1] for i, arg in enumerate(launch.argv) if arg == "-c"]
    builtin = "/opt/v/venv/lib/python3.11/site-packages/minisweagent/config"
    assert specs[:3] == [
        f"{builtin}/mini.yaml",
        f"{builtin}/benchmarks/swebench.yaml",
        "/etc/own.yaml",
    ]
    assert launch.argv[:5] == ["/opt/v/venv/bin/python", "-I", "-B", "-u", "/opt/v/venv/bin/mini"]
