"""Verifying a journal: one algorithm for every SQL store, over the rows it has stored.

The log is read once in ``seq`` order: each row's hash is recomputed from its own stored fields
(:func:`journal.export.row_hash`), each link and each ``seq`` checked, and each row folded with
the guard's ``apply`` (:func:`journal.projection.fold_row`, on the stored texts). The projection is
then compared with that fold row by row, in call id order, as stored text: a row that the log
cannot have produced is told from one merely stale (:func:`compare_projection`). A store hands
over the rows of one read snapshot; what only one backend has to check (PostgreSQL's head row, a
SQLite file's own pages) it checks around this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from guard.store import CallRecord

from .chain import GENESIS, ChainCheck, ahead_of_log
from .events import VerifyReport
from .export import row_hash
from .projection import fold_row, record_row

__all__ = ["ADVANCE_EVERY", "ArchivedProjection", "HeldProjection", "check_log", "compare_projection", "verify_rows"]

ADVANCE_EVERY = 10_000  # events between two calls of a progress callback


class ArchivedProjection(Protocol):
    """The projection as of the last archive's head, as verify reads it."""

    def seed(self, folded: dict[str, CallRecord], call_id: str | None) -> None:
        """Put the archived record of ``call_id`` into ``folded`` before its first event is folded."""
        ...

    def rows(self, folded: dict[str, CallRecord]) -> Iterable[tuple[Any, ...]]:
        """The projection rows to compare with ``folded`` (in call id order); the archived record
        of a call the log did not touch is put into ``folded`` where it is needed."""
        ...


class HeldProjection:
    """An :class:`ArchivedProjection` from the archived rows held in memory, and the current
    projection's rows (in call id order) read when they are asked for."""

    def __init__(self, archived: Iterable[tuple[Any, ...]], current: Callable[[], Iterable[tuple[Any, ...]]]) -> None:
        self._archived = {row[0]: row for row in archived}
        self._current = current

    def seed(self, folded: dict[str, CallRecord], call_id: str | None) -> None:
        if call_id is not None and call_id not in folded:
            row = self._archived.pop(call_id, None)
            if row is not None:
                folded[call_id] = CallRecord(*row)

    def rows(self, folded: dict[str, CallRecord]) -> Iterator[tuple[Any, ...]]:
        archived = self._archived  # what is left: the calls the log did not touch
        for row in self._current():
            kept = archived.pop(row[0], None)
            if row[0] in folded or kept is None or tuple(kept) != tuple(row):
                if kept is not None:
                    folded.setdefault(row[0], CallRecord(*kept))
                yield row
        for call_id, row in archived.items():
            folded.setdefault(call_id, CallRecord(*row))


def verify_rows(
    events: Iterable[tuple[Any, ...]],
    calls: Callable[[], Iterable[tuple[Any, ...]]],
    *,
    start: tuple[int, str] = (0, GENESIS),
    archived: ArchivedProjection | None = None,
    advance: Callable[[int], None] | None = None,
) -> VerifyReport:
    """The report of a journal whose log holds ``events`` (stored rows in ``seq`` order, from the
    one after ``start``) and whose projection ``calls()`` gives (stored rows in call id order),
    read when the log has checked out. ``archived``: the projection as of ``start``, onto which the
    log is folded (a journal with archives). ``advance`` is told of each stretch of events checked."""
    check, folded = check_log(events, start=start, archived=archived, advance=advance)
    if not check.ok:
        return check.report()
    return compare_projection(check, folded, archived.rows(folded) if archived is not None else calls())


def check_log(
    events: Iterable[tuple[Any, ...]],
    *,
    start: tuple[int, str] = (0, GENESIS),
    archived: ArchivedProjection | None = None,
    advance: Callable[[int], None] | None = None,
) -> tuple[ChainCheck, dict[str, CallRecord]]:
    """The first half of :func:`verify_rows`: the chain of ``events`` checked, and the calls
    folded from them (onto ``archived``), to compare with the projection."""
    check = ChainCheck(start=start)
    folded: dict[str, CallRecord] = {}
    for row in events:
        if advance is not None and row[0] % ADVANCE_EVERY == 0:
            advance(ADVANCE_EVERY)
        try:
            expected = row_hash(row)
        except (ValueError, TypeError, AttributeError) as e:
            check.fail(row[0], f"seq {row[0]} has been altered: a stored field cannot be read ({e})")
            break
        if not check.feed(row[0], row[14], row[15], expected):
            break
        if archived is not None:
            archived.seed(folded, row[2])
        fold_row(folded, row)
    return check, folded


def compare_projection(
    check: ChainCheck, folded: dict[str, CallRecord], rows: Iterable[tuple[Any, ...]]
) -> VerifyReport:
    """The report of a log that checked out in ``check`` and folds to ``folded`` (emptied here),
    against its projection ``rows`` (:data:`~journal.rows.CALL_COLUMNS`, in call id order).

    A row the log cannot have produced (see :func:`journal.chain.ahead_of_log`) is named before
    any stale one: its problem says events may have been removed from the end, and does not advise
    a rebuild, which would erase it. A stale or edited row, or a missing one, advises a rebuild.
    """
    stale: tuple[int, str] | None = None
    for row in rows:
        expected = folded.pop(row[0], None)
        if expected is not None and record_row(expected) == tuple(row):
            continue
        ahead = ahead_of_log(str(row[0]), row[15], row[3], expected, check.last_seq)
        if ahead is not None:
            check.fail(row[15], ahead)
            return check.report()
        if stale is None:
            seq = expected.last_seq if expected is not None else row[15]
            stale = seq, f"the projection of call {row[0]!r} differs from the log; run rebuild"
    if stale is not None:
        check.fail(*stale)
    elif folded:
        call_id, record = min(folded.items(), key=lambda item: item[1].last_seq)
        check.fail(record.last_seq, f"the projection lacks call {call_id!r}; run rebuild")
    return check.report()
