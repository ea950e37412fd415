"""An archived SQLite journal whose projection was changed by hand: verify says where, and rebuild
repairs it, for rows of calls from before the log's start as for the others."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest

from journal import SQLiteJournal
from journal.errors import JournalDamaged
from journal.sqlite.archive_schema import COPY_ON_WRITE
from tests.cli_support import Tools, invoke, seed


@pytest.fixture
def journal_path(tmp_path: Path) -> Path:
    """A journal archived once (the seeded calls, call-read among them, all before the cut), with
    calls made after the archive."""
    path = tmp_path / "journal.db"
    seed(path)
    done = invoke("journal", "archive", "--db", str(path), "--before", datetime.now(UTC).isoformat(),
                  "--output", str(tmp_path / "a1.jsonl"))
    assert done.exit_code == 0, done.output
    with SQLiteJournal(path) as journal:
        tools = Tools(journal)
        for n in range(2):
            tools.call(f"later-{n}", tools.charge, account="acct_9", cents=n + 1)
        assert journal.archived_head()[0] > 3
        assert journal.verify().ok
    return path


def _sql(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in statements:
            conn.execute(statement)
    finally:
        conn.close()


_NULL_ROW = ("INSERT INTO calls SELECT NULL, tool, status, attempt, agent_id, idempotency_key, arguments, value, "
             "error, reason, actor, owner, created_at, updated_at, since, {} FROM calls WHERE call_id = 'later-0'")


@pytest.mark.parametrize("rows", [1, 2])
def test_rows_without_a_call_id_from_before_the_start_are_removed_by_rebuild(journal_path: Path, rows: int) -> None:
    _sql(journal_path, *(_NULL_ROW.format(seq) for seq in (3, 4)[:rows]))
    with SQLiteJournal(journal_path) as journal:
        journal.verify()  # says what it says, and raises nothing
        journal.rebuild()
        assert journal.verify().ok
    conn = sqlite3.connect(journal_path)
    try:
        assert conn.execute("SELECT count(*) FROM calls WHERE call_id IS NULL").fetchone() == (0,)
        # The archive's copy-on-write triggers are all still there.
        names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
        assert {"calls_keep_archived_on_update", "calls_keep_archived_on_delete"} <= names
    finally:
        conn.close()


def test_a_text_that_is_not_utf8_in_a_row_from_before_the_start_names_its_column(journal_path: Path) -> None:
    # Written past the copy-on-write triggers, as a hand edit of the file could.
    _sql(journal_path, "DROP TRIGGER calls_keep_archived_on_update", "DROP TRIGGER calls_keep_archived_on_delete",
         "UPDATE calls SET reason = CAST(x'ff00fe' AS TEXT) WHERE call_id = 'call-read'", *COPY_ON_WRITE)
    with SQLiteJournal(journal_path, readonly=True) as journal, \
            pytest.raises(JournalDamaged, match="not UTF-8 in the column 'reason'"):
        journal.verify()
