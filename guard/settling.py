"""The guard's side of reconcilers: the check a retry runs on a call in doubt before it is refused
(``EffectGuard(reconcile_on_retry=True)``), and the settlement it appends."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from .canonical import to_json_value
from .leases import LeaseStore
from .reconcile import (
    DEFAULT_CHECK_TIMEOUT,
    Applied,
    Check,
    CheckFailed,
    NotApplied,
    Outcome,
    in_doubt_call,
    reconciler_actor,
    run_check,
    settlement,
)
from .store import CallRecord, EffectEvent, SettlingStore

__all__ = ["NeedsCheck", "reconcile_record", "settle_as"]

log = logging.getLogger("guard")
# How long a claim to check a call is held at least: the check's deadline and a margin.
_CLAIM_MARGIN = 5.0


class NeedsCheck(Exception):
    """Raised by a retry's decision, inside the store's begin, so that nothing is appended: the call
    is in doubt and its tool has a check, which runs before the retry is decided again."""

    def __init__(self, record: CallRecord) -> None:
        super().__init__(record.call_id)
        self.record = record


def settle_as(
    store: SettlingStore, record: CallRecord, verdict: Applied | NotApplied, actor: str,
    appended: Callable[[EffectEvent], Any] | None = None,
) -> int | None:
    """Append the event that settles ``record`` as ``verdict`` says, only if the call is still in
    the status and attempt of ``record``; returns its ``seq``, or None when the call moved on.
    ``appended`` is called with the event once it is stored."""
    value: str | None = None
    if isinstance(verdict, Applied) and verdict.has_value:
        value = to_json_value(verdict.value)
        if value is None:
            log.warning("the value %s gave for %s has no JSON form; it is settled without one", actor,
                        record.call_id)

    made: list[EffectEvent] = []

    def choose(current: CallRecord | None) -> EffectEvent | None:
        made.clear()
        if current is None or (current.status, current.attempt) != (record.status, record.attempt):
            return None
        made.append(settlement(current, verdict, actor, value))
        return made[0]

    seq = store.settle(record.call_id, choose)
    if seq is not None and made and appended is not None:
        appended(made[0])
    return seq


def reconcile_record(
    store: SettlingStore, record: CallRecord, check: Check, holder: str | None = None,
    timeout: float = DEFAULT_CHECK_TIMEOUT, run: Callable[..., Any] = run_check,
    appended: Callable[[EffectEvent], Any] | None = None,
) -> tuple[Outcome, str, int | None]:
    """Claim the call, run ``check`` on it and settle it as the check says.

    Returns ``(outcome, message, seq)``: outcome ``"applied"``, ``"not_applied"``,
    ``"still_unknown"``, ``"error"`` or ``"skipped"`` (the owner is alive, another check holds the
    call, or it moved on meanwhile). ``holder`` is the caller's own lease on the call, if it has one;
    else a claim is taken for the check and dropped after. ``appended`` is called with the event
    appended, once stored. A store's failure is raised.
    """
    call_id = record.call_id
    own = holder is not None
    holder = holder or uuid.uuid4().hex
    if isinstance(store, LeaseStore):
        if not store.claim_lease(call_id, holder, timeout + _CLAIM_MARGIN):
            return ("skipped", "its owner is alive (or, without a lease, not seen from here), or another check "
                    "holds it", None)
    elif record.status == "pending":
        return "skipped", "the store keeps no leases, so a pending call's owner cannot be told gone", None
    try:
        try:
            verdict = run(check, in_doubt_call(record), timeout)
        except CheckFailed as e:
            log.warning("reconciling %s: %s", call_id, e)
            return "error", str(e), None
        if verdict is None:
            log.info("reconciling %s: the check cannot tell yet", call_id)
            return "still_unknown", "the backend cannot tell yet", None
        seq = settle_as(store, record, verdict, reconciler_actor(check), appended)
        outcome: Outcome = "applied" if isinstance(verdict, Applied) else "not_applied"
        if seq is None:
            return "skipped", "the call moved on while it was checked", None
        return outcome, str(verdict.evidence), seq
    finally:
        if not own and isinstance(store, LeaseStore):
            try:
                store.drop_lease(call_id, holder)
            except Exception as e:
                log.warning("could not drop the claim on %s (it runs out by itself): %r", call_id, e)
