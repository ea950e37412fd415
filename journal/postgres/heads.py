"""The head of the log as a writer knows it, and events stamped so that no two of one process are alike."""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from guard.store import CallRecord, Decision, EffectEvent

from ..events import JournalEvent

if TYPE_CHECKING:
    from .store import PostgresJournal


class _InDoubt(Exception):
    """A one-statement append whose connection died before it answered, not found afterwards."""

    def __init__(self, event: JournalEvent) -> None:
        super().__init__(event.seq)
        self.event = event

@dataclass(frozen=True, slots=True)

class _Head:
    seq: int
    hash: str
    generation: int

_Seen = tuple[_Head, CallRecord | None]  # what a compare-and-set that failed found

# The time of the latest event this process stamped, through any PostgresJournal: the server-side
# append tells an event of one process from another by its fields, so no two may be alike.
_last_at: list[datetime] = []

_AT_LOCK = threading.Lock()

_MICROSECOND = timedelta(microseconds=1)

_JOURNALS: weakref.WeakSet[PostgresJournal] = weakref.WeakSet()

def _forked() -> None:
    """In a forked child, locks that a thread of the parent held at the fork are held for good."""
    global _AT_LOCK
    _AT_LOCK = threading.Lock()
    for journal in list(_JOURNALS):
        journal._lock = threading.Lock()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)

def _unique_at(event: EffectEvent) -> EffectEvent:
    """``event``, its time after that of every event this process stamped before: a time that is
    not (a clock that ticks coarsely, stands still in a test, or was set back) is moved to a
    microsecond after the last one, so no two events of one process are alike."""
    at = event.at.astimezone(UTC)  # as format_at reads it (a naive time is local)
    with _AT_LOCK:
        if _last_at and at <= _last_at[0]:
            at = _last_at[0] + _MICROSECOND
        _last_at[:] = [at]
    return event if at == event.at else replace(event, at=at)

def _uniquely_timed(decision: Decision) -> Decision:
    event = _unique_at(decision.event)
    return decision if event is decision.event else replace(decision, event=event)
