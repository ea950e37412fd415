"""Running an archive on a journal: the check before it, the removal of its events in steps, and
the finishing of one that was stopped half-way. What ``airlock journal archive`` calls.

On SQLite the check reads the journal in bounded memory (the log in ``seq`` order for the chain,
then the log, the projection and its kept copies side by side in call id order), and the events
are removed :data:`STEP` at a time, each step a short transaction of its own. Another store is
checked with its own ``verify`` and its events are removed in one transaction.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from guard.store import CallRecord

from . import approvals, archive, verifying
from .archive import ArchivePlan, ArchiveStore
from .errors import JournalError
from .events import VerifyReport
from .projection import fold_row
from .rows import CALL_COLUMNS, EVENT_COLUMNS
from .sqlite import SQLiteJournal, schema

__all__ = ["STEP", "ArchivedMeanwhile", "check", "commit", "finish", "in_steps", "unfinished"]

STEP = 5_000  # events a step removes: a guarded call waits for one step at most

_EVENTS = ", ".join(EVENT_COLUMNS)
_CALLS = ", ".join(CALL_COLUMNS)


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


def in_steps(journal: ArchiveStore) -> bool:
    """Whether ``journal`` removes archived events in steps (a SQLite journal)."""
    return isinstance(journal, SQLiteJournal)


def _reader(journal: ArchiveStore) -> sqlite3.Connection:
    """A read-only connection of its own to a SQLite journal's file."""
    assert isinstance(journal, SQLiteJournal)
    path = Path(os.path.realpath(journal.path))
    return sqlite3.connect(schema.reader_uri(path), uri=True, timeout=30.0)


def unfinished(journal: ArchiveStore) -> tuple[ArchivePlan, str] | None:
    """The rest of an archive of ``journal`` stopped before it let go of all its events, and its
    file; None when there is none."""
    if not in_steps(journal):
        return None
    conn = _reader(journal)
    try:
        return archive.sqlite_unfinished(conn)
    finally:
        conn.close()


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
    reclaim = getattr(journal, "reclaim_space", None) if stepped else None
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
    """What ``verify`` reports of ``journal``; on SQLite, read in bounded memory whatever its size."""
    if not in_steps(journal):
        return journal.verify()
    conn = _reader(journal)
    try:
        conn.execute("BEGIN")  # one snapshot for both passes
        return _checked(conn)
    except sqlite3.Error as e:
        raise JournalError(f"the journal could not be read to check it: {e}") from e
    finally:
        conn.close()


def _checked(conn: sqlite3.Connection) -> VerifyReport:
    start = archive.sqlite_archived_head(conn)
    chain = verifying.check_chain(conn.execute(f"SELECT {_EVENTS} FROM events ORDER BY seq"), start=start)
    if not chain.ok:
        return chain.report()
    problem = _projection_problem(conn, start[0], chain.last_seq)
    if problem is not None:
        chain.fail(*problem)
    return approvals.checked(conn, "?", chain.report())


def _by_call(rows: Iterator[tuple[Any, ...]]) -> Iterator[tuple[str, list[tuple[Any, ...]]]]:
    """Rows in call id order, grouped by call id."""
    call_id: Any = None
    group: list[tuple[Any, ...]] = []
    for row in rows:
        if row[0] != call_id and group:
            yield call_id, group
            group = []
        call_id = row[0]
        group.append(row)
    if group:
        yield call_id, group


def _projection_problem(conn: sqlite3.Connection, start: int, log_end: int) -> tuple[int | None, str] | None:
    """The first problem of the projection against the log folded onto the kept projection as of
    ``start``, all three read side by side in call id order (one call in memory at a time); the
    same problems, in the same precedence, as :func:`journal.verifying.compare_projection`."""
    # Sorted by SQLite's external sort, which spills to temporary files past its cache: reading
    # them through the call_id index would fetch each event from a page of its own.
    events = _by_call(iter(conn.execute(
        f"SELECT call_id, {_EVENTS} FROM events NOT INDEXED WHERE call_id IS NOT NULL ORDER BY call_id, seq")))
    calls = iter(conn.execute(f"SELECT {_CALLS} FROM calls ORDER BY call_id"))
    kept: Iterator[tuple[Any, ...]] = iter(())
    if start:
        kept = iter(conn.execute("SELECT call_id, record FROM calls_archived ORDER BY call_id"))
    nexts: dict[str, Any] = {"e": next(events, None), "c": next(calls, None), "k": next(kept, None)}
    stale: tuple[int | None, str] | None = None
    lacking: tuple[int, str] | None = None
    while any(v is not None for v in nexts.values()):
        call_id = min(v[0] for v in nexts.values() if v is not None)
        group = nexts["e"][1] if nexts["e"] is not None and nexts["e"][0] == call_id else []
        row = nexts["c"] if nexts["c"] is not None and nexts["c"][0] == call_id else None
        record = nexts["k"][1] if nexts["k"] is not None and nexts["k"][0] == call_id else None
        if group:
            nexts["e"] = next(events, None)
        if row is not None:
            nexts["c"] = next(calls, None)
        if record is not None:
            nexts["k"] = next(kept, None)
        settled = row is not None and isinstance(row[15], int) and row[15] <= start
        if not group and record is None and (row is None or settled):
            continue  # a call untouched since the start: its row is its own
        folded: dict[str, CallRecord] = {}
        if record is not None:
            folded[call_id] = CallRecord(call_id, *orjson.loads(record))
        elif settled and row is not None:
            folded[call_id] = CallRecord(*row)
        for event in group:
            fold_row(folded, event[1:])
        expected = folded.get(call_id)
        if row is None:
            if expected is not None and (lacking is None or expected.last_seq < lacking[0]):
                lacking = verifying.lacks(expected)
            continue
        found = verifying.row_problem(row, expected, log_end)
        if found is not None:
            ahead, problem = found
            if ahead:
                return problem
            stale = stale or problem
    return stale if stale is not None else lacking
