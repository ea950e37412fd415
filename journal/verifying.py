"""Verifying a journal: one algorithm for every SQL store, over the rows it has stored.

:func:`verify_log` reads the log twice, holding one event and one call at a time. First in ``seq``
order: each row's hash is recomputed from its own stored fields (:func:`journal.export.row_hash`),
each link and each ``seq`` checked (:func:`check_chain`). Then by call id: each call's events are
folded with the guard's ``apply`` (:func:`journal.projection.fold_calls`, on the stored texts) and
the record compared with the call's projection row, read in the same order, as stored text
(:func:`compare_calls`): a row that the log cannot have produced is told from one merely stale.

A journal with archives folds its log onto the projection as of the last archive's head, read by
call id beside the log (:func:`journal.projection.folded_onto`), one call at a time. A store hands
over the rows of one read snapshot; what only one backend has to check (PostgreSQL's head row, a
SQLite file's own pages) it checks around this.

Whichever way the calls are folded, they are compared with the projection by one function,
:func:`projection_problem`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from guard.store import TRANSITIONS, CallRecord, EffectEvent, apply

from .chain import GENESIS, ChainCheck, ahead_of_log
from .events import VerifyReport
from .export import hash_of_row, row_hash
from .projection import before, fold_row, record_row

__all__ = ["ADVANCE_EVERY", "check_chain", "check_log",
           "checked_calls", "compare_calls", "compare_projection", "lacks", "projection_problem", "row_problem",
           "verify_log", "verify_rows"]

ADVANCE_EVERY = 10_000  # events between two calls of a progress callback


def verify_rows(
    events: Iterable[tuple[Any, ...]],
    calls: Callable[[], Iterable[tuple[Any, ...]]],
    *,
    start: tuple[int, str] = (0, GENESIS),
    advance: Callable[[int], None] | None = None,
) -> VerifyReport:
    """The report of a journal whose log holds ``events`` (stored rows in ``seq`` order, from the
    one after ``start``) and whose projection ``calls()`` gives (stored rows in call id order),
    read when the log has checked out, every call folded into memory at once (the plain form of
    :func:`verify_log`). ``advance`` is told of each stretch of events checked."""
    check, folded = check_log(events, start=start, advance=advance)
    if not check.ok:
        return check.report()
    return compare_projection(check, folded, calls())


def check_log(
    events: Iterable[tuple[Any, ...]],
    *,
    start: tuple[int, str] = (0, GENESIS),
    advance: Callable[[int], None] | None = None,
) -> tuple[ChainCheck, dict[str, CallRecord]]:
    """The first half of :func:`verify_rows`: the chain of ``events`` checked, and the calls
    folded from them, to compare with the projection."""
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
        fold_row(folded, row)
    return check, folded


def compare_projection(
    check: ChainCheck, folded: dict[str, CallRecord], rows: Iterable[tuple[Any, ...]]
) -> VerifyReport:
    """The report of a log that checked out in ``check`` and folds to ``folded`` (emptied here),
    against its projection ``rows`` (:data:`~journal.rows.CALL_COLUMNS`, in call id order):
    :func:`projection_problem` of the folded calls put in the same order."""
    records = sorted(folded.values(), key=functools.cmp_to_key(_in_call_order))
    folded.clear()
    return compare_calls(check, records, rows)


def _in_call_order(a: CallRecord, b: CallRecord) -> int:
    return -1 if before(a.call_id, b.call_id) else 1 if before(b.call_id, a.call_id) else 0


def row_problem(
    row: tuple[Any, ...], expected: CallRecord | None, log_end: int
) -> tuple[bool, tuple[int | None, str]] | None:
    """What is wrong with the projection ``row`` of a call the log folds to ``expected`` (None:
    the log makes no record of it), whose last event is ``log_end``: None when nothing is; else
    ``(True, problem)`` for a row the log cannot have produced (see
    :func:`journal.chain.ahead_of_log`), named before any other, or ``(False, problem)`` for a row
    stale or edited. A problem is its seq and what it is."""
    if expected is not None and record_row(expected) == tuple(row):
        return None
    ahead = ahead_of_log(str(row[0]), row[15], row[3], expected, log_end)
    if ahead is not None:
        return True, (row[15], ahead)
    return False, (expected.last_seq if expected is not None else row[15],
                   f"the projection of call {row[0]!r} differs from the log; run rebuild")


def lacks(record: CallRecord) -> tuple[int, str]:
    """The problem of a projection that lacks the call folded to ``record``."""
    return record.last_seq, f"the projection lacks call {record.call_id!r}; run rebuild"


def verify_log(
    events: Iterable[tuple[Any, ...]],
    records: Callable[[], Iterable[CallRecord]],
    calls: Callable[[], Iterable[tuple[Any, ...]]],
    *,
    start: tuple[int, str] = (0, GENESIS),
    between: Callable[[ChainCheck], tuple[int | None, str] | None] | None = None,
    advance: Callable[[int], None] | None = None,
) -> VerifyReport:
    """The report of a journal, in bounded memory.

    ``events``: the stored rows of the log (:data:`~journal.rows.EVENT_COLUMNS`) in ``seq`` order,
    from the one after ``start``. Read once the chain has checked out, in one snapshot with it:
    ``records()``, each call folded from the log read by call id (:func:`journal.projection.fold_calls`,
    or :func:`journal.projection.folded_onto` a journal's projection as of its last archive), and
    ``calls()``, the projection rows (:data:`~journal.rows.CALL_COLUMNS`), both in the database's
    binary order of the ids (the order of Python's ``<`` on text; no id comes before ``NULL``,
    every number before any text); ``ValueError`` when a stream is out of order. ``between`` is
    given the chain once it has checked out, and names what the store itself finds wrong before
    the calls are compared (its seq, and what it is), or None. ``advance`` is told of each
    stretch of events checked.
    """
    check = check_chain(events, start=start, advance=advance)
    if not check.ok:
        return check.report()
    problem = between(check) if between is not None else None
    if problem is not None:
        check.fail(*problem)
        return check.report()
    return compare_calls(check, records(), calls())


def check_chain(
    events: Iterable[tuple[Any, ...]],
    *,
    start: tuple[int, str] = (0, GENESIS),
    advance: Callable[[int], None] | None = None,
) -> ChainCheck:
    """``events`` (stored rows in ``seq`` order, from the one after ``start``) checked: each hash
    recomputed, each link, no gap. The returned check names the first bad event, if any."""
    check = ChainCheck(start=start)
    last_seq, head = start
    good = 0  # events that checked out since the last one handed to the check
    for row in events:
        seq = row[0]
        if advance is not None and seq % ADVANCE_EVERY == 0:
            advance(ADVANCE_EVERY)
        try:
            expected = row_hash(row)
        except (ValueError, TypeError, AttributeError) as e:
            _catch_up(check, good, last_seq, head)
            check.fail(seq, f"seq {seq} has been altered: a stored field cannot be read ({e})")
            return check
        # The common case checked here; the check itself takes the last good event and any bad one.
        if seq == last_seq + 1 and type(seq) is int and row[14] == head and row[15] == expected:
            last_seq, head, good = seq, expected, good + 1
            continue
        _catch_up(check, good, last_seq, head)
        check.feed(seq, row[14], row[15], expected)
        return check
    _catch_up(check, good, last_seq, head)
    return check


def _catch_up(check: ChainCheck, good: int, last_seq: int, head: str) -> None:
    """Tell ``check`` of the ``good`` events that checked out, the last of them ``last_seq`` with ``head``."""
    if good:
        check.advance(good, last_seq, head)


def compare_calls(check: ChainCheck, records: Iterable[CallRecord], rows: Iterable[tuple[Any, ...]]) -> VerifyReport:
    """:func:`compare_projection` of a log that checked out in ``check``, with the calls folded from
    it given one at a time (``records``, in call id order) and the projection ``rows`` in the same
    order: the same problems, in the same precedence, holding one call at a time."""
    problem = projection_problem(records, rows, check.last_seq)
    if problem is not None:
        check.fail(*problem)
    return check.report()


def checked_calls(rows: Iterable[tuple[Any, ...]]) -> Iterator[CallRecord]:
    """The record of each call folded from ``rows`` (:data:`~journal.rows.EVENT_COLUMNS`, each
    call's rows together and in ``seq`` order: a log read by call id), every row's hash recomputed
    on the way. Holds one call at a time; rows without a call id are checked and fold to nothing.

    This is the check of :func:`check_chain` without the links (which need the log in ``seq``
    order: a store checks them apart, see :mod:`journal.sqlite.verify`) and the fold of
    :func:`journal.projection.fold_calls`, in one read of the log. ``ValueError`` names the first
    row, in this order, whose hash is not the one its fields give.
    """
    call_id: Any = _NOTHING
    record: CallRecord | None = None
    arguments: Any = _NOTHING  # the last arguments text hashed, and its digest: a call's rows share it
    digest: str | None = None
    sha256 = hashlib.sha256
    for row in rows:
        if row[7] != arguments:
            arguments = row[7]
            digest = None if arguments is None else sha256(arguments.encode()).hexdigest()
        if hash_of_row(row, digest) != row[15]:
            raise ValueError(f"seq {row[0]!r} has been altered: its hash is not the one its fields give")
        if row[2] != call_id:
            if record is not None:
                yield record
            call_id, record = row[2], None
        if row[3] in TRANSITIONS and call_id is not None:
            record = apply(record, EffectEvent(
                row[3], call_id, row[4], row[1], row[5], row[6], row[7], row[8], row[9], row[10], row[11], row[12],
                row[13], row[0],
            ), row[0])
    if record is not None:
        yield record


def projection_problem(
    records: Iterable[CallRecord], rows: Iterable[tuple[Any, ...]], log_end: int
) -> tuple[int | None, str] | None:
    """The first problem (its seq, and what it is) of the projection ``rows`` against the calls
    folded from the log (``records``), both in call id order; None when they are the same calls.

    A row the log cannot have produced (see :func:`journal.chain.ahead_of_log`; ``log_end`` is the
    seq of the log's last event) is named before any stale one: its problem does not advise a
    rebuild, which would erase it. Then the first stale or edited row, in call id order; then the
    call the projection lacks whose last event came first. Raises ``ValueError`` when either stream
    is out of order (the merge would then compare calls that are not the same).
    """
    folded = iter(records)
    record = next(folded, None)
    lacking: CallRecord | None = None  # of the folded calls without a row, the one whose last event came first
    stale: tuple[int | None, str] | None = None
    previous: Any = _NOTHING
    for row in rows:
        call_id = row[0]
        if previous is not _NOTHING and before(call_id, previous):
            raise ValueError(f"the projection rows are not in call id order ({previous!r}, then {call_id!r})")
        previous = call_id
        while record is not None and before(record.call_id, call_id):
            if lacking is None or record.last_seq < lacking.last_seq:
                lacking = record
            record = _next_in_order(folded, record)
        expected = None
        if record is not None and record.call_id == call_id:
            expected, record = record, _next_in_order(folded, record)
        found = row_problem(row, expected, log_end)
        if found is not None:
            ahead, problem = found
            if ahead:
                return problem
            stale = stale or problem
    while record is not None:
        if lacking is None or record.last_seq < lacking.last_seq:
            lacking = record
        record = _next_in_order(folded, record)
    if stale is not None:
        return stale
    return lacks(lacking) if lacking is not None else None


_NOTHING = object()


def _next_in_order(folded: Iterator[CallRecord], record: CallRecord) -> CallRecord | None:
    """The call folded after ``record``; ``ValueError`` when it does not come after it."""
    following = next(folded, None)
    if following is not None and not before(record.call_id, following.call_id):
        raise ValueError(f"the log's events are not in call id order ({record.call_id!r}, then "
                         f"{following.call_id!r})")
    return following
