"""Checking a SQLite journal against its own log, and rebuilding its projection."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from guard.approvals import approval_event
from guard.store import CallRecord, EffectEvent

from .. import approvals
from ..chain import GENESIS
from ..errors import JournalDamaged, JournalError
from ..events import JournalEvent, VerifyReport
from ..projection import fold_into
from ..rebuilding import ByCall, changes, checked_row
from ..rows import call_row, event_row
from . import indexes, schema
from . import verify as sqlite_verify
from .archives import archived_head, seeds
from .datastore import FULL, SQLiteDatastore
from .sql import _CALL_COLUMNS, _INSERT_EVENT, _SELECT_HEAD, _UPSERT_CALL


class _UnreadableRow(Exception):
    """A projection row read for a rebuild holds a text that is not UTF-8."""


def _readable(rows: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    """The projection ``rows`` a rebuild compares with the fold; :class:`_UnreadableRow` when one
    holds a text that is not UTF-8.

    A plain loop, not ``yield from``: closing this generator (an interrupted rebuild, after the
    connection was closed) would otherwise close the cursor too, which then raises on the closed
    connection and is printed as an exception ignored."""
    try:
        for row in rows:  # noqa: UP028
            yield row
    except sqlite3.OperationalError as e:
        if "Could not decode to UTF-8" in str(e):
            raise _UnreadableRow from e
        raise


class Checker:
    """The checks of a SQLite journal on ``datastore``: verify (in parts, on several cores, for a
    large journal), rebuild, and the import of a copied log (checked before it commits)."""

    def __init__(self, datastore: SQLiteDatastore) -> None:
        self._datastore = datastore
        self._retry = datastore.retry
        self._write = datastore.write
        self._decoded = datastore.decoded

    def verify(self, *, parts: int | None = None, advance: Callable[[int], None] | None = None) -> VerifyReport:
        """Recompute the hash chain from the stored fields, check that ``seq`` is gapless from 1,
        check every index of the file against its table, and compare the projection with the fold
        of the log, on one consistent snapshot.

        A journal of :data:`~journal.sqlite.verify.PARALLEL_FROM` events or more is checked in
        ``parts`` (default: one a core, at most 4) by child processes at once; when a part finds a
        problem, or a child cannot run, it is checked again in one pass, which names the first bad
        event. ``parts=1`` always checks in one pass. ``advance`` is told of each stretch of events
        checked (a progress bar's update).
        """
        if parts is not None and (isinstance(parts, bool) or not isinstance(parts, int) or parts < 1):
            raise ValueError(f"parts is a number, 1 or more, not {parts!r}")
        snapshot = self._datastore.open_reader()
        try:
            head = self._retry(snapshot, lambda: snapshot.execute(_SELECT_HEAD).fetchone())
            if head is not None:
                n = parts if parts is not None else (
                    min(os.cpu_count() or 1, 4) if head[0] >= sqlite_verify.PARALLEL_FROM else 1
                )
                if n > 1 and self._retry(snapshot, lambda: archived_head(snapshot))[0]:
                    n = 1  # the parts check a log that starts at seq 1; an archived one is checked in one pass
                if n > 1 and self._verified_in_parts(int(head[0]), n, advance):
                    parts_ok = VerifyReport(ok=True, events=int(head[0]), head=str(head[1]), first_bad_seq=None,
                                            problem=None)
                    return self._undamaged(snapshot, self._retry(snapshot, lambda: self._requests_checked(
                        snapshot, parts_ok)))
            try:
                report = self._retry(snapshot, lambda: self._verify(snapshot, advance))
            except JournalDamaged as e:
                # SQLite could not read a page the pass needed (an index, read by call id), or an
                # index differs from its table in a file whose pages are damaged: the file is marked,
                # and SQLite's own check says what it finds. A text that is not UTF-8 is no damage
                # of SQLite's pages: its own message names it.
                index = indexes.damaged_index(e)
                if index is None:
                    found = self._retry(snapshot, lambda: snapshot.execute("PRAGMA quick_check").fetchall())
                    if found == [("ok",)]:
                        raise
                    problem = f"SQLite finds the file damaged: {indexes.first_finding(found)}"
                else:  # named, and what to do: not REINDEX (see journal.sqlite.indexes)
                    pages = index.pages or self._retry(snapshot, lambda: indexes.quick_check(snapshot))
                    problem = (f"SQLite finds the file damaged: {pages}; " if pages else "") + (
                        f"{index.index.said(index.what)}: {indexes.RESTORE}")
                return VerifyReport(ok=False, events=0, head=str(head[1]) if head is not None else GENESIS,
                                    first_bad_seq=None, problem=problem)
            return self._undamaged(snapshot, report)
        finally:
            with contextlib.suppress(sqlite3.Error):
                snapshot.close()

    def _undamaged(self, snapshot: sqlite3.Connection, report: VerifyReport) -> VerifyReport:
        """``report``, for a journal marked damaged checked whole by SQLite too: the mark is taken
        away (writes are taken again) only when its pages, indexes included, are sound."""
        if not report.ok or self._datastore.damage_found() is None:
            return report
        found = self._retry(snapshot, lambda: snapshot.execute("PRAGMA quick_check").fetchall())
        if found != [("ok",)]:
            return VerifyReport(ok=False, events=report.events, head=report.head, first_bad_seq=None,
                                problem=f"SQLite finds the file damaged: {found[0][0]}")
        self._datastore.clear_damage()
        return report

    def _verified_in_parts(self, head: int, parts: int, advance: Callable[[int], None] | None = None) -> bool:
        """True when every part of the events up to ``head`` checks out (part 0 in this process)."""
        children = [sqlite_verify.start_part(self._datastore.file, part, parts, head) for part in range(1, parts)]
        try:
            started = time.monotonic()
            if None in children or not sqlite_verify.check_part(self._datastore.file, 0, parts, head):
                return False
            if advance is not None:
                advance(head // parts)
            # The parts are of one size: a child far slower than this process's part is stuck.
            patience = sqlite_verify.PATIENCE + 3 * (time.monotonic() - started)
            for child in children:
                if child is None or sqlite_verify.child_said_ok(child, patience) is not True:
                    return False
                if advance is not None:
                    advance(head // parts)
            return True
        finally:
            for child in children:
                if child is not None and child.poll() is None:
                    child.kill()
                    child.wait()

    def _verify(self, conn: sqlite3.Connection, advance: Callable[[int], None] | None = None) -> VerifyReport:
        conn.execute("BEGIN")  # one read transaction: a snapshot that concurrent writers do not move
        try:
            return self.verified_log(conn, advance)
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")

    def verified_log(self, conn: sqlite3.Connection, advance: Callable[[int], None] | None = None) -> VerifyReport:
        """The report of :meth:`verify`, in one pass over what ``conn`` sees (in a transaction of
        the caller's: a read snapshot, or a write not yet committed), one event and one call at a time."""
        report = sqlite_verify.verify_snapshot(conn, advance)
        return approvals.checked(conn, "?", report) if schema.has_approvals(conn) else report

    @staticmethod
    def _requests_checked(conn: sqlite3.Connection, report: VerifyReport) -> VerifyReport:
        """``report``, with the approvals projection checked against the log in a snapshot of its own."""
        conn.execute("BEGIN")
        try:
            return approvals.checked(conn, "?", report) if schema.has_approvals(conn) else report
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")

    def rebuild(self, *, advance: Callable[[int], None] | None = None) -> int:
        """Rebuild the projection from the log through the fold, in one transaction; returns the
        number of calls. ``advance`` is told of each stretch of events folded."""

        def step(conn: sqlite3.Connection) -> int:
            calls = calls_rebuilt(conn)
            approvals.rebuild(conn, "?")  # the requests, folded from the log as the calls are
            return calls

        def calls_rebuilt(conn: sqlite3.Connection) -> int:
            self._remake_indexes(conn)
            return self._rebuilt_by_call(conn, advance)

        return self._write(self._datastore.durable_sync, step)

    @staticmethod
    def _remake_indexes(conn: sqlite3.Connection) -> None:
        """Make again, in the write transaction on ``conn``, each index whose entries are not its
        table's rows (:func:`journal.sqlite.indexes.mismatched`): the log is read through the one on
        call id, and the guard's lookups through the others. Only in a file whose pages SQLite's
        quick check finds sound: in one it finds damaged, the index's pages may point into other
        tables', which REINDEX would free, and :class:`~journal.sqlite.indexes.DamagedIndex` (a
        malformed file, for which rebuild is refused) is raised instead."""
        first = archived_head(conn)[0] + 1
        last = conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
        for index in indexes.mismatched(conn, first, last):
            conn.execute(f'REINDEX "{index.name}"')

    def _rebuilt_by_call(self, conn: sqlite3.Connection, advance: Callable[[int], None] | None) -> int:
        """The projection made the fold of the log, in the write transaction on ``conn``, holding
        one call at a time: the events that change a record are read by call id and folded on
        their stored texts (as verify folds them; onto the projection as of the start of the log,
        in a journal with archives), beside the projection rows read in the same order; only the
        rows that differ are written (through a temporary table, as
        the projection is being read), so a sound projection is left as it is. A field of a row the
        fold makes that cannot be read stops the rebuild with the journal's error, the projection as
        it was; a projection row that cannot be read (a text that is not UTF-8) has every row
        replaced by the fold."""
        events = conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
        start = archived_head(conn)[0]
        _remove_rows_without_id(conn)
        conn.execute("DROP TABLE IF EXISTS temp.airlock_rebuilt")
        conn.execute(f"CREATE TEMP TABLE airlock_rebuilt AS SELECT {_CALL_COLUMNS}, 0 AS gone FROM calls WHERE 0")
        by_call = conn.execute(sqlite_verify.BY_CALL)
        stored = conn.execute(f"SELECT {_CALL_COLUMNS} FROM calls ORDER BY call_id")
        folding = ByCall(by_call, advance, seeds(conn, start) if start else None)
        try:
            conn.executemany(
                f"INSERT INTO temp.airlock_rebuilt VALUES ({', '.join('?' * 17)})",
                ((*row, 0) if row is not None else (call_id, *([None] * 15), 1)
                 for call_id, row in changes(folding.records(), _readable(stored), self._decoded)),
            )
        except _UnreadableRow:
            # A row holds a text that is not UTF-8 (its bytes overwritten): it cannot be compared,
            # so every row is replaced by the fold, as a rebuild did before it compared rows.
            by_call.close()
            stored.close()
            conn.execute("DROP TABLE temp.airlock_rebuilt")
            kept = list(seeds(conn, start)) if start else None  # read before the rows go
            conn.execute("DELETE FROM calls")
            again = ByCall(conn.execute(sqlite_verify.BY_CALL), None, kept)
            conn.executemany(_UPSERT_CALL, (self._decoded(checked_row, r) for r in again.records()))
            folding.done(events)
            return again.calls
        conn.execute("DELETE FROM calls WHERE call_id IN (SELECT call_id FROM temp.airlock_rebuilt WHERE gone)")
        conn.execute(f"INSERT INTO calls ({_CALL_COLUMNS}) SELECT {_CALL_COLUMNS} FROM temp.airlock_rebuilt "
                     f"WHERE NOT gone {_UPSERT_CALL[_UPSERT_CALL.index('ON CONFLICT'):]}")
        conn.execute("DROP TABLE temp.airlock_rebuilt")
        folding.done(events)
        return folding.calls

    def import_events(self, events: Iterable[JournalEvent],
                      check: Callable[[VerifyReport], None] | None = None) -> int:
        """See :meth:`journal.protocol.EventImporter.import_events` (used by :mod:`journal.copy`)."""
        folded: dict[str, CallRecord] = {}
        requests: list[tuple[int, EffectEvent]] = []  # the events that may change a request

        def folding() -> Iterator[tuple[Any, ...]]:
            for event in events:
                fold_into(folded, event)
                if event.kind in approvals.MAY_CHANGE_KINDS and approval_event(effect := event.to_effect_event()):
                    requests.append((event.seq, effect))
                yield event_row(event)

        def step(conn: sqlite3.Connection) -> int:
            if conn.execute("SELECT EXISTS (SELECT 1 FROM events)").fetchone()[0]:
                raise JournalError(f"the destination {self._datastore.path} is not empty; copy only into a new journal")
            conn.executemany(_INSERT_EVENT, folding())
            conn.execute("DELETE FROM calls")
            conn.executemany(_UPSERT_CALL, (call_row(r) for r in folded.values()))
            approvals.import_fold(conn, "?", requests)
            calls = len(folded)
            folded.clear()  # the check folds the log again: one fold in memory at a time
            if check is not None:
                check(self.verified_log(conn))  # raises to refuse the copy: the transaction is undone
            return calls

        return self._write(FULL, step)


def _remove_rows_without_id(conn: sqlite3.Connection) -> None:
    """Take away the projection rows without a call id: no log makes one. The archive's
    copy-on-write triggers would keep a copy of such a row from before the log's start, under no
    id, which its table refuses; so they are set aside for the delete, in its transaction."""
    if conn.execute("SELECT 1 FROM calls WHERE call_id IS NULL LIMIT 1").fetchone() is None:
        return
    triggers = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'calls' "
                            "AND name LIKE 'calls_keep_archived_on_%'").fetchall()
    for name, _ in triggers:
        conn.execute(f'DROP TRIGGER "{name}"')
    conn.execute("DELETE FROM calls WHERE call_id IS NULL")
    for _, sql in triggers:
        conn.execute(sql)
