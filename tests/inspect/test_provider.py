"""The ``vf`` inspect provider beyond inspect's self-check: its config forms, how vf-sandbox's
typed errors map onto inspect's contract, ``connection()``, and the life cycle around
samples: ``task_cleanup`` closing what interrupted samples left, ``--no-sandbox-cleanup``
leaving sandboxes for the user, and ``inspect sandbox cleanup vf`` sweeping them."""

from __future__ import annotations

import json
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import docker
import docker.errors
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from inspect_ai.util import OutputLimitExceededError, SandboxEnvironmentSpec
from inspect_ai.util import SandboxUnavailableError as InspectUnavailableError
from inspect_ai.util._sandbox.environment import SandboxUserUnsupportedError

from runtimes import RuntimeConfigError, open_runtime
from runtimes.cleanup import list_target
from runtimes.inspect_sandbox import INSPECT_LABEL, TASK_LABEL, VfSandboxEnvironment, load_config
from runtimes.reaper import drain_removals

pytestmark = pytest.mark.anyio

IMAGE = "vf-sandbox/base:bookworm"
DOCKER = {"type": "docker", "image": IMAGE}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def sample(config: Any, task: str = "provider_test") -> VfSandboxEnvironment:
    envs = await VfSandboxEnvironment.sample_init(task, load_config(config), {})
    return envs["default"].as_type(VfSandboxEnvironment)


async def cleanup(env: VfSandboxEnvironment, config: Any, task: str = "provider_test") -> None:
    await VfSandboxEnvironment.sample_cleanup(task, load_config(config), {"default": env}, False)


# ---------------------------------------------------------------------- config forms


def test_config_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_config(None).type == "subprocess"
    assert load_config("docker").type == "docker"
    assert load_config(DOCKER) == load_config(dict(DOCKER))
    Path("sb.yaml").write_text(f"type: docker\nimage: {IMAGE}\nenv: {{A: b}}\n")
    Path("sb.json").write_text(json.dumps({**DOCKER, "env": {"A": "b"}}))
    assert load_config("sb.yaml") == load_config("sb.json")
    assert dict(load_config("sb.yaml").env) == {"A": "b"}


def test_bad_configs_are_typed_errors_naming_the_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeConfigError, match=r"missing\.yaml"):
        load_config("missing.yaml")
    Path("bad.yaml").write_text("type: [docker\n")
    with pytest.raises(RuntimeConfigError, match="malformed"):
        load_config("bad.yaml")
    Path("list.json").write_text("[1, 2]")
    with pytest.raises(RuntimeConfigError, match="mapping"):
        load_config("list.json")
    with pytest.raises(RuntimeConfigError, match="nmae_prefix"):
        load_config({**DOCKER, "nmae_prefix": "x"})


def test_a_spec_with_a_dict_config_round_trips_through_inspects_serialisation() -> None:
    spec = SandboxEnvironmentSpec("vf", {**DOCKER, "labels": {"team": "a"}})  # type: ignore[arg-type]
    assert spec.config == load_config({**DOCKER, "labels": {"team": "a"}})
    again = SandboxEnvironmentSpec.model_validate(json.loads(spec.model_dump_json()))
    assert again == spec and hash(again) == hash(spec)  # inspect keys its caches on specs


async def test_task_init_refuses_a_bad_config_before_any_sample() -> None:
    with pytest.raises(RuntimeConfigError):
        await VfSandboxEnvironment.task_init("t", "no-such-file.yaml")


# ---------------------------------------------------------------------- exec and files


async def test_exec_maps_vf_errors_onto_inspects_contract(tmp_path: Path) -> None:
    env = await sample({"type": "subprocess"})
    try:
        missing = await env.exec(["no-such-program-xyz", "arg"])
        assert (missing.success, missing.returncode) == (False, 127)
        assert "no-such-program-xyz" in missing.stderr
        no_cwd = await env.exec(["true"], cwd="no/such/dir")
        assert (no_cwd.success, no_cwd.returncode) == (False, 126)
        assert "no/such/dir" in no_cwd.stderr
        with pytest.raises(PermissionError):  # inspect: a non-executable file raises
            await env.exec(["/etc/passwd"])
        mixed = await env.exec(["sh", "-c", "printf 'a\\377b'; printf 'e' >&2; exit 3"])
        assert (mixed.returncode, mixed.stdout, mixed.stderr) == (3, "a\ufffdb", "e")
    finally:
        await cleanup(env, {"type": "subprocess"})
    with pytest.raises(InspectUnavailableError):
        await env.exec(["true"])
    with pytest.raises(InspectUnavailableError):
        await env.read_file("x")


async def test_a_missing_program_and_a_missing_cwd_are_told_apart_by_their_whole_path() -> None:
    """127 only when the error names the program itself: a missing cwd ending in the
    program's name (same basename) is still a missing cwd (126)."""
    config = {"type": "subprocess"}
    env = await sample(config)
    try:
        await env.exec(["mkdir", "bin"])
        gone = f"{env.runtime.workdir}/gone"
        cases: list[tuple[list[str], str | None, int, str]] = [
            (["ls"], "sub/ls", 126, "sub/ls"),
            (["sub/ls"], "sub/ls", 126, "sub/ls"),  # both missing: the cwd is entered first
            ([gone], gone, 126, gone),  # an absolute program that is the missing cwd
            (["no-such-prog"], None, 127, "no-such-prog"),
            (["./no-such-prog"], None, 127, "./no-such-prog"),  # relative, and missing
            (["./no-such-prog"], "bin", 127, "./no-such-prog"),  # relative to an existing cwd
        ]
        for cmd, cwd, code, named in cases:
            result = await env.exec(cmd, cwd=cwd)
            assert (result.success, result.returncode) == (False, code), (cmd, cwd, result)
            assert named in result.stderr, (cmd, cwd, result)
        assert (await env.exec(["ls"], cwd="bin")).returncode == 0  # the cases ran where meant
    finally:
        await cleanup(env, config)


async def test_per_stream_output_limit_keeps_the_limit_and_kills_the_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from inspect_ai.util import SandboxEnvironmentLimits

    monkeypatch.setattr(SandboxEnvironmentLimits, "MAX_EXEC_OUTPUT_SIZE", 64 * 1024)
    monkeypatch.setattr(SandboxEnvironmentLimits, "MAX_EXEC_OUTPUT_SIZE_STR", "64 KiB")
    env = await sample({"type": "subprocess"})
    try:
        # 60 KiB on each stream fits: the limit is per stream, as inspect's
        both = await env.exec(["sh", "-c", "head -c 61440 /dev/zero; head -c 61440 /dev/zero >&2"])
        assert (len(both.stdout), len(both.stderr)) == (61440, 61440)
        marker = "vf-flood-7f3a"
        with pytest.raises(OutputLimitExceededError) as caught:
            await env.exec(["sh", "-c", f"yes {marker} >&2; :"], timeout=60)
        assert caught.value.limit_str == "64 KiB"
        kept = caught.value.truncated_output or ""
        assert len(kept) == 64 * 1024 and kept.startswith(marker)
        left = await env.exec(["sh", "-c", f"ps -eo args | grep -c '^yes {marker}' || true"])
        assert left.stdout.strip() == "0"
    finally:
        await cleanup(env, {"type": "subprocess"})


@pytest.mark.docker
async def test_a_non_root_docker_sandbox_refuses_root_as_inspect_asks() -> None:
    config = {**DOCKER, "user": "nobody"}
    env = await sample(config)
    try:
        with pytest.raises(SandboxUserUnsupportedError, match="nobody"):
            await env.exec(["id"], user="root")
        unknown = await env.exec(["id"], user="no-such-user-xyz")
        assert not unknown.success and "no-such-user-xyz" in unknown.stderr
        assert (await env.exec(["id", "-un"])).stdout == "nobody\n"
    finally:
        await cleanup(env, config)


# ---------------------------------------------------------------------- connection


@pytest.mark.docker
async def test_connection_is_a_command_that_gets_into_the_sandbox() -> None:
    env = await sample(DOCKER)
    try:
        await env.write_file("here.txt", "inside\n")
        connection = await env.connection()
        assert connection.type == "vf-docker"
        assert connection.container == env.runtime.sandbox_id
        argv = [arg for arg in shlex.split(connection.command) if arg != "-t"]  # no terminal here
        with anyio.fail_after(60):
            shell = await anyio.run_process(argv, input=b"pwd; cat here.txt\n")
        assert shell.stdout == b"/work\ninside\n"
        with pytest.raises(NotImplementedError):
            await env.connection(user="root")
    finally:
        await cleanup(env, DOCKER)
    with pytest.raises(ConnectionError):
        await env.connection()


# ---------------------------------------------------------------------- life cycle


def inspect_containers(task: str) -> list[Any]:
    client = docker.from_env()
    return client.containers.list(all=True, filters={"label": f"{TASK_LABEL}={task}"})


@pytest.mark.docker
async def test_task_cleanup_closes_sandboxes_whose_sample_cleanup_never_ran() -> None:
    task = "interrupted_task"
    config = load_config(DOCKER)
    other = load_config({**DOCKER, "env": {"OTHER": "1"}})
    first = await sample(config, task)
    second = await sample(other, task)
    try:
        assert len(inspect_containers(task)) == 2
        await VfSandboxEnvironment.task_cleanup("shutdown", config, True)
        assert first.runtime.closed and not second.runtime.closed  # only this config's
        await drain_removals()
        assert [c.id for c in inspect_containers(task)] == [second.runtime.sandbox_id]
    finally:
        await VfSandboxEnvironment.task_cleanup("shutdown", other, True)
    await drain_removals()
    assert second.runtime.closed and inspect_containers(task) == []


CHILD = textwrap.dedent(
    """
    import sys, anyio
    from runtimes.inspect_sandbox import VfSandboxEnvironment, load_config

    async def main() -> None:
        config = load_config({"type": "docker", "image": sys.argv[1]})
        envs = await VfSandboxEnvironment.sample_init(sys.argv[2], config, {})
        env = envs["default"]
        await env.exec(["sh", "-c", "echo kept > kept.txt"])
        await VfSandboxEnvironment.task_cleanup("shutdown", config, False)
        print(env.runtime.sandbox_id, flush=True)

    anyio.run(main)
    """
)


async def no_cleanup_eval(task: str) -> str:
    """A process that opens a sample's sandbox, ends the task with ``cleanup=False`` (inspect's
    ``--no-sandbox-cleanup``) and exits; returns the sandbox's id."""
    with anyio.fail_after(120):
        done = await anyio.run_process([sys.executable, "-c", CHILD, IMAGE, task], cwd=REPO)
    stderr = done.stderr.decode()
    assert "left" in stderr and "inspect sandbox cleanup vf" in stderr, stderr
    return done.stdout.decode().strip()


@pytest.mark.docker
async def test_no_sandbox_cleanup_leaves_the_sandbox_and_cli_cleanup_removes_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    task = "no_cleanup_task"
    left = await no_cleanup_eval(task)
    [container] = inspect_containers(task)
    assert container.id == left and container.status == "running"
    assert container.labels[INSPECT_LABEL] == "true"
    async with open_runtime({**DOCKER, "container": left}) as attached:
        assert await attached.read("kept.txt") == b"kept\n"  # the sample's world, as it was
    live = await sample(DOCKER, task)  # this process is alive: its sandbox is spared
    try:
        await VfSandboxEnvironment.cli_cleanup(None)
        assert f"removed: docker sandbox {left}" in capsys.readouterr().out
        assert [c.id for c in inspect_containers(task)] == [live.runtime.sandbox_id]
    finally:
        await cleanup(live, DOCKER, task)
    by_id = await no_cleanup_eval(task)
    await VfSandboxEnvironment.cli_cleanup(by_id[:12])
    assert f"removed docker sandbox {by_id}" in capsys.readouterr().out
    await drain_removals()
    assert inspect_containers(task) == []
    with pytest.raises(docker.errors.NotFound):
        docker.from_env().containers.get(by_id)


ENDING_EVAL = textwrap.dedent(
    """
    import sys, anyio
    from runtimes.inspect_sandbox import VfSandboxEnvironment, load_config

    async def main() -> None:
        task = sys.argv[1]
        kept = load_config({"type": "subprocess", "keep": True})
        plain = load_config({"type": "subprocess"})
        kept_envs = await VfSandboxEnvironment.sample_init(task, kept, {})
        plain_envs = await VfSandboxEnvironment.sample_init(task, plain, {})
        ids = [envs["default"].runtime.sandbox_id for envs in (kept_envs, plain_envs)]
        print(*ids, flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)  # running until told to end
        await VfSandboxEnvironment.sample_cleanup(task, kept, kept_envs, False)  # keep=True
        await VfSandboxEnvironment.task_cleanup("shutdown", plain, False)  # --no-sandbox-cleanup

    anyio.run(main)
    """
)


async def subprocess_sandbox_ids() -> set[str]:
    _, _, found = await list_target("subprocess")
    return {info.id for info in found}


async def test_cli_cleanup_spares_a_running_evals_sandboxes_and_removes_an_ended_evals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without an id: every sandbox of a running eval survives, kept (``keep=True``) or not;
    once that eval has ended, its ``keep=True`` sandbox and the one ``--no-sandbox-cleanup``
    left both go."""
    argv = [sys.executable, "-c", ENDING_EVAL, "ending_eval_task"]
    with anyio.fail_after(120):
        async with await anyio.open_process(argv, cwd=REPO) as child:
            assert child.stdout is not None and child.stdin is not None
            line = await BufferedByteReceiveStream(child.stdout).receive_until(b"\n", 4096)
            kept_id, plain_id = line.decode().split()
            try:
                await VfSandboxEnvironment.cli_cleanup(None)
                assert {kept_id, plain_id} <= await subprocess_sandbox_ids()
            finally:
                await child.stdin.send(b"\n")
                assert await child.wait() == 0
    assert {kept_id, plain_id} <= await subprocess_sandbox_ids()  # the eval left both
    capsys.readouterr()
    await VfSandboxEnvironment.cli_cleanup(None)
    out = capsys.readouterr().out
    assert f"removed: subprocess sandbox {kept_id}" in out, out
    assert f"removed: subprocess sandbox {plain_id}" in out, out
    assert not {kept_id, plain_id} & await subprocess_sandbox_ids()


async def test_sandboxes_of_concurrent_samples_are_apart() -> None:
    config = {"type": "subprocess"}
    envs = [await sample(config) for _ in range(3)]
    try:
        async with anyio.create_task_group() as tg:
            for i, env in enumerate(envs):
                tg.start_soon(env.write_file, "who.txt", str(i))
        assert [await env.read_file("who.txt") for env in envs] == ["0", "1", "2"]
        assert len({env.runtime.workdir for env in envs}) == 3
    finally:
        for env in envs:
            await cleanup(env, config)


async def test_subprocess_commands_take_inspects_subprocess_limit() -> None:
    """As inspect's local sandbox: with ``max_subprocesses=1`` concurrent commands run one at a
    time (each holds a lock directory that a concurrent one would find taken); with
    ``concurrency=False`` they overlap."""
    from inspect_ai.util._concurrency import init_concurrency
    from inspect_ai.util._subprocess import init_max_subprocesses

    config = {"type": "subprocess"}
    env = await sample(config)
    hold = ["sh", "-c", "mkdir held || exit 9; sleep 0.3; rmdir held"]
    codes: list[int] = []

    async def run(concurrency: bool) -> None:
        codes.append((await env.exec(hold, concurrency=concurrency)).returncode)

    try:
        init_concurrency()  # inspect's limiters are created once per eval; start afresh, as it does
        init_max_subprocesses(1)
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(run, True)
        assert codes == [0, 0, 0]
        codes.clear()
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(run, False)
        assert sorted(codes) == [0, 9, 9]
    finally:
        init_concurrency()
        init_max_subprocesses()
        await cleanup(env, config)
