"""Copy a journal to another store (SQLite to PostgreSQL, or back), preserving every ``seq`` and hash.

The stored events are inserted as they are, the projection is recomputed by the fold (replacing any
rows the destination's projection held), and the copy is verified: its chain must check and its
head must equal the source's. The destination is verified inside the import's transaction, before
it commits, so a copy that does not verify leaves it as it was. The destination must hold no
events; the source is only read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from .errors import JournalError
from .events import JournalEvent, VerifyReport
from .open import open_journal
from .protocol import EventImporter, Journal

__all__ = ["CopyReport", "copy_from", "copy_journal", "import_events"]


@dataclass(frozen=True, slots=True)
class CopyReport:
    """What was copied: ``events``, ``calls`` (projection rows) and the ``head`` hash both share."""

    events: int
    calls: int
    head: str


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
            f"the source {_name(src)} does not verify (seq {checked.first_bad_seq}: {checked.problem}); "
            "it was not copied"
        )
    last_seq, head = src.head()
    if on_total is not None:
        on_total(last_seq)
    with open_journal(destination, create=True) as dst:
        # The destination is checked inside the import's transaction: refused, it is rolled back.

        def check(copied: VerifyReport) -> None:
            if not copied.ok or (copied.events, copied.head) != (last_seq, head):
                raise JournalError(
                    f"the copy in {_name(dst)} does not verify: {copied.problem or 'its head differs'}"
                    "; it was rolled back, and the destination left as it was"
                )

        calls = import_events(dst, _bounded(src.events(), last_seq, progress), check)
    return CopyReport(events=last_seq, calls=calls, head=head)


def _name(journal: Journal) -> str:
    """The journal for a message: a SQLite file's path, a PostgreSQL journal's URL without its password."""
    name = getattr(journal, "name", None)  # a PostgreSQL journal's; a SQLite journal is named by its path
    return name if isinstance(name, str) else str(getattr(journal, "path", journal))
