"""One SSH connection (blocking paramiko calls): host key checks, credentials, the handshake,
and :class:`Connection` (a transport plus its lazily opened SFTP client).

The host key and authentication errors are public (re-exported by :mod:`runtimes.ssh`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from ..errors import ProvisioningError
from ..models import MiB
from .config import SSHConfig, parse_host_key_line
from .faults import paramiko_failures

if TYPE_CHECKING:
    import paramiko
    import paramiko.packet

log = logging.getLogger("runtimes.ssh")

CHUNK = 1 * MiB
_WINDOW = 16 * MiB
_MAX_PACKET = 32 * 1024
_LONGEST_READ = 256 * 1024 + 64
"""The most bytes one inbound packet may take: OpenSSH's own bound on a packet (256 KiB,
``PACKET_MAX_SIZE``) plus the longest MAC. A longer length is garbage."""
_READER_EXIT = 2.0
"""Seconds ``close()`` waits for the reader thread to see EOF and close the socket."""


class HostKeyVerificationError(ProvisioningError):
    """The server's host key could not be verified; nothing was sent to it."""


class UnknownHostKeyError(HostKeyVerificationError):
    """The server's host key is in neither ``known_hosts`` nor ``host_key``."""


class HostKeyMismatchError(HostKeyVerificationError):
    """The server presented a different host key than the one on record."""


class SSHAuthenticationError(ProvisioningError):
    """The server refused every configured credential."""


class HostUnreachableError(ProvisioningError):
    """The TCP connection or the SSH handshake to the host failed."""


class _Probing(Protocol):
    def probe(self, count_max: int, interval: float) -> None: ...


def _signal_exit_code(name: str) -> int:
    try:
        return 128 + signal.Signals["SIG" + name].value
    except KeyError:
        log.warning("unknown signal %r in exit-signal; reporting SIGKILL", name)
        return 128 + signal.SIGKILL.value


@functools.cache
def _packetizer_class() -> type[paramiko.packet.Packetizer]:
    """A Packetizer that refuses a packet longer than any server sends.

    Bytes lost from the inbound stream (a stale read elsewhere in the process, a broken
    middlebox) can leave paramiko a block-aligned garbage packet length: it then waits for up
    to 4 GiB that never form a packet, and while the server's output keeps arriving the
    socket never times out, so no keepalive is sent to notice. Refused here, the reader
    thread ends at once, as it does on a MAC mismatch: every call in flight fails typed."""
    import paramiko
    import paramiko.packet

    class Packetizer(paramiko.packet.Packetizer):
        def read_all(self, n: int, check_rekey: bool = False) -> bytes:
            if n > _LONGEST_READ:
                raise paramiko.SSHException(
                    f"inbound packet of {n} bytes, over the {_LONGEST_READ} any server "
                    "sends: the stream is corrupt"
                )
            return super().read_all(n, check_rekey)

    return Packetizer


@functools.cache
def _transport_class() -> type[paramiko.Transport]:
    """A Transport that also understands ``exit-signal`` (paramiko ignores it: status -1)."""
    import paramiko
    from paramiko.common import MSG_CHANNEL_REQUEST, cMSG_GLOBAL_REQUEST

    base_table: dict[int, Callable[[paramiko.Channel, paramiko.Message], None]] = getattr(
        paramiko.Transport, "_channel_handler_table", {}
    )
    base_handler = base_table.get(MSG_CHANNEL_REQUEST)

    def handle_request(chan: paramiko.Channel, m: paramiko.Message) -> None:
        start = m.packet.tell()
        if m.get_text() == "exit-signal":
            m.get_boolean()  # want_reply
            chan.exit_status = _signal_exit_code(m.get_text())
            chan.status_event.set()
            return
        m.packet.seek(start)
        assert base_handler is not None
        base_handler(chan, m)

    class Transport(paramiko.Transport):
        if base_handler is not None:
            _channel_handler_table = {**base_table, MSG_CHANNEL_REQUEST: handle_request}

        unanswered_probes = 0
        """Keepalives sent since the server last answered a global request."""

        def _parse_request_success(self, m: paramiko.Message) -> None:
            self.unanswered_probes = 0
            super()._parse_request_success(m)  # type: ignore[misc]

        def _parse_request_failure(self, m: paramiko.Message) -> None:
            self.unanswered_probes = 0
            super()._parse_request_failure(m)  # type: ignore[misc]

        def probe(self, count_max: int, interval: float) -> None:
            """paramiko's keepalive callback (its reader thread, after ``interval`` seconds
            with nothing sent): ask for an answer, as OpenSSH's ServerAliveInterval does.

            paramiko's own keepalive asks for none, so a transport whose server stopped
            answering (a silent network drop, a wedged host) or whose reader waits for a
            garbage packet length (bytes lost from the stream) would wait for ever. Raising
            here ends paramiko's reader thread, which closes every channel: the calls in
            flight fail at once, typed, and the next call reconnects."""
            if self.unanswered_probes >= count_max:
                raise paramiko.SSHException(
                    f"the server answered none of {count_max} keepalives in "
                    f"{(count_max + 1) * interval:g}s: the connection is dead"
                )
            self.unanswered_probes += 1
            m = paramiko.Message()
            m.add_byte(cMSG_GLOBAL_REQUEST)
            m.add_string("keepalive@openssh.com")
            m.add_boolean(True)  # want_reply: OpenSSH answers with a request failure
            self._send_user_message(m)  # type: ignore[attr-defined]

    return Transport


def _host_key_name(config: SSHConfig) -> str:
    return config.host if config.port == 22 else f"[{config.host}]:{config.port}"


def _expected_host_keys(config: SSHConfig) -> dict[str, bytes]:
    """Key type -> key blob the server must present (empty: unknown host)."""
    if config.host_key is not None:
        key_type, blob = parse_host_key_line(config.host_key)
        return {key_type: blob}
    import paramiko

    path = os.path.expanduser(config.known_hosts)
    try:
        keys = paramiko.HostKeys(path)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ProvisioningError(f"cannot read known_hosts file {path}: {exc}") from exc
    found = keys.lookup(_host_key_name(config))
    if not found:
        return {}
    return {key_type: found[key_type].asbytes() for key_type in found}


def _prefer_key_types(transport: paramiko.Transport, expected: Iterable[str]) -> None:
    """Offer the key types we can verify first, as OpenSSH does with known_hosts."""
    wanted: list[str] = []
    for key_type in expected:
        wanted += (
            ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"] if key_type == "ssh-rsa" else [key_type]
        )
    options = transport.get_security_options()
    offered = list(options.key_types)
    first = [k for k in wanted if k in offered]
    if first:
        options.key_types = first + [k for k in offered if k not in first]


def _verify_host_key(
    config: SSHConfig, key: paramiko.PKey, expected: dict[str, bytes], accepted: dict[str, bytes]
) -> None:
    name = _host_key_name(config)
    shown = f"{key.get_name()} {key.fingerprint}"
    known = expected or accepted
    if not known:
        if config.accept_unknown_host_key:
            log.warning(
                "accepting unknown host key of %s: %s (accept_unknown_host_key)", name, shown
            )
            accepted[key.get_name()] = key.asbytes()
            return
        where = "host_key" if config.host_key else os.path.expanduser(config.known_hosts)
        raise UnknownHostKeyError(
            f"host key of {name} is not known ({shown}; not in {where}): add it to known_hosts "
            f"(ssh-keyscan -p {config.port} {config.host}), pin it with host_key=..., or set "
            "accept_unknown_host_key=True"
        )
    if known.get(key.get_name()) == key.asbytes():
        return
    raise HostKeyMismatchError(
        f"HOST KEY MISMATCH for {name}: the server presented {shown}, which does not match "
        f"the recorded {', '.join(sorted(known))} key; refusing to connect (a reinstalled host, "
        "or someone intercepting the connection)"
    )


def _load_private_key(data: bytes, passphrase: str | None, origin: str) -> paramiko.PKey:
    import paramiko
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    secret = passphrase.encode() if passphrase is not None else None
    try:
        try:
            loaded: object = serialization.load_ssh_private_key(data, password=secret)
        except ValueError:
            loaded = serialization.load_pem_private_key(data, password=secret)
    except (ValueError, TypeError) as exc:
        raise ProvisioningError(f"cannot load the private key from {origin}: {exc}") from None
    key_class: type[paramiko.PKey]
    if isinstance(loaded, rsa.RSAPrivateKey):
        key_class = paramiko.RSAKey
    elif isinstance(loaded, ed25519.Ed25519PrivateKey):
        key_class = paramiko.Ed25519Key
    elif isinstance(loaded, ec.EllipticCurvePrivateKey):
        key_class = paramiko.ECDSAKey
    else:
        raise ProvisioningError(
            f"unsupported private key type in {origin}: {type(loaded).__name__}"
        )
    try:
        return key_class.from_private_key(io.StringIO(data.decode()), password=passphrase)
    except (paramiko.SSHException, ValueError) as exc:
        raise ProvisioningError(f"cannot load the private key from {origin}: {exc}") from None


def _credentials(config: SSHConfig) -> list[tuple[str, paramiko.PKey | None]]:
    """(description, key) pairs to try; a ``None`` key means the password."""
    passphrase = config.key_passphrase.get_secret_value() if config.key_passphrase else None
    found: list[tuple[str, paramiko.PKey | None]] = []
    if config.key_file:
        path = Path(config.key_file).expanduser()
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ProvisioningError(f"cannot read key_file {str(path)!r}: {exc.strerror}") from None
        found.append((f"key {path}", _load_private_key(data, passphrase, f"key_file {path}")))
    if config.key_env:
        text = os.environ.get(config.key_env)
        if not text:
            raise ProvisioningError(
                f"key_env names the environment variable {config.key_env!r}, which is not set"
            )
        origin = f"${config.key_env}"
        found.append((f"key from {origin}", _load_private_key(text.encode(), passphrase, origin)))
    if config.use_agent:
        import paramiko

        for key in paramiko.Agent().get_keys():
            found.append((f"agent key {key.get_name()} {key.fingerprint}", key))
    if config.password is not None:
        found.append(("password", None))
    return found


def _authenticate(transport: paramiko.Transport, config: SSHConfig) -> None:
    import paramiko

    tried: list[str] = []
    for description, key in _credentials(config):
        tried.append(description)
        try:
            if key is None:
                assert config.password is not None
                transport.auth_password(config.username, config.password.get_secret_value())
            else:
                transport.auth_publickey(config.username, key)
        except paramiko.BadAuthenticationType as exc:
            tried[-1] += f" (server allows only {', '.join(exc.allowed_types)})"
        except paramiko.AuthenticationException:
            pass  # the next credential may work; the summary below names them all
        if transport.is_authenticated():
            return
    what = "; ".join(tried) if tried else "no credential (the ssh agent offered no key)"
    raise SSHAuthenticationError(f"authentication failed for {config.destination} (tried: {what})")


def connect(config: SSHConfig, accepted: dict[str, bytes]) -> paramiko.Transport:
    """Open, verify and authenticate one transport. Raises ProvisioningError subclasses
    (ProvisioningError itself when paramiko, the [ssh] extra, is not installed)."""
    try:
        import paramiko
    except ImportError as exc:
        raise ProvisioningError(
            "the ssh runtime needs paramiko: pip install 'vf-sandbox[ssh]'"
        ) from exc

    expected = _expected_host_keys(config)
    try:
        sock = socket.create_connection((config.host, config.port), timeout=config.connect_timeout)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise HostUnreachableError(f"cannot reach {config.host}:{config.port}: {reason}") from None
    # Without it Nagle on our small requests meets the server's delayed ACKs: +40 ms per exec.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport = _transport_class()(
        sock,
        default_window_size=_WINDOW,
        default_max_packet_size=_MAX_PACKET,
        packetizer_class=_packetizer_class(),
    )
    try:
        transport.banner_timeout = config.connect_timeout
        transport.auth_timeout = config.connect_timeout
        _prefer_key_types(transport, (expected or accepted).keys())
        try:
            # start_client returns quietly on timeout: get_remote_server_key then raises.
            transport.start_client(timeout=config.connect_timeout)
            server_key = transport.get_remote_server_key()
        except paramiko_failures() as exc:
            raise HostUnreachableError(
                f"SSH handshake with {config.host}:{config.port} failed or timed out after "
                f"{config.connect_timeout:g}s: {exc or type(exc).__name__}"
            ) from None
        _verify_host_key(config, server_key, expected, accepted)
        try:
            _authenticate(transport, config)
        except paramiko_failures() as exc:
            if isinstance(exc, paramiko.AuthenticationException):
                raise
            raise HostUnreachableError(
                f"connection to {config.host}:{config.port} failed during authentication: {exc}"
            ) from None
        if config.keepalive_interval:
            transport.packetizer.set_keepalive(
                config.keepalive_interval,
                functools.partial(
                    cast(_Probing, transport).probe,
                    config.keepalive_count_max,
                    config.keepalive_interval,
                ),
            )
        # The socket keeps paramiko's own 0.1 s timeout: its reader thread wakes on it to see
        # close() and to send keepalives. Blocking (None), close() left that thread in recv()
        # for ever, holding the TCP connection and the server's session open.
    except BaseException:
        transport.close()
        raise
    return transport


class Connection:
    """One authenticated transport plus its lazily opened SFTP client (blocking calls)."""

    def __init__(self, transport: paramiko.Transport, io_timeout: float):
        self.transport = transport
        self.io_timeout = io_timeout
        self.broken = False
        self.closing = False
        """Set first thing by :meth:`close`: a call that fails from here on failed because the
        connection is going, whatever paramiko says (an SFTP read on a closed channel raises
        a bare ``OSError("Socket is closed")`` while the transport is still up)."""
        self._sftp: paramiko.SFTPClient | None = None

    def usable(self) -> bool:
        return not self.broken and not self.closing and self.transport.is_active()

    def sftp(self) -> paramiko.SFTPClient:
        import paramiko

        if self._sftp is None or self._sftp.get_channel().closed:  # type: ignore[union-attr]
            # SFTPClient.from_transport, with every wait bounded by io_timeout.
            chan = self.transport.open_session(
                window_size=_WINDOW, max_packet_size=_MAX_PACKET, timeout=self.io_timeout
            )
            chan.settimeout(self.io_timeout)
            with answer_within(chan, self.io_timeout):
                chan.invoke_subsystem("sftp")
                self._sftp = paramiko.SFTPClient(chan)
        return self._sftp

    def sftp_closed(self) -> bool:
        channel = self._sftp.get_channel() if self._sftp is not None else None
        return self.closing or (channel is not None and channel.closed)

    def close(self) -> None:
        self.closing = True
        if self._sftp is not None:
            with contextlib.suppress(OSError, EOFError):
                self._sftp.close()
            self._sftp = None
        # Wake paramiko's reader thread with EOF and let it close the socket itself (the end
        # of Transport.run) before closing from here: a close from this thread frees the
        # descriptor number while the reader may sit between releasing the GIL and its
        # recv(), which then reads from whatever socket reuses the number (stolen bytes,
        # "Invalid packet blocking" on that connection).
        with contextlib.suppress(OSError):
            self.transport.sock.shutdown(socket.SHUT_RDWR)
        if self.transport is not threading.current_thread():
            self.transport.join(_READER_EXIT)
            if self.transport.is_alive():
                # Busy (a loaded machine): it has the EOF coming, and closes the socket and
                # every channel on its way out (the end of Transport.run). Closing from
                # here would reopen the window above.
                log.debug(
                    "paramiko's reader thread is busy: it closes the connection on its way out"
                )
                return
        self.transport.close()


@contextlib.contextmanager
def answer_within(channel: paramiko.Channel, seconds: float) -> Iterator[None]:
    """paramiko waits for the answer to a channel request (exec, subsystem) without a
    timeout: a server that stopped answering (paused, wedged) would hold the thread for
    ever. After ``seconds`` the channel is closed, which ends the wait; that is reported
    as a ``TimeoutError`` (a connection failure for the callers)."""

    expired = threading.Event()

    def expire() -> None:
        expired.set()
        channel.close()

    watchdog = threading.Timer(seconds, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    except paramiko_failures() as exc:
        if expired.is_set():
            raise TimeoutError(f"the server did not answer within {seconds:g}s") from exc
        raise
    finally:
        watchdog.cancel()
