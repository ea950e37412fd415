"""How calls and events look to an operator: tables that fit the terminal, ages, colour, JSON shapes."""

from __future__ import annotations

import json
import os
import shutil
import sys
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import click
import orjson

from guard.leases import OwnerState
from guard.liveness import owner_alive
from guard.store import CallRecord, current_owner, format_at
from journal.events import JournalEvent, JournalStats
from journal.export import one_line_each

ELLIPSIS = "…"

_STATUS_COLOURS = {
    "committed": "green",
    "pending": "yellow",
    "unknown": "red",
    "released": "cyan",
    "replayed": "green",
    "refused": "magenta",
}


def use_colour(stream: Any = None) -> bool:
    """Colour only on a terminal, and never when ``NO_COLOR`` is set (https://no-color.org)."""
    stream = sys.stdout if stream is None else stream
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def paint(text: str, status: str | None, colour: bool) -> str:
    if not colour:
        return text
    fg = _STATUS_COLOURS.get(status or "")
    return click.style(text, fg=fg, bold=status == "unknown") if fg else text


def age(at: datetime | None, now: datetime | None = None) -> str:
    """``"12m ago"``: the largest whole unit of the time since ``at``."""
    if at is None:
        return "-"
    now = now or datetime.now(UTC)
    seconds = max(0, int((now - at).total_seconds()))
    if seconds < 60:
        return f"{seconds}s ago"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes}m ago"
    hours = minutes // 60
    if hours < 48:
        return f"{hours}h ago"
    return f"{hours // 24}d ago"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (controls, NUL, bidi overrides) escaped,
    so a hostile call id or tool name is shown, never obeyed; ``--json`` has the exact text."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def char_width(ch: str) -> int:
    """How many columns a terminal gives ``ch``: 2 for a wide or full-width character (CJK), 0 for a
    combining mark or a format character, 1 otherwise."""
    if ch < "\u0300":  # ASCII and Latin: the common case, at once
        return 1
    if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def display_width(text: str) -> int:
    """How many columns ``text`` takes on a terminal (see :func:`char_width`)."""
    if text.isascii():
        return len(text)
    return sum(char_width(ch) for ch in text)


def pad(text: str, width: int) -> str:
    """``text`` followed by spaces to ``width`` columns."""
    return text + " " * max(0, width - display_width(text))


def _head(text: str, width: int) -> str:
    """The longest start of ``text`` that fits in ``width`` columns."""
    used = 0
    for n, ch in enumerate(text):
        used += char_width(ch)
        if used > width:
            return text[:n]
    return text


def _tail(text: str, width: int) -> str:
    """The longest end of ``text`` that fits in ``width`` columns."""
    used = 0
    for n in range(len(text) - 1, -1, -1):
        used += char_width(text[n])
        if used > width:
            return text[n + 1 :]
    return text


def truncate(text: str, width: int) -> str:
    """``text`` cut to ``width`` columns, ending in an ellipsis when cut."""
    if display_width(text) <= width:
        return text
    if width <= 1:
        return _head(text, width)
    return _head(text, width - 1) + ELLIPSIS


def shorten_middle(text: str, width: int) -> str:
    """``text`` cut to ``width`` columns in its middle (``call_…_9f2a``): ids that share a start
    still differ at their end, as most do."""
    if display_width(text) <= width:
        return text
    if width <= 2:
        return truncate(text, width)
    head = (width - 1) // 3
    start = _head(text, head)
    return start + ELLIPSIS + _tail(text, width - 1 - display_width(start))


def id_cut(ids: Sequence[str], width: int) -> Callable[[str, int], str] | None:
    """How to cut ``ids`` to ``width`` columns and still tell them apart: at their end (as any cell)
    when that does, else in their middle; None when neither does."""
    unique = len(set(ids))
    for cut in (truncate, shorten_middle):
        if len({cut(i, width) for i in ids}) == unique:
            return cut
    return None


def distinct_width(ids: Sequence[str], floor: int) -> int:
    """The fewest columns, ``floor`` or more, at which :func:`id_cut` keeps ``ids`` apart (their
    full width when nothing less does)."""
    widest = max((display_width(i) for i in ids), default=0)
    for width in range(min(floor, widest), widest):
        if id_cut(ids, width) is not None:
            return width
    return widest


def owner_mark(record: CallRecord, state: OwnerState | None = None) -> str | None:
    """For a pending call: whether its owner is alive, by its lease as the journal decides it
    (``state``), or without one by whether the process that recorded it still runs (None otherwise)."""
    if record.status != "pending":
        return None
    if state is not None and state.alive is not None:
        return "owner alive" if state.alive else "owner gone"
    host = (record.owner or {}).get("host")
    if host is not None and host != current_owner()["host"]:
        return f"owner on {host}"
    return "owner alive" if owner_alive(record.owner) else "owner gone"


def status_text(record: CallRecord | None, state: OwnerState | None = None) -> str:
    if record is None:
        return "-"
    mark = owner_mark(record, state)
    if mark is None and record.actor.startswith(("operator:", "reconciler:")):
        mark = f"by {record.actor}"  # settled by hand: resolve, not the guard, recorded it
    return f"{record.status} ({mark})" if mark else record.status


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    shrinkable: Sequence[int] = (),
    ids: int | None = None,
    droppable: Sequence[int] = (),
    floors: Mapping[int, int] | None = None,
    width: int | None = None,
    styles: Sequence[str | None] | None = None,
    colour: bool = False,
    show_headers: bool = True,
) -> list[str]:
    """Lay out ``rows`` under ``headers`` in columns two spaces apart, each as wide as the terminal
    shows its text (a CJK character takes two columns).

    When ``width`` is given and the table is wider, the columns in ``shrinkable`` lose characters
    (widest first, each keeping at least 8) and their cells end in an ellipsis; the column ``ids``
    (a column of ids) is never cut so far that two of its ids look the same, and is cut in the
    middle where its ids share their start. ``floors`` gives a shrinkable column a narrowest width of
    its own. If that is not enough, the columns in ``droppable`` are left out, in that order.
    ``styles`` names a status per row, which colours the status cell (header "STATUS") when
    ``colour``. ``show_headers=False`` leaves out the header line.
    """
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [display_width(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], display_width(cell))
    shown = list(range(len(headers)))
    if width is not None:
        least = {i: max(8, display_width(headers[i])) for i in shrinkable}
        least.update(floors or {})
        floors = least
        if ids is not None:
            floors[ids] = max(display_width(headers[ids]), distinct_width([row[ids] for row in rows], 8))
        drop = list(droppable)
        excess = sum(widths[i] for i in shown) + 2 * (len(shown) - 1) - width
        while excess > 0:
            candidates = [i for i in floors if i in shown and widths[i] > floors[i]]
            if candidates:
                widest = max(candidates, key=lambda i: widths[i])
                widths[widest] -= 1
                excess -= 1
            elif drop:
                gone = drop.pop(0)
                shown.remove(gone)
                excess -= widths[gone] + 2
            else:
                break
    status = list(headers).index("STATUS") if "STATUS" in headers else None
    cut_id = (id_cut([row[ids] for row in rows], widths[ids]) or truncate) if ids is not None else truncate
    lines = ["  ".join(pad(headers[i], widths[i]) for i in shown).rstrip()] if show_headers else []
    for n, row in enumerate(rows):
        cells = []
        for i in shown:
            fitted = cut_id(row[i], widths[i]) if i == ids else truncate(row[i], widths[i])
            text = pad(fitted, widths[i])
            if colour and styles is not None and i == status:
                text = paint(text, styles[n], colour)
            cells.append(text)
        lines.append("  ".join(cells).rstrip())
    return lines


def terminal_width() -> int | None:
    """The terminal's width when stdout is one; None (no limit) when the output goes elsewhere."""
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


CALL_HEADERS = ("CALL ID", "TOOL", "STATUS", "ATTEMPT", "AGENT", "AGE")


def calls_table(records: Sequence[CallRecord], *, width: int | None = None, colour: bool = False,
                states: Mapping[str, OwnerState] | None = None, show_headers: bool = True) -> list[str]:
    """The ``show`` table: one call a row, newest first as given; AGE counts from its last change.
    In a narrow terminal a call id is never cut (it is what an operator copies): the status's mark
    (``(by reconciler:...)``), tools and agents are cut at their end, and AGENT, then ATTEMPT, are
    left out when that is not enough."""
    now = datetime.now(UTC)
    rows = [
        (r.call_id, r.tool, status_text(r, (states or {}).get(r.call_id)), str(r.attempt), r.agent_id or "-",
         age(r.updated_at, now))
        for r in records
    ]
    status_word = max((display_width(r.status) for r in records), default=8)
    return table(
        CALL_HEADERS, rows, shrinkable=(2, 1, 4), droppable=(4, 3), floors={2: max(status_word, 6)}, width=width,
        styles=[r.status for r in records], colour=colour, show_headers=show_headers,
    )


def _json_value(text: str | None, what: str = "a stored value") -> Any:
    try:
        return None if text is None else orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise click.ClickException(f"{what} is not JSON: the journal has been altered (run verify)") from e


def _plain(mapping: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if mapping is None else dict(mapping)


def owner_fields(record: CallRecord, state: OwnerState | None) -> dict[str, Any]:
    """``owner_state`` (``"alive"``, ``"gone"``, or None when the call is not pending) and
    ``lease_expires_at`` (None without a lease) of ``show --json``."""
    if record.status != "pending":
        return {"owner_state": None, "lease_expires_at": None}
    alive = state.alive if state is not None and state.alive is not None else owner_alive(record.owner)
    expires = state.lease_expires_at if state is not None else None
    return {"owner_state": "alive" if alive else "gone",
            "lease_expires_at": format_at(expires) if expires is not None else None}


# The fields of a call in ``show --json``, in order: the columns of ``show --csv``.
CALL_COLUMNS = ("call_id", "tool", "status", "attempt", "agent_id", "idempotency_key", "arguments", "value", "error",
                "reason", "actor", "owner", "owner_alive", "owner_state", "lease_expires_at", "created_at",
                "updated_at", "since", "last_seq")


def call_json(record: CallRecord, state: OwnerState | None = None) -> dict[str, Any]:
    """One call as ``show --json`` prints it: JSON values as values, times as ISO-8601 strings."""
    owner = owner_fields(record, state)
    alive = None if owner["owner_state"] is None else owner["owner_state"] == "alive"
    return {
        "call_id": record.call_id,
        "tool": record.tool,
        "status": record.status,
        "attempt": record.attempt,
        "agent_id": record.agent_id,
        "idempotency_key": record.idempotency_key,
        "arguments": _json_value(record.arguments, f"the arguments of call {record.call_id!r}"),
        "value": _json_value(record.value, f"the value of call {record.call_id!r}"),
        "error": _plain(record.error),
        "reason": _plain(record.reason),
        "actor": record.actor,
        "owner": _plain(record.owner),
        "owner_alive": alive,
        **owner,
        "created_at": format_at(record.created_at),
        "updated_at": format_at(record.updated_at),
        "since": format_at(record.since),
        "last_seq": record.last_seq,
    }


def unprojected_call_json(call_id: str, events: Sequence[JournalEvent]) -> dict[str, Any]:
    """A call id with events but no projection row (only refusals): its fields from its first
    event, and a null status."""
    first, last = events[0], events[-1]
    return {
        "call_id": call_id,
        "tool": first.tool,
        "status": None,
        "attempt": None,
        "agent_id": first.agent_id,
        "idempotency_key": first.idempotency_key,
        "arguments": _json_value(first.arguments),
        "value": None,
        "error": None,
        "reason": None,
        "actor": None,
        "owner": None,
        "owner_alive": None,
        "owner_state": None,
        "lease_expires_at": None,
        "duplicate_of": duplicate_of(events),
        "created_at": format_at(first.at),
        "updated_at": format_at(last.at),
        "since": None,
        "last_seq": last.seq,
    }


def duplicate_of(events: Sequence[JournalEvent]) -> str | None:
    """The earlier call an id without a record of its own was answered as (its events' reason
    ``duplicate_of``), or None."""
    for event in events:
        if event.reason and event.reason.get("code") == "duplicate_of":
            message = event.reason.get("message")
            return message if isinstance(message, str) else None
    return None


def event_detail(event: JournalEvent) -> str:
    """What an event adds in a line: its reason code and message, or its error."""
    parts = []
    if event.reason:
        code, message = event.reason.get("code"), event.reason.get("message")
        parts.append(f"{code}: {message}" if code and message else str(code or message))
    if event.error:
        parts.append(f"{event.error.get('type')}: {event.error.get('message')}")
    if event.kind == "committed" and event.value is not None:
        parts.append(f"value {event.value}")
    return "; ".join(parts)


EVENT_HEADERS = ("SEQ", "AT", "KIND", "ATTEMPT", "ACTOR", "DETAIL")


def events_table(events: Sequence[JournalEvent], *, width: int | None = None, colour: bool = False) -> list[str]:
    rows = [
        (str(e.seq), format_at(e.at), e.kind, str(e.attempt), e.actor, event_detail(e)) for e in events
    ]
    lines = table(EVENT_HEADERS, rows, shrinkable=(4, 5), width=width)
    if colour:
        # colour the KIND cell, found by its fixed offset in each row
        offset = lines[0].index("KIND")
        kind_width = max([len("KIND"), *(len(e.kind) for e in events)])
        for n, e in enumerate(events, 1):
            line = lines[n]
            cell = line[offset : offset + kind_width]
            lines[n] = line[:offset] + paint(cell, e.kind, colour) + line[offset + kind_width :]
    return lines


def call_lines(
    call_id: str,
    record: CallRecord | None,
    events: Sequence[JournalEvent],
    *,
    width: int | None = None,
    colour: bool = False,
    state: OwnerState | None = None,
) -> list[str]:
    """``show CALL_ID`` for a person: the call's state, then every event of it."""
    first = events[0] if events else None
    now = datetime.now(UTC)
    status = "- (no attempt recorded; only refusals)" if record is None else status_text(record, state)
    copy_of = duplicate_of(events) if record is None else None
    if copy_of is not None:  # a re-planned copy, answered as the earlier call
        status = f"- (no attempt of its own: a copy of {printable(copy_of)})"
    fields: list[tuple[str, str]] = [("call", call_id)]
    if record is not None:
        fields += [
            ("tool", record.tool),
            ("status", paint(status, record.status, colour)
             + f"  since {format_at(record.since)} ({age(record.since, now)})"),
            ("attempt", str(record.attempt)),
            ("agent", record.agent_id or "-"),
            ("key", record.idempotency_key or "-"),
            ("arguments", record.arguments or "-"),
        ]
        if record.status == "committed":
            fields.append(("value", record.value if record.value is not None else "(none stored)"))
        if record.error:
            fields.append(("error", f"{record.error.get('type')}: {record.error.get('message')}"))
        if record.reason:
            fields.append(("reason", f"{record.reason.get('code')}: {record.reason.get('message')}"))
        if record.owner:
            fields.append(("owner", f"{record.owner.get('host')} pid {record.owner.get('pid')}"))
        fields.append(("created", f"{format_at(record.created_at)} ({age(record.created_at, now)})"))
    elif first is not None:
        fields += [
            ("tool", first.tool),
            ("status", status),
            ("agent", first.agent_id or "-"),
            ("key", first.idempotency_key or "-"),
            ("arguments", first.arguments or "-"),
        ]
    label = max(len(name) for name, _ in fields)
    lines = [f"{name.ljust(label)}  {text if name == 'status' else printable(text)}" for name, text in fields]
    lines.append("")
    lines += events_table(events, width=width, colour=colour)
    return lines


def stats_lines(stats: JournalStats, *, colour: bool = False) -> list[str]:
    """``stats`` for a person: totals, counts by status and by tool, the oldest open calls."""
    now = datetime.now(UTC)
    lines = [f"calls   {stats.calls}", f"events  {stats.events}", "", "by status"]
    statuses = ("pending", "unknown", "committed", "released")
    names = [*statuses, *(s for s in sorted(stats.by_status) if s not in statuses)]
    for status in names:
        count = stats.by_status.get(status, 0)
        lines.append(f"  {paint(status.ljust(10), status, colour and count > 0)}  {count}")
    lines += ["", "by tool"]
    if stats.by_tool:
        tool_width = max(display_width(printable(t)) for t in stats.by_tool)
        for tool, count in sorted(stats.by_tool.items(), key=lambda item: (-item[1], item[0])):
            lines.append(f"  {pad(printable(tool), tool_width)}  {count}")
    else:
        lines.append("  (none)")
    lines.append("")
    for status, at in (("pending", stats.oldest_pending_at), ("unknown", stats.oldest_unknown_at)):
        text = "-" if at is None else f"{format_at(at)} ({age(at, now)})"
        lines.append(f"oldest {status}  {text}")
    lines += ["", f"approvals open  {stats.approvals_open}"]
    if stats.oldest_open_approval_at is not None:
        at = stats.oldest_open_approval_at
        lines.append(f"oldest open approval  {format_at(at)} ({age(at, now)})")
    return lines


def stats_json(stats: JournalStats) -> dict[str, Any]:
    return {
        "calls": stats.calls,
        "events": stats.events,
        "by_status": dict(stats.by_status),
        "by_tool": dict(stats.by_tool),
        "oldest_pending_at": None if stats.oldest_pending_at is None else format_at(stats.oldest_pending_at),
        "oldest_unknown_at": None if stats.oldest_unknown_at is None else format_at(stats.oldest_unknown_at),
        "approvals_open": stats.approvals_open,
    }


def dumps_line(obj: Any) -> bytes:
    """One JSON Lines line (a NEL, U+2028 or U+2029 in it escaped, so that it is one line to every reader)."""
    try:
        return one_line_each(orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE))
    except TypeError:
        # Nested deeper than orjson writes (a stored value may come close to its limit, and the line
        # wraps it a level or three more): the standard library writes the same compact JSON.
        return one_line_each((json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode())
