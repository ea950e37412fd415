"""``airlock journal show``: the calls, newest first, filtered and paged, or one call and every event of it."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

import click
from click.core import ParameterSource

from guard.store import format_at
from journal import Journal, open_journal
from journal.archive import archive_holding, archived_call_last_seq, recorded_archives

from . import render
from .console.reads import call_and_events
from .listing import chosen_format, delimited, listing_options
from .options import MOMENT, TEXT, db_option, describe, echo, echo_bytes, json_option

STATUSES = ("pending", "committed", "unknown", "released")

# More calls than any journal holds, and within the 64-bit integers SQL takes for LIMIT.
MOST_CALLS = 2**62


@click.command()
@click.argument("call_id", required=False, type=TEXT)
@click.option("--status", "statuses", type=click.Choice(STATUSES, case_sensitive=False), multiple=True,
              help="Only calls in this status; given more than once, in any of them.")
@click.option("--tool", type=TEXT, help="Only calls of this tool.")
@click.option("--agent", "agent_id", type=TEXT, help="Only calls of this agent.")
@click.option("--since", type=MOMENT, help="Only calls updated since: ISO-8601, or an age like 10m, 2h, 3d.")
@click.option("--until", type=MOMENT, help="Only calls updated before this time (ISO-8601, or an age).")
@click.option("--key", "idempotency_key", type=TEXT, metavar="IDEMPOTENCY_KEY",
              help="Only the calls with this idempotency key (what the backend hands you).")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="At most this many calls.")
@click.option("--offset", type=click.IntRange(min=0), default=0,
              help="Skip the first N calls: the next page is --offset 50, then 100, ...")
@click.option("--all", "every", is_flag=True, help="Every call that matches, however many (no --limit).")
@click.option("--watch", is_flag=True,
              help="Show the table again every --interval seconds until Ctrl-C (without --status: the calls in "
                   "doubt, pending and unknown).")
@click.option("--interval", type=click.FloatRange(min=0.1, max=3600), default=2.0, show_default=True,
              help="Seconds between two tables of --watch.")
@json_option
@listing_options
@db_option
@click.pass_context
def show(
    ctx: click.Context,
    call_id: str | None,
    statuses: tuple[str, ...],
    tool: str | None,
    agent_id: str | None,
    since: datetime | None,
    until: datetime | None,
    idempotency_key: str | None,
    limit: int,
    offset: int,
    every: bool,
    watch: bool,
    interval: float,
    as_json: bool,
    as_csv: bool,
    as_tsv: bool,
    as_nl: bool,
    no_headers: bool,
    db: str,
) -> None:
    """Show the calls, newest first, or one call and every event of it.

    A pending call is marked "owner alive" while the process that recorded it still runs on
    this host, "owner gone" when it does not. --json (or --nl) prints JSON Lines, one call a line
    (one object with an "events" list for CALL_ID); --csv and --tsv print the same fields. When
    more calls match than are shown, a note on stderr says so, whatever the output.

    Example:

    \b
        airlock journal show --status unknown --since 2h

    \b
        airlock journal show --status pending --status unknown

    \b
        airlock journal show --status unknown --all --csv > unknown.csv

    \b
        airlock journal show call_7Qx2 --json
    """
    if call_id is not None:
        _refuse_list_flags(ctx)
        _show_call(call_id, as_json, db)
        return
    fmt = chosen_format(as_json=as_json, as_csv=as_csv, as_tsv=as_tsv, as_nl=as_nl, no_headers=no_headers)
    if every and ctx.get_parameter_source("limit") is not ParameterSource.DEFAULT:
        raise click.UsageError("--all shows every call; it cannot be combined with --limit")
    if watch:
        if fmt != "table":
            raise click.UsageError("--watch shows the table again and again: it goes with no other output")
        _watch(ctx, statuses or ("pending", "unknown"), interval)
        return
    with open_journal(db, readonly=True, create=False) as j:
        # One more than asked for tells whether the list was cut at --limit; a larger --limit is all,
        # and a larger --offset is past them all (SQL takes neither beyond 64 bits).
        limit = min(limit, MOST_CALLS)
        records = j.calls(status=statuses or None, tool=tool, agent_id=agent_id, since=since, until=until,
                          idempotency_key=idempotency_key, limit=None if every else limit + 1,
                          offset=min(offset, MOST_CALLS))
        cut = not every and len(records) > limit
        records = records if every else records[:limit]
        states = j.owner_states(records)
        unseen_tool = not records and tool is not None and not j.calls(tool=tool, limit=1)
        if fmt in ("json", "nl"):
            echo_bytes(*(render.dumps_line(render.call_json(r, states.get(r.call_id))) for r in records))
        elif fmt in ("csv", "tsv"):
            shown = [render.call_json(r, states.get(r.call_id)) for r in records]
            echo_bytes(delimited(render.CALL_COLUMNS, shown, fmt, headers=not no_headers))
    if fmt == "table":
        if not records:
            click.echo("No calls match." if not offset else f"No calls match past the first {offset}.", err=True)
            if tool is not None and unseen_tool:
                click.echo(f"The journal has no call of the tool {tool!r} at all: check its name "
                           "(`airlock journal stats` lists the tools).", err=True)
        else:
            table = render.calls_table(records, width=render.terminal_width(), colour=render.use_colour(),
                                       states=states, show_headers=not no_headers)
            echo("\n".join(table))
    if cut:
        click.echo(_cut_note(offset, len(records)), err=True)


def _watch(ctx: click.Context, statuses: tuple[str, ...], interval: float) -> None:
    """``show --watch``: the table of the calls in ``statuses`` again every ``interval`` seconds, the
    screen cleared between two on a terminal; Ctrl-C ends it (exit 0: watching has no result)."""
    import time

    from guard.store import utc_now

    clear = sys.stdout.isatty()
    try:
        while True:
            ctx.invoke(show, statuses=statuses, tool=ctx.params["tool"], agent_id=ctx.params["agent_id"],
                       since=ctx.params["since"], until=ctx.params["until"],
                       idempotency_key=ctx.params["idempotency_key"], limit=ctx.params["limit"],
                       offset=ctx.params["offset"],
                       every=ctx.params["every"], watch=False, interval=interval, as_json=False, as_csv=False,
                       as_tsv=False, as_nl=False, no_headers=ctx.params["no_headers"], db=ctx.params["db"],
                       call_id=None)
            stamp = f"-- {format_at(utc_now())}: {' or '.join(statuses)}, every {interval:g}s; Ctrl-C ends --"
            echo(stamp)
            time.sleep(interval)
            if clear:
                echo_bytes(b"\x1b[H\x1b[2J")
    except KeyboardInterrupt:
        click.echo("", err=True)


def _refuse_list_flags(ctx: click.Context) -> None:
    """Refuse the flags of ``show``'s list of calls when it is given a CALL_ID, which shows one call."""
    filters = {"statuses": "--status", "tool": "--tool", "agent_id": "--agent", "since": "--since",
               "until": "--until", "idempotency_key": "--key", "limit": "--limit", "offset": "--offset",
               "every": "--all", "watch": "--watch"}
    given = [flag for name, flag in filters.items() if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT]
    if given:
        verb, it = ("filter", "they") if len(given) > 1 else ("filters", "it")
        raise click.UsageError(f"{', '.join(given)} {verb} the list of calls; {it} cannot be combined with "
                               "CALL_ID, which shows one call")
    forms = {"as_csv": "--csv", "as_tsv": "--tsv", "as_nl": "--nl", "no_headers": "--no-headers"}
    listed = [flag for name, flag in forms.items() if ctx.params[name]]
    if listed:
        raise click.UsageError(f"{listed[0]} goes with the list of calls; for the events of one call: "
                               "airlock journal export --call CALL_ID --format csv")


def _cut_note(offset: int, shown: int) -> str:
    """What stderr says when more calls match than a page shows, and how to see them."""
    if not offset:
        return f"(the newest {shown}; more match: pass --limit for more, --offset {shown} for the next page, or --all)"
    return (f"(calls {offset + 1} to {offset + shown}, newest first; more match: pass --offset {offset + shown} "
            "for the next page, or --all)")


def _show_call(call_id: str, as_json: bool, db: str) -> None:
    with open_journal(db, readonly=True, create=False) as j:
        record, events = call_and_events(j, call_id)
        state = j.owner_states([record]).get(call_id) if record is not None else None
        archived = _archived_events(j, call_id) if record is not None else None
    if record is None and not events:
        raise click.ClickException(f"no call {call_id!r} in the journal {describe(db)}")
    if as_json:
        shown = render.call_json(record, state) if record is not None else render.unprojected_call_json(call_id, events)
        shown["events"] = [e.export() for e in events]
        if archived is not None:
            shown["archived"] = archived
        echo_bytes(render.dumps_line(shown))
        return
    colour = render.use_colour()
    echo("\n".join(render.call_lines(call_id, record, events, width=render.terminal_width(), colour=colour,
                                     state=state)))
    if archived is not None:
        echo(f"\n{_archived_note(archived, bool(events))}")
    if record is not None and record.status in ("pending", "unknown"):
        echo(
            f"\nAsk the backend whether idempotency key {record.idempotency_key} was applied, then settle it:\n"
            f"  airlock journal resolve {call_id} --applied --reason \"...\"      (it happened)\n"
            f"  airlock journal resolve {call_id} --not-applied --reason \"...\"  (it did not)"
        )


def _archived_events(j: Journal, call_id: str) -> dict[str, Any] | None:
    """Where the events of ``call_id`` that the journal archived went: ``last_seq``, the last of
    them that changed the call's state (the projection's ``last_seq`` as of the archived head), and
    the archive file that holds it, as the journal recorded it (``file``, ``file_first_seq``,
    ``file_last_seq``; null when it recorded none); None when none of its events was archived."""
    last = archived_call_last_seq(j, call_id)
    if last is None:
        return None
    holding = archive_holding(recorded_archives(j), last)
    return {"last_seq": last, "file": None if holding is None else holding.file,
            "file_first_seq": None if holding is None else holding.first_seq,
            "file_last_seq": None if holding is None else holding.upto_seq}


def _archived_note(archived: dict[str, Any], some_left: bool) -> str:
    """What ``show CALL_ID`` says of the call's events that were archived (not in the table)."""
    which = "Earlier events" if some_left else "Events"
    last, file = archived["last_seq"], archived["file"]
    said = f"{which} of this call were archived and are not shown: seq {last}, the last that changed its state,"
    if file is None:
        return f"{said} was archived, but the journal holds no record of the archive file."
    first, upto = archived["file_first_seq"], archived["file_last_seq"]
    earlier = "" if first == 1 else "; earlier ones are there or in the archives before it"
    return f"{said} is in the archive {file} (seq {first} to {upto}){earlier}."
