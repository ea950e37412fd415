"""The head of the log as a writer knows it, and events stamped so that no two of one process are alike."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from guard.store import CallRecord, Decision, EffectEvent

from ..events import JournalEvent
from .forks import fork_safe_lock

__all__ = ["Head", "InDoubt", "Known", "Recent", "Seen", "unique_at", "uniquely_timed"]


class InDoubt(Exception):
    """A one-statement append whose connection died before it answered, not found afterwards."""

    def __init__(self, event: JournalEvent) -> None:
        super().__init__(event.seq)
        self.event = event


@dataclass(frozen=True, slots=True)
class Head:
    """The chain head row: the last event's seq and hash, and the generation a rebuild moves."""

    seq: int
    hash: str
    generation: int


Seen = tuple[Head, CallRecord | None]  # what a compare-and-set that failed found

# The head a write left, the call it wrote, that call's record then, and the hash of the record's
# last event where it is known.
Recent = tuple[Head, str | None, CallRecord | None, str | None]

# Calls whose record this object remembers from its own writes: a replay or a refusal of one of
# them, or its next attempt, is decided at once and appended in one round trip. A retry comes soon
# after its call; a few hundred records are a few hundred KiB for typical values.
_WRITTEN_CALLS = 512


class Known:
    """What a journal's own writes tell it of the log, so that its next write need not read first.

    :attr:`recent` is the head its last write left, with the call it wrote, that call's record and
    the hash of the record's last event (None: nothing known, the next write reads); the records of
    the calls it wrote lately are kept beside, each with the hash of its last event; :attr:`floor`
    is a seq at or before the head: every event appended from now on comes after it. All of it but
    the floor is forgotten when a connection is lost (the server may have lost what it names).
    """

    __slots__ = ("_lock", "_written", "floor", "recent")

    def __init__(self, floor: int) -> None:
        self.recent: Recent | None = None
        self.floor = floor
        self._written: dict[str, tuple[CallRecord, str]] = {}
        self._lock = fork_safe_lock()

    def remember(self, head: Head, call_id: str | None, record: CallRecord | None, known: bool,
                 last_hash: str | None) -> None:
        """This object's last write left ``head``, and the call's record ``record`` (when ``known``:
        a record not read is never remembered as the call's, so the next begin checks for one),
        whose last event has the hash ``last_hash`` (None: not known). The floor moves up to ``head``."""
        if head.seq > self.floor:
            self.floor = head.seq
        self.recent = (head, call_id, record, last_hash) if known else (head, None, None, None)
        if known and call_id is not None and record is not None and last_hash is not None:
            with self._lock:
                written = self._written
                written.pop(call_id, None)  # the newest last, so the oldest is the one let go
                written[call_id] = (record, last_hash)
                if len(written) > _WRITTEN_CALLS:
                    del written[next(iter(written))]

    def written(self, call_id: str) -> tuple[CallRecord, str] | None:
        """The record this object last wrote for ``call_id`` and the hash of its last event, if it
        still remembers them: it was current then, and is checked to be still (see sql._CAS_APPEND)."""
        with self._lock:
            return self._written.get(call_id)

    def record_of(self, call_id: str | None) -> tuple[bool, CallRecord | None, str | None]:
        """Whether this object wrote ``call_id`` last, the call's record as that write left it, and
        the hash of that record's last event where known; for a call this object wrote before,
        (False, its record then, that hash); else (False, None, None)."""
        recent = self.recent
        if recent is not None and call_id is not None and recent[1] == call_id:
            return True, recent[2], recent[3]
        written = self.written(call_id) if call_id is not None else None
        if written is not None:
            return False, *written
        return False, None, None

    def moved(self, seq: int) -> None:
        """The head reached ``seq``: no event comes at or before it any more."""
        self.floor = max(self.floor, seq)

    def forget(self) -> None:
        """Forget the head and the records: the next write reads them."""
        self.recent = None
        with self._lock:
            self._written.clear()


# The time of the latest event this process stamped, through any PostgresJournal: the server-side
# append tells an event of one process from another by its fields, so no two may be alike.
_last_at: list[datetime] = []

_AT_LOCK = fork_safe_lock()

_MICROSECOND = timedelta(microseconds=1)


def unique_at(event: EffectEvent) -> EffectEvent:
    """``event``, its time after that of every event this process stamped before: a time that is
    not (a clock that ticks coarsely, stands still in a test, or was set back) is moved to a
    microsecond after the last one, so no two events of one process are alike."""
    at = event.at.astimezone(UTC)  # as format_at reads it (a naive time is local)
    with _AT_LOCK:
        if _last_at and at <= _last_at[0]:
            at = _last_at[0] + _MICROSECOND
        _last_at[:] = [at]
    return event if at == event.at else replace(event, at=at)


def uniquely_timed(decision: Decision) -> Decision:
    event = unique_at(decision.event)
    return decision if event is decision.event else replace(decision, event=event)
