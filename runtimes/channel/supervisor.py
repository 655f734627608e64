"""What a runtime holds: the supervisor that starts its channel, routes each call through it,
and falls back to the backend's plain path when the sandbox has no ``python3`` (probed once),
when the channel died (restarted on the next call, at most :data:`MAX_RESTARTS` times per
:data:`RESTART_WINDOW` seconds, from verified files only), or when the agent cannot serve a
request (switching users without root). A request in flight on a channel that died is
retried through the plain path only when it is idempotent (read, exists); otherwise it fails
with :class:`~runtimes.errors.SandboxTransportError`, or
:class:`~runtimes.errors.SandboxUnavailableError` when the sandbox itself is gone.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TypeVar

import anyio

from ..errors import (
    ChannelTamperedError,
    HostRouteError,
    SandboxError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from ..models import ExecRequest, OutputSink
from ..stdin_feed import StdinTap
from .agent.wire import PathInfo
from .core import Channel
from .framing import current_loop
from .hooks import UNKNOWN, ChannelHooks, ChannelInfo
from .protocol import (
    HALT_WAIT,
    KILL_WAIT,
    MAX_RESTARTS,
    RESTART_WINDOW,
    START_TIMEOUT,
    ChannelLost,
    ChannelRefused,
    ChannelUnsupported,
    SandboxGone,
)
from .relay import RelayListener

log = logging.getLogger("runtimes.channel")

T = TypeVar("T")


class ChannelSupervisor:
    """Routes a runtime's calls through its channel, with the fallbacks described above."""

    def __init__(
        self,
        enabled: bool,
        label: Callable[[], str],
        hooks: ChannelHooks,
        *,
        max_restarts: int = MAX_RESTARTS,
        restart_window: float = RESTART_WINDOW,
        start_timeout: float = START_TIMEOUT,
        stall_timeout: float | None = None,
        kill_wait: float = KILL_WAIT,
        first_interpreter: str | None = None,
    ) -> None:
        self.enabled = enabled
        self._first_interpreter = first_interpreter
        self._label = label
        self._hooks = hooks
        self._max_restarts = max_restarts
        self._restart_window = restart_window
        self._start_timeout = start_timeout
        self._stall_timeout = stall_timeout
        self._kill_wait = kill_wait
        self._channel: Channel | None = None
        self._unsupported = False
        self._closed = False
        self._reason: str | None = None
        self._restarts: collections.deque[float] = collections.deque()
        self._restart_count = 0
        self._served = 0
        self._fallbacks = 0
        self._locks: dict[int, anyio.Lock] = {}
        self._interpreter: str | None = None
        """The interpreter's absolute path, as the first agent (started before any command
        of the runtime) reported it: later starts run it by path, after verification."""
        self._first: Channel | None = None
        self._distrusted: str | None = None

    @property
    def info(self) -> ChannelInfo:
        chan = self._channel
        if not self.enabled:
            state = "disabled"
        elif self._closed:
            state = "closed"
        elif self._distrusted is not None or (chan is not None and chan.tampered):
            state = "distrusted"
        elif self._unsupported:
            state = "unsupported"
        elif chan is not None and chan.running:
            state = "running"
        else:
            state = "down"
        hello = chan.hello if chan is not None else None
        return ChannelInfo(
            state=state,
            agent_pid=chan.agent_pid if chan is not None else None,
            python=hello.python if hello is not None else None,
            restarts=self._restart_count,
            served=self._served,
            fallbacks=self._fallbacks,
            reason=self._reason or (chan.tampered if chan is not None else None),
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the agent (the runtime's ``_start``). Never raises: a sandbox without a
        channel still works through the plain path."""
        if not self.enabled:
            return
        if self._hooks.verify_first is not None:
            try:
                reason = await self._hooks.verify_first()
            except SandboxError as exc:
                reason = f"could not verify the sandbox's python3: {exc}"
            if reason is not None:
                self._distrust(f"the agent's interpreter cannot be trusted: {reason}")
                return
        self._channel = await self._launch(self._first_interpreter)

    @property
    def interpreter(self) -> str | None:
        """The interpreter's absolute path pinned at the first start (``None``: none yet)."""
        return self._interpreter

    async def halt(self, timeout: float = HALT_WAIT) -> bool:
        """At close: have the running agent SIGKILL every other process of the sandbox but
        PID 1. ``True`` once it confirmed; ``False`` (nothing done that the caller may count
        on) when no trusted agent runs, it is not root (it could not signal the others), or
        it did not confirm within ``timeout`` seconds. Never raises."""
        chan = self._channel
        hello = chan.hello if chan is not None else None
        if chan is None or hello is None or not chan.usable or self._closed or self._distrusted:
            return False
        if hello.uid != 0:
            return False
        with anyio.move_on_after(timeout):
            try:
                await chan.halt()
            except (SandboxError, ChannelLost, SandboxGone) as exc:
                log.info("%s: the agent could not halt the sandbox: %s", self._label(), exc)
                return False
            return True
        return False

    async def close(self) -> None:
        """Close the channel (before the sandbox goes away)."""
        self._closed = True
        chan, self._channel = self._channel, None
        if chan is not None:
            await chan.aclose()

    def close_now(self) -> None:
        """Blocking close, for the atexit backstop."""
        self._closed = True
        chan, self._channel = self._channel, None
        if chan is not None:
            chan.close()

    def _distrust(self, reason: str) -> None:
        if self._distrusted is None:
            self._distrusted = reason
            self._reason = reason
            log.warning("%s: channel distrusted: %s; the plain path serves", self._label(), reason)

    async def _verified_interpreter(self) -> str | None:
        """Before a restart: the pinned interpreter if the files the first agent ran from
        are verified unchanged; else ``None`` and the channel is distrusted for good."""
        first = self._first
        if self._interpreter is None or first is None:
            self._distrust(
                "no interpreter was pinned at the first start: a restart would run "
                "whatever python3 the sandbox has now"
            )
            return None
        verify = self._hooks.verify_agent
        if verify is None:
            self._distrust("the agent died and this backend cannot verify its interpreter")
            return None
        # The first agent may have died before it reported (killed at once): the pinned
        # interpreter is then listed with an unknown digest (a backend that verifies by
        # content refuses it; Docker's diff against the image needs no digest).
        digests = dict(await first.wait_digests(self._start_timeout) or {})
        digests.setdefault(self._interpreter, UNKNOWN)
        try:
            reason = await verify(digests)
        except SandboxError as exc:
            reason = f"could not verify the agent's files: {exc}"
        if reason is not None:
            self._distrust(f"the agent died and its files cannot be trusted: {reason}")
            return None
        return self._interpreter

    async def _launch(self, interpreter: str | None = None) -> Channel | None:
        label = self._label()
        first = self._first is None
        try:
            with anyio.CancelScope(shield=True):
                # Shielded: once the stream is open nothing may lose the handle on it.
                transport = await self._hooks.open_transport(interpreter)
        except SandboxError as exc:
            self._reason = f"could not start the agent: {exc}"
            log.info("%s: %s", label, self._reason)
            return None
        chan = Channel(
            transport,
            f"channel of {label}",
            probe_dead=self._probe_dead,
            kill_group=self._hooks.kill_group,
            stall_timeout=self._stall_timeout,
            kill_wait=self._kill_wait,
            want_digests=first and self._hooks.verify_agent is not None,
        )
        try:
            await chan.start(self._start_timeout)
        except ChannelUnsupported as exc:
            self._unsupported = True
            self._reason = str(exc)
            log.info("%s: %s; using the plain path", label, exc)
        except (ChannelLost, TimeoutError) as exc:
            if chan.tampered is not None:
                self._distrust(chan.tampered)
            else:
                self._reason = f"the agent did not start: {exc or 'timed out'}"
                log.warning("%s: %s", label, self._reason)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await chan.aclose()
            raise
        else:
            self._reason = None
            if first:
                self._first = chan
                executable = chan.hello.executable if chan.hello is not None else ""
                self._interpreter = executable if executable.startswith("/") else None
            return chan
        with anyio.CancelScope(shield=True):
            await chan.aclose()
        return None

    async def _current(self) -> Channel | None:
        """The channel to use for this call, restarting a dead one if allowed; ``None``
        for the plain path."""
        if not self.enabled or self._unsupported or self._closed or self._distrusted:
            return None
        chan = self._channel
        if chan is not None:
            if chan.usable:
                return chan
            if chan.foreign_loop:
                return None  # another event loop (an atexit close, say): plain path
        async with self._lock():
            chan = self._channel
            if chan is not None and chan.usable:
                return chan
            if chan is not None:
                self._channel = None
                await chan.aclose()
                if chan.tampered is not None:
                    self._distrust(chan.tampered)
            if self._closed or self._distrusted or not self._may_restart():
                return None
            interpreter = None
            if self._first is not None or self._served or self._fallbacks:
                # Commands may have run since the first start: never search PATH again,
                # and run the pinned interpreter only once its files are verified.
                interpreter = await self._verified_interpreter()
                if interpreter is None:
                    return None
            self._restart_count += 1
            self._restarts.append(time.monotonic())
            self._channel = await self._launch(interpreter)
            return self._channel

    def _lock(self) -> anyio.Lock:
        key = id(current_loop())
        lock = self._locks.get(key)
        if lock is None:
            self._locks = {key: (lock := anyio.Lock())}
        return lock

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self._restart_window:
            self._restarts.popleft()
        return len(self._restarts) < self._max_restarts

    async def _retire(self, chan: Channel) -> None:
        if self._channel is chan:
            self._channel = None
        with anyio.CancelScope(shield=True):
            await chan.aclose()

    async def _probe_dead(self) -> bool:
        probe = self._hooks.probe_dead
        if probe is None:
            return False
        try:
            return await probe()
        except SandboxError as exc:
            log.debug("%s: liveness probe failed: %s", self._label(), exc)
            return False

    async def _tampered(
        self, chan: Channel, what: str, pgid: int | None = None
    ) -> ChannelTamperedError:
        """The error for a request whose channel was tampered with (never retried through
        a channel; the plain path serves later calls)."""
        reason = chan.tampered or "tampered with"
        self._distrust(reason)
        with anyio.CancelScope(shield=True):
            await self._retire_and_kill(chan, pgid)
        return ChannelTamperedError(f"{self._label()}: during {what}: {reason}")

    async def _retire_and_kill(self, chan: Channel, pgid: int | None) -> None:
        """Retire a channel that failed a request, and kill the request's process group
        (if it started one) through the backend's plain path, bounded."""
        await self._retire(chan)
        if pgid is not None:
            with anyio.move_on_after(self._kill_wait):
                try:
                    await self._hooks.kill_group(pgid)
                except SandboxError as exc:
                    log.warning("%s: could not kill group %s: %s", self._label(), pgid, exc)

    async def _failure(self, chan: Channel, what: str, pgid: int | None = None) -> SandboxError:
        """The error for a non-idempotent request whose channel died under it."""
        with anyio.CancelScope(shield=True):
            await self._retire_and_kill(chan, pgid)
            try:
                dead = await self._hooks.lost_means_dead()
            except SandboxError:
                dead = False
        if dead:
            return SandboxUnavailableError(f"{self._label()} died during {what}")
        said = chan.diagnostics()
        return SandboxTransportError(
            f"{self._label()}: the channel to the sandbox failed during {what}"
            + (f" (agent said: {said})" if said else "")
        )

    async def _unsent(self, chan: Channel, plain: Callable[[], Awaitable[T]]) -> T:
        """The channel died before the request left: nothing ran, the plain path may."""
        await self._retire(chan)
        self._served -= 1
        self._fallbacks += 1
        return await plain()

    def _gone(self, what: str) -> SandboxUnavailableError:
        return SandboxUnavailableError(f"{self._label()} stopped answering during {what}")

    # ------------------------------------------------------------------ relay

    @property
    def can_relay(self) -> bool:
        """Whether a relay may be asked for: the channel is enabled, the sandbox can run
        the agent, and the channel is neither distrusted nor closed (a channel that is down
        is restarted by :meth:`listen`)."""
        return self.enabled and not self._unsupported and not self._closed and not self._distrusted

    async def close_relays(self) -> int:
        """Close every relay listener of the running channel (the routes its users opened),
        leaving the channel up; how many there were. Never raises."""
        chan = self._channel
        if chan is None:
            return 0
        with chan.relay.lock:
            listeners = list(chan.relay.listeners.values())
        for listener in listeners:
            await listener.aclose()
        return len(listeners)

    async def listen(self, target: tuple[str, int]) -> RelayListener:
        """A listener on the sandbox's loopback relayed to ``target`` on the host.

        Raises:
            HostRouteError: the channel cannot serve (disabled, no python3, distrusted,
                down) or the agent could not listen.
            SandboxUnavailableError: the sandbox stopped answering.
        """
        chan = await self._current()
        if chan is None:
            state = self.info
            raise HostRouteError(
                f"{self._label()}: no channel to relay through (state {state.state!r}"
                + (f": {state.reason}" if state.reason else "")
                + ")",
                via="channel",
            )
        try:
            return await chan.listen(target)
        except ChannelLost as lost:
            if chan.tampered is not None:
                self._distrust(chan.tampered)  # never restarted: the plain path serves
            await self._retire(chan)
            raise HostRouteError(f"{self._label()}: {lost}", via="channel") from None
        except SandboxGone:
            await self._retire(chan)
            raise self._gone("starting a relay") from None

    # ------------------------------------------------------------------ routed calls

    async def exec(
        self,
        request: ExecRequest,
        sink: OutputSink,
        plain: Callable[[], Awaitable[int]],
        env: Mapping[str, str] | None = None,
    ) -> int:
        """Run through the channel, or ``plain()``. Errors as for ``Runtime._exec``."""
        chan = await self._current()
        if chan is None:
            self._fallbacks += self.enabled
            return await plain()
        self._served += 1
        what = f"exec of {request.argv[0]!r}"
        tap = _tap_stdin(request)
        try:
            return await chan.exec(
                request if tap is None else replace(request, stdin=tap), sink, env or {}
            )
        except ChannelRefused:
            self._served -= 1
            self._fallbacks += 1
            self._check_replayable(tap, what)
            return await plain()
        except ChannelLost as lost:
            if chan.tampered is not None:
                raise await self._tampered(chan, what, lost.pgid) from None
            if not lost.sent:
                self._check_replayable(tap, what)
                return await self._unsent(chan, plain)
            raise await self._failure(chan, what, lost.pgid) from None
        except SandboxGone:
            await self._retire(chan)
            raise self._gone(what) from None

    def _check_replayable(self, tap: StdinTap | None, what: str) -> None:
        """Before the plain path serves an exec the channel did not run: a stdin iterable
        the channel already pulled from cannot be replayed there.

        Raises:
            SandboxTransportError: part of the iterable was consumed.
        """
        if tap is not None and tap.pulled:
            raise SandboxTransportError(
                f"{self._label()}: the channel could not run the {what}, and its stdin "
                "iterable was already partly consumed: it cannot be replayed on the plain path"
            )

    async def read(self, path: str, limit: int, plain: Callable[[], Awaitable[bytes]]) -> bytes:
        """Idempotent: a channel that dies under it hands over to ``plain()``."""
        return await self.file_call(
            lambda chan: chan.read(path, limit), plain, f"a read of {path!r}", idempotent=True
        )

    async def exists(self, path: str, plain: Callable[[], Awaitable[bool]]) -> bool:
        """Idempotent: a channel that dies under it hands over to ``plain()``."""
        return await self.file_call(
            lambda chan: chan.exists(path), plain, f"a stat of {path!r}", idempotent=True
        )

    async def lstat(
        self, path: str, limit: int, plain: Callable[[], Awaitable[PathInfo]]
    ) -> PathInfo:
        """Idempotent: a channel that dies under it hands over to ``plain()``."""
        return await self.file_call(
            lambda chan: chan.lstat(path, limit), plain, f"an lstat of {path!r}", idempotent=True
        )

    async def mkdir(
        self, path: str, mode: int, uid: int, gid: int, plain: Callable[[], Awaitable[None]]
    ) -> None:
        """Not idempotent: a channel that dies under it is a transport (or dead) error."""
        await self.file_call(
            lambda chan: chan.mkdir(path, mode, uid, gid),
            plain,
            f"making {path!r}",
            idempotent=False,
        )

    async def write(self, path: str, data: bytes, plain: Callable[[], Awaitable[None]]) -> None:
        """Not idempotent: a channel that dies under it is a transport (or dead) error."""
        await self.file_call(
            lambda chan: chan.write(path, data), plain, f"a write of {path!r}", idempotent=False
        )

    async def remove(self, path: str, plain: Callable[[], Awaitable[None]]) -> None:
        """Not idempotent: a channel that dies under it is a transport (or dead) error."""
        await self.file_call(
            lambda chan: chan.remove(path), plain, f"removing {path!r}", idempotent=False
        )

    async def file_call(
        self,
        call: Callable[[Channel], Awaitable[T]],
        plain: Callable[[], Awaitable[T]],
        what: str,
        *,
        idempotent: bool,
    ) -> T:
        """Serve a call of one request through the channel, else ``plain()`` (the file
        calls above; a backend's own, such as Docker's agent sweep). A channel lost under an
        idempotent call hands over to ``plain()``; under another one, only if the request
        was never sent (else a transport or dead error); a tampered channel is distrusted.

        Raises:
            SandboxTransportError, SandboxUnavailableError, ChannelTamperedError: as above;
            what ``call`` or ``plain`` raise.
        """
        chan = await self._current()
        if chan is None:
            self._fallbacks += self.enabled
            return await plain()
        self._served += 1
        try:
            return await call(chan)
        except ChannelLost as lost:
            if chan.tampered is not None:
                raise await self._tampered(chan, what) from None
            if idempotent:
                await self._retire(chan)
                self._fallbacks += 1
                return await plain()
            if not lost.sent:
                return await self._unsent(chan, plain)
            raise await self._failure(chan, what) from None
        except SandboxGone:
            await self._retire(chan)
            raise self._gone(what) from None


def _tap_stdin(request: ExecRequest) -> StdinTap | None:
    """A tap on the request's stdin iterable (``None`` for bytes), to tell whether the
    channel consumed any of it."""
    stdin = request.stdin
    return None if stdin is None or isinstance(stdin, bytes) else StdinTap(stdin)
