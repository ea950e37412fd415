"""The journals' URLs: which of them name a PostgreSQL journal, and how to quote one without its password.

Nothing here imports a store, so a store's own modules, :mod:`journal.open` and the CLI can all use it.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["POSTGRES_SCHEMES", "is_postgres_url", "without_secrets"]

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(target: str) -> bool:
    """Whether ``target`` names a PostgreSQL journal (else it is the path of a SQLite file)."""
    return target.startswith(POSTGRES_SCHEMES)


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
