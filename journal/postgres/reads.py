"""The PostgreSQL journal's reads for operators."""

from __future__ import annotations

from .. import archive
from ..chain import GENESIS
from ..reading import LogReads
from .connection import Conn, Connection
from .sql import _LOCK_HEAD


class Reads(Connection, LogReads):
    """Calls, events, counts, the head and stats; and archiving."""

    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last event; ``(0, GENESIS)`` for an empty journal."""
        rows = self._read("read the chain head", "SELECT seq, hash FROM chain_head WHERE id = 1")
        return (int(rows[0][0]), str(rows[0][1])) if rows else (0, GENESIS)

    def archived_head(self) -> tuple[int, str]:
        """The seq and hash of the last archived event, where the log now starts; ``(0, GENESIS)``
        when nothing was archived."""
        rows = self._read("read the archived head", "SELECT last_seq, last_hash FROM archives "
                          "ORDER BY last_seq DESC LIMIT 1")
        return (int(rows[0][0]), str(rows[0][1])) if rows else (0, GENESIS)

    def commit_archive(self, plan: archive.ArchivePlan, file: str, archived_at: str) -> int:
        """Remove the events ``plan`` moves, once they are in the archive ``file``, in one
        transaction that holds the chain head and also records the archive's head; returns how many
        were removed. The login needs EXECUTE on ``airlock_archive_events`` (see docs/postgres.md)."""

        def work(conn: Conn) -> int:
            conn.execute(_LOCK_HEAD).fetchone()
            return archive.postgres_commit(conn, plan, file, archived_at)

        return self._write("archive the events", work, pipeline=False, retry=False)

