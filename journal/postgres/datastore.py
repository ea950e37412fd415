"""The PostgreSQL journal's datastore: its server, its sessions and its transactions.

:class:`PostgresDatastore` is the one object of a journal that holds connections: the pool, the
connection each writing thread keeps, a connection of its own for what a pooled session must not
do. It bounds every wait (the busy deadline, the connect timeout, the client's deadline on each
exchange), carries on after the server was lost, leaves the parent's pool alone in a forked
child, and runs the read and write transactions, the one place where a psycopg error becomes the
journal's own. It holds no statement of the journal but the settings of its sessions: the parts
of :class:`~journal.postgres.PostgresJournal` bring their own SQL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.sql import SQL, Identifier
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from ..datastore import Dialect
from ..errors import JournalError, JournalNotFound, StoreBusy
from ..urls import without_secrets
from .deadline import DeadlineConnection
from .forks import fork_safe_lock

__all__ = ["DIALECT", "Conn", "ConnectionLost", "NoServerAppend", "PostgresDatastore", "connect_settings", "describe"]

log = logging.getLogger("journal.postgres")

T = TypeVar("T")

Conn = psycopg.Connection[tuple[Any, ...]]

# See journal.datastore.Dialect: a PostgreSQL text holds no NUL, and ORDER BY takes no word that
# keeps an index out of the sort.
DIALECT = Dialect(placeholder="%s", unlimited="ALL", nul=False, sort_apart="")

# Pools inherited through fork are never used or closed in the child (closing one would end the
# parent's sessions on the sockets they share); they are parked here instead.
_INHERITED: list[object] = []

# libpq's words for a connection string value it will not take: a port that is no number or out of
# range, an sslmode (or another setting with named values) that is none of them.
_BAD_SETTING = re.compile(r'invalid (integer value "[^"]*" for connection option|port number:|[\w ]+ value: ")')


def describe(dsn: str) -> str:
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


class ConnectionLost(JournalError):
    """The connection died during a write whose COMMIT may have reached the server."""


class NoServerAppend(Exception):
    """The session has no server-side append; nothing was written: append the locked way."""


class _Held:
    """A connection one thread keeps between its appends, given back to its pool when the thread
    ends, when the journal closes, or when it breaks (see :meth:`PostgresDatastore._writer_conn`)."""

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


class PostgresDatastore:
    """The connections of one journal to its server, and the transactions run on them.

    ``dsn`` is a libpq URL or key=value string; :attr:`name` shows it without its password.
    ``busy_timeout`` bounds the wait for a lock and for a free pooled connection
    (:class:`StoreBusy`), ``connect_timeout`` a connection attempt, and ``busy_timeout + timeout``
    each exchange with the server (a late one is cut off, as a lost connection). Sessions of a
    ``readonly`` datastore write nothing. ``session_setup`` is a statement each pooled session
    runs as it opens (the journal's server-side append, made in the session's ``pg_temp``); a
    session that may not run it goes without, and :attr:`server_append` turns false.

    :meth:`start` opens the pool once the journal's schema is known; until then only
    :meth:`session` connects. Safe to share between threads; a forked child makes a pool of its
    own on its first use.
    """

    dialect = DIALECT

    def __init__(
        self,
        dsn: str,
        *,
        busy_timeout: float,
        connect_timeout: float,
        timeout: float,
        pool_size: int,
        readonly: bool,
        session_setup: str | None,
    ) -> None:
        self.dsn = dsn
        self.name = describe(dsn)
        self.readonly = readonly
        self.busy_timeout = busy_timeout
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.pool_size = pool_size
        #: The schema every session's statements reach (see :meth:`start`).
        self.schema = ""
        #: The statement each pooled session runs as it opens; None: none.
        self.session_setup = session_setup
        #: Whether the sessions have the server-side append: false for a read-only journal, and
        #: from the first time a session could not make it (see :meth:`no_server_append`).
        self.server_append = not readonly and session_setup is not None
        self._connect_kwargs = connect_settings(dsn, busy_timeout, connect_timeout)
        self._lost: list[Callable[[], None]] = []
        self._suspect = False  # a connection failed lately: probe the server before waiting on the pool
        self._closed = False
        self._lock = fork_safe_lock()
        self._pid = os.getpid()
        self._pool = self._new_pool()  # opened by start, once the schema is known
        self._writers = threading.local()  # a thread's _Held, as ``held``
        self._holders: weakref.WeakSet[_Held] = weakref.WeakSet()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, schema: str) -> None:
        """Open the pool, each session's statements set to reach ``schema``."""
        self.schema = schema
        self._pool.open(wait=False)

    @property
    def pool(self) -> ConnectionPool[Conn]:
        """The pool of this process's sessions."""
        return self._pool

    def close(self) -> None:
        """Give back the connections threads keep and close the pool; nothing can be run afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() == self._pid:
            for held in list(self._holders):
                self._holders.discard(held)
                held.release()
            self._pool.close()

    def when_lost(self, forget: Callable[[], None]) -> None:
        """Call ``forget`` whenever a connection is found dead: the server may have restarted and
        lost the events committed last without waiting for the flush, so what a part remembers of
        the log (the head its last write left) may name events that are gone."""
        self._lost.append(forget)

    def no_server_append(self, why: str) -> None:
        """Append the locked way from now on, since ``why``."""
        if self.server_append:
            self.server_append = False
            log.warning("journal %s: appends lock their call from the client, since %s", self.name, why)

    # -- sessions -----------------------------------------------------------------------------

    def _new_pool(self) -> ConnectionPool[Conn]:
        """A pool of sessions configured for the journal, not open yet."""
        return ConnectionPool(
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

    def _configure(self, conn: Conn) -> None:
        self._set_deadline(conn)
        settings = [
            # Each statement sees every commit before it; a read after the head's lock sees the
            # appends that lock waited for (a database whose default is REPEATABLE READ would
            # fail those writes with serialization errors instead).
            "SET default_transaction_isolation = 'read committed'",
            # A session of this version may move the chain head (see the schema's version 6).
            "SET airlock.layout = '6'",
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
        if self.server_append and self.session_setup is not None:
            try:
                conn.execute(self.session_setup.encode())
            except (pg_errors.InsufficientPrivilege, pg_errors.ReadOnlySqlTransaction) as e:
                self.no_server_append(f"the login cannot make a temporary function ({str(e).strip()})")

    def _set_deadline(self, conn: Conn) -> None:
        # The server is given the lock wait it is allowed (lock_timeout), and timeout more to answer.
        if isinstance(conn, DeadlineConnection):
            conn.set_deadline(self.busy_timeout + self.timeout)

    def _connect_direct(self, doing: str) -> Conn:
        try:
            conn: Conn = DeadlineConnection.connect(self.dsn, **self._connect_kwargs)
        except psycopg.Error as e:
            raise self._translate(e, doing) from e
        self._set_deadline(conn)
        return conn

    def own_session(self, doing: str) -> Conn:
        """A connection of its own, outside the pool, reaching the journal's schema, autocommit; the
        caller closes it. For a part that keeps a session beside the pool's (the sealer's)."""
        conn = self._connect_direct(doing)
        try:
            conn.execute(SQL("SET search_path = {}").format(Identifier(self.schema)))
            conn.execute(f"SET lock_timeout = {int(self.busy_timeout * 1000)}".encode())
            # As the pool's sessions: a statement after a lock sees what that lock waited for.
            conn.execute(b"SET default_transaction_isolation = 'read committed'")
            conn.execute(b"SET airlock.layout = '6'")
        except psycopg.Error as e:
            conn.close()
            raise self._translate(e, doing) from e
        return conn

    def translated(self, e: Exception, doing: str) -> JournalError:
        """The journal's error for a psycopg error met while ``doing``."""
        return self._translate(e, doing)

    @contextlib.contextmanager
    def session(self, doing: str) -> Iterator[Conn]:
        """A connection of its own, outside the pool, closed on leaving: for what a pooled session
        cannot do (open the journal before the pool exists, wait on ``LISTEN``). A psycopg error
        raised inside becomes the journal's, ``doing`` naming what failed."""
        conn = self._connect_direct(doing)
        try:
            yield conn
        except psycopg.Error as e:
            raise self._translate(e, doing) from e
        finally:
            conn.close()

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
        """A connection died: the server may have restarted. Probe it before waiting on the pool,
        and have the parts forget what they remember of the log."""
        self._suspect = True
        for forget in self._lost:
            forget()

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
                    self._pool = self._new_pool()
                    self._pool.open(wait=False)
                    self._writers, self._holders = threading.local(), weakref.WeakSet()
        if self._suspect:
            self._probe(doing)
        pool = self._pool
        deadline = time.monotonic() + self.busy_timeout
        try:
            return pool.getconn(timeout=min(self.connect_timeout, self.busy_timeout))
        except PoolTimeout:
            pass
        except PoolClosed as e:
            raise JournalError(f"cannot {doing}: the journal {self.name} is closed") from e
        # No connection in connect_timeout. With connections of its own the pool is only busy: wait
        # on. With none, the server may be down: then fail now, not at the busy deadline.
        if not pool.get_stats().get("pool_size", 0):
            self._probe(doing)
        try:
            return pool.getconn(timeout=max(0.001, deadline - time.monotonic()))
        except PoolTimeout as e:
            raise self._translate(e, doing) from e
        except PoolClosed as e:
            raise JournalError(f"cannot {doing}: the journal {self.name} is closed") from e

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

    # -- transactions -------------------------------------------------------------------------

    def check_writable(self, doing: str) -> None:
        """Raise :class:`JournalError` for ``doing`` on a read-only journal."""
        if self.readonly:
            raise JournalError(f"cannot {doing}: the journal {self.name} is open read-only")

    def label(self) -> str:
        """How the journal's messages name it: :attr:`name`, never with a password."""
        return self.name

    def decoded(self, decode: Callable[[Any], T], row: Any) -> T:
        """``decode(row)``; a stored row that cannot be read raised as the journal's error."""
        try:
            return decode(row)
        except (ValueError, TypeError) as e:
            raise JournalError(f"a stored row of the journal {self.name} cannot be read ({e}); run verify") from e

    def rows(self, doing: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one query and fetch its rows (``doing`` names it in an error); a dead pooled
        connection is replaced once."""
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

    def read_only(self, doing: str, work: Callable[[Conn], T]) -> T:
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

    def snapshot(self, doing: str, statements: Sequence[str]) -> list[list[tuple[Any, ...]]]:
        """The rows of each of ``statements``, in one snapshot."""
        return self.read_only(doing, lambda conn: [conn.execute(s.encode()).fetchall() for s in statements])

    def write(self, doing: str, work: Callable[[Conn], T], pipeline: bool = True, retry: bool = True) -> T:
        """Run ``work`` in one write transaction (pipelined), committed on return.

        A connection found dead before anything could commit is replaced and ``work`` run again
        (unless not ``retry``); a failure once COMMIT may have reached the server is never retried
        (it might have committed) and raises :class:`JournalError` (:class:`ConnectionLost` when
        the connection died).
        """
        self.check_writable(doing)
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
                    raise ConnectionLost(str(self._translate(e, doing))) from e
                raise self._translate(e, doing) from e
            finally:
                self._pool.putconn(conn)
        raise AssertionError("unreachable")

    def single_statement(self, doing: str, sql: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
        """Run one write statement as its own transaction (autocommit: one round trip, no BEGIN or
        COMMIT) on this thread's writer connection; its first row. A connection that dies
        meanwhile leaves it in doubt: :class:`ConnectionLost`."""
        self.check_writable(doing)
        conn = self._writer_conn(doing)
        try:
            return conn.execute(sql, params).fetchone()
        except psycopg.Error as e:
            if conn.broken:
                self._connection_broke()
                raise ConnectionLost(str(self._translate(e, doing))) from e
            raise self._translate(e, doing) from e
        finally:
            self._writer_done(conn)

    def resendable(self, doing: str, sql: str, params: Sequence[Any]) -> tuple[Any, ...]:
        """Run one call of the server-side append (``sql``: a statement that may be sent twice, the
        server telling the second from the first) on this thread's writer connection; its one row.
        A connection that dies meanwhile is replaced and the same statement sent again, once.

        Raises :class:`NoServerAppend` when the session has no server-side append (nothing was
        written), and :class:`ConnectionLost` when it is found missing on the second try (the
        first, cut off, may still append) or the connection dies again."""
        self.check_writable(doing)
        for attempt in (1, 2):
            conn = self._writer_conn(doing)
            try:
                row = conn.execute(sql, params).fetchone()
                assert row is not None  # the function returns one row
                return row
            except (pg_errors.UndefinedFunction, pg_errors.InvalidSchemaName) as e:
                # This session could not make the function (see _configure): it wrote nothing.
                self.no_server_append(f"a session has no server-side append ({str(e).strip()})")
                if attempt == 1:
                    raise NoServerAppend() from e
                # The first call, cut off, may still append: the locked way cannot tell its event.
                raise ConnectionLost(f"cannot {doing}: the connection to the journal {self.name} was lost "
                                     "while the append was made, and it cannot be made again the same way") from e
            except psycopg.Error as e:
                if conn.broken:
                    self._connection_broke()
                    if attempt == 1:
                        continue
                    raise ConnectionLost(str(self._translate(e, doing))) from e
                raise self._translate(e, doing) from e
            finally:
                self._writer_done(conn)
        raise AssertionError("unreachable")
