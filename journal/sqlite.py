"""The SQLite journal: an EffectStore on one file that processes on one host share.

Writes run in ``BEGIN IMMEDIATE`` transactions on a WAL database; the event insert and the
projection update share one. The transactions of a guarded call commit with ``synchronous=NORMAL``.
With ``durability="full"``, ``begin`` then waits, before it lets the tool run, until the WAL file has
been fsynced after that commit: the first waiting thread fsyncs it for every commit made so far while
the others wait for it (group commit), so a guarded call costs one fsync, and calls made at the same
time by several threads share one. Every other event becomes durable with the next fsync.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import hashlib
import os
import re
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import orjson

from guard.canonical import NotCanonical
from guard.leases import OwnerState, Settle
from guard.store import CallRecord, Decide, Decision, EffectEvent, apply, parse_at

from . import archive, damage, schema, sqlite_verify, verifying
from .chain import GENESIS, compute_hash
from .errors import (
    DiskFull,
    JournalDamaged,
    JournalError,
    JournalNotFound,
    NewerSchema,
    NotAJournal,
    StoreBusy,
    unstorable,
)
from .events import JournalEvent, JournalStats, VerifyReport, at_text, text_sha256
from .export import check_redact, csv_header, csv_lines, jsonl_lines, one_line_each
from .leasing import SWEEP_EVERY, owner_state, unclaimable
from .projection import fold_into
from .reading import LogReads, call_filter, event_filter, page
from .reconcile import Reconciling
from .rows import event_from_row, holds, json_text, operator_event, record_from_row

__all__ = ["SQLiteJournal"]

T = TypeVar("T")
Durability = Literal["full", "process"]

_FULL, _NORMAL = "FULL", "NORMAL"
# What SQLite itself syncs the WAL with where it can: the data, and the metadata needed to read it.
_fdatasync = getattr(os, "fdatasync", os.fsync)
_BUSY_CODES = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
_BATCH = 1000
_ADVANCE_EVERY = 10_000  # events between two calls of a progress callback
_EXPORT_BYTES = 1 << 20  # about a megabyte of lines a batch
_CHECKPOINT_PAGES = 4000
# A group commit's fsync still under way after this many seconds is made again by a thread waiting
# for it: the thread that started it may have been interrupted before it could say it was done.
_SYNC_STALE = 1.0
_WAL_KEEP = 16 * 1024 * 1024
# Connections inherited through fork are never used or closed in the child (closing one could
# checkpoint and delete a WAL that the parent still writes); they are parked here instead.
_INHERITED: list[sqlite3.Connection] = []
_FORKS = [0]  # how many forks this process descends from: a change means the connection was inherited


def _held(lock: threading.RLock) -> int:
    """How many times the calling thread holds ``lock`` (0: not at all)."""
    count: int = cast(Any, lock)._recursion_count()
    return count


def _settle(conn: sqlite3.Connection) -> None:
    """End a transaction that an interrupt (KeyboardInterrupt, an exception from a signal handler)
    left open on ``conn``, holding the file's write lock, before the connection is used again."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


_JOURNALS: weakref.WeakSet[SQLiteJournal] = weakref.WeakSet()  # this process's open journals
_HELD_FOR_FORK: list[threading.RLock] = []


def _before_fork() -> None:
    # No connection of this process to a journal may cross a fork. SQLite keeps, per process, a
    # record of the locks it holds on each file; a child inheriting it while the locks themselves
    # (POSIX locks, never inherited) stay with the parent would take its own connections' locks
    # for held, and another process could then check the WAL into the file and delete it under
    # the child's commits. So each journal lets go of its connection, between transactions (its
    # lock held), and opens a new one when it is next used, in the parent and in the child alike.
    for journal in sorted(_JOURNALS, key=id):
        lock = journal._lock
        if lock.acquire(timeout=journal.busy_timeout):
            _HELD_FOR_FORK.append(lock)
            journal._let_go()


def _after_fork_in_parent() -> None:
    while _HELD_FOR_FORK:
        _HELD_FOR_FORK.pop().release()


def _inode(path: str) -> int | None:
    """The inode of the file at ``path``, or None when there is none."""
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _sync_directory(path: str) -> None:
    """fsync a directory, so the names made in it survive a power loss (where the OS allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a directory that cannot be opened for it (some platforms): as SQLite does, go on
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse to fsync a directory; the file's own fsync still follows
    finally:
        os.close(fd)


def _forked() -> None:
    _FORKS[0] += 1
    _HELD_FOR_FORK.clear()
    for journal in list(_JOURNALS):
        # The parent's locks and queue may be held, or filled, by threads the child lacks; an fsync
        # a parent thread was making is not the child's to wait for.
        journal._lock = threading.RLock()
        journal._requests = collections.deque()
        fd = journal._wal_fd
        journal._reset_group()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # the child's own copy of the descriptor; the parent's stays open


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_forked)

_EVENT_COLUMNS = ("seq, at, call_id, kind, tool, agent_id, idempotency_key, arguments, value, error, reason, "
                  "actor, attempt, owner, prev_hash, hash")
_CALL_COLUMNS = ("call_id, tool, status, attempt, agent_id, idempotency_key, arguments, value, error, reason, "
                 "actor, owner, created_at, updated_at, since, last_seq")
_INSERT_EVENT = f"INSERT INTO events ({_EVENT_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
_UPSERT_CALL = (
    f"INSERT INTO calls ({_CALL_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
    "ON CONFLICT (call_id) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _CALL_COLUMNS.split(", ")[1:])
)
_SELECT_CALL = f"SELECT {_CALL_COLUMNS} FROM calls WHERE call_id = ?"
_TAKE_LEASE = ("INSERT INTO leases (call_id, holder, expires_at) VALUES (?, ?, ?) "
               "ON CONFLICT (call_id, holder) DO UPDATE SET expires_at = excluded.expires_at")
_RENEW_LEASE = "UPDATE leases SET expires_at = ? WHERE call_id = ? AND holder = ?"
_DROP_LEASE = "DELETE FROM leases WHERE call_id = ? AND holder = ?"
_LEASES_OF = "SELECT holder, expires_at FROM leases WHERE call_id = ?"
_LATEST_LEASE = "SELECT max(expires_at) FROM leases WHERE call_id = ?"
_SWEEP_LEASES = ("DELETE FROM leases WHERE expires_at < ? AND call_id NOT IN "
                 "(SELECT call_id FROM calls WHERE status = 'pending')")
_SELECT_HEAD = "SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1"
_SELECT_RECENT = (
    f"SELECT {_CALL_COLUMNS} FROM calls WHERE idempotency_key = ? AND created_at >= ? AND agent_id IS ? "
    "AND status != 'released' ORDER BY created_at DESC, call_id DESC LIMIT 1"
)
# The head of the log and the call's row in one round trip: the read of every write transaction.
_SELECT_HEAD_AND_CALL = (
    "SELECT (SELECT seq FROM events ORDER BY seq DESC LIMIT 1), (SELECT hash FROM events ORDER BY seq DESC LIMIT 1), "
    + ", ".join(f"calls.{c}" for c in _CALL_COLUMNS.split(", "))
    + " FROM (SELECT 1) LEFT JOIN calls ON calls.call_id = ?"
)


class _Request:
    """One thread's write (``step``, run in a transaction at NORMAL), and what came of it."""

    __slots__ = ("abandoned", "deadline", "done", "error", "forks", "result", "staged", "staged_in", "step",
                 "ticket")

    def __init__(self, step: Callable[[sqlite3.Connection], Any], deadline: float) -> None:
        self.step = step
        self.deadline = deadline  # the busy deadline counts from when the thread asked, not from its turn
        self.forks = _FORKS[0]
        self.done = False
        self.abandoned = False  # its thread left (interrupted) before the write was taken on: never made
        self.result: Any = None
        self.error: BaseException | None = None
        self.ticket = 0
        self.staged: Any = None  # what step returned in the transaction numbered staged_in
        self.staged_in = 0

    def run(self, journal: SQLiteJournal, conn: sqlite3.Connection) -> Any:
        result = self.step(conn)
        self.staged, self.staged_in = result, journal._txn
        return result


class _StepFailed(Exception):
    """A write of a batch raised (its ``__cause__``): the batch is undone and made write by write."""


def _step_of(journal: SQLiteJournal, request: _Request, conn: sqlite3.Connection) -> Any:
    try:
        return request.run(journal, conn)
    except Exception as e:
        raise _StepFailed() from e


def _fetch_all(conn: sqlite3.Connection, sql: str, params: Sequence[Any]) -> list[Any]:
    return conn.execute(sql, params).fetchall()


def _busy(e: sqlite3.Error) -> bool:
    return (getattr(e, "sqlite_errorcode", 0) & 0xFF) in _BUSY_CODES


# Python's sqlite3 reading a stored text that is not UTF-8 (bytes of the file overwritten); the
# message goes on with the damaged bytes, and is cut short when the column is an expression.
_UNDECODABLE = "Could not decode to UTF-8 column '"
_COLUMN = re.compile(r"Could not decode to UTF-8 column '(\w+)' with text")


def _failure(path: object, e: sqlite3.Error) -> str:
    """The message of a failure of the journal at ``path``: SQLite's own, except for a stored text
    that cannot be decoded, whose message would quote the damaged bytes."""
    if _UNDECODABLE not in str(e):
        return f"The journal {path} failed: {e}."
    column = _COLUMN.search(str(e))
    where = f"the column {column.group(1)!r}" if column else "a column of its events or calls"
    return (f"The journal {path} holds a text that is not UTF-8 in {where}: the file is damaged; "
            "restore it from a copy, or read what is left with a tool that takes bytes.")


def _plain(obj: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return obj if obj is None or type(obj) is dict else dict(obj)


def _head_and_record(conn: sqlite3.Connection, call_id: str | None) -> tuple[tuple[int, str], CallRecord | None]:
    """Inside a write transaction: the log's (seq, hash) head and the current record of ``call_id``."""
    row = conn.execute(_SELECT_HEAD_AND_CALL, (call_id,)).fetchone()
    head = (0, GENESIS) if row[0] is None else (row[0], row[1])
    if row[2] is None:
        return head, None
    try:
        return head, record_from_row(row[2:])
    except (ValueError, TypeError) as e:
        raise JournalError(f"The stored record of the call {call_id!r} cannot be read ({e}); run verify.") from e


def _call_row(record: CallRecord, known: dict[int, str | None] | None = None) -> tuple[Any, ...]:
    """The projection row of ``record``; ``known`` maps id() of objects already turned into text
    (the event's ``at``, ``error``, ``reason`` and ``owner``) to that text, so it is not redone."""
    known = known or {}

    def text(obj: Mapping[str, Any] | None) -> str | None:
        return known[id(obj)] if id(obj) in known else json_text(obj)

    def when(t: datetime) -> str:
        done = known.get(id(t))
        return done if done is not None else at_text(t)

    return (
        record.call_id, record.tool, record.status, record.attempt, record.agent_id, record.idempotency_key,
        record.arguments, record.value, text(record.error), text(record.reason), record.actor,
        text(record.owner), when(record.created_at), when(record.updated_at), when(record.since),
        record.last_seq,
    )


def _event_filter(
    call_id: str | None, tool: str | None, agent_id: str | None, since: datetime | None,
    until: datetime | None, after_seq: int,
) -> tuple[str, list[Any]]:
    clauses, params = event_filter("?", True, call_id, tool, agent_id, since, until)
    return " AND ".join(["seq > ?", *clauses]), [after_seq, *params]  # params[0]: the keyset cursor of events()


class SQLiteJournal(LogReads, Reconciling):
    """An :class:`~guard.store.EffectStore` on a SQLite file, with the operator's reads and repairs.

    Args:
        path: the journal file; created (mode 0600) when missing unless ``create=False`` or ``readonly``.
        durability: ``"full"`` fsyncs ``pending`` before the tool runs (survives power loss);
            ``"process"`` survives a crash of the process only, and is faster.
        busy_timeout: seconds a write waits for the lock before :class:`StoreBusy`.
        readonly: open without creating or changing anything; writes raise :class:`JournalError`.
        create: make the journal when the file does not exist.

    Raises :class:`JournalNotFound` (no file, and it may not be created), :class:`NotAJournal`
    (a foreign file), :class:`NewerSchema`; in the last two cases the file is left unchanged.
    One object is safe to share between threads; after a fork the child opens its own connection.
    """

    #: Set it true (on the object or a subclass) to have ``async def`` tools make this journal's
    #: writes in the guard's pool of threads, off the loop, so that the loop runs on while a write waits
    #: for another writer's lock. Off by default: each trip costs some 70-90 µs.
    offload_async = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        durability: Durability = "full",
        busy_timeout: float = 30.0,
        *,
        readonly: bool = False,
        create: bool = True,
    ) -> None:
        if durability not in ("full", "process"):
            raise ValueError(f"durability is 'full' or 'process', not {durability!r}")
        if isinstance(busy_timeout, bool) or not isinstance(busy_timeout, int | float) or not busy_timeout >= 0:
            raise ValueError(f"busy_timeout is a number of seconds, 0 or more, not {busy_timeout!r}")
        if str(path) == ":memory:" or str(path).startswith("file:"):
            raise ValueError(f"SQLiteJournal takes the path of a file, not {str(path)!r}")
        self.path = Path(path)
        # The file itself, for every open and the WAL's fsync: wherever the cwd moves, and past a
        # symbolic link (SQLite keeps the WAL beside the file the link points to).
        self._file = Path(os.path.realpath(path))
        self._wal_path = f"{self._file}-wal"
        self._mark = str(damage.mark_path(self._file))  # where a damage found is marked
        self.durability: Durability = durability
        self.busy_timeout = float(busy_timeout)
        self.readonly = readonly
        self._create = create
        self._lock = threading.RLock()
        self._requests: collections.deque[_Request] = collections.deque()  # writes waiting for the lock
        self._sync: str | None = None
        self._owner: tuple[object, str | None] = (object(), None)
        self._arguments: tuple[str | None, str | None] = (None, None)
        self._reset_group()
        self._closed = False
        self._taken = 0  # leases taken by this object, for the sweep of those run out
        self._damaged: str | None = None  # what SQLite said when this object found the file damaged
        self._archive: tuple[int, int, int, bool] | None = None  # the file as a read-only open found it
        self._tidy: int | None = None  # the inode of a file whose side files a read-only open made
        self._first_open = True
        self._txn = 0  # write transactions begun, numbered
        self._committing = 0  # the one whose COMMIT was sent
        self._committed = 0  # the last one known committed
        self._counted = 0  # the last one counted in _written
        self._conns = 0  # connections opened, numbered: the WAL descriptor belongs to one of them
        self._conn: sqlite3.Connection | None = self._open()
        self._conns = 1
        self._stale = False  # the connection lost its WAL: open a new one
        self._first_open = False
        self._forks = _FORKS[0]
        _JOURNALS.add(self)

    # -- opening -------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        path, file = self.path, self._file
        if self.readonly:
            if not file.exists():
                raise self._not_found()
            kind = self._check(self._inspect(), blank_ok=False)
            if kind.version < schema.READABLE_FROM:
                raise JournalError(
                    f"The journal {path} has schema version {kind.version} and needs migrating to "
                    f"{schema.LATEST}; open it once for writing."
                )
            uri = schema.reader_uri(file)
            # Read as an archive (immutable): the file as it is now, which a writer must not change.
            self._archive = schema.signature(file) if uri.endswith("immutable=1") else None
            if self._archive is None:
                self._check_room()
            if self._first_open:  # whether reading makes the side files (see close)
                sides = any(os.path.lexists(f"{file}{side}") for side in ("-wal", "-shm"))
                self._tidy = None if sides or self._archive is not None else os.stat(file).st_ino
            conn = self._connect(uri, uri=True)
            self._sync = _NORMAL
            return conn
        if not file.exists():
            if not self._create:
                raise self._not_found()
            self._check_room()
            try:
                os.close(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except FileExistsError:
                # Another process made it first, and it is inspected like any existing file; or the
                # name is a link that leads to no file, which no journal can be made behind.
                if not file.exists():
                    raise self._not_found() from None
            except OSError as e:
                raise JournalError(f"Cannot create the journal {path}: {e.strerror}.") from e
        if not os.access(file, os.R_OK | os.W_OK):
            raise JournalError(f"Cannot write the journal {path}: permission denied; open it with readonly=True "
                               "to read it.")
        # Inspect through a read-only connection first, so a foreign file is never written to.
        kind = self._check(self._inspect(), blank_ok=self._create)
        self._check_room()
        conn = self._connect(str(file))
        try:
            if kind.kind == "blank":
                # Before the WAL makes the file's header: the pages an archive frees can then be given
                # back in small steps (PRAGMA incremental_vacuum); an older file needs a VACUUM for it.
                self._retry(conn, lambda: conn.execute("PRAGMA auto_vacuum = INCREMENTAL"))
            self._retry(conn, lambda: conn.execute("PRAGMA journal_mode = WAL"))
            # A guarded call dirties about ten pages; checkpointing (two fsyncs) every 1000 pages, as
            # SQLite does by default, would cost more than the call's own fsync. The WAL is cut back
            # to _WAL_KEEP bytes after each checkpoint.
            self._retry(conn, lambda: conn.execute(f"PRAGMA wal_autocheckpoint = {_CHECKPOINT_PAGES}"))
            self._retry(conn, lambda: conn.execute(f"PRAGMA journal_size_limit = {_WAL_KEEP}"))
            self._sync = None
            if kind.kind != "journal" or kind.version < schema.LATEST:
                # Made or migrated under the write lock; a journal already at the latest version
                # needs no write to open (nor the lock, which another process may be holding).
                self._transaction(conn, _NORMAL, self._initialise)
        except BaseException:
            conn.close()
            raise
        return conn

    def _not_found(self) -> JournalError:
        if os.path.islink(self.path):  # there is a name, but it leads to no file
            return JournalError(f"The journal {self.path} is a symbolic link that leads to no file "
                                "(its target is gone, or the links go round in a loop).")
        return JournalNotFound(f"There is no journal at {self.path}.")

    def _check_room(self) -> None:
        """Refuse to open on a full disk before SQLite makes its -wal and -shm files beside the
        journal: made on a disk without room, they are left there, empty and cut short."""
        if not os.path.exists(f"{self._file}-shm") and schema.no_room(self._file):
            raise self._disk_full()

    def _disk_full(self) -> DiskFull:
        return DiskFull(f"The disk holding the journal {self.path} is full: free some space and try again "
                        "(nothing was changed).")

    def _inspect(self) -> schema.FileKind:
        try:
            return schema.inspect(self._file, self.busy_timeout)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise self._disk_full() from e
            raise JournalError(f"Cannot read the journal {self.path}: {e.strerror}.") from e
        except sqlite3.Error as e:
            raise StoreBusy(
                f"The journal {self.path} stayed locked by another process for {self.busy_timeout:g} s."
            ) from e

    def _check(self, kind: schema.FileKind, blank_ok: bool) -> schema.FileKind:
        if kind.kind == "foreign":
            raise NotAJournal(f"The file {self.path} {kind.why}, not an airlock journal; it was left unchanged.")
        if kind.kind == "blank" and not blank_ok:
            raise NotAJournal(f"The file {self.path} is an empty database, not an airlock journal.")
        if kind.version > schema.LATEST:
            raise NewerSchema(
                f"The journal {self.path} has schema version {kind.version}, newer than this version of "
                f"airlock-journal understands ({schema.LATEST}); it was left unchanged."
            )
        return kind

    def _initialise(self, conn: sqlite3.Connection) -> None:
        # Checked again under the write lock: another process may have made or changed it meanwhile.
        kind = self._check(schema.read_kind(conn), blank_ok=self._create)
        if kind.kind == "blank" or kind.version < schema.LATEST:
            schema.migrate(conn, kind.version)

    def _connect(self, target: str, uri: bool = False) -> sqlite3.Connection:
        try:
            with schema.OPENING:
                conn = sqlite3.connect(
                    target, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False, uri=uri
                )
        except sqlite3.Error as e:
            raise JournalError(f"Cannot open the journal {self.path}: {e}.") from e
        return conn

    # -- transactions --------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._closed:
            raise JournalError(f"The journal {self.path} is closed.")
        if _FORKS[0] != self._forks:  # first use in a forked child
            if self._conn is not None:  # not let go of before the fork (its lock stayed busy)
                _INHERITED.append(self._conn)
                self._conn = None
            self._forks = _FORKS[0]
        conn = self._conn
        if conn is not None and (self._stale or (
            self._archive is not None and schema.signature(self._file) != self._archive
        )):
            # Its WAL was taken away under it; or, opened as an archive, the file has been written
            # since: open it again (the ordinary way, if it can be).
            self._conn = None
            with contextlib.suppress(sqlite3.Error):
                conn.close()
            conn = None
        if conn is None:
            self._stale = False
            self._sync = None
            conn = self._conn = self._open()  # kept only once opened: a failure is tried again next time
            self._conns += 1
        return conn

    def _let_go(self) -> None:
        """Close this process's connection (between transactions); the next use opens a new one."""
        conn = self._conn
        if conn is not None and not self._closed and _FORKS[0] == self._forks:
            self._conn = None
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def _retry(self, conn: sqlite3.Connection, step: Callable[[], T]) -> T:
        """Run ``step`` until it is not refused by a lock, within the busy deadline."""
        deadline = time.monotonic() + self.busy_timeout
        waited = False
        try:
            while True:
                try:
                    return step()
                except sqlite3.Error as e:
                    waited = self._wait(conn, e, deadline)
        finally:
            if waited:
                self._restore_busy_timeout(conn)

    def _restore_busy_timeout(self, conn: sqlite3.Connection) -> None:
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        except sqlite3.Error as e:
            raise JournalError(f"The journal {self.path} failed: {e}.") from e

    def _wait(self, conn: sqlite3.Connection, e: sqlite3.Error, deadline: float) -> bool:
        """After ``e``: raise it as a JournalError, or StoreBusy past the deadline, or wait a little
        and return True (the connection's busy timeout is then shortened to what is left)."""
        if not _busy(e):
            if self.readonly and "malformed" in str(e) and schema.reader_uri(self._file).endswith("immutable=1"):
                raise JournalError(
                    f"The journal {self.path} changed while it was read as a read-only archive (nothing can "
                    f"be locked in its directory, so a writer is not seen): read it again ({e})."
                ) from e
            if schema.full_disk_error(self._file, e):
                raise self._disk_full() from e
            if damage.damaged(e):
                raise self._found_damaged(e) from e
            raise JournalError(_failure(self.path, e)) from e
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreBusy(
                f"The journal {self.path} stayed locked by another writer for {self.busy_timeout:g} s."
            ) from e
        # SQLite's own wait can be cut short (a WAL being recovered): wait only what is left.
        try:
            conn.execute(f"PRAGMA busy_timeout = {max(1, int(remaining * 1000))}")
        except sqlite3.Error as shortening:
            raise JournalError(f"The journal {self.path} failed: {shortening}.") from shortening
        time.sleep(min(0.001, remaining))
        return True

    def _found_damaged(self, e: sqlite3.Error) -> JournalDamaged:
        """Mark the file damaged, for this object and (with the mark beside it) every process."""
        self._damaged = str(e)
        damage.mark(self._file, str(e))
        return self._damaged_error(str(e))

    def _damaged_error(self, problem: str) -> JournalDamaged:
        if _UNDECODABLE in problem:  # that message says the file is damaged, and what to do
            return JournalDamaged(_failure(self.path, sqlite3.DatabaseError(problem)))
        return JournalDamaged(f"The journal {self.path} is damaged ({problem}). It refuses writes until it is "
                              "restored (see the runbook).")

    def _refuse_if_damaged(self) -> None:
        problem = self._damaged or damage.marked(self._mark)
        if problem is not None:
            raise self._damaged_error(problem)

    def _transaction(
        self, conn: sqlite3.Connection, sync: str, body: Callable[[sqlite3.Connection], T],
        deadline: float | None = None,
    ) -> T:
        """Run ``body`` in one ``BEGIN IMMEDIATE`` transaction committed at ``sync``, retrying on locks
        until ``deadline`` (default: the busy timeout from now).

        Every sqlite3 error leaves as a :class:`JournalError`; a journal known to be damaged raises
        :class:`JournalDamaged` and writes nothing.
        """
        if self.readonly:
            raise JournalError(f"The journal {self.path} is open read-only.")
        self._refuse_if_damaged()
        now = time.monotonic()
        waited = False
        if deadline is None:
            deadline = now + self.busy_timeout
        elif deadline - now < self.busy_timeout - 0.01:
            # Part of the wait is spent already (in this process's queue): SQLite waits only the rest,
            # and at least one attempt is made.
            waited = True
            try:
                conn.execute(f"PRAGMA busy_timeout = {max(0, int((deadline - now) * 1000))}")
            except sqlite3.Error as e:
                raise JournalError(f"The journal {self.path} failed: {e}.") from e
        try:
            while True:
                try:
                    _settle(conn)
                    if self._sync != sync:
                        self._sync = None  # unknown until the PRAGMA has run, should it be interrupted
                        conn.execute(f"PRAGMA synchronous = {sync}")
                        self._sync = sync
                    self._txn += 1
                    txn = self._txn
                    try:
                        conn.execute("BEGIN IMMEDIATE")
                        result = body(conn)
                        self._committing = txn
                        conn.execute("COMMIT")
                    except BaseException as e:
                        if conn.in_transaction:
                            conn.execute("ROLLBACK")
                        elif self._committing == txn and not isinstance(e, sqlite3.Error):
                            # COMMIT ran, and an interrupt came as it returned: it is made all the same.
                            self._committed = txn
                        raise
                    self._committed = txn
                    return result
                except sqlite3.Error as e:
                    waited = self._wait(conn, e, deadline)
        finally:
            if waited:
                self._restore_busy_timeout(conn)

    def _write(self, sync: str, body: Callable[[sqlite3.Connection], T]) -> T:
        lock = self._lock
        depth = _held(lock)
        try:
            if not lock.acquire(timeout=self.busy_timeout):
                raise self._own_lock_busy()
            return self._transaction(self._connection(), sync, body)
        finally:
            # Released by what this thread holds, not by whether acquire() returned: an interrupt can
            # come as it returns, before anything else runs.
            if _held(lock) > depth:
                lock.release()

    def _own_lock_busy(self) -> StoreBusy:
        return StoreBusy(f"The journal {self.path} stayed busy with another thread's work for "
                         f"{self.busy_timeout:g} s.")

    def _combined(self, step: Callable[[sqlite3.Connection], T]) -> tuple[T, int]:
        """Run ``step`` in a write transaction at NORMAL; returns its result and the commit's ticket
        for :meth:`_wait_durable`.

        The writes of threads that wait for the lock meanwhile are made by whichever of them gets
        it first, all in one transaction: so threads that write at once share a commit, and the
        pages it writes, as well as the fsync. If one of them fails, that transaction is undone
        and each write is made again in a transaction of its own, so that only the failing one
        raises, in its own thread. Each thread returns only after the commit that holds its write.
        """
        request = _Request(step, time.monotonic() + self.busy_timeout)
        lock = self._lock
        depth = _held(lock)
        self._requests.append(request)
        try:
            if not lock.acquire(timeout=self.busy_timeout):
                try:
                    self._requests.remove(request)
                except ValueError:  # the thread holding the lock has taken it on: it is being made
                    lock.acquire()
                else:
                    raise self._own_lock_busy()
            if not request.done:  # not made by another thread (or handed back by an interrupted one)
                self._run_requests(request)
        except BaseException:
            # Interrupted while it waited (KeyboardInterrupt, an exception from a signal handler):
            # the write is not made later for a caller that has gone. One another thread has taken
            # on may be made all the same, as when the interrupt comes just after its commit.
            request.abandoned = True
            with contextlib.suppress(ValueError):
                self._requests.remove(request)
            raise
        finally:
            if _held(lock) > depth:  # see _write
                lock.release()
        if request.error is not None:
            raise request.error
        return request.result, request.ticket

    def _run_requests(self, own: _Request) -> None:
        """Under the lock: make every waiting write, in one transaction when they all succeed.

        ``own`` is the calling thread's write: an interrupt of this thread (KeyboardInterrupt, an
        exception from a signal handler) fails it, and hands the writes of the other threads that
        its transaction did not make back to the queue, for their threads to make.
        """
        batch: list[_Request] = []
        requests = self._requests
        try:
            conn = self._connection()  # a failure to open it fails this thread's write; the others wait
            while requests:
                request = requests.popleft()
                if request.abandoned:
                    request.done = True  # its thread has gone: nobody waits for it
                elif request.forks == _FORKS[0]:  # a write queued before a fork is the parent's to make
                    batch.append(request)
            if not own.done and own not in batch:  # handed back and taken again: made here, never lost
                batch.append(own)
            if len(batch) > 1:
                try:
                    self._transaction(conn, _NORMAL, lambda c: [_step_of(self, r, c) for r in batch],
                                      min(r.deadline for r in batch))
                except _StepFailed:
                    pass  # one of them failed, and all were undone: each is made again alone, to fail alone
                except StoreBusy as e:
                    # Busy at the earliest deadline of the batch: the writes whose own deadline has come
                    # fail; the others are tried again, each until its own.
                    now = time.monotonic()
                    for request in batch:
                        if request.deadline <= now + 0.01:
                            request.error, request.done = e, True
                    batch = [r for r in batch if not r.done]
                except Exception as e:  # the journal's own failure (a full disk, say): the batch's
                    for request in batch:
                        request.error, request.done = e, True
                    return
                else:
                    self._told(batch)
                    return
            for request in batch:
                try:
                    self._transaction(conn, _NORMAL, functools.partial(request.run, self), request.deadline)
                except Exception as e:
                    request.error, request.ticket, request.done = e, self._written, True
                else:
                    self._told((request,))
        except BaseException as e:
            self._told(batch)  # what the last transaction committed is made, whatever came after
            interrupted = not isinstance(e, Exception)
            for request in reversed(batch):
                if not request.done:
                    if interrupted and request is not own and not request.abandoned:
                        requests.appendleft(request)  # undone with the transaction: its thread makes it
                    else:
                        request.error, request.done = e, True
            if not own.done:  # not taken off the queue yet: this thread's write fails with its interrupt
                with contextlib.suppress(ValueError):
                    requests.remove(own)
                own.error, own.done = e, True
            raise

    def _told(self, requests: Sequence[_Request]) -> None:
        """Count the last committed transaction once, and give its result to each of ``requests``
        whose write it made."""
        txn = self._committed
        if not txn:
            return
        if self._counted != txn:
            self._written += 1
            self._counted = txn
        for request in requests:
            if not request.done and request.staged_in == txn:
                request.result, request.ticket, request.done = request.staged, self._written, True

    def _read(self, body: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            conn = self._connection()

            def settled() -> T:
                _settle(conn)
                return body(conn)

            return self._retry(conn, settled)

    # -- the EffectStore protocol --------------------------------------------------------------

    def begin(self, call_id: str, decide: Decide, lease: tuple[str, float] | None = None) -> Decision:
        """Decide and record one attempt of ``call_id`` atomically (see :class:`~guard.store.EffectStore`).

        At ``durability="full"``, when the decision records ``pending`` this returns only once an
        fsync of the WAL that began after its commit has completed (one this thread makes, or one
        another thread was making for it too), so the tool never runs before its ``pending`` is on disk.

        Raises :class:`StoreBusy` past the busy deadline, :class:`JournalError` on any other failure
        (an fsync that fails too: the guard then refuses the call, and a retry finds it ``pending``).
        """

        def step(conn: sqlite3.Connection) -> Decision:
            head, record = _head_and_record(conn, call_id)
            decision = decide(record)
            if lease is not None and decision.event.kind == "pending":  # in the transaction of its pending
                conn.execute(_TAKE_LEASE, (call_id, lease[0], time.time() + lease[1]))
            self._append(conn, decision.event, record, head)
            return decision

        try:
            decision, ticket = self._combined(step)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(str(self.path), e) from e
        if self.durability == "full" and decision.event.kind == "pending":
            self._wait_durable(ticket)
        return decision

    # -- group commit --------------------------------------------------------------------------

    def _reset_group(self) -> None:
        self._group = threading.Condition()
        self._written = 0  # commits of this object that begin must see on disk, counted in order
        self._synced = 0  # how many of them an fsync has covered
        self._syncing = False
        self._sync_since = 0.0  # when the fsync under way was started
        self._wal_lock = threading.Lock()  # held by the thread making an fsync, and for the descriptor
        self._wal_fd: int | None = None
        self._wal_of = 0  # the connection (numbered as _conns counts) whose WAL _wal_fd is

    def _wait_durable(self, ticket: int) -> None:
        """Return once the first ``ticket`` counted commits are on disk.

        A thread that finds no fsync running starts one for every commit counted so far; the others
        wait for it, and those it did not cover (they committed after it started) start the next.
        """
        group = self._group
        claimed = synced = False
        covered = 0
        try:
            with group:
                while self._synced < ticket and self._syncing:
                    waited = time.monotonic() - self._sync_since
                    if waited >= _SYNC_STALE:
                        # The thread that started it was interrupted before it could say it was done,
                        # or its fsync is that slow: make one here (they take turns on the descriptor).
                        break
                    group.wait(_SYNC_STALE - waited)
                if self._synced >= ticket:
                    return
                covered = self._written
                self._sync_since = time.monotonic()
                claimed = self._syncing = True  # within the try: an interrupt cannot leave it claimed
            self._sync_wal()
            synced = True
        finally:
            if claimed:
                with group:
                    self._syncing = False
                    if synced:
                        self._synced = max(self._synced, covered)
                    group.notify_all()

    def _sync_wal(self) -> None:
        """fsync the WAL file, where the commits are until a checkpoint (which fsyncs them itself)."""
        with self._wal_lock:
            self._sync_wal_locked()

    def _sync_wal_locked(self) -> None:
        wal = self._wal_path
        try:
            fd = self._wal_fd
            if fd is not None and self._wal_of != self._conns:
                self._wal_fd = None  # a connection opened since, whose WAL may be a new file
                os.close(fd)
                fd = None
            if fd is None:
                conns = self._conns
                try:
                    fd = os.open(wal, os.O_RDWR)
                except FileNotFoundError:
                    if self._checkpointed_since(conns):
                        return
                    raise
                self._wal_fd, self._wal_of = fd, conns
                _sync_directory(os.path.dirname(wal))  # a WAL new since the last fsync: its name too
            elif os.fstat(fd).st_ino != _inode(wal):
                self._wal_fd = None
                os.close(fd)
                if self._checkpointed_since(self._wal_of):
                    return
                # Another process took the WAL away while this connection had it open, believing
                # itself the file's last user: the commits made since may be lost. Said, never
                # fsynced in its place; the next write opens a new connection.
                self._stale = True
                raise JournalError(f"The journal {self.path} lost its WAL file to another process while "
                                   "open (its locks on the file were taken away); the last write is not on disk.")
            _fdatasync(fd)
            if self._closed:  # closed meanwhile: close() has already let go of the descriptor it saw
                self._wal_fd = None
                os.close(fd)
        except OSError as e:
            raise JournalError(f"The journal {self.path} could not be synced to disk: {e.strerror or e}.") from e

    def _checkpointed_since(self, conns: int) -> bool:
        """Whether a WAL found gone or replaced was checkpointed, its commits (the ones to sync) in
        the journal file: true once the connection that made them (numbered ``conns``) is closed (by
        close(), or let go of for a fork; another process may then have been the file's last user).

        SQLite removes or restarts a WAL only after copying every commit in it into the journal
        file and syncing that file (under synchronous NORMAL or FULL, as every connection of a
        journal has); while the connection is open, only a process that took its locks away can.
        The file is never fsynced here by a descriptor of this module's own: closing one would take
        away the locks SQLite holds on the file for this process's connections.
        """
        return self._closed or self._conn is None or conns != self._conns

    def append(self, event: EffectEvent, drop_lease: str | None = None) -> None:
        """Record an outcome or a refusal outside ``begin``; it becomes durable with the next fsync.
        ``drop_lease``: the holder whose lease on the call ends with this outcome."""

        def step(conn: sqlite3.Connection) -> None:
            head, record = _head_and_record(conn, event.call_id)
            self._append(conn, event, record, head)
            if drop_lease is not None:
                conn.execute(_DROP_LEASE, (event.call_id, drop_lease))

        try:
            if event.kind == "pending" and self.durability == "full":
                self._write(_FULL, step)
            else:
                self._combined(step)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(str(self.path), e) from e

    def get(self, call_id: str) -> CallRecord | None:
        """The current record of ``call_id``, or None."""
        if not holds(call_id):
            return None  # an id with no UTF-8 form (a lone surrogate) is never stored
        row = self._read(lambda c: c.execute(_SELECT_CALL, (call_id,)).fetchone())
        return None if row is None else self._decoded(record_from_row, row)

    def recent_call(self, agent_id: str | None, idempotency_key: str, since: datetime) -> CallRecord | None:
        """The most recent call of ``agent_id`` with ``idempotency_key`` begun at or after ``since`` and
        not released, or None (the lookup of ``EffectGuard(duplicate_window=...)``)."""
        if not holds(idempotency_key) or (agent_id is not None and not holds(agent_id)):
            return None
        row = self._read(lambda c: c.execute(_SELECT_RECENT, (idempotency_key, at_text(since), agent_id)).fetchone())
        return None if row is None else self._decoded(record_from_row, row)

    # -- leases (see guard.leases); the store's clock is this host's, which its processes share -----

    leases_in_begin = True  # begin takes a call's lease and append drops it, in their transactions

    def take_lease(self, call_id: str, holder: str, seconds: float) -> None:
        """Record ``holder``'s lease on ``call_id``, running out ``seconds`` from now."""
        self._taken += 1
        sweep = self._taken % SWEEP_EVERY == 0

        def step(conn: sqlite3.Connection) -> None:
            now = time.time()
            conn.execute(_TAKE_LEASE, (call_id, holder, now + seconds))
            if sweep:
                conn.execute(_SWEEP_LEASES, (now,))

        self._combined(step)

    def renew_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        """Extend ``holder``'s lease; False when it has none on the call any more."""
        return self._combined(
            lambda conn: conn.execute(_RENEW_LEASE, (time.time() + seconds, call_id, holder)).rowcount > 0
        )[0]

    def drop_lease(self, call_id: str, holder: str) -> None:
        """Forget ``holder``'s lease on ``call_id``."""
        self._combined(lambda conn: conn.execute(_DROP_LEASE, (call_id, holder)))

    def claim_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        """Take a lease on ``call_id`` only if no other holder has a live one and the call is not
        pending with an owner alive by the host-and-pid test (one that never had a lease)."""

        def step(conn: sqlite3.Connection) -> bool:
            now = time.time()
            others = [until for other, until in conn.execute(_LEASES_OF, (call_id,)) if other != holder]
            if others and max(others) > now:
                return False
            if not others:
                row = conn.execute(_SELECT_CALL, (call_id,)).fetchone()
                record = None if row is None else record_from_row(row)
                if unclaimable(record):
                    return False
            conn.execute(_TAKE_LEASE, (call_id, holder, now + seconds))
            return True

        return self._write(_NORMAL, step)

    def settle(self, call_id: str, choose: Settle) -> int | None:
        """Read the call's record, let ``choose`` make the event, append it;
        in one write transaction. Returns the ``seq`` appended (None when ``choose`` chose none)."""

        def step(conn: sqlite3.Connection) -> int | None:
            head, record = _head_and_record(conn, call_id)
            event = choose(record)
            if event is None:
                return None
            return self._append(conn, event, record, head)[0]

        try:
            return self._write(_FULL if self.durability == "full" else _NORMAL, step)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(str(self.path), e) from e

    def owner_states(self, records: list[CallRecord]) -> dict[str, OwnerState]:
        """Whether each pending record's owner is alive, and when its lease runs out."""

        def read(conn: sqlite3.Connection) -> dict[str, OwnerState]:
            now = time.time()
            return {r.call_id: owner_state(r, self._latest_lease(conn, r.call_id), now) for r in records}

        return self._read(read)

    def _latest_lease(self, conn: sqlite3.Connection, call_id: str) -> float | None:
        try:
            row = conn.execute(_LATEST_LEASE, (call_id,)).fetchone()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return None  # a journal from before leases, read as it is
            raise
        return None if row is None or row[0] is None else float(row[0])

    def _lease_alive(self, conn: sqlite3.Connection, record: CallRecord | None) -> bool | None:
        """Whether a lease on the pending call has not run out; None when it has none."""
        if record is None or record.status != "pending":
            return None
        latest = self._latest_lease(conn, record.call_id)
        return None if latest is None else latest > time.time()

    def _append(
        self, conn: sqlite3.Connection, event: EffectEvent, record: CallRecord | None, head: tuple[int, str]
    ) -> tuple[int, str, str]:
        """Insert ``event`` after ``head`` and fold it into the projection; returns (seq, prev, hash)."""
        seq, prev = head[0] + 1, head[1]
        at = at_text(event.at)
        error, reason, owner = _plain(event.error), _plain(event.reason), _plain(event.owner)
        error_text, reason_text = json_text(error), json_text(reason)
        if owner is not self._owner[0]:
            self._owner = (owner, json_text(owner))  # the guard hands every event one owner object
        owner_text = self._owner[1]
        arguments, value = event.arguments, event.value
        if arguments != self._arguments[0]:
            self._arguments = (arguments, text_sha256(arguments))  # a call's events repeat its arguments
        digest = compute_hash(prev, {
            "seq": seq, "at": at, "call_id": event.call_id, "kind": event.kind, "tool": event.tool,
            "agent_id": event.agent_id, "idempotency_key": event.idempotency_key,
            "arguments_sha256": self._arguments[1], "value_sha256": text_sha256(value),
            "error": error, "reason": reason, "actor": event.actor, "attempt": event.attempt, "owner": owner,
        })
        conn.execute(_INSERT_EVENT, (
            seq, at, event.call_id, event.kind, event.tool, event.agent_id, event.idempotency_key,
            arguments, value, error_text, reason_text, event.actor, event.attempt, owner_text, prev, digest,
        ))
        folded = apply(record, event, seq)
        if folded is not None and folded is not record:
            conn.execute(_UPSERT_CALL, _call_row(folded, {
                id(event.at): at, id(event.error): error_text, id(event.reason): reason_text,
                id(event.owner): owner_text,
            }))
        return seq, prev, digest

    # -- reads for operators -------------------------------------------------------------------

    def call(self, call_id: str) -> CallRecord | None:
        """The current record of ``call_id``, or None (the same as :meth:`get`)."""
        return self.get(call_id)

    def calls(
        self,
        *,
        status: str | Sequence[str] | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        limit: int | None = 50,
        offset: int = 0,
    ) -> list[CallRecord]:
        """Calls newest first (by ``updated_at``, then ``call_id``, both descending), filtered by status
        (one, or any of several), tool, agent and ``updated_at >= since``; at most ``limit`` (None: all),
        after skipping the first ``offset`` (the pages of a long list)."""
        clauses, params = call_filter("?", True, status, tool, agent_id, since)
        sql = (f"SELECT {_CALL_COLUMNS} FROM calls WHERE {' AND '.join(['1', *clauses])} "
               "ORDER BY updated_at DESC, call_id DESC") + page(limit, offset, "-1")
        rows = self._read(lambda c: c.execute(sql, params).fetchall())
        return [self._decoded(record_from_row, row) for row in rows]

    def event_rows(
        self,
        *,
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after_seq: int = 0,
    ) -> Iterator[tuple[Any, ...]]:
        """What :meth:`events` gives, as the stored rows (columns of ``journal.rows.EVENT_COLUMNS``:
        ``at`` and the JSON fields as their stored text), for exports that stream millions."""
        where, params = _event_filter(call_id, tool, agent_id, since, until, after_seq)
        # Up to the head as it is now: a reader never chases writers that keep appending.
        head = self._read(lambda c: c.execute(_SELECT_HEAD).fetchone())
        if head is None:
            return
        params.append(head[0])
        sql = f"SELECT {_EVENT_COLUMNS} FROM events WHERE {where} AND seq <= ? ORDER BY seq LIMIT {_BATCH}"
        while True:
            rows = self._read(lambda c: c.execute(sql, params).fetchall())
            yield from rows
            if len(rows) < _BATCH:
                return
            params[0] = rows[-1][0]

    def export_lines(
        self,
        *,
        redact: frozenset[str] = frozenset(),
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> Iterator[tuple[bytes, int]]:
        """The JSON Lines export of the filtered events, in batches: (the lines, how many).

        SQLite writes each line's JSON itself (``json()`` also checks every stored JSON text), so
        only the two digests are computed here; the lines hold the same values as
        :meth:`JournalEvent.export`. A stored text that is not JSON raises :class:`JournalError`
        naming the event.
        """
        check_redact(redact)
        where, params = _event_filter(call_id, tool, agent_id, since, until, 0)
        shown = {name: "NULL" if name in redact else f"json({name})" for name in ("arguments", "value")}
        redacted = orjson.dumps(sorted(redact)).decode()
        # The two digests, computed here, close each line (as journal.export.jsonl_lines puts them).
        sql = (
            "SELECT seq, json_object('seq', seq, 'at', at, 'call_id', call_id, 'kind', kind, 'tool', tool, "
            "'agent_id', agent_id, 'idempotency_key', idempotency_key, "
            f"'arguments', {shown['arguments']}, 'value', {shown['value']}, 'error', json(error), "
            "'reason', json(reason), 'actor', actor, 'attempt', attempt, 'owner', json(owner), "
            f"'prev_hash', prev_hash, 'hash', hash, 'redacted', json('{redacted}')), arguments, value "
            f"FROM events WHERE {where} AND seq <= ? ORDER BY seq"
        )
        sha256 = hashlib.sha256
        parts: list[str] = []
        size = count = 0
        try:
            for rows in self._snapshot_rows(sql, params, 100):
                for _, line, arguments, value in rows:
                    parts.append(line[:-1])
                    parts.append(',"arguments_sha256":null' if arguments is None
                                 else ',"arguments_sha256":"' + sha256(arguments.encode()).hexdigest() + '"')
                    parts.append(',"value_sha256":null}\n' if value is None
                                 else ',"value_sha256":"' + sha256(value.encode()).hexdigest() + '"}\n')
                    size += len(line)
                count += len(rows)
                # Bounded by bytes, not events: an event may hold a megabyte of arguments.
                if size >= _EXPORT_BYTES:
                    yield one_line_each("".join(parts).encode()), count
                    parts, size, count = [], 0, 0
        except (sqlite3.Error, JournalError) as e:
            cause = e.__cause__ if isinstance(e, JournalError) else e
            if isinstance(cause, sqlite3.Error) and "JSON" in str(cause):
                # json() refused a stored text: the row path names the event and the field.
                for row in self.event_rows(call_id=call_id, tool=tool, agent_id=agent_id, since=since, until=until):
                    next(jsonl_lines([row], redact))
            if isinstance(e, JournalError):
                raise
            raise JournalError(f"The journal {self.path} could not be exported: {e}") from e
        if count:
            yield one_line_each("".join(parts).encode()), count

    def _snapshot_rows(self, sql: str, params: Any, batch: int) -> Iterator[list[tuple[Any, ...]]]:
        """The rows of ``sql`` (its first column ``seq``; ``params[0]`` the ``seq >`` cursor and its
        last placeholder ``seq <=`` the head), ``batch`` at a time, on a connection of its own.

        The head is read once; then each page, from the last ``seq`` read up to that head, is a read
        of its own. The log is append-only with a gapless ``seq``, so the pages are one consistent
        snapshot; and a reader that stalls between pages (an export into a pager left open) holds
        no read transaction, which would keep SQLite from checkpointing and grow the WAL for as
        long as it stalls. Writers never wait for it. Raises :class:`JournalError` (from the
        sqlite3.Error).
        """
        with self._lock:
            self._connection()
        reader = self._connect(schema.reader_uri(self._file), uri=True)
        try:
            head = self._retry(reader, lambda: reader.execute(_SELECT_HEAD).fetchone())
            if head is None:
                return
            paged, after, filters, top = f"{sql} LIMIT {int(batch)}", params[0], list(params[1:]), head[0]
            while True:
                rows = self._retry(reader, functools.partial(_fetch_all, reader, paged, (after, *filters, top)))
                if rows:
                    yield rows
                if len(rows) < batch:
                    return
                after = rows[-1][0]
        finally:
            with contextlib.suppress(sqlite3.Error):
                reader.close()

    def export_csv(
        self,
        *,
        redact: frozenset[str] = frozenset(),
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> Iterator[tuple[bytes, int]]:
        """The CSV export of the filtered events, its header first, in batches: (the lines, how many
        events), byte for byte what :meth:`LogReads.export_csv` writes.

        SQLite checks every stored JSON text (``json_valid``), on one snapshot read in pages. A stored
        text that is not JSON raises :class:`JournalError` naming the event.
        """
        check_redact(redact)
        where, params = _event_filter(call_id, tool, agent_id, since, until, 0)
        checked = " AND ".join(f"({c} IS NULL OR json_valid({c}))" for c in ("arguments", "value", "error", "reason",
                                                                             "owner"))
        sql = f"SELECT {_EVENT_COLUMNS}, {checked} FROM events WHERE {where} AND seq <= ? ORDER BY seq"
        header = csv_header()  # written with the first lines, so that an export that fails at once writes nothing
        try:
            for rows in self._snapshot_rows(sql, params, _BATCH):
                chunk = "".join(csv_lines(rows, redact)).encode()
                if header:
                    chunk, header = header + chunk, b""
                yield chunk, len(rows)
        except sqlite3.Error as e:
            raise JournalError(f"The journal {self.path} could not be exported: {e}") from e
        if header:
            yield header, 0

    def count_events(
        self,
        *,
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after_seq: int = 0,
    ) -> int:
        """How many events :meth:`events` with the same filters would give now."""
        where, params = _event_filter(call_id, tool, agent_id, since, until, after_seq)
        row = self._read(lambda c: c.execute(f"SELECT count(*) FROM events WHERE {where}", params).fetchone())
        return int(row[0])

    def head(self) -> tuple[int, str]:
        """The last event's seq and hash; ``(0, GENESIS)`` for an empty journal."""
        row = self._read(lambda c: c.execute(_SELECT_HEAD).fetchone())
        return (0, GENESIS) if row is None else (int(row[0]), str(row[1]))

    # -- archiving (journal.archive) -----------------------------------------------------------

    def archived_head(self) -> tuple[int, str]:
        """The seq and hash of the last archived event, where the log now starts; ``(0, GENESIS)``
        when nothing was archived."""
        return self._read(archive.sqlite_archived_head)

    def commit_archive(self, plan: archive.ArchivePlan, file: str, archived_at: str) -> int:
        """Remove the events ``plan`` moves, once they are in the archive ``file``, in one write
        transaction that also records the archive's head; returns how many were removed."""
        return self._write(_FULL if self.durability == "full" else _NORMAL,
                           lambda conn: archive.sqlite_commit(conn, plan, file, archived_at))

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
            left = self._write(_NORMAL, lambda c: (c.execute(step).fetchall(),
                                                   c.execute("PRAGMA freelist_count").fetchone()[0])[1])
        self._read(lambda c: c.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall())  # the file shrinks here
        return int(free)

    def stats(self) -> JournalStats:
        """Counts of calls by status and by tool, the number of events, and when the oldest pending
        and unknown calls entered that status."""

        def read(c: sqlite3.Connection) -> JournalStats:
            c.execute("BEGIN")  # the counts of one moment, however many writers there are
            try:
                by_status = dict(c.execute("SELECT status, count(*) FROM calls GROUP BY status ORDER BY status"))
                by_tool = dict(c.execute("SELECT tool, count(*) FROM calls GROUP BY tool ORDER BY tool"))
                # seq is gapless from 1, so the last one counts the events without a scan.
                events = c.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
                oldest = dict(c.execute(
                    "SELECT status, min(since) FROM calls WHERE status IN ('pending', 'unknown') GROUP BY status"
                ))
            finally:
                if c.in_transaction:
                    c.execute("COMMIT")
            return JournalStats(
                calls=sum(by_status.values()), events=events, by_status=by_status, by_tool=by_tool,
                oldest_pending_at=self._decoded(parse_at, oldest["pending"]) if "pending" in oldest else None,
                oldest_unknown_at=self._decoded(parse_at, oldest["unknown"]) if "unknown" in oldest else None,
            )

        return self._read(read)

    def _decoded(self, decode: Callable[[Any], T], row: Any) -> T:
        try:
            return decode(row)
        except (ValueError, TypeError) as e:
            raise JournalError(f"A stored row of the journal {self.path} cannot be read ({e}); run verify.") from e

    # -- verification and repair ---------------------------------------------------------------

    def verify(self, *, parts: int | None = None, advance: Callable[[int], None] | None = None) -> VerifyReport:
        """Recompute the hash chain from the stored fields, check that ``seq`` is gapless from 1, and
        compare the projection with the fold of the log, on one consistent snapshot.

        A journal of :data:`~journal.sqlite_verify.PARALLEL_FROM` events or more is checked in
        ``parts`` (default: one a core, at most 4) by child processes at once; when a part finds a
        problem, or a child cannot run, it is checked again in one pass, which names the first bad
        event. ``parts=1`` always checks in one pass. ``advance`` is told of each stretch of events
        checked (a progress bar's update).
        """
        if parts is not None and (isinstance(parts, bool) or not isinstance(parts, int) or parts < 1):
            raise ValueError(f"parts is a number, 1 or more, not {parts!r}")
        with self._lock:
            self._connection()
        snapshot = self._connect(schema.reader_uri(self._file), uri=True)
        try:
            head = self._retry(snapshot, lambda: snapshot.execute(_SELECT_HEAD).fetchone())
            if head is not None:
                n = parts if parts is not None else (
                    min(os.cpu_count() or 1, 4) if head[0] >= sqlite_verify.PARALLEL_FROM else 1
                )
                if n > 1 and self._retry(snapshot, lambda: archive.sqlite_archived_head(snapshot))[0]:
                    n = 1  # the parts check a log that starts at seq 1; an archived one is checked in one pass
                if n > 1 and self._verified_in_parts(int(head[0]), n, advance):
                    return self._undamaged(snapshot, VerifyReport(
                        ok=True, events=int(head[0]), head=str(head[1]), first_bad_seq=None, problem=None))
            return self._undamaged(snapshot, self._retry(snapshot, lambda: self._verify(snapshot, advance)))
        finally:
            with contextlib.suppress(sqlite3.Error):
                snapshot.close()

    def _undamaged(self, snapshot: sqlite3.Connection, report: VerifyReport) -> VerifyReport:
        """``report``, for a journal marked damaged checked whole by SQLite too: the mark is taken
        away (writes are taken again) only when its pages, indexes included, are sound."""
        if not report.ok or (self._damaged is None and damage.marked(self._mark) is None):
            return report
        found = self._retry(snapshot, lambda: snapshot.execute("PRAGMA quick_check").fetchall())
        if found != [("ok",)]:
            return VerifyReport(ok=False, events=report.events, head=report.head, first_bad_seq=None,
                                problem=f"SQLite finds the file damaged: {found[0][0]}")
        damage.clear(self._file)
        self._damaged = None
        return report

    def _verified_in_parts(self, head: int, parts: int, advance: Callable[[int], None] | None = None) -> bool:
        """True when every part of the events up to ``head`` checks out (part 0 in this process)."""
        children = [sqlite_verify.start_part(self._file, part, parts, head) for part in range(1, parts)]
        try:
            started = time.monotonic()
            if None in children or not sqlite_verify.check_part(self._file, 0, parts, head):
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
            return self._verified_log(conn, advance)
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")

    def _verified_log(self, conn: sqlite3.Connection, advance: Callable[[int], None] | None = None) -> VerifyReport:
        """The report of :meth:`verify`, in one pass over what ``conn`` sees (in a transaction of
        the caller's: a read snapshot, or a write not yet committed)."""
        # The log goes on from the last archive's head, folded onto the projection as of that head.
        base = archive.sqlite_archived_head(conn)
        return verifying.verify_rows(
            conn.execute(f"SELECT {_EVENT_COLUMNS} FROM events ORDER BY seq"),
            lambda: conn.execute(f"SELECT {_CALL_COLUMNS} FROM calls ORDER BY call_id"),
            start=base, archived=archive.SQLiteSnapshot(conn) if base[0] else None, advance=advance,
        )

    def rebuild(self, *, advance: Callable[[int], None] | None = None) -> int:
        """Rebuild the projection from the log through the fold, in one transaction; returns the
        number of calls. ``advance`` is told of each stretch of events folded."""

        def step(conn: sqlite3.Connection) -> int:
            # From the projection as of the last archive's head (none: from an empty one).
            folded = {row[0]: self._decoded(record_from_row, row) for row in archive.sqlite_snapshot(conn)}
            for row in conn.execute(f"SELECT {_EVENT_COLUMNS} FROM events ORDER BY seq"):
                if advance is not None and row[0] % _ADVANCE_EVERY == 0:
                    advance(_ADVANCE_EVERY)
                fold_into(folded, self._decoded(event_from_row, row))
            conn.execute("DELETE FROM calls")
            conn.executemany(_UPSERT_CALL, (_call_row(r) for r in folded.values()))
            return len(folded)

        return self._write(_FULL if self.durability == "full" else _NORMAL, step)

    def _label(self) -> str:
        return str(self.path)

    def resolve(
        self,
        call_id: str,
        *,
        applied: bool,
        reason: str,
        operator: str,
        value: str | None = None,
        force: bool = False,
    ) -> JournalEvent:
        """Settle a ``pending`` or ``unknown`` call as the backend confirmed it.

        ``applied=True`` appends ``committed`` (with ``value``, JSON text, stored canonicalised; None
        for none), ``applied=False`` appends ``released``; by ``operator:NAME`` at the call's attempt.
        Raises :class:`CallNotFound`, :class:`NotResolvable` (another status, or a pending call whose
        owner process is alive on this host, unless ``force``), ``ValueError`` for a ``value`` that is
        not JSON or given with ``applied=False``. Nothing changes when it raises.
        """
        if not holds(call_id):  # no call has it: what is wrong with the arguments, else CallNotFound
            operator_event(call_id, None, applied=applied, reason=reason, operator=operator, value=value,
                           force=force, journal=str(self.path))

        def step(conn: sqlite3.Connection) -> JournalEvent:
            head, record = _head_and_record(conn, call_id)
            event = operator_event(call_id, record, applied=applied, reason=reason, operator=operator,
                                   value=value, force=force, journal=str(self.path),
                                   lease_alive=self._lease_alive(conn, record))
            seq, prev, digest = self._append(conn, event, record, head)
            return JournalEvent(
                seq=seq, at=event.at, call_id=call_id, kind=event.kind, tool=event.tool,
                agent_id=event.agent_id, idempotency_key=event.idempotency_key, arguments=event.arguments,
                value=event.value, error=None, reason=dict(event.reason or {}), actor=event.actor,
                attempt=event.attempt, owner=dict(event.owner), prev_hash=prev, hash=digest,
            )

        return self._write(_FULL if self.durability == "full" else _NORMAL, step)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection; the object cannot be used afterwards. Closing twice is harmless."""
        with self._lock:
            if not self._closed:
                self._closed = True
                conn, self._conn = self._conn, None
                if _FORKS[0] == self._forks:
                    if conn is not None:
                        with contextlib.suppress(sqlite3.Error):  # nothing is left to lose on close
                            conn.close()
                    if self._tidy is not None:
                        self._remove_side_files(self._tidy)
                elif conn is not None:
                    _INHERITED.append(conn)
                with self._wal_lock:  # after the fsync under way, which uses the descriptor
                    if self._wal_fd is not None:
                        os.close(self._wal_fd)
                        self._wal_fd = None

    def _remove_side_files(self, inode: int) -> None:
        """Take away the ``-wal`` and ``-shm`` files that reading made beside a journal that had none.

        A read-only connection cannot remove them; one that may write does, when it closes as the
        file's last connection (SQLite checks that under its locks, and the WAL is empty: nothing is
        copied into the file). While another process has the journal open, they stay, as it needs
        them. Where this process may not write the file, they stay too.
        """
        file = self._file
        with contextlib.suppress(OSError, sqlite3.Error):
            if os.stat(file).st_ino != inode or not os.access(file, os.R_OK | os.W_OK):
                return
            with schema.OPENING:
                conn = sqlite3.connect(str(file), timeout=0, isolation_level=None)
            try:
                conn.execute("PRAGMA query_only = 1")
                conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            finally:
                conn.close()

    def __enter__(self) -> SQLiteJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = ", readonly=True" if self.readonly else ""
        return f"SQLiteJournal({str(self.path)!r}, durability={self.durability!r}{mode})"
