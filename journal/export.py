"""The audit trail from stored rows: export lines, CSV cells and recomputed hashes, without
building a :class:`~journal.events.JournalEvent` per event (export and verify stream millions).

A row has the columns of :data:`journal.rows.EVENT_COLUMNS`, as both SQL journals store them:
``at`` as its exported ISO-8601 text, JSON fields as canonical JSON text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from .errors import JournalError
from .events import REDACTABLE

__all__ = ["CSV_COLUMNS", "LineCloser", "check_redact", "csv_cell", "csv_cells", "csv_header", "csv_lines",
           "hash_of_row", "jsonl_lines", "one_line_each", "row_hash", "utf8_lines"]

# The CSV columns, in this order: section 3's fields, each digest of a JSON value beside it.
CSV_COLUMNS: tuple[str, ...] = (
    "seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "arguments", "arguments_sha256",
    "value", "value_sha256", "error", "reason", "actor", "attempt", "owner", "prev_hash", "hash", "redacted",
)

_sha256 = hashlib.sha256
_loads = orjson.loads
_dumps = orjson.dumps
_Fragment = orjson.Fragment
_NEWLINE = orjson.OPT_APPEND_NEWLINE

# Characters that may stand raw in a JSON string, but where str.splitlines() (and readers like it)
# would break a line: NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR. Their UTF-8 forms, and escapes.
_BREAKS = (("\x85".encode(), b"\\u0085"), ("\u2028".encode(), b"\\u2028"), ("\u2029".encode(), b"\\u2029"))


def one_line_each(lines: bytes) -> bytes:
    """JSON lines (UTF-8) with every NEL, U+2028 and U+2029 written as its ``\\u`` escape, so that a
    line is a line for every reader, ``splitlines()`` included. The JSON values are the same, and so
    are the digests (they are of the canonical JSON of the values). A byte sequence of one of these
    can only be that character in UTF-8, and in JSON it can only stand in a string."""
    # isascii() checks a word at a time, several times quicker than searching for two byte pairs.
    if lines.isascii() or (b"\xc2\x85" not in lines and b"\xe2\x80" not in lines):
        return lines
    for raw, escaped in _BREAKS:
        lines = lines.replace(raw, escaped)
    return lines


def _digest(text: str | None) -> str | None:
    return None if text is None else _sha256(text.encode()).hexdigest()


def _json(row: tuple[Any, ...], index: int, name: str) -> Any:
    text = row[index]
    if text is None:
        return None
    try:
        return _loads(text)
    except orjson.JSONDecodeError as e:
        raise JournalError(
            f"The {name} of event seq {row[0]} {'are' if name == 'arguments' else 'is'} not JSON; the journal "
            "has been altered (run verify)."
        ) from e


def check_redact(redact: frozenset[str]) -> None:
    """``ValueError`` unless every name in ``redact`` is a field that can be redacted."""
    unknown = redact - REDACTABLE
    if unknown:
        raise ValueError(
            f"cannot redact {', '.join(sorted(unknown))}: redactable fields are {', '.join(sorted(REDACTABLE))}"
        )


def _line(row: tuple[Any, ...], redact: frozenset[str], redacted: list[str]) -> dict[str, Any]:
    return {
        "seq": row[0], "at": row[1], "call_id": row[2], "kind": row[3], "tool": row[4], "agent_id": row[5],
        "idempotency_key": row[6],
        "arguments": None if "arguments" in redact else _json(row, 7, "arguments"),
        "value": None if "value" in redact else _json(row, 8, "value"),
        "error": _json(row, 9, "error"), "reason": _json(row, 10, "reason"), "actor": row[11],
        "attempt": row[12], "owner": _json(row, 13, "owner"), "prev_hash": row[14], "hash": row[15],
        "redacted": redacted, "arguments_sha256": _digest(row[7]), "value_sha256": _digest(row[8]),
    }


def jsonl_lines(rows: Iterable[tuple[Any, ...]], redact: frozenset[str] = frozenset()) -> Iterator[bytes]:
    """One JSON line (with its newline) per row: the export line of SPEC section 4, the same object
    as :meth:`JournalEvent.export` (its two digests last, as SQLite's own export writes them).
    Raises :class:`JournalError` for a stored field that is not JSON."""
    check_redact(redact)
    redacted = sorted(redact)
    if redact:
        for row in rows:
            yield _dumped(_line(row, redact, redacted), row)
        return
    loads, dumps, sha256, newline = _loads, _dumps, _sha256, _NEWLINE
    for row in rows:
        # The common case in one expression: a stored text that is not JSON falls back to _line,
        # which names the field.
        arguments, value, error, reason, owner = row[7], row[8], row[9], row[10], row[13]
        try:
            line = {
                "seq": row[0], "at": row[1], "call_id": row[2], "kind": row[3], "tool": row[4],
                "agent_id": row[5], "idempotency_key": row[6],
                "arguments": None if arguments is None else loads(arguments),
                "value": None if value is None else loads(value),
                "error": None if error is None else loads(error),
                "reason": None if reason is None else loads(reason),
                "actor": row[11], "attempt": row[12],
                "owner": None if owner is None else loads(owner),
                "prev_hash": row[14], "hash": row[15], "redacted": redacted,
                "arguments_sha256": None if arguments is None else sha256(arguments.encode()).hexdigest(),
                "value_sha256": None if value is None else sha256(value.encode()).hexdigest(),
            }
        except orjson.JSONDecodeError:
            line = _line(row, redact, redacted)
        try:
            yield dumps(line, option=newline)
        except TypeError:
            yield _dumped(line, row)


# A call's events carry the same arguments, a few events apart: the digests of texts up to _SHORT
# characters are remembered, _REMEMBERED of them at most (the memory stays bounded).
_SHORT = 2048
_REMEMBERED = 4096


class LineCloser:
    """Closes export lines that the store wrote up to their last field: adds the two digests,
    which only Python computes. One closer serves one export, batch after batch."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[str | None, str] = {None: "null"}  # a stored text -> its digest as JSON

    def joined(self, lines: list[str], arguments: list[str], values: list[str]) -> str:
        """:meth:`lines` of rows given as three lists, where an empty text is none (a JSON text is
        never empty): as SQLite hands over a page whose stored texts it has checked."""
        get, sha256 = self._seen.get, _sha256
        closed: list[str] = []
        append = closed.append
        for line, stored, value in zip(lines, arguments, values, strict=True):
            quoted = get(stored or None) or self._remember(stored)
            value_digest = '"' + sha256(value.encode()).hexdigest() + '"' if value else "null"
            append(f'{line},"arguments_sha256":{quoted},"value_sha256":{value_digest}}}\n')
        return "".join(closed)

    def _remember(self, text: str) -> str:
        """The digest of ``text`` as JSON, remembered if ``text`` is short."""
        quoted = '"' + _sha256(text.encode()).hexdigest() + '"'
        if len(text) <= _SHORT:
            seen = self._seen
            if len(seen) > _REMEMBERED:
                seen.clear()
                seen[None] = "null"
            seen[text] = quoted
        return quoted

    def lines(self, rows: Iterable[tuple[Any, ...]]) -> str:
        """The JSON lines of ``rows``, each ``(seq, line, arguments, value)``: ``line`` an export line
        without its closing brace, ``arguments`` and ``value`` the stored texts (or None). Each
        line gets ``arguments_sha256`` and ``value_sha256``, last, as :func:`jsonl_lines` puts them."""
        get, sha256 = self._seen.get, _sha256
        closed: list[str] = []
        append = closed.append
        for _, line, arguments, value in rows:
            quoted = get(arguments)
            if quoted is None:
                quoted = self._remember(arguments)
            value_digest = "null" if value is None else '"' + sha256(value.encode()).hexdigest() + '"'
            append(f'{line},"arguments_sha256":{quoted},"value_sha256":{value_digest}}}\n')
        return "".join(closed)


def utf8_lines(text: str) -> bytes:
    """JSON lines as UTF-8, each line one line for every reader (:func:`one_line_each`)."""
    if text.isascii():  # known without a scan: most exports hold no other character
        return text.encode()
    return one_line_each(text.encode())


_STORED_JSON = (("arguments", 7), ("value", 8), ("error", 9), ("reason", 10), ("owner", 13))


def _dumped(line: dict[str, Any], row: tuple[Any, ...]) -> bytes:
    """``line`` as a JSON line; a value nested deeper than orjson writes (about 250 levels, which a
    stored value may reach) goes in as its stored text, which is canonical JSON already."""
    try:
        return _dumps(line, option=_NEWLINE)
    except TypeError:
        shallow = dict(line)
        for field, index in _STORED_JSON:
            if shallow[field] is not None:
                shallow[field] = _Fragment(row[index])
        return _dumps(shallow, option=_NEWLINE)


def csv_cells(rows: Iterable[tuple[Any, ...]], redact: frozenset[str] = frozenset()) -> Iterator[list[str]]:
    """The CSV cells of each row, in :data:`CSV_COLUMNS` order: JSON values as their JSON text,
    null as an empty cell."""
    check_redact(redact)
    redacted_text = _dumps(sorted(redact)).decode()
    for row in rows:
        for index, name in ((7, "arguments"), (8, "value"), (9, "error"), (10, "reason"), (13, "owner")):
            _json(row, index, name)  # a cell of text that is not JSON would hide an altered journal
        yield [
            str(row[0]), row[1], row[2] or "", row[3], row[4], row[5] or "", row[6] or "",
            "" if "arguments" in redact or row[7] is None else row[7], _digest(row[7]) or "",
            "" if "value" in redact or row[8] is None else row[8], _digest(row[8]) or "",
            row[9] or "", row[10] or "", row[11], str(row[12]), row[13] or "", row[14], row[15], redacted_text,
        ]


_NEEDS_QUOTES = frozenset(',"\r\n')


def csv_cell(text: Any) -> str:
    """One CSV cell (RFC 4180): quoted, with its quotes doubled, when it holds a comma, a quote, a
    carriage return or a line feed; as it is otherwise."""
    cell = text if type(text) is str else str(text)  # only an altered row stores other types in a text column
    if _NEEDS_QUOTES.isdisjoint(cell):
        return cell
    return '"' + cell.replace('"', '""') + '"'


def _json_cell(text: str | None) -> str:
    """:func:`csv_cell` of a stored JSON text (or of nothing), made quickly: most hold quotes."""
    if text is None:
        return ""
    if '"' in text or "," in text or "\n" in text or "\r" in text:
        return '"' + text.replace('"', '""') + '"'
    return text


def csv_header() -> bytes:
    """The first line of a CSV export: :data:`CSV_COLUMNS`."""
    return (",".join(CSV_COLUMNS) + "\n").encode()


def csv_lines(rows: Iterable[tuple[Any, ...]], redact: frozenset[str] = frozenset()) -> Iterator[str]:
    """The CSV line of each row (without the header), cells in :data:`CSV_COLUMNS` order, each as
    :func:`csv_cell` makes it: the same bytes from every store.

    Every stored JSON text is checked (a cell of text that is not JSON would hide an altered
    journal) unless the row carries a 17th column that is true: the store checked them already.
    """
    check_redact(redact)
    redacted = csv_cell(_dumps(sorted(redact)).decode())
    hide_arguments, hide_value = "arguments" in redact, "value" in redact
    sha256, needs_quotes = _sha256, _NEEDS_QUOTES
    for row in rows:
        if len(row) < 17 or not row[16]:
            for index, name in ((7, "arguments"), (8, "value"), (9, "error"), (10, "reason"), (13, "owner")):
                _json(row, index, name)
        seq, at, call_id, kind, tool, agent_id, key, arguments, value, error, reason, actor, attempt, owner = row[:14]
        prev_hash, digest = row[14], row[15]
        call_id, agent_id, key = call_id or "", agent_id or "", key or ""
        try:
            plain = at + call_id + kind + tool + agent_id + key + actor + prev_hash + digest
        except TypeError:
            plain = ","  # a column of an altered row that is not text: the cell by cell way
        if type(seq) is not int or type(attempt) is not int or not needs_quotes.isdisjoint(plain):
            yield ",".join([csv_cell(c) for c in next(csv_cells([row[:16]], redact))]) + "\n"
            continue
        yield (
            f"{seq},{at},{call_id},{kind},{tool},{agent_id},{key},"
            f"{'' if hide_arguments else _json_cell(arguments)},"
            f"{'' if arguments is None else sha256(arguments.encode()).hexdigest()},"
            f"{'' if hide_value else _json_cell(value)},"
            f"{'' if value is None else sha256(value.encode()).hexdigest()},"
            f"{_json_cell(error)},{_json_cell(reason)},{actor},{attempt},{_json_cell(owner)},{prev_hash},{digest},"
            f"{redacted}\n"
        )


def row_hash(row: tuple[Any, ...]) -> str:
    """The hash a stored row should carry, recomputed by the rule of section 3 from its own fields.

    The stored error, reason and owner are canonical JSON text already, so they enter the body as
    they are; a stored text that is not canonical (an altered row) gives another hash, as it should.
    """
    arguments = row[7]
    return hash_of_row(row, None if arguments is None else _sha256(arguments.encode()).hexdigest())


def hash_of_row(row: tuple[Any, ...], arguments_sha256: str | None) -> str:
    """:func:`row_hash`, given the digest of the row's arguments text (``None``: it has none),
    which the rows of one call share."""
    value, error, reason, owner = row[8], row[9], row[10], row[13]
    # The keys written in sorted order, so orjson need not sort them: the same canonical bytes.
    body = _dumps({
        "actor": row[11], "agent_id": row[5],
        "arguments_sha256": arguments_sha256,
        "at": row[1], "attempt": row[12], "call_id": row[2],
        "error": None if error is None else _Fragment(error),
        "idempotency_key": row[6], "kind": row[3],
        "owner": None if owner is None else _Fragment(owner),
        "reason": None if reason is None else _Fragment(reason),
        "seq": row[0], "tool": row[4],
        "value_sha256": None if value is None else _sha256(value.encode()).hexdigest(),
    })
    return _sha256(row[14].encode("ascii") + body).hexdigest()
