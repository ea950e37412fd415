"""``airlock journal stats``: the calls counted by status and by tool, and those in doubt."""

from __future__ import annotations

from typing import Any

import click
from click.core import ParameterSource

from guard.store import format_at
from journal import Journal, open_journal

from . import prometheus, render
from .listing import STATS_COLUMNS, chosen_format, delimited, listing_options, stats_rows
from .options import db_option, echo, echo_bytes, json_option


@click.command()
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
    echo("\n".join(render.stats_lines(counted, colour=render.use_colour())))
    if owners is not None:
        echo(f"pending calls whose owner is alive: {owners['pending_owner_alive']}, "
             f"gone: {owners['pending_owner_gone']}")


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

