"""A guarded call here and in two peer libraries, and the raw SQLite transactions under them, in one run.

    python benchmarks/compare.py [--dir DIR] [--rounds R] [--calls N] [--sync-calls M] [--pg DSN|auto]
                                 [--warmup W] [--threads T] [--throughput-calls K]

Needs the ``bench`` extra (``pip install -e '.[bench]'``): agent-once (``once``) and airlock-sdk
(``airlock``). Every system guards the same tool, ``charge(account, cents)``, which counts its runs
and returns a dict. For each system it prints the median and the 99th percentile of one call with a
fresh id (the tool runs) and of a replay of a committed call (the stored value comes back):

- the bare function;
- this project on its in-memory store, on SQLiteJournal at ``full`` and at ``process``, and on
  PostgresJournal when a server is given (``--pg DSN``, or ``AIRLOCK_BENCH_PG_DSN``; ``--pg auto``
  starts a throwaway cluster as the tests do);
- agent-once on its SQLite store (a fresh id is ``once.scope(id)``), at its default
  ``synchronous=FULL`` and at ``NORMAL``;
- airlock-sdk on its SQLite store in its at-most-once mode (a bare ``Effect()``; a fresh id is the
  ``key=`` override), at its default ``synchronous=NORMAL`` and at ``FULL``;
- the floors: one and two raw ``BEGIN IMMEDIATE; INSERT; COMMIT`` transactions, WAL, at FULL and at
  NORMAL, on a file in the same directory; with PostgreSQL, two raw ``INSERT`` statements of an
  event-sized row, each its own transaction and round trip (autocommit), into a table shaped as the
  journal's ``events`` in a schema of its own, committed as the journal commits a ``pending``.

Then the durable throughput of fresh calls at ``durability="full"``, from one thread and from
``--threads`` threads sharing one SQLiteJournal (their pending records share an fsync: group commit).

Last, each performance target with the ratio this run measured and whether it is met (see
:func:`targets`).

Before timing, each system must run the tool exactly once for a fresh id, return the stored value on
a replay without running it, and run it again for another id; its SQLite file must be in WAL mode at
the ``synchronous`` level named. Otherwise the run stops with the reason. Every system runs a batch
in every round, in an order that rotates, so noise from other work on the machine falls on all alike.
The files go in a temporary directory under ``--dir`` (default /var/tmp), which must be on a disk,
not tmpfs.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import gc
import importlib.metadata
import itertools
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard, InMemoryEffectStore
from journal import SQLiteJournal

_PG_ENV = "AIRLOCK_BENCH_PG_DSN"
_SYNC_LEVELS = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
_ROW = ("2026-12-01T05:23:06.123456Z", "pending", "charge", "bench", "k" * 64,
        '{"account":"acct_1","cents":500}', "guard", 1, '{"host":"bench","pid":1}', "0" * 64, "f" * 64)


class Misconfigured(SystemExit):
    """A system does not do what its row says: no figures are printed for a run that has one."""

    def __init__(self, system: str, why: str) -> None:
        super().__init__(f"compare.py: {system}: {why}; stopping, no figures printed.")


@dataclass
class System:
    """One row of the table: how to make one call with a given id, and how often the tool ran."""

    name: str
    durability: str
    call: Callable[[str], Any]
    ran: list[int]
    synced: bool  # an fsync per fresh call, so fewer calls a round
    guarded: bool = True  # False for the bare function and the floors: nothing to check
    replays: bool = True
    context: contextvars.Context | None = None  # the context the calls run in (airlock-sdk's runtime)
    check_sqlite: tuple[sqlite3.Connection, str] | None = None  # a peer's connection and the level it needs
    warned: Callable[[list[warnings.WarningMessage]], str | None] | None = None
    fresh: list[int] = field(default_factory=list)
    replay: list[int] = field(default_factory=list)

    def run(self, work: Callable[[], Any]) -> Any:
        return work() if self.context is None else self.context.run(work)


def make_tool(ran: list[int]) -> Callable[[str, int], dict[str, Any]]:
    """A fresh ``charge`` tool: each run counts, and its value says which run it was."""

    def charge(account: str, cents: int) -> dict[str, Any]:
        ran[0] += 1
        return {"charge_id": f"ch_{ran[0]}", "account": account, "cents": cents}

    return charge


# -- the systems ---------------------------------------------------------------------------------


def bare() -> System:
    """The unguarded tool, called in the same AirlockContext a guarded call gets: the difference is
    the guard's own cost."""
    ran = [0]
    tool = make_tool(ran)

    def call(call_id: str) -> Any:
        with AirlockContext(agent_id="bench", metadata={"tool_call_id": call_id}):
            return tool("acct_1", 500)

    return System("bare function, in an AirlockContext", "-", call, ran, synced=False, guarded=False)


def ours(name: str, durability: str, store: Any, synced: bool) -> System:
    ran = [0]
    tool = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))(make_tool(ran))

    def call(call_id: str) -> Any:
        with AirlockContext(agent_id="bench", metadata={"tool_call_id": call_id}):
            return tool("acct_1", 500)

    return System(name, durability, call, ran, synced=synced)


def agent_once(path: Path, synchronous: str | None) -> System:
    import once

    ran = [0]
    runner = once.Once(path)
    tool = runner.tool(make_tool(ran))
    conn = runner.store._conn()  # type: ignore[attr-defined]  # this thread's connection, the one calls use
    default = _SYNC_LEVELS[conn.execute("PRAGMA synchronous").fetchone()[0]]
    if synchronous is not None:
        conn.execute(f"PRAGMA synchronous = {synchronous}")
    level = synchronous or default

    def call(call_id: str) -> Any:
        with runner.scope(call_id):
            return tool("acct_1", 500)

    label = f"synchronous={level}" + (" (its default)" if synchronous is None else "")
    return System(f"agent-once {_version('agent-once')}, SQLiteStore", label, call, ran, synced=level == "FULL",
                  check_sqlite=(conn, level))


def airlock_sdk(path: Path, synchronous: str | None, action: str) -> System:
    import airlock
    from airlock import AtMostOnceWarning, Decision, Effect, Policy, Rule
    from airlock.store.sqlite import SqliteStore
    from airlock.transport.console import ConsoleApprovalTransport

    ran = [0]
    call_id_var: contextvars.ContextVar[str] = contextvars.ContextVar(f"{action}_call_id")
    # A bare Effect() is airlock-sdk's at-most-once mode; key= makes the call id the ledger key.
    tool = airlock.guard(action, effect=Effect(), key=lambda account, cents: call_id_var.get())(make_tool(ran))
    store = SqliteStore(str(path))
    store.ensure_schema()
    context = contextvars.copy_context()  # init() installs its runtime in the current context
    context.run(lambda: airlock.init(
        store=store, policy=Policy(rules=[Rule(match=action, decision=Decision.AUTO)]),
        transport=ConsoleApprovalTransport(str(path.with_suffix(".approvals.jsonl"))),
    ))
    conn = store._conn()  # this thread's connection, the one calls use
    default = _SYNC_LEVELS[conn.execute("PRAGMA synchronous").fetchone()[0]]
    if synchronous is not None:
        conn.execute(f"PRAGMA synchronous = {synchronous}")
    level = synchronous or default

    def call(call_id: str) -> Any:
        token = call_id_var.set(call_id)
        try:
            return tool("acct_1", 500)
        finally:
            call_id_var.reset(token)

    def warned(caught: list[warnings.WarningMessage]) -> str | None:
        if any(issubclass(w.category, AtMostOnceWarning) for w in caught):
            warnings.filterwarnings("ignore", category=AtMostOnceWarning)
            return None
        return "did not warn AtMostOnceWarning, so it is not in its at-most-once mode"

    label = f"synchronous={level}" + (" (its default)" if synchronous is None else "")
    return System(f"airlock-sdk {_version('airlock-sdk')}, SqliteStore", label, call, ran,
                  synced=level == "FULL", context=context, check_sqlite=(conn, level), warned=warned)


def floor(path: Path, synchronous: str, transactions: int) -> System:
    """Raw transactions of an event-sized row: the least that many durable appends can cost."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, at, call_id, kind, tool, agent_id, "
                 "idempotency_key, arguments, actor, attempt, owner, prev_hash, hash)")
    insert = ("INSERT INTO events (at, call_id, kind, tool, agent_id, idempotency_key, arguments, actor, attempt, "
              "owner, prev_hash, hash) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)")

    def call(call_id: str) -> None:
        for _ in range(transactions):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(insert, (_ROW[0], call_id, *_ROW[1:]))
            conn.execute("COMMIT")

    what = "one raw transaction" if transactions == 1 else f"{transactions} raw transactions"
    return System(f"floor: {what}", f"synchronous={synchronous}", call, [0], synced=synchronous == "FULL",
                  guarded=False, replays=False, check_sqlite=(conn, synchronous))


_PG_FLOOR_SCHEMA = "compare_floor"


def pg_floor(dsn: str, journal_schema: str, durability: str) -> System:
    """Two raw INSERT transactions on PostgreSQL: a row shaped as an event, into a copy of the
    journal's ``events`` table (its columns, checks and indexes) in a schema of its own, each
    statement its own transaction and round trip, at the server's ``synchronous_commit`` (the one
    the journal commits a ``pending`` with). What a fresh call's two events cost at the least."""
    import psycopg
    from psycopg.sql import SQL, Identifier

    from journal.rows import EVENT_COLUMNS

    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute(SQL("CREATE SCHEMA IF NOT EXISTS {}").format(Identifier(_PG_FLOOR_SCHEMA)))
    conn.execute(SQL("CREATE TABLE IF NOT EXISTS {}.events (LIKE {}.events INCLUDING ALL)").format(
        Identifier(_PG_FLOOR_SCHEMA), Identifier(journal_schema)))
    insert = SQL("INSERT INTO {}.events ({}) VALUES ({})").format(
        Identifier(_PG_FLOOR_SCHEMA), SQL(", ").join(map(Identifier, EVENT_COLUMNS)),
        SQL(", ").join([SQL("%s")] * len(EVENT_COLUMNS)))
    at, kind, tool, agent_id, key, arguments, actor, attempt, owner, prev_hash, digest = _ROW
    seq = itertools.count(1)

    def call(call_id: str) -> None:
        for _ in range(2):
            conn.execute(insert, (next(seq), at, call_id, kind, tool, agent_id, key, arguments, None, None, None,
                                  actor, attempt, owner, prev_hash, digest))

    return System("floor: two raw INSERT transactions", durability, call, [0], synced=False, guarded=False,
                  replays=False)


# -- checks --------------------------------------------------------------------------------------


def check(system: System, run_id: str) -> None:
    """Stop the run unless ``system`` runs the tool once per id and replays the stored value."""
    if system.check_sqlite is not None:
        conn, level = system.check_sqlite
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        actual = _SYNC_LEVELS[conn.execute("PRAGMA synchronous").fetchone()[0]]
        if mode != "wal" or actual != level:
            raise Misconfigured(system.name, f"its SQLite file is journal_mode={mode}, synchronous={actual}, "
                                             f"not wal and {level}")
    if not system.guarded:
        return
    first_id, second_id = f"{run_id}-check-1", f"{run_id}-check-2"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = system.ran[0]
        first = system.run(lambda: system.call(first_id))
        if system.ran[0] != before + 1:
            raise Misconfigured(system.name, f"a fresh id ran the tool {system.ran[0] - before} times, not once")
        again = system.run(lambda: system.call(first_id))
        if system.ran[0] != before + 1:
            raise Misconfigured(system.name, "a replay ran the tool again")
        if again != first:
            raise Misconfigured(system.name, f"a replay returned {again!r}, not the stored {first!r}")
        other = system.run(lambda: system.call(second_id))
        if system.ran[0] != before + 2 or other == first:
            raise Misconfigured(system.name, "another id did not run the tool: the id is not part of the key")
    if system.warned is not None:
        problem = system.warned(caught)
        if problem is not None:
            raise Misconfigured(system.name, problem)


# -- timing --------------------------------------------------------------------------------------


def timed(call: Callable[[str], Any], ids: list[str]) -> list[int]:
    """Nanoseconds of each call, one per id."""
    clock = time.perf_counter_ns
    out: list[int] = []
    for call_id in ids:
        start = clock()
        call(call_id)
        out.append(clock() - start)
    return out


def _call_id() -> str:
    """A fresh tool call id as models make them: random, so that consecutive calls land on
    unrelated pages of every store's index, as they do in use (ids that count up would keep
    writing the same few pages)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def measure(systems: list[System], rounds: int, calls: int, sync_calls: int, warmup: int) -> None:
    # Warm up: caches, prepared statements, and the WAL grown to the size it cycles at in a process
    # that has been running (after a checkpoint SQLite writes it over again from the start).
    for system in systems:
        ids = [_call_id() for _ in range(warmup)]
        system.run(lambda s=system, ids=ids: timed(s.call, ids))
    for r in range(rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            n = sync_calls if system.synced else calls
            ids = [_call_id() for _ in range(n)]
            gc.collect()
            system.fresh += system.run(lambda s=system, ids=ids: timed(s.call, ids))
            if system.replays:
                replay_ids = [ids[i % n] for i in range(calls)]
                gc.collect()
                system.replay += system.run(lambda s=system, ids=replay_ids: timed(s.call, ids))


class Throughput:
    """Fresh guarded calls at durability="full" from ``threads`` threads sharing one SQLiteJournal."""

    def __init__(self, path: Path, threads: int) -> None:
        self.threads = threads
        self.ran = [0]
        self.lock = threading.Lock()
        self.journal = SQLiteJournal(path, durability="full")
        self.tool = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=self.journal)))(self.counted())
        self.ids = (_call_id() for _ in itertools.count())
        self.rates: list[float] = []

    def counted(self) -> Callable[[str, int], dict[str, Any]]:
        def charge(account: str, cents: int) -> dict[str, Any]:
            with self.lock:
                self.ran[0] += 1
            return {"account": account, "cents": cents}

        return charge

    def run(self, calls: int) -> None:
        """Make ``calls`` calls (each thread its share, all started at once); keep calls per second."""
        per_thread = max(1, calls // self.threads)
        ids = [[next(self.ids) for _ in range(per_thread)] for _ in range(self.threads)]
        barrier = threading.Barrier(self.threads + 1)
        failed: list[BaseException] = []

        def work(mine: list[str]) -> None:
            barrier.wait()
            try:
                for call_id in mine:
                    with AirlockContext(agent_id="bench", metadata={"tool_call_id": call_id}):
                        self.tool("acct_1", 500)
            except BaseException as e:
                failed.append(e)

        workers = [threading.Thread(target=work, args=(mine,)) for mine in ids]
        for w in workers:
            w.start()
        before = self.ran[0]
        barrier.wait()
        start = time.perf_counter()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - start
        made = per_thread * self.threads
        if failed or self.ran[0] - before != made:
            raise Misconfigured(f"{self.threads} threads at full", f"{self.ran[0] - before} runs for {made} fresh "
                                f"calls{f', and {failed[0]!r}' if failed else ''}")
        self.rates.append(made / elapsed)


def median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1000


def p99_us(samples: list[int]) -> float:
    if len(samples) < 2:  # statistics.quantiles needs two; the 99th percentile of one is that one
        return median_us(samples)
    return statistics.quantiles(samples, n=100, method="inclusive")[98] / 1000


# -- the report ----------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError as e:
        raise SystemExit(f"compare.py: {dist} is not installed; pip install -e '.[bench]'") from e


def filesystem(path: Path) -> tuple[str, str]:
    """The (type, device) of the filesystem that holds ``path``, from /proc/mounts."""
    best = ("", "?", "?")
    target = str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            device, point, kind = line.split()[:3]
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, kind, device)
    return best[1], best[2]


def postgres_dsn(option: str | None) -> tuple[str | None, Callable[[], None]]:
    """The DSN to run PostgresJournal on (or None), and what to call at the end."""
    dsn = option or os.environ.get(_PG_ENV)
    if not dsn:
        return None, lambda: None
    if dsn != "auto":
        return dsn, lambda: None
    from tests import pgserver

    try:
        server = pgserver.server()
    except pgserver.PgUnavailable as e:
        raise SystemExit(f"compare.py: --pg auto: {e}") from e
    return pgserver.fresh_database(server), pgserver.shutdown


def postgres_durability(dsn: str) -> str:
    """The server's settings that decide when a commit is on disk."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        settings = {name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
                    for name in ("fsync", "synchronous_commit")}
    return f"fsync={settings['fsync']}, synchronous_commit={settings['synchronous_commit']}"


@dataclass(frozen=True)
class Target:
    """A performance target: ``measured`` (a ratio, or microseconds where ``unit`` says so) against
    ``limit``, met when at most it (``at_least`` False) or at least it."""

    label: str
    measured: float | None  # None: not measured in this run
    limit: float
    at_least: bool = False
    unit: str = "x"
    why_not: str = ""

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.limit if self.at_least else self.measured <= self.limit

    def line(self) -> str:
        bound = f"{'>=' if self.at_least else '<='} {self.limit:g}{self.unit}"
        if self.measured is None:
            return f"  {self.label:<78} {'-':>8}   (target {bound:<9})  not measured: {self.why_not}"
        figure = f"{self.measured:.2f}{self.unit}"
        return f"  {self.label:<78} {figure:>8}   (target {bound:<9})  {'met' if self.met else 'NOT MET'}"


_PEERS = {"once-full": "agent-once at FULL", "once-normal": "agent-once at NORMAL",
          "sdk-normal": "airlock-sdk at NORMAL", "sdk-full": "airlock-sdk at FULL"}


def targets(fresh: Mapping[str, float], replay: Mapping[str, float], one_thread: float,
            many_threads: float, threads: int) -> list[Target]:
    """The targets, from the median microseconds of a fresh call and of a replay by system key (as
    :func:`main` names them; ``postgres`` and ``floor-pg-2`` may be missing) and the calls per
    second of one thread and of ``threads`` threads sharing one journal."""
    fastest = min((key for key in _PEERS if key in replay), key=lambda key: replay[key])
    made = [
        Target("process, fresh: ours / agent-once at NORMAL", fresh["process"] / fresh["once-normal"], 0.6),
        Target("full, fresh: ours / agent-once at FULL, its default", fresh["full"] / fresh["once-full"], 0.7),
        Target("full, fresh: ours / one raw fsync'd transaction", fresh["full"] / fresh["floor-full-1"], 1.6),
    ]
    made += [Target(f"{level}, replay: ours / the faster peer's ({_PEERS[fastest]})",
                    replay[level] / replay[fastest], 0.5) for level in ("full", "process")]
    made.append(Target(f"full, {threads} threads sharing one SQLiteJournal / one thread, calls per second",
                       many_threads / one_thread, 2.5, at_least=True))
    if "postgres" in fresh and "floor-pg-2" in fresh:
        made.append(Target("PostgreSQL, fresh: ours / two raw INSERT transactions on the same server",
                           fresh["postgres"] / fresh["floor-pg-2"], 1.3))
    else:
        made.append(Target("PostgreSQL, fresh: ours / two raw INSERT transactions on the same server", None,
                           1.3, why_not=f"no server (--pg DSN, --pg auto or ${_PG_ENV})"))
    made.append(Target("in-memory store, fresh: ours - the bare function", fresh["memory"] - fresh["bare"], 10,
                       unit="us"))
    return made


def report(systems: dict[str, System], where: str, options: argparse.Namespace, single: Throughput,
           many: Throughput) -> None:
    print(f"journals in {where}")
    print(f"python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, {os.cpu_count()} CPUs; "
          f"{options.rounds} rounds of {options.calls} calls ({options.sync_calls} where each call fsyncs), "
          "interleaved; microseconds per call")
    print()
    print(f"{'system':<44} {'durability':<32} {'fresh med':>10} {'p99':>9} {'replay med':>11} {'p99':>9}")
    for system in systems.values():
        fresh = f"{median_us(system.fresh):10.1f} {p99_us(system.fresh):9.1f}"
        replay = (f"{median_us(system.replay):11.1f} {p99_us(system.replay):9.1f}" if system.replays
                  else f"{'-':>11} {'-':>9}")
        print(f"{system.name:<44} {system.durability:<32} {fresh} {replay}")
    med = {key: median_us(s.fresh) for key, s in systems.items()}
    rep = {key: median_us(s.replay) for key, s in systems.items() if s.replays}
    one, several = statistics.median(single.rates), statistics.median(many.rates)
    print()
    print('durable throughput: fresh calls at durability="full", threads sharing one SQLiteJournal '
          f"(median of {len(single.rates)} rounds)")
    print(f"  {'1 thread':<20} {one:8.0f} calls/s")
    print(f"  {f'{many.threads} threads':<20} {several:8.0f} calls/s")
    print()
    print("targets (ratios of the medians of this run; a peer 'at NORMAL' or 'at FULL' runs at that "
          "synchronous level):")
    for target in targets(med, rep, one, several, many.threads):
        print(target.line())
    print("for reference:")
    for label, slow, fast in (
        ("full, fresh: airlock-sdk at FULL / ours", med["sdk-full"], med["full"]),
        ("process, fresh: airlock-sdk at NORMAL, its default / ours", med["sdk-normal"], med["process"]),
        ("full, fresh: ours / two raw fsync'd transactions", med["full"], med["floor-full-2"]),
        ("process, fresh: ours / two raw transactions at NORMAL", med["process"], med["floor-normal-2"]),
        ("full, replay: agent-once at FULL / ours", rep["once-full"], rep["full"]),
        ("process, replay: agent-once at NORMAL / ours", rep["once-normal"], rep["process"]),
    ):
        print(f"  {label:<78} {slow / fast:7.2f}x")
    if "postgres" in med and "floor-pg-2" in med:
        print(f"  {'PostgreSQL, replay: ours / two raw INSERT transactions':<78} "
              f"{rep['postgres'] / med['floor-pg-2']:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where the journals go (a disk)")
    # Many short rounds: an fsync's cost swings with the other work on the disk from second to second.
    parser.add_argument("--rounds", type=int, default=30,
                        help="rounds; each times every system once, the order rotated round by round")
    parser.add_argument("--calls", type=int, default=100, help="calls a round, and replays a round")
    parser.add_argument("--sync-calls", type=int, default=6, help="fresh calls a round where each fsyncs")
    # 1500: enough for every WAL here to have been checkpointed and begun again from its start,
    # the floors' included (one page a transaction, checkpointed every 1000 pages). A WAL that is
    # still growing makes each fsync record the file's new size too, which costs it about double.
    parser.add_argument("--warmup", type=int, default=1500, help="fresh calls each system makes before the rounds")
    parser.add_argument("--pg", default=None, help=f"a PostgreSQL DSN, or 'auto' (default: ${_PG_ENV})")
    parser.add_argument("--threads", type=int, default=8, help="threads for the durable throughput")
    parser.add_argument("--throughput-calls", type=int, default=96, help="fresh calls a round, for throughput")
    options = parser.parse_args()
    for flag in ("rounds", "calls", "sync_calls", "threads", "throughput_calls"):
        if getattr(options, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be 1 or more")
    if options.warmup < 0:
        parser.error("--warmup must be 0 or more")
    if not options.dir.is_dir():
        raise SystemExit(f"compare.py: --dir {options.dir} is not a directory")
    kind, device = filesystem(options.dir)
    if kind in ("tmpfs", "ramfs"):
        raise SystemExit(f"compare.py: {options.dir} is on {kind}: fsync would cost nothing; give --dir on a disk")
    pg_dsn, pg_done = postgres_dsn(options.pg)
    run_id = uuid.uuid4().hex[:8]
    try:
        with tempfile.TemporaryDirectory(dir=options.dir, prefix="compare-") as tmp:
            d = Path(tmp)
            systems = {
                "bare": bare(),
                "memory": ours("airlock-journal, in-memory store", "this process's memory",
                               InMemoryEffectStore(), synced=False),
                "full": ours("airlock-journal, SQLiteJournal", 'durability="full"',
                             SQLiteJournal(d / "ours-full.db", durability="full"), synced=True),
                "process": ours("airlock-journal, SQLiteJournal", 'durability="process"',
                                SQLiteJournal(d / "ours-process.db", durability="process"), synced=False),
            }
            if pg_dsn is not None:
                from journal.postgres import PostgresJournal

                pg_journal = PostgresJournal(pg_dsn)
                pg_durability = postgres_durability(pg_dsn)
                # A full batch a round (not the few of a file's fsync): a commit's flush on the server
                # swings from call to call, and the ratio to its floor needs many of each.
                systems["postgres"] = ours("airlock-journal, PostgresJournal", pg_durability, pg_journal,
                                           synced=False)
                systems["floor-pg-2"] = pg_floor(pg_dsn, pg_journal.schema, pg_durability)
            systems |= {
                "once-full": agent_once(d / "once-full.db", None),
                "once-normal": agent_once(d / "once-normal.db", "NORMAL"),
                "sdk-normal": airlock_sdk(d / "sdk-normal.db", None, "bench.charge_normal"),
                "sdk-full": airlock_sdk(d / "sdk-full.db", "FULL", "bench.charge_full"),
                "floor-full-1": floor(d / "floor-full-1.db", "FULL", 1),
                "floor-full-2": floor(d / "floor-full-2.db", "FULL", 2),
                "floor-normal-1": floor(d / "floor-normal-1.db", "NORMAL", 1),
                "floor-normal-2": floor(d / "floor-normal-2.db", "NORMAL", 2),
            }
            if systems["once-full"].durability != "synchronous=FULL (its default)":
                raise Misconfigured("agent-once", f"its default is {systems['once-full'].durability}, not FULL")
            if systems["sdk-normal"].durability != "synchronous=NORMAL (its default)":
                raise Misconfigured("airlock-sdk", f"its default is {systems['sdk-normal'].durability}, not NORMAL")
            for system in systems.values():
                check(system, run_id)
            measure(list(systems.values()), options.rounds, options.calls, options.sync_calls, options.warmup)
            single = Throughput(d / "throughput-1.db", 1)
            many = Throughput(d / f"throughput-{options.threads}.db", options.threads)
            for r in range(options.rounds):
                for runner in (single, many) if r % 2 == 0 else (many, single):
                    runner.run(options.throughput_calls // (4 if runner is single else 1))
            report(systems, f"{d} ({kind} on {device})", options, single, many)
    finally:
        pg_done()


if __name__ == "__main__":
    main()
