"""The PostgreSQL journal: one object that threads share, and what it is made of."""

from __future__ import annotations

import os
import threading
import weakref

from guard.store import CallRecord

from ..reconcile import Reconciling
from .checking import Checking
from .connection import _describe, connect_settings
from .heads import _JOURNALS, _Head
from .opening import Opening
from .reads import Reads
from .writes import Writes


class PostgresJournal(Writes, Reads, Checking, Opening, Reconciling):
    """A journal in a PostgreSQL database (its tables in the first schema of the connection's
    search_path, named by :attr:`schema` once open).

    ``PostgresJournal(dsn, busy_timeout=30.0, pool_size=8, readonly=False, create=True,
    connect_timeout=5.0, timeout=10.0)``. ``dsn`` is a libpq URL or key=value string. ``create`` makes the
    tables in an empty schema; the database itself must exist, in the UTF8 or SQL_ASCII encoding.
    ``busy_timeout`` bounds the wait for the journal's write lock and for a free pooled connection
    (then :class:`StoreBusy`); ``connect_timeout`` bounds a connection attempt; ``timeout`` is how
    long the server may take to answer, past the lock wait ``busy_timeout`` allows: an exchange
    with the server that takes longer than ``busy_timeout + timeout`` seconds (a frozen server) is
    cut off by the client, and the journal treats it as a lost connection (``begin`` then raises,
    and the guard refuses the call ``store_unavailable``). One object is safe to share between threads.

    Raises :class:`JournalNotFound` (no such database or schema, or an empty one and ``create``
    false), :class:`NotAJournal` (the schema holds another application's tables),
    :class:`NewerSchema`, or :class:`JournalError` (the server cannot be reached, the database has
    another encoding, the login may not use the schema); in every case nothing is changed.
    """

    #: that the loop runs on while a write waits for the server (set it false to keep them on the loop).

    offload_async = True

    _placeholder, _unlimited, _nul, _sort_apart = "%s", "ALL", False, ""  # see journal.reading.LogReads

    def __init__(
        self,
        dsn: str,
        *,
        busy_timeout: float = 30.0,
        pool_size: int = 8,
        readonly: bool = False,
        create: bool = True,
        connect_timeout: float = 5.0,
        timeout: float = 10.0,
    ) -> None:
        if busy_timeout <= 0 or connect_timeout <= 0:
            raise ValueError("busy_timeout and connect_timeout must be positive")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"timeout is a number of seconds, more than 0, not {timeout!r}")
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        self.dsn = dsn
        self.name = _describe(dsn)
        self.readonly = readonly
        self.busy_timeout = busy_timeout
        self.connect_timeout = connect_timeout
        self.timeout = float(timeout)
        self._connect_kwargs = connect_settings(dsn, busy_timeout, connect_timeout)
        # The head this object's last write left, the call it wrote, that call's record then, and
        # the hash of the record's last event where it is known.
        self._recent: tuple[_Head, str | None, CallRecord | None, str | None] | None = None
        self._skip_cas = 0
        # Records of calls this object wrote lately, with the hash of each one's last event.
        self._written: dict[str, tuple[CallRecord, str]] = {}
        self._taken = 0  # leases taken by this object, for the sweep of those run out
        # Whether this object's sessions have the server-side append (a login that may not make
        # temporary objects does without it), and a seq at or before the head: every event this
        # object appends from now on comes after it.
        self._server_append = not readonly
        self._floor = 0
        self._suspect = False  # a connection failed lately: probe the server before waiting on the pool
        self._closed = False
        self._lock = threading.Lock()
        _JOURNALS.add(self)
        self._open(create=create and not readonly)
        self.pool_size = pool_size
        self._pid = os.getpid()
        self._pool = self._make_pool()
        self._writers, self._holders = threading.local(), weakref.WeakSet()  # see Connection._writer_conn

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the pool; the journal cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() == self._pid:
            self._release_writers()
            self._pool.close()

    def __enter__(self) -> PostgresJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PostgresJournal({self.name!r}{', readonly' if self.readonly else ''})"
