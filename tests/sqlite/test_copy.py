"""`copy` into a SQLite file: the copy is verified before its transaction commits, so a copy that
does not verify leaves the destination as it was (the same promise as for PostgreSQL)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cli.main import main
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import JournalError, SQLiteJournal
from journal.copy import copy_journal


def _seed(path: Path) -> None:
    with SQLiteJournal(path) as journal:
        policy = SecurityPolicy(effect_guard=EffectGuard(store=journal))

        @Airlock(policy=policy)
        def charge(account: str, cents: int) -> dict[str, Any]:
            return {"charged": cents, "account": account}

        for n in range(3):
            with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": f"call_{n}"}):
                charge("acct-1", 100 + n)
        with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": "call_0"}):
            charge("acct-1", 100)  # replayed


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "source.db"
    _seed(path)
    return path


def test_sqlite_to_sqlite_keeps_every_seq_and_hash(source: Path, tmp_path: Path) -> None:
    report = copy_journal(str(source), str(tmp_path / "copy.db"))
    with SQLiteJournal(source, readonly=True) as src, SQLiteJournal(tmp_path / "copy.db", readonly=True) as dst:
        assert [e.export() for e in dst.events()] == [e.export() for e in src.events()]
        assert (report.events, report.head) == src.head() == dst.head()
        assert dst.verify().ok


def test_a_copy_that_does_not_verify_leaves_the_sqlite_destination_as_it_was(source: Path, tmp_path: Path) -> None:
    destination = tmp_path / "dst" / "copy.db"
    destination.parent.mkdir()
    SQLiteJournal(destination).close()
    with sqlite3.connect(destination) as conn:
        # Something in the destination alters what is inserted: the copy's projection does not check.
        conn.execute("CREATE TRIGGER retool AFTER INSERT ON calls BEGIN "
                     "UPDATE calls SET tool = 'other' WHERE call_id = NEW.call_id; END")
    conn.close()
    before = _files(destination.parent)
    with pytest.raises(JournalError, match=r"does not verify: the projection of call .* differs.*"
                                           r"rolled back, and the destination left as it was"):
        copy_journal(str(source), str(destination))
    assert _files(destination.parent) == before
    with SQLiteJournal(destination, readonly=True) as dst:
        assert list(dst.events()) == [] and dst.calls(limit=None) == []

    result = CliRunner().invoke(main, ["journal", "copy", "--from", str(source), "--to", str(destination)],
                                env={"AIRLOCK_JOURNAL": None})
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: the copy in ") and "does not verify" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert _files(destination.parent) == before


def test_a_destination_that_fails_while_it_is_made_is_taken_away(
        source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from journal.sqlite import schema

    def fail(conn: sqlite3.Connection, version: int) -> None:
        raise sqlite3.OperationalError("disk I/O error")  # as a disk that fails while the tables are made

    destination = tmp_path / "dst" / "copy.db"
    destination.parent.mkdir()
    monkeypatch.setattr(schema, "migrate", fail)
    with pytest.raises(JournalError):
        copy_journal(str(source), str(destination))
    assert _files(destination.parent) == {}  # not the file the open made, nor SQLite's beside it
