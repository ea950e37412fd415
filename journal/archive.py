"""Archiving: moving the oldest events of a journal out of its log into an export, forgetting no call.

An archive takes a prefix of the log: the events from where the log starts now up to the last one
before a given time (by ``at``), never the log's last event, which stays so that the chain goes on
from it. Its lines are exactly those of ``export``. Once the archive file is complete and on disk,
the store removes those events and records where the log now starts (the ``seq`` and ``hash`` of
the last event removed) in the same transaction, and keeps the projection as of that point: so
the journal verifies alone from there on, ``rebuild`` folds the rest of the log onto that
projection, and every call keeps its projection row: a retry of an archived call is still
replayed or refused, never run again.

SQLite removes the events in short steps (:func:`archive_steps`), each a transaction that
moves the start of the log on by a few thousand events, so that a guarded call waits for one step
at most; each step leaves a journal that verifies, and the archive's file holds every event of it
from the first step on. A run stopped between steps is finished by the next (see
:mod:`journal.archive_run`). The projection as of the start is kept copy-on-write
(:mod:`journal.archive_schema`): ``calls_archived`` holds the row of a call only once its row in
``calls`` moved past the start; every other call's row is its own. PostgreSQL removes the events
in one transaction and keeps a copy of every archived call's row.

The fold of the calls whose projection moved past the start is the guard's own ``apply``
(:func:`fold_onto`).

Requests for approval (:mod:`journal.approvals`): an archive never takes an event of a request
still open or approved. :func:`plan_archive` ends the archive before the first of them, and each
step's transaction refuses one that would take such an event, and keeps the requests as of its
last event in ``approvals_archived`` (their rows stay in ``approvals``).
"""


from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import orjson

from guard.store import CallRecord

from . import approvals
from .archive_schema import record_of
from .chain import GENESIS
from .errors import JournalError
from .events import JournalEvent, VerifyReport
from .export import jsonl_lines
from .projection import fold_row, record_row
from .rows import CALL_COLUMNS, EVENT_COLUMNS
from .sqlite import schema

if TYPE_CHECKING:
    import psycopg

__all__ = ["ArchivePlan", "ArchiveRecord", "ArchiveStore", "Archiving", "POSTGRES_SNAPSHOT_BY_CALL",
           "SQLiteSnapshot", "StartMoved", "archive_holding", "archive_lines", "archive_steps",
           "archived_call_last_seq", "archived_projection", "archived_requests", "archives_between", "fold_onto",
           "plan_archive", "postgres_archived_head", "postgres_commit", "recorded_archives", "snapshot_row",
           "sqlite_archived_head", "sqlite_commit", "sqlite_unfinished", "stored_copy"]

_EVENTS = ", ".join(EVENT_COLUMNS)
_CHUNK = 1 << 20  # about a megabyte of lines a write


class StartMoved(JournalError):
    """An archive's transaction found the log starting elsewhere than where it was planned from:
    another archive (or another step of the same one) moved it meanwhile; nothing was changed."""


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
    # A step of an archive removed in steps: the archive it is part of (None: the plan is whole).
    whole: ArchivePlan | None = None

    @property
    def events(self) -> int:
        return self.last_seq - self.base_seq

    @property
    def archive(self) -> ArchivePlan:
        """The whole archive this plan is (a step of)."""
        return self.whole if self.whole is not None else self

    def step(self, base_seq: int, base_hash: str, last_seq: int, last_hash: str) -> ArchivePlan:
        """The step of this archive that moves the events ``base_seq`` < seq <= ``last_seq``."""
        whole = self.archive
        if not whole.base_seq <= base_seq < last_seq <= whole.last_seq:
            raise ValueError(f"seq {base_seq + 1} to {last_seq} is not a step of the archive of seq "
                             f"{whole.base_seq + 1} to {whole.last_seq}")
        return ArchivePlan(base_seq, base_hash, last_seq, last_hash, whole)


@dataclass(frozen=True, slots=True)
class ArchiveRecord:
    """What a journal recorded of one archive (a row of its ``archives`` table): the archive file
    ``file`` (its path when it was written) holds the events ``first_seq`` to ``upto_seq``; the
    journal has let go of them up to ``last_seq`` (``upto_seq`` once it is finished: only a SQLite
    archive stopped between its steps is not), ``events`` of them, at ``archived_at``."""

    first_seq: int
    last_seq: int
    last_hash: str
    upto_seq: int
    upto_hash: str
    events: int
    archived_at: str
    file: str

    @property
    def finished(self) -> bool:
        """Whether the journal has let go of every event of the archive's file."""
        return self.last_seq >= self.upto_seq

    def holds(self, seq: int) -> bool:
        """Whether the archive's file holds event ``seq``."""
        return self.first_seq <= seq <= self.upto_seq

    def describe(self) -> str:
        """The archive for a message: its file and the seqs it holds."""
        return f"{self.file} (seq {self.first_seq} to {self.upto_seq})"


_ARCHIVES_SQLITE = ("SELECT last_seq, last_hash, upto_seq, upto_hash, events, archived_at, file FROM archives "
                    "ORDER BY last_seq")
# Version 6 of SQLite, and PostgreSQL, record no upto_seq: an archive there is finished when recorded.
_ARCHIVES_POSTGRES = _ARCHIVES_SQLITE_V6 = ("SELECT last_seq, last_hash, NULL, NULL, events, archived_at, file "
                                            "FROM archives ORDER BY last_seq")


def _sqlite_archive_rows(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
    for sql in (_ARCHIVES_SQLITE, _ARCHIVES_SQLITE_V6):
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return []  # a journal of a version before archives, read as it is
            if "no such column" not in str(e):
                raise
    return []


def _record(row: tuple[Any, ...]) -> ArchiveRecord:
    last_seq, last_hash, upto_seq, upto_hash, events, archived_at, file = row
    upto_seq = int(last_seq) if upto_seq is None else int(upto_seq)
    upto_hash = str(last_hash) if upto_hash is None else str(upto_hash)
    return ArchiveRecord(first_seq=int(last_seq) - int(events) + 1, last_seq=int(last_seq), last_hash=str(last_hash),
                         upto_seq=upto_seq, upto_hash=upto_hash, events=int(events), archived_at=str(archived_at),
                         file=str(file))


def _store(journal: object) -> str | None:
    """``"sqlite"`` or ``"postgres"`` for a journal of these stores, else None."""
    from .sqlite import SQLiteJournal  # here: the SQLite journal's own modules import this one

    if isinstance(journal, SQLiteJournal):
        return "sqlite"
    if type(journal).__module__.startswith(f"{__package__}.postgres"):  # without importing psycopg
        return "postgres"
    return None


def recorded_archives(journal: object) -> list[ArchiveRecord]:
    """Every archive ``journal`` recorded, oldest first (none for a journal that cannot archive)."""
    store = _store(journal)
    if store == "sqlite":
        rows = journal._read(_sqlite_archive_rows)  # type: ignore[attr-defined]
    elif store == "postgres":
        rows = journal._read("read the archives", _ARCHIVES_POSTGRES)  # type: ignore[attr-defined]
    else:
        return []
    return [_record(tuple(row)) for row in rows]


def archive_holding(archives: Iterable[ArchiveRecord], seq: int) -> ArchiveRecord | None:
    """The archive whose file holds event ``seq`` (the latest, should two), or None."""
    found = None
    for record in archives:
        if record.holds(seq):
            found = record
    return found


def archives_between(archives: Iterable[ArchiveRecord], first: int, last: int) -> list[ArchiveRecord]:
    """The archives whose files hold events of ``first`` to ``last``, oldest first."""
    return [a for a in archives if a.first_seq <= last and a.upto_seq >= first]


# The position of last_seq in a row of calls_archived's record (the projection row without call_id).
_RECORD_LAST_SEQ = CALL_COLUMNS.index("last_seq") - 1


def archived_call_last_seq(journal: object, call_id: str) -> int | None:
    """The ``seq`` of the last event of ``call_id`` that the journal has let go of (archived),
    from the projection as of the start of its log; None when none of its events is archived."""
    def last_of(record: Any) -> int | None:
        try:
            value = orjson.loads(record)[_RECORD_LAST_SEQ]
        except (orjson.JSONDecodeError, IndexError, TypeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    store = _store(journal)
    if store == "sqlite":
        def read(conn: sqlite3.Connection) -> int | None:
            start = sqlite_archived_head(conn)[0]
            if not start:
                return None
            kept = conn.execute(_KEPT, (call_id,)).fetchone()
            if kept is not None:
                return last_of(kept[0])
            row = conn.execute("SELECT last_seq FROM calls WHERE call_id = ?", (call_id,)).fetchone()
            return int(row[0]) if row is not None and isinstance(row[0], int) and row[0] <= start else None

        return journal._read(read)  # type: ignore[attr-defined,no-any-return]
    if store == "postgres":
        rows = journal._read("read an archived call",  # type: ignore[attr-defined]
                             "SELECT record FROM calls_archived WHERE call_id = %s", (call_id,))
        return last_of(rows[0][0]) if rows else None
    return None


def archived_projection(journal: object) -> dict[str, tuple[Any, ...]]:
    """The projection of ``journal`` as of the start of its log (its last archive's head): each
    call's stored row (:data:`~journal.rows.CALL_COLUMNS`) by call id; empty without an archive.

    SQLite keeps it copy-on-write: a call's row is its copy in calls_archived, else its row in
    calls when that row is not past the start. The rows are read before the copies, so that a row
    a writer moves meanwhile is found as its copy (which the trigger takes as it moves)."""
    store = _store(journal)
    if store == "sqlite":
        def read(conn: sqlite3.Connection) -> dict[str, tuple[Any, ...]]:
            start = sqlite_archived_head(conn)[0]
            if not start:
                return {}
            rows = {row[0]: tuple(row) for row in conn.execute(
                f"SELECT {', '.join(CALL_COLUMNS)} FROM calls WHERE last_seq <= ?", (start,))}
            for call_id, record in conn.execute("SELECT call_id, record FROM calls_archived"):
                rows[call_id] = _row(call_id, record)
            return rows

        return journal._read(read)  # type: ignore[attr-defined,no-any-return]
    if store == "postgres":
        found = journal._read("read the archived projection",  # type: ignore[attr-defined]
                              "SELECT call_id, record FROM calls_archived")
        return {call_id: _row(call_id, record) for call_id, record in found}
    return {}


def archived_requests(journal: object) -> list[tuple[str, str]]:
    """The requests for approval of ``journal`` as of the start of its log (``request_id`` and
    the request as stored); none without an archive, or in a journal from before approvals."""
    store = _store(journal)
    sql = "SELECT request_id, request FROM approvals_archived ORDER BY request_id"
    if store == "sqlite":
        def read(conn: sqlite3.Connection) -> list[tuple[str, str]]:
            try:
                return [(str(r), str(q)) for r, q in conn.execute(sql)]
            except sqlite3.OperationalError as e:
                if "no such table" in str(e):
                    return []
                raise

        return journal._read(read)  # type: ignore[attr-defined,no-any-return]
    if store == "postgres":
        return [(str(r), str(q)) for r, q in journal._read("read the archived requests", sql)]  # type: ignore[attr-defined]
    return []


def stored_copy(row: tuple[Any, ...]) -> tuple[str, str]:
    """A row of calls_archived (call id, record) from a projection row."""
    return _stored(row)


def plan_archive(journal: Archiving, before: datetime) -> ArchivePlan | None:
    """What archiving the events of ``journal`` older than ``before`` moves, or None for nothing.

    The log is a chain: only a prefix of it can move. It ends before the first event at or after
    ``before`` (events are stamped before they are appended, so a later ``seq`` may carry an
    earlier ``at``: such an event waits for the next archive), before the log's last event, and
    before the first event of any request for approval still open or approved: an open request is
    never archived away (its events stay in the log until it is decided, expires or is consumed).
    """
    base_seq, base_hash = journal.archived_head()
    head_seq, _ = journal.head()
    later = next(iter(journal.events(since=before, after_seq=base_seq)), None)
    last_seq = min(head_seq - 1, later.seq - 1 if later is not None else head_seq)
    live = approvals.first_live_seq(journal)
    if live is not None:
        last_seq = min(last_seq, live - 1)
    if last_seq <= base_seq:
        return None
    last = next(iter(journal.events(after_seq=last_seq - 1)), None)
    if last is None or last.seq != last_seq:
        raise JournalError(f"the log has no event seq {last_seq} to end the archive with; run verify")
    return ArchivePlan(base_seq, base_hash, last_seq, last.hash)


def archive_lines(journal: Archiving, plan: ArchivePlan, marks: list[tuple[int, str]] | None = None,
                  every: int = 0) -> Iterator[bytes]:
    """The export lines of the events ``plan`` moves, in chunks of about a megabyte.

    Each event must follow the one before (its ``seq`` and ``prev_hash``) from the plan's base to
    its last event: raises :class:`JournalError` otherwise, before the archive could be taken for whole.
    With ``marks`` and ``every``, the ``seq`` and ``hash`` of every ``every``-th event are added to
    ``marks`` on the way (where :func:`archive_steps` cuts the archive's removal).
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
            if marks is not None and every and (row[0] - plan.base_seq) % every == 0:
                marks.append((row[0], row[15]))
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


def archive_steps(plan: ArchivePlan, marks: Iterable[tuple[int, str]]) -> list[ArchivePlan]:
    """The steps that remove the events of ``plan`` one stretch at a time: each ends at one of
    ``marks`` (the ``seq`` and ``hash`` of events of the plan, in order), the last at the plan's end."""
    steps: list[ArchivePlan] = []
    seq, digest = plan.base_seq, plan.base_hash
    for last_seq, last_hash in [*marks, (plan.last_seq, plan.last_hash)]:
        if seq < last_seq <= plan.last_seq:
            steps.append(plan.step(seq, digest, last_seq, last_hash))
            seq, digest = last_seq, last_hash
    return steps


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


_UPSERT = ("INSERT INTO calls_archived (call_id, record) VALUES (?, ?) "
           "ON CONFLICT (call_id) DO UPDATE SET record = excluded.record")

# -- SQLite: the projection as of the start of the log, copy-on-write (see journal.archive_schema) --

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


def sqlite_archived_head(conn: sqlite3.Connection) -> tuple[int, str]:
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


def sqlite_unfinished(conn: sqlite3.Connection) -> tuple[ArchivePlan, str] | None:
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


class SQLiteSnapshot:
    """The projection as of the start of the log, read as verify needs it: the row of each call
    the rest of the log touches (:meth:`seed`, as its first event comes), then every other call
    compared with its row in SQL order (:meth:`rows`); so only the calls the log touches are held.

    A call's row as of the start is its kept copy in calls_archived, else its row in calls when
    that row is from before the start (nothing moved it since), else none (a later call)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._start = sqlite_archived_head(conn)[0]
        self._seen: set[str] = set()

    def seed(self, folded: dict[str, CallRecord], call_id: str | None) -> None:
        """Put the archived record of ``call_id`` into ``folded`` before its first event is folded."""
        if call_id is None or call_id in self._seen:
            return
        self._seen.add(call_id)
        row = self._conn.execute(_KEPT, (call_id,)).fetchone()
        if row is not None:
            folded[call_id] = CallRecord(*_row(call_id, row[0]))
            return
        current = self._conn.execute(f"SELECT {_CURRENT} FROM calls c WHERE c.call_id = ? AND c.last_seq <= ?",
                                     (call_id, self._start)).fetchone()
        if current is not None:
            folded[call_id] = CallRecord(*current)

    def rows(self, folded: dict[str, CallRecord]) -> Iterator[tuple[Any, ...]]:
        """The projection rows to compare with ``folded``: those of the calls the log touched, those
        of the others that differ from their kept copy (whose record is put in ``folded``), and those
        that moved past the start with no event left to move them; a kept call with no projection
        row is put in ``folded`` too."""
        width = len(CALL_COLUMNS)
        for row in self._conn.execute(
            f"SELECT {_CURRENT}, a.record FROM calls c LEFT JOIN calls_archived a ON a.call_id = c.call_id "
            "ORDER BY c.call_id"
        ):
            current, record = row[:width], row[width]
            if current[0] in self._seen:
                yield current
                continue
            if record is None:
                if not (isinstance(current[15], int) and current[15] <= self._start):
                    yield current  # moved past the start by no event of the log
                continue
            archived = _row(current[0], record)
            if current != archived:
                folded[current[0]] = CallRecord(*archived)
                yield current
        gone = "NOT EXISTS (SELECT 1 FROM calls c WHERE c.call_id = a.call_id)"
        for call_id, record in self._conn.execute(f"SELECT call_id, record FROM calls_archived a WHERE {gone}"):
            folded.setdefault(call_id, CallRecord(*_row(call_id, record)))


def sqlite_commit(conn: sqlite3.Connection, plan: ArchivePlan, file: str, archived_at: str) -> int:
    """Inside the SQLite journal's write transaction: remove the events ``plan`` moves (a whole
    archive, or one step of it), keep the projection as of its last event, and record where the
    log now starts; returns how many events were removed.

    The first step of an archive records it (its file, and how far the file goes); each later one
    must follow the step before. The delete trigger is dropped, the events deleted and the trigger
    made again, all in this transaction: no other writer ever sees the log without it. Raises
    :class:`JournalError`, the transaction then undone, when the log is no longer the one planned from.
    """
    whole = plan.archive
    base = sqlite_archived_head(conn)
    if base != (plan.base_seq, plan.base_hash):
        raise StartMoved(f"another archive moved the start of the log to seq {base[0]} meanwhile; archive again")
    head = conn.execute("SELECT max(seq) FROM events").fetchone()[0] or 0
    for seq, digest in {(plan.last_seq, plan.last_hash), (whole.last_seq, whole.last_hash)}:
        found = conn.execute("SELECT hash FROM events WHERE seq = ?", (seq,)).fetchone()
        if seq >= head or found is None or found[0] != digest:
            raise JournalError(f"event seq {seq} is no longer the one archived; run verify")
    first = plan.base_seq == whole.base_seq
    if first:
        stopped = sqlite_unfinished(conn)
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
    conn.execute(schema.NO_DELETE_TRIGGER)
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
            kept.append(_row(call_id, found[0]))
    wanted = set(moved)
    events = (row for row in conn.execute(_STEP_EVENTS, (base_seq, last_seq)) if row[2] in wanted)
    conn.executemany(_UPSERT, [_stored(row) for row in fold_onto(kept, list(events))])


# -- PostgreSQL: a copy of every archived call's row --------------------------------------------------

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


def postgres_archived_head(conn: psycopg.Connection[tuple[Any, ...]]) -> tuple[int, str]:
    """The last archive's head in a PostgreSQL journal; ``(0, GENESIS)`` without one."""
    row = conn.execute(b"SELECT last_seq, last_hash FROM archives ORDER BY last_seq DESC LIMIT 1").fetchone()
    return (0, GENESIS) if row is None else (int(row[0]), str(row[1]))


# The PostgreSQL projection as of the last archive's head, by call id in binary order (rows of
# call_id and record: see snapshot_row).
POSTGRES_SNAPSHOT_BY_CALL = 'SELECT call_id, record FROM calls_archived ORDER BY call_id COLLATE "C"'


def snapshot_row(call_id: str, record: str) -> tuple[Any, ...]:
    """A projection row from a row of calls_archived (call_id and its record)."""
    return _row(call_id, record)


def postgres_commit(conn: psycopg.Connection[tuple[Any, ...]], plan: ArchivePlan, file: str,
                    archived_at: str) -> int:
    """Inside the PostgreSQL journal's write transaction, the chain head locked: as
    :func:`sqlite_commit`; the events are removed by ``airlock_archive_events``, which runs as the
    tables' owner and records the head."""
    base = postgres_archived_head(conn)
    if base != (plan.base_seq, plan.base_hash):
        raise StartMoved(f"another archive moved the start of the log to seq {base[0]} meanwhile; archive again")
    approvals.keep_as_of(conn, "%s", plan.base_seq, plan.last_seq)
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
