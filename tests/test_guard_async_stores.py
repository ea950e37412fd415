"""An ``async def`` tool on a store with ``offload_async`` (PostgreSQL by default, SQLite when asked):
the store's work runs off the event loop, which keeps running while a write waits for another
writer's lock, and a caller cancelled in the meantime leaves a call that may run again, not one
stuck ``pending``."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard, InMemoryEffectStore
from guard.store import CallRecord, Decide, Decision, EffectEvent
from journal import SQLiteJournal

HOLD = 0.6  # seconds another writer keeps the journal locked


def guarded(store: Any, effects: list[str]) -> Any:
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    async def charge(account: str, cents: int) -> dict[str, Any]:
        effects.append(account)
        return {"charged": cents}

    return charge


def hold_sqlite(path: Path, seconds: float) -> Callable[[], threading.Thread]:
    """A function that starts a thread holding the journal's write lock for ``seconds``, and returns
    once the lock is held."""

    def start() -> threading.Thread:
        held = threading.Event()

        def run() -> None:
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
            held.set()
            time.sleep(seconds)
            conn.execute("ROLLBACK")
            conn.close()

        thread = threading.Thread(target=run)
        thread.start()
        assert held.wait(10)
        return thread

    return start


async def ticks_during(coro: Any) -> tuple[Any, int]:
    """Await ``coro`` while a task ticks every 10 ms; returns its result and the ticks it let through."""
    count = 0
    done = False

    async def ticker() -> None:
        nonlocal count
        while not done:
            await asyncio.sleep(0.01)
            count += 1

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)
    try:
        result = await coro
    finally:
        done = True
        await task
    return result, count


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[SQLiteJournal]:
    j = SQLiteJournal(tmp_path / "j.db")
    j.offload_async = True
    j.head()  # the file exists before another connection locks it
    yield j
    j.close()


def test_the_loop_runs_while_begin_waits_for_another_writer(journal: SQLiteJournal) -> None:
    effects: list[str] = []
    charge = guarded(journal, effects)
    locker = hold_sqlite(journal.path, HOLD)

    async def main() -> tuple[Any, int]:
        thread = locker()
        async with AirlockContext(metadata={"tool_call_id": "t1"}):
            started = time.monotonic()
            result, ticks = await ticks_during(charge("acct", 5))
        thread.join()
        assert time.monotonic() - started >= HOLD * 0.8  # it did wait for the lock
        return result, ticks

    result, ticks = asyncio.run(main())
    assert result == {"charged": 5}
    assert effects == ["acct"]
    # The whole wait blocked the loop when begin ran in its thread: no tick at all came through.
    assert ticks >= 10
    assert journal.get("t1").status == "committed"


def test_the_loop_runs_while_the_outcome_waits_for_another_writer(journal: SQLiteJournal) -> None:
    locker = hold_sqlite(journal.path, HOLD)
    threads: list[threading.Thread] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    async def charge(account: str) -> str:
        threads.append(locker())  # the lock is taken after pending, before the outcome is written
        return "ok"

    async def main() -> tuple[Any, int]:
        async with AirlockContext(metadata={"tool_call_id": "t2"}):
            return await ticks_during(charge("acct"))

    result, ticks = asyncio.run(main())
    threads[0].join()
    assert result == "ok"
    assert ticks >= 10
    assert journal.get("t2").status == "committed"


def test_a_caller_cancelled_while_begin_waits_leaves_a_call_that_may_run(journal: SQLiteJournal) -> None:
    effects: list[str] = []
    charge = guarded(journal, effects)
    locker = hold_sqlite(journal.path, HOLD)

    async def main() -> None:
        thread = locker()
        async with AirlockContext(metadata={"tool_call_id": "t3"}):
            task = asyncio.ensure_future(charge("acct", 5))
            await asyncio.sleep(0.1)  # begin is waiting for the lock
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        thread.join()

    asyncio.run(main())
    # The begin went on in its thread once the lock was free, and recorded pending; the tool never
    # ran, so the attempt is released and a retry runs it, where a pending would refuse it for good.
    deadline = time.monotonic() + 10
    while journal.get("t3") is None or journal.get("t3").status == "pending":
        assert time.monotonic() < deadline, journal.get("t3")
        time.sleep(0.01)
    record = journal.get("t3")
    assert effects == []
    assert record.status == "released"
    events = list(journal.events(call_id="t3"))
    assert [e.kind for e in events] == ["pending", "released"]
    assert events[-1].error["type"] == "CancelledError"

    async def retry() -> Any:
        async with AirlockContext(metadata={"tool_call_id": "t3"}):
            return await charge("acct", 5)

    assert asyncio.run(retry()) == {"charged": 5}
    assert effects == ["acct"]
    assert journal.get("t3").status == "committed"
    assert journal.verify().ok


def test_a_caller_cancelled_just_after_begin_finished_releases_the_call(
    journal: SQLiteJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    import guard.airlock as airlock_module

    effects: list[str] = []
    charge = guarded(journal, effects)
    tasks: list[asyncio.Task[Any]] = []
    finish = airlock_module._Handoff.finish

    def finish_then_cancel(self: Any) -> bool:
        # The cancellation reaches the loop after begin finished, before its result does.
        kept = finish(self)
        tasks[0].get_loop().call_soon_threadsafe(tasks[0].cancel)
        time.sleep(0.1)
        return kept

    monkeypatch.setattr(airlock_module._Handoff, "finish", finish_then_cancel)

    async def main() -> None:
        async with AirlockContext(metadata={"tool_call_id": "t8"}):
            tasks.append(asyncio.ensure_future(charge("acct", 5)))
            with pytest.raises(asyncio.CancelledError):
                await tasks[0]

    asyncio.run(main())
    assert effects == []
    assert [e.kind for e in journal.events(call_id="t8")] == ["pending", "released"]
    assert journal.get("t8").status == "released"


def test_a_refusal_of_an_async_call_is_journaled_from_the_worker(journal: SQLiteJournal) -> None:
    @Airlock(policy=SecurityPolicy(denied_tools=["charge"], effect_guard=EffectGuard(store=journal)))
    async def charge(account: str) -> None:
        raise AssertionError("a denied tool ran")

    async def main() -> Any:
        async with AirlockContext(metadata={"tool_call_id": "t5"}):
            return await charge("acct")

    refusal = asyncio.run(main())
    assert refusal["block_reason"] == "policy_violation"
    assert [(e.kind, e.reason["code"]) for e in journal.events(call_id="t5")] == [("refused", "policy_violation")]


class ThreadNotingStore:
    """A store of one's own that notes the threads it is called from."""

    def __init__(self, offload: bool | None = None) -> None:
        self.inner = InMemoryEffectStore()
        self.threads: set[int] = set()
        if offload is not None:
            self.offload_async = offload

    def begin(self, call_id: str, decide: Decide) -> Decision:
        self.threads.add(threading.get_ident())
        return self.inner.begin(call_id, decide)

    def append(self, event: EffectEvent) -> None:
        self.threads.add(threading.get_ident())
        self.inner.append(event)

    def get(self, call_id: str) -> CallRecord | None:
        return self.inner.get(call_id)


@pytest.mark.parametrize("offload", [None, False])
def test_a_store_that_does_not_ask_for_a_worker_is_called_in_the_loops_thread(offload: bool | None) -> None:
    store = ThreadNotingStore(offload)
    charge = guarded(store, [])

    async def main() -> int:
        async with AirlockContext(metadata={"tool_call_id": "t6"}):
            await charge("acct", 1)
        return threading.get_ident()

    assert store.threads == {asyncio.run(main())}


def test_a_store_that_asks_for_a_worker_is_called_from_one() -> None:
    store = ThreadNotingStore(True)
    charge = guarded(store, [])

    async def main() -> int:
        async with AirlockContext(metadata={"tool_call_id": "t7"}):
            assert await charge("acct", 1) == {"charged": 1}
            assert await charge("acct", 1) == {"charged": 1}  # replayed
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert store.threads and loop_thread not in store.threads
    assert store.get("t7").status == "committed"


def test_postgres_asks_for_a_worker_and_sqlite_by_default_does_not(tmp_path: Path) -> None:
    from journal.postgres import PostgresJournal

    assert PostgresJournal.offload_async is True
    assert getattr(InMemoryEffectStore(), "offload_async", False) is False
    journal = SQLiteJournal(tmp_path / "inline.db")
    assert journal.offload_async is False
    threads: set[int] = set()
    begin = journal.begin

    def noting(call_id: str, decide: Decide) -> Decision:
        threads.add(threading.get_ident())
        return begin(call_id, decide)

    journal.begin = noting  # type: ignore[method-assign]
    charge = guarded(journal, [])

    async def main() -> int:
        async with AirlockContext(metadata={"tool_call_id": "t9"}):
            assert await charge("acct", 1) == {"charged": 1}
        return threading.get_ident()

    assert threads == {asyncio.run(main())}
    journal.close()


def test_the_loop_runs_while_a_postgres_begin_waits_for_the_chain_head() -> None:
    psycopg = pytest.importorskip("psycopg")
    from journal.postgres import PostgresJournal
    from tests.pgserver import fresh_schema

    dsn = fresh_schema()
    journal = PostgresJournal(dsn, pool_size=2)
    try:
        effects: list[str] = []
        charge = guarded(journal, effects)
        def hold() -> threading.Thread:
            held = threading.Event()

            def run() -> None:
                with psycopg.connect(dsn) as conn:
                    conn.execute("SELECT * FROM chain_head FOR UPDATE")
                    held.set()
                    time.sleep(HOLD)
                    conn.rollback()

            thread = threading.Thread(target=run)
            thread.start()
            assert held.wait(10)
            return thread

        async def main() -> tuple[Any, int]:
            thread = hold()
            async with AirlockContext(metadata={"tool_call_id": "p1"}):
                started = time.monotonic()
                result, ticks = await ticks_during(charge("acct", 9))
            thread.join()
            assert time.monotonic() - started >= HOLD * 0.8
            return result, ticks

        result, ticks = asyncio.run(main())
        assert result == {"charged": 9}
        assert effects == ["acct"]
        assert ticks >= 10
        assert journal.get("p1").status == "committed"
    finally:
        journal.close()


@pytest.mark.parametrize("grant", [True, False])
def test_an_async_approver_before_a_begin_off_the_loop(journal: SQLiteJournal, grant: bool) -> None:
    from guard import OversightRequest, OversightResponse, OversightVerdict

    asked: list[str] = []

    async def approver(request: OversightRequest) -> OversightResponse:
        asked.append(request.tool_call_id)
        verdict = OversightVerdict.GRANT if grant else OversightVerdict.DENY
        return OversightResponse(request_id=request.request_id, verdict=verdict, approver="ops")

    effects: list[str] = []
    policy = SecurityPolicy(escalate_tools={"charge": "money moves"}, approver=approver,
                            effect_guard=EffectGuard(store=journal))

    @Airlock(policy=policy)
    async def charge(account: str) -> str:
        effects.append(account)
        return "ok"

    async def main() -> Any:
        async with AirlockContext(metadata={"tool_call_id": "e1"}):
            return await charge("acct")

    result = asyncio.run(main())
    assert asked == ["e1"]
    if grant:
        assert result == "ok" and effects == ["acct"]
        assert [e.kind for e in journal.events(call_id="e1")] == ["pending", "committed"]
    else:
        assert result["block_reason"] == "escalation_denied" and effects == []
        assert [e.kind for e in journal.events(call_id="e1")] == ["refused"]


def test_an_approver_that_raises_before_a_begin_off_the_loop(journal: SQLiteJournal) -> None:
    async def approver(request: Any) -> Any:
        raise RuntimeError("the approval service is down")

    policy = SecurityPolicy(escalate_tools={"charge": "money moves"}, approver=approver,
                            effect_guard=EffectGuard(store=journal))

    @Airlock(policy=policy)
    async def charge(account: str) -> str:
        raise AssertionError("ran without approval")

    async def main() -> Any:
        async with AirlockContext(metadata={"tool_call_id": "e2"}):
            return await charge("acct")

    assert asyncio.run(main())["block_reason"] == "escalation_denied"
    assert [e.kind for e in journal.events(call_id="e2")] == ["refused"]
