"""Re-planned copies: a call with a new ``tool_call_id`` that repeats a recent call of its agent.

A model that loses patience (a slow tool, a timeout it was shown) may ask for the same call again
under a new id. With ``EffectGuard(duplicate_window=N)`` such a call, whose idempotency key matches a
call of the same ``agent_id`` begun within N seconds and not ``released``, is answered as that
earlier call would answer a retry of itself: its stored value (``replayed``), or the refusal its
doubt gets (``refused``); each event on the new id with ``reason = {"code": "duplicate_of",
"message": <the earlier call's id>}``. The tool does not run.

The lookup is a store's optional ``recent_call(agent_id, idempotency_key, since)``
(:class:`~guard.store.RecentCalls`); a store without it cannot be given a window (``EffectGuard``
says so when it is made).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from .store import (
    GUARD_ACTOR,
    CallRecord,
    Decision,
    EffectEvent,
    RecentCalls,
    Verdict,
    current_owner,
    format_at,
    utc_now,
)

__all__ = ["DUPLICATE_OF", "decide_duplicate", "earlier_call"]

DUPLICATE_OF = "duplicate_of"


def earlier_call(
    store: RecentCalls, window: float, call_id: str, agent_id: str | None, key: str, now: datetime | None = None
) -> CallRecord | None:
    """The most recent call of ``agent_id`` with idempotency key ``key`` begun within ``window``
    seconds and not released, other than ``call_id`` itself; None when there is none."""
    since = (now or utc_now()) - timedelta(seconds=window)
    record = store.recent_call(agent_id, key, since)
    if record is None or record.call_id == call_id:
        return None
    return record


def decide_duplicate(
    earlier: CallRecord, call_id: str, tool: str, key: str, arguments: str, agent_id: str | None
) -> Decision:
    """The answer to ``call_id``, a copy of ``earlier``: a REPLAY of its value, or a REFUSE.

    The event (``replayed`` or ``refused``) is on ``call_id`` and names ``earlier`` in its reason;
    the decision's ``record`` is ``earlier``, whose value a replay returns.
    """
    reason = {"code": DUPLICATE_OF, "message": earlier.call_id}
    kind = "replayed" if earlier.status == "committed" and earlier.value is not None else "refused"
    event = EffectEvent(
        kind, call_id, tool, utc_now(), agent_id, key, arguments, None, None, reason, GUARD_ACTOR,
        earlier.attempt, current_owner(),
    )
    if kind == "replayed":
        return Decision(Verdict.REPLAY, event, earlier)
    details: dict[str, Any] = {
        DUPLICATE_OF: earlier.call_id, "status": earlier.status, "idempotency_key": key,
        "attempt": earlier.attempt,
    }
    if earlier.status == "committed":
        return Decision(
            Verdict.REFUSE, event, earlier, "replay_value_unavailable",
            f"This call repeats the call {earlier.call_id!r} (the same tool and arguments), which already took "
            "effect, but its result was not stored, so it cannot be returned; it will not be run again.",
            details,
        )
    details["since"] = format_at(earlier.since)
    return Decision(
        Verdict.REFUSE, event, earlier, "effect_status_unknown",
        f"This call repeats the call {earlier.call_id!r} (the same tool and arguments), which is "
        f"{earlier.status} and may have taken effect: do not retry it; ask the backend whether idempotency "
        f"key {key} was applied.",
        details,
    )
