"""How fast the operator's commands are on a large journal; prints figures, asserts nothing.

    .venv/bin/python benchmarks/cli_bench.py                 # 1,000,000 events in a temporary file
    .venv/bin/python benchmarks/cli_bench.py --quick         # 100,000 events: a check in seconds
    .venv/bin/python benchmarks/cli_bench.py --events 200000 --db /tmp/big.db --keep

The journal is seeded with a bulk insert that computes the same hash chain as the journal's
own append path (journal.chain), then its projection is folded by ``rebuild``. The commands run
as the installed ``airlock`` script in real processes (wall time, and peak memory read from
/proc), and in this process through click's runner (the command's own time, without the
interpreter's start-up), with the targets beside each figure: ``show`` (the newest 50) and
``show CALL_ID`` under 50 ms, ``stats`` under 500 ms, ``export`` and ``verify`` at least
200,000 events/s in under 100 MB. ``rebuild`` runs last (it rewrites the projection).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
from click.testing import CliRunner

from cli.main import main
from guard.canonical import idempotency_key
from journal import SQLiteJournal
from journal.chain import GENESIS, compute_hash, event_body
from journal.events import text_sha256

AIRLOCK = str(Path(sys.executable).with_name("airlock"))
_SORTED = orjson.OPT_SORT_KEYS
_INSERT = (
    "INSERT INTO events (seq, at, call_id, kind, tool, agent_id, idempotency_key, arguments, value, error, "
    "reason, actor, attempt, owner, prev_hash, hash) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
)


def _text(obj: Any) -> str | None:
    return None if obj is None else orjson.dumps(obj, option=_SORTED).decode()


def story(events: int) -> Iterator[tuple[str, str, str, str | None, dict[str, str] | None, dict[str, str] | None]]:
    """(call_id, kind, tool, value, error, reason) in log order: most calls commit, some are
    replayed, 2% end unknown (and are refused once), 1% are released, 1% stay pending."""
    n = 0
    call = 0
    while n < events:
        call += 1
        call_id = f"call_{call:08d}"
        fate = call % 100
        steps: list[tuple[str, str | None, dict[str, str] | None, dict[str, str] | None]] = [
            ("pending", None, None, None)
        ]
        if fate < 2:
            steps.append(("unknown", None, {"type": "TimeoutError", "message": "backend did not answer"}, None))
            steps.append(("refused", None, None, {"code": "effect_status_unknown", "message": "do not retry"}))
        elif fate == 2:
            steps.append(("released", None, {"type": "ValueError", "message": "card declined"}, None))
        elif fate == 3:
            pass  # its process died mid-effect
        else:
            steps.append(("committed", _text({"charge_id": f"ch_{call}", "cents": call % 10_000}), None, None))
            if fate % 4 == 0:
                steps.append(("replayed", None, None, None))
        tool = "read_balance" if fate % 10 == 9 else "charge"
        for kind, value, error, reason in steps:
            if n >= events:
                return
            n += 1
            yield call_id, kind, tool, value, error, reason


def seed(path: Path, events: int) -> None:
    SQLiteJournal(path, durability="process").close()  # the journal makes its own schema
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = OFF")
    owner = {"host": "bench-host", "pid": 4242}
    owner_text = _text(owner)
    start = datetime.now(UTC) - timedelta(days=30)
    step = timedelta(days=30) / events
    prev = GENESIS
    batch: list[tuple[Any, ...]] = []
    conn.execute("BEGIN")
    for seq, (call_id, kind, tool, value, error, reason) in enumerate(story(events), 1):
        account = f"acct_{int(call_id[5:]) % 5000}"
        arguments = _text({"account": account} if tool == "read_balance" else {"account": account, "cents": 500})
        key = idempotency_key(tool, orjson.loads(arguments or "{}"))
        at = (start + step * seq).isoformat(timespec="microseconds")[:-6] + "Z"
        agent = f"agent-{seq % 7}"
        body = event_body(
            seq=seq, at=at, call_id=call_id, kind=kind, tool=tool, agent_id=agent, idempotency_key=key,
            arguments_sha256=text_sha256(arguments), value_sha256=text_sha256(value), error=error,
            reason=reason, actor="guard", attempt=1, owner=owner,
        )
        digest = compute_hash(prev, body)
        batch.append((seq, at, call_id, kind, tool, agent, key, arguments, value, _text(error), _text(reason),
                      "guard", 1, owner_text, prev, digest))
        prev = digest
        if len(batch) == 20_000:
            conn.executemany(_INSERT, batch)
            batch.clear()
    conn.executemany(_INSERT, batch)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def _high_water(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (verify checks its parts in children)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return [int(child) for child in listing.read().split()]
    except OSError:
        return []


def timed_process(*args: str, stdout: Any = subprocess.DEVNULL) -> tuple[float, int]:
    """Run ``airlock ARGS``; (seconds, peak RSS in bytes): :func:`measured_process` without the CPU time."""
    elapsed, _, peak = measured_process(*args, stdout=stdout)
    return elapsed, peak


def measured_process(*args: str, stdout: Any = subprocess.DEVNULL) -> tuple[float, float, int]:
    """Run ``airlock ARGS``; (seconds, CPU seconds, peak RSS in bytes) of that process and the
    children it starts. On a machine that other work keeps busy, the CPU time is the steadier figure.

    The peak is read from /proc while it runs: ``ru_maxrss`` would also count the memory of this
    (large) process, which a child inherits as its starting high-water mark. A child's peak is
    added to the parent's (an upper bound when they did not peak at once).
    """
    began, cpu = time.perf_counter(), os.times()
    proc = subprocess.Popen([AIRLOCK, *args], stdout=stdout, stderr=subprocess.PIPE)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        for pid in (proc.pid, *_children(proc.pid)):
            peaks[pid] = max(peaks.get(pid, 0), _high_water(pid))
        time.sleep(0.005)
    elapsed = time.perf_counter() - began
    done = os.times()
    used = done.children_user + done.children_system - cpu.children_user - cpu.children_system
    if proc.returncode != 0:
        assert proc.stderr is not None
        sys.exit(f"airlock {' '.join(args)} failed: {proc.stderr.read().decode()}")
    return elapsed, used, sum(peaks.values())


def in_process_ms(args: list[str], repeat: int = 7) -> float:
    """The median time of one command run in this process (the interpreter and imports are warm)."""
    runner = CliRunner()
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        result = runner.invoke(main, args)
        times.append(time.perf_counter() - began)
        if result.exit_code != 0:
            sys.exit(f"airlock {' '.join(args)} failed: {result.output}")
    return statistics.median(times) * 1000


def row(label: str, figure: str, target: str = "", verdict: bool | None = None) -> None:
    mark = "" if verdict is None else ("  ok" if verdict else "  MISSED")
    print(f"{label:<44} {figure:>18}   {target}{mark}", flush=True)


def main_bench(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_const", const=100_000, dest="events",
                        help="100,000 events instead of 1,000,000")
    parser.add_argument("--db", type=Path, help="journal file (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the journal (and reuse it if it exists)")
    options = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="airlock-bench-"))
    db = options.db or workdir / "bench.db"
    try:
        run(db, workdir, options.events, reuse=options.keep and db.exists())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if not options.keep and options.db is not None:
            for leftover in db.parent.glob(db.name + "*"):
                leftover.unlink()


def run(db: Path, workdir: Path, events: int, reuse: bool) -> None:
    if not reuse:
        began = time.perf_counter()
        seed(db, events)
        seeded = time.perf_counter() - began
        began = time.perf_counter()
        with SQLiteJournal(db, durability="process") as journal:
            calls = journal.rebuild()
        rebuilt = time.perf_counter() - began
        print(f"seeded {events:,} events ({calls:,} calls) in {seeded:.1f} s; rebuild folded them in {rebuilt:.1f} s")
    with SQLiteJournal(db, readonly=True) as journal:
        events = journal.count_events()
        unknown = journal.calls(status="unknown", limit=1)[0].call_id
        size = db.stat().st_size
    print(f"journal {db} ({size / 2**20:.0f} MiB), {events:,} events\n")
    target = str(db)

    startup, _ = timed_process("--version")
    row("interpreter start and imports (airlock --version)", f"{startup * 1000:.0f} ms")
    mb = 2**20

    newest = in_process_ms(["journal", "show", "--db", target])
    row("show (newest 50 calls), the command itself", f"{newest:.1f} ms", "target < 50 ms", newest < 50)
    wall, rss = timed_process("journal", "show", "--db", target)
    row("show, a whole airlock process", f"{wall * 1000:.0f} ms", f"max RSS {rss / mb:.0f} MB")
    one = in_process_ms(["journal", "show", unknown, "--db", target])
    row("show CALL_ID, the command itself", f"{one:.1f} ms", "target < 50 ms", one < 50)
    wall, rss = timed_process("journal", "show", unknown, "--db", target)
    row("show CALL_ID, a whole airlock process", f"{wall * 1000:.0f} ms", f"max RSS {rss / mb:.0f} MB")
    listed = in_process_ms(["journal", "show", "--status", "unknown", "--db", target])
    row("show --status unknown (50 calls)", f"{listed:.1f} ms")
    counted = in_process_ms(["journal", "stats", "--db", target], repeat=3)
    row("stats, the command itself", f"{counted:.0f} ms", "target < 500 ms", counted < 500)
    wall, rss = timed_process("journal", "stats", "--db", target)
    row("stats, a whole airlock process", f"{wall * 1000:.0f} ms", f"max RSS {rss / mb:.0f} MB")

    out = workdir / "audit.jsonl"
    wall, cpu, rss = measured_process("journal", "export", "--db", target, "--output", str(out))
    rate = events / wall
    row("export --format jsonl (to a file)", f"{rate:,.0f} events/s", "target >= 200,000/s", rate >= 200_000)
    row("export, CPU time of the process", f"{cpu:.1f} s", f"{events / cpu:,.0f} events per CPU second")
    row("export peak memory (max RSS of the process)", f"{rss / mb:.0f} MB", "target < 100 MB", rss < 100 * mb)
    wall, rss = timed_process("journal", "export", "--db", target, "--format", "csv")
    row("export --format csv (to stdout)", f"{events / wall:,.0f} events/s", f"max RSS {rss / mb:.0f} MB")
    wall, cpu, rss = measured_process("journal", "verify", "--db", target)
    rate = events / wall
    row("verify (chain and projection)", f"{rate:,.0f} events/s", "target >= 200,000/s", rate >= 200_000)
    row("verify, CPU time of the process and its children", f"{cpu:.1f} s",
        f"{events / cpu:,.0f} events per CPU second, {wall and cpu / wall:.1f} cores busy")
    row("verify peak memory (max RSS of the process)", f"{rss / mb:.0f} MB", "target < 100 MB", rss < 100 * mb)
    wall, rss = timed_process("journal", "verify", "--export", str(out))
    rate = events / wall
    row("verify --export FILE (offline)", f"{rate:,.0f} events/s", f"max RSS {rss / mb:.0f} MB")
    wall, rss = timed_process("journal", "rebuild", "--db", target)
    row("rebuild (the projection folded again)", f"{wall:.1f} s", f"{events / wall:,.0f} events/s")
    row("rebuild peak memory (max RSS of the process)", f"{rss / mb:.0f} MB")


if __name__ == "__main__":
    main_bench()

