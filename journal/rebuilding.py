"""Folding the log again: the rows ``rebuild`` writes (those that differ from the fold, found one
call at a time), and one call for a write that does not trust its row; written once for both SQL
journals."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

from guard.store import CallRecord

from .projection import before, fold_calls, fold_into, folded_onto, in_order, record_row
from .rows import event_from_row, record_from_row
from .verifying import ADVANCE_EVERY

__all__ = ["ByCall", "Decoding", "as_logged", "changes", "checked_row"]

log = logging.getLogger("journal")

T = TypeVar("T")


class Decoding(Protocol):
    """A store's ``_decoded``: ``decode(row)``, a row that cannot be read raised as the journal's error."""

    def __call__(self, decode: Callable[[Any], T], row: Any) -> T: ...


class ByCall:
    """The calls folded from a log read by call id (rows of :data:`~journal.projection.FOLD_COLUMNS`,
    the kinds that change no record left out), onto ``seeds`` when the journal has archives (see
    :func:`journal.projection.folded_onto`), counting the events folded for a progress bar and the
    calls: :meth:`records` yields them, :meth:`done` tells ``advance`` of the rest of the log."""

    def __init__(self, rows: Iterable[tuple[Any, ...]], advance: Callable[[int], None] | None,
                 seeds: Iterable[tuple[Any, ...]] | None = None) -> None:
        self._rows = rows
        self._advance = advance
        self._seeds = seeds  # the projection as of the start of the log, for a journal with archives
        self.folded = 0  # events folded so far
        self.calls = 0

    def records(self) -> Iterator[CallRecord]:
        rows = self._counted()
        for record in fold_calls(rows) if self._seeds is None else folded_onto(self._seeds, rows):
            self.calls += 1
            yield record

    def _counted(self) -> Iterator[tuple[Any, ...]]:
        advance = self._advance
        for row in self._rows:
            self.folded += 1
            if advance is not None and self.folded % ADVANCE_EVERY == 0:
                advance(ADVANCE_EVERY)
            yield row

    def done(self, events: int) -> None:
        """Tell ``advance`` of the ``events`` of the log not yet told of (the kinds not read among them)."""
        told = self.folded - self.folded % ADVANCE_EVERY
        if self._advance is not None and events > told:
            self._advance(events - told)


def changes(
    records: Iterable[CallRecord], rows: Iterable[tuple[Any, ...]], decoded: Decoding
) -> Iterator[tuple[Any, tuple[Any, ...] | None]]:
    """What makes the projection ``rows`` the fold ``records`` (both in the database's call id
    order, as :func:`journal.verifying.projection_problem` takes them), one call at a time:
    ``(call_id, row)`` for a call whose row is missing or differs (the row it must have), and
    ``(call_id, None)`` for a row the log makes no record of. Each folded row is read back as a
    record through ``decoded`` (the store's, which names the journal when a field cannot be
    read); ``ValueError`` when either stream is out of order."""
    folded = in_order(records, lambda record: record.call_id, "the log's events")
    record = next(folded, None)
    for stored in in_order(rows, lambda row: row[0], "the projection rows"):
        call_id = stored[0]
        while record is not None and before(record.call_id, call_id):
            yield record.call_id, decoded(checked_row, record)
            record = next(folded, None)
        if record is not None and record.call_id == call_id:
            row = decoded(checked_row, record)
            if row != tuple(stored):
                yield call_id, row
            record = next(folded, None)
        else:
            yield call_id, None
    while record is not None:
        yield record.call_id, decoded(checked_row, record)
        record = next(folded, None)


def checked_row(record: CallRecord) -> tuple[Any, ...]:
    """The projection row of a record folded on stored texts, once it reads back as a record."""
    row = record_row(record)
    record_from_row(row)
    return row


def as_logged(call_id: str, record: CallRecord | None, kept: CallRecord | None, events: Iterable[tuple[Any, ...]],
              decoded: Decoding, journal: str) -> CallRecord | None:
    """The record of ``call_id`` folded from its ``events`` (stored rows, in ``seq`` order) onto
    ``kept`` (its row as of the start of the log, kept by an archive), where its projection row
    says ``record``: the record a write decides on when the row would let the call run (none, or
    ``released``) and the log has state-changing events of it. A difference is logged."""
    folded = {} if kept is None else {call_id: kept}
    for row in events:
        fold_into(folded, decoded(event_from_row, row))
    logged = folded.get(call_id)
    if logged is None:  # the log makes no record of it either (an outcome with no pending): none to trust
        return record
    if logged != record:
        log.warning("the projection row of the call %r in the journal %s (%s) differs from its log (%s): the log "
                    "decides; run verify, and rebuild", call_id, journal, "none" if record is None else record.status,
                    logged.status)
    return logged
