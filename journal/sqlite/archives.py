"""Archiving a SQLite journal: its statements, the projection as of the start of its log kept
copy-on-write (see :mod:`journal.sqlite.archive_schema`), and the part of the journal that
archives (:class:`Archiver`). What archiving is, and what both stores share of it, is
:mod:`journal.archive`; what runs an archive, :mod:`journal.archive_run`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

from guard.store import CallRecord

from .. import approvals, verifying
from ..archive import (
    ArchivePlan,
    ArchiveRecord,
    StartMoved,
    fold_onto,
    kept_row,
    last_seq_of,
    stored_copy,
)
from ..chain import GENESIS
from ..errors import JournalError
from ..events import VerifyReport
from ..projection import FOLD_COLUMNS, folded_onto, record_row
from ..rows import CALL_COLUMNS, CHANGING_KINDS, EVENT_COLUMNS
from .archive_schema import record_of
from .datastore import FULL, NORMAL, SQLiteDatastore
from .schema import NO_DELETE_TRIGGER, has_approvals, reader_uri
from .sql import _INSERT_EVENT, _UPSERT_CALL

__all__ = ["Archiver", "archived_head", "archived_record", "commit", "seeds", "unfinished"]

_EVENTS = ", ".join(EVENT_COLUMNS)
_CALLS = ", ".join(CALL_COLUMNS)
_UPSERT = ("INSERT INTO calls_archived (call_id, record) VALUES (?, ?) "
           "ON CONFLICT (call_id) DO UPDATE SET record = excluded.record")

_ARCHIVES = ("SELECT last_seq, last_hash, upto_seq, upto_hash, events, archived_at, file FROM archives "
             "ORDER BY last_seq")
# Version 6 records no upto_seq: an archive there is finished when recorded.
_ARCHIVES_V6 = "SELECT last_seq, last_hash, NULL, NULL, events, archived_at, file FROM archives ORDER BY last_seq"

_CURRENT = ", ".join(f"c.{c}" for c in CALL_COLUMNS)
# The calls a step's events touch, with where their row is now.
_TOUCHED = ("SELECT c.call_id, c.last_seq FROM calls c WHERE c.call_id IN "
            "(SELECT DISTINCT call_id FROM events WHERE seq > ? AND seq <= ? AND call_id IS NOT NULL)")
_STEP_EVENTS = f"SELECT {_EVENTS} FROM events WHERE seq > ? AND seq <= ? ORDER BY seq"
_KEPT = "SELECT record FROM calls_archived WHERE call_id = ?"
_LET_GO = "DELETE FROM calls_archived WHERE call_id = ?"
# Copies equal to the call's row of today, the row not moved since the start: the row is the copy
# (a rebuild, which rewrites every row, leaves one for every call).
_TRIM = ("DELETE FROM calls_archived WHERE call_id IN (SELECT c.call_id FROM calls c JOIN calls_archived a "
         f"ON a.call_id = c.call_id WHERE c.last_seq <= ? AND a.record = {record_of('c')})")


def archived_head(conn: sqlite3.Connection) -> tuple[int, str]:
    """Where the log of a SQLite journal starts now: the seq and hash of the last event removed
    (an archive stopped half-way included); ``(0, GENESIS)`` without one (or without the table, in
    a journal of an older version read as it is)."""
    try:
        row = conn.execute("SELECT last_seq, last_hash FROM archives ORDER BY last_seq DESC LIMIT 1").fetchone()
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):
            return 0, GENESIS
        raise
    return (0, GENESIS) if row is None else (int(row[0]), str(row[1]))


def unfinished(conn: sqlite3.Connection) -> tuple[ArchivePlan, str] | None:
    """The rest of an archive whose removal of events was stopped half-way (its file written whole
    before it began), with that file; None when there is none (or the journal is of a version
    before archives were removed in steps)."""
    try:
        row = conn.execute("SELECT last_seq, last_hash, upto_seq, upto_hash, file, events FROM archives "
                           "ORDER BY last_seq DESC LIMIT 1").fetchone()
    except sqlite3.OperationalError as e:
        if "no such table" in str(e) or "no such column" in str(e):
            return None
        raise
    if row is None or row[2] is None or row[2] <= row[0]:
        return None
    start = int(row[0]) - int(row[5])  # where the archive began: it has removed ``events`` so far
    whole = ArchivePlan(start, "", int(row[2]), str(row[3]))
    return ArchivePlan(int(row[0]), str(row[1]), int(row[2]), str(row[3]), whole), str(row[4])


def archived_record(conn: sqlite3.Connection, call_id: str) -> CallRecord | None:
    """The record of ``call_id`` as of the start of the log: its kept copy in calls_archived, else
    its row in calls when that row is from before the start (nothing moved it since), else None
    (a later call, or no archive)."""
    start = archived_head(conn)[0]
    if not start:
        return None
    row = conn.execute(_KEPT, (call_id,)).fetchone()
    if row is not None:
        return CallRecord(*kept_row(call_id, row[0]))
    current = conn.execute(f"SELECT {_CURRENT} FROM calls c WHERE c.call_id = ? AND c.last_seq <= ?",
                           (call_id, start)).fetchone()
    return None if current is None else CallRecord(*current)


def commit(conn: sqlite3.Connection, plan: ArchivePlan, file: str, archived_at: str) -> int:
    """Inside the SQLite journal's write transaction: remove the events ``plan`` moves (a whole
    archive, or one step of it), keep the projection as of its last event, and record where the
    log now starts; returns how many events were removed.

    The first step of an archive records it (its file, and how far the file goes); each later one
    must follow the step before. The delete trigger is dropped, the events deleted and the trigger
    made again, all in this transaction: no other writer ever sees the log without it. Raises
    :class:`JournalError`, the transaction then undone, when the log is no longer the one planned from.
    """
    whole = plan.archive
    base = archived_head(conn)
    if base != (plan.base_seq, plan.base_hash):
        raise StartMoved(f"another archive moved the start of the log to seq {base[0]} meanwhile; archive again")
    head = conn.execute("SELECT max(seq) FROM events").fetchone()[0] or 0
    for seq, digest in {(plan.last_seq, plan.last_hash), (whole.last_seq, whole.last_hash)}:
        found = conn.execute("SELECT hash FROM events WHERE seq = ?", (seq,)).fetchone()
        if seq >= head or found is None or found[0] != digest:
            raise JournalError(f"event seq {seq} is no longer the one archived; run verify")
    first = plan.base_seq == whole.base_seq
    if first:
        stopped = unfinished(conn)
        if stopped is not None:
            raise JournalError(f"the archive to {stopped[1]} was stopped before the journal let go of all its "
                               "events; archive again to finish it first")
        conn.execute(_TRIM, (plan.base_seq,))
    else:
        going = conn.execute("SELECT upto_seq, upto_hash, file FROM archives WHERE last_seq = ?",
                             (plan.base_seq,)).fetchone()
        if going is None or tuple(going) != (whole.last_seq, whole.last_hash, file):
            raise JournalError(f"the log starts at seq {plan.base_seq + 1}, but no archive to {file} of seq "
                               f"{whole.base_seq + 1} to {whole.last_seq} is under way there; archive again")
    _keep_as_of(conn, plan.base_seq, plan.last_seq)
    approvals.keep_as_of(conn, "?", plan.base_seq, plan.last_seq)
    conn.execute("DROP TRIGGER events_no_delete")
    removed = conn.execute("DELETE FROM events WHERE seq <= ?", (plan.last_seq,)).rowcount
    conn.execute(NO_DELETE_TRIGGER)
    if removed != plan.events:
        raise JournalError(f"the log held {removed} events up to seq {plan.last_seq}, not {plan.events}; run verify")
    if first:
        conn.execute("INSERT INTO archives (last_seq, last_hash, events, archived_at, file, upto_seq, upto_hash) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (plan.last_seq, plan.last_hash, removed, archived_at, file, whole.last_seq, whole.last_hash))
    else:
        conn.execute("UPDATE archives SET last_seq = ?, last_hash = ?, events = events + ? WHERE last_seq = ?",
                     (plan.last_seq, plan.last_hash, removed, plan.base_seq))
    return int(removed)


def _keep_as_of(conn: sqlite3.Connection, base_seq: int, last_seq: int) -> None:
    """Move the kept projection from seq ``base_seq`` to seq ``last_seq``, before the events
    between are removed: a call those events touch whose row is now from ``last_seq`` or before
    needs no copy any more; one whose row moved past it gets its row as of ``last_seq``, folded
    from its copy (or from nothing: a call begun after ``base_seq``) and its events up to there."""
    moved: list[str] = []
    for call_id, row_seq in conn.execute(_TOUCHED, (base_seq, last_seq)).fetchall():
        if row_seq > last_seq:
            moved.append(call_id)
        elif row_seq > base_seq:
            conn.execute(_LET_GO, (call_id,))
    if not moved:
        return
    kept = []
    for call_id in moved:
        found = conn.execute(_KEPT, (call_id,)).fetchone()
        if found is not None:
            kept.append(kept_row(call_id, found[0]))
    wanted = set(moved)
    events = (row for row in conn.execute(_STEP_EVENTS, (base_seq, last_seq)) if row[2] in wanted)
    conn.executemany(_UPSERT, [stored_copy(row) for row in fold_onto(kept, list(events))])


# The projection as of the start of the log, in call id order: each kept copy, and each row
# from before the start that has none (nothing moved it since). A row of call_id, the kept
# record (NULL for a row of its own), and the rest of the row's columns.
# The placeholders of the first SELECT are named as the columns, since a message about a row
# that cannot be read names its column by them. A row without a call id is left to rebuild to
# take away: no log makes one, and the fold has no place for it.
_SEEDS = (f"SELECT call_id, record, {', '.join(f'NULL AS {c}' for c in CALL_COLUMNS[1:])} FROM calls_archived "
          f"UNION ALL SELECT c.call_id, NULL, {', '.join(f'c.{c}' for c in CALL_COLUMNS[1:])} FROM calls c "
          "WHERE c.last_seq <= ? AND c.call_id IS NOT NULL "
          "AND NOT EXISTS (SELECT 1 FROM calls_archived a WHERE a.call_id = c.call_id) "
          "ORDER BY 1")


def seeds(conn: sqlite3.Connection, start: int) -> Iterator[tuple[Any, ...]]:
    """The projection rows as of the start of the log (seq ``start``), in call id order: what
    :func:`journal.projection.folded_onto` folds the rest of the log onto."""
    for row in conn.execute(_SEEDS, (start,)):
        yield kept_row(row[0], row[1]) if row[1] is not None else (row[0], *row[2:])


# The log by call id, in SQLite's external sort (which spills to temporary files past its cache):
# read through the index on call id, each event would be fetched from a page of its own.
_BY_CALL_SORTED = (f"SELECT {', '.join(FOLD_COLUMNS)} FROM events NOT INDEXED WHERE call_id IS NOT NULL "
                   f"AND kind IN {CHANGING_KINDS} ORDER BY call_id, seq")


def _archive_rows(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
    for sql in (_ARCHIVES, _ARCHIVES_V6):
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return []  # a journal of a version before archives, read as it is
            if "no such column" not in str(e):
                raise
    return []


_TABLES_FIRST = ("calls", "calls_archived", "approvals", "approvals_archived", "archives")


class Archiver:
    """The part of a SQLite journal that archives: where its log starts, the transactions that
    remove archived events (in steps), the reads of what the archives kept, the check before an
    archive (in bounded memory) and the copy of an archived journal into this one.
    ``verified``: the journal's verify of what a connection sees in its transaction."""

    def __init__(self, datastore: SQLiteDatastore,
                 verified: Callable[[sqlite3.Connection], VerifyReport]) -> None:
        self._datastore = datastore
        self._verified = verified
        self._write = datastore.write
        self._read = datastore.read

    def archived_head(self) -> tuple[int, str]:
        """The seq and hash of the last archived event, where the log now starts; ``(0, GENESIS)``
        when nothing was archived."""
        return self._read(archived_head)

    def commit_archive(self, plan: ArchivePlan, file: str, archived_at: str) -> int:
        """Remove the events ``plan`` moves, once they are in the archive ``file``, in one write
        transaction that also records the archive's head; returns how many were removed."""
        return self._write(self._datastore.durable_sync, lambda conn: commit(conn, plan, file, archived_at))

    def reclaim_space(self, pages: int = 256) -> int:
        """Give the file's free pages back to the file system, ``pages`` at a time, each step a
        short write transaction of its own (guarded calls wait at most one step); returns the pages
        given back. Only a journal made with ``auto_vacuum`` incremental can (every new one is); an
        older file gives nothing back here, and needs a ``VACUUM`` (see docs/journal.md)."""
        mode, free = self._read(lambda c: (c.execute("PRAGMA auto_vacuum").fetchone()[0],
                                           c.execute("PRAGMA freelist_count").fetchone()[0]))
        if mode != 2:
            return 0
        step = f"PRAGMA incremental_vacuum({max(1, int(pages))})"
        left = free
        while left:
            left = self._write(NORMAL, lambda c: (c.execute(step).fetchall(),
                                                  c.execute("PRAGMA freelist_count").fetchone()[0])[1])
        self._read(lambda c: c.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall())  # the file shrinks here
        return int(free)

    # -- what the archives kept (see journal.archive.ArchiveReading) ------------------------------

    def archive_rows(self) -> list[tuple[Any, ...]]:
        """Every archive recorded, oldest first: ``last_seq, last_hash, upto_seq, upto_hash, events,
        archived_at, file`` (``upto_*`` NULL in a journal of version 6)."""
        return self._read(_archive_rows)

    def archived_call_last_seq(self, call_id: str) -> int | None:
        """The ``seq`` of the last archived event of ``call_id``; None when none of its events is."""

        def read(conn: sqlite3.Connection) -> int | None:
            start = archived_head(conn)[0]
            if not start:
                return None
            kept = conn.execute(_KEPT, (call_id,)).fetchone()
            if kept is not None:
                return last_seq_of(kept[0])
            row = conn.execute("SELECT last_seq FROM calls WHERE call_id = ?", (call_id,)).fetchone()
            return int(row[0]) if row is not None and isinstance(row[0], int) and row[0] <= start else None

        return self._read(read)

    def archived_projection(self) -> dict[str, tuple[Any, ...]]:
        """The projection as of the start of the log, by call id; empty without an archive.

        A call's row is its copy in calls_archived, else its row in calls when that row is not past
        the start. The rows are read before the copies, so that a row a writer moves meanwhile is
        found as its copy (which the trigger takes as it moves)."""

        def read(conn: sqlite3.Connection) -> dict[str, tuple[Any, ...]]:
            start = archived_head(conn)[0]
            if not start:
                return {}
            rows = {row[0]: tuple(row) for row in conn.execute(
                f"SELECT {_CALLS} FROM calls WHERE last_seq <= ?", (start,))}
            for call_id, record in conn.execute("SELECT call_id, record FROM calls_archived"):
                rows[call_id] = kept_row(call_id, record)
            return rows

        return self._read(read)

    def archived_requests(self) -> list[tuple[str, str]]:
        """The requests for approval as of the start of the log (``request_id`` and the request as
        stored); none without an archive, or in a journal from before approvals."""

        def read(conn: sqlite3.Connection) -> list[tuple[str, str]]:
            try:
                return [(str(r), str(q)) for r, q in conn.execute(
                    "SELECT request_id, request FROM approvals_archived ORDER BY request_id")]
            except sqlite3.OperationalError as e:
                if "no such table" in str(e):
                    return []
                raise

        return self._read(read)

    # -- archives removed in steps (see journal.archive.SteppedArchiveStore) ------------------------

    def _reader(self) -> sqlite3.Connection:
        """A read-only connection of its own to the file."""
        return sqlite3.connect(reader_uri(self._datastore.file), uri=True, timeout=30.0)

    def unfinished_archive(self) -> tuple[ArchivePlan, str] | None:
        """The rest of an archive stopped before it let go of all its events, and its file; None
        when there is none."""
        conn = self._reader()
        try:
            return unfinished(conn)
        finally:
            conn.close()

    def check_archive(self) -> VerifyReport:
        """What ``verify`` reports, read in bounded memory whatever the journal's size: the log in
        ``seq`` order for the chain, then the log by call id folded onto the projection as of its
        start, beside the projection (:func:`journal.verifying.projection_problem`)."""
        conn = self._reader()
        try:
            conn.execute("BEGIN")  # one snapshot for both passes
            start = archived_head(conn)
            chain = verifying.check_chain(conn.execute(f"SELECT {_EVENTS} FROM events ORDER BY seq"), start=start)
            if not chain.ok:
                return chain.report()
            records = folded_onto(seeds(conn, start[0]), conn.execute(_BY_CALL_SORTED))
            rows = conn.execute(f"SELECT {_CALLS} FROM calls ORDER BY call_id")
            problem = verifying.projection_problem(records, rows, chain.last_seq)
            if problem is not None:
                chain.fail(*problem)
            report = chain.report()
            return approvals.checked(conn, "?", report) if has_approvals(conn) else report
        except sqlite3.Error as e:
            raise JournalError(f"the journal could not be read to check it: {e}") from e
        finally:
            conn.close()

    # -- an archived journal copied in (see journal.copy) -----------------------------------------

    def import_archived(self, records: list[ArchiveRecord], snapshot: dict[str, tuple[Any, ...]],
                        touched: dict[str, tuple[Any, ...]], requests: list[tuple[str, str]],
                        rows: Iterator[tuple[Any, ...]], folded: dict[str, CallRecord],
                        check: Callable[[VerifyReport], None]) -> int:
        """The copy of an archived journal into this empty one, in one transaction: its archives'
        ``records``, the events ``rows`` (stored rows after its archived head), the projection
        ``folded`` (their fold onto ``snapshot``, the projection as of that head) and the requests
        kept as of it; ``check`` is given the verify report before the commit and raises to
        refuse it. The projection as of the archived head is kept copy-on-write, as an archive
        keeps it: a copy in calls_archived of each call the rest of the log moves (``touched``),
        every other call's row its own. Returns the number of calls."""
        label = self._datastore.label()

        def step(conn: sqlite3.Connection) -> int:
            if conn.execute("SELECT EXISTS (SELECT 1 FROM events)").fetchone()[0]:
                raise JournalError(f"the destination {label} is not empty; copy only into a new journal")
            for table in _TABLES_FIRST:  # rows left with no log (calls first: no archive yet, no copy taken)
                conn.execute(f"DELETE FROM {table}")
            conn.executemany(
                "INSERT INTO archives (last_seq, last_hash, events, archived_at, file, upto_seq, upto_hash) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(a.last_seq, a.last_hash, a.events, a.archived_at, a.file, a.upto_seq, a.upto_hash)
                 for a in records])
            conn.executemany(_INSERT_EVENT, rows)
            conn.executemany("INSERT INTO calls_archived (call_id, record) VALUES (?, ?)",
                             [stored_copy(row) for row in touched.values()])
            conn.executemany(_UPSERT_CALL, (record_row(record) for record in folded.values()))
            conn.executemany("INSERT INTO approvals_archived (request_id, request) VALUES (?, ?)", requests)
            approvals.rebuild(conn, "?")
            calls = len(folded)
            folded.clear()  # the check folds the log again: one fold in memory at a time
            snapshot.clear()
            check(self._verified(conn))  # raises to refuse: undone
            return calls

        return self._write(FULL, step)
