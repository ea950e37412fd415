"""Writing the audit trail as JSON Lines or CSV, one event at a time, in bounded memory."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import orjson

from journal.events import JournalEvent

# The CSV columns, in this order: section 3's fields, each hash of a JSON value beside it.
CSV_COLUMNS: tuple[str, ...] = (
    "seq",
    "at",
    "call_id",
    "kind",
    "tool",
    "agent_id",
    "idempotency_key",
    "arguments",
    "arguments_sha256",
    "value",
    "value_sha256",
    "error",
    "reason",
    "actor",
    "attempt",
    "owner",
    "prev_hash",
    "hash",
    "redacted",
)
# Fields whose cell holds JSON text; a null there is an empty cell.
JSON_COLUMNS = frozenset({"arguments", "value", "error", "reason", "owner", "redacted"})

BATCH = 2000
_LINE = orjson.OPT_APPEND_NEWLINE


def _cell(name: str, value: Any) -> str:
    if value is None:
        return ""
    if name in JSON_COLUMNS:
        return orjson.dumps(value).decode()
    return str(value)


def _jsonl(batch: list[JournalEvent], redact: frozenset[str]) -> bytes:
    dumps = orjson.dumps
    return b"".join([dumps(e.export(redact), option=_LINE) for e in batch])


def _csv(batch: list[JournalEvent], redact: frozenset[str]) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    for event in batch:
        line = event.export(redact)
        writer.writerow([_cell(name, line.get(name)) for name in CSV_COLUMNS])
    return text.getvalue().encode()


def write_events(
    events: Iterable[JournalEvent],
    out: BinaryIO,
    *,
    fmt: str,
    redact: frozenset[str] = frozenset(),
    advance: Callable[[int], None] | None = None,
) -> int:
    """Write ``events`` to ``out`` as ``fmt`` (``jsonl`` or ``csv``, which starts with a header
    row) in batches of :data:`BATCH`; ``advance(n)`` is told after each batch. Returns the count."""
    encode = _jsonl if fmt == "jsonl" else _csv
    if fmt == "csv":
        out.write((",".join(CSV_COLUMNS) + "\n").encode())
    written = 0
    batch: list[JournalEvent] = []
    for event in events:
        batch.append(event)
        if len(batch) >= BATCH:
            out.write(encode(batch, redact))
            written += len(batch)
            if advance is not None:
                advance(len(batch))
            batch = []
    if batch:
        out.write(encode(batch, redact))
        written += len(batch)
        if advance is not None:
            advance(len(batch))
    return written


class NotJsonLines(ValueError):
    """A line of an export file is not one JSON object."""


def read_export(stream: Iterable[bytes]) -> Iterable[dict[str, Any]]:
    """The events of an exported JSON Lines file, one dict a line, read as they are needed.

    Blank lines are skipped; any other line that is not a JSON object raises :class:`NotJsonLines`
    naming its line number.
    """
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise NotJsonLines(f"line {number} is not JSON ({e})") from e
        if not isinstance(event, dict):
            raise NotJsonLines(f"line {number} is not a JSON object but {type(event).__name__}")
        yield event
