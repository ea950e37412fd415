"""The guard's overhead on the in-memory store, against the bare function, in one run.

    python benchmarks/guard_bench.py [--calls 20000] [--rounds 7]

Prints the median per-call time of: the bare function, a guarded call with a fresh tool_call_id
(pending + committed), and a replay of a committed call; and the overhead of each over the bare
function. Rounds are interleaved so that machine noise hits every variant alike.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard, InMemoryEffectStore


def charge(account: str, cents: int) -> dict[str, object]:
    return {"charge_id": "ch_1", "account": account, "cents": cents}


def per_call(fn: Callable[..., object], contexts: list[AirlockContext]) -> float:
    """Microseconds per call of ``fn("acct_1", 500)``, each inside its own context."""
    gc.collect()
    start = time.perf_counter()
    for ctx in contexts:
        with ctx:
            fn("acct_1", 500)
    return (time.perf_counter() - start) / len(contexts) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    opts = parser.parse_args()
    n = opts.calls
    results: dict[str, list[float]] = {"bare": [], "fresh": [], "replay": []}
    for r in range(opts.rounds):
        store = InMemoryEffectStore()
        guarded = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))(charge)
        contexts = [AirlockContext(agent_id="bench", metadata={"tool_call_id": f"r{r}-{i}"}) for i in range(n)]

        results["bare"].append(per_call(charge, contexts))
        results["fresh"].append(per_call(guarded, contexts))  # every id is new here
        results["replay"].append(per_call(guarded, contexts))  # the same ids again: all committed
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"in-memory store, {n} calls x {opts.rounds} rounds (median per call)")
    print(f"  bare function           {med['bare']:8.2f} us")
    print(f"  guarded, fresh id       {med['fresh']:8.2f} us   overhead {med['fresh'] - med['bare']:6.2f} us")
    print(f"  guarded, replay         {med['replay']:8.2f} us   overhead {med['replay'] - med['bare']:6.2f} us")
    print("  target: overhead at most 10 us per call")


if __name__ == "__main__":
    main()
