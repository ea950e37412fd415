"""``airlock journal resolve``: settle a pending or unknown call by hand, after asking its backend."""

from __future__ import annotations

import shlex

import click
import orjson

from journal import open_journal
from journal.rows import unfaithful_json

from . import render
from .options import (
    MOST_VALUE_LEVELS,
    TEXT,
    db_option,
    default_operator,
    echo,
    echo_bytes,
    json_levels,
    json_option,
    reason_text,
)


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


@click.command()
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

