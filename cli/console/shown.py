"""How calls, events and requests look on a page: plain dicts for the templates, with the fields
the console redacts never in them (the export's rule: the value is gone, its sha256 stays)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import quote

import orjson

from guard.approvals import ApprovalRequest
from guard.leases import OwnerState
from guard.store import CallRecord, format_at, utc_now
from journal.errors import JournalError
from journal.events import REDACTABLE, JournalEvent, text_sha256

from .. import render

__all__ = ["MOST_SHOWN", "call_fields", "call_href", "call_row", "event_view", "json_shown", "request_view", "when"]

# A stored value is shown up to this many characters; the export has all of it.
MOST_SHOWN = 20_000


def call_href(call_id: str) -> str:
    """The call's page: its id percent-encoded whole (a slash, a '?' or a space in an id included)."""
    return "/calls/" + quote(call_id, safe="")


def when(at: datetime | None, now: datetime | None = None) -> dict[str, str] | None:
    """A moment as a page shows it: the ISO-8601 time and how far it is from now (``12m ago``, or
    ``in 59m`` for one to come, such as an expiry)."""
    if at is None:
        return None
    now = now or utc_now()
    if at > now:
        ahead = render.age(now, at).removesuffix(" ago")  # the same units, counted forwards
        return {"iso": format_at(at), "age": f"in {ahead}"}
    return {"iso": format_at(at), "age": render.age(at, now)}


def json_shown(value: Any) -> str:
    """A JSON value for a page, indented; cut at :data:`MOST_SHOWN` characters."""
    try:
        text = orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()
    except TypeError:  # nested deeper than orjson writes: its compact stored form
        text = render.dumps_line(value).decode().rstrip("\n")
    if len(text) > MOST_SHOWN:
        return f"{text[:MOST_SHOWN]}\n… ({len(text):,} characters in all: the export has the whole value)"
    return text


def _stored_json(text: str | None, field: str, redact: frozenset[str]) -> dict[str, Any] | None:
    """A stored JSON text (``arguments`` or ``value``) for a page: redacted (with its sha256),
    shown, or None when there is none."""
    if text is None:
        return None
    if field in redact:
        return {"redacted": True, "sha256": text_sha256(text), "damaged": None}
    try:
        return {"redacted": False, "text": json_shown(orjson.loads(text)), "damaged": None}
    except orjson.JSONDecodeError:
        return {"redacted": True, "sha256": text_sha256(text),
                "damaged": "not JSON: the journal has been altered (run verify)"}


def _reason(reason: Mapping[str, Any] | None) -> str | None:
    if not reason:
        return None
    code, message = reason.get("code"), reason.get("message")
    return f"{code}: {message}" if code and message else str(code or message)


def _error(error: Mapping[str, Any] | None) -> str | None:
    if not error:
        return None
    return f"{error.get('type')}: {error.get('message')}"


def status_view(record: CallRecord, state: OwnerState | None) -> dict[str, str]:
    """The call's status (``unknown``, ``pending``) and how the CLI says it (``pending (owner gone)``)."""
    return {"status": record.status, "text": render.status_text(record, state)}


def call_row(record: CallRecord, state: OwnerState | None, now: datetime | None = None) -> dict[str, Any]:
    """One row of a list of calls."""
    now = now or utc_now()
    return {
        "call_id": render.printable(record.call_id), "href": call_href(record.call_id),
        "tool": render.printable(record.tool), **status_view(record, state), "attempt": record.attempt,
        "agent": render.printable(record.agent_id or "-"), "changed": when(record.updated_at, now),
        "since": when(record.since, now), "error": _error(record.error),
    }


def call_fields(record: CallRecord, state: OwnerState | None, redact: frozenset[str]) -> dict[str, Any]:
    """A call's current state for its page."""
    now = utc_now()
    owner = record.owner or {}
    lease = state.lease_expires_at if state is not None else None
    return {
        **call_row(record, state, now),
        "key": record.idempotency_key,
        "arguments": _stored_json(record.arguments, "arguments", redact),
        "value": _stored_json(record.value, "value", redact),
        "committed": record.status == "committed",
        "error": _error(record.error),
        "reason": _reason(record.reason),
        "actor": record.actor,
        "owner": f"{owner.get('host')} pid {owner.get('pid')}" if owner else None,
        "lease": when(lease, now),
        "created": when(record.created_at, now),
        "settled_by": record.actor if record.actor.startswith(("operator:", "reconciler:")) else None,
        "in_doubt": record.status == "unknown" or (record.status == "pending" and not (state and state.alive)),
        "owner_alive": record.status == "pending" and bool(state and state.alive),
        "resolvable": record.status in ("pending", "unknown"),
    }


def event_view(event: JournalEvent, redact: frozenset[str], previous: JournalEvent | None = None,
               arguments_seen: dict[str, int] | None = None) -> dict[str, Any]:
    """One event of a timeline, as the export shows it (``JournalEvent.export`` with the console's
    redaction); ``previous``: the event before it on this page, which its ``prev_hash`` links to
    when it is the one at ``seq - 1``. ``arguments_seen`` (the sha256 of arguments shown on this
    page, with the seq that showed them) names an earlier event instead of showing them again."""
    try:
        line = event.export(redact)
        damaged = None
    except JournalError:
        line = event.export(REDACTABLE)  # a stored text that is not JSON is never shown as it is
        damaged = "Its arguments or value are not JSON: the journal has been altered (run verify)."
    shown: dict[str, Any] = {}
    for field in ("arguments", "value"):
        if line[f"{field}_sha256"] is None:
            shown[field] = None
        elif field in line["redacted"]:
            shown[field] = {"redacted": True, "sha256": line[f"{field}_sha256"], "damaged": None}
        else:
            shown[field] = {"redacted": False, "text": json_shown(line[field]), "damaged": None}
    digest = line["arguments_sha256"]
    same_as = None
    if arguments_seen is not None and digest is not None:
        same_as = arguments_seen.get(digest)
        arguments_seen.setdefault(digest, event.seq)
    linked_here = previous is not None and previous.seq == event.seq - 1
    reason = dict(event.reason or {})
    return {
        "seq": event.seq,
        "anchor": f"seq-{event.seq}",
        "at": line["at"],
        "kind": event.kind,
        "actor": render.printable(event.actor),
        "attempt": event.attempt,
        "tool": render.printable(event.tool),
        "call_id": None if event.call_id is None else render.printable(event.call_id),
        "call_href": None if event.call_id is None else call_href(event.call_id),
        "reason": _reason(reason),
        "request_id": reason.get("request_id"),
        "error": _error(event.error),
        "arguments": shown["arguments"],
        "arguments_as_at": same_as,
        "value": shown["value"],
        "owner": None if not event.owner else f"{event.owner.get('host')} pid {event.owner.get('pid')}",
        "hash": event.hash,
        "prev_hash": event.prev_hash,
        "prev_seq": event.seq - 1 if event.seq > 1 else None,
        "prev_href": None if event.seq == 1 else f"#seq-{event.seq - 1}" if linked_here else f"/events/{event.seq - 1}",
        "damaged": damaged,
    }


def request_view(request: ApprovalRequest, redact: frozenset[str], now: datetime | None = None) -> dict[str, Any]:
    """One request for approval for the inbox or a call's page."""
    now = now or utc_now()
    overdue = request.overdue(now)
    return {
        "request_id": request.request_id,
        "call_id": render.printable(request.call_id),
        "call_href": call_href(request.call_id),
        "raw_call_id": request.call_id,
        "tool": render.printable(request.tool),
        "agent": render.printable(request.agent_id or "-"),
        "status": "expired" if overdue else request.status,
        "overdue": overdue,
        "open": request.status == "open" and not overdue,
        "requested": when(request.requested_at, now),
        "expires": when(request.expires_at, now),
        "decided": when(request.decided_at, now),
        "reason": request.reason,
        "arguments": _stored_json(request.arguments, "arguments", redact),
        "quorum": request.quorum,
        "votes": f"{len(request.approvers)}/{request.quorum}",
        "approvers": [a.removeprefix("operator:") for a in request.approvers],
        "replay": request.replay,
        "decided_by": request.decided_by,
        "decision_reason": request.decision_reason,
        "consumed_attempt": request.consumed_attempt,
    }
