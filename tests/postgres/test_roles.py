"""The roles and grants of docs/postgres.md, run as written: each role can do what the page says
and nothing more. The guard's login appends events but can never change or remove one."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from guard.store import Decision, EffectEvent, Verdict
from journal import JournalError, NotAJournal
from journal.postgres import PostgresJournal
from tests.pgserver import PgServer, fresh_database

pytestmark = pytest.mark.postgres

DOC = Path(__file__).resolve().parents[2] / "docs" / "postgres.md"
ROLES = ("airlock_owner", "airlock_guard", "airlock_operator", "airlock_auditor")


def deploying_sql() -> list[str]:
    """The SQL blocks of the page's "Deploying" section, in order."""
    text = DOC.read_text()
    section = text.split("## Deploying", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sql\n(.*?)```", section, flags=re.S)


def as_role(dsn: str, role: str) -> str:
    """``dsn`` logged in as ``role``, with the journal's schema first in the search_path."""
    scheme, rest = dsn.split("://", 1)
    where = rest.split("@", 1)[1] if "@" in rest else rest
    return f"{scheme}://{role}@{where}?options={quote('-csearch_path=airlock')}"


@pytest.fixture
def deployed(pg_server: PgServer) -> Iterator[str]:
    dsn = fresh_database(pg_server)
    blocks = deploying_sql()
    assert len(blocks) == 2, "docs/postgres.md should have the two SQL blocks this test runs"
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(blocks[0].encode())
        PostgresJournal(as_role(dsn, "airlock_owner")).close()  # the owner makes the tables
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(blocks[1].encode())
        yield dsn
    finally:
        dbname = dsn.rsplit("/", 1)[1]
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'.encode())
            for role in ROLES:
                conn.execute(f"DROP ROLE IF EXISTS {role}".encode())


def guarded_call(journal: PostgresJournal, call_id: str) -> object:
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, int]:
        return {"charged": cents}

    with AirlockContext(metadata={"tool_call_id": call_id}):
        return charge("acct", 5)


def refused(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(statement.encode())


def test_the_guard_appends_and_can_never_change_an_event(deployed: str) -> None:
    guard_dsn = as_role(deployed, "airlock_guard")
    with PostgresJournal(guard_dsn) as journal:
        assert guarded_call(journal, "c1") == {"charged": 5}
        assert guarded_call(journal, "c1") == {"charged": 5}  # a replay
        assert [e.kind for e in journal.events()] == ["pending", "committed", "replayed"]
    for statement in (
        "UPDATE events SET value = NULL WHERE seq = 2",
        "DELETE FROM events",
        "TRUNCATE events",
        "ALTER TABLE events DISABLE TRIGGER events_append_only",
        "DROP TRIGGER events_append_only ON events",
        "DROP TABLE events",
        "DELETE FROM calls",
        "CREATE TABLE airlock.other (id int)",
    ):
        refused(guard_dsn, statement)
    with PostgresJournal(guard_dsn) as journal:
        with pytest.raises(JournalError, match="may not"):
            journal.rebuild()
        assert journal.verify().ok and journal.head()[0] == 3


def test_the_operator_resolves_and_rebuilds(deployed: str) -> None:
    with PostgresJournal(as_role(deployed, "airlock_guard")) as journal:
        guarded_call(journal, "c1")
        begin_pending(journal, "c2")
    operator = as_role(deployed, "airlock_operator")
    with PostgresJournal(operator) as journal:
        event = journal.resolve("c2", applied=False, reason="the backend has no such charge", operator="ops",
                                force=True)
        assert (event.kind, event.actor) == ("released", "operator:ops")
        assert journal.rebuild() == 2
        assert journal.verify().ok
    refused(operator, "UPDATE events SET value = NULL")
    refused(operator, "DELETE FROM events")


def test_the_auditor_only_reads(deployed: str) -> None:
    with PostgresJournal(as_role(deployed, "airlock_guard")) as journal:
        guarded_call(journal, "c1")
    auditor = as_role(deployed, "airlock_auditor")
    with PostgresJournal(auditor, readonly=True) as journal:
        assert journal.verify().ok and journal.stats().calls == 1
    with PostgresJournal(auditor) as journal, pytest.raises(JournalError, match="may not"):
        begin_pending(journal, "a1")
    for statement in ("INSERT INTO calls (call_id) VALUES ('x')", "UPDATE chain_head SET seq = 0"):
        refused(auditor, statement)


def begin_pending(journal: PostgresJournal, call_id: str) -> None:
    event = EffectEvent(kind="pending", call_id=call_id, tool="charge", attempt=1)
    journal.begin(call_id, lambda r: Decision(Verdict.RUN, event, r))


def test_a_login_that_may_not_read_the_meta_table_is_told_so_not_that_it_is_no_journal(deployed: str) -> None:
    with psycopg.connect(deployed, autocommit=True) as conn:
        conn.execute(b"REVOKE SELECT ON airlock.airlock_journal_meta FROM airlock_auditor")
    with pytest.raises(JournalError) as raised:
        PostgresJournal(as_role(deployed, "airlock_auditor"), readonly=True)
    assert not isinstance(raised.value, NotAJournal)
    assert "permission denied for table airlock_journal_meta" in str(raised.value)
