"""A fake ``modal`` SDK: Modal's own client code, with the local Docker engine as the service.

Modal cannot be reached from the test machines, so ``runtimes.modal`` is tested against this
module, injected by replacing ``runtimes.modal.client.modal_sdk``. The runtime's code path is the
production one: it calls the same names with the same arguments, through the same
synchronicity interface (``.aio`` under asyncio, blocking calls in threads under trio).

Where the fake stops and the real SDK starts:

* **Real SDK code** (imported from the installed ``modal`` package): the exception classes;
  the synchronicity wrapping (``synchronize_api`` with Modal's own synchronizer, so ``.aio``,
  blocking calls, async iteration behave exactly as in ``modal.Sandbox``); ``Sandbox.create``'s
  client-side validation (``SandboxCreateCommon``: network options, timeout, workdir...);
  ``exec`` itself (``exec_via_tcr``: the 65,536-character argv cap, request building,
  ``int(timeout)`` deadlines); the returned process (``ContainerProcess``, ``StreamReader``,
  ``StreamWriter``: ``wait()`` returning ``-1`` at the exec deadline, the 16 MiB stdin buffer
  cap, streams ending at the deadline, signal exits as ``128 + N``); and the whole
  ``Sandbox.filesystem`` API (``_SandboxFilesystem``: exec of the fs-tools binary, error payload
  parsing, mapping to ``SandboxFilesystem*Error``, ``NotFoundError("The Sandbox is
  unavailable")`` for a dead sandbox).
* **Fake** (this module): the control plane (``Sandbox.create`` after validation, ``list``,
  ``from_id``, ``terminate``, ``poll``, ``wait``, tags, ``App.lookup``, ``Image``, ``Secret``,
  ``Dict``, ``experimental.image_delete``) and the worker's task command router (exec start,
  stdio, stdin, wait/poll, filesystem snapshot), executing each exec as a ``docker exec`` in
  one container per sandbox; and the fs-tools binary, played by ``fake_fs_tools.py``.
  ``Sandbox.snapshot_filesystem`` is the SDK's own request path (``snapshot_filesystem_via_tcr``:
  ttl validation, the returned hydrated ``modal.Image``); the router commits the sandbox's
  container to a Docker image registered under an ``im-`` id, which ``Sandbox.create(image=)``
  accepts (as the returned ``Image``, or ``Image.from_id``). Server-side state lives in a
  directory (``state_dir``) so several processes can share one fake service, as they share
  Modal.

``FakeModalService`` also lets tests inject failures (``create_failures``, ``exec_failures``)
and records every ``create`` call (``created``). Every container carries the label
``vf-sandbox-test.fake-modal``; ``close()`` removes the service's containers.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import json
import os
import signal
import struct
import tarfile
import threading
import time
import types
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import docker
import docker.errors
import modal
import modal.exception as modal_exc
from grpclib import GRPCError, Status
from modal._grpc_client import grpc_error_converter
from modal._utils.async_utils import synchronize_api, synchronizer
from modal.sandbox._common import (
    SandboxCreateArgs,
    SandboxCreateCommon,
    _result_returncode,
    exec_via_tcr,
    snapshot_filesystem_via_tcr,
)
from modal.sandbox._filesystem import _SANDBOX_FS_TOOLS_PATH, _SandboxFilesystem
from modal.sandbox._sandbox import _Sandbox
from modal.stream_type import StreamType
from modal_proto import api_pb2
from modal_proto import task_command_router_pb2 as sr_pb2

FAKE_LABEL = "vf-sandbox-test.fake-modal"
IMAGE_REPOSITORY = "fake-modal-snapshot"
STAND_IN_IMAGE = "vf-sandbox/base:bookworm"
STDIO_MESSAGE_BYTES = 256 * 1024
PIPE_BUFFER_BYTES = 8 * 1024 * 1024
"""Output the fake worker buffers per stream before it stops reading the process (backpressure)."""

_CREATE_SIGNATURE = inspect.signature(_Sandbox.create)
_FS_TOOLS_SOURCE = Path(__file__).with_name("fake_fs_tools.py")
_T = TypeVar("_T")


def grpc_error(status: Status, message: str) -> Exception:
    """The Modal exception the real client raises for a gRPC status (its own converter)."""
    try:
        with grpc_error_converter():
            raise GRPCError(status, message)
    except Exception as exc:  # noqa: BLE001 - captured to be raised by the caller
        return exc
    raise AssertionError("grpc_error_converter did not convert")


# ---------------------------------------------------------------------- records


@dataclass
class CreateCall:
    """One ``Sandbox.create`` as the fake service received it."""

    kwargs: dict[str, Any]
    network: str  # "BLOCKED", "OPEN" or "ALLOWLIST"
    allowed_cidrs: list[str]
    image: str
    sandbox_id: str | None = None


@dataclass
class _Record:
    id: str
    container: str
    app_id: str
    tags: dict[str, str]
    created: float
    timeout: int
    status: str | None = None  # None while running, "terminated", "timeout", "exited"
    exit_code: int | None = None

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


@dataclass
class _Pipe:
    """One output stream of an exec, as the worker buffers it (offsets from the start)."""

    data: bytearray = field(default_factory=bytearray)
    base: int = 0
    eof: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def append(self, chunk: bytes, exited: asyncio.Event) -> None:
        """Buffer output; while the process runs, a full buffer stops reading it (a pipe)."""
        while len(self.data) > PIPE_BUFFER_BYTES and not exited.is_set():
            changed = asyncio.ensure_future(self.changed.wait())
            ended = asyncio.ensure_future(exited.wait())
            try:
                await asyncio.wait({changed, ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                ended.cancel()
        self.data += chunk
        self._notify()

    def close(self) -> None:
        self.eof = True
        self._notify()

    def read_from(self, offset: int) -> bytes:
        if offset > self.base:
            del self.data[: offset - self.base]
            self.base = offset
            self._notify()
        start = offset - self.base
        return bytes(self.data[start : start + STDIO_MESSAGE_BYTES])


class _ExecSession:
    """One ``docker exec``, playing a Modal exec on the worker."""

    def __init__(self, service: FakeModalService, sandbox_id: str, docker_exec_id: str):
        self.service = service
        self.sandbox_id = sandbox_id
        self.docker_exec_id = docker_exec_id
        self.pipes = {
            api_pb2.FILE_DESCRIPTOR_STDOUT: _Pipe(),
            api_pb2.FILE_DESCRIPTOR_STDERR: _Pipe(),
        }
        self.exited = asyncio.Event()
        self.exit_code: int | None = None
        self.lost = False  # the sandbox went away under the exec
        self.stdin_offset = 0
        self.stdin_closed = False
        self._eof_seen = asyncio.Event()
        self.stdout_cut: int | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, socket: Any, timeout_secs: int | None) -> None:
        raw = socket._sock
        raw.setblocking(False)
        reader, self._writer = await asyncio.open_connection(sock=raw)
        self._tasks.append(asyncio.create_task(self._demux(reader)))
        self._tasks.append(asyncio.create_task(self._watch()))
        if timeout_secs:
            self._tasks.append(asyncio.create_task(self._server_timeout(timeout_secs)))

    async def _demux(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header = await reader.readexactly(8)
                size = struct.unpack(">I", header[4:])[0]
                chunk = await reader.readexactly(size)
                pipe = self.pipes.get(header[0])
                if header[0] == api_pb2.FILE_DESCRIPTOR_STDOUT and self.stdout_cut is not None:
                    chunk, self.stdout_cut = chunk[: self.stdout_cut], 0
                if pipe is not None and chunk:
                    await pipe.append(chunk, self.exited)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            for pipe in self.pipes.values():
                pipe.close()
            self._eof_seen.set()

    async def _watch(self) -> None:
        """Exit detection: docker's exec inspect, polled with backoff, woken by EOF."""
        delay = 0.02
        while True:
            try:
                info = await self.service.in_thread(
                    self.service.api.exec_inspect, self.docker_exec_id
                )
            except docker.errors.NotFound:
                self.lost = True
                break
            if not info["Running"] and info.get("ExitCode") is not None:
                self.exit_code = int(info["ExitCode"])  # docker may report no code for a moment
                break
            if self._eof_seen.is_set():
                await asyncio.sleep(delay)
            else:
                try:
                    await asyncio.wait_for(self._eof_seen.wait(), delay)
                    delay = 0.005  # output closed: the exit is due any moment
                except TimeoutError:
                    pass
            delay = min(delay * 2, 0.5)
        self.exited.set()

    async def _server_timeout(self, timeout_secs: int) -> None:
        """Modal's ``exec(timeout=...)`` on the worker: the started process is killed."""
        await asyncio.sleep(timeout_secs)
        if self.exited.is_set():
            return
        info = await self.service.in_thread(self.service.api.exec_inspect, self.docker_exec_id)
        if info.get("Running") and info.get("Pid"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(info["Pid"]), signal.SIGKILL)

    async def write_stdin(self, offset: int, data: bytes, eof: bool) -> None:
        if offset > self.stdin_offset:
            raise grpc_error(Status.INVALID_ARGUMENT, "stdin offset beyond the data written")
        data = data[self.stdin_offset - offset :]
        if self.stdin_closed:
            if data:
                raise grpc_error(Status.FAILED_PRECONDITION, "stdin is closed")
            return
        writer = self._writer
        assert writer is not None
        try:
            if data:
                writer.write(data)
                await self._drain_unless_exited(writer)
                self.stdin_offset += len(data)
            if eof:
                writer.write_eof()
                self.stdin_closed = True
        except (ConnectionError, OSError) as exc:
            # What the worker answers for stdin of a process that already exited; like the
            # worker, answer once the exit is known (the SDK polls the process next).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.exited.wait(), 10)
            raise grpc_error(Status.FAILED_PRECONDITION, f"stdin write dropped: {exc}") from None

    async def _drain_unless_exited(self, writer: asyncio.StreamWriter) -> None:
        """Docker keeps a dead exec's stdin open for seconds; the worker would not."""
        drain = asyncio.ensure_future(writer.drain())
        exited = asyncio.ensure_future(self.exited.wait())
        try:
            await asyncio.wait({drain, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if drain.done():
            drain.result()
            return
        drain.cancel()
        raise BrokenPipeError("the process exited before reading its stdin")

    def mark_lost(self) -> None:
        self.lost = True
        self.exited.set()
        for pipe in self.pipes.values():
            pipe.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._writer is not None:
            self._writer.close()


# ---------------------------------------------------------------------- the service


class FakeModalService:
    """The Modal control plane and workers, played by the local Docker engine.

    ``state_dir`` holds the server-side records (apps, sandboxes, tags) so that several
    processes can share one service; exec sessions live in the process that started them.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        stand_in_image: str = STAND_IN_IMAGE,
        missing_images: Iterable[str] = (),
        secrets: dict[str, dict[str, str]] | None = None,
        max_read_bytes: int | None = None,
        container_user: str | None = None,
    ):
        self.state_dir = Path(state_dir)
        (self.state_dir / "sandboxes").mkdir(parents=True, exist_ok=True)
        self.stand_in_image = stand_in_image
        self.missing_images = set(missing_images)
        self.secrets = dict(secrets or {})
        self.max_read_bytes = max_read_bytes
        self.container_user = container_user
        self.create_delay = 0.0
        self.create_attempts = 0
        self.stdin_writes: list[int] = []  # sizes of unary exec stdin writes (drain calls)
        self.docker = docker.from_env(max_pool_size=64)
        self.api = self.docker.api
        self.created: list[CreateCall] = []
        self.create_failures: list[BaseException] = []
        self.exec_failures: list[BaseException] = []
        # (a word of the command, n): the next such exec's stdout stops after n bytes while
        # the process exits 0, as when the engine loses an attach stream under load
        self.stdout_cuts: list[tuple[str, int]] = []
        self.exec_calls: list[list[str]] = []
        self._sessions: dict[tuple[str, str], _ExecSession] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(32, thread_name_prefix="fake-modal")
        self.router = _FakeCommandRouter(self)

    # -- helpers

    async def in_thread(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
        except RuntimeError:
            # At interpreter exit executors refuse work; the real SDK (grpclib) needs no
            # threads, so atexit handlers must still reach the service: call inline.
            return fn(*args, **kwargs)

    def _record_path(self, sandbox_id: str) -> Path:
        return self.state_dir / "sandboxes" / f"{sandbox_id}.json"

    def load(self, sandbox_id: str) -> _Record:
        try:
            data = json.loads(self._record_path(sandbox_id).read_text())
        except FileNotFoundError:
            raise grpc_error(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found") from None
        return _Record(**data)

    def save(self, record: _Record) -> None:
        path = self._record_path(record.id)
        tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_text(record.to_json())
        os.replace(tmp, path)

    def records(self) -> list[_Record]:
        found = []
        for path in sorted((self.state_dir / "sandboxes").glob("sb-*.json")):
            try:
                found.append(_Record(**json.loads(path.read_text())))
            except (OSError, ValueError):
                continue
        return found

    def _json_state(self, name: str) -> Path:
        return self.state_dir / name

    def _update_json(self, name: str, change: Callable[[dict[str, Any]], _T]) -> _T:
        """Read-modify-write one JSON state file (under the lock; atomic replace)."""
        path = self._json_state(name)
        with self._lock:
            data = json.loads(path.read_text()) if path.exists() else {}
            result = change(data)
            tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
            return result

    def _read_json(self, name: str) -> dict[str, Any]:
        path = self._json_state(name)
        with self._lock:
            data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
            return data

    def app_id(self, name: str, create: bool) -> str:
        path = self.state_dir / "apps.json"
        with self._lock:
            apps = json.loads(path.read_text()) if path.exists() else {}
            if name not in apps:
                if not create:
                    raise grpc_error(Status.NOT_FOUND, f"App '{name}' not found")
                apps[name] = f"ap-{uuid.uuid4().hex[:22]}"
                path.write_text(json.dumps(apps))
            return str(apps[name])

    # -- control plane

    async def create(self, bound: dict[str, Any], common: SandboxCreateCommon) -> str:
        self.create_attempts += 1
        if self.create_failures:
            raise self.create_failures.pop(0)
        if self.create_delay:
            await asyncio.sleep(self.create_delay)  # scheduling time
        network = api_pb2.NetworkAccess.NetworkAccessType.Name(
            common.network_access.network_access_type
        )
        image = await self._image_tag(bound.get("image"))
        call = CreateCall(
            kwargs=dict(bound),
            network=network,
            allowed_cidrs=list(common.network_access.allowed_cidrs),
            image=image,
        )
        self.created.append(call)
        env: dict[str, str] = {}
        for secret in bound.get("secrets") or []:
            if secret.name not in self.secrets:
                raise grpc_error(Status.NOT_FOUND, f"Secret '{secret.name}' not found")
            env.update(self.secrets[secret.name])
        env.update({k: v for k, v in (bound.get("env") or {}).items() if v is not None})
        app = bound["app"]
        sandbox_id = f"sb-{uuid.uuid4().hex[:22]}"
        timeout = int(common.timeout or 300)
        command = list(bound.get("args") or ()) or ["sleep", str(timeout)]
        container = await self.in_thread(
            self.docker.containers.run,
            image,
            command,
            detach=True,
            init=True,
            environment=env,
            working_dir=bound.get("workdir"),
            network_mode="none" if network == "BLOCKED" else None,
            user=self.container_user,
            labels={FAKE_LABEL: str(self.state_dir), "fake-modal.sandbox-id": sandbox_id},
        )
        await self.in_thread(container.put_archive, "/", self._fs_tools_archive())
        self.save(
            _Record(
                id=sandbox_id,
                container=container.id,
                app_id=app.app_id,
                tags=dict(bound.get("tags") or {}),
                created=time.time(),
                timeout=timeout,
            )
        )
        call.sandbox_id = sandbox_id
        return sandbox_id

    def _fs_tools_archive(self) -> bytes:
        source = _FS_TOOLS_SOURCE.read_text()
        if self.max_read_bytes is not None:
            source = source.replace(
                "MAX_READ_BYTES = 5 * 1024**3", f"MAX_READ_BYTES = {self.max_read_bytes}"
            )
        script = ("#!/usr/bin/env python3\n" + source).encode()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(_SANDBOX_FS_TOOLS_PATH.lstrip("/"))
            info.size, info.mode = len(script), 0o755
            tar.addfile(info, io.BytesIO(script))
        return buf.getvalue()

    async def _image_tag(self, image: Any) -> str:
        if image is None:
            return self.stand_in_image
        image_id = _image_id(image)
        if image_id is not None:
            return self.snapshot_image(image_id)
        if image.dockerfile is not None:
            return await self._build(image.dockerfile, image.context_dir)
        if image.tag in self.missing_images:
            raise modal_exc.ImageBuildError(
                f"Image build for {image.tag} failed: pull access denied", image_id="im-fake"
            )
        try:
            await self.in_thread(self.docker.images.get, image.tag)
        except docker.errors.ImageNotFound:
            return self.stand_in_image
        return str(image.tag)

    async def _build(self, dockerfile: str, context_dir: str | None) -> str:
        path = Path(dockerfile)
        context = Path(context_dir) if context_dir else path.parent
        tag = (
            f"fake-modal-dockerfile:{uuid.uuid5(uuid.NAMESPACE_URL, str(path.resolve())).hex[:12]}"
        )
        try:
            await self.in_thread(
                self.docker.images.build,
                path=str(context),
                dockerfile=str(path.resolve()),
                tag=tag,
                rm=True,
                pull=False,
            )
        except docker.errors.BuildError as exc:
            raise modal_exc.ImageBuildError(
                f"Image build failed: {exc}", image_id="im-fake"
            ) from None
        return tag

    async def status(self, record: _Record) -> _Record:
        """Refresh a running record from Docker (the entrypoint may have ended)."""
        if record.status is not None:
            return record
        try:
            info = await self.in_thread(self.api.inspect_container, record.container)
        except docker.errors.NotFound:
            record.status, record.exit_code = "terminated", None
            self.save(record)
            return record
        state = info["State"]
        if state["Running"]:
            return record
        timed_out = time.time() - record.created >= record.timeout - 1
        record.status = "timeout" if timed_out else "exited"
        record.exit_code = int(state["ExitCode"])
        self.save(record)
        return record

    # -- filesystem snapshots (images) and dicts

    async def snapshot_filesystem(self, sandbox_id: str, ttl_seconds: int) -> str:
        """Commit the sandbox's container to an image; its ``im-`` id."""
        record = await self.status(self.load(sandbox_id))
        if record.status is not None:
            raise grpc_error(Status.NOT_FOUND, f"task for {sandbox_id} not found")
        image_id = f"im-{uuid.uuid4().hex[:22]}"
        try:
            committed = await self.in_thread(
                self.api.commit,
                record.container,
                repository=IMAGE_REPOSITORY,
                tag=image_id,
                conf={"Labels": {FAKE_LABEL: str(self.state_dir), "fake-modal.image-id": image_id}},
            )
        except docker.errors.NotFound:
            raise grpc_error(Status.NOT_FOUND, f"task for {sandbox_id} not found") from None
        entry = {"docker": str(committed["Id"]), "ttl": ttl_seconds, "created": time.time()}
        self._update_json("images.json", lambda images: images.__setitem__(image_id, entry))
        return image_id

    def snapshot_image(self, image_id: str) -> str:
        """The Docker image of a snapshot ``image_id`` (NotFoundError: none, or deleted)."""
        entry = self._read_json("images.json").get(image_id)
        if entry is None:
            raise grpc_error(Status.NOT_FOUND, f"Image {image_id} not found")
        return str(entry["docker"])

    def delete_image(self, image_id: str) -> None:
        """``ImageDelete``: the image is gone for good (NotFoundError: no such image)."""
        entry = self._update_json("images.json", lambda images: images.pop(image_id, None))
        if entry is None:
            raise grpc_error(Status.NOT_FOUND, f"Image {image_id} not found")
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            self.api.remove_image(entry["docker"], force=True)

    def dict_id(self, name: str, environment: str | None, create: bool) -> str:
        key = f"{environment or ''}/{name}"

        def find(dicts: dict[str, Any]) -> str | None:
            if key not in dicts and create:
                dicts[key] = {"id": f"di-{uuid.uuid4().hex[:22]}", "items": {}}
            return None if key not in dicts else str(dicts[key]["id"])

        found = self._update_json("dicts.json", find)
        if found is None:
            raise grpc_error(Status.NOT_FOUND, f"Dict '{name}' not found")
        return found

    def dict_items(self, dict_id: str) -> dict[str, Any]:
        for entry in self._read_json("dicts.json").values():
            if entry["id"] == dict_id:
                return dict(entry["items"])
        raise grpc_error(Status.NOT_FOUND, f"Dict {dict_id} not found")

    def dict_change(self, dict_id: str, change: Callable[[dict[str, Any]], _T]) -> _T:
        def apply(dicts: dict[str, Any]) -> _T:
            for entry in dicts.values():
                if entry["id"] == dict_id:
                    return change(entry["items"])
            raise grpc_error(Status.NOT_FOUND, f"Dict {dict_id} not found")

        return self._update_json("dicts.json", apply)

    def returncode(self, record: _Record) -> int | None:
        return _result_returncode(_generic_result(record))

    async def terminate(self, sandbox_id: str) -> None:
        record = await self.status(self.load(sandbox_id))
        if record.status is None:
            record.status = "terminated"
            self.save(record)
        for key, session in list(self._sessions.items()):
            if key[0] == sandbox_id:
                session.mark_lost()
                del self._sessions[key]
                await session.close()
        with contextlib.suppress(docker.errors.NotFound):
            await self.in_thread(self.api.remove_container, record.container, force=True)

    def expire(self, sandbox_id: str) -> None:
        """End a sandbox the way its ``timeout`` does (status TIMEOUT, return code 124)."""
        record = self.load(sandbox_id)
        with contextlib.suppress(docker.errors.NotFound):
            self.api.remove_container(record.container, force=True)
        record.status = "timeout"
        self.save(record)

    def running_containers(self) -> list[str]:
        return [
            c.id
            for c in self.docker.containers.list(
                filters={"label": f"{FAKE_LABEL}={self.state_dir}"}
            )
        ]

    # -- worker side

    def session(self, sandbox_id: str, exec_id: str) -> _ExecSession:
        session = self._sessions.get((sandbox_id, exec_id))
        if session is None:
            raise grpc_error(Status.NOT_FOUND, f"exec {exec_id} not found")
        return session

    async def start_exec(self, sandbox_id: str, request: sr_pb2.TaskExecStartRequest) -> None:
        if self.exec_failures:
            raise self.exec_failures.pop(0)
        record = await self.status(self.load(sandbox_id))
        if record.status is not None:
            raise grpc_error(Status.NOT_FOUND, f"task for {sandbox_id} not found")
        env: dict[str, str] = {}
        for source in request.secret_sources:
            if source.HasField("env"):
                env.update(source.env.contents)
        command = list(request.command_args)
        self.exec_calls.append(command)
        try:
            created = await self.in_thread(
                self.api.exec_create,
                record.container,
                command,
                stdin=True,
                stdout=True,
                stderr=True,
                environment=env or None,
                workdir=request.workdir if request.HasField("workdir") else None,
            )
            sock = await self.in_thread(self.api.exec_start, created["Id"], socket=True)
        except docker.errors.NotFound:
            raise grpc_error(Status.NOT_FOUND, f"task for {sandbox_id} not found") from None
        session = _ExecSession(self, sandbox_id, created["Id"])
        for cut in self.stdout_cuts:
            if any(cut[0] in word for word in command):
                self.stdout_cuts.remove(cut)
                session.stdout_cut = cut[1]
                break
        self._sessions[(sandbox_id, request.exec_id)] = session
        timeout = request.timeout_secs if request.HasField("timeout_secs") else None
        await session.start(sock, timeout)

    async def _close_sessions(self) -> None:
        for session in list(self._sessions.values()):
            session.mark_lost()
            await session.close()
        self._sessions.clear()

    def close(self) -> None:
        """Remove every container of this service (tests' teardown)."""
        loop = synchronizer._get_loop(start=False)
        if loop is not None and self._sessions:
            asyncio.run_coroutine_threadsafe(self._close_sessions(), loop).result(30)
        for container in self.docker.containers.list(
            all=True, filters={"label": f"{FAKE_LABEL}={self.state_dir}"}
        ):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
        for image in self.docker.images.list(filters={"label": f"{FAKE_LABEL}={self.state_dir}"}):
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                self.api.remove_image(image.id, force=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.docker.close()

    def module(self) -> types.ModuleType:
        """The fake ``modal`` module to hand to the runtime."""
        global _SERVICE
        _SERVICE = self
        fake = types.ModuleType("fake_modal_sdk")
        fake.Sandbox = Sandbox  # type: ignore[attr-defined]
        fake.App = App  # type: ignore[attr-defined]
        fake.Image = Image  # type: ignore[attr-defined]
        fake.Secret = Secret  # type: ignore[attr-defined]
        fake.Dict = Dict  # type: ignore[attr-defined]
        fake.experimental = types.SimpleNamespace(image_delete=image_delete)  # type: ignore[attr-defined]
        fake.exception = modal_exc  # type: ignore[attr-defined]
        fake.config = types.SimpleNamespace(config={"token_id": "ak-fake"})  # type: ignore[attr-defined]
        fake.__version__ = modal.__version__  # type: ignore[attr-defined]
        return fake


def _generic_result(record: _Record) -> api_pb2.GenericResult | None:
    if record.status is None:
        return None
    status = {
        "terminated": api_pb2.GenericResult.GENERIC_STATUS_TERMINATED,
        "timeout": api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT,
    }.get(record.status)
    if status is not None:
        return api_pb2.GenericResult(status=status)
    return api_pb2.GenericResult(
        status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS
        if record.exit_code == 0
        else api_pb2.GenericResult.GENERIC_STATUS_FAILURE,
        exitcode=record.exit_code or 0,
    )


_SERVICE: FakeModalService | None = None


def _service() -> FakeModalService:
    if _SERVICE is None:
        raise RuntimeError("no FakeModalService installed")
    return _SERVICE


# ---------------------------------------------------------------------- task command router


class _FakeCommandRouter:
    """The worker's task command router (``TaskCommandRouterClient``'s methods the SDK uses)."""

    def __init__(self, service: FakeModalService):
        self.service = service

    @staticmethod
    def _sandbox(task_id: str) -> str:
        return task_id.removeprefix("ta-")

    @staticmethod
    def _remaining(deadline: float | None, what: str) -> float | None:
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise modal_exc.ExecTimeoutError(f"Deadline exceeded while {what}")
        return left

    async def exec_start(
        self, request: sr_pb2.TaskExecStartRequest
    ) -> sr_pb2.TaskExecStartResponse:
        await self.service.start_exec(self._sandbox(request.task_id), request)
        return sr_pb2.TaskExecStartResponse()

    async def exec_stdio_read(
        self,
        task_id: str,
        exec_id: str,
        file_descriptor: int,
        deadline: float | None = None,
        start_offset: int = 0,
    ) -> AsyncGenerator[sr_pb2.TaskExecStdioReadResponse, None]:
        session = self.service.session(self._sandbox(task_id), exec_id)
        pipe = session.pipes[file_descriptor]
        offset = start_offset
        while True:
            chunk = pipe.read_from(offset)
            if chunk:
                offset += len(chunk)
                yield sr_pb2.TaskExecStdioReadResponse(data=chunk)
                continue
            if pipe.eof:
                if session.lost:
                    raise grpc_error(Status.NOT_FOUND, f"exec {exec_id} not found")
                return
            changed = pipe.changed
            left = self._remaining(deadline, f"streaming stdio for exec {exec_id}")
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                raise modal_exc.ExecTimeoutError(
                    f"Deadline exceeded while streaming stdio for exec {exec_id}"
                ) from None

    async def exec_stdin_write(
        self, task_id: str, exec_id: str, offset: int, data: bytes, eof: bool
    ) -> sr_pb2.TaskExecStdinWriteResponse:
        session = self.service.session(self._sandbox(task_id), exec_id)
        self.service.stdin_writes.append(len(data))
        await session.write_stdin(offset, data, eof)
        return sr_pb2.TaskExecStdinWriteResponse()

    async def exec_stdin_write_stream(
        self,
        task_id: str,
        exec_id: str,
        source: BinaryIO,
        chunk_size: int = 256 * 1024,
        max_resume_attempts: int = 9,
    ) -> int:
        session = self.service.session(self._sandbox(task_id), exec_id)
        while chunk := source.read(chunk_size):
            await session.write_stdin(session.stdin_offset, chunk, False)
        await session.write_stdin(session.stdin_offset, b"", True)
        return source.tell()

    async def _exit_status(self, session: _ExecSession, exec_id: str) -> int:
        if session.lost:
            raise grpc_error(Status.NOT_FOUND, f"exec {exec_id} not found")
        assert session.exit_code is not None
        return session.exit_code

    async def exec_poll(
        self, task_id: str, exec_id: str, deadline: float | None = None
    ) -> sr_pb2.TaskExecPollResponse:
        self._remaining(deadline, f"polling for exec {exec_id}")
        session = self.service.session(self._sandbox(task_id), exec_id)
        if not session.exited.is_set():
            return sr_pb2.TaskExecPollResponse()
        return sr_pb2.TaskExecPollResponse(code=await self._exit_status(session, exec_id))

    async def snapshot_filesystem(
        self, request: sr_pb2.TaskSnapshotFilesystemRequest, *, timeout: float, **kwargs: Any
    ) -> sr_pb2.TaskSnapshotFilesystemResponse:
        try:
            image_id = await asyncio.wait_for(
                self.service.snapshot_filesystem(
                    self._sandbox(request.task_id), request.ttl_seconds
                ),
                timeout,
            )
        except TimeoutError:
            raise modal_exc.TimeoutError("Deadline exceeded while snapshotting") from None
        return sr_pb2.TaskSnapshotFilesystemResponse(image_id=image_id)

    async def exec_wait(
        self, task_id: str, exec_id: str, deadline: float | None = None
    ) -> sr_pb2.TaskExecWaitResponse:
        left = self._remaining(deadline, f"waiting for exec {exec_id}")
        session = self.service.session(self._sandbox(task_id), exec_id)
        try:
            await asyncio.wait_for(session.exited.wait(), left)
        except TimeoutError:
            raise modal_exc.ExecTimeoutError(
                f"Deadline exceeded while waiting for exec {exec_id}"
            ) from None
        return sr_pb2.TaskExecWaitResponse(code=await self._exit_status(session, exec_id))


class _FakeImpl:
    """The slice of ``SandboxImpl`` that ``exec_via_tcr`` uses."""

    def __init__(self, sandbox: _FakeSandbox):
        self.sandbox = sandbox

    async def get_task_id(
        self,
        raise_if_task_complete: bool = False,
        timeout: float | None = None,
        retry_transient: bool = False,
    ) -> str:
        if self.sandbox._task_id is None:
            service = _service()
            record = await service.status(service.load(self.sandbox._id))
            if record.status is not None and raise_if_task_complete:
                raise grpc_error(Status.FAILED_PRECONDITION, "Sandbox already finished")
            self.sandbox._task_id = f"ta-{self.sandbox._id}"
        return self.sandbox._task_id

    async def get_command_router_client(self, task_id: str) -> _FakeCommandRouter:
        return _service().router


# ---------------------------------------------------------------------- SDK surface


class _FakeApp:
    def __init__(self, app_id: str, name: str):
        self._app_id = app_id
        self.name = name

    @property
    def app_id(self) -> str:
        return self._app_id

    @staticmethod
    async def lookup(
        name: str,
        *,
        client: Any = None,
        environment_name: str | None = None,
        create_if_missing: bool = False,
    ) -> _FakeApp:
        return _FakeApp(_service().app_id(name, create_if_missing), name)


def _image_id(image: Any) -> str | None:
    """The ``im-`` id of an image that names one (``Image.from_id``, or the ``Image`` a
    filesystem snapshot returned: the SDK's own class), else ``None``."""
    image_id = getattr(image, "image_id", None)
    if image_id is None and isinstance(image, modal.image._Image):
        image_id = image.object_id
    return None if image_id is None else str(image_id)


class _FakeImage:
    def __init__(
        self,
        tag: str | None = None,
        dockerfile: str | None = None,
        context_dir: str | None = None,
        image_id: str | None = None,
    ):
        self.tag = tag
        self.dockerfile = dockerfile
        self.context_dir = context_dir
        self.image_id = image_id

    @property
    def object_id(self) -> str:
        if self.image_id is None:
            raise AttributeError(f"Attempting to get object_id of unhydrated {self!r}")
        return self.image_id

    @staticmethod
    def from_id(image_id: str, client: Any = None) -> _FakeImage:
        return _FakeImage(image_id=image_id)

    async def hydrate(self, client: Any = None) -> _FakeImage:
        if self.image_id is not None:
            _service().snapshot_image(self.image_id)  # NotFoundError once deleted
        return self

    @staticmethod
    def from_registry(tag: str, secret: Any = None, **kwargs: Any) -> _FakeImage:
        return _FakeImage(tag=tag)

    @staticmethod
    def from_dockerfile(
        path: str | os.PathLike[str], *, context_dir: Any = None, **kwargs: Any
    ) -> _FakeImage:
        return _FakeImage(
            dockerfile=str(path), context_dir=None if context_dir is None else str(context_dir)
        )


class _FakeDict:
    """``modal.Dict``: a named key-value store of the control plane (JSON keys and values)."""

    def __init__(self, name: str, environment_name: str | None, create_if_missing: bool):
        self.name = name
        self._environment = environment_name
        self._create = create_if_missing
        self._id: str | None = None

    def _dict_id(self) -> str:
        if self._id is None:  # hydrated lazily, at first use, like the SDK's
            self._id = _service().dict_id(self.name, self._environment, self._create)
        return self._id

    @staticmethod
    def from_name(
        name: str,
        *,
        environment_name: str | None = None,
        create_if_missing: bool = False,
        client: Any = None,
    ) -> _FakeDict:
        return _FakeDict(name, environment_name, create_if_missing)

    async def put(self, key: Any, value: Any, *, skip_if_exists: bool = False) -> bool:
        def put(items: dict[str, Any]) -> bool:
            if skip_if_exists and json.dumps(key) in items:
                return False
            items[json.dumps(key)] = value
            return True

        return _service().dict_change(self._dict_id(), put)

    async def get(self, key: Any, default: Any | None = None) -> Any:
        return _service().dict_items(self._dict_id()).get(json.dumps(key), default)

    async def pop(self, key: Any, default: Any = KeyError) -> Any:
        found = _service().dict_change(
            self._dict_id(), lambda items: items.pop(json.dumps(key), KeyError)
        )
        if found is KeyError:
            if default is KeyError:
                raise KeyError(f"{key} not in dict {self._dict_id()}")
            return default
        return found

    async def items(self) -> AsyncGenerator[tuple[Any, Any], None]:
        for key, value in _service().dict_items(self._dict_id()).items():
            yield json.loads(key), value


async def _image_delete(image_id: str, *, client: Any = None) -> None:
    """``modal.experimental.image_delete``."""
    _service().delete_image(image_id)


class _FakeSecret:
    def __init__(self, name: str):
        self.name = name

    @staticmethod
    def from_name(name: str, *, environment_name: str | None = None, **kwargs: Any) -> _FakeSecret:
        return _FakeSecret(name)


class _FakeSandbox:
    """``modal.Sandbox``: control plane faked, ``exec`` and ``filesystem`` the SDK's own."""

    def __init__(
        self, sandbox_id: str, *, task_id: str | None = None, returncode: int | None = None
    ):
        self._id = sandbox_id
        self._task_id = task_id
        self._attached = True
        self._filesystem: _SandboxFilesystem | None = None
        self._returncode = returncode

    def _ensure_attached(self) -> None:
        if not self._attached:
            raise modal_exc.ClientClosed("Unable to perform operation on a detached sandbox")

    @property
    def object_id(self) -> str:
        return self._id

    @property
    def returncode(self) -> int | None:
        return self._returncode

    @staticmethod
    async def create(*args: str, **kwargs: Any) -> _FakeSandbox:
        bound = _CREATE_SIGNATURE.bind(*args, **kwargs)  # TypeError for what the SDK rejects
        bound.apply_defaults()
        params = dict(bound.arguments)
        params["args"] = params.pop("args", ())
        if params.get("cidr_allowlist") is not None:
            if params.get("outbound_cidr_allowlist") is not None:
                raise modal_exc.InvalidError(
                    "Cannot specify both `cidr_allowlist` and `outbound_cidr_allowlist`."
                )
            params["outbound_cidr_allowlist"] = params["cidr_allowlist"]
        create_args = SandboxCreateArgs(
            args=params["args"],
            image=params["image"],
            secrets=params["secrets"],
            env=params["env"],
            name=params["name"],
            timeout=params["timeout"],
            idle_timeout=params["idle_timeout"],
            workdir=params["workdir"],
            gpu=params["gpu"],
            cloud=params["cloud"],
            region=params["region"],
            cpu=params["cpu"],
            memory=params["memory"],
            block_network=params["block_network"],
            outbound_cidr_allowlist=params["outbound_cidr_allowlist"],
            outbound_domain_allowlist=params["outbound_domain_allowlist"],
            inbound_cidr_allowlist=params["inbound_cidr_allowlist"],
            pty=params["pty"],
            encrypted_ports=params["encrypted_ports"],
            h2_ports=params["h2_ports"],
            unencrypted_ports=params["unencrypted_ports"],
            tags=params["tags"],
        )
        common = SandboxCreateCommon(create_args, secrets=[])  # the SDK's own validation
        if params["app"] is None:
            raise modal_exc.InvalidError(
                "Sandboxes require an App when created outside of a Modal container."
            )
        sandbox_id = await _service().create(params, common)
        return _FakeSandbox(sandbox_id, task_id=f"ta-{sandbox_id}")

    @staticmethod
    async def from_id(sandbox_id: str, client: Any = None) -> _FakeSandbox:
        service = _service()
        record = await service.status(service.load(sandbox_id))
        return _FakeSandbox(sandbox_id, returncode=service.returncode(record))

    @staticmethod
    async def list(
        *, app_id: str | None = None, tags: dict[str, str] | None = None, client: Any = None
    ) -> AsyncGenerator[_FakeSandbox, None]:
        service = _service()
        for record in service.records():
            record = await service.status(record)
            if record.status is not None:
                continue  # include_finished=False, as the SDK asks
            if app_id and record.app_id != app_id:
                continue
            if any(record.tags.get(k) != v for k, v in (tags or {}).items()):
                continue
            yield _FakeSandbox(record.id)

    async def exec(
        self,
        *args: str,
        stdout: StreamType = StreamType.PIPE,
        stderr: StreamType = StreamType.PIPE,
        timeout: int | None = None,
        workdir: str | None = None,
        env: dict[str, str | None] | None = None,
        secrets: Any = None,
        text: bool = True,
        bufsize: int = -1,
        pty: bool = False,
        _pty_info: Any = None,
        pty_info: Any = None,
    ) -> Any:
        self._ensure_attached()
        return await exec_via_tcr(
            _FakeImpl(self),  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            *args,
            pty_info=None,
            stdout=stdout,
            stderr=stderr,
            timeout=timeout,
            workdir=workdir,
            env=env,
            secrets=secrets,
            text=text,
            bufsize=bufsize,  # type: ignore[arg-type]
            container_id=None,
        )

    @property
    def filesystem(self) -> _SandboxFilesystem:
        self._ensure_attached()
        if self._filesystem is None:
            self._filesystem = _SandboxFilesystem(self)  # type: ignore[arg-type]
        return self._filesystem

    async def set_tags(self, tags: dict[str, str], *, client: Any = None) -> None:
        self._ensure_attached()
        service = _service()
        record = service.load(self._id)
        record.tags = dict(tags)
        service.save(record)

    async def get_tags(self) -> dict[str, str]:
        self._ensure_attached()
        return dict(_service().load(self._id).tags)

    async def poll(self) -> int | None:
        self._ensure_attached()
        service = _service()
        record = await service.status(service.load(self._id))
        self._returncode = service.returncode(record)
        return self._returncode

    async def wait(self, raise_on_termination: bool = True) -> None:
        service = _service()
        while True:
            record = await service.status(service.load(self._id))
            if record.status is not None:
                break
            await asyncio.sleep(0.1)
        self._returncode = service.returncode(record)
        if record.status == "timeout":
            raise modal_exc.SandboxTimeoutError()
        if record.status == "terminated" and raise_on_termination:
            raise modal_exc.SandboxTerminatedError()

    async def terminate(self, *, wait: bool = False) -> int | None:
        self._ensure_attached()
        await _service().terminate(self._id)
        if wait:
            await self.wait(raise_on_termination=False)
            return self._returncode
        return None

    async def snapshot_filesystem(
        self, timeout: int = 55, *, ttl: int | None = 30 * 24 * 3600
    ) -> Any:
        self._ensure_attached()
        return await snapshot_filesystem_via_tcr(
            _FakeImpl(self),  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            timeout,
            ttl=ttl,
        )

    async def detach(self) -> None:
        self._attached = False


Sandbox = synchronize_api(_FakeSandbox, target_module=__name__)
App = synchronize_api(_FakeApp, target_module=__name__)
Image = synchronize_api(_FakeImage, target_module=__name__)
Secret = synchronize_api(_FakeSecret, target_module=__name__)
Dict = synchronize_api(_FakeDict, target_module=__name__)
image_delete = synchronize_api(_image_delete, target_module=__name__)


def install(service: FakeModalService, monkeypatch: Any) -> types.ModuleType:
    """Make ``runtimes.modal`` use ``service`` (via ``monkeypatch``); returns the fake module."""
    import runtimes.modal.client

    fake = service.module()
    monkeypatch.setattr(runtimes.modal.client, "modal_sdk", lambda: fake)
    return fake


__all__ = ["FAKE_LABEL", "CreateCall", "FakeModalService", "grpc_error", "install"]
