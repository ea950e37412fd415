"""Named kill points: SIGKILL a guarded process at one exact point of a call's life.

``KillPoints(store, at="after_effect")`` is an EffectStore that delegates every method to
``store`` and kills the current process with SIGKILL (no cleanup, no ``finally``, no flush) when
a call reaches the named point. Run the guarded call in a child process, let it die, then retry
it in a new process and check what a user would see: no second effect, ``verify()`` passing, and
the status the replay table promises.

The points, in the order a call meets them:

``during_pending``
    inside the store's transaction that writes ``pending``, before its COMMIT: nothing is
    recorded and the tool has not run, so a retry runs it (once).
``after_pending``
    ``begin`` returned RUN: ``pending`` is durable and the tool has not started.
``in_tool``
    inside the tool, before its body runs (wrap the tool with :meth:`KillPoints.tool`).
``after_effect``
    the tool returned; ``committed`` is not yet recorded.
``during_committed``
    inside the store's transaction that writes ``committed``, before its COMMIT. On SQLite the
    kill comes as the connection starts the COMMIT statement; on PostgreSQL a trigger holds the
    transaction on the server after the event row is inserted and the process is killed there
    (the journal's schema gets a trigger and a function named ``airlock_kill_point``: use it on a
    throwaway journal). ``during_pending`` works the same way.
``during_replay``
    ``begin`` returned REPLAY (``replayed`` is recorded) and the value has not reached the caller.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from guard.context import get_current_context
from guard.store import CallRecord, Decide, Decision, EffectEvent, EffectStore, Verdict

__all__ = ["KILL_POINTS", "KillPoints", "die", "remove_postgres_kill_point"]

F = TypeVar("F", bound=Callable[..., Any])

KILL_POINTS: tuple[str, ...] = (
    "during_pending", "after_pending", "in_tool", "after_effect", "during_committed", "during_replay",
)
_IN_TRANSACTION = {"during_pending": "pending", "during_committed": "committed"}

# At most this long the PostgreSQL trigger waits for the process to be killed.
_PG_HOLD_SECONDS = 10
_PG_LOCK_KEY = 0x41524C4B  # "ARLK", with the pid as the second key
_PG_TRIGGER = "airlock_kill_point"


def die() -> None:
    """SIGKILL this process now: nothing after this line runs."""
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # the signal is delivered before the kernel returns to us; this is never reached
        time.sleep(1)


class KillPoints:
    """An EffectStore that kills this process at the point ``at`` (one of :data:`KILL_POINTS`).

    Args:
        store: the store to delegate to (a journal for ``during_pending`` and ``during_committed``).
        at: the kill point, or None to never kill (so a retry can run the same code unharmed).
        call_id: only calls with this id reach the point (None: the first call that gets there).

    Raises ``ValueError`` for an unknown point, or ``during_pending`` / ``during_committed`` on a
    store that is neither a ``SQLiteJournal`` nor a ``PostgresJournal``. Every other attribute
    (``verify``, ``events``, ``close``, ...) is the wrapped store's.
    """

    def __init__(self, store: EffectStore, at: str | None, *, call_id: str | None = None) -> None:
        if at is not None and at not in KILL_POINTS:
            raise ValueError(f"the kill points are {', '.join(KILL_POINTS)}; not {at!r}")
        if at in _IN_TRANSACTION and _store_kind(store) is None:
            raise ValueError(f"{at} needs a SQLiteJournal or a PostgresJournal, not {store!r}")
        self.store = store
        self.at = at
        self.call_id = call_id

    def _reached(self, point: str, call_id: str | None) -> bool:
        return self.at == point and (self.call_id is None or self.call_id == call_id)

    # -- the EffectStore protocol ----------------------------------------------------------------

    def begin(self, call_id: str, decide: Decide) -> Decision:
        if self._reached("during_pending", call_id):
            # Only a begin that records pending reaches the point: a replay or a refusal passes.
            records_pending = [False]

            def watched(record: CallRecord | None) -> Decision:
                decision = decide(record)
                records_pending[0] = decision.event.kind == "pending"
                return decision

            with _dies_before_commit(self.store, "pending", lambda: records_pending[0]):
                return self.store.begin(call_id, watched)
        decision = self.store.begin(call_id, decide)
        if decision.verdict is Verdict.RUN and self._reached("after_pending", call_id):
            die()
        if decision.verdict is Verdict.REPLAY and self._reached("during_replay", call_id):
            die()
        return decision

    def append(self, event: EffectEvent) -> None:
        if event.kind == "committed" and self._reached("after_effect", event.call_id):
            die()
        if event.kind == "committed" and self._reached("during_committed", event.call_id):
            with _dies_before_commit(self.store, "committed", lambda: True):
                self.store.append(event)
            raise AssertionError(f"the kill point during_committed was not reached in {self.store!r}")
        self.store.append(event)

    def get(self, call_id: str) -> CallRecord | None:
        return self.store.get(call_id)

    # -- the tool ----------------------------------------------------------------------------------

    def tool(self, fn: F) -> F:
        """Wrap a tool (under ``@Airlock``) so that ``in_tool`` kills as its body is entered.

        The wrapper keeps the name, docstring and signature, so the guard binds and keys it alike.
        """

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.at == "in_tool":
                context = get_current_context()
                if self._reached("in_tool", context.tool_call_id if context is not None else None):
                    die()
            return fn(*args, **kwargs)

        return cast(F, wrapper)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def __repr__(self) -> str:
        return f"KillPoints({self.store!r}, at={self.at!r})"


def _store_kind(store: object) -> str | None:
    from journal.sqlite import SQLiteJournal

    if isinstance(store, SQLiteJournal):
        return "sqlite"
    if type(store).__name__ == "PostgresJournal" and type(store).__module__.startswith("journal.postgres"):
        return "postgres"
    return None


@contextmanager
def _dies_before_commit(store: EffectStore, kind: str, armed: Callable[[], bool]) -> Iterator[None]:
    """Kill this process inside the transaction that inserts an event of ``kind``, before COMMIT
    (on SQLite: the first transaction that inserts an event while ``armed()`` is true)."""
    if _store_kind(store) == "sqlite":
        with _sqlite_dies_at_commit(store, armed):
            yield
    else:
        with _postgres_dies_in_transaction(store, kind):
            yield


@contextmanager
def _sqlite_dies_at_commit(store: Any, armed: Callable[[], bool]) -> Iterator[None]:
    # The trace callback runs as a statement starts: at COMMIT the event and the projection row are
    # written inside the transaction, and nothing of it is committed yet.
    conn = store.datastore.connection()
    inserted = [False]

    def trace(statement: str) -> None:
        text = statement.strip().upper()
        if text.startswith("INSERT INTO EVENTS"):
            inserted[0] = armed()
        elif text == "COMMIT" and inserted[0]:
            die()
        elif text in ("COMMIT", "ROLLBACK"):
            inserted[0] = False

    conn.set_trace_callback(trace)
    try:
        yield
    finally:
        conn.set_trace_callback(None)


@contextmanager
def _postgres_dies_in_transaction(store: Any, kind: str) -> Iterator[None]:
    import psycopg

    pid = os.getpid()
    # A session of this process holds an advisory lock while it lives. The trigger holds this
    # process's event of ``kind`` inside its transaction until that lock is free (the process is
    # dead), then aborts the transaction, so nothing of it commits, whatever the client had sent.
    install = [
        f"""CREATE OR REPLACE FUNCTION {_PG_TRIGGER}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.kind = '{kind}' AND (NEW.owner::json ->> 'pid') = '{pid}' THEN
                FOR i IN 1..{_PG_HOLD_SECONDS * 50} LOOP
                    EXIT WHEN pg_try_advisory_xact_lock({_PG_LOCK_KEY}, {pid});
                    PERFORM pg_sleep(0.02);
                END LOOP;
                RAISE EXCEPTION 'airlock kill point: process {pid} was killed inside this transaction';
            END IF;
            RETURN NEW;
        END $$""",
        f"DROP TRIGGER IF EXISTS {_PG_TRIGGER} ON events",
        f"CREATE TRIGGER {_PG_TRIGGER} AFTER INSERT ON events FOR EACH ROW EXECUTE FUNCTION {_PG_TRIGGER}()",
    ]
    with psycopg.connect(store.dsn, autocommit=True) as conn, conn.transaction():
        for statement in install:
            conn.execute(statement.encode())
    watcher = psycopg.connect(store.dsn, autocommit=True)
    watcher.execute(f"SELECT pg_advisory_lock({_PG_LOCK_KEY}, {pid})".encode())

    disarmed = threading.Event()

    def watch() -> None:
        # Kill this process once its transaction is held on the server, the event row inserted.
        while not disarmed.is_set():
            row = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND backend_xid IS NOT NULL "
                "AND datname = current_database() "
                "AND (query LIKE '%INSERT INTO events%' OR query LIKE '%airlock_append(%')"
            ).fetchone()
            if row is not None and row[0] > 0:
                die()
            time.sleep(0.005)

    watching = threading.Thread(target=watch, name="airlock-kill-point", daemon=True)
    watching.start()
    try:
        yield
    finally:  # not killed: the point was not reached (a replay, say), and later writes must pass
        disarmed.set()
        watching.join(5)
        remove_postgres_kill_point(store.dsn)
        watcher.close()


def remove_postgres_kill_point(dsn: str) -> None:
    """Drop the trigger and function ``during_committed`` installed in a PostgreSQL journal."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TRIGGER IF EXISTS {_PG_TRIGGER} ON events".encode())
        conn.execute(f"DROP FUNCTION IF EXISTS {_PG_TRIGGER}()".encode())
