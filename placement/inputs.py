"""Judge inputs: one snapshot of the rollout, materialised under ``/tmp/vf-agent/<id>/``.

The snapshot (task, trace) is taken once, before any judge runs, as exact bytes: every
judge reads the same ``task.json``, ``trace.json`` and ``transcript.md``. The input
directory never lives in the rollout's workdir (the world being judged). Its ``<id>`` is
generated and validated, and the directory must be fresh: a planted file, directory or
symlink — at ``/tmp/vf-agent`` itself or at ``<id>`` — is refused, and so is a
``/tmp/vf-agent`` that another user (the policy's account) made before the judge came.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from harnesses.base import Trace
from runtimes import Runtime

from .errors import InputTamperError, PlacementConfigError

INPUTS_ROOT = "/tmp/vf-agent"
INPUT_FILES = ("task.json", "transcript.md", "trace.json")
VERDICT_FILE = "verdict.json"

_ID = re.compile(r"^[a-z0-9][a-z0-9-]{2,62}[a-z0-9]$")

_PREPARE = r"""
set -u
root="$1"; dir="$1/$2"
if [ -L "$root" ]; then echo "symlink planted at $root" >&2; exit 3; fi
if [ -e "$root" ] && [ ! -d "$root" ]; then echo "not a directory: $root" >&2; exit 3; fi
if [ -d "$root" ]; then
  owner=$(stat -c %u "$root") || exit 4
  if [ "$owner" != 0 ] && [ "$owner" != "$(id -u)" ]; then
    echo "$root belongs to uid $owner, not to root or the judge's user" >&2; exit 3
  fi
fi
mkdir -p "$root" || exit 4
chmod 1777 "$root" 2>/dev/null
if [ -e "$dir" ] || [ -L "$dir" ]; then echo "already exists: $dir" >&2; exit 3; fi
mkdir -m 0700 "$dir" || exit 4
"""

_VERIFY = r"""
dir="$1"; shift
for f in "$dir"/* "$dir"/.[!.]* "$dir"/..?*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  name=${f##*/}; ok=0
  for want in "$@"; do [ "$name" = "$want" ] && ok=1; done
  if [ "$ok" -eq 0 ] || [ -L "$f" ] || [ ! -f "$f" ]; then echo "unexpected: $f" >&2; exit 3; fi
done
"""


def new_agent_id(name: str) -> str:
    """A fresh, unguessable id for one agent run: ``<slug>-<16 hex>``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "agent"
    return validate_agent_id(f"{slug}-{secrets.token_hex(8)}")


def validate_agent_id(agent_id: str) -> str:
    """Raises PlacementConfigError unless ``agent_id`` is a safe single path component."""
    if not _ID.fullmatch(agent_id) or "--" in agent_id:
        raise PlacementConfigError(f"invalid agent id {agent_id!r}")
    return agent_id


_JUDGING_FIELDS = {"agents", "extra_usage", "total_usage"}
"""Trace fields that record judging (:meth:`~harnesses.base.Trace.attach_agents`)."""


@dataclass(frozen=True)
class Snapshot:
    """The rollout as every judge sees it: exact bytes, taken once."""

    task: dict[str, Any]
    task_json: bytes
    trace_json: bytes
    transcript_md: bytes

    @classmethod
    def take(cls, task: dict[str, Any], trace: Trace) -> Snapshot:
        task_json = json.dumps(task, indent=2, ensure_ascii=False, sort_keys=True).encode()
        return cls(
            task=json.loads(task_json),
            task_json=task_json,
            # The policy's run only: the runs of earlier judges (trace.agents) stay out.
            trace_json=trace.model_dump_json(indent=2, exclude=_JUDGING_FIELDS).encode(),
            transcript_md=render_transcript(task, trace).encode(),
        )

    def files(self) -> dict[str, bytes]:
        return {
            "task.json": self.task_json,
            "transcript.md": self.transcript_md,
            "trace.json": self.trace_json,
        }


def render_transcript(task: dict[str, Any], trace: Trace) -> str:
    """A readable Markdown rendering of the policy's run."""
    lines = [f"# Transcript ({trace.harness}, model {trace.model or 'unknown'})", ""]
    prompt = task.get("prompt")
    if isinstance(prompt, str):
        lines += ["## Task", "", prompt, ""]
    shown: int = 0
    for turn in trace.turns:
        for message in turn.request_messages[shown:]:
            lines += _render_message(message)
        shown = len(turn.request_messages)
        if turn.reply is not None:
            lines += _render_message(turn.reply.assistant_message())
        for result in turn.tool_results:
            lines += [
                f"### tool result `{result.name}` (exit {result.exit_code})",
                "",
                "```",
                result.output,
                "```",
                "",
            ]
        if turn.reply is not None:
            shown += 1 + len(turn.tool_results)
    if trace.output is not None:
        lines += ["## Final output", "", trace.output, ""]
    if trace.error is not None:
        lines += ["## Error", "", f"{trace.error.kind}: {trace.error.message}", ""]
    return "\n".join(lines)


def _render_message(message: dict[str, Any]) -> list[str]:
    role = str(message.get("role", "?"))
    if role == "tool":
        return []  # rendered from the tool results, with exit codes
    out = [f"## {role}", ""]
    content = message.get("content")
    if isinstance(content, str) and content:
        out += [content, ""]
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        out += [f"**tool call** `{function.get('name')}`: `{function.get('arguments')}`", ""]
    return out


async def materialise(runtime: Runtime, agent_id: str, snapshot: Snapshot) -> str:
    """Write the snapshot to a fresh ``/tmp/vf-agent/<agent_id>/``; return that directory.

    Raises:
        InputTamperError: ``/tmp/vf-agent`` is a symlink or not a directory, ``<id>``
            already exists, or anything but the three input files is found after writing.
        SandboxError: the sandbox failed (typed, from runtimes).
    """
    validate_agent_id(agent_id)
    directory = f"{INPUTS_ROOT}/{agent_id}"
    prepared = await runtime.exec(["sh", "-c", _PREPARE, "sh", INPUTS_ROOT, agent_id], timeout=60)
    if prepared.exit_code == 3:
        raise InputTamperError(f"refusing judge inputs at {directory}: {prepared.stderr.strip()}")
    if prepared.exit_code != 0:
        raise InputTamperError(f"cannot create {directory}: {prepared.stderr.strip()}")
    for name, data in snapshot.files().items():
        await runtime.write(f"{directory}/{name}", data)
    verified = await runtime.exec(["sh", "-c", _VERIFY, "sh", directory, *INPUT_FILES], timeout=60)
    if verified.exit_code != 0:
        raise InputTamperError(f"judge inputs at {directory} were tampered with: {verified.stderr}")
    return directory
