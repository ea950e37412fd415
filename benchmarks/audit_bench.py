"""What signing costs: ``export --sign`` against ``export``, and ``verify --export --public-key``
against ``verify --export``, on one journal; prints figures and ratios, asserts nothing.

    .venv/bin/python benchmarks/audit_bench.py                  # 200,000 events in a temporary dir
    .venv/bin/python benchmarks/audit_bench.py --events 1000000 --rounds 3

The journal is refusals with small arguments, inserted in bulk with the chain's own hash rule.
Each command runs as the installed ``airlock`` script in a real process; the figure is the least
CPU time (user + system) of the rounds, which other load on the machine moves less than wall time.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

from journal import SQLiteJournal
from journal.chain import GENESIS
from journal.export import row_hash

AIRLOCK = str(Path(sys.executable).with_name("airlock"))


def fill(path: Path, events: int) -> None:
    """A journal of ``events`` refusals, each hash by the chain's rule."""
    SQLiteJournal(path).close()
    reason = orjson.dumps({"code": "rate_limited", "message": "too many calls"}, option=orjson.OPT_SORT_KEYS)
    conn = sqlite3.connect(path)
    prev, rows = GENESIS, []
    for seq in range(1, events + 1):
        at = f"2026-12-01T{seq // 3_600_000_000 % 24:02d}:00:00.{seq % 1_000_000:06d}Z"
        row = (seq, at, None, "refused", "charge", "agent-1", None, '{"cents":5}', None, None, reason.decode(),
               "guard", 0, '{"host":"bench","pid":1}', prev)
        prev = row_hash((*row, ""))
        rows.append((*row, prev))
        if len(rows) == 50_000:
            conn.executemany(f"INSERT INTO events VALUES ({', '.join('?' * 16)})", rows)
            rows = []
    conn.executemany(f"INSERT INTO events VALUES ({', '.join('?' * 16)})", rows)
    conn.commit()
    conn.close()


def cpu_seconds(command: list[str], rounds: int) -> float:
    """The least CPU time (user + system) of ``command`` over ``rounds`` runs."""
    times = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(command, check=True, capture_output=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        times.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="Where to put the journal and exports (default: a temporary dir).")
    args = parser.parse_args()
    if args.events < 1 or args.rounds < 1:
        parser.error("--events and --rounds are numbers, 1 or more")
    directory = Path(tempfile.mkdtemp(prefix="audit-bench-", dir=args.dir))
    try:
        db, key = directory / "journal.db", directory / "key.pem"
        fill(db, args.events)
        public = subprocess.run([AIRLOCK, "journal", "keygen", "-o", str(key)], check=True, capture_output=True,
                                text=True).stdout.strip()
        plain, signed = directory / "plain.jsonl", directory / "signed.jsonl"
        export = cpu_seconds([AIRLOCK, "journal", "export", "--db", str(db), "-o", str(plain)], args.rounds)
        export_signed = cpu_seconds([AIRLOCK, "journal", "export", "--db", str(db), "-o", str(signed),
                                     "--sign", str(key)], args.rounds)
        verify = cpu_seconds([AIRLOCK, "journal", "verify", "--export", str(signed)], args.rounds)
        verify_signed = cpu_seconds([AIRLOCK, "journal", "verify", "--export", str(signed), "--public-key", public],
                                    args.rounds)
        n = args.events
        print(f"{n:,} events, CPU seconds (least of {args.rounds})")
        print(f"  export                     {export:7.2f} s  {n / export:10,.0f} events/s")
        print(f"  export --sign              {export_signed:7.2f} s  {n / export_signed:10,.0f} events/s  "
              f"{export_signed / export:.2f}x")
        print(f"  verify --export            {verify:7.2f} s  {n / verify:10,.0f} events/s")
        print(f"  verify --public-key        {verify_signed:7.2f} s  {n / verify_signed:10,.0f} events/s  "
              f"{verify_signed / verify:.2f}x")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
