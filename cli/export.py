"""Writing the audit trail as JSON Lines or CSV, one event at a time, in bounded memory."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import orjson


def write_events(
    journal: Any,
    filters: dict[str, Any],
    out: BinaryIO,
    *,
    fmt: str,
    redact: frozenset[str] = frozenset(),
    advance: Callable[[int], None] | None = None,
) -> int:
    """Write the filtered events of ``journal`` to ``out`` as ``fmt`` (``jsonl``, or ``csv``, which
    starts with a header row of :data:`journal.export.CSV_COLUMNS`) in batches; ``advance(n)`` is
    told after each batch. Returns the count."""
    if fmt == "csv":
        batches = journal.export_csv(redact=redact, **filters)
    else:
        batches = journal.export_lines(redact=redact, **filters)
    written = 0
    for chunk, count in batches:
        write_all(out, chunk)
        written += count
        if advance is not None and count:
            advance(count)
    return written


def write_all(out: BinaryIO, chunk: bytes) -> None:
    """Write all of ``chunk``: a write to stdout may come back short (a pipe whose reader left, a
    full disk), and the retry then raises the error that a cut output must not hide."""
    view = memoryview(chunk)
    while view:
        written = out.write(view)
        if not written:
            raise OSError(f"the output took no more bytes after {len(chunk) - len(view)} of a batch")
        view = view[written:]


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
