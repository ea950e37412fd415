"""Gate 6: the effect guard's atomic begin of one attempt of a keyed call.

A recent duplicate is looked up and a lease taken first where the guard asks for them, a call in
doubt whose tool has a check is checked first, and the store records the replay table's decision
in its ``begin``: here, the one place a guarded call reaches it.
"""

from __future__ import annotations

import functools
import logging
from time import perf_counter

import orjson

from . import telemetry
from .call import GuardedCall
from .duplicates import earlier_call
from .effect_guard import EffectGuard
from .escalation import queued_decision
from .outcomes import message_of
from .refusal import Refusal
from .scope import AGENT_PREFIX, old_call_id
from .settling import NeedsCheck, reconcile_record
from .store import CallRecord, Decision, Verdict

__all__ = ["begin"]

log = logging.getLogger("guard")
# An enum member costs a class attribute lookup each time on Python 3.11; the hot path keeps them.
_RUN, _REPLAY, _REFUSE = Verdict.RUN, Verdict.REPLAY, Verdict.REFUSE


def begin(call: GuardedCall) -> Refusal | None:
    """The effect guard's atomic begin of ``call``; sets its ``verdict`` (None when the call runs
    unguarded: no effect guard, or no id to key it on). Returns the refusal, or None."""
    eg, call_id, tool_call_id = call.eg, call.call_id, call.tool_call_id
    if eg is None or call_id is None or tool_call_id is None:
        return None
    # The model's id, not the stored one: an escaped global id begins "agent:" too.
    if eg.id_scope == "global" and tool_call_id.startswith(AGENT_PREFIX):
        call.call_id = None  # journaled without the id, which names a call of the agent scope
        return call.refuse(
            "policy_violation",
            f"The tool call id {tool_call_id!r} has the form kept for ids scoped by agent ('agent:...'); "
            "it was not run.",
            violation_type="tool_call_id_reserved",
        )
    old = old_call_id(eg.id_scope, call.agent_id, tool_call_id)
    try:
        # A call kept under the id's old form may be this one or the other id spelled alike then.
        kept_before = old is not None and eg.store.get(old) is not None
        decision = None if kept_before else _decision(call, eg, call_id)
    except Exception as e:
        call.let_go()
        log.error("store could not record pending for %s (tool_call_id=%s): %r", call.tool.name, call_id, e)
        return call.refuse(
            "store_unavailable",
            "The effect journal could not record this call, so it was not run; try again later.",
            journal=False,
            store_error=f"{type(e).__name__}: {message_of(e)}",
        )
    if decision is None:
        return call.refuse(
            "policy_violation",
            f"A call was recorded under {old!r}, the form this tool call id was kept under before ids "
            "were kept apart, which another id shared; it may be this call, so it was not run.",
            violation_type="tool_call_id_ambiguous", old_call_id=old,
        )
    call.verdict = verdict = decision.verdict
    call.attempt = decision.event.attempt
    if call.context is not None:  # asked for before the call was recorded (by an approver, say)
        call.context._attempt = call.attempt or None
    holder, leasing = call.holder, eg.leasing
    if holder is not None and leasing is not None:
        if verdict is _RUN:
            leasing.keep(call_id, holder)
        elif leasing.in_begin is not None and not call.checked:
            call.holder = None  # its begin took no lease for a call that does not run
        else:
            call.let_go()
    if verdict is _REFUSE:
        return call.refuse(str(decision.code), str(decision.message), journal=False, **decision.details)
    if verdict is _REPLAY:
        assert decision.record is not None and decision.record.value is not None
        call.replay_value = orjson.loads(decision.record.value)
    return None


def _decision(call: GuardedCall, eg: EffectGuard, call_id: str) -> Decision:
    """The store's decision for this call, recorded: a recent duplicate looked up and a lease
    taken first where the guard asks for them, and a call in doubt checked first where its
    tool has a check. The store's ``begin`` is given the call's lease where it takes it in the
    same transaction (:class:`~guard.store.LeasesInBegin`), and timed while a span is open; its
    event goes to ``on_event``."""
    if eg.duplicate_window is not None:
        assert call.key is not None and eg.recent_calls is not None
        call.duplicate = earlier_call(eg.recent_calls, eg.duplicate_window, call_id, call.recorded_agent, call.key)
    if call.queue is not None:
        return queued_decision(call, eg, call_id, call.queue)
    leasing = eg.leasing
    if leasing is not None and call.holder is None:
        call.holder = leasing.take(call_id)
    while True:
        started = None if call.store_seconds is None else perf_counter()
        doubt: CallRecord | None = None
        try:
            holder = call.holder
            if holder is None or leasing is None or leasing.in_begin is None:
                decision = eg.store.begin(call_id, call.decide)
            else:
                decision = leasing.in_begin.begin(call_id, call.decide, lease=(holder, leasing.seconds))
        except NeedsCheck as e:  # nothing was appended
            doubt = e.record
        finally:
            if started is not None and call.store_seconds is not None:
                call.store_seconds += perf_counter() - started
        if doubt is None:
            break
        # The call is in doubt and its tool has a check: check first, then decide again.
        settling, check = eg.settling, call.tool.check
        assert settling is not None and check is not None
        call.checked = True
        reconcile_record(
            settling, doubt, check, call.holder,
            appended=None if eg.on_event is None else functools.partial(telemetry.deliver, eg.on_event))
    if eg.on_event is not None:
        telemetry.deliver(eg.on_event, decision.event)
    return decision
