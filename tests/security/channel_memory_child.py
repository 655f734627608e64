"""Host memory against a hostile channel agent: ``python -m tests.security.channel_memory_child
CONFIG MODE``.

The child replaces the agent's source (what the host sends through the bootstrap) with the real
agent plus a patch: a test double that authenticates like the real one (it has the key: it is
the process the host started, only hostile) and then

* ``read-flood``: answers a 1 MiB-capped read with 768 MiB of chunks;
* ``huge-frame``: answers a read with a header announcing a 4 GiB frame, then streams junk;
* ``exec-flood``: answers a 1 MiB-capped exec with 768 MiB of stdout, ignoring the kill.

It warms the runtime up, resets its peak RSS (``/proc/self/clear_refs``), makes the call, and
prints one JSON line: the error raised, the growth of the peak RSS, how many bytes the host
received from the stream, and the channel's state after.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio

import runtimes.channel.bootstrap as channel
from runtimes import open_runtime
from tests.reliability.memory_child import _reset_peak, _status_kib

FLOOD = 768 * 1024 * 1024

PATCH = f"""
def _vf_read_flood(self):
    chunk = b"x" * READ_CHUNK
    sent = 0
    while sent < {FLOOD} and not self.agent.out.broken:
        self.agent.out.send(CHUNK, self.rid, chunk)
        sent += len(chunk)
    self.agent.out.send(DONE, self.rid)
    self.agent.finish(self.rid)


def _vf_huge_frame(self):
    out = self.agent.out
    with out._lock:
        os.write(out._fd, HEADER.pack(CHUNK, self.rid, 0xFFFFFFF0))
        junk = b"y" * (1024 * 1024)
        try:
            for _ in range({FLOOD} // len(junk)):
                os.write(out._fd, junk)
        except OSError:
            pass
    self.agent.finish(self.rid)


_vf_exec_run = Exec.run


def _vf_exec_flood(self):
    if self.header.argv != ["true"]:
        return _vf_exec_run(self)
    chunk = b"z" * PIPE_CHUNK
    sent = 0
    while sent < {FLOOD} and not self.agent.out.broken:
        self.agent.out.send(STDOUT, self.rid, chunk, before=self.take_start())
        sent += len(chunk)
    self.agent.out.send(EXIT, self.rid, I32.pack(0))
    self.release()


_VF_MODE = "{{mode}}"
if _VF_MODE == "read-flood":
    Read.run = _vf_read_flood
elif _VF_MODE == "huge-frame":
    Read.run = _vf_huge_frame
elif _VF_MODE == "exec-flood":
    Exec.run = _vf_exec_flood
"""


def hostile_source(mode: str) -> bytes:
    real = channel.agent_source()[10:].decode()
    anchor = 'if __name__ in ("__main__", "__vf_sandbox_agent__"):'
    assert anchor in real
    source = real.replace(anchor, PATCH.replace("{mode}", mode) + "\n\n" + anchor).encode()
    return b"%010d" % len(source) + source


async def measure(config: dict[str, Any], mode: str) -> dict[str, Any]:
    source = hostile_source(mode)
    channel.agent_source = lambda: source  # type: ignore[assignment]
    received = [0]
    rt: Any
    async with open_runtime(config) as rt:
        chan = rt._channel_supervisor._channel
        assert chan is not None
        original = chan._transport.recv

        def counting() -> bytes:
            data: bytes = original()
            received[0] += len(data)
            return data

        chan._transport.recv = counting
        outcome: dict[str, Any] = {"error": None, "kept": 0}
        outcome["hostile_agent"] = (await rt.exec(["echo", "ok"])).stdout == "ok\n"
        await rt.write("/tmp/small", b"s" * 1000)
        _reset_peak()
        rss = _status_kib("VmRSS")
        try:
            if mode == "exec-flood":
                result = await rt.exec(["true"], output_limit=1024 * 1024, timeout=120)
                outcome["kept"] = len(result.stdout_bytes)
            else:
                outcome["kept"] = len(await rt.read("/tmp/small", max_bytes=1024 * 1024))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts the type
            outcome["error"] = type(exc).__name__
            outcome["message"] = str(exc)[:300]
            outcome["kept"] = len(getattr(exc, "stdout_bytes", b""))
            del exc
        outcome["growth_bytes"] = (_status_kib("VmHWM") - rss) * 1024
        outcome["received_bytes"] = received[0]
        outcome["state_after"] = rt.channel_info.state
        outcome["reason"] = rt.channel_info.reason
        after = await rt.exec(["echo", "after"])
        small = await rt.read("/tmp/small")
        outcome["usable_after"] = after.stdout == "after\n" and small == b"s" * 1000
    return outcome


def main() -> None:
    config, mode = json.loads(sys.argv[1]), sys.argv[2]
    print(json.dumps(anyio.run(measure, config, mode)))


if __name__ == "__main__":
    main()
