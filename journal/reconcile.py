"""``journal.reconcile(checks)``: the checks of the calls in doubt, run once for both journals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol

from guard.leases import LeaseStore
from guard.reconcile import (
    DEFAULT_CHECK_TIMEOUT,
    Applied,
    Check,
    CheckFailed,
    Outcome,
    ReconcileResult,
    in_doubt_call,
    run_check,
)
from guard.settling import reconcile_record
from guard.store import CallRecord, EffectStore, utc_now

__all__ = ["Reconcilable", "Reconciler", "in_doubt"]

_IN_DOUBT = ("pending", "unknown")


def _older_than(older_than: timedelta | float | None) -> timedelta | None:
    if older_than is None:
        return None
    if isinstance(older_than, timedelta):
        age = older_than
    elif isinstance(older_than, int | float) and not isinstance(older_than, bool):
        age = timedelta(seconds=older_than)
    else:
        raise TypeError(f"older_than is a timedelta or a number of seconds, not {older_than!r}")
    if age < timedelta(0):
        raise ValueError(f"older_than is not negative, not {older_than!r}")
    return age


def in_doubt(journal: Any, tool: str | None = None, older_than: timedelta | float | None = None) -> list[CallRecord]:
    """The calls of ``journal`` in doubt (pending or unknown), oldest first: of ``tool`` when given,
    in doubt for longer than ``older_than`` when given."""
    age = _older_than(older_than)
    records: list[CallRecord] = journal.calls(status=list(_IN_DOUBT), tool=tool, limit=None)
    if age is not None:
        cutoff: datetime = utc_now() - age
        records = [r for r in records if r.since <= cutoff]
    return sorted(records, key=lambda r: (r.since, r.call_id))


class Reconcilable(EffectStore, LeaseStore, Protocol):
    """What ``reconcile`` asks of a journal: its calls, its leases and ``settle``."""

    def calls(
        self, *, status: str | Sequence[str] | None = None, tool: str | None = None, limit: int | None = 50,
    ) -> list[CallRecord]: ...


class Reconciler:
    """``reconcile`` on ``journal`` (a store's facade, whose parts give it calls, leases and ``settle``)."""

    def __init__(self, journal: Reconcilable) -> None:
        self._journal = journal

    def reconcile(
        self,
        checks: Mapping[str, Check],
        *,
        tool: str | None = None,
        older_than: timedelta | float | None = None,
        dry_run: bool = False,
        timeout: float = DEFAULT_CHECK_TIMEOUT,
    ) -> list[ReconcileResult]:
        """Run each call in doubt past its tool's check, oldest first, and settle it as the check says.

        ``checks`` maps a tool's name to its check. A call whose owner is alive is never given to a
        check (``"skipped"``), nor one of a tool without a check. An outcome is appended only if the
        call is still in the status and attempt the check was given (``"skipped"`` otherwise), with
        the actor ``reconciler:NAME``. ``dry_run`` asks the checks and appends nothing. ``timeout``:
        seconds a check may take before it counts as an ``"error"``. Raises the journal's error when
        the journal cannot be used; a check's failure is its call's result, never raised.
        """
        if not isinstance(checks, Mapping) or not all(callable(c) for c in checks.values()):
            raise TypeError("checks is a mapping of tool name to check (a function of an InDoubtCall)")
        journal = self._journal
        records = in_doubt(journal, tool, older_than)
        states = journal.owner_states([r for r in records if r.status == "pending"])
        results: list[ReconcileResult] = []
        for record in records:
            check = checks.get(record.tool)
            state = states.get(record.call_id)
            if check is None:
                results.append(ReconcileResult(record.call_id, record.tool, "skipped",
                                               f"no check for the tool {record.tool!r}"))
            elif state is not None and state.alive:
                results.append(ReconcileResult(record.call_id, record.tool, "skipped",
                                               "its owner is alive: the tool may still be running"))
            elif dry_run:
                results.append(_asked(record, check, timeout))
            else:
                outcome, message, seq = reconcile_record(journal, record, check, timeout=timeout)
                results.append(ReconcileResult(record.call_id, record.tool, outcome, message, seq))
        return results


def _asked(record: CallRecord, check: Check, timeout: float) -> ReconcileResult:
    """A dry run's result: what the check says, nothing appended."""
    try:
        verdict = run_check(check, in_doubt_call(record), timeout)
    except CheckFailed as e:
        return ReconcileResult(record.call_id, record.tool, "error", str(e))
    if verdict is None:
        return ReconcileResult(record.call_id, record.tool, "still_unknown", "the backend cannot tell yet")
    outcome: Outcome = "applied" if isinstance(verdict, Applied) else "not_applied"
    return ReconcileResult(record.call_id, record.tool, outcome, str(verdict.evidence))


def tools_without_calls(journal: Any, tools: Sequence[str]) -> list[str]:
    """Those of ``tools`` of which the journal has no call at all."""
    return [t for t in tools if not journal.calls(tool=t, limit=1)]
