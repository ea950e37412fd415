"""Verifying a large SQLite journal in parts, on several cores at once.

Each part reads the events of one range of call ids once, by call id: it recomputes each hash
from the row's fields, folds each call's events with the guard's ``apply`` and compares the record
with the call's projection row, one call at a time (a part's memory does not grow with the
journal). SQLite checks the links of one contiguous range of ``seq`` (no gap, each ``prev_hash``
the hash of the event before), so no part reads the log twice. Each index of the file is checked
against its table (:mod:`journal.sqlite.indexes`) by one of the parts. The parts together check
what the one-pass ``SQLiteJournal.verify`` checks; they only say whether all is well. When any part
finds a problem, the journal is verified again in one pass, which names the first bad event (or
index) exactly as it always does.

A part runs in this process or in a child: ``python -m journal.sqlite.verify PATH PART PARTS HEAD``
prints ``{"ok":true}`` or ``{"ok":false}``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

from .. import verifying
from ..chain import GENESIS, ChainCheck
from ..events import VerifyReport
from ..projection import FOLD_COLUMNS, fold_calls, folded_onto
from ..rows import CALL_COLUMNS, CHANGING_KINDS, EVENT_COLUMNS
from . import indexes, schema
from .archives import archived_head, seeds

__all__ = ["BY_CALL", "PARALLEL_FROM", "PATIENCE", "SAMPLES", "check_part", "child_said_ok", "index_problem",
           "start_part", "unindexed", "verify_snapshot"]

# Below this many events one pass is quicker than starting another interpreter.
PARALLEL_FROM = 200_000
# How long a child may take beyond three times this process's own part before it is given up.
PATIENCE = 60.0

_EVENT_COLUMNS = ", ".join(EVENT_COLUMNS)
_CALL_COLUMNS = ", ".join(CALL_COLUMNS)


# The log by call id, as verify folds it: the events that can change a record, each call's together.
# Read through the index on call id, each row's fields taken from the table and only where the
# index's key is the row's own: an index entry that names another call, or no row, is passed over
# (an event the index leaves out is found by unindexed()).
BY_CALL = (f"SELECT {', '.join(f't.{c}' for c in FOLD_COLUMNS)} FROM events AS i JOIN events AS t "
           f"ON t.seq = i.seq WHERE i.call_id IS NOT NULL AND t.call_id IS i.call_id AND t.kind IN {CHANGING_KINDS} "
           "ORDER BY i.call_id, i.seq")
_T_EVENT_COLUMNS = ", ".join(f"t.{c}" for c in EVENT_COLUMNS)
_T_OTHER_CALL_COLUMNS = ", ".join(f"t.{c}" for c in CALL_COLUMNS[1:])


def unindexed(conn: sqlite3.Connection, lo: int, hi: int) -> int | None:
    """The first event from ``lo`` to ``hi`` that the index on call id lacks (under its own call
    id), or None. The reads by call id (verify's fold, rebuild's) see the log through that index:
    an index altered or damaged behind SQLite's back (its own quick check does not look) would
    otherwise hide an event from them."""
    return indexes.unindexed(conn, lo, hi)


def index_problem(seq: int) -> str:
    """What verify says of an event that the index on call id lacks."""
    return (f"seq {seq} is missing from the log's index by call id ({indexes.EVENTS_BY_CALL}: the file was "
            "altered or damaged); run rebuild, which makes the index again")


def _indexes_problem(conn: sqlite3.Connection, first: int, last: int) -> tuple[int | None, str] | None:
    """What is wrong with the file's indexes, for a log of events ``first`` to ``last`` that checked
    out: the first event that the index on call id lacks, or the first index whose entries are not
    its table's rows (:func:`journal.sqlite.indexes.problem`, which raises
    :class:`~journal.sqlite.indexes.DamagedIndex` for an index in a damaged file); None."""
    by_call = next((i for i in indexes.indexes(conn) if i.name == indexes.EVENTS_BY_CALL), None)
    try:
        missing = indexes.unindexed(conn, first, last, by_call)
    except indexes.DamagedIndex as e:  # SQLite cannot read it: said so, if it may be made again in place
        return None, indexes.diagnosed(conn, e.index, e.what)
    if missing is not None:
        return missing, index_problem(missing)
    found = indexes.problem(conn, events=last - first + 1)
    return None if found is None else (None, found)


def verify_snapshot(conn: sqlite3.Connection, advance: Callable[[int], None] | None = None) -> VerifyReport:
    """The report of ``SQLiteJournal.verify`` in one pass over what ``conn`` sees (in a transaction of
    the caller's: a read snapshot, or a write not yet committed), holding one event and one call at
    a time (:func:`journal.verifying.verify_log`). A journal with archives has its log folded onto
    the projection as of the last archive's head (:func:`journal.sqlite.archives.seeds`). Once the
    chain has checked out, every index is checked against its table, before the projection is
    compared with the log read through them (raises :class:`~journal.sqlite.indexes.DamagedIndex`,
    see there)."""
    base = archived_head(conn)

    def indexed(check: ChainCheck) -> tuple[int | None, str] | None:
        return _indexes_problem(conn, base[0] + 1, check.last_seq)

    def records() -> Iterable[Any]:
        by_call = conn.execute(BY_CALL)
        return folded_onto(seeds(conn, base[0]), by_call) if base[0] else fold_calls(by_call)

    return verifying.verify_log(
        conn.execute(f"SELECT {_EVENT_COLUMNS} FROM events ORDER BY seq"),
        records,
        lambda: conn.execute(f"SELECT {_CALL_COLUMNS} FROM calls ORDER BY call_id"),
        start=base, between=indexed, advance=advance,
    )


# How many events _bounds samples to cut the calls into parts of about as many events each.
SAMPLES = 2_000


def _bounds(conn: sqlite3.Connection, part: int, parts: int, head: int) -> tuple[Any, Any]:
    """The call ids of this part's share, ``lo <= call_id < hi`` (None: no bound), as every part
    finds them whatever its snapshot: cut from the ids of the events up to ``head``, which are only
    ever appended to. The ids of :data:`SAMPLES` events spread evenly over the log are sorted in
    the database's order, and cut into parts: each then holds about as many events (the fold's
    work) as the next, whatever the ids look like. A bound is always a text, so every id (a blob,
    in an altered journal, sorts after every text) falls in one part. A range read from the index by call
    id touches this part's entries only."""
    step = max(1, head // SAMPLES)
    ids = [found[0] for found in conn.execute(
        "WITH RECURSIVE sample(seq) AS (SELECT 1 UNION ALL SELECT seq + ? FROM sample WHERE seq + ? <= ?) "
        "SELECT call_id FROM events JOIN sample USING (seq) WHERE typeof(call_id) = 'text' ORDER BY call_id",
        (step, step, head),
    )]

    def cut(k: int) -> Any:
        return ids[len(ids) * k // parts] if 0 < k < parts and ids else None

    return cut(part), cut(part + 1)


def _range(part: int, parts: int, head: int) -> tuple[int, int]:
    size = -(-head // parts)
    return part * size + 1, min(head, (part + 1) * size)


def _links_ok(conn: sqlite3.Connection, lo: int, hi: int) -> bool:
    """Events ``lo..hi`` are all there, each names the hash of the one before as its ``prev_hash``
    (the one before ``lo`` is taken as it is: the part before checks it), and each has its own
    entry in the index on call id (:func:`unindexed`), in one read of the range. Each hash is
    recomputed from its row's fields by :func:`_calls_ok`; the links are SQLite's to check."""
    if lo == 1:
        if conn.execute("SELECT 1 FROM events WHERE seq < 1 LIMIT 1").fetchone() is not None:
            return False  # an event before the first (seq starts at 1)
        first = conn.execute("SELECT prev_hash FROM events WHERE seq = 1").fetchone()
        if first is None or first[0] != GENESIS or unindexed(conn, 1, 1) is not None:
            return False
        lo = 2
    if lo > hi:
        return True
    linked = conn.execute(
        "SELECT count(*) FROM events AS e JOIN events AS before ON before.seq = e.seq - 1 "
        "WHERE e.seq BETWEEN ? AND ? AND e.prev_hash = before.hash AND EXISTS "
        "(SELECT 1 FROM events AS i INDEXED BY events_call_id WHERE i.call_id IS e.call_id AND i.seq = e.seq)",
        (lo, hi),
    ).fetchone()[0]
    return bool(linked == hi - lo + 1)  # no gap, no link broken, no event the index lacks


def _calls_ok(conn: sqlite3.Connection, part: int, parts: int, head: int) -> bool:
    """The events of this part's share of the calls (:func:`_bounds`), each hash recomputed and
    each call folded from its events in the whole log, are sound and exactly their stored
    projection rows (part 0 also checks the events without a call id, and looks for a row without
    a call id, which only an altered journal has). One read of the log by call id, holding one
    call at a time, beside the projection rows. Every event of the log is read by the part whose
    range holds its call id, as :func:`unindexed` shows the index it is read through holds each
    under its own."""
    lo, hi = _bounds(conn, part, parts, head)
    where = " AND ".join(["call_id IS NOT NULL", *(["call_id >= :lo"] if lo is not None else []),
                          *(["call_id < :hi"] if hi is not None else [])])
    bounds = {"lo": lo, "hi": hi}
    log_end = conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
    events: Iterable[tuple[Any, ...]] = conn.execute(
        f"SELECT {_T_EVENT_COLUMNS} FROM events AS i JOIN events AS t ON t.seq = i.seq "
        f"WHERE {where.replace('call_id', 'i.call_id')} AND t.call_id IS i.call_id ORDER BY i.call_id, i.seq", bounds
    )
    if part == 0:
        if conn.execute("SELECT 1 FROM calls WHERE call_id IS NULL LIMIT 1").fetchone() is not None:
            return False  # a row without a call id: the log cannot have produced it
        callless = conn.execute(f"SELECT {_T_EVENT_COLUMNS} FROM events AS i JOIN events AS t ON t.seq = i.seq "
                                "WHERE i.call_id IS NULL AND t.call_id IS NULL ORDER BY i.seq")
        events = itertools.chain(callless, events)
    # The projection read through its index on call id, the id from each entry and the rest from its
    # row: an entry altered to name another call gives a row that the fold of no call matches, and
    # a row the index lacks is not read (the fold then lacks it, or the index's count is short).
    rows = conn.execute(f"SELECT i.call_id, {_T_OTHER_CALL_COLUMNS} FROM calls AS i INDEXED BY "
                        f"{indexes.CALLS_BY_ID} CROSS JOIN calls AS t ON t.rowid = i.rowid "
                        f"WHERE {where.replace('call_id', 'i.call_id')} ORDER BY i.call_id", bounds)
    return verifying.projection_problem(verifying.checked_calls(events), rows, log_end) is None


def check_part(path: str | os.PathLike[str], part: int, parts: int, head: int) -> bool:
    """Check one part of the journal at ``path`` whose head was ``head`` (a snapshot of its own:
    events are only ever appended, so events up to ``head`` are the same in any later snapshot)."""
    conn = sqlite3.connect(schema.reader_uri(Path(path)), uri=True, isolation_level=None)
    try:
        conn.execute("BEGIN")  # the projection and the log it is compared with, at one moment
        lo, hi = _range(part, parts, head)
        if not _links_ok(conn, lo, hi):
            return False
        if part == parts - 1:  # the events after head, in this snapshot: each has its entry too
            if unindexed(conn, head + 1, 1 << 62) is not None:
                return False
            events = head + conn.execute("SELECT count(*) FROM events WHERE seq > ?", (head,)).fetchone()[0]
        else:
            events = None
        if indexes.problem(conn, part, parts, calls_read=True, diagnose=False, events=events) is not None:
            return False
        return _calls_ok(conn, part, parts, head)
    except (sqlite3.Error, ValueError, TypeError, AttributeError):
        return False  # a stored field that cannot be read, or ids out of order: the one-pass check names it
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.close()


def start_part(path: Path, part: int, parts: int, head: int) -> subprocess.Popen[bytes] | None:
    """Start a child checking one part; None when no child can be started (the caller does it),
    or when this interpreter is not a ``python`` program (embedded in another one, say)."""
    if not os.path.basename(sys.executable or "").lower().startswith(("python", "pypy")):
        return None
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "journal.sqlite.verify", str(path), str(part), str(parts), str(head)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env,
        )
    except OSError:
        return None


def child_said_ok(child: subprocess.Popen[bytes], timeout: float) -> bool | None:
    """What a child said: True or False; None when it said nothing readable within ``timeout``
    seconds (it failed, or hangs: it is then killed)."""
    try:
        out, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return None
    if child.returncode != 0:
        return None
    try:
        said = orjson.loads(out)
    except orjson.JSONDecodeError:
        return None
    return said.get("ok") if isinstance(said, dict) and isinstance(said.get("ok"), bool) else None


def main(argv: list[str]) -> int:
    try:
        path, part, parts, head = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
        if len(argv) != 4 or not 0 <= part < parts:
            raise ValueError
    except (IndexError, ValueError):
        sys.stderr.write("usage: python -m journal.sqlite.verify PATH PART PARTS HEAD\n")
        return 2
    sys.stdout.buffer.write(orjson.dumps({"ok": check_part(path, part, parts, head)}) + b"\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
