"""Section 2 of the behaviour contract, the public API: the decorator and context, the policy, the
refusals, the gates in order, the idempotency key, the effect guard and the EffectStore protocol.

Written against the behaviour contract alone: public names only, and only what the contract states."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import functools
import inspect
import logging
import re
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guard import (
    Airlock,
    AirlockBlocked,
    AirlockContext,
    OversightRequest,
    OversightResponse,
    OversightVerdict,
    Refusal,
    SecurityPolicy,
    get_current_context,
    is_refusal,
    requires,
)
from guard.effect_guard import (
    EffectGuard,
    EffectOutcomeUnknown,
    InMemoryEffectStore,
    idempotency_key,
    reversibility,
)
from journal import SQLiteJournal
from tests.spec.support import (
    PYTHON,
    answering,
    close,
    count,
    ctx,
    db_calls,
    db_events,
    expected_key,
    export_lines,
    guard_for,
    make_pay,
    projected_fields,
    raw,
    report_field,
)


def _params(fn: Any) -> dict[str, Any]:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()}


def test_public_signatures() -> None:
    assert _params(SecurityPolicy) == {
        "allowed_tools": None, "denied_tools": (), "escalate_tools": None, "approver": None,
        "granted_capabilities": (), "effect_guard": None,
    }
    eg = _params(EffectGuard)
    assert list(eg)[:5] == ["store", "require_tool_call_id", "require_approval_for_irreversible", "target_args",
                            "ambiguous_errors"]
    assert eg["store"] is None and eg["require_tool_call_id"] is True
    assert eg["require_approval_for_irreversible"] is False and tuple(eg["target_args"]) == ()
    assert tuple(eg["ambiguous_errors"]) == (TimeoutError, ConnectionResetError, ConnectionAbortedError,
                                             BrokenPipeError, EffectOutcomeUnknown)
    air = _params(Airlock)
    assert "policy" in air and air["on_block"] == "return"
    ctxp = _params(AirlockContext)
    assert ctxp["agent_id"] is None and ctxp["metadata"] is None
    j = _params(SQLiteJournal)
    assert next(iter(j)) == "path" and j["durability"] == "full" and j["busy_timeout"] == 30.0
    assert list(_params(idempotency_key))[:2] == ["tool", "arguments"]


# --------------------------------------------------------------------------------------------------------------
# 2.1 decorator and context


def test_wrapper_keeps_name_doc_wrapped_and_signature() -> None:
    airlock = Airlock(policy=SecurityPolicy())

    def transfer(account: str, cents: int = 5) -> int:
        """Move money."""
        return cents

    wrapped = airlock(transfer)
    assert wrapped.__wrapped__ is transfer
    assert wrapped.__name__ == "transfer"
    assert wrapped.__doc__ == "Move money."
    assert inspect.signature(wrapped) == inspect.signature(transfer)


def test_async_tool_stays_awaitable() -> None:
    airlock = Airlock(policy=SecurityPolicy())

    @airlock
    async def lookup(x: int) -> int:
        await asyncio.sleep(0)
        return x * 2

    assert inspect.iscoroutinefunction(lookup)
    result = lookup(21)
    assert inspect.isawaitable(result)
    assert asyncio.run(result) == 42


def test_context_nesting_sync_and_async() -> None:
    assert get_current_context() is None
    outer = AirlockContext(agent_id="outer")
    inner = AirlockContext(agent_id="inner", metadata={"tool_call_id": "x"})
    with outer:
        assert get_current_context() is outer
        with inner:
            assert get_current_context() is inner
        assert get_current_context() is outer
    assert get_current_context() is None

    async def go() -> None:
        async with outer:
            assert get_current_context() is outer
            async with inner:
                assert get_current_context() is inner
            assert get_current_context() is outer
        assert get_current_context() is None

    asyncio.run(go())


def test_context_inside_call_is_a_copy_with_key_and_call_id() -> None:
    seen: list[Any] = []
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    def pay(account: str, cents: int = 100) -> str:
        seen.append(get_current_context())
        return "ok"

    host = AirlockContext(agent_id="a1", metadata={"tool_call_id": "call-7", "other": 1})
    before_meta = dict(host.metadata)
    with host:
        assert pay("acct") == "ok"
    inner = seen[0]
    assert inner is not host
    assert inner.tool_call_id == "call-7"
    assert inner.idempotency_key == expected_key("pay", {"account": "acct", "cents": 100})
    assert inner.agent_id == "a1"
    assert dict(host.metadata) == before_meta
    assert getattr(host, "idempotency_key", None) is None
    assert getattr(host, "tool_call_id", None) in (None, "call-7")


def test_context_inside_call_without_host_context_is_fresh() -> None:
    seen: list[Any] = []

    @Airlock(policy=SecurityPolicy())
    def look(x: int) -> int:
        seen.append(get_current_context())
        return x

    assert get_current_context() is None
    assert look(1) == 1
    assert isinstance(seen[0], AirlockContext)
    assert seen[0].tool_call_id is None
    assert get_current_context() is None


def test_call_id_that_is_not_a_string_is_no_call_id() -> None:
    seen: list[Any] = []

    @guard_for(InMemoryEffectStore())
    @reversibility("reversible")
    def look(q: str) -> str:
        seen.append(get_current_context().tool_call_id)
        return "ok"

    with AirlockContext(metadata={"tool_call_id": 123}):
        assert look("q") == "ok"
    with AirlockContext(metadata={"tool_call_id": ""}):
        assert look("q") == "ok"
    assert seen == [None, None]


def test_per_call_context_does_not_share_metadata_with_the_host() -> None:
    @guard_for(InMemoryEffectStore())
    def pay(account: str) -> str:
        c = get_current_context()
        c.metadata["scribble"] = True
        return "ok"

    host = AirlockContext(agent_id="h", metadata={"tool_call_id": "md-1"})
    with host:
        pay("a")
    assert host.metadata == {"tool_call_id": "md-1"}


def test_refused_async_call_is_still_awaitable() -> None:
    @guard_for(InMemoryEffectStore(), denied_tools=["den"])
    async def den(x: int) -> int:
        return x

    result = den(1)
    assert inspect.isawaitable(result)
    refusal = asyncio.run(result)
    assert is_refusal(refusal) and refusal["block_reason"] == "policy_violation"

    @guard_for(InMemoryEffectStore(), denied_tools=["den2"], on_block="raise")
    async def den2(x: int) -> int:
        return x

    async def go() -> None:
        with pytest.raises(AirlockBlocked):
            await den2(1)

    asyncio.run(go())


def test_generator_functions_decorated_directly_are_deferred() -> None:
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    def gen(x: int) -> Iterator[int]:
        yield x

    @airlock
    async def agen(x: int) -> Any:
        yield x

    with ctx("gd-1"):
        g = gen(1)
    assert inspect.isgenerator(g) and list(g) == [1]
    with ctx("gd-1"):
        assert gen(1)["block_reason"] == "effect_status_unknown"
    with ctx("gd-2"):
        a = agen(1)
    assert inspect.isasyncgen(a)
    with ctx("gd-2"):
        assert agen(1)["block_reason"] == "effect_status_unknown"


# --------------------------------------------------------------------------------------------------------------
# 2.2 policy


def test_allowed_tools_none_allows_everything_and_list_restricts() -> None:
    @Airlock(policy=SecurityPolicy(allowed_tools=None))
    def anything(x: int) -> int:
        return x

    assert anything(3) == 3

    runs: list[int] = []

    def other(x: int) -> int:
        runs.append(x)
        return x

    restricted = Airlock(policy=SecurityPolicy(allowed_tools=["read_*", "ping"]))(other)
    result = restricted(1)
    assert is_refusal(result)
    assert result["block_reason"] == "policy_violation"
    assert runs == []

    def read_file(x: int) -> int:
        return x

    assert Airlock(policy=SecurityPolicy(allowed_tools=["read_*"]))(read_file)(4) == 4


def test_denied_tools_win_over_allowed() -> None:
    runs: list[int] = []

    def read_secret(x: int) -> int:
        runs.append(x)
        return x

    wrapped = Airlock(policy=SecurityPolicy(allowed_tools=["read_*"], denied_tools=["*_secret"]))(read_secret)
    result = wrapped(1)
    assert is_refusal(result) and result["block_reason"] == "policy_violation"
    assert runs == []


def test_refusal_shape() -> None:
    @Airlock(policy=SecurityPolicy(denied_tools=["drop"]))
    def drop(x: int) -> int:
        return x

    with ctx("tc-1"):
        result = drop(1)
    assert isinstance(result, Refusal)
    assert isinstance(result, dict)
    assert result["success"] is False
    assert result["status"] == "blocked"
    assert result["block_reason"] == "policy_violation"
    assert isinstance(result["error"], str) and result["error"]
    assert isinstance(result["fix_hints"], list) and all(isinstance(h, str) for h in result["fix_hints"])
    assert result["metadata"]["tool"] == "drop"
    assert result["metadata"]["tool_call_id"] == "tc-1"
    assert is_refusal(result)
    assert not is_refusal(dict(result))
    assert not is_refusal({"success": False, "status": "blocked", "block_reason": "policy_violation"})
    assert not is_refusal(None)


def test_on_block_raise() -> None:
    @Airlock(policy=SecurityPolicy(denied_tools=["drop"]), on_block="raise")
    def drop(x: int) -> int:
        return x

    with pytest.raises(AirlockBlocked) as info:
        drop(1)
    assert info.value.block_reason == "policy_violation"
    assert is_refusal(info.value.refusal)
    assert info.value.refusal["block_reason"] == "policy_violation"


def test_escalation_without_approver_is_required() -> None:
    runs: list[Any] = []
    airlock = guard_for(InMemoryEffectStore(), escalate_tools={"pay": "moves money"})
    pay = make_pay(airlock, runs)
    with ctx("e-1"):
        result = pay("a", 1)
    assert is_refusal(result) and result["block_reason"] == "escalation_required"
    assert runs == []


@pytest.mark.parametrize(
    "kind", ["deny", "timeout", "exception", "other_request"],
)
def test_escalation_refused_unless_granted_for_this_request(kind: str) -> None:
    calls: list[OversightRequest] = []
    approver = {
        "deny": answering(OversightVerdict.DENY, calls),
        "timeout": answering(OversightVerdict.TIMEOUT, calls),
        "exception": answering(OversightVerdict.GRANT, calls, raise_=True),
        "other_request": answering(OversightVerdict.GRANT, calls, other_id=True),
    }[kind]
    runs: list[Any] = []
    airlock = guard_for(InMemoryEffectStore(), escalate_tools={"pa*": "moves money"}, approver=approver)
    pay = make_pay(airlock, runs)
    with ctx("e-2"):
        result = pay("a", 1)
    assert is_refusal(result) and result["block_reason"] == "escalation_denied"
    assert runs == []
    assert len(calls) == 1


def test_escalation_granted_runs_and_request_fields() -> None:
    calls: list[OversightRequest] = []
    runs: list[Any] = []
    airlock = guard_for(InMemoryEffectStore(), escalate_tools={"pay": "moves money"},
                        approver=answering(OversightVerdict.GRANT, calls))
    pay = make_pay(airlock, runs)
    with ctx("e-3", agent_id="agent-x"):
        assert pay("acct", 7) == {"charged": 7, "account": "acct"}
    assert runs == [("acct", 7)]
    (request,) = calls
    assert request.tool_name == "pay"
    assert request.arguments == {"account": "acct", "cents": 7}
    assert request.reason == "moves money"
    assert request.tool_call_id == "e-3"
    assert request.agent_id == "agent-x"
    assert request.idempotency_key == expected_key("pay", {"account": "acct", "cents": 7})
    assert isinstance(request.request_id, str) and request.request_id
    assert request.requested_at is not None
    with pytest.raises(Exception):  # noqa: B017 - frozen
        request.tool_name = "other"  # type: ignore[misc]


def test_oversight_response_approver_optional() -> None:
    calls: list[OversightRequest] = []

    def approve(request: OversightRequest) -> OversightResponse:
        calls.append(request)
        return OversightResponse(request_id=request.request_id, verdict=OversightVerdict.GRANT)

    airlock = guard_for(InMemoryEffectStore(), escalate_tools={"pay": "r"}, approver=approve)
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    with ctx("e-4"):
        assert not is_refusal(pay("a", 1))
    assert runs == [("a", 1)]


def test_oversight_request_arguments_in_json_form_with_defaults() -> None:
    calls: list[OversightRequest] = []
    airlock = guard_for(InMemoryEffectStore(), escalate_tools={"book": "r"},
                        approver=answering(OversightVerdict.GRANT, calls))
    when = dt.datetime(2026, 3, 4, 5, 6, 7, tzinfo=dt.UTC)

    @airlock
    def book(when: dt.datetime, tags: tuple[str, ...] = ("a", "b")) -> str:
        return "booked"

    with ctx("e-5"):
        assert book(when) == "booked"
    expected = orjson.loads(orjson.dumps({"when": when, "tags": ("a", "b")}))
    assert calls[0].arguments == expected


def test_requires_above_and_below_airlock() -> None:
    airlock_none = guard_for(InMemoryEffectStore())
    airlock_ok = guard_for(InMemoryEffectStore(), granted_capabilities=("payments:write",))

    def body(x: int) -> int:
        return x

    below_none = airlock_none(requires("payments:write")(body))
    above_none = requires("payments:write")(airlock_none(body))
    below_ok = airlock_ok(requires("payments:write")(body))
    above_ok = requires("payments:write")(airlock_ok(body))
    for i, fn in enumerate([below_none, above_none]):
        with ctx(f"cap-n{i}"):
            result = fn(1)
        assert is_refusal(result) and result["block_reason"] == "capability_denied"
    for i, fn in enumerate([below_ok, above_ok]):
        with ctx(f"cap-o{i}"):
            assert fn(2) == 2


def test_requires_several_capabilities_all_needed() -> None:
    airlock = guard_for(InMemoryEffectStore(), granted_capabilities=("a",))

    @airlock
    @requires("a", "b")
    def both(x: int) -> int:
        return x

    with ctx("cap-2"):
        result = both(1)
    assert is_refusal(result) and result["block_reason"] == "capability_denied"


def test_requires_read_through_other_wrappers() -> None:
    def passthrough(fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(*a: Any, **k: Any) -> Any:
            return fn(*a, **k)

        return inner

    def pay(account: str) -> str:
        return "ok"

    fn = guard_for(InMemoryEffectStore())(passthrough(requires("payments:write")(pay)))
    with ctx("rq-1"):
        assert fn("a")["block_reason"] == "capability_denied"


@pytest.mark.parametrize("response", ["none", "dict", "string_verdict", "deny"])
def test_only_a_real_grant_lets_the_call_through(response: str) -> None:
    runs: list[Any] = []

    def approve(request: OversightRequest) -> Any:
        if response == "none":
            return None
        if response == "dict":
            return {"request_id": request.request_id, "verdict": "grant"}
        if response == "string_verdict":  # the word, not OversightVerdict.GRANT
            return OversightResponse(request_id=request.request_id, verdict="grant", approver="x")  # type: ignore[arg-type]
        return OversightResponse(request_id=request.request_id, verdict=OversightVerdict.DENY, approver="x")

    pay = make_pay(guard_for(InMemoryEffectStore(), escalate_tools={"pay": "r"}, approver=approve), runs)
    with ctx("gr-1"):
        result = pay("a")
    assert is_refusal(result) and result["block_reason"] == "escalation_denied"
    assert runs == []


def test_an_empty_allowed_list_allows_nothing() -> None:
    runs: list[Any] = []

    def ping(x: int) -> int:
        runs.append(x)
        return x

    result = Airlock(policy=SecurityPolicy(allowed_tools=[]))(ping)(1)
    assert is_refusal(result) and result["block_reason"] == "policy_violation"
    assert runs == []


def test_requires_stacked_at_two_levels_needs_both() -> None:
    def pay(account: str) -> str:
        return "ok"

    for granted, ok in ((("a",), False), (("b",), False), (("a", "b"), True)):
        airlock = guard_for(InMemoryEffectStore(), granted_capabilities=granted)
        fn = requires("a")(airlock(requires("b")(pay)))
        with ctx("rs2-1"):
            result = fn("x")
        if ok:
            assert result == "ok"
        else:
            assert is_refusal(result) and result["block_reason"] == "capability_denied", granted


# --------------------------------------------------------------------------------------------------------------
# 2.4 the gates, in order


def test_gate_order_policy_before_capability() -> None:
    airlock = guard_for(InMemoryEffectStore(), denied_tools=["pay"])

    def pay_(account: str) -> str:
        return account

    pay_.__name__ = "pay"
    fn = airlock(requires("x")(pay_))
    result = fn("a")  # no tool_call_id either
    assert result["block_reason"] == "policy_violation"


def test_gate_order_capability_before_tool_call_id() -> None:
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    @requires("x")
    def pay(account: str) -> str:
        return account

    assert pay("a")["block_reason"] == "capability_denied"


def test_gate_order_tool_call_id_before_target_args() -> None:
    airlock = guard_for(InMemoryEffectStore(), eg={"target_args": ("account",)})
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    assert pay(None)["block_reason"] == "tool_call_id_required"


def test_gate_order_target_args_before_escalation_and_approver_not_consulted() -> None:
    calls: list[OversightRequest] = []
    airlock = guard_for(InMemoryEffectStore(), eg={"target_args": ("account",)}, escalate_tools={"pay": "r"},
                        approver=answering(OversightVerdict.GRANT, calls))
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    with ctx("g-1"):
        assert pay("")["block_reason"] == "target_args_required"
    assert calls == [] and runs == []


def test_policy_refusal_does_not_consult_approver() -> None:
    calls: list[OversightRequest] = []
    airlock = guard_for(InMemoryEffectStore(), denied_tools=["pay"], escalate_tools={"pay": "r"},
                        approver=answering(OversightVerdict.GRANT, calls))
    pay = make_pay(airlock, [])
    with ctx("g-2"):
        assert pay("a")["block_reason"] == "policy_violation"
    assert calls == []


def test_approval_never_reused_on_replay(journal: Any) -> None:
    calls: list[OversightRequest] = []
    verdicts = [OversightVerdict.GRANT, OversightVerdict.GRANT, OversightVerdict.DENY]

    def approve(request: OversightRequest) -> OversightResponse:
        calls.append(request)
        return OversightResponse(request_id=request.request_id, verdict=verdicts[len(calls) - 1])

    airlock = guard_for(journal, escalate_tools={"pay": "r"}, approver=approve)
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    for _ in range(2):
        with ctx("g-3"):
            assert pay("a", 3) == {"charged": 3, "account": "a"}
    with ctx("g-3"):
        result = pay("a", 3)
    assert is_refusal(result) and result["block_reason"] == "escalation_denied"
    assert len(calls) == 3
    assert runs == [("a", 3)]


def test_policy_that_now_denies_refuses_the_replay(journal: Any, db: Path) -> None:
    runs: list[Any] = []
    first = make_pay(guard_for(journal), runs)
    later = make_pay(guard_for(journal, denied_tools=["pay"]), runs)
    with ctx("g-4"):
        first("a", 1)
    with ctx("g-4"):
        result = later("a", 1)
    assert is_refusal(result) and result["block_reason"] == "policy_violation"
    assert runs == [("a", 1)]
    assert count(db, "replayed") == 0


@pytest.mark.parametrize("call_id", [None, "", 123])
def test_tool_call_id_required_for_non_reversible(call_id: Any) -> None:
    for tag in (None, "costly", "irreversible"):
        runs: list[Any] = []
        pay = make_pay(guard_for(InMemoryEffectStore()), runs, tag=tag)
        with AirlockContext(metadata={} if call_id is None else {"tool_call_id": call_id}):
            result = pay("a")
        assert is_refusal(result) and result["block_reason"] == "tool_call_id_required", tag
        assert runs == []


def test_reversible_without_tool_call_id_runs_unguarded(journal: Any, db: Path) -> None:
    runs: list[Any] = []
    look = make_pay(guard_for(journal), runs, tag="reversible", name="look")
    assert look("a") == {"charged": 100, "account": "a"}
    assert look("a") == {"charged": 100, "account": "a"}
    assert len(runs) == 2
    assert count(db, "pending") == 0


def test_reversible_without_tool_call_id_still_gets_other_gates() -> None:
    runs: list[Any] = []
    look = make_pay(guard_for(InMemoryEffectStore(), denied_tools=["look"]), runs, tag="reversible", name="look")
    assert look("a")["block_reason"] == "policy_violation"
    assert runs == []


def test_require_tool_call_id_false_lets_a_call_without_id_run() -> None:
    runs: list[Any] = []
    pay = make_pay(guard_for(InMemoryEffectStore(), eg={"require_tool_call_id": False}), runs)
    assert pay("a") == {"charged": 100, "account": "a"}
    assert runs == [("a", 100)]


@pytest.mark.parametrize("value", [None, ""])
def test_target_args_required(value: Any) -> None:
    runs: list[Any] = []
    airlock = guard_for(InMemoryEffectStore(), eg={"target_args": ("account", "iban")})

    @airlock
    def pay(account: Any = None, iban: Any = None, cents: int = 1) -> str:
        runs.append(1)
        return "paid"

    with ctx("t-1"):
        assert pay(account=value, iban=value)["block_reason"] == "target_args_required"
    with ctx("t-2"):
        assert pay(account=value, iban="DE00") == "paid"
    assert runs == [1]


def test_target_args_and_irreversible_approval_apply_to_irreversible_only() -> None:
    airlock = guard_for(InMemoryEffectStore(), eg={"target_args": ("account",),
                                                   "require_approval_for_irreversible": True})
    for tag in ("reversible", "costly"):
        runs: list[Any] = []
        fn = make_pay(airlock, runs, tag=tag, name=f"f_{tag}")
        with ctx(f"t-{tag}"):
            assert fn(None) == {"charged": 100, "account": None}, tag
        assert len(runs) == 1, tag
    runs2: list[Any] = []
    irreversible = make_pay(airlock, runs2, tag="irreversible", name="f_irr")
    with ctx("t-irr-none"):
        assert irreversible(None)["block_reason"] == "target_args_required"
    with ctx("t-irr"):
        assert irreversible("acct")["block_reason"] == "escalation_required"
    assert runs2 == []


def test_require_approval_for_irreversible_untagged_tool() -> None:
    calls: list[OversightRequest] = []
    airlock = guard_for(InMemoryEffectStore(), eg={"require_approval_for_irreversible": True},
                        approver=answering(OversightVerdict.GRANT, calls))
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    with ctx("t-3"):
        assert pay("a") == {"charged": 100, "account": "a"}
    assert len(calls) == 1


def test_approver_is_consulted_before_pending(journal: Any, db: Path) -> None:
    rows: list[Any] = []

    def approve(request: OversightRequest) -> OversightResponse:
        rows.append(dict(db_calls(db)))
        return OversightResponse(request_id=request.request_id, verdict=OversightVerdict.GRANT)

    pay = make_pay(guard_for(journal, escalate_tools={"pay": "r"}, approver=approve), [])
    with ctx("ap-1"):
        pay("a")
    assert rows == [{}]


def test_capability_removed_refuses_the_replay(journal: Any) -> None:
    runs: list[Any] = []

    def pay(account: str) -> str:
        runs.append(account)
        return "ok"

    first = guard_for(journal, granted_capabilities=("pay",))(requires("pay")(pay))
    later = guard_for(journal)(requires("pay")(pay))
    with ctx("cr-1"):
        assert first("a") == "ok"
    with ctx("cr-1"):
        assert later("a")["block_reason"] == "capability_denied"
    assert runs == ["a"]


# --------------------------------------------------------------------------------------------------------------
# 2.5 the idempotency key


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
)


json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tool=st.text(min_size=1, max_size=10), arguments=st.dictionaries(st.text(max_size=6), json_values, max_size=5),
       data=st.data())
def test_idempotency_key_byte_rule(tool: str, arguments: dict[str, Any], data: Any) -> None:
    key = idempotency_key(tool, arguments)
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert key == expected_key(tool, arguments)
    order = data.draw(st.permutations(list(arguments)))
    assert idempotency_key(tool, {k: arguments[k] for k in order}) == key


def test_idempotency_key_nested_key_order_never_matters() -> None:
    a = {"x": {"b": 1, "a": [{"d": 1, "c": 2}]}, "y": 2}
    b = {"y": 2, "x": {"a": [{"c": 2, "d": 1}], "b": 1}}
    assert idempotency_key("t", a) == idempotency_key("t", b) == expected_key("t", a)


def test_idempotency_key_dataclasses_and_pydantic_key_order() -> None:
    import pydantic

    @dataclasses.dataclass
    class BA:
        b: int
        a: str

    @dataclasses.dataclass
    class AB:
        a: str
        b: int

    class PBA(pydantic.BaseModel):
        b: int
        a: str

    plain = {"v": {"a": "s", "b": 1}}
    expected = expected_key("t", plain)
    assert idempotency_key("t", {"v": BA(b=1, a="s")}) == expected
    assert idempotency_key("t", {"v": AB(a="s", b=1)}) == expected
    assert idempotency_key("t", {"v": PBA(b=1, a="s")}) == expected


def test_key_binding_positional_keyword_defaults() -> None:
    keys: list[str] = []
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    def f(account: str, cents: int = 5, note: str = "n") -> str:
        keys.append(get_current_context().idempotency_key)
        return "ok"

    for i, call in enumerate([lambda: f("a", 5), lambda: f(account="a", cents=5), lambda: f("a", cents=5),
                              lambda: f("a")]):
        with ctx(f"k-{i}"):
            call()
    assert len(set(keys)) == 1
    assert keys[0] == expected_key("f", {"account": "a", "cents": 5, "note": "n"})


def test_key_binding_var_args_and_kwargs() -> None:
    keys: list[str] = []
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    def g(a: int, *rest: int, **extra: Any) -> str:
        keys.append(get_current_context().idempotency_key)
        return "ok"

    with ctx("k-va"):
        g(1, 2, 3, x=4, y="z")
    assert keys[0] == expected_key("g", {"a": 1, "rest": [2, 3], "x": 4, "y": "z"})


def test_key_does_not_depend_on_tool_call_id() -> None:
    keys: list[str] = []

    @guard_for(InMemoryEffectStore())
    def h(x: int) -> str:
        keys.append(get_current_context().idempotency_key)
        return "ok"

    for cid in ("one", "two"):
        with ctx(cid):
            h(1)
    assert keys[0] == keys[1] == expected_key("h", {"x": 1})


def test_argument_named_tool_call_id_is_ordinary() -> None:
    seen: list[Any] = []
    runs: list[Any] = []

    @guard_for(InMemoryEffectStore())
    def notify(tool_call_id: str, text: str) -> str:
        runs.append(1)
        c = get_current_context()
        seen.append((c.tool_call_id, c.idempotency_key))
        return "sent"

    result = notify(tool_call_id="abc", text="hi")  # no context id: the argument is not the call's id
    assert is_refusal(result) and result["block_reason"] == "tool_call_id_required"
    assert runs == []
    with ctx("real-id"):
        assert notify(tool_call_id="abc", text="hi") == "sent"
    assert seen[0] == ("real-id", expected_key("notify", {"tool_call_id": "abc", "text": "hi"}))


@pytest.mark.parametrize("bad", [object(), float("nan"), float("inf"), float("-inf")])
def test_non_canonical_arguments_refused_where_key_needed(bad: Any) -> None:
    runs: list[Any] = []
    pay = make_pay(guard_for(InMemoryEffectStore()), runs)
    with ctx("nc-1"):
        result = pay(bad)
    assert is_refusal(result) and result["block_reason"] == "arguments_not_canonical"
    assert runs == []


def test_non_canonical_arguments_refused_for_escalation_before_approver() -> None:
    calls: list[OversightRequest] = []
    runs: list[Any] = []
    look = make_pay(guard_for(InMemoryEffectStore(), escalate_tools={"look": "r"},
                              approver=answering(OversightVerdict.GRANT, calls)), runs, tag="reversible", name="look")
    result = look(object())
    assert is_refusal(result) and result["block_reason"] == "arguments_not_canonical"
    assert calls == [] and runs == []


def test_non_canonical_refusal_comes_after_gate_four() -> None:
    airlock = guard_for(InMemoryEffectStore(), eg={"target_args": ("account",)})

    @airlock
    def pay(account: Any = None, blob: Any = None) -> str:
        return "x"

    assert pay(None, object())["block_reason"] == "tool_call_id_required"
    with ctx("nc-2"):
        assert pay(None, object())["block_reason"] == "target_args_required"


def test_non_canonical_arguments_run_when_no_key_needed() -> None:
    seen: list[Any] = []
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    @reversibility("reversible")
    def look(thing: Any) -> str:
        seen.append(get_current_context().idempotency_key)
        return "seen"

    assert look(object()) == "seen"
    assert seen == [None]


def test_idempotency_key_nested_models() -> None:
    import pydantic

    class Item(pydantic.BaseModel):
        sku: str
        qty: int

    @dataclasses.dataclass
    class Order:
        lines: list[Any]
        meta: dict[str, Any]

    value = {"order": Order(lines=[Item(qty=2, sku="x")], meta={"z": 1, "a": 2})}
    plain = {"order": {"lines": [{"qty": 2, "sku": "x"}], "meta": {"a": 2, "z": 1}}}
    assert idempotency_key("t", value) == expected_key("t", plain)


def test_idempotency_key_accepts_any_mapping_and_orjson_native_types() -> None:
    import types
    import uuid

    assert idempotency_key("t", types.MappingProxyType({"b": 1, "a": 2})) == expected_key("t", {"a": 2, "b": 1})
    when = dt.datetime(2026, 5, 6, 7, 8, 9, 10, tzinfo=dt.UTC)
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    args = {"when": when, "day": dt.date(2026, 5, 6), "id": u, "pair": (1, 2)}
    assert idempotency_key("t", args) == expected_key("t", args)


def test_key_binding_empty_var_args_and_positional_only() -> None:
    keys: list[str] = []
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    def g(a: int, *rest: int, **extra: Any) -> int:
        keys.append(get_current_context().idempotency_key)
        return 1

    @airlock
    def h(a: int, /, b: int, *, c: int = 3) -> int:
        keys.append(get_current_context().idempotency_key)
        return 1

    with ctx("kb-1"):
        g(1)
    with ctx("kb-2"):
        h(1, 2)
    with ctx("kb-3"):
        h(1, b=2, c=3)
    assert keys[0] == expected_key("g", {"a": 1, "rest": []})
    assert keys[1] == keys[2] == expected_key("h", {"a": 1, "b": 2, "c": 3})


def test_non_canonical_arguments_of_a_reversible_call_with_an_id() -> None:
    runs: list[Any] = []
    look = make_pay(guard_for(InMemoryEffectStore()), runs, tag="reversible", name="look")
    with ctx("nc-r"):
        result = look(float("nan"))
    assert is_refusal(result) and result["block_reason"] == "arguments_not_canonical"
    assert runs == []


# --------------------------------------------------------------------------------------------------------------
# 2.6 the effect guard


STORES = ["memory", "sqlite"]


@pytest.fixture(params=STORES)
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    store = InMemoryEffectStore() if request.param == "memory" else SQLiteJournal(str(tmp_path / "s.db"))
    try:
        yield store
    finally:
        close(store)


def test_committed_replays_stored_json_form(any_store: Any) -> None:
    @dataclasses.dataclass
    class Receipt:
        id: str
        cents: int

    when = dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.UTC)
    value = {"pair": (1, 2), "receipt": Receipt("r1", 5), "at": when}
    runs: list[Any] = []

    @guard_for(any_store)
    def pay(account: str) -> Any:
        runs.append(account)
        return value

    with ctx("r-1"):
        first = pay("a")
    assert first is value
    with ctx("r-1"):
        second = pay("a")
    assert runs == ["a"]
    assert second == orjson.loads(orjson.dumps(value))
    assert second == {"pair": [1, 2], "receipt": {"id": "r1", "cents": 5}, "at": "2026-01-02T03:04:05.123456+00:00"}


def test_unencodable_value_returned_first_then_replay_value_unavailable(any_store: Any) -> None:
    token = object()
    runs: list[Any] = []

    @guard_for(any_store)
    def mint(n: int) -> Any:
        runs.append(n)
        return token

    with ctx("u-1"):
        assert mint(1) is token
    for _ in range(2):
        with ctx("u-1"):
            result = mint(1)
        assert is_refusal(result) and result["block_reason"] == "replay_value_unavailable"
    assert runs == [1]


@pytest.mark.parametrize("kind", ["generator", "iterator", "awaitable", "async_generator"])
def test_deferred_result_recorded_unknown_and_returned_untouched(any_store: Any, kind: str) -> None:
    made: list[Any] = []

    def gen() -> Iterator[int]:
        yield 1

    async def coro() -> int:
        return 1

    async def agen() -> Any:
        yield 1

    @guard_for(any_store)
    def stream(n: int) -> Any:
        obj = {"generator": gen, "iterator": lambda: iter([1, 2]), "awaitable": coro, "async_generator": agen}[kind]()
        made.append(obj)
        return obj

    with ctx("d-1"):
        result = stream(1)
    assert result is made[0]
    with ctx("d-1"):
        again = stream(1)
    assert is_refusal(again) and again["block_reason"] == "effect_status_unknown"
    assert again["metadata"]["status"] == "unknown"
    assert len(made) == 1
    if kind == "awaitable":
        result.close()


def test_ambiguous_error_recorded_unknown_and_reraised(any_store: Any) -> None:
    runs: list[Any] = []
    err = TimeoutError("backend timed out")

    @guard_for(any_store)
    def pay(account: str) -> str:
        runs.append(account)
        raise err

    with ctx("a-1"), pytest.raises(TimeoutError) as info:
        pay("a")
    assert info.value is err
    with ctx("a-1"):
        result = pay("a")
    assert is_refusal(result) and result["block_reason"] == "effect_status_unknown"
    md = result["metadata"]
    assert md["status"] == "unknown"
    assert md["idempotency_key"] == expected_key("pay", {"account": "a"})
    assert md["attempt"] == 1
    assert md["since"]
    assert "idempotency" in result["error"].lower()
    assert "retry" in result["error"].lower()
    assert runs == ["a"]


@pytest.mark.parametrize("exc", [ConnectionResetError, ConnectionAbortedError, BrokenPipeError, EffectOutcomeUnknown])
def test_default_ambiguous_errors(exc: type[BaseException]) -> None:
    runs: list[Any] = []

    @guard_for(InMemoryEffectStore())
    def pay(account: str) -> str:
        runs.append(account)
        raise exc("lost")

    with ctx("a-2"), pytest.raises(exc):
        pay("a")
    with ctx("a-2"):
        assert pay("a")["block_reason"] == "effect_status_unknown"
    assert len(runs) == 1


def test_custom_ambiguous_errors() -> None:
    class Lost(Exception):
        pass

    runs: list[Any] = []

    @guard_for(InMemoryEffectStore(), eg={"ambiguous_errors": (Lost,)})
    def pay(account: str) -> str:
        runs.append(account)
        raise Lost("?")

    with ctx("a-3"), pytest.raises(Lost):
        pay("a")
    with ctx("a-3"):
        assert pay("a")["block_reason"] == "effect_status_unknown"


def test_other_exception_released_and_runs_again(any_store: Any) -> None:
    attempts: list[int] = []

    @guard_for(any_store)
    def pay(account: str) -> str:
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            raise ValueError("declined")
        return "paid"

    with ctx("x-1"), pytest.raises(ValueError):
        pay("a")
    with ctx("x-1"):
        assert pay("a") == "paid"
    with ctx("x-1"):
        assert pay("a") == "paid"
    assert attempts == [1, 2]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_base_exception_recorded_unknown(any_store: Any, exc: type[BaseException]) -> None:
    runs: list[Any] = []

    @guard_for(any_store)
    def pay(account: str) -> str:
        runs.append(account)
        raise exc()

    with ctx("b-1"), pytest.raises(exc):
        pay("a")
    with ctx("b-1"):
        result = pay("a")
    assert result["block_reason"] == "effect_status_unknown"
    assert runs == ["a"]


def test_async_tool_awaited_inside_guard_and_cancellation_unknown(any_store: Any) -> None:
    runs: list[Any] = []
    airlock = guard_for(any_store)

    @airlock
    async def pay(account: str) -> dict[str, Any]:
        runs.append(account)
        await asyncio.sleep(0)
        return {"paid": (1, 2)}

    @airlock
    async def hang(account: str) -> str:
        runs.append(account)
        await asyncio.sleep(10)
        return "never"

    async def go() -> None:
        async with ctx("as-1"):
            assert await pay("a") == {"paid": (1, 2)}
        async with ctx("as-1"):
            assert await pay("a") == {"paid": [1, 2]}
        async with ctx("as-2"):
            task = asyncio.ensure_future(hang("h"))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        async with ctx("as-2"):
            result = await hang("h")
        assert result["block_reason"] == "effect_status_unknown"

    asyncio.run(go())
    assert runs == ["a", "h"]


def test_tool_call_id_reused_with_other_arguments_or_tool(any_store: Any) -> None:
    airlock = guard_for(any_store)
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    refund = make_pay(airlock, runs, name="refund")
    with ctx("re-1"):
        pay("a", 1)
    for call in (lambda: pay("a", 2), lambda: refund("a", 1)):
        with ctx("re-1"):
            result = call()
        assert is_refusal(result) and result["block_reason"] == "policy_violation"
        assert result["metadata"]["violation_type"] == "tool_call_id_reused"
    assert runs == [("a", 1)]


@pytest.mark.parametrize("earlier", ["unknown", "released"])
def test_reused_id_with_other_arguments_refused_for_every_status(any_store: Any, earlier: str) -> None:
    runs: list[Any] = []

    @guard_for(any_store)
    @reversibility("reversible")
    def look(q: str) -> str:
        runs.append(q)
        raise (TimeoutError if earlier == "unknown" else ValueError)("x")

    with ctx("re-2"), pytest.raises(TimeoutError if earlier == "unknown" else ValueError):
        look("a")
    assert any_store.get("re-2").status == earlier
    with ctx("re-2"):
        result = look("b")
    assert result["block_reason"] == "policy_violation"
    assert result["metadata"]["violation_type"] == "tool_call_id_reused"
    assert runs == ["a"]


def test_reversible_unknown_runs_again_with_next_attempt(journal: Any, db: Path) -> None:
    runs: list[Any] = []

    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        runs.append(q)
        if len(runs) == 1:
            raise TimeoutError("slow")
        return "found"

    with ctx("rv-1"), pytest.raises(TimeoutError):
        look("a")
    with ctx("rv-1"):
        assert look("a") == "found"
    assert runs == ["a", "a"]
    pendings = [e for e in db_events(db) if e["kind"] == "pending"]
    assert [e["attempt"] for e in pendings] == [1, 2]
    assert db_calls(db)["rv-1"]["attempt"] == 2
    assert db_calls(db)["rv-1"]["status"] == "committed"


def test_costly_is_not_run_again_on_doubt() -> None:
    runs: list[Any] = []

    @guard_for(InMemoryEffectStore())
    @reversibility("costly")
    def render(q: str) -> str:
        runs.append(q)
        raise TimeoutError("slow")

    with ctx("co-1"), pytest.raises(TimeoutError):
        render("a")
    with ctx("co-1"):
        assert render("a")["block_reason"] == "effect_status_unknown"
    assert runs == ["a"]


def test_reversibility_tags() -> None:
    with pytest.raises(ValueError):
        reversibility("maybe")
    with pytest.raises(ValueError):
        reversibility("")

    def tool(q: str) -> str:
        raise TimeoutError("x")

    # strictest tag wins, above or below the decorator
    for name, build in [
        ("above", lambda a: reversibility("irreversible")(a(reversibility("reversible")(tool)))),
        ("below", lambda a: a(reversibility("reversible")(reversibility("costly")(tool)))),
        ("above_only", lambda a: reversibility("costly")(a(tool))),
    ]:
        fn = build(guard_for(InMemoryEffectStore()))
        with ctx(f"tag-{name}"), pytest.raises(TimeoutError):
            fn("q")
        with ctx(f"tag-{name}"):
            assert fn("q")["block_reason"] == "effect_status_unknown", name
    # reversible above the decorator: runs again on doubt, and runs without a tool_call_id
    runs: list[Any] = []

    def look(q: str) -> str:
        runs.append(q)
        return "ok"

    fn = reversibility("reversible")(guard_for(InMemoryEffectStore())(look))
    assert fn("q") == "ok"


def test_effect_guards_without_store_do_not_share() -> None:
    runs: list[Any] = []

    def pay(account: str) -> str:
        runs.append(account)
        return "paid"

    one = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))(pay)
    two = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))(pay)
    with ctx("ns-1"):
        one("a")
    with ctx("ns-1"):
        two("a")
    with ctx("ns-1"):
        one("a")
    assert runs == ["a", "a"]


def test_outcome_recording_failure_keeps_pending(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = SQLiteJournal(str(db), busy_timeout=0.2)
    holder: list[sqlite3.Connection] = []
    runs: list[Any] = []
    try:
        @guard_for(journal)
        def pay(account: str) -> str:
            runs.append(account)
            conn = raw(db)
            conn.execute("BEGIN IMMEDIATE")
            holder.append(conn)
            return "paid"

        caplog.set_level(logging.DEBUG, logger="guard")
        with ctx("of-1"):
            assert pay("a") == "paid"
        holder[0].execute("ROLLBACK")
        holder[0].close()
        assert any(r.name == "guard" or r.name.startswith("guard.") for r in caplog.records)
        with ctx("of-1"):
            result = pay("a")
        assert is_refusal(result) and result["block_reason"] == "effect_status_unknown"
        assert result["metadata"]["status"] == "pending"
        assert runs == ["a"]
        assert db_calls(db)["of-1"]["status"] == "pending"
    finally:
        for c in holder:
            c.close()
        close(journal)


def test_store_unavailable_fails_closed(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = SQLiteJournal(str(db), busy_timeout=0.2)
    conn = raw(db)
    runs: list[Any] = []
    try:
        pay = make_pay(guard_for(journal), runs)
        caplog.set_level(logging.DEBUG, logger="guard")
        conn.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with ctx("su-1"):
            result = pay("a")
        assert time.monotonic() - started < 10
        conn.execute("ROLLBACK")
        assert is_refusal(result) and result["block_reason"] == "store_unavailable"
        assert runs == []
        assert any(r.name == "guard" or r.name.startswith("guard.") for r in caplog.records)
        assert count(db, "refused", "store_unavailable") == 0
        # once the file is free again, the call may run
        with ctx("su-1"):
            assert pay("a") == {"charged": 100, "account": "a"}
    finally:
        conn.close()
        close(journal)


def test_threads_sharing_one_journal_run_the_tool_at_most_once(journal: Any) -> None:
    runs: list[Any] = []
    lock = threading.Lock()

    @guard_for(journal)
    def pay(account: str) -> str:
        with lock:
            runs.append(account)
        time.sleep(0.1)
        return "paid"

    barrier = threading.Barrier(8)
    results: list[Any] = []

    def worker() -> None:
        barrier.wait()
        with ctx("th-1"):
            r = pay("a")
        with lock:
            results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert runs == ["a"]
    assert len(results) == 8
    for r in results:
        assert r == "paid" or (is_refusal(r) and r["block_reason"] == "effect_status_unknown"), r


PROCESS_SCRIPT = r"""
import sys, time, os
from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
db, effects = sys.argv[1], sys.argv[2]
j = SQLiteJournal(db)
@Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=j)))
def charge(account):
    with open(effects, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.05)
    return "charged"
out = []
for _ in range(5):
    with AirlockContext(metadata={"tool_call_id": "proc-1"}):
        r = charge("acct")
    out.append(r["block_reason"] if is_refusal(r) else r)
j.close()
print(",".join(out))
"""


def test_processes_sharing_one_file_run_the_tool_at_most_once(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    close(SQLiteJournal(str(db)))
    effects = tmp_path / "effects.txt"
    procs = [subprocess.Popen([PYTHON, "-c", PROCESS_SCRIPT, str(db), str(effects)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.extend(out.strip().split(","))
    assert len(effects.read_text().splitlines()) == 1
    assert set(outs) <= {"charged", "effect_status_unknown"}
    assert "database is locked" not in " ".join(outs)


def test_late_outcome_appended_with_its_attempt(journal: Any, db: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()
    calls: list[int] = []

    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        calls.append(1)
        if len(calls) == 1:
            entered.set()
            gate.wait(120)
            raise ValueError("late failure")
        return "second"

    errors: list[BaseException] = []

    def first() -> None:
        try:
            with ctx("late-1"):
                look("q")
        except ValueError as e:
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(120)
    with ctx("late-1"):
        assert look("q") == "second"
    gate.set()
    t.join(120)
    assert len(errors) == 1
    events = [e for e in db_events(db) if e["call_id"] == "late-1"]
    kinds = [(e["kind"], e["attempt"]) for e in events]
    assert ("released", 1) in kinds
    assert ("committed", 2) in kinds
    assert kinds.index(("released", 1)) > kinds.index(("committed", 2))
    call = db_calls(db)["late-1"]
    assert call["status"] == "committed" and call["attempt"] == 2
    assert report_field(journal.verify(), "ok") is True
    journal.rebuild()
    assert projected_fields(db_calls(db)) == projected_fields({"late-1": call})
    with ctx("late-1"):
        assert look("q") == "second"
    assert len(calls) == 2


UNUSUAL_VALUES = {
    "int_keys": lambda: {1: "a"},
    "big_int": lambda: 2**70,
    "set": lambda: {1, 2},
    "nan": lambda: float("nan"),
    "nested_tuple": lambda: {"a": ((1, 2), [3])},
    "naive_datetime": lambda: dt.datetime(2026, 1, 1, 12, 0, 0),
    "date": lambda: dt.date(2026, 1, 1),
}


@pytest.mark.parametrize("name", sorted(UNUSUAL_VALUES))
def test_replay_of_unusual_values_is_the_same_from_every_store(tmp_path: Path, name: str) -> None:
    outcomes = []
    for kind in ("memory", "sqlite"):
        store = InMemoryEffectStore() if kind == "memory" else SQLiteJournal(str(tmp_path / f"{name}.db"))
        runs: list[Any] = []
        try:
            @guard_for(store)
            def give(n: int) -> Any:
                runs.append(n)  # noqa: B023 - called within this iteration
                return UNUSUAL_VALUES[name]()

            with ctx("uv-1"):
                give(1)
            with ctx("uv-1"):
                replay = give(1)
            assert runs == [1]
            outcomes.append(("refusal", replay["block_reason"]) if is_refusal(replay) else ("value", repr(replay)))
        finally:
            close(store)
    assert outcomes[0] == outcomes[1]
    if outcomes[0][0] == "refusal":
        assert outcomes[0][1] == "replay_value_unavailable"


def test_reversibility_read_through_other_wrappers() -> None:
    def passthrough(fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(*a: Any, **k: Any) -> Any:
            return fn(*a, **k)

        return inner

    runs: list[Any] = []

    def look(q: str) -> str:
        runs.append(q)
        return "ok"

    airlock = guard_for(InMemoryEffectStore())
    reversible = airlock(passthrough(reversibility("reversible")(look)))
    assert reversible("q") == "ok"  # reversible: runs without a tool_call_id
    strict = airlock(reversibility("costly")(passthrough(reversibility("reversible")(look))))
    assert strict("q")["block_reason"] == "tool_call_id_required"
    with pytest.raises(ValueError):
        reversibility("Reversible")


def test_outcome_recording_failure_after_an_exception(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = SQLiteJournal(str(db), busy_timeout=0.2)
    holder: list[sqlite3.Connection] = []
    runs: list[Any] = []
    try:
        @guard_for(journal)
        def pay(account: str) -> str:
            runs.append(account)
            conn = raw(db)
            conn.execute("BEGIN IMMEDIATE")
            holder.append(conn)
            raise ValueError("declined")

        caplog.set_level(logging.DEBUG, logger="guard")
        with ctx("of-2"), pytest.raises(ValueError):
            pay("a")
        holder[0].execute("ROLLBACK")
        with ctx("of-2"):
            result = pay("a")
        assert is_refusal(result) and result["block_reason"] == "effect_status_unknown"
        assert runs == ["a"]
    finally:
        for c in holder:
            c.close()
        close(journal)


@pytest.mark.parametrize("kind", STORES)
def test_async_tasks_with_one_id_run_the_tool_at_most_once(tmp_path: Path, kind: str) -> None:
    store = InMemoryEffectStore() if kind == "memory" else SQLiteJournal(str(tmp_path / "a.db"))
    runs: list[Any] = []
    try:
        @guard_for(store)
        async def charge(account: str) -> str:
            runs.append(account)
            await asyncio.sleep(0.05)
            return "charged"

        async def one() -> Any:
            async with ctx("at-1"):
                return await charge("a")

        async def go() -> list[Any]:
            return await asyncio.gather(*(one() for _ in range(10)))

        results = asyncio.run(go())
    finally:
        close(store)
    assert runs == ["a"]
    for r in results:
        assert r == "charged" or r["block_reason"] == "effect_status_unknown"


def test_in_memory_store_threads_run_the_tool_at_most_once() -> None:
    runs: list[Any] = []
    lock = threading.Lock()

    @guard_for(InMemoryEffectStore())
    def pay(account: str) -> str:
        with lock:
            runs.append(account)
        time.sleep(0.05)
        return "paid"

    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        with ctx("mt-1"):
            pay("a")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert runs == ["a"]


def test_pending_is_recorded_before_the_tool_runs(tmp_path: Path) -> None:
    for durability in ("full", "process"):
        path = tmp_path / f"{durability}.db"
        journal = SQLiteJournal(str(path), durability=durability)
        seen: list[Any] = []
        try:
            @guard_for(journal)
            def pay(account: str) -> str:
                calls = db_calls(path)  # noqa: B023 - called within this iteration
                seen.append((calls["pb-1"]["status"], [e["kind"] for e in db_events(path)]))  # noqa: B023
                return "ok"

            with ctx("pb-1"):
                pay("a")
        finally:
            close(journal)
        assert seen == [("pending", ["pending"])], durability


def test_unencodable_value_is_recorded_committed_without_value(journal: Any, db: Path) -> None:
    @guard_for(journal)
    def mint(n: int) -> Any:
        return {1, 2, 3}

    with ctx("uv-2"):
        assert mint(1) == {1, 2, 3}
    assert db_calls(db)["uv-2"]["status"] == "committed"
    committed = [e for e in db_events(db) if e["kind"] == "committed"]
    assert len(committed) == 1 and committed[0]["value"] is None


@pytest.mark.parametrize(
    ("exc", "status"),
    [(ConnectionRefusedError, "released"), (ConnectionError, "released"), (OSError, "released"),
     (type("SlowError", (TimeoutError,), {}), "unknown")],
)
def test_only_the_listed_errors_are_ambiguous(journal: Any, db: Path, exc: type[BaseException], status: str) -> None:
    @guard_for(journal)
    def pay(account: str) -> str:
        raise exc("x")

    with ctx("am-1"), pytest.raises(exc):
        pay("a")
    assert db_calls(db)["am-1"]["status"] == status


def test_empty_ambiguous_errors_makes_timeouts_released(journal: Any, db: Path) -> None:
    runs: list[Any] = []

    @guard_for(journal, eg={"ambiguous_errors": ()})
    def pay(account: str) -> str:
        runs.append(account)
        raise TimeoutError("x")

    with ctx("am-2"), pytest.raises(TimeoutError):
        pay("a")
    assert db_calls(db)["am-2"]["status"] == "released"
    with ctx("am-2"), pytest.raises(TimeoutError):
        pay("a")
    assert runs == ["a", "a"]


def test_committed_reversible_call_is_replayed_not_run(any_store: Any) -> None:
    runs: list[Any] = []

    @guard_for(any_store)
    @reversibility("reversible")
    def look(q: str) -> dict[str, Any]:
        runs.append(q)
        return {"hits": (len(runs),)}

    with ctx("cr-2"):
        assert look("q") == {"hits": (1,)}
    with ctx("cr-2"):
        assert look("q") == {"hits": [1]}
    assert runs == ["q"]


def test_in_flight_call_with_other_arguments_is_a_reuse(journal: Any, db: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()
    runs: list[Any] = []

    @guard_for(journal)
    def pay(account: str) -> str:
        runs.append(account)
        entered.set()
        gate.wait(120)
        return "paid"

    t = threading.Thread(target=lambda: (ctx("fl-1").__enter__(), pay("a")))
    t.start()
    try:
        assert entered.wait(120)
        with ctx("fl-1"):
            other = pay("b")
        with ctx("fl-1"):
            same = pay("a")
    finally:
        gate.set()
        t.join(120)
    assert other["block_reason"] == "policy_violation"
    assert other["metadata"]["violation_type"] == "tool_call_id_reused"
    assert same["block_reason"] == "effect_status_unknown" and same["metadata"]["status"] == "pending"
    assert runs == ["a"]


@pytest.mark.parametrize("value", [0, False, [], {}, "0", " "])
def test_target_args_any_value_but_none_and_empty_string_counts(value: Any) -> None:
    runs: list[Any] = []

    @guard_for(InMemoryEffectStore(), eg={"target_args": ("account",)})
    def pay(account: Any) -> str:
        runs.append(account)
        return "paid"

    with ctx(f"tv-{value!r}"):
        assert pay(value) == "paid"
    assert runs == [value]


OUTCOMES = ["value", "unencodable", "ambiguous", "error", "deferred"]


call_steps = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["t_irr", "t_rev"]), st.sampled_from([1, 2]),
              st.sampled_from(OUTCOMES)),
    min_size=1, max_size=12,
)


class _Unencodable:
    pass


def _run_model(store: Any, steps: list[Any], path: Path | None) -> None:
    airlock = guard_for(store)
    ran: list[Any] = []
    plan: dict[str, str] = {}

    def body(name: str, n: int) -> Any:
        ran.append((name, n))
        outcome = plan["next"]
        if outcome == "value":
            return {"n": n, "t": (n,)}
        if outcome == "unencodable":
            return _Unencodable()
        if outcome == "ambiguous":
            raise TimeoutError("lost")
        if outcome == "error":
            raise ValueError("no")
        return iter([n])

    def t_irr(n: int) -> Any:
        return body("t_irr", n)

    def t_rev(n: int) -> Any:
        return body("t_rev", n)

    tools = {"t_irr": airlock(t_irr), "t_rev": airlock(reversibility("reversible")(t_rev))}
    model: dict[str, dict[str, Any]] = {}
    expected_kinds = {"pending": 0, "refused": 0, "replayed": 0}
    for call_id, tool, n, outcome in steps:
        plan["next"] = outcome
        rec = model.get(call_id)
        runs_before = len(ran)
        raised: BaseException | None = None
        with ctx(call_id):
            try:
                result = tools[tool](n)
            except (TimeoutError, ValueError) as e:
                raised, result = e, None
        if rec is not None and (rec["tool"] != tool or rec["n"] != n):
            assert is_refusal(result) and result["block_reason"] == "policy_violation", (call_id, result)
            assert len(ran) == runs_before
            expected_kinds["refused"] += 1
            continue
        if rec is not None and rec["status"] == "committed":
            assert len(ran) == runs_before
            expected_kinds["replayed" if rec["has_value"] else "refused"] += 1
            if rec["has_value"]:
                assert result == {"n": n, "t": [n]}
            else:
                assert is_refusal(result) and result["block_reason"] == "replay_value_unavailable"
            continue
        if rec is not None and rec["status"] == "unknown" and tool == "t_irr":
            assert is_refusal(result) and result["block_reason"] == "effect_status_unknown"
            assert len(ran) == runs_before
            expected_kinds["refused"] += 1
            continue
        # runs: a first attempt, a released call, or a reversible one in doubt
        assert len(ran) == runs_before + 1, (call_id, tool, rec, result)
        expected_kinds["pending"] += 1
        attempt = 1 if rec is None else rec["attempt"] + 1
        status = {"value": "committed", "unencodable": "committed", "ambiguous": "unknown", "error": "released",
                  "deferred": "unknown"}[outcome]
        if outcome == "value":
            assert result == {"n": n, "t": (n,)}
        elif outcome in ("ambiguous", "error"):
            assert raised is not None
        elif outcome == "unencodable":
            assert isinstance(result, _Unencodable)
        else:
            assert list(result) == [n]
        model[call_id] = {"tool": tool, "n": n, "status": status, "attempt": attempt,
                          "has_value": outcome == "value"}
    if path is not None:
        events = db_events(path)
        counted = {k: sum(1 for e in events if e["kind"] == k) for k in expected_kinds}
        assert counted == expected_kinds
        calls = db_calls(path)
        assert {c: (r["status"], r["attempt"], r["tool"]) for c, r in calls.items()} == {
            c: (m["status"], m["attempt"], m["tool"]) for c, m in model.items()}
        assert report_field(store_verify(path), "ok") is True


def store_verify(path: Path) -> Any:
    j = SQLiteJournal(str(path))
    try:
        return j.verify()
    finally:
        close(j)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(steps=call_steps)
def test_the_effect_table_as_a_model(tmp_path_factory: pytest.TempPathFactory, steps: list[Any]) -> None:
    path = tmp_path_factory.mktemp("model") / "m.db"
    for kind in STORES:
        store = InMemoryEffectStore() if kind == "memory" else SQLiteJournal(str(path), durability="process")
        try:
            _run_model(store, steps, path if kind == "sqlite" else None)
        finally:
            close(store)


def test_a_tool_returning_none_replays_none(any_store: Any) -> None:
    runs: list[Any] = []

    @guard_for(any_store)
    def notify(x: int) -> None:
        runs.append(x)

    with ctx("none-1"):
        assert notify(1) is None
    with ctx("none-1"):
        assert notify(1) is None
    assert runs == [1]


def test_effect_status_unknown_since_is_when_the_call_entered_that_status(journal: Any, db: Path) -> None:
    @guard_for(journal)
    def pay(account: str) -> str:
        raise TimeoutError("lost")

    with ctx("si-1"), pytest.raises(TimeoutError):
        pay("a")
    time.sleep(0.01)
    with ctx("si-1"):
        result = pay("a")
    unknown_at = next(e["at"] for e in export_lines(db) if e["kind"] == "unknown")
    since = result["metadata"]["since"]
    since_dt = since if isinstance(since, dt.datetime) else dt.datetime.fromisoformat(str(since).replace("Z", "+00:00"))
    assert since_dt == dt.datetime.fromisoformat(unknown_at.replace("Z", "+00:00"))


def test_a_late_outcome_of_an_older_attempt_leaves_the_current_one(journal: Any, db: Path) -> None:
    gates = [threading.Event(), threading.Event()]
    entered = [threading.Event(), threading.Event()]
    count_lock = threading.Lock()
    attempts: list[int] = []

    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        with count_lock:
            attempts.append(len(attempts))
            mine = attempts[-1]
        entered[mine].set()
        gates[mine].wait(120)
        if mine == 0:
            return "old"
        raise ValueError("new attempt failed")

    def run() -> None:
        with ctx("lo-1"), contextlib.suppress(ValueError):
            look("q")

    t1 = threading.Thread(target=run)
    t1.start()
    assert entered[0].wait(120)
    t2 = threading.Thread(target=run)
    t2.start()
    try:
        assert entered[1].wait(120)
        gates[0].set()
        t1.join(120)
        call = db_calls(db)["lo-1"]
        assert (call["status"], call["attempt"]) == ("pending", 2)
        old = [e for e in db_events(db) if e["kind"] == "committed"]
        assert len(old) == 1 and old[0]["attempt"] == 1
    finally:
        gates[0].set()
        gates[1].set()
        t1.join(120)
        t2.join(120)
    call = db_calls(db)["lo-1"]
    assert (call["status"], call["attempt"]) == ("released", 2)
    assert report_field(journal.verify(), "ok") is True
    before = projected_fields(db_calls(db))
    journal.rebuild()
    assert projected_fields(db_calls(db)) == before
