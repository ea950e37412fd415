"""Sealing: the events appended to the inbox, moved into the hash-chained log shortly after they commit.

An append takes its call's lock alone (never a lock every append waits on) and inserts its event
into the ``inbox``, with the canonical body cut around the ``seq`` it does not have yet; the call's
projection row names that inbox row by a negative ``last_seq`` (minus its id). Sealing
(``airlock_seal``, see the schema's version 6) takes the chain head's row, moves every inbox row
committed by then into ``events`` in id order, each given the next ``seq`` and chained to the one
before, and points the projection rows at their ``seq``. One call's events are inserted under its
lock, so they are in the inbox in the order they were written, and are sealed in that order.

Who seals:

- the append itself, when nobody else holds the head (one process writing alone: its event is in
  the log when its transaction commits, as before there was an inbox);
- otherwise a thread of the process that appended, some 30 milliseconds after its commit
  (:class:`Sealer`): a seal waits for the one under way, so every committed row is sealed within
  one seal's time after it, while the process lives;
- every read an operator makes (show, export, verify, checkpoint, archive, stats, the console),
  before it reads (:class:`SealingReads`): what any process left in the inbox is sealed then.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg

from ..errors import JournalError
from .datastore import Conn, PostgresDatastore
from .forks import fork_safe_lock

__all__ = ["SEAL_BATCH", "Sealer", "SealingReads", "hold_log", "seal_all", "try_seal"]

log = logging.getLogger("airlock.journal")

T = TypeVar("T")

#: The most rows one call of ``airlock_seal`` moves (a longer inbox takes several, each committed).
SEAL_BATCH = 5000

_SEAL_WAIT = b"SELECT airlock_seal(%s, true)"
# A read's seal: nothing at all (no lock) when the inbox is empty; nothing either while rebuild,
# archive or copy hold the log (airlock_hold_log's lock: they seal all there is, and the read sees
# the log as it was before them); else as _SEAL_WAIT.
_SEAL_WAITING = (b"SELECT CASE WHEN EXISTS (SELECT 1 FROM inbox) AND pg_try_advisory_xact_lock_shared("
                 b"hashtext('airlock-journal:hold:' || current_schema())) THEN airlock_seal(%s, true) ELSE 0 END")
_SEAL_TRY = b"SELECT airlock_seal(%s, false)"
# The thread's seal: nothing when the inbox is empty; -1 at once when another session holds the head.
_SEAL_SOON = b"SELECT CASE WHEN EXISTS (SELECT 1 FROM inbox) THEN airlock_seal(%s, false) ELSE 0 END"

# How long the thread lets a burst of appends gather before it seals them in one transaction:
# under contention a longer batch costs less an event (8 processes of guarded calls, in paired runs
# on a 2-core machine: 3 ms to 10 ms, 835 to 920 calls/s; 10 ms to 30 ms, 955 to 1,005), for events
# that wait in the inbox that much longer.
_GATHER = 0.030

# A seal commits without waiting for the WAL flush, and so holds the head's row for less time. What
# it moved was committed in the inbox already: a server crash that loses the seal leaves those rows
# there, sealed again afterwards (see docs/postgres.md, "Durability"). A later commit that waits
# for the flush (a pending's) flushes the seal with it, since the WAL is written in order.
_NO_FLUSH_WAIT = b"SET synchronous_commit = off"


def _in_batches(conn: Conn, statement: bytes) -> int:
    """Run a seal ``statement`` (one batch of at most SEAL_BATCH rows each) until a batch is short;
    how many rows moved, or -1 when a batch found the head held by another session."""
    moved = 0
    while True:
        row = conn.execute(statement, (SEAL_BATCH,)).fetchone()
        n = int(row[0]) if row is not None else -1
        if n < 0:
            return -1
        moved += n
        if n < SEAL_BATCH:
            return moved


def seal_all(conn: Conn, *, if_waiting: bool = False) -> int:
    """In ``conn``'s transaction (or autocommit): seal every row of the inbox, waiting for a seal
    under way; the head's row stays locked to the end of the transaction. Returns how many moved.
    ``if_waiting``: not even the head is taken when the inbox is empty."""
    return _in_batches(conn, _SEAL_WAITING if if_waiting else _SEAL_WAIT)


def hold_log(conn: Conn) -> None:
    """In ``conn``'s write transaction: hold the log whole until it ends (appends wait, reads go on)
    with every committed event sealed; what rebuild, archive and copy do before anything else. The
    login needs EXECUTE on ``airlock_hold_log`` (an operator's grant, see docs/postgres.md)."""
    conn.execute(b"SELECT airlock_hold_log()").fetchone()


def seal_soon(conn: Conn) -> int:
    """Seal the inbox, unless it is empty (0) or another session holds the head (-1, at once);
    how many moved."""
    return _in_batches(conn, _SEAL_SOON)


def try_seal(conn: Conn) -> bool:
    """In ``conn``'s transaction: seal the inbox unless another session seals now (then False).
    True means this transaction holds the head's row, with nothing left in the inbox it can see."""
    return _in_batches(conn, _SEAL_TRY) >= 0


class Sealer:
    """Seals what this process's appends left in the inbox, on a thread of its own, soon after.

    :meth:`poke` after an append that was not sealed as it committed: the thread wakes, lets a
    burst gather for some 30 milliseconds, and seals. When another session holds the head (sealing,
    or appending and sealing first), it does not wait behind it: it looks again after the next
    gathering, and so on until it seals or finds the inbox empty, so the rows committed before it
    first looked are sealed by then, by it or by another. A failed seal is logged and tried again
    at the next poke or read; the rows wait in the inbox meanwhile, the projection already holding them. It
    seals on a session of its own, beside the pool (whose sessions are the application's threads'),
    which reads also seal on (a read-only journal's sessions refuse every write).
    """

    def __init__(self, datastore: PostgresDatastore) -> None:
        self._datastore = datastore
        self._wanted = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._lock = fork_safe_lock()
        self._sealing = fork_safe_lock()  # one seal at a time on the session
        self._conn: Conn | None = None
        self._conn_pid = 0
        self._closed = False

    def poke(self) -> None:
        """A row was left in the inbox: seal soon."""
        self._wanted.set()
        thread = self._thread
        if thread is None or self._pid != os.getpid() or not thread.is_alive():
            self._start()

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
                return
            self._pid = os.getpid()  # a forked child has no thread of its parent's
            self._thread = threading.Thread(target=self._run, name="airlock-journal sealer", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread, seal what this process left in the inbox (where the server can be
        reached: else the next append or read of any process seals it), and close the session."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None and self._pid == os.getpid():
            self._wanted.set()
            thread.join(timeout=self._datastore.busy_timeout + self._datastore.timeout)
            try:
                self._seal(seal_all)
            except JournalError as e:
                log.warning("journal %s: could not seal the inbox as it closed (%s)", self._datastore.name, e)
        with self._sealing:
            conn, self._conn = self._conn, None
            if conn is not None and self._conn_pid == os.getpid():
                conn.close()

    def _run(self) -> None:
        held_since: float | None = None  # since when every look found the head held
        told = False
        while not self._closed:
            self._wanted.wait()
            time.sleep(_GATHER)
            self._wanted.clear()
            try:
                if self._seal(seal_soon) >= 0:
                    held_since, told = None, False
                    continue
            except JournalError as e:
                log.warning("journal %s: could not seal the inbox (%s); it is sealed at the next append or read",
                            self._datastore.name, e)
                continue
            self._wanted.set()  # another session holds the head: look again after the next gathering
            now = time.monotonic()
            if held_since is None:
                held_since = now
            elif not told and now - held_since > self._datastore.busy_timeout:
                told = True  # once a while it lasts: a seal, a rebuild or an archive takes no longer
                log.warning("journal %s: another session has held the chain head for over %g s; the events "
                            "in the inbox wait to be sealed until it lets go (see pg_locks for who holds it)",
                            self._datastore.name, self._datastore.busy_timeout)

    def seal(self, *, if_waiting: bool = False) -> int:
        """Seal every committed row of the inbox now (waiting for a seal under way); how many moved.
        Sealing changes nothing any reader sees but where events already committed stand in the log.
        ``if_waiting``: take nothing when the inbox is empty (a read's seal)."""
        if self._closed:
            raise JournalError(f"cannot seal the inbox: the journal {self._datastore.name} is closed")
        return self._seal(lambda conn: seal_all(conn, if_waiting=if_waiting))

    def _seal(self, way: Callable[[Conn], int]) -> int:
        doing = "seal the inbox"
        with self._sealing:
            for attempt in (1, 2):
                fresh = self._conn is None or self._conn_pid != os.getpid() or self._conn.closed
                if fresh:
                    self._conn = self._datastore.own_session(doing)  # a child's own, never its parent's
                    self._conn_pid = os.getpid()
                conn = self._conn
                assert conn is not None
                try:
                    if fresh:
                        conn.execute(_NO_FLUSH_WAIT)
                    return way(conn)
                except psycopg.Error as e:
                    if conn.broken:
                        self._conn = None
                        conn.close()
                        if attempt == 1:
                            continue
                    raise self._datastore.translated(e, doing) from e
        raise AssertionError("unreachable")


class SealingReads:
    """The journal's datastore for operators' reads: before each read, the inbox is sealed, so the
    read sees in the log every event committed before it. A login that may not seal (a read-only
    journal, a standby server, no EXECUTE on ``airlock_seal``) reads what is sealed."""

    def __init__(self, datastore: PostgresDatastore, sealer: Sealer) -> None:
        self._datastore = datastore
        self._sealer = sealer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._datastore, name)

    def seal(self) -> None:
        """Seal what is committed, where this login may; else leave it to the writers."""
        try:
            self._sealer.seal(if_waiting=True)
        except JournalError as e:  # the read itself says so if the server cannot be reached
            log.debug("journal %s: read without sealing first (%s)", self._datastore.name, e)

    def rows(self, doing: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.seal()
        return self._datastore.rows(doing, sql, params)

    def read_only(self, doing: str, work: Callable[[Conn], T]) -> T:
        self.seal()
        return self._datastore.read_only(doing, work)

    def snapshot(self, doing: str, statements: Sequence[str]) -> list[list[tuple[Any, ...]]]:
        self.seal()
        return self._datastore.snapshot(doing, statements)
