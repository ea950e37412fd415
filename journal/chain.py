"""The hash chain: the byte rule of an event's hash, and checking a chain of events or exported lines.

``hash = sha256(prev_hash.encode("ascii") + canonical_json(body)).hexdigest()`` where ``body`` holds
``seq, at, call_id, kind, tool, agent_id, idempotency_key, arguments_sha256, value_sha256, error,
reason, actor, attempt, owner`` as the export shows them, and ``canonical_json`` is orjson with
sorted keys and no whitespace (``guard.canonical``). The first ``prev_hash`` is :data:`GENESIS`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from guard.canonical import canonical_bytes
from guard.store import CallRecord

from .events import REDACTABLE, JournalEvent, VerifyReport, at_text, text_sha256

__all__ = ["AHEAD", "GAP", "GENESIS", "ChainCheck", "ahead_of_log", "body_bytes", "compute_hash", "event_body",
           "feed_line", "hash_of", "verify_lines"]

GENESIS = "0" * 64

_SORTED = orjson.OPT_SORT_KEYS
_LINE_FIELDS = ("seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "arguments",
                "arguments_sha256", "value", "value_sha256", "error", "reason", "actor", "attempt", "owner",
                "prev_hash", "hash")


def event_body(
    *,
    seq: int,
    at: str,
    call_id: str | None,
    kind: str,
    tool: str,
    agent_id: str | None,
    idempotency_key: str | None,
    arguments_sha256: str | None,
    value_sha256: str | None,
    error: Mapping[str, Any] | None,
    reason: Mapping[str, Any] | None,
    actor: str,
    attempt: int,
    owner: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The object whose canonical JSON an event's hash covers; ``at`` is the exported ISO string."""
    return {
        "seq": seq, "at": at, "call_id": call_id, "kind": kind, "tool": tool, "agent_id": agent_id,
        "idempotency_key": idempotency_key, "arguments_sha256": arguments_sha256,
        "value_sha256": value_sha256, "error": error, "reason": reason, "actor": actor,
        "attempt": attempt, "owner": owner,
    }


def body_bytes(body: Mapping[str, Any]) -> bytes:
    """The canonical JSON of an event's body (``ValueError`` when it has none)."""
    try:
        # A body holds plain JSON values (stores canonicalise error, reason, owner on the way in),
        # for which orjson with sorted keys is the canonical rule, and cheaper.
        return orjson.dumps(body, option=_SORTED)
    except TypeError:
        return canonical_bytes(dict(body))


def compute_hash(prev_hash: str, body: Mapping[str, Any]) -> str:
    """``sha256(prev_hash.encode("ascii") + canonical_json(body)).hexdigest()``.

    Raises ``ValueError`` when ``prev_hash`` is not ASCII or the body has no canonical JSON form.
    """
    return hashlib.sha256(prev_hash.encode("ascii") + body_bytes(body)).hexdigest()


def hash_of(event: JournalEvent) -> str:
    """The hash ``event`` should carry, recomputed from its stored fields and its ``prev_hash``."""
    return compute_hash(event.prev_hash, event_body(
        seq=event.seq, at=at_text(event.at), call_id=event.call_id, kind=event.kind, tool=event.tool,
        agent_id=event.agent_id, idempotency_key=event.idempotency_key,
        arguments_sha256=text_sha256(event.arguments), value_sha256=text_sha256(event.value),
        error=event.error, reason=event.reason, actor=event.actor, attempt=event.attempt, owner=event.owner,
    ))


GAP = "events are missing"  # how a problem of a gap in seq ends

# How a problem of a projection ahead of its log ends: a rebuild would fold the shorter log and
# erase what the projection still remembers, so such a problem never advises one.
AHEAD = ("events may have been removed from the end; keep the journal as it is (the projection is the "
         "evidence) and compare it with an earlier export or checkpoint")


def ahead_of_log(call_id: str, last_seq: Any, attempt: Any, folded: CallRecord | None, log_end: int) -> str | None:
    """The problem of a projection row (its ``last_seq`` and ``attempt``) that the log, whose last
    event is ``log_end``, cannot have produced, or None when the row is merely stale or edited.

    ``folded`` is the call folded from the log (None when the log has no event of it). A row that
    names a later event than the log's last, than the call's own last, or a later attempt, was
    written by events that are no longer in the log.
    """
    if isinstance(last_seq, bool) or not isinstance(last_seq, int):
        return None
    if last_seq > log_end:
        return (f"the projection of call {call_id!r} records seq {last_seq}, beyond the last event of the log "
                f"(seq {log_end}): {AHEAD}")
    if folded is None:
        return f"the projection has call {call_id!r}, of which the log has no event: {AHEAD}"
    later_attempt = (isinstance(attempt, int) and not isinstance(attempt, bool) and isinstance(folded.attempt, int)
                     and attempt > folded.attempt)  # an attempt stored as text (an altered log) is no number
    if last_seq > folded.last_seq or later_attempt:
        return (f"the projection of call {call_id!r} is ahead of its events in the log (seq {last_seq}, attempt "
                f"{attempt}; the log ends the call at seq {folded.last_seq}, attempt {folded.attempt}): {AHEAD}")
    return None


class ChainCheck:
    """Checks events one at a time, in ``seq`` order: each hash, each link, no gaps.

    ``feed`` returns False at the first bad event; :meth:`report` then names it.
    """

    __slots__ = ("_allow_gaps", "_bad_seq", "_count", "_head", "_last_seq", "_problem")

    def __init__(self, allow_gaps: bool = False, start: tuple[int, str] = (0, GENESIS)) -> None:
        # start: the seq and hash the first event follows (a journal whose older events are archived).
        self._allow_gaps = allow_gaps
        self._count = 0
        self._last_seq, self._head = start
        self._bad_seq: int | None = None
        self._problem: str | None = None

    @property
    def ok(self) -> bool:
        return self._problem is None

    @property
    def last_seq(self) -> int:
        """The seq of the last event that checked out (0 before the first)."""
        return self._last_seq

    @property
    def head(self) -> str:
        """The hash of the last event that checked out (:data:`GENESIS` before the first)."""
        return self._head

    def fail(self, seq: int | None, problem: str) -> bool:
        """Record the first problem (later ones are ignored) and return False."""
        if self._problem is None:
            self._bad_seq, self._problem = seq, problem
        return False

    def feed(self, seq: int, prev_hash: str, stored_hash: str, expected_hash: str) -> bool:
        """Check one event whose recomputed hash is ``expected_hash``."""
        if self._problem is not None:
            return False
        if seq <= self._last_seq:
            return self.fail(seq, f"seq {seq} does not follow seq {self._last_seq}")
        linked = seq == self._last_seq + 1
        if not linked and not self._allow_gaps:
            if self._last_seq == 0:
                return self.fail(seq, f"the first event is seq {seq}, not seq 1: {GAP}")
            return self.fail(seq, f"seq {seq} follows seq {self._last_seq}: {GAP}")
        if linked and prev_hash != self._head:
            return self.fail(seq, f"seq {seq} does not link to the hash of the event before it")
        if stored_hash != expected_hash:
            return self.fail(seq, f"seq {seq} has been altered: its hash does not match its fields")
        self._count += 1
        self._last_seq = seq
        self._head = stored_hash
        return True

    def advance(self, count: int, last_seq: int, head: str) -> None:
        """Take ``count`` events that the caller checked as :meth:`feed` does (each ``seq`` the one
        after the last, linked, its hash recomputed), the last of them ``last_seq`` with ``head``."""
        if self._problem is None:
            self._count += count
            self._last_seq, self._head = last_seq, head

    def report(self) -> VerifyReport:
        return VerifyReport(
            ok=self._problem is None, events=self._count, head=self._head,
            first_bad_seq=self._bad_seq, problem=self._problem,
        )


_NULL_DIGEST = hashlib.sha256(b"null").hexdigest()


def _redacted(line: Mapping[str, Any]) -> list[str]:
    """The fields the line says were redacted: a list of redactable names (none when absent)."""
    redacted = line.get("redacted", [])
    if not isinstance(redacted, list) or not all(isinstance(f, str) and f in REDACTABLE for f in redacted):
        raise ValueError(f"its redacted list {redacted!r} is not a list of redactable fields "
                         f"({', '.join(sorted(REDACTABLE))})")
    return redacted


def _line_digest(line: Mapping[str, Any], field: str, redacted: list[str]) -> str | None:
    """The digest the line claims for ``field``, checked against the field's value unless redacted
    (a redacted field must then be null: a value standing beside the claim could be anything)."""
    claimed = line[f"{field}_sha256"]
    value = line[field]
    if field in redacted:
        if value is not None:
            raise ValueError(f"its {field} is named redacted but is not null")
        return claimed  # type: ignore[no-any-return]
    actual = None if value is None else hashlib.sha256(canonical_bytes(value)).hexdigest()
    if value is None and claimed == _NULL_DIGEST:
        actual = claimed  # the value JSON null (a tool that returned None), not the absence of one
    if actual != claimed:
        raise ValueError(f"its {field} {'do' if field == 'arguments' else 'does'} not match {field}_sha256")
    return actual


def verify_lines(lines: Iterable[Mapping[str, Any]], allow_gaps: bool = False) -> VerifyReport:
    """Check an exported JSONL stream offline (each line decoded to a dict), in the order given.

    Every event's hash is recomputed from the line, every link between consecutive ``seq`` s is
    checked, and a gap in ``seq`` is an error unless ``allow_gaps`` (a filtered export has gaps;
    its links across a gap cannot be checked). A redacted line verifies through its digests.
    Returns a :class:`VerifyReport`; it never raises for bad lines.
    """
    check = ChainCheck(allow_gaps)
    for n, line in enumerate(lines, 1):
        if not feed_line(check, n, line):
            break
    return check.report()


def feed_line(check: ChainCheck, n: int, line: Mapping[str, Any]) -> bool:
    """Check the exported line numbered ``n`` (decoded to a dict) as the next event of ``check``;
    False at a bad line, which ``check`` then names. Lines of several files that continue one
    another go through one :class:`ChainCheck`, so the links between the files are checked too."""
    seq = line.get("seq") if isinstance(line, Mapping) else None
    if not isinstance(seq, int) or isinstance(seq, bool):
        return check.fail(None, f"line {n} has no integer seq")
    missing = [f for f in _LINE_FIELDS if f not in line]
    if missing:
        return check.fail(seq, f"seq {seq} lacks the fields {', '.join(missing)}")
    try:
        redacted = _redacted(line)
        body = event_body(
            seq=seq, at=line["at"], call_id=line["call_id"], kind=line["kind"], tool=line["tool"],
            agent_id=line["agent_id"], idempotency_key=line["idempotency_key"],
            arguments_sha256=_line_digest(line, "arguments", redacted),
            value_sha256=_line_digest(line, "value", redacted),
            error=line["error"], reason=line["reason"], actor=line["actor"], attempt=line["attempt"],
            owner=line["owner"],
        )
        prev_hash, stored_hash = str(line["prev_hash"]), str(line["hash"])
        expected = compute_hash(prev_hash, body)
    except (ValueError, TypeError, UnicodeError) as e:
        return check.fail(seq, f"seq {seq} has been altered: {e}")
    return check.feed(seq, prev_hash, stored_hash, expected)
