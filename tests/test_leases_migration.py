"""Journals from before leases: read as they are with the host-and-pid test, migrated on a writable
open, on SQLite and PostgreSQL."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
from journal.postgres import PostgresJournal
from journal.postgres import schema as pg_schema
from journal.sqlite import schema
from tests.cli_support import invoke


def pending_call(journal: object) -> None:
    """A call left pending by this (live) process: its outcome is never recorded."""
    record = journal.begin  # type: ignore[attr-defined]
    from guard.effect_guard import decide_attempt

    record("old-1", lambda r: decide_attempt(r, "old-1", "pay", "k" * 64, "{}", None, False))


def test_a_sqlite_journal_without_leases_is_read_with_the_host_and_pid_test(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with SQLiteJournal(path) as j:
        pending_call(j)
    # What a read-only open of a journal from before leases reads: no leases table.
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE leases")
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    shown = invoke("journal", "show", "--db", str(path), "--json")
    assert shown.exit_code == 0, shown.output
    assert '"owner_state":"alive"' in shown.stdout  # this process recorded it and runs: host and pid
    assert '"lease_expires_at":null' in shown.stdout
    refused = invoke("journal", "resolve", "old-1", "--not-applied", "--reason", "r", "--db", str(path))
    assert refused.exit_code == 1 and "--force" in refused.stderr
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone() == (3,)  # read, not migrated


def test_a_sqlite_journal_of_version_3_is_migrated_to_leases(tmp_path: Path) -> None:
    path = tmp_path / "v3.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN IMMEDIATE")
    for version in (1, 2, 3):
        schema.MIGRATIONS[version](conn)
    conn.execute("PRAGMA user_version = 3")
    conn.execute(f"PRAGMA application_id = {schema.APPLICATION_ID}")
    conn.execute("COMMIT")
    conn.close()
    with SQLiteJournal(path) as j:  # a writable open migrates it
        assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone() == (schema.LATEST,)

        @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=j, lease=30.0)))
        def pay(cents: int) -> int:
            state = j.owner_states([j.get("new-1")])["new-1"]
            assert state.alive is True and state.lease_expires_at is not None
            return cents

        with AirlockContext(metadata={"tool_call_id": "new-1"}):
            assert pay(5) == 5
        assert j.verify().ok


@pytest.mark.postgres
def test_a_postgres_journal_of_version_1_is_migrated_to_leases(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in pg_schema.MIGRATIONS[1]:
            conn.execute(statement.encode())
        conn.execute("INSERT INTO airlock_journal_meta (id, application, schema_version) VALUES (1, %s, 1)",
                     (pg_schema.APPLICATION,))
    with PostgresJournal(pg_dsn) as j:
        pending_call(j)
        state = j.owner_states([j.get("old-1")])["old-1"]
        assert state.alive is True and state.lease_expires_at is None  # no lease: host and pid
        assert j.claim_lease("old-1", "someone", 5.0) is False  # its owner may still be running it
        assert j.verify().ok
    with psycopg.connect(pg_dsn) as conn:
        tables = {r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()")}
        version = conn.execute("SELECT schema_version FROM airlock_journal_meta").fetchone()
    assert "leases" in tables and version == (pg_schema.SCHEMA_VERSION,)
