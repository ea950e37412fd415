"""Archiving in a PostgreSQL journal: where the log starts, what the archives kept, the transaction
that removes archived events, and the copy of an archived journal.

PostgreSQL removes the events of an archive in one transaction (see :mod:`journal.archive`, which
plans the archive and writes its file), and keeps a copy of every archived call's row in
``calls_archived``: the projection as of the archive's head, which verify and rebuild fold the
rest of the log onto.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from guard.store import CallRecord

from .. import approvals
from ..archive import ArchivePlan, ArchiveRecord, StartMoved, fold_onto, kept_row, last_seq_of, stored_copy
from ..chain import GENESIS
from ..errors import JournalError
from ..events import VerifyReport
from ..projection import record_row
from ..rows import CALL_COLUMNS, EVENT_COLUMNS
from .datastore import Conn, PostgresDatastore
from .sealing import SealingReads, hold_log
from .sql import _LOCK_HEAD, _SET_HEAD, _UPSERT_CALL

__all__ = ["SNAPSHOT_BY_CALL", "Archiver", "archived_head", "commit"]

# Every archive recorded, oldest first, as journal.archive reads them. PostgreSQL removes an
# archive's events in one transaction, so it records no upto_seq: an archive is finished when recorded.
_ARCHIVES = "SELECT last_seq, last_hash, NULL, NULL, events, archived_at, file FROM archives ORDER BY last_seq"
_ARCHIVED_HEAD = "SELECT last_seq, last_hash FROM archives ORDER BY last_seq DESC LIMIT 1"

# What the archives kept: a call's row as of the last archive's head, every such row, and the
# requests for approval as of that head.
_ARCHIVED_CALL = "SELECT record FROM calls_archived WHERE call_id = %s"
_ARCHIVED_PROJECTION = "SELECT call_id, record FROM calls_archived"
_ARCHIVED_REQUESTS = "SELECT request_id, request FROM approvals_archived ORDER BY request_id"

# The projection as of the last archive's head, by call id in binary order (rows of call_id and
# record: see journal.archive.kept_row).
SNAPSHOT_BY_CALL = 'SELECT call_id, record FROM calls_archived ORDER BY call_id COLLATE "C"'

# A row of calls_archived is a call id and the other columns of its projection row as one JSON
# array (``record``): a table of its own shape, never taken for the projection itself.
_RECORD = f"json_build_array({', '.join(CALL_COLUMNS[1:])})::text"

# The calls whose projection row is as it was at the archive's head (nothing moved it since): copied
# as they are, the ones copied by an earlier archive left as they were.
_COPY_SETTLED = (f"INSERT INTO calls_archived (call_id, record) SELECT call_id, {_RECORD} FROM calls "
                 "WHERE last_seq > %s AND last_seq <= %s "
                 "ON CONFLICT (call_id) DO UPDATE SET record = excluded.record")

# The calls moved past the archive's head: their row in the last snapshot, and their events up to the
# head, folded.
_MOVED_SNAPSHOT = ("SELECT call_id, record FROM calls_archived WHERE call_id IN "
                   "(SELECT call_id FROM calls WHERE last_seq > %s)")
_MOVED_EVENTS = (f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE seq > %s AND seq <= %s AND call_id IN "
                 "(SELECT call_id FROM calls WHERE last_seq > %s) ORDER BY seq")

_UPSERT = ("INSERT INTO calls_archived (call_id, record) VALUES (%s, %s) "
           "ON CONFLICT (call_id) DO UPDATE SET record = excluded.record")

_HASH = EVENT_COLUMNS.index("hash")
_COPY_EVENTS = f"COPY events ({', '.join(EVENT_COLUMNS)}) FROM STDIN".encode()

# The tables an archived journal's copy fills besides the log, emptied first: rows left with no log.
_TABLES_FIRST = ("calls", "calls_archived", "approvals", "approvals_archived", "archives")


def archived_head(conn: Conn) -> tuple[int, str]:
    """The last archive's head; ``(0, GENESIS)`` without one."""
    row = conn.execute(_ARCHIVED_HEAD.encode()).fetchone()
    return (0, GENESIS) if row is None else (int(row[0]), str(row[1]))


def commit(conn: Conn, plan: ArchivePlan, file: str, archived_at: str) -> int:
    """Inside the journal's write transaction, the chain head locked: check that the log still
    starts where ``plan`` was made from (else :class:`~journal.archive.StartMoved`), keep the
    projection and the requests as of ``plan``'s last event, and remove the events it moves by
    ``airlock_archive_events`` (which runs as the tables' owner and records the archive's head);
    returns how many were removed."""
    base = archived_head(conn)
    if base != (plan.base_seq, plan.base_hash):
        raise StartMoved(f"another archive moved the start of the log to seq {base[0]} meanwhile; archive again")
    approvals.keep_as_of(conn, "%s", plan.base_seq, plan.last_seq)
    conn.execute(_COPY_SETTLED.encode(), (plan.base_seq, plan.last_seq))
    archived = conn.execute(_MOVED_SNAPSHOT.encode(), (plan.last_seq,)).fetchall()
    moved = fold_onto([kept_row(*row) for row in archived],
                      conn.execute(_MOVED_EVENTS.encode(), (plan.base_seq, plan.last_seq, plan.last_seq)).fetchall())
    if moved:
        with conn.cursor() as cur:
            cur.executemany(_UPSERT.encode(), [stored_copy(row) for row in moved])
    row = conn.execute(b"SELECT airlock_archive_events(%s, %s, %s, %s, %s)",
                       (plan.base_seq, plan.last_seq, plan.last_hash, archived_at, file)).fetchone()
    removed = int(row[0]) if row is not None else 0
    if removed != plan.events:
        raise JournalError(f"the log held {removed} events up to seq {plan.last_seq}, not {plan.events}; run verify")
    return removed


class Archiver:
    """Where the log starts, what the archives kept (:class:`~journal.archive.ArchiveReading`),
    the transaction that removes archived events, and the copy of an archived journal into this
    one (:class:`~journal.archive.ArchivedImporter`), checked by ``verified`` (verify, in the
    transaction of the connection given) before it commits."""

    def __init__(self, datastore: PostgresDatastore | SealingReads, verified: Callable[[Conn], VerifyReport]) -> None:
        self.name = datastore.name
        self._datastore = datastore
        self._rows = datastore.rows
        self._verified = verified

    def archived_head(self) -> tuple[int, str]:
        """The seq and hash of the last archived event, where the log now starts; ``(0, GENESIS)``
        when nothing was archived."""
        rows = self._rows("read the archived head", _ARCHIVED_HEAD)
        return (int(rows[0][0]), str(rows[0][1])) if rows else (0, GENESIS)

    def archive_rows(self) -> list[tuple[Any, ...]]:
        """Every archive recorded, oldest first: ``last_seq, last_hash, upto_seq, upto_hash, events,
        archived_at, file`` (``upto_*`` NULL: an archive here is finished when recorded)."""
        return self._rows("read the archives", _ARCHIVES)

    def archived_call_last_seq(self, call_id: str) -> int | None:
        """The ``seq`` of the last archived event of ``call_id``; None when none of its events is."""
        rows = self._rows("read an archived call", _ARCHIVED_CALL, (call_id,))
        return last_seq_of(rows[0][0]) if rows else None

    def archived_projection(self) -> dict[str, tuple[Any, ...]]:
        """The projection as of the start of the log, each call's stored row by call id (a copy of
        every archived call's row is kept); empty without an archive."""
        rows = self._rows("read the archived projection", _ARCHIVED_PROJECTION)
        return {call_id: kept_row(call_id, record) for call_id, record in rows}

    def archived_requests(self) -> list[tuple[str, str]]:
        """The requests for approval as of the start of the log (``request_id`` and the request as
        stored); none without an archive."""
        rows = self._rows("read the archived requests", _ARCHIVED_REQUESTS)
        return [(str(request_id), str(request)) for request_id, request in rows]

    def commit_archive(self, plan: ArchivePlan, file: str, archived_at: str) -> int:
        """Remove the events ``plan`` moves, once they are in the archive ``file``, in one
        transaction that holds the chain head and also records the archive's head; returns how many
        were removed. The login needs EXECUTE on ``airlock_archive_events`` (see docs/postgres.md)."""

        def work(conn: Conn) -> int:
            hold_log(conn)  # appends wait; every committed event is sealed
            return commit(conn, plan, file, archived_at)

        return self._datastore.write("archive the events", work, pipeline=False, retry=False)

    def import_archived(self, records: list[ArchiveRecord], snapshot: dict[str, tuple[Any, ...]],
                        touched: dict[str, tuple[Any, ...]], requests: list[tuple[str, str]],
                        rows: Iterator[tuple[Any, ...]], folded: dict[str, CallRecord],
                        check: Callable[[VerifyReport], None]) -> int:
        """The copy of an archived journal into this empty one, in one transaction: its archives'
        ``records``, the events ``rows`` (stored rows after its archived head, in ``seq`` order),
        the projection ``folded`` (their fold onto ``snapshot``, the projection as of that head) and
        the ``requests`` kept as of it; ``check`` is given the verify report before the commit and
        raises to refuse it. A copy of every archived call's row is kept, as an archive here keeps
        it (``touched``, the rows the rest of the log moves, is all a copy-on-write store keeps).
        Returns the number of calls. See :class:`~journal.archive.ArchivedImporter`."""

        def work(conn: Conn) -> int:
            hold_log(conn)  # appends wait; every committed event is sealed
            seq = (conn.execute(_LOCK_HEAD).fetchone() or (0,))[0]
            if seq or conn.execute(b"SELECT EXISTS (SELECT 1 FROM events)").fetchone() != (False,):
                raise JournalError(f"the destination {self.name} is not empty; copy only into a new journal")
            for table in _TABLES_FIRST:
                conn.execute(f"DELETE FROM {table}".encode())
            with conn.cursor() as cur:
                cur.executemany(b"INSERT INTO archives (last_seq, last_hash, events, archived_at, file) "
                                b"VALUES (%s, %s, %s, %s, %s)",
                                [(a.last_seq, a.last_hash, a.events, a.archived_at, a.file) for a in records])
                cur.executemany(b"INSERT INTO calls_archived (call_id, record) VALUES (%s, %s)",
                                [stored_copy(row) for row in snapshot.values()])
                cur.executemany(b"INSERT INTO approvals_archived (request_id, request) VALUES (%s, %s)", requests)
            # The head is the last event copied; with none after the archived head, that head.
            head = (records[-1].last_seq, records[-1].last_hash) if records else None
            with conn.cursor().copy(_COPY_EVENTS) as copy:
                for row in rows:
                    copy.write_row(row)
                    head = (row[0], row[_HASH])
            with conn.cursor() as cur:
                cur.executemany(_UPSERT_CALL, [record_row(record) for record in folded.values()])
            approvals.rebuild(conn, "%s")
            if head is not None:
                conn.execute(_SET_HEAD, head)
            conn.execute(b"UPDATE chain_head SET generation = generation + 1 WHERE id = 1")
            calls = len(folded)
            folded.clear()  # the check folds the log again: one fold in memory at a time
            snapshot.clear()
            check(self._verified(conn))  # before the commit: a copy refused leaves nothing behind
            return calls

        # Not retried: the events are consumed as they are copied.
        return self._datastore.write("copy events", work, pipeline=False, retry=False)
