"""What a lease costs a guarded call: a fresh call with and without ``EffectGuard(lease=...)``.

    python benchmarks/lease_bench.py [--calls 2000] [--rounds 5] [--pg postgresql://...]
    python benchmarks/lease_bench.py --gil

``--gil`` measures instead how long a C call that holds the GIL delays a thread that wakes every
10 ms, as the guard's renewing thread does: the longest gap it saw, beside the call's length.

For each store (in memory, SQLite at durability "process" and "full", and PostgreSQL when --pg
names a server) it prints the median per-call time of a fresh guarded call without a lease and
with one, and their ratio. Rounds alternate the two so that machine noise hits both alike. A lease
adds a write before the call's begin and one after its outcome; the renewal thread does nothing
for calls shorter than a third of the lease.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard, InMemoryEffectStore
from journal import SQLiteJournal


def charge(account: str, cents: int) -> dict[str, object]:
    return {"charge_id": "ch_1", "account": account, "cents": cents}


def per_call(store: Any, lease: float | None, prefix: str, calls: int) -> float:
    """Microseconds per fresh guarded call of ``charge`` on ``store``."""
    guarded = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store, lease=lease)))(charge)
    contexts = [AirlockContext(agent_id="bench", metadata={"tool_call_id": f"{prefix}-{i}"}) for i in range(calls)]
    gc.collect()
    start = time.perf_counter()
    for ctx in contexts:
        with ctx:
            guarded("acct_1", 500)
    return (time.perf_counter() - start) / calls * 1e6


def measure(name: str, make: Callable[[], Any], calls: int, rounds: int) -> None:
    store = make()
    plain: list[float] = []
    leased: list[float] = []
    try:
        per_call(store, 30.0, "warm", min(calls, 200))
        for r in range(rounds):
            plain.append(per_call(store, None, f"p{r}", calls))
            leased.append(per_call(store, 30.0, f"l{r}", calls))
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
    a, b = statistics.median(plain), statistics.median(leased)
    print(f"  {name:<24} {a:9.1f} us   {b:9.1f} us   {b / a:5.2f}x")


def gil_starvation(seconds: float) -> None:
    """Print how long a thread that wakes every 10 ms waits while a C call holds the GIL."""
    import threading

    gaps: list[float] = []
    done = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not done.wait(0.01):
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.1)
    n = 1_000_000
    start = time.perf_counter()
    sum(range(n))
    per = (time.perf_counter() - start) / n
    n = max(1, int(seconds / per))
    gaps.clear()
    start = time.perf_counter()
    sum(range(n))  # one C call: the GIL is not let go until it returns
    held = time.perf_counter() - start
    time.sleep(0.05)
    done.set()
    thread.join()
    print(f"a C call holding the GIL for {held * 1000:.0f} ms; the 10 ms thread's longest gap: "
          f"{max(gaps) * 1000:.0f} ms ({max(gaps) / held:.2f} of the call)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pg", help="a PostgreSQL DSN to measure a PostgresJournal on (an empty database)")
    parser.add_argument("--gil", action="store_true",
                        help="measure how long a C call holding the GIL starves a renewing thread")
    opts = parser.parse_args()
    if opts.gil:
        for seconds in (0.5, 2.0):
            gil_starvation(seconds)
        return
    print(f"fresh guarded call, {opts.calls} calls x {opts.rounds} rounds (median per call)")
    print(f"  {'store':<24} {'no lease':>12}   {'lease=30':>12}   ratio")
    with tempfile.TemporaryDirectory() as d:
        measure("in memory", InMemoryEffectStore, opts.calls * 5, opts.rounds)
        measure("sqlite, process", lambda: SQLiteJournal(Path(d) / "p.db", durability="process"),
                opts.calls, opts.rounds)
        measure("sqlite, full", lambda: SQLiteJournal(Path(d) / "f.db"), opts.calls // 2 or 1, opts.rounds)
    if opts.pg:
        from journal.postgres import PostgresJournal

        measure("postgresql", lambda: PostgresJournal(opts.pg), opts.calls // 4 or 1, opts.rounds)


if __name__ == "__main__":
    main()
