"""What an approval costs a guarded call: a call that passes the approval gate with a grant against
the same call without any escalation.

    python benchmarks/approval_bench.py [--calls 2000] [--rounds 5] [--pg postgresql://...]

For each store (in memory, SQLite at durability "process" and "full", and PostgreSQL when --pg
names a server) it prints the median per-call time of a fresh guarded call of ``charge`` under a
policy that does not escalate it, and of the same call under ``SecurityPolicy(escalate_tools=
{"charge": ...}, approver=ApprovalQueue())`` whose request was made and approved beforehand, and
their ratio. Only the call that consumes the grant is timed: for each round the requests are made
(each call refused ``approval_pending``) and approved (``decide_request``) before the timed loop.
Rounds alternate the two so that machine noise hits both alike. A granted call takes the store's
approval step (the call's record and its latest request read, ``approval_consumed`` appended with
the call's ``pending``) where a plain call takes ``begin``.
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

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.approvals import ApprovalQueue, decide_request
from guard.effect_guard import EffectGuard, InMemoryEffectStore
from journal import SQLiteJournal


def charge(account: str, cents: int) -> dict[str, object]:
    return {"charge_id": "ch_1", "account": account, "cents": cents}


def per_call(store: Any, escalated: bool, prefix: str, calls: int) -> float:
    """Microseconds per fresh guarded call of ``charge`` on ``store``; with ``escalated``, each call
    consumes a grant made for it before the timing."""
    guard = EffectGuard(store=store)
    policy = (SecurityPolicy(escalate_tools={"charge": "moves money"}, approver=ApprovalQueue(ttl=3600),
                             effect_guard=guard)
              if escalated else SecurityPolicy(effect_guard=guard))
    guarded = Airlock(policy=policy)(charge)
    ids = [f"{prefix}-{i}" for i in range(calls)]
    contexts = [AirlockContext(agent_id="bench", metadata={"tool_call_id": call_id}) for call_id in ids]
    if escalated:  # the requests, asked and approved: not timed
        for call_id, ctx in zip(ids, contexts, strict=True):
            with ctx:
                asked = guarded("acct_1", 500)
            assert is_refusal(asked) and asked["block_reason"] == "approval_pending", asked
            decide_request(store, call_id, approve=True, operator="bench", reason="benchmark")
    results: list[Any] = []
    gc.collect()
    start = time.perf_counter()
    for ctx in contexts:
        with ctx:
            results.append(guarded("acct_1", 500))
    elapsed = time.perf_counter() - start
    ran = sum(1 for r in results if not is_refusal(r))
    if ran != calls:
        raise SystemExit(f"{prefix}: {calls - ran} of {calls} calls did not run: {results[0]!r}")
    return elapsed / calls * 1e6


def measure(name: str, make: Callable[[], Any], calls: int, rounds: int) -> None:
    store = make()
    plain: list[float] = []
    granted: list[float] = []
    try:
        per_call(store, True, "warm", min(calls, 200))
        per_call(store, False, "warm-plain", min(calls, 200))
        for r in range(rounds):
            plain.append(per_call(store, False, f"p{r}", calls))
            granted.append(per_call(store, True, f"g{r}", calls))
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
    a, b = statistics.median(plain), statistics.median(granted)
    print(f"  {name:<24} {a:9.1f} us   {b:9.1f} us   {b / a:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pg", help="a PostgreSQL DSN to measure a PostgresJournal on (an empty database)")
    opts = parser.parse_args()
    print(f"fresh guarded call, {opts.calls} calls x {opts.rounds} rounds (median per call)")
    print(f"  {'store':<24} {'no escalation':>12}   {'with a grant':>12}   ratio")
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
