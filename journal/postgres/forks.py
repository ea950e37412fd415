"""Locks that a forked child finds free.

A thread of the parent that held one of the PostgreSQL journal's locks at the fork does not exist
in the child, so the child's copy of that lock would stay held for good, and the child's first
write would hang on it. Every lock of this package is made by :func:`fork_safe_lock`, and released
in the child as it starts. (What else a child must not take over, the parent's pool and
connections, the datastore leaves behind itself: see :mod:`journal.postgres.datastore`.)
"""

from __future__ import annotations

import os
import threading
import weakref

__all__ = ["fork_safe_lock"]

_LOCKS: weakref.WeakSet[threading.Lock] = weakref.WeakSet()


def fork_safe_lock() -> threading.Lock:
    """A new lock, free in any child this process forks from now on."""
    lock = threading.Lock()
    _LOCKS.add(lock)
    return lock


def _forked() -> None:
    # The only thread of the child is the one that forked, which held none of them.
    for lock in list(_LOCKS):
        if lock.locked():
            lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
