"""``airlock journal ...``: inspect calls, settle the ones in doubt, export and verify the audit trail."""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import os
import shlex
import stat
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import click
import orjson
from click.core import ParameterSource

from guard.store import format_at
from journal import Journal, open_journal
from journal.archive import archive_holding, archived_call_last_seq, recorded_archives
from journal.chain import GAP, verify_lines
from journal.events import REDACTABLE, VerifyReport
from journal.rows import unfaithful_json
from journal.signing import SigningKey

from . import approvals, archive, audit, console, prometheus, reconcile, render
from .console.reads import call_and_events
from .export import NotJsonLines, read_export, write_events, write_file
from .listing import STATS_COLUMNS, chosen_format, delimited, listing_options, stats_rows
from .options import (
    MOMENT,
    TEXT,
    FieldList,
    Group,
    db_option,
    describe,
    echo,
    echo_bytes,
    json_levels,
    json_option,
    output_failed,
    reason_text,
)

T = TypeVar("T")

STATUSES = ("pending", "committed", "unknown", "released")

# More calls than any journal holds, and within the 64-bit integers SQL takes for LIMIT.
MOST_CALLS = 2**62


@click.group(cls=Group)
def journal() -> None:
    """Inspect and settle the calls in an effect journal, and export or verify its audit trail.

    The journal is --db, else $AIRLOCK_JOURNAL, else ./airlock-journal.db; a postgresql:// URL
    names a PostgreSQL journal. Commands that only read never create or change it.

    Example:

    \b
        airlock journal show --status unknown
    """


def _echo_lines(lines: list[str]) -> None:
    echo("\n".join(lines))


# -- show ----------------------------------------------------------------------------------------


@journal.command()
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
            _echo_lines(render.calls_table(records, width=render.terminal_width(), colour=render.use_colour(),
                                           states=states, show_headers=not no_headers))
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


def in_doubt(j: Journal) -> dict[str, Any]:
    """The counts a runbook alerts on: pending calls whose owner is alive and gone, the calls in
    doubt (unknown, and pending with the owner gone) and when the oldest of them entered its status."""
    gauges = prometheus.read_gauges(j)
    owners = pending_owners(j)
    oldest = gauges.oldest_in_doubt
    return {**owners, "calls_in_doubt": gauges.in_doubt,
            "oldest_in_doubt_at": None if oldest is None else format_at(oldest)}


def pending_owners(j: Journal) -> dict[str, int]:
    """How many pending calls have an owner alive (a live lease, or a running process on this host
    without one), and how many an owner gone: those are in doubt."""
    records = j.calls(status="pending", limit=None)
    states = j.owner_states(records)
    alive = sum(1 for r in records if states[r.call_id].alive)
    return {"pending_owner_alive": alive, "pending_owner_gone": len(records) - alive}


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
    _echo_lines(render.call_lines(call_id, record, events, width=render.terminal_width(), colour=colour,
                                  state=state))
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


# -- resolve -------------------------------------------------------------------------------------


def default_operator() -> str:
    """Who is at the keyboard: the login name, else ``uid:N``."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = ""
    return name or f"uid:{os.getuid()}"


# show --json prints a value within its call and the call's events, and orjson writes at most 254 levels.
MOST_VALUE_LEVELS = 250


def _json_text(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    too_deep = click.BadParameter(f"nests arrays or objects too deeply to be stored (at most {MOST_VALUE_LEVELS} "
                                  "levels)", ctx, param)
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e):
            raise too_deep from e
        hint = ""
        if value.strip() and value.strip()[0] not in '{["-0123456789':  # a bare word: meant as a string
            hint = f"; a string is given in JSON's quotes: --value {shlex.quote(orjson.dumps(value.strip()).decode())}"
        raise click.BadParameter(f"{value!r} is not JSON ({e}){hint}", ctx, param) from e
    if json_levels(parsed) > MOST_VALUE_LEVELS:
        raise too_deep
    problem = unfaithful_json(value)
    if problem is not None:  # stored, it would not be the value written
        advice = "write each key once" if "twice" in problem else "send a large number as a string"
        raise click.BadParameter(f"{value!r} {problem}; {advice}", ctx, param)
    return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS).decode()


@journal.command()
@click.argument("call_id", type=TEXT)
@click.option("--applied", is_flag=True, help="The backend confirms the effect happened: record it committed.")
@click.option("--not-applied", is_flag=True, help="The backend confirms it did not happen: release the call.")
@click.option("--value", type=TEXT, callback=_json_text, metavar="JSON",
              help="With --applied: the tool's result as JSON, which replays then return.")
@click.option("--reason", type=TEXT, required=True, callback=reason_text,
              help="Why: what the backend said (required).")
@click.option("--operator", type=TEXT, help="Who settles it. [default: your login name]")
@click.option("--force", is_flag=True, help="Settle a pending call even though its owner process still runs.")
@json_option
@db_option
def resolve(
    call_id: str,
    applied: bool,
    not_applied: bool,
    value: str | None,
    reason: str,
    operator: str | None,
    force: bool,
    as_json: bool,
    db: str,
) -> None:
    """Settle a pending or unknown call after checking with the backend.

    --applied appends "committed": replays then return --value, or are refused
    replay_value_unavailable without one; the tool is never run again. --not-applied appends
    "released": the next call with this id runs the tool. The event's actor is operator:NAME.

    Example:

    \b
        airlock journal resolve call_7Qx2 --applied --value '{"charge_id": "ch_1"}' --reason "ledger shows ch_1"

    \b
        airlock journal resolve call_7Qx2 --not-applied --reason "no charge with this key"
    """
    if applied == not_applied:
        raise click.UsageError("give exactly one of --applied or --not-applied")
    if not_applied and value is not None:
        raise click.UsageError("--value goes with --applied only: a call that did not happen has no result")
    operator = default_operator() if operator is None else operator.strip()
    if not operator:
        raise click.BadParameter("name who settles the call", param_hint="--operator")
    # Checked on a read-only open first: opening for writing would migrate an older journal, and a
    # refused resolve changes nothing.
    with open_journal(db, readonly=True) as j:
        j.check_resolve(call_id, applied=applied, reason=reason, operator=operator, value=value, force=force)
    with open_journal(db, create=False) as j:
        event = j.resolve(call_id, applied=applied, reason=reason, operator=operator, value=value, force=force)
    if as_json:
        echo_bytes(render.dumps_line(event.export()))
        return
    echo(f"Appended seq {event.seq}: {event.kind} by {event.actor} for call {call_id} (attempt {event.attempt}).")
    if event.kind == "released":
        echo("The next call with this id runs the tool again.")
    elif event.value is not None:
        echo(f"Replays of this call now return {event.value}.")
    else:
        echo("Replays of this call are refused replay_value_unavailable; it is never run again.")


# -- export --------------------------------------------------------------------------------------


@journal.command()
@click.option("--nl", "as_nl", is_flag=True, help="JSON Lines, one event a line (the default).")
@click.option("--csv", "as_csv", is_flag=True, help="CSV: a header row, JSON values as text.")
@click.option("--format", "fmt", type=click.Choice(("jsonl", "csv")), default=None,
              help="The same as --nl or --csv (jsonl or csv).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True, allow_dash=True, path_type=Path),
              help="Write to this file instead of stdout ('-': stdout).")
@click.option("--since", type=MOMENT, help="Only events at or after: ISO-8601, or an age like 10m, 2h, 3d.")
@click.option("--until", type=MOMENT, help="Only events before this time.")
@click.option("--call", "call_id", type=TEXT, help="Only the events of this call.")
@click.option("--tool", type=TEXT, help="Only events of this tool.")
@click.option("--agent", "agent_id", type=TEXT, help="Only events of this agent.")
@click.option("--redact", type=FieldList(tuple(sorted(REDACTABLE))), multiple=True, metavar="FIELDS",
              help="Comma-separated, or the flag repeated: arguments,value. Each becomes null and is named "
                   "in 'redacted'; its sha256 stays, so the export still verifies.")
@click.option("--sign", "key_file", type=click.Path(dir_okay=False, path_type=Path), metavar="KEY",
              help="Sign it: write OUTPUT.manifest.json beside --output, signed with this private key (keygen).")
@db_option
def export(
    as_nl: bool,
    as_csv: bool,
    fmt: str | None,
    output: Path | None,
    since: datetime | None,
    until: datetime | None,
    call_id: str | None,
    tool: str | None,
    agent_id: str | None,
    redact: tuple[frozenset[str], ...],
    key_file: Path | None,
    db: str,
) -> None:
    """Export the audit trail, one event at a time, in seq order.

    Every field of each event, plus arguments_sha256 and value_sha256; arguments, value, error,
    reason and owner are JSON values. A filtered export has gaps in seq: verify it with
    --allow-gaps. Writing to --output replaces the file only once the export is complete.

    Example:

    \b
        airlock journal export --since 2026-12-01 --redact arguments,value -o audit.jsonl

    \b
        airlock journal export --csv --tool charge > charges.csv
    """
    given = [f for f, on in (("jsonl", as_nl), ("csv", as_csv)) if on] + ([fmt] if fmt is not None else [])
    if len(set(given)) > 1:
        raise click.UsageError("--nl, --csv and --format choose one output: give one")
    fmt = given[0] if given else "jsonl"
    if output == Path("."):  # click makes an empty --output the current directory
        raise click.BadParameter("is empty: name the file to write the export to", param_hint="'--output' / '-o'")
    if output == Path("-"):  # the usual name for stdout; a file named so is ./- in full
        output = None
    if key_file is not None and (output is None or fmt != "jsonl"):
        raise click.UsageError("--sign writes a manifest beside the export: it needs --output FILE, in the "
                               "jsonl format")
    signer = audit.load_key(key_file)
    redacted = frozenset().union(*redact)  # every --redact given counts: none is dropped
    filters: dict[str, Any] = {"call_id": call_id, "tool": tool, "agent_id": agent_id, "since": since, "until": until}
    journal_file = None if output is None else _journal_file(output, db)
    if journal_file is not None:
        what = "the journal" if journal_file == db else "a file SQLite keeps with the journal"
        raise click.BadParameter(f"{output} is {what} {db}: write the export to another file",
                                 param_hint="'--output' / '-o'")
    with open_journal(db, readonly=True, create=False) as j:
        if output is None:
            try:
                out = sys.stdout.buffer
                write_events(j, filters, out, fmt=fmt, redact=redacted)
                out.flush()
            except OSError as e:
                output_failed(e, "the export")
            return
        written = _export_to_file(j, filters, output, fmt, redacted, signer)
    click.echo(f"Exported {written} events to {output}", err=True)


def _journal_file(output: Path, db: str) -> str | None:
    """Which of the SQLite journal ``db`` and the files SQLite keeps beside it ``output`` is, or None."""
    if db.startswith(("postgresql://", "postgres://")):
        return None
    real = os.path.realpath(db)  # SQLite keeps its side files beside the file a link names
    for name in (db, f"{db}-wal", f"{db}-shm", f"{db}-journal", f"{real}-wal", f"{real}-shm", f"{real}-journal"):
        if os.path.realpath(output) == os.path.realpath(name):  # realpath: a symlink loop is no error
            return name
        try:
            if os.path.samefile(output, name):  # a hard link, say
                return name
        except OSError:  # one of the two does not exist: not the same file
            continue
    return None


def _export_to_file(j: Journal, filters: dict[str, Any], output: Path, fmt: str, redact: frozenset[str],
                    signer: SigningKey | None = None) -> int:
    try:
        replaceable = stat.S_ISREG(output.stat().st_mode)
    except FileNotFoundError:
        replaceable = True
    except OSError as e:
        raise click.ClickException(f"cannot write to {output}: {e.strerror or e}") from e
    if not replaceable:
        if signer is not None:
            raise click.ClickException(f"{output} is not a regular file: a signed export needs one, beside its "
                                       "manifest")
        # A FIFO or a device is written into: renaming a file over it would replace the node.
        try:
            with output.open("wb") as out:
                return _write_export(j, filters, out, fmt, redact)
        except BrokenPipeError:
            sys.exit(1)  # the reader of a pipe went away (-o /dev/stdout | head): as for stdout, quietly
        except OSError as e:
            raise click.ClickException(f"the export could not be written to {output}: {e.strerror or e}") from e
    try:
        if signer is not None:
            return audit.export_signed(output, filters, redact, signer,
                                       lambda out: _write_export(j, filters, out, fmt, redact))
        # A symbolic link stays one: the file it names is the one replaced (/dev/stdout sent to a file, say).
        return write_file(Path(os.path.realpath(output)), lambda out: _write_export(j, filters, out, fmt, redact))
    except OSError as e:
        raise click.ClickException(f"the export could not be written to {output}: {e.strerror or e}") from e


def _write_export(j: Journal, filters: dict[str, Any], out: BinaryIO, fmt: str, redact: frozenset[str]) -> int:
    """Write the export to ``out``, with a progress bar when stderr is a terminal; returns the count."""
    if sys.stderr.isatty():
        with click.progressbar(length=j.count_events(**filters), label="Exporting", file=sys.stderr) as bar:
            return write_events(j, filters, out, fmt=fmt, redact=redact, advance=bar.update)
    return write_events(j, filters, out, fmt=fmt, redact=redact)


# -- verify --------------------------------------------------------------------------------------


EMPTY_EXPORT = ("it holds no events, and an empty export is evidence of nothing (an export whose filters "
                "matched no event verifies with --allow-gaps)")


@journal.command()
# A file that is not there (or is a directory) is an error, exit 1, as a journal that is not there is.
@click.option("--export", "export_files", type=click.Path(allow_dash=True, path_type=Path), multiple=True,
              help="Check this exported JSON Lines file offline instead of the journal ('-': stdin). Given "
                   "more than once, the files in order as one chain, and then the journal when --db is given.")
@click.option("--allow-gaps", is_flag=True, help="With --export: accept gaps in seq (a filtered export has them).")
@click.option("--public-key", metavar="PUBFILE_OR_HEX",
              help="Check the signature of each export's manifest (FILE.manifest.json) and the file's sha256, "
                   "or of the checkpoint: 64 hex digits, or a file holding them or a PEM public key.")
@click.option("--checkpoint", "checkpoint_files", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              multiple=True,
              help="Also check that the journal, or an --export (an archive) before it, still holds the "
                   "checkpoint's seq with its hash. May be given more than once.")
@json_option
@db_option
@click.pass_context
def verify(ctx: click.Context, export_files: tuple[Path, ...], allow_gaps: bool, public_key: str | None,
           checkpoint_files: tuple[Path, ...], as_json: bool, db: str) -> None:
    """Recompute the hash chain and check the projection against the log.

    Exit 0 with the event count and head hash; exit 1 naming the seq of the first bad event.
    With --export FILE, check an exported file instead: every event's hash and every link
    between consecutive seqs (no journal is opened); a file with no events is an error unless
    --allow-gaps says the export was filtered. With --public-key, each export must come
    with its signed manifest, and match it byte for byte. Several --export files, and --db
    after them, are checked as one chain in seq order. --checkpoint FILE fails when the journal
    no longer holds the checkpoint's seq with its hash (a log cut short or rewritten); a
    checkpoint whose seq was archived is checked against the archives given as --export, with
    the journal (--db) after them. --checkpoint may be given more than once.

    Example:

    \b
        airlock journal verify

    \b
        airlock journal verify --export audit.jsonl --allow-gaps

    \b
        airlock journal export --since 1d | airlock journal verify --export - --allow-gaps

    \b
        airlock journal verify --export audit.jsonl --public-key audit-key.pub

    \b
        airlock journal verify --checkpoint checkpoint.json --public-key audit-key.pub

    \b
        airlock journal verify --checkpoint checkpoint.json --export archive-2026-10.jsonl --db journal.db
    """
    export_file = export_files[0] if export_files else None
    if allow_gaps and export_file is None:
        raise click.UsageError("--allow-gaps goes with --export FILE")
    db_given = ctx.get_parameter_source("db") is ParameterSource.COMMANDLINE
    if audit.verify_audit_wanted(export_files, public_key, checkpoint_files, db_given):
        try:
            report, source = audit.verify_audit(export_files, public_key, checkpoint_files, allow_gaps,
                                                db if db_given or checkpoint_files else None)
        except audit.CannotCheck as e:  # a checkpoint whose seq is archived, and no archive holding it given
            if as_json:
                echo_bytes(render.dumps_line(dataclasses.asdict(e.report)))
            raise
    elif export_file is not None:
        audit.note_unchecked_manifests(export_files)
        report, source = _verify_export_file(export_file, allow_gaps)
    else:
        with open_journal(db, readonly=True, create=False) as j:
            report = _with_progress(j, "Verifying", j.verify)
        source = describe(db)
    if as_json:
        echo_bytes(render.dumps_line({
            "ok": report.ok, "events": report.events, "head": report.head,
            "first_bad_seq": report.first_bad_seq, "problem": report.problem,
        }))
    if not report.ok:  # with --json too: the JSON on stdout, the one line on stderr
        # The hint of --allow-gaps is for a gap in an export, never in the journal joined to them.
        raise _not_verified(report, source, export_file is not None and source != describe(db))
    if as_json:
        return
    if export_file is not None and not report.events:
        echo("OK: 0 events (an empty export: its filters matched no event)")
        return
    echo(f"OK: {report.events} events, head {report.head}")


def _verify_export_file(export_file: Path, allow_gaps: bool) -> tuple[VerifyReport, str]:
    """The report on an exported JSON Lines file (``-``: stdin), and how messages name the file."""
    from_stdin = str(export_file) == "-"
    source = "the export on stdin" if from_stdin else str(export_file)
    if from_stdin and sys.stdin is None:  # started with stdin closed ("<&-")
        raise click.ClickException(f"cannot read {source}: stdin is closed")
    try:
        if not from_stdin:
            audit.refuse_device(export_file)
        with contextlib.nullcontext(sys.stdin.buffer) if from_stdin else export_file.open("rb") as stream:
            report = verify_lines(read_export(stream), allow_gaps=allow_gaps)
    except NotJsonLines as e:
        raise click.ClickException(f"{source} is not a JSON Lines export: {e}") from e
    except OSError as e:
        raise click.ClickException(f"cannot read {source}: {e.strerror or e}") from e
    if report.ok and not report.events and not allow_gaps:
        # An empty file is evidence of nothing; only an export's filters matching no event explain it.
        report = dataclasses.replace(report, ok=False, problem=EMPTY_EXPORT)
    return report, source


def _not_verified(report: VerifyReport, source: str, from_export: bool) -> click.ClickException:
    """The one line that says where ``source`` does not verify (with a hint for a filtered export)."""
    hint = ""
    if from_export and (report.problem or "").endswith(GAP):
        hint = " (an export filtered by --call, --tool, --agent, --since or --until has gaps: add --allow-gaps)"
    if report.first_bad_seq is not None:
        return click.ClickException(f"{source} does not verify at seq {report.first_bad_seq}: {report.problem}{hint}")
    return click.ClickException(f"{source} does not verify: {report.problem}")


# -- rebuild -------------------------------------------------------------------------------------


@journal.command()
@db_option
def rebuild(db: str) -> None:
    """Rebuild the projection (each call's current status) from the log.

    The log is never changed; the projection is folded again from its first event.

    Example:

    \b
        airlock journal rebuild --db /var/lib/agent/airlock-journal.db
    """
    with open_journal(db, create=False) as j:
        calls = _with_progress(j, "Rebuilding", j.rebuild)
    echo(f"Rebuilt the projection: {calls} calls")


def _with_progress(j: Journal, label: str, work: Callable[..., T]) -> T:
    """``work(advance=...)`` with a progress bar over the journal's events on stderr, when stderr
    is a terminal (as export has); ``work()`` otherwise."""
    if not sys.stderr.isatty():
        return work()
    events = j.head()[0]
    with click.progressbar(length=events, label=label, file=sys.stderr) as bar:
        result = work(advance=bar.update)
        bar.update(max(0, events - bar.pos))  # done: the store tells of whole stretches only
        return result


# -- stats ---------------------------------------------------------------------------------------


@journal.command()
@json_option
@click.option("--format", "fmt", type=click.Choice(("text", "prometheus")), default="text", show_default=True,
              help="prometheus: gauges in the Prometheus text format, for a textfile collector.")
@listing_options
@db_option
@click.pass_context
def stats(ctx: click.Context, as_json: bool, fmt: str, as_csv: bool, as_tsv: bool, as_nl: bool, no_headers: bool,
          db: str) -> None:
    """Count the calls by status and by tool, and show the oldest pending and unknown call.

    --json prints one object: calls, events, by_status, by_tool, oldest_pending_at and
    oldest_unknown_at (when the oldest such call entered that status, or null), approvals_open,
    pending_owner_alive and pending_owner_gone, calls_in_doubt (unknown, and pending with the
    owner gone) and oldest_in_doubt_at: alert on these, not on oldest_pending_at, which counts
    calls still running. --csv, --tsv and --nl print rows of group (total, status, tool,
    approvals, owner, doubt), name, count and oldest_at.
    --format prometheus prints airlock_calls, airlock_events, airlock_calls_in_doubt and
    airlock_oldest_in_doubt_age_seconds (see docs/observability.md).

    Example:

    \b
        airlock journal stats --json

    \b
        airlock journal stats --format prometheus --db /srv/agent/airlock-journal.db
    """
    listing = chosen_format(as_json=as_json, as_csv=as_csv, as_tsv=as_tsv, as_nl=as_nl, no_headers=no_headers,
                            table_headers=False)
    if listing in ("csv", "tsv", "nl"):
        if ctx.get_parameter_source("fmt") is not ParameterSource.DEFAULT:
            raise click.UsageError(f"--{listing} and --format {fmt} are two outputs: give one")
        with open_journal(db, readonly=True, create=False) as j:
            rows = stats_rows(j.stats())
            doubt = in_doubt(j)
        rows += [
            {"group": "owner", "name": "pending_owner_alive", "count": doubt["pending_owner_alive"], "oldest_at": None},
            {"group": "owner", "name": "pending_owner_gone", "count": doubt["pending_owner_gone"], "oldest_at": None},
            {"group": "doubt", "name": "in_doubt", "count": doubt["calls_in_doubt"],
             "oldest_at": doubt["oldest_in_doubt_at"]},
        ]
        if listing == "nl":
            echo_bytes(*(render.dumps_line(row) for row in rows))
        else:
            echo_bytes(delimited(STATS_COLUMNS, rows, listing, headers=not no_headers))
        return
    if fmt == "prometheus":
        if as_json:
            raise click.UsageError("--json and --format prometheus are two outputs: give one")
        with open_journal(db, readonly=True, create=False) as j:
            gauges = prometheus.read_gauges(j)
        echo_bytes(prometheus.render_gauges(gauges).encode())
        return
    with open_journal(db, readonly=True, create=False) as j:
        counted = j.stats()
        if as_json:
            doubt = in_doubt(j)
        # Only a person reads whose pending calls are alive; it costs a read of the pending calls.
        owners = pending_owners(j) if counted.by_status.get("pending") and not as_json else None
    if as_json:
        echo_bytes(render.dumps_line({**render.stats_json(counted), **doubt}))
        return
    _echo_lines(render.stats_lines(counted, colour=render.use_colour()))
    if owners is not None:
        echo(f"pending calls whose owner is alive: {owners['pending_owner_alive']}, "
             f"gone: {owners['pending_owner_gone']}")


# -- keygen, checkpoint: the signed audit trail (cli/audit.py) ------------------------------------

journal.add_command(audit.keygen)
journal.add_command(reconcile.reconcile)
journal.add_command(audit.checkpoint)
journal.add_command(archive.archive)
journal.add_command(approvals.approvals)
journal.add_command(approvals.approve)
journal.add_command(approvals.deny)
journal.add_command(console.serve)
