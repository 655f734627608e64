"""Behaviour specific to the Modal runtime, proven against the fake Modal SDK.

The fake (``fake_modal.py``) runs Modal's own client code for exec, process streams and the
filesystem API, raises Modal's real exception classes, and plays the service with one local
Docker container per sandbox. These tests cover what the conformance suite does not: the
options passed to ``Sandbox.create``, retries and caps at creation, the mapping of every Modal
exception, the transport limits (argv cap, stdin chunks, the SDK's own exec timeout), and leaks
(cancelled starts, crashed sessions, the atexit backstop, ``vf-sandbox cleanup``).

Tests of the SDK-level exec and filesystem paths use ``channel=False``: with the channel on,
commands and files go through the in-sandbox agent instead (``tests/channel``).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import grpclib.exceptions
import modal.exception as modal_exc
import pytest
from grpclib import Status

import runtimes.modal as modal_runtime
import runtimes.modal.client as modal_client
import runtimes.modal.runtime as modal_lifecycle
from runtimes import (
    ExecRequest,
    ExecTimeoutError,
    OutputLimitExceededError,
    OutputSink,
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
    open_runtime,
    ownership,
)
from runtimes.cleanup import cleanup_sandboxes
from runtimes.limits import live_cap
from runtimes.modal import ModalRuntime
from runtimes.testing import CHECKS, run_check

from .fake_modal import FakeModalService, grpc_error
from .support import fake_config

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]


async def _raises(expected: type[BaseException], awaitable: Awaitable[object]) -> BaseException:
    try:
        await awaitable
    except expected as exc:
        return exc
    except BaseException as exc:
        raise AssertionError(f"expected {expected.__name__}, got {exc!r}") from exc
    raise AssertionError(f"expected {expected.__name__}, nothing was raised")


# ---------------------------------------------------------------------- creation


def test_create_blocks_network_bounds_lifetime_and_tags_at_creation(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    async def body() -> tuple[str, dict[str, str], str]:
        async with open_runtime(fake_config(tags={"team": "rl"})) as rt:
            assert rt.sandbox_id is not None
            handle = await fake_modal.Sandbox.from_id.aio(rt.sandbox_id)
            tags = await handle.get_tags.aio()
            interfaces = (await rt.exec(["ls", "/sys/class/net"])).stdout
            return rt.sandbox_id, tags, interfaces

    sandbox_id, tags, interfaces = anyio.run(body)
    call = fake_service.created[0]
    assert call.sandbox_id == sandbox_id
    assert call.network == "BLOCKED" and call.kwargs["block_network"] is True
    assert interfaces.split() == ["lo"], "a blocked sandbox has no network interface but lo"
    assert call.kwargs["timeout"] == 3600 and call.kwargs["idle_timeout"] == 900
    assert call.kwargs["tags"] == tags, "tags are set in the create call itself"
    assert tags[ownership.CREATOR] == ownership.CREATOR_ID
    assert tags[ownership.BACKEND] == "modal" and tags[ownership.PID] == str(os.getpid())
    assert tags["team"] == "rl"


def test_cidr_allowlist_opens_the_network_to_those_cidrs_only(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    async def body() -> None:
        async with open_runtime(fake_config(cidr_allowlist=["10.0.0.0/8"])):
            pass

    anyio.run(body)
    call = fake_service.created[0]
    assert call.network == "ALLOWLIST" and call.allowed_cidrs == ["10.0.0.0/8"]
    assert call.kwargs["block_network"] is False
    assert call.kwargs["outbound_cidr_allowlist"] == ["10.0.0.0/8"]


def test_resource_exhausted_is_retried_until_creation_succeeds(
    fake_service: FakeModalService, fake_modal: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(modal_lifecycle, "CREATE_BACKOFF", (0.01, 0.05))
    fake_service.create_failures = [
        grpc_error(Status.RESOURCE_EXHAUSTED, "rate limit exceeded"),
        modal_exc.ResourceExhaustedError("Insufficient capacity to create sandbox."),
    ]

    async def body() -> str:
        async with open_runtime(fake_config()) as rt:
            return (await rt.exec(["echo", "up"])).stdout

    assert anyio.run(body) == "up\n"
    assert fake_service.create_attempts == 3
    assert len(fake_service.created) == 1


def test_resource_exhausted_every_time_is_a_provisioning_error(
    fake_service: FakeModalService, fake_modal: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(modal_lifecycle, "CREATE_BACKOFF", (0.01, 0.05))
    fake_service.create_failures = [modal_exc.ResourceExhaustedError("quota")] * 10

    async def body() -> None:
        async with open_runtime(fake_config(create_attempts=3)):
            raise AssertionError("the sandbox should not have been created")

    with pytest.raises(ProvisioningError) as info:
        anyio.run(body)
    assert isinstance(info.value.__cause__, modal_exc.ResourceExhaustedError)
    assert "3 times" in str(info.value)
    assert fake_service.create_attempts == 3
    assert fake_service.running_containers() == []


@pytest.mark.parametrize(
    ("case", "cause"),
    [
        ("missing image", modal_exc.ImageBuildError),
        ("missing secret", modal_exc.NotFoundError),
        ("bad credentials", modal_exc.AuthError),
        ("invalid option", modal_exc.InvalidError),
    ],
)
def test_refused_creations_are_provisioning_errors_and_not_retried(
    case: str,
    cause: type[BaseException],
    fake_service: FakeModalService,
    fake_modal: types.ModuleType,
) -> None:
    config = fake_config()
    if case == "missing image":
        fake_service.missing_images.add("ghcr.io/nobody/nothing:1")
        config["image"] = "ghcr.io/nobody/nothing:1"
    elif case == "missing secret":
        config["secrets"] = ["no-such-secret"]
    elif case == "bad credentials":
        fake_service.create_failures = [grpc_error(Status.UNAUTHENTICATED, "token invalid")]
    else:
        fake_service.create_failures = [grpc_error(Status.INVALID_ARGUMENT, "unknown GPU type")]
        config["gpu"] = "no-such-gpu"

    async def body() -> None:
        async with open_runtime(config):
            raise AssertionError("the sandbox should not have been created")

    with pytest.raises(ProvisioningError) as info:
        anyio.run(body)
    assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)
    if case == "bad credentials":
        assert "MODAL_TOKEN_ID" in str(info.value)
    assert fake_service.create_attempts <= 1
    assert fake_service.running_containers() == []


def test_a_start_cancelled_during_creation_terminates_the_sandbox(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    fake_service.create_delay = 1.0
    runtime = open_runtime(fake_config())

    async def body() -> bool:
        with anyio.move_on_after(0.3) as scope:
            await runtime.start()
        return scope.cancelled_caught

    assert anyio.run(body), "the start should have been cancelled"
    assert runtime.closed
    records = fake_service.records()
    assert len(records) == 1 and records[0].status == "terminated", records
    assert fake_service.running_containers() == []


def test_the_live_cap_queues_creations_and_waiting_is_cancellable(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    config = fake_config(max_live=1)

    async def body() -> None:
        first = await open_runtime(config).start()
        waiting = open_runtime(config)
        with anyio.move_on_after(0.5) as scope:
            await waiting.start()
        assert scope.cancelled_caught and waiting.sandbox_id is None
        queued = open_runtime(config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(queued.start)
            await anyio.sleep(0.5)
            assert queued.sandbox_id is None, "created while the cap was full"
            await first.close()
        assert queued.sandbox_id is not None
        assert live_cap("modal").live == 1
        await queued.close()
        assert live_cap("modal").live == 0

    anyio.run(body)
    assert len(fake_service.created) == 2


# ---------------------------------------------------------------------- a dead sandbox


@pytest.mark.parametrize("how", ["terminated from outside", "lifetime expired"])
def test_a_dead_sandbox_is_unavailable_on_every_call(
    how: str, fake_service: FakeModalService, fake_modal: types.ModuleType, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    (local / "f.txt").write_text("x")

    async def body() -> None:
        async with open_runtime(fake_config()) as rt:
            await rt.write("kept.txt", b"kept")
            assert rt.sandbox_id is not None
            if how == "terminated from outside":
                handle = await fake_modal.Sandbox.from_id.aio(rt.sandbox_id)
                await handle.terminate.aio()
            else:
                fake_service.expire(rt.sandbox_id)
            assert not await rt.alive()
            calls: list[Callable[[], Awaitable[object]]] = [
                lambda: rt.exec(["true"]),
                lambda: rt.read("kept.txt"),
                lambda: rt.write("new.txt", b""),
                lambda: rt.exists("kept.txt"),
                lambda: rt.remove("kept.txt"),
                lambda: rt.upload(local, "up"),
                lambda: rt.download("kept.txt", tmp_path / "down"),
            ]
            for call in calls:
                exc = await _raises(SandboxUnavailableError, call())
                assert not isinstance(exc, FileNotFoundError | ConnectionError), exc

    anyio.run(body)


# ---------------------------------------------------------------------- exec transport


def test_the_sdks_own_exec_timeout_is_exec_timeout_and_kills_the_tree(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    """With no caller-side deadline, only Modal's ``exec(timeout=1)`` fires: ``wait() == -1``."""
    token = "777.123456"

    async def body() -> tuple[ExecTimeoutError, float, str]:
        async with open_runtime(fake_config(channel=False)) as rt:
            request = ExecRequest(
                argv=("sh", "-c", f"echo started; sleep {token} & sleep {token}; wait"),
                cwd=rt.workdir,
                env={},
                stdin=None,
                user=None,
                timeout=1.0,
                output_limit=1 << 20,
            )
            started = time.monotonic()
            exc = await _raises(ExecTimeoutError, rt._exec(request, OutputSink(1 << 20)))
            elapsed = time.monotonic() - started
            assert isinstance(exc, ExecTimeoutError)
            await anyio.sleep(0.3)
            left = (await rt.exec(["ps", "-eo", "args"])).stdout
            return exc, elapsed, left

    exc, elapsed, left = anyio.run(body)
    assert exc.stdout_bytes == b"started\n" and exc.timeout == 1.0
    assert 0.9 <= elapsed < 10, elapsed
    assert token not in left, f"processes left running: {left}"


def test_argv_over_the_sdk_cap_is_spooled_through_a_file(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    big = ["a" * 40_000, "it's $HOME\n" * 3_000]  # 73 KB: over the SDK's 65,536-character cap
    script = 'for a in "$@"; do printf %s "$a" | sha256sum; done'

    async def body() -> tuple[str, str, str]:
        async with open_runtime(fake_config(channel=False)) as rt:
            spooled = (await rt.exec(["sh", "-c", script, "sh", *big])).stdout
            inline = (await rt.exec(["echo", "small"])).stdout
            leftover = (await rt.exec(["sh", "-c", "ls /tmp/.vf-sandbox | grep -c argv"])).stdout
            return spooled, inline, leftover

    spooled, inline, leftover = anyio.run(body)
    assert spooled.split()[::2] == [hashlib.sha256(a.encode()).hexdigest() for a in big]
    assert inline == "small\n"
    assert leftover.strip() == "0", "the spooled argv file is removed"
    wrapped = [c for c in fake_service.exec_calls if c[:2] == ["sh", "-c"] and len(c) > 4]
    assert any(c[-1].startswith("/tmp/.vf-sandbox/") and c[-1].endswith(".argv") for c in wrapped)
    assert all(sum(map(len, c)) <= 65_536 for c in fake_service.exec_calls)
    assert any(c[-2:] == ["echo", "small"] for c in wrapped), "small argv stays inline"


def test_argv_too_long_for_the_sandbox_kernel_is_an_invalid_argument(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    async def body() -> None:
        async with open_runtime(fake_config(channel=False)) as rt:
            huge = "x" * (200 * 1024)  # over Linux's 128 KiB limit for one argument
            await _raises(SandboxInvalidArgumentError, rt.exec(["sh", "-c", "true", "sh", huge]))
            assert (await rt.exec(["echo", "still fine"])).stdout == "still fine\n"

    anyio.run(body)


def test_large_stdin_is_sent_in_drained_chunks(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    data = os.urandom(40 * 1024 * 1024)  # over the SDK's 16 MiB stdin buffer

    async def body() -> str:
        async with open_runtime(fake_config(channel=False)) as rt:
            return (await rt.exec(["sha256sum"], stdin=data, timeout=120)).stdout

    assert anyio.run(body).split()[0] == hashlib.sha256(data).hexdigest()
    assert sum(fake_service.stdin_writes) == len(data)
    assert max(fake_service.stdin_writes) <= modal_runtime.STDIN_CHUNK


def test_a_failed_exec_channel_is_a_transport_error_and_not_retried(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    async def body() -> None:
        async with open_runtime(fake_config(channel=False)) as rt:
            fake_service.exec_failures = [grpc_error(Status.UNAVAILABLE, "connection reset")]
            await _raises(SandboxTransportError, rt.exec(["touch", "once"]))
            assert fake_service.exec_failures == []
            assert not await rt.exists("once"), "exec is not idempotent: never retried"
            assert (await rt.exec(["echo", "ok"])).stdout == "ok\n"

    anyio.run(body)


# ---------------------------------------------------------------------- files


def test_transport_errors_on_file_calls_are_retried_then_surface(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    flaky = grpc_error(Status.UNAVAILABLE, "connection reset")

    async def body() -> None:
        async with open_runtime(fake_config(channel=False)) as rt:
            await rt.write("f.txt", b"content")
            fake_service.exec_failures = [flaky]
            assert await rt.read("f.txt") == b"content"
            assert fake_service.exec_failures == []
            fake_service.exec_failures = [flaky] * modal_client.TRANSPORT_ATTEMPTS
            exc = await _raises(SandboxTransportError, rt.read("f.txt"))
            assert isinstance(exc, ConnectionError) and not isinstance(exc, FileNotFoundError)
            assert await rt.read("f.txt") == b"content"

    anyio.run(body)


def test_modal_exceptions_map_to_typed_errors(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    """Every Modal exception the runtime can meet, on a live and then on a dead sandbox."""
    fs = modal_exc
    on_live: list[tuple[Exception, str, str, type[SandboxError]]] = [
        (fs.SandboxFilesystemNotFoundError("m"), "read", "/work/x", SandboxFileNotFoundError),
        (fs.SandboxFilesystemIsADirectoryError("m"), "write", "/work/x", SandboxIsADirectoryError),
        (fs.SandboxFilesystemNotADirectoryError("m"), "read", "/work/x", SandboxNotADirectoryError),
        (fs.SandboxFilesystemPermissionError("m"), "read", "/work/x", SandboxPermissionError),
        (
            fs.SandboxFilesystemPathAlreadyExistsError("m"),
            "mkdir",
            "/work/x",
            SandboxFileExistsError,
        ),
        (fs.SandboxFilesystemDirectoryNotEmptyError("m"), "rm", "/work/x", SandboxFileExistsError),
        # untyped filesystem errors are diagnosed in the sandbox:
        (
            fs.SandboxFilesystemError("unexpected"),
            "read",
            "/work/file/child",
            SandboxNotADirectoryError,
        ),
        (
            fs.SandboxFilesystemError("unexpected"),
            "read",
            "/work/missing",
            SandboxFileNotFoundError,
        ),
        (fs.SandboxFilesystemError("unexpected"), "read", "/work", SandboxIsADirectoryError),
        (fs.SandboxFilesystemError("x"), "write_bytes", "/work/file/a", SandboxNotADirectoryError),
        (fs.ClientClosed("detached"), "exec", "sh", SandboxUnavailableError),
        (fs.ConflictError("conflicting request"), "exec", "sh", SandboxError),
        (fs.SandboxTerminatedError(), "exec", "sh", SandboxUnavailableError),
        (fs.SandboxTimeoutError(), "exec", "sh", SandboxUnavailableError),
        (fs.AuthError("token revoked"), "exec", "sh", SandboxUnavailableError),
        (fs.InvalidError("bad"), "exec", "sh", SandboxInvalidArgumentError),
        (fs.NotFoundError("The Sandbox is unavailable"), "read", "/work/x", SandboxTransportError),
        (grpc_error(Status.UNAVAILABLE, "reset"), "exec", "sh", SandboxTransportError),
        (fs.ConnectionError("refused"), "exec", "sh", SandboxTransportError),
        (fs.InternalError("oops"), "exec", "sh", SandboxTransportError),
        (grpclib.exceptions.StreamTerminatedError("gone"), "exec", "sh", SandboxTransportError),
        (fs.ExecutionError("weird"), "exec", "sh", SandboxError),
    ]
    on_dead: list[tuple[Exception, type[SandboxError]]] = [
        (fs.NotFoundError("The Sandbox is unavailable"), SandboxUnavailableError),
        (fs.ConflictError("Sandbox already finished"), SandboxUnavailableError),
        (grpc_error(Status.UNAVAILABLE, "reset"), SandboxUnavailableError),
    ]

    async def body() -> None:
        async with open_runtime(fake_config()) as rt:
            runtime = rt
            assert isinstance(runtime, ModalRuntime)
            await rt.write("file", b"x")
            for exc, operation, path, expected in on_live:
                err = await runtime.backend._translate(exc, operation, path)
                assert type(err) is expected, (exc, err)
                if isinstance(err, OSError) and not isinstance(err, ConnectionError):
                    assert err.filename == path and err.errno, err
            assert runtime.sandbox_id is not None
            fake_service.expire(runtime.sandbox_id)
            for exc, expected in on_dead:
                err = await runtime.backend._translate(exc, "read", "/work/file")
                assert type(err) is expected, (exc, err)

    anyio.run(body)


def test_a_read_cut_short_under_the_worker_is_read_again(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    """A read shorter than the size ``stat`` just gave (its output stream lost, the process
    exiting 0) is read once more, never returned truncated."""
    data = os.urandom(150_000)

    async def body() -> None:
        async with open_runtime(fake_config(channel=False)) as rt:
            await rt.write("cut.bin", data)
            fake_service.stdout_cuts = [("ReadFile", 4096)]
            assert await rt.read("cut.bin") == data
            assert fake_service.stdout_cuts == []

    anyio.run(body)


def test_a_file_too_large_for_the_filesystem_api_is_streamed_instead(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    fake_service.max_read_bytes = 1000
    data = os.urandom(5000)

    async def body() -> bytes:
        async with open_runtime(fake_config(channel=False)) as rt:
            await rt.write("big.bin", data)
            return await rt.read("big.bin")

    assert anyio.run(body) == data
    assert any(c[-3:] == ["cat", "--", "/work/big.bin"] for c in fake_service.exec_calls)


def test_a_read_over_max_bytes_is_refused_before_any_transfer(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    async def body() -> int:
        async with open_runtime(fake_config(channel=False)) as rt:
            await rt.exec(["sh", "-c", "head -c 10000000 /dev/zero > ten-mb"])
            before = len(fake_service.exec_calls)
            await _raises(OutputLimitExceededError, rt.read("ten-mb", max_bytes=1000))
            return before

    before = anyio.run(body)
    commands = [" ".join(c) for c in fake_service.exec_calls[before:]]
    assert any('"Stat"' in c for c in commands)
    assert not any('"ReadFile"' in c or " cat -- " in c for c in commands), commands


def test_a_workdir_that_is_a_file_is_a_provisioning_error(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    async def body() -> None:
        async with open_runtime(fake_config(workdir="/etc/hostname")):
            raise AssertionError("started with a file as workdir")

    with pytest.raises(ProvisioningError, match="/etc/hostname"):
        anyio.run(body)
    assert fake_service.running_containers() == []


def test_a_dockerfile_image_is_built_with_from_dockerfile(
    fake_service: FakeModalService, fake_modal: types.ModuleType, tmp_path: Path
) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "FROM vf-sandbox/base:bookworm\nRUN echo built-from-dockerfile > /marker\n"
    )

    async def body() -> bytes:
        async with open_runtime(fake_config(image=str(dockerfile))) as rt:
            return await rt.read("/marker")

    assert anyio.run(body) == b"built-from-dockerfile\n"
    image = fake_service.created[0].kwargs["image"]
    assert image.dockerfile == str(dockerfile) and image.context_dir == str(tmp_path)


@pytest.mark.parametrize(
    "name",
    [
        "unreadable_file",
        "unwritable_directory",
        "user",
        "non_executable_program",
        "read_missing",
        "write_under_file",
        "exists",
        "cwd_missing",
    ],
)
def test_conformance_checks_as_a_non_root_sandbox_user(
    name: str, fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    """Modal runs images as root by default; an image with a USER runs execs as that user."""
    fake_service.container_user = "nobody"
    check = next(c for c in CHECKS if c.name == name)
    anyio.run(run_check, check, fake_config(workdir="/tmp/work"))


# ---------------------------------------------------------------------- leaks and cleanup


def _child(state: Path, mode: str) -> tuple[subprocess.Popen[str], str]:
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.modal.child_session", str(state), mode],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    sandbox_id = child.stdout.readline().strip()
    assert sandbox_id.startswith("sb-"), f"the child printed {sandbox_id!r}"
    return child, sandbox_id


def test_cleanup_sweeps_sandboxes_of_a_crashed_session_only(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    child, crashed = _child(fake_service.state_dir, "hang")
    child.send_signal(signal.SIGKILL)
    child.wait(30)

    async def body() -> tuple[list[Any], str, str]:
        async with open_runtime(fake_config()) as mine:
            app = await fake_modal.App.lookup.aio("vf-sandbox-tests")
            foreign = await fake_modal.Sandbox.create.aio(app=app)  # no vf-sandbox tags
            results = await cleanup_sandboxes([fake_config()])
            await foreign.terminate.aio()
            assert mine.sandbox_id is not None
            return results, mine.sandbox_id, foreign.object_id

    results, mine, foreign = anyio.run(body)
    by_id = {r.info.id: r for r in results}
    assert by_id[crashed].action == "removed" and "dead" in by_id[crashed].reason
    assert by_id[mine].action == "kept"
    assert foreign not in by_id, "only sandboxes tagged by vf-sandbox are listed"
    assert fake_service.load(crashed).status == "terminated"


def test_the_atexit_backstop_terminates_a_sandbox_left_open(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    child, sandbox_id = _child(fake_service.state_dir, "exit")
    assert child.wait(60) == 0
    assert fake_service.load(sandbox_id).status == "terminated"
    assert fake_service.running_containers() == []


def test_listing_without_modal_credentials_contacts_nothing(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    fake_modal.config = types.SimpleNamespace(config={})  # no token anywhere
    assert anyio.run(ModalRuntime.list_sandboxes, None) == []
    assert not (fake_service.state_dir / "apps.json").exists()
