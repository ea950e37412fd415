"""An escalated call: the request its approver is asked, the answer checked, and the decision of a
durable approval queue (:class:`~guard.approvals.ApprovalQueue`), taken in the store's own step."""

from __future__ import annotations

import logging
import uuid
from typing import Any, cast

import orjson

from . import telemetry
from .approvals import ApprovalQueue, ApprovalRequest, Waiting, guarded_step, wait_for_decision
from .call import GuardedCall
from .effect_guard import EffectGuard, decide_attempt
from .outcomes import message_of
from .oversight import OversightRequest, OversightResponse, OversightVerdict
from .refusal import Refusal
from .store import CallRecord, Decision, EffectEvent, utc_now

__all__ = ["approval_failed", "approval_request", "check_approval", "queued_decision"]

log = logging.getLogger("guard")


def approval_request(call: GuardedCall) -> OversightRequest:
    """The request the approver of ``call`` is asked, kept on the call to check its answer against."""
    assert call.arguments is not None and call.key is not None and call.escalation is not None
    call.request = OversightRequest(
        request_id=uuid.uuid4().hex,
        tool_name=call.tool.name,
        arguments=orjson.loads(call.arguments),
        reason=call.escalation,
        tool_call_id=call.tool_call_id,
        idempotency_key=call.key,
        agent_id=call.agent_id,
        requested_at=utc_now(),
    )
    return call.request


def approval_failed(call: GuardedCall, e: Exception) -> Refusal:
    """The refusal of a call whose approver raised ``e``."""
    log.warning("approver raised for %s (tool_call_id=%s): %r", call.tool.name, call.tool_call_id, e)
    return call.refuse(
        "escalation_denied",
        f"The approver failed on this call to {call.tool.name!r} ({type(e).__name__}), so it was not "
        "approved; it was not run.",
        verdict="error",
    )


def check_approval(call: GuardedCall, response: object) -> Refusal | None:
    """None when ``response`` grants the request of ``call`` (the grant is kept, for its
    ``pending``); else the refusal, which says why."""
    request = call.request
    assert request is not None
    if (
        isinstance(response, OversightResponse)
        and response.request_id == request.request_id
        and response.verdict is OversightVerdict.GRANT
    ):
        approver: object = response.approver
        if approver is None or (isinstance(approver, str) and not approver):
            approver = "an approver"
        # Journaled on the pending event: as every store can keep it (a lone surrogate escaped).
        who = message_of(approver)
        call.approval = {"code": "approved", "message": f"approved by {who} (request {request.request_id})"}
        return None
    if not isinstance(response, OversightResponse):
        verdict = "invalid_response"
    elif response.request_id != request.request_id:
        verdict = "response_for_another_request"
    elif not isinstance(response.verdict, OversightVerdict):
        verdict = "invalid_verdict"  # "grant" as a bare string is not a grant
    else:
        verdict = str(response.verdict)
    return call.refuse(
        "escalation_denied",
        f"The approver did not grant this call to {call.tool.name!r} ({verdict}); it was not run.",
        verdict=verdict,
        request_id=request.request_id,
    )


def queued_decision(call: GuardedCall, eg: EffectGuard, call_id: str, queue: ApprovalQueue) -> Decision:
    """The decision of an escalated call whose approver is a durable queue: one atomic step of
    the store that asks, refuses, or consumes a grant with the call's ``pending``; with the
    queue's ``wait``, a wait for the decision between two such steps."""
    store = eg.approvals
    if store is None:
        raise TypeError(f"{type(eg.store).__name__} keeps no approvals: an ApprovalQueue needs a store that does")
    assert call.key is not None and call.arguments is not None and call.escalation is not None
    tool, key, arguments, escalation = call.tool, call.key, call.arguments, call.escalation
    leasing = eg.leasing
    # Taken before the step, which takes none and names it on the pending it records.
    holder = None if leasing is None else leasing.take_now(call_id)
    made: list[EffectEvent] = []

    def decide(record: CallRecord | None, approval: dict[str, str] | None) -> Decision:
        decision = decide_attempt(record, call_id, tool.recorded_name, key, arguments, call.recorded_agent,
                                  tool.reversible, approval)
        if holder is not None and decision.event.kind == "pending":
            decision.event.owner = {**decision.event.owner, "lease": holder}
        return decision

    def run(waiting: bool) -> Any:
        chosen = guarded_step(queue, call_id, tool.recorded_name, key, arguments, call.recorded_agent,
                              tool.reversible, escalation, waiting, decide)

        def step(record: CallRecord | None, request: ApprovalRequest | None) -> tuple[list[EffectEvent], Any]:
            events, result = chosen(record, request)
            made[:] = events
            return events, result

        try:
            return store.approval_step(call_id, step)
        finally:
            if eg.on_event is not None:
                for event in made:
                    telemetry.deliver(eg.on_event, event)
            made.clear()

    try:
        result = run(queue.wait > 0)
        if isinstance(result, Waiting):
            wait_for_decision(store, call_id, result.request.request_id, queue.wait, queue)
            result = run(False)
    except BaseException:
        if leasing is not None and holder is not None:
            leasing.let_go(call_id, holder)
        raise
    decision = cast(Decision, result)
    if leasing is not None and holder is not None:
        if decision.event.kind == "pending":
            call.holder = holder  # renewed while the tool runs, dropped with its outcome
        else:
            leasing.let_go(call_id, holder)
    return decision
