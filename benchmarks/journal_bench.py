"""How much a guarded call on SQLiteJournal costs against the raw transaction it cannot avoid.

Prints, for durability "full" and "process": a guarded call with a fresh tool call id, and a
replay, each against the floor measured in the same run on a file in the same directory (one raw
BEGIN IMMEDIATE; INSERT; COMMIT at the same synchronous level), with the ratios and the targets.
Then what the journal's own tables cost with no journal code: one raw transaction of an event row
and its projection row, and the fresh calls against two of them.

    python benchmarks/journal_bench.py [--dir DIR] [--calls N] [--rounds R] [--warmup W]
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
from journal.rows import CALL_COLUMNS, EVENT_COLUMNS

_ROW = ("2026-12-01T05:23:06.123456Z", "call-000000", "pending", "charge", "agent-1", "k" * 64,
        '{"account":"acct-1","cents":500}', "guard", 1, '{"host":"bench","pid":1}', "0" * 64, "f" * 64)


def floor(path: Path, synchronous: str) -> Callable[[int], float]:
    """One raw transaction of an event-sized row: the least a durable append can cost."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, at, call_id, kind, tool, agent_id, "
                 "idempotency_key, arguments, actor, attempt, owner, prev_hash, hash)")

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO events (at, call_id, kind, tool, agent_id, idempotency_key, arguments, "
                         "actor, attempt, owner, prev_hash, hash) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", _ROW)
            conn.execute("COMMIT")
        return (time.perf_counter() - start) / n

    return run


def schema_floor(path: Path, synchronous: str) -> Callable[[int], float]:
    """One raw transaction of what a guarded call's ``pending`` must write, in the journal's own
    tables and indexes (a file made by SQLiteJournal): an event row and its call's projection row,
    with no journal code (no reads, no hashing, no decision). The least the schema allows."""
    SQLiteJournal(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    events = ", ".join(EVENT_COLUMNS)
    calls = ", ".join(CALL_COLUMNS)
    insert_event = f"INSERT INTO events ({events}) VALUES ({', '.join('?' * len(EVENT_COLUMNS))})"
    insert_call = f"INSERT INTO calls ({calls}) VALUES ({', '.join('?' * len(CALL_COLUMNS))})"
    seq = [0]

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            seq[0] += 1
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(insert_event, (seq[0], at, call_id, "pending", *_ROW[3:7], None, None, None, "guard", 1,
                                        _ROW[9], "0" * 64, "f" * 64))
            conn.execute(insert_call, (call_id, "charge", "pending", 1, *_ROW[4:7], None, None, None, "guard",
                                       _ROW[9], at, at, at, seq[0]))
            conn.execute("COMMIT")
        return (time.perf_counter() - start) / n

    return run


def guarded_calls(path: Path, durability: str, replay: bool) -> Callable[[int], float]:
    """Guarded calls of one tool: each with a fresh tool call id, or all replays of one call."""
    journal = SQLiteJournal(path, durability=durability)  # type: ignore[arg-type]
    policy = SecurityPolicy(effect_guard=EffectGuard(store=journal))

    @Airlock(policy=policy)
    def charge(account: str, cents: int) -> dict[str, Any]:
        return {"charge_id": "ch_1", "cents": cents}

    counter = [0]
    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": "replayed-call"}):
        charge("acct-1", 500)

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            if replay:
                call_id = "replayed-call"
            else:
                counter[0] += 1
                call_id = f"call_{uuid.uuid4().hex[:24]}"  # random, as models make them
            with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": call_id}):
                charge("acct-1", 500)
        return (time.perf_counter() - start) / n

    return run


def threaded_calls(directory: Path, shared: bool, threads: int = 8) -> Callable[[int], float]:
    """Fresh guarded calls from ``threads`` threads at once (durability "process"), all through one
    shared SQLiteJournal (one connection behind a lock) or through one journal object per thread
    (a connection per thread, contending through SQLite's busy handler); time per call."""
    path = directory / f"threads-{'shared' if shared else 'each'}.db"
    journals = [SQLiteJournal(path, durability="process")]
    journals += [journals[0] if shared else SQLiteJournal(path, durability="process") for _ in range(threads - 1)]
    tools = []
    for journal in journals:
        @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
        def charge(account: str, cents: int) -> dict[str, Any]:
            return {"charge_id": "ch_1", "cents": cents}

        tools.append(charge)
    rounds = [0]

    def run(n: int) -> float:
        rounds[0] += 1
        per_thread = max(1, n // threads)
        barrier = threading.Barrier(threads + 1)

        def work(t: int) -> None:
            barrier.wait()
            for i in range(per_thread):
                with AirlockContext(metadata={"tool_call_id": f"r{rounds[0]}-t{t}-{i}"}):
                    tools[t]("acct-1", 500)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        barrier.wait()
        start = time.perf_counter()
        for w in workers:
            w.join()
        return (time.perf_counter() - start) / (per_thread * threads)

    return run


def measure(runs: dict[str, Callable[[int], float]], calls: dict[str, int], rounds: int,
            warmup: int) -> dict[str, float]:
    """The median per-call time of each run, the runs interleaved round by round so that noise
    from other work on the machine falls on all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        # Warm up the caches, and grow each WAL to the size it cycles at in a process that has been
        # running: after a checkpoint SQLite writes the WAL again from its start, and an fsync then
        # has no file size to record, where a WAL still growing makes every fsync record one.
        run(warmup)
    for _ in range(rounds):
        for name, run in runs.items():
            samples[name].append(run(calls[name]))
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (a real disk; default: a temp dir)")
    parser.add_argument("--calls", type=int, default=400, help="calls per round for the unsynced runs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1500, help="calls each run makes before it is timed")
    options = parser.parse_args()
    if options.dir is not None and not options.dir.is_dir():
        raise SystemExit(f"journal_bench.py: --dir {options.dir} is not a directory")
    with tempfile.TemporaryDirectory(dir=options.dir, prefix="journal-bench-") as tmp:
        d = Path(tmp)
        n, n_sync = options.calls, max(20, options.calls // 10)
        runs = {
            "floor FULL": floor(d / "floor-full.db", "FULL"),
            "floor NORMAL": floor(d / "floor-normal.db", "NORMAL"),
            "schema FULL": schema_floor(d / "schema-full.db", "FULL"),
            "schema NORMAL": schema_floor(d / "schema-normal.db", "NORMAL"),
            "fresh full": guarded_calls(d / "fresh-full.db", "full", replay=False),
            "replay full": guarded_calls(d / "replay-full.db", "full", replay=True),
            "fresh process": guarded_calls(d / "fresh-process.db", "process", replay=False),
            "replay process": guarded_calls(d / "replay-process.db", "process", replay=True),
            "threads shared": threaded_calls(d, shared=True),
            "threads each": threaded_calls(d, shared=False),
        }
        synced = {"floor FULL", "schema FULL", "fresh full"}
        t = measure(runs, {name: n_sync if name in synced else n for name in runs}, options.rounds, options.warmup)
    print(f"files in {options.dir or tempfile.gettempdir()}; median of {options.rounds} rounds, "
          f"after {options.warmup} calls of each run")
    print(f"{'':34}{'per call':>12}{'ratio':>9}{'target':>9}")
    rows = [
        ("floor: raw txn, synchronous=FULL", "floor FULL", None, None),
        ("floor: raw txn, synchronous=NORMAL", "floor NORMAL", None, None),
        ("fresh call, durability=full", "fresh full", "floor FULL", 1.25),
        ("replay, durability=full", "replay full", "floor NORMAL", 3.0),
        ("fresh call, durability=process", "fresh process", "floor NORMAL", 2.5),
        ("replay, durability=process", "replay process", "floor NORMAL", 3.0),
        ("8 threads, one shared journal", "threads shared", None, None),
        ("8 threads, a journal per thread", "threads each", "threads shared", None),
    ]
    for label, name, base, target in rows:
        line = f"{label:34}{t[name] * 1e6:10.1f}us"
        if base is not None:
            ratio = t[name] / t[base]
            line += f"{ratio:8.2f}x"
            if target is not None:
                line += f"{target:8.2f}x  {'ok' if ratio <= target else 'MISSED'}"
        print(line)
    # How much of the ratios the journal's tables make, written with no journal code at all: a
    # fresh call must write two such transactions (pending, then its outcome), one of them synced
    # at full.
    print("what the journal's tables cost alone (raw statements: an event row and its projection row):")
    print(f"{'  one transaction, FULL':34}{t['schema FULL'] * 1e6:10.1f}us{t['schema FULL'] / t['floor FULL']:8.2f}x"
          "  the FULL floor")
    print(f"{'  one transaction, NORMAL':34}{t['schema NORMAL'] * 1e6:10.1f}us"
          f"{t['schema NORMAL'] / t['floor NORMAL']:8.2f}x  the NORMAL floor")
    least_full, least_process = t["schema FULL"] + t["schema NORMAL"], 2 * t["schema NORMAL"]
    print(f"  fresh call at full    {t['fresh full'] / least_full:5.2f}x its two transactions "
          f"(those alone: {least_full / t['floor FULL']:.2f}x the FULL floor)")
    print(f"  fresh call at process {t['fresh process'] / least_process:5.2f}x its two transactions "
          f"(those alone: {least_process / t['floor NORMAL']:.2f}x the NORMAL floor)")


if __name__ == "__main__":
    main()
