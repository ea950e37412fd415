"""Open the journal a path or a URL names."""

from __future__ import annotations

import importlib
from typing import Any

from .sqlite import SQLiteJournal

__all__ = ["open_journal"]

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_journal(target: str, *, readonly: bool = False, create: bool = True, **options: Any) -> Any:
    """A :class:`SQLiteJournal` for a file path, or a ``PostgresJournal`` for a ``postgresql://``
    or ``postgres://`` URL; ``options`` go to its constructor.

    With ``readonly`` nothing is created or changed, and a journal that does not exist raises
    :class:`~journal.errors.JournalNotFound`.
    """
    if target.startswith(_POSTGRES_SCHEMES):
        # Imported only when asked for: psycopg is an optional extra.
        postgres = importlib.import_module("journal.postgres")
        return postgres.PostgresJournal(target, readonly=readonly, create=create, **options)
    return SQLiteJournal(target, readonly=readonly, create=create, **options)
