"""The PostgreSQL journal's reads for operators: those both SQL journals make the same way
(:class:`journal.reading.LogReader`), and the chain head."""

from __future__ import annotations

from ..chain import GENESIS
from ..reading import LogReader
from .datastore import PostgresDatastore
from .sealing import SealingReads

__all__ = ["Reader"]


class Reader(LogReader):
    """:class:`~journal.reading.LogReader` on the journal's datastore, and the chain head, which
    PostgreSQL keeps in a row of its own."""

    def __init__(self, datastore: PostgresDatastore | SealingReads) -> None:
        super().__init__(datastore)
        self._read_head = datastore.rows

    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last event; ``(0, GENESIS)`` for an empty journal."""
        rows = self._read_head("read the chain head", "SELECT seq, hash FROM chain_head WHERE id = 1")
        return (int(rows[0][0]), str(rows[0][1])) if rows else (0, GENESIS)
