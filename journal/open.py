"""Open the journal a path or a URL names."""

from __future__ import annotations

from typing import Any

from .protocol import Journal
from .sqlite import SQLiteJournal
from .urls import is_postgres_url, without_secrets

__all__ = ["open_journal", "without_secrets"]


def open_journal(target: str, *, readonly: bool = False, create: bool = True, **options: Any) -> Journal:
    """A :class:`SQLiteJournal` for a file path, or a ``PostgresJournal`` for a ``postgresql://``
    or ``postgres://`` URL; ``options`` go to its constructor. Either is a :class:`Journal`.

    With ``readonly`` nothing is created or changed, and a journal that does not exist raises
    :class:`~journal.errors.JournalNotFound`.
    """
    if is_postgres_url(target):
        from .postgres import PostgresJournal  # only when asked for: psycopg is an optional extra

        return PostgresJournal(target, readonly=readonly, create=create, **options)
    return SQLiteJournal(target, readonly=readonly, create=create, **options)
