"""Attack class 24: a sandbox's code at the cluster's control plane.

A ray sandbox runs on a node of a Ray cluster whose ports (the GCS, each raylet, each worker)
take any caller: Ray has no authentication of its own by default, so code that reaches them
can run anything anywhere in the cluster. A Docker sandbox on a node has no network of its own
(``network="none"``, the default; model access goes through the channel relay), and a config
that would give it one is refused unless ``cluster_reachable`` says the code is trusted. The
node's actor, which holds the sandbox's runtime and the relay's token, is a host process the
sandbox cannot see. (A subprocess sandbox is the node's own user and network: not a boundary,
docs/ray.md.)
"""

from __future__ import annotations

import pytest

from runtimes import RuntimeConfigError, open_runtime
from tests.ray.cluster import LocalCluster

pytestmark = [pytest.mark.attack(24), pytest.mark.anyio, pytest.mark.docker]

IMAGE = "vf-sandbox/base:bookworm"

CONNECT = """
import socket, sys
reached = []
for host, port in [tuple(t.rsplit(":", 1)) for t in sys.argv[1:]]:
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        reached.append(f"{host}:{port}")
    except OSError as exc:
        print(f"{host}:{port} {exc}")
print("REACHED", " ".join(reached))
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_docker_sandbox_on_a_node_cannot_reach_the_ray_ports(
    ray_cluster: LocalCluster,
) -> None:
    node = ray_cluster.nodes[0]
    head_host, head_port = ray_cluster.head_address.rsplit(":", 1)
    targets = [f"{head_host}:{head_port}", f"{node.address}:{head_port}"]
    config = {"type": "ray", "runtime": {"type": "docker", "image": IMAGE}, "node": node.address}
    async with open_runtime(config) as rt:
        result = await rt.exec(["python3", "-c", CONNECT, *targets], timeout=60)
        assert result.exit_code == 0, result.stderr
        assert "REACHED \n" in result.stdout or result.stdout.rstrip().endswith("REACHED"), (
            result.stdout
        )
        # The actor (and the relay token it holds) is no process the sandbox can see.
        ps = await rt.exec(["ps", "-eo", "args"], timeout=30, check=True)
        assert "ray" not in ps.stdout.lower() and "SandboxHost" not in ps.stdout, ps.stdout
        env = await rt.exec(["env"], timeout=30, check=True)
        assert "RAY_" not in env.stdout, env.stdout


async def test_a_sandbox_network_that_reaches_the_node_is_refused_unless_trusted(
    ray_cluster: LocalCluster,
) -> None:
    for network in ("bridge", "host"):
        config = {"type": "ray", "runtime": {"type": "docker", "image": IMAGE, "network": network}}
        with pytest.raises(RuntimeConfigError, match="cluster_reachable"):
            open_runtime(config)
    trusted = {
        "type": "ray",
        "runtime": {"type": "docker", "image": IMAGE, "network": "bridge"},
        "cluster_reachable": True,
        "node": ray_cluster.nodes[1].address,
    }
    async with open_runtime(trusted) as rt:  # the opt-in is honoured: the caller's call
        await rt.exec(["true"], check=True)


async def test_a_subprocess_sandbox_on_a_node_gets_no_ray_variables(
    ray_cluster: LocalCluster,
) -> None:
    """The actor's environment (RAY_* settings, addresses) is not handed to the commands of a
    subprocess sandbox it opens (which gets PATH, LANG, HOME and its config's env only)."""
    config = {
        "type": "ray",
        "runtime": {"type": "subprocess"},
        "node": ray_cluster.nodes[0].address,
    }
    async with open_runtime(config) as rt:
        env = await rt.exec(["env"], timeout=30, check=True)
        assert "RAY_" not in env.stdout, env.stdout
