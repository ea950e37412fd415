"""The projection of the log: each call's current record, folded with the guard's one pure ``apply``."""

from __future__ import annotations

from collections.abc import Iterable

from guard.store import CallRecord, EffectEvent, apply

from .events import JournalEvent

__all__ = ["fold", "fold_into"]


def fold_into(records: dict[str, CallRecord], event: EffectEvent | JournalEvent) -> None:
    """Fold one event (in ``seq`` order) into ``records``, keyed by call id."""
    call_id = event.call_id
    if call_id is None:
        return
    effect = event.to_effect_event() if isinstance(event, JournalEvent) else event
    record = apply(records.get(call_id), effect, effect.seq)
    if record is not None:
        records[call_id] = record


def fold(events: Iterable[EffectEvent | JournalEvent]) -> dict[str, CallRecord]:
    """The projection of a log given in ``seq`` order: ``{call_id: CallRecord}``.

    Each event's own ``seq`` becomes the record's ``last_seq``.
    """
    records: dict[str, CallRecord] = {}
    for event in events:
        fold_into(records, event)
    return records
