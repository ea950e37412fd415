"""The projection of approval requests beside the calls, written once for both SQL journals.

``approvals`` has a row per request (see :class:`guard.approvals.ApprovalRequest`): its id, call,
tool, status, when it was asked, the ``seq`` of its first and last events, and the whole request
as canonical JSON (``request``). A row is the fold of the log's approval events with the guard's
own :func:`guard.approvals.apply_approval`, written in the transaction that appends each event,
whichever write appends it (a store's ``approval_step``, ``begin``, ``append``, an import).
``approvals_archived`` keeps, once an archive has removed events, the request of every request
asked before the archive's head as it was at that head: verify and rebuild fold the rest of the
log onto it, as they do the calls. An archive never removes an event of a request still open or
approved (:func:`first_live_seq`, :func:`keep_as_of`).

The statements are written with ``?`` placeholders; a store passes its driver's ``mark``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import orjson

from guard.approvals import APPROVAL_KINDS, ApprovalRequest, apply_approval, approval_event
from guard.store import EffectEvent, format_at

from .chain import AHEAD
from .errors import JournalError
from .events import VerifyReport
from .rows import EVENT_COLUMNS, event_from_row, holds, page

__all__ = [
    "APPROVAL_COLUMNS", "MAY_CHANGE_KINDS", "approval_events", "checked", "expected", "first_live_seq", "fold_event",
    "fold_one", "import_fold", "keep_as_of", "latest_request", "problem", "rebuild", "request_from_row",
    "request_from_text", "request_row", "requests", "stats",
]

log = logging.getLogger("journal")

APPROVAL_COLUMNS = ("request_id", "call_id", "tool", "status", "requested_at", "first_seq", "last_seq", "request")
_COLUMNS = ", ".join(APPROVAL_COLUMNS)
_EVENTS = ", ".join(EVENT_COLUMNS)
# The events that may change a request: its own kinds, and a refusal naming one (the pattern is a
# parameter: a literal % would be a placeholder to some drivers). Each is checked in Python too.
_MAY_CHANGE = (f"(kind IN ({', '.join(repr(k) for k in APPROVAL_KINDS)}) "
               "OR (kind = 'refused' AND reason LIKE ?))")
_NAMES_A_REQUEST = '%"request_id"%'
MAY_CHANGE_KINDS = frozenset({*APPROVAL_KINDS, "refused"})  # the kinds of the events of _MAY_CHANGE
LIVE = ("open", "approved")  # a request that may still let an attempt through

_UPSERT = (f"INSERT INTO approvals ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO UPDATE SET "
           + ", ".join(f"{c} = excluded.{c}" for c in APPROVAL_COLUMNS[1:]))
_SELECT = "SELECT request FROM approvals WHERE request_id = ?"
_LATEST = "SELECT request FROM approvals WHERE call_id = ? ORDER BY first_seq DESC LIMIT 1"
_ALL_EVENTS = f"SELECT {_EVENTS} FROM events WHERE {_MAY_CHANGE} ORDER BY seq"
_CALL_EVENTS = f"SELECT {_EVENTS} FROM events WHERE call_id = ? AND seq >= ? AND {_MAY_CHANGE} ORDER BY seq"
_STEP_EVENTS = f"SELECT {_EVENTS} FROM events WHERE seq > ? AND seq <= ? AND {_MAY_CHANGE} ORDER BY seq"
_ROWS = f"SELECT {_COLUMNS} FROM approvals"
_ARCHIVED = "SELECT request_id, request FROM approvals_archived"
_KEEP = ("INSERT INTO approvals_archived (request_id, request) VALUES (?, ?) "
         "ON CONFLICT (request_id) DO UPDATE SET request = excluded.request")
_OPEN = "SELECT count(*), min(requested_at) FROM approvals WHERE status = 'open'"


class _Conn(Protocol):
    """A sqlite3 or psycopg connection: ``execute(sql, params)`` returning a cursor."""

    def execute(self, sql: Any, params: Any = ...) -> Any: ...


def _sql(template: str, mark: str) -> str:
    return template.replace("?", mark)


# -- rows --------------------------------------------------------------------------------------------


def request_text(request: ApprovalRequest) -> str:
    """The request's stored JSON text (canonical: keys sorted)."""
    return orjson.dumps(request.to_json(), option=orjson.OPT_SORT_KEYS).decode()


def request_row(request: ApprovalRequest) -> tuple[Any, ...]:
    """The row of ``request`` (columns as :data:`APPROVAL_COLUMNS`)."""
    return (request.request_id, request.call_id, request.tool, request.status, format_at(request.requested_at),
            request.first_seq, request.last_seq, request_text(request))


def request_from_text(text: str) -> ApprovalRequest:
    """A stored request (``ValueError`` or ``TypeError``/``KeyError`` for one that is not one)."""
    try:
        return ApprovalRequest.from_json(orjson.loads(text))
    except KeyError as e:
        raise ValueError(f"a stored request lacks {e}") from e


def request_from_row(row: tuple[Any, ...]) -> ApprovalRequest:
    """The request of a row holding its stored text first (as ``approval_requests`` reads them)."""
    return request_from_text(row[0])


def _event(row: tuple[Any, ...]) -> EffectEvent:
    return event_from_row(row).to_effect_event()


def approval_events(rows: Iterable[tuple[Any, ...]]) -> Iterator[tuple[int, EffectEvent]]:
    """The events of stored ``rows`` (in ``seq`` order) that may change a request, decoded."""
    for row in rows:
        event = _event(row)
        if event.call_id is not None and approval_event(event):
            yield int(row[0]), event


# -- the fold ------------------------------------------------------------------------------------------


def fold_one(requests: dict[str, ApprovalRequest], event: EffectEvent, seq: int) -> ApprovalRequest | None:
    """Fold one event (in ``seq`` order) into ``requests`` (by request id), as
    :func:`guard.approvals.fold_approvals` does; returns the request it changed, or None."""
    if event.call_id is None or not approval_event(event):
        return None
    if event.kind == "approval_requested":
        made = apply_approval(None, event, seq)
        if made is not None:
            requests[made.request_id] = made
        return made
    rid = (event.reason or {}).get("request_id")
    current = requests.get(rid) if isinstance(rid, str) else None
    if current is None:
        return None
    folded = apply_approval(current, event, seq)
    if folded is None or folded is current:
        return None
    requests[current.request_id] = folded
    return folded


def _fold(requests: dict[str, ApprovalRequest],
          events: Iterable[tuple[int, EffectEvent]]) -> dict[str, ApprovalRequest]:
    for seq, event in events:
        fold_one(requests, event, seq)
    return requests


def fold_event(conn: _Conn, mark: str, event: EffectEvent, seq: int) -> None:
    """Inside the write transaction that appends ``event`` at ``seq``: fold it into the approvals
    table (nothing for an event that changes no request)."""
    if event.call_id is None or not approval_event(event):
        return
    requests: dict[str, ApprovalRequest] = {}
    if event.kind != "approval_requested":
        rid = (event.reason or {}).get("request_id")
        if not isinstance(rid, str) or not holds(rid, nul=mark == "?"):
            return
        found = conn.execute(_sql(_SELECT, mark), (rid,)).fetchone()
        if found is None:
            return
        try:
            requests[rid] = request_from_text(found[0])
        except (ValueError, TypeError) as e:
            raise JournalError(f"the stored request {rid!r} cannot be read ({e}); run verify, and rebuild") from e
    changed = fold_one(requests, event, seq)
    if changed is not None:
        conn.execute(_sql(_UPSERT, mark), request_row(changed))


def latest_request(conn: _Conn, mark: str, call_id: str) -> ApprovalRequest | None:
    """Inside a write transaction: the latest request of ``call_id`` (the one asked last).

    A request the table says is approved (the one status that lets an attempt through) is taken
    from the log instead, folded from the call's events since it was asked: a row set to approved
    by hand never lets a call run; a difference is logged."""
    row = conn.execute(_sql(_LATEST, mark), (call_id,)).fetchone()
    if row is None:
        return None
    try:
        request = request_from_text(row[0])
    except (ValueError, TypeError) as e:
        raise JournalError(f"the stored request of the call {call_id!r} cannot be read ({e}); run verify, "
                           "and rebuild") from e
    if request.status != "approved":
        return request
    events = approval_events(conn.execute(_sql(_CALL_EVENTS, mark), (call_id, request.first_seq, _NAMES_A_REQUEST)))
    logged = _fold({}, events).get(request.request_id)
    if logged != request:
        log.warning("the approvals row of the request %s of the call %r (approved) differs from its log (%s): the "
                    "log decides; run verify, and rebuild", request.request_id, call_id,
                    "no such request" if logged is None else logged.status)
    return logged


def requests(
    mark: str, nul: bool, unlimited: str, *, call_id: str | None, request_id: str | None, status: str | None,
    tool: str | None, limit: int | None, offset: int,
) -> tuple[str, list[Any]]:
    """The statement of ``approval_requests`` (newest first) and its parameters."""
    clauses: list[str] = []
    params: list[Any] = []
    for column, wanted in (("call_id", call_id), ("request_id", request_id), ("status", status), ("tool", tool)):
        if wanted is None:
            continue
        if not holds(wanted, nul=nul):
            clauses.append("1 = 0")
            continue
        clauses.append(f"{column} = {mark}")
        params.append(wanted)
    where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
    return (f"SELECT request FROM approvals{where} ORDER BY first_seq DESC, request_id DESC"
            + page(limit, offset, unlimited)), params


def stats(conn: _Conn) -> tuple[int, str | None]:
    """How many requests are open, and when the oldest of them was asked (its stored text)."""
    found = conn.execute(_OPEN).fetchone()
    return (int(found[0]), found[1]) if found is not None else (0, None)


# -- verify and rebuild ------------------------------------------------------------------------------


def _archived(conn: _Conn) -> dict[str, ApprovalRequest]:
    """The requests as of the last archive's head (none before an archive)."""
    return {rid: request_from_text(text) for rid, text in conn.execute(_ARCHIVED).fetchall()}


def expected(conn: _Conn, mark: str) -> dict[str, ApprovalRequest]:
    """Every request, as the log folds it onto the requests kept as of the last archive's head."""
    return _fold(_archived(conn), approval_events(conn.execute(_sql(_ALL_EVENTS, mark), (_NAMES_A_REQUEST,))))


def problem(folded: dict[str, ApprovalRequest], rows: Iterable[tuple[Any, ...]],
            log_end: int) -> tuple[int | None, str] | None:
    """The first problem (its seq, and what it is) of the approvals ``rows`` (columns as
    :data:`APPROVAL_COLUMNS`) against the requests ``folded`` from the log (emptied here); None
    when they are the same. A row the log cannot have produced (it names an event past the log's
    last) comes first; then the row, missing, edited or extra, whose event came first."""
    found: list[tuple[int, str]] = []
    for row in rows:
        rid, call_id, last_seq = row[0], row[1], row[6]
        want = folded.pop(rid, None)
        if isinstance(last_seq, int) and not isinstance(last_seq, bool) and last_seq > log_end:
            return last_seq, (f"the approvals projection of request {rid!r} (call {call_id!r}) records seq "
                              f"{last_seq}, beyond the last event of the log (seq {log_end}): {AHEAD}")
        if want is None:
            found.append((last_seq if isinstance(last_seq, int) else 0,
                          f"the approvals projection has request {rid!r} (call {call_id!r}), which the log never "
                          "asked for; run rebuild"))
            continue
        if not _same(row, want):
            found.append((want.last_seq, f"the approvals projection of request {rid!r} (call {call_id!r}) differs "
                                         "from the log; run rebuild"))
    for want in folded.values():
        found.append((want.last_seq, f"the approvals projection lacks request {want.request_id!r} (call "
                                     f"{want.call_id!r}); run rebuild"))
    if not found:
        return None
    seq, said = min(found)
    return seq or None, said


def _same(row: tuple[Any, ...], want: ApprovalRequest) -> bool:
    made = request_row(want)
    if tuple(row[:7]) != made[:7]:
        return False
    try:
        return bool(orjson.loads(row[7]) == want.to_json())
    except (orjson.JSONDecodeError, TypeError):
        return False


def checked(conn: _Conn, mark: str, report: VerifyReport) -> VerifyReport:
    """``report`` (of a log and calls that checked out), with the approvals projection compared
    with the fold of the log in the same snapshot (``conn``'s transaction)."""
    if not report.ok:
        return report
    end = conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()
    log_end = int(end[0]) if end is not None else 0
    try:
        folded = expected(conn, mark)
    except (ValueError, TypeError) as e:
        return VerifyReport(ok=False, events=report.events, head=report.head, first_bad_seq=None,
                            problem=f"the requests kept as of the last archive cannot be read ({e})")
    found = problem(folded, conn.execute(f"{_ROWS} ORDER BY request_id").fetchall(), log_end)
    if found is None:
        return report
    return VerifyReport(ok=False, events=report.events, head=report.head, first_bad_seq=found[0], problem=found[1])


def rebuild(conn: _Conn, mark: str) -> int:
    """Inside a write transaction: make the approvals projection the fold of the log (only the
    rows that differ are written); returns the number of requests."""
    try:
        folded = expected(conn, mark)
    except (ValueError, TypeError) as e:
        raise JournalError(f"the requests kept as of the last archive cannot be read ({e}); restore the "
                           "journal from a copy") from e
    count = len(folded)
    gone: list[Any] = []
    for row in conn.execute(f"{_ROWS} ORDER BY request_id").fetchall():
        want = folded.pop(row[0], None)
        if want is None:
            gone.append(row[0])
        elif not _same(row, want):
            folded[want.request_id] = want  # written again below
    for rid in gone:
        conn.execute(_sql("DELETE FROM approvals WHERE request_id = ?", mark), (rid,))
    for want in folded.values():
        conn.execute(_sql(_UPSERT, mark), request_row(want))
    return count


def import_fold(conn: _Conn, mark: str, events: Iterable[tuple[int, EffectEvent]]) -> None:
    """Inside an import's write transaction: the approvals projection the fold of ``events``
    alone (the copied log's approval events, in ``seq`` order)."""
    conn.execute("DELETE FROM approvals")
    for request in _fold({}, events).values():
        conn.execute(_sql(_UPSERT, mark), request_row(request))


# -- archiving ---------------------------------------------------------------------------------------


def first_live_seq(journal: Any) -> int | None:
    """The ``seq`` of the first event of the earliest request of ``journal`` still open or
    approved (an archive ends before it), or None."""
    listing: Callable[..., list[ApprovalRequest]] | None = getattr(journal, "approval_requests", None)
    if listing is None:
        return None
    firsts = [r.first_seq for status in LIVE for r in listing(status=status)]
    return min(firsts) if firsts else None


def keep_as_of(conn: _Conn, mark: str, base_seq: int, last_seq: int) -> None:
    """Inside an archive's write transaction, before the events ``base_seq`` < seq <= ``last_seq``
    are removed: refuse (:class:`JournalError`) when one of them belongs to a request still open or
    approved; else move the requests kept as of the start of the log on to ``last_seq``."""
    live = conn.execute(_sql("SELECT request_id, call_id, status FROM approvals WHERE status IN ('open', 'approved') "
                             "AND first_seq <= ? ORDER BY first_seq LIMIT 1", mark), (last_seq,)).fetchone()
    if live is not None:
        raise JournalError(f"the request {live[0]} of the call {live[1]!r} is still {live[2]}: an archive never "
                           "removes the events of an open request; decide it (or let it expire), then archive again")
    try:
        kept = _archived(conn)
    except (ValueError, TypeError) as e:
        raise JournalError(f"the requests kept as of the last archive cannot be read ({e}); run verify") from e
    before = dict(kept)
    _fold(kept, approval_events(conn.execute(_sql(_STEP_EVENTS, mark), (base_seq, last_seq, _NAMES_A_REQUEST))))
    for rid, request in kept.items():
        if before.get(rid) != request:
            conn.execute(_sql(_KEEP, mark), (rid, request_text(request)))
