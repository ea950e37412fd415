"""Human oversight: the request an approver sees and the response that lets a call through."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

__all__ = ["Approver", "OversightRequest", "OversightResponse", "OversightVerdict"]


class OversightVerdict(StrEnum):
    GRANT = "grant"
    DENY = "deny"
    TIMEOUT = "timeout"


@dataclass(frozen=True, slots=True)
class OversightRequest:
    """One call waiting for approval. ``arguments`` are the bound arguments in their JSON form.

    A new request (with a new ``request_id``) is made for every attempt: an approval is never reused.
    """

    request_id: str
    tool_name: str
    arguments: Mapping[str, Any]
    reason: str
    tool_call_id: str | None
    idempotency_key: str
    agent_id: str | None
    requested_at: datetime


@dataclass(frozen=True, slots=True)
class OversightResponse:
    """The approver's answer. Only ``GRANT`` for the same ``request_id`` lets the call through."""

    request_id: str
    verdict: OversightVerdict
    approver: str | None = None
    note: str | None = field(default=None)


Approver = Callable[[OversightRequest], OversightResponse]
