"""The reads both SQL journals make the same way, written once on each store's datastore
(:class:`~journal.datastore.Datastore`): ``rows`` (one statement, its rows) and ``snapshot``
(several statements that see one moment).

The statements are the same on both backends but for the words of its
:class:`~journal.datastore.Dialect`: the placeholder, the ``LIMIT`` that means all, whether a text
may hold a NUL."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from guard.approvals import ApprovalRequest
from guard.store import CallRecord, format_at, parse_at

from . import approvals
from .datastore import Datastore, Dialect
from .events import JournalEvent, JournalStats
from .export import csv_header, csv_lines, jsonl_lines, one_line_each
from .rows import CALL_COLUMNS, EVENT_COLUMNS, event_from_row, holds, page, record_from_row

__all__ = ["Counts", "LogReader", "call_filter", "event_filter", "page"]

# What stats() reports, as stored (see LogReader.counts).
Counts = tuple[dict[str, int], dict[str, int], dict[str, str], int, tuple[int, str | None]]
_LINES_A_BATCH = 1000
_BATCH = 1000  # rows of events read at a time
_CALLS = f"SELECT {', '.join(CALL_COLUMNS)} FROM calls"
_EVENTS = f"SELECT {', '.join(EVENT_COLUMNS)} FROM events"
_STATS = (
    # One scan of the projection: counts by status and tool, and when the oldest pending or unknown
    # call of each group entered its status (its time read only for those: the column lies far
    # into a row, past the arguments and the value).
    "SELECT status, tool, count(*), min(CASE WHEN status IN ('pending', 'unknown') THEN since END) "
    "FROM calls GROUP BY status, tool",
    # seq is gapless from 1 (archives included), so the last one counts the events without a scan.
    "SELECT coalesce(max(seq), 0) FROM events",
    # The requests for approval still open, and when the oldest of them was asked.
    "SELECT count(*), min(requested_at) FROM approvals WHERE status = 'open'",
)


def _filter(
    mark: str, nul: bool, equal: Sequence[tuple[str, str | None]], times: Sequence[tuple[str, datetime | None]],
) -> tuple[list[str], list[Any]]:
    """SQL conditions (joined with AND by the caller) and their parameters, ``mark`` the driver's
    placeholder: each column of ``equal`` equal to its value, each comparison of ``times`` (like
    ``"at <"``) with its time; a None value is no condition. ``nul``: the database holds a NUL in a
    text (a value it cannot hold matches nothing)."""
    clauses: list[str] = []
    params: list[Any] = []
    for column, wanted in equal:
        if wanted is not None:
            if not holds(wanted, nul=nul):
                clauses.append("1 = 0")
                continue
            clauses.append(f"{column} = {mark}")
            params.append(wanted)
    for comparison, at in times:
        if at is not None:
            clauses.append(f"{comparison} {mark}")
            params.append(format_at(at))
    return clauses, params


def call_filter(
    mark: str, nul: bool, status: str | Sequence[str] | None, tool: str | None, agent_id: str | None,
    since: datetime | None, until: datetime | None = None, idempotency_key: str | None = None,
) -> tuple[list[str], list[Any]]:
    """The conditions of ``calls()``: status (one, or any of several), tool, agent, idempotency key,
    ``updated_at >= since`` and ``updated_at < until`` (see :func:`_filter`)."""
    updated = (("updated_at >=", since), ("updated_at <", until))
    equal = (("tool", tool), ("agent_id", agent_id), ("idempotency_key", idempotency_key))
    if status is None or isinstance(status, str):
        return _filter(mark, nul, (("status", status), *equal), updated)
    clauses, params = _filter(mark, nul, equal, updated)
    statuses = [s for s in status if holds(s, nul=nul)]
    any_of = f"status IN ({', '.join([mark] * len(statuses))})" if statuses else "1 = 0"
    return [any_of, *clauses], [*statuses, *params]


def event_filter(
    mark: str, nul: bool, call_id: str | None, tool: str | None, agent_id: str | None,
    since: datetime | None, until: datetime | None,
) -> tuple[list[str], list[Any]]:
    """The conditions of ``events()``: call, tool, agent and ``since <= at < until`` (see
    :func:`_filter`)."""
    return _filter(mark, nul, (("call_id", call_id), ("tool", tool), ("agent_id", agent_id)),
                   (("at >=", since), ("at <", until)))


class LogReader:
    """The operator's reads of a SQL journal: calls, events, counts, stats and the exports, on
    ``datastore``. A store with a quicker way to some of them (SQLite's
    :class:`~journal.sqlite.reads.Reader`) subclasses it and overrides those: :meth:`counts`,
    :meth:`export_lines`, :meth:`export_csv`."""

    def __init__(self, datastore: Datastore) -> None:
        self._datastore = datastore
        dialect: Dialect = datastore.dialect
        self._mark, self._unlimited, self._nul, self._sort_apart = (
            dialect.placeholder, dialect.unlimited, dialect.nul, dialect.sort_apart)
        self._rows = datastore.rows
        self._decoded = datastore.decoded

    def calls(
        self,
        *,
        status: str | Sequence[str] | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        limit: int | None = 50,
        offset: int = 0,
        until: datetime | None = None,
        idempotency_key: str | None = None,
    ) -> list[CallRecord]:
        """Calls newest first (by ``updated_at``, then ``call_id``, both descending), filtered by status
        (one, or any of several), tool, agent, idempotency key, ``updated_at >= since`` and
        ``updated_at < until``; at most ``limit`` (None: all), after skipping the first ``offset``
        (the pages of a long list)."""
        clauses, params = call_filter(self._mark, self._nul, status, tool, agent_id, since, until, idempotency_key)
        sql = _CALLS + (" WHERE " + " AND ".join(clauses) if clauses else "")
        # Every call of some statuses: one scan and a sort of those, not a walk of the whole
        # projection in the order of its index on updated_at (twice as slow on SQLite).
        newest = self._sort_apart if limit is None and status is not None else ""
        sql += f" ORDER BY {newest}updated_at DESC, call_id DESC" + page(limit, offset, self._unlimited)
        return [self._decoded(record_from_row, row) for row in self._rows("read the calls", sql, params)]

    def event_rows(
        self,
        *,
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after_seq: int = 0,
    ) -> Iterator[tuple[Any, ...]]:
        """What :meth:`events` gives, as the stored rows (columns of ``journal.rows.EVENT_COLUMNS``:
        ``at`` and the JSON fields as their stored text), in batches, for exports that stream millions."""
        clauses, params = event_filter(self._mark, self._nul, call_id, tool, agent_id, since, until)
        # Up to the head as it is now: a reader never chases writers that keep appending.
        head = int(self._rows("read the events", "SELECT coalesce(max(seq), 0) FROM events")[0][0])
        mark = self._mark
        sql = (f"{_EVENTS} WHERE {' AND '.join([f'seq > {mark}', f'seq <= {mark}', *clauses])} "
               f"ORDER BY seq LIMIT {_BATCH}")
        last = after_seq
        while True:
            rows = self._rows("read the events", sql, [last, head, *params])
            yield from rows
            if len(rows) < _BATCH:
                return
            last = int(rows[-1][0])

    def count_events(
        self,
        *,
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after_seq: int = 0,
    ) -> int:
        """How many events :meth:`events` with the same filters would give now."""
        clauses, params = event_filter(self._mark, self._nul, call_id, tool, agent_id, since, until)
        sql = f"SELECT count(*) FROM events WHERE {' AND '.join([f'seq > {self._mark}', *clauses])}"
        return int(self._rows("count the events", sql, [after_seq, *params])[0][0])

    def stats(self) -> JournalStats:
        """Counts of calls by status and by tool, the number of events, and when the oldest pending
        and unknown calls entered that status; all of one moment, however many writers there are."""
        by_status, by_tool, oldest, events, (approvals_open, oldest_open) = self.counts()
        decoded = self._decoded
        return JournalStats(
            calls=sum(by_status.values()), events=events, by_status=dict(sorted(by_status.items())),
            by_tool=dict(sorted(by_tool.items())),
            oldest_pending_at=decoded(parse_at, oldest["pending"]) if "pending" in oldest else None,
            oldest_unknown_at=decoded(parse_at, oldest["unknown"]) if "unknown" in oldest else None,
            approvals_open=approvals_open,
            oldest_open_approval_at=decoded(parse_at, oldest_open) if oldest_open is not None else None,
        )

    def counts(self) -> Counts:
        """What :meth:`stats` reports, as stored: the calls by status, by tool, the stored time the
        oldest pending and unknown call entered its status, the number of events, and the number
        of open requests for approval with the stored time the oldest was asked."""
        groups, events, open_requests = self._datastore.snapshot("read the stats", _STATS)
        by_status: dict[str, int] = {}
        by_tool: dict[str, int] = {}
        oldest: dict[str, str] = {}
        for status, tool, n, since in groups:
            by_status[status] = by_status.get(status, 0) + int(n)
            by_tool[tool] = by_tool.get(tool, 0) + int(n)
            if status in ("pending", "unknown") and since is not None and (
                    status not in oldest or since < oldest[status]):
                oldest[status] = since
        opened = open_requests[0] if open_requests else (0, None)
        return by_status, by_tool, oldest, int(events[0][0]), (int(opened[0]), opened[1])

    def events(
        self,
        *,
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after_seq: int = 0,
    ) -> Iterator[JournalEvent]:
        """The events in ``seq`` order, filtered (``since <= at < until``, ``seq > after_seq``), read in
        batches so that memory stays bounded however long the log is."""
        for row in self.event_rows(
            call_id=call_id, tool=tool, agent_id=agent_id, since=since, until=until, after_seq=after_seq
        ):
            yield self._decoded(event_from_row, row)

    def call_events(self, call_id: str) -> list[JournalEvent]:
        """Every event of ``call_id`` (refusals included) in ``seq`` order; [] for an id never seen."""
        return list(self.events(call_id=call_id))

    def approval_requests(
        self, *, call_id: str | None = None, request_id: str | None = None, status: str | None = None,
        tool: str | None = None, limit: int | None = None, offset: int = 0,
    ) -> list[ApprovalRequest]:
        """The requests for approval, newest first (by the seq they were asked at), filtered by
        call, request id, status and tool; at most ``limit`` (None: all) after the first ``offset``."""
        sql, params = approvals.requests(self._mark, self._nul, self._unlimited, call_id=call_id,
                                         request_id=request_id, status=status, tool=tool, limit=limit, offset=offset)
        if not self.keeps_requests():
            return []
        return [self._decoded(approvals.request_from_row, row)
                for row in self._rows("read the requests for approval", sql, params)]

    def keeps_requests(self) -> bool:
        """Whether the journal keeps requests for approval: every journal does, but one of a
        version from before them that a store reads as it is (see SQLite's
        :class:`~journal.sqlite.reads.Reader`)."""
        return True

    def export_lines(
        self,
        *,
        redact: frozenset[str] = frozenset(),
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> Iterator[tuple[bytes, int]]:
        """The JSON Lines export of the filtered events, in batches: (the lines, how many)."""
        batch: list[bytes] = []
        rows = self.event_rows(call_id=call_id, tool=tool, agent_id=agent_id, since=since, until=until)
        for line in jsonl_lines(rows, redact):
            batch.append(line)
            if len(batch) >= _LINES_A_BATCH:
                yield one_line_each(b"".join(batch)), len(batch)
                batch = []
        if batch:
            yield one_line_each(b"".join(batch)), len(batch)

    def export_csv(
        self,
        *,
        redact: frozenset[str] = frozenset(),
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> Iterator[tuple[bytes, int]]:
        """The CSV export of the filtered events, its header first, in batches: (the lines, how many
        events). Columns as :data:`journal.export.CSV_COLUMNS`; cells as :func:`journal.export.csv_cell`."""
        header = csv_header()  # written with the first lines, so that an export that fails at once writes nothing
        batch: list[str] = []
        rows = self.event_rows(call_id=call_id, tool=tool, agent_id=agent_id, since=since, until=until)
        for line in csv_lines(rows, redact):
            batch.append(line)
            if len(batch) >= _LINES_A_BATCH:
                chunk = "".join(batch).encode()
                if header:
                    chunk, header = header + chunk, b""
                yield chunk, len(batch)
                batch = []
        if batch or header:
            yield header + "".join(batch).encode(), len(batch)
