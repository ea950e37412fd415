"""What knowing a journal is damaged costs: the look for the damage mark, against what it guards.

    .venv/bin/python benchmarks/damage_check.py                      # 1,000,000 events in a temporary file
    .venv/bin/python benchmarks/damage_check.py --events 200000

A journal refuses writes once SQLite has found its file malformed (journal/sqlite/damage.py): every write
transaction first looks for the mark beside the file. Prints, on a journal of ``--events`` events
(seeded as benchmarks/cli_bench.py does): opening it for writing; the look for the mark, against a
guarded call's ``begin``; and SQLite's ``PRAGMA quick_check``, which reads every page, to show what
a check of the whole file at each open would cost instead. Asserts nothing.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_bench import seed

from guard.store import Decision, EffectEvent, Verdict
from journal import SQLiteJournal
from journal.sqlite.damage import mark_path, marked


def median_s(step: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        step()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(workdir) / "journal.db"
        seed(path, args.events)
        size_mb = path.stat().st_size / 1e6

        def open_close() -> None:
            SQLiteJournal(path, durability="process").close()

        opened = median_s(open_close, 7)
        mark = str(mark_path(path))
        look = median_s(lambda: [marked(mark) for _ in range(10_000)], 5) / 10_000
        with SQLiteJournal(path, durability="process") as journal:
            calls = iter(range(10**9))

            def begin() -> None:
                call_id = f"bench-{next(calls)}"
                journal.begin(call_id, lambda record: Decision(
                    Verdict.RUN, EffectEvent("pending", call_id, "pay", attempt=1, arguments="{}")))

            begun = median_s(begin, 501)
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        checked = median_s(lambda: conn.execute("PRAGMA quick_check").fetchall(), 3)
        conn.close()
    print(f"journal: {args.events} events, {size_mb:.0f} MB")
    print(f"open for writing: {opened * 1e3:.2f} ms")
    print(f"look for the damage mark: {look * 1e6:.2f} us, "
          f"{look / begun * 100:.2f}% of a begin at durability='process' ({begun * 1e6:.0f} us)")
    print(f"PRAGMA quick_check of the whole file: {checked * 1e3:.0f} ms, {checked / opened:.0f}x the open")


if __name__ == "__main__":
    main()
