"""The SQLite journal's requests for approval: the write that asks and decides on them (what both
SQL journals do alike is :mod:`journal.approvals`, and their reads :class:`journal.reading.LogReader`'s)."""

from __future__ import annotations

import sqlite3

from guard.approvals import ApprovalStep, T
from guard.canonical import NotCanonical
from guard.store import apply

from .. import approvals
from ..errors import unstorable
from .datastore import SQLiteDatastore
from .writes import Writer


class Approvals:
    """``approval_step``, on ``datastore``; the events a step chooses are appended by ``writer``, as
    every other event is."""

    def __init__(self, datastore: SQLiteDatastore, writer: Writer) -> None:
        self._label = str(datastore.path)
        self._durable_sync = datastore.durable_sync
        self._write = datastore.write
        self._read = datastore.read
        self._decoded = datastore.decoded
        self._head_and_record = writer.head_and_record
        self._append_event = writer.append_event

    def approval_step(self, call_id: str, step: ApprovalStep[T]) -> T:
        """In one write transaction, at the journal's durability (a consumed grant and the
        ``pending`` it lets through are on disk before this returns, at ``durability="full"``):
        read the call's record as ``begin`` does and its latest request, let ``step`` choose the
        events, and append them in order, each folded into the calls and the requests. What
        ``step`` raises is raised, and nothing is appended. The write lock keeps every other
        write of the journal (another step, a ``begin``), in any thread or process, out meanwhile."""

        def work(conn: sqlite3.Connection) -> T:
            head, record = self._head_and_record(conn, call_id)
            events, result = step(record, approvals.latest_request(conn, "?", call_id))
            for event in events:
                own = record if event.call_id == call_id else self._head_and_record(conn, event.call_id)[1]
                seq, _, digest = self._append_event(conn, event, own, head)
                head = (seq, digest)
                if event.call_id == call_id:
                    record = apply(record, event, seq)
            return result

        try:
            return self._write(self._durable_sync, work)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self._label, e) from e
