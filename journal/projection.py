"""The projection of the log: each call's current record, folded with the guard's one pure ``apply``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from guard.store import TRANSITIONS, CallRecord, EffectEvent, apply

from .events import JournalEvent

__all__ = ["fold", "fold_into", "fold_row", "record_row"]


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


def fold_row(records: dict[str, CallRecord], row: tuple[Any, ...]) -> None:
    """Fold one stored event row (columns of ``journal.rows.EVENT_COLUMNS``) into ``records``.

    ``apply`` never looks inside ``at``, ``error``, ``reason`` or ``owner``, it only carries them
    over; so their stored texts stand in for them here, and each folded record compares, field by
    field, with the projection row stored beside the log (see :func:`record_row`) without decoding
    a million events.
    """
    call_id = row[2]
    if call_id is None or row[3] not in TRANSITIONS:
        return
    event = EffectEvent(
        row[3], call_id, row[4], cast(Any, row[1]), row[5], row[6], row[7], row[8], cast(Any, row[9]),
        cast(Any, row[10]), row[11], row[12], cast(Any, row[13]), row[0],
    )
    record = apply(records.get(call_id), event, row[0])
    if record is not None:
        records[call_id] = record


def record_row(record: CallRecord) -> tuple[Any, ...]:
    """A record folded by :func:`fold_row` as a projection row (``journal.rows.CALL_COLUMNS``)."""
    return (
        record.call_id, record.tool, record.status, record.attempt, record.agent_id, record.idempotency_key,
        record.arguments, record.value, record.error, record.reason, record.actor, record.owner,
        record.created_at, record.updated_at, record.since, record.last_seq,
    )
