"""One set of resource names and units across backends (``docs/resources.md``): the shared
memory parser, the old names, the refusals of backends that cannot enforce a limit, the
Docker create options they become, and the typed error of an out-of-memory kill."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import runtimes
from runtimes import RuntimeConfigError, SandboxError, SandboxResourceError
from runtimes import resolve_runtime_config as resolve
from runtimes.docker.container import container_options
from runtimes.resources import LIMIT_FIELDS, format_mib, memory_mib

SSH = {"type": "ssh", "host": "h", "username": "u", "password": "p"}


@pytest.mark.parametrize(
    ("value", "mib"),
    [
        (512, 512),
        ("512", 512),
        ("512m", 512),
        ("512M", 512),
        ("512MiB", 512),
        ("512mb", 512),
        ("512 MiB", 512),
        ("2g", 2048),
        ("2GiB", 2048),
        ("1.5GiB", 1536),
        ("1t", 1 << 20),
        ("65536k", 64),
        (f"{64 << 20}b", 64),
        (6, 6),
    ],
)
def test_memory_sizes_are_mib_or_binary_units(value: object, mib: int) -> None:
    assert memory_mib(value) == mib
    assert resolve({"type": "docker", "memory": value}).memory == mib


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("lots", "a size with a unit"),
        ("512 potatoes", "a size with a unit"),
        ("-5m", "a size with a unit"),
        ("100k", "whole number of MiB"),
        ("1.5", "whole number of MiB"),
        (5, "at least 6 MiB"),
        (0, "at least 6 MiB"),
        ("5MiB", "at least 6 MiB"),
        (True, "not a bool"),
        (536870912, "looks like a byte count, write '512MiB'"),
        ("2147483648", "looks like a byte count, write '2GiB'"),
        (2.5, "memory"),
    ],
)
def test_bad_memory_is_a_config_error_naming_the_field(value: object, says: str) -> None:
    for backend in ({"type": "docker"}, {"type": "modal"}):
        with pytest.raises(RuntimeConfigError) as info:
            resolve({**backend, "memory": value})
        assert "memory" in str(info.value) and says in str(info.value)
        assert [e["loc"] for e in info.value.errors] == [("memory",)]


def test_format_mib() -> None:
    assert (format_mib(64), format_mib(2048), format_mib(1536)) == ("64MiB", "2GiB", "1536MiB")


def test_issue_example_2048_means_2_gib_on_docker_and_modal() -> None:
    """``{"memory": 2048}`` was 2048 bytes on Docker (refused by the engine) and MiB on Modal."""
    docker = resolve({"type": "docker", "memory": 2048, "cpus": 1.5, "pids_limit": 100})
    modal = resolve({"type": "modal", "memory": 2048})
    assert docker.memory == modal.memory == 2048
    options = container_options(docker, "docker", init=True)
    assert options["mem_limit"] == 2 << 30, "the engine gets bytes"
    assert options["nano_cpus"] == 1_500_000_000
    assert options["pids_limit"] == 100


def test_no_limit_means_no_engine_option() -> None:
    config = resolve({"type": "docker", "memory": None, "pids_limit": None})
    options = container_options(config, "docker", init=True)
    assert not {"mem_limit", "memswap_limit", "nano_cpus", "pids_limit"} & set(options)


def test_limits_on_an_attached_container_are_refused_not_ignored() -> None:
    with pytest.raises(RuntimeConfigError, match="memory: limits apply to sandboxes this"):
        resolve({"type": "docker", "container": "web", "memory": 512})
    assert resolve({"type": "docker", "container": "web"}).memory is None


def test_the_old_cpu_name_still_works_once() -> None:
    assert resolve({"type": "docker", "cpu": 0.5}).cpus == 0.5
    with pytest.raises(RuntimeConfigError, match="'cpu' is the old name of 'cpus'"):
        resolve({"type": "docker", "cpu": 0.5, "cpus": 1})


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        ({**SSH, "cpus": 1}, "cpus"),
        ({**SSH, "cpu": 1}, "cpus"),
        ({**SSH, "disk": "1GiB"}, "disk"),
        ({"type": "modal", "pids_limit": 10}, "pids_limit"),
        ({"type": "modal", "disk": 1024}, "disk"),
        ({"type": "subprocess", "memory": 512}, "memory"),
        ({"type": "subprocess", "disk": 512}, "disk"),
    ],
)
def test_a_limit_the_backend_cannot_enforce_is_refused_never_ignored(
    config: dict[str, Any], refused: str
) -> None:
    with pytest.raises(RuntimeConfigError) as info:
        resolve(config)
    message = str(info.value)
    assert f"cannot enforce {refused}" in message and f"{config['type']!r}" in message
    assert [e["loc"] for e in info.value.errors] == [(refused,)]


def test_what_each_backend_enforces() -> None:
    assert set(LIMIT_FIELDS) == {"cpus", "memory", "pids_limit", "disk"}
    assert resolve({"type": "docker"}).enforced_limits == frozenset(LIMIT_FIELDS)
    assert resolve({"type": "modal"}).enforced_limits == {"cpus", "memory"}
    assert resolve(SSH).enforced_limits == {"memory", "pids_limit"}


def test_each_refusal_says_why_for_that_field() -> None:
    with pytest.raises(RuntimeConfigError, match=r"Sandbox\.create takes no disk size"):
        resolve({"type": "modal", "disk": 1024})
    with pytest.raises(RuntimeConfigError, match="no per-sandbox process limit"):
        resolve({"type": "modal", "pids_limit": 10})
    with pytest.raises(RuntimeConfigError, match="RLIMIT_FSIZE"):
        resolve({**SSH, "disk": 1024})
    with pytest.raises(RuntimeConfigError, match="per-sandbox cgroup"):
        resolve({**SSH, "cpus": 1})


def test_disk_is_a_common_field_in_the_units_of_memory() -> None:
    assert resolve({"type": "docker", "disk": "512MiB"}).disk == 512
    assert resolve({"type": "docker", "disk": 256}).disk == 256
    assert resolve({"type": "modal"}).disk is None
    with pytest.raises(RuntimeConfigError, match="disk must be at least 6 MiB"):
        resolve({"type": "docker", "disk": 1})
    with pytest.raises(RuntimeConfigError, match="disk must be MiB"):
        resolve({"type": "docker", "disk": "lots"})


def test_docker_disk_keeps_its_memory_check_and_its_attach_refusal() -> None:
    with pytest.raises(RuntimeConfigError, match="memory must be at least 2 x disk"):
        resolve({"type": "docker", "disk": "1GiB", "memory": "1GiB"})
    with pytest.raises(RuntimeConfigError, match="disk: limits apply to sandboxes this runtime"):
        resolve({"type": "docker", "container": "c", "disk": 64})


def test_ssh_takes_memory_and_pids_limit() -> None:
    config = resolve({**SSH, "memory": "1GiB", "pids_limit": 64})
    assert (config.memory, config.pids_limit) == (1024, 64)


def test_ssh_pids_limit_needs_an_account_other_than_root() -> None:
    root = {**SSH, "username": "root"}
    with pytest.raises(RuntimeConfigError, match="root is exempt"):
        resolve({**root, "pids_limit": 64})
    assert resolve({**root, "pids_limit": 64, "policy_user": "sandbox"}).pids_limit == 64
    assert resolve({**root, "memory": 512}).memory == 512


@pytest.mark.parametrize(
    ("config", "network"),
    [
        ({"type": "docker"}, "none"),
        ({"type": "docker", "network": "default"}, "default"),
        ({"type": "modal"}, "none"),
        ({"type": "modal", "network": "default"}, "default"),
        (SSH, "host"),
    ],
)
def test_network_has_one_meaning(config: dict[str, Any], network: str) -> None:
    assert resolve(config).network == network  # type: ignore[attr-defined]


def test_ssh_cannot_isolate_the_network() -> None:
    with pytest.raises(RuntimeConfigError, match=r"network.*cannot isolate the network"):
        resolve({**SSH, "network": "none"})


def test_resource_error_carries_limit_code_and_output() -> None:
    err = SandboxResourceError(
        "memory", ["python3", "-c", "x"], 137, b"out", b"err", setting="64MiB"
    )
    assert isinstance(err, SandboxError) and runtimes.SandboxResourceError is SandboxResourceError
    assert (err.limit, err.setting, err.exit_code) == ("memory", "64MiB", 137)
    assert (err.stdout, err.stderr) == ("out", "err")
    assert "memory limit (memory=64MiB)" in str(err) and "137" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert (again.limit, again.argv, again.exit_code, again.stdout_bytes, again.setting) == (
        "memory",
        ["python3", "-c", "x"],
        137,
        b"out",
        "64MiB",
    )
    assert str(again) == str(err)
