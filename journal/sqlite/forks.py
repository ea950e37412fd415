"""Forks: no connection of this process to a SQLite journal crosses a fork.

Each journal lets go of its connection before a fork and opens a new one when it is next used, in
the parent and in the child alike; a connection inherited all the same is parked, never used or
closed in the child.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sqlite3
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store import SQLiteJournal


# Connections inherited through fork are never used or closed in the child (closing one could
# checkpoint and delete a WAL that the parent still writes); they are parked here instead.
_INHERITED: list[sqlite3.Connection] = []

_FORKS = [0]  # how many forks this process descends from: a change means the connection was inherited

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
