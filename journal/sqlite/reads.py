"""The SQLite journal's reads for operators: those both SQL journals make the same way
(:class:`journal.reading.LogReader`), its exports and counts made quicker by SQLite itself, and its head."""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import orjson

from .. import approvals
from ..chain import GENESIS
from ..errors import (
    JournalError,
)
from ..export import LineCloser, check_redact, csv_header, csv_lines, jsonl_lines, utf8_lines
from ..read_ahead import read_ahead
from ..reading import Counts, LogReader, event_filter
from . import schema
from .datastore import SQLiteDatastore
from .sql import _EVENT_COLUMNS, _SELECT_HEAD

_BATCH = 1000

_EXPORT_BYTES = 1 << 20  # about a megabyte of lines a batch
_EXPORT_ROWS = 100  # events a page: bounded by events, as an event may hold a megabyte of arguments
# An aggregate takes its rows in the order asked for where SQLite can be told (3.44); before, in
# the order of the subquery it reads, which is ordered by seq.
_IN_ORDER = " ORDER BY seq" if sqlite3.sqlite_version_info >= (3, 44, 0) else ""

def _fetch_all(conn: sqlite3.Connection, sql: str, params: Sequence[Any]) -> list[Any]:
    return conn.execute(sql, params).fetchall()

def _fetch_one(conn: sqlite3.Connection, sql: str, params: Sequence[Any]) -> Any:
    return conn.execute(sql, params).fetchone()

def _event_filter(
    call_id: str | None, tool: str | None, agent_id: str | None, since: datetime | None,
    until: datetime | None, after_seq: int,
) -> tuple[str, list[Any]]:
    clauses, params = event_filter("?", True, call_id, tool, agent_id, since, until)
    return " AND ".join(["seq > ?", *clauses]), [after_seq, *params]  # params[0]: the keyset cursor of events()


# More tools than this and the calls are grouped by tool in SQLite's sorter: each tool counted
# apart adds a comparison for every call.
_TOOLS_COUNTED_APART = 16


def _counted(conn: sqlite3.Connection) -> Counts:
    """:meth:`LogReader.counts` in one read transaction of ``conn``, without grouping the calls in
    SQLite's sorter, which takes most of the time of a GROUP BY over many calls: the distinct
    tools are read, then one scan counts each status and each tool. A status the schema does not
    know (an altered journal) or many tools are grouped as usual."""
    conn.execute("BEGIN")
    try:
        tools = [row[0] for row in conn.execute(
            f"SELECT DISTINCT tool FROM calls LIMIT {_TOOLS_COUNTED_APART + 1}")]
        apart = len(tools) <= _TOOLS_COUNTED_APART
        counted = conn.execute(
            "SELECT count(*), "
            + "".join(f"count(*) FILTER (WHERE status = '{status}'), " for status in schema.STATUSES)
            + "min(since) FILTER (WHERE status = 'pending'), min(since) FILTER (WHERE status = 'unknown')"
            + "".join(", count(*) FILTER (WHERE tool IS ?)" for _ in tools if apart)
            + " FROM calls",
            tools if apart else [],
        ).fetchone()
        calls, statuses = counted[0], len(schema.STATUSES)
        by_status = {status: n for status, n in zip(schema.STATUSES, counted[1:1 + statuses], strict=True) if n}
        if sum(by_status.values()) != calls:
            by_status = dict(conn.execute("SELECT status, count(*) FROM calls GROUP BY status").fetchall())
        oldest = {status: since for status, since in zip(("pending", "unknown"), counted[1 + statuses:3 + statuses],
                                                       strict=True) if since is not None}
        if apart:
            by_tool = dict(zip(tools, counted[3 + statuses:], strict=True))
        else:
            by_tool = dict(conn.execute("SELECT tool, count(*) FROM calls GROUP BY tool").fetchall())
        events = conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
        requests = approvals.stats(conn) if schema.has_approvals(conn) else (0, None)
        return by_status, by_tool, oldest, int(events), requests
    finally:
        if conn.in_transaction:
            conn.execute("COMMIT")


class Reader(LogReader):
    """The operator's reads of a SQLite journal: :class:`~journal.reading.LogReader`'s, with those
    SQLite makes quicker than the shared ones: the exports (written by SQLite itself, read ahead on
    a connection of their own) and the counts of :meth:`~journal.reading.LogReader.stats`; and the
    head. On ``datastore``."""

    def __init__(self, datastore: SQLiteDatastore) -> None:
        super().__init__(datastore)
        self._sqlite = datastore
        self._read = datastore.read
        self._retry = datastore.retry

    def counts(self) -> Counts:
        """See :meth:`journal.reading.LogReader.counts`."""
        return self._read(_counted)

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
        """The JSON Lines export of the filtered events, in batches: (the lines, how many).

        SQLite writes each line's JSON itself (``json()`` also checks every stored JSON text), a page
        of lines as one value, on a thread that reads ahead; only the two digests are computed
        here. The bytes are those of :func:`journal.export.jsonl_lines` over :meth:`event_rows`,
        each line kept one line (:func:`journal.export.one_line_each`). A stored text that is not
        JSON raises :class:`JournalError` naming the event.
        """
        check_redact(redact)
        where, params = _event_filter(call_id, tool, agent_id, since, until, 0)
        shown = {name: "NULL" if name in redact else f"json({name})" for name in ("arguments", "value")}
        redacted = orjson.dumps(sorted(redact)).decode()
        # Each line without its closing brace (the last field is the 'redacted' list, so rtrim takes
        # one brace): the two digests, computed here, close it (as journal.export.jsonl_lines puts them).
        line = (
            "rtrim(json_object('seq', seq, 'at', at, 'call_id', call_id, 'kind', kind, 'tool', tool, "
            "'agent_id', agent_id, 'idempotency_key', idempotency_key, "
            f"'arguments', {shown['arguments']}, 'value', {shown['value']}, 'error', json(error), "
            "'reason', json(reason), 'actor', actor, 'attempt', attempt, 'owner', json(owner), "
            f"'prev_hash', prev_hash, 'hash', hash, 'redacted', json('{redacted}')), '}}')"
        )
        rows_sql = f"SELECT seq, {line} AS line, arguments, value FROM events WHERE {where} AND seq <= ? ORDER BY seq"
        # A page is three values: its lines, its arguments and its values, each joined by U+0001, which
        # no JSON text holds (json() checked them; json_valid those it did not show), an empty text
        # standing for none. So SQLite builds a page in one step, without the GIL, while Python
        # closes the last one.
        checked = " AND ".join(f"({name} IS NULL OR json_valid({name}))" for name in sorted(redact)) or "1"
        page_sql = (
            f"SELECT max(seq), count(*), min({checked}), group_concat(line, char(1){_IN_ORDER}), "
            f"group_concat(coalesce(arguments, ''), char(1){_IN_ORDER}), "
            f"group_concat(coalesce(value, ''), char(1){_IN_ORDER}) FROM ({rows_sql} LIMIT {_EXPORT_ROWS})"
        )
        closer = LineCloser()
        pending: list[str] = []
        size = count = 0
        try:
            for after, (last, n, clean, lines, arguments, values) in read_ahead(
                    self._snapshot_pages(page_sql, params, _EXPORT_ROWS)):
                page = lines.split("\x01"), arguments.split("\x01"), values.split("\x01")
                if clean and len(page[0]) == len(page[1]) == len(page[2]) == n:
                    text = closer.joined(*page)
                else:  # a redacted stored text that is not JSON: the page read row by row
                    text = closer.lines(self._rows_between(rows_sql, params, after, last))
                pending.append(text)
                size += len(text)
                count += n
                # Bounded by bytes, not events: an event may hold a megabyte of arguments.
                if size >= _EXPORT_BYTES:
                    yield utf8_lines("".join(pending)), count
                    pending, size, count = [], 0, 0
        except (sqlite3.Error, JournalError) as e:
            cause = e.__cause__ if isinstance(e, JournalError) else e
            if isinstance(cause, sqlite3.Error) and "JSON" in str(cause):
                # json() refused a stored text: the row path names the event and the field.
                rows = self.event_rows(call_id=call_id, tool=tool, agent_id=agent_id, since=since, until=until)
                for row in rows:
                    next(jsonl_lines([row], redact))
            if isinstance(e, JournalError):
                raise
            raise JournalError(f"The journal {self._sqlite.path} could not be exported: {e}") from e
        if count:
            yield utf8_lines("".join(pending)), count

    def _snapshot_pages(self, sql: str, params: Any, batch: int) -> Iterator[tuple[int, tuple[Any, ...]]]:
        """The pages of ``sql``, an aggregate over at most ``batch`` rows after the ``seq >`` cursor
        ``params[0]`` (its last placeholder ``seq <=`` the head) whose first columns are
        ``max(seq), count(*)``: each page as ``(after, its row)``, its rows those with
        ``after < seq <= max(seq)``. One snapshot, read as :meth:`_snapshot_rows` reads it."""
        reader = self._sqlite.open_reader()
        try:
            head = self._retry(reader, lambda: reader.execute(_SELECT_HEAD).fetchone())
            if head is None:
                return
            after, filters, top = params[0], list(params[1:]), head[0]
            while True:
                page = self._retry(reader, functools.partial(_fetch_one, reader, sql, (after, *filters, top)))
                if page[1]:
                    yield after, page
                if page[1] < batch:
                    return
                after = page[0]
        finally:
            with contextlib.suppress(sqlite3.Error):
                reader.close()

    def _rows_between(self, sql: str, params: Any, after: int, last: int) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` (placeholders as :meth:`_snapshot_pages` takes them) with
        ``after < seq <= last``."""
        return self._read(lambda c: c.execute(sql, (after, *params[1:], last)).fetchall())

    def _snapshot_rows(self, sql: str, params: Any, batch: int) -> Iterator[list[tuple[Any, ...]]]:
        """The rows of ``sql`` (its first column ``seq``; ``params[0]`` the ``seq >`` cursor and its
        last placeholder ``seq <=`` the head), ``batch`` at a time, on a connection of its own.

        The head is read once; then each page, from the last ``seq`` read up to that head, is a read
        of its own. The log is append-only with a gapless ``seq``, so the pages are one consistent
        snapshot; and a reader that stalls between pages (an export into a pager left open) holds
        no read transaction, which would keep SQLite from checkpointing and grow the WAL for as
        long as it stalls. Writers never wait for it. Raises :class:`JournalError` (from the
        sqlite3.Error).
        """
        reader = self._sqlite.open_reader()
        try:
            head = self._retry(reader, lambda: reader.execute(_SELECT_HEAD).fetchone())
            if head is None:
                return
            paged, after, filters, top = f"{sql} LIMIT {int(batch)}", params[0], list(params[1:]), head[0]
            while True:
                rows = self._retry(reader, functools.partial(_fetch_all, reader, paged, (after, *filters, top)))
                if rows:
                    yield rows
                if len(rows) < batch:
                    return
                after = rows[-1][0]
        finally:
            with contextlib.suppress(sqlite3.Error):
                reader.close()

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
        events), byte for byte what :meth:`LogReader.export_csv` writes.

        SQLite checks every stored JSON text (``json_valid``), on one snapshot read in pages. A stored
        text that is not JSON raises :class:`JournalError` naming the event.
        """
        check_redact(redact)
        where, params = _event_filter(call_id, tool, agent_id, since, until, 0)
        checked = " AND ".join(f"({c} IS NULL OR json_valid({c}))" for c in ("arguments", "value", "error", "reason",
                                                                             "owner"))
        sql = f"SELECT {_EVENT_COLUMNS}, {checked} FROM events WHERE {where} AND seq <= ? ORDER BY seq"
        header = csv_header()  # written with the first lines, so that an export that fails at once writes nothing
        try:
            for rows in self._snapshot_rows(sql, params, _BATCH):
                chunk = "".join(csv_lines(rows, redact)).encode()
                if header:
                    chunk, header = header + chunk, b""
                yield chunk, len(rows)
        except sqlite3.Error as e:
            raise JournalError(f"The journal {self._sqlite.path} could not be exported: {e}") from e
        if header:
            yield header, 0

    def keeps_requests(self) -> bool:
        """Whether the journal keeps requests for approval (a journal of a version before them,
        read as it is, does not)."""
        return self._read(schema.has_approvals)

    def head(self) -> tuple[int, str]:
        """The last event's seq and hash; ``(0, GENESIS)`` for an empty journal."""
        row = self._read(lambda c: c.execute(_SELECT_HEAD).fetchone())
        return (0, GENESIS) if row is None else (int(row[0]), str(row[1]))
