"""The console's two actions, each in two steps that work without JavaScript: a form posts for a
review (checked as the CLI checks it, nothing written), the review page's button confirms, and the
confirmed action appends through the same journal API as ``airlock journal resolve`` /
``approve`` / ``deny``, by ``operator:NAME``, then shows what it appended.

The gate (:mod:`.auth`) has already refused a read-only console's POST (403) and a request without
a session (401); :func:`~.auth.read_form` refuses a form without the session's CSRF token (403).
"""

from __future__ import annotations

from datetime import datetime

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from guard.approvals import ApprovalRequest, NotDecidable, decide_request
from guard.store import format_at, utc_now
from journal.errors import CallNotFound, NotResolvable
from journal.rows import unfaithful_json

from ..options import MOST_VALUE_LEVELS, json_levels
from ..render import printable
from . import reads, shown
from .auth import read_form
from .pages import console_of, page

__all__ = ["decide", "resolve"]

OUTCOMES = {"applied": "Resolve as applied", "not_applied": "Resolve as not applied"}
DECISIONS = {"approve": "Approve", "deny": "Deny"}


def value_json(text: str) -> tuple[str | None, str | None]:
    """The value an operator typed as canonical JSON text, or why it cannot be stored (the checks
    of ``resolve --value``)."""
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        return None, (f"The value is not JSON ({e}). A text is written in JSON's double quotes, "
                      f"{orjson.dumps(text.strip()).decode()}; an object as {{\"charge_id\": \"ch_1\"}}.")
    if json_levels(parsed) > MOST_VALUE_LEVELS:
        return None, f"The value nests arrays or objects too deeply to be stored (at most {MOST_VALUE_LEVELS} levels)."
    problem = unfaithful_json(text)
    if problem is not None:
        advice = "write each key once" if "twice" in problem else "send a large number as a string"
        return None, f"The value {problem}; {advice}."
    return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS).decode(), None


# -- resolve ---------------------------------------------------------------------------------------


async def resolve(request: Request) -> Response:
    """Resolve a pending or unknown call as applied or not applied: review, then confirm."""
    fields = await read_form(request)
    return await run_in_threadpool(_resolve, request, fields)


def _resolve(request: Request, fields: dict[str, str]) -> Response:
    console = console_of(request)
    j = console.journal
    call_id = fields.get("call_id", "")
    record, events = reads.call_and_events(j, call_id)
    if record is None and not events:
        raise HTTPException(404, f"The journal has no call {printable(call_id)!r}.")
    outcome = fields.get("outcome", "")
    reason = fields.get("reason", "")
    typed = fields.get("value", "")
    force = fields.get("force") == "yes"
    problems: list[str] = []
    if outcome not in OUTCOMES:
        problems.append("Choose whether the effect happened: resolve as applied, or as not applied.")
    if not reason.strip():
        problems.append("Say why: the reason is part of the audit trail.")
    value: str | None = None
    if typed.strip():
        if outcome == "not_applied":
            problems.append("A value goes with 'applied' only: a call that did not happen has no result.")
        else:
            value, problem = value_json(typed)
            if problem is not None:
                problems.append(problem)
    applied = outcome == "applied"

    def again(status: int, problems: list[str]) -> Response:
        state = j.owner_states([record]).get(call_id) if record is not None else None
        return page(request, "resolve.html", status, title=f"Resolve call {printable(call_id)}", step="form",
                    problems=problems, call_id=printable(call_id), raw_call_id=call_id,
                    call_href=shown.call_href(call_id),
                    fields=None if record is None else shown.call_fields(record, state, console.redact),
                    outcome=outcome, reason=reason, value=typed, force=force)

    if problems:
        return again(400, problems)
    try:
        j.check_resolve(call_id, applied=applied, reason=reason, operator=console.operator, value=value,
                        force=force)
    except (CallNotFound, NotResolvable, ValueError) as e:
        return again(409, [_refusal(e)])
    if fields.get("step") != "confirm":
        state = j.owner_states([record]).get(call_id) if record is not None else None
        return page(request, "resolve.html", title=f"Resolve call {printable(call_id)}", step="confirm",
                    problems=[], call_id=printable(call_id), raw_call_id=call_id, call_href=shown.call_href(call_id),
                    fields=None if record is None else shown.call_fields(record, state, console.redact),
                    outcome=outcome, label=OUTCOMES[outcome], kind="committed" if applied else "released",
                    reason=reason, value=typed, canonical_value=value,
                    value_redacted="value" in console.redact, force=force,
                    attempt=None if record is None else record.attempt)
    try:
        with console.writable() as w:
            event = w.resolve(call_id, applied=applied, reason=reason, operator=console.operator, value=value,
                              force=force)
    except (CallNotFound, NotResolvable, ValueError) as e:
        return again(409, [_refusal(e)])
    return RedirectResponse(f"{shown.call_href(call_id)}?appended={event.seq}#seq-{event.seq}", status_code=303)


def _refusal(error: Exception) -> str:
    """The journal's refusal of a resolve, as the page says it (the CLI's flag named by the page's box)."""
    return f"{str(error).replace('--force overrides.', 'tick Force to settle it anyway.')} Nothing was appended."


# -- approve, deny ---------------------------------------------------------------------------------


async def decide(request: Request) -> Response:
    """Approve or deny the open request for approval of a call: review, then confirm."""
    fields = await read_form(request)
    return await run_in_threadpool(_decide, request, fields)


def _not_decidable(request: ApprovalRequest, actor: str, approve: bool, now: datetime) -> str | None:
    """Why ``request`` cannot take this decision now, as ``decide_request`` would say it, or None."""
    if request.overdue(now):
        return (f"The request {request.request_id} expired at {format_at(request.expires_at)}; the agent's next "
                "retry asks again.")
    if request.status != "open":
        return f"The request {request.request_id} is already {request.status}."
    if approve and actor in request.approvers:
        return (f"{actor} has already approved the request {request.request_id}; it needs {request.quorum} "
                "distinct operators.")
    return None


def _decide(request: Request, fields: dict[str, str]) -> Response:
    console = console_of(request)
    j = console.journal
    call_id = fields.get("call_id", "")
    request_id = fields.get("request_id", "").strip() or None
    decision = fields.get("decision", "")
    reason = fields.get("reason", "")
    latest = j.approval_requests(call_id=call_id, limit=1)
    if not latest:
        raise HTTPException(404, f"The call {printable(call_id)!r} has no request for approval.")
    current = latest[0]
    approve = decision == "approve"
    problems: list[str] = []
    if decision not in DECISIONS:
        problems.append("Choose a decision: approve or deny.")
    if decision == "deny" and not reason.strip():
        problems.append("Say why you deny it: the agent's retries are refused with this reason.")
    if reason and not reason.strip():
        problems.append("The reason is empty: say why, or leave it out.")
    if request_id is not None and current.request_id != request_id:
        problems.append(f"The request {request_id} is no longer the call's current one ({current.request_id}).")
    if not problems and decision in DECISIONS:
        refused = _not_decidable(current, console.actor, approve, utc_now())
        if refused is not None:
            problems.append(f"{refused} Nothing was appended.")

    def view(status: int, step: str, problems: list[str]) -> Response:
        return page(request, "decide.html", status, title=f"{DECISIONS.get(decision, 'Decide')} call "
                                                          f"{printable(call_id)}",
                    step=step, problems=problems, call_id=printable(call_id), raw_call_id=call_id,
                    call_href=shown.call_href(call_id), approval=shown.request_view(current, console.redact),
                    decision=decision, label=DECISIONS.get(decision, ""),
                    kind="approved" if approve else "denied", reason=reason)

    if problems:
        conflict = any(p.endswith("Nothing was appended.") or "no longer" in p for p in problems)
        return view(409 if conflict else 400, "form", problems)
    if fields.get("step") != "confirm":
        return view(200, "confirm", [])
    try:
        with console.writable() as w:
            event, _request = decide_request(w, call_id, approve=approve, operator=console.operator,
                                             reason=reason if reason.strip() else None, request_id=current.request_id)
            stored = next((e for e in reversed(w.call_events(call_id))
                           if e.kind == event.kind and e.actor == event.actor and e.at == event.at), None)
    except NotDecidable as e:
        return view(409, "form", [f"{e} Nothing was appended."])
    except ValueError as e:
        return view(400, "form", [str(e)])
    target = shown.call_href(call_id)
    if stored is not None:
        target += f"?appended={stored.seq}#seq-{stored.seq}"
    return RedirectResponse(target, status_code=303)
