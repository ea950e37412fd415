"""Approvals that wait for a human: a durable, single-use, argument-bound decision on the log.

``ApprovalQueue(ttl=..., wait=..., quorum=...)`` is an approver that keeps its requests in the
effect guard's store. A call that needs approval and has none appends ``approval_requested`` and
is refused ``approval_pending`` (or, with ``wait``, waits for the decision first). Operators append
``approved`` / ``denied`` (compare-and-set on the open request); a request left undecided past its
``expires_at`` is ``expired`` (deny by default). The next attempt with the same tool and arguments
after a grant consumes it (``approval_consumed``) in the same transaction that records its
``pending`` (or its ``replayed``): a grant never lets two attempts through.

Everything here is written once for every store, on one primitive a store provides
(:class:`ApprovalStore`): in one atomic step, read a call's record and its latest request, let a
function choose the events to append, and append them.
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from .oversight import OversightRequest, OversightResponse
from .store import GUARD_ACTOR, CallRecord, EffectEvent, current_owner, format_at, parse_at, utc_now

__all__ = [
    "APPROVAL_KINDS",
    "ApprovalQueue",
    "ApprovalRequest",
    "ApprovalStatus",
    "ApprovalStore",
    "ApprovalWaiter",
    "NotDecidable",
    "Waiting",
    "ApprovalStep",
    "apply_approval",
    "approval_event",
    "decide_request",
    "expire_overdue",
    "fold_approvals",
    "guarded_step",
    "wait_for_decision",
]

ApprovalStatus = Literal["open", "approved", "denied", "expired", "consumed"]
STATUSES: tuple[ApprovalStatus, ...] = ("open", "approved", "denied", "expired", "consumed")
# The events of approvals, on the same chain as the calls' events; none changes a call's record.
APPROVAL_KINDS = ("approval_requested", "approved", "denied", "expired", "approval_consumed")

T = TypeVar("T")


def arguments_sha256(arguments: str | None) -> str | None:
    """The sha256 hex of canonical arguments text (what a grant is bound to)."""
    return None if arguments is None else hashlib.sha256(arguments.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """One request for approval, as the fold of its events makes it (a row of the store's
    projection of requests).

    ``attempt`` is the call's attempt when the request was made (0: the call never ran);
    ``replay``: the call had already taken effect, so a grant only lets a replay through.
    ``approvers``: the distinct operators who approved so far; ``decided_by`` and
    ``decision_reason``: who denied it (or the last approver) and why. ``answered``: a retry was
    told of its expiry (the next one makes a new request).
    """

    request_id: str
    call_id: str
    tool: str
    agent_id: str | None
    idempotency_key: str | None
    arguments: str | None
    arguments_sha256: str | None
    reason: str
    requested_at: datetime
    expires_at: datetime
    quorum: int
    replay: bool
    attempt: int
    status: ApprovalStatus = "open"
    approvers: tuple[str, ...] = ()
    decided_by: str | None = None
    decision_reason: str | None = None
    decided_at: datetime | None = None
    consumed_attempt: int | None = None
    answered: bool = False
    first_seq: int = 0
    last_seq: int = 0

    def overdue(self, now: datetime) -> bool:
        """Whether the request is open past its ``expires_at``."""
        return self.status == "open" and now >= self.expires_at

    def to_json(self) -> dict[str, Any]:
        """The request as a JSON object (times in the journal's ISO-8601 form)."""
        return {
            "request_id": self.request_id, "call_id": self.call_id, "tool": self.tool, "agent_id": self.agent_id,
            "idempotency_key": self.idempotency_key, "arguments": self.arguments,
            "arguments_sha256": self.arguments_sha256, "reason": self.reason,
            "requested_at": format_at(self.requested_at), "expires_at": format_at(self.expires_at),
            "quorum": self.quorum, "replay": self.replay, "attempt": self.attempt, "status": self.status,
            "approvers": list(self.approvers), "decided_by": self.decided_by,
            "decision_reason": self.decision_reason,
            "decided_at": None if self.decided_at is None else format_at(self.decided_at),
            "consumed_attempt": self.consumed_attempt, "answered": self.answered,
            "first_seq": self.first_seq, "last_seq": self.last_seq,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ApprovalRequest:
        """The inverse of :meth:`to_json`."""
        decided = obj.get("decided_at")
        return cls(
            obj["request_id"], obj["call_id"], obj["tool"], obj.get("agent_id"), obj.get("idempotency_key"),
            obj.get("arguments"), obj.get("arguments_sha256"), obj.get("reason", ""),
            parse_at(obj["requested_at"]), parse_at(obj["expires_at"]), int(obj["quorum"]), bool(obj["replay"]),
            int(obj.get("attempt", 0)), obj["status"], tuple(obj.get("approvers", ())), obj.get("decided_by"),
            obj.get("decision_reason"), None if decided is None else parse_at(decided),
            obj.get("consumed_attempt"), bool(obj.get("answered", False)), int(obj.get("first_seq", 0)),
            int(obj.get("last_seq", 0)),
        )


def _request_id_of(event: EffectEvent) -> str | None:
    reason = event.reason
    if not reason:
        return None
    rid = reason.get("request_id")
    return rid if isinstance(rid, str) else None


def apply_approval(request: ApprovalRequest | None, event: EffectEvent, seq: int = 0) -> ApprovalRequest | None:
    """Fold one event into the request it names: the projection of requests is the fold of the log.

    ``approval_requested`` starts a request; ``approved`` adds its operator (distinct ones count
    once) and grants it at its quorum; ``denied``, ``expired`` and ``approval_consumed`` end it; a
    ``refused`` that names the expired request marks it answered. A decision on a request that is
    not open, or that names another request, changes nothing.
    """
    kind = event.kind
    rid = _request_id_of(event)
    if kind == "approval_requested":
        reason = event.reason or {}
        if rid is None or event.call_id is None:
            return request
        return ApprovalRequest(
            rid, event.call_id, event.tool, event.agent_id, event.idempotency_key, event.arguments,
            arguments_sha256(event.arguments), str(reason.get("message", "")), event.at,
            parse_at(str(reason.get("expires_at"))), int(reason.get("quorum", 1)), bool(reason.get("replay", False)),
            event.attempt, first_seq=seq, last_seq=seq,
        )
    if request is None or rid != request.request_id:
        return request
    message = str((event.reason or {}).get("message", "")) or None
    if kind == "approved" and request.status == "open":
        approvers = request.approvers if event.actor in request.approvers else (*request.approvers, event.actor)
        granted = len(approvers) >= request.quorum
        return replace(request, approvers=approvers, status="approved" if granted else "open",
                       decided_by=event.actor, decision_reason=message,
                       decided_at=event.at if granted else request.decided_at, last_seq=seq)
    if kind == "denied" and request.status == "open":
        return replace(request, status="denied", decided_by=event.actor, decision_reason=message,
                       decided_at=event.at, last_seq=seq)
    if kind == "expired" and request.status == "open":
        return replace(request, status="expired", decided_at=event.at, last_seq=seq)
    if kind == "approval_consumed" and request.status == "approved":
        return replace(request, status="consumed", consumed_attempt=event.attempt, last_seq=seq)
    if kind == "refused" and request.status == "expired" and not request.answered:
        return replace(request, answered=True, last_seq=seq)
    return request


def approval_event(event: EffectEvent) -> bool:
    """Whether ``event`` may change a request: an approval's own kinds, and a refusal naming one."""
    return event.kind in APPROVAL_KINDS or (event.kind == "refused" and _request_id_of(event) is not None)


def fold_approvals(events: Sequence[tuple[int, EffectEvent]]) -> dict[str, ApprovalRequest]:
    """Every request of ``events`` (``(seq, event)`` in seq order), by request id."""
    latest: dict[str, str] = {}  # call id -> its latest request's id
    requests: dict[str, ApprovalRequest] = {}
    for seq, event in events:
        if event.call_id is None:
            continue
        if event.kind == "approval_requested":
            folded = apply_approval(None, event, seq)
            if folded is not None:
                requests[folded.request_id] = folded
                latest[event.call_id] = folded.request_id
            continue
        rid = _request_id_of(event)
        if rid is not None and rid in requests:
            changed = apply_approval(requests[rid], event, seq)
            if changed is not None:
                requests[rid] = changed
    return requests


# -- the store's side --------------------------------------------------------------------------

# Chooses, from a call's record and its latest request, the events to append (in order) and what
# the step returns.
ApprovalStep = Callable[[CallRecord | None, ApprovalRequest | None], tuple[list[EffectEvent], T]]


@runtime_checkable
class ApprovalStore(Protocol):
    """What a store that keeps approvals provides beside :class:`~guard.store.EffectStore`.

    - ``approval_step``: in one atomic step (no other ``begin`` or step of the call can interleave),
      read the call's record and its latest request, call ``step`` with them, and append the events
      it returns, in order, each folded into the calls and the requests; returns what ``step``
      returned. What ``step`` raises is raised, and nothing is appended. The append is durable
      before it returns, as ``begin``'s ``pending`` is.
    - ``approval_requests``: the requests, newest first, filtered by call, request id, status or
      tool; ``limit`` None for all.
    """

    def approval_step(self, call_id: str, step: ApprovalStep[T]) -> T: ...

    def approval_requests(
        self, *, call_id: str | None = None, request_id: str | None = None, status: str | None = None,
        tool: str | None = None, limit: int | None = None, offset: int = 0,
    ) -> list[ApprovalRequest]: ...


@runtime_checkable
class ApprovalWaiter(Protocol):
    """A store that can wake a waiting call as soon as its request is decided (PostgreSQL's
    ``LISTEN``): ``wait_for_decision`` returns when the request may have changed, or after
    ``seconds``."""

    def wait_for_decision(self, call_id: str, seconds: float) -> None: ...


# -- the events --------------------------------------------------------------------------------

def request_event(call_id: str, tool: str, agent_id: str | None, key: str, arguments: str, reason: str,
                  ttl: float, quorum: int, record: CallRecord | None) -> EffectEvent:
    now = utc_now()
    replay = record is not None and record.status == "committed"
    return EffectEvent(
        "approval_requested", call_id, tool, now, agent_id, key, arguments, None, None,
        {"code": "approval_requested", "message": reason, "request_id": uuid.uuid4().hex,
         "expires_at": format_at(now + timedelta(seconds=ttl)), "quorum": quorum, "replay": replay},
        GUARD_ACTOR, 0 if record is None else record.attempt, current_owner(),
    )


def _follow_up(kind: str, request: ApprovalRequest, actor: str, message: str, attempt: int | None = None,
               **extra: Any) -> EffectEvent:
    return EffectEvent(
        kind, request.call_id, request.tool, utc_now(), request.agent_id, request.idempotency_key, None, None,
        None, {"code": kind, "message": message, "request_id": request.request_id, **extra}, actor,
        request.attempt if attempt is None else attempt, current_owner(),
    )


class NotDecidable(Exception):
    """An operator's approve or deny that cannot be taken: no open request for the call, or one
    already decided, expired or consumed. Nothing was appended."""


def decide_request(store: ApprovalStore, call_id: str, *, approve: bool, operator: str, reason: str | None,
                   request_id: str | None = None) -> tuple[EffectEvent, ApprovalRequest]:
    """Append an operator's ``approved`` (``approve``) or ``denied`` on the open request of
    ``call_id`` (and, when given, only if it is ``request_id``), compare-and-set in one step.

    Returns the event appended and the request as it now stands. Raises ``ValueError`` (no
    operator; a deny without a reason) and :class:`NotDecidable`; nothing is appended then.
    """
    if not operator or not operator.strip():
        raise ValueError("the operator's name is needed")
    if not approve and (reason is None or not reason.strip()):
        raise ValueError("a deny needs a reason")
    actor = operator if operator.startswith("operator:") else f"operator:{operator}"

    def step(record: CallRecord | None, request: ApprovalRequest | None) -> tuple[list[EffectEvent],
                                                                                   tuple[EffectEvent, ApprovalRequest]]:
        if request is None:
            raise NotDecidable(f"The call {call_id!r} has no request for approval.")
        if request_id is not None and request.request_id != request_id:
            raise NotDecidable(f"The request {request_id!r} is not the call's current one ({request.request_id}).")
        if request.overdue(utc_now()):
            raise NotDecidable(f"The request {request.request_id} of {call_id!r} expired at "
                               f"{format_at(request.expires_at)}; the agent's next retry asks again.")
        if request.status != "open":
            raise NotDecidable(f"The request {request.request_id} of {call_id!r} is already {request.status}.")
        if approve and actor in request.approvers:
            raise NotDecidable(f"{actor} has already approved the request {request.request_id}; "
                               f"it needs {request.quorum} distinct operators.")
        event = _follow_up("approved" if approve else "denied", request, actor, reason or "")
        folded = apply_approval(request, event)
        assert folded is not None
        return [event], (event, folded)

    return store.approval_step(call_id, step)


def expire_overdue(store: ApprovalStore, now: datetime | None = None) -> list[ApprovalRequest]:
    """Append ``expired`` for every open request past its ``expires_at`` (what a listing does
    first); returns the requests it expired."""
    now = now or utc_now()
    expired: list[ApprovalRequest] = []
    for request in store.approval_requests(status="open"):
        if not request.overdue(now):
            continue

        def step(record: CallRecord | None, current: ApprovalRequest | None,
                 rid: str = request.request_id) -> tuple[list[EffectEvent], ApprovalRequest | None]:
            if current is None or current.request_id != rid or not current.overdue(utc_now()):
                return [], None
            event = _follow_up("expired", current, GUARD_ACTOR,
                               f"no decision by {format_at(current.expires_at)}: denied by default")
            return [event], apply_approval(current, event)

        done = store.approval_step(request.call_id, step)
        if done is not None:
            expired.append(done)
    return expired


# -- the approver ------------------------------------------------------------------------------

def _seconds(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
            value <= 0 if positive else value < 0):
        raise ValueError(f"{name} is a {'positive' if positive else 'non-negative'} finite number of seconds, "
                         f"not {value!r}")
    return float(value)


class ApprovalQueue:
    """An approver whose requests wait, in the effect guard's store, for an operator's decision.

    Args:
        ttl: seconds a request stays open; undecided after it, it expires (denied by default).
        wait: seconds a call waits for the decision before it is refused ``approval_pending``
            (0: refused at once; the agent retries with the same ``tool_call_id`` later).
        quorum: how many distinct operators must approve; one ``denied`` denies.

    Give it as ``SecurityPolicy(approver=ApprovalQueue(...), effect_guard=EffectGuard(store=...))``:
    the guard consults it itself, in the store's transaction. Called as a plain approver (with an
    :class:`OversightRequest`), it raises ``TypeError``.
    """

    def __init__(self, ttl: float = 3600.0, wait: float = 0.0, quorum: int = 1) -> None:
        self.ttl = _seconds("ttl", ttl, positive=True)
        self.wait = _seconds("wait", wait, positive=False)
        if isinstance(quorum, bool) or not isinstance(quorum, int) or quorum < 1:
            raise ValueError(f"quorum is a whole number of operators, 1 or more, not {quorum!r}")
        self.quorum = quorum

    def __repr__(self) -> str:
        return f"ApprovalQueue(ttl={self.ttl:g}, wait={self.wait:g}, quorum={self.quorum})"

    def __call__(self, request: OversightRequest) -> OversightResponse:
        raise TypeError("an ApprovalQueue keeps its requests in the effect guard's store: give the policy an "
                        "EffectGuard(store=...) and let the guard consult it")

    def poll(self) -> Callable[[], float]:
        """How long to sleep between looks at the store while a call waits: from 20 ms, doubling
        up to 0.5 s, so that a decision made at once wakes the call at once and a long wait costs
        two reads a second."""
        delay = [0.01]

        def next_delay() -> float:
            delay[0] = min(delay[0] * 2, 0.5)
            return delay[0]

        return next_delay


def wait_for_decision(store: Any, call_id: str, request_id: str, seconds: float, queue: ApprovalQueue) -> None:
    """Block up to ``seconds`` until the request ``request_id`` of ``call_id`` is no longer open."""
    deadline = time.monotonic() + seconds
    delay = queue.poll()
    while True:
        found = store.approval_requests(request_id=request_id, limit=1)
        now = utc_now()
        if not found or found[0].status != "open" or found[0].overdue(now):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            return
        if isinstance(store, ApprovalWaiter):
            store.wait_for_decision(call_id, min(left, 5.0))
        else:
            time.sleep(min(delay(), left))


# -- a guarded call's step ---------------------------------------------------------------------

@dataclass(slots=True)
class Waiting:
    """The step's answer while a call may still wait for its request's decision."""

    request: ApprovalRequest


def _refusal(record: CallRecord | None, call_id: str, tool: str, key: str, arguments: str, agent_id: str | None,
             code: str, message: str, request: ApprovalRequest | None, **details: Any) -> Any:
    from .store import Decision, Verdict

    reason: dict[str, Any] = {"code": code, "message": message}
    if request is not None:
        reason["request_id"] = request.request_id
        details.setdefault("request_id", request.request_id)
    event = EffectEvent("refused", call_id, tool, utc_now(), agent_id, key, arguments, None, None, reason,
                        GUARD_ACTOR, 0 if record is None else record.attempt, current_owner())
    return Decision(Verdict.REFUSE, event, record, code, message, details)


def guarded_step(
    queue: ApprovalQueue, call_id: str, tool: str, key: str, arguments: str, agent_id: str | None,
    reversible: bool, escalation: str, waiting: bool, decide: Callable[..., Any],
) -> ApprovalStep[Any]:
    """The step of one attempt of an escalated call: refused, asked, waiting, or let through on a
    grant that it consumes in the same step as the replay table's decision (``decide``: the
    replay table, given the record and the approval to keep on ``pending``)."""
    sha = arguments_sha256(arguments)

    def step(record: CallRecord | None, request: ApprovalRequest | None) -> tuple[list[EffectEvent], Any]:
        from .store import Verdict

        events: list[EffectEvent] = []
        if record is not None and (record.tool != tool or record.idempotency_key != key):
            decision = decide(record, None)  # the replay table's policy_violation
            return [decision.event], decision
        if record is None and request is not None and request.status in ("open", "approved") and (
                request.tool != tool or request.arguments_sha256 != sha):
            other = "another tool" if request.tool != tool else "other arguments"
            message = (f"The tool call id {call_id!r} waits for approval of a call with {other}; every tool call "
                       "needs its own id.")
            decision = _refusal(record, call_id, tool, key, arguments, agent_id, "policy_violation", message, None,
                                violation_type="tool_call_id_reused", earlier_tool=request.tool)
            return [decision.event], decision
        if request is not None and request.overdue(utc_now()):
            expired = _follow_up("expired", request, GUARD_ACTOR,
                                 f"no decision by {format_at(request.expires_at)}: denied by default")
            events.append(expired)
            request = apply_approval(request, expired)
        if request is not None and request.status == "approved" and request.arguments_sha256 == sha:
            who = ", ".join(a.removeprefix("operator:") for a in request.approvers)
            decision = decide(record, {"code": "approved", "message": f"approved by {who} (request "
                                                                      f"{request.request_id})",
                                       "request_id": request.request_id})
            if decision.verdict is not Verdict.REFUSE:
                events.append(_follow_up("approval_consumed", request, GUARD_ACTOR,
                                         f"consumed by attempt {decision.event.attempt}",
                                         attempt=decision.event.attempt))
            events.append(decision.event)
            return events, decision
        if request is not None and request.status == "denied":
            who = (request.decided_by or "an operator").removeprefix("operator:")
            message = (f"An operator ({who}) denied this call to {tool!r}: {request.decision_reason or 'no reason'}. "
                       "It was not run.")
            decision = _refusal(record, call_id, tool, key, arguments, agent_id, "escalation_denied", message,
                                request, denied_by=who, denial_reason=request.decision_reason)
            events.append(decision.event)
            return events, decision
        if request is not None and request.status == "expired" and not request.answered:
            message = (f"The request for approval of this call to {tool!r} expired at "
                       f"{format_at(request.expires_at)} with no decision, so it is denied; a retry asks again.")
            decision = _refusal(record, call_id, tool, key, arguments, agent_id, "escalation_denied", message,
                                request, expired_at=format_at(request.expires_at))
            events.append(decision.event)
            return events, decision
        if request is None or request.status in ("expired", "consumed") or request.arguments_sha256 != sha:
            asked = request_event(call_id, tool, agent_id, key, arguments, escalation, queue.ttl, queue.quorum, record)
            events.append(asked)
            request = apply_approval(None, asked)
            assert request is not None
        if waiting:
            return events, Waiting(request)
        message = (f"This call to {tool!r} waits for an operator's approval ({escalation}); retry it with the "
                   f"same tool_call_id after the decision (request {request.request_id}, open until "
                   f"{format_at(request.expires_at)}).")
        decision = _refusal(record, call_id, tool, key, arguments, agent_id, "approval_pending", message, request,
                            expires_at=format_at(request.expires_at))
        events.append(decision.event)
        return events, decision

    return step
