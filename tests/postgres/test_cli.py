"""Every CLI command works the same on a PostgreSQL journal: run on a SQLite journal and on its copy
in PostgreSQL, a command prints the same, and its errors are the same one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from cli.options import describe
from journal.copy import copy_journal
from journal.postgres import PostgresJournal
from tests.cli_support import invoke, leave_pending, seed
from tests.pgserver import PgServer

pytestmark = pytest.mark.postgres


@pytest.fixture
def both(tmp_path: Path, pg_dsn: str) -> tuple[str, str]:
    """A seeded SQLite journal and its copy in PostgreSQL (same events, seq and hashes)."""
    path = tmp_path / "j.db"
    seed(path)
    leave_pending(path, "call-dead")
    copy_journal(str(path), pg_dsn)
    return str(path), pg_dsn


def contents(dsn: str) -> list[Any]:
    with psycopg.connect(dsn) as conn:
        return [conn.execute(f"SELECT * FROM {t} ORDER BY 1".encode()).fetchall()
                for t in ("events", "calls", "chain_head", "airlock_journal_meta")]


@pytest.mark.parametrize("args", [
    ["show", "--json"],
    ["show", "--json", "--status", "unknown"],
    ["show", "--json", "--tool", "charge", "--limit", "2"],
    ["show", "--json", "--agent", "agent-2"],
    ["show", "call-ok", "--json"],
    ["show", "call-refused", "--json"],
    ["export"],
    ["export", "--format", "csv"],
    ["export", "--redact", "arguments,value", "--call", "call-ok"],
    ["export", "--tool", "charge", "--since", "1h"],
    ["verify"],
    ["stats", "--json"],
])
def test_a_command_that_reads_prints_the_same_on_both(both: tuple[str, str], args: list[str]) -> None:
    sqlite_db, pg_db = both
    before = contents(pg_db)
    on_sqlite = invoke("journal", *args, "--db", sqlite_db)
    on_pg = invoke("journal", *args, "--db", pg_db)
    assert on_sqlite.exit_code == on_pg.exit_code == 0, on_pg.output
    assert on_pg.stdout == on_sqlite.stdout
    assert contents(pg_db) == before  # reading changed nothing


def test_resolve_on_postgres(both: tuple[str, str]) -> None:
    sqlite_db, pg_db = both
    for db in (sqlite_db, pg_db):
        result = invoke("journal", "resolve", "call-dead", "--not-applied", "--reason", "no such charge",
                        "--operator", "ops", "--db", db)
        assert result.exit_code == 0, result.output
        assert "released by operator:ops" in result.stdout
    with PostgresJournal(pg_db, readonly=True) as j:
        record = j.get("call-dead")
        assert record is not None and record.status == "released"
        assert j.verify().ok
    shown = [orjson.loads(invoke("journal", "show", "call-dead", "--json", "--db", db).stdout) for db in both]
    assert shown[0]["status"] == shown[1]["status"] == "released"
    assert [e["kind"] for e in shown[1]["events"]] == [e["kind"] for e in shown[0]["events"]]


@pytest.mark.parametrize("args", [
    ["show", "no-such-call"],
    ["resolve", "call-ok", "--applied", "--reason", "r", "--operator", "ops"],  # committed: not resolvable
    ["resolve", "no-such-call", "--not-applied", "--reason", "r", "--operator", "ops"],
])
def test_errors_are_the_same_one_line_and_change_nothing(both: tuple[str, str], args: list[str]) -> None:
    sqlite_db, pg_db = both
    before = contents(pg_db)
    results = [invoke("journal", *args, "--db", db) for db in (sqlite_db, pg_db)]
    for result in results:
        assert result.exit_code == 1
        assert result.stderr.startswith("Error: ") and len(result.stderr.strip().splitlines()) == 1
    # The same sentence, but for the journal's name: a PostgreSQL one is named without its password,
    # as given in --db by the command or as the journal names itself (host, port and database).
    with PostgresJournal(pg_db, readonly=True) as j:
        pg_names = (describe(pg_db), j.name)
    said = [results[0].stderr.replace(sqlite_db, "JOURNAL"), results[1].stderr]
    for name in pg_names:
        said[1] = said[1].replace(name, "JOURNAL")
    assert "JOURNAL" in said[0] and said[1] == said[0]
    assert contents(pg_db) == before


def test_usage_errors_exit_2_on_postgres(both: tuple[str, str]) -> None:
    _, pg_db = both
    before = contents(pg_db)
    result = invoke("journal", "resolve", "call-dead", "--applied", "--value", "{nope", "--reason", "r",
                    "--db", pg_db)
    assert result.exit_code == 2
    assert contents(pg_db) == before


def test_rebuild_on_postgres(both: tuple[str, str]) -> None:
    _, pg_db = both
    with psycopg.connect(pg_db) as conn:
        conn.execute("UPDATE calls SET status = 'released' WHERE call_id = 'call-ok'")
    broken = invoke("journal", "verify", "--db", pg_db)
    assert broken.exit_code == 1 and "projection" in broken.stderr
    assert invoke("journal", "rebuild", "--db", pg_db).exit_code == 0
    assert invoke("journal", "verify", "--db", pg_db).exit_code == 0


@pytest.mark.parametrize("command", [["show"], ["verify"], ["stats"], ["export"]])
def test_a_command_that_reads_never_creates_a_postgres_journal(pg_dsn: str, pg_server: PgServer,
                                                               command: list[str]) -> None:
    result = invoke("journal", *command, "--db", pg_dsn)
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone() == (0,)
    missing = invoke("journal", *command, "--db", pg_server.dsn_for("no_such_db"))
    assert missing.exit_code == 1 and "does not exist" in missing.stderr


# -- copy: what it prints of a URL ---------------------------------------------------------------

SECRET = "hunter2"


def with_password(dsn: str) -> str:
    """``dsn`` with a password (the server trusts the login, so any is accepted), as an operator pastes it."""
    assert dsn.startswith("postgresql://postgres@")
    return dsn.replace("postgres@", f"postgres:{SECRET}@", 1)


def test_copy_prints_a_url_without_its_password(tmp_path: Path, pg_dsn: str) -> None:
    source = tmp_path / "j.db"
    seed(source)
    result = invoke("journal", "copy", "--from", str(source), "--to", with_password(pg_dsn))
    assert result.exit_code == 0, result.output
    with PostgresJournal(pg_dsn, readonly=True) as copied:
        events, head = copied.head()
    assert result.stdout == (f"Copied {events} events (4 calls) from {source} to {pg_dsn}; "
                             f"the copy verifies, head {head}\n")
    assert SECRET not in result.stdout + result.stderr


@pytest.mark.parametrize("command", [["journal", "show", "--db"], ["journal", "stats", "--db"], ["demo", "--db"],
                                     ["journal", "copy", "--from", "j.db", "--to"]])
def test_a_key_value_connection_string_is_a_usage_error_that_hides_its_password(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    # libpq's other form, pasted into --db: not a file to make a journal of, nor a password to print.
    monkeypatch.chdir(tmp_path)
    seed(tmp_path / "j.db")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = invoke(*command, f"host=127.0.0.1 port=5432 dbname=bank user=ops password={SECRET}")
    assert result.exit_code == 2
    assert "is a key=value connection string (host, port, dbname, user, password)" in result.stderr
    assert "postgresql://USER@HOST:PORT/DBNAME" in result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_file_whose_name_looks_like_a_connection_string_is_still_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    seed(tmp_path / "user=ops.db")
    result = invoke("journal", "stats", "--db", "user=ops.db")
    assert result.exit_code == 0, result.output


def test_demo_on_postgresql_prints_its_url_without_the_password(pg_dsn: str) -> None:
    result = invoke("demo", "--db", with_password(pg_dsn))
    assert result.exit_code == 0, result.output
    assert SECRET not in result.stdout + result.stderr
    shown = pg_dsn.split("?")[0]  # the URL as the operator gave it, less the password
    assert f"journal {shown}" in result.stdout  # the heading and the commands to copy name the journal
    assert f"airlock journal show --db {shown}" in result.stdout
    assert f"--db {shown}" in result.stdout.split("settles it with:")[1]
    with PostgresJournal(pg_dsn, readonly=True) as journal:
        assert journal.stats().calls == 4  # three charges and a balance


def test_copy_of_a_source_that_does_not_verify_names_it_without_its_password(both: tuple[str, str],
                                                                             tmp_path: Path) -> None:
    _, pg_db = both
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
        conn.execute("UPDATE events SET tool = 'x' WHERE seq = 1")
    with PostgresJournal(pg_db, readonly=True) as journal:
        name = journal.name
    result = invoke("journal", "copy", "--from", with_password(pg_db), "--to", str(tmp_path / "out.db"))
    assert result.exit_code == 1
    assert result.stderr == (f"Error: the source {name} does not verify (seq 1: seq 1 has been altered: its hash "
                             "does not match its fields); it was not copied\n")
    assert SECRET not in result.stdout + result.stderr
    assert not (tmp_path / "out.db").exists()


def test_copy_into_a_database_that_does_not_exist_blames_to(tmp_path: Path, pg_server: PgServer) -> None:
    source = tmp_path / "j.db"
    seed(source)
    missing = with_password(pg_server.dsn_for("no_such_db"))
    result = invoke("journal", "copy", "--from", str(source), "--to", missing)
    assert result.exit_code == 1
    line = result.stderr.strip()
    assert len(result.stderr.splitlines()) == 1 and line.startswith("Error: the journal postgresql://")
    assert line.endswith("does not exist); create the database first (createdb). --to names the journal to copy "
                         "into.")
    assert "--from" not in line and SECRET not in line


def test_a_login_the_server_refuses_is_told_from_a_server_out_of_reach(pg_dsn: str) -> None:
    stranger = with_password(pg_dsn).replace("postgres:", "nobody_here:", 1)
    result = invoke("journal", "stats", "--db", stranger)
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1
    assert "refused the login" in result.stderr and 'role "nobody_here" does not exist' in result.stderr
    assert "cannot be reached" not in result.stderr and SECRET not in result.stderr


def test_copy_from_a_database_that_does_not_exist_blames_from(tmp_path: Path, pg_server: PgServer) -> None:
    result = invoke("journal", "copy", "--from", with_password(pg_server.dsn_for("no_such_db")),
                    "--to", str(tmp_path / "out.db"))
    assert result.exit_code == 1
    line = result.stderr.strip()
    assert line.endswith("create the database first (createdb). --from names the journal to copy.")
    assert SECRET not in line
    assert not (tmp_path / "out.db").exists()
