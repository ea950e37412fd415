"""Where a guarded call's time goes: a fresh call, a replay and a refusal, part by part, on each store.

    python benchmarks/profile_call.py [--calls N] [--dir DIR] [--pg DSN|auto] [--stores LIST] [--top K]

For each store (the in-memory one; SQLiteJournal at ``durability="process"`` and ``"full"``;
PostgresJournal with ``--pg``) and each path it makes ``--calls`` calls of ``charge(account, cents)``
under an ``AirlockContext`` whose ``tool_call_id`` is:

- *fresh*: an id never seen (``pending``, the tool, ``committed``);
- *replay*: the id of a committed call (the stored value comes back, ``replayed`` is journaled);
- *refusal*: the id of a call left ``unknown`` (its tool raised ``TimeoutError``), retried: refused
  ``effect_status_unknown`` by the store's ``begin``, ``refused`` journaled.

Each path is first timed with nothing watching (the median and the mean of single calls), then run
again under cProfile. A part of the table is the own time of the functions it names, each less what
the profiler adds to one call of a function (measured first on fresh calls to the in-memory store,
which are all Python), scaled so that the parts add up to the unprofiled median. On
SQLite the statements a call issues are then counted, by a trace callback on the journal's
connection (a trigger's run apart from its statement), and timed one by one (the median of each
kind), in two batches of their own; on PostgreSQL the statements sent and the waits for the server
are counted from the profile.

``--dir`` (default /var/tmp) should be on a disk: on tmpfs an fsync costs nothing. ``--top`` prints
the K functions that cost most in each path as well.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import platform
import pstats
import re
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guard import Airlock, AirlockContext, SecurityPolicy  # noqa: E402
from guard.effect_guard import EffectGuard, InMemoryEffectStore  # noqa: E402

_GUARD = str(ROOT / "guard") + os.sep
_JOURNAL = str(ROOT / "journal") + os.sep
_HERE = str(Path(__file__).resolve())
# The journal's transaction, retry and group-commit code, apart from the code that makes an event.
_MACHINERY = ("connection.py", "group_commit.py", "forks.py")

PARTS = (
    "guard (Python)",
    "journal: event, hash, rows (Python)",
    "journal: transaction, group commit (Python)",
    "SQLite statements (C)",
    "fsync of the WAL",
    "psycopg (Python)",
    "waiting for the server (libpq)",
    "hashing, JSON, times (C)",
    "locks (C)",
    "the tool and the caller",
    "other builtins",
)


def part_of(key: tuple[str, int, str]) -> str:
    """The part of the table a profiled function's own time belongs to."""
    filename, _, name = key
    if filename == "~":  # a builtin: its name says what it is
        if "sqlite3." in name:
            return "SQLite statements (C)"
        if "fdatasync" in name or "posix.fsync" in name:
            return "fsync of the WAL"
        if any(w in name for w in ("poll", "select", "wait_c", "recv", "send", "connect_poll")):
            return "waiting for the server (libpq)"
        if any(w in name for w in ("_hashlib", "hexdigest", "orjson", "isoformat", "datetime", "sha256", "encode",
                                   "decode", "fromisoformat")):
            return "hashing, JSON, times (C)"
        if any(w in name for w in ("lock", "acquire", "release", "_recursion_count", "Condition", "notify")):
            return "locks (C)"
        if "psycopg" in name:
            return "psycopg (Python)"
        return "other builtins"
    if filename == _HERE:
        return "the tool and the caller"
    if filename.startswith(_GUARD):
        return "guard (Python)"
    if filename.startswith(_JOURNAL):
        if filename.endswith(_MACHINERY):
            return "journal: transaction, group commit (Python)"
        return "journal: event, hash, rows (Python)"
    if "psycopg" in filename:
        # libpq's own sending and waiting run inside these two (compiled code the profiler does not see).
        if (filename.endswith("connection.py") and name == "wait") or name.startswith("_send_query"):
            return "waiting for the server (libpq)"
        return "psycopg (Python)"
    if filename.endswith(("threading.py", "queue.py")):
        return "locks (C)"
    return "other builtins"


def charge(account: str, cents: int) -> dict[str, Any]:
    return {"charge_id": f"ch_{cents}", "account": account, "cents": cents}


def charge_lost(account: str, cents: int) -> dict[str, Any]:
    raise TimeoutError("the payment backend did not answer")


@dataclass
class Path_:
    """One path of one store: the ids it is called with, and what a call does."""

    name: str
    ids: Iterator[str]
    call: Callable[[str], Any]


@dataclass
class Profiled:
    mean_us: float
    median_us: float
    parts: dict[str, float]
    statements: Counter[str]
    spent: dict[str, list[float]]
    top: list[tuple[str, float]]


def new_ids(prefix: str) -> Iterator[str]:
    # Random ids, as models make them: ids that count up keep the indexes writing the same pages.
    while True:
        yield f"{prefix}_{uuid.uuid4().hex[:24]}"


def paths_of(store: Any, calls: int) -> list[Path_]:
    """The three paths on ``store``, with the committed and the unknown calls they need made first."""
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))
    guarded = Airlock(policy=policy)(charge)
    lost = Airlock(policy=policy)(charge_lost)

    def call(fn: Callable[..., Any]) -> Callable[[str], Any]:
        def one(call_id: str) -> Any:
            with AirlockContext(agent_id="bench", metadata={"tool_call_id": call_id}):
                return fn("acct_1", 500)
        return one

    fresh = call(guarded)
    lose = call(lost)
    # Warm-up, the timed calls, the profiled ones, and the two batches of statements.
    needed = max(20, calls // 10) + 2 * calls + 2 * min(calls, 200)
    committed = [f"call_{uuid.uuid4().hex[:24]}" for _ in range(needed)]
    for call_id in committed:
        fresh(call_id)
    unknown = [f"call_{uuid.uuid4().hex[:24]}" for _ in range(needed)]
    for call_id in unknown:
        with contextlib.suppress(TimeoutError):
            lose(call_id)
    return [
        Path_("fresh", new_ids("call"), fresh),
        Path_("replay", iter(committed), fresh),
        Path_("refusal", iter(unknown), lose),
    ]


def checked(path: Path_, result: Any) -> None:
    """Each path must do what its name says, or its figures mean nothing."""
    if path.name in ("fresh", "replay") and not (isinstance(result, dict) and result.get("cents") == 500
                                                 and "block_reason" not in result):
        raise SystemExit(f"profile_call.py: a {path.name} call returned {result!r}")
    refused = isinstance(result, dict) and result.get("block_reason") == "effect_status_unknown"
    if path.name == "refusal" and not refused:
        raise SystemExit(f"profile_call.py: a refused call returned {result!r}")


def statement_of(sql: str) -> str:
    """A statement without its values: its verb and the table it names."""
    text = " ".join(sql.split())
    if text.startswith("SELECT (SELECT seq FROM events"):
        return "SELECT head and call row"
    verb = text.split(" ", 1)[0].upper()
    if verb in ("BEGIN", "COMMIT", "ROLLBACK", "PRAGMA"):
        return " ".join(text.split(" ")[:2]).split("=")[0].strip()
    table = re.search(r"\b(?:INTO|FROM|UPDATE)\s+(\w+)", text, re.IGNORECASE)
    upsert = " ... ON CONFLICT" if verb == "INSERT" and "ON CONFLICT" in text.upper() else ""
    return f"{verb} {table.group(1) if table else ''}{upsert}".strip()


class _TimedConnection:
    """The journal's connection, each ``execute`` timed by the kind of statement (the time SQLite
    takes for it, its triggers and, for COMMIT, writing the WAL)."""

    def __init__(self, conn: sqlite3.Connection, spent: dict[str, list[float]]) -> None:
        self._conn = conn
        self._spent = spent

    def execute(self, sql: str, *params: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._conn.execute(sql, *params)
        finally:
            took = time.perf_counter() - started
            self._spent.setdefault(statement_of(sql), []).append(took)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def sqlite_statements(store: Any, path: Path_, calls: int) -> tuple[Counter[str], dict[str, list[float]]]:
    """How many statements of each kind a call issues (a trigger's run apart), and the seconds each
    statement of each kind took, in ``calls`` calls: counted and timed in two batches of their own."""
    datastore = getattr(store, "datastore", None)  # a SQLite journal's holds its connection
    conn = getattr(datastore, "current", None)
    seen: Counter[str] = Counter()
    spent: dict[str, list[float]] = {}
    if not isinstance(conn, sqlite3.Connection):
        return seen, spent
    datastore.current = _TimedConnection(conn, spent)
    try:
        for _ in range(calls):
            checked(path, path.call(next(path.ids)))
    finally:
        datastore.current = conn
    last = [""]

    def traced(sql: str) -> None:
        # Python's sqlite3 reports a trigger's program as the statement that fired it, again.
        seen[f"trigger on {statement_of(sql)}" if sql == last[0] else statement_of(sql)] += 1
        last[0] = sql

    conn.set_trace_callback(traced)
    try:
        for _ in range(calls):
            checked(path, path.call(next(path.ids)))
    finally:
        conn.set_trace_callback(None)
    return seen, spent


def profiler_cost(calls: int = 2000) -> float:
    """What cProfile adds to one function call, in µs: measured on fresh calls to the in-memory store,
    all Python and no waits, so nothing but the profiler tells the profiled run from the bare one
    (the least of three tries)."""
    best = float("inf")
    for _ in range(3):
        path = paths_of(InMemoryEffectStore(), 0)[0]
        ids = [next(path.ids) for _ in range(2 * calls)]
        started = time.perf_counter()
        for call_id in ids[:calls]:
            path.call(call_id)
        bare = time.perf_counter() - started
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        for call_id in ids[calls:]:
            path.call(call_id)
        profile.disable()
        profiled = time.perf_counter() - started
        ncalls = sum(e[1] for e in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]
        best = min(best, max(0.0, (profiled - bare) / ncalls * 1e6))
    return best


_COST = [0.0]  # profiler_cost(), measured once at the start


def fitted_parts(stats: pstats.Stats, calls: int, typical_us: float,
                 top: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Each part's µs per call, and the ``top`` functions that cost most: the functions' own times,
    each less what the profiler adds to one call (:func:`profiler_cost`; a function's time stays at
    zero or more), scaled so that they add up to ``typical_us``, the unprofiled median."""
    entries = stats.stats  # type: ignore[attr-defined]
    profiled = [(part_of(key), key, tottime / calls * 1e6, primitive / calls)
                for key, (_, primitive, tottime, _, _) in entries.items()]
    cost = _COST[0]
    corrected = [(part, key, max(0.0, us - n * cost)) for part, key, us, n in profiled]
    left = sum(c[2] for c in corrected)
    scale = typical_us / left if left else 0.0
    parts = dict.fromkeys(PARTS, 0.0)
    own: list[tuple[str, float]] = []
    for part, key, us in corrected:
        parts[part] += us * scale
        own.append((f"{Path(key[0]).name}:{key[1]}({key[2]})" if key[0] != "~" else key[2], us * scale))
    own.sort(key=lambda item: -item[1])
    return parts, own[:top]


def profile_path(store: Any, path: Path_, calls: int, top: int) -> Profiled:
    for _ in range(max(20, calls // 10)):  # warmed up: the connection open, the WAL grown
        checked(path, path.call(next(path.ids)))
    gc.collect()
    times = []
    for _ in range(calls):
        call_id = next(path.ids)
        started = time.perf_counter()
        result = path.call(call_id)
        times.append(time.perf_counter() - started)
        checked(path, result)
    mean_us, median_us = statistics.fmean(times) * 1e6, statistics.median(times) * 1e6
    ids = [next(path.ids) for _ in range(calls)]
    profile = cProfile.Profile()
    profile.enable()
    for call_id in ids:
        path.call(call_id)
    profile.disable()
    statements, spent = sqlite_statements(store, path, min(calls, 200))
    counted = min(calls, 200)
    parts, heavy = fitted_parts(pstats.Stats(profile), calls, median_us, top)
    if not statements:  # PostgreSQL: what psycopg sends and how often it waits, from the profile
        for key, entry in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
            if "psycopg" in key[0] and key[2] == "execute" and key[0].endswith("cursor.py"):
                statements["statements sent (Cursor.execute)"] += round(entry[1] / calls * counted)
            elif "psycopg" in key[0] and key[0].endswith("connection.py") and key[2] == "wait":
                statements["waits for the server"] += round(entry[1] / calls * counted)
        statements = Counter({k: v for k, v in statements.items() if v}) + Counter({"__calls__": counted})
    else:
        statements["__calls__"] = counted
    return Profiled(mean_us, median_us, parts, statements, spent, heavy)


def print_store(title: str, store: Any, calls: int, top: int) -> None:
    print(f"\n{title}")
    for path in paths_of(store, calls):
        run = profile_path(store, path, calls, top)
        profiled = sum(run.parts.values())
        print(f"  {path.name}: median {run.median_us:.1f} us, mean {run.mean_us:.1f} us unprofiled; "
              f"the parts add up to {profiled:.1f} us")
        for part in PARTS:
            us = run.parts[part]
            if us >= 0.05:
                print(f"    {part:46s} {us:8.1f} us  {us / profiled:6.1%}")
        counted = run.statements.pop("__calls__")
        if run.statements:
            each = ", ".join(f"{name} x{n / counted:.2g}" for name, n in sorted(run.statements.items(),
                                                                                  key=lambda item: -item[1]))
            print(f"    per call: {each}")
        if run.spent:
            medians = {name: statistics.median(times) * 1e6 for name, times in run.spent.items()}
            print("    median time of one statement (with its triggers; COMMIT writes the WAL): " + ", ".join(
                f"{name} {us:.1f} us" for name, us in sorted(medians.items(), key=lambda item: -item[1])))
        for name, us in run.top:
            print(f"      {us:7.1f} us  {name}")


def postgres_dsn(option: str | None) -> str | None:
    if option != "auto":
        return option
    from tests import pgserver

    try:
        return pgserver.fresh_database(pgserver.server())
    except pgserver.PgUnavailable as e:
        raise SystemExit(f"profile_call.py: --pg auto: {e}") from e


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls a path, timed and again profiled")
    parser.add_argument("--dir", default="/var/tmp", help="where the SQLite journals go (a disk, not tmpfs)")
    parser.add_argument("--pg", default=None, help="a PostgreSQL DSN, or 'auto' for a throwaway local cluster")
    parser.add_argument("--stores", default="memory,process,full,postgres",
                        help="which stores, of memory, process, full, postgres (postgres needs --pg)")
    parser.add_argument("--top", type=int, default=0, help="also print the K functions that cost most a path")
    opts = parser.parse_args()
    if opts.calls < 10:
        parser.error("--calls is at least 10")
    stores = {s.strip() for s in opts.stores.split(",") if s.strip()}
    unknown = stores - {"memory", "process", "full", "postgres"}
    if unknown:
        parser.error(f"--stores: no store named {', '.join(sorted(unknown))}")
    print(f"python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; {opts.calls} calls a path; microseconds per call, "
          "the parts add up to the unprofiled median")
    _COST[0] = profiler_cost()
    if "memory" in stores:
        print_store("in-memory store", InMemoryEffectStore(), opts.calls, opts.top)
    if stores & {"process", "full"}:
        from journal import SQLiteJournal

        with tempfile.TemporaryDirectory(prefix="profile-call-", dir=opts.dir) as tmp:
            for durability in ("process", "full"):
                if durability in stores:
                    journal = SQLiteJournal(Path(tmp) / f"{durability}.db", durability=durability)
                    try:
                        print_store(f'SQLiteJournal, durability="{durability}" ({tmp})', journal, opts.calls,
                                    opts.top)
                    finally:
                        journal.close()
    if "postgres" in stores and opts.pg:
        dsn = postgres_dsn(opts.pg)
        from journal.postgres import PostgresJournal

        journal = PostgresJournal(dsn)
        try:
            print_store("PostgresJournal", journal, opts.calls, opts.top)
        finally:
            journal.close()


if __name__ == "__main__":
    main()
