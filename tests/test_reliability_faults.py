"""Real storage faults: the database full, unwritable, or locked by another process past the deadline.

Recording ``pending`` is the last step before the tool runs, so a store that cannot record it
refuses the call ``store_unavailable`` and the tool does not run; a failure to record the outcome
after the tool ran leaves the call ``pending`` (a retry is refused, never re-run) and is logged.
Every fault here is SQLite's own error on a real file (or PostgreSQL's on a real server).
"""

from __future__ import annotations

import logging
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
from journal.testing import EffectLog, database_full, read_only, write_lock_held

BIG = "x" * 50_000  # needs pages of its own, so it cannot fit in the free space of a full file


def make_pay(store: Any, effects: EffectLog, during: Any = None) -> Any:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def pay(account: str, cents: int, memo: str = "") -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        effects.record(context.tool_call_id, cents=cents)
        if during is not None:
            return during()  # type: ignore[no-any-return]
        return {"paid": cents}

    return pay


def call(tool: Any, call_id: str, *args: Any, **kwargs: Any) -> Any:
    with AirlockContext(metadata={"tool_call_id": call_id}):
        return tool(*args, **kwargs)


def guard_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "guard" and r.levelno >= logging.ERROR]


def assert_untouched(journal: Any, events_before: int) -> None:
    assert journal.count_events() == events_before
    report = journal.verify()
    assert report.ok, report.problem


# -- pending cannot be recorded ------------------------------------------------------------------


def test_a_full_database_refuses_store_unavailable_and_runs_nothing(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog, caplog: pytest.LogCaptureFixture
) -> None:
    pay = make_pay(airlock_journal, airlock_effects)
    assert call(pay, "call_before", "acct_1", 1) == {"paid": 1}
    before = airlock_journal.count_events()

    with database_full(airlock_journal):
        refusal = call(pay, "call_full", "acct_1", 500, memo=BIG)
        assert refusal["block_reason"] == "store_unavailable"
        assert "full" in refusal["metadata"]["store_error"]
        assert airlock_effects.count("call_full") == 0
        assert airlock_journal.get("call_full") is None
        assert_untouched(airlock_journal, before)
    assert any("could not record pending" in m and "call_full" in m for m in guard_errors(caplog))

    # Space again: the same call was never recorded, so it runs now, once.
    assert call(pay, "call_full", "acct_1", 500, memo=BIG) == {"paid": 500}
    assert airlock_effects.count("call_full") == 1
    assert airlock_journal.verify().ok


def test_an_unwritable_database_refuses_store_unavailable_and_runs_nothing(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog, caplog: pytest.LogCaptureFixture
) -> None:
    pay = make_pay(airlock_journal, airlock_effects)
    before = airlock_journal.count_events()
    with read_only(airlock_journal):
        refusal = call(pay, "call_ro", "acct_1", 500)
    assert refusal["block_reason"] == "store_unavailable"
    assert "readonly" in refusal["metadata"]["store_error"]
    assert airlock_effects.count() == 0
    assert_untouched(airlock_journal, before)
    assert any("could not record pending" in m for m in guard_errors(caplog))


def test_a_journal_opened_read_only_as_the_store_refuses_every_call(
    airlock_journal: SQLiteJournal, airlock_journal_path: Path, airlock_effects: EffectLog
) -> None:
    with SQLiteJournal(airlock_journal_path, readonly=True) as readonly:
        pay = make_pay(readonly, airlock_effects)
        assert call(pay, "call_1", "acct_1", 500)["block_reason"] == "store_unavailable"
    assert airlock_effects.count() == 0
    assert_untouched(airlock_journal, 0)


# -- the outcome cannot be recorded after the tool ran -------------------------------------------


def test_the_committed_write_failing_returns_the_value_and_leaves_the_call_pending(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog, caplog: pytest.LogCaptureFixture
) -> None:
    with ExitStack() as fault:

        def fill_the_disk_then_return() -> dict[str, Any]:
            fault.enter_context(database_full(airlock_journal))  # stays full after the tool returns
            return {"paid": 500, "receipt": BIG}

        pay = make_pay(airlock_journal, airlock_effects, during=fill_the_disk_then_return)
        value = call(pay, "call_1", "acct_1", 500)
        assert value == {"paid": 500, "receipt": BIG}  # the caller still gets the tool's value
    assert airlock_effects.count("call_1") == 1
    assert airlock_journal.get("call_1").status == "pending"
    assert any("could not record committed" in m and "call_1" in m for m in guard_errors(caplog))
    assert airlock_journal.verify().ok

    # The retry is refused, not re-run: the effect may have happened (it did).
    retry = call(pay, "call_1", "acct_1", 500)
    assert retry["block_reason"] == "effect_status_unknown"
    assert airlock_effects.count("call_1") == 1
    assert [e.kind for e in airlock_journal.call_events("call_1")] == ["pending", "refused"]


def test_the_unknown_write_failing_still_raises_the_tools_error(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog, caplog: pytest.LogCaptureFixture
) -> None:
    with ExitStack() as fault:

        def unwritable_then_time_out() -> dict[str, Any]:
            fault.enter_context(read_only(airlock_journal))
            raise TimeoutError("the bank did not answer")

        pay = make_pay(airlock_journal, airlock_effects, during=unwritable_then_time_out)
        with pytest.raises(TimeoutError, match="the bank did not answer"):
            call(pay, "call_1", "acct_1", 500)
    assert airlock_journal.get("call_1").status == "pending"
    assert any("could not record unknown" in m for m in guard_errors(caplog))
    assert call(pay, "call_1", "acct_1", 500)["block_reason"] == "effect_status_unknown"
    assert airlock_effects.count("call_1") == 1


# -- the lock held elsewhere past the deadline ---------------------------------------------------


def test_a_lock_held_by_another_process_past_the_deadline_refuses_store_unavailable(
    airlock_journal_path: Path, airlock_effects: EffectLog, caplog: pytest.LogCaptureFixture
) -> None:
    with SQLiteJournal(airlock_journal_path, busy_timeout=1.0) as journal:
        pay = make_pay(journal, airlock_effects)
        assert call(pay, "call_0", "acct_1", 1) == {"paid": 1}
        before = journal.count_events()
        with write_lock_held(airlock_journal_path):
            refusal = call(pay, "call_1", "acct_1", 500)
            assert refusal["block_reason"] == "store_unavailable"
            assert "StoreBusy" in refusal["metadata"]["store_error"]
            assert "locked" in refusal["metadata"]["store_error"]
            assert journal.count_events() == before  # reads still work while the lock is held
        assert airlock_effects.count("call_1") == 0
        assert_untouched(journal, before)
        logged = [m for m in guard_errors(caplog) if "could not record pending" in m]
        assert len(logged) == 1
        assert "call_1" in logged[0] and "stayed locked" in logged[0]
        # The lock is gone: the call was never recorded, so it runs now.
        assert call(pay, "call_1", "acct_1", 500) == {"paid": 500}
        assert airlock_effects.count("call_1") == 1


def test_a_lock_released_within_the_deadline_is_waited_for(
    airlock_journal_path: Path, airlock_effects: EffectLog, caplog: pytest.LogCaptureFixture
) -> None:
    # Contention alone never refuses a call: the holder lets go after a moment and the call runs.
    with SQLiteJournal(airlock_journal_path, busy_timeout=30.0) as journal:
        pay = make_pay(journal, airlock_effects)
        result: list[Any] = []
        with write_lock_held(airlock_journal_path):
            caller = threading.Thread(target=lambda: result.append(call(pay, "call_1", "acct_1", 500)))
            caller.start()
            caller.join(0.5)
            assert caller.is_alive()  # waiting for the lock, not refused
        caller.join(300)
        assert result == [{"paid": 500}]
        assert airlock_effects.count("call_1") == 1
        assert guard_errors(caplog) == []


@pytest.mark.postgres
def test_postgres_a_head_lock_held_past_the_deadline_refuses_store_unavailable(
    airlock_effects: EffectLog, caplog: pytest.LogCaptureFixture
) -> None:
    import psycopg

    from journal.postgres import PostgresJournal
    from tests.pgserver import fresh_schema

    dsn = fresh_schema()
    with PostgresJournal(dsn, busy_timeout=1.0) as journal:
        pay = make_pay(journal, airlock_effects)
        assert call(pay, "call_0", "acct_1", 1) == {"paid": 1}
        before = journal.count_events()
        with psycopg.connect(dsn) as holder:
            # Another replica's open write of the call: it holds the call's lock.
            holder.execute("SELECT pg_advisory_xact_lock(hashtext(current_schema()), hashtext('call_1'))")
            refusal = call(pay, "call_1", "acct_1", 500)
            holder.rollback()
        assert refusal["block_reason"] == "store_unavailable"
        assert "StoreBusy" in refusal["metadata"]["store_error"]
        assert airlock_effects.count("call_1") == 0
        assert_untouched(journal, before)
        assert any("could not record pending" in m and "call_1" in m for m in guard_errors(caplog))
        assert call(pay, "call_1", "acct_1", 500) == {"paid": 500}
