"""How guarded calls on PostgresJournal scale with processes, now that appends do not wait on the chain head.

Prints, in one run on one server:

- for each process count of ``--procs`` (8, 16 and 32 by default), with distinct ids: raw INSERTs of
  an event-sized row, each its own transaction (autocommit, default synchronous_commit, each process
  on a connection of its own), in transactions per second; the same each moving a head row in its
  transaction (the ceiling every append had while one chain head ordered them); the previous
  release's guarded calls (``--baseline-rev``, run by the same harness); guarded calls with a fresh tool call id
  each (a pending and a committed event a call; each process with a PostgresJournal of its own,
  ``pool_size=1``, on one database), in calls per second; and the ratio of the two (target: 0.40 or
  more at 8 processes, where it was 0.16 when every append waited on the chain head's row). Each
  process opens its connection or journal and makes a few calls before they all start together,
  and each figure runs ``--seconds`` on a database of its own;
- one process: the latency of a guarded fresh call as shipped (seal mode SEAL: writing alone, each
  event is sealed into the log as it commits) against the same loop on the previous release's code
  (``--baseline-rev``, extracted with ``git archive`` to a temporary directory and run in a
  subprocess that imports from it, on a database of its own), in interleaved rounds; the medians in
  microseconds a call and their ratio (target: 1.10 or less). Without git or the revision it says so
  and compares, as a fallback, against seal mode SEAL_NOW in the same process;
- the events left in the inbox as each guarded run ended and a second later (0 by then: each
  writer's sealer thread seals within tens of milliseconds of its commits, and closing a journal seals),
  and how many of the run's events went through the inbox at all (the server's statistics); then
  each guarded run's journal verified, its event count checked against 2 for each call the
  processes made (warm-up calls included). A wrong count stops the script; nothing else is asserted.

Without ``--dsn`` it starts a throwaway cluster (tests/pgserver.py, default settings: fsync and
synchronous_commit on) and removes it afterwards. With ``--dsn`` (a role that may CREATE DATABASE)
it creates its databases on that server beside the one named, and drops them at the end.

    python benchmarks/pg_scale.py [--dsn URL] [--procs 8,16,32] [--seconds S] [--calls N] [--rounds R]
                                  [--baseline-rev REV]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

if TYPE_CHECKING:
    from journal.postgres import PostgresJournal

ROOT = Path(__file__).resolve().parents[1]

_ROW = ("2026-12-01T05:23:06.123456Z", "pending", "charge", "agent-1", "k" * 64,
        '{"account":"acct-1","cents":500}', "guard", 1, '{"host":"bench","pid":1}', "0" * 64, "f" * 64)
_RAW_TABLE = """
CREATE SCHEMA bench_raw;
CREATE TABLE bench_raw.raw_events (
    seq bigserial PRIMARY KEY, at text, call_id text, kind text, tool text, agent_id text,
    idempotency_key text, arguments text, actor text, attempt integer, owner text, prev_hash text, hash text
);
CREATE INDEX raw_events_call_id ON bench_raw.raw_events (call_id, seq);
CREATE TABLE bench_raw.raw_head (id smallint PRIMARY KEY, seq bigint NOT NULL) WITH (fillfactor = 10);
INSERT INTO bench_raw.raw_head VALUES (1, 0);
"""
_INSERT = ("INSERT INTO bench_raw.raw_events (at, call_id, kind, tool, agent_id, idempotency_key, arguments, actor, "
           "attempt, owner, prev_hash, hash) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)")
_RESULT = {"charge_id": "ch_1", "cents": 500}

_WARMUP = 20  # ops each process makes before the start
_START_WAIT = 600.0  # seconds the processes may take to start (32 of them on 2 cores import slowly)
_TARGET_RATIO, _TARGET_PROCS, _BEFORE_RATIO = 0.40, 8, 0.16
_TARGET_LATENCY = 1.10


def use_code(root: Path) -> None:
    """Import ``guard`` and ``journal`` from ``root``: this checkout, or an extracted older release."""
    if sys.path[:1] != [str(root)]:
        sys.path.insert(0, str(root))


# -- the ops ---------------------------------------------------------------------------------------


def raw_insert(dsn: str) -> Callable[[], None]:
    """One raw INSERT of an event-sized row a call, as its own transaction, on a connection of its own."""
    conn = psycopg.connect(dsn, autocommit=True)
    prefix, counter = uuid.uuid4().hex[:8], itertools.count()

    def call() -> None:
        conn.execute(_INSERT, (_ROW[0], f"raw-{prefix}-{next(counter)}", *_ROW[1:]))

    return call


def raw_head_insert(dsn: str) -> Callable[[], None]:
    """The raw INSERT with a head row locked and moved in its transaction: what every append did
    while one chain head ordered them (the old ceiling, whatever the journal's own work)."""
    conn = psycopg.connect(dsn)
    prefix, counter = uuid.uuid4().hex[:8], itertools.count()

    def call() -> None:
        with conn.transaction():
            conn.execute(_INSERT, (_ROW[0], f"raw-{prefix}-{next(counter)}", *_ROW[1:]))
            conn.execute(b"UPDATE bench_raw.raw_head SET seq = seq + 1 WHERE id = 1")

    return call


def fresh_call(journal: PostgresJournal) -> Callable[[], None]:
    """A guarded call of one tool a call, each with a fresh tool call id, random as models make them:
    a pending and a committed event. A refusal stops it (the count of events would be wrong)."""
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)), on_block="raise")
    def charge(account: str, cents: int) -> dict[str, Any]:
        return {"charge_id": "ch_1", "cents": cents}

    def call() -> None:
        with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": f"call_{uuid.uuid4().hex[:24]}"}):
            result = charge("acct-1", 500)
        if result != _RESULT:
            raise RuntimeError(f"the guarded call answered {result!r}, not the tool's value")

    return call


def timed(call: Callable[[], None], n: int) -> float:
    """Seconds a call, over ``n`` calls."""
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n


# -- many processes --------------------------------------------------------------------------------


def _worker(kind: str, code: str, dsn: str, seconds: float, barrier: Any, results: Any) -> None:
    """Warm up, start with the others, call for ``seconds``; report the calls timed and all made."""
    journal = None
    try:
        use_code(Path(code))
        if kind == "guarded":
            from journal.postgres import PostgresJournal

            journal = PostgresJournal(dsn, pool_size=1)
            call = fresh_call(journal)
        elif kind == "raw-head":
            call = raw_head_insert(dsn)
        else:
            call = raw_insert(dsn)
        for _ in range(_WARMUP):
            call()
        barrier.wait(timeout=_START_WAIT)
        done, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            for _ in range(10):
                call()
            done += 10
        results.put(("ok", done, _WARMUP + done))
    except BaseException as e:
        barrier.abort()  # the others stop waiting for this one
        results.put(("error", f"{type(e).__name__}: {e}", 0))
        raise
    finally:
        if journal is not None:
            journal.close()  # seals what this process left in the inbox


@dataclass
class Run:
    """What one throughput figure did: ops a second, and (guarded) the calls made and the inbox as it ended."""

    rate: float
    made: int = 0
    inbox_at_end: int = 0
    inbox_later: int = 0


def throughput(kind: str, dsn: str, procs: int, seconds: float, inbox: sql.Composed | None = None,
               code: Path = ROOT) -> Run:
    """Ops a second of ``procs`` processes together (the journal's code from ``code``); with
    ``inbox`` (a count of the inbox's rows), the count as the last process reported and a second later."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(kind, str(code), dsn, seconds, barrier, results))
               for _ in range(procs)]
    watcher = psycopg.connect(dsn, autocommit=True) if inbox is not None else None
    try:
        for w in workers:
            w.start()
        reports = [results.get(timeout=_START_WAIT + seconds + 120) for _ in workers]
        run = Run(rate=0.0)
        if watcher is not None and inbox is not None:
            run.inbox_at_end = _count(watcher, inbox)
            time.sleep(1.0)
            run.inbox_later = _count(watcher, inbox)
    finally:
        if watcher is not None:
            watcher.close()
        for w in workers:
            if w.pid is None:  # never started
                continue
            w.join(timeout=120)
            if w.is_alive():
                w.terminate()
                w.join()
    failed = [r[1] for r in reports if r[0] != "ok"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {procs} {kind} processes failed: {failed[0]}")
    run.rate = sum(int(r[1]) for r in reports) / seconds
    run.made = sum(int(r[2]) for r in reports)
    return run


def _count(conn: psycopg.Connection[Any], query: sql.Composed) -> int:
    row = conn.execute(query).fetchone()
    return int(row[0]) if row is not None else 0


# -- one process: as shipped against the previous release ------------------------------------------


def _baseline_child(code: Path, dsn: str, calls: int) -> None:
    """In a subprocess: the guarded loop on the code at ``code``. Prints a JSON line when warm, then
    one for each line read from stdin (a round of ``calls`` calls), then all the rounds at the end."""
    use_code(code)
    import journal as journal_package
    from journal.postgres import PostgresJournal

    where = Path(journal_package.__file__).resolve()
    if not where.is_relative_to(code.resolve()):
        raise SystemExit(f"the baseline imported the journal from {where}, not from {code}")
    journal = PostgresJournal(dsn, pool_size=2)
    try:
        call = fresh_call(journal)
        timed(call, max(10, calls // 10))
        print(json.dumps({"ready": str(where)}), flush=True)
        rounds = []
        for _ in sys.stdin:
            rounds.append(timed(call, calls))
            print(json.dumps({"seconds_per_call": rounds[-1]}), flush=True)
        print(json.dumps({"rounds": rounds}), flush=True)
    finally:
        journal.close()


class Baseline:
    """The previous release's guarded loop, a round at a time, in a subprocess."""

    def __init__(self, code: Path, dsn: str, calls: int) -> None:
        self._child = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--baseline-child", str(code), "--dsn", dsn,
             "--calls", str(calls)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.imported_from = str(self._read()["ready"])

    def _read(self) -> dict[str, Any]:
        assert self._child.stdout is not None
        line = self._child.stdout.readline()
        if not line:
            raise RuntimeError(f"the baseline subprocess ended (exit status {self._child.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def __call__(self) -> float:
        assert self._child.stdin is not None
        self._child.stdin.write("round\n")
        self._child.stdin.flush()
        return float(self._read()["seconds_per_call"])

    def kill(self) -> None:
        self._child.kill()
        self._child.wait()

    def close(self) -> list[float]:
        assert self._child.stdin is not None
        self._child.stdin.close()
        rounds = [float(t) for t in self._read()["rounds"]]
        if self._child.wait(timeout=120) != 0:
            raise RuntimeError(f"the baseline subprocess failed (exit status {self._child.returncode})")
        return rounds


def extract(rev: str, into: Path) -> str | None:
    """``git archive`` of ``rev`` of this checkout, extracted into ``into``; None, or why it could not be."""
    git = shutil.which("git")
    if git is None:
        return "no git on PATH"
    made = subprocess.run([git, "-C", str(ROOT), "archive", "--format=tar", rev], capture_output=True)
    if made.returncode != 0:
        return made.stderr.decode(errors="replace").strip() or f"git archive exited {made.returncode}"
    with tarfile.open(fileobj=io.BytesIO(made.stdout)) as tar:
        tar.extractall(into, filter="data")
    return None


def latency(new_dsn: str, old_dsn: str, calls: int, rounds: int, rev: str) -> None:
    from journal.postgres import PostgresJournal
    from journal.postgres.writes import SEAL, SEAL_NOW

    print(f"one process, a guarded fresh call: median of {rounds} rounds of {calls} calls, rounds interleaved "
          "(new, old, new, old, ...), each on a database of its own:")
    journal = PostgresJournal(new_dsn, pool_size=2)
    journal.writes.seal_mode = SEAL
    new = fresh_call(journal)
    other: PostgresJournal | None = None
    baseline: Baseline | None = None
    old: Callable[[], float]
    with tempfile.TemporaryDirectory(prefix="airlock-baseline-") as tmp:
        try:
            why_not = extract(rev, Path(tmp))
            if why_not is None:
                baseline = Baseline(Path(tmp), old_dsn, calls)
                old = baseline
                old_label = f"the previous release ({rev}, in a subprocess)"
            else:
                print(f"  the previous release ({rev}) is not to be had: {why_not}")
                print("  FALLBACK: compared against seal mode SEAL_NOW (each append waits for the chain head's row) "
                      "in this process, not against the previous release")
                other = PostgresJournal(old_dsn, pool_size=2)
                other.writes.seal_mode = SEAL_NOW
                fallback = fresh_call(other)

                def old_round() -> float:
                    return timed(fallback, calls)

                old = old_round
                old_label = "fallback: seal mode SEAL_NOW, this process"
                timed(fallback, max(10, calls // 10))
            timed(new, max(10, calls // 10))
            news, olds = [], []
            for _ in range(rounds):
                news.append(timed(new, calls))
                olds.append(old())
            if baseline is not None:
                reported = baseline.close()
                baseline = None
                if len(reported) != len(olds):
                    raise RuntimeError(f"the baseline reported {len(reported)} rounds, not {len(olds)}")
        finally:
            if baseline is not None:  # it failed on the way
                baseline.kill()
            journal.close()
            if other is not None:
                other.close()
    new_median, old_median = statistics.median(news), statistics.median(olds)
    ratios = [n / o for n, o in zip(news, olds, strict=True)]
    print(f"  {'as shipped (seal mode SEAL: alone, sealed as it commits)':<58} {new_median * 1e6:9.1f} us a call")
    print(f"  {old_label:<58} {old_median * 1e6:9.1f} us a call")
    print(f"  as shipped / {'previous release' if other is None else 'SEAL_NOW'}: "
          f"{new_median / old_median:.2f}x (median of the rounds' ratios {statistics.median(ratios):.2f}x)"
          f"  (target: {_TARGET_LATENCY:.2f}x or less)")
    print("  rounds, us a call: new " + ", ".join(f"{t * 1e6:.0f}" for t in news)
          + "; old " + ", ".join(f"{t * 1e6:.0f}" for t in olds))


# -- the databases -----------------------------------------------------------------------------------


class Databases:
    """Fresh databases on one server, one a figure; those made on a server given by ``--dsn`` are
    dropped at the end (a throwaway cluster goes whole)."""

    def __init__(self, admin_dsn: str, drop: bool) -> None:
        self._admin = admin_dsn
        self._drop = drop
        self._made: list[str] = []
        self._names = itertools.count()

    def fresh(self) -> str:
        name = f"airlock_scale_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self._admin, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self._made.append(name)
        return make_conninfo(self._admin, dbname=name)

    def drop_all(self) -> None:
        if not self._drop:
            return
        with psycopg.connect(self._admin, autocommit=True) as conn:
            for name in self._made:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _procs(text: str) -> list[int]:
    try:
        counts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of process counts, each 1 or more, not {text!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dsn", help="a database of an existing server (default: a throwaway cluster)")
    parser.add_argument("--procs", type=_procs, default=[8, 16, 32], help="process counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per throughput figure")
    parser.add_argument("--calls", type=int, default=300, help="calls per latency round")
    parser.add_argument("--rounds", type=int, default=9, help="latency rounds; the median is shown")
    parser.add_argument("--baseline-rev", default="e1d5260", help="the previous release's revision (git)")
    parser.add_argument("--baseline-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seconds <= 0 or args.calls < 1 or args.rounds < 1:
        parser.error("--seconds must be more than 0, --calls and --rounds 1 or more")
    if args.baseline_child:
        _baseline_child(Path(args.baseline_child), args.dsn, args.calls)
        return

    use_code(ROOT)
    from journal.postgres import PostgresJournal

    server = None
    if args.dsn:
        admin = args.dsn
    else:
        from tests import pgserver

        server = pgserver.server()
        admin = server.dsn
    databases = Databases(admin, drop=server is None)
    try:
        with psycopg.connect(admin, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            settings: dict[str, str] = dict(conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit')"
            ).fetchall())
        host = conninfo_to_dict(admin).get("host", "?")
        print(f"PostgreSQL {version[0] if version else '?'} at {host}: fsync={settings.get('fsync')}, "
              f"synchronous_commit={settings.get('synchronous_commit')}; {os.cpu_count()} cores here")

        old_code = tempfile.TemporaryDirectory(prefix="airlock-baseline-")
        why_not = extract(args.baseline_rev, Path(old_code.name))
        print(f"many processes, distinct ids, {args.seconds:g} s a figure, each on a database of its own"
              + (f"; the previous release is {args.baseline_rev}" if why_not is None
                 else f"; no previous release to compare with ({why_not})") + ":")
        print(f"  {'processes':>9}  {'raw INSERT tx/s':>15}  {'moving a head':>13}  {'previous calls/s':>16}  "
              f"{'guarded calls/s':>15}  {'guarded / raw':>13}")
        guarded_runs: list[tuple[int, str, Run]] = []
        for procs in args.procs:
            raw_dsn = databases.fresh()
            with psycopg.connect(raw_dsn, autocommit=True) as conn:
                conn.execute(_RAW_TABLE.encode())
            raw = throughput("raw", raw_dsn, procs, args.seconds)
            head = throughput("raw-head", raw_dsn, procs, args.seconds)
            previous = "-"
            if why_not is None:
                old_dsn = databases.fresh()
                previous = f"{throughput('guarded', old_dsn, procs, args.seconds, code=Path(old_code.name)).rate:.0f}"
            journal_dsn = databases.fresh()
            opened = PostgresJournal(journal_dsn)  # the tables, before the processes open it
            inbox = sql.SQL("SELECT count(*) FROM {}.inbox").format(sql.Identifier(opened.schema))
            opened.close()
            guarded = throughput("guarded", journal_dsn, procs, args.seconds, inbox)
            guarded_runs.append((procs, journal_dsn, guarded))
            target = (f"  (target: {_TARGET_RATIO:.2f} or more; {_BEFORE_RATIO:.2f} before)"
                      if procs == _TARGET_PROCS else "")
            print(f"  {procs:>9}  {raw.rate:>15.0f}  {head.rate:>13.0f}  {previous:>16}  {guarded.rate:>15.0f}  "
                  f"{guarded.rate / raw.rate:>13.2f}{target}", flush=True)
        old_code.cleanup()

        latency(databases.fresh(), databases.fresh(), args.calls, args.rounds, args.baseline_rev)

        print("the inbox and the log after each guarded run:")
        total_calls = total_events = 0
        for procs, journal_dsn, run in guarded_runs:
            journal = PostgresJournal(journal_dsn)
            try:
                report = journal.verify()
                schema = journal.schema
            finally:
                journal.close()
            with psycopg.connect(journal_dsn, autocommit=True) as conn:
                # The server's count of rows inserted (its statistics, written as each session ends).
                row = conn.execute("SELECT n_tup_ins FROM pg_stat_user_tables WHERE schemaname = %s "
                                   "AND relname = 'inbox'", (schema,)).fetchone()
            through = int(row[0]) if row is not None else 0
            print(f"  {procs:>3} processes: {run.inbox_at_end} events in the inbox as the run ended, "
                  f"{run.inbox_later} a second later{'' if run.inbox_later == 0 else ' (expected 0)'}; "
                  f"{through} of the events went through it")
            print(f"      verify: {'ok' if report.ok else 'FAILED: ' + str(report.problem)}, {report.events} events "
                  f"for {run.made} calls")
            total_calls += run.made
            total_events += report.events
            if not report.ok or report.events != 2 * run.made:
                raise AssertionError(f"the journal of the {procs}-process run holds {report.events} events "
                                     f"(verify ok: {report.ok}); its processes made {run.made} calls, "
                                     f"so {2 * run.made} were expected")
        print(f"  every run: {total_events} events = 2 x {total_calls} guarded calls made: the count checks out")
    finally:
        databases.drop_all()
        if server is not None:
            from tests import pgserver

            pgserver.shutdown()


if __name__ == "__main__":
    main()
