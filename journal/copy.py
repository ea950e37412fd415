"""Copy a journal to another store (SQLite to PostgreSQL, or back), preserving every ``seq`` and hash.

The stored events are inserted as they are, the projection is recomputed by the fold (replacing any
rows the destination's projection held), and the copy is verified: its chain must check and its
head must equal the source's. The destination is verified inside the import's transaction, before
it commits, so a copy that does not verify leaves it as it was. The destination must hold no
events; the source is only read. A destination the copy made (a new SQLite file, or the journal's
tables in a PostgreSQL database that held none) is removed again when the copy fails.

A source whose start is archived (``airlock journal archive``) is copied as it is: its archives'
records (the archived head), the projection as of that head (and the requests for approval as of
it), then the rest of the log, whose fold onto that projection is the copy's projection; so the
copy verifies alone, goes on from the same archives (``verify --export A1 ... --db COPY``), and
keeps every call's row, so that a retry of an archived call is still replayed or refused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from guard.store import CallRecord

from . import approvals, archive
from .errors import JournalError, JournalNotFound
from .events import JournalEvent, VerifyReport
from .open import open_journal
from .projection import fold_row, record_row
from .protocol import EventImporter, Journal

__all__ = ["CopyReport", "copy_from", "copy_journal", "import_events"]


@dataclass(frozen=True, slots=True)
class CopyReport:
    """What was copied: ``events``, ``calls`` (projection rows) and the ``head`` hash both share;
    ``archived``: the ``seq`` the source's log starts after (its archived head, kept in the copy),
    0 when nothing was archived."""

    events: int
    calls: int
    head: str
    archived: int = 0


def _bounded(events: Iterable[JournalEvent], last_seq: int,
             progress: Callable[[int], None] | None) -> Iterator[JournalEvent]:
    """The source's events up to ``last_seq`` (a writer's later events are not part of the copy)."""
    for event in events:
        if event.seq > last_seq:
            return
        yield event
        if progress is not None:
            progress(1)


def _check_chain(events: Iterable[JournalEvent]) -> Iterator[JournalEvent]:
    """Pass the events through, refusing one that does not follow the one before."""
    expected = 1
    for event in events:
        if event.seq != expected:
            raise JournalError(f"the source's seq {event.seq} follows seq {expected - 1}: events are missing")
        expected += 1
        yield event


def import_events(destination: Journal, events: Iterable[JournalEvent],
                  check: Callable[[VerifyReport], None] | None = None) -> int:
    """Insert stored ``events`` (in ``seq`` order from 1) into the empty journal ``destination`` as
    they are, and its projection folded from them, in one transaction; returns the number of calls.

    ``check`` is given the destination's verify report, and raises to refuse the copy: the
    destination is checked before its transaction commits, so a refused copy changes nothing.

    Raises :class:`JournalError` when the destination is not empty (nothing is changed then) or
    the events do not follow one another.
    """
    if not isinstance(destination, EventImporter):
        raise JournalError(f"cannot copy into {destination!r}: it is not a journal")
    return destination.import_events(_check_chain(events), check)


def copy_journal(
    source: str,
    destination: str,
    *,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> CopyReport:
    """Copy the journal at ``source`` (a path or URL, only read) into ``destination`` (created when
    missing, and it must hold no events), then verify the copy before the import commits, so a
    copy that does not verify leaves the destination as it was.

    ``on_total`` is told how many events will be copied, ``progress`` is called once per event.
    Raises :class:`JournalError` (and its kinds): a missing, foreign or broken source, a non-empty
    destination, or a copy that does not verify.
    """
    with open_journal(source, readonly=True, create=False) as src:
        return copy_from(src, destination, progress=progress, on_total=on_total)


def copy_from(
    src: Journal,
    destination: str,
    *,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> CopyReport:
    """Copy the open journal ``src`` into ``destination``, as :func:`copy_journal` does.

    The destination is opened only once the source verifies, so a :class:`JournalNotFound` raised
    here is about the destination.
    """
    checked = src.verify()
    if not checked.ok:
        raise JournalError(
            f"the source {_name(src)} does not verify (seq {checked.first_bad_seq}: {checked.problem}); "
            "it was not copied"
        )
    last_seq, head = src.head()
    start = _archived_head(src)
    if on_total is not None:
        on_total(last_seq - start)
    made = not _exists(destination)
    try:
        with open_journal(destination, create=True) as dst:
            # The destination is checked inside the import's transaction: refused, it is rolled back.

            def check(copied: VerifyReport) -> None:
                if not copied.ok or (copied.events, copied.head) != (last_seq - start, head):
                    raise JournalError(
                        f"the copy in {_name(dst)} does not verify: {copied.problem or 'its head differs'}"
                        "; it was rolled back, and the destination left as it was"
                    )

            if start:
                calls = _import_archived(src, dst, last_seq, head, progress, check)
            else:
                calls = import_events(dst, _bounded(src.events(), last_seq, progress), check)
    except BaseException:
        if made:
            _remove(destination)  # a failed copy leaves nothing behind, not even an empty journal
        raise
    return CopyReport(events=last_seq - start, calls=calls, head=head, archived=start)


def _archived_head(src: Journal) -> int:
    """The ``seq`` the log of ``src`` starts after (0: nothing archived)."""
    archived_head = getattr(src, "archived_head", None)
    return 0 if archived_head is None else int(archived_head()[0])


def _is_postgres(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


def _exists(destination: str) -> bool:
    """Whether a journal (or, for a path, any file) is already at ``destination``."""
    if not _is_postgres(destination):
        return os.path.lexists(destination)
    try:
        open_journal(destination, readonly=True, create=False).close()
    except JournalNotFound:
        return False
    except JournalError:
        return True  # something is there (an older journal, say): never removed
    return True


def _remove(destination: str) -> None:
    """Take away the journal a failed copy made at ``destination``: the SQLite file and the files
    SQLite keeps beside it, or the journal's tables and functions in a PostgreSQL database (only
    while its log is empty). Best effort: the copy's own error is what is raised."""
    if not _is_postgres(destination):
        for name in (destination, f"{destination}-wal", f"{destination}-shm", f"{destination}-journal"):
            with contextlib.suppress(OSError):
                os.unlink(name)
        return
    from .postgres.schema import TABLES

    def drop(conn: Any) -> None:
        conn.execute(b"LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
        if conn.execute(b"SELECT EXISTS (SELECT 1 FROM events)").fetchone() != (False,):
            return  # someone began to use it meanwhile: left as it is
        conn.execute(f"DROP TABLE IF EXISTS {', '.join(TABLES)} CASCADE".encode())
        conn.execute(b"DROP FUNCTION IF EXISTS airlock_events_append_only() CASCADE")
        conn.execute(b"DROP FUNCTION IF EXISTS airlock_archive_events(bigint, bigint, text, text, text)")

    with contextlib.suppress(JournalError), open_journal(destination, create=False) as made:
        made._write("remove the journal a failed copy made", drop, pipeline=False, retry=False)  # type: ignore[attr-defined]


def _import_archived(src: Journal, dst: Journal, last_seq: int, head: str,
                     progress: Callable[[int], None] | None, check: Callable[[VerifyReport], None]) -> int:
    """Copy the archived journal ``src`` into the empty ``dst``: its archives' records, the
    projection and the requests as of its archived head, then its events up to ``last_seq``
    (stored rows, as they are), the projection their fold onto the archived one; verified by
    ``check`` before the transaction commits. Returns the number of calls."""
    records = archive.recorded_archives(src)
    snapshot = archive.archived_projection(src)
    requests = archive.archived_requests(src)
    folded = {call_id: CallRecord(*row) for call_id, row in snapshot.items()}
    touched: dict[str, tuple[Any, ...]] = {}  # the archived rows of the calls the rest of the log moves
    start = _archived_head(src)
    if not records or records[-1].last_seq != start:
        raise JournalError(f"the source {_name(src)} records no archive ending at seq {start}, where its log starts; "
                           "run verify")

    def rows() -> Iterator[tuple[Any, ...]]:
        expected, prev = start + 1, records[-1].last_hash
        for row in src.event_rows(after_seq=start):
            if row[0] > last_seq:
                break
            if row[0] != expected or row[14] != prev:
                raise JournalError(f"the source's seq {row[0]} does not follow seq {expected - 1}; run verify")
            call_id = row[2]
            if call_id is not None and call_id in snapshot and call_id not in touched:
                touched[call_id] = snapshot[call_id]
            fold_row(folded, row)
            expected, prev = expected + 1, row[15]
            yield tuple(row)
            if progress is not None:
                progress(1)

    if archive._store(dst) == "sqlite":
        return _into_sqlite(dst, records, snapshot, touched, requests, rows(), folded, check)
    if archive._store(dst) == "postgres":
        return _into_postgres(dst, records, snapshot, requests, rows(), folded, last_seq, head, check)
    raise JournalError(f"cannot copy an archived journal into {_name(dst)}")


_TABLES_FIRST = ("calls", "calls_archived", "approvals", "approvals_archived", "archives")


def _into_sqlite(dst: Journal, records: list[archive.ArchiveRecord], snapshot: dict[str, tuple[Any, ...]],
                 touched: dict[str, tuple[Any, ...]], requests: list[tuple[str, str]],
                 rows: Iterator[tuple[Any, ...]], folded: dict[str, CallRecord],
                 check: Callable[[VerifyReport], None]) -> int:
    """The copy of an archived journal into the empty SQLite journal ``dst``, in one transaction.
    Its projection as of the archived head is kept copy-on-write, as an archive keeps it: a copy
    in calls_archived of each call the rest of the log moves, every other call's row its own."""
    import sqlite3

    from .sqlite.connection import _FULL
    from .sqlite.sql import _INSERT_EVENT, _UPSERT_CALL

    def step(conn: sqlite3.Connection) -> int:
        if conn.execute("SELECT EXISTS (SELECT 1 FROM events)").fetchone()[0]:
            raise JournalError(f"the destination {_name(dst)} is not empty; copy only into a new journal")
        for table in _TABLES_FIRST:  # rows left with no log (calls first: no archive yet, no copy taken)
            conn.execute(f"DELETE FROM {table}")
        conn.executemany(
            "INSERT INTO archives (last_seq, last_hash, events, archived_at, file, upto_seq, upto_hash) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(a.last_seq, a.last_hash, a.events, a.archived_at, a.file, a.upto_seq, a.upto_hash) for a in records])
        conn.executemany(_INSERT_EVENT, rows)
        conn.executemany("INSERT INTO calls_archived (call_id, record) VALUES (?, ?)",
                         [archive.stored_copy(row) for row in touched.values()])
        conn.executemany(_UPSERT_CALL, (record_row(record) for record in folded.values()))
        conn.executemany("INSERT INTO approvals_archived (request_id, request) VALUES (?, ?)", requests)
        approvals.rebuild(conn, "?")
        calls = len(folded)
        folded.clear()  # the check folds the log again: one fold in memory at a time
        snapshot.clear()
        check(dst._verified_log(conn))  # type: ignore[attr-defined]  # raises to refuse: undone
        return calls

    return dst._write(_FULL, step)  # type: ignore[attr-defined,no-any-return]


def _into_postgres(dst: Journal, records: list[archive.ArchiveRecord], snapshot: dict[str, tuple[Any, ...]],
                   requests: list[tuple[str, str]], rows: Iterator[tuple[Any, ...]], folded: dict[str, CallRecord],
                   last_seq: int, head: str, check: Callable[[VerifyReport], None]) -> int:
    """The copy of an archived journal into the empty PostgreSQL journal ``dst``, in one
    transaction; it keeps a copy of every archived call's row, as a PostgreSQL archive does."""
    from .postgres.sql import _LOCK_HEAD, _SET_HEAD, _UPSERT_CALL
    from .rows import EVENT_COLUMNS

    def work(conn: Any) -> int:
        seq = (conn.execute(_LOCK_HEAD.encode()).fetchone() or (0,))[0]
        if seq or conn.execute(b"SELECT EXISTS (SELECT 1 FROM events)").fetchone() != (False,):
            raise JournalError(f"the destination {_name(dst)} is not empty; copy only into a new journal")
        for table in _TABLES_FIRST:
            conn.execute(f"DELETE FROM {table}".encode())
        with conn.cursor() as cur:
            cur.executemany(b"INSERT INTO archives (last_seq, last_hash, events, archived_at, file) "
                            b"VALUES (%s, %s, %s, %s, %s)",
                            [(a.last_seq, a.last_hash, a.events, a.archived_at, a.file) for a in records])
            cur.executemany(b"INSERT INTO calls_archived (call_id, record) VALUES (%s, %s)",
                            [archive.stored_copy(row) for row in snapshot.values()])
            cur.executemany(b"INSERT INTO approvals_archived (request_id, request) VALUES (%s, %s)", requests)
        with conn.cursor().copy(f"COPY events ({', '.join(EVENT_COLUMNS)}) FROM STDIN".encode()) as copy:
            for row in rows:
                copy.write_row(row)
        with conn.cursor() as cur:
            cur.executemany(_UPSERT_CALL.encode(), [record_row(record) for record in folded.values()])
        approvals.rebuild(conn, "%s")
        conn.execute(_SET_HEAD.encode(), (last_seq, head))
        conn.execute(b"UPDATE chain_head SET generation = generation + 1 WHERE id = 1")
        calls = len(folded)
        folded.clear()
        snapshot.clear()
        check(dst._verify(conn))  # type: ignore[attr-defined]  # before the commit: refused, nothing stays
        return calls

    # Not retried: the events are consumed as they are copied.
    return dst._write("copy events", work, pipeline=False, retry=False)  # type: ignore[attr-defined,no-any-return]


def _name(journal: Journal) -> str:
    """The journal for a message: a SQLite file's path, a PostgreSQL journal's URL without its password."""
    name = getattr(journal, "name", None)  # a PostgreSQL journal's; a SQLite journal is named by its path
    return name if isinstance(name, str) else str(getattr(journal, "path", journal))
