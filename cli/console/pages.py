"""The pages that only read: overview, calls, a call, an event, in doubt, approvals, verify, export.

Each is a plain function Starlette runs in its thread pool (the journal's reads block), and reads
through the :class:`~journal.Journal` API alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse

from guard.store import format_at, utc_now
from journal.events import REDACTABLE

from ..render import duplicate_of, printable
from . import reads, shown
from .filters import (
    APPROVAL_STATUSES,
    CALL_STATUSES,
    OWNER_STATES,
    PAGE_SIZES,
    ApprovalFilter,
    CallFilter,
    EventFilter,
)
from .state import Console, LastVerify

__all__ = ["approvals", "call", "calls", "download", "event", "export", "in_doubt", "overview", "page",
           "run_verify", "verify"]

STATUS_ORDER = ("pending", "unknown", "committed", "released")
# A call's page shows at most this many events; the export of the call has them all.
MOST_EVENTS = 1000


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def page(request: Request, template: str, status_code: int = 200, **values: Any) -> Response:
    """The page ``template`` with ``values``."""
    response: Response = request.app.state.templates.TemplateResponse(request, template, values,
                                                                       status_code=status_code)
    return response


# -- overview --------------------------------------------------------------------------------------


def overview(request: Request) -> Response:
    console = console_of(request)
    j = console.journal
    stats = j.stats()
    doubt = reads.in_doubt(j)
    seq, head_hash = j.head()
    now = utc_now()
    statuses = [*STATUS_ORDER, *(s for s in sorted(stats.by_status) if s not in STATUS_ORDER)]
    by_status = [{"status": s, "count": stats.by_status.get(s, 0), "href": CallFilter(status=s).href()}
                 for s in statuses]
    by_tool = sorted(stats.by_tool.items(), key=lambda item: (-item[1], item[0]))
    return page(
        request, "overview.html", title="Overview", stats=stats, by_status=by_status,
        by_tool=[{"tool": printable(t), "count": n, "href": CallFilter(tool=t).href()}
                 for t, n in by_tool[:20]],
        more_tools=max(0, len(by_tool) - 20),
        in_doubt=len(doubt.calls), oldest_in_doubt=shown.when(doubt.oldest, now), running=doubt.running,
        oldest_approval=shown.when(stats.oldest_open_approval_at, now),
        head_seq=seq, head_hash=head_hash, last_verify=_verify_view(console.last_verify, now),
    )


# -- calls -----------------------------------------------------------------------------------------


def calls(request: Request) -> Response:
    console = console_of(request)
    chosen = CallFilter.parse(request.query_params)
    if not chosen.problems and _elsewhere(request, chosen.href()):
        # A form sends its empty fields too: the page's own address holds only the filters given.
        return RedirectResponse(chosen.href(), status_code=303)
    if chosen.problems:
        return page(request, "calls.html", 400, title="Calls", filter=chosen, rows=[], more=False,
                      **_call_choices())
    listed = reads.list_calls(console.journal, status=chosen.status, tool=chosen.tool, agent_id=chosen.agent,
                            owner=chosen.owner, since=chosen.since_at, offset=chosen.offset, limit=chosen.limit)
    now = utc_now()
    rows = [shown.call_row(r, listed.states.get(r.call_id), now) for r in listed.records]
    return page(
        request, "calls.html", title="Calls", filter=chosen, rows=rows, more=listed.more,
        first=chosen.offset + 1, last=chosen.offset + len(rows),
        previous_href=chosen.href(offset=max(0, chosen.offset - chosen.limit)) if chosen.offset else None,
        next_href=chosen.href(offset=chosen.offset + chosen.limit) if listed.more else None,
        **_call_choices(),
    )


def _elsewhere(request: Request, href: str) -> bool:
    """Whether ``href`` (a page's own address for its filters) holds other parameters than the
    request's: a form sends its empty fields too, and the default page size."""
    path, _, query = href.partition("?")
    given = parse_qsl(request.url.query, keep_blank_values=True)
    return request.url.path != path or given != parse_qsl(query, keep_blank_values=True)


def _call_choices() -> dict[str, Any]:
    return {"statuses": CALL_STATUSES, "owner_states": OWNER_STATES, "page_sizes": PAGE_SIZES}


def call(request: Request) -> Response:
    console = console_of(request)
    call_id: str = request.path_params["call_id"]
    j = console.journal
    record, events = reads.call_and_events(j, call_id)
    if record is None and not events:
        raise HTTPException(404, f"The journal has no call {printable(call_id)!r}.")
    state = j.owner_states([record]).get(call_id) if record is not None else None
    requests = j.approval_requests(call_id=call_id, limit=20)
    cut = max(0, len(events) - MOST_EVENTS)
    kept = events[:MOST_EVENTS]
    seen: dict[str, int] = {}
    timeline = [shown.event_view(e, console.redact, kept[n - 1] if n else None, seen) for n, e in enumerate(kept)]
    appended = _appended(request, events)
    first = events[0] if events else None
    copy_of = duplicate_of(events) if record is None else None
    return page(
        request, "call.html", title=f"Call {printable(call_id)}",
        call_id=printable(call_id), raw_call_id=call_id,
        fields=None if record is None else shown.call_fields(record, state, console.redact),
        first=None if first is None else {"tool": printable(first.tool),
                                          "agent": printable(first.agent_id or "-")},
        copy_of=None if copy_of is None else printable(copy_of),
        copy_of_href=None if copy_of is None else shown.call_href(copy_of),
        requests=[shown.request_view(r, console.redact) for r in requests],
        timeline=timeline, cut=cut, export_href=EventFilter(call=call_id).download_href("jsonl"),
        appended=appended,
    )


def _appended(request: Request, events: list[Any]) -> dict[str, Any] | None:
    """The event an action just appended (``?appended=SEQ`` after its redirect), for the page's
    notice, found among the call's events."""
    text = request.query_params.get("appended", "")
    if not text.isascii() or not text.isdigit():
        return None
    seq = int(text)
    for event in events:
        if event.seq == seq:
            return {"seq": event.seq, "kind": event.kind, "actor": printable(event.actor),
                    "attempt": event.attempt, "request_id": (event.reason or {}).get("request_id"),
                    "has_value": event.value is not None}
    return None


def event(request: Request) -> Response:
    """One event by its ``seq``: where a ``prev_hash`` link leads when the event before is another call's."""
    console = console_of(request)
    seq: int = request.path_params["seq"]
    found = reads.event_at(console.journal, seq)
    if found is None:
        raise HTTPException(404, f"The journal has no event at seq {seq} (never written, or archived).")
    if found.call_id is not None:
        return RedirectResponse(f"{shown.call_href(found.call_id)}#seq-{seq}", status_code=303)
    return page(request, "event.html", title=f"Event {seq}", event=shown.event_view(found, console.redact))


# -- in doubt --------------------------------------------------------------------------------------


def in_doubt(request: Request) -> Response:
    console = console_of(request)
    chosen = CallFilter.parse({k: v for k, v in request.query_params.items() if k in ("offset", "limit")})
    doubt = reads.in_doubt(console.journal)
    now = utc_now()
    oldest_first = doubt.calls[chosen.offset:chosen.offset + chosen.limit]
    rows = [shown.call_row(r, doubt.states.get(r.call_id), now) for r in oldest_first]
    more = len(doubt.calls) > chosen.offset + chosen.limit
    base = "/in-doubt"
    return page(
        request, "in_doubt.html", 400 if chosen.problems else 200, title="In doubt", problems=chosen.problems,
        rows=rows, total=len(doubt.calls), running=doubt.running, oldest=shown.when(doubt.oldest, now),
        first=chosen.offset + 1, last=chosen.offset + len(rows),
        previous_href=f"{base}?offset={max(0, chosen.offset - chosen.limit)}" if chosen.offset else None,
        next_href=f"{base}?offset={chosen.offset + chosen.limit}" if more else None,
        running_href=CallFilter(status="pending", owner="alive").href(),
    )


# -- approvals -------------------------------------------------------------------------------------


def approvals(request: Request) -> Response:
    console = console_of(request)
    chosen = ApprovalFilter.parse(request.query_params)
    if not chosen.problems and _elsewhere(request, chosen.href()):
        return RedirectResponse(chosen.href(), status_code=303)
    found: list[Any] = []
    more = False
    if not chosen.problems:
        found, more = reads.approval_page(console.journal, status=chosen.status, tool=chosen.tool,
                                          offset=chosen.offset, limit=chosen.limit)
    now = utc_now()
    views = [shown.request_view(r, console.redact, now) for r in found]
    return page(
        request, "approvals.html", 400 if chosen.problems else 200, title="Approvals", filter=chosen,
        open_requests=[v for v in views if v["open"]], other_requests=[v for v in views if not v["open"]],
        statuses=APPROVAL_STATUSES, first=chosen.offset + 1, last=chosen.offset + len(views),
        previous_href=chosen.href(offset=max(0, chosen.offset - chosen.limit)) if chosen.offset else None,
        next_href=chosen.href(offset=chosen.offset + chosen.limit) if more else None,
    )


# -- verify ----------------------------------------------------------------------------------------


def _verify_view(last: LastVerify | None, now: datetime) -> dict[str, Any] | None:
    if last is None:
        return None
    report = last.report
    return {"ok": report.ok, "events": report.events, "head": report.head, "first_bad_seq": report.first_bad_seq,
            "problem": report.problem, "at": shown.when(last.at, now), "seconds": f"{last.seconds:.2f}",
            "bad_href": None if report.first_bad_seq is None else f"/events/{report.first_bad_seq}"}


def verify(request: Request) -> Response:
    console = console_of(request)
    return page(request, "verify.html", title="Verify", last_verify=_verify_view(console.last_verify, utc_now()))


def run_verify(request: Request) -> Response:
    """Run ``verify()`` (it only reads), keep its report, and show it on the verify page."""
    console = console_of(request)
    began = time.perf_counter()
    report = console.journal.verify()
    console.last_verify = LastVerify(at=datetime.now(UTC), seconds=time.perf_counter() - began, report=report)
    return RedirectResponse("/verify", status_code=303)


# -- export ----------------------------------------------------------------------------------------


def _event_filter(request: Request, console: Console) -> EventFilter:
    return EventFilter.parse(request.query_params, request.query_params.getlist("redact"), console.redact)


def export(request: Request) -> Response:
    console = console_of(request)
    chosen = _event_filter(request, console)
    return page(request, "export.html", 400 if chosen.problems else 200, title="Export", filter=chosen,
                  redactable=sorted(REDACTABLE))


def download(request: Request) -> Response:
    """The export of the filtered events, streamed from the journal in batches as it is read."""
    console = console_of(request)
    chosen = _event_filter(request, console)
    if chosen.problems:
        return page(request, "export.html", 400, title="Export", filter=chosen, redactable=sorted(REDACTABLE))
    write = console.journal.export_csv if chosen.fmt == "csv" else console.journal.export_lines
    batches = write(redact=chosen.redact, **chosen.journal_filters())

    def chunks() -> Iterator[bytes]:
        try:
            for lines, _count in batches:
                yield lines
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    stamp = format_at(utc_now()).replace(":", "").replace("-", "").split(".")[0]
    name = f"airlock-export-{stamp}.{chosen.fmt}"
    media = "text/csv; charset=utf-8" if chosen.fmt == "csv" else "application/x-ndjson"
    return StreamingResponse(chunks(), media_type=media,
                             headers={"Content-Disposition": f'attachment; filename="{name}"'})
