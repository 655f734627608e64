"""Checking an install against the wheels the host meant to install.

The host knows what it uploaded: every wheel of the wheelhouse carries
``*.dist-info/RECORD``, a list of its files with their sha256 and size. After pip ran in the
sandbox, :func:`verify_install` has the sandbox's own interpreter (``python -I -S``, cwd
``/``: nothing of the venv or of the policy's directories on ``sys.path``) open each of
those paths under the venv without following a link at any component (``O_NOFOLLOW``
from the venv down), check that it is a regular file with one link, owned by the account
that installed it, hash it, and report. The host compares: a missing file, a link, a
different size or hash is :class:`~harnesses.errors.HarnessInstallError`. So a step the
sandbox could influence (a pip, a ``.pth`` or a module the policy planted, a process that
rewrites the venv while pip runs) cannot leave an agent other than the wheel's.

Which wheels were installed is read from the venv (``*.dist-info`` directories in
site-packages), then held to the host's list: every pinned requirement (``name==...``)
must be installed from the wheelhouse, and every installed distribution must come from
the wheelhouse, except the bootstrap that ``python -m venv`` put there (``pip``,
``setuptools``, ``wheel``). A ``.pth`` file in site-packages (code every start of the
venv's Python runs) must be one a verified wheel installed, or setuptools'
``distutils-precedence.pth``.

Not checked: entries without a hash (``RECORD`` itself, signatures), the
``<name>.data/scripts`` and ``headers`` entries (pip rewrites a script's ``#!`` line and
places headers outside the venv's lib), files pip writes itself (``INSTALLER``,
``REQUESTED``, the installed ``RECORD``, bytecode, console scripts). Those are covered by
the tree digest taken after this check (:mod:`harnesses.installed`).
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import re
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from runtimes import Runtime
from runtimes.machinery import isolated_python, run_machinery

from .errors import HarnessInstallError

__all__ = ["RecordEntry", "WheelRecord", "read_wheelhouse", "verify_install"]

_BOOTSTRAP = frozenset({"pip", "setuptools", "wheel"})
_BOOTSTRAP_PTH = frozenset({"distutils-precedence.pth"})
_ALGORITHMS = frozenset({"sha256", "sha384", "sha512"})
_REPORT_LIMIT = 64 * 1024 * 1024

# Run as ``python -I -S -c VERIFY`` with the request as JSON on stdin: {"venv": path,
# "files": [[where, relative path, algorithm], ...]} (where: "site" or "venv"). Answers
# {"site": <site-packages, relative to the venv>, "dists": [...], "pth": [...],
# "files": [[status, size, hexdigest], ...]} on stdout.
_VERIFY = r"""
import errno, hashlib, json, os, stat, sys
request = json.load(sys.stdin)
site = "lib/python%d.%d/site-packages" % sys.version_info[:2]
flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
me = os.geteuid()
root = os.open(request["venv"], flags | os.O_DIRECTORY)
def opened(rel, last):
    fd, opened_dirs = root, []
    try:
        parts = rel.split("/")
        for part in parts[:-1]:
            fd = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            opened_dirs.append(fd)
        return os.open(parts[-1], flags | last, dir_fd=fd)
    finally:
        for d in opened_dirs:
            os.close(d)
def status(exc):
    if exc.errno == errno.ENOENT:
        return "missing"
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return "link"
    return "error %d" % exc.errno
def check(where, rel, algorithm):
    try:
        fd = opened(rel if where == "venv" else site + "/" + rel, os.O_NONBLOCK)
    except OSError as exc:
        return [status(exc), 0, ""]
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ["not a regular file", 0, ""]
        if st.st_nlink != 1:
            return ["hard-linked", 0, ""]
        if st.st_uid != me:
            return ["owned by uid %d" % st.st_uid, 0, ""]
        digest = hashlib.new(algorithm)
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            digest.update(chunk)
        return ["ok", st.st_size, digest.hexdigest()]
    finally:
        os.close(fd)
try:
    site_fd = opened(site, os.O_DIRECTORY)
except OSError as exc:
    print(json.dumps({"error": site + ": " + status(exc)}))
    sys.exit(0)
names = sorted(os.listdir(site_fd))
os.close(site_fd)
print(json.dumps({
    "site": site,
    "dists": [n for n in names if n.endswith(".dist-info")],
    "pth": [n for n in names if n.endswith(".pth")],
    "files": [check(*item) for item in request["files"]],
}))
"""


@dataclass(frozen=True)
class RecordEntry:
    """One file a wheel installs: where (``site``: site-packages, ``venv``: the venv's
    root), its path there, and its hash and size from the wheel's ``RECORD``."""

    where: str
    path: str
    algorithm: str
    digest: str  # hex
    size: int | None


@dataclass(frozen=True)
class WheelRecord:
    """A wheel of the wheelhouse: its ``.dist-info`` directory name and checked files."""

    wheel: str
    dist_info: str
    entries: list[RecordEntry] = field(default_factory=list)

    @property
    def project(self) -> str:
        return project_of(self.dist_info)


def canonical_name(name: str) -> str:
    """A project name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(dist_info: str) -> str:
    """The canonical project name of a ``<name>-<version>.dist-info`` directory."""
    return canonical_name(dist_info.removesuffix(".dist-info").rsplit("-", 1)[0])


def read_wheelhouse(wheelhouse: Path) -> list[WheelRecord]:
    """Every wheel's ``RECORD`` in ``wheelhouse``, as the files it installs (blocking).

    Raises:
        HarnessInstallError: a wheel is no zip, has no single ``RECORD``, or a ``RECORD``
            line is malformed or names a path outside the install.
    """
    records = []
    for wheel in sorted(wheelhouse.glob("*.whl")):
        try:
            with zipfile.ZipFile(wheel) as archive:
                names = [
                    n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)
                ]
                if len(names) != 1:
                    raise HarnessInstallError(f"wheel {wheel.name} has {len(names)} RECORD files")
                text = archive.read(names[0]).decode("utf-8")
        except (zipfile.BadZipFile, OSError, UnicodeDecodeError) as exc:
            raise HarnessInstallError(f"cannot read the RECORD of {wheel.name}: {exc}") from exc
        dist_info = names[0].split("/", 1)[0]
        records.append(
            WheelRecord(wheel.name, dist_info, list(_entries(wheel.name, dist_info, text)))
        )
    return records


def _entries(wheel: str, dist_info: str, text: str) -> Iterable[RecordEntry]:
    data_dir = dist_info[: -len(".dist-info")] + ".data/"
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if len(row) != 3:
            raise HarnessInstallError(f"{wheel}: malformed RECORD line {row!r}")
        path, hashed, size = row
        parts = path.split("/")
        if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise HarnessInstallError(f"{wheel}: RECORD names an unsafe path {path!r}")
        if not hashed:
            continue
        algorithm, _, encoded = hashed.partition("=")
        if algorithm not in _ALGORITHMS:
            raise HarnessInstallError(f"{wheel}: unsupported hash {algorithm!r} for {path}")
        try:
            digest = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).hex()
        except (binascii.Error, ValueError) as exc:
            raise HarnessInstallError(f"{wheel}: malformed hash for {path}") from exc
        where, rel = "site", path
        if path.startswith(data_dir):
            scheme, _, rel = path[len(data_dir) :].partition("/")
            if scheme in ("purelib", "platlib"):
                where = "site"
            elif scheme == "data":
                where = "venv"
            else:  # scripts (pip rewrites their #! line), headers (outside the venv's lib)
                continue
            if not rel:
                continue
        yield RecordEntry(where, rel, algorithm, digest, int(size) if size.isdigit() else None)


async def verify_install(
    runtime: Runtime,
    python: str,
    venv: str,
    wheelhouse: Path,
    requirements: Sequence[str],
) -> str:
    """Check the venv against the wheels of ``wheelhouse``; return its site-packages
    (relative to the venv). See the module doc.

    Raises:
        HarnessInstallError: a file differs, is missing or is a link; a pinned requirement
            was not installed from the wheelhouse; a distribution or a ``.pth`` file is
            unexpected; the check could not run.
        SandboxError: the sandbox failed (typed).
    """
    wheels = await anyio.to_thread.run_sync(read_wheelhouse, wheelhouse)
    files = [[e.where, e.path, e.algorithm] for w in wheels for e in w.entries]
    request = json.dumps({"venv": venv, "files": files})
    result = await run_machinery(
        runtime,
        isolated_python(python, "-c", _VERIFY, site=False),
        stdin=request,
        timeout=600,
        output_limit=_REPORT_LIMIT,
    )
    try:
        report = json.loads(result.stdout)
        if result.exit_code != 0 or "error" in report:
            raise ValueError(report.get("error", f"exit {result.exit_code}"))
        site, dists, pth, found = report["site"], report["dists"], report["pth"], report["files"]
        if len(found) != len(files):
            raise ValueError(f"{len(found)} answers for {len(files)} files")
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise HarnessInstallError(
            f"cannot verify {venv} against the wheelhouse: {exc}: {result.stderr[-2000:]!r}"
        ) from exc
    answers = iter(found)
    by_dist: dict[str, list[tuple[RecordEntry, list[object]]]] = {}
    for wheel in wheels:
        by_dist.setdefault(wheel.dist_info, [])
        by_dist[wheel.dist_info] += [(entry, next(answers)) for entry in wheel.entries]
    installed = [w for w in wheels if w.dist_info in dists]
    _check_requirements(venv, requirements, installed)
    _check_distributions(venv, dists, {w.dist_info for w in installed})
    listed: set[str] = set()
    for wheel in installed:
        for entry, answer in by_dist[wheel.dist_info]:
            _check_file(venv, site, entry, answer)
            if entry.where == "site" and "/" not in entry.path:
                listed.add(entry.path)
    stray = sorted(set(pth) - listed - _BOOTSTRAP_PTH)
    if stray:
        raise HarnessInstallError(
            f"{venv}: site-packages holds .pth files no wheel installed: {stray}"
        )
    return str(site)


def _check_file(venv: str, site: str, entry: RecordEntry, answer: list[object]) -> None:
    where = f"{venv}/{site if entry.where == 'site' else ''}".rstrip("/")
    match answer:
        case ["ok", int(size), str(digest)]:
            if digest != entry.digest or (entry.size is not None and size != entry.size):
                raise HarnessInstallError(
                    f"{where}/{entry.path} differs from the wheel the host uploaded"
                )
        case [str(status), *_]:
            raise HarnessInstallError(f"{where}/{entry.path}: {status} (expected the wheel's file)")
        case _:
            raise HarnessInstallError(f"{where}/{entry.path}: malformed answer {answer!r}")


def _check_requirements(
    venv: str, requirements: Sequence[str], installed: Sequence[WheelRecord]
) -> None:
    projects = {w.project for w in installed}
    for requirement in requirements:
        pinned = re.fullmatch(
            r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*==.*", requirement
        )
        if pinned and canonical_name(pinned.group(1)) not in projects:
            raise HarnessInstallError(
                f"{venv}: {requirement} was not installed from the host's wheelhouse"
            )


def _check_distributions(venv: str, dists: Sequence[object], known: set[str]) -> None:
    for dist in dists:
        if not isinstance(dist, str):
            raise HarnessInstallError(f"{venv}: malformed distribution name {dist!r}")
        if dist in known or project_of(dist) in _BOOTSTRAP:
            continue
        raise HarnessInstallError(
            f"{venv}: {dist} is installed but is no wheel of the host's wheelhouse"
        )
