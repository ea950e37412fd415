"""Archiving: moving the oldest events of a journal out of its log into an export, forgetting no call.

An archive takes a prefix of the log: the events from where the log starts now up to the last one
before a given time (by ``at``), never the log's last event, which stays so that the chain goes on
from it. Its lines are exactly those of ``export``. Once the archive file is complete and on disk,
the store removes those events and records where the log now starts (the ``seq`` and ``hash`` of
the last event removed) in the same transaction, and keeps the projection as of that point: so
the journal verifies alone from there on, ``rebuild`` folds the rest of the log onto that
projection, and every call keeps its projection row: a retry of an archived call is still
replayed or refused, never run again.

A store that removes the events in short steps (:class:`SteppedArchiveStore`: SQLite) does so
at :func:`archive_steps`, each a transaction that moves the start of the log on by a few thousand
events, so that a guarded call waits for one step at most; each step leaves a journal that
verifies, and the archive's file holds every event of it from the first step on. A run stopped
between steps is finished by the next (see :mod:`journal.archive_run`). SQLite keeps the
projection as of the start copy-on-write (:mod:`journal.sqlite.archive_schema`); PostgreSQL
removes the events in one transaction and keeps a copy of every archived call's row. What a
store kept, the shared functions here read through :class:`ArchiveReading`.

The fold of the calls whose projection moved past the start is the guard's own ``apply``
(:func:`fold_onto`).

Requests for approval (:mod:`journal.approvals`): an archive never takes an event of a request
still open or approved. :func:`plan_archive` ends the archive before the first of them, and each
step's transaction refuses one that would take such an event, and keeps the requests as of its
last event in ``approvals_archived`` (their rows stay in ``approvals``).
"""


from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

import orjson

from guard.store import CallRecord

from . import approvals
from .errors import JournalError
from .events import JournalEvent, VerifyReport
from .export import jsonl_lines
from .projection import fold_row, record_row
from .rows import CALL_COLUMNS

__all__ = ["ArchivePlan", "ArchiveReading", "ArchiveRecord", "ArchiveStore", "ArchivedImporter", "Archiving",
           "StartMoved", "SteppedArchiveStore", "archive_holding", "archive_lines", "archive_steps",
           "archived_call_last_seq", "archived_projection", "archived_requests", "archives_between", "fold_onto",
           "kept_row", "last_seq_of", "plan_archive", "recorded_archives", "stored_copy"]

_CHUNK = 1 << 20  # about a megabyte of lines a write


class StartMoved(JournalError):
    """An archive's transaction found the log starting elsewhere than where it was planned from:
    another archive (or another step of the same one) moved it meanwhile; nothing was changed."""


class Archiving(Protocol):
    """What archiving asks of a journal (both stores have it)."""

    def archived_head(self) -> tuple[int, str]:
        """The ``seq`` and ``hash`` of the last archived event; ``(0, 64 zeros)`` when none is."""
        ...

    def head(self) -> tuple[int, str]: ...

    def events(self, *, since: datetime | None = None, after_seq: int = 0) -> Iterator[JournalEvent]: ...

    def event_rows(self, *, after_seq: int = 0) -> Iterator[tuple[Any, ...]]: ...


@runtime_checkable
class ArchiveStore(Archiving, Protocol):
    """A journal that archives: :class:`Archiving`, its verify, and the transaction that removes
    the archived events (both stores)."""

    def verify(self) -> VerifyReport: ...

    def commit_archive(self, plan: ArchivePlan, file: str, archived_at: str) -> int:
        """Remove the events ``plan`` moves, in one transaction that records the archive's head
        and keeps the projection as of it; returns how many were removed."""
        ...


@runtime_checkable
class SteppedArchiveStore(ArchiveStore, Protocol):
    """A journal that removes an archive's events in steps, finishes one stopped half-way, and
    checks itself before an archive in bounded memory (SQLite)."""

    def unfinished_archive(self) -> tuple[ArchivePlan, str] | None:
        """The rest of an archive stopped before the journal let go of all its events, and its file."""
        ...

    def check_archive(self) -> VerifyReport:
        """What ``verify`` reports, read in bounded memory whatever the journal's size."""
        ...

    def reclaim_space(self, pages: int = 256) -> int:
        """Give the file's free pages back to the file system; returns how many."""
        ...


@runtime_checkable
class ArchiveReading(Protocol):
    """What a journal kept of its archives, as :func:`recorded_archives` and the others read it."""

    def archive_rows(self) -> list[tuple[Any, ...]]:
        """Every archive recorded, oldest first: ``last_seq, last_hash, upto_seq, upto_hash, events,
        archived_at, file`` (``upto_*`` NULL where the store records none: finished when recorded)."""
        ...

    def archived_call_last_seq(self, call_id: str) -> int | None:
        """The ``seq`` of the last archived event of ``call_id``; None when none of its events is."""
        ...

    def archived_projection(self) -> dict[str, tuple[Any, ...]]:
        """The projection as of the start of the log, each call's stored row by call id."""
        ...

    def archived_requests(self) -> list[tuple[str, str]]:
        """The requests for approval as of the start of the log: ``request_id`` and the stored request."""
        ...


@runtime_checkable
class ArchivedImporter(Protocol):
    """A journal that takes a copy of an archived journal in one transaction (see :mod:`journal.copy`)."""

    def import_archived(self, records: list[ArchiveRecord], snapshot: dict[str, tuple[Any, ...]],
                        touched: dict[str, tuple[Any, ...]], requests: list[tuple[str, str]],
                        rows: Iterator[tuple[Any, ...]], folded: dict[str, CallRecord],
                        check: Callable[[VerifyReport], None]) -> int:
        """Into this empty journal: the archives' ``records``, the events ``rows`` (stored rows after
        the archived head), the projection ``folded`` (their fold onto ``snapshot``, the projection
        as of that head; ``touched``: the rows of it the rest of the log moves) and the ``requests``
        kept as of it; ``check`` is given the verify report before the commit, and raises to
        refuse it. Returns the number of calls."""
        ...


@dataclass(frozen=True, slots=True)
class ArchivePlan:
    """The events one archive moves: ``base_seq`` < seq <= ``last_seq``. ``base_seq`` and
    ``base_hash`` are where the log starts now (the last archive's head, or 0 and 64 zeros);
    ``last_hash`` is the hash of event ``last_seq``, the new archive's head."""

    base_seq: int
    base_hash: str
    last_seq: int
    last_hash: str
    # A step of an archive removed in steps: the archive it is part of (None: the plan is whole).
    whole: ArchivePlan | None = None

    @property
    def events(self) -> int:
        return self.last_seq - self.base_seq

    @property
    def archive(self) -> ArchivePlan:
        """The whole archive this plan is (a step of)."""
        return self.whole if self.whole is not None else self

    def step(self, base_seq: int, base_hash: str, last_seq: int, last_hash: str) -> ArchivePlan:
        """The step of this archive that moves the events ``base_seq`` < seq <= ``last_seq``."""
        whole = self.archive
        if not whole.base_seq <= base_seq < last_seq <= whole.last_seq:
            raise ValueError(f"seq {base_seq + 1} to {last_seq} is not a step of the archive of seq "
                             f"{whole.base_seq + 1} to {whole.last_seq}")
        return ArchivePlan(base_seq, base_hash, last_seq, last_hash, whole)


@dataclass(frozen=True, slots=True)
class ArchiveRecord:
    """What a journal recorded of one archive (a row of its ``archives`` table): the archive file
    ``file`` (its path when it was written) holds the events ``first_seq`` to ``upto_seq``; the
    journal has let go of them up to ``last_seq`` (``upto_seq`` once it is finished: only a SQLite
    archive stopped between its steps is not), ``events`` of them, at ``archived_at``."""

    first_seq: int
    last_seq: int
    last_hash: str
    upto_seq: int
    upto_hash: str
    events: int
    archived_at: str
    file: str

    @property
    def finished(self) -> bool:
        """Whether the journal has let go of every event of the archive's file."""
        return self.last_seq >= self.upto_seq

    def holds(self, seq: int) -> bool:
        """Whether the archive's file holds event ``seq``."""
        return self.first_seq <= seq <= self.upto_seq

    def describe(self) -> str:
        """The archive for a message: its file and the seqs it holds."""
        return f"{self.file} (seq {self.first_seq} to {self.upto_seq})"


def _record(row: tuple[Any, ...]) -> ArchiveRecord:
    last_seq, last_hash, upto_seq, upto_hash, events, archived_at, file = row
    upto_seq = int(last_seq) if upto_seq is None else int(upto_seq)
    upto_hash = str(last_hash) if upto_hash is None else str(upto_hash)
    return ArchiveRecord(first_seq=int(last_seq) - int(events) + 1, last_seq=int(last_seq), last_hash=str(last_hash),
                         upto_seq=upto_seq, upto_hash=upto_hash, events=int(events), archived_at=str(archived_at),
                         file=str(file))


def recorded_archives(journal: object) -> list[ArchiveRecord]:
    """Every archive ``journal`` recorded, oldest first (none for a journal that cannot archive)."""
    if not isinstance(journal, ArchiveReading):
        return []
    return [_record(tuple(row)) for row in journal.archive_rows()]


def archive_holding(archives: Iterable[ArchiveRecord], seq: int) -> ArchiveRecord | None:
    """The archive whose file holds event ``seq`` (the latest, should two), or None."""
    found = None
    for record in archives:
        if record.holds(seq):
            found = record
    return found


def archives_between(archives: Iterable[ArchiveRecord], first: int, last: int) -> list[ArchiveRecord]:
    """The archives whose files hold events of ``first`` to ``last``, oldest first."""
    return [a for a in archives if a.first_seq <= last and a.upto_seq >= first]


# The position of last_seq in a row of calls_archived's record (the projection row without call_id).
_RECORD_LAST_SEQ = CALL_COLUMNS.index("last_seq") - 1


def last_seq_of(record: Any) -> int | None:
    """The ``last_seq`` of a kept record (a row of calls_archived's ``record``); None when it has none."""
    try:
        value = orjson.loads(record)[_RECORD_LAST_SEQ]
    except (orjson.JSONDecodeError, IndexError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def archived_call_last_seq(journal: object, call_id: str) -> int | None:
    """The ``seq`` of the last event of ``call_id`` that the journal has let go of (archived),
    from the projection as of the start of its log; None when none of its events is archived."""
    return journal.archived_call_last_seq(call_id) if isinstance(journal, ArchiveReading) else None


def archived_projection(journal: object) -> dict[str, tuple[Any, ...]]:
    """The projection of ``journal`` as of the start of its log (its last archive's head): each
    call's stored row (:data:`~journal.rows.CALL_COLUMNS`) by call id; empty without an archive."""
    return journal.archived_projection() if isinstance(journal, ArchiveReading) else {}


def archived_requests(journal: object) -> list[tuple[str, str]]:
    """The requests for approval of ``journal`` as of the start of its log (``request_id`` and
    the request as stored); none without an archive, or in a journal from before approvals."""
    return journal.archived_requests() if isinstance(journal, ArchiveReading) else []


# A row of calls_archived is a call id and the other columns of its projection row as one JSON
# array (``record``): a table of its own shape, never taken for the projection itself.


def kept_row(call_id: str, record: str) -> tuple[Any, ...]:
    """A projection row from a row of calls_archived (the call id, and its kept record)."""
    return (call_id, *orjson.loads(record))


def stored_copy(row: tuple[Any, ...]) -> tuple[str, str]:
    """A row of calls_archived (call id, record) from a projection row."""
    return row[0], orjson.dumps(list(row[1:])).decode()


def plan_archive(journal: Archiving, before: datetime) -> ArchivePlan | None:
    """What archiving the events of ``journal`` older than ``before`` moves, or None for nothing.

    The log is a chain: only a prefix of it can move. It ends before the first event at or after
    ``before`` (events are stamped before they are appended, so a later ``seq`` may carry an
    earlier ``at``: such an event waits for the next archive), before the log's last event, and
    before the first event of any request for approval still open or approved: an open request is
    never archived away (its events stay in the log until it is decided, expires or is consumed).
    """
    base_seq, base_hash = journal.archived_head()
    head_seq, _ = journal.head()
    later = next(iter(journal.events(since=before, after_seq=base_seq)), None)
    last_seq = min(head_seq - 1, later.seq - 1 if later is not None else head_seq)
    live = approvals.first_live_seq(journal)
    if live is not None:
        last_seq = min(last_seq, live - 1)
    if last_seq <= base_seq:
        return None
    last = next(iter(journal.events(after_seq=last_seq - 1)), None)
    if last is None or last.seq != last_seq:
        raise JournalError(f"the log has no event seq {last_seq} to end the archive with; run verify")
    return ArchivePlan(base_seq, base_hash, last_seq, last.hash)


def archive_lines(journal: Archiving, plan: ArchivePlan, marks: list[tuple[int, str]] | None = None,
                  every: int = 0) -> Iterator[bytes]:
    """The export lines of the events ``plan`` moves, in chunks of about a megabyte.

    Each event must follow the one before (its ``seq`` and ``prev_hash``) from the plan's base to
    its last event: raises :class:`JournalError` otherwise, before the archive could be taken for whole.
    With ``marks`` and ``every``, the ``seq`` and ``hash`` of every ``every``-th event are added to
    ``marks`` on the way (where :func:`archive_steps` cuts the archive's removal).
    """
    expected, prev = plan.base_seq + 1, plan.base_hash

    def rows() -> Iterator[tuple[Any, ...]]:
        nonlocal expected, prev
        for row in journal.event_rows(after_seq=plan.base_seq):
            if row[0] > plan.last_seq:
                return
            if row[0] != expected or row[14] != prev:
                raise JournalError(f"event seq {row[0]} does not follow seq {expected - 1} in the log; run verify")
            expected, prev = expected + 1, row[15]
            if marks is not None and every and (row[0] - plan.base_seq) % every == 0:
                marks.append((row[0], row[15]))
            yield row

    chunk: list[bytes] = []
    size = 0
    for line in jsonl_lines(rows()):
        chunk.append(line)
        size += len(line)
        if size >= _CHUNK:
            yield b"".join(chunk)
            chunk, size = [], 0
    if chunk:
        yield b"".join(chunk)
    if expected != plan.last_seq + 1 or prev != plan.last_hash:
        raise JournalError(f"the log ends the archive at seq {expected - 1}, not at seq {plan.last_seq}; run verify")


def archive_steps(plan: ArchivePlan, marks: Iterable[tuple[int, str]]) -> list[ArchivePlan]:
    """The steps that remove the events of ``plan`` one stretch at a time: each ends at one of
    ``marks`` (the ``seq`` and ``hash`` of events of the plan, in order), the last at the plan's end."""
    steps: list[ArchivePlan] = []
    seq, digest = plan.base_seq, plan.base_hash
    for last_seq, last_hash in [*marks, (plan.last_seq, plan.last_hash)]:
        if seq < last_seq <= plan.last_seq:
            steps.append(plan.step(seq, digest, last_seq, last_hash))
            seq, digest = last_seq, last_hash
    return steps


def fold_onto(snapshot: Iterable[tuple[Any, ...]], events: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The projection rows (:data:`~journal.rows.CALL_COLUMNS`) of the calls of ``snapshot`` (stored
    rows) and ``events`` (stored rows, in ``seq`` order) after folding the events onto the rows,
    with the guard's ``apply``; the stored texts are carried over as they are (see ``fold_row``)."""
    records = {row[0]: CallRecord(*row) for row in snapshot}
    for row in events:
        fold_row(records, row)
    return [record_row(record) for record in records.values()]
