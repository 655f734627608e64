"""The conformance suite on ray sandboxes, each on a worker node of the session's cluster (a
network namespace of its own, tests/ray/cluster.py): over the subprocess runtime under asyncio
and trio, and over Docker under trio (the driver's event loop is the axis this package adds;
the inner runtimes' own suites cover theirs). The checks marked ``shares_sandbox`` share one
sandbox per class and event loop; each sandbox is verified to be on the node it was pinned to.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from runtimes.testing import RuntimeConformance
from tests.ray.cluster import LocalCluster

pytestmark = pytest.mark.slow


class OnANode(RuntimeConformance):
    """A ray sandbox pinned to worker node ``node_index`` by its address."""

    node_index: ClassVar[int] = 0
    inner: ClassVar[dict[str, Any]] = {"type": "subprocess"}
    share_sandbox = True

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def pinned_config(cls, ray_cluster: LocalCluster) -> dict[str, Any]:
        node = ray_cluster.nodes[cls.node_index]
        cls.config = {"type": "ray", "runtime": cls.inner, "node": node.address}
        return cls.config


class TestRaySubprocessConformance(OnANode):
    anyio_backends = ("asyncio", "trio")
    verify_sharing = True


class TestRayDockerConformance(OnANode):
    node_index = 1
    inner = {"type": "docker", "image": "vf-sandbox/base:bookworm"}
    anyio_backends = ("trio",)
    pytestmark = pytest.mark.docker
