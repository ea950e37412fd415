"""Open the journal a path or a URL names."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from .protocol import Journal
from .sqlite import SQLiteJournal

__all__ = ["open_journal", "without_secrets"]

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_journal(target: str, *, readonly: bool = False, create: bool = True, **options: Any) -> Journal:
    """A :class:`SQLiteJournal` for a file path, or a ``PostgresJournal`` for a ``postgresql://``
    or ``postgres://`` URL; ``options`` go to its constructor. Either is a :class:`Journal`.

    With ``readonly`` nothing is created or changed, and a journal that does not exist raises
    :class:`~journal.errors.JournalNotFound`.
    """
    if target.startswith(_POSTGRES_SCHEMES):
        from .postgres import PostgresJournal  # only when asked for: psycopg is an optional extra

        return PostgresJournal(target, readonly=readonly, create=create, **options)
    return SQLiteJournal(target, readonly=readonly, create=create, **options)


def without_secrets(text: str, url: str) -> str:
    """``text`` (a message about ``url``, a driver's included) with the URL's passwords blanked:
    the one before the host and any ``password=`` of the query, as written and percent-decoded."""
    found: set[str] = set()
    rest = url.split("://", 1)[-1]
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    userinfo = netloc.rpartition("@")[0]
    if ":" in userinfo:
        found.add(userinfo.split(":", 1)[1])
    found.update(m.group(1) for m in re.finditer(r"[?&]password=([^&#]*)", url))
    found |= {unquote(secret) for secret in found}
    for secret in sorted(found, key=len, reverse=True):
        if secret:
            text = text.replace(secret, "***")
    return text
