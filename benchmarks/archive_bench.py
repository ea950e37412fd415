"""What archiving costs: ``airlock journal archive`` of 90% of a journal, ``verify`` before and after,
and archive plus journal verified as one chain; the file's size before and after (and what is left
in it, table by table with its indexes), each command's peak memory, and how long a guarded call
made meanwhile had to wait. Prints figures, asserts nothing.

    .venv/bin/python benchmarks/archive_bench.py                   # 1,000,000 events
    .venv/bin/python benchmarks/archive_bench.py --events 200000   # fewer, for a quick look

The journal holds calls that committed (a ``pending`` and a ``committed`` event each, and the
call's projection row), inserted in bulk with the chain's own hash rule and the guard's own fold,
one millisecond apart. Each command runs as the installed ``airlock`` script in a real process;
its wall time, and its peak resident memory as the kernel counts it, are printed.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
from journal.chain import GENESIS
from journal.events import at_text
from journal.export import row_hash
from journal.projection import fold_row, record_row

AIRLOCK = str(Path(sys.executable).with_name("airlock"))
_START = datetime(2026, 1, 1, tzinfo=UTC)


def at_of(seq: int) -> str:
    """The time of event ``seq`` in the journal :func:`fill` makes."""
    return at_text(_START + timedelta(milliseconds=seq))


def fill(path: Path, events: int) -> None:
    """A journal of ``events`` // 2 committed calls, one event a millisecond from 2026-01-01."""
    SQLiteJournal(path).close()
    conn = sqlite3.connect(path)
    prev, rows = GENESIS, []
    records: dict[str, Any] = {}
    insert = f"INSERT INTO events VALUES ({', '.join('?' * 16)})"
    for seq in range(1, events + 1):
        call = (seq + 1) // 2
        at = at_of(seq)
        pending = seq % 2 == 1
        row = (seq, at, f"call_{call:08d}", "pending" if pending else "committed", "charge", "agent-1",
               f"key-{call:08d}", f'{{"account":"acct_{call % 997}","cents":{call % 5000}}}',
               None if pending else f'{{"charge_id":"ch_{call}"}}', None, None, "guard", 1,
               '{"host":"bench","pid":1}', prev)
        prev = row_hash((*row, ""))
        full = (*row, prev)
        fold_row(records, full)
        rows.append(full)
        if len(rows) == 50_000:
            conn.executemany(insert, rows)
            rows = []
    conn.executemany(insert, rows)
    conn.executemany(f"INSERT INTO calls VALUES ({', '.join('?' * 16)})", (record_row(r) for r in records.values()))
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def size(path: Path) -> int:
    """The journal's size on disk once its WAL is checkpointed into it."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return path.stat().st_size + sum(
        Path(f"{path}{side}").stat().st_size for side in ("-wal",) if Path(f"{path}{side}").exists())


def left_in(path: Path) -> list[tuple[str, float]]:
    """What the file holds, in MiB: the events, the projection and the archived projection, each
    with its indexes, and the free pages."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = dict(conn.execute("SELECT name, tbl_name FROM sqlite_schema WHERE type IN ('table', 'index')"))
        sizes: dict[str, int] = {}
        for name, pages in conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name"):
            table = tables.get(name, name)
            sizes[table] = sizes.get(table, 0) + pages
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0] * page
    finally:
        conn.close()
    shown = [(name, sizes.get(name, 0) / 2**20) for name in ("events", "calls", "calls_archived")]
    return [*shown, ("other", (sum(sizes.values()) - sum(sizes.get(n, 0) for n, _ in shown)) / 2**20),
            ("free", free / 2**20)]


def run(command: list[str]) -> tuple[float, float]:
    """Run ``command``; its wall seconds and peak resident memory in MiB."""
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    took = time.monotonic() - started
    out = proc.stdout.read() if proc.stdout else b""
    err = proc.stderr.read() if proc.stderr else b""
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed: {out.decode()} {err.decode()}")
    return took, usage.ru_maxrss / 1024


def probe(path: Path, stop: threading.Event, waits: list[float]) -> None:
    """A guarded call every 5 ms until ``stop``; each one's wall time into ``waits`` (how long the
    archive made it wait for the journal's write lock)."""
    with SQLiteJournal(path, durability="process") as journal:

        @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
        def ping(n: int) -> int:
            return n

        n = 0
        while not stop.is_set():
            n += 1
            with AirlockContext(metadata={"tool_call_id": f"probe-{n}"}):
                started = time.monotonic()
                ping(n)
                waits.append(time.monotonic() - started)
            stop.wait(0.005)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="events in the journal (default 1,000,000)")
    parser.add_argument("--share", type=float, default=0.9, help="the share of them archived (default 0.9)")
    parser.add_argument("--fill", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fill is not None:
        fill(args.fill, args.events)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path, archive = Path(tmp) / "journal.db", Path(tmp) / "archive.jsonl"
        started = time.monotonic()
        # Made in a process of its own: a command started from a large process would count its
        # memory as the command's peak (the kernel keeps the high-water mark across exec).
        subprocess.run([sys.executable, __file__, "--events", str(args.events), "--fill", str(path)], check=True)
        made = time.monotonic() - started
        print(f"journal: {args.events:,} events, {args.events // 2:,} calls, made in {made:.0f} s")
        before = size(path)

        took, rss = run([AIRLOCK, "journal", "verify", "--db", str(path)])
        print(f"verify (whole journal):      {args.events / took:>10,.0f} events/s  {took:6.2f} s  peak {rss:5.0f} MiB")

        cut = at_of(int(args.events * args.share) + 1)
        stop, waits = threading.Event(), []
        command = [AIRLOCK, "journal", "archive", "--db", str(path), "--before", cut, "-o", str(archive)]
        prober = threading.Thread(target=probe, args=(path, stop, waits))
        prober.start()
        try:
            took, rss = run(command)
        finally:
            stop.set()
            prober.join()
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        moved = conn.execute("SELECT sum(events) FROM archives").fetchone()[0]
        left = conn.execute("SELECT count(*) FROM events").fetchone()[0]
        conn.close()
        print(f"archive (verify, write, commit, vacuum): {moved / took:>10,.0f} events/s  {took:6.2f} s  "
              f"peak {rss:5.0f} MiB  ({moved:,} events moved)")
        waits.sort()
        if waits:
            median = waits[len(waits) // 2] * 1000
            print(f"guarded calls made during the archive (one every 5 ms): {len(waits):,}, median {median:.1f} ms, "
                  f"longest {waits[-1]:.2f} s")
        after = size(path)
        print(f"file: {before / 2**20:,.0f} MiB before, {after / 2**20:,.0f} MiB after "
              f"({after / before:.2f} of it); archive {archive.stat().st_size / 2**20:,.0f} MiB")
        print(f"left in the file: {', '.join(f'{name} {mib:,.1f} MiB' for name, mib in left_in(path))}")

        took, rss = run([AIRLOCK, "journal", "verify", "--db", str(path)])
        print(f"verify (journal after):      {left / took:>10,.0f} events/s  {took:6.2f} s  peak {rss:5.0f} MiB  "
              f"({left:,} events)")
        took, rss = run([AIRLOCK, "journal", "verify", "--export", str(archive), "--db", str(path)])
        total = moved + left
        print(f"verify (archive + journal):  {total / took:>10,.0f} events/s  {took:6.2f} s  peak {rss:5.0f} MiB  "
              f"({total:,} events)")


if __name__ == "__main__":
    main()
