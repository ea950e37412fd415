"""Running an archive on a journal: the check before it, the removal of its events in steps, and
the finishing of one that was stopped half-way. What ``airlock journal archive`` calls.

A store that archives in steps (:class:`~journal.archive.SteppedArchiveStore`: SQLite) checks
itself in bounded memory, and its events are removed :data:`STEP` at a time, each step a short
transaction of its own. Another store is checked with its own ``verify`` and its events are
removed in one transaction.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, TypeGuard

import orjson

from . import archive
from .archive import ArchivePlan, ArchiveStore, SteppedArchiveStore
from .errors import JournalError
from .events import VerifyReport

__all__ = ["STEP", "ArchivedMeanwhile", "check", "commit", "finish", "in_steps", "unfinished"]

STEP = 5_000  # events a step removes: a guarded call waits for one step at most


class ArchivedMeanwhile(JournalError):
    """Another archive (``others``: what the journal recorded of it, to another file) let go of
    events of ``plan`` before this one let go of any: this run removed nothing, so its ``file``
    holds no event that is not in the other archive or still in the journal."""

    def __init__(self, plan: ArchivePlan, file: str, others: list[archive.ArchiveRecord]) -> None:
        self.plan, self.file, self.others = plan, file, others
        named = "; ".join(o.describe() for o in others)
        super().__init__(f"another archive, to {named}, took events of seq {plan.base_seq + 1} to {plan.last_seq} "
                         f"meanwhile, before this one let go of any")

    @property
    def covered(self) -> bool:
        """Whether the other archives hold every event this one was to archive."""
        return max(o.upto_seq for o in self.others) >= self.plan.last_seq


def in_steps(journal: ArchiveStore) -> TypeGuard[SteppedArchiveStore]:
    """Whether ``journal`` removes archived events in steps (a SQLite journal)."""
    return isinstance(journal, SteppedArchiveStore)


def unfinished(journal: ArchiveStore) -> tuple[ArchivePlan, str] | None:
    """The rest of an archive of ``journal`` stopped before it let go of all its events, and its
    file; None when there is none."""
    return journal.unfinished_archive() if in_steps(journal) else None


def finish(journal: ArchiveStore, rest: ArchivePlan, file: str, shared: list[int] | None = None) -> int:
    """Let go of the events an archive stopped half-way had not yet removed (``rest``, from
    :func:`unfinished`), in steps; returns how many. Raises :class:`JournalError`, changing
    nothing, when its ``file`` no longer ends with the archive's last event: the events would
    then be nowhere else. ``shared`` (see :func:`commit`) gets the steps another process let go
    of meanwhile: the archive was not stopped, but still running."""
    ends = _last_line(Path(file))
    if ends is None or (ends.get("seq"), ends.get("hash")) != (rest.last_seq, rest.last_hash):
        raise JournalError(f"the archive {file} was stopped before the journal let go of its events from seq "
                           f"{rest.base_seq + 1} to {rest.last_seq}, and it no longer ends with seq {rest.last_seq}: "
                           "put it back where it was written, then archive again")
    marks = []
    for row in journal.event_rows(after_seq=rest.base_seq):
        if row[0] >= rest.last_seq:
            break
        if (row[0] - rest.base_seq) % STEP == 0:
            marks.append((int(row[0]), str(row[15])))
    return commit(journal, rest, marks, file, "", shared)[0]


def commit(journal: ArchiveStore, plan: ArchivePlan, marks: list[tuple[int, str]], file: str,
           archived_at: str, shared: list[int] | None = None) -> tuple[int, int]:
    """Remove the events of ``plan`` (written whole to ``file``) from ``journal``: in steps that
    end at ``marks`` where the store removes in steps, else at once. Returns how many events were
    removed, and how many free pages were given back to the file system on the way (each step's
    pages right after it, where the store can).

    A step whose events are gone into ``file`` when it fails (it committed as the connection
    broke, or another process finishing this same archive let go of them) counts as done; its
    last ``seq`` is added to ``shared`` (when given) if another process's step did it.

    Raises :class:`ArchivedMeanwhile` when another archive, to another file, took the first step's
    events before this one let go of any; :class:`JournalError` when a step fails otherwise; the
    steps before it stay done (the journal verifies, and the next archive finishes the rest)."""
    stepped = in_steps(journal)
    steps = archive.archive_steps(plan, marks) if stepped else [plan]
    reclaim = journal.reclaim_space if in_steps(journal) else None
    removed, freed, took = 0, 0, 0.0
    for n, step in enumerate(steps):
        if n:
            # Half as long again before the next step: a guarded call waiting for the write lock
            # (polling as SQLite's busy handler does) finds it free, and goes first.
            time.sleep(min(took / 2, 0.025))
        started = time.monotonic()
        try:
            removed += journal.commit_archive(step, file, archived_at)
        except JournalError as e:
            recorded = archive.recorded_archives(journal)
            if _step_done(recorded, step, file):
                # It committed as the connection broke, or another process finishing this same
                # archive (to this file) let go of the step's events: they are in the file.
                removed += step.events
                if shared is not None and isinstance(e, archive.StartMoved):
                    shared.append(step.last_seq)  # another process's step let go of them
                continue
            others = [a for a in recorded if a.file != file and a.upto_seq > step.archive.base_seq]
            if n == 0 and others and not any(a.file == file and a.upto_seq > plan.base_seq for a in recorded):
                raise ArchivedMeanwhile(plan.archive, file, others) from e
            raise
        if reclaim is not None:
            freed += int(reclaim())  # a few short transactions: the pause below covers them too
        took = time.monotonic() - started
    return removed, freed


def _step_done(recorded: list[archive.ArchiveRecord], step: ArchivePlan, file: str) -> bool:
    """Whether the journal has let go of the events of ``step`` into ``file``: the archive it
    recorded to that file, of the same last event, starts the log at or past the step's end."""
    whole = step.archive
    return any(a.file == file and (a.upto_seq, a.upto_hash) == (whole.last_seq, whole.last_hash)
               and a.last_seq >= step.last_seq for a in recorded)


def _last_line(path: Path) -> dict[str, Any] | None:
    """The last line of an export file as an object; None when it has none or cannot be read."""
    try:
        with path.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            tail, at = b"", end
            while at > 0 and tail.rstrip(b"\n").count(b"\n") == 0:
                at = max(0, at - (1 << 16))
                f.seek(at)
                tail = f.read(end - at)
    except OSError:
        return None
    lines = tail.rstrip(b"\n").split(b"\n")
    try:
        line = orjson.loads(lines[-1])
    except orjson.JSONDecodeError:
        return None
    return line if isinstance(line, dict) else None


# -- the check before an archive ------------------------------------------------------------------


def check(journal: ArchiveStore) -> VerifyReport:
    """What ``verify`` reports of ``journal``; read in bounded memory whatever its size where the
    store can (:meth:`~journal.archive.SteppedArchiveStore.check_archive`)."""
    return journal.check_archive() if in_steps(journal) else journal.verify()
