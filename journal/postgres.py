"""PostgresJournal: an EffectStore on PostgreSQL, for replicas of an agent on many hosts.

Every append moves the one ``chain_head`` row in the transaction that inserts the event (with the
next ``seq`` and its hash) and updates the call's projection row, so that row's lock orders all
appends: ``seq`` stays gapless and the chain unbroken under any number of writers, and two
``begin`` for one call id can never interleave. Right after this object's own write, a write is one
compare-and-set of the head (one round trip); while other replicas write, one call of a function
that appends on the server under the head's lock (one round trip, the lock held only there); and
where that function cannot be made, or to settle a compare-and-set cut off in doubt, a transaction
that locks the head and then reads (two round trips). docs/postgres.md explains all three. Only
``pending`` is committed synchronously.

While the server cannot be reached, writes raise :class:`~journal.errors.JournalError` within
the connect timeout (the guard refuses the call ``store_unavailable`` and runs nothing); after
it comes back the pool replaces its dead connections and the journal carries on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.sql import SQL, Identifier
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from guard.canonical import NotCanonical
from guard.leases import OwnerState, Settle
from guard.store import CallRecord, Decide, Decision, EffectEvent, apply, format_at, utc_now

from . import archive, pg_schema, verifying
from .chain import GENESIS, hash_of
from .errors import JournalError, JournalNotFound, NewerSchema, NotAJournal, StoreBusy, unstorable
from .events import JournalEvent, JournalStats, VerifyReport
from .leasing import SWEEP_EVERY, owner_state, unclaimable
from .open import without_secrets
from .pg_deadline import DeadlineConnection
from .projection import fold_into
from .reading import LogReads, call_filter, event_filter, page
from .reconcile import Reconciling
from .rows import (
    CALL_COLUMNS,
    EVENT_COLUMNS,
    call_row,
    event_from_row,
    event_row,
    holds,
    operator_event,
    placed,
    record_from_row,
    split_body,
    stamp,
)

__all__ = ["PostgresJournal"]

log = logging.getLogger("journal.postgres")

T = TypeVar("T")
Conn = psycopg.Connection[tuple[Any, ...]]

_BATCH = 1000
# Pools inherited through fork are never used or closed in the child (closing one would end the
# parent's sessions on the sockets they share); they are parked here instead.
_INHERITED: list[object] = []
_CALL_SELECT = f"SELECT {', '.join(CALL_COLUMNS)} FROM calls"
_TAKE_LEASE = ("INSERT INTO leases (call_id, holder, expires_at) "
               "VALUES (%s, %s, clock_timestamp() + make_interval(secs => %s)) "
               "ON CONFLICT (call_id, holder) DO UPDATE SET expires_at = excluded.expires_at RETURNING 1")
_RENEW_LEASE = ("UPDATE leases SET expires_at = clock_timestamp() + make_interval(secs => %s) "
                "WHERE call_id = %s AND holder = %s RETURNING 1")
_DROP_LEASE = "DELETE FROM leases WHERE call_id = %s AND holder = %s RETURNING 1"
_LOCK_LEASES = "SELECT pg_advisory_xact_lock(hashtext('airlock-journal:lease:' || %s))"
_LEASES_OF = "SELECT holder, expires_at > clock_timestamp() FROM leases WHERE call_id = %s"
_LATEST_LEASE = "SELECT max(expires_at), clock_timestamp() FROM leases WHERE call_id = %s"
_LATEST_LEASES = ("SELECT call_id, max(expires_at), clock_timestamp() FROM leases "
                  "WHERE call_id = ANY(%s) GROUP BY call_id")
_SWEEP_LEASES = ("DELETE FROM leases WHERE expires_at < clock_timestamp() AND call_id NOT IN "
                 "(SELECT call_id FROM calls WHERE status = 'pending') RETURNING 1")
_EVENT_SELECT = f"SELECT {', '.join(EVENT_COLUMNS)} FROM events"
_INSERT_EVENT = (
    f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) VALUES ({', '.join(['%s'] * len(EVENT_COLUMNS))})"
)
_UPSERT_CALL = (
    f"INSERT INTO calls ({', '.join(CALL_COLUMNS)}) VALUES ({', '.join(['%s'] * len(CALL_COLUMNS))}) "
    "ON CONFLICT (call_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in CALL_COLUMNS if c != "call_id")
)
_LOCK_HEAD = "SELECT seq, hash, generation FROM chain_head WHERE id = 1 FOR UPDATE"
# Right after this object's own write, an append needs no read: it is made in one round trip if
# the head is still the one that write left (a compare-and-set on the head row; every change of
# the projection moves the head, so an unmoved head means an unchanged projection). A begin for
# a call id this object does not know is decided as for a call never seen, and the append also
# requires that the call has no projection row.
_TYPES = {"seq": "bigint", "attempt": "integer", "last_seq": "bigint"}


def _casts(columns: Sequence[str]) -> str:
    return ", ".join(f"%s::{_TYPES.get(c, 'text')}" for c in columns)


def _cas_append(project: bool, absent: bool, relaxed: bool) -> str:
    # The head as this object left it, by its seq and its hash: after a crash of the server lost the
    # last events (those not committed synchronously), other writers can bring the head back to the
    # same seq, with other events.
    head = "UPDATE chain_head SET seq = %s, hash = %s WHERE id = 1 AND seq = %s AND hash = %s AND generation = %s"
    if absent:
        head += " AND NOT EXISTS (SELECT 1 FROM calls WHERE call_id = %s)"
    if relaxed:
        # The statement is its own transaction (autocommit), so SET LOCAL cannot precede it; this
        # sets the same for the transaction it runs in.
        head += " AND set_config('synchronous_commit', 'off', true) = 'off'"
    parts = [
        f"head AS ({head} RETURNING seq)",
        f"event AS (INSERT INTO events ({', '.join(EVENT_COLUMNS)}) SELECT {_casts(EVENT_COLUMNS)} FROM head)",
    ]
    if project:
        parts.append(
            f"call AS (INSERT INTO calls ({', '.join(CALL_COLUMNS)}) SELECT {_casts(CALL_COLUMNS)} FROM head "
            "ON CONFLICT (call_id) DO UPDATE SET "
            + ", ".join(f"{c} = EXCLUDED.{c}" for c in CALL_COLUMNS if c != "call_id") + ")"
        )
    # Whether it moved the head; and, for a retry when it did not, the head and the call's row as
    # the statement found them (its snapshot: the CTEs' own changes are not seen here).
    found = ", ".join(f"c.{c}" for c in CALL_COLUMNS)
    return (
        f"WITH {', '.join(parts)} SELECT (SELECT count(*) FROM head), h.seq, h.hash, h.generation, {found} "
        "FROM chain_head h LEFT JOIN calls c ON c.call_id = %s WHERE h.id = 1"
    )


_CAS_APPEND = {(p, a, r): _cas_append(p, a, r) for p in (False, True) for a in (False, True) for r in (False, True)}
_NO_RECORD_NEEDED = frozenset({"refused", "replayed"})  # they never change a call's record
_SKIP_AFTER_CONFLICT = 8  # writes that wait for the lock after another writer moved the head
_SET_HEAD = "UPDATE chain_head SET seq = %s, hash = %s WHERE id = 1"
# One statement appends: the event, the projection row where it changes, the head.
_APPEND = f"WITH event AS ({_INSERT_EVENT}) {_SET_HEAD}"
_APPEND_AND_PROJECT = f"WITH event AS ({_INSERT_EVENT}), call AS ({_UPSERT_CALL}) {_SET_HEAD}"
# Only pending must be durable before the tool runs; any other event may reach the disk with the
# next flush (a lost outcome leaves the call pending: a replay is then refused, never re-run).
# The WAL is written in order, so only a tail of such events can be lost: never a hole in the chain.
_RELAXED = b"SET LOCAL synchronous_commit = off"


# The server encodings that store the UTF-8 the journal sends unchanged.
_SERVER_ENCODINGS = frozenset({"UTF8", "SQL_ASCII"})

_CALL_FIELDS = [c for c in CALL_COLUMNS if c not in ("call_id", "last_seq")]
_EVENT_FIELDS = [c for c in EVENT_COLUMNS if c not in ("seq", "prev_hash", "hash")]
# Where other replicas write too (and for an object's first write), an append is one call of this
# function: the server takes the chain head's lock, looks at the call's record and appends, the
# event's seq and hash computed there from the canonical body the client sends cut around its seq.
# So the lock is held for as long as the server needs, not across a round trip to the client and
# its decision. It is a temporary function, made on each of the journal's sessions in the session's
# own pg_temp schema (which only schema-qualified calls reach): every journal, whatever its schema
# version, has it, and a login needs no right beyond the default one to make temporary objects.
#
# Its outcome is 'appended'; or 'found' when the same event (every field alike but its place in the
# chain, the owner naming the calling process, after after_seq) is there already: a call made again
# after its connection was cut appends once, and a first call still running on the server then
# finds the second's event. Or 'changed', when the call's record is not the one the event was made
# from (its last_seq is not expected_last_seq, NULL for no record; or a rebuild moved the head's
# generation): nothing was written, and the row holds the call's current record to decide again on.
_SAME_EVENT = " AND ".join(f"e.{c} IS NOT DISTINCT FROM e_{c}" for c in _EVENT_FIELDS if c != "call_id")
_NO_ROW = ", ".join(f"NULL::{_TYPES.get(c, 'text')}" for c in CALL_COLUMNS)
_APPEND_FN = f"""
CREATE OR REPLACE FUNCTION pg_temp.airlock_append(
    after_seq bigint, check_record boolean, expected_last_seq bigint, expected_last_hash text,
    expected_head_hash text, expected_generation bigint, relaxed boolean, body_head bytea, body_tail bytea,
    {", ".join(f"e_{c} {_TYPES.get(c, 'text')}" for c in _EVENT_FIELDS)},
    project boolean,
    {", ".join(f"c_{c} {_TYPES.get(c, 'text')}" for c in _CALL_FIELDS)}
) RETURNS TABLE (outcome text, new_seq bigint, new_prev_hash text, new_hash text, head_generation bigint,
                 {", ".join(f"r_{c} {_TYPES.get(c, 'text')}" for c in CALL_COLUMNS)}, r_last_hash text)
LANGUAGE plpgsql AS $fn$
DECLARE
    h_seq bigint; h_hash text; h_gen bigint; f_seq bigint; f_prev text; f_hash text; current_last bigint;
    current_hash text; n_seq bigint; n_hash text;
BEGIN
    SELECT h.seq, h.hash, h.generation INTO h_seq, h_hash, h_gen FROM chain_head h WHERE h.id = 1 FOR UPDATE;
    -- Each statement from here on sees every append committed before the lock was taken.
    IF after_seq > h_seq THEN  -- the server lost events the client saw (a crash): it must look again
        RETURN QUERY SELECT 'behind'::text, h_seq, NULL::text, h_hash, h_gen, {_NO_ROW}, NULL::text;
        RETURN;
    END IF;
    IF e_call_id IS NULL THEN
        SELECT e.seq, e.prev_hash, e.hash INTO f_seq, f_prev, f_hash FROM events e
        WHERE e.call_id IS NULL AND e.seq > after_seq AND {_SAME_EVENT} LIMIT 1;
    ELSE
        SELECT e.seq, e.prev_hash, e.hash INTO f_seq, f_prev, f_hash FROM events e
        WHERE e.call_id = e_call_id AND e.seq > after_seq AND {_SAME_EVENT} LIMIT 1;
    END IF;
    IF f_seq IS NOT NULL THEN
        RETURN QUERY SELECT 'found'::text, f_seq, f_prev, f_hash, h_gen, {_NO_ROW}, NULL::text;
        RETURN;
    END IF;
    IF check_record THEN
        -- The record is the one expected when its last event is: by seq and by hash (a crash may
        -- have lost an event whose seq others have filled since), or, where its hash is not
        -- known, when the whole head is the one the client left.
        SELECT c.last_seq, e.hash INTO current_last, current_hash
            FROM calls c LEFT JOIN events e ON e.seq = c.last_seq WHERE c.call_id = e_call_id;
        IF current_last IS DISTINCT FROM expected_last_seq
           OR (expected_generation IS NOT NULL AND h_gen <> expected_generation)
           OR (current_last IS NOT NULL AND CASE WHEN expected_last_hash IS NOT NULL
                                                 THEN current_hash IS DISTINCT FROM expected_last_hash
                                                 ELSE h_hash IS DISTINCT FROM expected_head_hash END) THEN
            RETURN QUERY SELECT 'changed'::text, h_seq, NULL::text, h_hash, h_gen,
                {", ".join(f"c.{c}" for c in CALL_COLUMNS)}, le.hash
                FROM (SELECT 1) AS one LEFT JOIN calls c ON c.call_id = e_call_id
                LEFT JOIN events le ON le.seq = c.last_seq;
            RETURN;
        END IF;
    END IF;
    n_seq := h_seq + 1;
    n_hash := encode(sha256(convert_to(h_hash, 'UTF8') || body_head || convert_to(n_seq::text, 'UTF8')
                            || body_tail), 'hex');
    INSERT INTO events ({", ".join(EVENT_COLUMNS)})
        VALUES (n_seq, {", ".join(f"e_{c}" for c in _EVENT_FIELDS)}, h_hash, n_hash);
    IF project THEN
        INSERT INTO calls ({", ".join(CALL_COLUMNS)})
            VALUES (e_call_id, {", ".join(f"c_{c}" for c in _CALL_FIELDS)}, n_seq)
            ON CONFLICT (call_id) DO UPDATE SET
            {", ".join(f"{c} = EXCLUDED.{c}" for c in CALL_COLUMNS if c != "call_id")};
    END IF;
    UPDATE chain_head SET seq = n_seq, hash = n_hash WHERE id = 1;
    IF relaxed THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN QUERY SELECT 'appended'::text, n_seq, h_hash, n_hash, h_gen, {_NO_ROW}, NULL::text;
END
$fn$
"""
_CALL_APPEND_FN = (
    "SELECT * FROM pg_temp.airlock_append(%s::bigint, %s::boolean, %s::bigint, %s::text, %s::text, %s::bigint, "
    "%s::boolean, "
    f"%s::bytea, %s::bytea, {_casts(_EVENT_FIELDS)}, %s::boolean, {_casts(_CALL_FIELDS)})"
)


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


class _ConnectionLost(JournalError):
    """The connection died during a write whose COMMIT may have reached the server."""


class _NoServerAppend(Exception):
    """The session has no server-side append; nothing was written: append the locked way."""


class _InDoubt(Exception):
    """A one-statement append whose connection died before it answered, not found afterwards."""

    def __init__(self, event: JournalEvent) -> None:
        super().__init__(event.seq)
        self.event = event


@dataclass(frozen=True, slots=True)
class _Head:
    seq: int
    hash: str
    generation: int


_Seen = tuple[_Head, CallRecord | None]  # what a compare-and-set that failed found

# The time of the latest event this process stamped, through any PostgresJournal: the server-side
# append tells an event of one process from another by its fields, so no two may be alike.
_last_at: list[datetime] = []
_AT_LOCK = threading.Lock()
_MICROSECOND = timedelta(microseconds=1)


_JOURNALS: weakref.WeakSet[PostgresJournal] = weakref.WeakSet()


def _forked() -> None:
    """In a forked child, locks that a thread of the parent held at the fork are held for good."""
    global _AT_LOCK
    _AT_LOCK = threading.Lock()
    for journal in list(_JOURNALS):
        journal._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _unique_at(event: EffectEvent) -> EffectEvent:
    """``event``, its time after that of every event this process stamped before: a time that is
    not (a clock that ticks coarsely, stands still in a test, or was set back) is moved to a
    microsecond after the last one, so no two events of one process are alike."""
    at = event.at.astimezone(UTC)  # as format_at reads it (a naive time is local)
    with _AT_LOCK:
        if _last_at and at <= _last_at[0]:
            at = _last_at[0] + _MICROSECOND
        _last_at[:] = [at]
    return event if at == event.at else replace(event, at=at)


def _uniquely_timed(decision: Decision) -> Decision:
    event = _unique_at(decision.event)
    return decision if event is decision.event else replace(decision, event=event)



class _Tx:
    """Where a write transaction got to: nothing is committed before ``committing``."""

    __slots__ = ("committing",)

    def __init__(self) -> None:
        self.committing = False


class PostgresJournal(LogReads, Reconciling):
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

    #: ``async def`` tools make this journal's writes in the guard's pool of threads, off the loop, so
    #: that the loop runs on while a write waits for the server (set it false to keep them on the loop).
    offload_async = True

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
        self._connect_kwargs: dict[str, Any] = {
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
                self._connect_kwargs[key] = value
        # The head this object's last write left, the call it wrote, that call's record then, and
        # the hash of the record's last event where it is known.
        self._recent: tuple[_Head, str | None, CallRecord | None, str | None] | None = None
        self._skip_cas = 0
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
        conn = self._connect_direct("open the journal")
        try:
            self._check_encoding(conn)
            self.schema = self._schema(conn)
            self._open_schema(conn, create=create and not readonly)
            self._floor = int((conn.execute("SELECT seq FROM chain_head WHERE id = 1").fetchone() or (0,))[0])
            may_make_temporary = conn.execute(
                "SELECT has_database_privilege(current_database(), 'TEMPORARY')").fetchone()
            if self._server_append and may_make_temporary != (True,):
                self._no_server_append("the login may not make temporary objects in the database")
        except psycopg.Error as e:
            raise self._translate(e, "open the journal") from e
        finally:
            conn.close()
        self.pool_size = pool_size
        self._pid = os.getpid()
        self._pool = self._make_pool()

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
        conn = self._getconn(doing)
        try:
            return conn.execute(sql, params).fetchone()
        except psycopg.Error as e:
            if conn.broken:
                self._connection_broke()
                raise _ConnectionLost(str(self._translate(e, doing))) from e
            raise self._translate(e, doing) from e
        finally:
            self._pool.putconn(conn)

    # -- schema -------------------------------------------------------------------------------

    def _check_encoding(self, conn: Conn) -> None:
        """Refuse, before anything is written, a database that cannot hold every UTF-8 text."""
        database, encoding = conn.execute(
            "SELECT current_database(), current_setting('server_encoding')").fetchone() or ("", "")
        # SQL_ASCII converts nothing: the UTF-8 bytes the journal sends are stored as they are.
        # Any other encoding refuses the texts it has no character for ("€" in LATIN1).
        if encoding not in _SERVER_ENCODINGS:
            raise JournalError(
                f"cannot open the journal {self.name}: its database {database} has the encoding {encoding}, "
                "which cannot hold every text of a journal; use a UTF8 database "
                "(CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"
            )

    def _open_schema(self, conn: Conn, *, create: bool) -> None:
        """Check what the schema holds; make or migrate the journal's tables when allowed.

        Changes nothing in a schema that holds anything but a journal of this version or older.
        """
        try:
            version = self._inspect(conn)
            if version == pg_schema.SCHEMA_VERSION:
                return
            if not create:
                if version == 0:
                    raise JournalNotFound(f"the journal {self.name} does not exist: the database holds no journal")
                raise JournalError(
                    f"the journal {self.name} has schema version {version}; open it writable once "
                    f"to migrate it to version {pg_schema.SCHEMA_VERSION}"
                )
            with conn.transaction():
                # Replicas that start together migrate one at a time; the others then find it done.
                conn.execute("SELECT pg_advisory_xact_lock(hashtext('airlock-journal:' || current_schema()))")
                version = self._inspect(conn)
                for target in range(version + 1, pg_schema.SCHEMA_VERSION + 1):
                    for statement in pg_schema.MIGRATIONS[target]:
                        conn.execute(statement.encode())
                    if target == 1:
                        conn.execute(
                            "INSERT INTO airlock_journal_meta (id, application, schema_version) VALUES (1, %s, %s)",
                            (pg_schema.APPLICATION, target),
                        )
                    else:
                        conn.execute("UPDATE airlock_journal_meta SET schema_version = %s", (target,))
                if version < pg_schema.SCHEMA_VERSION:
                    log.info("journal %s migrated from schema version %d to %d", self.name, version,
                             pg_schema.SCHEMA_VERSION)
        except psycopg.Error as e:
            raise self._translate(e, "open the journal") from e

    def _schema(self, conn: Conn) -> str:
        """The journal's schema: the first of the search_path (after a leading ``$user`` that names no
        schema), which must be the one the session's statements reach; raises if it is not.

        PostgreSQL's current_schema() skips a schema that does not exist or that the login may not
        use: replicas whose logins differ there would each write a journal of their own.
        """
        setting, current, login = conn.execute(
            "SELECT current_setting('search_path'), current_schema(), current_user").fetchone() or ("", None, "")
        names = pg_schema.search_path_schemas(setting)
        if names[:1] == [pg_schema.USER_SCHEMA]:
            exists = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s)", (login,))
            names[0:1] = [login] if exists.fetchone() == (True,) else []
        if not names:
            raise JournalNotFound(f"the journal {self.name} does not exist: its search_path names no schema")
        schema = names[0]
        if current == schema:
            return schema
        exists, usable = conn.execute(
            "SELECT n.oid IS NOT NULL, coalesce(has_schema_privilege(n.oid, 'USAGE'), false) "
            "FROM (SELECT 1) AS one LEFT JOIN pg_namespace n ON n.nspname = %s", (schema,)).fetchone() or (False, False)
        if not exists:
            raise JournalNotFound(f"the journal {self.name} does not exist: the schema {schema}, the first of its "
                                  "search_path, does not exist; create it first (CREATE SCHEMA)")
        if not usable:
            raise JournalError(f"cannot open the journal {self.name}: the login {login} lacks USAGE on the schema "
                               f"{schema}, the first of its search_path; grant it (GRANT USAGE ON SCHEMA)")
        raise JournalError(f"cannot open the journal {self.name}: its statements reach the schema {current}, "
                           f"not {schema}, the first of its search_path")

    def _inspect(self, conn: Conn) -> int:
        """The journal's schema version (0: an empty schema); raises for anything else."""
        schema = self.schema
        relations = [
            r[0] for r in conn.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'v', 'm', 'f') ORDER BY c.relname", (schema,)
            ).fetchall()
        ]
        if not relations:
            return 0
        if "airlock_journal_meta" not in relations:
            shown = ", ".join(relations[:5]) + (", ..." if len(relations) > 5 else "")
            raise NotAJournal(
                f"{self.name} is not an airlock journal: schema {schema} holds other tables ({shown}); "
                "it was left unchanged (use an empty database, or another schema via search_path)"
            )
        unlike = (f"{self.name} is not an airlock journal: its table airlock_journal_meta is not a journal's "
                  "meta table; it was left unchanged")
        try:
            row = conn.execute("SELECT application, schema_version FROM airlock_journal_meta WHERE id = 1").fetchone()
        except (pg_errors.UndefinedColumn, pg_errors.DatatypeMismatch, pg_errors.UndefinedFunction) as e:
            raise NotAJournal(unlike) from e  # other columns: another application's table of that name
        if row is None or row[0] != pg_schema.APPLICATION:
            raise NotAJournal(f"{self.name} is not an airlock journal: its meta table names "
                              f"{row[0] if row else 'no application'!r}; it was left unchanged")
        try:
            version = int(row[1])
        except (ValueError, TypeError) as e:
            raise NotAJournal(unlike) from e
        if version > pg_schema.SCHEMA_VERSION:
            raise NewerSchema(
                f"the journal {self.name} has schema version {version}, newer than this library's "
                f"{pg_schema.SCHEMA_VERSION}; upgrade airlock-journal to open it (it was left unchanged)"
            )
        missing = [t for t in pg_schema.tables_of(version) if t not in relations]
        if missing:
            raise NotAJournal(f"{self.name} is a damaged journal: it lacks the tables {', '.join(missing)}; "
                              "it was left unchanged")
        return version

    # -- the EffectStore protocol -------------------------------------------------------------

    def _lock_and_read(self, conn: Conn, call_id: str | None) -> tuple[_Head, CallRecord | None]:
        """Lock the head row, then read the call's record (a statement after the lock: it sees the
        last commit); one round trip."""
        head = conn.execute(_LOCK_HEAD)
        found = conn.execute(f"{_CALL_SELECT} WHERE call_id = %s", (call_id,)) if call_id is not None else None
        seq, prev, generation = head.fetchone() or (0, GENESIS, 0)  # the fetch sends the pipeline
        row = found.fetchone() if found is not None else None
        record = self._decoded(record_from_row, row) if row is not None else None
        return _Head(int(seq), str(prev), int(generation)), record

    def _append_locked(self, conn: Conn, head: _Head, record: CallRecord | None,
                       event: EffectEvent) -> tuple[JournalEvent, _Head, CallRecord | None]:
        """Insert ``event`` after ``head`` (locked), fold it into the projection, move the head;
        returns the stored event, the new head and the call's record after it."""
        stored, row = stamp(event, head.seq + 1, head.hash)
        updated = apply(record, event, stored.seq) if event.call_id is not None else None
        if updated is not None and updated is not record:
            conn.execute(_APPEND_AND_PROJECT, (*row, *call_row(updated), stored.seq, stored.hash))
            record = updated
        else:
            conn.execute(_APPEND, (*row, stored.seq, stored.hash))
        return stored, _Head(stored.seq, stored.hash, head.generation), record

    def _locked_write(self, doing: str, call_id: str | None,
                      choose: Callable[[CallRecord | None], EffectEvent],
                      doubt: JournalEvent | None = None) -> JournalEvent:
        """One transaction: lock the head, read the record, ``choose`` the event, append it.

        ``doubt`` is an event whose one-statement append was cut off with its connection: once the
        head is locked, that statement has committed (and is found: it is returned, nothing more is
        written) or it never will (its compare-and-set finds the head moved).
        """
        known = self._recent[0] if self._recent is not None else None

        def work(conn: Conn) -> tuple[JournalEvent, _Head, CallRecord | None]:
            head, record = self._lock_and_read(conn, call_id)
            if doubt is not None and head.seq >= doubt.seq and conn.execute(
                "SELECT 1 FROM events WHERE seq = %s AND hash = %s", (doubt.seq, doubt.hash)
            ).fetchone():
                return doubt, head, record
            if known is not None and head != known:
                self._skip_cas = _SKIP_AFTER_CONFLICT  # others write too: wait for the lock a while
            event = choose(record)
            if event.kind != "pending":
                conn.execute(_RELAXED)
            return self._append_locked(conn, head, record, event)

        self._recent = None
        stored, head, record = self._write(doing, work)
        self._floor = max(self._floor, head.seq)
        projected = record is not None and record.last_seq == stored.seq
        self._remember(head, call_id, record, True, stored.hash if projected else None)
        return stored

    def _append_on_server(self, doing: str, choose: Callable[[CallRecord | None], EffectEvent],
                          known: bool, record: CallRecord | None, last_hash: str | None,
                          check: bool) -> JournalEvent:
        """Append the event ``choose`` makes from the call's record by one call of the server-side
        append (see _APPEND_FN), starting from ``record`` (None: no record; ``known``: it is the
        record this object last wrote, ``last_hash`` the hash of its last event where known).
        ``check``: the event must come from the call's current record; when the server finds
        another, the event is made again from that one and sent again, until the busy deadline."""
        after = self._floor
        last_head = self._recent[0] if self._recent is not None else None
        head_hash = last_head.hash if last_head is not None and known else None
        generation = last_head.generation if last_head is not None and known else None
        deadline = time.monotonic() + self.busy_timeout
        while True:
            event = choose(record)
            updated = apply(record, event, 0) if event.call_id is not None else None
            project = updated is not None and updated is not record
            prepared, body_head, body_tail = split_body(event)
            at_text, error_text, reason_text, owner_text = prepared[0]
            calls = call_row(updated)[1:-1] if updated is not None and project else (None,) * len(_CALL_FIELDS)
            row = self._call_server_append(doing, (
                after, check, record.last_seq if record is not None else None, last_hash, head_hash,
                generation if record is not None else None, event.kind != "pending", body_head, body_tail,
                at_text, event.call_id, event.kind, event.tool, event.agent_id, event.idempotency_key,
                event.arguments, event.value, error_text, reason_text, event.actor, event.attempt, owner_text,
                project, *calls,
            ))
            if row[0] not in ("changed", "behind"):
                break
            if time.monotonic() > deadline:
                raise StoreBusy(f"cannot {doing}: the record of the call {event.call_id!r} in the journal "
                                f"{self.name} kept changing for {self.busy_timeout:g} s")
            generation, head_hash = int(row[4]), str(row[3])
            if row[0] == "behind":
                # The server lost events this object saw (it crashed): what the object remembers of
                # them is gone, and so is the place after which an append sent again is looked for.
                self._floor = after = int(row[1])
                self._recent, last_head = None, None
                record, last_hash = None, None
            else:
                record = None if row[5] is None else self._decoded(record_from_row, row[5:5 + len(CALL_COLUMNS)])
                last_hash = row[5 + len(CALL_COLUMNS)]
        seq, prev, digest = int(row[1]), str(row[2]), str(row[3])
        stored, _ = placed(event, prepared, seq, prev, digest)
        if hash_of(stored) != digest:  # the server hashed other bytes than the chain's rule covers
            raise JournalError(f"cannot {doing}: the journal {self.name} stored event {seq} with the hash "
                               f"{digest}, which is not the chain's; run verify")
        self._floor = max(self._floor, seq)
        head = _Head(seq, digest, int(row[4]))
        if row[0] == "appended" and last_head is not None and (seq - 1, prev) != (last_head.seq, last_head.hash):
            self._skip_cas = _SKIP_AFTER_CONFLICT  # others write too: their appends move the head
        # Unchecked (a refusal or a replay), the record is not known to be current at this head,
        # even if it was the one this object wrote last: another replica may have changed it since.
        if project:
            self._remember(head, event.call_id, apply(record, event, seq), True, digest)
        else:
            self._remember(head, event.call_id, record, check, last_hash)
        return stored

    def _call_server_append(self, doing: str, params: Sequence[Any]) -> tuple[Any, ...]:
        """One call of the server-side append. A connection that dies meanwhile is replaced and the
        same call made again, once: the server finds the event if the first call appended it, and
        a first call still running there finds the second's."""
        self._check_writable(doing)
        for attempt in (1, 2):
            conn = self._getconn(doing)
            try:
                row = conn.execute(_CALL_APPEND_FN, params).fetchone()
                assert row is not None  # the function returns one row
                return row
            except (pg_errors.UndefinedFunction, pg_errors.InvalidSchemaName) as e:
                # This session could not make the function (see _configure): it wrote nothing.
                self._no_server_append(f"a session has no server-side append ({str(e).strip()})")
                if attempt == 1:
                    raise _NoServerAppend() from e
                # The first call, cut off, may still append: the locked way cannot tell its event.
                raise _ConnectionLost(f"cannot {doing}: the connection to the journal {self.name} was lost "
                                      "while the append was made, and it cannot be made again the same way") from e
            except psycopg.Error as e:
                if conn.broken:
                    self._connection_broke()
                    if attempt == 1:
                        continue
                    raise _ConnectionLost(str(self._translate(e, doing))) from e
                raise self._translate(e, doing) from e
            finally:
                self._pool.putconn(conn)
        raise AssertionError("unreachable")

    def _try_append(self, head: _Head, record: CallRecord | None, event: EffectEvent, doing: str,
                    absent: str | None = None, known: bool = True) -> tuple[JournalEvent | None, _Seen | None]:
        """Append ``event`` after ``head`` in one round trip, if the head is still there (and the
        call ``absent`` has no record). Returns the stored event, or None (and then nothing was
        written) with what the statement found: the head and the call's record, to try again with
        (None when the connection was lost). ``known``: ``record`` is the call's (else it was not
        read: a refusal or a replay of a call this object did not write last)."""
        stored, row = stamp(event, head.seq + 1, head.hash)
        updated = apply(record, event, stored.seq) if event.call_id is not None else None
        project = updated is not None and updated is not record
        cas: tuple[Any, ...] = (stored.seq, stored.hash, head.seq, head.hash, head.generation)
        if absent is not None:
            cas += (absent,)
        statement = _CAS_APPEND[project, absent is not None, event.kind != "pending"]
        params = (*cas, *row, *call_row(updated)) if updated is not None and project else (*cas, *row)
        try:
            result = self._single_statement(doing, statement, (*params, event.call_id))
        except _ConnectionLost:
            # In doubt: the compare-and-set either committed whole or not at all; look for it. Not
            # found yet, it may still be waiting on the server for the head's lock: the caller's
            # locked write looks again once it holds that lock (see _locked_write).
            if not self._read(doing, "SELECT 1 FROM events WHERE seq = %s AND hash = %s", (stored.seq, stored.hash)):
                raise _InDoubt(stored) from None
            result = (1,)
        assert result is not None  # the chain_head row is always there
        if result[0] != 1:
            seen = _Head(int(result[1]), str(result[2]), int(result[3]))
            self._floor = max(self._floor, seen.seq)
            found = None if result[4] is None else self._decoded(record_from_row, result[4:])
            return None, (seen, found)
        self._floor = max(self._floor, stored.seq)
        after = _Head(stored.seq, stored.hash, head.generation)
        if project:
            self._remember(after, event.call_id, updated, True, stored.hash)
        else:  # the record as it was: the hash of its last event is known if this object had it
            prior = self._recent
            last_hash = prior[3] if prior is not None and prior[1] == event.call_id and prior[2] is record else None
            self._remember(after, event.call_id, record, known, last_hash)
        return stored, None

    def _remember(self, head: _Head, call_id: str | None, record: CallRecord | None, known: bool,
                  last_hash: str | None) -> None:
        """This object's last write left ``head``, and the call's record ``record`` (when ``known``:
        a record not read is never remembered as the call's, so the next begin checks for one),
        whose last event has the hash ``last_hash`` (None: not known)."""
        self._recent = (head, call_id, record, last_hash) if known else (head, None, None, None)

    def begin(self, call_id: str, decide: Decide) -> Decision:
        """Read the call's record, let ``decide`` choose, append its event, atomically: no other
        append comes between the read and the append (see :meth:`_begin`)."""
        try:
            return self._begin(call_id, decide)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self.name, e) from e

    def _begin(self, call_id: str, decide: Decide) -> Decision:
        """:meth:`begin`.

        Right after this object's own write, in one round trip (a compare-and-set on the head, which
        also reads the record the decision should have been taken on, for one more try); else by
        the server-side append (one round trip, and one more when the call's record was not the one
        this object knew), or in one transaction that locks the head row first (two round trips).
        """
        doing = "record the call"
        self._check_writable(doing)
        recent = self._recent
        doubt: JournalEvent | None = None
        doubted: Decision | None = None
        if recent is not None and self._skip_cas <= 0:
            head, known_id, record, _ = recent
            absent: str | None = None if known_id == call_id else call_id
            if absent is not None:
                record = None  # decided as for a call never seen; the append checks that it is not
            for _ in range(2):
                decision = _uniquely_timed(decide(record))
                try:
                    stored, seen = self._try_append(head, record, decision.event, doing, absent=absent)
                except _InDoubt as e:
                    doubt, doubted = e.event, decision
                    break
                if stored is not None:
                    return decision
                if seen is None:
                    break
                # The head the statement found, and the record as of that head: current while the
                # head does not move again (every change of the projection moves it).
                (head, record), absent = seen, None
        self._skip_cas = max(0, self._skip_cas - 1)
        decisions: list[Decision] = []

        def choose(record: CallRecord | None) -> EffectEvent:
            decisions[:] = [_uniquely_timed(decide(record))]
            return decisions[0].event

        if doubt is None and self._server_append:
            with contextlib.suppress(_NoServerAppend):
                self._append_on_server(doing, choose, *self._known_record(call_id), check=True)
                return decisions[0]
        if self._locked_write(doing, call_id, choose, doubt) is doubt and doubted is not None:
            return doubted  # the cut-off append had committed: that is the decision recorded
        return decisions[0]

    def append(self, event: EffectEvent) -> None:
        """Append an outcome or a refusal (folded into the projection where it applies)."""
        self.append_event(event)

    def append_event(self, event: EffectEvent) -> JournalEvent:
        """:meth:`append`, returning the event as stored (with its ``seq`` and ``hash``)."""
        try:
            return self._append_event(event)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self.name, e) from e

    def _append_event(self, event: EffectEvent) -> JournalEvent:
        doing = f"record the {event.kind} event"
        self._check_writable(doing)
        event = _unique_at(event)
        doubt: JournalEvent | None = None
        recent = self._recent
        if recent is not None and self._skip_cas <= 0:
            # This object wrote last: if it still did, its head and the call's record are current.
            head, call_id, record, _ = recent
            if call_id == event.call_id or event.call_id is None or event.kind in _NO_RECORD_NEEDED:
                known = call_id == event.call_id
                attempt_record = record if known else None
                for _ in range(2):
                    try:
                        stored, seen = self._try_append(head, attempt_record, event, doing, known=known)
                    except _InDoubt as e:
                        doubt = e.event
                        break
                    if stored is not None:
                        return stored
                    if seen is None:
                        break
                    (head, attempt_record), known = seen, True
        self._skip_cas = max(0, self._skip_cas - 1)
        if doubt is None and self._server_append:
            check = event.call_id is not None and event.kind not in _NO_RECORD_NEEDED
            with contextlib.suppress(_NoServerAppend):
                return self._append_on_server(doing, lambda record: event, *self._known_record(event.call_id), check)
        return self._locked_write(doing, event.call_id, lambda record: event, doubt)

    def _known_record(self, call_id: str | None) -> tuple[bool, CallRecord | None, str | None]:
        """Whether this object wrote ``call_id`` last, the call's record as that write left it, and
        the hash of that record's last event where known; (False, None, None) for another call."""
        recent = self._recent
        if recent is not None and call_id is not None and recent[1] == call_id:
            return True, recent[2], recent[3]
        return False, None, None

    def _check_writable(self, doing: str) -> None:
        if self.readonly:
            raise JournalError(f"cannot {doing}: the journal {self.name} is open read-only")

    def get(self, call_id: str) -> CallRecord | None:
        """The current record of ``call_id``, or None."""
        if not holds(call_id, nul=False):
            return None  # an id with no UTF-8 form (a lone surrogate), or with a NUL, is never stored
        rows = self._read("read the call", f"{_CALL_SELECT} WHERE call_id = %s", (call_id,))
        return self._decoded(record_from_row, rows[0]) if rows else None

    def recent_call(self, agent_id: str | None, idempotency_key: str, since: datetime) -> CallRecord | None:
        """The most recent call of ``agent_id`` with ``idempotency_key`` begun at or after ``since`` and
        not released, or None (the lookup of ``EffectGuard(duplicate_window=...)``)."""
        if not holds(idempotency_key, nul=False) or (agent_id is not None and not holds(agent_id, nul=False)):
            return None
        agent, params = ("agent_id IS NULL", ()) if agent_id is None else ("agent_id = %s", (agent_id,))
        rows = self._read(
            "look up a recent call",
            f"{_CALL_SELECT} WHERE idempotency_key = %s AND created_at >= %s AND {agent} AND status != 'released' "
            "ORDER BY created_at DESC, call_id DESC LIMIT 1",
            (idempotency_key, format_at(since), *params),
        )
        return self._decoded(record_from_row, rows[0]) if rows else None

    def _decoded(self, decode: Callable[[tuple[Any, ...]], T], row: tuple[Any, ...]) -> T:
        try:
            return decode(row)
        except (ValueError, TypeError) as e:
            raise JournalError(f"a stored row of the journal {self.name} cannot be read ({e}); run verify") from e

    # -- reading ------------------------------------------------------------------------------

    def call(self, call_id: str) -> CallRecord | None:
        """The call's current record, or None (never seen, or only refusals)."""
        return self.get(call_id)

    def calls(
        self,
        *,
        status: str | Sequence[str] | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        limit: int | None = 50,
        offset: int = 0,
    ) -> list[CallRecord]:
        """Calls newest first (by ``updated_at``, then ``call_id``, both descending), filtered by status
        (one, or any of several), tool, agent and ``updated_at >= since``; at most ``limit`` (None: all),
        after skipping the first ``offset`` (the pages of a long list)."""
        where, params = call_filter("%s", False, status, tool, agent_id, since)
        sql = _CALL_SELECT + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY updated_at DESC, call_id DESC" + page(limit, offset, "ALL")
        return [self._decoded(record_from_row, r) for r in self._read("read the calls", sql, params)]

    @staticmethod
    def _event_filter(
        call_id: str | None, tool: str | None, agent_id: str | None,
        since: datetime | None, until: datetime | None,
    ) -> tuple[str, list[Any]]:
        clauses, params = event_filter("%s", False, call_id, tool, agent_id, since, until)
        return "".join(f" AND {c}" for c in clauses), params

    def event_rows(
        self,
        *,
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after_seq: int = 0,
    ) -> Iterator[tuple[Any, ...]]:
        """What :meth:`events` gives, as the stored rows (columns of ``journal.rows.EVENT_COLUMNS``),
        for exports that stream millions."""
        where, params = self._event_filter(call_id, tool, agent_id, since, until)
        # Up to the head as it is now: a reader never chases writers that keep appending.
        head = int(self._read("read the events", "SELECT coalesce(max(seq), 0) FROM events")[0][0])
        sql = f"{_EVENT_SELECT} WHERE seq > %s AND seq <= %s{where} ORDER BY seq LIMIT {_BATCH}"
        last = after_seq
        while True:
            rows = self._read("read the events", sql, [last, head, *params])
            yield from rows
            if len(rows) < _BATCH:
                return
            last = int(rows[-1][0])

    def count_events(
        self,
        *,
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after_seq: int = 0,
    ) -> int:
        """How many events :meth:`events` with the same filters yields."""
        where, params = self._event_filter(call_id, tool, agent_id, since, until)
        rows = self._read("count the events", f"SELECT count(*) FROM events WHERE seq > %s{where}",
                          [after_seq, *params])
        return int(rows[0][0])

    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last event; ``(0, GENESIS)`` for an empty journal."""
        rows = self._read("read the chain head", "SELECT seq, hash FROM chain_head WHERE id = 1")
        return (int(rows[0][0]), str(rows[0][1])) if rows else (0, GENESIS)

    # -- archiving (journal.archive) -------------------------------------------------------------

    def archived_head(self) -> tuple[int, str]:
        """The seq and hash of the last archived event, where the log now starts; ``(0, GENESIS)``
        when nothing was archived."""
        rows = self._read("read the archived head", "SELECT last_seq, last_hash FROM archives "
                          "ORDER BY last_seq DESC LIMIT 1")
        return (int(rows[0][0]), str(rows[0][1])) if rows else (0, GENESIS)

    def commit_archive(self, plan: archive.ArchivePlan, file: str, archived_at: str) -> int:
        """Remove the events ``plan`` moves, once they are in the archive ``file``, in one
        transaction that holds the chain head and also records the archive's head; returns how many
        were removed. The login needs EXECUTE on ``airlock_archive_events`` (see docs/postgres.md)."""

        def work(conn: Conn) -> int:
            conn.execute(_LOCK_HEAD).fetchone()
            return archive.postgres_commit(conn, plan, file, archived_at)

        return self._write("archive the events", work, pipeline=False, retry=False)

    def stats(self) -> JournalStats:
        """Counts of calls by status and tool, and when the oldest pending and unknown calls
        entered that status."""
        from guard.store import parse_at

        by_status = {str(s): int(n) for s, n in self._read(
            "count the calls", "SELECT status, count(*) FROM calls GROUP BY status ORDER BY status")}
        by_tool = {str(t): int(n) for t, n in self._read(
            "count the calls", "SELECT tool, count(*) FROM calls GROUP BY tool ORDER BY tool")}
        oldest = dict(self._read(
            "read the oldest calls",
            "SELECT status, min(since) FROM calls WHERE status IN ('pending', 'unknown') GROUP BY status"))
        events = self.head()[0]
        return JournalStats(
            calls=sum(by_status.values()),
            events=events,
            by_status=by_status,
            by_tool=by_tool,
            oldest_pending_at=parse_at(oldest["pending"]) if oldest.get("pending") else None,
            oldest_unknown_at=parse_at(oldest["unknown"]) if oldest.get("unknown") else None,
        )

    # -- checking and repairing ---------------------------------------------------------------

    def verify(self, *, advance: Callable[[int], None] | None = None) -> VerifyReport:
        """Recompute the hash chain and check the projection and the head against the log, on one
        consistent snapshot (writers carry on meanwhile). ``advance`` is told of each stretch of
        events checked (a progress bar's update)."""
        doing = "verify the journal"
        for attempt in (1, 2):
            conn = self._getconn(doing)
            try:
                with conn.transaction():
                    conn.execute(b"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                    return self._verify(conn, advance)
            except psycopg.Error as e:
                if conn.broken:
                    self._connection_broke()
                    if attempt == 1:
                        continue  # a connection that died with an earlier server: it only read
                raise self._translate(e, doing) from e
            finally:
                self._pool.putconn(conn)
        raise AssertionError("unreachable")

    def _verify(self, conn: Conn, advance: Callable[[int], None] | None = None) -> VerifyReport:
        # The log goes on from the last archive's head, folded onto the projection as of that head.
        # Server-side cursors: the log and the projection come in batches, never whole into memory.
        def streamed(name: str, sql: str) -> Iterator[tuple[Any, ...]]:
            with conn.cursor(name=name) as cur:
                cur.itersize = _BATCH
                cur.execute(sql.encode())
                yield from cur

        calls = functools.partial(streamed, "airlock_verify_calls", f"{_CALL_SELECT} ORDER BY call_id")
        start = archive.postgres_archived_head(conn)
        archived = verifying.HeldProjection(archive.postgres_snapshot(conn), calls) if start[0] else None
        check, folded = verifying.check_log(streamed("airlock_verify", f"{_EVENT_SELECT} ORDER BY seq"),
                                            start=start, archived=archived, advance=advance)
        report = check.report()
        if not report.ok:
            return report
        head = conn.execute(b"SELECT seq, hash FROM chain_head WHERE id = 1").fetchone()
        log_end = check.last_seq
        if head is None or (int(head[0]), str(head[1])) != (log_end, report.head):
            if head is not None and int(head[0]) > log_end:
                # The log was cut short: the first event missing is the first bad one.
                first, last = log_end + 1, int(head[0])
                missing = f"seq {first} is" if first == last else f"seq {first} to {last} are"
                return VerifyReport(
                    ok=False, events=report.events, head=report.head, first_bad_seq=first,
                    problem=f"{missing} missing: the log ends at seq {log_end} but the chain head "
                            f"row records seq {last}",
                )
            return VerifyReport(
                ok=False, events=report.events, head=report.head, first_bad_seq=log_end or None,
                problem=f"the chain head row {head!r} does not match the last event",
            )
        return verifying.compare_projection(check, folded, archived.rows(folded) if archived is not None else calls())

    def rebuild(self, *, advance: Callable[[int], None] | None = None) -> int:
        """Rebuild the projection from the log (writers wait meanwhile); returns the number of calls.
        ``advance`` is told of each batch of events folded."""

        def work(conn: Conn) -> int:
            conn.execute(_LOCK_HEAD).fetchone()
            # From the projection as of the last archive's head (none: from an empty one).
            folded = {row[0]: self._decoded(record_from_row, row) for row in archive.postgres_snapshot(conn)}
            # A server-side cursor: the log comes in batches, never whole into this process's memory.
            with conn.cursor(name="airlock_rebuild") as cur:
                cur.execute(f"{_EVENT_SELECT} ORDER BY seq".encode())
                while rows := cur.fetchmany(_BATCH):
                    for row in rows:
                        fold_into(folded, self._decoded(event_from_row, row))
                    if advance is not None:
                        advance(len(rows))
            conn.execute(b"DELETE FROM calls")
            with conn.cursor() as cur:
                cur.executemany(_UPSERT_CALL, [call_row(r) for r in folded.values()])
            # Writers that read the old projection must read again: their compare-and-set now fails.
            conn.execute(b"UPDATE chain_head SET generation = generation + 1 WHERE id = 1")
            return len(folded)

        return self._write("rebuild the projection", work, pipeline=False)

    def import_events(self, events: Iterable[JournalEvent],
                      check: Callable[[VerifyReport], None] | None = None) -> int:
        """Insert stored ``events`` (``seq`` from 1, in order) as they are, with their hashes, and the
        projection folded from them (replacing whatever rows the projection held), into this empty
        journal in one transaction; returns the number of calls. ``check`` is given the report of
        :meth:`verify` on the result before it commits, and raises to refuse it. Raises
        :class:`JournalError` when the journal already holds events, or ``check`` refuses: nothing
        is changed then. Used by :func:`journal.copy.copy_journal`."""

        def work(conn: Conn) -> int:
            seq = (conn.execute(_LOCK_HEAD).fetchone() or (0,))[0]
            if seq or conn.execute(b"SELECT EXISTS (SELECT 1 FROM events)").fetchone() != (False,):
                raise JournalError(f"the destination {self.name} is not empty; copy only into a new journal")
            folded: dict[str, CallRecord] = {}
            last: JournalEvent | None = None
            with conn.cursor().copy(f"COPY events ({', '.join(EVENT_COLUMNS)}) FROM STDIN".encode()) as copy:
                for event in events:
                    copy.write_row(event_row(event))
                    fold_into(folded, event)
                    last = event
            # The projection is the fold of these events alone: rows left from before (with no events
            # of their own) would make calls the copied log never had.
            conn.execute(b"DELETE FROM calls")
            with conn.cursor() as cur:
                cur.executemany(_UPSERT_CALL, [call_row(r) for r in folded.values()])
            if last is not None:
                conn.execute(_SET_HEAD, (last.seq, last.hash))
            conn.execute(b"UPDATE chain_head SET generation = generation + 1 WHERE id = 1")
            if check is not None:
                check(self._verify(conn))  # before the commit: a copy refused leaves nothing behind
            return len(folded)

        # Not retried: the events are consumed as they are copied.
        return self._write("copy events", work, pipeline=False, retry=False)

    # -- leases (see guard.leases); the store's clock is the server's ---------------------------

    def take_lease(self, call_id: str, holder: str, seconds: float) -> None:
        """Record ``holder``'s lease on ``call_id``, running out ``seconds`` from the server's now."""
        self._taken += 1
        self._single_statement("take a lease", _TAKE_LEASE, (call_id, holder, seconds))
        if self._taken % SWEEP_EVERY == 0:
            self._single_statement("sweep the leases", _SWEEP_LEASES, ())

    def renew_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        """Extend ``holder``'s lease; False when it has none on the call any more."""
        return self._single_statement("renew a lease", _RENEW_LEASE, (seconds, call_id, holder)) is not None

    def drop_lease(self, call_id: str, holder: str) -> None:
        """Forget ``holder``'s lease on ``call_id``."""
        self._single_statement("drop a lease", _DROP_LEASE, (call_id, holder))

    def claim_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        """Take a lease on ``call_id`` only if no other holder has a live one and the call is not
        pending with an owner alive by the host-and-pid test (one that never had a lease)."""

        def work(conn: Conn) -> bool:
            conn.execute(_LOCK_LEASES, (call_id,))  # one claim of the call at a time, on any replica
            rows = conn.execute(_LEASES_OF, (call_id,)).fetchall()
            others = [r for r in rows if r[0] != holder]
            if others:
                if any(alive for _, alive in others):
                    return False
            else:
                row = conn.execute(f"{_CALL_SELECT} WHERE call_id = %s", (call_id,)).fetchone()
                record = None if row is None else self._decoded(record_from_row, row)
                if unclaimable(record):
                    return False
            conn.execute(_TAKE_LEASE, (call_id, holder, seconds))
            return True

        return self._write("claim a call", work, pipeline=False)

    def settle(self, call_id: str, choose: Settle) -> int | None:
        """Read the call's record, let ``choose`` make the event, append it;
        in one transaction that holds the head. Returns the ``seq`` appended (None: none chosen)."""
        if not holds(call_id, nul=False):  # no call has it
            choose(None)
            return None

        def work(conn: Conn) -> int | None:
            head, record = self._lock_and_read(conn, call_id)
            event = choose(record)
            if event is None:
                return None
            return self._append_locked(conn, head, record, event)[0].seq

        self._recent = None
        try:
            return self._write("settle the call", work, pipeline=False)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self.name, e) from e

    def owner_states(self, records: list[CallRecord]) -> dict[str, OwnerState]:
        """Whether each pending record's owner is alive, and when its lease runs out."""
        pending = [r.call_id for r in records if r.status == "pending"]
        latest: dict[str, datetime] = {}
        now = None
        if pending:
            for call_id, until, at in self._read("read the leases", _LATEST_LEASES, (pending,)):
                latest[call_id], now = until, at
        return {r.call_id: owner_state(r, latest.get(r.call_id), now if now is not None else utc_now())
                for r in records}

    def _lease_alive(self, conn: Conn, record: CallRecord | None) -> bool | None:
        """Whether a lease on the pending call has not run out; None when it has none."""
        if record is None or record.status != "pending":
            return None
        until, now = conn.execute(_LATEST_LEASE, (record.call_id,)).fetchone() or (None, None)
        return None if until is None else bool(until > now)

    # -- operators ----------------------------------------------------------------------------

    def _label(self) -> str:
        return self.name

    def resolve(
        self,
        call_id: str,
        *,
        applied: bool,
        reason: str,
        operator: str,
        value: str | None = None,
        force: bool = False,
    ) -> JournalEvent:
        """Settle a pending or unknown call: append ``committed`` (``applied``, with ``value``,
        JSON text) or ``released`` by ``operator:NAME``, checking its status in the same
        transaction. Raises :class:`CallNotFound` or :class:`NotResolvable`; changes nothing then."""

        if not holds(call_id, nul=False):  # no call has it: what is wrong with the arguments, else CallNotFound
            operator_event(call_id, None, applied=applied, reason=reason, operator=operator, value=value,
                           force=force, journal=self.name)

        def work(conn: Conn) -> JournalEvent:
            head, record = self._lock_and_read(conn, call_id)
            event = operator_event(call_id, record, applied=applied, reason=reason, operator=operator,
                                   value=value, force=force, journal=self.name,
                                   lease_alive=self._lease_alive(conn, record))
            return self._append_locked(conn, head, record, event)[0]

        self._recent = None
        return self._write("resolve the call", work)

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the pool; the journal cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() == self._pid:
            self._pool.close()

    def __enter__(self) -> PostgresJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PostgresJournal({self.name!r}{', readonly' if self.readonly else ''})"
