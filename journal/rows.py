"""Events and call records as table rows, the same for every SQL journal.

Both tables keep one column per field: ``arguments`` and ``value`` as the canonical JSON text the
guard handed over, ``error``, ``reason`` and ``owner`` as canonical JSON text, times as their
exported ISO-8601 text (so a stored row re-hashes to exactly the hash it carries).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson

from guard.canonical import canonical_bytes
from guard.liveness import process_seen
from guard.store import TRANSITIONS, CallRecord, EffectEvent, current_owner, format_at, parse_at

from .chain import body_bytes, compute_hash, event_body
from .errors import CallNotFound, NotResolvable
from .events import JournalEvent, at_text, text_sha256

__all__ = [
    "CALL_COLUMNS",
    "CHANGING_KINDS",
    "EVENT_COLUMNS",
    "call_row",
    "canonical_text",
    "event_from_row",
    "event_row",
    "json_text",
    "operator_event",
    "page",
    "placed",
    "record_from_row",
    "split_body",
    "stamp",
    "stored_at",
]

EVENT_COLUMNS = ("seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "arguments", "value",
                 "error", "reason", "actor", "attempt", "owner", "prev_hash", "hash")
CALL_COLUMNS = ("call_id", "tool", "status", "attempt", "agent_id", "idempotency_key", "arguments", "value",
                "error", "reason", "actor", "owner", "created_at", "updated_at", "since", "last_seq")
# The kinds of event that change a call's record (the ones the fold takes), as an SQL list.
CHANGING_KINDS = "(" + ", ".join(f"'{kind}'" for kind in sorted(TRANSITIONS)) + ")"

_SORTED = orjson.OPT_SORT_KEYS


def json_text(obj: Mapping[str, Any] | None) -> str | None:
    """The canonical JSON text of an error, reason or owner object (``ValueError`` if it has none)."""
    if obj is None:
        return None
    try:
        return orjson.dumps(obj if type(obj) is dict else dict(obj), option=_SORTED).decode()
    except TypeError:
        return canonical_bytes(dict(obj)).decode()


def stored_at(text: str) -> datetime:
    """A stored time (``2026-12-01T05:23:06.123456Z``) as an aware UTC datetime: ``parse_at``,
    faster for the texts the journals write themselves."""
    at = datetime.fromisoformat(text)
    return at if at.tzinfo is UTC else parse_at(text)


def _loads(text: str | None) -> Any:
    return None if text is None else orjson.loads(text)


def holds(text: str, nul: bool = True) -> bool:
    """Whether a journal can hold ``text``: it has a UTF-8 form (no lone surrogate) and, where
    ``nul`` is False (PostgreSQL), no NUL. A filter or an id that cannot be held matches nothing."""
    if "\x00" in text and not nul:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def page(limit: int | None, offset: int, unlimited: str) -> str:
    """The ``LIMIT``/``OFFSET`` clause of a page of ``calls()`` (or of the requests for approval): at
    most ``limit`` calls (None: all)
    after the first ``offset``; ``unlimited`` is the driver's limit for all (``-1``, ``ALL``).
    Raises ``ValueError`` for a negative number."""
    for name, number in (("limit", limit), ("offset", offset)):
        if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 0):
            raise ValueError(f"{name} is a number of calls, 0 or more, not {number!r}")
    if limit is None and not offset:
        return ""
    return f" LIMIT {unlimited if limit is None else int(limit)}" + (f" OFFSET {int(offset)}" if offset else "")


def canonical_text(text: str | None, what: str) -> str | None:
    """JSON ``text`` in its canonical form; ``ValueError`` naming ``what`` when it is not JSON, or
    would not be stored as written (see :func:`unfaithful_json`)."""
    if text is None:
        return None
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"the {what} is not valid JSON: {e}") from e
    problem = unfaithful_json(text)
    if problem is not None:
        raise ValueError(f"the {what} {problem}")
    try:
        return canonical_bytes(parsed).decode()
    except ValueError as e:
        raise ValueError(f"the {what} is not valid JSON: {e}") from e


class _KeyTwice(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _one_of_each_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    made: dict[str, Any] = {}
    for key, item in pairs:
        if key in made:
            raise _KeyTwice(key)
        made[key] = item
    return made


def _int_of_64_bits(text: str) -> int:
    number = int(text)
    if not -(2**63) <= number < 2**64:
        raise OverflowError(text)
    return number


def unfaithful_json(text: str) -> str | None:
    """Why the JSON ``text`` (valid JSON) would not be stored as it was written, or None: a key
    twice in one object (orjson keeps the last), or an integer beyond 64 bits (orjson reads it as a
    rounded float)."""
    try:
        json.loads(text, parse_int=_int_of_64_bits, object_pairs_hook=_one_of_each_key)
    except _KeyTwice as e:
        return f"has the key {e.key!r} twice in one object"
    except OverflowError:
        return "has a number that cannot be stored exactly (integers are limited to 64 bits)"
    except (RecursionError, ValueError):
        return None  # what orjson read, the standard library does not follow: orjson's reading stands
    return None


def record_from_row(row: tuple[Any, ...]) -> CallRecord:
    """A projection row (columns as :data:`CALL_COLUMNS`) as a :class:`CallRecord`."""
    return CallRecord(
        call_id=row[0], tool=row[1], status=row[2], attempt=int(row[3]), agent_id=row[4],
        idempotency_key=row[5], arguments=row[6], value=row[7], error=_loads(row[8]), reason=_loads(row[9]),
        actor=row[10], owner=_loads(row[11]), created_at=stored_at(row[12]), updated_at=stored_at(row[13]),
        since=stored_at(row[14]), last_seq=int(row[15]),
    )


def call_row(record: CallRecord) -> tuple[Any, ...]:
    """The projection row of ``record`` (columns as :data:`CALL_COLUMNS`)."""
    return (
        record.call_id, record.tool, record.status, record.attempt, record.agent_id, record.idempotency_key,
        record.arguments, record.value, json_text(record.error), json_text(record.reason), record.actor,
        json_text(record.owner), format_at(record.created_at), format_at(record.updated_at),
        format_at(record.since), record.last_seq,
    )


def event_from_row(row: tuple[Any, ...]) -> JournalEvent:
    """An event row (columns as :data:`EVENT_COLUMNS`) as a :class:`JournalEvent`."""
    return JournalEvent(
        seq=int(row[0]), at=stored_at(row[1]), call_id=row[2], kind=row[3], tool=row[4], agent_id=row[5],
        idempotency_key=row[6], arguments=row[7], value=row[8], error=_loads(row[9]), reason=_loads(row[10]),
        actor=row[11], attempt=int(row[12]), owner=_loads(row[13]), prev_hash=row[14], hash=row[15],
    )


def event_row(event: JournalEvent) -> tuple[Any, ...]:
    """The row of a stored event, exactly as it was stored (columns as :data:`EVENT_COLUMNS`)."""
    return (
        event.seq, format_at(event.at), event.call_id, event.kind, event.tool, event.agent_id,
        event.idempotency_key, event.arguments, event.value, json_text(event.error), json_text(event.reason),
        event.actor, event.attempt, json_text(event.owner), event.prev_hash, event.hash,
    )


def stamp(event: EffectEvent, seq: int, prev_hash: str) -> tuple[JournalEvent, tuple[Any, ...]]:
    """Place ``event`` at ``seq`` after ``prev_hash``: the stored event and its row.

    Raises ``ValueError`` when its error, reason or owner has no JSON form.
    """
    texts, body = _texts_and_body(event, seq)
    return placed(event, (texts, body), seq, prev_hash, compute_hash(prev_hash, body))


_SEQ_MARK = b',"seq":0,"tool":'  # sorted, a body's seq comes after every nested object


_Texts = tuple[str, str | None, str | None, str | None]  # at, error, reason, owner as stored
Prepared = tuple[_Texts, dict[str, Any]]  # an event's texts and the body its hash covers


def split_body(event: EffectEvent) -> tuple[Prepared, bytes, bytes]:
    """The texts and body of ``event`` (for :func:`placed`), and the canonical JSON of its body cut
    around its ``seq``: ``head + str(seq).encode() + tail`` is the body at any ``seq``."""
    texts, body = _texts_and_body(event, 0)
    encoded = body_bytes(body)
    cut = encoded.rfind(_SEQ_MARK) + len(b',"seq":')
    return (texts, body), encoded[:cut], encoded[cut + 1:]


_PLAIN = frozenset({str, int, bool, type(None)})  # values whose JSON text reads back as an equal value

_last_arguments: tuple[str | None, str | None] = (None, None)  # a text and its sha256


def _as_stored(obj: Mapping[str, Any] | None) -> tuple[str | None, Any]:
    """The canonical JSON text of an error, reason or owner object, and the value it reads back as.

    A flat dict of strings, integers, booleans and nulls (what the guard makes) is its own reading
    (copied): it need not be parsed back. Raises ``ValueError`` as :func:`json_text`."""
    if obj is None:
        return None, None
    if type(obj) is dict and all(type(key) is str and type(item) in _PLAIN for key, item in obj.items()):
        with contextlib.suppress(TypeError):  # an integer beyond 64 bits: the slow way says what to do
            return orjson.dumps(obj, option=_SORTED).decode(), dict(obj)
    text = json_text(obj)
    return text, _loads(text)


def _arguments_sha256(text: str | None) -> str | None:
    """``text_sha256`` of a call's arguments: a call's events carry the one text the guard made, so
    the digest of the last one is kept for the next."""
    global _last_arguments
    last_text, last_digest = _last_arguments
    if text is last_text:
        return last_digest
    digest = text_sha256(text)
    _last_arguments = (text, digest)
    return digest


def _texts_and_body(event: EffectEvent, seq: int) -> Prepared:
    at_string = at_text(event.at)
    error_text, error = _as_stored(event.error)
    reason_text, reason = _as_stored(event.reason)
    owner_text, owner = _as_stored(event.owner)
    body = event_body(
        seq=seq, at=at_string, call_id=event.call_id, kind=event.kind, tool=event.tool, agent_id=event.agent_id,
        idempotency_key=event.idempotency_key, arguments_sha256=_arguments_sha256(event.arguments),
        value_sha256=text_sha256(event.value), error=error, reason=reason,
        actor=event.actor, attempt=event.attempt, owner=owner,
    )
    return (at_string, error_text, reason_text, owner_text), body


def _utc(at: datetime) -> datetime:
    """``at`` as the aware UTC time its stored text reads back as (a naive time is local)."""
    return at if at.tzinfo is UTC else at.astimezone(UTC)


def placed(event: EffectEvent, prepared: Prepared, seq: int, prev_hash: str,
           digest: str) -> tuple[JournalEvent, tuple[Any, ...]]:
    """``event`` stored at ``seq`` after ``prev_hash`` with hash ``digest``, and its row; ``prepared``
    as :func:`split_body` gives it."""
    (at_string, error_text, reason_text, owner_text), body = prepared
    error, reason, owner = body["error"], body["reason"], body["owner"]
    stored = JournalEvent(
        seq=seq, at=_utc(event.at), call_id=event.call_id, kind=event.kind, tool=event.tool,
        agent_id=event.agent_id, idempotency_key=event.idempotency_key, arguments=event.arguments,
        value=event.value, error=error, reason=reason, actor=event.actor, attempt=event.attempt, owner=owner,
        prev_hash=prev_hash, hash=digest,
    )
    row = (seq, at_string, event.call_id, event.kind, event.tool, event.agent_id, event.idempotency_key,
           event.arguments, event.value, error_text, reason_text, event.actor, event.attempt, owner_text,
           prev_hash, digest)
    return stored, row


def why_alive(record: CallRecord) -> str:
    """Why the owner of a pending ``record`` is taken for alive, as a clause."""
    owner = record.owner or {}
    pid, host = owner.get("pid"), owner.get("host")
    seen = process_seen(owner)
    if seen == "running":
        return f"its owner process (pid {pid}) is alive on this host, so it may still finish"
    if "lease" in owner:
        return (f"its lease has not run out: its owner (pid {pid} on {host}) may still be running the tool")
    return (f"its owner (pid {pid} on {host}) cannot be seen from here (another host, container or boot) "
            "and took no lease, so nothing says it has stopped")


def operator_event(
    call_id: str,
    record: CallRecord | None,
    *,
    applied: bool,
    reason: str,
    operator: str,
    value: str | None,
    force: bool,
    journal: str,
    owner_alive: bool | None = None,
) -> EffectEvent:
    """The event an operator's resolve of ``call_id`` appends, checked against its ``record``
    (``owner_alive``: whether the owner of the pending call may still be running its tool, as the
    journal judges it by its lease and process; None when the call is not pending).

    Raises ``ValueError`` (a value without ``applied``, one that is not JSON, no operator),
    :class:`CallNotFound`, or :class:`NotResolvable` (another status than pending or unknown, or a
    pending call whose owner is alive, unless ``force``).
    """
    if value is not None and not applied:
        raise ValueError("a value can only be given for a call whose effect was applied")
    if not operator:
        raise ValueError("the operator's name is needed")
    stored_value = canonical_text(value, "value")
    if record is None:
        raise CallNotFound(f"The journal {journal} has no call {call_id!r}.")
    if record.status not in ("pending", "unknown"):
        raise NotResolvable(
            f"The call {call_id!r} in {journal} is {record.status}; only a pending or unknown call can be resolved."
        )
    if record.status == "pending" and not force and owner_alive:
        raise NotResolvable(f"The call {call_id!r} in {journal} is pending and {why_alive(record)}; "
                            "--force overrides.")
    return EffectEvent(
        kind="committed" if applied else "released", call_id=call_id, tool=record.tool,
        agent_id=record.agent_id, idempotency_key=record.idempotency_key, arguments=record.arguments,
        value=stored_value, reason={"code": "applied" if applied else "not_applied", "message": reason},
        actor=f"operator:{operator}", attempt=record.attempt, owner=current_owner(),
    )
