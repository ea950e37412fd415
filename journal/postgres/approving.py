"""Requests for approval on a PostgreSQL journal: their steps, and the wait for a decision (their
reads are :class:`journal.reading.LogReader`'s).

See :mod:`guard.approvals` and :mod:`journal.approvals` (the projection of requests, written once for both stores).
"""

from __future__ import annotations

import contextlib
import time

import orjson
from psycopg.sql import SQL, Identifier

from guard.approvals import ApprovalStep, T
from guard.canonical import NotCanonical
from guard.store import CallRecord

from .. import approvals
from ..errors import unstorable
from ..events import JournalEvent
from .datastore import Conn, PostgresDatastore
from .deadline import DeadlineConnection
from .heads import unique_at
from .writes import APPROVALS_CHANNEL, SEAL_NOW, Writer

__all__ = ["Approvals"]


class Approvals:
    """``approval_step`` and ``wait_for_decision``; the steps append as
    ``begin``'s locked way does (through :class:`~journal.postgres.writes.Writer`)."""

    def __init__(self, datastore: PostgresDatastore, writes: Writer) -> None:
        self.name = datastore.name
        self._datastore = datastore
        self._writes = writes

    def approval_step(self, call_id: str, step: ApprovalStep[T]) -> T:
        """In one transaction that holds the call (so no ``begin`` or other step of it, from any
        replica, comes between): read the call's record as ``begin``'s locked way does and its
        latest request, let ``step`` choose the events, and append them in order, each sealed into
        the log at once and folded into the calls and the requests, committed synchronously (a
        consumed grant and the ``pending`` it lets through are durable before this returns). What
        ``step`` raises is raised, and nothing is appended."""
        doing = "record a step of a request for approval"
        self._datastore.check_writable(doing)
        writes = self._writes

        def work(conn: Conn) -> tuple[T, list[tuple[str | None, JournalEvent, CallRecord | None, int]]]:
            record, generation = writes.lock_and_read(conn, call_id)
            events, result = step(record, approvals.latest_request(conn, "%s", call_id))
            done: list[tuple[str | None, JournalEvent, CallRecord | None, int]] = []
            for event in events:
                event = unique_at(event)
                if event.call_id == call_id:
                    stored, record = writes.append_locked(conn, record, event, SEAL_NOW, generation)
                    done.append((call_id, stored, record, generation))
                else:
                    other, other_generation = writes.lock_and_read(conn, event.call_id)
                    stored, other = writes.append_locked(conn, other, event, SEAL_NOW, other_generation)
                    done.append((event.call_id, stored, other, other_generation))
            return result, done

        try:
            result, done = writes.rebuilt_again(doing, work, pipeline=False)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self.name, e) from e
        for written_id, stored, record, generation in done:
            writes.appended(written_id, stored, record, generation)
        return result

    def wait_for_decision(self, call_id: str, seconds: float) -> bool:
        """Block up to ``seconds`` until a decision on a request of ``call_id`` (``approved``,
        ``denied`` or ``expired``) is committed, told by PostgreSQL's ``NOTIFY`` on a connection of
        this wait's own (``LISTEN``); returns True when one was told, False after ``seconds`` or
        when the call's latest request was no longer open as the wait began (a decision made before
        the ``LISTEN``). See :class:`guard.approvals.ApprovalWaiter`."""
        if seconds <= 0:
            return False
        schema = self._datastore.schema
        with self._datastore.session("wait for a decision on a request for approval") as conn:
            conn.execute(b"SET application_name = 'airlock-journal approval waiter'")
            conn.execute(SQL("LISTEN {}").format(Identifier(APPROVALS_CHANNEL)))
            # After the LISTEN: a decision committed from here on is told; one before it is seen here.
            latest = conn.execute(SQL("SELECT status FROM {}.approvals WHERE call_id = %s ORDER BY first_seq DESC "
                                      "LIMIT 1").format(Identifier(schema)), (call_id,)).fetchone()
            if latest is not None and latest[0] != "open":
                return False
            if isinstance(conn, DeadlineConnection):
                conn.set_deadline(None)  # the wait for a notification is bounded by its own timeout
            wanted = [schema, call_id]
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0:
                for notice in conn.notifies(timeout=left, stop_after=1):
                    with contextlib.suppress(orjson.JSONDecodeError):
                        if orjson.loads(notice.payload) == wanted:
                            return True
            return False
