"""Group commit: the writes of several threads in one transaction, the fsync of several commits in one."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..errors import (
    JournalError,
    StoreBusy,
)
from . import forks

if TYPE_CHECKING:
    from .datastore import SQLiteDatastore

T = TypeVar("T")
_NORMAL = "NORMAL"

# What SQLite itself syncs the WAL with where it can: the data, and the metadata needed to read it.
_fdatasync = getattr(os, "fdatasync", os.fsync)

# A group commit's fsync still under way after this many seconds is made again by a thread waiting
# for it: the thread that started it may have been interrupted before it could say it was done.
_SYNC_STALE = 1.0

def held(lock: threading.RLock) -> int:
    """How many times the calling thread holds ``lock`` (0: not at all)."""
    count: int = cast(Any, lock)._recursion_count()
    return count

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

class _Request:
    """One thread's write (``step``, run in a transaction at NORMAL), and what came of it."""

    __slots__ = ("abandoned", "deadline", "done", "error", "forks", "result", "staged", "staged_in", "step",
                 "ticket")

    def __init__(self, step: Callable[[sqlite3.Connection], Any], deadline: float) -> None:
        self.step = step
        self.deadline = deadline  # the busy deadline counts from when the thread asked, not from its turn
        self.forks = forks.FORKS[0]
        self.done = False
        self.abandoned = False  # its thread left (interrupted) before the write was taken on: never made
        self.result: Any = None
        self.error: BaseException | None = None
        self.ticket = 0
        self.staged: Any = None  # what step returned in the transaction numbered staged_in
        self.staged_in = 0

    def run(self, datastore: SQLiteDatastore, conn: sqlite3.Connection) -> Any:
        result = self.step(conn)
        self.staged, self.staged_in = result, datastore.txn_begun
        return result

class _StepFailed(Exception):
    """A write of a batch raised (its ``__cause__``): the batch is undone and made write by write."""

def _step_of(datastore: SQLiteDatastore, request: _Request, conn: sqlite3.Connection) -> Any:
    try:
        return request.run(datastore, conn)
    except Exception as e:
        raise _StepFailed() from e


class GroupCommit:
    """Writes of threads that wait for the lock made in one transaction, and one fsync of the WAL
    for every commit made before it (durability ``full``): the queue and the WAL's descriptor of
    one :class:`~journal.sqlite.datastore.SQLiteDatastore`, made in its transactions."""

    _wal_fd: int | None  # the WAL's descriptor, kept open between fsyncs

    def __init__(self, datastore: SQLiteDatastore) -> None:
        # Weakly: the datastore holds this object, and a journal nobody closed is freed (and its
        # connection closed) as soon as its last reference goes, without waiting for the collector.
        self._datastore: SQLiteDatastore = weakref.proxy(datastore)
        self._lock = datastore.lock  # the datastore's, taken again after a fork (see forked)
        self._requests: collections.deque[_Request] = collections.deque()  # writes waiting for the lock
        self._counted = 0  # the last transaction counted in _written
        self._reset_group()

    def forked(self) -> None:
        """In a forked child: the datastore's new lock, a new queue, and the parent's fsync let go of
        (see SQLiteDatastore.forked)."""
        self._lock = self._datastore.lock
        self._requests = collections.deque()
        fd = self._wal_fd
        self._reset_group()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # the child's own copy of the descriptor; the parent's stays open

    def close(self) -> None:
        """Let go of the WAL's descriptor (after the fsync under way, which uses it)."""
        with self._wal_lock:
            if self._wal_fd is not None:
                os.close(self._wal_fd)
                self._wal_fd = None

    def combined(self, step: Callable[[sqlite3.Connection], T]) -> tuple[T, int]:
        """Run ``step`` in a write transaction at NORMAL; returns its result and the commit's ticket
        for :meth:`wait_durable`.

        The writes of threads that wait for the lock meanwhile are made by whichever of them gets
        it first, all in one transaction: so threads that write at once share a commit, and the
        pages it writes, as well as the fsync. If one of them fails, that transaction is undone
        and each write is made again in a transaction of its own, so that only the failing one
        raises, in its own thread. Each thread returns only after the commit that holds its write.
        """
        lock = self._lock
        depth = held(lock)
        if not depth and not self._requests:
            try:
                if lock.acquire(blocking=False):
                    return self._alone(step)  # no other thread writing or waiting: nothing to combine
            finally:
                if held(lock) > depth:  # see SQLiteDatastore.write: an interrupt can come as acquire() returns
                    lock.release()
        request = _Request(step, time.monotonic() + self._datastore.busy_timeout)
        self._requests.append(request)
        try:
            if not lock.acquire(timeout=self._datastore.busy_timeout):
                try:
                    self._requests.remove(request)
                except ValueError:  # the thread holding the lock has taken it on: it is being made
                    lock.acquire()
                else:
                    raise self._datastore.own_lock_busy()
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
            if held(lock) > depth:  # see SQLiteDatastore.write
                lock.release()
        if request.error is not None:
            raise request.error
        return request.result, request.ticket

    def _alone(self, step: Callable[[sqlite3.Connection], T]) -> tuple[T, int]:
        """:meth:`combined` for a thread that took the free lock with no write waiting: its write
        in a transaction of its own, without the queue. The caller holds the lock."""
        try:
            result = self._datastore.transaction(self._datastore.connection(), _NORMAL, step)
        finally:
            if self._counted != self._datastore.txn_committed:  # counted even when an interrupt followed COMMIT
                self._written += 1
                self._counted = self._datastore.txn_committed
        return result, self._written

    def _run_requests(self, own: _Request) -> None:
        """Under the lock: make every waiting write, in one transaction when they all succeed.

        ``own`` is the calling thread's write: an interrupt of this thread (KeyboardInterrupt, an
        exception from a signal handler) fails it, and hands the writes of the other threads that
        its transaction did not make back to the queue, for their threads to make.
        """
        batch: list[_Request] = []  # filled as the queue is emptied: an interrupt meanwhile loses none
        try:
            conn = self._datastore.connection()  # a failure to open it fails this thread's write; the others wait
            self._take_queue(own, batch)
            for request in self._made_together(conn, batch):
                self._make_alone(conn, request)
        except BaseException as e:
            self._hand_back(own, batch, e)
            raise

    def _take_queue(self, own: _Request, batch: list[_Request]) -> None:
        """Move the waiting writes this process may make into ``batch``, ``own`` among them."""
        requests = self._requests
        while requests:
            request = requests.popleft()
            if request.abandoned:
                request.done = True  # its thread has gone: nobody waits for it
            elif request.forks == forks.FORKS[0]:  # a write queued before a fork is the parent's to make
                batch.append(request)
        if not own.done and own not in batch:  # handed back and taken again: made here, never lost
            batch.append(own)

    def _made_together(self, conn: sqlite3.Connection, batch: list[_Request]) -> list[_Request]:
        """Make the writes of ``batch`` in one transaction; returns those still to be made, each
        alone: all of them when one failed (so that only it fails), or those whose deadline has not
        come when the lock stayed busy."""
        if len(batch) < 2:
            return batch
        try:
            self._datastore.transaction(conn, _NORMAL, lambda c: [_step_of(self._datastore, r, c) for r in batch],
                              min(r.deadline for r in batch))
        except _StepFailed:
            return batch  # one of them failed, and all were undone
        except StoreBusy as e:
            # Busy at the earliest deadline of the batch: the writes whose own deadline has come
            # fail; the others are tried again, each until its own.
            now = time.monotonic()
            for request in batch:
                if request.deadline <= now + 0.01:
                    request.error, request.done = e, True
            return [r for r in batch if not r.done]
        except Exception as e:  # the journal's own failure (a full disk, say): the batch's
            for request in batch:
                request.error, request.done = e, True
            return []
        self._told(batch)
        return []

    def _make_alone(self, conn: sqlite3.Connection, request: _Request) -> None:
        try:
            self._datastore.transaction(conn, _NORMAL, functools.partial(request.run, self._datastore),
                                        request.deadline)
        except Exception as e:
            request.error, request.ticket, request.done = e, self._written, True
        else:
            self._told((request,))

    def _hand_back(self, own: _Request, batch: list[_Request], e: BaseException) -> None:
        """After ``e`` broke off making ``batch``: what the last transaction committed is made; an
        interrupt of this thread hands the other threads' writes not made back to the queue; every
        other write not made fails with ``e``, and so does ``own``."""
        self._told(batch)
        interrupted = not isinstance(e, Exception)
        requests = self._requests
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

    def _told(self, requests: Sequence[_Request]) -> None:
        """Count the last committed transaction once, and give its result to each of ``requests``
        whose write it made."""
        txn = self._datastore.txn_committed
        if not txn:
            return
        if self._counted != txn:
            self._written += 1
            self._counted = txn
        for request in requests:
            if not request.done and request.staged_in == txn:
                request.result, request.ticket, request.done = request.staged, self._written, True

    # -- group commit --------------------------------------------------------------------------

    def _reset_group(self) -> None:
        self._group = threading.Condition()
        self._written = 0  # commits of this object that begin must see on disk, counted in order
        self._synced = 0  # how many of them an fsync has covered
        self._syncing = False
        self._sync_since = 0.0  # when the fsync under way was started
        self._wal_lock = threading.Lock()  # held by the thread making an fsync, and for the descriptor
        self._wal_fd = None
        self._wal_of = 0  # the connection (numbered as _conns counts) whose WAL _wal_fd is

    def wait_durable(self, ticket: int) -> None:
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
            self.sync_wal()
            synced = True
        finally:
            if claimed:
                with group:
                    self._syncing = False
                    if synced:
                        self._synced = max(self._synced, covered)
                    group.notify_all()

    def sync_wal(self) -> None:
        """fsync the WAL file, where the commits are until a checkpoint (which fsyncs them itself)."""
        with self._wal_lock:
            self._sync_wal_locked()

    def _sync_wal_locked(self) -> None:
        wal = self._datastore.wal_path
        try:
            fd = self._wal_fd
            if fd is not None and self._wal_of != self._datastore.conns_opened:
                self._wal_fd = None  # a connection opened since, whose WAL may be a new file
                os.close(fd)
                fd = None
            if fd is None:
                conns = self._datastore.conns_opened
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
                self._datastore.mark_stale()
                raise JournalError(f"The journal {self._datastore.path} lost its WAL file to another process while "
                                   "open (its locks on the file were taken away); the last write is not on disk.")
            _fdatasync(fd)
            if self._datastore.closed:  # closed meanwhile: close() has already let go of the descriptor it saw
                self._wal_fd = None
                os.close(fd)
        except OSError as e:
            raise JournalError(f"The journal {self._datastore.path} could not be synced to disk: "
                               f"{e.strerror or e}.") from e

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
        return self._datastore.closed or not self._datastore.connected or conns != self._datastore.conns_opened
