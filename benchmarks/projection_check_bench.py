"""What the check of the projection against the log costs a guarded call on SQLite.

    python benchmarks/projection_check_bench.py [--calls 2000] [--rounds 5]

A write that decides a call looks up, in the same statement that reads the call's row, whether
the log has a state-changing event of it (docs/journal.md, "What a writer with the file can
hide"). This prints the median per-call time of a fresh call and of a replay at durability
"process" and "full", with the check and with that lookup taken out of the statement (the journal
as it was before), and their ratio. Rounds alternate the two so that machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
from journal.rows import CHANGING_KINDS
from journal.sqlite import writes

CHECKED = writes._SELECT_HEAD_AND_CALL
# The same statement without the lookup: a NULL in its place, so the row keeps its shape.
UNCHECKED = CHECKED.replace(
    "CASE WHEN calls.status IS NULL OR calls.status = 'released' THEN "
    f"(SELECT 1 FROM events WHERE call_id = ?1 AND kind IN {CHANGING_KINDS}) END", "NULL")
assert UNCHECKED != CHECKED


def charge(account: str, cents: int) -> dict[str, object]:
    return {"charge_id": "ch_1", "account": account, "cents": cents}


@contextmanager
def statement(text: str) -> Iterator[None]:
    writes._SELECT_HEAD_AND_CALL = text
    try:
        yield
    finally:
        writes._SELECT_HEAD_AND_CALL = CHECKED


def per_call(journal: SQLiteJournal, ids: list[str]) -> float:
    """Microseconds per guarded call of ``charge`` with each of ``ids``."""
    guarded = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))(charge)
    contexts = [AirlockContext(agent_id="bench", metadata={"tool_call_id": i}) for i in ids]
    gc.collect()
    start = time.perf_counter()
    for ctx in contexts:
        with ctx:
            guarded("acct_1", 500)
    return (time.perf_counter() - start) / len(ids) * 1e6


def measure(durability: str, calls: int, rounds: int, folder: Path) -> None:
    journal = SQLiteJournal(folder / f"{durability}.db", durability=durability)  # type: ignore[arg-type]
    times: dict[tuple[str, str], list[float]] = {}
    try:
        per_call(journal, [f"warm-{i}" for i in range(min(calls, 200))])
        for r in range(rounds):
            pair = [("checked", CHECKED), ("unchecked", UNCHECKED)]
            for name, text in pair if r % 2 else pair[::-1]:  # each goes first in every other round
                ids = [f"{name}-{r}-{i}" for i in range(calls)]
                with statement(text):
                    times.setdefault(("fresh", name), []).append(per_call(journal, ids))
                    times.setdefault(("replay", name), []).append(per_call(journal, ids))
    finally:
        journal.close()
    for path in ("fresh", "replay"):
        checked = statistics.median(times[path, "checked"])
        unchecked = statistics.median(times[path, "unchecked"])
        print(f"  {durability:<8} {path:<7} {unchecked:9.1f} us   {checked:9.1f} us   {checked / unchecked:5.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("  SQLite   path       without the check   with it   ratio")
    with tempfile.TemporaryDirectory() as folder:
        for durability in ("process", "full"):
            measure(durability, args.calls, args.rounds, Path(folder))


if __name__ == "__main__":
    main()
