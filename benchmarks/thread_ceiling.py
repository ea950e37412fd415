"""How far N threads can go over one at durability="full" on this machine, with and without the journal.

Durable calls from many threads gain only where a thread's wait for the disk leaves the CPUs free
for the others: the most N threads can make is bounded by the calls per second the machine makes
when no thread ever waits for an fsync. This script measures that bound on a model of the write
path that has no journal code in it, and the journal beside it, in one process, the runs
interleaved round by round:

- the disk: one page rewritten and fdatasync'ed, per second;
- the model: the journal's own tables and indexes (a file made by SQLiteJournal), two raw
  statements a write (the event, the projection row), one connection behind a lock, the writes
  that wait for it made together in one transaction, and the fsync after a ``pending`` shared by
  the threads that wait for one (group commit), as SQLiteJournal does it; no guard, no hashing, no
  decision. From one thread and from N with the fsync, and from N without it: the ceiling;
- SQLiteJournal behind the guard: one thread and N at ``full``, N at ``process``.

    python benchmarks/thread_ceiling.py [--dir DIR] [--threads N] [--calls K] [--rounds R]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
from journal.rows import CALL_COLUMNS, EVENT_COLUMNS

_INSERT_EVENT = f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) VALUES ({', '.join('?' * len(EVENT_COLUMNS))})"
_UPSERT_CALL = (
    f"INSERT INTO calls ({', '.join(CALL_COLUMNS)}) VALUES ({', '.join('?' * len(CALL_COLUMNS))}) "
    "ON CONFLICT (call_id) DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in CALL_COLUMNS[1:])
)
_ARGUMENTS = '{"account":"acct_1","cents":500}'
_OWNER = '{"host":"bench","pid":1}'


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # random, as models make them


class Model:
    """The journal's write path with nothing of the journal's code: see the module's docstring."""

    def __init__(self, path: Path, fsync: bool) -> None:
        SQLiteJournal(path).close()  # the journal's schema, tables and indexes
        self.fsync = fsync
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA synchronous = NORMAL")
        self.wal = str(path) + "-wal"
        self.wal_fd: int | None = None
        self.lock = threading.Lock()
        self.queue: collections.deque[list[Any]] = collections.deque()
        self.seq = 0
        self.group = threading.Condition()
        self.written = self.synced = 0
        self.syncing = False

    def write(self, call_id: str, kind: str) -> int:
        """Record one event and its projection row; returns the commit's ticket."""
        request: list[Any] = [call_id, kind, 0]
        self.queue.append(request)
        with self.lock:
            if not request[2]:
                batch = []
                while self.queue:
                    batch.append(self.queue.popleft())
                self.conn.execute("BEGIN IMMEDIATE")
                for call, what, _ in batch:
                    self.seq += 1
                    at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                    self.conn.execute(_INSERT_EVENT, (
                        self.seq, at, call, what, "charge", "bench", "k" * 64, _ARGUMENTS, None, None, None,
                        "guard", 1, _OWNER, "0" * 64, "f" * 64))
                    self.conn.execute(_UPSERT_CALL, (
                        call, "charge", what, 1, "bench", "k" * 64, _ARGUMENTS, None, None, None, "guard", _OWNER,
                        at, at, at, self.seq))
                self.conn.execute("COMMIT")
                self.written += 1
                for taken in batch:
                    taken[2] = self.written
        return int(request[2])

    def durable(self, ticket: int) -> None:
        """Return once the commit ``ticket`` is on disk: one fsync for every thread waiting."""
        with self.group:
            while self.synced < ticket and self.syncing:
                self.group.wait()
            if self.synced >= ticket:
                return
            covered, self.syncing = self.written, True
        try:
            if self.wal_fd is None:
                self.wal_fd = os.open(self.wal, os.O_RDWR)
            os.fdatasync(self.wal_fd)
        finally:
            with self.group:
                self.syncing = False
                self.synced = max(self.synced, covered)
                self.group.notify_all()

    def call(self, call_id: str) -> None:
        ticket = self.write(call_id, "pending")
        if self.fsync:
            self.durable(ticket)
        self.write(call_id, "committed")


def journal_call(path: Path, durability: str) -> Callable[[str], None]:
    """One guarded call on a SQLiteJournal at ``durability``, for a call id."""
    journal = SQLiteJournal(path, durability=durability)  # type: ignore[arg-type]

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        return {"account": account, "cents": cents}

    def call(call_id: str) -> None:
        with AirlockContext(agent_id="bench", metadata={"tool_call_id": call_id}):
            charge("acct_1", 500)

    return call


def rate(call: Callable[[str], None], threads: int, calls: int) -> float:
    """Calls per second of ``calls`` fresh calls, shared by ``threads`` threads all started at once."""
    per_thread = max(1, calls // threads)
    ids = [[_call_id() for _ in range(per_thread)] for _ in range(threads)]
    barrier = threading.Barrier(threads + 1)
    failed: list[BaseException] = []

    def work(mine: list[str]) -> None:
        barrier.wait()
        try:
            for call_id in mine:
                call(call_id)
        except BaseException as e:
            failed.append(e)

    workers = [threading.Thread(target=work, args=(mine,)) for mine in ids]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    if failed:
        raise SystemExit(f"thread_ceiling.py: a call failed: {failed[0]!r}")
    return per_thread * threads / elapsed


def disk(directory: Path) -> Callable[[int], float]:
    """Pages rewritten and fdatasync'ed per second, on a file in ``directory``."""
    fd = os.open(directory / "disk.bin", os.O_RDWR | os.O_CREAT, 0o600)
    page = b"\0" * 4096
    for i in range(16):
        os.pwrite(fd, page, i * 4096)
    os.fdatasync(fd)
    counter = itertools.count()

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            os.pwrite(fd, page, next(counter) % 16 * 4096)
            os.fdatasync(fd)
        return n / (time.perf_counter() - start)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where the files go (a disk, not tmpfs)")
    parser.add_argument("--threads", type=int, default=8, help="threads for the many-thread runs")
    parser.add_argument("--calls", type=int, default=2000, help="calls per run and round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; each figure is the median")
    parser.add_argument("--warmup", type=int, default=1500, help="calls each file takes before it is timed")
    options = parser.parse_args()
    for flag in ("threads", "calls", "rounds"):
        if getattr(options, flag) < 1:
            parser.error(f"--{flag} is a number, 1 or more")
    if options.warmup < 0:
        parser.error("--warmup is a number, 0 or more")
    if not options.dir.is_dir():
        parser.error(f"--dir {options.dir} is not a directory")
    n = options.threads
    with tempfile.TemporaryDirectory(dir=options.dir, prefix="thread-ceiling-") as tmp:
        d = Path(tmp)
        synced, unsynced = Model(d / "model-full.db", fsync=True), Model(d / "model-none.db", fsync=False)
        full, process = journal_call(d / "full.db", "full"), journal_call(d / "process.db", "process")
        fsyncs = disk(d)
        runs: dict[str, Callable[[], float]] = {
            "disk": lambda: fsyncs(max(1, options.calls // 4)),
            "model 1": lambda: rate(synced.call, 1, options.calls),
            "model n": lambda: rate(synced.call, n, options.calls),
            "model n unsynced": lambda: rate(unsynced.call, n, options.calls),
            "model 1 unsynced": lambda: rate(unsynced.call, 1, options.calls),
            "full 1": lambda: rate(full, 1, options.calls),
            "full n": lambda: rate(full, n, options.calls),
            "process n": lambda: rate(process, n, options.calls),
            "process 1": lambda: rate(process, 1, options.calls),
        }
        for call in (synced.call, unsynced.call, full, process):
            rate(call, 1, options.warmup)  # a WAL grown to the size it cycles at, caches warm
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(options.rounds):
            for name, run in runs.items():
                samples[name].append(run())
        r = {name: statistics.median(s) for name, s in samples.items()}

    print(f"files in {options.dir}; {os.cpu_count()} CPUs; median of {options.rounds} rounds of "
          f"{options.calls} fresh calls, interleaved; calls per second")
    print(f"disk: one page rewritten and fdatasync'ed      {r['disk']:8.0f}/s")
    print(f"{'':44}{'1 thread':>10}{f'{n} threads':>12}{'ratio':>8}")
    rows = [
        ("model, fsync after pending (group commit)", "model 1", "model n"),
        ("model, no fsync (what the CPUs allow)", "model 1 unsynced", "model n unsynced"),
        ('SQLiteJournal, durability="full"', "full 1", "full n"),
        ('SQLiteJournal, durability="process"', "process 1", "process n"),
    ]
    for label, one, many in rows:
        print(f"{label:44}{r[one]:10.0f}{r[many]:12.0f}{r[many] / r[one]:7.2f}x")
    # No number of threads makes durable calls faster than the machine makes them with no fsync at
    # all, from one thread or from N: that rate over one thread's durable rate bounds the ratio.
    ceiling = max(r["model 1 unsynced"], r["model n unsynced"]) / r["model 1"]
    print(f"the bound for {n} threads at full (the model's best rate without fsync / its one thread with it): "
          f"{ceiling:.2f}x")
    print(f"the journal at full, {n} threads / one: {r['full n'] / r['full 1']:.2f}x "
          f"(target >= 2.5x; {r['full n'] / r['model n']:.2f} of the model's {n}-thread rate)")


if __name__ == "__main__":
    main()
