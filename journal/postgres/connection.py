"""The PostgreSQL journal's connections: the pool, transactions, and the one place errors are translated."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.sql import SQL, Identifier
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from guard.store import CallRecord

from ..errors import JournalError, JournalNotFound, StoreBusy
from ..open import without_secrets
from .deadline import DeadlineConnection
from .server_append import _APPEND_FN

if TYPE_CHECKING:
    from .heads import _Head


log = logging.getLogger("journal.postgres")

T = TypeVar("T")

Conn = psycopg.Connection[tuple[Any, ...]]

# Pools inherited through fork are never used or closed in the child (closing one would end the
# parent's sessions on the sockets they share); they are parked here instead.
_INHERITED: list[object] = []

# libpq's words for a connection string value it will not take: a port that is no number or out of
# range, an sslmode (or another setting with named values) that is none of them.
_BAD_SETTING = re.compile(r'invalid (integer value "[^"]*" for connection option|port number:|[\w ]+ value: ")')

def _describe(dsn: str) -> str:
    """``host:port/dbname`` (and the search_path option) of a DSN, never its password."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as e:
        raise JournalError(f"not a PostgreSQL connection string ({without_secrets(str(e).strip(), dsn)})") from e
    host = params.get("host") or params.get("hostaddr") or "localhost"
    where = f"{host}:{params.get('port') or 5432}/{params.get('dbname') or params.get('user') or ''}"
    options = str(params.get("options") or "")
    if "search_path" in options:
        where += f" ({options.strip()})"
    return f"postgresql://{where}"

def _dsn_keys(dsn: str) -> set[str]:
    try:
        return set(conninfo_to_dict(dsn))
    except psycopg.Error:
        return set()  # the connection attempt reports what is wrong with it

def connect_settings(dsn: str, busy_timeout: float, connect_timeout: float) -> dict[str, Any]:
    """The keyword arguments of every connection the journal makes to the server of ``dsn``."""
    settings: dict[str, Any] = {
        "autocommit": True,
        "connect_timeout": max(1, round(connect_timeout)),
        "fallback_application_name": "airlock-journal",
        # Every text goes to the server as UTF-8 and comes back as str, whatever the DSN or
        # PGCLIENTENCODING say: another client encoding cannot carry every id and argument.
        "client_encoding": "utf8",
    }
    # A server cut off by the network mid-statement would otherwise hold a guarded call until the
    # kernel gives up on the connection (minutes): unacknowledged data, or an idle connection
    # whose keepalives go unanswered, drop it within about busy_timeout + connect_timeout.
    # Settings the DSN makes itself are left as they are.
    given = _dsn_keys(dsn)
    for key, value in (
        ("keepalives", 1),
        ("keepalives_idle", max(1, round(connect_timeout))),
        ("keepalives_interval", 1),
        ("keepalives_count", 3),
        ("tcp_user_timeout", int((busy_timeout + connect_timeout) * 1000)),
    ):
        if key not in given:
            settings[key] = value
    return settings


class _ConnectionLost(JournalError):
    """The connection died during a write whose COMMIT may have reached the server."""

class _NoServerAppend(Exception):
    """The session has no server-side append; nothing was written: append the locked way."""

class _Held:
    """A connection one thread keeps between its appends, given back to its pool when the thread
    ends, when the journal closes, or when it breaks (see :meth:`Connection._writer_conn`)."""

    __slots__ = ("__weakref__", "conn", "pid", "pool", "release")

    def __init__(self, conn: Conn, pool: ConnectionPool[Conn]) -> None:
        self.conn, self.pool, self.pid = conn, pool, os.getpid()
        self.release = weakref.finalize(self, _give_back, conn, pool, self.pid)


def _give_back(conn: Conn, pool: ConnectionPool[Conn], pid: int) -> None:
    # It may run in any thread, from the garbage collector: it takes none of the journal's locks.
    if os.getpid() != pid:
        _INHERITED.append(conn)  # a forked child's copy: its socket is the parent's session
        return
    with contextlib.suppress(Exception):
        pool.putconn(conn)  # a closed pool closes it


class _Tx:
    """Where a write transaction got to: nothing is committed before ``committing``."""

    __slots__ = ("committing",)

    def __init__(self) -> None:
        self.committing = False


class Connection:
    """The pool of sessions, each configured for the journal's schema, and the transactions run on them."""

    # What every part reads and writes on the one object (set in PostgresJournal.__init__).
    dsn: str
    name: str
    schema: str
    readonly: bool
    busy_timeout: float
    connect_timeout: float
    timeout: float
    pool_size: int
    _connect_kwargs: dict[str, Any]
    _recent: tuple[_Head, str | None, CallRecord | None, str | None] | None
    _written: dict[str, tuple[CallRecord, str]]
    _skip_cas: int
    _taken: int
    _server_append: bool
    _floor: int
    _suspect: bool
    _closed: bool
    _lock: threading.Lock
    _pid: int
    _pool: ConnectionPool[Conn]
    _writers: threading.local  # a thread's _Held, as ``held``
    _holders: weakref.WeakSet[_Held]

    def _make_pool(self) -> ConnectionPool[Conn]:
        pool: ConnectionPool[Conn] = ConnectionPool(
            self.dsn,
            kwargs=self._connect_kwargs,
            min_size=1,
            max_size=self.pool_size,
            configure=self._configure,
            connection_class=DeadlineConnection,
            timeout=self.busy_timeout,
            name="airlock-journal",
            open=False,
        )
        pool.open(wait=False)
        return pool

    # -- connections and errors ---------------------------------------------------------------

    def _configure(self, conn: Conn) -> None:
        self._set_deadline(conn)
        settings = [
            # Each statement sees every commit before it; a read after the head's lock sees the
            # appends that lock waited for (a database whose default is REPEATABLE READ would
            # fail those writes with serialization errors instead).
            "SET default_transaction_isolation = 'read committed'",
            f"SET lock_timeout = {int(self.busy_timeout * 1000)}",
            # A client that stalls inside a transaction must not hold the write lock for ever.
            f"SET idle_in_transaction_session_timeout = {int(max(60.0, 2 * self.busy_timeout) * 1000)}",
        ]
        if conn.info.server_version >= 120000:
            # The journal's statements look rows up by key: one plan fits every parameter, and
            # planning each execution anew would cost more than the plan saves.
            settings.append("SET plan_cache_mode = force_generic_plan")
        if self.readonly:
            settings.append("SET default_transaction_read_only = on")
        for setting in settings:
            conn.execute(setting.encode())
        # Only the schema checked at open: should it lose its USAGE grant later (or a schema named
        # after the login appear), a statement fails instead of reaching another schema's tables.
        conn.execute(SQL("SET search_path = {}").format(Identifier(self.schema)))
        if self._server_append:
            try:
                conn.execute(_APPEND_FN.encode())
            except (pg_errors.InsufficientPrivilege, pg_errors.ReadOnlySqlTransaction) as e:
                self._no_server_append(f"the login cannot make a temporary function ({str(e).strip()})")

    def _no_server_append(self, why: str) -> None:
        if self._server_append:
            self._server_append = False
            log.warning("journal %s: appends lock the chain head from the client, since %s", self.name, why)

    def _connect_direct(self, doing: str) -> Conn:
        try:
            conn: Conn = DeadlineConnection.connect(self.dsn, **self._connect_kwargs)
        except psycopg.Error as e:
            raise self._translate(e, doing) from e
        self._set_deadline(conn)
        return conn

    def _set_deadline(self, conn: Conn) -> None:
        # The server is given the lock wait it is allowed (lock_timeout), and timeout more to answer.
        if isinstance(conn, DeadlineConnection):
            conn.set_deadline(self.busy_timeout + self.timeout)

    def _translate(self, e: Exception, doing: str) -> JournalError:
        """The one place a psycopg (or pool) error becomes the journal's own."""
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, PoolTimeout):
            return StoreBusy(f"cannot {doing}: no connection to the journal {self.name} "
                             f"was free within {self.busy_timeout:g} s")
        if isinstance(e, pg_errors.LockNotAvailable | pg_errors.QueryCanceled):
            return StoreBusy(f"cannot {doing}: the journal {self.name} stayed locked by other writers "
                             f"for {self.busy_timeout:g} s")
        if isinstance(e, pg_errors.InvalidCatalogName) or (
            isinstance(e, psycopg.OperationalError) and "does not exist" in message and "database" in message
        ):
            return JournalNotFound(f"the journal {self.name} does not exist ({message}); "
                                   "create the database first (createdb)")
        if isinstance(e, pg_errors.ReadOnlySqlTransaction):
            return JournalError(f"cannot {doing}: the journal {self.name} is open read-only")
        if isinstance(e, pg_errors.InsufficientPrivilege):
            return JournalError(f"cannot {doing}: the login may not do it on the journal {self.name} ({message})")
        if isinstance(e, psycopg.OperationalError) and any(
            sign in message for sign in ("authentication failed", "no pg_hba.conf entry", "role \"")
        ):
            # Reached, and it said no: a wrong password, or a login it does not know or let in here.
            return JournalError(f"cannot {doing}: the PostgreSQL server of the journal {self.name} "
                                f"refused the login ({message})")
        if isinstance(e, pg_errors.ProgramLimitExceeded):
            # A btree entry holds at most about 2,700 bytes: a call id (or another indexed text) that
            # long, and that does not compress, cannot be indexed, so it cannot be recorded.
            return JournalError(f"cannot {doing}: a text of it is longer than the journal {self.name} can "
                                f"index ({message}); PostgreSQL keeps call ids of up to about 2,700 bytes")
        if isinstance(e, psycopg.OperationalError) and _BAD_SETTING.search(message):
            # libpq refused a value of the connection string before trying any server.
            return JournalError(f"cannot {doing}: the connection string of the journal {self.name} has a value "
                                f"libpq does not take ({message})")
        if isinstance(e, psycopg.OperationalError | psycopg.InterfaceError):
            return JournalError(f"cannot {doing}: the PostgreSQL server of the journal {self.name} "
                                f"cannot be reached ({message})")
        return JournalError(f"cannot {doing} in the journal {self.name}: {message}")

    def _connection_broke(self) -> None:
        """A connection died: the server may have restarted, and lost the events committed last
        without waiting for the flush. Probe it before waiting on the pool, and forget the head and
        record this object last wrote: after such a loss they may name events that are gone."""
        self._suspect = True
        self._recent = None
        with self._lock:
            self._written.clear()

    def _probe(self, doing: str) -> None:
        """Connect once outside the pool: raises at once while the server is down."""
        conn = self._connect_direct(doing)
        conn.close()
        self._suspect = False
        self._pool.check()  # drop the pooled connections that died with the old server

    def _getconn(self, doing: str) -> Conn:
        if self._closed:
            raise JournalError(f"cannot {doing}: the journal {self.name} is closed")
        if os.getpid() != self._pid:
            with self._lock:
                if os.getpid() != self._pid:  # a forked child: a pool of its own
                    _INHERITED.append(self._pool)
                    self._pid = os.getpid()
                    self._pool = self._make_pool()
                    self._writers, self._holders = threading.local(), weakref.WeakSet()
        if self._suspect:
            self._probe(doing)
        deadline = time.monotonic() + self.busy_timeout
        try:
            return self._pool.getconn(timeout=min(self.connect_timeout, self.busy_timeout))
        except PoolTimeout:
            pass
        except PoolClosed as e:
            raise JournalError(f"cannot {doing}: the journal {self.name} is closed") from e
        # No connection in connect_timeout. With connections of its own the pool is only busy: wait
        # on. With none, the server may be down: then fail now, not at the busy deadline.
        if not self._pool.get_stats().get("pool_size", 0):
            self._probe(doing)
        try:
            return self._pool.getconn(timeout=max(0.001, deadline - time.monotonic()))
        except PoolTimeout as e:
            raise self._translate(e, doing) from e
        except PoolClosed as e:
            raise JournalError(f"cannot {doing}: the journal {self.name} is closed") from e

    def _read(self, doing: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one query and fetch its rows; a dead pooled connection is replaced once."""
        for attempt in (1, 2):
            conn = self._getconn(doing)
            try:
                return conn.execute(sql.encode(), params).fetchall()
            except psycopg.Error as e:
                if attempt == 1 and conn.broken:
                    self._connection_broke()
                    continue
                raise self._translate(e, doing) from e
            finally:
                self._pool.putconn(conn)
        raise AssertionError("unreachable")

    def _rows(self, doing: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows of one statement (see :class:`~journal.reading.LogReads`)."""
        return self._read(doing, sql, params)

    def _read_only(self, doing: str, work: Callable[[Conn], T]) -> T:
        """Run ``work`` in one read-only transaction that sees one snapshot (writers carry on);
        a connection that died with an earlier server is replaced once."""
        for attempt in (1, 2):
            conn = self._getconn(doing)
            try:
                with conn.transaction():
                    conn.execute(b"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                    return work(conn)
            except psycopg.Error as e:
                if conn.broken:
                    self._connection_broke()
                    if attempt == 1:
                        continue  # it only read
                raise self._translate(e, doing) from e
            finally:
                self._pool.putconn(conn)
        raise AssertionError("unreachable")

    def _snapshot(self, doing: str, statements: Sequence[str]) -> list[list[tuple[Any, ...]]]:
        """The rows of each of ``statements``, in one snapshot."""
        return self._read_only(doing, lambda conn: [conn.execute(s.encode()).fetchall() for s in statements])

    def _write(self, doing: str, work: Callable[[Conn], T], pipeline: bool = True, retry: bool = True) -> T:
        """Run ``work`` in one write transaction (pipelined), committed on return.

        A connection found dead before anything could commit is replaced and ``work`` run again;
        a failure once COMMIT may have reached the server is never retried (it might have
        committed) and raises :class:`JournalError` (:class:`_ConnectionLost` when the connection died).
        """
        if self.readonly:
            raise JournalError(f"cannot {doing}: the journal {self.name} is open read-only")
        for attempt in (1, 2):
            conn = self._getconn(doing)
            tx = _Tx()
            try:
                if pipeline:
                    with conn.pipeline(), conn.transaction():
                        result = work(conn)
                        tx.committing = True
                else:
                    with conn.transaction():
                        result = work(conn)
                        tx.committing = True
                return result
            except psycopg.Error as e:
                if retry and attempt == 1 and conn.broken and not tx.committing:
                    self._connection_broke()
                    continue
                if conn.broken:
                    self._connection_broke()
                    raise _ConnectionLost(str(self._translate(e, doing))) from e
                raise self._translate(e, doing) from e
            finally:
                self._pool.putconn(conn)
        raise AssertionError("unreachable")

    def _single_statement(self, doing: str, sql: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
        """Run one write statement as its own transaction (autocommit: one round trip, no BEGIN or
        COMMIT); its first row. A connection that dies meanwhile leaves it in doubt:
        :class:`_ConnectionLost`."""
        self._check_writable(doing)
        conn = self._writer_conn(doing)
        try:
            return conn.execute(sql, params).fetchone()
        except psycopg.Error as e:
            if conn.broken:
                self._connection_broke()
                raise _ConnectionLost(str(self._translate(e, doing))) from e
            raise self._translate(e, doing) from e
        finally:
            self._writer_done(conn)

    def _writer_conn(self, doing: str) -> Conn:
        """A connection for one of the guard's one-statement appends: this thread's own, kept from
        its last append (a pool's checkout and return cost as much as a tenth of the round trip),
        while the threads that keep one leave at least one of the pool's connections to the others.
        Only this thread uses it; :meth:`_writer_done` says when it is free again."""
        held: _Held | None = getattr(self._writers, "held", None)
        if held is not None:
            conn = held.conn
            if (held.pid == os.getpid() and held.pool is self._pool and not self._suspect and not self._closed
                    and not conn.broken and conn.info.transaction_status == TransactionStatus.IDLE):
                return conn
            self._let_go(held)
        conn = self._getconn(doing)
        if len(self._holders) < self.pool_size - 1:
            held = _Held(conn, self._pool)
            self._holders.add(held)
            self._writers.held = held
        return conn

    def _writer_done(self, conn: Conn) -> None:
        held: _Held | None = getattr(self._writers, "held", None)
        if held is None or held.conn is not conn:
            self._pool.putconn(conn)
        elif conn.broken:
            self._let_go(held)  # the pool replaces it

    def _let_go(self, held: _Held) -> None:
        if getattr(self._writers, "held", None) is held:
            self._writers.held = None
        self._holders.discard(held)
        held.release()

    def _release_writers(self) -> None:
        """Give every connection a thread keeps back to the pool (on close)."""
        for held in list(self._holders):
            self._holders.discard(held)
            held.release()

    def _check_writable(self, doing: str) -> None:
        if self.readonly:
            raise JournalError(f"cannot {doing}: the journal {self.name} is open read-only")

    def _decoded(self, decode: Callable[[tuple[Any, ...]], T], row: tuple[Any, ...]) -> T:
        try:
            return decode(row)
        except (ValueError, TypeError) as e:
            raise JournalError(f"a stored row of the journal {self.name} cannot be read ({e}); run verify") from e

    def _label(self) -> str:
        return self.name
