"""A real multi-node Ray cluster on this machine, for the tests.

Every worker node is a network namespace of its own, with its own address on a veth the
cluster creates, all plugged into a bridge the cluster creates in the root namespace. The head
node (where the driver, the pytest process, runs) lives in the root namespace, bound to the
bridge's address: an address the cluster made, never the machine's interface address.

Names carry the owning process's pid (``vc<pid>-<k>``: bridge ``…b``, host-side veths ``…v<i>``,
namespaces ``…n<i>``, temp dir ``/tmp/vc<pid>-<k>``), so a later run removes what a crashed run
left behind once that pid is dead (:func:`cleanup_stale`). :meth:`LocalCluster.stop` never
runs ``ray stop``: it SIGKILLs every process in the node namespaces and every process of the
cluster in the root one (:func:`marked_pids`). Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARK = "VF_RAY_CLUSTER"
"""The environment variable every Ray process of a cluster carries; its value is the tag."""

OBJECT_STORE_BYTES = 200 * 1024 * 1024
"""Each node's object store: small, to keep memory in check."""

HEALTH_ENV = {
    # The GCS health-checks every raylet; a SIGKILLed node (its namespace gone) fails each check
    # by timeout, so it is marked dead after about threshold * (period + timeout): measured
    # 3.4-4.3 s here (test_cluster.py prints it). Tighter (500/500) gave ~2.8 s, at more risk
    # of a busy 2-core machine failing a live node.
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
"""Fast node-death detection, in the head's environment (the GCS reads it)."""

START_TIMEOUT = 90.0
"""Seconds a node (head or worker) may take to start and join."""

_PREFIX = "vc"
_NAME = re.compile(rf"^{_PREFIX}(\d+)-(\d+)(?:b|v\d+|n\d+)$")
_ALIVE = 0  # GcsNodeInfo.state of a live node
_counter = itertools.count(1)
_counter_lock = threading.Lock()


class ClusterError(RuntimeError):
    """The local Ray cluster could not be built, or a node did not join or die in time."""


def missing_requirement() -> str | None:
    """Why a cluster cannot be built here (not root, no iproute2), or None where it can."""
    if os.geteuid() != 0:
        return "a LocalCluster needs root (network namespaces, veths, a bridge)"
    if shutil.which("ip") is None:
        return "a LocalCluster needs iproute2's `ip` on PATH"
    return None


def require_root_and_ip() -> None:
    """Fail (never skip) where a cluster cannot be built: CI runs as root with iproute2."""
    import pytest

    if missing := missing_requirement():
        pytest.fail(f"the Ray test cluster: {missing}", pytrace=False)


@dataclass
class Node:
    """One worker node: a network namespace running a raylet."""

    name: str
    netns: str
    address: str
    node_id: str
    slots: int


def _run(
    *args: str, check: bool = True, timeout: float = 30.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command, its output to files (not pipes: ``ray start``'s daemons would hold a pipe
    open, and reading it to its end would wait for them).

    Raises:
        ClusterError: ``check`` and the command failed or timed out.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            code = subprocess.run(
                args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, timeout=timeout, env=env,
                check=False, start_new_session=True,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"{' '.join(args)} timed out after {timeout}s") from exc
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(args, code, out.read(), err.read())
    if check and done.returncode != 0:
        output = done.stderr.strip() or done.stdout.strip()
        raise ClusterError(f"{' '.join(args)} failed ({done.returncode}): {output}")
    return done


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def netns_pids(netns: str) -> list[int]:
    """The pids of every process in network namespace ``netns`` (none if it is gone)."""
    done = _run("ip", "netns", "pids", netns, check=False)
    return [int(word) for word in done.stdout.split() if word.isdigit()]


def marked_pids(tag: str) -> list[int]:
    """The pids of every live process of cluster ``tag``, wherever it runs: its environment
    carries ``VF_RAY_CLUSTER=<tag>``, or its command line names the cluster's temp dir, or it
    holds a file open under that dir (every Ray process logs there). The last is what finds a
    ``ray::…`` process, whose title rewrite may clobber what /proc shows of its environment."""
    want = f"{MARK}={tag}".encode()
    temp_dir = _temp_dir(tag) + "/"
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
            cmdline = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile, or a kernel thread
        if (
            want in environ.split(b"\0")
            or temp_dir.encode() in cmdline
            or _holds(entry.path, temp_dir)
        ):
            found.append(int(entry.name))
    return found


def _holds(proc: str, prefix: str) -> bool:
    """Whether process ``/proc/<pid>`` has a file open under ``prefix``."""
    try:
        fds = os.listdir(f"{proc}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"{proc}/fd/{fd}").startswith(prefix):
                return True
    return False


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _kill_until_gone(find: Any, timeout: float = 10.0) -> None:
    """SIGKILL what ``find()`` lists until it lists nothing (a dying parent may spawn more)."""
    deadline = time.monotonic() + timeout
    while pids := [pid for pid in find() if pid != os.getpid()]:
        _kill(pids)
        if time.monotonic() > deadline:
            log.warning("processes survive SIGKILL: %s", pids)
            return
        time.sleep(0.05)


def _temp_dir(tag: str) -> str:
    return f"/tmp/{tag}"


def _bridge_nf_filtered() -> bool:
    path = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    return path.exists() and path.read_text().strip() == "1"


def _forward_rule(bridge: str) -> list[str]:
    return ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]


def _remove_forward_rules(bridge: str) -> None:
    if shutil.which("iptables") is None:
        return
    for _ in range(10):
        if _run("iptables", "-D", *_forward_rule(bridge), check=False).returncode != 0:
            return


def _remove_tag(tag: str) -> None:
    """Remove all of cluster ``tag``: processes, namespaces, links, firewall rule, temp dir."""
    namespaces = [ns for ns in _list_netns() if ns.startswith(f"{tag}n")]
    for ns in namespaces:
        _kill_until_gone(lambda ns=ns: netns_pids(ns))
    _kill_until_gone(lambda: marked_pids(tag))
    for ns in namespaces:
        _run("ip", "netns", "del", ns, check=False)
    for link in _list_links():
        if link.startswith(f"{tag}v"):
            _run("ip", "link", "del", link, check=False)
    _remove_forward_rules(f"{tag}b")
    if f"{tag}b" in _list_links():
        _run("ip", "link", "del", f"{tag}b", check=False)
    shutil.rmtree(_temp_dir(tag), ignore_errors=True)


def _list_netns() -> list[str]:
    done = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _list_links() -> list[str]:
    done = _run("ip", "-br", "link", check=False)
    return [line.split()[0].split("@")[0] for line in done.stdout.splitlines() if line.strip()]


def cleanup_stale() -> list[str]:
    """Remove clusters (namespaces, links, processes, temp dirs) whose owning pid is dead.

    Returns:
        The tags removed.
    """
    tags = set()
    for name in [*_list_netns(), *_list_links()]:
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            tags.add(f"{_PREFIX}{match.group(1)}-{match.group(2)}")
    for entry in Path("/tmp").glob(f"{_PREFIX}*-*"):
        match = re.fullmatch(rf"{_PREFIX}(\d+)-(\d+)", entry.name)
        if match and not _pid_alive(int(match.group(1))):
            tags.add(entry.name)
    for tag in sorted(tags):
        log.warning("removing the stale Ray test cluster %s", tag)
        _remove_tag(tag)
    return sorted(tags)


def _used_networks() -> list[ipaddress.IPv4Network]:
    used = []
    for line in _run("ip", "-br", "-4", "addr").stdout.splitlines():
        for word in line.split()[2:]:
            with contextlib.suppress(ValueError):
                used.append(ipaddress.IPv4Interface(word).network)
    for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        if words and words[0] == "default":
            continue
        for word in words[:2]:
            with contextlib.suppress(ValueError):
                used.append(ipaddress.IPv4Network(word, strict=False))
                break
    return used


def pick_subnet(seed: int) -> ipaddress.IPv4Network:
    """A free ``10.2xx.<n>.0/24``: one that overlaps no address or route on this machine.

    Raises:
        ClusterError: every candidate is taken.
    """
    used = _used_networks()
    count = 55 * 256
    for step in range(count):
        index = (seed * 7919 + step) % count
        net = ipaddress.IPv4Network(f"10.{200 + index // 256}.{index % 256}.0/24")
        if not any(net.overlaps(other) for other in used):
            return net
    raise ClusterError("no free 10.2xx.n.0/24 subnet")


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` right now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _gcs_nodes(address: str) -> dict[str, tuple[str, int]]:
    """node id (hex) -> (node address, state) as the GCS at ``address`` lists them.

    Raises:
        ClusterError: the GCS did not answer.
    """
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    try:
        infos = GcsClient(address=address).get_all_node_info(timeout=5)
    except Exception as exc:  # Ray's RPC errors share no narrower base
        raise ClusterError(f"cannot list the nodes of {address}: {exc}") from exc
    return {key.hex(): (info.node_manager_address, info.state) for key, info in infos.items()}


COMMON_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Explicit: with the mode unset, a head turns token auth on as soon as some other local
    # Ray run has written ~/.ray/auth_token, and its workers (and this driver) then fail to
    # authenticate. A test cluster is reachable only through the bridge it made.
    "RAY_AUTH_MODE": "disabled",
}
"""The environment of every Ray process of a cluster, the driver's included."""


def _ray_env(tag: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(COMMON_ENV)
    env[MARK] = tag
    env.update(extra or {})
    return env


class LocalCluster:
    """A Ray cluster of one head (root namespace, on the bridge) and worker namespaces.

    ``start()`` it, ``connect()`` this process as its driver, ``stop()`` it (idempotent; also
    what a crashed run left is removed by the next run's :func:`cleanup_stale`).
    """

    def __init__(self, *, workers: int = 3, slots: int = 4, subnet: str | None = None) -> None:
        with _counter_lock:
            self.tag = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        self.workers = workers
        self.slots = slots
        self._subnet = ipaddress.IPv4Network(subnet) if subnet else None
        self.bridge = f"{self.tag}b"
        self.temp_dir = _temp_dir(self.tag)
        self.ray_bin = str(Path(sys.executable).parent / "ray")
        self.head_address = ""
        self.driver_address = ""
        self.nodes: list[Node] = []
        self._index = itertools.count(1)
        self._index_lock = threading.Lock()
        self._hosts: list[ipaddress.IPv4Address] = []
        self._prefixlen = 24
        self._connected = False
        self._started = False

    def __repr__(self) -> str:
        names = [node.name for node in self.nodes]
        return f"LocalCluster({self.tag}, head={self.head_address}, nodes={names})"

    # -- start ---------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        """Build the bridge, start the head, start the workers concurrently, and wait until all
        of them joined (each within :data:`START_TIMEOUT`).

        Raises:
            ClusterError: a step failed or a node did not join in time (what was built is removed).
        """
        if missing := missing_requirement():
            raise ClusterError(missing)
        cleanup_stale()
        self._started = True
        try:
            self._make_bridge()
            self._start_head()
            with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
                list(pool.map(lambda _: self.add_node(), range(self.workers)))
        except ClusterError as exc:
            tails = self.log_tails()
            self.stop()
            raise ClusterError(f"{exc}\n{tails}") from exc
        except BaseException:
            self.stop()
            raise
        return self

    def _make_bridge(self) -> None:
        net = self._subnet or pick_subnet(os.getpid() + int(self.tag.rsplit("-", 1)[1]))
        self._hosts = list(net.hosts())
        self._prefixlen = net.prefixlen
        self.driver_address = str(self._hosts[-1])
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.driver_address}/{net.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        if _bridge_nf_filtered() and shutil.which("iptables") is not None:
            # br_netfilter sends bridged traffic through FORWARD, whose policy Docker sets to
            # DROP: without this, node-to-node traffic (object transfers, actor calls) is lost.
            _run("iptables", "-I", *_forward_rule(self.bridge))

    def _start_head(self) -> None:
        os.makedirs(self.temp_dir, exist_ok=True)
        for attempt in (1, 2):  # a second try on a fresh port: the free one may be taken since
            # The GCS binds the wildcard address: the port must be free there.
            (gcs,) = free_ports("0.0.0.0", 1)
            self.head_address = f"{self.driver_address}:{gcs}"
            try:
                _run(
                    self.ray_bin, "start", "--head",
                    f"--node-ip-address={self.driver_address}",
                    f"--port={gcs}",
                    "--num-cpus=0",
                    "--include-dashboard=false",
                    "--include-log-monitor=false",
                    "--disable-usage-stats",
                    f"--object-store-memory={OBJECT_STORE_BYTES}",
                    f"--temp-dir={self.temp_dir}",
                    env=_ray_env(self.tag, HEALTH_ENV),
                    timeout=START_TIMEOUT,
                )  # fmt: skip
                return
            except ClusterError:
                if attempt == 2:
                    raise
                log.warning("the head of %s did not start; trying once more", self.tag)
                _kill_until_gone(lambda: marked_pids(self.tag))

    # -- nodes -----------------------------------------------------------------------------

    def add_node(self, slots: int | None = None) -> Node:
        """Start a new worker namespace and return once the GCS lists its raylet alive.

        Raises:
            ClusterError: it could not be built, or did not join within :data:`START_TIMEOUT`.
        """
        if not self.head_address:
            raise ClusterError("start() the cluster first")
        with self._index_lock:
            index = next(self._index)
        if index >= len(self._hosts):
            raise ClusterError(f"subnet full: {index} nodes")
        slots = self.slots if slots is None else slots
        name, netns, veth = f"n{index}", f"{self.tag}n{index}", f"{self.tag}v{index}"
        address = str(self._hosts[index - 1])
        _run("ip", "netns", "add", netns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        _run("ip", "-n", netns, "addr", "add", f"{address}/{self._prefixlen}", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        started = time.monotonic()
        try:
            _run(
                "ip", "netns", "exec", netns,
                "env", f"{MARK}={self.tag}", *(f"{k}={v}" for k, v in COMMON_ENV.items()),
                self.ray_bin, "start",
                f"--address={self.head_address}",
                f"--node-ip-address={address}",
                "--num-cpus=1",
                f"--resources={json.dumps({'vf_sandbox': slots})}",
                "--include-log-monitor=false",
                "--disable-usage-stats",
                f"--object-store-memory={OBJECT_STORE_BYTES}",
                # A temp dir of its own: nodes sharing one race for the same socket names
                # (sockets/raylet.N) when they start together, and one of them fails to bind.
                f"--temp-dir={self.temp_dir}/{name}",
                timeout=START_TIMEOUT,
            )  # fmt: skip
            node_id = self._wait_alive(address, START_TIMEOUT - (time.monotonic() - started))
        except ClusterError as exc:
            tails = self.log_tails(under=name)
            _kill_until_gone(lambda: netns_pids(netns))
            _run("ip", "netns", "del", netns, check=False)
            raise ClusterError(f"node {name} ({address}) did not join: {exc}\n{tails}") from exc
        node = Node(name=name, netns=netns, address=address, node_id=node_id, slots=slots)
        with self._index_lock:
            self.nodes.append(node)
            self.nodes.sort(key=lambda each: int(each.name[1:]))
        return node

    def _wait_alive(self, address: str, timeout: float) -> str:
        deadline = time.monotonic() + max(timeout, 5.0)
        while True:
            for node_id, (node_address, state) in _gcs_nodes(self.head_address).items():
                if node_address == address and state == _ALIVE:
                    return node_id
            if time.monotonic() > deadline:
                raise ClusterError(f"node {address} did not join {self.head_address} in time")
            time.sleep(0.1)

    def kill_node(self, node: Node) -> None:
        """SIGKILL every process in ``node``'s namespace and remove the namespace; returns at once
        (the GCS notices later: :meth:`wait_node_dead`)."""
        _kill_until_gone(lambda: netns_pids(node.netns))
        _run("ip", "netns", "del", node.netns, check=False)
        with self._index_lock:
            self.nodes = [other for other in self.nodes if other.netns != node.netns]

    def wait_node_dead(self, node: Node, timeout: float = 30) -> None:
        """Return once the GCS lists ``node`` as not alive.

        Raises:
            ClusterError: it is still alive after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while _gcs_nodes(self.head_address).get(node.node_id, ("", -1))[1] == _ALIVE:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"node {node.name} ({node.address}) still alive after {timeout}s"
                )
            time.sleep(0.05)

    def processes(self, node: Node) -> list[int]:
        """The pids in ``node``'s namespace."""
        return netns_pids(node.netns)

    def all_pids(self) -> list[int]:
        """Every live process of this cluster: the head's tree and every node's."""
        pids = set(marked_pids(self.tag))
        for ns in _list_netns():
            if ns.startswith(f"{self.tag}n"):
                pids.update(netns_pids(ns))
        pids.discard(os.getpid())
        return sorted(pids)

    def rss_bytes(self) -> int:
        """The resident memory of every process of this cluster, summed."""
        total = 0
        for pid in self.all_pids():
            with contextlib.suppress(OSError, ValueError, IndexError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def log_tails(self, lines: int = 15, under: str = "") -> str:
        """The last error lines of every Ray log of this cluster (or of node ``under``)."""
        out = []
        root = Path(self.temp_dir, under)
        for path in sorted(root.glob("**/session_latest/logs/*")):
            if not path.is_file() or path.suffix not in (".err", ".out", ".log"):
                continue
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").splitlines()
                bad = [
                    line
                    for line in text
                    if " INFO " not in line and (" E " in line or "rror" in line)
                ]
                if bad:
                    out.append(f"== {path.relative_to(self.temp_dir)}\n" + "\n".join(bad[-lines:]))
        return "\n".join(out)

    # -- driver ----------------------------------------------------------------------------

    def connect(self) -> None:
        """Make this process the cluster's driver (``ray.init`` on the head's address)."""
        import ray

        os.environ.update(COMMON_ENV)
        ray.init(
            address=self.head_address,
            _node_ip_address=self.driver_address,
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
        self._connected = True

    def stop(self) -> None:
        """Disconnect the driver, SIGKILL every process of the head and every node, remove the
        namespaces, veths, bridge, firewall rule and temp dir. Idempotent; leaves nothing."""
        if self._connected:
            import ray

            try:
                ray.shutdown()
            except Exception:
                log.exception("ray.shutdown() failed")
            self._connected = False
        if not self._started:
            return
        _remove_tag(self.tag)
        self.nodes = []
        self._started = False
