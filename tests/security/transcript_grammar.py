"""What the transcript tests of attack classes 17 and 21 check a rendered transcript against.

A transcript (``transcript.md``, or the prompt of a tool-less judge that inlines it) is
split into its *data fences* and the lines outside them, the way a CommonMark reader does:
a line of up to three spaces then three or more backticks (or tildes) opens a fence, and a
line of up to three spaces, then at least as many of the same character and nothing but
spaces or tabs, closes it; lines end at ``\\n``, ``\\r\\n`` or ``\\r``.

The invariant (:func:`structure_violations`): the document ends outside any fence, and
every line outside a fence is one :mod:`placement.transcript` writes from its own
templates (:data:`RENDERER_LINES`), its inline values being whole JSON literals in a code
span no backtick inside them can end. So no content — a tool output, a message, a tool
name, an argument, a role — produced a line a reader takes for the transcript's structure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from placement.transcript import ROLES, TRANSCRIPT_PREAMBLE

_LINE_END = re.compile(r"\r\n|\r|\n")
_OPEN = re.compile(r"^ {0,3}(?P<run>`{3,}|~{3,})(?P<info>.*)$")

SOURCES = "sent by the harness|the agent's claim"
ROLE_WORDS = "|".join([*ROLES, "role not recognised"])


def _value(n: int) -> str:
    return rf"(?P<t{n}>`+) (?P<v{n}>.*) (?P=t{n})"


RENDERER_LINES = [
    re.compile(p)
    for p in (
        r"",
        r"# Transcript of the policy's run",
        re.escape(TRANSCRIPT_PREAMBLE),
        rf"- (?:harness|model|kind|role|name|answers tool call|exit code|timed out|proxy note"
        rf"|request fields the proxy dropped): {_value(1)}",
        r"## Task",
        r"## Turn \d+: (?:a model call the harness made|a request the model proxy relayed)",
        rf"### (?:Message|Claimed message) \d+: (?:{ROLE_WORDS}) \((?:{SOURCES})\)",
        r"### Reply: assistant \((?:received by the harness|seen by the model proxy)\)",
        r"### Model call failed \((?:received by the harness|seen by the model proxy)\)",
        rf"#### Tool call \d+: {_value(1)} \(id {_value(2)}\)",
        rf"### Tool result \d+ \((?:run by the harness|recorded with the turn)\): {_value(1)}",
        r"arguments:|output:|content parts:|other fields:",
        r"## Final output|## Error",
        r"The history this request claims does not continue what the earlier turns recorded: "
        r"the agent changed, trimmed or rewrote it\. All of it follows\.",
        r"The messages of this request are the agent's claim about the conversation; the proxy "
        r"did not see them happen\.",
    )
]


@dataclass
class Parsed:
    """A document split the CommonMark way: lines outside fences and the fences' bodies."""

    outside: list[str] = field(default_factory=list)
    fences: list[str] = field(default_factory=list)
    unclosed: bool = False


def parse(document: str) -> Parsed:
    parsed = Parsed()
    lines = _LINE_END.split(document)
    fence: str | None = None
    body: list[str] = []
    for line in lines:
        if fence is None:
            opened = _OPEN.match(line)
            if opened and not (opened["run"][0] == "`" and "`" in opened["info"]):
                fence, body = opened["run"], []
            else:
                parsed.outside.append(line)
            continue
        closing = re.fullmatch(rf" {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*", line)
        if closing:
            parsed.fences.append("\n".join(body))
            fence = None
        else:
            body.append(line)
    parsed.unclosed = fence is not None
    return parsed


def _inline_ok(match: re.Match[str]) -> bool:
    for n in (1, 2):
        if f"v{n}" not in match.groupdict() or match[f"v{n}"] is None:
            continue
        value, ticks = match[f"v{n}"], match[f"t{n}"]
        if re.search(f"`{{{len(ticks)},}}", value):
            return False
        try:
            json.loads(value)
        except ValueError:
            return False
    return True


def structure_violations(document: str) -> list[str]:
    """The lines outside fences that the renderer did not write (empty: the invariant
    holds); an unclosed fence at the end is a violation too."""
    parsed = parse(document)
    bad = []
    for line in parsed.outside:
        match = next((m for p in RENDERER_LINES if (m := p.fullmatch(line))), None)
        if match is None or not _inline_ok(match):
            bad.append(line)
    if parsed.unclosed:
        bad.append("<the document ends inside a fence>")
    return bad
