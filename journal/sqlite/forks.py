"""Forks: no connection of this process to a SQLite journal crosses a fork.

Each datastore lets go of its connection before a fork and opens a new one when it is next used,
in the parent and in the child alike; a connection inherited all the same is parked, never used or
closed in the child. The hooks act on the datastores this process has open (anything with
:class:`ForkSafe`'s two methods): this module imports none of the journal's.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import weakref
from typing import Protocol

__all__ = ["FORKS", "INHERITED", "ForkSafe", "opened"]


class ForkSafe(Protocol):
    def before_fork(self) -> threading.RLock | None:
        """Let go of the connection, holding the lock (returned; None when it stayed busy)."""
        ...

    def forked(self) -> None:
        """In the child: fresh locks and queues."""
        ...


# Connections inherited through fork are never used or closed in the child (closing one could
# checkpoint and delete a WAL that the parent still writes); they are parked here instead.
INHERITED: list[sqlite3.Connection] = []

FORKS = [0]  # how many forks this process descends from: a change means the connection was inherited

_OPEN: weakref.WeakSet[ForkSafe] = weakref.WeakSet()  # this process's open datastores

_HELD_FOR_FORK: list[threading.RLock] = []


def opened(datastore: ForkSafe) -> None:
    """Have the hooks act on ``datastore`` while it lives."""
    _OPEN.add(datastore)


def _before_fork() -> None:
    # No connection of this process to a journal may cross a fork. SQLite keeps, per process, a
    # record of the locks it holds on each file; a child inheriting it while the locks themselves
    # (POSIX locks, never inherited) stay with the parent would take its own connections' locks
    # for held, and another process could then check the WAL into the file and delete it under
    # the child's commits. So each datastore lets go of its connection, between transactions (its
    # lock held), and opens a new one when it is next used, in the parent and in the child alike.
    for datastore in sorted(_OPEN, key=id):
        lock = datastore.before_fork()
        if lock is not None:
            _HELD_FOR_FORK.append(lock)


def _after_fork_in_parent() -> None:
    while _HELD_FOR_FORK:
        _HELD_FOR_FORK.pop().release()


def _forked() -> None:
    FORKS[0] += 1
    _HELD_FOR_FORK.clear()
    for datastore in list(_OPEN):
        datastore.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_forked)
