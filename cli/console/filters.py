"""The filters a page takes from its URL, so that a filtered page can be linked: parsed, checked,
and written back into links (the next page, an export of the same events)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

import click

from guard.approvals import STATUSES as APPROVAL_STATUSES
from journal.events import REDACTABLE

from ..options import MOMENT, is_utf8

__all__ = ["APPROVAL_STATUSES", "CALL_STATUSES", "OWNER_STATES", "PAGE_SIZES", "ApprovalFilter", "CallFilter",
           "EventFilter", "moment", "query"]

CALL_STATUSES = ("pending", "committed", "unknown", "released")
OWNER_STATES = ("alive", "gone")
PAGE_SIZES = (25, 50, 100, 200)
DEFAULT_PAGE = 50


def query(params: Mapping[str, Any]) -> str:
    """``?a=1&b=2`` of the parameters that have a value (empty, None and 0 offsets left out)."""
    pairs: list[tuple[str, str]] = []
    for name, value in params.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        pairs.extend((name, str(v)) for v in values if v not in (None, ""))
    return "?" + urlencode(pairs) if pairs else ""


def _text(params: Mapping[str, str], name: str, problems: list[str], label: str) -> str | None:
    value = params.get(name, "").strip()
    if not value:
        return None
    if not is_utf8(value):
        problems.append(f"{label} is not valid text.")
        return None
    return value


def moment(text: str | None, label: str, problems: list[str]) -> datetime | None:
    """A time as the CLI's ``--since`` takes it (ISO-8601, or an age like ``2h``), or None."""
    if text is None:
        return None
    try:
        return MOMENT.convert(text, None, None)
    except click.BadParameter as e:
        problems.append(f"{label}: {e.message}")
        return None


def _offset(params: Mapping[str, str], problems: list[str]) -> int:
    text = params.get("offset", "").strip()
    if not text:
        return 0
    if not text.isascii() or not text.isdigit():
        problems.append(f"The offset {text!r} is not a whole number.")
        return 0
    return int(text)


def _limit(params: Mapping[str, str], problems: list[str]) -> int:
    text = params.get("limit", "").strip()
    if not text:
        return DEFAULT_PAGE
    if not text.isascii() or not text.isdigit() or int(text) not in PAGE_SIZES:
        problems.append(f"Calls per page is one of {', '.join(map(str, PAGE_SIZES))}, not {text!r}.")
        return DEFAULT_PAGE
    return int(text)


def _choice(params: Mapping[str, str], name: str, choices: tuple[str, ...], label: str,
            problems: list[str]) -> str | None:
    value = params.get(name, "").strip().lower()
    if not value:
        return None
    if value not in choices:
        problems.append(f"{label} is one of {', '.join(choices)}, not {params[name]!r}.")
        return None
    return value


@dataclass(frozen=True, slots=True)
class CallFilter:
    """The calls page's filters: status, tool, agent, owner state (of pending calls) and how
    recently a call changed (``since``, as typed: an age like ``2h`` or a time), and the page."""

    status: str | None = None
    tool: str | None = None
    agent: str | None = None
    owner: str | None = None
    since: str | None = None
    since_at: datetime | None = None
    offset: int = 0
    limit: int = DEFAULT_PAGE
    problems: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> CallFilter:
        problems: list[str] = []
        status = _choice(params, "status", CALL_STATUSES, "Status", problems)
        owner = _choice(params, "owner", OWNER_STATES, "Owner", problems)
        if owner is not None and status not in (None, "pending"):
            problems.append(f"An owner is alive or gone only for a pending call, not a {status} one.")
        since = _text(params, "since", problems, "Changed within")
        return cls(
            status=status, tool=_text(params, "tool", problems, "Tool"),
            agent=_text(params, "agent", problems, "Agent"), owner=owner, since=since,
            since_at=moment(since, "Changed within", problems), offset=_offset(params, problems),
            limit=_limit(params, problems), problems=problems,
        )

    def params(self, **changes: Any) -> dict[str, Any]:
        shown = replace(self, **changes)
        return {"status": shown.status, "tool": shown.tool, "agent": shown.agent, "owner": shown.owner,
                "since": shown.since, "offset": shown.offset or None,
                "limit": None if shown.limit == DEFAULT_PAGE else shown.limit}

    def href(self, **changes: Any) -> str:
        """The calls page with these filters (and ``changes``)."""
        return "/calls" + query(self.params(**changes))

    def export_href(self) -> str:
        """The export of the events of these calls, as far as the events' filters reach (tool,
        agent, since: status and owner are a call's, not an event's)."""
        return "/export" + query({"tool": self.tool, "agent": self.agent, "since": self.since})

    @property
    def any(self) -> bool:
        return any((self.status, self.tool, self.agent, self.owner, self.since))


@dataclass(frozen=True, slots=True)
class EventFilter:
    """The export's filters, as ``airlock journal export`` takes them, and the fields to redact."""

    call: str | None = None
    tool: str | None = None
    agent: str | None = None
    since: str | None = None
    until: str | None = None
    since_at: datetime | None = None
    until_at: datetime | None = None
    fmt: str = "jsonl"
    redact: frozenset[str] = frozenset()
    problems: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, params: Mapping[str, str], redact: list[str], forced: frozenset[str]) -> EventFilter:
        problems: list[str] = []
        fmt = _choice(params, "format", ("jsonl", "csv"), "Format", problems) or "jsonl"
        unknown = sorted(set(redact) - REDACTABLE)
        if unknown:
            problems.append(f"Only {', '.join(sorted(REDACTABLE))} can be redacted, not {', '.join(unknown)}.")
        since = _text(params, "since", problems, "Since")
        until = _text(params, "until", problems, "Until")
        return cls(
            call=_text(params, "call", problems, "Call id"), tool=_text(params, "tool", problems, "Tool"),
            agent=_text(params, "agent", problems, "Agent"), since=since, until=until,
            since_at=moment(since, "Since", problems), until_at=moment(until, "Until", problems), fmt=fmt,
            redact=frozenset(redact) & REDACTABLE | forced, problems=problems,
        )

    def journal_filters(self) -> dict[str, Any]:
        """The keyword arguments of ``export_lines`` / ``export_csv`` (without ``redact``)."""
        return {"call_id": self.call, "tool": self.tool, "agent_id": self.agent, "since": self.since_at,
                "until": self.until_at}

    def download_href(self, fmt: str) -> str:
        return "/export/download" + query({"format": fmt, "call": self.call, "tool": self.tool, "agent": self.agent,
                                           "since": self.since, "until": self.until,
                                           "redact": sorted(self.redact)})


@dataclass(frozen=True, slots=True)
class ApprovalFilter:
    """The approvals inbox's filters: a status (none: open first, then the rest) and a tool."""

    status: str | None = None
    tool: str | None = None
    offset: int = 0
    limit: int = DEFAULT_PAGE
    problems: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> ApprovalFilter:
        problems: list[str] = []
        return cls(status=_choice(params, "status", APPROVAL_STATUSES, "Status", problems),
                   tool=_text(params, "tool", problems, "Tool"), offset=_offset(params, problems),
                   limit=_limit(params, problems), problems=problems)

    def href(self, **changes: Any) -> str:
        shown = replace(self, **changes)
        return "/approvals" + query({"status": shown.status, "tool": shown.tool, "offset": shown.offset or None,
                                     "limit": None if shown.limit == DEFAULT_PAGE else shown.limit})
