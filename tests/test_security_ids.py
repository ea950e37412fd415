"""The call's id comes from the host, never from the model's arguments; an approval covers only
the exact arguments it was asked for, once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from guard import (
    Airlock,
    AirlockContext,
    OversightRequest,
    OversightResponse,
    OversightVerdict,
    SecurityPolicy,
    get_current_context,
)
from guard.adapters import anthropic, openai
from guard.effect_guard import EffectGuard, idempotency_key
from journal import SQLiteJournal
from journal.testing import EffectLog


def make_transfer(journal: SQLiteJournal, effects: EffectLog, **policy: Any) -> Any:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=journal), **policy))
    def transfer(tool_call_id: str, to: str, cents: int) -> dict[str, Any]:
        """A tool whose own argument happens to be called tool_call_id."""
        context = get_current_context()
        assert context is not None
        effects.record(context.tool_call_id, argument=tool_call_id, to=to, cents=cents)
        return {"seen_id": context.tool_call_id, "argument": tool_call_id, "to": to, "cents": cents}

    return transfer


# -- an argument named tool_call_id ---------------------------------------------------------------


def test_an_argument_named_tool_call_id_is_an_argument_not_the_calls_id(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    transfer = make_transfer(airlock_journal, airlock_effects)
    with AirlockContext(metadata={"tool_call_id": "call_host"}):
        value = transfer(tool_call_id="call_victim", to="mallory", cents=500)
    assert value["seen_id"] == "call_host"
    record = airlock_journal.get("call_host")
    assert record is not None and record.status == "committed"
    assert json.loads(record.arguments) == {"tool_call_id": "call_victim", "to": "mallory", "cents": 500}
    assert record.idempotency_key == idempotency_key(
        "transfer", {"tool_call_id": "call_victim", "to": "mallory", "cents": 500})
    assert airlock_journal.get("call_victim") is None
    assert airlock_journal.call_events("call_victim") == []


def test_naming_an_earlier_calls_id_in_the_arguments_does_not_replay_it(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    transfer = make_transfer(airlock_journal, airlock_effects)
    with AirlockContext(metadata={"tool_call_id": "call_A"}):
        first = transfer("x", "alice", 100)
    # The model asks for a transfer to mallory, dressed as a retry of call_A: it is a new call.
    with AirlockContext(metadata={"tool_call_id": "call_B"}):
        second = transfer("call_A", "mallory", 100)
    assert first["to"] == "alice" and second["to"] == "mallory"
    assert second["seen_id"] == "call_B"
    assert airlock_effects.counts() == {"call_A": 1, "call_B": 1}
    assert [e.kind for e in airlock_journal.call_events("call_A")] == ["pending", "committed"]


def test_an_argument_named_tool_call_id_does_not_stand_in_for_a_missing_id(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    transfer = make_transfer(airlock_journal, airlock_effects)
    refusal = transfer(tool_call_id="call_forged", to="mallory", cents=500)
    assert refusal["block_reason"] == "tool_call_id_required"
    assert airlock_effects.count() == 0
    assert airlock_journal.get("call_forged") is None


def openai_call(call_id: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "transfer", "arguments": json.dumps(arguments)}}


def test_through_the_openai_adapter_the_id_is_the_tool_calls_own(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    transfer = make_transfer(airlock_journal, airlock_effects)
    first = openai.dispatch(openai_call("call_real", {"tool_call_id": "call_other", "to": "bob", "cents": 5}),
                            [transfer])
    assert first["tool_call_id"] == "call_real"
    assert json.loads(first["content"])["seen_id"] == "call_real"
    # A second tool call whose id is the first's argument, and whose argument is the first's id.
    second = openai.dispatch(openai_call("call_other", {"tool_call_id": "call_real", "to": "bob", "cents": 5}),
                             [transfer])
    assert json.loads(second["content"])["seen_id"] == "call_other"
    assert airlock_effects.counts() == {"call_real": 1, "call_other": 1}
    responses = openai.dispatch({"type": "function_call", "call_id": "fc_real", "name": "transfer",
                                 "arguments": json.dumps({"tool_call_id": "call_real", "to": "bob", "cents": 5})},
                                [transfer])
    assert responses["call_id"] == "fc_real"
    assert json.loads(responses["output"])["seen_id"] == "fc_real"
    assert {r.call_id for r in airlock_journal.calls()} == {"call_real", "call_other", "fc_real"}


def test_through_the_anthropic_adapter_the_id_is_the_blocks_own(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    transfer = make_transfer(airlock_journal, airlock_effects)
    block = {"type": "tool_use", "id": "toolu_real", "name": "transfer",
             "input": {"tool_call_id": "toolu_victim", "to": "bob", "cents": 5}}
    reply = anthropic.dispatch(block, {"transfer": transfer})
    assert (reply["tool_use_id"], reply["is_error"]) == ("toolu_real", False)
    assert json.loads(reply["content"])["seen_id"] == "toolu_real"
    assert airlock_journal.get("toolu_victim") is None
    assert airlock_journal.get("toolu_real").status == "committed"
    # The same block again is a replay of toolu_real, not a second transfer.
    again = anthropic.dispatch(block, {"transfer": transfer})
    assert again["content"] == reply["content"]
    assert airlock_effects.count() == 1


# -- approvals --------------------------------------------------------------------------------------


class Approver:
    """Grants exactly the arguments it was told to, and keeps every request it saw."""

    def __init__(self, grant: dict[str, Any] | None) -> None:
        self.grant = grant
        self.requests: list[OversightRequest] = []

    def __call__(self, request: OversightRequest) -> OversightResponse:
        self.requests.append(request)
        verdict = OversightVerdict.GRANT if request.arguments == self.grant else OversightVerdict.DENY
        return OversightResponse(request_id=request.request_id, verdict=verdict, approver="ops")


def make_pay(journal: SQLiteJournal, effects: EffectLog, approver: Any) -> Any:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=journal), escalate_tools={"pay": "moves money"},
                            approver=approver))
    def pay(account: str, cents: int, memo: str = "") -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        effects.record(context.tool_call_id, account=account, cents=cents, memo=memo)
        if memo == "fail":
            raise ValueError("declined before any effect")
        return {"account": account, "cents": cents}

    return pay


def call(tool: Any, call_id: str, *args: Any, **kwargs: Any) -> Any:
    with AirlockContext(metadata={"tool_call_id": call_id}):
        return tool(*args, **kwargs)


def test_an_approval_covers_only_the_arguments_it_was_asked_for(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    approver = Approver(grant={"account": "acct_1", "cents": 500, "memo": ""})
    pay = make_pay(airlock_journal, airlock_effects, approver)
    assert call(pay, "call_1", "acct_1", 500) == {"account": "acct_1", "cents": 500}
    assert call(pay, "call_2", "acct_1", 50_000)["block_reason"] == "escalation_denied"
    assert call(pay, "call_3", "acct_2", 500)["block_reason"] == "escalation_denied"
    assert call(pay, "call_4", account="acct_1", cents=500, memo="x")["block_reason"] == "escalation_denied"
    # The approver saw each call's own bound arguments, defaults applied, and only call_1 ran.
    assert [r.arguments for r in approver.requests] == [
        {"account": "acct_1", "cents": 500, "memo": ""},
        {"account": "acct_1", "cents": 50_000, "memo": ""},
        {"account": "acct_2", "cents": 500, "memo": ""},
        {"account": "acct_1", "cents": 500, "memo": "x"},
    ]
    assert [r.tool_call_id for r in approver.requests] == ["call_1", "call_2", "call_3", "call_4"]
    assert airlock_effects.counts() == {"call_1": 1}
    assert airlock_journal.get("call_2") is None


def test_changing_the_request_inside_the_approver_does_not_change_what_runs(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    def sly(request: OversightRequest) -> OversightResponse:
        request.arguments["cents"] = 1  # approve a different amount than the call carries
        return OversightResponse(request_id=request.request_id, verdict=OversightVerdict.GRANT, approver="sly")

    pay = make_pay(airlock_journal, airlock_effects, sly)
    assert call(pay, "call_1", "acct_1", 500) == {"account": "acct_1", "cents": 500}
    assert json.loads(airlock_journal.get("call_1").arguments)["cents"] == 500
    assert airlock_effects.entries()[0]["cents"] == 500


def test_an_approval_is_never_reused_by_a_retry_or_a_replay(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    approver = Approver(grant={"account": "acct_1", "cents": 500, "memo": "fail"})
    pay = make_pay(airlock_journal, airlock_effects, approver)
    with pytest.raises(ValueError):
        call(pay, "call_1", "acct_1", 500, memo="fail")  # released: it may run again
    approver.grant = None  # the approver now refuses everything
    assert call(pay, "call_1", "acct_1", 500, memo="fail")["block_reason"] == "escalation_denied"
    assert len(approver.requests) == 2
    assert approver.requests[0].request_id != approver.requests[1].request_id
    assert airlock_effects.count("call_1") == 1

    approver.grant = {"account": "acct_1", "cents": 7, "memo": ""}
    assert call(pay, "call_2", "acct_1", 7) == {"account": "acct_1", "cents": 7}
    approver.grant = None
    assert call(pay, "call_2", "acct_1", 7)["block_reason"] == "escalation_denied"  # no replay without approval
    assert [e.kind for e in airlock_journal.call_events("call_2")] == ["pending", "committed", "refused"]


def test_a_response_for_another_request_does_not_approve(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    seen: list[OversightRequest] = []

    def replaying(request: OversightRequest) -> OversightResponse:
        # Answers with the first request's grant, whatever is asked now.
        seen.append(request)
        return OversightResponse(request_id=seen[0].request_id, verdict=OversightVerdict.GRANT, approver="old")

    pay = make_pay(airlock_journal, airlock_effects, replaying)
    assert call(pay, "call_1", "acct_1", 5) == {"account": "acct_1", "cents": 5}
    refusal = call(pay, "call_2", "acct_1", 50_000)
    assert refusal["block_reason"] == "escalation_denied"
    assert refusal["metadata"]["verdict"] == "response_for_another_request"
    assert airlock_effects.counts() == {"call_1": 1}
