"""What the client's deadline on each exchange with PostgreSQL costs a guarded call's ``begin``.

    .venv/bin/python benchmarks/pg_deadline_cost.py [--rounds 5] [--calls 1500]

Starts a throwaway cluster as the tests do (tests/pgserver.py), and times ``begin`` of fresh calls on
a PostgresJournal of one connection with the deadline (``busy_timeout + timeout``) and without it,
in alternating rounds; prints the medians and their ratio. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guard.store import Decision, EffectEvent, Verdict
from journal.postgres import PostgresJournal
from journal.postgres.deadline import DeadlineConnection
from tests.pgserver import fresh_database, server


def median_begin(dsn: str, calls: int, deadline: bool) -> float:
    journal = PostgresJournal(dsn, pool_size=1)
    if not deadline:  # the pool's one session goes without one
        with journal.datastore.pool.connection() as conn:
            assert isinstance(conn, DeadlineConnection)
            conn.set_deadline(None)
    times = []
    try:
        for n in range(calls):
            call_id = f"c{n}"
            decision = Decision(Verdict.RUN, EffectEvent("pending", call_id, "pay", attempt=1, arguments="{}"))
            started = time.perf_counter()
            journal.begin(call_id, lambda record, d=decision: d)
            times.append(time.perf_counter() - started)
        with journal.datastore.pool.connection() as conn:
            assert isinstance(conn, DeadlineConnection) and (conn.answer_within is not None) == deadline
    finally:
        journal.close()
    return statistics.median(times[calls // 10:])  # past the warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=1500)
    args = parser.parse_args()
    srv = server()
    try:
        found: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for deadline in (False, True):
                found[deadline].append(median_begin(fresh_database(srv), args.calls, deadline))
    finally:
        srv.destroy()
    without, with_ = statistics.median(found[False]), statistics.median(found[True])
    print(f"begin without the deadline: {without * 1e6:.0f} us")
    print(f"begin with the deadline: {with_ * 1e6:.0f} us")
    print(f"with / without: {with_ / without:.3f}")


if __name__ == "__main__":
    main()
