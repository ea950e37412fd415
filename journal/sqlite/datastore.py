"""The SQLite journal's datastore: the one object that owns its file, its connection, the
transactions made on it and their retries, the write lock, group commit (see
:mod:`journal.sqlite.group_commit`), a file found damaged, and what a fork does to all of them.

Every sqlite3 error a transaction meets leaves it as the journal's own error, here. The parts
of the journal (its writes, reads, checks, archives, approvals) are built on this object's public
methods and touch nothing else of it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..datastore import Dialect
from ..errors import (
    DiskFull,
    JournalDamaged,
    JournalError,
    JournalNotFound,
    NewerSchema,
    NotAJournal,
    StoreBusy,
)
from . import damage, forks, schema
from .group_commit import GroupCommit, held

__all__ = ["DIALECT", "FULL", "NORMAL", "Durability", "SQLiteDatastore", "remove_files"]

T = TypeVar("T")
Durability = Literal["full", "process"]

# The synchronous levels a transaction commits at.
FULL, NORMAL = "FULL", "NORMAL"
_FULL, _NORMAL = FULL, NORMAL

DIALECT = Dialect(placeholder="?", unlimited="-1", nul=True, sort_apart="+")

_BUSY_CODES = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)

_CHECKPOINT_PAGES = 4000

_WAL_KEEP = 16 * 1024 * 1024

def _settle(conn: sqlite3.Connection) -> None:
    """End a transaction that an interrupt (KeyboardInterrupt, an exception from a signal handler)
    left open on ``conn``, holding the file's write lock, before the connection is used again."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")

def remove_files(path: str | os.PathLike[str], *, keep_journal: bool = False) -> None:
    """Remove a journal file (unless ``keep_journal``: it is gone already) and the files SQLite keeps
    beside it, those that are there. Best effort: what cannot be removed stays."""
    names = [f"{path}-wal", f"{path}-shm", f"{path}-journal"]
    for name in names if keep_journal else [os.fspath(path), *names]:
        with contextlib.suppress(OSError):
            os.unlink(name)


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


class SQLiteDatastore:
    """A journal file and this process's one connection to it, shared by threads.

    Args as :class:`~journal.sqlite.SQLiteJournal` takes them. Opening checks the file before
    anything is written (raises :class:`JournalNotFound`, :class:`NotAJournal`,
    :class:`NewerSchema`, :class:`JournalError`). Before a fork it lets go of its connection, and
    opens a new one when next used, in the parent and in the child alike (see :mod:`journal.sqlite.forks`).
    """

    dialect = DIALECT

    def __init__(self, path: str | os.PathLike[str], durability: Durability, busy_timeout: float, *,
                 readonly: bool, create: bool) -> None:
        self.path = Path(path)
        # The file itself, for every open and the WAL's fsync: wherever the cwd moves, and past a
        # symbolic link (SQLite keeps the WAL beside the file the link points to).
        self.file = Path(os.path.realpath(path))
        self.wal_path = f"{self.file}-wal"
        self._mark = str(damage.mark_path(self.file))  # where a damage found is marked
        self.durability: Durability = durability
        # The level of a write that is as durable as the journal: an operator's, an archive's.
        self.durable_sync = FULL if durability == "full" else NORMAL
        self.busy_timeout = float(busy_timeout)
        self.readonly = readonly
        self._create = create
        self._lock = threading.RLock()
        self._sync: str | None = None
        self.closed = False  # closed by close(): the object cannot be used afterwards
        self._damaged: str | None = None  # what SQLite said when this object found the file damaged
        self._archive: tuple[int, int, int, bool] | None = None  # the file as a read-only open found it
        self._tidy: int | None = None  # the inode of a file whose side files a read-only open made
        self._first_open = True
        self.txn_begun = 0  # write transactions begun, numbered
        self._committing = 0  # the one whose COMMIT was sent
        self.txn_committed = 0  # the last one known committed
        self.conns_opened = 0  # connections opened, numbered: the WAL descriptor belongs to one of them
        self.group = GroupCommit(self)
        self._conn: sqlite3.Connection | None = self._open()
        self.conns_opened = 1
        self._stale = False  # the connection lost its WAL: open a new one
        self._first_open = False
        self._forks = forks.FORKS[0]
        forks.opened(self)

    # -- lifetime ------------------------------------------------------------------------------

    @property
    def lock(self) -> threading.RLock:
        """Held by a thread while it uses the connection; a write holds it for its transaction."""
        return self._lock

    @property
    def connected(self) -> bool:
        """Whether this object holds an open connection (none after close, or let go of for a fork)."""
        return self._conn is not None

    def close(self) -> None:
        """Close the connection; the object cannot be used afterwards. Closing twice is harmless."""
        with self._lock:
            if not self.closed:
                self.closed = True
                conn, self._conn = self._conn, None
                if forks.FORKS[0] == self._forks:
                    if conn is not None:
                        with contextlib.suppress(sqlite3.Error):  # nothing is left to lose on close
                            conn.close()
                    if self._tidy is not None:
                        self._remove_side_files(self._tidy)
                elif conn is not None:
                    forks.INHERITED.append(conn)
                self.group.close()

    def remove_if_empty(self) -> bool:
        """When the log holds no event, close the journal and remove its file and the files SQLite
        keeps beside it; returns whether it did (False: the log holds events, and all is left as
        it is). Raises :class:`JournalError` when the journal cannot be written."""
        with self._lock:
            if not self.write(NORMAL, lambda c: c.execute("SELECT NOT EXISTS (SELECT 1 FROM events)").fetchone()[0]):
                return False
            self.close()
            try:
                os.unlink(self.file)
            except OSError as e:
                raise JournalError(f"Cannot remove the journal {self.path}: {e.strerror}.") from e
            remove_files(self.file, keep_journal=True)
            return True

    def _remove_side_files(self, inode: int) -> None:
        """Take away the ``-wal`` and ``-shm`` files that reading made beside a journal that had none.

        A read-only connection cannot remove them; one that may write does, when it closes as the
        file's last connection (SQLite checks that under its locks, and the WAL is empty: nothing is
        copied into the file). While another process has the journal open, they stay, as it needs
        them. Where this process may not write the file, they stay too.
        """
        file = self.file
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

    def before_fork(self) -> threading.RLock | None:
        """Let go of the connection between transactions, the lock held (returned, for the parent
        to release after the fork); None when the lock stayed busy (see :mod:`journal.sqlite.forks`)."""
        lock = self._lock
        if not lock.acquire(timeout=self.busy_timeout):
            return None
        self._let_go()
        return lock

    def forked(self) -> None:
        """In a forked child: the parent's lock and queue may be held, or filled, by threads the
        child lacks; an fsync a parent thread was making is not the child's to wait for."""
        self._lock = threading.RLock()
        self.group.forked()

    @property
    def current(self) -> sqlite3.Connection | None:
        """The connection open now, if any: for the test kit and the benchmarks, which trace or
        wrap it (what they set is used until the connection is next opened again)."""
        return self._conn

    @current.setter
    def current(self, conn: sqlite3.Connection | None) -> None:
        self._conn = conn

    def mark_stale(self) -> None:
        """The connection lost its WAL to another process: the next use opens a new one."""
        self._stale = True

    # -- opening -------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        return self._open_readonly() if self.readonly else self._open_writable()

    def _open_readonly(self) -> sqlite3.Connection:
        """A connection that reads the journal as it is, changing nothing (see ``schema.reader_uri``)."""
        path, file = self.path, self.file
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
        if self._first_open:  # whether reading makes the side files, or found them empty (see close)
            self._tidy = None if _holds_writes(file) or self._archive is not None else os.stat(file).st_ino
        conn = self._connect(uri, uri=True)
        self._sync = _NORMAL
        return conn

    def _open_writable(self) -> sqlite3.Connection:
        """A connection to the journal, made (mode 0600) or migrated first where allowed."""
        path, file = self.path, self.file
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
                self.retry(conn, lambda: conn.execute("PRAGMA auto_vacuum = INCREMENTAL"))
            self.retry(conn, lambda: conn.execute("PRAGMA journal_mode = WAL"))
            # A guarded call dirties about ten pages; checkpointing (two fsyncs) every 1000 pages, as
            # SQLite does by default, would cost more than the call's own fsync. The WAL is cut back
            # to _WAL_KEEP bytes after each checkpoint.
            self.retry(conn, lambda: conn.execute(f"PRAGMA wal_autocheckpoint = {_CHECKPOINT_PAGES}"))
            self.retry(conn, lambda: conn.execute(f"PRAGMA journal_size_limit = {_WAL_KEEP}"))
            self._sync = None
            if kind.kind != "journal" or kind.version < schema.LATEST:
                # Made or migrated under the write lock; a journal already at the latest version
                # needs no write to open (nor the lock, which another process may be holding).
                self.transaction(conn, _NORMAL, self._initialise)
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
        if not os.path.exists(f"{self.file}-shm") and schema.no_room(self.file):
            raise self._disk_full()

    def _disk_full(self) -> DiskFull:
        return DiskFull(f"The disk holding the journal {self.path} is full: free some space and try again "
                        "(nothing was changed).")

    def _inspect(self) -> schema.FileKind:
        try:
            return schema.inspect(self.file, self.busy_timeout)
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

    def connection(self) -> sqlite3.Connection:
        if self.closed:
            raise JournalError(f"The journal {self.path} is closed.")
        if forks.FORKS[0] != self._forks:  # first use in a forked child
            if self._conn is not None:  # not let go of before the fork (its lock stayed busy)
                forks.INHERITED.append(self._conn)
                self._conn = None
            self._forks = forks.FORKS[0]
        conn = self._conn
        if conn is not None and (self._stale or (
            self._archive is not None and schema.signature(self.file) != self._archive
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
            self.conns_opened += 1
        return conn

    def _let_go(self) -> None:
        """Close this process's connection (between transactions); the next use opens a new one."""
        conn = self._conn
        if conn is not None and not self.closed and forks.FORKS[0] == self._forks:
            self._conn = None
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def retry(self, conn: sqlite3.Connection, step: Callable[[], T]) -> T:
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
            if self.readonly and "malformed" in str(e) and schema.reader_uri(self.file).endswith("immutable=1"):
                raise JournalError(
                    f"The journal {self.path} changed while it was read as a read-only archive (nothing can "
                    f"be locked in its directory, so a writer is not seen): read it again ({e})."
                ) from e
            if schema.full_disk_error(self.file, e):
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
        damage.mark(self.file, str(e))
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

    def transaction(
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
                    self.txn_begun += 1
                    txn = self.txn_begun
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
                            self.txn_committed = txn
                        raise
                    self.txn_committed = txn
                    return result
                except sqlite3.Error as e:
                    waited = self._wait(conn, e, deadline)
        finally:
            if waited:
                self._restore_busy_timeout(conn)

    def write(self, sync: str, body: Callable[[sqlite3.Connection], T]) -> T:
        lock = self._lock
        depth = held(lock)
        try:
            if not lock.acquire(timeout=self.busy_timeout):
                raise self.own_lock_busy()
            return self.transaction(self.connection(), sync, body)
        finally:
            # Released by what this thread holds, not by whether acquire() returned: an interrupt can
            # come as it returns, before anything else runs.
            if held(lock) > depth:
                lock.release()

    def own_lock_busy(self) -> StoreBusy:
        return StoreBusy(f"The journal {self.path} stayed busy with another thread's work for "
                         f"{self.busy_timeout:g} s.")

    def read(self, body: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            conn = self.connection()

            def settled() -> T:
                _settle(conn)
                return body(conn)

            return self.retry(conn, settled)

    def rows(self, doing: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows of one statement (see :class:`~journal.datastore.Datastore`)."""
        return self.read(lambda c: c.execute(sql, params).fetchall())

    def snapshot(self, doing: str, statements: Sequence[str]) -> list[list[tuple[Any, ...]]]:
        """The rows of each of ``statements``, in one read transaction: the counts of one moment."""

        def read(c: sqlite3.Connection) -> list[list[tuple[Any, ...]]]:
            c.execute("BEGIN")
            try:
                return [c.execute(statement).fetchall() for statement in statements]
            finally:
                if c.in_transaction:
                    c.execute("COMMIT")

        return self.read(read)

    def decoded(self, decode: Callable[[Any], T], row: Any) -> T:
        try:
            return decode(row)
        except (ValueError, TypeError) as e:
            raise JournalError(f"A stored row of the journal {self.path} cannot be read ({e}); run verify.") from e

    def label(self) -> str:
        return str(self.path)

    # -- what the parts ask besides ------------------------------------------------------------

    def open_reader(self) -> sqlite3.Connection:
        """A read-only connection of its own to the file (opened once this object's connection
        has opened the journal, migrating it where it may): for a long read that holds neither
        the lock nor a read transaction of the shared connection. The caller closes it."""
        with self._lock:
            self.connection()
        return self._connect(schema.reader_uri(self.file), uri=True)

    def damage_found(self) -> str | None:
        """What SQLite said when this object, or any process (by the mark beside the file), found
        the file damaged; None when it is not known to be."""
        return self._damaged or damage.marked(self._mark)

    def clear_damage(self) -> None:
        """Take the mark away, for this object and every process: the file has been found whole."""
        damage.clear(self.file)
        self._damaged = None


def _holds_writes(file: str | os.PathLike[str]) -> bool:
    """Whether the side files beside ``file`` may hold writes not yet in it: a ``-wal`` that is not
    empty. An empty one (left by a reader that was interrupted before it closed, say) holds nothing,
    so closing as the file's last connection, which removes it, copies nothing into the file."""
    try:
        return os.stat(f"{file}-wal").st_size > 0
    except FileNotFoundError:
        return False
