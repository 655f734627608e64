"""The base of :class:`~runtimes.ssh.SSHBackend`: a backend that keeps one SSH connection to its
host. It reconnects when the connection dropped (re-requesting the reverse port forwards),
retries idempotent calls a bounded number of times, and runs every blocking paramiko call
(control scripts, SFTP, opening channels) in a worker thread under a capacity limiter."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from ..backend import Backend
from ..config import RuntimeConfig
from ..errors import (
    ProvisioningError,
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from .client import Connection, HostKeyVerificationError, connect
from .config import SSHConfig
from .control import ControlScript, run_control
from .faults import Fault, Request, fault, paramiko_failures, timed_out
from .forward import Forward, bridge

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("runtimes.ssh")

T = TypeVar("T")

_RETRY_ATTEMPTS = 3


class ConnectedBackend(Backend):
    """A backend on one SSH connection: reconnecting, retries, worker-thread calls, forwards.

    The connection opens with :meth:`_connect_first` (the subclass's ``create``) and is let
    go for good by :meth:`_release_connection` (its ``destroy``): no call reconnects after.
    """

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self.config: SSHConfig
        self._conn: Connection | None = None
        self._conn_released = False
        """``destroy`` let the connection go: no call may open another (it would leak)."""
        self._accepted_keys: dict[str, bytes] = {}
        self._forwards: dict[int, Forward] = {}
        self._connect_lock: anyio.Lock | None = None
        self._sftp_lock: anyio.Lock | None = None
        self._control_slots: anyio.Semaphore | None = None
        self._call_limiter: anyio.CapacityLimiter | None = None

    def _released(self) -> bool:
        return self._conn_released

    def _open_connection(self) -> Connection:
        return Connection(connect(self.config, self._accepted_keys), self.config.io_timeout)

    # ------------------------------------------------------------------ connection

    async def _connect_first(self) -> None:
        """Open the connection (at ``create``), with the locks and slots its calls share.

        Raises:
            ProvisioningError: the host cannot be reached, refuses the credentials or its
                host key.
        """
        self._connect_lock = anyio.Lock()
        self._sftp_lock = anyio.Lock()
        self._control_slots = anyio.Semaphore(2)
        self._call_limiter = anyio.CapacityLimiter(self.config.max_channels)
        self._conn = await self._thread(self._open_connection)

    async def _release_connection(self) -> None:
        """Let the connection go for good (at ``destroy``): a call in flight must not
        reconnect now."""
        self._conn_released = True
        conn, self._conn = self._conn, None
        self._forwards.clear()
        if conn is not None:
            await anyio.to_thread.run_sync(conn.close)

    async def _connection(self) -> Connection:
        """The live connection, reconnecting first when it dropped.

        Raises:
            SandboxUnavailableError: the host cannot be reached or refuses us now.
            HostKeyMismatchError: the host came back with another key.
        """
        conn = self._conn
        if conn is not None and conn.usable():
            return conn
        assert self._connect_lock is not None
        async with self._connect_lock:
            conn = self._conn
            if conn is not None and conn.usable():
                return conn
            if self._conn_released:
                raise SandboxUnavailableError(f"{self.describe()} is closed")
            if conn is not None:
                await anyio.to_thread.run_sync(conn.close)
            self._conn = None
            try:
                conn = await self._thread(self._open_connection)
            except HostKeyVerificationError:
                raise
            except ProvisioningError as exc:
                raise SandboxUnavailableError(
                    f"{self.describe()}: reconnecting failed: {exc}"
                ) from exc
            if self._released():  # destroy let the connection go while this one opened
                await anyio.to_thread.run_sync(conn.close)
                raise SandboxUnavailableError(f"{self.describe()} is closed")
            log.info("%s: reconnected", self.describe())
            self._conn = conn
            await self._restore_forwards(conn)
            return conn

    @contextlib.contextmanager
    def _paramiko_calls(
        self,
        conn: Connection,
        what: str,
        refused: str | None = None,
        *,
        request: Request = "channel",
        hint: str = "",
        unanswered: str | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> Iterator[None]:
        """The boundary of paramiko calls on ``conn``: what they raise is read with
        paramiko's exception table (:mod:`.faults`).

        A failure of the connection is ``SandboxTransportError`` naming ``what`` (the
        connection marked broken); a refusal of the one operation, where the call site has
        one (``refused``), is ``SandboxError("<sandbox>: <refused>: <exc><hint>")``. With
        ``unanswered``, a wait that timed out on a live transport is a slow server, not a
        dead connection: ``SandboxTransportError("<sandbox>: <unanswered>")``, the
        connection left to the keepalives. ``alive``: whether the connection still serves
        this call (default: its transport is up).
        """
        try:
            yield
        except SandboxError:
            raise
        except paramiko_failures() as exc:
            if unanswered is not None and timed_out(exc) and conn.transport.is_active():
                # A slow server (a loaded host), not a dead connection: that is for the
                # keepalives to say. Marked broken, the next call would close the
                # connection under every call in flight on it.
                raise SandboxTransportError(f"{self.describe()}: {unanswered}") from exc
            up = (alive or conn.transport.is_active)()
            if refused is not None and fault(exc, request, up) is Fault.REFUSED:
                raise SandboxError(f"{self.describe()}: {refused}: {exc}{hint}") from exc
            raise self._broken(conn, what, exc) from exc

    def _broken(self, conn: Connection, what: str, exc: BaseException) -> SandboxTransportError:
        conn.broken = True
        reason = str(exc) or type(exc).__name__
        return SandboxTransportError(
            f"{self.describe()}: connection failed during {what}: {reason}"
        )

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._call_limiter)

    async def _retrying(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Bounded retries of an idempotent call on SandboxTransportError (reconnecting)."""
        from tenacity import (
            AsyncRetrying,
            retry_if_exception_type,
            stop_after_attempt,
            wait_exponential,
        )

        retrying = AsyncRetrying(
            stop=stop_after_attempt(_RETRY_ATTEMPTS),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            retry=retry_if_exception_type(SandboxTransportError),
            sleep=anyio.sleep,
            reraise=True,
            before_sleep=lambda state: log.info(
                "%s: retrying after %s",
                self.describe(),
                state.outcome and state.outcome.exception(),
            ),
        )
        return await retrying(fn, *args)

    async def _control(
        self, script: ControlScript, stdin: bytes | None = None, *, timeout: float | None = None
    ) -> tuple[int, bytes, bytes]:
        """Run a bookkeeping script on its own channel (not retried); ``timeout`` defaults
        to ``io_timeout``."""
        assert self._control_slots is not None
        seconds = timeout or self.config.io_timeout
        async with self._control_slots:
            conn = await self._connection()
            unanswered = f"a control command got no answer within {seconds:g}s"
            with self._paramiko_calls(conn, "a control command", unanswered=unanswered):
                return await self._thread(run_control, conn.transport, script, stdin, seconds)

    async def _sftp_call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(sftp, *args)`` in a thread; SFTP clients are not thread-safe: one at a time."""
        assert self._sftp_lock is not None
        async with self._sftp_lock:
            conn = await self._connection()

            def call() -> T:
                return fn(conn.sftp(), *args)

            what = f"sftp {fn.__name__.lstrip('_')}"

            def serving() -> bool:
                return conn.transport.is_active() and not conn.sftp_closed()

            try:
                with self._paramiko_calls(conn, what, f"{what} failed", alive=serving):
                    return await self._thread(call)
            except UnicodeEncodeError as exc:  # paramiko sends paths as strict UTF-8
                raise SandboxInvalidArgumentError(
                    f"{self.describe()}: SFTP takes only valid UTF-8 paths, not {exc.object!r}"
                ) from None

    async def _open_channel(self) -> tuple[Connection, paramiko.Channel]:
        conn = await self._connection()
        with self._paramiko_calls(conn, "opening a channel"):
            channel = await self._thread(
                functools.partial(conn.transport.open_session, timeout=self.config.io_timeout)
            )
        return conn, channel

    # ------------------------------------------------------------------ port forwarding

    async def forward_remote(
        self, local_port: int, remote_port: int = 0, *, local_host: str = "127.0.0.1"
    ) -> int:
        """Make ``127.0.0.1:<port>`` on the remote host reach ``local_host:local_port`` here.

        A reverse (``ssh -R``) forward on this sandbox's connection, so a process in the
        sandbox can reach a server on the host's loopback. It is re-established on
        reconnect and ends with the runtime.

        Returns:
            The remote port (chosen by the server when ``remote_port`` is 0).

        Raises:
            SandboxInvalidArgumentError: a port out of range.
            SandboxError: the server refused the forward (``AllowTcpForwarding``, port in use).
            SandboxTransportError: the connection failed.
            SandboxUnavailableError: the sandbox is closed or its host is gone.
        """
        if not 0 < local_port < 65536 or not 0 <= remote_port < 65536:
            raise SandboxInvalidArgumentError(
                f"invalid ports: local {local_port}, remote {remote_port}"
            )
        conn = await self._connection()
        forward = Forward(local_host, local_port)
        bound = await self._request_forward(conn, remote_port, forward)
        self._forwards[bound] = forward
        return bound

    async def cancel_forward_remote(self, remote_port: int) -> None:
        """Stop a forward made by :meth:`forward_remote`. Unknown ports are ignored, and so is
        every port once the connection was let go (its forwards went with it).

        Raises:
            SandboxTransportError: the connection failed.
        """
        if self._forwards.pop(remote_port, None) is None:
            return
        conn = self._conn
        if conn is not None and conn.usable():
            with self._paramiko_calls(conn, "cancelling a port forward"):
                await self._thread(conn.transport.cancel_port_forward, "127.0.0.1", remote_port)

    async def _request_forward(self, conn: Connection, remote_port: int, forward: Forward) -> int:

        timeout = self.config.io_timeout

        def handler(
            channel: paramiko.Channel, origin: tuple[str, int], server: tuple[str, int]
        ) -> None:
            threading.Thread(
                target=bridge, args=(channel, forward, timeout), name="vf-ssh-forward", daemon=True
            ).start()

        with self._paramiko_calls(
            conn,
            "a port forward request",
            f"the server refused to forward remote port {remote_port}",
            request="global",
            hint=" (is AllowTcpForwarding enabled?)",
        ):
            return await self._thread(
                conn.transport.request_port_forward, "127.0.0.1", remote_port, handler
            )

    async def _restore_forwards(self, conn: Connection) -> None:
        for port, forward in list(self._forwards.items()):
            try:
                await self._request_forward(conn, port, forward)
            except SandboxError as exc:
                log.warning(
                    "%s: could not restore the forward of remote port %s: %s",
                    self.describe(),
                    port,
                    exc,
                )
                self._forwards.pop(port, None)
