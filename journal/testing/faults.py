"""Real faults for a SQLite journal: the disk full, the database unwritable, the lock held elsewhere.

Each is a context manager that puts the fault in place for its ``with`` block and takes it away
afterwards; nothing is mocked, the journal meets the error SQLite itself raises.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from journal.sqlite.datastore import SQLiteDatastore

__all__ = ["database_full", "read_only", "write_lock_held"]

_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN IMMEDIATE")
sys.stdout.write("locked\\n")
sys.stdout.flush()
sys.stdin.read()  # hold the lock until the parent closes our stdin (or kills us)
"""


def _datastore(journal: Any) -> SQLiteDatastore:
    from journal.sqlite import SQLiteJournal

    if not isinstance(journal, SQLiteJournal):
        raise TypeError(f"a SQLiteJournal is needed, not {journal!r}")
    return journal.datastore


@contextmanager
def database_full(journal: Any) -> Iterator[None]:
    """The journal's file may not grow (``PRAGMA max_page_count`` at its current size).

    A write that needs a new page fails with SQLite's "database or disk is full"; a small write may
    still fit in the free space of a page already there, so fill it with something big (an argument
    or a value of some kilobytes) when the test needs the write to fail for certain.
    """
    datastore = _datastore(journal)
    conn = datastore.connection()
    with datastore.lock:
        before = conn.execute("PRAGMA max_page_count").fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {int(pages)}")
    try:
        yield
    finally:
        with datastore.lock:
            conn.execute(f"PRAGMA max_page_count = {int(before)}")


@contextmanager
def read_only(journal: Any) -> Iterator[None]:
    """Every write of the journal fails ("attempt to write a readonly database"); reads still work.

    This is what a file that became unwritable looks like to the journal, even to root (whom a
    ``chmod`` does not stop).
    """
    datastore = _datastore(journal)
    conn = datastore.connection()
    with datastore.lock:
        conn.execute("PRAGMA query_only = ON")
    try:
        yield
    finally:
        with datastore.lock:
            conn.execute("PRAGMA query_only = OFF")


@contextmanager
def write_lock_held(path: str | os.PathLike[str]) -> Iterator[int]:
    """Another process holds ``BEGIN IMMEDIATE`` on the SQLite file ``path`` for the ``with`` block.

    Yields the holder's pid. The holder is a child process that took the write lock before the
    block starts; on the way out it is stopped (and killed if it does not stop), so the lock goes.
    """
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, os.fspath(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if line.strip() != b"locked":
            _, err = holder.communicate(timeout=10)
            raise RuntimeError(f"the lock holder did not take the lock: {err.decode(errors='replace').strip()}")
        yield holder.pid
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        try:
            holder.wait(timeout=10)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        for stream in (holder.stdout, holder.stderr):
            if stream is not None:
                stream.close()
