"""What the parts written once for both SQL journals ask of a store's datastore.

A store owns its connections and transactions in one datastore object (SQLite's
:class:`~journal.sqlite.datastore.SQLiteDatastore`, PostgreSQL's
:class:`~journal.postgres.datastore.PostgresDatastore`); the parts that read, resolve and reconcile
(:mod:`journal.reading`, :mod:`journal.resolving`, :mod:`journal.reconcile`) are built on it and
touch nothing else of it. The statements are the same on both backends but for the few words of
its :class:`Dialect`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

__all__ = ["Datastore", "Dialect"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Dialect:
    """How a backend's SQL differs where the shared statements care."""

    placeholder: str  # the driver's placeholder: ``?``, ``%s``
    unlimited: str  # what LIMIT takes for all rows: ``-1``, ``ALL``
    nul: bool  # whether the database holds a NUL in a text
    sort_apart: str  # before a column of ORDER BY: sort the rows, the column's index unused ("" where none is)


class Datastore(Protocol):
    """What a store's datastore gives the shared parts: its reads (each raises the journal's own
    errors), its name in messages, and its end."""

    @property
    def dialect(self) -> Dialect: ...

    def rows(self, doing: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows of one statement (``doing`` names it in an error)."""
        ...

    def snapshot(self, doing: str, statements: Sequence[str]) -> list[list[tuple[Any, ...]]]:
        """The rows of each of ``statements``, all read in one snapshot."""
        ...

    def decoded(self, decode: Callable[[Any], T], row: Any) -> T:
        """``decode(row)``; a row that cannot be read raised as the journal's error."""
        ...

    def label(self) -> str:
        """How the journal's messages name it (never with a password)."""
        ...

    def close(self) -> None:
        """Let go of the connections; nothing can be run afterwards. Closing twice is harmless."""
        ...
