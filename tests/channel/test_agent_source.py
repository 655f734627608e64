"""The agent's one source, joined from the parts of ``runtimes/channel/agent/``: valid for the
oldest Python the agent supports, free of the imports joining drops, and speaking the same
headers as the host (the typed headers of the shared ``wire`` part round-trip)."""

from __future__ import annotations

import ast
import re

import pytest

from runtimes.channel import agent, agent_source
from runtimes.channel.agent import wire

STDLIB = {
    "contextlib",
    "errno",
    "hmac",
    "os",
    "queue",
    "select",
    "signal",
    "socket",
    "stat",
    "struct",
    "subprocess",
    "sys",
    "threading",
    "time",
}
"""What the agent imports at start: a module more changes its start-up and the files it
reports for verification."""


def joined() -> str:
    source = agent_source()
    assert int(source[:10]) == len(source) - 10
    return source[10:].decode("utf-8")


def test_the_joined_agent_parses_as_python_3_8() -> None:
    tree = ast.parse(joined(), "vf-sandbox-agent", feature_version=(3, 8))
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.module == "__future__" and not node.level, ast.dump(node)
    assert imported == STDLIB


def test_every_part_is_joined_once_in_order() -> None:
    source = joined()
    names = ("Fields", "RelayStream", "Output", "Exec", "Read", "Conn", "Agent")
    positions = [re.search(rf"\nclass {name}\b[(:]", source) for name in names]
    assert all(positions), positions
    starts = [match.start() for match in positions if match]
    assert starts == sorted(starts)
    assert source.count("\nclass RelayStream") == 1
    assert source.rstrip().endswith("main()")
    assert 'if __name__ in ("__main__", "__vf_sandbox_agent__"):' in source
    assert "TYPE_CHECKING" not in source and "from ." not in source


@pytest.mark.parametrize(
    "header",
    [
        wire.ExecHeader(["printf", "%s", "\udcff"], "/tmp", {"A": "b"}, None, 1 << 40, True, False),
        wire.ExecHeader(["true"], "/", {}, "nobody:nogroup", 0, False, True),
        wire.WriteHeader("/tmp/x\udc80", True),
        wire.ReadHeader("/etc/hosts", 1024),
        wire.PathHeader("/tmp"),
        wire.ListenHeader(32, 256 * 1024, 0),
        wire.Hello(wire.VERSION, 7, 7, 0, 0, wire.NON_DUMPABLE, "3.8.0", "/usr/bin/python3.8"),
        wire.ErrorReport(2, "prog", "No such file or directory"),
    ],
)
def test_typed_headers_round_trip(header: object) -> None:
    data = header.to_wire()  # type: ignore[attr-defined]
    again = type(header).from_wire(data)  # type: ignore[attr-defined]
    assert vars(again) == vars(header)


def test_the_exec_header_keeps_its_wire_layout() -> None:
    """Version 3 of the protocol: flags, cap, cwd, user, argv, env."""
    header = wire.ExecHeader(["a"], "/w", {"K": "v"}, None, 5, True, True)
    expected = (
        wire.U8.pack(3)
        + wire.U64.pack(5)
        + wire.text("/w")
        + wire.text("")
        + wire.U32.pack(1)
        + wire.text("a")
        + wire.U32.pack(1)
        + wire.text("K")
        + wire.text("v")
    )
    assert header.to_wire() == expected


def test_a_part_importing_a_later_part_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "PARTS", ("serve", "wire"))
    agent.joined_source.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="not before it"):
            agent.joined_source()
    finally:
        monkeypatch.undo()
        agent.joined_source.cache_clear()
