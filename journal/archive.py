"""Archiving: moving the oldest events of a journal out of its log into an export, forgetting no call.

An archive takes a prefix of the log: the events from where the log starts now up to the last one
before a given time (by ``at``), never the log's last event, which stays so that the chain goes on
from it. Its lines are exactly those of ``export``. Once the archive file is complete and on disk,
one transaction of the store removes those events and records the archive's head (the ``seq`` and
``hash`` of its last event, and how many it holds); the same transaction keeps the projection as of
that head in a table of its own (``calls_archived``). So the journal verifies alone from the
archive's head on, ``rebuild`` folds the rest of the log onto that projection, and every call keeps
its projection row: a retry of an archived call is still replayed or refused, never run again.

Both stores run the transaction here (:func:`sqlite_commit`, :func:`postgres_commit`); the fold of
the calls whose projection moved past the head is the guard's own ``apply`` (:func:`fold_onto`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import orjson

from guard.store import CallRecord

from . import schema
from .chain import GENESIS
from .errors import JournalError
from .events import JournalEvent, VerifyReport
from .export import jsonl_lines
from .projection import fold_row, record_row
from .rows import CALL_COLUMNS, EVENT_COLUMNS

if TYPE_CHECKING:
    import psycopg

__all__ = ["ArchivePlan", "ArchiveStore", "Archiving", "SQLiteSnapshot", "archive_lines", "fold_onto", "plan_archive",
           "postgres_commit", "sqlite_commit"]

_EVENTS = ", ".join(EVENT_COLUMNS)
_CHUNK = 1 << 20  # about a megabyte of lines a write


class Archiving(Protocol):
    """What archiving asks of a journal (both stores have it)."""

    def archived_head(self) -> tuple[int, str]:
        """The ``seq`` and ``hash`` of the last archived event; ``(0, 64 zeros)`` when none is."""
        ...

    def head(self) -> tuple[int, str]: ...

    def events(self, *, since: datetime | None = None, after_seq: int = 0) -> Iterator[JournalEvent]: ...

    def event_rows(self, *, after_seq: int = 0) -> Iterator[tuple[Any, ...]]: ...


@runtime_checkable
class ArchiveStore(Archiving, Protocol):
    """A journal that archives: :class:`Archiving`, its verify, and the transaction that removes
    the archived events (both stores)."""

    def verify(self) -> VerifyReport: ...

    def commit_archive(self, plan: ArchivePlan, file: str, archived_at: str) -> int:
        """Remove the events ``plan`` moves, in one transaction that records the archive's head
        and keeps the projection as of it; returns how many were removed."""
        ...


@dataclass(frozen=True, slots=True)
class ArchivePlan:
    """The events one archive moves: ``base_seq`` < seq <= ``last_seq``. ``base_seq`` and
    ``base_hash`` are where the log starts now (the last archive's head, or 0 and 64 zeros);
    ``last_hash`` is the hash of event ``last_seq``, the new archive's head."""

    base_seq: int
    base_hash: str
    last_seq: int
    last_hash: str

    @property
    def events(self) -> int:
        return self.last_seq - self.base_seq


def plan_archive(journal: Archiving, before: datetime) -> ArchivePlan | None:
    """What archiving the events of ``journal`` older than ``before`` moves, or None for nothing.

    The log is a chain: only a prefix of it can move. It ends before the first event at or after
    ``before`` (events are stamped before they are appended, so a later ``seq`` may carry an
    earlier ``at``: such an event waits for the next archive), and before the log's last event.
    """
    base_seq, base_hash = journal.archived_head()
    head_seq, _ = journal.head()
    later = next(iter(journal.events(since=before, after_seq=base_seq)), None)
    last_seq = min(head_seq - 1, later.seq - 1 if later is not None else head_seq)
    if last_seq <= base_seq:
        return None
    last = next(iter(journal.events(after_seq=last_seq - 1)), None)
    if last is None or last.seq != last_seq:
        raise JournalError(f"the log has no event seq {last_seq} to end the archive with; run verify")
    return ArchivePlan(base_seq, base_hash, last_seq, last.hash)


def archive_lines(journal: Archiving, plan: ArchivePlan) -> Iterator[bytes]:
    """The export lines of the events ``plan`` moves, in chunks of about a megabyte.

    Each event must follow the one before (its ``seq`` and ``prev_hash``) from the plan's base to
    its last event: raises :class:`JournalError` otherwise, before the archive could be taken for whole.
    """
    expected, prev = plan.base_seq + 1, plan.base_hash

    def rows() -> Iterator[tuple[Any, ...]]:
        nonlocal expected, prev
        for row in journal.event_rows(after_seq=plan.base_seq):
            if row[0] > plan.last_seq:
                return
            if row[0] != expected or row[14] != prev:
                raise JournalError(f"event seq {row[0]} does not follow seq {expected - 1} in the log; run verify")
            expected, prev = expected + 1, row[15]
            yield row

    chunk: list[bytes] = []
    size = 0
    for line in jsonl_lines(rows()):
        chunk.append(line)
        size += len(line)
        if size >= _CHUNK:
            yield b"".join(chunk)
            chunk, size = [], 0
    if chunk:
        yield b"".join(chunk)
    if expected != plan.last_seq + 1 or prev != plan.last_hash:
        raise JournalError(f"the log ends the archive at seq {expected - 1}, not at seq {plan.last_seq}; run verify")


def fold_onto(snapshot: Iterable[tuple[Any, ...]], events: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The projection rows (:data:`~journal.rows.CALL_COLUMNS`) of the calls of ``snapshot`` (stored
    rows) and ``events`` (stored rows, in ``seq`` order) after folding the events onto the rows,
    with the guard's ``apply``; the stored texts are carried over as they are (see ``fold_row``)."""
    records = {row[0]: CallRecord(*row) for row in snapshot}
    for row in events:
        fold_row(records, row)
    return [record_row(record) for record in records.values()]


# -- the stores' transactions ----------------------------------------------------------------------

# A row of calls_archived is a call id and the other columns of its projection row as one JSON
# array (``record``): a table of its own shape, never taken for the projection itself.
_FIELDS = ", ".join(CALL_COLUMNS[1:])
_RECORD = {"?": f"json_array({_FIELDS})", "%s": f"json_build_array({_FIELDS})::text"}


def _sql(template: str, mark: str) -> str:
    return template.replace("{record}", _RECORD[mark]).replace("?", mark)


def _row(call_id: str, record: str) -> tuple[Any, ...]:
    """A projection row from a row of calls_archived."""
    return (call_id, *orjson.loads(record))


def _stored(row: tuple[Any, ...]) -> tuple[str, str]:
    """A row of calls_archived from a projection row."""
    return row[0], orjson.dumps(list(row[1:])).decode()


# The calls whose projection row is as it was at the archive's head (nothing moved it since): copied
# as they are, the ones copied by an earlier archive left as they were.
_COPY_SETTLED = ("INSERT INTO calls_archived (call_id, record) SELECT call_id, {record} FROM calls "
                 "WHERE last_seq > ? AND last_seq <= ? ON CONFLICT (call_id) DO UPDATE SET record = excluded.record")
# The calls moved past the archive's head: their row in the last snapshot, and their events up to the
# head, folded.
_MOVED_SNAPSHOT = ("SELECT call_id, record FROM calls_archived WHERE call_id IN "
                   "(SELECT call_id FROM calls WHERE last_seq > ?)")
_MOVED_EVENTS = (f"SELECT {_EVENTS} FROM events WHERE seq > ? AND seq <= ? AND call_id IN "
                 "(SELECT call_id FROM calls WHERE last_seq > ?) ORDER BY seq")
_UPSERT = ("INSERT INTO calls_archived (call_id, record) VALUES (?, ?) "
           "ON CONFLICT (call_id) DO UPDATE SET record = excluded.record")


def sqlite_archived_head(conn: sqlite3.Connection) -> tuple[int, str]:
    """The last archive's head in a SQLite journal; ``(0, GENESIS)`` without one (or without the
    table, in a journal of an older version read as it is)."""
    try:
        row = conn.execute("SELECT last_seq, last_hash FROM archives ORDER BY last_seq DESC LIMIT 1").fetchone()
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):
            return 0, GENESIS
        raise
    return (0, GENESIS) if row is None else (int(row[0]), str(row[1]))


def sqlite_snapshot(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
    """The stored projection as of the last archive's head ([] without one)."""
    if sqlite_archived_head(conn)[0] == 0:
        return []
    return [_row(*row) for row in conn.execute("SELECT call_id, record FROM calls_archived")]


class SQLiteSnapshot:
    """The projection as of the last archive's head, read as verify needs it: the row of each call
    the rest of the log touches (:meth:`seed`, as its first event comes), then every other call
    compared with its row in SQL order (:meth:`rows`); so only the calls the log touches are held."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._seen: set[str] = set()

    def seed(self, folded: dict[str, CallRecord], call_id: str | None) -> None:
        """Put the archived record of ``call_id`` into ``folded`` before its first event is folded."""
        if call_id is None or call_id in self._seen:
            return
        self._seen.add(call_id)
        row = self._conn.execute("SELECT record FROM calls_archived WHERE call_id = ?", (call_id,)).fetchone()
        if row is not None:
            folded[call_id] = CallRecord(*_row(call_id, row[0]))

    def rows(self, folded: dict[str, CallRecord]) -> Iterator[tuple[Any, ...]]:
        """The projection rows to compare with ``folded``: those of the calls the log touched, and
        those of the others that differ from their archived row (whose record is put in
        ``folded``); an archived call with no projection row is put in ``folded`` too."""
        width = len(CALL_COLUMNS)
        current_columns = ", ".join(f"c.{c}" for c in CALL_COLUMNS)
        for row in self._conn.execute(
            f"SELECT {current_columns}, a.record FROM calls c LEFT JOIN calls_archived a ON a.call_id = c.call_id "
            "ORDER BY c.call_id"
        ):
            current, record = row[:width], row[width]
            if current[0] in self._seen:
                yield current
                continue
            archived = None if record is None else _row(current[0], record)
            if current != archived:
                if archived is not None:
                    folded[current[0]] = CallRecord(*archived)
                yield current
        gone = "NOT EXISTS (SELECT 1 FROM calls c WHERE c.call_id = a.call_id)"
        for call_id, record in self._conn.execute(f"SELECT call_id, record FROM calls_archived a WHERE {gone}"):
            folded.setdefault(call_id, CallRecord(*_row(call_id, record)))


def sqlite_commit(conn: sqlite3.Connection, plan: ArchivePlan, file: str, archived_at: str) -> int:
    """Inside the SQLite journal's write transaction: remove the events ``plan`` moves, keep the
    projection as of its head and record the head; returns how many events were removed.

    The delete trigger is dropped, the events deleted and the trigger made again, all in this
    transaction: no other writer ever sees the log without it. Raises :class:`JournalError`, the
    transaction then undone, when the log is no longer the one planned from.
    """
    base = sqlite_archived_head(conn)
    if base != (plan.base_seq, plan.base_hash):
        raise JournalError(f"another archive moved the start of the log to seq {base[0]} meanwhile; archive again")
    head = conn.execute("SELECT max(seq) FROM events").fetchone()[0] or 0
    found = conn.execute("SELECT hash FROM events WHERE seq = ?", (plan.last_seq,)).fetchone()
    if plan.last_seq >= head or found is None or found[0] != plan.last_hash:
        raise JournalError(f"event seq {plan.last_seq} is no longer the one archived; run verify")
    conn.execute(_sql(_COPY_SETTLED, "?"), (plan.base_seq, plan.last_seq))
    moved = fold_onto([_row(*row) for row in conn.execute(_MOVED_SNAPSHOT, (plan.last_seq,))],
                      conn.execute(_MOVED_EVENTS, (plan.base_seq, plan.last_seq, plan.last_seq)).fetchall())
    conn.executemany(_UPSERT, [_stored(row) for row in moved])
    conn.execute("DROP TRIGGER events_no_delete")
    removed = conn.execute("DELETE FROM events WHERE seq <= ?", (plan.last_seq,)).rowcount
    conn.execute(schema.NO_DELETE_TRIGGER)
    if removed != plan.events:
        raise JournalError(f"the log held {removed} events up to seq {plan.last_seq}, not {plan.events}; run verify")
    conn.execute("INSERT INTO archives (last_seq, last_hash, events, archived_at, file) VALUES (?, ?, ?, ?, ?)",
                 (plan.last_seq, plan.last_hash, removed, archived_at, file))
    return int(removed)


def postgres_archived_head(conn: psycopg.Connection[tuple[Any, ...]]) -> tuple[int, str]:
    """The last archive's head in a PostgreSQL journal; ``(0, GENESIS)`` without one."""
    row = conn.execute(b"SELECT last_seq, last_hash FROM archives ORDER BY last_seq DESC LIMIT 1").fetchone()
    return (0, GENESIS) if row is None else (int(row[0]), str(row[1]))


def postgres_snapshot(conn: psycopg.Connection[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The stored projection as of the last archive's head ([] without one)."""
    if postgres_archived_head(conn)[0] == 0:
        return []
    return [_row(*row) for row in conn.execute(b"SELECT call_id, record FROM calls_archived")]


def postgres_commit(conn: psycopg.Connection[tuple[Any, ...]], plan: ArchivePlan, file: str,
                    archived_at: str) -> int:
    """Inside the PostgreSQL journal's write transaction, the chain head locked: as
    :func:`sqlite_commit`; the events are removed by ``airlock_archive_events``, which runs as the
    tables' owner and records the head."""
    base = postgres_archived_head(conn)
    if base != (plan.base_seq, plan.base_hash):
        raise JournalError(f"another archive moved the start of the log to seq {base[0]} meanwhile; archive again")
    conn.execute(_sql(_COPY_SETTLED, "%s").encode(), (plan.base_seq, plan.last_seq))
    archived = conn.execute(_sql(_MOVED_SNAPSHOT, "%s").encode(), (plan.last_seq,)).fetchall()
    moved = fold_onto([_row(*row) for row in archived],
                      conn.execute(_sql(_MOVED_EVENTS, "%s").encode(),
                                   (plan.base_seq, plan.last_seq, plan.last_seq)).fetchall())
    if moved:
        with conn.cursor() as cur:
            cur.executemany(_sql(_UPSERT, "%s").encode(), [_stored(row) for row in moved])
    row = conn.execute(b"SELECT airlock_archive_events(%s, %s, %s, %s, %s)",
                       (plan.base_seq, plan.last_seq, plan.last_hash, archived_at, file)).fetchone()
    removed = int(row[0]) if row is not None else 0
    if removed != plan.events:
        raise JournalError(f"the log held {removed} events up to seq {plan.last_seq}, not {plan.events}; run verify")
    return removed
