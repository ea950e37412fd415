"""Checking a PostgreSQL journal against its log, rebuilding its projection, and importing a copied log."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from guard.approvals import approval_event
from guard.store import CallRecord, EffectEvent

from .. import approvals, verifying
from ..archive import kept_row
from ..chain import ChainCheck
from ..errors import JournalError
from ..events import JournalEvent, VerifyReport
from ..projection import fold_calls, fold_into, folded_onto
from ..rebuilding import ByCall, changes
from ..rows import (
    EVENT_COLUMNS,
    call_row,
    event_row,
)
from .archiving import SNAPSHOT_BY_CALL, archived_head
from .datastore import Conn, PostgresDatastore
from .sealing import SealingReads, hold_log
from .sql import _BATCH, _BY_CALL, _BY_CALL_WITH_INBOX, _CALL_SELECT, _EVENT_SELECT, _LOCK_HEAD, _SET_HEAD, _UPSERT_CALL

__all__ = ["Checker"]

_COPY_EVENTS = f"COPY events ({', '.join(EVENT_COLUMNS)}) FROM STDIN".encode()


def _streamed(conn: Conn, name: str, sql: str) -> Iterator[tuple[Any, ...]]:
    """The rows of ``sql`` through a server-side cursor named ``name``: a batch at a time, never
    whole in this process's memory; it sees the transaction as it was when it opened."""
    with conn.cursor(name=name) as cur:
        cur.itersize = _BATCH
        cur.execute(sql.encode())
        yield from cur


def _seeds(conn: Conn) -> Iterator[tuple[Any, ...]]:
    """The projection as of the last archive's head, by call id, a batch at a time."""
    for call_id, record in _streamed(conn, "airlock_archived_calls", SNAPSHOT_BY_CALL):
        yield kept_row(call_id, record)


class Checker:
    """Verify, rebuild and import."""

    def __init__(self, datastore: PostgresDatastore | SealingReads) -> None:
        self.name = datastore.name
        self._datastore = datastore

    def verify(self, *, advance: Callable[[int], None] | None = None) -> VerifyReport:
        """Recompute the hash chain and check the projection and the head against the log, on one
        consistent snapshot (writers carry on meanwhile). ``advance`` is told of each stretch of
        events checked (a progress bar's update)."""
        return self._datastore.read_only("verify the journal", lambda conn: self.verify_in(conn, advance))

    def verify_in(self, conn: Conn, advance: Callable[[int], None] | None = None) -> VerifyReport:
        """:meth:`verify`, in the transaction of ``conn`` (a copy checks what it wrote before it commits)."""
        # The log goes on from the last archive's head, folded onto the projection as of that head.
        # Server-side cursors: the log and the projection come in batches, never whole into memory.
        streamed = functools.partial(_streamed, conn)
        # Ids in binary order (COLLATE "C"), the order the log read by call id is merged in.
        calls = functools.partial(streamed, "airlock_verify_calls", f'{_CALL_SELECT} ORDER BY call_id COLLATE "C"')
        start = archived_head(conn)

        def head_row(check: ChainCheck) -> tuple[int | None, str] | None:
            """What is wrong with the chain head row, against the log that checked out."""
            head = conn.execute(b"SELECT seq, hash FROM chain_head WHERE id = 1").fetchone()
            log_end, last = check.last_seq, check.report().head
            if head is not None and (int(head[0]), str(head[1])) == (log_end, last):
                return None
            if head is not None and int(head[0]) > log_end:
                # The log was cut short: the first event missing is the first bad one.
                first, recorded = log_end + 1, int(head[0])
                missing = f"seq {first} is" if first == recorded else f"seq {first} to {recorded} are"
                return first, (f"{missing} missing: the log ends at seq {log_end} but the chain head row "
                               f"records seq {recorded}")
            return log_end or None, f"the chain head row {head!r} does not match the last event"

        def records() -> Iterator[CallRecord]:
            # The projection holds the events still in the inbox too: folded after the log's.
            by_call = streamed("airlock_verify_by_call", _BY_CALL_WITH_INBOX)
            return folded_onto(_seeds(conn), by_call) if start[0] else fold_calls(by_call)

        # The chain first, holding one event at a time; then the head row; then each call; then
        # each request for approval.
        report = verifying.verify_log(streamed("airlock_verify", f"{_EVENT_SELECT} ORDER BY seq"), records, calls,
                                      start=start, between=head_row, advance=advance)
        return approvals.checked(conn, "%s", report)

    def rebuild(self, *, advance: Callable[[int], None] | None = None) -> int:
        """Rebuild the projection from the log (writers wait meanwhile); returns the number of calls.
        ``advance`` is told of each batch of events folded."""

        def work(conn: Conn) -> int:
            # An operator's work: it may delete rows (those no event made), so it takes the grant to.
            # The guard's login, which may update rows, is refused even where nothing would be deleted.
            allowed = conn.execute(b"SELECT has_table_privilege('calls', 'DELETE')").fetchone()
            if allowed is None or not allowed[0]:
                raise JournalError(f"cannot rebuild the projection: the login may not do it on the journal {self.name} "
                                   "(rebuild needs DELETE on calls, an operator's grant)")
            hold_log(conn)  # appends wait; every committed event is sealed
            calls = self._rebuilt_by_call(conn, advance)
            approvals.rebuild(conn, "%s")  # the requests, folded from the log as the calls are
            # Writers that read the old projection must read again: their append now finds it moved.
            conn.execute(b"UPDATE chain_head SET generation = generation + 1 WHERE id = 1")
            return calls

        return self._datastore.write("rebuild the projection", work, pipeline=False)

    def _rebuilt_by_call(self, conn: Conn, advance: Callable[[int], None] | None) -> int:
        """The projection made the fold of the log, in the write transaction on ``conn``, holding
        one call at a time: the events that change a record are read by call id and folded on
        their stored texts (as verify folds them; onto the projection as of the last archive's
        head, read in the same order, for a journal with archives), beside the projection rows read
        in the same order (server-side cursors, which do not see what this transaction writes
        after they open); only the rows that differ are written, a batch at a time. A stored
        field that cannot be read stops the rebuild with the journal's error."""
        last = conn.execute(b"SELECT coalesce(max(seq), 0) FROM events").fetchone()
        events = int(last[0]) if last is not None else 0
        seeds = _seeds(conn) if archived_head(conn)[0] else None
        folding = ByCall(_streamed(conn, "airlock_rebuild_by_call", _BY_CALL), advance, seeds)
        stored = _streamed(conn, "airlock_rebuild_calls", f'{_CALL_SELECT} ORDER BY call_id COLLATE "C"')
        put: list[tuple[Any, ...]] = []
        gone: list[Any] = []

        def write() -> None:
            with conn.cursor() as cur:
                if put:
                    cur.executemany(_UPSERT_CALL, put)
                if gone:
                    cur.execute(b"DELETE FROM calls WHERE call_id = ANY(%s)", (gone,))
            put.clear()
            gone.clear()

        for call_id, row in changes(folding.records(), stored, self._datastore.decoded):
            if row is None:
                gone.append(call_id)
            else:
                put.append(row)
            if len(put) + len(gone) >= _BATCH:
                write()
        write()
        folding.done(events)
        return folding.calls

    def import_events(self, events: Iterable[JournalEvent],
                      check: Callable[[VerifyReport], None] | None = None) -> int:
        """Insert stored ``events`` (``seq`` from 1, in order) as they are, with their hashes, and the
        projection folded from them (replacing whatever rows the projection held), into this empty
        journal in one transaction; returns the number of calls. ``check`` is given the report of
        :meth:`verify` on the result before it commits, and raises to refuse it. Raises
        :class:`JournalError` when the journal already holds events, or ``check`` refuses: nothing
        is changed then. Used by :func:`journal.copy.copy_journal`."""

        def work(conn: Conn) -> int:
            hold_log(conn)  # appends wait; every committed event is sealed
            seq = (conn.execute(_LOCK_HEAD).fetchone() or (0,))[0]
            if seq or conn.execute(b"SELECT EXISTS (SELECT 1 FROM events)").fetchone() != (False,):
                raise JournalError(f"the destination {self.name} is not empty; copy only into a new journal")
            folded: dict[str, CallRecord] = {}
            requests: list[tuple[int, EffectEvent]] = []  # the events that may change a request
            last: JournalEvent | None = None
            with conn.cursor().copy(_COPY_EVENTS) as copy:
                for event in events:
                    copy.write_row(event_row(event))
                    fold_into(folded, event)
                    if event.kind in approvals.MAY_CHANGE_KINDS and approval_event(effect := event.to_effect_event()):
                        requests.append((event.seq, effect))
                    last = event
            # The projection is the fold of these events alone: rows left from before (with no events
            # of their own) would make calls the copied log never had.
            conn.execute(b"DELETE FROM calls")
            with conn.cursor() as cur:
                cur.executemany(_UPSERT_CALL, [call_row(r) for r in folded.values()])
            approvals.import_fold(conn, "%s", requests)
            if last is not None:
                conn.execute(_SET_HEAD, (last.seq, last.hash))
            conn.execute(b"UPDATE chain_head SET generation = generation + 1 WHERE id = 1")
            if check is not None:
                check(self.verify_in(conn))  # before the commit: a copy refused leaves nothing behind
            return len(folded)

        # Not retried: the events are consumed as they are copied.
        return self._datastore.write("copy events", work, pipeline=False, retry=False)
