"""The forms a listing (``show``, ``stats``) takes for a program: CSV, TSV, JSON Lines, and whether
the header line is printed; the options that choose one, and the rows each form holds."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import click
import orjson

from guard.store import format_at
from journal.events import JournalStats

F = TypeVar("F", bound=Callable[..., Any])

def listing_options(fn: F) -> F:
    """``--csv``, ``--tsv``, ``--nl`` (parameters ``as_csv``, ``as_tsv``, ``as_nl``) and ``--no-headers``."""
    fn = click.option("--no-headers", is_flag=True, help="Leave out the header line (the table, --csv, --tsv).")(fn)
    for flag, text in reversed((
        ("csv", "Print CSV: a header line, then one row a line (JSON values as text)."),
        ("tsv", "Print tab-separated values, as --csv."),
        ("nl", "Print JSON Lines: one JSON object a row."),
    )):
        fn = click.option(f"--{flag}", f"as_{flag}", is_flag=True, help=text)(fn)
    return fn


def chosen_format(*, as_json: bool, as_csv: bool, as_tsv: bool, as_nl: bool, no_headers: bool,
                  table_headers: bool = True) -> str:
    """The one output asked for: ``table``, ``json``, ``csv``, ``tsv`` or ``nl``. More than one, or
    ``--no-headers`` with an output that has no header line, is a usage error. ``table_headers``:
    whether the table has a header line to leave out."""
    given = [name for name, on in (("json", as_json), ("csv", as_csv), ("tsv", as_tsv), ("nl", as_nl)) if on]
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join('--' + g for g in given)} are outputs of their own: give one")
    chosen = given[0] if given else "table"
    if no_headers and (chosen in ("json", "nl") or (chosen == "table" and not table_headers)):
        where = "the table, --csv or --tsv" if table_headers else "--csv or --tsv"
        what = f"--{chosen}" if given else "the summary"
        raise click.UsageError(f"--no-headers goes with {where}: {what} has no header line")
    return chosen


def cell(value: Any) -> str:
    """A value as a CSV cell: text as it is, null as an empty cell, anything else as its JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def delimited(columns: Sequence[str], rows: Iterable[Mapping[str, Any]], fmt: str, headers: bool = True) -> bytes:
    """``rows`` as CSV (RFC 4180 quoting) or TSV (the same quoting, tab-separated), one line each."""
    out = io.StringIO()
    writer = csv.writer(out, delimiter="\t" if fmt == "tsv" else ",", lineterminator="\n")
    if headers:
        writer.writerow(columns)
    for row in rows:
        writer.writerow([cell(row.get(name)) for name in columns])
    return out.getvalue().encode()


STATS_COLUMNS = ("group", "name", "count", "oldest_at")


def stats_rows(stats: JournalStats) -> list[dict[str, Any]]:
    """``stats`` as rows: the totals (group ``total``: calls, events), one row a status (with when
    its oldest call entered it, for pending and unknown) and one a tool."""
    oldest = {"pending": stats.oldest_pending_at, "unknown": stats.oldest_unknown_at}
    rows: list[dict[str, Any]] = [
        {"group": "total", "name": "calls", "count": stats.calls, "oldest_at": None},
        {"group": "total", "name": "events", "count": stats.events, "oldest_at": None},
    ]
    order = ("pending", "unknown", "committed", "released")
    for status in [*order, *(s for s in sorted(stats.by_status) if s not in order)]:
        at = oldest.get(status)
        rows.append({"group": "status", "name": status, "count": stats.by_status.get(status, 0),
                     "oldest_at": None if at is None else format_at(at)})
    for tool, count in sorted(stats.by_tool.items(), key=lambda item: (-item[1], item[0])):
        rows.append({"group": "tool", "name": tool, "count": count, "oldest_at": None})
    oldest_request = stats.oldest_open_approval_at
    rows.append({"group": "approvals", "name": "open", "count": stats.approvals_open,
                 "oldest_at": None if oldest_request is None else format_at(oldest_request)})
    return rows
