"""Attack class 1 with ``links="keep"``, and the all-or-nothing destination.

``links="keep"`` creates every symlink of a download as it is (absolute, out of the
destination), as ``docker cp`` does. A policy then tries to make the host write through
one: a link out followed by a file below it, a link replaced by a directory, the CVE chain,
a hard link to a kept link, links into a destination that already holds host links. Each
attack must fail typed with nothing outside the destination changed, and a failed download
must leave the destination exactly as it was (nothing created, parents included, nothing
overwritten). The end-to-end case plays a root policy's replaced ``tar`` against SSH and
Modal (Docker as root archives with the engine).
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from runtimes import SandboxInvalidArgumentError, UnsafeArchiveMemberError, open_runtime

from .conftest import Hostile
from .test_downloads import _FAKE_TAR, Area, _extract, _member, _plant, _tar, chain_tar

pytestmark = [pytest.mark.anyio, pytest.mark.attack(1)]


@pytest.fixture
def area(tmp_path: Path) -> Area:
    return Area(tmp_path)


def _refused_keep(data: bytes, area: Area, member: str) -> UnsafeArchiveMemberError:
    with pytest.raises(UnsafeArchiveMemberError) as info:
        _extract(data, area.dest, links="keep")
    assert info.value.member == member, info.value
    assert not os.path.lexists(area.dest), "a failed download left its destination"
    area.assert_untouched()
    return info.value


def test_keep_creates_links_out_as_links_and_never_follows_them(area: Area) -> None:
    data = _tar(
        _member("python", tarfile.SYMTYPE, link="/usr/bin/python3"),
        _member("up", tarfile.SYMTYPE, link="../sentinel"),
        _member("victim", tarfile.SYMTYPE, link="../sentinel/victim.txt"),
        _member("ok.txt", data=b"ok\n"),
    )
    _extract(data, area.dest, links="keep")
    assert os.readlink(area.dest / "python") == "/usr/bin/python3"
    assert os.readlink(area.dest / "up") == "../sentinel"
    assert (area.dest / "ok.txt").read_bytes() == b"ok\n"
    area.assert_untouched()


@pytest.mark.parametrize(
    ("link", "target"),
    [("abs", None), ("up", "../sentinel"), ("dotdot", "..")],
)
def test_keep_refuses_a_file_through_a_kept_link(area: Area, link: str, target: str | None) -> None:
    """A link out then a file below it: the file is never written through the link."""
    target = target or str(area.sentinel)
    member = f"{link}/victim.txt" if link != "dotdot" else f"{link}/sentinel/victim.txt"
    data = _tar(
        _member("ok.txt", data=b"ok\n"),
        _member(link, tarfile.SYMTYPE, link=target),
        _member(member, data=b"forged\n"),
    )
    err = _refused_keep(data, area, member)
    assert "skip_unsafe=True" in str(err)


def test_keep_refuses_a_directory_through_a_kept_link(area: Area) -> None:
    data = _tar(
        _member("abs", tarfile.SYMTYPE, link="/tmp"),
        _member("abs/vf-keep-probe", tarfile.DIRTYPE, mode=0o755),
    )
    _refused_keep(data, area, "abs/vf-keep-probe")
    assert not os.path.lexists("/tmp/vf-keep-probe")


def test_keep_a_file_at_a_links_name_replaces_the_link_not_its_target(area: Area) -> None:
    data = _tar(
        _member("victim", tarfile.SYMTYPE, link="../sentinel/victim.txt"),
        _member("victim", data=b"replaced the link\n"),
    )
    _extract(data, area.dest, links="keep")
    assert not (area.dest / "victim").is_symlink()
    assert (area.dest / "victim").read_bytes() == b"replaced the link\n"
    area.assert_untouched()


def test_keep_refuses_a_hard_link_to_a_kept_link(area: Area) -> None:
    data = _tar(
        _member("abs", tarfile.SYMTYPE, link=str(area.sentinel / "victim.txt")),
        _member("hard", tarfile.LNKTYPE, link="abs"),
    )
    _refused_keep(data, area, "hard")


def test_keep_still_refuses_the_cve_chain(area: Area) -> None:
    """The chain's links are all kept, but its payload goes through one: refused, and the
    chain's links never appear at the destination."""
    with pytest.raises(UnsafeArchiveMemberError):
        _extract(chain_tar("sentinel/victim.txt"), area.dest, links="keep")
    assert not os.path.lexists(area.dest)
    area.assert_untouched()


def test_keep_never_follows_a_host_link_already_in_the_destination(area: Area) -> None:
    """The destination holds a host link to the sentinel; the download has a directory
    there: refused before anything is merged (the download's other file too)."""
    area.dest.mkdir()
    (area.dest / "to-dir").symlink_to(area.sentinel)
    (area.dest / "a.txt").write_bytes(b"the host's\n")
    data = _tar(
        _member("a.txt", data=b"new\n"),
        _member("to-dir", tarfile.DIRTYPE, mode=0o755),
        _member("to-dir/victim.txt", data=b"forged\n"),
    )
    with pytest.raises(UnsafeArchiveMemberError) as info:
        _extract(data, area.dest, links="keep")
    assert info.value.member == "to-dir/victim.txt", info.value
    assert (area.dest / "a.txt").read_bytes() == b"the host's\n"
    assert os.readlink(area.dest / "to-dir") == str(area.sentinel)
    area.assert_untouched()


def test_a_refused_download_creates_nothing_not_even_parents(area: Area) -> None:
    dest = area.root / "new" / "deeper" / "dest"
    area.dests.append(area.root / "new")
    data = _tar(_member("ok.txt", data=b"ok\n"), _member("abs", tarfile.SYMTYPE, link="/etc"))
    with pytest.raises(UnsafeArchiveMemberError, match="links='keep'"):
        _extract(data, dest)
    assert not os.path.lexists(area.root / "new")
    assert sorted(os.listdir(area.root)) == ["sentinel"]  # no staging directory left


def test_a_refused_download_overwrites_nothing(area: Area) -> None:
    area.dest.mkdir()
    (area.dest / "ok.txt").write_bytes(b"the host's\n")
    data = _tar(_member("ok.txt", data=b"sandbox's\n"), _member("../up", data=b"x"))
    with pytest.raises(UnsafeArchiveMemberError):
        _extract(data, area.dest)
    assert os.listdir(area.dest) == ["ok.txt"]
    assert (area.dest / "ok.txt").read_bytes() == b"the host's\n"
    area.assert_untouched()


@pytest.mark.parametrize("hostile", ["docker-root", "ssh-root", "modal-fake"], indirect=True)
async def test_a_venv_with_links_out_downloads_with_keep_and_fails_whole_without(
    hostile: Hostile, area: Area
) -> None:
    """End to end: the venv-shaped tree fails typed by default, naming both options and
    creating nothing; with ``links="keep"`` the link comes back as a link. Then a root
    policy's ``tar`` answers with a link out and a file through it: refused even with
    ``links="keep"``, nothing written outside (Docker as root archives with the engine,
    which the policy does not control: the real tree comes back)."""
    evil = _tar(
        _member("bin", tarfile.SYMTYPE, link=str(area.sentinel)),
        _member("bin/victim.txt", data=b"forged by the sandbox's tar\n"),
    )
    async with open_runtime(hostile.config) as rt:
        loot = f"{rt.workdir}/venv"
        await _plant(rt, hostile, loot, "absolute")
        with pytest.raises(UnsafeArchiveMemberError, match="links='keep'") as info:
            await rt.download(loot, area.dest)
        assert "skip_unsafe=True" in str(info.value)
        assert not os.path.lexists(area.dest)
        await rt.download(loot, area.dest, links="keep")
        assert os.readlink(area.dest / "planted") == "/etc/passwd"
        assert (area.dest / "sub" / "ok2.txt").read_bytes() == b"ok2\n"
        with pytest.raises(SandboxInvalidArgumentError, match="links"):
            await rt.download(loot, area.another_dest(), links="follow")  # type: ignore[arg-type]
        wrote = await rt.exec(["sh", "-c", "cat > /var/tmp/evil.tar"], stdin=evil)
        assert wrote.exit_code == 0, wrote
        installed = await rt.exec(["sh", "-c", _FAKE_TAR], user=hostile.user)
        assert installed.exit_code == 0, installed
        fresh = area.another_dest()
        if hostile.backend == "docker":
            await rt.download(loot, fresh, links="keep")
            assert os.readlink(fresh / "planted") == "/etc/passwd"
        else:
            with pytest.raises(UnsafeArchiveMemberError) as refused:
                await rt.download(loot, fresh, links="keep")
            assert refused.value.member.endswith("bin/victim.txt"), refused.value
            assert not os.path.lexists(fresh)
        area.assert_untouched()
