"""What a journal hands back: stored events, statistics and verification reports (frozen dataclasses)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import orjson

from guard.store import EffectEvent, format_at

from .errors import JournalError

__all__ = ["REDACTABLE", "JournalEvent", "JournalStats", "VerifyReport", "at_text", "text_sha256"]

# Only these enter the hash as digests, so only these can be blanked out of a verifiable export.
REDACTABLE: frozenset[str] = frozenset({"arguments", "value"})


def at_text(at: datetime) -> str:
    """``guard.store.format_at(at)`` (``2026-12-01T05:23:06.123456Z``), faster for aware UTC times."""
    if at.tzinfo is UTC and at.year >= 1000:
        return at.isoformat(timespec="microseconds")[:-6] + "Z"
    return format_at(at)


def text_sha256(text: str | None) -> str | None:
    """sha256 hex of a stored canonical JSON text, or None for no text."""
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class JournalEvent:
    """One event as the journal stored it, with its place in the chain.

    ``arguments`` and ``value`` are canonical JSON text; ``error``, ``reason`` and ``owner`` are
    the decoded JSON objects. ``at`` is an aware UTC datetime.
    """

    seq: int
    at: datetime
    call_id: str | None
    kind: str
    tool: str
    agent_id: str | None
    idempotency_key: str | None
    arguments: str | None
    value: str | None
    error: dict[str, Any] | None
    reason: dict[str, Any] | None
    actor: str
    attempt: int
    owner: dict[str, Any] | None
    prev_hash: str
    hash: str

    def to_effect_event(self) -> EffectEvent:
        """The guard's view of this event, with its ``seq``."""
        return EffectEvent(
            kind=self.kind, call_id=self.call_id, tool=self.tool, at=self.at, agent_id=self.agent_id,
            idempotency_key=self.idempotency_key, arguments=self.arguments, value=self.value,
            error=self.error, reason=self.reason, actor=self.actor, attempt=self.attempt,
            # An event recorded without an owner keeps none: the projection the append wrote holds none.
            owner=cast(Mapping[str, Any], self.owner), seq=self.seq,
        )

    def export(self, redact: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The event's export line (a JSON object): every field, JSON values decoded, the two
        digests, and ``redacted`` naming the fields blanked out (``[]`` when none).

        Raises ``ValueError`` for a field name in ``redact`` that cannot be redacted, and
        :class:`~journal.errors.JournalError` when a stored ``arguments`` or ``value`` is not JSON.
        """
        unknown = redact - REDACTABLE
        if unknown:
            raise ValueError(
                f"cannot redact {', '.join(sorted(unknown))}: redactable fields are "
                f"{', '.join(sorted(REDACTABLE))}"
            )
        line: dict[str, Any] = {
            "seq": self.seq,
            "at": at_text(self.at),
            "call_id": self.call_id,
            "kind": self.kind,
            "tool": self.tool,
            "agent_id": self.agent_id,
            "idempotency_key": self.idempotency_key,
            "arguments": None if "arguments" in redact else self._decoded("arguments", self.arguments),
            "arguments_sha256": text_sha256(self.arguments),
            "value": None if "value" in redact else self._decoded("value", self.value),
            "value_sha256": text_sha256(self.value),
            "error": self.error,
            "reason": self.reason,
            "actor": self.actor,
            "attempt": self.attempt,
            "owner": self.owner,
            "prev_hash": self.prev_hash,
            "hash": self.hash,
        }
        redacted = sorted(redact)
        for name in redacted:
            line[name] = None
        line["redacted"] = redacted
        return line


    def _decoded(self, field: str, text: str | None) -> Any:
        try:
            return None if text is None else orjson.loads(text)
        except orjson.JSONDecodeError as e:
            verb = "are" if field == "arguments" else "is"
            raise JournalError(f"The {field} of event seq {self.seq} {verb} not JSON; the journal has been "
                               "altered (run verify).") from e


@dataclass(frozen=True, slots=True)
class JournalStats:
    """Counts of calls by status and tool, and when the oldest pending and unknown calls entered
    that status (None when there is none); how many requests for approval are open (one past its
    ``expires_at`` counts until it is marked expired), and when the oldest of them was asked."""

    calls: int
    events: int
    by_status: dict[str, int]
    by_tool: dict[str, int]
    oldest_pending_at: datetime | None
    oldest_unknown_at: datetime | None
    approvals_open: int = 0
    oldest_open_approval_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The result of checking a journal or an export: ``ok``, how many ``events`` were checked,
    the ``head`` hash, and on failure the ``first_bad_seq`` and a one-sentence ``problem``."""

    ok: bool
    events: int
    head: str
    first_bad_seq: int | None = None
    problem: str | None = None
