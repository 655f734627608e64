"""ModalConfig: safe defaults and the contradictions it refuses (no sandbox needed)."""

from __future__ import annotations

from typing import Any

import pytest

from runtimes import RuntimeConfigError, resolve_runtime_config, runtime_is_local
from runtimes.modal import ModalConfig, ModalRuntime
from runtimes.modal.config import is_dockerfile


def test_defaults_block_the_network_and_bound_the_lifetime() -> None:
    config = resolve_runtime_config("modal")
    assert isinstance(config, ModalConfig)
    assert config.network == "none" and config.cidr_allowlist is None
    assert config.timeout == 3600 and config.idle_timeout == 900
    assert config.workdir == "/work" and config.app_name == "vf-sandbox"
    assert not runtime_is_local(config)


def test_an_allowlist_alone_opens_the_network_to_those_cidrs_only() -> None:
    config = resolve_runtime_config({"type": "modal", "cidr_allowlist": ["10.0.0.0/8"]})
    assert isinstance(config, ModalConfig)
    assert config.network == "default" and config.cidr_allowlist == ["10.0.0.0/8"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"network": "none", "cidr_allowlist": ["10.0.0.0/8"]}, "cidr_allowlist"),
        ({"block_network": True, "cidr_allowlist": ["10.0.0.0/8"]}, "cidr_allowlist"),
        ({"network": "bridge"}, "network"),
        ({"block_network": False, "network": "default"}, "block_network"),
        ({"cidr_allowlist": ["not-a-cidr"]}, "cidr_allowlist"),
        ({"workdir": "relative/dir"}, "workdir"),
        ({"timeout": 2 * 24 * 3600}, "timeout"),
        ({"idle_timeout": 1}, "idle_timeout"),
        ({"max_live": 0}, "max_live"),
        ({"creations_per_second": 0}, "creations_per_second"),
        ({"secrets": [""]}, "secrets"),
        ({"unknown_option": 1}, "unknown_option"),
    ],
)
def test_contradictions_and_unbounded_values_are_refused(
    fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(RuntimeConfigError) as info:
        resolve_runtime_config({"type": "modal", **fields})
    assert named in str(info.value)


def test_image_is_a_registry_reference_or_a_dockerfile_path() -> None:
    assert not is_dockerfile("python:3.11-slim")
    assert not is_dockerfile("ghcr.io/org/image:tag")
    assert is_dockerfile("images/python/Dockerfile")
    assert is_dockerfile("build/agent.Dockerfile")


def test_the_runtime_is_registered_and_importing_it_needs_no_sdk_call() -> None:
    from runtimes.registry import load_runtime_class

    assert load_runtime_class("modal") is ModalRuntime
