"""Commands other packages add (``vf_sandbox.commands``): judge comes from placement, and a
broken or clashing one costs only itself."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from placement.cli_judge import JUDGE_COMMAND
from runtimes.cli import COMMAND_GROUP, Command, CommandFactory, build_parser, commands, main


def test_placement_registers_judge_in_the_group() -> None:
    assert [c.name for c in commands.installed_commands(frozenset())] == ["judge"]
    assert commands.installed_commands(frozenset())[0] is JUDGE_COMMAND


def _hello(command: CommandFactory) -> None:
    hello = command("hello", "say hello", reporting=True)
    hello.set_defaults(func=lambda args: 7 if args.json else 0)


HELLO = Command(name="hello", add=_hello, summary="say hello")
NOT_A_COMMAND = object()
CLASHING = Command(name="ls", add=_hello)


def _installed(monkeypatch: pytest.MonkeyPatch, *targets: tuple[str, str]) -> None:
    points = [EntryPoint(name, f"{__name__}:{value}", COMMAND_GROUP) for name, value in targets]

    def fake(group: str) -> list[EntryPoint]:
        assert group == COMMAND_GROUP
        return points

    monkeypatch.setattr(commands, "entry_points", fake)


def test_an_added_command_runs_and_is_listed_first(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _installed(monkeypatch, ("hello", "HELLO"))
    assert main(["hello", "--json"]) == 7
    parser = build_parser()
    assert "\n  hello    say hello\n  check    the conformance" in parser.format_help()
    assert capsys.readouterr().err == ""


def test_a_broken_or_clashing_command_is_left_out_with_one_line_each(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _installed(
        monkeypatch,
        ("gone", "MISSING"),
        ("object", "NOT_A_COMMAND"),
        ("ls", "CLASHING"),
        ("hello", "HELLO"),
    )
    found = commands.installed_commands(frozenset({"ls"}))
    assert [c.name for c in found] == ["hello"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3, err
    assert "'gone' command" in err[0] and "cannot be loaded: AttributeError" in err[0]
    assert "takes the name of another command" in err[1]
    assert "is not a Command (object)" in err[2]


def test_the_runtime_commands_work_without_any_added_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _installed(monkeypatch)
    parser = build_parser()
    text = parser.format_help()
    assert "The subcommands:" in text and "judge" not in text
    with pytest.raises(SystemExit):
        parser.parse_args(["judge", "r", "--judges", "j"])
