"""Behaviour specific to the subprocess runtime: private workdirs, user workdirs (refused
when missing, created on request and removed without following links), process groups,
non-root permission errors, leaks after SIGKILL, the atexit backstop, cancellation."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from runtimes import (
    RuntimeConfigError,
    SandboxFileNotFoundError,
    SandboxNotADirectoryError,
    SandboxUnavailableError,
    SubprocessConfig,
    open_runtime,
    resolve_runtime_config,
)
from runtimes.cleanup import cleanup_sandboxes
from runtimes.subprocess import SubprocessRuntime
from tests.nonroot import conformance_as_nobody


@pytest.fixture
def as_root() -> None:
    """These tests drop to another user, which needs root: CI runs `make test` as root."""
    if os.geteuid() != 0:
        pytest.fail("needs root to drop to another user (run `make test` as root, as CI does)")


ROOT_ONLY = pytest.mark.usefixtures("as_root")


def _pids_running(token: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if token in line]


def test_workdir_is_private_and_removed_on_close(tmp_path: Path) -> None:
    async def body() -> tuple[str, str]:
        async with (
            open_runtime(SubprocessConfig(root=str(tmp_path))) as a,
            open_runtime(SubprocessConfig(root=str(tmp_path))) as b,
        ):
            assert a.workdir != b.workdir
            await a.write("only-in-a", b"x")
            assert not await b.exists("only-in-a")
            return a.workdir, b.workdir

    first, second = anyio.run(body)
    assert not os.path.exists(first) and not os.path.exists(second)
    assert list(tmp_path.iterdir()) == []


def test_each_command_gets_its_own_process_group() -> None:
    async def body() -> list[str]:
        async with open_runtime("subprocess") as rt:
            results = [await rt.exec(["sh", "-c", "ps -o pgid= -p $$"]) for _ in range(2)]
        return [r.stdout.strip() for r in results]

    groups = anyio.run(body)
    assert len(set(groups)) == 2
    assert str(os.getpgid(0)) not in groups


def test_close_kills_background_processes_left_running() -> None:
    token = "777.424242"

    async def body() -> None:
        async with open_runtime("subprocess") as rt:
            await rt.exec(["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 &"])
            assert _pids_running(token)

    anyio.run(body)
    deadline = time.monotonic() + 5
    while _pids_running(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pids_running(token)


def test_workdir_given_by_user_is_used_and_kept(tmp_path: Path) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "before.txt").write_bytes(b"b")

    async def body() -> None:
        async with open_runtime(
            SubprocessConfig(workdir=str(target), root=str(tmp_path / "r"), create_workdir=True)
        ) as rt:
            assert rt.workdir == str(target)
            await rt.write("kept.txt", b"k")

    anyio.run(body)
    assert (target / "kept.txt").read_bytes() == b"k"
    assert (target / "before.txt").read_bytes() == b"b"


def test_missing_workdir_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    target = tmp_path / "no" / "such"
    root = tmp_path / "r"
    rt = open_runtime(SubprocessConfig(workdir=str(target), root=str(root)))
    with pytest.raises(SandboxFileNotFoundError, match="create_workdir") as caught:
        anyio.run(rt.start)
    assert caught.value.filename == str(target)
    assert rt.closed
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_workdir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_bytes(b"")
    config = SubprocessConfig(workdir=str(target), root=str(tmp_path / "r"), create_workdir=True)
    with pytest.raises(SandboxNotADirectoryError):
        anyio.run(open_runtime(config).start)
    assert target.read_bytes() == b""


def test_create_workdir_removes_only_the_directories_it_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "existing").mkdir()
    monkeypatch.chdir(tmp_path)
    config = SubprocessConfig(workdir="existing/a/b", root=str(tmp_path / "r"), create_workdir=True)

    async def body() -> str:
        async with open_runtime(config) as rt:
            await rt.write("deep/file.txt", b"x")
            result = await rt.exec(["pwd", "-P"])
            assert result.stdout.strip() == rt.workdir
            return rt.workdir

    workdir = anyio.run(body)
    assert workdir == str(tmp_path / "existing" / "a" / "b")  # relative: to the cwd at start
    assert not os.path.lexists(tmp_path / "existing" / "a")
    assert (tmp_path / "existing").is_dir()
    assert list((tmp_path / "r").iterdir()) == []


def test_create_workdir_without_workdir_is_a_config_error() -> None:
    with pytest.raises(RuntimeConfigError, match="create_workdir needs a workdir"):
        resolve_runtime_config({"type": "subprocess", "create_workdir": True})


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    (victim / "new").mkdir(parents=True)
    (victim / "precious.txt").write_bytes(b"p")
    (victim / "new" / "precious.txt").write_bytes(b"p")
    return victim


def test_created_workdir_swapped_for_a_link_is_not_followed_on_close(tmp_path: Path) -> None:
    """A hostile command replaces the workdir the runtime created by a symlink to a
    directory of the user's: close() removes the link, never what it points to."""
    victim = _victim(tmp_path)
    created = tmp_path / "new"
    config = SubprocessConfig(workdir=str(created), root=str(tmp_path / "r"), create_workdir=True)
    swap = 'cd / && mv "$1" "$1.moved" && ln -s "$2" "$1"'

    async def body() -> None:
        async with open_runtime(config) as rt:
            result = await rt.exec(["sh", "-c", swap, "sh", str(created), str(victim)])
            assert result.exit_code == 0, result.stderr

    anyio.run(body)
    assert not os.path.lexists(created)  # the planted link, unlinked
    assert (victim / "precious.txt").read_bytes() == b"p"
    assert (victim / "new" / "precious.txt").read_bytes() == b"p"
    assert (tmp_path / "new.moved").is_dir()  # moved away: no longer at the name it had


def test_created_workdir_under_a_swapped_parent_is_left_alone(tmp_path: Path) -> None:
    """The parent the workdir was created in is replaced by a link to a directory of the
    user's with an entry of the same name (here a symlink): close() leaves that entry."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_bytes(b"p")
    (victim / "new").symlink_to("precious.txt")
    parent = tmp_path / "parent"
    parent.mkdir()
    config = SubprocessConfig(
        workdir=str(parent / "new"), root=str(tmp_path / "r"), create_workdir=True
    )
    swap = 'cd / && mv "$1" "$1.moved" && ln -s "$2" "$1"'

    async def body() -> None:
        async with open_runtime(config) as rt:
            result = await rt.exec(["sh", "-c", swap, "sh", str(parent), str(victim)])
            assert result.exit_code == 0, result.stderr

    anyio.run(body)
    assert os.readlink(victim / "new") == "precious.txt"
    assert (victim / "precious.txt").read_bytes() == b"p"


_CREATING_HOLDER = textwrap.dedent(
    """
    import sys, anyio
    from runtimes import SubprocessConfig, open_runtime

    async def main():
        config = SubprocessConfig(root=sys.argv[1], workdir=sys.argv[2], create_workdir=True)
        rt = open_runtime(config)
        await rt.start()
        await rt.write("left.txt", b"x")
        print("READY", flush=True)
        await anyio.sleep(600)

    anyio.run(main)
    """
)


def test_cleanup_of_a_leaked_sandbox_removes_the_workdir_it_created(tmp_path: Path) -> None:
    root, workdir = tmp_path / "r", tmp_path / "existing" / "made" / "work"
    (tmp_path / "existing").mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _CREATING_HOLDER, str(root), str(workdir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "READY"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (workdir / "left.txt").is_file()

    results = anyio.run(lambda: cleanup_sandboxes([SubprocessConfig(root=str(root))]))
    assert [r.action for r in results] == ["removed"]
    assert not os.path.lexists(tmp_path / "existing" / "made")
    assert (tmp_path / "existing").is_dir()


@ROOT_ONLY
def test_permission_checks_as_non_root() -> None:
    """The root-only-skipped conformance checks, run for real as `nobody` in a forked child."""
    root = Path(tempfile.mkdtemp(prefix="vf-nonroot-"))  # pytest's tmp_path is root-only
    root.chmod(0o777)
    outcomes = conformance_as_nobody(
        SubprocessConfig(root=str(root)),
        ["unreadable_file", "unwritable_directory", "user", "read_missing"],
    )
    shutil.rmtree(root, ignore_errors=True)
    assert outcomes == {
        "unreadable_file": ("pass", ""),
        "unwritable_directory": ("pass", ""),
        "user": ("pass", ""),
        "read_missing": ("pass", ""),
    }


@ROOT_ONLY
def test_user_switch_as_root() -> None:
    async def body() -> str:
        async with open_runtime("subprocess") as rt:
            return (await rt.exec(["id", "-un"], user="nobody")).stdout.strip()

    assert anyio.run(body) == "nobody"


_HOLDER = textwrap.dedent(
    """
    import sys, anyio
    from runtimes import SubprocessConfig, open_runtime

    async def main():
        runtimes = [open_runtime(SubprocessConfig(root=sys.argv[1])) for _ in range(5)]
        for rt in runtimes:
            await rt.start()
            await rt.exec(["sh", "-c", "nohup sleep 655.31337 >/dev/null 2>&1 &"])
        print("READY", flush=True)
        await anyio.sleep(600)

    anyio.run(main)
    """
)


def test_sigkilled_holder_leaks_nothing_after_cleanup(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "READY"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert len(list(tmp_path.iterdir())) == 5
    assert _pids_running("655.31337")

    config = SubprocessConfig(root=str(tmp_path))
    results = anyio.run(lambda: cleanup_sandboxes([config]))
    assert [r.action for r in results] == ["removed"] * 5
    assert list(tmp_path.iterdir()) == []
    deadline = time.monotonic() + 5
    while _pids_running("655.31337") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pids_running("655.31337")


def test_cleanup_keeps_sandboxes_of_live_sessions(tmp_path: Path) -> None:
    config = SubprocessConfig(root=str(tmp_path))

    async def body() -> list[str]:
        async with open_runtime(config):
            return [r.action for r in await cleanup_sandboxes([config])]

    assert anyio.run(body) == ["kept"]


def test_atexit_backstop_closes_forgotten_runtimes(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import anyio
        from runtimes import SubprocessConfig, open_runtime
        async def main():
            rt = open_runtime(SubprocessConfig(root={str(tmp_path)!r}))
            await rt.start()
            await rt.exec(["sh", "-c", "nohup sleep 655.4242 >/dev/null 2>&1 &"])
            print(rt.workdir)
        anyio.run(main)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    assert not _pids_running("655.4242")


def test_cancelled_start_leaves_nothing(tmp_path: Path) -> None:
    async def body() -> SubprocessRuntime:
        rt = open_runtime(SubprocessConfig(root=str(tmp_path)))
        assert isinstance(rt, SubprocessRuntime)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await rt.start()
        return rt

    rt = anyio.run(body)
    assert rt.closed
    assert list(tmp_path.iterdir()) == []


def test_close_from_cancelled_task_still_cleans_up(tmp_path: Path) -> None:
    async def body() -> None:
        rt = open_runtime(SubprocessConfig(root=str(tmp_path)))
        await rt.start()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await rt.close()
        assert rt.closed

    anyio.run(body)
    assert list(tmp_path.iterdir()) == []


def test_operations_before_start_are_unavailable() -> None:
    rt = open_runtime("subprocess")
    with pytest.raises(SandboxUnavailableError, match="never started"):
        anyio.run(lambda: rt.exec(["true"]))


def test_huge_argv_is_a_typed_error_not_a_crash() -> None:
    from runtimes import SandboxInvalidArgumentError

    async def body() -> None:
        async with open_runtime("subprocess") as rt:
            with pytest.raises(SandboxInvalidArgumentError, match="too long"):
                await rt.exec(["true", *(["x" * 100_000] * 100)])

    anyio.run(body)


def test_tempdir_default_root_is_under_tmp() -> None:
    from runtimes.subprocess import default_root

    assert default_root().startswith(tempfile.gettempdir())


def test_a_group_number_that_now_leads_another_command_is_not_killed() -> None:
    """A command's group is killed by number (timeout, cancellation, output cap). Once its
    leader was reaped and the group emptied, the kernel can give the number to a new command,
    which leads a group of that number: the kill must spare it (the soak saw a fresh command
    die with 137 under load)."""
    from runtimes.subprocess.process import kill_group
    from runtimes.subprocess.sweep import start_ticks

    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        theirs = start_ticks(other.pid)
        kill_group(other.pid, theirs - 1)  # the recorded leader started at another time
        time.sleep(0.2)
        assert other.poll() is None, "the command now holding the number was killed"
        kill_group(other.pid, theirs)
        assert other.wait(timeout=10) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()


def _holding(path: Path) -> subprocess.Popen[bytes]:
    """A child of this process, in a session of its own, holding ``path`` open."""
    with path.open("rb") as fh:
        return subprocess.Popen(["sleep", "60"], pass_fds=(fh.fileno(),), start_new_session=True)


def test_the_hosts_other_children_are_never_swept_for_a_file_they_hold() -> None:
    """A sweep takes what holds a file under the sandbox's directories, but not a child of
    the host process for a file it holds: another sandbox's command, or a fork on its way
    to ``exec`` that inherited the host's open files (a read of this sandbox in flight in
    another task). The soak saw another sandbox's fresh ``printf`` die
    with 137 after this sandbox's sweep froze it."""

    async def body() -> None:
        async with open_runtime("subprocess") as rt:
            await rt.write("held.bin", b"x")
            other = await anyio.to_thread.run_sync(_holding, Path(rt.workdir, "held.bin"))
            try:
                mine = await rt.spawn(["sleep", "60"])
                assert await rt.stop_processes() >= 1
                assert (await mine.wait(timeout=10)).exit_code == 137
                assert other.poll() is None, "the sweep killed a child of the host it did not start"
            finally:
                other.kill()
                other.wait()

    anyio.run(body)


def _no_thread(*args: object, **kwargs: object) -> object:
    raise AssertionError("handed to a worker thread")


def test_small_file_calls_run_inline_and_large_ones_in_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small regular file is written and read in the event loop's thread (no thread
    hand-off) while every mount is local; a larger one than the inline bounds, or any call
    while a mount may wait (FUSE, NFS...), goes to a worker thread, with the same bytes."""
    from runtimes.subprocess import mounts, runtime

    async def body() -> None:
        async with open_runtime("subprocess") as rt:
            with monkeypatch.context() as patched:
                # The decision under test, whatever this host mounts besides the workdir.
                patched.setattr(mounts.WATCH, "all_local", lambda: True)
                patched.setattr(runtime.anyio.to_thread, "run_sync", _no_thread)
                await rt.write("small.bin", b"s" * 1024)
                assert await rt.read("small.bin") == b"s" * 1024
                assert await rt.exists("small.bin")
            big = os.urandom(4096)
            with monkeypatch.context() as patched:
                patched.setattr(runtime, "INLINE_READ_BYTES", 1024)
                patched.setattr(runtime, "INLINE_WRITE_BYTES", 1024)
                await rt.write("big.bin", big)
                assert await rt.read("big.bin") == big
            with monkeypatch.context() as patched:
                patched.setattr(mounts.WATCH, "all_local", lambda: False)
                await rt.write("remote.bin", b"r" * 10)
                assert await rt.read("remote.bin") == b"r" * 10
                assert await rt.exists("remote.bin")

    anyio.run(body)


def test_reads_of_files_without_a_size_or_growing_are_whole() -> None:
    """A file whose ``fstat`` size is 0 (``/proc``) is read to its end, in a worker
    thread; the limit still holds for it."""
    from runtimes import OutputLimitExceededError

    async def body() -> None:
        async with open_runtime("subprocess") as rt:
            status = await rt.read("/proc/self/status")
            assert status.startswith(b"Name:") and b"\nPid:" in status
            with pytest.raises(OutputLimitExceededError):
                await rt.read("/proc/self/status", max_bytes=10)
            await rt.write("empty.bin", b"")
            assert await rt.read("empty.bin") == b""

    anyio.run(body)


def test_the_mount_table_decides_what_is_local() -> None:
    from runtimes.subprocess.mounts import all_local_types

    local = b"22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
    fuse = b"90 22 0:50 / /mnt/x rw,nosuid - fuse.sshfs host:/ rw,user_id=0\n"
    nfs = b"91 22 0:51 / /mnt/y rw - nfs4 server:/ rw\n"
    assert all_local_types(local)
    assert not all_local_types(local + fuse)
    assert not all_local_types(local + nfs)
    assert not all_local_types(b"garbage\n")
