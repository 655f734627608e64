"""The ``modal`` runtime: sandboxes that are Modal Sandboxes, driven through the ``modal`` SDK.

Written against ``modal`` 1.6 (``Sandbox.create``, ``Sandbox.exec``, ``Sandbox.filesystem``,
``Sandbox.list``), always through the SDK's async interface (the ``.aio`` variants) when
the caller runs on asyncio. The SDK's ``.aio`` variants only work on an asyncio loop; under
trio every SDK call goes to a worker thread through the SDK's blocking interface instead.

What Modal's transport limits, and how this module works around it:

* **argv**: the SDK refuses an ``exec`` whose arguments total more than 65,536 characters
  (``ARG_MAX_BYTES`` in ``modal/sandbox/_common.py``). Commands whose wrapped argv is over
  :data:`ARGV_INLINE_LIMIT` bytes are spooled: the argv is written into the sandbox as a
  shell ``set --`` script through the filesystem API and the wrapper sources it.
* **stdin**: the SDK buffers at most 16 MiB of stdin between two ``drain()`` calls; stdin
  is sent in :data:`STDIN_CHUNK` pieces, each drained, then EOF.
* **timeouts**: ``exec(timeout=N)`` takes whole seconds; when it fires the SDK ends the
  output streams and ``wait()`` returns ``-1``. The runtime enforces the caller's exact
  timeout itself, passes the rounded-up value to Modal as a server-side backstop, and turns
  ``-1`` into :class:`~runtimes.errors.ExecTimeoutError`.
* **process trees**: Modal kills at most the process it started. Every command runs under a
  small ``sh`` wrapper that starts it with ``setsid`` (its own session and process group)
  and records the group id in ``/tmp/.vf-sandbox``; a timeout, an output cap or a
  cancellation sends a second exec that kills the whole group.
* **files** go through ``Sandbox.filesystem`` (``stat``, ``read_bytes``, ``write_bytes``,
  ``make_directory``, ``remove``). Its typed exceptions are mapped to this suite's errors;
  an untyped ``SandboxFilesystemError`` is diagnosed with a small shell probe so the
  caller still gets the right errno. Reads check the size with ``stat`` first, so a file
  over ``max_bytes`` is refused without being transferred.

Creation: bounded lifetime (``timeout``, default one hour) and idle timeout by default,
network blocked by default, every sandbox tagged with the session labels (so
``vf-sandbox cleanup`` finds leaked ones with ``Sandbox.list(tags=...)``), a process-wide
cap on live sandboxes and on creations per second (:mod:`runtimes.limits`), and bounded
retries with backoff when Modal answers ``ResourceExhaustedError``.
"""

from __future__ import annotations

import asyncio
import atexit
import errno
import functools
import ipaddress
import logging
import math
import secrets as _secrets
import shlex
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Self

import anyio
from pydantic import Field, field_validator, model_validator
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random_exponential,
)

from . import limits, ownership
from .base import CLOCK_TICK_SCRIPT, MARK_VAR, Runtime, live_runtimes, sweep_argv
from .channel import (
    ChannelHooks,
    ChannelInfo,
    ChannelSupervisor,
    ChannelTransport,
    agent_command,
    verify_by_reading,
)
from .config import RuntimeConfig, absolute_workdir
from .errors import (
    ExecTimeoutError,
    OutputLimitExceededError,
    ProvisioningError,
    SandboxError,
    SandboxFileExistsError,
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
from .policy import DEFAULT_POLICY_USER, validate_policy_user
from .routes import HostRoute, RouteKind, channel_route

log = logging.getLogger("runtimes.modal")

__all__ = ["ARGV_INLINE_LIMIT", "STDIN_CHUNK", "ModalConfig", "ModalRuntime"]

ARGV_INLINE_LIMIT = 60_000
"""Largest wrapped argv (UTF-8 bytes) sent inline; the SDK's own cap is 65,536 characters."""

STDIN_CHUNK = 1 * MiB
"""Stdin is written and drained in pieces of this size (the SDK buffers at most 16 MiB)."""

CONTROL_DIR = "/tmp/.vf-sandbox"
"""Where the exec wrapper keeps process-group ids and spooled argv files, per exec nonce."""

KILL_TIMEOUT = 30.0
"""How long the process-tree kill may take before it is given up (and logged)."""

DRAIN_AFTER_KILL = 10.0
"""How long output may keep arriving after the process tree was killed."""

TRANSPORT_ATTEMPTS = 3
"""Attempts for idempotent calls (file operations, liveness) when the channel fails."""

CREATE_BACKOFF = (1.0, 30.0)
"""First and longest wait (seconds) between creations Modal refused as resource-exhausted."""

_PRELUDE_FAILED = 255

# The exec wrapper. Arguments: nonce, cwd, user, spooled-argv file (or ""), then argv.
# Failures before the command starts are reported as one marker line on stderr naming the
# nonce, an errno and what failed, with exit 255; the command itself runs with setsid in its
# own session and process group, whose id is recorded so that _KILL_SCRIPT can kill the tree.
_PRELUDE = r"""n=$1 c=$2 u=$3 a=$4
shift 4
d=/tmp/.vf-sandbox
f=$d/$n
e() { printf '\nvf-sandbox-%s:%s:%s\n' "$n" "$1" "$2" >&2; exit 255; }
[ -d $d ] || mkdir -p -m 1777 $d 2>/dev/null
if [ -n "$a" ]; then . "$a" || e 22 argv; rm -f "$a"; fi
cd "$c" 2>/dev/null || { [ -e "$c" ] || e 2 cwd; [ -d "$c" ] || e 20 cwd; e 13 cwd; }
p=$1
case $p in
*/*) [ -e "$p" ] || e 2 prog; if [ -d "$p" ] || [ ! -x "$p" ]; then e 13 prog; fi;;
*) s=2; o=$IFS; IFS=:; set -f
   for q in $PATH; do q=${q:-.}/$p
     if [ -f "$q" ]; then if [ -x "$q" ]; then s=0; break; fi; s=13; fi
   done
   IFS=$o; set +f; [ $s = 0 ] || e $s prog;;
esac
if [ -n "$u" ]; then
  i=$(id -u "$u" 2>/dev/null) || e 22 user
  if [ "$i" != "$(id -u)" ]; then
    [ "$(id -u)" = 0 ] || e 13 user
    g=$(id -g "$u")
    if command -v setpriv >/dev/null 2>&1; then
      set -- setpriv --reuid="$i" --regid="$g" --init-groups -- "$@"
    elif command -v runuser >/dev/null 2>&1; then set -- runuser -u "$u" -- "$@"
    else e 95 user; fi
  fi
fi
[ -e "$f.cancel" ] && exit 137
exec 3<&0
setsid -- "$@" <&3 3<&- &
{ echo $! >"$f.pgid"; } 2>/dev/null
exec 3<&-
[ -e "$f.cancel" ] && kill -s KILL -- "-$!" 2>/dev/null
wait $! 2>/dev/null
s=$?
rm -f "$f.pgid" "$f.cancel"
exit $s
"""

# Kill the process group of the exec with this nonce. The cancel marker is written before the
# group id is read, and the wrapper writes the group id before it reads the marker, so
# whichever runs second does the kill: a command never starts unsupervised after a cancel.
_KILL_SCRIPT = r"""f=/tmp/.vf-sandbox/$1
: >"$f.cancel" 2>/dev/null
if [ -s "$f.pgid" ]; then
  read -r g <"$f.pgid" && kill -s KILL -- "-$g" 2>/dev/null
  rm -f "$f.pgid" "$f.cancel"
fi
exit 0
"""

# Print the errno a read (r) or write (w) of $1 most likely failed with, 0 if unknown.
_DIAGNOSE_SCRIPT = r"""p=$1 m=$2
if [ ! -e "$p" ] && [ -L "$p" ]; then echo 2; exit 0; fi
if [ -e "$p" ]; then
  if [ -d "$p" ]; then echo 21
  elif [ "$m" = r ] && [ ! -r "$p" ]; then echo 13
  elif [ "$m" = w ] && [ ! -w "$p" ]; then echo 13
  else echo 0; fi
  exit 0
fi
q=$p
while :; do
  case $q in */*) q=${q%/*};; *) q=;; esac
  [ -n "$q" ] || q=/
  if [ -e "$q" ]; then
    if [ ! -d "$q" ]; then echo 20
    elif [ ! -x "$q" ]; then echo 13
    elif [ "$m" = w ] && [ ! -w "$q" ]; then echo 13
    elif [ "$m" = r ]; then echo 2
    else echo 0; fi
    exit 0
  fi
  [ "$q" = / ] && { echo 2; exit 0; }
done
"""

_MARKER_WHAT = {"cwd", "prog", "user", "argv"}


def _modal() -> Any:
    """The ``modal`` SDK module. Tests replace this function to inject a fake SDK.

    Raises:
        ProvisioningError: the SDK is not installed.
    """
    try:
        import modal
    except ImportError as exc:
        raise ProvisioningError(
            "the modal runtime needs the modal SDK: pip install 'vf-sandbox[modal]'"
        ) from exc
    return modal


_exit_hook_lock = threading.Lock()
_exit_hook_registered = False


def _register_exit_hook() -> None:
    """Close this process's open Modal runtimes at exit, before the SDK stops its loop.

    The SDK (synchronicity) registers an atexit handler that stops the event loop its
    clients live on. atexit runs handlers last-registered first, so the generic backstop of
    :mod:`runtimes.base`, registered when ``runtimes`` was imported, would run after it and
    find the SDK unusable; this one is registered after the SDK was imported.
    """
    global _exit_hook_registered
    with _exit_hook_lock:
        if not _exit_hook_registered:
            atexit.register(_close_modal_runtimes_at_exit)
            _exit_hook_registered = True


def _close_modal_runtimes_at_exit() -> None:
    for runtime in live_runtimes():
        if isinstance(runtime, ModalRuntime) and not runtime.closed:
            try:
                runtime._close_at_exit()
            except Exception:  # last resort at exit: logged, and `cleanup` sweeps the rest
                log.warning("atexit: could not close %s", runtime.describe(), exc_info=True)


# ---------------------------------------------------------------------- config


def _is_dockerfile(image: str) -> bool:
    name = Path(image).name
    return (
        name == "Dockerfile"
        or name.endswith((".Dockerfile", ".dockerfile"))
        or ("/" in image and Path(image).is_file())
    )


class ModalConfig(RuntimeConfig):
    """Config of the ``modal`` runtime.

    ``image`` is a registry reference (``"python:3.11-slim"``) or the path of a local
    Dockerfile (for example ``images/python/Dockerfile``; its directory is the build
    context). ``timeout`` bounds the sandbox's whole life and ``idle_timeout`` its idle
    time (seconds), so a crashed client never leaves a sandbox billing for a day. The
    network is blocked unless ``block_network=False``; ``cidr_allowlist`` opens it to
    those CIDRs only. ``secrets`` are names of Modal Secrets injected as environment
    variables. ``tags`` are added to the session labels every sandbox carries as Modal
    tags. ``max_live`` caps this process's live Modal sandboxes and
    ``creations_per_second`` its creation rate; ``create_attempts`` bounds the retries
    when Modal answers ``ResourceExhaustedError``.
    """

    type: Literal["modal"] = "modal"
    workdir: str | None = "/work"
    image: str = "python:3.11-slim"
    app_name: str = Field(default="vf-sandbox", min_length=1)
    environment: str | None = None
    cpu: float | None = Field(default=None, gt=0)
    memory: int | None = Field(default=None, gt=0, description="MiB")
    gpu: str | None = None
    timeout: int = Field(default=3600, ge=10, le=24 * 3600)
    idle_timeout: int | None = Field(default=900, ge=10, le=24 * 3600)
    region: str | list[str] | None = None
    block_network: bool = True
    cidr_allowlist: list[str] | None = None
    secrets: list[str] = Field(default_factory=list)
    tags: dict[str, str] = Field(default_factory=dict)
    max_live: int | None = Field(default=None, ge=1)
    creations_per_second: float | None = Field(default=None, gt=0)
    create_attempts: int = Field(default=6, ge=1, le=20)
    create_timeout: float = Field(default=600.0, gt=0)
    policy_user: str | None = DEFAULT_POLICY_USER
    channel: bool = Field(
        default=True,
        description="run commands and files through a persistent in-sandbox agent (python3)",
    )

    _plain_policy_user = field_validator("policy_user")(validate_policy_user)

    @model_validator(mode="before")
    @classmethod
    def _allowlist_opens_network(cls, data: Any) -> Any:
        """``cidr_allowlist`` alone means "network on, but only to these"."""
        if isinstance(data, dict) and data.get("cidr_allowlist") is not None:
            if data.get("block_network") is True:
                raise ValueError("cidr_allowlist needs block_network=False (it opens the network)")
            data = {**data, "block_network": False}
        return data

    _absolute_workdir = field_validator("workdir")(absolute_workdir)

    @field_validator("cidr_allowlist")
    @classmethod
    def _valid_cidrs(cls, value: list[str] | None) -> list[str] | None:
        for cidr in value or []:
            ipaddress.ip_network(cidr, strict=False)  # raises ValueError naming the bad one
        return value

    @field_validator("secrets")
    @classmethod
    def _named_secrets(cls, value: list[str]) -> list[str]:
        if any(not name for name in value):
            raise ValueError("secret names must not be empty")
        return value


# ---------------------------------------------------------------------- calling the SDK


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _call(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Call a (synchronicity-wrapped) SDK function from asyncio or trio."""
    if _on_asyncio():
        return await fn.aio(*args, **kwargs)
    return await anyio.to_thread.run_sync(
        functools.partial(fn, *args, **kwargs), abandon_on_cancel=True
    )


async def _collect(gen_fn: Any, /, *args: Any, **kwargs: Any) -> list[Any]:
    """All items of an SDK async generator (``Sandbox.list``)."""
    if _on_asyncio():
        return [item async for item in gen_fn.aio(*args, **kwargs)]
    return await anyio.to_thread.run_sync(
        lambda: list(gen_fn(*args, **kwargs)), abandon_on_cancel=True
    )


async def _pump(stream: Any, sink: OutputSink, name: Stream) -> None:
    """Feed one output stream of a process to the sink until EOF or the sink is full."""
    if _on_asyncio():
        async for chunk in stream:
            if chunk and not sink.feed(name, bytes(chunk)):
                return
        return

    def blocking() -> None:
        try:
            for chunk in stream:
                if chunk and not anyio.from_thread.run_sync(sink.feed, name, bytes(chunk)):
                    return
        except anyio.RunFinishedError:
            return  # the caller's event loop is gone; nobody wants this output any more

    await anyio.to_thread.run_sync(blocking, abandon_on_cancel=True)


def _exception_module() -> Any:
    return _modal().exception


def _is_transport_error(exc: BaseException) -> bool:
    errors = _exception_module()
    if isinstance(exc, errors.ServiceError | errors.ConnectionError | errors.InternalError):
        return True
    if isinstance(exc, OSError | TimeoutError) and not isinstance(exc, SandboxError):
        return True
    try:
        from grpclib.exceptions import StreamTerminatedError
    except ImportError:  # pragma: no cover - grpclib comes with modal
        return False
    return isinstance(exc, StreamTerminatedError)


def _quote_argv(argv: tuple[str, ...] | list[str]) -> bytes:
    return ("set --" + "".join(" " + shlex.quote(a) for a in argv) + "\n").encode("utf-8")


def _argv_size(argv: list[str]) -> int:
    return sum(len(a.encode("utf-8")) for a in argv)


class _AgentProcess(ChannelTransport):
    """The channel agent's process (one ``Sandbox.exec`` with stdin), driven through the
    SDK's blocking interface from the channel's threads."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self._chunks: Iterator[Any] | None = None
        self._closed = False

    def recv(self) -> bytes:
        if self._chunks is None:
            self._chunks = iter(self._process.stdout)
        for chunk in self._chunks:
            if chunk:
                return bytes(chunk)
        return b""

    def send(self, data: bytes) -> None:
        self._process.stdin.write(data)
        self._process.stdin.drain()

    def close(self) -> None:
        """EOF to the agent (it then exits, ending the stream), from a thread of its own:
        a dead sandbox or a stopped SDK must not block the caller."""
        if self._closed:
            return
        self._closed = True
        threading.Thread(target=self._send_eof, name="vf-modal-agent-eof", daemon=True).start()

    def _send_eof(self) -> None:
        try:
            self._process.stdin.write_eof()
            self._process.stdin.drain()
        except Exception as exc:  # noqa: BLE001 - the process or the sandbox is gone already
            log.debug("modal: closing the channel agent's stdin failed: %r", exc)


class _TooLargeForFilesystemApi(SandboxError):
    """The filesystem API refused a read as too large: read it through exec instead."""


# ---------------------------------------------------------------------- the runtime


class ModalRuntime(Runtime):
    """A Modal Sandbox: created on start, terminated on close.

    Besides the errors every runtime method documents: a sandbox Modal terminated (its
    ``timeout``, ``idle_timeout``, the dashboard, ``cleanup``) is
    :class:`~runtimes.errors.SandboxUnavailableError` on every call, a failed channel to a
    live one is :class:`~runtimes.errors.SandboxTransportError` (file operations and
    ``alive`` are retried first), and a creation Modal refuses is
    :class:`~runtimes.errors.ProvisioningError`.
    """

    name = "modal"
    config_model = ModalConfig

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self.config: ModalConfig
        self._sandbox: Any = None
        self._sandbox_id: str | None = None
        self._holds_slot = False
        self._started_at: int | None = None
        """Clock tick at which the sandbox became ours: every process that started later
        is a command's (``stop_processes``)."""
        self._channels = ChannelSupervisor(
            self.config.channel,
            self.describe,
            ChannelHooks(
                open_transport=self._open_agent,
                kill_group=self._kill_group_plainly,
                lost_means_dead=self._finished,
                probe_dead=self._finished,
                verify_agent=self._verify_agent_files,
            ),
        )

    @property
    def channel_info(self) -> ChannelInfo:
        """The state of the persistent channel (``docs/channel.md``)."""
        return self._channels.info

    @property
    def sandbox_id(self) -> str | None:
        return self._sandbox_id

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        """Create the Modal Sandbox and wait until it is ready.

        Waiting for a live-sandbox slot, for the creation rate and between retries is
        cancellable; each creation call is shielded until its handle is captured (and
        bounded by ``create_timeout``), and a sandbox created for a cancelled caller is
        terminated before the cancellation propagates.

        Raises:
            ProvisioningError: Modal refused the sandbox (quota or capacity after
                ``create_attempts`` tries, image build, missing secret, authentication,
                invalid options), or it did not come up within ``create_timeout``.
            SandboxUnavailableError: the runtime was already started or closed.
        """
        if self._state != "new":
            return await super().start()
        try:
            await self._take_slot()
            await self._create_sandbox()
            return await super().start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._discard()
            raise

    async def _take_slot(self) -> None:
        if self.config.max_live is not None:
            await limits.live_cap(self.name).acquire(self.config.max_live)
            self._holds_slot = True

    def _release_slot(self) -> None:
        if self._holds_slot:
            self._holds_slot = False
            limits.live_cap(self.name).release()

    async def _discard(self) -> None:
        """Terminate a sandbox created by a start that did not finish; free the slot."""
        sandbox, self._sandbox = self._sandbox, None
        try:
            if sandbox is not None:
                await self._terminate(sandbox)
        finally:
            self._release_slot()

    async def _create_sandbox(self) -> None:
        modal = _modal()
        _register_exit_hook()
        errors = modal.exception
        kwargs = await self._create_arguments(modal)
        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda e: isinstance(e, errors.ResourceExhaustedError)),
            stop=stop_after_attempt(self.config.create_attempts),
            wait=wait_random_exponential(multiplier=CREATE_BACKOFF[0], max=CREATE_BACKOFF[1]),
            sleep=anyio.sleep,
            before_sleep=lambda state: log.info(
                "modal: capacity or rate limit, retrying creation (attempt %d)",
                state.attempt_number,
            ),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await limits.creation_rate(self.name).wait(self.config.creations_per_second)
                    await self._create_once(modal, kwargs)
        except ProvisioningError:
            raise
        except errors.ResourceExhaustedError as exc:
            raise ProvisioningError(
                f"Modal refused the sandbox {self.config.create_attempts} times "
                f"(quota, rate limit or capacity): {exc}"
            ) from exc
        except errors.AuthError as exc:
            raise ProvisioningError(
                f"Modal authentication failed (set MODAL_TOKEN_ID / MODAL_TOKEN_SECRET "
                f"or run `modal token new`): {exc}"
            ) from exc
        except errors.Error as exc:
            raise ProvisioningError(
                f"Modal could not create the sandbox: {type(exc).__name__}: {exc}"
            ) from exc
        except Exception as exc:  # the SDK's own helpers (images, secrets) raise builtins too
            raise ProvisioningError(
                f"could not create the Modal sandbox: {type(exc).__name__}: {exc}"
            ) from exc

    async def _create_once(self, modal: Any, kwargs: dict[str, Any]) -> None:
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(self.config.create_timeout):
                    sandbox = await _call(modal.Sandbox.create, **kwargs)
            except TimeoutError as exc:
                raise ProvisioningError(
                    f"the Modal sandbox did not come up within {self.config.create_timeout:g}s"
                ) from exc
            self._sandbox = sandbox
            self._sandbox_id = str(sandbox.object_id)

    async def _create_arguments(self, modal: Any) -> dict[str, Any]:
        cfg = self.config
        try:
            app = await _call(
                modal.App.lookup,
                cfg.app_name,
                create_if_missing=True,
                environment_name=cfg.environment,
            )
        except modal.exception.Error as exc:
            raise ProvisioningError(
                f"cannot look up the Modal app {cfg.app_name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        kwargs: dict[str, Any] = {
            "app": app,
            "image": self._image(modal),
            "tags": self._tags(),
            "timeout": cfg.timeout,
            "idle_timeout": cfg.idle_timeout,
            "block_network": cfg.block_network,
        }
        if cfg.cidr_allowlist is not None:
            kwargs["outbound_cidr_allowlist"] = list(cfg.cidr_allowlist)
        if cfg.secrets:
            kwargs["secrets"] = [modal.Secret.from_name(name) for name in cfg.secrets]
        optional = {"cpu": cfg.cpu, "memory": cfg.memory, "gpu": cfg.gpu, "region": cfg.region}
        kwargs.update({key: value for key, value in optional.items() if value is not None})
        return kwargs

    def _image(self, modal: Any) -> Any:
        image = self.config.image
        if _is_dockerfile(image):
            path = Path(image)
            if not path.is_file():
                raise ProvisioningError(f"Dockerfile not found: {image}")
            return modal.Image.from_dockerfile(str(path), context_dir=str(path.parent))
        return modal.Image.from_registry(image)

    def _tags(self) -> dict[str, str]:
        extra = {**self.config.labels, **self.config.tags}
        labels = ownership.session_labels(self.name, extra)
        return {key: value for key, value in labels.items() if value}

    async def _start(self) -> str:
        workdir = self.config.workdir or "/work"
        try:
            await self._files("make_directory", workdir, workdir, create_parents=True)
        except SandboxError as exc:
            raise ProvisioningError(
                f"{self.describe()}: cannot create the workdir {workdir!r}: {exc}"
            ) from exc
        await self._channels.start()
        self._started_at = await self._clock_tick(workdir)
        return workdir

    async def _clock_tick(self, workdir: str) -> int:
        """The sandbox's clock tick now (see :data:`~runtimes.base.CLOCK_TICK_SCRIPT`).

        Raises:
            ProvisioningError: the sandbox cannot run ``sh`` or has no ``/proc``.
        """
        request, sink = self._internal(["sh", "-c", CLOCK_TICK_SCRIPT])
        code = await self._exec(request, sink)
        text = bytes(sink.stdout).decode("utf-8", "replace").strip()
        if code != 0 or not text.isdigit():
            detail = bytes(sink.stderr).decode("utf-8", "replace").strip()
            raise ProvisioningError(f"{self.describe()}: cannot read /proc ({code}): {detail}")
        return int(text)

    def _sweep_argv(self) -> list[str]:
        """Every process that started after the sandbox became ours: Modal gives the sandbox
        a pid namespace of its own, so anything newer is a command's, however it detached
        itself (``setsid``, ``env -i``). The channel agent's session is spared."""
        mark = f"{MARK_VAR}={self._mark}"
        if self._started_at is None:
            return sweep_argv("mark", mark)
        agent = self._channels.info.agent_pid
        return sweep_argv(f"since:{self._started_at}", mark, keep=agent)

    async def _close(self) -> None:
        await self._channels.close()
        sandbox, self._sandbox = self._sandbox, None
        try:
            if sandbox is not None:
                await self._terminate(sandbox)
        finally:
            self._release_slot()

    async def _terminate(self, sandbox: Any) -> None:
        """Terminate and detach; a failure is logged, not raised (see the module docs)."""
        errors = _exception_module()
        gone = (errors.NotFoundError, errors.ClientClosed, errors.ConflictError)
        try:
            with anyio.fail_after(KILL_TIMEOUT):
                async for attempt in self._transport_retrying():
                    with attempt:
                        try:
                            await _call(sandbox.terminate)
                        except gone:
                            pass
                        except Exception as exc:
                            if _is_transport_error(exc):
                                raise SandboxTransportError(str(exc)) from exc
                            raise
        except Exception as exc:  # noqa: BLE001 - close must finish; the sandbox is tagged and bounded
            log.warning(
                "modal: could not terminate sandbox %s (%s: %s); it ends at its timeout "
                "and `vf-sandbox cleanup` removes it",
                self._sandbox_id,
                type(exc).__name__,
                exc,
            )
        try:
            await _call(sandbox.detach)
        except Exception as exc:  # noqa: BLE001 - only releases client-side resources
            log.debug("modal: detach of %s failed: %r", self._sandbox_id, exc)

    def _close_at_exit(self) -> None:
        """The atexit backstop: terminate through the SDK's blocking interface (bounded)."""
        self._channels.close_now()
        sandbox, self._sandbox = self._sandbox, None
        self._state = "closed"
        self._release_slot()
        if sandbox is None:
            return
        failures: list[BaseException] = []

        def terminate() -> None:
            try:
                sandbox.terminate()
            except BaseException as exc:  # noqa: BLE001 - reported below, from the main thread
                failures.append(exc)

        worker = threading.Thread(target=terminate, name="vf-modal-atexit", daemon=True)
        worker.start()
        worker.join(KILL_TIMEOUT)
        if worker.is_alive() or failures:
            reason = repr(failures[0]) if failures else f"no answer in {KILL_TIMEOUT:g}s"
            raise SandboxError(f"{self.describe()}: terminate at exit failed: {reason}")

    def _host_routes(self) -> tuple[RouteKind, ...]:
        return ("channel",) if self._channels.can_relay else ()

    def _route_hint(self) -> str:
        return (
            "A Modal sandbox reaches the host only through the channel (python3 in the image, "
            "channel=True); otherwise expose the service yourself (a tunnel) and pass its URL"
        )

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        return await channel_route(self._channels, port)

    async def _alive(self) -> bool:
        sandbox = self._sandbox
        if sandbox is None:
            return False
        errors = _exception_module()
        async for attempt in self._transport_retrying():
            with attempt:
                try:
                    code = await _call(sandbox.poll)
                except (errors.NotFoundError, errors.ClientClosed, errors.ConflictError):
                    return False
                except Exception as exc:
                    if _is_transport_error(exc):
                        raise SandboxTransportError(
                            f"{self.describe()}: liveness check failed: {exc}"
                        ) from exc
                    raise
                return code is None
        raise AssertionError("unreachable: tenacity reraises")

    # ------------------------------------------------------------------ error mapping

    def _transport_retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception_type(SandboxTransportError),
            stop=stop_after_attempt(TRANSPORT_ATTEMPTS),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            sleep=anyio.sleep,
            reraise=True,
        )

    def _live_sandbox(self) -> Any:
        if self._sandbox is None:
            raise SandboxUnavailableError(f"{self.describe()} is closed")
        return self._sandbox

    async def _finished(self) -> bool:
        """Whether the sandbox has stopped (``poll``); ``False`` when that cannot be told."""
        sandbox = self._sandbox
        if sandbox is None:
            return True
        errors = _exception_module()
        try:
            return await _call(sandbox.poll) is not None
        except (errors.NotFoundError, errors.ClientClosed, errors.ConflictError):
            return True
        except Exception as exc:  # noqa: BLE001 - a probe: the caller reports the original error
            log.debug("modal: poll of %s failed: %r", self._sandbox_id, exc)
            return False

    async def _translate(self, exc: Exception, operation: str, path: str | None) -> SandboxError:
        """The typed error for an exception the SDK raised during ``operation``."""
        if isinstance(exc, SandboxError):
            return exc
        errors = _exception_module()
        subject = path or operation
        typed_fs: list[tuple[type[BaseException], int]] = [
            (errors.SandboxFilesystemNotFoundError, errno.ENOENT),
            (errors.SandboxFilesystemIsADirectoryError, errno.EISDIR),
            (errors.SandboxFilesystemNotADirectoryError, errno.ENOTDIR),
            (errors.SandboxFilesystemPermissionError, errno.EACCES),
            (errors.SandboxFilesystemPathAlreadyExistsError, errno.EEXIST),
            (errors.SandboxFilesystemDirectoryNotEmptyError, errno.ENOTEMPTY),
        ]
        for cls, num in typed_fs:
            if isinstance(exc, cls):
                return error_for_errno(num, subject, str(exc) or None)
        if isinstance(exc, errors.SandboxFilesystemFileTooLargeError):
            return _TooLargeForFilesystemApi(str(exc))
        if isinstance(exc, errors.SandboxFilesystemError):
            return await self._diagnosed(exc, operation, path)
        dead = (errors.ClientClosed, errors.SandboxTerminatedError, errors.SandboxTimeoutError)
        if isinstance(exc, dead):
            return SandboxUnavailableError(f"{self.describe()} is no longer running: {exc}")
        if isinstance(exc, errors.ConflictError):  # "Sandbox already finished", or a real conflict
            if await self._finished():
                return SandboxUnavailableError(f"{self.describe()} is no longer running: {exc}")
            return SandboxError(f"{self.describe()}: Modal refused {operation}: {exc}")
        if isinstance(exc, errors.AuthError | errors.PermissionDeniedError):
            return SandboxUnavailableError(
                f"{self.describe()}: Modal refused {operation}: {type(exc).__name__}: {exc}"
            )
        # The filesystem API reports every control-plane failure as NotFoundError("The
        # Sandbox is unavailable"), so NotFoundError alone cannot tell a dead sandbox from
        # a dropped connection: ask Modal whether it still runs.
        if isinstance(exc, errors.NotFoundError) or _is_transport_error(exc):
            if await self._finished():
                return SandboxUnavailableError(f"{self.describe()} is no longer running: {exc}")
            return SandboxTransportError(
                f"{self.describe()}: {operation} failed on the channel to Modal: "
                f"{type(exc).__name__}: {exc}"
            )
        if isinstance(exc, errors.InvalidError):
            return SandboxInvalidArgumentError(f"Modal refused {operation}: {exc}")
        return SandboxError(f"{self.describe()}: {operation} failed: {type(exc).__name__}: {exc}")

    async def _diagnosed(self, exc: Exception, operation: str, path: str | None) -> SandboxError:
        """An untyped filesystem error: find the errno with a shell probe on the path."""
        if path is None:
            return SandboxError(f"{self.describe()}: {operation} failed: {exc}")
        mode = "w" if operation in ("write_bytes", "make_directory") else "r"
        request, sink = self._internal(["sh", "-c", _DIAGNOSE_SCRIPT, "sh", path, mode])
        code = await self._exec(request, sink)
        found = bytes(sink.stdout).strip()
        num = int(found) if code == 0 and found.isdigit() else 0
        if num == 0:
            return SandboxError(f"{self.describe()}: {operation} of {path!r} failed: {exc}")
        return error_for_errno(num, path, str(exc) or None)

    async def _sdk(
        self, operation: str, path: str | None, call: Callable[[], Awaitable[Any]]
    ) -> Any:
        try:
            return await call()
        except Exception as exc:
            raise await self._translate(exc, operation, path) from exc

    async def _files(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        """One idempotent ``Sandbox.filesystem`` call, retried when the channel fails."""
        async for attempt in self._transport_retrying():
            with attempt:

                async def call() -> Any:
                    filesystem = self._live_sandbox().filesystem
                    return await _call(getattr(filesystem, method), *args, **kwargs)

                return await self._sdk(method, path, call)
        raise AssertionError("unreachable: tenacity reraises")

    # ------------------------------------------------------------------ exec

    @property
    def policy_user(self) -> str | None:
        """``policy_user`` (``vf-policy`` by default), made on first use: Modal sandboxes
        run as root, so the policy's account is always apart from the machinery's."""
        return self.config.policy_user

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        self._live_sandbox()
        return await self._channels.exec(request, sink, lambda: self._plain_exec(request, sink))

    async def _open_agent(self, interpreter: str | None = None) -> ChannelTransport:
        """Start the channel agent: one exec with stdin, for the sandbox's lifetime;
        ``interpreter``: the absolute path pinned at the first start (no shell, no PATH)."""
        sandbox = self._live_sandbox()
        argv = agent_command(interpreter)
        process = await self._sdk(
            "exec", "the channel agent", lambda: _call(sandbox.exec, *argv, text=False)
        )
        return _AgentProcess(process)

    async def _verify_agent_files(self, digests: Mapping[str, bytes]) -> str | None:
        """Before the channel agent restarts: the files the first agent ran from, read
        again through the filesystem API (no command runs in the sandbox) and hashed."""

        async def read(path: str) -> bytes | None:
            try:
                info = await self._files("stat", path, path)
            except (SandboxFileNotFoundError, SandboxNotADirectoryError):
                return None
            kind = getattr(info.type, "value", info.type)
            if kind != "file":
                raise SandboxError(f"{path!r} is a {kind}, not the file it was")
            data: bytes = await self._files("read_bytes", path, path)
            return data

        return await verify_by_reading(read, digests)

    async def _kill_group_plainly(self, pgid: int) -> None:
        """The channel's fallback kill, when its agent died holding a process group."""
        # The shell's kill: procps' kill(1) refuses "-- -PGID".
        request, sink = self._internal(["sh", "-c", 'kill -s KILL -- "-$1"', "sh", str(pgid)])
        await self._plain_exec(request, sink)

    async def _plain_exec(self, request: ExecRequest, sink: OutputSink) -> int:
        sandbox = self._live_sandbox()
        nonce = _secrets.token_hex(8)
        argv, spooled = await self._command_line(request, nonce)
        process = await self._sdk(
            "exec", request.argv[0], lambda: self._start_process(sandbox, argv, request)
        )
        code = await self._run(sandbox, nonce, process, request, sink)
        if code == -1:  # the SDK's own exec timeout fired: streams ended, wait() said -1
            with anyio.CancelScope(shield=True):
                await self._kill_tree(sandbox, nonce)
            raise ExecTimeoutError(
                list(request.argv), request.timeout, bytes(sink.stdout), bytes(sink.stderr)
            )
        if code == _PRELUDE_FAILED:
            failure = self._prelude_failure(nonce, request, sink)
            if failure is not None:
                raise failure
        if spooled and code in (2, 126, 127) and b"Argument list too long" in sink.stderr:
            size = _argv_size(list(request.argv))
            raise SandboxInvalidArgumentError(
                f"argument list too long for the sandbox's kernel ({size} bytes); "
                "pass large data through stdin or a file"
            )
        return code

    async def _command_line(self, request: ExecRequest, nonce: str) -> tuple[list[str], bool]:
        """The wrapped argv, spooling the caller's argv to a file when it is too large."""
        head = ["sh", "-c", _PRELUDE, "sh", nonce, request.cwd, request.user or ""]
        inline = [*head, "", *request.argv]
        if _argv_size(inline) <= ARGV_INLINE_LIMIT:
            return inline, False
        spool = f"{CONTROL_DIR}/{nonce}.argv"
        await self._files("write_bytes", spool, _quote_argv(request.argv), spool)
        return [*head, spool], True

    async def _start_process(self, sandbox: Any, argv: list[str], request: ExecRequest) -> Any:
        timeout = None if request.timeout is None else max(1, math.ceil(request.timeout))
        return await _call(
            sandbox.exec, *argv, timeout=timeout, env=dict(request.env) or None, text=False
        )

    async def _run(
        self, sandbox: Any, nonce: str, process: Any, request: ExecRequest, sink: OutputSink
    ) -> int:
        """Feed stdin, drain both streams and wait for the exit code.

        When cancelled (timeout, output cap, caller) or when a step fails, the process tree
        is killed first; the output streams are never cancelled mid-read (the SDK's stream
        wrapper cannot close a generator that is still reading) but drained to their EOF,
        which the kill brings, within :data:`DRAIN_AFTER_KILL` seconds.
        """
        failures: list[Exception] = []
        code = -1
        drain_scope = anyio.CancelScope(shield=True)

        async with anyio.create_task_group() as work:

            async def record(step: Callable[[], Awaitable[None]]) -> None:
                try:
                    await step()
                except Exception as exc:  # noqa: BLE001 - re-raised typed after the group
                    failures.append(exc)
                    work.cancel_scope.cancel()

            async def drain() -> None:
                with drain_scope:
                    async with anyio.create_task_group() as pumps:
                        pumps.start_soon(record, lambda: _pump(process.stdout, sink, "stdout"))
                        pumps.start_soon(record, lambda: _pump(process.stderr, sink, "stderr"))

            async def wait() -> None:
                nonlocal code
                try:
                    code = await _call(process.wait)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await self._kill_tree(sandbox, nonce)
                        drain_scope.deadline = anyio.current_time() + DRAIN_AFTER_KILL
                    raise

            work.start_soon(drain)
            work.start_soon(record, lambda: self._feed_stdin(process, request.stdin))
            work.start_soon(record, wait)
        if failures:
            raise await self._translate(failures[0], "exec", request.argv[0])
        return code

    async def _feed_stdin(self, process: Any, data: bytes | None) -> None:
        """Send stdin in drained chunks, then EOF. A process that exits first is fine."""
        try:
            view = memoryview(data or b"")
            for offset in range(0, len(view), STDIN_CHUNK):
                process.stdin.write(bytes(view[offset : offset + STDIN_CHUNK]))
                await _call(process.stdin.drain)
            process.stdin.write_eof()
            await _call(process.stdin.drain)
        except Exception as exc:
            # Modal rejects stdin for a process that already exited (the worker reports a
            # dropped write); unread stdin is not an error, anything else is.
            if await self._exited(process):
                log.debug("modal: stdin not fully delivered, the process exited: %r", exc)
                return
            raise

    async def _exited(self, process: Any) -> bool:
        try:
            return await _call(process.poll) is not None
        except Exception as exc:  # noqa: BLE001 - a probe: the caller re-raises the original
            log.debug("modal: poll of a process failed: %r", exc)
            return False

    async def _kill_tree(self, sandbox: Any, nonce: str) -> None:
        """Kill the command's process group inside the sandbox (best effort, bounded)."""
        try:
            with anyio.fail_after(KILL_TIMEOUT):
                process = await _call(
                    sandbox.exec, "sh", "-c", _KILL_SCRIPT, "sh", nonce, text=False
                )
                await _call(process.wait)
        except Exception as exc:  # noqa: BLE001 - nothing to kill in a dead sandbox; else logged
            if await self._finished():
                log.debug("modal: sandbox %s is gone, nothing to kill", self._sandbox_id)
            else:
                log.warning(
                    "modal: could not kill process group %s in %s: %r",
                    nonce,
                    self._sandbox_id,
                    exc,
                )

    def _prelude_failure(
        self, nonce: str, request: ExecRequest, sink: OutputSink
    ) -> SandboxError | None:
        marker = f"vf-sandbox-{nonce}:".encode()
        lines = bytes(sink.stderr).splitlines()
        if not lines or not lines[-1].startswith(marker):
            return None
        parts = lines[-1][len(marker) :].decode("utf-8", "replace").split(":")
        if len(parts) != 2 or not parts[0].isdigit() or parts[1] not in _MARKER_WHAT:
            return None
        num, what = int(parts[0]), parts[1]
        if what == "cwd":
            return error_for_errno(num, request.cwd, "working directory")
        if what == "prog":
            return error_for_errno(num, request.argv[0], "cannot execute")
        if what == "argv":
            return SandboxError(f"{self.describe()}: the spooled argv could not be read")
        if num == errno.EINVAL:
            return SandboxInvalidArgumentError(f"no such user in the sandbox: {request.user!r}")
        if num == errno.EACCES:
            return SandboxPermissionError(
                request.argv[0],
                f"cannot run as user {request.user!r}: the sandbox user is not root",
            )
        return SandboxPermissionError(
            request.argv[0], f"cannot run as user {request.user!r}: no setpriv or runuser"
        )

    # ------------------------------------------------------------------ files

    async def _read(self, path: str, limit: int) -> bytes:
        return await self._channels.read(path, limit, lambda: self._plain_read(path, limit))

    async def _plain_read(self, path: str, limit: int) -> bytes:
        info = await self._files("stat", path, path)
        kind = getattr(info.type, "value", info.type)
        if kind == "directory":
            raise SandboxIsADirectoryError(path)
        if kind == "symlink":
            return await self._read_streamed(path, limit)
        if info.size > limit:
            raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
        try:
            data: bytes = await self._files("read_bytes", path, path)
        except _TooLargeForFilesystemApi:
            return await self._read_streamed(path, limit)
        return data

    async def _read_streamed(self, path: str, limit: int) -> bytes:
        """Read through ``cat`` with a capped sink: follows symlinks, bounded memory."""
        request, sink = self._internal(["cat", "--", path], limit=limit)
        with anyio.CancelScope() as scope:
            sink.on_overflow = scope.cancel
            code = await self._exec(request, sink)
        if sink.overflowed:
            raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
        if code != 0:
            raise await self._diagnosed(
                SandboxError(bytes(sink.stderr).decode("utf-8", "replace").strip()), "read", path
            )
        return bytes(sink.stdout)

    async def _write(self, path: str, data: bytes) -> None:
        await self._channels.write(path, data, lambda: self._files("write_bytes", path, data, path))

    async def _exists(self, path: str) -> bool:
        return await self._channels.exists(path, lambda: self._plain_exists(path))

    async def _plain_exists(self, path: str) -> bool:
        try:
            await self._files("stat", path, path)
        except (SandboxFileNotFoundError, SandboxNotADirectoryError):
            return False
        return True

    async def _remove(self, path: str) -> None:
        await self._channels.remove(path, lambda: self._plain_remove(path))

    async def _plain_remove(self, path: str) -> None:
        try:
            try:
                await self._files("remove", path, path, recursive=False)
            except SandboxFileExistsError:  # a non-empty directory: now, and only now, recurse
                await self._files("remove", path, path, recursive=True)
        except SandboxFileNotFoundError:
            return  # removed meanwhile (or by an attempt whose answer was lost)

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Running Modal sandboxes of the config's app that carry vf-sandbox tags.

        Without Modal credentials (no ``MODAL_TOKEN_ID`` and no ``~/.modal.toml`` token)
        nothing is listed and Modal is not contacted.

        Raises:
            SandboxTransportError: Modal could not be reached.
            SandboxError: Modal refused the listing.
        """
        cfg = config if isinstance(config, ModalConfig) else ModalConfig()
        modal = _modal()
        if not modal.config.config.get("token_id"):
            log.debug("modal: no credentials configured, nothing to list")
            return []
        errors = modal.exception
        try:
            app = await _call(
                modal.App.lookup,
                cfg.app_name,
                create_if_missing=False,
                environment_name=cfg.environment,
            )
            found = await _collect(
                modal.Sandbox.list, app_id=app.app_id, tags={ownership.BACKEND: cls.name}
            )
            infos = []
            for sandbox in found:
                labels = await _call(sandbox.get_tags)
                infos.append(
                    SandboxInfo(
                        backend=cls.name,
                        id=str(sandbox.object_id),
                        labels=dict(labels),
                        state="running" if sandbox.returncode is None else "finished",
                        created=labels.get(ownership.CREATED),
                    )
                )
        except errors.NotFoundError:
            return []  # no such app: nothing was ever created under it
        except Exception as exc:
            raise _sweep_error(exc, f"list sandboxes of app {cfg.app_name!r}") from exc
        return infos

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Terminate one sandbox found by :meth:`list_sandboxes` (gone already is fine).

        Raises:
            SandboxTransportError: Modal could not be reached.
            SandboxError: Modal refused to terminate it.
        """
        modal = _modal()
        errors = modal.exception
        try:
            sandbox = await _call(modal.Sandbox.from_id, info.id)
            await _call(sandbox.terminate)
            await _call(sandbox.detach)
        except errors.NotFoundError:
            return
        except Exception as exc:
            raise _sweep_error(exc, f"terminate sandbox {info.id}") from exc


def _sweep_error(exc: Exception, what: str) -> SandboxError:
    if _is_transport_error(exc):
        return SandboxTransportError(f"modal: cannot {what}: {type(exc).__name__}: {exc}")
    return SandboxError(f"modal: cannot {what}: {type(exc).__name__}: {exc}")
