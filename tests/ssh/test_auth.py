"""Host keys and credentials: strict by default, clear typed refusals, secrets never shown."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

import paramiko
import pydantic
import pytest

from runtimes import ProvisioningError, RuntimeConfigError, open_runtime, resolve_runtime_config
from runtimes.ssh import (
    HostKeyMismatchError,
    SSHAuthenticationError,
    SSHConfig,
    UnknownHostKeyError,
)
from tests.ssh.sshd import PASSWORD, SSHServer, make_keypair

pytestmark = pytest.mark.anyio


async def _whoami(config: SSHConfig) -> str:
    async with open_runtime(config) as rt:
        return (await rt.exec(["id", "-un"])).stdout.strip()


def _other_host_key() -> str:
    """A valid ed25519 public key line that is not the server's."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    public = ed25519.Ed25519PrivateKey.generate().public_key()
    return public.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()


# ---------------------------------------------------------------------- host keys


async def test_known_host_key_connects(sshd: SSHServer) -> None:
    assert await _whoami(sshd.config()) == "root"


async def test_wrong_known_host_key_is_refused(sshd: SSHServer, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(f"[{sshd.host}]:{sshd.port} {_other_host_key()}\n")
    with pytest.raises(HostKeyMismatchError) as info:
        await _whoami(sshd.config(known_hosts=str(known)))
    assert isinstance(info.value, ProvisioningError)
    assert "MISMATCH" in str(info.value) and f"[{sshd.host}]:{sshd.port}" in str(info.value)


async def test_unknown_host_key_is_refused_unless_accepted(sshd: SSHServer, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-known-hosts"
    with pytest.raises(UnknownHostKeyError) as info:
        await _whoami(sshd.config(known_hosts=str(missing)))
    assert "accept_unknown_host_key" in str(info.value)
    other_host = tmp_path / "other"
    other_host.write_text(f"example.invalid {_other_host_key()}\n")
    with pytest.raises(UnknownHostKeyError):
        await _whoami(sshd.config(known_hosts=str(other_host)))
    accepted = sshd.config(known_hosts=str(missing), accept_unknown_host_key=True)
    assert await _whoami(accepted) == "root"
    assert not missing.exists(), "accepting a key must not write known_hosts"


async def test_pinned_host_key(sshd: SSHServer, tmp_path: Path) -> None:
    nowhere = str(tmp_path / "none")
    assert await _whoami(sshd.config(known_hosts=nowhere, host_key=sshd.host_key_line)) == "root"
    with pytest.raises(HostKeyMismatchError):
        await _whoami(sshd.config(host_key=_other_host_key()))


async def test_hashed_known_hosts_entry(sshd: SSHServer, tmp_path: Path) -> None:
    hashed = paramiko.HostKeys.hash_host(f"[{sshd.host}]:{sshd.port}")
    known = tmp_path / "hashed_known_hosts"
    known.write_text(f"{hashed} {sshd.host_key_line}\n")
    assert await _whoami(sshd.config(known_hosts=str(known))) == "root"


def test_malformed_pinned_key_is_a_config_error() -> None:
    with pytest.raises(pydantic.ValidationError):
        SSHConfig(host="h", username="u", password="p", host_key="not-a-key")


# ---------------------------------------------------------------------- credentials


async def test_wrong_key_is_refused_naming_user_and_host(sshd: SSHServer, tmp_path: Path) -> None:
    stranger = make_keypair(tmp_path, "stranger")
    with pytest.raises(SSHAuthenticationError) as info:
        await _whoami(sshd.config(key_file=str(stranger.private_path)))
    assert isinstance(info.value, ProvisioningError)
    assert f"authentication failed for root@{sshd.host}:{sshd.port}" in str(info.value)


async def test_key_from_environment_variable(
    sshd: SSHServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VF_TEST_SSH_KEY", sshd.key.private_text)
    assert await _whoami(sshd.config(key_file=None, key_env="VF_TEST_SSH_KEY")) == "root"
    with pytest.raises(ProvisioningError, match="VF_TEST_UNSET_KEY"):
        await _whoami(sshd.config(key_file=None, key_env="VF_TEST_UNSET_KEY"))


async def test_password_login(sshd: SSHServer) -> None:
    assert await _whoami(sshd.password_config()) == "sandbox"


async def test_wrong_password_is_refused(sshd: SSHServer) -> None:
    with pytest.raises(SSHAuthenticationError, match=f"sandbox@{sshd.host}:{sshd.port}"):
        await _whoami(sshd.password_config(password="not-the-password"))


def test_config_needs_a_credential() -> None:
    with pytest.raises(pydantic.ValidationError, match="no authentication method"):
        SSHConfig(host="h", username="u")


# ---------------------------------------------------------------------- secrets stay secret


async def test_password_never_appears(sshd: SSHServer, caplog: pytest.LogCaptureFixture) -> None:
    """Neither the real nor a wrong password shows in reprs, logs, errors or validation errors."""
    wrong = "wrong-pw-3b1f9c0e"
    caplog.set_level(logging.DEBUG)  # every logger, paramiko's included
    logging.getLogger("paramiko").setLevel(logging.DEBUG)
    shown: list[str] = []

    good = sshd.password_config()
    shown += [repr(good), str(good), good.model_dump_json(), repr(good.model_dump())]
    async with open_runtime(good) as rt:
        shown.append(rt.describe())
        await rt.exec(["true"])

    for secret_config in (sshd.password_config(password=wrong),):
        try:
            await _whoami(secret_config)
        except SSHAuthenticationError as exc:
            shown += [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
        else:
            pytest.fail("a wrong password was accepted")

    base = {"type": "ssh", "host": sshd.host, "username": "sandbox"}
    for bad in (
        {**base, "password": wrong, "port": "not-a-port"},  # another field invalid
        {**base, "password": 12345678},  # the secret itself invalid (not a string)
        {**base, "pasword": wrong},  # a typo: an unknown field holding the secret
    ):
        with pytest.raises(pydantic.ValidationError) as v_info:
            SSHConfig.model_validate(bad)
        # str() hides inputs (hide_input_in_errors); .errors() is pydantic's raw data API and
        # returns them unless asked not to, which is what RuntimeConfigError does.
        shown += [
            str(v_info.value),
            repr(v_info.value),
            repr(v_info.value.errors(include_input=False)),
        ]
        with pytest.raises(RuntimeConfigError) as r_info:
            resolve_runtime_config(bad)
        shown += [str(r_info.value), repr(r_info.value.errors)]

    shown.append(caplog.text)
    assert any("Authentication (password) failed" in r.getMessage() for r in caplog.records), (
        "paramiko's DEBUG log was not captured: the scan would prove nothing"
    )
    for text in shown:
        for secret in (PASSWORD, wrong, "12345678"):
            assert secret not in text, f"{secret!r} leaked into: {text[:300]}"
