"""The ``ssh`` runtime: a private directory on a remote host, driven over one SSH connection.

One paramiko transport per sandbox carries everything: a channel per command (no pty),
one SFTP client for files, a short control channel to kill process groups, and any
reverse port forwards (:meth:`SSHRuntime.forward_remote`). paramiko blocks, so every
call runs in a worker thread (``anyio.to_thread``) under a capacity limiter; the event
loop never waits on a socket.

Commands go through a small POSIX ``sh`` wrapper (see :func:`_wrapper_script`) that
checks ``cwd`` and the program first (so a missing program is
``SandboxFileNotFoundError`` even when a real program exits 127), sets the environment,
starts the command under ``setsid`` (its own session and process group) and reports the
group id on stderr ahead of the command's own output. ``timeout=``, the output cap and
cancellation kill that whole group through a second channel; ``close()`` kills every
process still carrying the sandbox's marker variable (``VF_SANDBOX_ID``), then removes
the sandbox directory.

Requirements on the remote host: Linux (``/proc``), a POSIX ``sh``, util-linux
(``setsid``; ``runuser`` for ``user=``), coreutils, GNU grep (for the sweep), an SFTP
subsystem, and a POSIX-compatible login shell whose startup files print nothing on
stdout (stderr noise before the wrapper's header is dropped). See ``docs/ssh.md``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import functools
import io
import json
import logging
import os
import posixpath
import secrets
import select
import shlex
import signal
import socket
import stat
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from . import ownership
from .base import MARK_VAR, Runtime, sweep_argv
from .channel import (
    BOOTSTRAP,
    PROBE,
    ChannelHooks,
    ChannelInfo,
    ChannelSupervisor,
    ChannelTransport,
    verify_by_reading,
)
from .config import RuntimeConfig
from .errors import (
    OutputLimitExceededError,
    ProvisioningError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    SandboxTransportError,
    SandboxUnavailableError,
    error_for_errno,
)
from .models import ExecRequest, MiB, OutputSink, SandboxInfo, Stream
from .policy import validate_policy_user
from .routes import HostRoute, RouteKind, channel_route

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("runtimes.ssh")

T = TypeVar("T")

_SANDBOX_PREFIX = "vf-sandbox."
_META = "sandbox.json"
_MARKER_VAR = "VF_SANDBOX_ID"

_CHUNK = 1 * MiB
_WINDOW = 16 * MiB
_MAX_PACKET = 32 * 1024
_SFTP_REQUEST = 32 * 1024
_INLINE_SCRIPT_LIMIT = 96 * 1024
"""Larger wrapper scripts (big argv or env) are uploaded instead of sent as the exec string:
the kernel caps one argument (the ``sh -c`` script) at 128 KiB."""
_MAX_ARG_STRLEN = 128 * 1024
_ARG_MAX = 2 * MiB
_TEMP_PREFIX = ".vf-sandbox-write-"
"""Temporary files of atomic writes (the channel agent uses the same prefix)."""
_FILE_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.EACCES,
        errno.EPERM,
        errno.EISDIR,
        errno.ENOTDIR,
        errno.EEXIST,
        errno.ENOTEMPTY,
        errno.EROFS,
    }
)
_RETRY_ATTEMPTS = 3
_HEADER_WAIT = 5.0
_READER_WAIT = 5.0
_KILL_WAIT = 5.0
"""Seconds a process-group kill may take (at most ``io_timeout``): a server that does not
answer must not hold a timed-out exec for ``io_timeout``. A missed kill is retried before
the next command."""


# ---------------------------------------------------------------------- errors


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


# ---------------------------------------------------------------------- config


class SSHConfig(RuntimeConfig):
    """Config of the ``ssh`` runtime.

    Authentication (at least one; tried in this order): ``key_file`` (a private key
    path, optionally with ``key_passphrase``), ``key_env`` (the *name* of a host
    environment variable holding a private key in PEM/OpenSSH format), ``use_agent``
    (keys from ``SSH_AUTH_SOCK``), ``password``. Secrets are ``SecretStr``: they never
    appear in reprs, logs, exceptions or validation errors.

    Host keys are checked strictly: against ``host_key`` when given (a pinned
    ``"ssh-ed25519 AAAA..."`` line), else against ``known_hosts``. An unknown key is
    refused unless ``accept_unknown_host_key`` is set; a mismatching key is always
    refused.

    ``workdir``: by default a private directory is created under the remote temp dir
    (``mktemp -d``) and removed on close; a given ``workdir`` is created if missing and
    left in place. ``max_channels`` caps concurrent SSH channels on the connection
    (OpenSSH's ``MaxSessions`` defaults to 10); three are kept for SFTP and control.

    ``policy_user``: an existing account of the host that a rollout's policy runs as
    (``exec(user=rt.policy_user)``), apart from the root login the host's machinery uses;
    it is handed the workdir on first use. ``stop_processes`` kills every process of that
    account, so give each live sandbox an account of its own. Unset (the default), the
    policy runs as the login user (``docs/security.md``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    type: Literal["ssh"] = "ssh"
    host: str = Field(min_length=1)
    port: int = Field(default=22, ge=1, le=65535)
    username: str = Field(min_length=1)
    key_file: str | None = None
    key_env: str | None = None
    key_passphrase: SecretStr | None = None
    use_agent: bool = False
    password: SecretStr | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    host_key: str | None = None
    accept_unknown_host_key: bool = False
    connect_timeout: float = Field(default=10.0, gt=0)
    keepalive_interval: int = Field(default=30, ge=0, description="seconds; 0 disables")
    io_timeout: float = Field(
        default=120.0,
        gt=0,
        description="seconds without progress before a file or control call fails",
    )
    max_channels: int = Field(default=10, ge=4)
    policy_user: str | None = None
    channel: bool = Field(
        default=True,
        description="run commands and files through a persistent agent (python3 on the host); "
        "takes one of max_channels, and needs max_channels >= 5",
    )

    @field_validator("host_key")
    @classmethod
    def _check_host_key(cls, value: str | None) -> str | None:
        if value is not None:
            _parse_host_key_line(value)
        return value

    _plain_policy_user = field_validator("policy_user")(validate_policy_user)

    @model_validator(mode="after")
    def _policy_needs_root(self) -> SSHConfig:
        if self.policy_user is not None and self.username != "root":
            raise ValueError("policy_user needs username 'root' (to switch users with runuser)")
        return self

    @model_validator(mode="after")
    def _check_auth(self) -> SSHConfig:
        if not (self.key_file or self.key_env or self.use_agent or self.password is not None):
            raise ValueError(
                "no authentication method: set key_file, key_env, use_agent or password"
            )
        return self

    def is_local(self) -> bool:
        return False

    @property
    def destination(self) -> str:
        """``user@host:port``, for messages."""
        return f"{self.username}@{self.host}:{self.port}"


def _parse_host_key_line(line: str) -> tuple[str, bytes]:
    """``"ssh-ed25519 AAAA... [comment]"`` -> (key type, key blob)."""
    fields = line.split()
    if len(fields) < 2:
        raise ValueError("host_key must look like 'ssh-ed25519 AAAA...' (key type, base64 key)")
    try:
        blob = base64.b64decode(fields[1], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("host_key: the key is not valid base64") from None
    return fields[0], blob


# ---------------------------------------------------------------------- connection (blocking)


def _signal_exit_code(name: str) -> int:
    try:
        return 128 + signal.Signals["SIG" + name].value
    except KeyError:
        log.warning("unknown signal %r in exit-signal; reporting SIGKILL", name)
        return 128 + signal.SIGKILL.value


@functools.cache
def _transport_class() -> type[paramiko.Transport]:
    """A Transport that also understands ``exit-signal`` (paramiko ignores it: status -1)."""
    import paramiko
    from paramiko.common import MSG_CHANNEL_REQUEST

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

    return Transport


def _host_key_name(config: SSHConfig) -> str:
    return config.host if config.port == 22 else f"[{config.host}]:{config.port}"


def _expected_host_keys(config: SSHConfig) -> dict[str, bytes]:
    """Key type -> key blob the server must present (empty: unknown host)."""
    if config.host_key is not None:
        key_type, blob = _parse_host_key_line(config.host_key)
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


def _connect(config: SSHConfig, accepted: dict[str, bytes]) -> paramiko.Transport:
    """Open, verify and authenticate one transport. Raises ProvisioningError subclasses."""
    import paramiko

    expected = _expected_host_keys(config)
    try:
        sock = socket.create_connection((config.host, config.port), timeout=config.connect_timeout)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise HostUnreachableError(f"cannot reach {config.host}:{config.port}: {reason}") from None
    # Without it Nagle on our small requests meets the server's delayed ACKs: +40 ms per exec.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport = _transport_class()(
        sock, default_window_size=_WINDOW, default_max_packet_size=_MAX_PACKET
    )
    try:
        transport.banner_timeout = config.connect_timeout
        transport.auth_timeout = config.connect_timeout
        _prefer_key_types(transport, (expected or accepted).keys())
        try:
            # start_client returns quietly on timeout: get_remote_server_key then raises.
            transport.start_client(timeout=config.connect_timeout)
            server_key = transport.get_remote_server_key()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise HostUnreachableError(
                f"SSH handshake with {config.host}:{config.port} failed or timed out after "
                f"{config.connect_timeout:g}s: {exc or type(exc).__name__}"
            ) from None
        _verify_host_key(config, server_key, expected, accepted)
        try:
            _authenticate(transport, config)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if isinstance(exc, paramiko.AuthenticationException):
                raise
            raise HostUnreachableError(
                f"connection to {config.host}:{config.port} failed during authentication: {exc}"
            ) from None
        if config.keepalive_interval:
            transport.set_keepalive(config.keepalive_interval)
        sock.settimeout(None)
    except BaseException:
        transport.close()
        raise
    return transport


class _Connection:
    """One authenticated transport plus its lazily opened SFTP client (blocking calls)."""

    def __init__(self, transport: paramiko.Transport, io_timeout: float):
        self.transport = transport
        self.io_timeout = io_timeout
        self.broken = False
        self._sftp: paramiko.SFTPClient | None = None

    def usable(self) -> bool:
        return not self.broken and self.transport.is_active()

    def sftp(self) -> paramiko.SFTPClient:
        import paramiko

        if self._sftp is None or self._sftp.get_channel().closed:  # type: ignore[union-attr]
            # SFTPClient.from_transport, with every wait bounded by io_timeout.
            chan = self.transport.open_session(
                window_size=_WINDOW, max_packet_size=_MAX_PACKET, timeout=self.io_timeout
            )
            chan.settimeout(self.io_timeout)
            with _answer_within(chan, self.io_timeout):
                chan.invoke_subsystem("sftp")
                self._sftp = paramiko.SFTPClient(chan)
        return self._sftp

    def sftp_closed(self) -> bool:
        channel = self._sftp.get_channel() if self._sftp is not None else None
        return channel is not None and channel.closed

    def close(self) -> None:
        if self._sftp is not None:
            with contextlib.suppress(OSError, EOFError):
                self._sftp.close()
            self._sftp = None
        self.transport.close()


@contextlib.contextmanager
def _answer_within(channel: paramiko.Channel, seconds: float) -> Iterator[None]:
    """paramiko waits for the answer to a channel request (exec, subsystem) without a
    timeout: a server that stopped answering (paused, wedged) would hold the thread for
    ever. After ``seconds`` the channel is closed, which ends the wait; that is reported
    as a ``TimeoutError`` (a connection failure for the callers)."""
    import paramiko

    expired = threading.Event()

    def expire() -> None:
        expired.set()
        channel.close()

    watchdog = threading.Timer(seconds, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    except (paramiko.SSHException, EOFError, OSError) as exc:
        if expired.is_set():
            raise TimeoutError(f"the server did not answer within {seconds:g}s") from exc
        raise
    finally:
        watchdog.cancel()


def _read_channel(recv: Callable[[int], bytes]) -> bytes:
    chunks = []
    while data := recv(_CHUNK):
        chunks.append(data)
    return b"".join(chunks)


def _run_control(
    transport: paramiko.Transport, script: str, stdin: bytes | None, timeout: float
) -> tuple[int, bytes, bytes]:
    """Run a short bookkeeping script (no wrapper); returns (status, stdout, stderr)."""
    chan = transport.open_session(timeout=timeout)
    try:
        chan.settimeout(timeout)
        with _answer_within(chan, timeout):
            chan.exec_command("sh -c " + shlex.quote(script))
        if stdin:
            chan.sendall(stdin)
        chan.shutdown_write()
        out = _read_channel(chan.recv)
        err = _read_channel(chan.recv_stderr)
        return chan.recv_exit_status(), out, err
    finally:
        chan.close()


# ---------------------------------------------------------------------- exec: the wrapper


_IDENTIFIER = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def _is_identifier(name: str) -> bool:
    return bool(name) and not name[0].isdigit() and set(name) <= _IDENTIFIER


@dataclass(frozen=True)
class _Tools:
    """Absolute paths of the remote helpers, found once at start (a command's own PATH
    from ``env=`` must not decide whether the wrapper finds ``setsid``)."""

    setsid: str
    env: str
    runuser: str | None


def _wrapper_script(
    request: ExecRequest,
    nonce: str,
    marker: str,
    tools: _Tools,
    run_as: str | None,
    from_file: bool,
) -> str:
    """The POSIX sh program that runs one command.

    It reports on its stderr exactly one header line ``<nonce>:<status>`` before any
    output of the command: ``ok:<pgid>`` once the command runs in its own session, or
    ``cwd-missing`` / ``cwd-notdir`` / ``cwd-denied`` / ``missing`` / ``denied`` /
    ``nouser``. Its own stderr then goes to /dev/null (so no "Terminated" notices), and
    it exits with the command's status (128+N for a death by signal N). The caller's
    ``env`` is exported only in the last step, after every check and the header, so no
    name the caller picks (``IFS``, ``PATH``, ``__vf_n``) can derail it.
    """
    q = shlex.quote
    env = {**request.env, _MARKER_VAR: marker}
    exports = [f"export {k}={q(v)}" for k, v in env.items() if _is_identifier(k)]
    odd_names = [q(f"{k}={v}") for k, v in env.items() if not _is_identifier(k)]
    search = q(env["PATH"]) if "PATH" in env else '"$PATH"'
    launcher = q(tools.setsid) + " -- "
    lines = ['rm -f -- "$0"'] if from_file else []
    lines += [
        "set -f",
        f"__vf_n={nonce}",
        '__vf_h() { printf \'%s:%s\\n\' "$__vf_n" "$1" >&4; }',
        "exec 4>&2 2>/dev/null",
        f"__vf_d={q(request.cwd)}",
        'if [ ! -e "$__vf_d" ]; then __vf_h cwd-missing; exit 0; fi',
        'if [ ! -d "$__vf_d" ]; then __vf_h cwd-notdir; exit 0; fi',
        'cd -- "$__vf_d" || { __vf_h cwd-denied; exit 0; }',
    ]
    if run_as is not None:
        assert tools.runuser is not None
        lines.append(f"__vf_u=$(id -nu -- {q(run_as)}) || {{ __vf_h nouser; exit 0; }}")
        launcher += q(tools.runuser) + ' -u "$__vf_u" -- '
    if odd_names:
        launcher += q(tools.env) + " -- " + " ".join(odd_names) + " "
    lines += [
        "set -- " + " ".join(q(arg) for arg in request.argv),
        f"__vf_p=$1; __vf_f=; __vf_s=; __vf_path={search}",
        "case $__vf_p in",
        "  */*) __vf_f=$__vf_p ;;",
        '  *) IFS=:; for __vf_x in $__vf_path; do __vf_c="${__vf_x:-.}/$__vf_p"; '
        'if [ -f "$__vf_c" ]; then if [ -x "$__vf_c" ]; then __vf_f=$__vf_c; break; fi; '
        "__vf_s=$__vf_c; fi; done; unset IFS ;;",
        "esac",
        'if [ -z "$__vf_f" ]; then if [ -n "$__vf_s" ]; then __vf_h denied; '
        "else __vf_h missing; fi; exit 0; fi",
        'if [ ! -e "$__vf_f" ]; then __vf_h missing; exit 0; fi',
        'if [ -d "$__vf_f" ] || [ ! -x "$__vf_f" ]; then __vf_h denied; exit 0; fi',
        "exec 3<&0",
        # The subshell reads its own pid (a builtin, so /proc/self is the subshell), reports
        # it, takes the caller's env, then becomes the command: setsid needs no fork there,
        # so pid == pgid == sid.
        "(",
        "read -r __vf_g _ </proc/self/stat",
        '__vf_h "ok:$__vf_g"',
        *exports,
        f'exec {launcher}"$@" <&3 3<&- 2>&4 4>&-',
        ") &",
        "wait $!",
    ]
    return "\n".join(lines) + "\n"


def _raw(text: str) -> bytes:
    """Text as the remote host sees it: UTF-8, lone surrogates back to their bytes."""
    return text.encode("utf-8", "surrogateescape")


def _check_argv_size(request: ExecRequest) -> None:
    sizes = [len(_raw(arg)) + 1 for arg in request.argv]
    env_sizes = [len(_raw(k)) + len(_raw(v)) + 2 for k, v in request.env.items()]
    env_size = sum(env_sizes)
    longest = max(sizes + env_sizes)
    if longest > _MAX_ARG_STRLEN:
        raise SandboxInvalidArgumentError(
            f"an argument or environment entry of {longest - 1} bytes is over the kernel's "
            "128 KiB limit for one string; pass large data through stdin or a file"
        )
    if sum(sizes) + env_size > _ARG_MAX:
        raise SandboxInvalidArgumentError(
            f"argument list too long for the kernel ({sum(sizes) + env_size} bytes with the "
            "environment); pass large data through stdin or a file"
        )


class _Wakeup(threading.Event):
    """The event paramiko's buffers accept (``set_event``), shared by stdout and stderr.

    The buffers call ``clear()`` when one of them runs dry, which would lose a wake-up
    for the other: that call does nothing here, the pump ``reset()`` s it itself before
    looking at both buffers.
    """

    def clear(self) -> None:
        pass

    def reset(self) -> None:
        super().clear()


class _AgentChannel(ChannelTransport):
    """The SSH channel the channel agent runs on, for blocking use by the channel's threads."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self._channel = channel

    def recv(self) -> bytes:
        return self._channel.recv(_CHUNK)

    def send(self, data: bytes) -> None:
        self._channel.sendall(data)

    def close(self) -> None:
        self._channel.close()

    def diagnostics(self) -> str:
        if not self._channel.recv_stderr_ready():
            return ""
        return self._channel.recv_stderr(4096).decode("utf-8", "replace").strip()[-500:]


def _agent_command_line(marker: str, interpreter: str | None = None) -> str:
    """The agent's command for the login shell; the marker lets close() find it. Later
    starts run the interpreter pinned at the first one, by absolute path."""
    q = shlex.quote
    if interpreter is not None:
        return f"export {_MARKER_VAR}={q(marker)}; exec {q(interpreter)} -I -S -B -c {q(BOOTSTRAP)}"
    return f"export {_MARKER_VAR}={q(marker)}; exec sh -c {q(PROBE)} sh {q(BOOTSTRAP)}"


_VERIFY_LIMIT = 256 * 1024 * 1024
"""Bytes a file the channel agent runs from may have, when it is read to be verified."""


def _sftp_read_or_none(sftp: paramiko.SFTPClient, path: str) -> bytes | None:
    """A file's bytes through SFTP (no shell, no command), ``None`` if it is not there."""
    try:
        sftp.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno is None or exc.errno in (errno.ENOENT,):
            return None
        raise
    return _sftp_read(sftp, path, _VERIFY_LIMIT)


class _RemoteCommand:
    """One exec channel. One pump thread reads both streams and parses the wrapper's header."""

    def __init__(
        self, channel: paramiko.Channel, nonce: str, deliver: Callable[[Stream, bytes], bool]
    ):
        self.channel = channel
        self._tag = f"{nonce}:".encode()
        self._deliver = deliver
        self._pending = bytearray()
        self.preamble = b""
        self.status: str | None = None
        self.pgid: int | None = None
        self.exit_status: int | None = None
        self.failure: BaseException | None = None
        self.header_seen = threading.Event()
        self.started = False
        self.done = threading.Event()

    @property
    def finished(self) -> bool:
        return self.exit_status is not None and self.done.is_set()

    def pump(self, header_only: bool = False) -> None:
        """Feed both streams to the sink until EOF, then wait for the exit status.

        Stops early when the sink refuses more output, or (``header_only``) once the
        header is in.
        """
        import paramiko

        self.started = True
        channel = self.channel
        wake = _Wakeup()
        try:
            channel.in_buffer.set_event(wake)
            channel.in_stderr_buffer.set_event(wake)
            while not (header_only and self.header_seen.is_set()):
                wake.reset()
                ended = channel.eof_received or channel.closed
                progressed = False
                if channel.recv_stderr_ready():
                    progressed = True
                    data = channel.recv_stderr(_CHUNK)
                    if not self.header_seen.is_set():
                        data = self._take_header(data)
                    if data and not header_only and not self._deliver("stderr", data):
                        return
                if channel.recv_ready():
                    progressed = True
                    data = channel.recv(_CHUNK)
                    if data and not header_only and not self._deliver("stdout", data):
                        return
                if progressed:
                    continue
                if ended:
                    self.header_seen.set()  # EOF: no header is coming any more
                    self.exit_status = channel.recv_exit_status()
                    return
                wake.wait(1.0)  # the timeout only guards against a lost wake-up
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self.failure = exc
        finally:
            self.header_seen.set()
            self.done.set()

    def send_stdin(self, data: bytes) -> None:
        import paramiko

        try:
            view = memoryview(data)
            for offset in range(0, len(view), _CHUNK):
                # paramiko's stub says bytes; any buffer works, and a view slices in O(1)
                # (sendall re-slices what it is given: a big bytes object is quadratic).
                self.channel.sendall(view[offset : offset + _CHUNK])  # type: ignore[arg-type]
            self.channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the command exited (or was killed) without reading all of its stdin

    def _take_header(self, data: bytes) -> bytes:
        self._pending += data
        start = self._pending.find(self._tag)
        end = self._pending.find(b"\n", start) if start >= 0 else -1
        if end < 0:
            return b""
        self.preamble = bytes(self._pending[:start])
        header = self._pending[start + len(self._tag) : end].decode("ascii", "replace")
        rest = bytes(self._pending[end + 1 :])
        self._pending.clear()
        status, _, pgid = header.partition(":")
        self.status = status
        if status == "ok" and pgid.isdigit():
            self.pgid = int(pgid)
        self.header_seen.set()
        return rest

    def unparsed_stderr(self) -> bytes:
        return bytes(self._pending)


def _start_command(
    channel: paramiko.Channel, command: str, close_stdin: bool, timeout: float
) -> None:
    try:
        with _answer_within(channel, timeout):
            channel.exec_command(_raw(command))
        if close_stdin:
            channel.shutdown_write()
    except BaseException:
        channel.close()
        raise


# ---------------------------------------------------------------------- files (blocking SFTP)


def _sftp_error(exc: OSError, path: str) -> SandboxError | None:
    """The typed error for an SFTP status that names a file problem, else None."""
    if exc.errno in _FILE_ERRNOS:
        return error_for_errno(exc.errno, path, None)
    return None


def _is_dir(sftp: paramiko.SFTPClient, path: str) -> bool | None:
    """True/False for an existing path (following symlinks), None when it is missing."""
    try:
        mode = sftp.stat(path).st_mode
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EACCES):
            return None
        raise
    return stat.S_ISDIR(mode or 0)


def _diagnose(sftp: paramiko.SFTPClient, path: str, exc: OSError) -> SandboxError:
    """SFTP reports ENOTDIR as 'no such file' and EISDIR as a bare failure: look closer."""
    if exc.errno == errno.EACCES:
        return error_for_errno(errno.EACCES, path, None)
    if _is_dir(sftp, path):
        return SandboxIsADirectoryError(path)
    parent = posixpath.dirname(path)
    while parent and parent != "/":
        kind = _is_dir(sftp, parent)
        if kind is False:
            return SandboxNotADirectoryError(path, f"{parent} is not a directory")
        if kind:
            break
        parent = posixpath.dirname(parent)
    if exc.errno in (errno.ENOENT, None) and _is_dir(sftp, path) is None:
        return SandboxFileNotFoundError(path)
    typed = _sftp_error(exc, path)
    return typed or SandboxError(f"sftp operation on {path!r} failed: {exc}")


def _sftp_read(sftp: paramiko.SFTPClient, path: str, limit: int) -> bytes:
    try:
        attrs = sftp.stat(path)
    except OSError as exc:
        if exc.errno is None or exc.errno in _FILE_ERRNOS:
            raise _diagnose(sftp, path, exc) from None
        raise
    if stat.S_ISDIR(attrs.st_mode or 0):
        raise SandboxIsADirectoryError(path)
    if stat.S_ISFIFO(attrs.st_mode or 0) or stat.S_ISSOCK(attrs.st_mode or 0):
        # The server's read would wait for a writer until io_timeout, then again per retry.
        raise SandboxInvalidArgumentError(f"{path!r} is a FIFO or a socket, not a file")
    size = attrs.st_size or 0
    if size > limit:
        raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
    try:
        with sftp.open(path, "rb") as fh:
            if size:
                fh.prefetch(size)
            return _read_to_limit(fh, limit)
    except OSError as exc:
        if exc.errno is None or exc.errno in _FILE_ERRNOS:
            raise _diagnose(sftp, path, exc) from None
        raise


def _read_to_limit(fh: paramiko.SFTPFile, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes, one SFTP request at a time.

    ``SFTPFile.read(n)`` grows an immutable buffer chunk by chunk: quadratic for big n.
    """
    data = bytearray()
    while len(data) <= limit:
        chunk = fh.read(min(_SFTP_REQUEST, limit + 1 - len(data)))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _sftp_ensure_dir(sftp: paramiko.SFTPClient, directory: str, target: str) -> None:
    """mkdir -p over SFTP; errors name ``target`` (the file being written)."""
    kind = _is_dir(sftp, directory)
    if kind:
        return
    if kind is False:
        raise SandboxNotADirectoryError(target, f"{directory} is not a directory")
    parent = posixpath.dirname(directory)
    if parent != directory:
        _sftp_ensure_dir(sftp, parent, target)
    try:
        sftp.mkdir(directory)
    except OSError as exc:
        if _is_dir(sftp, directory):
            return  # made concurrently
        if exc.errno is None or exc.errno in _FILE_ERRNOS:
            raise _diagnose(sftp, target, exc) from None
        raise


def _refuse_fifo(sftp: paramiko.SFTPClient, path: str) -> paramiko.SFTPAttributes | None:
    """A FIFO or socket would hold the server's open() until io_timeout: refuse it first.
    Returns the path's (followed) attributes, ``None`` when it cannot be stat'ed."""
    try:
        info = sftp.stat(path)
    except OSError:
        return None  # missing or not searchable: open() tells what is wrong
    mode = info.st_mode or 0
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise SandboxInvalidArgumentError(f"{path!r} is a FIFO or a socket, not a file")
    return info


def _sftp_write(sftp: paramiko.SFTPClient, path: str, data: bytes) -> None:
    """Write into a temporary file next to the target and rename it over the target, so a
    write cut midway (server killed, connection lost) leaves the old content or the new,
    never a mix. In place where a rename could not keep the file what it was: not a
    regular file, another user's file, a directory we cannot create files in."""
    info = _refuse_fifo(sftp, path)
    try:
        target = _write_target(sftp, path)
        if info is not None and not stat.S_ISREG(info.st_mode or 0):
            _sftp_write_in_place(sftp, target, data)
            return
        temp = posixpath.join(
            posixpath.dirname(target) or "/", f"{_TEMP_PREFIX}{secrets.token_hex(8)}"
        )
        try:
            fh = sftp.open(temp, "wbx")
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                _sftp_write_in_place(sftp, target, data)  # the directory is not writable
                return
            _sftp_ensure_dir(sftp, posixpath.dirname(target) or "/", path)
            fh = sftp.open(temp, "wbx")
        try:
            with fh:
                if info is not None and fh.stat().st_uid != info.st_uid:
                    fh.close()
                    sftp.remove(temp)
                    _sftp_write_in_place(sftp, target, data)  # a rename would change the owner
                    return
                _write_chunks(fh, data)
                if info is not None:
                    fh.chmod(stat.S_IMODE(info.st_mode or 0o644))
            _sftp_replace(sftp, temp, target, data)
        except BaseException:
            with contextlib.suppress(OSError, EOFError):
                sftp.remove(temp)
            raise
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        if exc.errno is None or exc.errno in _FILE_ERRNOS:
            raise _diagnose(sftp, path, exc) from None
        raise


def _write_target(sftp: paramiko.SFTPClient, path: str) -> str:
    """The file a write to ``path`` lands in: a symlink is written through."""
    try:
        if not stat.S_ISLNK(sftp.lstat(path).st_mode or 0):
            return path
    except OSError:
        return path
    try:
        return sftp.normalize(path)
    except OSError:
        return path  # dangling: open() creates the link's target


def _sftp_replace(sftp: paramiko.SFTPClient, temp: str, target: str, data: bytes) -> None:
    try:
        sftp.posix_rename(temp, target)
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.EXDEV, None):
            raise
        # A mount point (or a server without posix-rename): rewrite the content in place.
        _sftp_write_in_place(sftp, target, data)
        sftp.remove(temp)


def _sftp_write_in_place(sftp: paramiko.SFTPClient, path: str, data: bytes) -> None:
    try:
        fh = sftp.open(path, "wb")
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
        _sftp_ensure_dir(sftp, posixpath.dirname(path) or "/", path)
        fh = sftp.open(path, "wb")
    with fh:
        _write_chunks(fh, data)


def _write_chunks(fh: paramiko.SFTPFile, data: bytes) -> None:
    fh.set_pipelined(True)
    view = memoryview(data)
    for offset in range(0, len(view), _CHUNK):
        fh.write(bytes(view[offset : offset + _CHUNK]))


def _sftp_exists(sftp: paramiko.SFTPClient, path: str) -> bool:
    try:
        sftp.lstat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # also ENOTDIR: SFTP folds it into 'no such file'
            return False
        if exc.errno == errno.EACCES:
            raise SandboxPermissionError(path, "a parent directory cannot be searched") from None
        raise
    return True


# ---------------------------------------------------------------------- control scripts


def _setup_script(workdir: str | None) -> str:
    wanted = shlex.quote(workdir) if workdir else "''"
    return f"""
set -e
command -v setsid >/dev/null 2>&1 || {{ echo "setsid (util-linux) is not installed" >&2; exit 3; }}
[ -r /proc/self/stat ] || {{ echo "/proc is not available (a Linux host is needed)" >&2; exit 3; }}
d=$(mktemp -d -t {_SANDBOX_PREFIX}XXXXXXXXXX)
mkdir "$d/work" "$d/x"
cat > "$d/{_META}"
w={wanted}
if [ -n "$w" ]; then
  if ! mkdir -p -- "$w" || ! w=$(cd -- "$w" && pwd -P); then rm -rf -- "$d"; exit 4; fi
else
  w=$(cd -- "$d/work" && pwd -P)
fi
printf '%s\\n%s\\n' "$d" "$w"
command -v setsid; command -v env; command -v runuser || echo
"""


def _kill_script(pgids: Iterable[int], marker: str | None, home: str | None = None) -> str:
    """Kill process groups, and sweep (freeze, then kill) every process whose environment
    carries the marker or whose working directory is ``home``."""
    groups = " ".join(f"-{int(pgid)}" for pgid in sorted(set(pgids)))
    lines = []
    if groups:
        lines.append(f"kill -s KILL -- {groups} 2>/dev/null")
    if marker:
        sweep = sweep_argv("mark", f"{_MARKER_VAR}={marker}", home=home)
        lines.append(f"{shlex.join(sweep)} >/dev/null 2>&1")
    lines.append("true")
    return "\n".join(lines) + "\n"


def _orphan_kill_script(pgids: Iterable[int], marker: str) -> str:
    """Kill each process group whose leader's environment carries the marker."""
    entry = shlex.quote(f"{_MARKER_VAR}={marker}")
    groups = " ".join(str(int(pgid)) for pgid in sorted(set(pgids)))
    return (
        f"for g in {groups}; do\n"
        f"  if grep -qsxzF -e {entry} /proc/$g/environ; then kill -s KILL -- -$g 2>/dev/null; fi\n"
        "done\ntrue\n"
    )


def _remove_script(directory: str) -> str:
    d = shlex.quote(directory)
    return f"chmod -R u+rwx -- {d} 2>/dev/null; rm -rf -- {d}\n"


def _list_script() -> str:
    return (
        f'for d in "${{TMPDIR:-/tmp}}"/{_SANDBOX_PREFIX}*; do\n'
        f'  [ -f "$d/{_META}" ] || continue\n'
        f"  printf '%s\\0' \"$d\"; cat \"$d/{_META}\"; printf '\\0'\n"
        "done\n"
    )


def _valid_sandbox_dir(path: str) -> bool:
    name = posixpath.basename(path)
    return (
        path.startswith("/")
        and name.startswith(_SANDBOX_PREFIX)
        and "/" not in name
        and ".." not in path
    )


# ---------------------------------------------------------------------- the runtime


_UNCLOSED: set[SSHRuntime] = set()
"""Strong references to started, unclosed runtimes: the base's atexit registry is weak, and a
runtime dropped without close() still holds a connection and a remote directory."""
_UNCLOSED_LOCK = threading.Lock()


@dataclass
class _Forward:
    local_host: str
    local_port: int


class SSHRuntime(Runtime):
    """A private directory on a remote host over SSH (paramiko). Isolation is the remote user's."""

    name = "ssh"
    config_model = SSHConfig

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self.config: SSHConfig
        self._conn: _Connection | None = None
        self._accepted_keys: dict[str, bytes] = {}
        self._dir: str | None = None
        self._tools: _Tools | None = None
        self._owns_workdir = True
        self._forwards: dict[int, _Forward] = {}
        self._connect_lock: anyio.Lock | None = None
        self._sftp_lock: anyio.Lock | None = None
        self._exec_slots: anyio.Semaphore | None = None
        self._control_slots: anyio.Semaphore | None = None
        self._call_limiter: anyio.CapacityLimiter | None = None
        self._stream_limiter: anyio.CapacityLimiter | None = None
        self._orphans: set[int] = set()
        """Process groups whose kill could not be delivered: killed before the next command."""
        self._channels = ChannelSupervisor(
            self.config.channel and self.config.max_channels >= 5,
            self.describe,
            ChannelHooks(
                open_transport=self._open_agent,
                kill_group=self._kill_group_plainly,
                lost_means_dead=_never,
                verify_agent=self._verify_agent_files,
            ),
            stall_timeout=self.config.io_timeout,
            kill_wait=self._kill_wait,
        )

    def _sweep_argv(self) -> list[str]:
        """Processes carrying the runtime's mark or working in a workdir of the sandbox's
        own; the channel agent's session is spared. Other processes of the login user are
        not the sandbox's: a leftover that scrubbed its environment and left the workdir is
        beyond reach (``docs/security.md``)."""
        home = self._workdir if self._owns_workdir else None
        agent = self._channels.info.agent_pid
        mark = f"{MARK_VAR}={self._mark}"
        return sweep_argv("mark", mark, keep=agent, user=self.policy_user, home=home)

    @property
    def channel_info(self) -> ChannelInfo:
        """The state of the persistent channel (``docs/channel.md``)."""
        return self._channels.info

    @property
    def sandbox_id(self) -> str | None:
        return self._dir

    def describe(self) -> str:
        where = f"{self.config.destination}:{self._dir}" if self._dir else self.config.destination
        return f"ssh sandbox {where}"

    @property
    def _marker(self) -> str | None:
        return posixpath.basename(self._dir) if self._dir else None

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> str:
        channels = self.config.max_channels
        self._connect_lock = anyio.Lock()
        self._sftp_lock = anyio.Lock()
        # SFTP, two control channels and (when enabled) the channel agent keep theirs.
        self._exec_slots = anyio.Semaphore(channels - 3 - int(self._channels.enabled))
        self._control_slots = anyio.Semaphore(2)
        self._call_limiter = anyio.CapacityLimiter(channels)
        self._stream_limiter = anyio.CapacityLimiter(3 * channels)
        conn = await self._thread(self._open_connection)
        self._conn = conn
        with _UNCLOSED_LOCK:
            _UNCLOSED.add(self)
        meta = {
            "labels": ownership.session_labels(self.name, self.config.labels),
            "destination": self.config.destination,
            "workdir": self.config.workdir,
        }
        try:
            code, out, err = await self._control(
                _setup_script(self.config.workdir), json.dumps(meta).encode()
            )
        except SandboxError as exc:
            raise ProvisioningError(
                f"{self.describe()}: setting up the sandbox failed: {exc}"
            ) from exc
        lines = out.decode("utf-8", "replace").split("\n")
        if code != 0 or len(lines) != 6:
            detail = err.decode("utf-8", "replace").strip() or f"exit status {code}"
            raise ProvisioningError(
                f"{self.describe()}: cannot create the sandbox directory: {detail}"
            )
        self._dir, workdir, setsid, env, runuser, _ = lines
        self._tools = _Tools(setsid=setsid, env=env, runuser=runuser or None)
        self._owns_workdir = self.config.workdir is None
        log.debug("opened %s (workdir %s)", self.describe(), workdir)
        await self._channels.start()
        return workdir

    def _open_connection(self) -> _Connection:
        return _Connection(_connect(self.config, self._accepted_keys), self.config.io_timeout)

    async def _close(self) -> None:
        await self._channels.close()
        try:
            if self._dir is not None:
                await self._remove_remote()
        finally:
            conn, self._conn = self._conn, None
            self._forwards.clear()
            with _UNCLOSED_LOCK:
                _UNCLOSED.discard(self)
            if conn is not None:
                await anyio.to_thread.run_sync(conn.close)

    async def _remove_remote(self) -> None:
        assert self._dir is not None
        script = _kill_script([], self._marker, f"{self._dir}/work") + _remove_script(self._dir)
        try:
            code, _, err = await self._control(script)
        except (SandboxUnavailableError, ProvisioningError) as exc:
            log.warning(
                "%s: host unreachable at close, directory left to `vf-sandbox cleanup`: %s",
                self.describe(),
                exc,
            )
            return
        if code != 0:
            raise SandboxTransportError(
                f"{self.describe()}: removing the sandbox failed: {err.decode('utf-8', 'replace')}"
            )

    def _close_at_exit(self) -> None:
        """Blocking cleanup at interpreter exit.

        paramiko's own atexit hook (registered after ours, so run before it) has already
        stopped every transport by then: reconnect to remove the sandbox.
        """
        self._channels.close_now()
        conn = self._conn
        try:
            if self._dir is not None:
                if conn is None or not conn.usable():
                    conn = self._open_connection()
                script = _kill_script([], self._marker, f"{self._dir}/work") + _remove_script(
                    self._dir
                )
                _run_control(conn.transport, script, None, self.config.io_timeout)
        finally:
            if conn is not None:
                conn.close()
            if self._conn is not None and self._conn is not conn:
                self._conn.close()
            self._conn = None
            self._state = "closed"
            with _UNCLOSED_LOCK:
                _UNCLOSED.discard(self)

    def _host_routes(self) -> tuple[RouteKind, ...]:
        channel: tuple[RouteKind, ...] = ("channel",) if self._channels.can_relay else ()
        return (*channel, "forward")

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        if via == "channel":
            return await channel_route(self._channels, port)
        remote = await self.forward_remote(port)

        async def cancel() -> None:
            if not self.closed:
                await self.cancel_forward_remote(remote)

        return HostRoute("forward", "127.0.0.1", remote, _close=cancel)

    async def _alive(self) -> bool:
        assert self._dir is not None
        directory = self._dir
        try:
            return await self._retrying(self._sftp_call, _is_dir, directory) is True
        except SandboxUnavailableError:
            return False

    # ------------------------------------------------------------------ connection

    async def _connection(self) -> _Connection:
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
            if self._state not in ("starting", "open", "closing"):
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
            log.info("%s: reconnected", self.describe())
            self._conn = conn
            await self._restore_forwards(conn)
            return conn

    @staticmethod
    def _connection_failed(conn: _Connection, exc: BaseException) -> bool:
        """Whether ``exc`` means the connection (not the remote operation) failed."""
        import paramiko

        if isinstance(exc, EOFError | TimeoutError | paramiko.SSHException):
            return True
        return not conn.transport.is_active()

    def _broken(self, conn: _Connection, what: str, exc: BaseException) -> SandboxTransportError:
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
        self, script: str, stdin: bytes | None = None, *, timeout: float | None = None
    ) -> tuple[int, bytes, bytes]:
        """Run a bookkeeping script on its own channel (not retried); ``timeout`` defaults
        to ``io_timeout``."""
        import paramiko

        assert self._control_slots is not None
        async with self._control_slots:
            conn = await self._connection()
            try:
                return await self._thread(
                    _run_control, conn.transport, script, stdin, timeout or self.config.io_timeout
                )
            except (paramiko.SSHException, OSError, EOFError) as exc:
                raise self._broken(conn, "a control command", exc) from exc

    async def _sftp_call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(sftp, *args)`` in a thread; SFTP clients are not thread-safe: one at a time."""
        import paramiko

        assert self._sftp_lock is not None
        async with self._sftp_lock:
            conn = await self._connection()

            def call() -> T:
                return fn(conn.sftp(), *args)

            what = f"sftp {fn.__name__.lstrip('_')}"
            try:
                return await self._thread(call)
            except SandboxError:
                raise
            except UnicodeEncodeError as exc:  # paramiko sends paths as strict UTF-8
                raise SandboxInvalidArgumentError(
                    f"{self.describe()}: SFTP takes only valid UTF-8 paths, not {exc.object!r}"
                ) from None
            except (paramiko.SSHException, OSError, EOFError) as exc:
                if self._connection_failed(conn, exc) or conn.sftp_closed():
                    raise self._broken(conn, what, exc) from exc
                raise SandboxError(f"{self.describe()}: {what} failed: {exc}") from exc

    # ------------------------------------------------------------------ exec

    def _run_as(self, request: ExecRequest) -> str | None:
        user = request.user
        if user is None or user == self.config.username:
            return None
        if self.config.username != "root":
            raise SandboxPermissionError(
                request.argv[0],
                f"cannot run as user {user!r}: logged in as {self.config.username!r}, not root",
            )
        if self._tools is None or self._tools.runuser is None:
            raise SandboxPermissionError(
                request.argv[0], f"cannot run as user {user!r}: runuser is not installed"
            )
        return user

    @property
    def policy_user(self) -> str | None:
        """``policy_user`` of the config (root logins only)."""
        return self.config.policy_user

    _creates_policy_user = False  # a host's accounts are not ours to make

    def _policy_passage(self) -> str:
        """The sandbox's private directory, above a workdir of its own (``mktemp -d``, 0700)."""
        return (self._dir or "") if self._owns_workdir else ""

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        run_as = self._run_as(request)
        _check_argv_size(request)
        assert self._marker is not None
        if self._orphans:
            await self._kill_orphans()
        return await self._channels.exec(
            request,
            sink,
            lambda: self._plain_exec(request, sink, run_as),
            {_MARKER_VAR: self._marker},
        )

    async def _verify_agent_files(self, digests: Mapping[str, bytes]) -> str | None:
        """Before the channel agent restarts: the files the first agent ran from, read
        again through SFTP (the server's file access, no shell) and hashed."""

        async def read(path: str) -> bytes | None:
            return await self._retrying(self._sftp_call, _sftp_read_or_none, path)

        return await verify_by_reading(read, digests)

    async def _open_agent(self, interpreter: str | None = None) -> ChannelTransport:
        """Start the channel agent on a channel of its own (stdin attached)."""
        import paramiko

        assert self._marker is not None
        conn, channel = await self._retrying(self._open_channel)
        try:
            await self._thread(
                _start_command,
                channel,
                _agent_command_line(self._marker, interpreter),
                False,
                self.config.io_timeout,
            )
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if self._connection_failed(conn, exc):
                raise self._broken(conn, "starting the channel agent", exc) from exc
            raise SandboxError(f"{self.describe()}: the server refused the agent: {exc}") from exc
        return _AgentChannel(channel)

    async def _kill_group_plainly(self, pgid: int) -> None:
        """The channel's fallback kill, when its agent died holding a process group."""
        conn = self._conn
        if conn is None or not conn.usable():
            return  # the connection went: the agent saw its stdin end and killed the group
        try:
            await self._control(_kill_script([pgid], None), timeout=self._kill_wait)
        except SandboxError as exc:
            log.warning("%s: could not kill process group %s: %s", self.describe(), pgid, exc)
            self._orphans.add(pgid)

    async def _plain_exec(self, request: ExecRequest, sink: OutputSink, run_as: str | None) -> int:
        assert self._exec_slots is not None and self._marker is not None and self._dir is not None
        assert self._tools is not None
        nonce = "vfsbx" + secrets.token_hex(12)
        script = _wrapper_script(request, nonce, self._marker, self._tools, run_as, False)
        command = "sh -c " + shlex.quote(script)
        if len(_raw(command)) > _INLINE_SCRIPT_LIMIT:
            path = f"{self._dir}/x/{nonce}.sh"
            big = _wrapper_script(request, nonce, self._marker, self._tools, run_as, True)
            await self._retrying(self._sftp_call, _sftp_write, path, _raw(big))
            command = "sh " + shlex.quote(path)
        async with self._exec_slots:
            conn, channel = await self._retrying(self._open_channel)
            remote = _RemoteCommand(channel, nonce, _sink_feeder(sink))
            try:
                # Not retried from here on: the command may have started. Shielded so a
                # cancellation finds the command either not sent or sent and abortable.
                with anyio.CancelScope(shield=True):
                    await self._send_command(conn, channel, command, request)
                try:
                    return await self._run_remote(conn, remote, request)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await self._abort(remote)
                    raise
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(channel.close)

    async def _send_command(
        self, conn: _Connection, channel: paramiko.Channel, command: str, request: ExecRequest
    ) -> None:
        import paramiko

        try:
            await self._thread(
                _start_command, channel, command, not request.stdin, self.config.io_timeout
            )
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if self._connection_failed(conn, exc):
                raise self._broken(conn, f"exec of {request.argv[0]!r}", exc) from exc
            raise SandboxError(f"{self.describe()}: the server refused the command: {exc}") from exc

    async def _open_channel(self) -> tuple[_Connection, paramiko.Channel]:
        import paramiko

        conn = await self._connection()
        try:
            channel = await self._thread(
                functools.partial(conn.transport.open_session, timeout=self.config.io_timeout)
            )
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._broken(conn, "opening a channel", exc) from exc
        return conn, channel

    async def _run_remote(
        self, conn: _Connection, remote: _RemoteCommand, request: ExecRequest
    ) -> int:
        async def in_thread(fn: Callable[..., None], *args: Any) -> None:
            await anyio.to_thread.run_sync(
                fn, *args, abandon_on_cancel=True, limiter=self._stream_limiter
            )

        async with anyio.create_task_group() as tg:
            if request.stdin:
                tg.start_soon(in_thread, remote.send_stdin, request.stdin)
            await in_thread(remote.pump)
        if remote.status is not None and remote.status != "ok":
            raise self._wrapper_error(remote.status, request)
        if remote.failure is not None or (
            remote.exit_status in (None, -1) and not conn.transport.is_active()
        ):
            raise self._broken(
                conn,
                f"exec of {request.argv[0]!r} (it may still run)",
                remote.failure or EOFError(),
            )
        if remote.exit_status is None:  # the sink refused more output: the caller raises
            await self._abort(remote)
            return -1
        if remote.status is None:
            said = (remote.preamble + remote.unparsed_stderr()).decode("utf-8", "replace")
            raise SandboxError(
                f"{self.describe()}: the remote login shell did not run the command wrapper "
                f"(a POSIX login shell is needed): {said.strip() or 'no output'}"
            )
        if remote.exit_status == -1:
            raise SandboxTransportError(
                f"{self.describe()}: the channel closed without an exit status"
            )
        if remote.preamble:
            log.debug("%s: login shell said on stderr: %r", self.describe(), remote.preamble[:200])
        return remote.exit_status

    def _wrapper_error(self, status: str, request: ExecRequest) -> SandboxError:
        program = request.argv[0]
        if status == "missing":
            where = "" if "/" in program else " in PATH"
            return SandboxFileNotFoundError(program, f"program not found{where}")
        if status == "denied":
            return SandboxPermissionError(program, "not an executable file")
        if status == "cwd-missing":
            return SandboxFileNotFoundError(request.cwd, "working directory")
        if status == "cwd-notdir":
            return SandboxNotADirectoryError(request.cwd, "working directory")
        if status == "cwd-denied":
            return SandboxPermissionError(request.cwd, "working directory")
        if status == "nouser":
            return SandboxInvalidArgumentError(f"no such user in the sandbox: {request.user!r}")
        return SandboxError(f"{self.describe()}: unexpected wrapper status {status!r}")

    async def _abort(self, remote: _RemoteCommand) -> None:
        """Kill the command's process group (shielded by the caller), then drop the channel."""
        if remote.finished:
            return
        if remote.pgid is None and remote.status is None:
            if not remote.started:
                # Cancelled before its pump ran: read just the header on a thread of our own.
                threading.Thread(target=remote.pump, args=(True,), daemon=True).start()
            await anyio.to_thread.run_sync(remote.header_seen.wait, _HEADER_WAIT)
        if remote.pgid is not None:
            try:
                await self._control(_kill_script([remote.pgid], None), timeout=self._kill_wait)
            except SandboxError as exc:
                log.warning(
                    "%s: could not kill process group %s (retried before the next command): %s",
                    self.describe(),
                    remote.pgid,
                    exc,
                )
                self._orphans.add(remote.pgid)
        elif remote.status in (None, "ok"):
            log.warning("%s: a cancelled command never reported its process group", self.describe())
        await anyio.to_thread.run_sync(remote.channel.close)
        if remote.started:
            await anyio.to_thread.run_sync(remote.done.wait, _READER_WAIT)

    @property
    def _kill_wait(self) -> float:
        return min(self.config.io_timeout, _KILL_WAIT)

    async def _kill_orphans(self) -> None:
        """Kill the process groups earlier kills missed, if they are still ours (their
        leader carries this sandbox's marker: after a reboot the ids mean other processes)."""
        orphans, self._orphans = self._orphans, set()
        assert self._marker is not None
        try:
            with anyio.CancelScope(shield=True):
                await self._control(
                    _orphan_kill_script(orphans, self._marker), timeout=self._kill_wait
                )
        except SandboxError as exc:
            self._orphans |= orphans
            log.warning("%s: could not kill process groups %s: %s", self.describe(), orphans, exc)

    # ------------------------------------------------------------------ files

    async def _read(self, path: str, limit: int) -> bytes:
        return await self._channels.read(
            path, limit, lambda: self._retrying(self._sftp_call, _sftp_read, path, limit)
        )

    async def _write(self, path: str, data: bytes) -> None:
        await self._channels.write(path, data, lambda: self._sftp_call(_sftp_write, path, data))

    async def _exists(self, path: str) -> bool:
        return await self._channels.exists(
            path, lambda: self._retrying(self._sftp_call, _sftp_exists, path)
        )

    async def _remove(self, path: str) -> None:
        await self._channels.remove(path, lambda: super(SSHRuntime, self)._remove(path))

    async def _download(self, remote: str, local: Path, *, skip_unsafe: bool = False) -> None:
        parent = super()._download

        async def download() -> None:
            await parent(remote, local, skip_unsafe=skip_unsafe)

        await self._retrying(download)

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
            SandboxError: the server refused the forward (``AllowTcpForwarding``, port in use).
            SandboxTransportError: the connection failed.
            SandboxUnavailableError: the sandbox is closed or its host is gone.
        """
        self._check_open()
        if not 0 < local_port < 65536 or not 0 <= remote_port < 65536:
            raise SandboxInvalidArgumentError(
                f"invalid ports: local {local_port}, remote {remote_port}"
            )
        conn = await self._connection()
        forward = _Forward(local_host, local_port)
        bound = await self._request_forward(conn, remote_port, forward)
        self._forwards[bound] = forward
        return bound

    async def cancel_forward_remote(self, remote_port: int) -> None:
        """Stop a forward made by :meth:`forward_remote`. Unknown ports are ignored.

        Raises:
            SandboxUnavailableError: the sandbox is closed.
        """
        self._check_open()
        if self._forwards.pop(remote_port, None) is None:
            return
        conn = self._conn
        if conn is not None and conn.usable():
            import paramiko

            try:
                await self._thread(conn.transport.cancel_port_forward, "127.0.0.1", remote_port)
            except (paramiko.SSHException, OSError, EOFError) as exc:
                raise self._broken(conn, "cancelling a port forward", exc) from exc

    async def _request_forward(self, conn: _Connection, remote_port: int, forward: _Forward) -> int:
        import paramiko

        timeout = self.config.io_timeout

        def handler(
            channel: paramiko.Channel, origin: tuple[str, int], server: tuple[str, int]
        ) -> None:
            threading.Thread(
                target=_bridge, args=(channel, forward, timeout), name="vf-ssh-forward", daemon=True
            ).start()

        try:
            return await self._thread(
                conn.transport.request_port_forward, "127.0.0.1", remote_port, handler
            )
        except paramiko.SSHException as exc:
            if conn.transport.is_active():
                raise SandboxError(
                    f"{self.describe()}: the server refused to forward remote port {remote_port}: "
                    f"{exc} (is AllowTcpForwarding enabled?)"
                ) from exc
            raise self._broken(conn, "a port forward request", exc) from exc
        except (OSError, EOFError) as exc:
            raise self._broken(conn, "a port forward request", exc) from exc

    async def _restore_forwards(self, conn: _Connection) -> None:
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

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Sandbox directories on ``config``'s host (none without an SSH config).

        Raises:
            ProvisioningError: the host cannot be reached or refuses the credentials.
            SandboxTransportError: the listing command failed.
        """
        if not isinstance(config, SSHConfig):
            return []
        code, out, err = await _one_shot(config, _list_script())
        if code != 0:
            raise SandboxTransportError(
                f"listing sandboxes on {config.destination} failed: {err!r}"
            )
        return _parse_listing(out)

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Kill what still runs in a listed sandbox and remove its directory.

        Raises:
            SandboxInvalidArgumentError: no SSH config, or ``info`` is not an SSH sandbox dir.
            ProvisioningError: the host cannot be reached or refuses the credentials.
            SandboxTransportError: the removal failed.
        """
        if not isinstance(config, SSHConfig):
            raise SandboxInvalidArgumentError("destroying an ssh sandbox needs its SSHConfig")
        if not _valid_sandbox_dir(info.id):
            raise SandboxInvalidArgumentError(f"not an ssh sandbox directory: {info.id!r}")
        script = _kill_script([], posixpath.basename(info.id), f"{info.id}/work")
        script += _remove_script(info.id)
        code, _, err = await _one_shot(config, script)
        if code != 0:
            raise SandboxTransportError(
                f"removing {info.id} on {config.destination} failed: {err!r}"
            )


async def _never() -> bool:
    """A dropped SSH channel says nothing about the host: the next call finds out."""
    return False


async def _one_shot(config: SSHConfig, script: str) -> tuple[int, bytes, bytes]:
    def run() -> tuple[int, bytes, bytes]:
        import paramiko

        transport = _connect(config, {})
        try:
            return _run_control(transport, script, None, config.io_timeout)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise SandboxTransportError(
                f"control command on {config.destination} failed: {exc}"
            ) from exc
        finally:
            transport.close()

    return await anyio.to_thread.run_sync(run)


def _parse_listing(out: bytes) -> list[SandboxInfo]:
    fields = out.split(b"\0")
    found = []
    for path_raw, meta_raw in zip(fields[0::2], fields[1::2], strict=False):
        path = path_raw.decode("utf-8", "replace")
        try:
            meta = json.loads(meta_raw)
            labels = {str(k): str(v) for k, v in dict(meta.get("labels", {})).items()}
        except (ValueError, TypeError, AttributeError):
            log.warning("skipping %s: unreadable %s", path, _META)
            continue
        found.append(
            SandboxInfo(
                backend="ssh",
                id=path,
                labels=labels,
                state="present",
                created=labels.get(ownership.CREATED),
            )
        )
    return found


def _sink_feeder(sink: OutputSink) -> Callable[[Stream, bytes], bool]:
    """Feed the sink on the event loop thread (it may cancel the exec's scope)."""

    def feed(stream: Stream, data: bytes) -> bool:
        try:
            return anyio.from_thread.run_sync(sink.feed, stream, data)
        except RuntimeError:
            return False  # the event loop is gone: this call was abandoned long ago

    return feed


def _bridge(channel: paramiko.Channel, forward: _Forward, timeout: float) -> None:
    """Pump bytes between a forwarded channel and a new local TCP connection."""
    try:
        sock = socket.create_connection((forward.local_host, forward.local_port), timeout=timeout)
    except OSError as exc:
        log.warning("forward to %s:%s failed: %s", forward.local_host, forward.local_port, exc)
        channel.close()
        return
    sock.settimeout(None)
    open_ends: list[Any] = [sock, channel]
    try:
        while open_ends:
            ready, _, _ = select.select(open_ends, [], [])
            for end in ready:
                data = end.recv(64 * 1024)
                if end is sock:
                    if data:
                        channel.sendall(data)
                    else:
                        channel.shutdown_write()
                        open_ends.remove(sock)
                elif data:
                    sock.sendall(data)
                else:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_WR)
                    open_ends.remove(channel)
    except (OSError, EOFError) as exc:
        log.debug("forward to %s:%s ended: %s", forward.local_host, forward.local_port, exc)
    finally:
        channel.close()
        sock.close()


__all__ = [
    "HostKeyMismatchError",
    "HostKeyVerificationError",
    "HostUnreachableError",
    "SSHAuthenticationError",
    "SSHConfig",
    "SSHRuntime",
    "UnknownHostKeyError",
]
