"""Added latency of the model proxy per turn: direct vs through the proxy.

    python -m benchmarks.proxy_latency [--turns 100]

Both paths use one keep-alive HTTP client against the same scripted endpoint (a local
server replying instantly), interleaved turn by turn so drift hits both alike. The
baseline (direct) is measured in the same run. Printed as a table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from harnesses.base import Budget, Trace
from harnesses.proxy import ModelProxy
from harnesses.scripted import ScriptedEndpoint, reply

WARMUP = 10


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure(turns: int) -> tuple[list[float], list[float]]:
    total = 2 * (turns + WARMUP)
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "ping"}]}
    direct: list[float] = []
    proxied: list[float] = []
    with (
        ScriptedEndpoint([reply("pong", usage=(5, 1)) for _ in range(total)]) as upstream,
        ModelProxy() as proxy,
        httpx.Client(timeout=30) as client,
    ):
        trace = Trace(harness="bench")
        run = proxy.open_run(upstream.endpoint(), trace, Budget(max_turns=None))
        targets = [
            (f"{upstream.base_url}/chat/completions", {}, direct),
            (
                f"{proxy.base_url}/chat/completions",
                {"Authorization": f"Bearer {run.secret}"},
                proxied,
            ),
        ]
        for index in range(turns + WARMUP):
            for url, headers, sink in targets:
                started = time.perf_counter()
                response = client.post(url, json=body, headers=headers)
                elapsed = time.perf_counter() - started
                response.raise_for_status()
                if index >= WARMUP:
                    sink.append(elapsed)
        if upstream.failures or len(trace.turns) != turns + WARMUP:
            raise SystemExit(f"benchmark invalid: {upstream.failures}, {len(trace.turns)} turns")
    return direct, proxied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=100)
    args = parser.parse_args()
    direct, proxied = measure(args.turns)
    rows = [("direct (baseline)", direct), ("through proxy", proxied)]
    print(f"proxy latency per turn, {args.turns} turns each (ms)")
    print(f"{'path':<20}{'median':>10}{'p90':>10}{'ratio':>10}")
    base = statistics.median(direct)
    for name, values in rows:
        median = statistics.median(values)
        print(
            f"{name:<20}{median * 1e3:>10.3f}{_percentile(values, 0.9) * 1e3:>10.3f}"
            f"{median / base:>10.2f}"
        )
    added = statistics.median(proxied) - base
    print(f"added by the proxy (median): {added * 1e3:.3f} ms per turn")


if __name__ == "__main__":
    main()
