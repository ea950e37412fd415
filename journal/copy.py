"""Copy a journal to another store (SQLite to PostgreSQL, or back), preserving every ``seq`` and hash.

The stored events are inserted as they are, the projection is recomputed by the fold (replacing any
rows the destination's projection held), and the copy is verified: its chain must check and its
head must equal the source's. The destination is verified inside the import's transaction, before
it commits, so a copy that does not verify leaves it as it was. The destination must hold no
events; the source is only read. A destination the copy made (a new SQLite file, or the journal's
tables in a PostgreSQL database that held none) is removed again when the copy fails.

A source whose start is archived (``airlock journal archive``) is copied as it is: its archives'
records (the archived head), the projection as of that head (and the requests for approval as of
it), then the rest of the log, whose fold onto that projection is the copy's projection; so the
copy verifies alone, goes on from the same archives (``verify --export A1 ... --db COPY``), and
keeps every call's row, so that a retry of an archived call is still replayed or refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from guard.store import CallRecord

from . import archive
from .errors import JournalError, JournalNotFound
from .events import JournalEvent, VerifyReport
from .open import open_journal, remove_made
from .projection import fold_row
from .protocol import EventImporter, Journal

__all__ = ["CopyReport", "copy_from", "copy_journal", "import_events"]


@dataclass(frozen=True, slots=True)
class CopyReport:
    """What was copied: ``events``, ``calls`` (projection rows) and the ``head`` hash both share;
    ``archived``: the ``seq`` the source's log starts after (its archived head, kept in the copy),
    0 when nothing was archived."""

    events: int
    calls: int
    head: str
    archived: int = 0


def _bounded(events: Iterable[JournalEvent], last_seq: int,
             progress: Callable[[int], None] | None) -> Iterator[JournalEvent]:
    """The source's events up to ``last_seq`` (a writer's later events are not part of the copy)."""
    for event in events:
        if event.seq > last_seq:
            return
        yield event
        if progress is not None:
            progress(1)


def _check_chain(events: Iterable[JournalEvent]) -> Iterator[JournalEvent]:
    """Pass the events through, refusing one that does not follow the one before."""
    expected = 1
    for event in events:
        if event.seq != expected:
            raise JournalError(f"the source's seq {event.seq} follows seq {expected - 1}: events are missing")
        expected += 1
        yield event


def import_events(destination: Journal, events: Iterable[JournalEvent],
                  check: Callable[[VerifyReport], None] | None = None) -> int:
    """Insert stored ``events`` (in ``seq`` order from 1) into the empty journal ``destination`` as
    they are, and its projection folded from them, in one transaction; returns the number of calls.

    ``check`` is given the destination's verify report, and raises to refuse the copy: the
    destination is checked before its transaction commits, so a refused copy changes nothing.

    Raises :class:`JournalError` when the destination is not empty (nothing is changed then) or
    the events do not follow one another.
    """
    if not isinstance(destination, EventImporter):
        raise JournalError(f"cannot copy into {destination!r}: it is not a journal")
    return destination.import_events(_check_chain(events), check)


def copy_journal(
    source: str,
    destination: str,
    *,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> CopyReport:
    """Copy the journal at ``source`` (a path or URL, only read) into ``destination`` (created when
    missing, and it must hold no events), then verify the copy before the import commits, so a
    copy that does not verify leaves the destination as it was.

    ``on_total`` is told how many events will be copied, ``progress`` is called once per event.
    Raises :class:`JournalError` (and its kinds): a missing, foreign or broken source, a non-empty
    destination, or a copy that does not verify.
    """
    with open_journal(source, readonly=True, create=False) as src:
        return copy_from(src, destination, progress=progress, on_total=on_total)


def copy_from(
    src: Journal,
    destination: str,
    *,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> CopyReport:
    """Copy the open journal ``src`` into ``destination``, as :func:`copy_journal` does.

    The destination is opened only once the source verifies, so a :class:`JournalNotFound` raised
    here is about the destination.
    """
    checked = src.verify()
    if not checked.ok:
        raise JournalError(
            f"the source {src.label()} does not verify (seq {checked.first_bad_seq}: {checked.problem}); "
            "it was not copied"
        )
    last_seq, head = src.head()
    start = _archived_head(src)
    if on_total is not None:
        on_total(last_seq - start)
    made = not _exists(destination)
    try:
        with open_journal(destination, create=True) as dst:
            # The destination is checked inside the import's transaction: refused, it is rolled back.

            def check(copied: VerifyReport) -> None:
                if not copied.ok or (copied.events, copied.head) != (last_seq - start, head):
                    raise JournalError(
                        f"the copy in {dst.label()} does not verify: {copied.problem or 'its head differs'}"
                        "; it was rolled back, and the destination left as it was"
                    )

            if start:
                calls = _import_archived(src, dst, last_seq, progress, check)
            else:
                calls = import_events(dst, _bounded(src.events(), last_seq, progress), check)
    except BaseException:
        if made:
            remove_made(destination)  # a failed copy leaves nothing behind, not even an empty journal
        raise
    return CopyReport(events=last_seq - start, calls=calls, head=head, archived=start)


def _archived_head(src: Journal) -> int:
    """The ``seq`` the log of ``src`` starts after (0: nothing archived)."""
    return int(src.archived_head()[0])


def _exists(destination: str) -> bool:
    """Whether a journal, or anything else that is not nothing, is already at ``destination``."""
    try:
        open_journal(destination, readonly=True, create=False).close()
    except JournalNotFound:
        return False
    except JournalError:
        return True  # something is there (an older journal, a foreign file, say): never removed
    return True


def _import_archived(src: Journal, dst: Journal, last_seq: int,
                     progress: Callable[[int], None] | None, check: Callable[[VerifyReport], None]) -> int:
    """Copy the archived journal ``src`` into the empty ``dst``: its archives' records, the
    projection and the requests as of its archived head, then its events up to ``last_seq``
    (stored rows, as they are), the projection their fold onto the archived one; verified by
    ``check`` before the transaction commits. Returns the number of calls."""
    records = archive.recorded_archives(src)
    snapshot = src.archived_projection()
    requests = src.archived_requests()
    folded = {call_id: CallRecord(*row) for call_id, row in snapshot.items()}
    touched: dict[str, tuple[Any, ...]] = {}  # the archived rows of the calls the rest of the log moves
    start = _archived_head(src)
    if not records or records[-1].last_seq != start:
        raise JournalError(f"the source {src.label()} records no archive ending at seq {start}, where its log starts; "
                           "run verify")

    def rows() -> Iterator[tuple[Any, ...]]:
        expected, prev = start + 1, records[-1].last_hash
        for row in src.event_rows(after_seq=start):
            if row[0] > last_seq:
                break
            if row[0] != expected or row[14] != prev:
                raise JournalError(f"the source's seq {row[0]} does not follow seq {expected - 1}; run verify")
            call_id = row[2]
            if call_id is not None and call_id in snapshot and call_id not in touched:
                touched[call_id] = snapshot[call_id]
            fold_row(folded, row)
            expected, prev = expected + 1, row[15]
            yield tuple(row)
            if progress is not None:
                progress(1)

    return dst.import_archived(records, snapshot, touched, requests, rows(), folded, check)
