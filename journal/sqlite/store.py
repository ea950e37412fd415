"""The SQLite journal: one object that threads share, and what it is made of."""

from __future__ import annotations

import collections
import contextlib
import os
import sqlite3
import threading
from pathlib import Path

from ..reconcile import Reconciling
from . import damage, schema
from .checking import Checking
from .connection import Durability
from .forks import _FORKS, _INHERITED, _JOURNALS
from .group_commit import _Request
from .reads import Reads
from .writes import Writes


class SQLiteJournal(Writes, Reads, Checking, Reconciling):
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
