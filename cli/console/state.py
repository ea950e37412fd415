"""What the console keeps for its life: the journal it reads, how it may write, who acts, its
sessions, and the last verify it ran."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from journal import Journal, open_journal
from journal.events import VerifyReport

from ..options import describe

__all__ = ["Console", "LastVerify", "Sessions"]


class Sessions:
    """The one-time sign-in token and the sessions it opened, each with its CSRF token.

    The token printed at start opens one session, once: a copy of the URL found later (in a
    shell's history, a proxy's log) opens nothing. A session lives as long as the server.
    """

    def __init__(self, token: str | None = None) -> None:
        self.token = token or secrets.token_urlsafe(32)
        # The cookie's name carries a part of its own, so that consoles on two ports of one host
        # (a browser keeps cookies by host, not port) do not overwrite each other's session.
        self.cookie = f"airlock_console_{secrets.token_hex(4)}"
        self._used = False
        self._csrf: dict[str, str] = {}
        self._lock = threading.Lock()

    def redeem(self, token: str) -> str | None:
        """A new session's id for the sign-in ``token``, the first time it is given; else None."""
        with self._lock:
            if self._used or not secrets.compare_digest(token.encode(), self.token.encode()):
                return None
            self._used = True
            session = secrets.token_urlsafe(32)
            self._csrf[session] = secrets.token_urlsafe(32)
            return session

    def csrf(self, session: str | None) -> str | None:
        """The CSRF token of ``session``; None for no such session."""
        if not session:
            return None
        with self._lock:
            return self._csrf.get(session)

    @property
    def used(self) -> bool:
        return self._used


@dataclass(frozen=True, slots=True)
class LastVerify:
    """A verify this server ran: when, how long it took, and its report."""

    at: datetime
    seconds: float
    report: VerifyReport


@dataclass
class Console:
    """The server's state.

    ``journal`` is opened once, read-only, and read by every page; a write action opens
    ``target`` for writing (``open_writable``) for the time of that action, as the CLI does.
    ``operator`` is the NAME of ``operator:NAME`` on what an action appends.
    """

    journal: Journal
    target: str
    allow_write: bool = False
    operator: str = ""
    redact: frozenset[str] = frozenset()
    sessions: Sessions = field(default_factory=Sessions)
    last_verify: LastVerify | None = None
    open_writable: Callable[[], Journal] | None = None

    @property
    def name(self) -> str:
        """The journal for a page: its path, or its URL without the password."""
        return describe(self.target)

    @property
    def actor(self) -> str:
        return f"operator:{self.operator}"

    def writable(self) -> Journal:
        """The journal opened for writing (never created): close it when done."""
        if self.open_writable is not None:
            return self.open_writable()
        return open_journal(self.target, create=False)
