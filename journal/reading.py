"""The reads both SQL journals make the same way, written once on each store's two primitives:
``_rows`` (one statement, its rows) and ``_snapshot`` (several statements that see one moment).

The statements are the same on both backends but for the placeholder (``_placeholder``), the ``LIMIT``
that means all (``_unlimited``), and whether a text may hold a NUL (``_nul``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any, TypeVar

from guard.store import CallRecord, format_at, parse_at

from .events import JournalEvent, JournalStats
from .export import csv_header, csv_lines, jsonl_lines, one_line_each
from .rows import CALL_COLUMNS, EVENT_COLUMNS, event_from_row, holds, operator_event, record_from_row

__all__ = ["LogReads", "call_filter", "event_filter", "page"]

T = TypeVar("T")
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


def page(limit: int | None, offset: int, unlimited: str) -> str:
    """The ``LIMIT``/``OFFSET`` clause of a page of ``calls()``: at most ``limit`` calls (None: all)
    after the first ``offset``; ``unlimited`` is the driver's limit for all (``-1``, ``ALL``).
    Raises ``ValueError`` for a negative number."""
    for name, number in (("limit", limit), ("offset", offset)):
        if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 0):
            raise ValueError(f"{name} is a number of calls, 0 or more, not {number!r}")
    if limit is None and not offset:
        return ""
    return f" LIMIT {unlimited if limit is None else int(limit)}" + (f" OFFSET {int(offset)}" if offset else "")


def event_filter(
    mark: str, nul: bool, call_id: str | None, tool: str | None, agent_id: str | None,
    since: datetime | None, until: datetime | None,
) -> tuple[list[str], list[Any]]:
    """The conditions of ``events()``: call, tool, agent and ``since <= at < until`` (see
    :func:`_filter`)."""
    return _filter(mark, nul, (("call_id", call_id), ("tool", tool), ("agent_id", agent_id)),
                   (("at >=", since), ("at <", until)))


class LogReads:
    """The operator's reads of a SQL journal: calls, events, counts, stats and the exports."""

    _placeholder = "?"  # the driver's placeholder
    _unlimited = "-1"  # what LIMIT takes for all rows
    _nul = True  # whether the database holds a NUL in a text
    _sort_apart = "+"  # before a column of ORDER BY: sort the rows, the column's index unused

    def _rows(self, doing: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows of one statement (``doing`` names it in an error)."""
        raise NotImplementedError

    def _snapshot(self, doing: str, statements: Sequence[str]) -> list[list[tuple[Any, ...]]]:
        """The rows of each of ``statements``, all read in one snapshot."""
        raise NotImplementedError

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
        clauses, params = call_filter(self._placeholder, self._nul, status, tool, agent_id, since, until,
                                      idempotency_key)
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
        clauses, params = event_filter(self._placeholder, self._nul, call_id, tool, agent_id, since, until)
        # Up to the head as it is now: a reader never chases writers that keep appending.
        head = int(self._rows("read the events", "SELECT coalesce(max(seq), 0) FROM events")[0][0])
        mark = self._placeholder
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
        clauses, params = event_filter(self._placeholder, self._nul, call_id, tool, agent_id, since, until)
        sql = f"SELECT count(*) FROM events WHERE {' AND '.join([f'seq > {self._placeholder}', *clauses])}"
        return int(self._rows("count the events", sql, [after_seq, *params])[0][0])

    def stats(self) -> JournalStats:
        """Counts of calls by status and by tool, the number of events, and when the oldest pending
        and unknown calls entered that status; all of one moment, however many writers there are."""
        by_status, by_tool, oldest, events, (approvals_open, oldest_open) = self._counts()
        return JournalStats(
            calls=sum(by_status.values()), events=events, by_status=dict(sorted(by_status.items())),
            by_tool=dict(sorted(by_tool.items())),
            oldest_pending_at=self._decoded(parse_at, oldest["pending"]) if "pending" in oldest else None,
            oldest_unknown_at=self._decoded(parse_at, oldest["unknown"]) if "unknown" in oldest else None,
            approvals_open=approvals_open,
            oldest_open_approval_at=self._decoded(parse_at, oldest_open) if oldest_open is not None else None,
        )

    def _counts(self) -> tuple[dict[str, int], dict[str, int], dict[str, str], int, tuple[int, str | None]]:
        """What :meth:`stats` reports, as stored: the calls by status, by tool, the stored time the
        oldest pending and unknown call entered its status, the number of events, and the number
        of open requests for approval with the stored time the oldest was asked."""
        groups, events, open_requests = self._snapshot("read the stats", _STATS)
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

    def _decoded(self, decode: Callable[[Any], T], row: Any) -> T:
        raise NotImplementedError

    def get(self, call_id: str) -> CallRecord | None:
        raise NotImplementedError

    def _label(self) -> str:
        """How the journal's messages name it (never with a password)."""
        raise NotImplementedError

    def check_resolve(
        self, call_id: str, *, applied: bool, reason: str, operator: str, value: str | None = None,
        force: bool = False,
    ) -> None:
        """Raise what ``resolve`` would raise for these arguments, on the call's current record,
        and write nothing: a check that also works on a journal opened ``readonly``, so a resolve
        that is refused changes nothing at all (not even an older journal's schema version)."""
        record = self.get(call_id)
        owner_alive: bool | None = None
        if record is not None and record.status == "pending":
            owner_alive = self.owner_states([record])[record.call_id].alive  # type: ignore[attr-defined]
        operator_event(call_id, record, applied=applied, reason=reason, operator=operator,
                       value=value, force=force, journal=self._label(), owner_alive=owner_alive)

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
