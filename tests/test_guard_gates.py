"""The gates of section 2.4 in order, refusals (2.3), approvals and capabilities."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import multiprocessing
import os
import threading
from typing import Any

import pytest

import guard.call
import guard.policy
from guard import (
    Airlock,
    AirlockBlocked,
    AirlockContext,
    OversightRequest,
    OversightResponse,
    OversightVerdict,
    Refusal,
    SecurityPolicy,
    is_refusal,
    requires,
)
from guard.effect_guard import (
    EffectGuard,
    InMemoryEffectStore,
    idempotency_key,
    reversibility,
    reversibility_of,
    tag_along,
)


def ctx(call_id: str | None = "tc-1", agent_id: str | None = "agent-1") -> AirlockContext:
    return AirlockContext(agent_id=agent_id, metadata={"tool_call_id": call_id} if call_id else {})


class Approvals:
    """An approver that records every request and answers with a fixed verdict."""

    def __init__(self, verdict: OversightVerdict = OversightVerdict.GRANT, approver: str | None = "alice") -> None:
        self.verdict = verdict
        self.approver = approver
        self.requests: list[OversightRequest] = []

    def __call__(self, request: OversightRequest) -> OversightResponse:
        self.requests.append(request)
        return OversightResponse(request_id=request.request_id, verdict=self.verdict, approver=self.approver)


def refused_codes(store: InMemoryEffectStore) -> list[str]:
    return [e.reason["code"] for e in store.events() if e.kind == "refused"]


# -- refusal shape ---------------------------------------------------------------------------


def test_refusal_shape_and_is_refusal() -> None:
    store = InMemoryEffectStore()

    @Airlock(policy=SecurityPolicy(allowed_tools=["other"], effect_guard=EffectGuard(store=store)))
    def charge(account: str) -> str:
        return "ok"

    with ctx():
        refusal = charge("a")
    assert isinstance(refusal, Refusal) and isinstance(refusal, dict) and is_refusal(refusal)
    assert set(refusal) == {"success", "status", "block_reason", "error", "fix_hints", "metadata"}
    assert refusal["success"] is False and refusal["status"] == "blocked"
    assert refusal["block_reason"] == "policy_violation"
    assert isinstance(refusal["error"], str) and refusal["error"].endswith(".")
    assert refusal["fix_hints"] and all(isinstance(h, str) for h in refusal["fix_hints"])
    assert refusal["metadata"]["tool"] == "charge" and refusal["metadata"]["tool_call_id"] == "tc-1"
    assert not is_refusal({"success": False, "status": "blocked", "block_reason": "policy_violation"})
    assert refused_codes(store) == ["policy_violation"]
    # The audit trail says what was asked, even of a call refused before it was keyed.
    [event] = store.events()
    assert event.arguments == '{"account":"a"}'
    assert event.idempotency_key == idempotency_key("charge", {"account": "a"})


def test_on_block_raise() -> None:
    @Airlock(policy=SecurityPolicy(denied_tools=["charge"]), on_block="raise")
    def charge(account: str) -> str:
        return "ok"

    with pytest.raises(AirlockBlocked) as raised:
        charge("a")
    assert raised.value.block_reason == "policy_violation"
    assert is_refusal(raised.value.refusal) and raised.value.refusal["block_reason"] == "policy_violation"


def test_a_raised_refusal_crosses_to_another_process_whole() -> None:
    # A process pool, or a test runner's worker, sends the exception back pickled.
    @Airlock(policy=SecurityPolicy(denied_tools=["charge"]), on_block="raise")
    def charge(account: str) -> str:
        return "ok"

    with pytest.raises(AirlockBlocked) as raised:
        charge("a")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        back = pool.submit(_raise_again, raised.value).exception(timeout=60)
    assert type(back) is AirlockBlocked and str(back) == str(raised.value)
    assert back.block_reason == "policy_violation"
    assert is_refusal(back.refusal) and back.refusal == raised.value.refusal


def test_on_block_must_be_return_or_raise() -> None:
    with pytest.raises(ValueError):
        Airlock(on_block="ignore")  # type: ignore[arg-type]


# -- gate 1: policy ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("allowed", "denied", "runs"),
    [
        (None, (), True),
        (["charge"], (), True),
        (["char*"], (), True),
        (["read_*"], (), False),
        ([], (), False),
        (None, ["charge"], False),
        (["charge"], ["ch*"], False),
    ],
)
def test_allowed_and_denied_tools(allowed: list[str] | None, denied: list[str], runs: bool) -> None:
    ran: list[int] = []

    @Airlock(policy=SecurityPolicy(allowed_tools=allowed, denied_tools=denied))
    def charge(account: str) -> str:
        ran.append(1)
        return "ok"

    result = charge("a")
    assert (result == "ok") is runs
    if not runs:
        assert result["block_reason"] == "policy_violation" and ran == []


def test_policy_that_now_denies_refuses_the_replay() -> None:
    store = InMemoryEffectStore()
    allowed = ["charge"]

    def charge(account: str) -> str:
        return "ok"

    first = Airlock(policy=SecurityPolicy(allowed_tools=allowed, effect_guard=EffectGuard(store=store)))(charge)
    later = Airlock(policy=SecurityPolicy(denied_tools=["charge"], effect_guard=EffectGuard(store=store)))(charge)
    with ctx():
        assert first("a") == "ok"
        assert later("a")["block_reason"] == "policy_violation"
        assert first("a") == "ok"
    assert [e.kind for e in store.events()] == ["pending", "committed", "refused", "replayed"]


# -- gate 2: capabilities ----------------------------------------------------------------------


@pytest.mark.parametrize("above", [True, False])
def test_requires_above_or_below(above: bool) -> None:
    def charge(account: str) -> str:
        return "ok"

    def build(granted: tuple[str, ...]) -> Any:
        airlock = Airlock(policy=SecurityPolicy(granted_capabilities=granted))
        if above:
            return requires("payments:write")(airlock(charge))
        return airlock(requires("payments:write")(charge))

    refusal = build(())("a")
    assert refusal["block_reason"] == "capability_denied"
    assert refusal["metadata"]["missing_capabilities"] == ["payments:write"]
    assert "payments:write" in refusal["error"]
    assert build(("payments:write",))("a") == "ok"


def test_capability_and_reversibility_are_separate() -> None:
    @reversibility("reversible")
    @requires("ledger:read")
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def balance(account: str) -> int:
        return 1

    assert balance("a")["block_reason"] == "capability_denied"


# -- gate 3: tool_call_id ------------------------------------------------------------------------


@pytest.mark.parametrize("call_id", [None, "", 17, ["x"]])
def test_tool_call_id_required_for_non_reversible(call_id: Any) -> None:
    store = InMemoryEffectStore()
    ran: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def charge(account: str) -> str:
        ran.append(1)
        return "ok"

    with AirlockContext(metadata={"tool_call_id": call_id}):
        assert charge("a")["block_reason"] == "tool_call_id_required"
    assert charge("a")["block_reason"] == "tool_call_id_required"
    assert ran == []
    assert refused_codes(store) == ["tool_call_id_required", "tool_call_id_required"]


def test_costly_needs_a_tool_call_id_too() -> None:
    @reversibility("costly")
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def ship(order: str) -> str:
        return "shipped"

    assert ship("o")["block_reason"] == "tool_call_id_required"


def test_require_tool_call_id_false_runs_unguarded() -> None:
    store = InMemoryEffectStore()
    ran: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store, require_tool_call_id=False)))
    def charge(account: str) -> str:
        ran.append(1)
        return "ok"

    assert charge("a") == "ok" and charge("a") == "ok"
    assert ran == [1, 1] and store.events() == []


def test_argument_named_tool_call_id_is_never_the_id() -> None:
    store = InMemoryEffectStore()
    ran: list[str] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def charge(account: str, tool_call_id: str) -> str:
        ran.append(tool_call_id)
        return "ok"

    # No id in the context: the argument does not stand in for one.
    assert charge("a", tool_call_id="forged")["block_reason"] == "tool_call_id_required"
    with ctx("real-id"):
        assert charge("a", tool_call_id="x") == "ok"
        # Same real id, other argument value: the argument is part of the key, so it is a reuse.
        assert charge("a", tool_call_id="y")["block_reason"] == "policy_violation"
    assert ran == ["x"]
    assert store.get("real-id") is not None and store.get("x") is None and store.get("forged") is None
    assert store.get("real-id").idempotency_key == idempotency_key("charge", {"account": "a", "tool_call_id": "x"})


# -- gate 4: target_args -------------------------------------------------------------------------


def test_target_args_required_for_irreversible_only() -> None:
    store = InMemoryEffectStore()
    guard = EffectGuard(store=store, target_args=("project", "cluster"))

    @Airlock(policy=SecurityPolicy(effect_guard=guard))
    def delete(project: str | None = None, cluster: str = "", force: bool = False) -> str:
        return f"deleted {project or cluster}"

    @reversibility("costly")
    @Airlock(policy=SecurityPolicy(effect_guard=guard))
    def scale(project: str | None = None) -> str:
        return "scaled"

    with ctx("d1"):
        assert delete()["block_reason"] == "target_args_required"
    with ctx("d2"):
        assert delete(project=None, cluster="")["block_reason"] == "target_args_required"
    with ctx("d3"):
        assert delete(cluster="c1") == "deleted c1"
    with ctx("d4"):
        assert delete("p1") == "deleted p1"
    with ctx("d5"):
        assert scale() == "scaled"
    assert refused_codes(store) == ["target_args_required", "target_args_required"]


# -- gate 5: escalation --------------------------------------------------------------------------


def test_escalation_required_without_approver() -> None:
    store = InMemoryEffectStore()

    @Airlock(policy=SecurityPolicy(escalate_tools={"refund*": "money leaves"}, effect_guard=EffectGuard(store=store)))
    def refund_order(order: str) -> str:
        return "refunded"

    with ctx():
        refusal = refund_order("o1")
    assert refusal["block_reason"] == "escalation_required"
    assert refused_codes(store) == ["escalation_required"]


def test_approver_grant_sees_the_exact_bound_arguments() -> None:
    approvals = Approvals()
    store = InMemoryEffectStore()
    policy = SecurityPolicy(
        escalate_tools={"refund": "money leaves"}, approver=approvals, effect_guard=EffectGuard(store=store)
    )

    @Airlock(policy=policy)
    def refund(order: str, cents: int = 100, note: tuple[str, ...] = ("a",)) -> str:
        return f"refunded {cents}"

    with AirlockContext(agent_id="agent-7", metadata={"tool_call_id": "r-1"}):
        assert refund("o1") == "refunded 100"
    [request] = approvals.requests
    assert request.tool_name == "refund" and request.reason == "money leaves"
    assert request.arguments == {"order": "o1", "cents": 100, "note": ["a"]}
    assert request.tool_call_id == "r-1" and request.agent_id == "agent-7"
    assert request.idempotency_key == idempotency_key("refund", {"order": "o1", "cents": 100, "note": ["a"]})
    assert request.requested_at.tzinfo is not None
    with pytest.raises(AttributeError):
        request.tool_name = "other"  # type: ignore[misc]
    pending = store.events("r-1")[0]
    assert pending.kind == "pending" and "alice" in pending.reason["message"]


def test_approval_is_asked_again_on_every_replay() -> None:
    approvals = Approvals()
    store = InMemoryEffectStore()
    runs: list[int] = []
    policy = SecurityPolicy(escalate_tools={"refund": "why"}, approver=approvals, effect_guard=EffectGuard(store=store))

    @Airlock(policy=policy)
    def refund(order: str) -> str:
        runs.append(1)
        return "refunded"

    with ctx("r-2"):
        assert refund("o1") == "refunded"
        assert refund("o1") == "refunded"
        approvals.verdict = OversightVerdict.DENY
        assert refund("o1")["block_reason"] == "escalation_denied"
    assert runs == [1]
    assert len(approvals.requests) == 3
    assert len({r.request_id for r in approvals.requests}) == 3


@pytest.mark.parametrize("verdict", [OversightVerdict.DENY, OversightVerdict.TIMEOUT])
def test_deny_and_timeout_refuse(verdict: OversightVerdict) -> None:
    ran: list[int] = []

    @Airlock(policy=SecurityPolicy(escalate_tools={"refund": "why"}, approver=Approvals(verdict)))
    def refund(order: str) -> str:
        ran.append(1)
        return "refunded"

    refusal = refund("o1")
    assert refusal["block_reason"] == "escalation_denied" and ran == []


def test_approver_exception_and_foreign_response_refuse() -> None:
    def broken(request: OversightRequest) -> OversightResponse:
        raise RuntimeError("pager down")

    def other_request(request: OversightRequest) -> OversightResponse:
        return OversightResponse(request_id="someone-else", verdict=OversightVerdict.GRANT)

    def not_a_response(request: OversightRequest) -> Any:
        return True

    def bare_string(request: OversightRequest) -> OversightResponse:
        return OversightResponse(request_id=request.request_id, verdict="grant")  # type: ignore[arg-type]

    for approver in (broken, other_request, not_a_response, bare_string):

        @Airlock(policy=SecurityPolicy(escalate_tools={"refund": "why"}, approver=approver))
        def refund(order: str) -> str:
            return "refunded"

        assert refund("o1")["block_reason"] == "escalation_denied", approver


@pytest.mark.parametrize("field", ["allowed_tools", "denied_tools", "granted_capabilities"])
def test_a_lone_string_where_a_list_belongs_is_refused(field: str) -> None:
    # "admin" as a list would be the names a, d, m, i, n: granting @requires("a") by accident.
    with pytest.raises(TypeError, match="not a string"):
        SecurityPolicy(**{field: "admin"})


def test_the_tools_own_escalation_entry_gives_the_reason_over_a_glob() -> None:
    approvals = Approvals()

    @Airlock(policy=SecurityPolicy(escalate_tools={"*": "every tool", "refund": "money leaves"}, approver=approvals))
    def refund(order: str) -> str:
        return "refunded"

    @Airlock(policy=SecurityPolicy(escalate_tools={"*": "every tool", "refund": "money leaves"}, approver=approvals))
    def ship(order: str) -> str:
        return "shipped"

    assert refund("o1") == "refunded" and ship("o1") == "shipped"
    assert [r.reason for r in approvals.requests] == ["money leaves", "every tool"]


def test_approver_is_optional_name() -> None:
    @Airlock(policy=SecurityPolicy(escalate_tools={"refund": "why"}, approver=Approvals(approver=None)))
    def refund(order: str) -> str:
        return "refunded"

    assert refund("o1") == "refunded"


@pytest.mark.parametrize(
    ("name", "recorded"),
    [(os.fsdecode(b"ops-\xff"), "ops-\\udcff"), (7, "7"), ("", "an approver")],
    ids=["lone-surrogate", "not-a-str", "empty"],
)
def test_a_granted_call_runs_once_on_every_store_whatever_the_approver_is_named(
    store: Any, name: Any, recorded: str,
) -> None:
    # The approver's name, as its host gave it (a file name's os.fsdecode(), say), goes on the pending event.
    approvals = Approvals(approver=name)
    runs: list[int] = []

    @Airlock(policy=SecurityPolicy(escalate_tools={"pay": "money leaves"}, approver=approvals,
                                   effect_guard=EffectGuard(store=store)))
    def pay(cents: int) -> str:
        runs.append(cents)
        return "paid"

    with ctx("g-1"):
        out = pay(5)
    assert out == "paid", out
    with ctx("g-1"):
        assert pay(5) == "paid"  # replayed, not run again
    assert runs == [5]
    pending = next(e for e in store.events(call_id="g-1") if e.kind == "pending")
    assert pending.reason == {
        "code": "approved", "message": f"approved by {recorded} (request {approvals.requests[0].request_id})",
    }


def test_require_approval_for_irreversible() -> None:
    approvals = Approvals()
    guard = EffectGuard(require_approval_for_irreversible=True)
    policy = SecurityPolicy(approver=approvals, effect_guard=guard)

    @Airlock(policy=policy)
    def charge(account: str) -> str:
        return "charged"

    @reversibility("costly")
    @Airlock(policy=policy)
    def ship(order: str) -> str:
        return "shipped"

    with ctx("i-1"):
        assert charge("a") == "charged"
    with ctx("i-2"):
        assert ship("o") == "shipped"
    assert [r.tool_name for r in approvals.requests] == ["charge"]


def test_async_approver_in_async_tool() -> None:
    async def approver(request: OversightRequest) -> OversightResponse:
        await asyncio.sleep(0)
        return OversightResponse(request_id=request.request_id, verdict=OversightVerdict.GRANT, approver="bob")

    @Airlock(policy=SecurityPolicy(escalate_tools={"refund": "why"}, approver=approver))  # type: ignore[arg-type]
    async def refund(order: str) -> str:
        return "refunded"

    async def main() -> Any:
        async with ctx("as-1"):
            return await refund("o1")

    assert asyncio.run(main()) == "refunded"


# -- the order of the gates -------------------------------------------------------------------------


def test_first_refusing_gate_ends_the_call() -> None:
    approvals = Approvals()
    store = InMemoryEffectStore()
    guard = EffectGuard(store=store, target_args=("account",))

    def charge(account: str | None = None) -> str:
        return "ok"

    def build(**policy: Any) -> Any:
        return Airlock(policy=SecurityPolicy(
            escalate_tools={"charge": "why"}, approver=approvals, effect_guard=guard, **policy
        ))(requires("pay")(charge))

    # policy before capabilities, capabilities before the id, the id before target args, all before approval
    assert build(denied_tools=["charge"])()["block_reason"] == "policy_violation"
    assert build()()["block_reason"] == "capability_denied"
    assert build(granted_capabilities=["pay"])()["block_reason"] == "tool_call_id_required"
    with ctx("o-1"):
        assert build(granted_capabilities=["pay"])()["block_reason"] == "target_args_required"
        assert approvals.requests == []
        assert build(granted_capabilities=["pay"])(float("nan"))["block_reason"] == "arguments_not_canonical"
        assert approvals.requests == []
        assert build(granted_capabilities=["pay"])("acct") == "ok"
    assert len(approvals.requests) == 1
    assert refused_codes(store) == [
        "policy_violation", "capability_denied", "tool_call_id_required", "target_args_required",
        "arguments_not_canonical",
    ]


def test_effect_status_unknown_still_asks_approval_first() -> None:
    approvals = Approvals(OversightVerdict.DENY)
    store = InMemoryEffectStore()
    policy = SecurityPolicy(escalate_tools={"charge": "why"}, approver=approvals, effect_guard=EffectGuard(store=store))

    @Airlock(policy=policy)
    def charge(account: str) -> str:
        return "ok"

    with ctx("e-1"):
        assert charge("a")["block_reason"] == "escalation_denied"
    assert store.get("e-1") is None


# -- decorator ---------------------------------------------------------------------------------------


def test_wrapper_keeps_name_doc_signature_and_wrapped() -> None:
    def charge(account: str, cents: int = 5) -> dict[str, int]:
        """Charge an account."""
        return {}

    guarded = Airlock()(charge)
    assert guarded.__name__ == "charge" and guarded.__doc__ == "Charge an account."
    assert guarded.__wrapped__ is charge  # type: ignore[attr-defined]
    assert inspect.signature(guarded) == inspect.signature(charge)


def test_async_wrapper_stays_awaitable() -> None:
    @Airlock()
    async def fetch(url: str) -> str:
        return url

    assert inspect.iscoroutinefunction(fetch)
    assert asyncio.run(fetch("u")) == "u"


def test_async_refusal_is_returned_from_the_coroutine() -> None:
    @Airlock(policy=SecurityPolicy(denied_tools=["fetch"]))
    async def fetch(url: str) -> str:
        return url

    assert asyncio.run(fetch("u"))["block_reason"] == "policy_violation"


def test_reversibility_tags() -> None:
    with pytest.raises(ValueError):
        reversibility("maybe")  # type: ignore[arg-type]
    store = InMemoryEffectStore()
    runs: list[int] = []

    def lookup(account: str) -> int:
        runs.append(1)
        raise TimeoutError()

    # The strictest tag wins, above or below the decorator.
    tool = reversibility("reversible")(
        Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))(reversibility("costly")(lookup))
    )
    with ctx("rv"):
        with pytest.raises(TimeoutError):
            tool("a")
        assert tool("a")["block_reason"] == "effect_status_unknown"
    assert runs == [1]


def logged(fn: Any) -> Any:
    """An ordinary decorator, of the kind a host puts between a tag and @Airlock."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return inner


def test_a_stricter_tag_above_another_decorator_keeps_the_tool_from_running_twice() -> None:
    runs: list[int] = []

    @reversibility("irreversible")
    @logged
    @reversibility("reversible")
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def pay(cents: int) -> None:
        runs.append(cents)
        raise TimeoutError("response lost")  # the charge may have happened

    with ctx("pay-1"):
        with pytest.raises(TimeoutError):
            pay(500)
        refusal = pay(500)
    assert refusal["block_reason"] == "effect_status_unknown"
    assert runs == [500]


def test_a_tag_above_another_decorator_is_the_tools_own_called_either_way() -> None:
    runs: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def lookup(n: int) -> None:  # untagged until the decorator above is tagged
        runs.append(n)
        raise TimeoutError("response lost")

    view = reversibility("reversible")(logged(lookup))
    assert reversibility_of(lookup) == reversibility_of(view) == "reversible"
    with ctx("l1"):
        for call in (lookup, view):
            with pytest.raises(TimeoutError):
                call(1)  # reversible: run again on doubt, directly as through the decorator
    assert runs == [1, 1]


@pytest.mark.parametrize("order", ["above first", "own first"])
def test_the_strictest_tag_wins_whatever_order_the_tags_came_in(order: str) -> None:
    runs: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def pay(cents: int) -> None:
        runs.append(cents)
        raise TimeoutError("response lost")  # the charge may have happened

    if order == "above first":
        view = reversibility("costly")(logged(pay))
        reversibility("reversible")(pay)
    else:
        reversibility("reversible")(pay)
        view = reversibility("costly")(logged(pay))
    assert reversibility_of(pay) == reversibility_of(view) == "costly"
    with ctx("p1"):
        with pytest.raises(TimeoutError):
            pay(500)
        assert pay(500)["block_reason"] == "effect_status_unknown"
        assert view(500)["block_reason"] == "effect_status_unknown"
    assert runs == [500]


def test_requires_above_another_decorator_is_asked_for() -> None:
    runs: list[str] = []

    @requires("admin")
    @logged
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def wipe_db() -> str:
        runs.append("wiped")
        return "wiped"

    with ctx("wipe-1"):
        refusal = wipe_db()
    assert refusal["block_reason"] == "capability_denied"
    assert refusal["metadata"]["missing_capabilities"] == ["admin"]
    assert runs == []


def test_a_tag_put_on_after_the_first_call_is_read() -> None:
    def charge(cents: int) -> int:
        return cents

    guarded = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))(charge)
    with ctx("before"):
        assert guarded(1) == 1
    wrapped = requires("payments:write")(logged(guarded))
    with ctx("after"):
        assert wrapped(2)["block_reason"] == "capability_denied"
        assert guarded(2)["block_reason"] == "capability_denied"  # one tool, one set of tags


def test_a_tag_put_on_while_the_first_call_reads_the_tags_is_obeyed_by_every_later_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs: list[str] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def wipe_db() -> str:
        runs.append("wiped")
        return "wiped"

    reading, tagged = threading.Event(), threading.Event()
    read_tags = guard.call.required_capabilities

    def slow_to_read(fn: Any) -> frozenset[str]:
        found = read_tags(fn)
        if threading.current_thread().name == "first-call":
            reading.set()
            tagged.wait(120)  # the tag is put on while the first call is reading the old ones
        return found

    monkeypatch.setattr(guard.call, "required_capabilities", slow_to_read)
    views: list[Any] = []

    def first_call() -> None:
        with ctx("first"):
            wipe_db()

    first = threading.Thread(target=first_call, name="first-call")
    first.start()
    assert reading.wait(120)
    tagger = threading.Thread(target=lambda: views.append(requires("admin")(logged(wipe_db))))
    tagger.start()
    tagger.join(0.2)  # done at once, or waiting for the first call to have read its tags
    tagged.set()
    first.join(120)
    tagger.join(120)
    with ctx("second"):
        assert views[0]()["block_reason"] == "capability_denied"
    with ctx("third"):
        assert wipe_db()["block_reason"] == "capability_denied"
    assert runs == ["wiped"]  # only the call that began before the tag


def test_two_tags_put_on_at_once_both_hold() -> None:
    def charge(cents: int) -> int:
        return cents

    guarded = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))(charge)
    merging, other_done = threading.Event(), threading.Event()

    def slow_union(existing: Any) -> frozenset[str]:
        merging.set()
        other_done.wait(120)  # another @requires is put on meanwhile
        return frozenset(existing or ()) | {"payments:write"}

    first = threading.Thread(target=tag_along, args=(guarded, guard.policy._REQUIRES_ATTR, slow_union))
    first.start()
    assert merging.wait(120)
    second = threading.Thread(target=requires("admin"), args=(guarded,))
    second.start()
    second.join(0.2)
    other_done.set()
    first.join(120)
    second.join(120)
    with ctx("c1"):
        refusal = guarded(1)
    assert refusal["metadata"]["missing_capabilities"] == ["admin", "payments:write"]


def test_effect_guard_default_store_is_fresh_per_guard() -> None:
    a, b = EffectGuard(), EffectGuard()
    assert isinstance(a.store, InMemoryEffectStore) and a.store is not b.store


def test_a_fork_while_another_thread_puts_a_tag_on_gives_a_child_that_can_tag_and_call() -> None:
    import os
    import signal
    import threading
    import time

    class SlowToUnwrap:  # a decorator object whose __wrapped__ takes a while to look up
        __name__ = "slow"

        def __call__(self) -> int:
            return 1

        @property
        def __wrapped__(self) -> None:
            time.sleep(1.0)
            return None

    tagging = threading.Thread(target=lambda: reversibility("reversible")(SlowToUnwrap()))
    tagging.start()
    time.sleep(0.2)  # the tag is being put on, its lock held
    pid = os.fork()
    if pid == 0:  # the child: tag a tool and call it, or be killed by the alarm
        signal.alarm(5)
        try:
            @reversibility("reversible")
            @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
            def ping() -> int:
                return 1

            os._exit(0 if ping() == 1 else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    tagging.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def _raise_again(blocked: AirlockBlocked) -> None:
    raise blocked
