"""``airlock journal stats --format prometheus``: the journal's calls, and the ones in doubt, in the
Prometheus text exposition format, for a node exporter's textfile collector."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from guard.store import CallRecord, utc_now

__all__ = ["JournalGauges", "escape_label", "read_gauges", "render_gauges"]

STATUSES = ("pending", "committed", "unknown", "released")

# name, help: each family's HELP line says what its samples count.
_CALLS = ("airlock_calls", "Calls in the effect journal, by status and tool.")
_EVENTS = ("airlock_events", "Events in the effect journal's log.")
_IN_DOUBT = ("airlock_calls_in_doubt",
             "Calls whose effect is in doubt: unknown, or pending with the owner gone; "
             "settle them with airlock journal resolve.")
_OLDEST = ("airlock_oldest_in_doubt_age_seconds",
           "Seconds since the oldest call in doubt entered its status; 0 when none is.")
_APPROVALS = ("airlock_approvals_open",
              "Requests for approval waiting for an operator's decision; decide them with airlock journal "
              "approve or deny.")
_OLDEST_APPROVAL = ("airlock_oldest_open_approval_age_seconds",
                    "Seconds since the oldest open request for approval was made; 0 when none is open.")


@dataclass(frozen=True, slots=True)
class JournalGauges:
    """What the text reports: calls by (status, tool), events, the calls in doubt, and when the
    oldest of them entered its status (None when none is)."""

    calls: dict[tuple[str, str], int]
    events: int
    in_doubt: int
    oldest_in_doubt: datetime | None
    approvals_open: int = 0
    oldest_open_approval: datetime | None = None


def read_gauges(j: Any) -> JournalGauges:
    """The gauges of journal ``j`` (SQLite or PostgreSQL).

    The calls that are not committed are read one by one (a pending call's owner decides whether it
    is in doubt); the committed ones are counted, as each tool's calls less those. The calls are
    read first and the counts after them, so under writers a call that changes status in between
    is counted in one status or the other, and no count is ever below zero.
    """
    unsettled: list[CallRecord] = j.calls(status=("pending", "unknown", "released"), limit=None)
    pending = [r for r in unsettled if r.status == "pending"]
    # The same owner test as `show`: a live lease, or a running process on this host without one.
    states = j.owner_states(pending)
    stats = j.stats()
    calls: dict[tuple[str, str], int] = {(status, tool): 0 for tool in stats.by_tool for status in STATUSES}
    for record in unsettled:
        calls[(record.status, record.tool)] = calls.get((record.status, record.tool), 0) + 1
    for tool, count in stats.by_tool.items():
        others = sum(calls[(status, tool)] for status in STATUSES if status != "committed")
        calls[("committed", tool)] = max(count - others, 0)
    doubtful = [r for r in unsettled
                if r.status == "unknown" or (r.status == "pending" and not states[r.call_id].alive)]
    oldest = min((r.since for r in doubtful), default=None)
    return JournalGauges(calls=calls, events=stats.events, in_doubt=len(doubtful), oldest_in_doubt=oldest,
                         approvals_open=stats.approvals_open, oldest_open_approval=stats.oldest_open_approval_at)


def escape_label(value: str) -> str:
    """A label value as the text format writes it between double quotes."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name_help: tuple[str, str], samples: Iterable[str]) -> list[str]:
    name, text = name_help
    return [f"# HELP {name} {text}", f"# TYPE {name} gauge", *samples]


def render_gauges(gauges: JournalGauges, now: datetime | None = None) -> str:
    """The text format of ``gauges``, each family with its ``# HELP`` and ``# TYPE`` lines; ends with
    a line feed. ``now`` (default: the time now) dates the age of the oldest call in doubt."""
    now = now or utc_now()
    age = 0.0
    if gauges.oldest_in_doubt is not None:
        age = max((now - gauges.oldest_in_doubt).total_seconds(), 0.0)
    asked = 0.0
    if gauges.oldest_open_approval is not None:
        asked = max((now - gauges.oldest_open_approval).total_seconds(), 0.0)
    calls = (f'{_CALLS[0]}{{status="{escape_label(status)}",tool="{escape_label(tool)}"}} {count}'
             for (status, tool), count in sorted(gauges.calls.items(), key=lambda item: (item[0][1], item[0][0])))
    lines = [
        *_family(_CALLS, calls),
        *_family(_EVENTS, [f"{_EVENTS[0]} {gauges.events}"]),
        *_family(_IN_DOUBT, [f"{_IN_DOUBT[0]} {gauges.in_doubt}"]),
        *_family(_OLDEST, [f"{_OLDEST[0]} {age:.3f}"]),
        *_family(_APPROVALS, [f"{_APPROVALS[0]} {gauges.approvals_open}"]),
        *_family(_OLDEST_APPROVAL, [f"{_OLDEST_APPROVAL[0]} {asked:.3f}"]),
    ]
    return "\n".join(lines) + "\n"
