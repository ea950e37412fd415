"""``airlock journal approvals | approve | deny``: the queue of calls that wait for a human."""

from __future__ import annotations

from typing import Any

import click
import orjson

from guard.approvals import STATUSES, ApprovalRequest, NotDecidable, decide_request, expire_overdue
from guard.store import utc_now
from journal import Journal, open_journal
from journal.errors import JournalError

from . import render
from .listing import chosen_format, delimited, listing_options
from .options import TEXT, db_option, default_operator, echo, echo_bytes, json_option, reason_text

# More requests than any journal holds, and within the 64-bit integers SQL takes for LIMIT.
_MOST = 2**62

COLUMNS = ("request_id", "call_id", "tool", "agent_id", "status", "requested_at", "expires_at", "age",
           "arguments", "reason", "quorum", "approvers", "votes", "replay", "decided_by", "decision_reason",
           "consumed_attempt")
HEADERS = ("REQUEST", "CALL ID", "TOOL", "STATUS", "VOTES", "AGENT", "AGE", "REASON", "ARGUMENTS")


def request_row(request: ApprovalRequest) -> dict[str, Any]:
    """One request as ``approvals --json`` prints it: every field, ``arguments`` as a JSON value."""
    row = request.to_json()
    text = row.pop("arguments")
    row["arguments"] = None if text is None else orjson.loads(text)
    row["age"] = render.age(request.requested_at)
    row["votes"] = f"{len(request.approvers)}/{request.quorum}"
    return {name: row.get(name) for name in COLUMNS}


def _table(requests: list[ApprovalRequest], no_headers: bool) -> list[str]:
    rows = [[r.request_id, r.call_id, r.tool, r.status + (" (replay)" if r.replay else ""),
             f"{len(r.approvers)}/{r.quorum}", r.agent_id or "-", render.age(r.requested_at), r.reason,
             r.arguments or ""] for r in requests]
    return render.table(HEADERS, rows, shrinkable=(7, 8), ids=1, droppable=(8, 5, 7),
                        width=render.terminal_width(), show_headers=not no_headers)


def _open_writable(db: str) -> Journal:
    return open_journal(db, create=False)


@click.command()
@click.option("--status", type=click.Choice(STATUSES, case_sensitive=False),
              help="Only requests in this status (open: waiting for a decision).")
@click.option("--tool", type=TEXT, help="Only requests of this tool.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="At most this many requests.")
@click.option("--offset", type=click.IntRange(min=0), default=0,
              help="Skip the first N requests: the next page is --offset 50, then 100, ...")
@click.option("--all", "every", is_flag=True, help="Every request that matches, however many (no --limit).")
@json_option
@listing_options
@db_option
def approvals(status: str | None, tool: str | None, limit: int, offset: int, every: bool, as_json: bool,
              as_csv: bool, as_tsv: bool, as_nl: bool, no_headers: bool, db: str) -> None:
    """List the requests for approval, newest first: open ones wait for approve or deny.

    A request still open past its expiry is recorded expired first (denied by default). --json
    (or --nl) prints JSON Lines, one request a line; --csv and --tsv the same fields.

    Example:

    \b
        airlock journal approvals --status open

    \b
        airlock journal approvals --tool charge --json
    """
    fmt = chosen_format(as_json=as_json, as_csv=as_csv, as_tsv=as_tsv, as_nl=as_nl, no_headers=no_headers)
    with open_journal(db, readonly=True, create=False) as j:
        now = utc_now()
        overdue = any(r.overdue(now) for r in j.approval_requests(status="open"))
    if overdue:  # the listing that finds a request past its expiry records it expired
        try:
            with _open_writable(db) as j:
                expire_overdue(j)
        except JournalError:
            pass  # a journal this user may not write: listed as it stands
    with open_journal(db, readonly=True, create=False) as j:
        found = j.approval_requests(status=status, tool=tool, limit=None if every else min(limit, _MOST) + 1,
                                    offset=min(offset, _MOST))
    cut = not every and len(found) > limit
    found = found if every else found[:limit]
    if fmt in ("json", "nl"):
        echo_bytes(*(render.dumps_line(request_row(r)) for r in found))
    elif fmt in ("csv", "tsv"):
        echo_bytes(delimited(COLUMNS, [request_row(r) for r in found], fmt, headers=not no_headers))
    elif not found:
        click.echo("No requests match." if not offset else f"No requests match past the first {offset}.", err=True)
    else:
        for line in _table(found, no_headers):
            echo(line)
    if cut:
        click.echo(f"Showing {len(found)} requests from {offset + 1}; more match: --offset {offset + len(found)} "
                   "shows the next, --all every one.", err=True)


def _decide(call_id: str, approve: bool, operator: str | None, reason: str | None, request_id: str | None,
            as_json: bool, db: str) -> None:
    name = default_operator() if operator is None else operator.strip()
    if not name:
        raise click.BadParameter("name who decides", param_hint="--operator")
    with open_journal(db, readonly=True, create=False) as j:
        if j.call(call_id) is None and not j.approval_requests(call_id=call_id, limit=1):
            raise click.ClickException(f"The journal has no call {call_id!r}.")
    with _open_writable(db) as j:
        try:
            event, request = decide_request(j, call_id, approve=approve, operator=name, reason=reason,
                                            request_id=request_id)
        except NotDecidable as e:
            raise click.ClickException(f"{e} Nothing was appended.") from e
        except ValueError as e:
            raise click.UsageError(str(e)) from e
        stored = j.call_events(call_id)[-1]
    if as_json:
        echo_bytes(render.dumps_line(stored.export()))
        return
    echo(f"Appended seq {stored.seq}: {event.kind} by {event.actor} for call {call_id} "
         f"(request {request.request_id}).")
    if request.status == "approved":
        echo("The next retry with this tool_call_id and these arguments runs the tool once.")
    elif request.status == "open":
        echo(f"{len(request.approvers)} of {request.quorum} approvals: it needs "
             f"{request.quorum - len(request.approvers)} more, from other operators.")
    else:
        echo("The call's retries are refused escalation_denied with this reason.")


@click.command()
@click.argument("call_id", type=TEXT)
@click.option("--operator", type=TEXT, help="Who approves. [default: your login name]")
@click.option("--reason", type=TEXT, callback=reason_text, help="Why (kept in the audit trail).")
@click.option("--request", "request_id", type=TEXT, help="Only if this is the call's open request.")
@json_option
@db_option
def approve(call_id: str, operator: str | None, reason: str | None, request_id: str | None, as_json: bool,
            db: str) -> None:
    """Approve the open request of a call: once it has its quorum, the call's next retry with the
    same arguments runs the tool, once.

    Appends "approved" by operator:NAME, only if the request is still open (not decided, expired
    or consumed); the same operator counts once.

    Example:

    \b
        airlock journal approve call_7Qx2 --reason "refund agreed with the customer"
    """
    _decide(call_id, True, operator, reason, request_id, as_json, db)


@click.command()
@click.argument("call_id", type=TEXT)
@click.option("--reason", type=TEXT, required=True, callback=reason_text,
              help="Why (required): the agent's retries are refused with it.")
@click.option("--operator", type=TEXT, help="Who denies. [default: your login name]")
@click.option("--request", "request_id", type=TEXT, help="Only if this is the call's open request.")
@json_option
@db_option
def deny(call_id: str, reason: str, operator: str | None, request_id: str | None, as_json: bool, db: str) -> None:
    """Deny the open request of a call: its retries are refused escalation_denied.

    Appends "denied" by operator:NAME, only if the request is still open.

    Example:

    \b
        airlock journal deny call_7Qx2 --reason "amount above the customer's limit"
    """
    _decide(call_id, False, operator, reason, request_id, as_json, db)
