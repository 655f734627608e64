"""The ``modal`` backend itself: :class:`ModalBackend`, a Modal Sandbox created on start and
terminated on close (its exec and file halves are in ``process.py`` and ``files.py``), and
:class:`ModalRuntime`, the runtime composed around it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from .. import limits, ownership
from ..backend import (
    CreateRequest,
)
from ..capabilities import (
    BlockingTeardown,
    FileFastPath,
    RemoveFastPath,
    SandboxLister,
    ShellOpener,
    Snapshotter,
    StreamSpawner,
    TrustedReader,
)
from ..composed import BackendRuntime
from ..config import RuntimeConfig
from ..errors import (
    ProvisioningError,
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
)
from ..models import SandboxInfo
from ..scripts import load
from ..snapshot import SandboxSnapshot, snapshot_from_labels
from ..wrapper import CONTROL_DIR
from . import client
from .client import (
    KILL_TIMEOUT,
    is_transport_error,
    run_bounded_at_exit,
    sdk_call,
    sdk_collect,
    stopped_errors,
    sweep_calls,
)
from .config import ModalConfig, is_dockerfile
from .files import ModalFiles
from .process import ModalExec
from .snapshots import (
    delete_recorded,
    delete_recorded_blocking,
    experimental,
    fork_image,
    list_recorded,
    record_snapshot,
)

log = logging.getLogger("runtimes.modal")

_RESET_CONTROL_DIR = load("reset_control_dir", "runtimes.modal.scripts")

CREATE_BACKOFF = (1.0, 30.0)
"""First and longest wait (seconds) between creations Modal refused as resource-exhausted."""


class ModalBackend(
    ModalExec,
    ModalFiles,
    StreamSpawner,
    TrustedReader,
    FileFastPath,
    RemoveFastPath,
    SandboxLister,
    Snapshotter,
    ShellOpener,
    BlockingTeardown,
):
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
    keep_supported = True
    destroy_ends_processes = True  # terminate ends the sandbox and everything in it
    pid_namespace = True  # the sandbox's own: every process newer than it is a command's
    snapshot_holds = "filesystem"

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self.config: ModalConfig
        self._sandbox: Any = None
        self._sandbox_id: str | None = None
        self._workdir: str | None = None

    @property
    def sandbox_id(self) -> str | None:
        return self._sandbox_id

    # ------------------------------------------------------------------ lifecycle

    def route_hint(self) -> str:
        return (
            "A Modal sandbox reaches the host only through the channel (python3 in the image, "
            "channel=True); otherwise expose the service yourself (a tunnel) and pass its URL"
        )

    def live_cap(self) -> int | None:
        return self.config.max_live

    async def prepare(self, request: CreateRequest) -> None:
        """Create the Modal Sandbox (``start()`` then waits until it is ready).

        Waiting for the creation rate and between retries is cancellable; each creation
        call is shielded until its handle is captured (and bounded by ``create_timeout``),
        and a sandbox created for a cancelled caller, or for a runtime closed meanwhile, is
        terminated before the cancellation (or the refusal) propagates.

        Raises:
            ProvisioningError: Modal refused the sandbox (quota or capacity after
                ``create_attempts`` tries, image build, missing secret, authentication,
                invalid options), or it did not come up within ``create_timeout``.
        """
        try:
            await self._create_sandbox(request)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._discard()
            raise

    async def _discard(self) -> None:
        """Terminate a sandbox created by a start that did not finish."""
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await self._terminate(sandbox)
            await self._detach(sandbox)

    async def _create_sandbox(self, request: CreateRequest) -> None:
        modal = client.modal_sdk()
        errors = modal.exception
        kwargs = await self._create_arguments(modal, request)
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
                    sandbox = await sdk_call(modal.Sandbox.create, **kwargs)
            except TimeoutError as exc:
                raise ProvisioningError(
                    f"the Modal sandbox did not come up within {self.config.create_timeout:g}s"
                ) from exc
            self._sandbox = sandbox
            self._sandbox_id = str(sandbox.object_id)

    async def _create_arguments(self, modal: Any, request: CreateRequest) -> dict[str, Any]:
        cfg = self.config
        try:
            app = await sdk_call(
                modal.App.lookup,
                cfg.app_name,
                create_if_missing=True,
                environment_name=cfg.environment,
            )
        except modal.exception.Error as exc:
            raise ProvisioningError(
                f"cannot look up the Modal app {cfg.app_name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        snap = request.snapshot
        kwargs: dict[str, Any] = {
            "app": app,
            "image": self._image(modal) if snap is None else await fork_image(cfg, snap),
            "tags": self._tags(request.labels),
            "timeout": cfg.timeout,
            "idle_timeout": cfg.idle_timeout,
            "block_network": cfg.network == "none",
        }
        if cfg.cidr_allowlist is not None:
            kwargs["outbound_cidr_allowlist"] = list(cfg.cidr_allowlist)
        if cfg.secrets:
            kwargs["secrets"] = [modal.Secret.from_name(name) for name in cfg.secrets]
        optional = {
            # Modal's cpu and memory alone are requests a sandbox may burst over: (request,
            # limit) makes them the hard limits they are on every other backend.
            "cpu": None if cfg.cpus is None else (cfg.cpus, cfg.cpus),
            "memory": None if cfg.memory is None else (cfg.memory, cfg.memory),
            "gpu": cfg.gpu,
            "region": cfg.region,
        }
        kwargs.update({key: value for key, value in optional.items() if value is not None})
        return kwargs

    def _image(self, modal: Any) -> Any:
        image = self.config.image
        if is_dockerfile(image):
            path = Path(image)
            if not path.is_file():
                raise ProvisioningError(f"Dockerfile not found: {image}")
            return modal.Image.from_dockerfile(str(path), context_dir=str(path.parent))
        return modal.Image.from_registry(image)

    def _tags(self, labels: dict[str, str]) -> dict[str, str]:
        """The sandbox's labels and the config's ``tags`` (its ``labels`` are in the first
        already), as Modal tags (no empty values)."""
        tags = {**labels, **self.config.tags}
        return {key: value for key, value in tags.items() if value}

    async def create(self, request: CreateRequest) -> str:
        """The sandbox :meth:`prepare` created: its workdir made (and, in a fork, the exec
        wrapper's control directory made anew).

        Raises:
            ProvisioningError: the workdir or the control directory could not be made.
        """
        workdir = self.config.workdir or "/work"
        try:
            await self._files("make_directory", workdir, workdir, create_parents=True)
        except SandboxError as exc:
            raise ProvisioningError(
                f"{self.describe()}: cannot create the workdir {workdir!r}: {exc}"
            ) from exc
        self._workdir = workdir
        if request.snapshot is not None:
            await self._reset_control_dir()
        return workdir

    async def _reset_control_dir(self) -> None:
        """A fork's filesystem holds the exec wrapper's control directory as the source left
        it (its commands may have planted files, or a link): made anew, as root, before any
        command of the fork runs.

        Raises:
            ProvisioningError: it could not be made.
        """
        request, sink = self._internal(["sh", "-c", _RESET_CONTROL_DIR, "sh", CONTROL_DIR])
        code = await self.spawn(request, sink)
        if code != 0:
            detail = bytes(sink.stderr).decode("utf-8", "replace").strip()
            raise ProvisioningError(f"{self.describe()}: cannot reset {CONTROL_DIR}: {detail}")

    async def destroy(self, *, keep: bool) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            if not keep:  # kept: it runs on until its own ``timeout``
                await self._terminate(sandbox)
            await self._detach(sandbox)

    async def _terminate(self, sandbox: Any) -> None:
        """Terminate; a failure is logged, not raised (see the module docs)."""
        gone = stopped_errors()
        try:
            with anyio.fail_after(KILL_TIMEOUT):
                async for attempt in self._transport_retrying():
                    with attempt:
                        try:
                            await sdk_call(sandbox.terminate)
                        except gone:
                            pass
                        except Exception as exc:
                            if is_transport_error(exc):
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

    async def _detach(self, sandbox: Any) -> None:
        """Release the client-side resources of ``sandbox`` (a failure is only logged)."""
        try:
            await sdk_call(sandbox.detach)
        except Exception as exc:  # noqa: BLE001 - only releases client-side resources
            log.debug("modal: detach of %s failed: %r", self._sandbox_id, exc)

    def destroy_now(self, *, keep: bool) -> None:
        """The exit backstop: terminate through the SDK's blocking interface (bounded)."""
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None and not keep:
            self._terminate_blocking(sandbox)

    def _terminate_blocking(self, sandbox: Any) -> None:
        """Terminate through the SDK's blocking interface, in a thread, bounded.

        Raises:
            SandboxError: the termination failed or did not answer in time.
        """
        run_bounded_at_exit(
            sandbox.terminate, f"{self.describe()}: terminate at exit", "vf-modal-atexit"
        )

    # ------------------------------------------------------------------ snapshots

    async def snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        """``Sandbox.snapshot_filesystem`` (kept ``snapshot_ttl`` seconds at most), recorded
        with its labels in the app's snapshot Dict (see :mod:`.snapshots`).

        Raises:
            SandboxUnavailableError: the sandbox is no longer running.
            SandboxTransportError: Modal could not be reached.
            SandboxError: Modal refused the snapshot or its record (the image is deleted).
        """
        sandbox, cfg = self._live_sandbox(), self.config
        async with self._modal_calls("snapshot_filesystem", None):
            image = await sdk_call(
                sandbox.snapshot_filesystem, cfg.snapshot_timeout, ttl=cfg.snapshot_ttl
            )
        snapshot = snapshot_from_labels(self.name, str(image.object_id), labels, "filesystem")
        try:
            await record_snapshot(cfg, snapshot.id, labels)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._delete_unrecorded(snapshot)
            raise
        return snapshot

    async def _delete_unrecorded(self, snapshot: SandboxSnapshot) -> None:
        """Delete the image of a snapshot whose record failed (it expires at its ttl anyway)."""
        modal = client.modal_sdk()
        try:
            await sdk_call(experimental(modal).image_delete, snapshot.id)
        except Exception as exc:  # noqa: BLE001 - the record's error propagates; this one is logged
            log.warning(
                "modal: could not delete the unrecorded image %s (it expires after "
                "snapshot_ttl=%ss): %r",
                snapshot.id,
                self.config.snapshot_ttl,
                exc,
            )

    @classmethod
    async def list_snapshots(cls, config: RuntimeConfig | None = None) -> list[SandboxSnapshot]:
        """The snapshots recorded for the config's app (none without Modal credentials).

        Raises:
            SandboxTransportError: Modal could not be reached.
            SandboxError: Modal refused the listing.
        """
        return await list_recorded(config if isinstance(config, ModalConfig) else ModalConfig())

    @classmethod
    async def destroy_snapshot(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        """Delete a recorded snapshot's image and record (gone already is fine).

        Raises:
            SandboxTransportError: Modal could not be reached.
            SandboxError: Modal refused.
        """
        cfg = config if isinstance(config, ModalConfig) else ModalConfig()
        await delete_recorded(cfg, snapshot)

    @classmethod
    def destroy_snapshot_now(cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None) -> None:
        """Through the SDK's blocking interface, in a thread, bounded."""
        cfg = config if isinstance(config, ModalConfig) else ModalConfig()
        delete_recorded_blocking(cfg, snapshot)

    async def alive(self) -> bool:
        sandbox = self._sandbox
        if sandbox is None:
            return False
        async for attempt in self._transport_retrying():
            with attempt:
                try:
                    code = await sdk_call(sandbox.poll)
                except stopped_errors():
                    return False
                except Exception as exc:
                    if is_transport_error(exc):
                        raise SandboxTransportError(
                            f"{self.describe()}: liveness check failed: {exc}"
                        ) from exc
                    raise
                return code is None
        raise AssertionError("unreachable: tenacity reraises")

    @property
    def policy_user(self) -> str | None:
        """``policy_user`` (``vf-policy`` by default), made on first use: Modal sandboxes
        run as root, so the policy's account is always apart from the machinery's."""
        return self.config.policy_user

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
        modal = client.modal_sdk()
        if not modal.config.config.get("token_id"):
            log.debug("modal: no credentials configured, nothing to list")
            return []
        infos = []
        with sweep_calls(f"list sandboxes of app {cfg.app_name!r}"):
            try:
                app = await sdk_call(
                    modal.App.lookup,
                    cfg.app_name,
                    create_if_missing=False,
                    environment_name=cfg.environment,
                )
                found = await sdk_collect(
                    modal.Sandbox.list, app_id=app.app_id, tags={ownership.BACKEND: cls.name}
                )
                for sandbox in found:
                    labels = await sdk_call(sandbox.get_tags)
                    infos.append(
                        SandboxInfo(
                            backend=cls.name,
                            id=str(sandbox.object_id),
                            labels=dict(labels),
                            state="running" if sandbox.returncode is None else "finished",
                            created=labels.get(ownership.CREATED),
                        )
                    )
            except modal.exception.NotFoundError:
                return []  # no such app: nothing was ever created under it
        return infos

    @classmethod
    def shell_hint(cls, sandbox_id: str, config: RuntimeConfig) -> str | None:
        """Modal's own command (see :meth:`shell_argv`)."""
        return f"modal shell {sandbox_id}"

    @classmethod
    async def shell_argv(
        cls, info: SandboxInfo, config: RuntimeConfig | None = None, *, tty: bool
    ) -> list[str]:
        """Not from here: Modal's own CLI opens shells in its sandboxes.

        Raises:
            SandboxInvalidArgumentError: always; the message gives Modal's command.
        """
        raise SandboxInvalidArgumentError(
            f"vf-sandbox cannot open a shell in a Modal sandbox; Modal's CLI can: "
            f"modal shell {info.id} (then cd to its workdir, /work by default)"
        )

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Terminate one sandbox found by :meth:`list_sandboxes` (gone already is fine).

        Raises:
            SandboxTransportError: Modal could not be reached.
            SandboxError: Modal refused to terminate it.
        """
        modal = client.modal_sdk()
        with sweep_calls(f"terminate sandbox {info.id}"):
            try:
                sandbox = await sdk_call(modal.Sandbox.from_id, info.id)
                await sdk_call(sandbox.terminate)
                await sdk_call(sandbox.detach)
            except modal.exception.NotFoundError:
                return


class ModalRuntime(BackendRuntime):
    """The runtime over :class:`ModalBackend` (``open_runtime({"type": "modal", ...})``)."""

    backend_class = ModalBackend
    backend: ModalBackend
