"""What the console's pages read, composed from the :class:`~journal.Journal` API alone (no SQL here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from guard.approvals import ApprovalRequest
from guard.leases import OwnerState
from guard.store import CallRecord, utc_now
from journal import Journal
from journal.events import JournalEvent
from journal.projection import fold

__all__ = ["CallPage", "Doubt", "approval_page", "call_and_events", "event_at", "in_doubt", "list_calls"]

# More rows than any journal holds, and within the 64-bit integers SQL takes for LIMIT and OFFSET.
MOST = 2**62


@dataclass(frozen=True, slots=True)
class CallPage:
    """One page of calls, newest first, with the owner state of each pending one; ``more``: a
    next page has at least one call."""

    records: list[CallRecord]
    states: dict[str, OwnerState]
    more: bool


def list_calls(
    j: Journal, *, status: str | None, tool: str | None, agent_id: str | None, owner: str | None,
    since: datetime | None, offset: int, limit: int,
) -> CallPage:
    """The calls that match, ``limit`` of them after the first ``offset``.

    ``owner`` (``"alive"`` or ``"gone"``) keeps the pending calls whose owner is so, as the
    journal judges it (``owner_states``): every pending call that matches the other filters is
    read to tell, and the page is cut from those.
    """
    if owner is not None:
        if status not in (None, "pending"):
            return CallPage([], {}, False)
        pending = j.calls(status="pending", tool=tool, agent_id=agent_id, since=since, limit=None)
        states = j.owner_states(pending)
        wanted = owner == "alive"
        kept = [r for r in pending if bool(states[r.call_id].alive) == wanted]
        shown = kept[offset:offset + limit]
        return CallPage(shown, {r.call_id: states[r.call_id] for r in shown}, len(kept) > offset + limit)
    # One more than shown tells whether there is a next page.
    records = j.calls(status=status, tool=tool, agent_id=agent_id, since=since, limit=min(limit, MOST) + 1,
                      offset=min(offset, MOST))
    shown = records[:limit]
    return CallPage(shown, j.owner_states(shown), len(records) > limit)


@dataclass(frozen=True, slots=True)
class Doubt:
    """The calls in doubt (unknown, and pending whose owner is gone), oldest in doubt first, and
    how many pending calls have a live owner (running, not in doubt)."""

    calls: list[CallRecord]
    states: dict[str, OwnerState]
    running: int

    @property
    def oldest(self) -> datetime | None:
        return self.calls[0].since if self.calls else None


def in_doubt(j: Journal) -> Doubt:
    """The calls in doubt, as ``stats --format prometheus`` counts them."""
    unsettled = j.calls(status=("pending", "unknown"), limit=None)
    pending = [r for r in unsettled if r.status == "pending"]
    states = j.owner_states(pending)
    doubtful = [r for r in unsettled if r.status == "unknown" or not states[r.call_id].alive]
    doubtful.sort(key=lambda r: (r.since, r.call_id))
    return Doubt(doubtful, {r.call_id: states[r.call_id] for r in doubtful if r.call_id in states},
                 len(pending) - sum(1 for r in doubtful if r.status == "pending"))


def call_and_events(j: Journal, call_id: str) -> tuple[CallRecord | None, list[JournalEvent]]:
    """The call's record and its events as of one moment, while writers go on (as ``show CALL_ID``
    reads them): the record read before and after the events agrees, or the events are folded."""
    for _ in range(10):
        before = j.call(call_id)
        events = j.call_events(call_id)
        after = j.call(call_id)
        if before == after:
            return after, events
    return fold(events).get(call_id), events


def event_at(j: Journal, seq: int) -> JournalEvent | None:
    """The event at ``seq``, or None (none there, or archived away)."""
    if seq < 1:
        return None
    events = j.events(after_seq=seq - 1)
    try:
        event = next(events, None)
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
    return event if event is not None and event.seq == seq else None


def approval_page(
    j: Journal, *, status: str | None, tool: str | None, offset: int, limit: int,
) -> tuple[list[ApprovalRequest], bool]:
    """A page of requests for approval: of ``status`` newest first, or (no status) every open one
    first, then the others, newest first. Returns the page and whether more follow."""
    if status is not None:
        found = j.approval_requests(status=status, tool=tool, limit=min(limit, MOST) + 1, offset=min(offset, MOST))
        return found[:limit], len(found) > limit
    opened = j.approval_requests(status="open", tool=tool, limit=None)
    wanted = offset + limit + 1
    others: list[ApprovalRequest] = []
    if wanted > len(opened):
        # The newest requests of every status, enough of them to hold the decided ones this page needs.
        every = j.approval_requests(tool=tool, limit=min(wanted + len(opened), MOST))
        others = [r for r in every if r.status != "open"]
    ordered = [*opened, *others]
    return ordered[offset:offset + limit], len(ordered) > offset + limit


def overdue(requests: Sequence[ApprovalRequest], now: datetime | None = None) -> set[str]:
    """The ids of the requests open past their expiry: expired, though no event says so yet."""
    now = now or utc_now()
    return {r.request_id for r in requests if r.overdue(now)}
