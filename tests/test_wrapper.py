"""The exec wrapper (runtimes/scripts/exec.sh) under the host's /bin/sh and bash --posix,
and its report parser (runtimes/wrapper.py): every report branch, the launch modes, the
caller's environment, the cancel protocol of track mode."""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtimes import scripts
from runtimes.errors import (
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    SandboxUserNotFoundError,
    SandboxUserRefusedError,
)
from runtimes.models import ExecRequest
from runtimes.wrapper import (
    CONTROL_DIR,
    WRAPPER_FAILED,
    LaunchMode,
    ReportReader,
    UserSwitch,
    WrapperReport,
    check_argv_size,
    new_nonce,
    parse_report,
    report_error,
    spool_argv,
    wrapper_argv,
)

SHELLS = {"dash": ["/bin/sh"], "bash-posix": ["bash", "--posix"]}
SANDBOX_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
"""The environment the wrapper runs with: the sandbox's own, never the caller's."""
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.usefixtures("running_as_root")


@pytest.fixture
def running_as_root() -> None:
    """Switching users needs root; the suite runs as root (``make test``, CI)."""
    assert IS_ROOT, "the user-switch checks run as root, as make test and CI do"


@dataclass
class Ran:
    code: int
    stdout: bytes
    stderr: bytes
    report: WrapperReport | None
    preamble: bytes


def request(
    argv: list[str], cwd: str = "/", env: Mapping[str, str] | None = None, user: str | None = None
) -> ExecRequest:
    return ExecRequest(
        argv=tuple(argv),
        cwd=cwd,
        env=dict(env or {}),
        stdin=None,
        user=user,
        timeout=None,
        output_limit=1 << 20,
    )


def run(
    shell: str,
    req: ExecRequest,
    *,
    mode: LaunchMode = "wait",
    user: str | None = None,
    switch: UserSwitch = "setpriv",
    tools: tuple[str, ...] = (),
    nonce: str | None = None,
    prefix: list[str] | None = None,
    stdin: bytes = b"",
    argv: list[str] | None = None,
) -> Ran:
    nonce = nonce or new_nonce()
    full = argv or wrapper_argv(req, nonce, mode=mode, user=user, switch=switch, tools=tools)
    done = subprocess.run(
        [*(prefix or []), *SHELLS[shell], *full[1:]],
        input=stdin,
        capture_output=True,
        env=SANDBOX_ENV,
        cwd="/",
        timeout=20,
        check=False,
    )
    reader = ReportReader(nonce)
    after = reader.feed(done.stderr)
    return Ran(done.returncode, done.stdout, after, reader.report, reader.preamble)


def refused(ran: Ran, num: int, what: str) -> None:
    assert ran.report == WrapperReport(errno=num, what=what), ran
    assert ran.code == WRAPPER_FAILED and ran.stdout == b"" and ran.stderr == b"", ran


@pytest.fixture(params=sorted(SHELLS))
def shell(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    assert shutil.which(SHELLS[name][0]) is not None, f"{SHELLS[name][0]} is not installed"
    return name


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user can enter (pytest's tmp_path is private to its owner)."""
    path = Path(tempfile.mkdtemp(prefix="vf-wrapper-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _pgrp_and_sid() -> str:
    return 'read -r s </proc/$$/stat; set -- ${s##*) }; echo "$$ $3 $4"'


# ---------------------------------------------------------------------- ok and exit status


@pytest.mark.parametrize("mode", ["exec", "wait", "track"])
def test_ok_report_then_output_and_the_programs_status(shell: str, mode: LaunchMode) -> None:
    script = f"{_pgrp_and_sid()}; echo err >&2; exit 3"
    ran = run(shell, request(["sh", "-c", script]), mode=mode)
    assert ran.report is not None and ran.report.ok, ran
    assert ran.code == 3 and ran.stderr == b"err\n" and ran.preamble == b"", ran
    pid, pgrp, sid = ran.stdout.decode().split()
    if mode == "exec":
        assert int(pid) == ran.report.pgid  # the wrapper became the command
    else:
        assert int(pid) == int(pgrp) == int(sid) == ran.report.pgid  # its own session


@pytest.mark.parametrize("mode", ["wait", "track"])
@pytest.mark.parametrize("signal_number", [9, 15])
def test_death_by_signal_is_128_plus_n_without_the_shells_notice(
    shell: str, mode: LaunchMode, signal_number: int
) -> None:
    ran = run(shell, request(["sh", "-c", f"echo before >&2; kill -{signal_number} $$"]), mode=mode)
    assert ran.report is not None and ran.report.ok
    assert ran.code == 128 + signal_number, ran
    assert ran.stderr == b"before\n", "no 'Killed'/'Terminated' notice of the wrapper's"


def test_exec_mode_status_is_the_programs_own(shell: str) -> None:
    ran = run(shell, request(["sh", "-c", "kill -9 $$"]), mode="exec")
    assert ran.code == -9 and ran.report is not None and ran.report.ok


@pytest.mark.parametrize("mode", ["exec", "wait"])
def test_stdin_reaches_the_command(shell: str, mode: LaunchMode) -> None:
    data = os.urandom(200_000)
    ran = run(shell, request(["cat"]), mode=mode, stdin=data)
    assert ran.code == 0 and ran.stdout == data


# ---------------------------------------------------------------------- refusals


def test_missing_cwd(shell: str, tmp_path: Path) -> None:
    ran = run(shell, request(["true"], cwd=str(tmp_path / "missing")))
    refused(ran, errno.ENOENT, "cwd")


def test_cwd_that_is_a_file(shell: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    refused(run(shell, request(["true"], cwd=str(tmp_path / "file"))), errno.ENOTDIR, "cwd")


def test_cwd_without_search_permission(shell: str, public_dir: Path) -> None:
    locked = public_dir / "locked"
    locked.mkdir(mode=0o700)
    if not IS_ROOT:
        locked.chmod(0o000)
    prefix = NOBODY if IS_ROOT else None
    refused(run(shell, request(["true"], cwd=str(locked)), prefix=prefix), errno.EACCES, "cwd")
    locked.chmod(0o700)


@pytest.mark.parametrize("mode", ["exec", "wait"])
def test_program_refusals(shell: str, tmp_path: Path, mode: LaunchMode) -> None:
    (tmp_path / "plain").write_text("#!/bin/sh\n")
    (tmp_path / "dir").mkdir()
    cwd = str(tmp_path)
    cases = [
        (["/usr/bin/vf-missing"], {}, errno.ENOENT),
        (["vf-missing-program"], {}, errno.ENOENT),
        ([str(tmp_path / "plain")], {}, errno.EACCES),
        (["./plain"], {}, errno.EACCES),
        (["plain"], {"PATH": str(tmp_path)}, errno.EACCES),
        ([str(tmp_path / "dir")], {}, errno.EISDIR),
        (["dir"], {"PATH": str(tmp_path)}, errno.ENOENT),  # directories are skipped
        (["ls"], {"PATH": ""}, errno.ENOENT),
    ]
    for argv, env, num in cases:
        refused(run(shell, request(argv, cwd=cwd, env=env), mode=mode), num, "prog")


def test_path_search_like_execvp(shell: str, tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "tool").write_text("#!/bin/sh\necho first\n")  # not executable: skipped
    (second / "tool").write_text("#!/bin/sh\necho second\n")
    (second / "tool").chmod(0o755)
    (tmp_path / "here").write_text("#!/bin/sh\necho here\n")
    (tmp_path / "here").chmod(0o755)
    env = {"PATH": f"{first}:{second}"}
    assert run(shell, request(["tool"], env=env)).stdout == b"second\n"
    # an empty entry is the working directory, as for execvp
    for path in (f":{first}", f"{first}::/nowhere"):
        ran = run(shell, request(["here"], cwd=str(tmp_path), env={"PATH": path}))
        assert ran.stdout == b"here\n", (path, ran)


def test_unknown_user(shell: str) -> None:
    refused(run(shell, request(["id"]), user="vf-no-such-user"), errno.EINVAL, "user")


@needs_root
def test_a_user_other_than_the_wrappers_needs_root(shell: str) -> None:
    refused(run(shell, request(["id"]), user="root", prefix=NOBODY), errno.EACCES, "user")


@needs_root
@pytest.mark.parametrize("switch", ["setpriv", "runuser"])
@pytest.mark.parametrize("mode", ["exec", "wait", "track"])
def test_user_switch(shell: str, switch: UserSwitch, mode: LaunchMode) -> None:
    env = {"VF_X": "kept", "weird.name": "odd"}
    req = request(["sh", "-c", "id -u; echo $VF_X"], env=env)
    ran = run(shell, req, user="nobody", switch=switch, mode=mode)
    assert ran.code == 0 and ran.stdout == b"65534\nkept\n", ran
    ran = run(shell, request(["id", "-u"]), user="root", switch=switch, mode=mode)
    assert ran.stdout == b"0\n", "the wrapper's own user: no switch"


@needs_root
def test_no_setpriv_or_runuser(shell: str, tmp_path: Path) -> None:
    (tmp_path / "id").symlink_to(shutil.which("id") or "/usr/bin/id")
    ran = run(shell, request(["id"]), user="nobody", tools=(str(tmp_path),))
    refused(ran, errno.EOPNOTSUPP, "user")


def test_no_setsid(shell: str, tmp_path: Path) -> None:
    refused(run(shell, request(["true"]), tools=(str(tmp_path),)), errno.EOPNOTSUPP, "setsid")
    assert run(shell, request(["true"]), tools=(str(tmp_path),), mode="exec").code == 0


# ---------------------------------------------------------------------- the caller's environment


@pytest.mark.parametrize("mode", ["exec", "wait", "track"])
def test_caller_env_cannot_derail_the_wrapper(shell: str, tmp_path: Path, mode: LaunchMode) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # env(1) under another name, found only through the caller's PATH; not a shell, which
    # would drop or reset some names itself
    (bin_dir / "show-env").symlink_to(shutil.which("env") or "/usr/bin/env")
    env = {
        "IFS": "x/",
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "CDPATH": "/tmp",
        "__vf_x": "kept",
        "__vf_n": "N",
        "__vf_code": "exit 9",
        "__vf_env": "E",
        "n": "N2",
        "weird.name": "a b",
        "quote": 'it\'s "$HOME" `x` \\ \n2nd line',
    }
    ran = run(shell, request(["show-env"], cwd=str(tmp_path), env=env), mode=mode)
    assert ran.report is not None and ran.report.ok and ran.code == 0, ran
    out = "\n" + ran.stdout.decode()
    for name, value in env.items():
        assert f"\n{name}={value}\n" in out, (name, out)
    (bin_dir / "bare").write_text("#!/bin/sh\necho bare\n")
    (bin_dir / "bare").chmod(0o755)
    odd = {"PATH": "/nowhere", "weird.name": "x"}
    ran = run(shell, request([str(bin_dir / "bare")], env=odd), mode=mode)
    assert ran.code == 0 and ran.stdout == b"bare\n", "tools never come from the caller's PATH"


@pytest.mark.parametrize("mode", ["exec", "wait"])
def test_an_environment_over_128_kib_in_all(shell: str, mode: LaunchMode) -> None:
    """One argument per variable: only one string over 128 KiB is over the kernel's limit."""
    env = {"A": "a" * 100_000, "B": "b" * 100_000, "odd-name": "c" * 100_000}
    req = request(["sh", "-c", 'printf "%s %s" ${#A} ${#B}'], env=env)
    ran = run(shell, req, mode=mode)
    assert ran.code == 0 and ran.stdout == b"100000 100000", ran.stderr


def test_malformed_arguments_are_refused(shell: str) -> None:
    argv = wrapper_argv(request(["true"]), "n1", mode="wait")
    refused(run(shell, request(["true"]), nonce="n1", argv=[*argv[:12], "x", "true"]), 22, "argv")
    refused(run(shell, request(["true"]), nonce="n1", argv=[*argv[:12], "3", "a"]), 22, "argv")


# ---------------------------------------------------------------------- spooled arguments


def test_spooled_arguments(shell: str, tmp_path: Path) -> None:
    nonce = new_nonce()
    big = ["x" * 50_000, "it's", "", "$HOME"]
    req = request(["printf", "%s|", *big], env={"BIG": "v" * 70_000, "a.b": "c"})
    path = str(tmp_path / f"{nonce}.args")
    short, content = spool_argv(wrapper_argv(req, nonce, mode="wait"), path)
    Path(path).write_bytes(content)
    assert sum(len(a) for a in short) < 20_000
    ran = run(shell, req, nonce=nonce, argv=short)
    assert ran.code == 0 and ran.stdout == "|".join(big).encode() + b"|", ran.stderr
    assert not Path(path).exists(), "the wrapper removes the spooled arguments"
    refused(run(shell, req, nonce=nonce, argv=short), errno.EINVAL, "argv")


# ---------------------------------------------------------------------- track mode: cancel


_KILLER = """f=$1
: >"$f.cancel"
if [ -s "$f.pgid" ]; then
  read -r g <"$f.pgid" && { kill -s KILL -- "$g" 2>/dev/null; kill -s KILL -- "-$g" 2>/dev/null; }
  rm -f "$f.pgid" "$f.cancel"
fi
"""
"""Modal's side of the protocol: cancel marker first, then the group id."""


@pytest.fixture(autouse=True)
def control_dir() -> None:
    """Modal's sandboxes have it from their first exec; the killer does not make it."""
    os.makedirs(CONTROL_DIR, exist_ok=True)
    if os.stat(CONTROL_DIR).st_uid == os.geteuid():
        os.chmod(CONTROL_DIR, 0o1777)


def _track(shell: str, nonce: str, witness: Path) -> subprocess.Popen[bytes]:
    req = request(["sh", "-c", f"touch {witness}; sleep 30"])
    argv = wrapper_argv(req, nonce, mode="track")
    return subprocess.Popen(
        [*SHELLS[shell], *argv[1:]],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=SANDBOX_ENV,
    )


def test_cancel_before_start_runs_nothing(shell: str, tmp_path: Path) -> None:
    nonce = new_nonce()
    marker = Path(CONTROL_DIR, f"{nonce}.cancel")
    marker.touch()
    witness = tmp_path / "ran"
    proc = _track(shell, nonce, witness)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 137 and not witness.exists()
    assert ReportReader(nonce).feed(err) == b"" and not marker.exists()


def test_cancel_kills_the_running_group_and_cleans_up(shell: str, tmp_path: Path) -> None:
    nonce = new_nonce()
    witness = tmp_path / "ran"
    proc = _track(shell, nonce, witness)
    pgid_file = Path(CONTROL_DIR, f"{nonce}.pgid")
    deadline = time.monotonic() + 10
    while not witness.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    subprocess.run(["sh", "-c", _KILLER, "sh", f"{CONTROL_DIR}/{nonce}"], check=True)
    proc.communicate(timeout=10)
    assert proc.returncode == 137
    assert not pgid_file.exists() and not Path(CONTROL_DIR, f"{nonce}.cancel").exists()


def test_cancel_at_any_moment_never_leaves_the_command_running(shell: str, tmp_path: Path) -> None:
    """The killer runs at random moments around the launch: either the group is killed or
    the command never starts; the wrapper never outlives the cancel by the command's sleep."""
    rng = random.Random(17)
    for attempt in range(12):
        nonce = new_nonce()
        proc = _track(shell, nonce, tmp_path / f"ran{attempt}")
        time.sleep(rng.uniform(0, 0.02))
        subprocess.run(["sh", "-c", _KILLER, "sh", f"{CONTROL_DIR}/{nonce}"], check=True)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"attempt {attempt}: the command ran on after the cancel")
        assert proc.returncode == 137, attempt
        for leftover in ("pgid", "cancel"):
            Path(CONTROL_DIR, f"{nonce}.{leftover}").unlink(missing_ok=True)


# ---------------------------------------------------------------------- parser


def test_parse_report() -> None:
    assert parse_report(b"vf-sandbox-abc:ok:42\n", "abc") == WrapperReport(pgid=42)
    assert parse_report(b"vf-sandbox-abc:2:cwd", "abc") == WrapperReport(errno=2, what="cwd")
    for forged in (
        b"vf-sandbox-abd:ok:42",
        b"vf-sandbox-ab:ok:42",
        b"xvf-sandbox-abc:ok:42",
        b"vf-sandbox-abc:ok:0",
        b"vf-sandbox-abc:ok:-1",
        b"vf-sandbox-abc:ok:42:1",
        b"vf-sandbox-abc:2:elsewhere",
        b"vf-sandbox-abc:x:cwd",
        b"vf-sandbox-abc:",
        b"vf-sandbox-abc:ok",
    ):
        assert parse_report(forged, "abc") is None, forged


def test_reader_takes_chunks_of_any_size() -> None:
    stream = b"login noise\nvf-sandbox-other:ok:1\nvf-sandbox-n1:ok:77\ncommand's stderr\n"
    for size in (1, 2, 3, 7, len(stream)):
        reader = ReportReader("n1")
        out = b"".join(reader.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        assert reader.report == WrapperReport(pgid=77), size
        assert reader.preamble == b"login noise\nvf-sandbox-other:ok:1\n"
        assert out == b"command's stderr\n"


def test_reader_passes_everything_after_the_report() -> None:
    reader = ReportReader("n1")
    first = reader.feed(b"vf-sandbox-n1:ok:5")
    early = reader.done
    second = reader.feed(b"\nvf-sandbox-n1:2:prog\n")
    assert (first, early, second) == (b"", False, b"vf-sandbox-n1:2:prog\n")
    assert reader.report == WrapperReport(pgid=5)
    assert reader.feed(b"more") == b"more"


def test_reader_skips_lines_with_the_tag_that_are_no_report() -> None:
    reader = ReportReader("n1")
    assert reader.feed(b"vf-sandbox-n1:garbage\nvf-sandbox-n1:" + b"9" * 200) == b""
    assert reader.feed(b"\nvf-sandbox-n1:13:user\nafter") == b"after"
    assert reader.report == WrapperReport(errno=13, what="user")


def test_reader_gives_up_after_its_limit() -> None:
    reader = ReportReader("n1", limit=100)
    reader.feed(b"x" * 150)
    assert reader.gave_up and reader.report is None and reader.held == b"x" * 150
    assert reader.feed(b"vf-sandbox-n1:ok:5\n") == b"" and reader.report is None


def test_wrapper_refuses_odd_nonces() -> None:
    with pytest.raises(ValueError):
        wrapper_argv(request(["true"]), "a;b", mode="exec")


def test_control_dir_matches_the_script() -> None:
    assert f"{CONTROL_DIR}/$__vf_n" in scripts.load("exec")


# ---------------------------------------------------------------------- typed errors


def test_report_errors_are_typed() -> None:
    req = request(["prog"], cwd="/work/x", user="bob")
    cases: list[tuple[int, str, type[SandboxError], str]] = [
        (errno.ENOENT, "cwd", SandboxFileNotFoundError, "working directory"),
        (errno.ENOTDIR, "cwd", SandboxNotADirectoryError, "working directory"),
        (errno.EACCES, "cwd", SandboxPermissionError, "working directory"),
        (errno.ENOENT, "prog", SandboxFileNotFoundError, "program not found in PATH"),
        (errno.EACCES, "prog", SandboxPermissionError, "not executable"),
        (errno.EISDIR, "prog", SandboxPermissionError, "is a directory"),
        (errno.E2BIG, "prog", SandboxInvalidArgumentError, "argument list too long"),
        (errno.EINVAL, "user", SandboxUserNotFoundError, "no such user in the sandbox: 'bob'"),
        (errno.EACCES, "user", SandboxUserRefusedError, "cannot run as user 'bob'"),
        (errno.EOPNOTSUPP, "user", SandboxUserRefusedError, "no setpriv or runuser"),
        (errno.EINVAL, "argv", SandboxError, "spooled argv"),
        (errno.EOPNOTSUPP, "setsid", SandboxError, "setsid"),
    ]
    for num, what, cls, fragment in cases:
        err = report_error(num, what, req)
        assert type(err) is cls and fragment in str(err), (num, what, err)
    path_err = report_error(errno.ENOENT, "prog", request(["/bin/x"]))
    assert "in PATH" not in str(path_err) and "/bin/x" in str(path_err)


def test_argv_size_limits() -> None:
    check_argv_size(["true", "x" * 1000], {"A": "b"})
    with pytest.raises(SandboxInvalidArgumentError, match="128 KiB"):
        check_argv_size(["true", "y" * 200_000], {})
    with pytest.raises(SandboxInvalidArgumentError, match="128 KiB"):
        check_argv_size(["true"], {"BIG": "v" * 200_000})
    with pytest.raises(SandboxInvalidArgumentError, match="stdin or a file"):
        check_argv_size(["true", *(["x" * 100_000] * 25)], {})
