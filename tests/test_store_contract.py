"""The contract every EffectStore passes: both tables of section 2.6 and the events of section 3.

Parametrised by the ``store`` fixture over tests/stores.py, so a new store gets every test.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard, EffectOutcomeUnknown, reversibility
from guard.store import EffectEvent
from tests.stores import store_events


class Cancelled(BaseException):
    pass


class Backend:
    """Counts effects outside the store, the way a payment provider would."""

    def __init__(self) -> None:
        self.effects: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def effect(self, account: str, cents: int) -> None:
        with self.lock:
            self.effects.append((account, cents))


@pytest.fixture
def backend() -> Backend:
    return Backend()


def guarded(store: Any, fn: Callable[..., Any], tag: str | None = None, **guard_options: Any) -> Any:
    wrapped = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store, **guard_options)))(fn)
    return reversibility(tag)(wrapped) if tag else wrapped  # type: ignore[arg-type]


def call(fn: Callable[..., Any], call_id: str | None, *args: Any, **kwargs: Any) -> Any:
    metadata = {"tool_call_id": call_id} if call_id is not None else {}
    with AirlockContext(agent_id="agent-1", metadata=metadata):
        return fn(*args, **kwargs)


def kinds(store: Any, call_id: str | None = None) -> list[str]:
    return [e.kind for e in store_events(store, call_id)]


# -- the outcome table -------------------------------------------------------------------------


def test_value_is_committed_and_returned(store: Any, backend: Backend) -> None:
    def charge(account: str, cents: int) -> dict[str, Any]:
        backend.effect(account, cents)
        return {"charge_id": "ch_1", "cents": cents, "parts": (1, 2)}

    tool = guarded(store, charge)
    assert call(tool, "t1", "acct", 500) == {"charge_id": "ch_1", "cents": 500, "parts": (1, 2)}
    record = store.get("t1")
    assert (record.status, record.attempt, record.tool) == ("committed", 1, "charge")
    assert kinds(store, "t1") == ["pending", "committed"]


def test_replay_returns_stored_json_form_without_running(store: Any, backend: Backend) -> None:
    def charge(account: str, cents: int) -> dict[str, Any]:
        backend.effect(account, cents)
        return {"charge_id": "ch_1", "parts": (1, 2)}

    tool = guarded(store, charge)
    call(tool, "t1", "acct", 500)
    again = call(tool, "t1", account="acct", cents=500)
    assert again == {"charge_id": "ch_1", "parts": [1, 2]}
    assert backend.effects == [("acct", 500)]
    assert kinds(store, "t1") == ["pending", "committed", "replayed"]
    assert store.get("t1").status == "committed"


def test_replay_of_none_value(store: Any) -> None:
    runs: list[int] = []

    def notify(user: str) -> None:
        runs.append(1)

    tool = guarded(store, notify)
    assert call(tool, "n1", "u") is None
    assert call(tool, "n1", "u") is None
    assert runs == [1]


@pytest.mark.parametrize(
    "deferred",
    [
        lambda: (x for x in [1]),
        lambda: iter([1, 2]),
        lambda: asyncio.sleep(0),
    ],
    ids=["generator", "iterator", "awaitable"],
)
def test_deferred_result_is_unknown_and_returned_untouched(store: Any, deferred: Callable[[], Any]) -> None:
    made: list[Any] = []

    def stream(account: str) -> Any:
        made.append(deferred())
        return made[-1]

    tool = guarded(store, stream)
    result = call(tool, "d1", "acct")
    assert result is made[0]
    if asyncio.iscoroutine(result):
        result.close()
    assert store.get("d1").status == "unknown"


def test_async_generator_is_unknown(store: Any) -> None:
    async def agen() -> Any:
        yield 1

    def stream(account: str) -> Any:
        return agen()

    tool = guarded(store, stream)
    result = call(tool, "d2", "acct")
    assert hasattr(result, "__anext__")
    assert store.get("d2").status == "unknown"


@pytest.mark.parametrize(
    "error",
    [TimeoutError("t"), ConnectionResetError("r"), ConnectionAbortedError("a"), BrokenPipeError("p"),
     EffectOutcomeUnknown("cannot tell")],
    ids=lambda e: type(e).__name__,
)
def test_ambiguous_error_is_unknown_and_reraised(store: Any, error: Exception) -> None:
    def charge(account: str) -> None:
        raise error

    tool = guarded(store, charge)
    with pytest.raises(type(error)) as raised:
        call(tool, "a1", "acct")
    assert raised.value is error
    record = store.get("a1")
    assert record.status == "unknown"
    assert record.error == {"type": type(error).__name__, "message": str(error)}
    unknown = [e for e in store_events(store, "a1") if e.kind == "unknown"]
    assert unknown[0].error == {"type": type(error).__name__, "message": str(error)}


def test_custom_ambiguous_errors(store: Any) -> None:
    class GatewayTimeout(Exception):
        pass

    def charge(account: str) -> None:
        raise GatewayTimeout("504")

    tool = guarded(store, charge, ambiguous_errors=(GatewayTimeout,))
    with pytest.raises(GatewayTimeout):
        call(tool, "c1", "acct")
    assert store.get("c1").status == "unknown"

    def charge2(account: str) -> None:
        raise TimeoutError("not ambiguous any more")

    tool2 = guarded(store, charge2, ambiguous_errors=(GatewayTimeout,))
    with pytest.raises(TimeoutError):
        call(tool2, "c2", "acct")
    assert store.get("c2").status == "released"


def test_other_error_releases_and_the_call_may_run_again(store: Any, backend: Backend) -> None:
    attempts: list[int] = []

    def charge(account: str, cents: int) -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise ValueError("card declined")
        backend.effect(account, cents)
        return "ok"

    tool = guarded(store, charge)
    with pytest.raises(ValueError, match="card declined"):
        call(tool, "r1", "acct", 5)
    record = store.get("r1")
    assert (record.status, record.error) == ("released", {"type": "ValueError", "message": "card declined"})
    assert call(tool, "r1", "acct", 5) == "ok"
    record = store.get("r1")
    assert (record.status, record.attempt) == ("committed", 2)
    assert kinds(store, "r1") == ["pending", "released", "pending", "committed"]
    assert [e.attempt for e in store_events(store, "r1")] == [1, 1, 2, 2]


@pytest.mark.parametrize("exc", [Cancelled(), KeyboardInterrupt(), SystemExit(3)], ids=lambda e: type(e).__name__)
def test_base_exception_is_unknown_and_reraised(store: Any, exc: BaseException) -> None:
    def charge(account: str) -> None:
        raise exc

    tool = guarded(store, charge)
    with pytest.raises(type(exc)):
        call(tool, "b1", "acct")
    assert store.get("b1").status == "unknown"


def test_unstorable_value_is_returned_then_replay_value_unavailable(store: Any, backend: Backend) -> None:
    marker = object()

    def charge(account: str) -> object:
        backend.effect(account, 1)
        return marker

    tool = guarded(store, charge)
    assert call(tool, "u1", "acct") is marker
    assert store.get("u1").status == "committed"
    refusal = call(tool, "u1", "acct")
    assert is_refusal(refusal) and refusal["block_reason"] == "replay_value_unavailable"
    assert backend.effects == [("acct", 1)]
    assert kinds(store, "u1") == ["pending", "committed", "refused"]


def test_async_tool_is_awaited_inside_the_guard(store: Any, backend: Backend) -> None:
    async def charge(account: str, cents: int) -> dict[str, int]:
        await asyncio.sleep(0)
        backend.effect(account, cents)
        return {"cents": cents}

    tool = guarded(store, charge)

    async def main() -> tuple[Any, Any]:
        async with AirlockContext(metadata={"tool_call_id": "as1"}):
            first = await tool("acct", 7)
            second = await tool("acct", 7)
        return first, second

    assert asyncio.run(main()) == ({"cents": 7}, {"cents": 7})
    assert backend.effects == [("acct", 7)]
    assert store.get("as1").status == "committed"


def test_async_tool_cancelled_is_unknown(store: Any) -> None:
    started = asyncio.Event()

    async def charge(account: str) -> None:
        started.set()
        await asyncio.sleep(10)

    tool = guarded(store, charge)

    async def main() -> None:
        async with AirlockContext(metadata={"tool_call_id": "cx"}):
            task = asyncio.ensure_future(tool("acct"))
            await asyncio.wait_for(started.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert store.get("cx").status == "unknown"


# -- the replay table --------------------------------------------------------------------------


def _unknown_call(store: Any, tag: str | None, backend: Backend) -> Any:
    state = {"fail": True}

    def charge(account: str, cents: int) -> str:
        backend.effect(account, cents)
        if state["fail"]:
            state["fail"] = False
            raise TimeoutError("lost")
        return "done"

    tool = guarded(store, charge, tag)
    with pytest.raises(TimeoutError):
        call(tool, "x1", "acct", 5)
    return tool


@pytest.mark.parametrize("tag", [None, "irreversible", "costly"])
def test_unknown_not_reversible_is_refused_effect_status_unknown(store: Any, backend: Backend, tag: str | None) -> None:
    tool = _unknown_call(store, tag, backend)
    refusal = call(tool, "x1", "acct", 5)
    assert is_refusal(refusal) and refusal["block_reason"] == "effect_status_unknown"
    meta = refusal["metadata"]
    assert meta["status"] == "unknown" and meta["attempt"] == 1
    assert meta["idempotency_key"] == store.get("x1").idempotency_key
    assert meta["since"].endswith("Z")
    assert "retry" in refusal["error"] and meta["idempotency_key"] in refusal["error"]
    assert backend.effects == [("acct", 5)]
    assert kinds(store, "x1") == ["pending", "unknown", "refused"]
    refused = store_events(store, "x1")[-1]
    assert refused.reason["code"] == "effect_status_unknown"
    assert store.get("x1").status == "unknown"


def test_unknown_reversible_runs_again(store: Any, backend: Backend) -> None:
    tool = _unknown_call(store, "reversible", backend)
    assert call(tool, "x1", "acct", 5) == "done"
    assert (store.get("x1").status, store.get("x1").attempt) == ("committed", 2)
    assert len(backend.effects) == 2


def test_pending_not_reversible_is_refused_while_it_runs(store: Any, backend: Backend) -> None:
    inside = threading.Event()
    finish = threading.Event()

    def charge(account: str) -> str:
        backend.effect(account, 1)
        inside.set()
        finish.wait(10)
        return "ok"

    tool = guarded(store, charge)
    worker = threading.Thread(target=call, args=(tool, "p1", "acct"))
    worker.start()
    assert inside.wait(10)
    refusal = call(tool, "p1", "acct")
    assert refusal["block_reason"] == "effect_status_unknown"
    assert refusal["metadata"]["status"] == "pending"
    finish.set()
    worker.join()
    assert store.get("p1").status == "committed"
    assert backend.effects == [("acct", 1)]


def _resolved_while_running(store: Any, backend: Backend, call_id: str, operator_kind: str,
                            late: BaseException | None) -> Any:
    """A charge that an operator resolves (``operator_kind``) while it still runs, and that then
    returns, or raises ``late``; returns the tool."""
    inside = threading.Event()
    finish = threading.Event()

    def charge(account: str) -> str:
        backend.effect(account, 1)
        inside.set()
        finish.wait(10)
        if late is not None:
            raise late
        return "ch_late"

    tool = guarded(store, charge)
    worker = threading.Thread(target=_swallow, args=(tool, call_id))
    worker.start()
    assert inside.wait(10)
    record = store.get(call_id)
    applied = operator_kind == "committed"
    event = EffectEvent(
        operator_kind, call_id, record.tool, agent_id=record.agent_id, idempotency_key=record.idempotency_key,
        arguments=record.arguments, value='"ch_1"' if applied else None, actor="operator:ana", attempt=record.attempt,
        reason={"code": "applied" if applied else "not_applied", "message": "checked the ledger"},
    )
    store.append(event)  # what resolve --force appends
    finish.set()
    worker.join()
    return tool


def _swallow(tool: Any, call_id: str) -> None:
    with contextlib.suppress(Exception):
        call(tool, call_id, "acct")


@pytest.mark.parametrize("late", [ValueError("card declined"), TimeoutError("no answer")],
                         ids=["released", "unknown"])
def test_a_late_failure_never_undoes_an_operators_confirmed_effect(store: Any, backend: Backend,
                                                                   late: BaseException) -> None:
    # The operator found the charge in the ledger while the tool still ran; the tool then failed. Its
    # outcome is in the log, but the call stays committed with the operator's value: a retry gets
    # that value, and the card is not charged a second time.
    tool = _resolved_while_running(store, backend, "op1", "committed", late)
    kind = "released" if isinstance(late, ValueError) else "unknown"
    assert [(e.kind, e.actor) for e in store_events(store, "op1")] == [
        ("pending", "guard"), ("committed", "operator:ana"), (kind, "guard")
    ]
    record = store.get("op1")
    assert (record.status, record.actor, record.value) == ("committed", "operator:ana", '"ch_1"')
    assert call(tool, "op1", "acct") == "ch_1"
    assert backend.effects == [("acct", 1)]


def test_a_late_value_replaces_the_operators_own(store: Any, backend: Backend) -> None:
    # Either way the operator resolved it, what the tool itself returned is better evidence.
    for call_id, operator_kind in (("op2", "committed"), ("op3", "released")):
        tool = _resolved_while_running(store, backend, call_id, operator_kind, None)
        record = store.get(call_id)
        assert (record.status, record.actor, record.value) == ("committed", "guard", '"ch_late"')
        assert call(tool, call_id, "acct") == "ch_late"
    assert backend.effects == [("acct", 1), ("acct", 1)]


def test_a_late_failure_after_the_operator_said_not_applied_is_taken(store: Any, backend: Backend) -> None:
    tool = _resolved_while_running(store, backend, "op4", "released", TimeoutError("no answer"))
    assert store.get("op4").status == "unknown"  # the safer of the two: refused, never run again
    assert call(tool, "op4", "acct")["block_reason"] == "effect_status_unknown"
    assert backend.effects == [("acct", 1)]


def test_pending_reversible_runs_again(store: Any) -> None:
    inside = threading.Event()
    finish = threading.Event()
    runs: list[int] = []

    def lookup(account: str) -> int:
        runs.append(1)
        if len(runs) == 1:
            inside.set()
            finish.wait(10)
        return len(runs)

    tool = guarded(store, lookup, "reversible")
    worker = threading.Thread(target=call, args=(tool, "p2", "acct"))
    worker.start()
    assert inside.wait(10)
    assert call(tool, "p2", "acct") == 2
    finish.set()
    worker.join()
    assert len(runs) == 2
    # The first attempt's late outcome is logged but does not move the call off attempt 2.
    record = store.get("p2")
    assert (record.status, record.attempt) == ("committed", 2)
    assert [(e.kind, e.attempt) for e in store_events(store, "p2")] == [
        ("pending", 1), ("pending", 2), ("committed", 2), ("committed", 1)
    ]


@pytest.mark.parametrize("status", ["committed", "unknown", "released"])
def test_other_arguments_or_tool_is_policy_violation(store: Any, status: str) -> None:
    def charge(account: str, cents: int) -> str:
        if status == "unknown":
            raise TimeoutError()
        if status == "released":
            raise ValueError()
        return "ok"

    def refund(account: str, cents: int) -> str:
        return "refunded"

    tool, other = guarded(store, charge), guarded(store, refund)
    with contextlib.suppress(TimeoutError, ValueError):
        call(tool, "v1", "acct", 5)
    for refusal in (call(tool, "v1", "acct", 6), call(other, "v1", "acct", 5)):
        assert refusal["block_reason"] == "policy_violation"
        assert refusal["metadata"]["violation_type"] == "tool_call_id_reused"
    record = store.get("v1")
    assert (record.status, record.tool, record.attempt) == (status, "charge", 1)
    assert kinds(store, "v1")[-2:] == ["refused", "refused"]


def test_reversible_without_tool_call_id_runs_unguarded(store: Any) -> None:
    def lookup(account: str) -> int:
        return 42

    tool = guarded(store, lookup, "reversible")
    assert call(tool, None, "acct") == 42
    assert call(tool, None, "acct") == 42
    assert store_events(store) == []


# -- the journal of every transition -------------------------------------------------------------


def test_refusal_without_tool_call_id_is_journaled(store: Any) -> None:
    def charge(account: str) -> str:
        return "ok"

    tool = guarded(store, charge)
    refusal = call(tool, None, "acct")
    assert refusal["block_reason"] == "tool_call_id_required"
    [event] = store_events(store)
    assert (event.kind, event.call_id, event.tool, event.reason["code"]) == (
        "refused", None, "charge", "tool_call_id_required"
    )


def test_refused_and_replayed_create_no_record(store: Any) -> None:
    def charge(account: str) -> str:
        return "ok"

    policy = SecurityPolicy(denied_tools=["charge"], effect_guard=EffectGuard(store=store))
    tool = Airlock(policy=policy)(charge)
    refusal = call(tool, "never", "acct")
    assert refusal["block_reason"] == "policy_violation"
    assert store.get("never") is None
    assert kinds(store) == ["refused"]


def test_events_carry_the_fields_of_section_3(store: Any) -> None:
    def charge(account: str, cents: int) -> dict[str, int]:
        return {"cents": cents}

    tool = guarded(store, charge)
    call(tool, "f1", "acct", 5)
    call(tool, "f1", "acct", 5)
    events = store_events(store, "f1")
    assert [e.seq for e in events] == [1, 2, 3]
    pending, committed, replayed = events
    for e in events:
        assert (e.call_id, e.tool, e.agent_id, e.actor, e.attempt) == ("f1", "charge", "agent-1", "guard", 1)
        assert e.idempotency_key == store.get("f1").idempotency_key and len(e.idempotency_key) == 64
        assert e.arguments == '{"account":"acct","cents":5}'
        assert (e.owner["host"], e.owner["pid"]) == (socket.gethostname(), os.getpid())
        assert set(e.owner) <= {"host", "pid", "boot", "pid_ns", "start"}  # no lease: none named
        assert e.at.tzinfo is not None
    assert committed.value == '{"cents":5}'
    assert pending.value is None and replayed.value is None


def test_outcome_write_failure_keeps_pending_and_returns_value(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    class FailingAppend:
        """Delegates to the real store but loses every write after begin."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def begin(self, call_id: str, decide: Any) -> Any:
            return self.inner.begin(call_id, decide)

        def append(self, event: Any) -> None:
            raise OSError("disk gone")

        def get(self, call_id: str) -> Any:
            return self.inner.get(call_id)

    runs: list[int] = []

    def charge(account: str) -> str:
        runs.append(1)
        return "charged"

    tool = guarded(FailingAppend(store), charge)
    with caplog.at_level(logging.ERROR, logger="guard"):
        assert call(tool, "w1", "acct") == "charged"
    assert any("w1" in r.getMessage() and r.name == "guard" for r in caplog.records)
    assert store.get("w1").status == "pending"
    refusal = call(tool, "w1", "acct")
    assert refusal["block_reason"] == "effect_status_unknown"
    assert runs == [1]


def test_store_unavailable_fails_closed(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    class BeginDown:
        """The store, but its begin fails as a journal out of reach does; the rest works."""

        def begin(self, call_id: str, decide: Any) -> Any:
            raise ConnectionError("journal down")

        def append(self, event: Any) -> None:
            store.append(event)

        def get(self, call_id: str) -> Any:
            return store.get(call_id)

    runs: list[int] = []

    def charge(account: str) -> str:
        runs.append(1)
        return "charged"

    tool = guarded(BeginDown(), charge)
    with caplog.at_level(logging.ERROR, logger="guard"):
        refusal = call(tool, "s1", "acct")
    assert refusal["block_reason"] == "store_unavailable"
    assert runs == []
    assert any(r.name == "guard" and "s1" in r.getMessage() for r in caplog.records)
    # Logged, not recorded: nothing of it reached the store, which has no record of the call either.
    assert kinds(store) == [] and store.get("s1") is None


def test_sixteen_threads_one_id_run_once(store: Any, backend: Backend) -> None:
    barrier = threading.Barrier(16)

    def charge(account: str, cents: int) -> str:
        backend.effect(account, cents)
        return "ok"

    tool = guarded(store, charge)
    results: list[Any] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        try:
            result = call(tool, "race", "acct", 5)
        except Exception as e:  # pragma: no cover - would be a failure below
            result = e
        with lock:
            results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert backend.effects == [("acct", 5)]
    assert len(results) == 16
    for r in results:
        assert r == "ok" or (is_refusal(r) and r["block_reason"] == "effect_status_unknown"), r
    assert kinds(store, "race").count("pending") == 1


class PausingInDecision:
    """Passes every call to ``store``, but the first ``begin`` pauses while its decision is made (in
    the store's atomic step, after it read the call's record), and the other begins are let in only
    once it is there: so they come exactly in the window a begin that is not atomic would leave open.
    Threads alone seldom meet there, the window being microseconds long."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.deciding = threading.Event()
        self.first = True
        self.lock = threading.Lock()

    def begin(self, call_id: str, decide: Callable[[Any], Any]) -> Any:
        with self.lock:
            first, self.first = self.first, False
        if not first:
            assert self.deciding.wait(10)
            return self.store.begin(call_id, decide)

        def pausing(record: Any) -> Any:
            self.deciding.set()
            time.sleep(0.2)  # the others' begins arrive meanwhile
            return decide(record)

        return self.store.begin(call_id, pausing)

    def append(self, event: Any) -> None:
        self.store.append(event)

    def get(self, call_id: str) -> Any:
        return self.store.get(call_id)


def test_begins_that_arrive_while_another_decides_wait_for_it_and_run_nothing(store: Any, backend: Backend) -> None:
    def charge(account: str, cents: int) -> str:
        backend.effect(account, cents)
        return "ok"

    tool = guarded(PausingInDecision(store), charge)
    results: list[Any] = []

    def worker() -> None:
        results.append(call(tool, "race", "acct", 5))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert backend.effects == [("acct", 5)]
    assert len(results) == 4 and "ok" in results
    for r in results:
        assert r == "ok" or (is_refusal(r) and r["block_reason"] == "effect_status_unknown"), r
    assert kinds(store, "race").count("pending") == 1
