"""One guarded call's way through the pipeline: who asks, under which id, its refusals, the replay
table's decision for it, and the outcome it records (section 2.4 of the contract).

The gates (:mod:`guard.gates`), the approver (:mod:`guard.escalation`) and the store's begin
(:mod:`guard.attempt`) each work on a :class:`GuardedCall`; :mod:`guard.airlock` takes it through them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any

from . import telemetry
from .approvals import ApprovalQueue
from .canonical import Binder, NotCanonical, canonical_bytes, key_from_canonical, key_prefix, storable
from .context import AirlockContext, CallContext, active
from .duplicates import decide_duplicate
from .effect_guard import DEFAULT_AMBIGUOUS_ERRORS, EffectGuard, decide_attempt, reversibility_of
from .outcomes import PLAIN, ambiguous_in, error_of, is_deferred
from .oversight import OversightRequest
from .policy import SecurityPolicy, required_capabilities
from .reconcile import reconciler_of
from .refusal import FIX_HINTS, Refusal, make_refusal
from .scope import agent_scoped_id, global_call_id
from .settling import NeedsCheck
from .store import GUARD_ACTOR, CallRecord, Decision, EffectEvent, Verdict, current_owner, utc_now

__all__ = ["GuardedCall", "GuardedTool"]

log = logging.getLogger("guard")
# An enum member costs a class attribute lookup each time on Python 3.11; the hot path keeps them.
_RUN, _REPLAY = Verdict.RUN, Verdict.REPLAY


class GuardedTool:
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


class GuardedCall:
    """One guarded call: what it asks, what was decided for it, and what it recorded."""

    __slots__ = (
        "agent_id", "approval", "args", "arguments", "attempt", "call_id", "checked", "code", "context",
        "duplicate", "eg", "escalation", "holder", "key", "kind", "kwargs", "metadata", "policy", "queue",
        "recorded_agent", "replay_value", "request", "store_seconds", "tool", "tool_call_id", "verdict",
    )

    def __init__(self, policy: SecurityPolicy, tool: GuardedTool, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.policy = policy
        self.tool = tool
        self.args = args
        self.kwargs = kwargs
        self.eg: EffectGuard | None = policy.effect_guard
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
        """The refusal ``code`` of this call, journaled (unless ``journal`` is False) with what it
        asked, its arguments keyed for the record where they were not yet (unless ``bind`` is False)."""
        if journal and bind and self.eg is not None and self.arguments is None:
            self._key_for_the_record()
        self.code = code
        hints = FIX_HINTS.get(str(details.get("violation_type")), ()) or FIX_HINTS.get(code, ())
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

    # -- the decision --------------------------------------------------------------------------

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
                and self.eg.settling is not None):
            raise NeedsCheck(record)
        if self.holder is not None and decision.event.kind == "pending":
            # The attempt names its lease: its owner is judged by that lease alone, never by another row.
            decision.event.owner = {**decision.event.owner, "lease": self.holder}
        return decision

    def let_go(self) -> None:
        """Let go of this call's lease (its tool has finished, or will not run)."""
        holder, self.holder = self.holder, None
        if holder is not None and self.eg is not None and self.eg.leasing is not None and self.call_id is not None:
            self.eg.leasing.let_go(self.call_id, holder)

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
            if type(result) not in PLAIN and is_deferred(result):
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
                held = ambiguous_in(exc, ambiguous)
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

    def abandoned(self) -> None:
        """The caller left (cancelled, or closed with its loop) while its ``begin`` was off the loop:
        the tool will not run, so an attempt that ``begin`` recorded ``pending`` is recorded
        ``released`` (a retry may run it)."""
        if self.verdict is _RUN:
            self.verdict = None
            self.outcome("released", error={
                "type": "CancelledError", "message": "the call was cancelled before its tool ran",
            })

    # -- appends -------------------------------------------------------------------------------

    def record(self, event: EffectEvent) -> None:
        """Append ``event`` (an outcome or a refusal), timed while a span is open; it goes to
        ``on_event`` once stored. A store's failure is logged: the caller's answer stands."""
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

    def append_on(self, eg: EffectGuard, event: EffectEvent) -> None:
        """``append`` on the guard's store; an outcome drops this call's lease in the same
        transaction on a store that can (:class:`~guard.store.LeasesInBegin`)."""
        holder, leasing = self.holder, eg.leasing
        if holder is not None and event.kind != "refused" and leasing is not None and leasing.in_begin is not None:
            leasing.in_begin.append(event, drop_lease=holder)
            self.holder = None
            leasing.stop_renewing(event.call_id or "", holder)
            return
        eg.store.append(event)

    def not_recorded(self, kind: str, e: Exception) -> None:
        log.error(
            "store could not record %s for %s (tool_call_id=%s, attempt %s): %r",
            kind, self.tool.name, self.tool_call_id, self.attempt, e,
        )

    # -- what a span reads (telemetry.TracedCall) ----------------------------------------------

    @property
    def tool_name(self) -> str:
        return self.tool.recorded_name

    @property
    def replayed(self) -> bool:
        return self.verdict is _REPLAY
