"""A PostgreSQL server frozen (SIGSTOP of the postmaster and every backend) while a journal uses it.

Its kernel still acknowledges what is sent and answers keepalives, so only a deadline kept by the
client ends the wait: a guarded call is refused ``store_unavailable`` while the server is still
frozen, an outcome that cannot be written leaves the call pending (never run again), and once the
server runs again the log holds each event once. The server is one of this module's own, so that
the freeze reaches no other test.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import psycopg
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from journal.postgres import PostgresJournal
from tests.pgserver import PgServer, fresh_database, frozen

pytestmark = pytest.mark.postgres

# Only a test gone wrong waits this long: the frozen call is to end within seconds.
PATIENCE = 300.0


def in_thread(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as e:  # handed to the test
            result["value"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def guarded(journal: PostgresJournal, during: Any = None) -> tuple[Any, list[int]]:
    ran: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(cents: int) -> dict[str, int]:
        ran.append(cents)
        if during is not None:
            during()
        return {"cents": cents}

    return charge, ran


def call(tool: Any, call_id: str, cents: int) -> Any:
    with AirlockContext(metadata={"tool_call_id": call_id}):
        return tool(cents=cents)


def events_of(dsn: str, call_id: str) -> list[str]:
    with psycopg.connect(dsn, connect_timeout=30) as conn:
        rows = conn.execute("SELECT kind FROM events WHERE call_id = %s ORDER BY seq", (call_id,)).fetchall()
    return [kind for (kind,) in rows]


def test_a_guarded_call_on_a_frozen_server_is_refused_while_it_is_still_frozen(own_server: PgServer) -> None:
    dsn = fresh_database(own_server)
    journal = PostgresJournal(dsn, busy_timeout=1.0, connect_timeout=2.0, timeout=2.0)
    try:
        charge, ran = guarded(journal)
        assert call(charge, "before", 1) == {"cents": 1}  # the pool's connections are open and used
        with frozen(own_server):
            thread, result = in_thread(lambda: call(charge, "during", 2))
            thread.join(PATIENCE)
            assert not thread.is_alive(), "the guarded call waited for the frozen server"
            refused = result["value"]
        assert is_refusal(refused) and refused["block_reason"] == "store_unavailable", refused
        assert ran == [1]  # the refused call did not run
        # Thawed, the server may still carry out the pending it had been sent (then the call is in
        # doubt, and a retry refused); or it never got it (then a retry runs it, once).
        again = call(charge, "during", 2)
        kinds = events_of(dsn, "during")
        if kinds[0] == "pending" and ran == [1]:
            assert kinds == ["pending", "refused"]
            assert is_refusal(again) and again["block_reason"] == "effect_status_unknown"
        else:
            assert (kinds, ran, again) == (["pending", "committed"], [1, 2], {"cents": 2})
        assert journal.verify().ok
    finally:
        journal.close()


def test_an_outcome_written_to_a_frozen_server_leaves_the_call_pending_and_never_run_again(
    own_server: PgServer,
) -> None:
    dsn = fresh_database(own_server)
    journal = PostgresJournal(dsn, busy_timeout=1.0, connect_timeout=2.0, timeout=2.0)
    stop = contextlib.ExitStack()
    try:
        # The server freezes while the tool runs: its pending is recorded, its committed cannot be.
        charge, ran = guarded(journal, during=lambda: stop.enter_context(frozen(own_server)))
        thread, result = in_thread(lambda: call(charge, "c1", 7))
        thread.join(PATIENCE)
        assert not thread.is_alive(), "the outcome write waited for the frozen server"
        stop.close()  # thawed
        assert result["value"] == {"cents": 7}  # the caller still gets the tool's value
        assert ran == [7]
        retried = call(charge, "c1", 7)
        kinds = events_of(dsn, "c1")
        # The committed cut off may still have been carried out once the server ran again: then the
        # retry is a replay; if not, the call is pending and the retry refused. Never run again.
        assert ran == [7]
        assert kinds in (["pending", "refused"], ["pending", "committed", "replayed"]), kinds
        if kinds[-1] == "refused":
            assert is_refusal(retried) and retried["block_reason"] == "effect_status_unknown"
        else:
            assert retried == {"cents": 7}
        assert journal.verify().ok
    finally:
        stop.close()
        journal.close()


def test_the_timeout_is_a_positive_number(own_server: PgServer) -> None:
    dsn = fresh_database(own_server)
    for bad in (0, -1.0, True, "10"):
        with pytest.raises(ValueError, match="timeout is a number of seconds"):
            PostgresJournal(dsn, timeout=bad)  # type: ignore[arg-type]
    with PostgresJournal(dsn) as journal:
        assert journal.timeout == 10.0
