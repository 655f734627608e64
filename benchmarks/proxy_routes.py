"""A proxied model turn made from INSIDE a sandbox, per route to the host proxy.

    python -m benchmarks.proxy_routes [--turns 200]

The same client (``http.client``, one keep-alive connection, a turn timed around request
and whole reply) runs: inside a Docker container with ``network="none"``, reaching the proxy
through the channel relay (the default route); inside a container on the bridge, reaching it
through the gateway (the route that needed a network); and on the host, straight to the
scripted endpoint (no proxy: the direct call). Rounds are interleaved so drift hits all
alike; every baseline is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import anyio

from harnesses.base import Budget, Trace
from harnesses.proxy import ModelProxy, route_to_host
from harnesses.scripted import ScriptedEndpoint, reply
from runtimes import Runtime, open_runtime

ROUNDS = 4
WARMUP = 5

CLIENT = r"""
import http.client, json, sys, time, urllib.parse
url, key, turns, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
parts = urllib.parse.urlsplit(url)
conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
body = json.dumps({"model": "scripted-model", "messages": [{"role": "user", "content": "ping"}]})
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + key}
times = []
for i in range(turns + warmup):
    started = time.perf_counter()
    conn.request("POST", parts.path + "/chat/completions", body, headers)
    answer = conn.getresponse()
    data = answer.read()
    elapsed = time.perf_counter() - started
    assert answer.status == 200, (answer.status, data[:200])
    if i >= warmup:
        times.append(elapsed)
print(json.dumps(times))
"""


async def _client(runtime: Runtime, url: str, key: str, turns: int) -> list[float]:
    result = await runtime.exec(
        ["python3", "-c", CLIENT, url, key, str(turns), str(WARMUP)], timeout=600
    )
    if result.exit_code != 0:
        raise SystemExit(f"client failed in {runtime.describe()}: {result.stderr[-2000:]}")
    return [float(t) for t in json.loads(result.stdout)]


async def measure(turns: int, image: str = "vf-sandbox/base:bookworm") -> dict[str, list[float]]:
    """Per-turn seconds: ``channel`` (network none), ``bridge`` (gateway), ``direct`` (host)."""
    per_round = max(1, turns // ROUNDS)
    total = 3 * ROUNDS * (per_round + WARMUP)
    series: dict[str, list[float]] = {"channel": [], "bridge": [], "direct": []}
    with ScriptedEndpoint([reply("pong", usage=(5, 1)) for _ in range(total)]) as upstream:
        async with (
            open_runtime({"type": "docker", "image": image}) as none,
            open_runtime({"type": "docker", "image": image, "network": "bridge"}) as bridge,
            open_runtime({"type": "subprocess"}) as host,
        ):
            channel_route = await route_to_host(none)
            gateway_route = await route_to_host(bridge, via="gateway")
            with (
                ModelProxy(host=channel_route.bind_host) as local_proxy,
                ModelProxy(host=gateway_route.bind_host) as gateway_proxy,
            ):
                unlimited = Budget(max_turns=None)
                runs: dict[str, Any] = {
                    "channel": local_proxy.open_run(
                        upstream.endpoint(), Trace(harness="b"), unlimited
                    ),
                    "bridge": gateway_proxy.open_run(
                        upstream.endpoint(), Trace(harness="b"), unlimited
                    ),
                }
                urls = {
                    "channel": await channel_route.sandbox_base_url(none, local_proxy),
                    "bridge": await gateway_route.sandbox_base_url(bridge, gateway_proxy),
                    "direct": upstream.base_url,
                }
                where = {"channel": none, "bridge": bridge, "direct": host}
                for _ in range(ROUNDS):
                    for name in ("direct", "channel", "bridge"):
                        key = runs[name].secret if name in runs else "none"
                        series[name] += await _client(where[name], urls[name], key, per_round)
                await channel_route.release(none)
                await gateway_route.release(bridge)
    if upstream.failures:
        raise SystemExit(f"benchmark invalid: {upstream.failures}")
    return series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    args = parser.parse_args()
    series = anyio.run(measure, args.turns)
    direct = statistics.median(series["direct"])
    print(f"proxied turn from inside a sandbox, {args.turns} turns each (ms)")
    print(f"{'path':<34}{'median':>10}{'p90':>10}{'vs direct':>12}")
    for name, label in (
        ("direct", "host -> scripted (direct)"),
        ("bridge", "network=bridge, gateway, proxy"),
        ("channel", "network=none, channel, proxy"),
    ):
        values = sorted(series[name])
        median = statistics.median(values)
        p90 = values[int(0.9 * (len(values) - 1))]
        print(f"{label:<34}{median * 1e3:>10.3f}{p90 * 1e3:>10.3f}{median / direct:>11.2f}x")


if __name__ == "__main__":
    main()
