"""What ``EffectGuard(duplicate_window=...)`` and ``id_scope="agent"`` add to a guarded call.

For each store (the in-memory one, and SQLiteJournal at durability "process" on a file in DIR),
times a guarded call with a fresh tool call id three ways: the default guard, with
``id_scope="agent"``, and with ``duplicate_window=60`` (one lookup by agent and idempotency key
before each begin, over a journal that already holds ``--history`` calls of other arguments).
Prints the median time per call of each and its ratio to the default.

    python benchmarks/window_bench.py [--dir DIR] [--calls N] [--rounds R] [--history H]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard, InMemoryEffectStore
from journal import SQLiteJournal


def guarded(store: Any, **options: Any) -> Callable[..., Any]:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store, **options)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        return {"account": account, "cents": cents}

    return charge


def per_call(fn: Callable[..., Any], calls: int, first: int) -> float:
    """Seconds per call of ``fn``, each with a new id and new arguments (no call is a copy)."""
    contexts = [AirlockContext(agent_id="agent-1", metadata={"tool_call_id": uuid.uuid4().hex}) for _ in range(calls)]
    start = time.perf_counter()
    for n, context in enumerate(contexts):
        with context:
            fn("acct-1", first + n)
    return (time.perf_counter() - start) / calls


def measure(make_store: Callable[[str], Any], calls: int, rounds: int, history: int) -> dict[str, float]:
    results: dict[str, list[float]] = {"default": [], "id_scope=agent": [], "duplicate_window=60": []}
    options = {"default": {}, "id_scope=agent": {"id_scope": "agent"}, "duplicate_window=60": {"duplicate_window": 60}}
    for r in range(rounds):
        for name, opts in options.items():
            store = make_store(f"{name}-{r}")
            fn = guarded(store, **opts)
            per_call(fn, history, 10**9)  # the journal's earlier calls, which a lookup must pass over
            results[name].append(per_call(fn, calls, 0))
            close = getattr(store, "close", None)
            if close is not None:
                close()
    return {name: statistics.median(times) for name, times in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where the journal files go (default: a temp dir)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--history", type=int, default=5000, help="calls each journal holds before it is timed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        stores: dict[str, Callable[[str], Any]] = {
            "memory": lambda name: InMemoryEffectStore(),
            "sqlite (process)": lambda name: SQLiteJournal(Path(tmp) / f"{name}.db", durability="process"),
        }
        for label, make in stores.items():
            medians = measure(make, args.calls, args.rounds, args.history)
            base = medians["default"]
            print(f"{label}:")
            for name, seconds in medians.items():
                print(f"  {name:<22} {seconds * 1e6:8.1f} us/call   x{seconds / base:.2f}")


if __name__ == "__main__":
    main()
