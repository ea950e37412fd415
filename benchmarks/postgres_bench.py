"""What a guarded call on PostgresJournal costs, against raw transactions on the same server.

Prints, in one run on one server:

- one process: a raw INSERT of an event-sized row as its own transaction (autocommit: one
  statement, one round trip, the least a durable append can cost), the same committed without
  waiting for the flush (so the floor less that is its fsync, and the script prints how long a
  commit's fsync must take for a fresh call to be within 2x of the floor), the same as BEGIN; INSERT;
  COMMIT (pipelined into one round trip, and plainly, one round trip per statement), the pipelined
  one with the chain-head row locked and updated (what serialising the appends adds), and a guarded
  call with a fresh tool call id and a replay, with their ratios to the floor (target for the
  fresh call: within 2x);
- 8 processes with distinct ids: raw INSERT transactions without and with the head-row lock, and
  guarded fresh calls, in transactions or calls per second.

Without ``--dsn`` it starts a throwaway cluster (tests/pgserver.py, default settings: fsync and
synchronous_commit on) and removes it afterwards.

    python benchmarks/postgres_bench.py [--dsn URL] [--calls N] [--rounds R] [--procs P] [--seconds S]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal.postgres import PostgresJournal
from journal.rows import CALL_COLUMNS, EVENT_COLUMNS

_ROW = ("2026-12-01T05:23:06.123456Z", "pending", "charge", "agent-1", "k" * 64,
        '{"account":"acct-1","cents":500}', "guard", 1, '{"host":"bench","pid":1}', "0" * 64, "f" * 64)
# The raw tables live in a schema of their own: the journal's schema must hold only the journal.
_RAW_TABLE = """
CREATE SCHEMA IF NOT EXISTS bench_raw;
CREATE TABLE IF NOT EXISTS bench_raw.raw_events (
    seq bigserial PRIMARY KEY, at text, call_id text, kind text, tool text, agent_id text,
    idempotency_key text, arguments text, actor text, attempt integer, owner text, prev_hash text, hash text
);
CREATE INDEX IF NOT EXISTS raw_events_call_id ON bench_raw.raw_events (call_id, seq);
CREATE TABLE IF NOT EXISTS bench_raw.raw_head (id smallint PRIMARY KEY, seq bigint, hash text);
INSERT INTO bench_raw.raw_head VALUES (1, 0, '') ON CONFLICT DO NOTHING;
"""
_INSERT = ("INSERT INTO bench_raw.raw_events (at, call_id, kind, tool, agent_id, idempotency_key, arguments, actor, "
           "attempt, owner, prev_hash, hash) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)")


def raw_single(dsn: str, relaxed: bool = False) -> Callable[[int], float]:
    """One raw INSERT per op, as its own transaction (autocommit: one statement, one round trip);
    ``relaxed``: committed without waiting for the WAL flush (all but the fsync)."""
    conn = psycopg.connect(dsn, autocommit=True)
    if relaxed:
        conn.execute("SET synchronous_commit = off")

    def run(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            conn.execute(_INSERT, (_ROW[0], f"raw-{i}", *_ROW[1:]))
        return (time.perf_counter() - start) / n

    return run


def raw(dsn: str, *, locked: bool, pipelined: bool) -> Callable[[int], float]:
    """One raw INSERT transaction per op; ``locked`` also locks and updates the head row first."""
    conn = psycopg.connect(dsn, autocommit=True)

    def one(n: int) -> None:
        if locked:
            conn.execute("SELECT seq FROM bench_raw.raw_head WHERE id = 1 FOR UPDATE")
        conn.execute(_INSERT, (_ROW[0], f"raw-{n}", *_ROW[1:]))
        if locked:
            conn.execute("UPDATE bench_raw.raw_head SET seq = seq + 1, hash = %s WHERE id = 1", ("f" * 64,))

    def run(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            if pipelined:
                with conn.pipeline(), conn.transaction():
                    one(i)
            else:
                with conn.transaction():
                    one(i)
        return (time.perf_counter() - start) / n

    return run


# What a fresh call must write, in the journal's own tables and as one statement a transaction (the
# least round trips), with no journal code: the head moved, the event inserted at its seq, the
# call's projection row written. The outcome's statement commits without waiting for the flush, as
# the journal's does.
_SCHEMA_APPEND = (
    "WITH head AS (UPDATE chain_head SET seq = seq + 1, hash = %s WHERE id = 1{relaxed} RETURNING seq), "
    f"event AS (INSERT INTO events ({', '.join(EVENT_COLUMNS)}) "
    f"SELECT head.seq, {', '.join(['%s'] * (len(EVENT_COLUMNS) - 1))} FROM head), "
    f"call AS (INSERT INTO calls ({', '.join(CALL_COLUMNS)}) "
    f"SELECT {', '.join(['%s'] * (len(CALL_COLUMNS) - 1))}, head.seq FROM head "
    "ON CONFLICT (call_id) DO UPDATE SET status = EXCLUDED.status, value = EXCLUDED.value, "
    "updated_at = EXCLUDED.updated_at, since = EXCLUDED.since, last_seq = EXCLUDED.last_seq) "
    "SELECT seq FROM head"
)


def schema_floor(dsn: str) -> Callable[[int], float]:
    """A fresh call's two appends (pending, then committed) as raw statements in the journal's own
    tables, in a schema of their own: what the tables cost with no journal code."""
    PostgresJournal(dsn).close()  # the journal's tables, in the schema the DSN names
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SET airlock.layout = '6'")  # as the journal's own sessions: it moves the head
    pending = _SCHEMA_APPEND.format(relaxed="")
    outcome = _SCHEMA_APPEND.format(relaxed=" AND set_config('synchronous_commit', 'off', true) = 'off'")

    def append(sql: str, call_id: str, kind: str, value: str | None) -> None:
        at = _ROW[0]
        conn.execute(sql, ("f" * 64, at, call_id, kind, "charge", "agent-1", "k" * 64, _ROW[5], value, None, None,
                           "guard", 1, _ROW[8], "0" * 64, "f" * 64,
                           call_id, "charge", kind, 1, "agent-1", "k" * 64, _ROW[5], value, None, None, "guard",
                           _ROW[8], at, at, at))

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            append(pending, call_id, "pending", None)
            append(outcome, call_id, "committed", '{"charge_id":"ch_1","cents":500}')
        return (time.perf_counter() - start) / n

    return run


def guarded(journal: PostgresJournal, replay: bool) -> Callable[[int], float]:
    """Guarded calls of one tool: each with a fresh tool call id, or all replays of one call."""

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        return {"charge_id": "ch_1", "cents": cents}

    prefix = uuid.uuid4().hex[:8]
    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": f"{prefix}-replayed"}):
        charge("acct-1", 500)
    counter = [0]

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            counter[0] += 1
            call_id = f"{prefix}-replayed" if replay else f"call_{uuid.uuid4().hex[:24]}"  # random, as models make them
            with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": call_id}):
                charge("acct-1", 500)
        return (time.perf_counter() - start) / n

    return run


def interleaved(runs: dict[str, Callable[[int], float]], calls: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per op of each run, for each round; every round runs each one in turn."""
    for run in runs.values():
        run(max(10, calls // 10))  # warm up: connections, prepared statements
    timings: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            timings[key].append(run(calls))
    return timings


def print_break_even(timings: dict[str, list[float]]) -> None:
    """Where the 2x target would be met: the floor is one fsync F and work w; a fresh call is one
    fsync (its pending) and work W. (F + W) <= 2 (F + w) holds where F >= W - 2w."""
    floor, nosync, fresh = (statistics.median(timings[k]) for k in ("floor", "nosync", "fresh"))
    fsync = max(0.0, floor - nosync)
    work_floor, work_fresh = floor - fsync, fresh - fsync
    need = work_fresh - 2 * work_floor
    print(f"  the floor's wait for its fsync (floor minus the unflushed INSERT): {fsync * 1e3:.3f} ms;"
          f" a fresh call does {work_fresh * 1e3:.3f} ms besides, the floor {work_floor * 1e3:.3f} ms")
    if need > 0:
        print(f"  a fresh call is within 2x of the floor where a commit's fsync takes {need * 1e3:.3f} ms or more")
    else:
        print("  a fresh call is within 2x of the floor whatever a commit's fsync takes")


# -- many processes --------------------------------------------------------------------------------


def _worker(kind: str, dsn: str, seconds: float, barrier: Any, results: Any) -> None:
    if kind == "guarded":
        journal = PostgresJournal(dsn, pool_size=1)
        run = guarded(journal, replay=False)
    elif kind == "raw":
        run = raw_single(dsn)
    else:
        run = raw(dsn, locked=True, pipelined=True)
    run(20)
    barrier.wait()
    done, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        run(10)
        done += 10
    results.put(done)


def throughput(kind: str, dsn: str, procs: int, seconds: float) -> float:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(kind, dsn, seconds, barrier, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    total = sum(results.get(timeout=seconds + 120) for _ in workers)
    for w in workers:
        w.join()
    return total / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="an existing server's database (default: a throwaway cluster)")
    parser.add_argument("--calls", type=int, default=500, help="ops per round (one process)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the median is shown")
    parser.add_argument("--procs", type=int, default=8, help="processes for the throughput figures")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per throughput figure")
    args = parser.parse_args()

    server = None
    if args.dsn:
        dsn = args.dsn
    else:
        from tests import pgserver

        server = pgserver.server()
        dsn = pgserver.fresh_database(server)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(_RAW_TABLE.encode())
            conn.execute("DROP SCHEMA IF EXISTS bench_tables CASCADE; CREATE SCHEMA bench_tables")
            version = conn.execute("SHOW server_version").fetchone()
            settings = dict(conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit')"
            ).fetchall())
        journal = PostgresJournal(dsn, pool_size=2)
        print(f"PostgreSQL {version[0] if version else '?'}: fsync={settings.get('fsync')}, "
              f"synchronous_commit={settings.get('synchronous_commit')}; median of {args.rounds} rounds "
              f"of {args.calls}")
        print("one process, per op (rounds interleaved: the disk's fsync latency drifts):")
        runs = {
            "floor": ("raw INSERT, autocommit: one statement (the floor)", raw_single(dsn)),
            "nosync": ("the same, committed without waiting for the flush", raw_single(dsn, relaxed=True)),
            "pipelined": ("raw BEGIN; INSERT; COMMIT, pipelined: one round trip",
                          raw(dsn, locked=False, pipelined=True)),
            "plain": ("raw BEGIN; INSERT; COMMIT, a round trip per statement",
                      raw(dsn, locked=False, pipelined=False)),
            "locked": ("raw INSERT + head-row lock and update, pipelined", raw(dsn, locked=True, pipelined=True)),
            "tables": ("the journal's tables alone: 2 raw statements (pending + committed)",
                       schema_floor(make_conninfo(dsn, options="-csearch_path=bench_tables"))),
            "fresh": ("guarded call, fresh tool call id (pending + committed)", guarded(journal, replay=False)),
            "replay": ("guarded call, replay of a committed call", guarded(journal, replay=True)),
        }
        timings = interleaved({k: run for k, (_, run) in runs.items()}, args.calls, args.rounds)
        for key, (label, _) in runs.items():
            print(f"  {label:<58} {statistics.median(timings[key]) * 1e3:8.3f} ms")
        for key, what in (("fresh", "fresh guarded call"), ("replay", "replay"), ("tables", "the tables alone"),
                          ("pipelined", "pipelined raw"), ("plain", "plain raw"), ("locked", "head-row lock")):
            ratios = [t / f for t, f in zip(timings[key], timings["floor"], strict=True)]
            print(f"  {what + ' / floor:':<30} {statistics.median(ratios):.2f}x"
                  f"{'  (target: within 2x)' if key == 'fresh' else ''}")
        ratios = [t / f for t, f in zip(timings["fresh"], timings["tables"], strict=True)]
        print(f"  {'fresh guarded call / the tables alone:':<30} {statistics.median(ratios):.2f}x")
        print_break_even(timings)
        journal.close()

        print(f"{args.procs} processes, distinct ids, {args.seconds:g} s each:")
        raw_free = throughput("raw", dsn, args.procs, args.seconds)
        raw_locked = throughput("raw-locked", dsn, args.procs, args.seconds)
        calls = throughput("guarded", dsn, args.procs, args.seconds)
        print(f"  raw INSERTs, autocommit, no lock              {raw_free:9.0f} tx/s")
        print(f"  raw INSERT transactions + head-row lock       {raw_locked:9.0f} tx/s"
              f"  ({raw_locked / raw_free:.2f}x of no lock)")
        print(f"  guarded fresh calls (2 transactions each)     {calls:9.0f} calls/s")
    finally:
        if server is not None:
            from tests import pgserver

            pgserver.shutdown()


if __name__ == "__main__":
    main()
