"""Open the journal a path or a URL names."""

from __future__ import annotations

import contextlib
from typing import Any

from .errors import JournalError
from .protocol import Journal
from .sqlite import SQLiteJournal
from .sqlite.datastore import remove_files
from .urls import is_postgres_url, without_secrets

__all__ = ["open_journal", "remove_made", "without_secrets"]


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


def remove_made(target: str) -> None:
    """Take away the journal that a failed copy made at ``target`` (where nothing was before): a
    SQLite file and the files beside it, or a PostgreSQL journal's tables, while its log is still
    empty. Best effort: what cannot be removed stays, and the caller's own error is what it raises."""
    if not is_postgres_url(target):
        remove_files(target)
        return
    with contextlib.suppress(JournalError), open_journal(target, create=False) as made:
        made.remove_if_empty()
