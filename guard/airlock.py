"""The ``@Airlock`` decorator: one guarded call through the gates, the effect guard and the tool."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from hashlib import sha256
from time import perf_counter
from typing import Any, Literal, TypeVar, cast

import orjson

from . import settling, telemetry
from .approvals import ApprovalQueue, ApprovalRequest, ApprovalStore, Waiting, guarded_step, wait_for_decision
from .canonical import (
    Binder,
    NotCanonical,
    canonical_bytes,
    key_from_canonical,
    key_prefix,
    storable,
)
from .context import AirlockContext, CallContext, active, enter_call, leave_call
from .duplicates import decide_duplicate, earlier_call
from .effect_guard import DEFAULT_AMBIGUOUS_ERRORS, TAGS_LOCK, EffectGuard, decide_attempt, reversibility_of
from .offload import offloaded, offloads
from .oversight import OversightRequest, OversightResponse, OversightVerdict
from .policy import SecurityPolicy, required_capabilities
from .reconcile import reconciler_of
from .refusal import AirlockBlocked, Refusal, make_refusal
from .scope import AGENT_PREFIX, agent_scoped_id, global_call_id, old_call_id
from .store import GUARD_ACTOR, CallRecord, Decision, EffectEvent, Verdict, current_owner, utc_now

__all__ = ["Airlock", "airlock_of", "error_of", "message_of"]

log = logging.getLogger("guard")
F = TypeVar("F", bound=Callable[..., Any])
# An enum member costs a class attribute lookup each time on Python 3.11; the hot path keeps them.
_RUN, _REPLAY, _REFUSE = Verdict.RUN, Verdict.REPLAY, Verdict.REFUSE

_HINTS: dict[str, tuple[str, ...]] = {
    "policy_violation": (
        "Do not call this tool again in this session; choose an allowed tool.",
    ),
    "tool_call_id_reused": (
        "Send a new tool call with a fresh id for a different call.",
        "To retry the earlier call, send exactly the same tool and arguments.",
    ),
    "capability_denied": ("Ask an operator to grant the capability, or use a tool that does not need it.",),
    "escalation_required": ("Ask an operator to configure an approver for this tool; do not retry until then.",),
    "escalation_denied": ("Do not retry this call unchanged; tell the user it was not approved.",),
    "tool_call_id_required": (
        "The host must run this tool inside AirlockContext(metadata={'tool_call_id': ...}), the id a "
        "non-empty string.",
    ),
    "target_args_required": ("Name the target explicitly and call again.",),
    "arguments_not_canonical": (
        "Pass arguments that fit the tool's signature and have a JSON form: "
        "strings, numbers, booleans, null, lists and objects (no NaN or infinity, and integers within "
        "64 bits: from -2**63 to 2**64 - 1).",
    ),
    "arguments_invalid": (  # an adapter's: the model's arguments do not fit the tool's parameters
        "Call the tool again with a JSON object of arguments that fits its parameters; the error says "
        "which one did not.",
    ),
    "effect_status_unknown": (
        "Do not retry this call.",
        "Ask the backend whether the operation with this idempotency key took effect.",
        "An operator can settle it with `airlock journal resolve`.",
    ),
    "replay_value_unavailable": (
        "Do not retry this call: it already took effect.",
        "Look up its result in the backend if you need it.",
    ),
    "store_unavailable": ("Try again later; the tool was not run.",),
    "approval_pending": (
        "Tell the user the call waits for an operator's approval.",
        "Retry with the same tool_call_id and the same arguments after the operator decides.",
    ),
    "tool_call_id_ambiguous": (
        "Do not retry this call: it may already have run under its earlier id.",
        "Send a new tool call with a fresh id for a new call.",
    ),
}


def message_of(exc: object) -> str:
    """``str(exc)`` (of an exception, or any object), storable; ``<unprintable X>`` when its
    ``__str__`` fails."""
    try:
        text = str(exc)
    except Exception:
        text = f"<unprintable {type(exc).__name__}>"
    return storable(text)


def error_of(exc: BaseException) -> dict[str, str]:
    """The ``{type, message}`` of an exception as an event records it."""
    return {"type": storable(type(exc).__name__), "message": message_of(exc)}


def _ambiguous_in(group: BaseExceptionGroup[Any], ambiguous: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception in ``group`` (depth first, nested groups included) that leaves a call's
    outcome in doubt: an instance of ``ambiguous``, or one that is no ``Exception``; None if none is."""
    # A loop, not recursion: groups may nest deeper than Python recurses. A nested group comes
    # after its members, which say better what happened.
    pending: list[tuple[BaseException, bool]] = [(e, False) for e in reversed(group.exceptions)]
    while pending:
        exc, members_seen = pending.pop()
        if isinstance(exc, BaseExceptionGroup) and not members_seen:
            pending.append((exc, True))
            pending.extend((e, False) for e in reversed(exc.exceptions))
        elif isinstance(exc, ambiguous) or not isinstance(exc, Exception):
            return exc
    return None


def is_deferred(result: Any) -> bool:
    """A result whose effect happens as it is consumed: an awaitable, a generator, an iterator."""
    if type(result) in _PLAIN:
        return False
    return (
        inspect.isawaitable(result)
        or inspect.isgenerator(result)
        or inspect.isasyncgen(result)
        or isinstance(result, Iterator | AsyncIterator)
    )


_PLAIN = frozenset({dict, list, str, int, float, bool, type(None), tuple, bytes})


class _Tool:
    """What the pipeline knows of one decorated function, read at its first call."""

    __slots__ = (
        "binder", "capabilities", "check", "irreversible", "key_prefix", "name", "recorded_name", "reversible",
    )

    def __init__(self, fn: Callable[..., Any], wrapper: Callable[..., Any]) -> None:
        self.name: str = fn.__name__
        self.recorded_name = storable(self.name)  # as every store can keep it (a lone surrogate escaped)
        self.key_prefix = key_prefix(self.name)
        self.binder = Binder(fn)
        tag = reversibility_of(wrapper)
        self.reversible = tag == "reversible"
        self.irreversible = tag == "irreversible"
        self.capabilities = required_capabilities(wrapper)
        self.check = reconciler_of(wrapper)


class _Call:
    """One guarded call's way through the pipeline (section 2.4 of the contract)."""

    __slots__ = (
        "agent_id", "airlock", "approval", "args", "arguments", "attempt", "call_id", "checked", "code", "context",
        "duplicate", "eg", "escalation", "holder", "key", "kind", "kwargs", "metadata", "queue", "recorded_agent",
        "replay_value", "request", "store_seconds", "tool", "tool_call_id", "verdict",
    )

    def __init__(self, airlock: Airlock, tool: _Tool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.airlock = airlock
        self.tool = tool
        self.args = args
        self.kwargs = kwargs
        self.eg: EffectGuard | None = airlock.policy.effect_guard
        host = active()
        if host is None:
            self.agent_id, self.metadata, self.tool_call_id = None, {}, None
        elif type(host) is AirlockContext or (isinstance(host, AirlockContext) and not isinstance(host, CallContext)):
            self.agent_id, self.metadata, self.tool_call_id = host.agent_id, host.metadata, host.tool_call_id
        else:
            # A guarded call made from inside a tool is not the model's call: it has no id of its own.
            outer = host.call_context() if not isinstance(host, AirlockContext) else host
            self.agent_id, self.tool_call_id = outer.agent_id, None
            self.metadata = {k: v for k, v in outer.metadata.items() if k != "tool_call_id"}
        # The agent as every event records it (a lone surrogate escaped), worked out once a call.
        self.recorded_agent = storable(self.agent_id)
        # The id the store keeps the call under: the tool call id, or with id_scope="agent" the pair,
        # escaped where it is not plain so that no two ids share one (guard/scope.py).
        tool_call_id = self.tool_call_id
        if tool_call_id is None:
            self.call_id: str | None = None
        elif self.eg is not None and self.eg.id_scope == "agent":
            self.call_id = agent_scoped_id(self.agent_id, tool_call_id)
        else:
            self.call_id = global_call_id(tool_call_id)
        self.duplicate: CallRecord | None = None
        self.holder: str | None = None  # this call's lease on its id, when the guard takes leases
        self.checked = False  # the tool's check has run on this call's record
        self.arguments: str | None = None
        self.key: str | None = None
        self.escalation: str | None = None
        self.request: OversightRequest | None = None
        self.approval: dict[str, str] | None = None
        self.queue: ApprovalQueue | None = None  # the durable queue that decides this escalated call
        self.verdict: Verdict | None = None
        self.attempt = 0
        self.replay_value: Any = None
        self.context: CallContext | None = None
        self.code: str | None = None  # the refusal's code
        self.kind: str | None = None  # the outcome recorded
        self.store_seconds: float | None = None  # time in the store, while a span is open

    # -- refusals ------------------------------------------------------------------------------

    def refuse(self, code: str, error: str, journal: bool = True, bind: bool = True, **details: Any) -> Refusal:
        if journal and bind and self.eg is not None and self.arguments is None:
            self._key_for_the_record()
        self.code = code
        hints = _HINTS.get(str(details.get("violation_type")), ()) or _HINTS.get(code, ())
        refusal = make_refusal(
            code, error, hints,
            {"tool": self.tool.name, "tool_call_id": self.tool_call_id, "agent_id": self.agent_id,
             "idempotency_key": self.key, **details},
        )
        if journal and self.eg is not None:
            self.record(
                EffectEvent(
                    # The ids may come from the model: a lone surrogate in one would make the event unstorable.
                    kind="refused", call_id=self.call_id, tool=self.tool.recorded_name,
                    agent_id=self.recorded_agent, idempotency_key=self.key, arguments=self.arguments,
                    reason={"code": code, "message": storable(error)}, attempt=self.attempt,
                )
            )
        return refusal

    def _key_for_the_record(self) -> None:
        """A refusal before the arguments were keyed still journals what was asked, when it can."""
        try:
            bound, _ = self.tool.binder.bind(self.args, self.kwargs)
            arguments = canonical_bytes(bound)
        except (TypeError, NotCanonical):
            return
        self.key = key_from_canonical(self.tool.key_prefix, arguments)
        self.arguments = arguments.decode()

    # -- gates 1 to 5 --------------------------------------------------------------------------

    def first_gates(self, bind: bool = True) -> Refusal | None:
        """Gates 1-3, which do not look at the arguments; the first refusal ends the call."""
        policy, tool, eg = self.airlock.policy, self.tool, self.eg
        name = tool.name
        violation = policy.violation(name)
        if violation is not None:
            return self.refuse(
                "policy_violation",
                f"The tool {name!r} is {'denied' if violation == 'tool_denied' else 'not allowed'} "
                "by this agent's policy; it was not run.",
                bind=bind, violation_type=violation,
            )
        if tool.capabilities:
            missing = policy.missing_capabilities(tool.capabilities)
            if missing:
                return self.refuse(
                    "capability_denied",
                    f"The tool {name!r} needs the capabilities {', '.join(missing)}, which this agent "
                    "has not been granted; it was not run.",
                    bind=bind, missing_capabilities=missing,
                )
        if eg is not None and eg.require_tool_call_id and self.tool_call_id is None and not tool.reversible:
            return self.refuse(
                "tool_call_id_required",
                f"The tool {name!r} has side effects and this call carries no tool call id, so it cannot "
                "be run at most once; it was not run.",
                bind=bind,
            )
        return None

    def gates(self) -> Refusal | None:
        """Gates 1-4 and the decision whether to escalate; the first refusal ends the call."""
        policy, tool, eg = self.airlock.policy, self.tool, self.eg
        name = tool.name
        # Gates 1-3 cost nothing to pass when no policy list, capability or missing id is involved.
        if (policy.allowed_tools is not None or policy.denied_tools or tool.capabilities
                or (eg is not None and self.tool_call_id is None)):
            refusal = self.first_gates()
            if refusal is not None:
                return refusal
        bind_error: str | None = None
        try:
            bound, passed = tool.binder.bind(self.args, self.kwargs)
        except TypeError as e:
            bound, passed, bind_error = None, set(), str(e)
        else:
            try:
                arguments = canonical_bytes(bound)
            except NotCanonical as e:
                bind_error = f"an argument has no JSON form ({e})"
            else:
                # key_from_canonical's rule, written out: this is every guarded call's path.
                self.key = sha256(tool.key_prefix + arguments).hexdigest()
                self.arguments = arguments.decode()
        if eg is not None and eg.target_args and tool.irreversible:
            if bound is None:
                return self._not_canonical(bind_error)
            if not any(n in passed and bound.get(n) not in (None, "") for n in eg.target_args):
                return self.refuse(
                    "target_args_required",
                    f"The tool {name!r} is irreversible and must name its target: pass a value for "
                    f"{' or '.join(repr(n) for n in eg.target_args)}.",
                    target_args=list(eg.target_args),
                )
        escalation = policy.escalation_reason(name) if policy.escalate_tools else None
        if escalation is None and eg is not None and eg.require_approval_for_irreversible and tool.irreversible:
            escalation = "every call to an irreversible tool needs approval"
        keyed = eg is not None and self.tool_call_id is not None
        if (escalation is not None or keyed) and self.key is None:
            return self._not_canonical(bind_error)
        if escalation is not None:
            if policy.approver is None:
                return self.refuse(
                    "escalation_required",
                    f"The tool {name!r} needs a human's approval ({escalation}) and no approver is "
                    "configured; it was not run.",
                    escalation_reason=escalation,
                )
            self.escalation = escalation
            if isinstance(policy.approver, ApprovalQueue):
                if eg is None or self.call_id is None:
                    return self.refuse(
                        "tool_call_id_required",
                        f"The tool {name!r} needs an operator's approval, which is kept under the call's "
                        "tool_call_id: call it with one.",
                    )
                self.queue = policy.approver
        return None

    def _not_canonical(self, why: str | None) -> Refusal:
        return self.refuse(
            "arguments_not_canonical",
            f"The arguments to {self.tool.name!r} cannot be keyed: {why}; it was not run.",
        )

    def approval_request(self) -> OversightRequest:
        assert self.arguments is not None and self.key is not None and self.escalation is not None
        self.request = OversightRequest(
            request_id=uuid.uuid4().hex,
            tool_name=self.tool.name,
            arguments=orjson.loads(self.arguments),
            reason=self.escalation,
            tool_call_id=self.tool_call_id,
            idempotency_key=self.key,
            agent_id=self.agent_id,
            requested_at=utc_now(),
        )
        return self.request

    def approval_failed(self, e: Exception) -> Refusal:
        log.warning("approver raised for %s (tool_call_id=%s): %r", self.tool.name, self.tool_call_id, e)
        return self.refuse(
            "escalation_denied",
            f"The approver failed on this call to {self.tool.name!r} ({type(e).__name__}), so it was not "
            "approved; it was not run.",
            verdict="error",
        )

    def check_approval(self, response: object) -> Refusal | None:
        request = self.request
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
            self.approval = {"code": "approved", "message": f"approved by {who} (request {request.request_id})"}
            return None
        if not isinstance(response, OversightResponse):
            verdict = "invalid_response"
        elif response.request_id != request.request_id:
            verdict = "response_for_another_request"
        elif not isinstance(response.verdict, OversightVerdict):
            verdict = "invalid_verdict"  # "grant" as a bare string is not a grant
        else:
            verdict = str(response.verdict)
        return self.refuse(
            "escalation_denied",
            f"The approver did not grant this call to {self.tool.name!r} ({verdict}); it was not run.",
            verdict=verdict,
            request_id=request.request_id,
        )

    # -- gate 6 --------------------------------------------------------------------------------

    def begin(self) -> Refusal | None:
        """The effect guard's atomic begin; sets ``verdict`` (None when the call runs unguarded)."""
        eg, call_id, tool_call_id = self.eg, self.call_id, self.tool_call_id
        if eg is None or call_id is None or tool_call_id is None:
            return None
        # The model's id, not the stored one: an escaped global id begins "agent:" too.
        if eg.id_scope == "global" and tool_call_id.startswith(AGENT_PREFIX):
            self.call_id = None  # journaled without the id, which names a call of the agent scope
            return self.refuse(
                "policy_violation",
                f"The tool call id {tool_call_id!r} has the form kept for ids scoped by agent ('agent:...'); "
                "it was not run.",
                violation_type="tool_call_id_reserved",
            )
        old = old_call_id(eg.id_scope, self.agent_id, tool_call_id)
        try:
            # A call kept under the id's old form may be this one or the other id spelled alike then.
            kept_before = old is not None and eg.store.get(old) is not None
            decision = None if kept_before else self._decision(eg, call_id)
        except Exception as e:
            self.let_go()
            log.error("store could not record pending for %s (tool_call_id=%s): %r", self.tool.name, call_id, e)
            return self.refuse(
                "store_unavailable",
                "The effect journal could not record this call, so it was not run; try again later.",
                journal=False,
                store_error=f"{type(e).__name__}: {message_of(e)}",
            )
        if decision is None:
            return self.refuse(
                "policy_violation",
                f"A call was recorded under {old!r}, the form this tool call id was kept under before ids "
                "were kept apart, which another id shared; it may be this call, so it was not run.",
                violation_type="tool_call_id_ambiguous", old_call_id=old,
            )
        self.verdict = verdict = decision.verdict
        self.attempt = decision.event.attempt
        if self.context is not None:  # asked for before the call was recorded (by an approver, say)
            self.context._attempt = self.attempt or None
        if self.holder is not None:
            if verdict is _RUN:
                settling.keep(eg.store, call_id, self.holder, eg.lease or 0.0)
            elif settling.leases_in_begin(eg.store) and not self.checked:
                self.holder = None  # its begin took no lease for a call that does not run
            else:
                self.let_go()
        if verdict is _REFUSE:
            return self.refuse(str(decision.code), str(decision.message), journal=False, **decision.details)
        if verdict is _REPLAY:
            assert decision.record is not None and decision.record.value is not None
            self.replay_value = orjson.loads(decision.record.value)
        return None

    def _decision(self, eg: EffectGuard, call_id: str) -> Decision:
        """The store's decision for this call, recorded: a recent duplicate looked up and a lease
        taken first where the guard asks for them, and a call in doubt checked first where its
        tool has a check."""
        if eg.duplicate_window is not None:
            assert self.key is not None
            self.duplicate = earlier_call(eg.store, eg.duplicate_window, call_id, self.recorded_agent, self.key)
        if self.queue is not None:
            return self.queued_decision(eg, call_id, self.queue)
        if eg.lease is not None and self.holder is None:
            self.holder = settling.take_lease(eg.store, call_id, eg.lease)
        try:
            if self.store_seconds is None and self.holder is None and eg.on_event is None:
                return eg.store.begin(call_id, self.decide)  # store_begin's plain case, without its frame
            return self.store_begin(call_id)
        except settling.NeedsCheck as doubt:  # nothing was appended: check first, then decide again
            assert self.tool.check is not None
            self.checked = True
            settling.reconcile_record(
                eg.store, doubt.record, self.tool.check, self.holder,
                appended=None if eg.on_event is None else functools.partial(telemetry.deliver, eg.on_event))
            return self.store_begin(call_id)

    def queued_decision(self, eg: EffectGuard, call_id: str, queue: ApprovalQueue) -> Decision:
        """The decision of an escalated call whose approver is a durable queue: one atomic step of
        the store that asks, refuses, or consumes a grant with the call's ``pending``; with the
        queue's ``wait``, a wait for the decision between two such steps."""
        store = eg.store
        if not isinstance(store, ApprovalStore):
            raise TypeError(f"{type(store).__name__} keeps no approvals: an ApprovalQueue needs a store that does")
        assert self.key is not None and self.arguments is not None and self.escalation is not None
        holder = None
        if eg.lease is not None:  # taken before the step, which names it on the pending it records
            holder = uuid.uuid4().hex
            store.take_lease(call_id, holder, eg.lease)  # type: ignore[attr-defined]
        made: list[EffectEvent] = []

        def decide(record: CallRecord | None, approval: dict[str, str] | None) -> Decision:
            decision = decide_attempt(record, call_id, self.tool.recorded_name, self.key or "", self.arguments or "",
                                      self.recorded_agent, self.tool.reversible, approval)
            if holder is not None and decision.event.kind == "pending":
                decision.event.owner = {**decision.event.owner, "lease": holder}
            return decision

        def run(waiting: bool) -> Any:
            chosen = guarded_step(queue, call_id, self.tool.recorded_name, self.key or "", self.arguments or "",
                                  self.recorded_agent, self.tool.reversible, self.escalation or "", waiting, decide)

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
            if holder is not None:
                settling.let_go(store, call_id, holder)
            raise
        decision = cast(Decision, result)
        if holder is not None:
            if decision.event.kind == "pending":
                self.holder = holder  # renewed while the tool runs, dropped with its outcome
            else:
                settling.let_go(store, call_id, holder)
        return decision

    def decide(self, record: CallRecord | None) -> Decision:
        """The replay table's decision for this call, given the store's record of its id."""
        assert self.call_id is not None and self.key is not None and self.arguments is not None
        tool = self.tool
        if record is None and self.duplicate is not None:  # a new id repeating a recent call: answered as it
            return decide_duplicate(
                self.duplicate, self.call_id, tool.recorded_name, self.key, self.arguments, self.recorded_agent)
        # The ids may come from the model: one with a lone surrogate is recorded as its backslash
        # escape, which every store can keep, as a refusal's is.
        decision = decide_attempt(
            record, self.call_id, tool.recorded_name, self.key, self.arguments, self.recorded_agent,
            tool.reversible, self.approval,
        )
        if (decision.code == "effect_status_unknown" and tool.check is not None and not self.checked
                and record is not None and self.eg is not None and self.eg.reconcile_on_retry
                and settling.can_settle(self.eg.store)):
            raise settling.NeedsCheck(record)
        if self.holder is not None and decision.event.kind == "pending":
            # The attempt names its lease: its owner is judged by that lease alone, never by another row.
            decision.event.owner = {**decision.event.owner, "lease": self.holder}
        return decision

    def let_go(self) -> None:
        """Let go of this call's lease (its tool has finished, or will not run)."""
        holder, self.holder = self.holder, None
        if holder is not None and self.eg is not None and self.call_id is not None:
            settling.let_go(self.eg.store, self.call_id, holder)

    def call_context(self) -> CallContext:
        """The per-call copy of the host's context, made when the tool first asks for it."""
        if self.context is None:
            self.context = CallContext(
                self.agent_id, self.metadata, tool=self.tool.name, tool_call_id=self.tool_call_id,
                idempotency_key=self.key, attempt=self.attempt or None,
            )
        return self.context

    # -- outcomes ------------------------------------------------------------------------------

    def outcome(self, kind: str, value: str | None = None, error: dict[str, str] | None = None,
                reason: dict[str, str] | None = None) -> None:
        self.kind = kind
        event = EffectEvent(
            kind, self.call_id, self.tool.recorded_name, utc_now(), self.recorded_agent, self.key,
            self.arguments, value, error, reason, GUARD_ACTOR, self.attempt, current_owner(),
        )
        eg = self.eg
        if self.store_seconds is None and self.holder is None and eg is not None and eg.on_event is None:
            try:
                eg.store.append(event)  # record's plain case, without its frame
            except Exception as e:
                self.not_recorded(kind, e)
            return
        self.record(event)
        if self.holder is not None:
            self.let_go()

    def returned(self, result: Any) -> None:
        if self.verdict is not _RUN:
            if self.store_seconds is not None:  # traced: the span tells what came of a call run unguarded
                self.kind = "unknown" if is_deferred(result) else "committed"
            return
        kind = "committed"
        try:
            if type(result) not in _PLAIN and is_deferred(result):
                kind = "unknown"
                self.outcome(kind, error={
                    "type": storable(type(result).__name__),
                    "message": "the tool returned a deferred result; its effect happens as it is consumed",
                })
                return
            try:
                value: str | None = canonical_bytes(result).decode()
            except NotCanonical:
                value = None
            if value is None:
                self.outcome("committed", reason={
                    "code": "value_not_stored",
                    "message": f"the tool's value of type {storable(type(result).__name__)} has no JSON form",
                })
            else:
                self.outcome("committed", value=value)
        except Exception as e:
            self.not_recorded(kind, e)  # the caller still gets the value

    def raised(self, exc: BaseException) -> None:
        if self.verdict is not _RUN:
            if self.store_seconds is not None:  # traced: the span tells what came of a call run unguarded
                ambiguous = self.eg.ambiguous_errors if self.eg is not None else DEFAULT_AMBIGUOUS_ERRORS
                self.kind = "released" if isinstance(exc, Exception) and not isinstance(exc, ambiguous) else "unknown"
            return
        eg = self.eg
        assert eg is not None
        ambiguous = eg.ambiguous_errors
        kind = "unknown" if isinstance(exc, ambiguous) or not isinstance(exc, Exception) else "released"
        error = error_of(exc)
        if isinstance(exc, BaseExceptionGroup) and not isinstance(exc, ambiguous):
            # A TaskGroup's or an except*'s group is as ambiguous as the worst exception it holds.
            try:
                held = _ambiguous_in(exc, ambiguous)
            except Exception:  # a group whose exceptions cannot be read: its outcome is in doubt
                kind = "unknown"
            else:
                if held is not None:
                    kind = "unknown"
                    among = error_of(held)
                    said = f": {among['message']}" if among["message"] else ""
                    error["message"] += f"; among them {among['type']}{said}"
        try:
            self.outcome(kind, error=error)
        except Exception as e:
            self.not_recorded(kind, e)  # the caller still gets the tool's exception

    def record(self, event: EffectEvent) -> None:
        eg = self.eg
        assert eg is not None
        try:
            if self.store_seconds is None:
                if self.holder is None:
                    eg.store.append(event)
                else:
                    self.append_on(eg, event)
            else:
                started = perf_counter()
                try:
                    self.append_on(eg, event)
                finally:
                    self.store_seconds += perf_counter() - started
        except Exception as e:
            self.not_recorded(event.kind, e)
            return
        if eg.on_event is not None:
            telemetry.deliver(eg.on_event, event)

    def begin_on(self, eg: EffectGuard, call_id: str) -> Decision:
        """``begin`` on the guard's store; a store that takes a lease in the same transaction is
        given this call's (see :mod:`guard.settling`)."""
        if self.holder is not None and settling.leases_in_begin(eg.store):
            return eg.store.begin(call_id, self.decide, lease=(self.holder, eg.lease))  # type: ignore[call-arg]
        return eg.store.begin(call_id, self.decide)

    def append_on(self, eg: EffectGuard, event: EffectEvent) -> None:
        """``append`` on the guard's store; an outcome drops this call's lease in the same
        transaction on a store that can."""
        holder = self.holder
        if holder is not None and event.kind != "refused" and settling.leases_in_begin(eg.store):
            eg.store.append(event, drop_lease=holder)  # type: ignore[call-arg]
            self.holder = None
            settling.stop_renewing(eg.store, event.call_id or "", holder)
            return
        eg.store.append(event)

    def store_begin(self, call_id: str) -> Decision:
        """The store's atomic begin, timed while a span is open; its event goes to ``on_event``."""
        eg = self.eg
        assert eg is not None
        if self.store_seconds is None:
            decision = eg.store.begin(call_id, self.decide) if self.holder is None else self.begin_on(eg, call_id)
        else:
            started = perf_counter()
            try:
                decision = self.begin_on(eg, call_id)
            finally:
                self.store_seconds += perf_counter() - started
        if eg.on_event is not None:
            telemetry.deliver(eg.on_event, decision.event)
        return decision

    @property
    def tool_name(self) -> str:
        return self.tool.recorded_name

    @property
    def replayed(self) -> bool:
        return self.verdict is _REPLAY

    def not_recorded(self, kind: str, e: Exception) -> None:
        log.error(
            "store could not record %s for %s (tool_call_id=%s, attempt %s): %r",
            kind, self.tool.name, self.tool_call_id, self.attempt, e,
        )

    def gates_and_begin(self) -> Refusal | None:
        """Gates 1 to 5 and, unless one refused or the call must be approved first, the begin."""
        refusal = self.gates()
        if refusal is None and (self.escalation is None or self.queue is not None):
            refusal = self.begin()
        return refusal

    def approved_and_begin(self, response: Any) -> Refusal | None:
        """The approver's verdict and, when it grants the call, the begin."""
        refusal = self.check_approval(response)
        return self.begin() if refusal is None else refusal

    def abandoned(self) -> None:
        """The caller left (cancelled, or closed with its loop) while its ``begin`` was off the loop:
        the tool will not run, so an attempt that ``begin`` recorded ``pending`` is recorded
        ``released`` (a retry may run it)."""
        if self.verdict is _RUN:
            self.verdict = None
            self.outcome("released", error={
                "type": "CancelledError", "message": "the call was cancelled before its tool ran",
            })


class Airlock:
    """Guard a tool: ``@Airlock(policy=SecurityPolicy(...), on_block="return")``.

    The decorated ``def`` or ``async def`` keeps its name, docstring and signature. A refused call
    does not run: it returns a :class:`Refusal` (``on_block="return"``) or raises
    :class:`AirlockBlocked` (``on_block="raise"``).
    """

    def __init__(self, policy: SecurityPolicy | None = None, on_block: Literal["return", "raise"] = "return") -> None:
        if on_block not in ("return", "raise"):
            raise ValueError(f"on_block is 'return' or 'raise', not {on_block!r}")
        if policy is not None and not isinstance(policy, SecurityPolicy):
            raise TypeError(f"policy is a SecurityPolicy, not {type(policy).__name__}")
        self.policy = policy if policy is not None else SecurityPolicy()
        self.on_block = on_block

    def blocked(self, refusal: Refusal) -> Any:
        if self.on_block == "raise":
            raise AirlockBlocked(refusal)
        return refusal

    def refuse(self, fn: Callable[..., Any], code: str, error: str, arguments: Any = None, **details: Any) -> Any:
        """Refuse a call to ``fn`` before it reaches the tool (for adapters), journaled like any refusal.

        Gates 1-3 come first: when one of them refuses the call, that refusal is the answer, not
        ``code`` (the first gate that refuses ends the call). ``arguments`` are the model's decoded
        arguments. When they are a JSON object with a JSON form, the refusal journals their
        canonical form and key as sent, not bound to the signature (they may not fit it); otherwise
        it journals no arguments and no key.
        """
        tool = _tool_of(fn)
        call = _Call(self, tool, (), {})
        if isinstance(arguments, Mapping):
            try:
                canonical = canonical_bytes(dict(arguments))
            except NotCanonical:
                pass
            else:
                call.key = key_from_canonical(tool.key_prefix, canonical)
                call.arguments = canonical.decode()

        def refused(call: _Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            refusal = call.first_gates(bind=False)
            return self.blocked(refusal if refusal is not None else call.refuse(code, error, bind=False, **details))

        return telemetry.traced(call, refused, (), {}) if telemetry.on else refused(call, (), {})

    def __call__(self, fn: F) -> F:
        if not callable(fn) or not isinstance(getattr(fn, "__name__", None), str):
            raise TypeError(f"@Airlock decorates a function (a def or async def, named by __name__), not {fn!r}")
        if "__airlock__" in getattr(fn, "__dict__", {}):
            # The inner guard would see a nested call without an id and refuse it; the outer one
            # would then commit that refusal as the tool's value.
            raise TypeError(f"{fn.__name__!r} is already guarded by an @Airlock; give a tool one Airlock")
        cache: list[_Tool] = []

        def tool() -> _Tool:
            # Off the hot path (a call reads cache[0] once it is filled); the lock keeps a tag
            # put on meanwhile from being overwritten by the tags read before it.
            with TAGS_LOCK:
                if not cache:
                    cache.append(_Tool(fn, wrapper))
                return cache[0]

        def retag() -> None:
            # A @reversibility or @requires put on above this wrapper after its first call.
            with TAGS_LOCK:
                if cache:
                    cache[0] = _Tool(fn, wrapper)

        make = self._async_wrapper if inspect.iscoroutinefunction(fn) else self._sync_wrapper
        wrapper = make(fn, cache, tool)
        wrapper.__airlock__ = self  # type: ignore[attr-defined]
        wrapper.__airlock_tool__ = tool  # type: ignore[attr-defined]
        wrapper.__airlock_retag__ = retag  # type: ignore[attr-defined]
        return cast(F, wrapper)

    def _sync_wrapper(self, fn: Callable[..., Any], cache: list[_Tool],
                      tool: Callable[[], _Tool]) -> Callable[..., Any]:
        """The guarded ``def`` tool: each call through the gates and the effect guard, then ``fn``."""
        guarded = functools.partial(self._guarded, fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            call = _Call(self, cache[0] if cache else tool(), args, kwargs)
            if telemetry.on:  # the one check a call pays when OpenTelemetry is absent
                return telemetry.traced(call, guarded, args, kwargs)
            return guarded(call, args, kwargs)

        return wrapper

    def _async_wrapper(self, fn: Callable[..., Any], cache: list[_Tool],
                       tool: Callable[[], _Tool]) -> Callable[..., Any]:
        """The guarded ``async def`` tool, as :meth:`_sync_wrapper`."""
        guarded = functools.partial(self._guarded_async, fn)

        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            call = _Call(self, cache[0] if cache else tool(), args, kwargs)
            if telemetry.on:  # the one check a call pays when OpenTelemetry is absent
                return await telemetry.atraced(call, guarded, args, kwargs)
            return await guarded(call, args, kwargs)

        return wrapper

    def _guarded(self, fn: Callable[..., Any], call: _Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of a ``def`` tool: the gates, an approval where one is needed, the store's begin;
        then the replay, the refusal, or the tool run and its outcome recorded."""
        refusal = call.gates()
        if refusal is None and call.escalation is not None and call.queue is None:
            refusal = self._approved(call)
        if refusal is None:
            refusal = call.begin()
        if refusal is not None:
            return self.blocked(refusal)
        if call.verdict is _REPLAY:
            return call.replay_value
        token = enter_call(call)
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            call.raised(e)
            raise
        finally:
            leave_call(token)
        call.returned(result)
        return result

    def _approved(self, call: _Call) -> Refusal | None:
        """The approver's answer for a ``def`` tool's escalated call: None when it approves."""
        try:
            response = self.policy.approver(call.approval_request())  # type: ignore[misc]
            if inspect.isawaitable(response):
                if inspect.iscoroutine(response):
                    response.close()
                raise TypeError("the approver is async; a def tool needs an approver that is a "
                                "plain function (an async approver serves async def tools)")
        except Exception as e:
            return call.approval_failed(e)
        return call.check_approval(response)

    async def _guarded_async(self, fn: Callable[..., Any], call: _Call, args: tuple[Any, ...],
                             kwargs: dict[str, Any]) -> Any:
        """One call of an ``async def`` tool, as :meth:`_guarded`; the store's work made in the
        guard's threads where the store asks for it (``offload_async``)."""
        off_loop = call.eg is not None and offloads(call.eg.store)
        queue = self.policy.approver
        if off_loop or (isinstance(queue, ApprovalQueue) and queue.wait > 0):
            # A call that may wait for an operator's decision waits in the guard's threads, so the
            # event loop keeps running.
            refusal = await offloaded(call.gates_and_begin, droppable=True, after=call.abandoned)
        else:
            refusal = call.gates_and_begin()
        if refusal is None and call.escalation is not None and call.queue is None:
            refusal = await self._approved_async(call, off_loop)
        if refusal is not None:
            return self.blocked(refusal)
        if call.verdict is _REPLAY:
            return call.replay_value
        token = enter_call(call)
        try:
            result = await cast(Callable[..., Awaitable[Any]], fn)(*args, **kwargs)
        except BaseException as e:
            if off_loop and not isinstance(e, GeneratorExit):
                await offloaded(call.raised, e)
            else:  # a coroutine being closed may not wait for anything
                call.raised(e)
            raise
        finally:
            # A coroutine closed outside its task's context (destroyed with its loop) cannot
            # reset the variable: the context it set it in is gone with the task.
            with contextlib.suppress(ValueError):
                leave_call(token)
        if off_loop:
            await offloaded(call.returned, result)
        else:
            call.returned(result)
        return result

    async def _approved_async(self, call: _Call, off_loop: bool) -> Refusal | None:
        """The approver's answer for an ``async def`` tool's escalated call (the approver may be
        async), and the call's begin once approved: None when it may run."""
        try:
            response: Any = self.policy.approver(call.approval_request())  # type: ignore[misc]
            if inspect.isawaitable(response):
                response = await response
        except Exception as e:
            return await offloaded(call.approval_failed, e) if off_loop else call.approval_failed(e)
        # Not given up even for a caller that left meanwhile: a denial is journaled.
        if off_loop:
            return cast(Refusal | None, await offloaded(call.approved_and_begin, response, after=call.abandoned))
        return call.approved_and_begin(response)


def _tool_of(fn: Callable[..., Any]) -> _Tool:
    resolve = getattr(fn, "__airlock_tool__", None)
    if resolve is None:
        raise TypeError(f"{fn!r} is not decorated with @Airlock")
    return cast(_Tool, resolve())


def airlock_of(fn: Callable[..., Any]) -> Airlock | None:
    """The :class:`Airlock` that guards ``fn`` (looked up along the ``__wrapped__`` chain), or None."""
    seen: set[int] = set()
    obj: Any = fn
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        found = obj.__dict__.get("__airlock__") if hasattr(obj, "__dict__") else None
        if isinstance(found, Airlock):
            return found
        obj = getattr(obj, "__wrapped__", None)
    return None
