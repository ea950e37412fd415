"""Folding the log again: the whole projection for ``rebuild``, one call for a write that does not
trust its row; written once for both SQL journals."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from guard.store import CallRecord

from .projection import fold_into
from .rows import call_row, event_from_row, record_from_row
from .verifying import ADVANCE_EVERY

__all__ = ["Decoding", "as_logged", "refold"]

log = logging.getLogger("journal")

T = TypeVar("T")


class Decoding(Protocol):
    """A store's ``_decoded``: ``decode(row)``, a row that cannot be read raised as the journal's error."""

    def __call__(self, decode: Callable[[Any], T], row: Any) -> T: ...


def refold(
    snapshot: Iterable[tuple[Any, ...]],
    events: Iterable[tuple[Any, ...]],
    decoded: Decoding,
    advance: Callable[[int], None] | None = None,
) -> list[tuple[Any, ...]]:
    """The projection rows of the log ``events`` (stored rows, in ``seq`` order) folded onto
    ``snapshot`` (the stored projection as of the last archive's head; none without one), each
    event decoded through ``decoded`` (the store's, which names the journal when a row cannot be
    read). ``advance`` is told of each stretch of events folded."""
    folded: dict[str, CallRecord] = {row[0]: decoded(record_from_row, row) for row in snapshot}
    for row in events:
        if advance is not None and row[0] % ADVANCE_EVERY == 0:
            advance(ADVANCE_EVERY)
        fold_into(folded, decoded(event_from_row, row))
    return [call_row(record) for record in folded.values()]


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
