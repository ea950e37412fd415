"""The PostgreSQL journal and the database's encoding: it always talks UTF-8 to the server, works in a
SQL_ASCII database (which keeps the UTF-8 bytes as they are), refuses any other encoding at open
before it writes anything, and does not care what PGCLIENTENCODING says."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from guard.store import Decision, EffectEvent, Verdict
from journal import JournalError, JournalNotFound
from journal.postgres import PostgresJournal
from tests.cli_support import invoke
from tests.pgserver import PgServer

pytestmark = pytest.mark.postgres

ODD = "é€𝄞"  # two, three and four bytes in UTF-8; "€" has no LATIN1 form


@pytest.fixture
def database(pg_server: PgServer) -> Iterator[Any]:
    """Make databases of a given encoding (``database("LATIN1")``); dropped afterwards."""
    made: list[str] = []

    def make(encoding: str) -> str:
        name = f"airlock_enc_{encoding.lower()}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE \"{name}\" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' "
                         "TEMPLATE template0".encode())
        made.append(name)
        return pg_server.dsn_for(name)

    yield make
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        for name in made:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())


def relations(dsn: str) -> list[Any]:
    """Every table, view, sequence and function outside the system schemas."""
    with psycopg.connect(dsn, client_encoding="utf8") as conn:
        return conn.execute(
            "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%' "
            "UNION ALL SELECT n.nspname, p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')").fetchall()


def guarded(journal: PostgresJournal, runs: list[str]) -> Any:
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str) -> dict[str, str]:
        runs.append(account)
        return {"account": account, "note": ODD}

    return charge


def test_a_sql_ascii_database_keeps_utf8_text_as_it_is(database: Any) -> None:
    dsn = database("SQL_ASCII")
    runs: list[str] = []
    call_id, account, agent = f"c-{ODD}", f"acct {ODD}", f"agent-{ODD}"
    with PostgresJournal(dsn) as journal:
        charge = guarded(journal, runs)
        with AirlockContext(agent_id=agent, metadata={"tool_call_id": call_id}):
            assert charge(account) == {"account": account, "note": ODD}
        pending = EffectEvent(kind="pending", call_id=f"p-{ODD}", tool=f"tool-{ODD}", agent_id=agent,
                              arguments=f'{{"to":"{ODD}"}}', attempt=1)
        journal.begin(pending.call_id or "", lambda record: Decision(Verdict.RUN, pending, record))
        journal.resolve(f"p-{ODD}", applied=True, reason=f"seen {ODD}", operator=ODD, value=f'"{ODD}"', force=True)
    with PostgresJournal(dsn) as journal:  # opened again: everything reads back as it was written
        with AirlockContext(agent_id=agent, metadata={"tool_call_id": call_id}):
            assert guarded(journal, runs)(account) == {"account": account, "note": ODD}  # a replay
        assert runs == [account]
        record = journal.get(call_id)
        assert record is not None and record.status == "committed" and record.agent_id == agent
        assert record.arguments is not None and ODD in record.arguments
        assert record.value is not None and ODD in record.value
        resolved = journal.get(f"p-{ODD}")
        assert resolved is not None and resolved.tool == f"tool-{ODD}" and resolved.value == f'"{ODD}"'
        assert resolved.actor == f"operator:{ODD}" and resolved.reason == {"code": "applied", "message": f"seen {ODD}"}
        assert [r.call_id for r in journal.calls(tool=f"tool-{ODD}")] == [f"p-{ODD}"]
        assert journal.verify().ok
    with psycopg.connect(dsn, client_encoding="utf8") as conn:  # stored as the UTF-8 bytes, unconverted
        assert conn.execute("SELECT octet_length(call_id) FROM calls WHERE call_id = %s",
                            (call_id,)).fetchone() == (len(call_id.encode()),)
    for args in (["show", call_id, "--json"], ["verify"], ["stats"]):
        result = invoke("journal", *args, "--db", dsn)
        assert result.exit_code == 0, result.output
    assert ODD in invoke("journal", "show", call_id, "--db", dsn).stdout


@pytest.mark.parametrize("encoding", ["LATIN1", "WIN1252"])
def test_another_encoding_is_refused_at_open_and_left_unchanged(database: Any, encoding: str) -> None:
    dsn = database(encoding)
    name = dsn.rsplit("/", 1)[1]
    for options in ({}, {"readonly": True}, {"create": False}):
        with pytest.raises(JournalError, match=rf"database {name} has the encoding {encoding}") as info:
            PostgresJournal(dsn, **options)
        assert not isinstance(info.value, JournalNotFound)  # there is a database: it is the wrong kind
    assert relations(dsn) == []
    for args in (["show"], ["show", "c-€"], ["resolve", "c-€", "--not-applied", "--reason", "x"]):
        result = invoke("journal", *args, "--db", dsn)
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith("Error: ") and f"has the encoding {encoding}" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert relations(dsn) == []


def test_pgclientencoding_in_the_environment_does_not_matter(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGCLIENTENCODING", "LATIN1")  # libpq's default for every connection of this process
    runs: list[str] = []
    with PostgresJournal(pg_dsn) as journal:
        with AirlockContext(metadata={"tool_call_id": "c-€"}):
            assert guarded(journal, runs)("price in €") == {"account": "price in €", "note": ODD}
        assert runs == ["price in €"]
        assert journal.verify().ok
    result = invoke("journal", "show", "c-€", "--json", "--db", pg_dsn)
    assert result.exit_code == 0, result.output
    assert "price in €" in result.stdout
    result = invoke("journal", "show", "--tool", "€", "--db", pg_dsn)
    assert result.exit_code == 0, result.output
    monkeypatch.delenv("PGCLIENTENCODING")
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT arguments FROM calls").fetchone() == ('{"account":"price in €"}',)
