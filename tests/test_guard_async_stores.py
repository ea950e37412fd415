"""An ``async def`` tool on a store with ``offload_async`` (PostgreSQL by default, SQLite when asked):
the store's work runs off the event loop, which keeps running while a write waits for another
writer's lock, and a caller cancelled in the meantime leaves a call that may run again, not one
stuck ``pending``."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, offload
from guard.effect_guard import EffectGuard, InMemoryEffectStore, reversibility
from guard.store import CallRecord, Decide, Decision, EffectEvent
from journal import SQLiteJournal
from journal.testing import write_lock_held

HOLD = 0.6  # seconds another writer keeps the journal locked


def guarded(store: Any, effects: list[str]) -> Any:
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    async def charge(account: str, cents: int) -> dict[str, Any]:
        effects.append(account)
        return {"charged": cents}

    return charge


def hold_sqlite(path: Path, seconds: float) -> Callable[[], threading.Thread]:
    """A function that has another process hold the journal's write lock for ``seconds`` (the test
    kit's ``write_lock_held``, from a thread), and returns once the lock is held."""

    def start() -> threading.Thread:
        held = threading.Event()

        def run() -> None:
            with write_lock_held(path):
                held.set()
                time.sleep(seconds)

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


def settled(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Wait for what a worker makes after its caller left."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not settled in time"
        time.sleep(0.01)


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

    async def main() -> Any:
        thread = locker()
        async with AirlockContext(metadata={"tool_call_id": "t3"}):
            with pytest.raises(TimeoutError):  # a host's timeout, while begin waits for the lock
                await asyncio.wait_for(charge("acct", 5), 0.1)
            # The begin went on once the lock was free and recorded pending; the tool never ran, so
            # the attempt is released before the caller hears of its cancellation, and the host's
            # retry runs the call, where a pending would have it refused "do not retry".
            assert [e.kind for e in journal.events(call_id="t3")] == ["pending", "released"]
            assert effects == []
            retried = await charge("acct", 5)
        thread.join()
        return retried

    assert asyncio.run(main()) == {"charged": 5}
    assert effects == ["acct"]
    events = list(journal.events(call_id="t3"))
    assert [(e.kind, e.attempt) for e in events] == [("pending", 1), ("released", 1), ("pending", 2),
                                                    ("committed", 2)]
    assert events[1].error["type"] == "CancelledError"
    assert journal.verify().ok


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
    """A store of one's own that notes the threads it is called from, and can take its time (a
    server's round trip) over a begin or an append of some kind."""

    def __init__(self, offload: bool | None = None, begin_takes: float = 0.0,
                 append_takes: dict[str, float] | None = None) -> None:
        self.inner = InMemoryEffectStore()
        self.threads: set[int] = set()
        self.writers: dict[str, set[int]] = {}
        self.begin_takes, self.append_takes = begin_takes, append_takes or {}
        if offload is not None:
            self.offload_async = offload

    def begin(self, call_id: str, decide: Decide) -> Decision:
        self.threads.add(threading.get_ident())
        time.sleep(self.begin_takes)
        return self.inner.begin(call_id, decide)

    def append(self, event: EffectEvent) -> None:
        self.threads.add(threading.get_ident())
        self.writers.setdefault(event.kind, set()).add(threading.get_ident())
        time.sleep(self.append_takes.get(event.kind, 0.0))
        self.inner.append(event)

    def kinds(self, call_id: str) -> list[str]:
        return [e.kind for e in self.inner.events(call_id)]

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
                    # Another replica's open write of the call: it holds the call's lock.
                    conn.execute("SELECT pg_advisory_xact_lock(hashtext(current_schema()), hashtext('p1'))")
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


# -- cancellations and the executor ------------------------------------------------------------


@pytest.mark.parametrize("reversible", [False, True])
def test_a_caller_cancelled_while_its_outcome_is_written_leaves_a_committed_call(reversible: bool) -> None:
    store = ThreadNotingStore(True, append_takes={"committed": 0.4})
    effects: list[str] = []
    charge = guarded(store, effects)
    if reversible:
        charge = reversibility("reversible")(charge)

    async def main() -> Any:
        async with AirlockContext(metadata={"tool_call_id": "o1"}):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(charge("acct", 5), 0.1)  # the tool ran; its commit is being written
            assert store.kinds("o1") == ["pending", "committed"]  # written before the caller heard
            return await charge("acct", 5)

    assert asyncio.run(main()) == {"charged": 5}  # replayed, not refused, and not run again
    assert effects == ["acct"]
    assert store.kinds("o1") == ["pending", "committed", "replayed"]


def test_a_caller_cancelled_before_a_worker_took_its_begin_journals_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    store = ThreadNotingStore(True)
    effects: list[str] = []
    charge = guarded(store, effects)

    pool = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(offload, "_executor", pool)  # the guard's pool, shrunk to one thread

    async def main() -> None:
        async with AirlockContext(metadata={"tool_call_id": "q1"}):
            assert await charge("acct", 5) == {"charged": 5}
            free = threading.Event()
            busy = pool.submit(free.wait, 10)  # its one worker is taken (by another call's write)
            task = asyncio.ensure_future(charge("acct", 5))  # a retry, queued behind it
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            free.set()
            busy.result()
            pool.submit(time.sleep, 0).result()  # anything still queued has run by now

    asyncio.run(main())
    assert store.kinds("q1") == ["pending", "committed"]  # no replay journaled for a caller that was gone


def test_the_release_of_a_call_cancelled_after_its_begin_is_written_off_the_loop() -> None:
    store = ThreadNotingStore(True, begin_takes=0.05, append_takes={"released": 0.3})
    effects: list[str] = []
    charge = guarded(store, effects)

    async def main() -> int:
        async with AirlockContext(metadata={"tool_call_id": "r1"}):
            task = asyncio.ensure_future(charge("acct", 5))
            await asyncio.sleep(0)  # gates and begin go to a worker

            async def busy_then_cancel() -> None:
                time.sleep(0.2)  # the loop is busy while the begin finishes and its result waits
                task.cancel()

            canceller = asyncio.ensure_future(busy_then_cancel())
            with pytest.raises(asyncio.CancelledError):
                await task
            await canceller
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    settled(lambda: store.kinds("r1") == ["pending", "released"])
    assert effects == []
    assert store.writers["released"] and loop_thread not in store.writers["released"]


def fail_to_start_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a pids limit or a full memory does: the executor queues the work, then cannot start a thread.
    start = threading.Thread.start
    failed: list[bool] = []

    def failing(self: threading.Thread) -> None:
        if self.name.startswith("starved") and not failed:
            failed.append(True)
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", failing)


def test_a_worker_that_cannot_start_leaves_the_call_made_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = SQLiteJournal(tmp_path / "j.db")
    journal.offload_async = True
    effects: list[str] = []
    charge = guarded(journal, effects)

    @Airlock(policy=SecurityPolicy(denied_tools=["refund"], effect_guard=EffectGuard(store=journal)))
    async def refund(account: str) -> None:
        raise AssertionError("a denied tool ran")

    fail_to_start_a_worker(monkeypatch)

    pool = ThreadPoolExecutor(thread_name_prefix="starved")
    monkeypatch.setattr(offload, "_executor", pool)

    async def main() -> Any:
        async with AirlockContext(metadata={"tool_call_id": "w1"}):
            value = await charge("acct", 5)
        async with AirlockContext(metadata={"tool_call_id": "w2"}):
            refusal = await refund("acct")
        pool.submit(time.sleep, 0).result()  # the queued copies, if any, have their turn
        return value, refusal

    value, refusal = asyncio.run(main())
    assert value == {"charged": 5} and effects == ["acct"]
    assert refusal["block_reason"] == "policy_violation"
    assert [e.kind for e in journal.events(call_id="w1")] == ["pending", "committed"]
    assert [e.kind for e in journal.events(call_id="w2")] == ["refused"]  # one refusal, one event
    journal.close()


@pytest.mark.parametrize("offload", [False, True])
def test_a_tool_stepped_without_an_asyncio_loop_runs(tmp_path: Path, offload: bool) -> None:
    # As another event loop library (trio, say) drives a coroutine: no asyncio loop is running.
    journal = SQLiteJournal(tmp_path / "j.db")
    journal.offload_async = offload
    charge = guarded(journal, [])
    with AirlockContext(metadata={"tool_call_id": "m1"}):
        coro = charge("acct", 1)
        with pytest.raises(StopIteration) as done:
            coro.send(None)
    assert done.value.value == {"charged": 1}
    assert journal.get("m1").status == "committed"
    journal.close()


@pytest.mark.parametrize("offload", [False, True])
def test_a_tool_whose_loop_closed_under_it_is_recorded_unknown(tmp_path: Path, offload: bool) -> None:
    journal = SQLiteJournal(tmp_path / "j.db")
    journal.offload_async = offload

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    async def charge(account: str) -> None:
        await asyncio.Event().wait()  # never returns

    loop = asyncio.new_event_loop()
    coros: list[Any] = []
    tasks: list[Any] = []

    async def start() -> None:
        with AirlockContext(metadata={"tool_call_id": "g1"}):
            coros.append(charge("acct"))
            tasks.append(loop.create_task(coros[0]))
        await asyncio.sleep(0.2)  # the tool is running

    loop.run_until_complete(start())
    loop.close()  # with the task still pending
    coros[0].close()  # what the garbage collector does to a destroyed task's coroutine
    assert journal.get("g1").status == "unknown"
    journal.close()


# -- the guard's own pool ----------------------------------------------------------------------


class GatedStore(ThreadNotingStore):
    """Its begin waits for ``gate`` (a server that answers late)."""

    def __init__(self) -> None:
        super().__init__(True)
        self.gate = threading.Event()
        self.gate.set()
        self.begun = threading.Event()

    def begin(self, call_id: str, decide: Decide) -> Decision:
        self.begun.set()
        assert self.gate.wait(20)
        return super().begin(call_id, decide)


def test_host_threads_waiting_for_guarded_calls_in_the_default_executor_do_not_starve_them(
    journal: SQLiteJournal,
) -> None:
    # Sync code that a host runs with asyncio.to_thread, calling async tools on the loop and waiting.
    charge = guarded(journal, [])
    workers = ThreadPoolExecutor()._max_workers  # what the loop's default executor gets here

    async def one(i: int) -> Any:
        async with AirlockContext(metadata={"tool_call_id": f"b{i}"}):
            return await charge(f"acct{i}", i)

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()

        def bridge(i: int) -> Any:
            return asyncio.run_coroutine_threadsafe(one(i), loop).result(timeout=10)

        return list(await asyncio.gather(*(asyncio.to_thread(bridge, i) for i in range(workers * 2))))

    assert asyncio.run(main()) == [{"charged": i} for i in range(workers * 2)]


def test_a_cancelled_caller_leaves_at_once_while_the_default_executor_is_busy(journal: SQLiteJournal) -> None:
    started = asyncio.Event()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    async def charge(account: str) -> None:
        started.set()
        await asyncio.sleep(10)

    workers = ThreadPoolExecutor()._max_workers

    async def main() -> float:
        host = [asyncio.ensure_future(asyncio.to_thread(time.sleep, 1.5)) for _ in range(workers)]
        async with AirlockContext(metadata={"tool_call_id": "h1"}):
            task = asyncio.ensure_future(charge("acct"))
            await asyncio.wait_for(started.wait(), 10)
            await asyncio.sleep(0.05)  # the host's threads took every worker of the default executor
            begun = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            held = time.monotonic() - begun
            assert not any(job.done() for job in host)  # they still hold every worker
            retry = await charge("acct")
        await asyncio.gather(*host)
        assert retry["block_reason"] == "effect_status_unknown"  # the retry found the unknown
        return held

    assert asyncio.run(main()) < 0.5
    assert journal.get("h1").status == "unknown"


def test_a_second_call_with_the_id_does_not_wait_for_the_first_ones_tool() -> None:
    store = ThreadNotingStore(True)
    release = asyncio.Event()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    async def charge(account: str) -> str:
        await release.wait()
        return "ok"

    async def main() -> tuple[Any, Any]:
        async with AirlockContext(metadata={"tool_call_id": "d1"}):
            first = asyncio.ensure_future(charge("acct"))
            await asyncio.sleep(0.05)  # the first is in its tool
            second = await asyncio.wait_for(charge("acct"), 5)  # refused at once, not after the tool
            release.set()
            return await first, second

    first, second = asyncio.run(main())
    assert first == "ok" and second["block_reason"] == "effect_status_unknown"
    assert store.kinds("d1") == ["pending", "refused", "committed"]


def test_an_anyio_cancel_scope_waits_for_the_write_and_spins_nothing() -> None:
    anyio = pytest.importorskip("anyio")
    store = GatedStore()
    store.gate.clear()  # the begin answers a second late
    effects: list[str] = []
    charge = guarded(store, effects)

    async def main() -> tuple[float, float]:
        cpu, wall = time.process_time(), time.monotonic()
        async with AirlockContext(metadata={"tool_call_id": "n1"}):
            with anyio.move_on_after(0.05):  # what an MCP request's cancel scope does
                await charge("acct", 5)
        return time.process_time() - cpu, time.monotonic() - wall

    threading.Timer(1.0, store.gate.set).start()
    cpu, wall = anyio.run(main)
    # The caller waited for its begin and the release (the scope cancels it again on every turn of
    # the loop: past the first, it waits in the loop's thread), burning no CPU meanwhile.
    assert wall >= 0.9 and cpu < 0.3
    assert store.kinds("n1") == ["pending", "released"]
    assert effects == []


@pytest.mark.parametrize("phase", ["running", "queued"])
def test_a_coroutine_closed_during_its_begin_leaves_a_call_that_may_run(
    phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = GatedStore()
    effects: list[str] = []
    charge = guarded(store, effects)
    pool = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(offload, "_executor", pool)
    free = threading.Event()
    loop = asyncio.new_event_loop()
    coros: list[Any] = []
    tasks: list[Any] = []

    async def start() -> None:
        if phase == "running":
            store.gate.clear()
        else:
            pool.submit(free.wait, 10)  # the one worker is taken
        with AirlockContext(metadata={"tool_call_id": "g2"}):
            coros.append(charge("acct", 5))
            tasks.append(loop.create_task(coros[0]))
        await asyncio.sleep(0.1)
        assert store.begun.is_set() == (phase == "running")

    loop.run_until_complete(start())
    loop.close()  # with the task still pending
    threading.Timer(0.2, store.gate.set).start()  # the server answers while the coroutine closes
    free.set()
    coros[0].close()  # what the garbage collector does to a destroyed task's coroutine
    assert store.kinds("g2") == (["pending", "released"] if phase == "running" else [])

    async def retry() -> Any:
        async with AirlockContext(metadata={"tool_call_id": "g2"}):
            return await charge("acct", 5)

    assert asyncio.run(retry()) == {"charged": 5}
    assert effects == ["acct"]


def test_work_made_in_the_callers_thread_keeps_nothing_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import weakref

    class Rows(list[str]):  # a value a weak reference can watch
        pass

    store = ThreadNotingStore(True)

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    async def fetch(n: int) -> Any:
        return Rows(["x" * 100] * 10)

    start = threading.Thread.start

    def always_failing(self: threading.Thread) -> None:
        if self.name.startswith("starved"):
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", always_failing)
    pool = ThreadPoolExecutor(thread_name_prefix="starved")
    monkeypatch.setattr(offload, "_executor", pool)
    values: list[weakref.ref[Any]] = []

    async def main() -> None:
        for i in range(20):
            async with AirlockContext(metadata={"tool_call_id": f"l{i}"}):
                values.append(weakref.ref(await fetch(i)))

    asyncio.run(main())
    gc.collect()
    assert all(store.get(f"l{i}").status == "committed" for i in range(20))
    assert sum(v() is not None for v in values) == 0  # the jobs left queued hold no value
    assert pool._work_queue.qsize() <= 1  # and the pool that could not start is not used again


def test_a_forked_child_has_a_pool_of_its_own(tmp_path: Path) -> None:
    import multiprocessing

    journal = SQLiteJournal(tmp_path / "f.db")
    journal.offload_async = True
    charge = guarded(journal, [])

    async def one(call_id: str) -> Any:
        async with AirlockContext(metadata={"tool_call_id": call_id}):
            return await charge("acct", 1)

    assert asyncio.run(one("parent")) == {"charged": 1}

    def child() -> None:
        os._exit(0 if asyncio.run(one("child")) == {"charged": 1} else 1)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == 0
    assert journal.get("child").status == "committed"
    journal.close()


def test_a_journal_closed_after_the_loop_has_every_record(tmp_path: Path) -> None:
    # A host that closes its journal once asyncio.run returns, with a call cancelled in its begin.
    path = tmp_path / "closed.db"
    effects: list[str] = []
    with SQLiteJournal(path) as journal:
        journal.offload_async = True
        journal.head()
        charge = guarded(journal, effects)
        locker = hold_sqlite(path, HOLD)

        async def main() -> None:
            thread = locker()
            async with AirlockContext(metadata={"tool_call_id": "x1"}):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(charge("acct", 5), 0.1)
            thread.join()

        asyncio.run(main())
    with SQLiteJournal(path) as reopened:
        assert [e.kind for e in reopened.events(call_id="x1")] == ["pending", "released"]
        assert reopened.verify().ok
    assert effects == []


def test_a_denial_is_journaled_for_a_caller_that_left_before_a_worker_took_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from guard import OversightResponse, OversightVerdict

    store = ThreadNotingStore(True)
    pool = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(offload, "_executor", pool)
    free = threading.Event()
    decided = asyncio.Event()

    async def approver(request: Any) -> Any:
        pool.submit(free.wait, 10)  # the one worker is taken as the verdict comes
        decided.set()
        return OversightResponse(request_id=request.request_id, verdict=OversightVerdict.DENY, approver="ops")

    @Airlock(policy=SecurityPolicy(escalate_tools={"charge": "money"}, approver=approver,
                                   effect_guard=EffectGuard(store=store)))
    async def charge(account: str) -> None:
        raise AssertionError("ran without approval")

    async def main() -> None:
        async with AirlockContext(metadata={"tool_call_id": "a1"}):
            task = asyncio.ensure_future(charge("acct"))
            await asyncio.wait_for(decided.wait(), 10)
            await asyncio.sleep(0.05)
            task.cancel()
            threading.Timer(0.2, free.set).start()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert [(e.kind, e.reason["code"]) for e in store.inner.events("a1")] == [("refused", "escalation_denied")]


def suspended_in(coro: Any) -> list[str]:
    """The coroutines ``coro`` is suspended in, outermost first."""
    names = []
    while coro is not None and hasattr(coro, "cr_code"):
        names.append(coro.cr_code.co_name)
        coro = coro.cr_await
    return names


def one_turn(loop: asyncio.AbstractEventLoop) -> None:
    loop.call_soon(loop.stop)
    loop.run_forever()


def test_a_coroutine_closed_as_it_waits_to_release_a_finished_begin_still_releases() -> None:
    store = GatedStore()
    store.gate.clear()
    effects: list[str] = []
    charge = guarded(store, effects)
    loop = asyncio.new_event_loop()
    with AirlockContext(metadata={"tool_call_id": "z1"}):
        coro = charge("acct", 5)
        task = loop.create_task(coro)

    async def until_begun() -> None:
        while not store.begun.is_set():
            await asyncio.sleep(0.005)

    loop.run_until_complete(until_begun())
    store.gate.set()
    settled(lambda: store.kinds("z1") == ["pending"])
    time.sleep(0.1)  # the worker is done; its result waits for the loop
    task.cancel()
    one_turn(loop)  # the caller takes its cancellation: the release is left to it
    names = suspended_in(coro)  # the guard's wrapper, any frame of its own, then the wait for the worker
    assert names[0] == "wrapper" and names[names.index("offloaded"):][:2] == ["offloaded", "_wait_out"]
    loop.close()
    coro.close()
    assert effects == []
    assert store.kinds("z1") == ["pending", "released"]


def test_a_coroutine_closed_as_it_waits_for_the_release_returns_once_it_is_written(tmp_path: Path) -> None:
    path = tmp_path / "z.db"
    journal = SQLiteJournal(path)
    journal.offload_async = True
    journal.head()
    begin_gate, release_gate, begun = threading.Event(), threading.Event(), threading.Event()
    begin, append = journal.begin, journal.append

    def slow_begin(call_id: str, decide: Decide) -> Decision:
        begun.set()
        assert begin_gate.wait(20)
        return begin(call_id, decide)

    def slow_append(event: EffectEvent) -> None:
        if event.kind == "released":
            assert release_gate.wait(20)  # a server's round trip
        append(event)

    journal.begin = slow_begin  # type: ignore[method-assign]
    journal.append = slow_append  # type: ignore[method-assign]
    effects: list[str] = []
    charge = guarded(journal, effects)
    loop = asyncio.new_event_loop()
    with AirlockContext(metadata={"tool_call_id": "z2"}):
        coro = charge("acct", 5)
        task = loop.create_task(coro)

    async def until_begun() -> None:
        while not begun.is_set():
            await asyncio.sleep(0.005)

    loop.run_until_complete(until_begun())
    task.cancel()
    one_turn(loop)  # cancelled while its begin is under way: it waits for it
    names = suspended_in(coro)  # the guard's wrapper, any frame of its own, then the wait for the worker
    assert names[0] == "wrapper" and names[names.index("offloaded"):][:2] == ["offloaded", "_wait_out"]
    loop.close()
    begin_gate.set()
    settled(lambda: journal.get("z2") is not None)
    threading.Timer(0.3, release_gate.set).start()
    coro.close()  # returns once the release under way is written
    journal.close()  # as a host does once its loop is gone
    with SQLiteJournal(path) as reopened:
        assert [e.kind for e in reopened.events(call_id="z2")] == ["pending", "released"]
    assert effects == []


@pytest.mark.parametrize("name, arguments", [("no_such_tool", "{}"), ("charge", "{not json"),
                                             ("charge", '{"account": "a"}')],
                         ids=["unknown-tool", "not-json", "not-fitting"])
def test_an_adapters_own_refusal_is_journaled_off_the_loop(journal: SQLiteJournal, name: str, arguments: str) -> None:
    from guard.adapters.openai import adispatch

    effects: list[str] = []
    charge = guarded(journal, effects)
    locker = hold_sqlite(journal.path, HOLD)
    tool_call = {"id": "m1", "type": "function", "function": {"name": name, "arguments": arguments}}

    async def main() -> tuple[Any, int]:
        thread = locker()
        reply = await ticks_during(adispatch(tool_call, [charge]))
        thread.join()
        return reply

    reply, ticks = asyncio.run(main())
    assert ticks >= 10  # the loop ran on while the refusal waited for the lock
    assert reply["tool_call_id"] == "m1" and '"status":"blocked"' in reply["content"].replace(" ", "")
    assert [e.kind for e in journal.events(call_id="m1")] == ["refused"]
    assert effects == []
