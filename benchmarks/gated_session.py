"""Added cost per turn of a gated session: the bash harness against a scripted endpoint
(the baseline) vs the same harness gated, the answers delivered by the caller.

    python -m benchmarks.gated_session [--turns 60] [--rounds 5]

Each turn is one model call plus one ``true`` run by the bash tool in a subprocess
sandbox, so both paths include the same tool cost; the difference is the gate (the proxy
thread parking the call, the hop into the event loop, the delivery). Rounds alternate
baseline and gated runs so drift hits both alike. Printed as a table of per-turn medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio

from harnesses.base import Budget
from harnesses.bash import BashHarness
from harnesses.scripted import ScriptedEndpoint, bash_call, reply
from harnesses.session import AgentSessionFactory, Completion, call
from runtimes import open_runtime


async def baseline_turn_seconds(turns: int) -> float:
    script = [bash_call("true")] * (turns - 1) + [reply("done")]
    with ScriptedEndpoint(script) as server:
        async with open_runtime("subprocess") as runtime:
            harness = BashHarness()
            await harness.setup(runtime)
            started = time.perf_counter()
            trace = await harness.run(
                "go", runtime=runtime, model=server.endpoint(), budget=Budget(max_turns=turns)
            )
            elapsed = time.perf_counter() - started
    assert trace.ok and len(trace.turns) == turns, trace.error
    return elapsed / turns


async def gated_turn_seconds(factory: AgentSessionFactory, rollout_id: str, turns: int) -> float:
    step = Completion(tool_calls=[call("bash", {"command": "true"})])
    async with await factory.create(task="go", rollout_id=rollout_id) as session:
        started = time.perf_counter()
        answered = 0
        while (request := await session.next_request()) is not None:
            answered += 1
            await session.deliver(request, step if answered < turns else "done")
        elapsed = time.perf_counter() - started
    assert answered == turns, answered
    return elapsed / turns


async def main(turns: int, rounds: int) -> None:
    baseline: list[float] = []
    gated: list[float] = []
    budget = Budget(max_turns=turns)
    async with AgentSessionFactory("subprocess", "bash", budget=budget) as factory:
        await gated_turn_seconds(factory, "warmup", 5)
        for index in range(rounds):
            baseline.append(await baseline_turn_seconds(turns))
            gated.append(await gated_turn_seconds(factory, f"bench-{index}", turns))
    base, gate = statistics.median(baseline) * 1e3, statistics.median(gated) * 1e3
    print(f"{'path':<28} {'median ms/turn':>15} {'ratio':>7}")
    print(f"{'scripted endpoint (baseline)':<28} {base:>15.2f} {1.0:>7.2f}")
    print(f"{'gated session':<28} {gate:>15.2f} {gate / base:>7.2f}")
    print(f"added per turn: {gate - base:.2f} ms ({turns} turns x {rounds} rounds each)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    anyio.run(main, args.turns, args.rounds)
