"""The lifecycle the base owns for every backend: the state enum, the live-sandbox slot, the
``_before_start`` hook, the exit registry and the owed kills, on a minimal in-memory backend
(so each property is checked without the cost of a real sandbox)."""

from __future__ import annotations

import anyio
import pytest

from runtimes import SandboxError, SandboxUnavailableError
from runtimes.base import Runtime, State
from runtimes.config import RuntimeConfig
from runtimes.lifecycle import live_runtimes
from runtimes.limits import live_cap
from runtimes.models import ExecRequest, OutputSink

pytestmark = pytest.mark.anyio


class _Config(RuntimeConfig):
    type: str = "memory"
    max_live: int = 1


class _Memory(Runtime):
    """Files in a dict; ``_exec`` records what it was asked to run."""

    name = "memory-test"
    config_model = _Config

    def __init__(self, config: RuntimeConfig, *, hold_before_start: anyio.Event | None = None):
        super().__init__(config)
        self.config: _Config
        self.files: dict[str, bytes] = {}
        self.ran: list[tuple[str, ...]] = []
        self.made: list[str] = []
        self.closed_with: list[str] = []
        self.fail_kills = 0
        self._hold = hold_before_start

    def _live_cap(self) -> int | None:
        return self.config.max_live

    async def _before_start(self) -> None:
        self.made.append("reserved")
        if self._hold is not None:
            await self._hold.wait()

    async def _start(self) -> str:
        self.made.append("sandbox")
        return "/work"

    async def _close(self) -> None:
        self.closed_with.append(",".join(self.made))

    async def _alive(self) -> bool:
        return True

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        self.ran.append(request.argv)
        return 0

    async def _read(self, path: str, limit: int) -> bytes:
        return self.files[path]

    async def _write(self, path: str, data: bytes) -> None:
        self.files[path] = data

    async def _kill_orphan_groups(self, pgids: frozenset[int]) -> None:
        if self.fail_kills:
            self.fail_kills -= 1
            raise SandboxError("the kill did not get through")
        self.ran.append(("kill", *map(str, sorted(pgids))))


async def test_state_moves_new_open_closed_and_registry_follows() -> None:
    rt = _Memory(_Config())
    assert rt.state is State.NEW
    async with rt:
        assert rt.state is State.OPEN
        assert rt in live_runtimes()
    assert rt.state is State.CLOSED and rt.closed
    assert rt not in live_runtimes()


async def test_live_slot_is_taken_before_start_and_given_back_at_close() -> None:
    cap = live_cap(_Memory.name)
    async with _Memory(_Config()):
        assert cap.live == 1
        second = _Memory(_Config())
        with anyio.move_on_after(0.2) as waited:
            await second.start()
        assert waited.cancel_called, "a second sandbox started beyond max_live=1"
        assert second.state is State.NEW and second.made == []
    assert cap.live == 0


async def test_close_during_before_start_discards_what_it_made() -> None:
    release = anyio.Event()
    rt = _Memory(_Config(), hold_before_start=release)
    failure: list[BaseException] = []

    async def start() -> None:
        try:
            await rt.start()
        except SandboxUnavailableError as exc:
            failure.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(start)
        await anyio.wait_all_tasks_blocked()
        await rt.close()
        release.set()
    assert failure, "start() went on after close()"
    assert rt.closed_with == ["reserved"], "what _before_start made was not discarded"
    assert "sandbox" not in rt.made
    assert live_cap(_Memory.name).live == 0


async def test_owed_kills_are_paid_before_the_next_command_and_kept_on_failure() -> None:
    async with _Memory(_Config()) as rt:
        rt._remember_orphan(4242)
        rt.fail_kills = 1
        await rt.exec(["true"])
        assert rt.ran[-1] == ("true",), "a failed kill must not stop the command"
        await rt.exec(["echo"])
        assert rt.ran[-2:] == [("kill", "4242"), ("echo",)]
        await rt.exec(["true"])
        assert ("kill", "4242") not in rt.ran[-1:], "a paid kill is not retried"


async def test_a_runtime_without_a_channel_reports_it_disabled_and_has_no_relay() -> None:
    async with _Memory(_Config()) as rt:
        assert rt.channel_info.state == "disabled"
        assert rt.host_routes() == ()
        await rt.write("f", b"x")
        assert await rt.read("f") == b"x"
