"""Judge inputs: one record of the rollout, materialised under ``/tmp/vf-agent/<id>/``.

The inputs (task, trace) are taken once, before any judge runs, as exact bytes: every
judge reads the same ``task.json``, ``trace.json`` and ``transcript.md`` (rendered by
:mod:`placement.transcript`, which no recorded content can escape). A malformed record is
refused when the inputs are taken (:class:`~placement.errors.RecordInvalid`). The input
directory never lives in the rollout's workdir (the world being judged). Its ``<id>`` is
generated and validated, and the directory must be fresh: a planted file, directory or
symlink — at ``/tmp/vf-agent`` itself or at ``<id>`` — is refused, and so is a
``/tmp/vf-agent`` that another user (the policy's account) made before the judge came.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from harnesses.base import Trace
from runtimes import Runtime, SandboxError, SandboxFileExistsError

from .errors import InputTamperError, PlacementConfigError, RecordInvalid
from .transcript import JUDGING_FIELDS, render_transcript, scrub, validate_record

INPUTS_ROOT = "/tmp/vf-agent"
INPUT_FILES = ("task.json", "transcript.md", "trace.json")

__all__ = [
    "INPUTS_ROOT",
    "INPUT_FILES",
    "VERDICT_FILE",
    "JudgeInputs",
    "materialise",
    "new_agent_id",
    "render_transcript",
    "validate_agent_id",
]
VERDICT_FILE = "verdict.json"

_ID = re.compile(r"^[a-z0-9][a-z0-9-]{2,62}[a-z0-9]$")


def new_agent_id(name: str) -> str:
    """A fresh, unguessable id for one agent run: ``<slug>-<16 hex>``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "agent"
    return validate_agent_id(f"{slug}-{secrets.token_hex(8)}")


def validate_agent_id(agent_id: str) -> str:
    """Raises PlacementConfigError unless ``agent_id`` is a safe single path component."""
    if not _ID.fullmatch(agent_id) or "--" in agent_id:
        raise PlacementConfigError(f"invalid agent id {agent_id!r}")
    return agent_id


@dataclass(frozen=True)
class JudgeInputs:
    """The rollout as every judge sees it: exact bytes, taken once."""

    task: dict[str, Any]
    task_json: bytes
    trace_json: bytes
    transcript_md: bytes

    @classmethod
    def take(cls, task: dict[str, Any], trace: Trace) -> JudgeInputs:
        """The inputs of ``task`` and ``trace``, validated at the judging boundary
        (:func:`~placement.transcript.validate_record`).

        Raises:
            RecordInvalid: ``task`` is not a JSON object, or ``trace`` is malformed.
        """
        if not isinstance(task, dict):
            raise RecordInvalid(f"the rollout's task is a {type(task).__name__}, not an object")
        try:
            task_text = json.dumps(scrub(task), indent=2, ensure_ascii=False, sort_keys=True)
            task_copy = json.loads(task_text)
        except (TypeError, ValueError, RecursionError) as exc:
            name = type(exc).__name__
            raise RecordInvalid(f"the rollout's task is not JSON ({name})") from None
        # The policy's run only: the runs of earlier judges (trace.agents) stay out.
        record = validate_record(trace)
        return cls(
            task=task_copy,
            task_json=task_text.encode(),
            trace_json=record.trace.model_dump_json(indent=2, exclude=JUDGING_FIELDS).encode(),
            transcript_md=render_transcript(task_copy, record).encode(),
        )

    def files(self) -> dict[str, bytes]:
        return {
            "task.json": self.task_json,
            "transcript.md": self.transcript_md,
            "trace.json": self.trace_json,
        }


async def materialise(
    runtime: Runtime, agent_id: str, inputs: JudgeInputs, *, judge_gid: int | None = None
) -> str:
    """Write the inputs to a fresh ``/tmp/vf-agent/<agent_id>/``; return that directory.

    Every step is a file operation of the runtime (:meth:`~runtimes.base.Runtime.lstat`,
    ``mkdir``, ``write``), served by the channel agent where there is one: no program of
    the sandbox (``sh``, ``mkdir``, ``stat``), which a root policy may have replaced, takes
    part. ``judge_gid``: the group of the judge's own account; the directory is then
    ``root:<judge group>`` with mode ``1770`` (the judge may add its verdict, never change
    or remove the inputs), else ``0700`` for the sandbox's default user.

    Raises:
        InputTamperError: ``/tmp/vf-agent`` is a symlink, not a directory or another
            user's, ``<id>`` already exists, or an input file is not what was written.
        SandboxError: the sandbox failed (typed, from runtimes).
    """
    validate_agent_id(agent_id)
    directory = f"{INPUTS_ROOT}/{agent_id}"
    root = await runtime.lstat(INPUTS_ROOT)
    if root.kind == "absent":
        with contextlib.suppress(SandboxFileExistsError):  # made meanwhile: checked below
            await runtime.mkdir(INPUTS_ROOT, mode=0o1777)
        root = await runtime.lstat(INPUTS_ROOT)
    if root.kind != "directory":
        raise InputTamperError(
            f"refusing judge inputs at {directory}: {INPUTS_ROOT} is a {root.kind}"
        )
    try:
        if judge_gid is None:
            await runtime.mkdir(directory, mode=0o700)
        else:
            await runtime.mkdir(directory, mode=0o1770, gid=judge_gid)
    except SandboxFileExistsError:
        raise InputTamperError(f"refusing judge inputs at {directory}: already exists") from None
    except SandboxError as exc:
        raise InputTamperError(f"cannot create {directory}: {exc}") from exc
    mine = (await runtime.lstat(directory)).uid
    if root.uid not in (0, mine):
        raise InputTamperError(
            f"refusing judge inputs at {directory}: {INPUTS_ROOT} belongs to uid {root.uid}, "
            "not to root or the judge machinery's user"
        )
    for name, data in inputs.files().items():
        await runtime.write(f"{directory}/{name}", data)
    for name, data in inputs.files().items():
        info = await runtime.lstat(f"{directory}/{name}")
        if info.kind != "file" or info.links != 1 or info.uid != mine or info.size != len(data):
            raise InputTamperError(
                f"judge inputs at {directory} were tampered with: {name} is a {info.kind} "
                f"({info.links} links, uid {info.uid}, {info.size} bytes)"
            )
    return directory
