"""The projection of the log: each call's current record, folded with the guard's one pure ``apply``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

from guard.store import TRANSITIONS, CallRecord, EffectEvent, apply

from .events import JournalEvent

T = TypeVar("T")

__all__ = ["FOLD_COLUMNS", "before", "fold", "fold_calls", "fold_into", "fold_row", "folded_onto", "in_order",
           "record_row"]

# The event columns a fold reads, in the order of EffectEvent's fields (so a row is an event's arguments).
FOLD_COLUMNS = ("kind", "call_id", "tool", "at", "agent_id", "idempotency_key", "arguments", "value", "error",
                "reason", "actor", "attempt", "owner", "seq")


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


def fold_calls(rows: Iterable[tuple[Any, ...]]) -> Iterator[CallRecord]:
    """The record of each call, folded from its events: ``rows`` of :data:`FOLD_COLUMNS`, each
    call's rows together and in ``seq`` order (a log read by call id). Holds one call at a time;
    a call whose events make no record (an outcome with no ``pending``) gives none.

    As in :func:`fold_row`, the stored texts stand in for ``at``, ``error``, ``reason`` and ``owner``.
    """
    return folded_onto((), rows)


def folded_onto(seeds: Iterable[tuple[Any, ...]], rows: Iterable[tuple[Any, ...]]) -> Iterator[CallRecord]:
    """:func:`fold_calls` onto a projection as of the start of the log (a
    journal with archives): each call's events (``rows`` of
    :data:`FOLD_COLUMNS`, read by call id) folded onto its row in ``seeds``
    (projection rows as stored, in the same call id order) when it has one; a row of ``seeds``
    that no event moves is its own record. Holds one call at a time; ``ValueError`` when either
    stream is out of order."""
    seeded = in_order(seeds, lambda seed: seed[0], "the archived projection rows")
    seed = next(seeded, None)
    call_id: Any = _NOTHING
    record: CallRecord | None = None
    for row in rows:
        if row[1] != call_id:
            if record is not None:
                yield record
            call_id, record = row[1], None
            while seed is not None and before(seed[0], call_id):
                yield CallRecord(*seed)
                seed = next(seeded, None)
            if seed is not None and seed[0] == call_id:
                record, seed = CallRecord(*seed), next(seeded, None)
        if call_id is not None:
            record = apply(record, EffectEvent(*row), row[13])
    if record is not None:
        yield record
    while seed is not None:
        yield CallRecord(*seed)
        seed = next(seeded, None)


def _rank(call_id: Any) -> tuple[int, Any]:
    """Where a call id stands in the database's order: NULL, then numbers, then text, then bytes."""
    if call_id is None:
        return 0, 0
    if isinstance(call_id, int | float):
        return 1, call_id
    return (2, call_id) if isinstance(call_id, str) else (3, bytes(call_id))


def before(a: Any, b: Any) -> bool:
    """Whether call id ``a`` comes before ``b`` in the database's order."""
    if type(a) is str and type(b) is str:
        return a < b
    return _rank(a) < _rank(b)


def in_order(items: Iterable[T], key: Callable[[T], Any], what: str) -> Iterator[T]:
    """``items`` as they come; ``ValueError`` naming ``what`` once the ``key`` (a call id) of one
    does not come after the one before, in the database's order."""
    previous: Any = _NOTHING
    for item in items:
        call_id = key(item)
        if previous is not _NOTHING and not before(previous, call_id):
            raise ValueError(f"{what} are not in call id order ({previous!r}, then {call_id!r})")
        previous = call_id
        yield item



_NOTHING = object()


def record_row(record: CallRecord) -> tuple[Any, ...]:
    """A record folded by :func:`fold_row` as a projection row (``journal.rows.CALL_COLUMNS``)."""
    return (
        record.call_id, record.tool, record.status, record.attempt, record.agent_id, record.idempotency_key,
        record.arguments, record.value, record.error, record.reason, record.actor, record.owner,
        record.created_at, record.updated_at, record.since, record.last_seq,
    )
