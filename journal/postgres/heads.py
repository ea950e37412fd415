"""What a writer knows of the calls it wrote, and events stamped so that no two of one process are alike."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from guard.store import CallRecord, Decision, EffectEvent

from .forks import fork_safe_lock

__all__ = ["Known", "unique_at", "uniquely_timed"]


# Calls whose record this object remembers from its own writes: a replay or a refusal of one of
# them, or its next attempt, is decided at once and appended in one round trip. A retry comes soon
# after its call; a few hundred records are a few hundred KiB for typical values.
_WRITTEN_CALLS = 512


class Known:
    """What a journal's own writes tell it of the log, so that its next write need not read first.

    The records of the calls it wrote lately are kept (each checked by the server to be still the
    call's when a write starts from it); :attr:`floor` is a seq at or before the log's head: every
    event sealed from now on comes after it. The records are forgotten when a connection is lost
    (the server may have lost what they name).
    """

    __slots__ = ("_lock", "_written", "floor")

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self._written: dict[str, tuple[CallRecord, int | None]] = {}
        self._lock = fork_safe_lock()

    def remember(self, call_id: str, record: CallRecord, generation: int | None) -> None:
        """This object's last write of ``call_id`` left its record ``record``, in the projection of
        ``generation`` (the head's, which a rebuild moves; None: not known)."""
        with self._lock:
            written = self._written
            written.pop(call_id, None)  # the newest last, so the oldest is the one let go
            written[call_id] = (record, generation)
            if len(written) > _WRITTEN_CALLS:
                del written[next(iter(written))]

    def written(self, call_id: str | None) -> tuple[CallRecord | None, int | None]:
        """The record this object last wrote for ``call_id`` and its generation, if it still
        remembers them (else None, None): it was current then, and the server checks that it still
        is (see server_append._APPEND_FN)."""
        if call_id is None:
            return None, None
        with self._lock:
            return self._written.get(call_id, (None, None))

    def moved(self, seq: int) -> None:
        """The log reached ``seq``: no event is sealed at or before it any more."""
        self.floor = max(self.floor, seq)

    def forget(self) -> None:
        """Forget the records: the next write of each call reads it."""
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
