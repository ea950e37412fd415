"""Reconcilers on every store: a retry that finds its call in doubt asks the tool's check first,
and ``journal.reconcile`` settles the calls in doubt of either journal, appending only when the call
has not moved on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal
from guard.effect_guard import EffectGuard, reversibility
from guard.reconcile import (
    Applied,
    InDoubtCall,
    NotApplied,
    ReconcileResult,
    reconciled_by,
    reconciler_of,
)
from guard.settling import settle_as
from tests.stores import store_events

LEASED = {"memory", "sqlite", "postgres", "postgres-contended"}


class Backend:
    """A payment backend keyed on the idempotency key, and the check that asks it."""

    def __init__(self) -> None:
        self.charges: dict[str, dict[str, Any]] = {}
        self.runs = 0
        self.asked: list[InDoubtCall] = []
        self.answer: str = "truth"  # "truth", "none", "raise", "junk", "applied-no-value"
        self.lose_response = True

    def charge(self, cents: int) -> dict[str, Any]:
        key = get_current_context().idempotency_key
        assert key is not None
        self.runs += 1
        self.charges.setdefault(key, {"charge_id": f"ch_{len(self.charges) + 1}", "cents": cents})
        if self.lose_response:
            self.lose_response = False
            raise TimeoutError("the response was lost")
        return self.charges[key]

    def check(self, call: InDoubtCall) -> Any:
        self.asked.append(call)
        if self.answer == "none":
            return None
        if self.answer == "raise":
            raise ConnectionError("the backend is down")
        if self.answer == "junk":
            return "yes"
        found = self.charges.get(call.idempotency_key or "")
        if found is None:
            return NotApplied(evidence=f"no charge for {call.idempotency_key}")
        if self.answer == "applied-no-value":
            return Applied(evidence="a charge exists")
        return Applied(value=found, evidence=f"found {found['charge_id']}")


def guarded(store: Any, backend: Backend, **options: Any) -> Callable[..., Any]:
    check = backend.check

    @reconciled_by(check)
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store, **options)))
    def charge(cents: int) -> dict[str, Any]:
        return backend.charge(cents)

    return charge


def call(tool: Callable[..., Any], call_id: str, *args: Any) -> Any:
    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": call_id}):
        return tool(*args)


def lost(tool: Callable[..., Any], call_id: str, *args: Any) -> None:
    with pytest.raises(TimeoutError):
        call(tool, call_id, *args)


def settling(store: Any) -> None:
    """Skip for a store without an atomic settle (the custom-store guide's): see the test below."""
    if not hasattr(store, "settle"):
        pytest.skip("a store without settle leaves a call in doubt to an operator")


def kinds(store: Any, call_id: str) -> list[tuple[str, str]]:
    return [(e.kind, e.actor) for e in store_events(store, call_id)]


def test_the_check_is_read_through_the_wrapped_chain_above_or_below_the_guard() -> None:
    def check(call: InDoubtCall) -> None:
        return None

    @reconciled_by(check)
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def above(x: int) -> int:
        return x

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    @reconciled_by(check)
    def below(x: int) -> int:
        return x

    assert reconciler_of(above) is check and reconciler_of(below) is check
    assert reconciler_of(lambda: None) is None
    with pytest.raises(TypeError, match="reconciled_by takes a check"):
        reconciled_by("not a function")  # type: ignore[arg-type]


def test_a_retry_of_a_lost_response_gets_the_backends_value_and_the_tool_runs_once(store: Any) -> None:
    settling(store)
    backend = Backend()
    charge = guarded(store, backend)
    lost(charge, "call_1", 500)
    first = backend.charges[next(iter(backend.charges))]
    assert call(charge, "call_1", 500) == first
    assert call(charge, "call_1", 500) == first  # now a plain replay: the check is not asked again
    assert backend.runs == 1 and len(backend.asked) == 1
    asked = backend.asked[0]
    assert (asked.call_id, asked.tool, asked.status, asked.attempt, asked.arguments) == (
        "call_1", "charge", "unknown", 1, {"cents": 500})
    assert asked.error == {"type": "TimeoutError", "message": "the response was lost"}
    assert asked.since.tzinfo is not None
    assert kinds(store, "call_1") == [
        ("pending", "guard"), ("unknown", "guard"), ("committed", "reconciler:Backend.check"),
        ("replayed", "guard"), ("replayed", "guard"),
    ]
    settled = store_events(store, "call_1")[2]
    assert settled.reason == {"code": "applied", "message": "found ch_1"}


def test_not_applied_releases_the_call_and_the_retry_runs_it_as_the_next_attempt(store: Any) -> None:
    settling(store)
    backend = Backend()
    charge = guarded(store, backend)

    def fail_before_the_effect(cents: int) -> dict[str, Any]:
        backend.runs += 1
        raise TimeoutError("the backend never answered")

    backend.charge, original = fail_before_the_effect, backend.charge  # type: ignore[method-assign]
    lost(charge, "call_2", 700)
    backend.charge = original  # type: ignore[method-assign]
    backend.lose_response = False
    result = call(charge, "call_2", 700)
    assert not is_refusal(result) and result["cents"] == 700
    assert backend.runs == 2 and len(backend.charges) == 1
    assert store.get("call_2").attempt == 2 and store.get("call_2").status == "committed"
    assert [k for k, _ in kinds(store, "call_2")] == [
        "pending", "unknown", "released", "pending", "committed"]
    assert kinds(store, "call_2")[2] == ("released", "reconciler:Backend.check")


@pytest.mark.parametrize("answer", ["none", "raise", "junk"])
def test_a_check_that_cannot_tell_raises_or_answers_junk_leaves_the_refusal(
        store: Any, answer: str, caplog: pytest.LogCaptureFixture) -> None:
    settling(store)
    backend = Backend()
    charge = guarded(store, backend)
    lost(charge, "call_3", 100)
    backend.answer = answer
    with caplog.at_level(logging.INFO, logger="guard"):
        refusal = call(charge, "call_3", 100)
    assert is_refusal(refusal) and refusal["block_reason"] == "effect_status_unknown"
    assert backend.runs == 1
    assert store.get("call_3").status == "unknown"
    assert [k for k, _ in kinds(store, "call_3")] == ["pending", "unknown", "refused"]
    if answer != "none":
        assert "Backend.check" in caplog.text


def test_applied_without_a_value_is_refused_replay_value_unavailable(store: Any) -> None:
    settling(store)
    backend = Backend()
    backend.answer = "applied-no-value"
    charge = guarded(store, backend)
    lost(charge, "call_4", 100)
    refusal = call(charge, "call_4", 100)
    assert is_refusal(refusal)
    assert refusal["block_reason"] == "replay_value_unavailable"
    assert store.get("call_4").status == "committed" and store.get("call_4").value is None
    assert backend.runs == 1


def test_a_store_without_settle_refuses_and_never_asks(tmp_path: Any) -> None:
    from tests.stores import guide_store

    backend = Backend()
    charge = guarded(guide_store(tmp_path), backend)
    lost(charge, "call_g", 100)
    assert call(charge, "call_g", 100)["block_reason"] == "effect_status_unknown"
    assert backend.asked == []


def test_reconcile_on_retry_false_never_asks(store: Any) -> None:
    settling(store)
    backend = Backend()
    charge = guarded(store, backend, reconcile_on_retry=False)
    lost(charge, "call_5", 100)
    refusal = call(charge, "call_5", 100)
    assert refusal["block_reason"] == "effect_status_unknown" and backend.asked == []


def test_an_async_check_and_an_async_tool(store: Any) -> None:
    settling(store)
    import asyncio

    ledger: dict[str, int] = {}

    async def check(call: InDoubtCall) -> Any:
        await asyncio.sleep(0)
        key = call.idempotency_key or ""
        return Applied(value=ledger[key], evidence="async") if key in ledger else NotApplied(evidence="none")

    lose = [True]

    @reconciled_by(check)
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    async def pay(cents: int) -> int:
        key = get_current_context().idempotency_key or ""
        ledger[key] = cents
        if lose[0]:
            lose[0] = False
            raise TimeoutError("lost")
        return cents

    async def run() -> Any:
        async with AirlockContext(metadata={"tool_call_id": "call_6"}):
            with pytest.raises(TimeoutError):
                await pay(42)
        async with AirlockContext(metadata={"tool_call_id": "call_6"}):
            return await pay(42)

    assert asyncio.run(run()) == 42
    assert len(ledger) == 1


def test_a_settlement_appends_only_if_the_call_has_not_moved(store: Any) -> None:
    if not hasattr(store, "settle"):
        pytest.skip("this store has no atomic settle")
    backend = Backend()
    charge = guarded(store, backend, reconcile_on_retry=False)
    lost(charge, "call_7", 100)
    seen = store.get("call_7")
    assert settle_as(store, seen, NotApplied(evidence="first"), "reconciler:a") is not None
    before = len(store_events(store))
    # The call was released meanwhile: a second check's answer, given the old record, is dropped.
    assert settle_as(store, seen, Applied(value=1, evidence="late"), "reconciler:b") is None
    assert len(store_events(store)) == before
    assert store.get("call_7").status == "released"


def test_a_running_call_is_never_given_to_a_check(store: Any) -> None:
    if store.__class__.__name__ not in ("InMemoryEffectStore", "SQLiteJournal", "PostgresJournal"):
        pytest.skip("a store without leases")
    started, finish = threading.Event(), threading.Event()
    asked: list[InDoubtCall] = []

    def check(call: InDoubtCall) -> Any:
        asked.append(call)
        return NotApplied(evidence="not yet")

    runs: list[int] = []

    @reconciled_by(check)
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store, lease=30.0)))
    def slow(x: int) -> int:
        runs.append(x)
        started.set()
        finish.wait(60)
        return x

    worker = threading.Thread(target=call, args=(slow, "call_8", 1))
    worker.start()
    try:
        assert started.wait(60)
        refusal = call(slow, "call_8", 1)
        assert refusal["block_reason"] == "effect_status_unknown"
        assert asked == [] and runs == [1]
        if hasattr(store, "reconcile"):
            results = store.reconcile({"slow": check})
            assert [(r.call_id, r.outcome) for r in results] == [("call_8", "skipped")]
            assert asked == []
            state = store.owner_states([store.get("call_8")])["call_8"]
            assert state.alive is True and state.lease_expires_at is not None
    finally:
        finish.set()
        worker.join(60)
    assert store.get("call_8").status == "committed" and runs == [1]


def test_concurrent_retries_run_the_tool_at_most_once(store: Any) -> None:
    settling(store)
    runs: list[int] = []
    gate = threading.Barrier(6)

    def check(call: InDoubtCall) -> Any:
        return NotApplied(evidence="nothing charged")

    @reconciled_by(check)
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def charge(cents: int) -> int:
        runs.append(cents)
        if len(runs) == 1:
            raise TimeoutError("lost")
        return cents

    lost(charge, "call_9", 5)
    results: list[Any] = []

    def retry() -> None:
        gate.wait(60)
        results.append(call(charge, "call_9", 5))

    threads = [threading.Thread(target=retry) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 6
    assert len(runs) <= 2  # the lost first run, and at most one retry
    values = [r for r in results if not is_refusal(r)]
    assert all(v == 5 for v in values)
    assert len(runs) == 2 and values  # one retry ran it (or replayed its value)


# -- journal.reconcile, on every journal (tests/conftest.py's journal) -----------------------------


def test_reconcile_settles_each_call_in_doubt_once(journal: Any) -> None:
    backend = Backend()
    charge = guarded(journal, backend, reconcile_on_retry=False)
    for i in range(3):
        backend.lose_response = True
        lost(charge, f"call_{i}", 100 + i)
    del backend.charges[next(k for k, v in backend.charges.items() if v["cents"] == 101)]
    results = journal.reconcile({"charge": backend.check})
    assert all(isinstance(r, ReconcileResult) for r in results)
    assert sorted((r.call_id, r.outcome) for r in results) == [
        ("call_0", "applied"), ("call_1", "not_applied"), ("call_2", "applied")]
    assert all(r.seq is not None for r in results)
    events = {e.seq: e for e in store_events(journal)}
    assert {events[r.seq].actor for r in results} == {"reconciler:Backend.check"}
    assert journal.reconcile({"charge": backend.check}) == []  # nothing left in doubt
    assert journal.verify().ok
    assert call(charge, "call_0", 100)["cents"] == 100  # replayed
    assert backend.runs == 3


def test_reconcile_dry_run_asks_and_appends_nothing(journal: Any) -> None:
    backend = Backend()
    charge = guarded(journal, backend, reconcile_on_retry=False)
    lost(charge, "call_1", 100)
    before = journal.head()
    results = journal.reconcile({"charge": backend.check}, dry_run=True)
    assert [(r.outcome, r.seq) for r in results] == [("applied", None)]
    assert journal.head() == before and len(backend.asked) == 1


def test_reconcile_filters_by_tool_and_age_and_reports_failures_per_call(journal: Any) -> None:
    backend = Backend()
    charge = guarded(journal, backend, reconcile_on_retry=False)
    lost(charge, "call_1", 100)
    assert journal.reconcile({"charge": backend.check}, older_than=timedelta(hours=1)) == []
    assert journal.reconcile({"charge": backend.check}, tool="refund") == []
    results = journal.reconcile({"refund": backend.check})
    assert [(r.outcome, r.message) for r in results] == [("skipped", "no check for the tool 'charge'")]
    backend.answer = "raise"
    results = journal.reconcile({"charge": backend.check})
    assert [r.outcome for r in results] == ["error"] and "ConnectionError" in results[0].message
    backend.answer = "junk"
    assert "returned str" in journal.reconcile({"charge": backend.check})[0].message
    hang = threading.Event()

    def hangs(call: InDoubtCall) -> None:
        hang.wait(30)

    try:
        results = journal.reconcile({"charge": hangs}, timeout=0.2)
    finally:
        hang.set()
    assert results[0].outcome == "error" and "did not answer within 0.2 s" in results[0].message
    assert journal.get("call_1").status == "unknown"
    assert [k for k, _ in kinds(journal, "call_1")] == ["pending", "unknown"]


def test_reversible_calls_are_never_reconciled_inline() -> None:
    asked: list[InDoubtCall] = []

    def check(call: InDoubtCall) -> Any:
        asked.append(call)
        return None

    runs: list[int] = []

    @reversibility("reversible")
    @reconciled_by(check)
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def lookup(x: int) -> int:
        runs.append(x)
        if len(runs) == 1:
            raise TimeoutError
        return x

    with pytest.raises(TimeoutError):
        call(lookup, "r1", 1)
    assert call(lookup, "r1", 1) == 1 and asked == []


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_lease_is_renewed_while_the_tool_runs_and_dropped_after(store: Any, kind: str) -> None:
    import asyncio
    import time

    if store.__class__.__name__ not in ("InMemoryEffectStore", "SQLiteJournal", "PostgresJournal"):
        pytest.skip("a store without leases")
    seen: list[Any] = []

    def renewed_twice() -> None:
        # What is waited for is two renewals, however long a loaded machine takes to make them.
        first = store.owner_states([store.get("call_l")])["call_l"]
        assert first.alive is True and first.lease_expires_at is not None
        seen.append(first.lease_expires_at)
        deadline = time.monotonic() + 120
        while len(seen) < 3:
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
            now = store.owner_states([store.get("call_l")])["call_l"].lease_expires_at
            if now is not None and now > seen[-1]:
                seen.append(now)

    guard = EffectGuard(store=store, lease=0.6)
    if kind == "def":
        @Airlock(policy=SecurityPolicy(effect_guard=guard))
        def work(x: int) -> int:
            renewed_twice()
            return x

        assert call(work, "call_l", 1) == 1
    else:
        @Airlock(policy=SecurityPolicy(effect_guard=guard))
        async def awork(x: int) -> int:
            await asyncio.to_thread(renewed_twice)
            return x

        async def run() -> int:
            async with AirlockContext(metadata={"tool_call_id": "call_l"}):
                return await awork(1)  # type: ignore[no-any-return]

        assert asyncio.run(run()) == 1
    assert seen[0] < seen[1] < seen[2]
    record = store.get("call_l")
    assert record.status == "committed"
    assert store.owner_states([record])["call_l"].lease_expires_at is None  # dropped with the outcome


def test_on_event_hears_the_settlement_of_an_inline_check() -> None:
    from guard import telemetry
    from guard.effect_guard import InMemoryEffectStore

    heard: list[Any] = []
    backend = Backend()
    charge = guarded(InMemoryEffectStore(), backend, on_event=heard.append)
    lost(charge, "call_h", 100)
    call(charge, "call_h", 100)
    assert telemetry.wait_for_events(60)
    assert [(e.kind, e.actor) for e in heard] == [
        ("pending", "guard"), ("unknown", "guard"), ("committed", "reconciler:Backend.check"),
        ("replayed", "guard"),
    ]
