"""Copying a journal between SQLite and PostgreSQL, either way: every seq and hash preserved,
the projection folded again, a non-empty destination refused, the copy verified."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from cli.main import main
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard, EffectOutcomeUnknown, reversibility
from journal import JournalError, JournalNotFound, SQLiteJournal, open_journal
from journal.copy import copy_journal
from journal.postgres import PostgresJournal

pytestmark = pytest.mark.postgres


def seed(journal: Any) -> None:
    """Every kind of event, through the real guard: committed, replayed, unknown, released then
    run again, refused, and an operator's resolution."""
    policy = SecurityPolicy(effect_guard=EffectGuard(store=journal), denied_tools=("wire",))
    outcomes = iter(["ok", "lost", "boom", "ok", "ok"])

    @Airlock(policy=policy)
    def charge(account: str, cents: int) -> dict[str, Any]:
        what = next(outcomes)
        if what == "lost":
            raise EffectOutcomeUnknown("the gateway timed out")
        if what == "boom":
            raise ValueError("card declined")
        return {"charged": cents, "account": account, "note": "ünïcödé ✓"}

    @Airlock(policy=policy)
    def wire(to: str) -> None:  # denied: only refusals
        raise AssertionError("never runs")

    @reversibility("reversible")
    @Airlock(policy=policy)
    def lookup(account: str) -> list[int]:
        return [1, 2, 3]

    def call(fn: Any, call_id: str, *args: Any) -> Any:
        with AirlockContext(agent_id="agent-7", metadata={"tool_call_id": call_id}):
            try:
                return fn(*args)
            except (EffectOutcomeUnknown, ValueError):
                return None

    call(charge, "c1", "acct-1", 100)
    call(charge, "c1", "acct-1", 100)  # replayed
    call(charge, "c2", "acct-2", 200)  # unknown
    call(charge, "c3", "acct-3", 300)  # released
    call(charge, "c3", "acct-3", 300)  # runs again: committed
    call(wire, "w1", "bob")  # refused
    call(lookup, "l1", "acct-1")
    call(charge, "c4", "acct-4", 400)
    journal.resolve("c2", applied=True, reason="the ledger shows it", operator="ops", value='{"charged":200}')


def exported(journal: Any) -> list[dict[str, Any]]:
    return [e.export() for e in journal.events()]


def projection(journal: Any) -> list[Any]:
    return sorted(journal.calls(limit=None), key=lambda r: r.call_id)


@pytest.fixture
def sqlite_source(tmp_path: Path) -> Path:
    path = tmp_path / "source.db"
    with SQLiteJournal(path) as j:
        seed(j)
    return path


def test_sqlite_to_postgres_preserves_every_seq_and_hash(sqlite_source: Path, pg_dsn: str) -> None:
    report = copy_journal(str(sqlite_source), pg_dsn)
    with SQLiteJournal(sqlite_source, readonly=True) as src, PostgresJournal(pg_dsn) as dst:
        assert exported(dst) == exported(src)
        assert dst.head() == src.head() == (report.events, report.head)
        assert projection(dst) == projection(src)
        assert report.calls == len(projection(src)) == 5
        assert dst.verify().ok
        assert dst.stats() == src.stats()
        # The copy is a working journal: the guard carries on where the source left off.
        seed_more(dst)
        assert dst.verify().ok and dst.head()[0] == report.events + 2


def seed_more(journal: Any) -> None:
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        raise AssertionError("c1 was committed in the source: it must be replayed, not run")

    with AirlockContext(metadata={"tool_call_id": "c1"}):
        assert charge("acct-1", 100)["charged"] == 100  # replayed from the copied projection
    with AirlockContext(metadata={"tool_call_id": "c1"}):
        assert charge("acct-1", 999)["block_reason"] == "policy_violation"


def test_postgres_to_sqlite_preserves_every_seq_and_hash(pg_dsn: str, tmp_path: Path) -> None:
    with PostgresJournal(pg_dsn) as j:
        seed(j)
    destination = tmp_path / "copy.db"
    report = copy_journal(pg_dsn, str(destination))
    with PostgresJournal(pg_dsn, readonly=True) as src, SQLiteJournal(destination) as dst:
        assert exported(dst) == exported(src)
        assert dst.head() == src.head() == (report.events, report.head)
        assert projection(dst) == projection(src)
        assert dst.verify().ok
        seed_more(dst)


def test_a_round_trip_leaves_the_export_byte_for_byte(sqlite_source: Path, pg_dsn: str, tmp_path: Path) -> None:
    back = tmp_path / "back.db"
    copy_journal(str(sqlite_source), pg_dsn)
    copy_journal(pg_dsn, str(back))
    with SQLiteJournal(sqlite_source, readonly=True) as a, SQLiteJournal(back, readonly=True) as b:
        assert exported(a) == exported(b)
    with sqlite3.connect(sqlite_source) as a_conn, sqlite3.connect(back) as b_conn:
        assert a_conn.execute("SELECT * FROM events ORDER BY seq").fetchall() == \
            b_conn.execute("SELECT * FROM events ORDER BY seq").fetchall()


def _pg_rows(dsn: str) -> list[Any]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT * FROM events ORDER BY seq").fetchall() + \
            conn.execute("SELECT * FROM calls ORDER BY call_id").fetchall() + \
            conn.execute("SELECT * FROM chain_head").fetchall()


def test_a_non_empty_postgres_destination_is_refused_and_unchanged(sqlite_source: Path, pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn) as j:
        seed_more_pending(j)
    before = _pg_rows(pg_dsn)
    with pytest.raises(JournalError, match="not empty"):
        copy_journal(str(sqlite_source), pg_dsn)
    assert _pg_rows(pg_dsn) == before


STALE_CALL = ("INSERT INTO calls VALUES ('stale', 't', 'pending', 1, NULL, NULL, NULL, NULL, NULL, NULL, 'guard', "
              "NULL, '2026-01-01T00:00:00.000000Z', '2026-01-01T00:00:00.000000Z', '2026-01-01T00:00:00.000000Z', 7)")


def test_a_stale_projection_row_of_an_empty_postgres_destination_is_replaced(sqlite_source: Path,
                                                                           pg_dsn: str) -> None:
    PostgresJournal(pg_dsn).close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # left by a rebuild cut short, say: no events
        conn.execute(STALE_CALL)
    result = invoke("--from", str(sqlite_source), "--to", pg_dsn)
    assert result.exit_code == 0, result.output
    with SQLiteJournal(sqlite_source, readonly=True) as src, PostgresJournal(pg_dsn) as dst:
        assert projection(dst) == projection(src)
        assert dst.get("stale") is None
        assert dst.verify().ok


def test_a_copy_that_does_not_verify_leaves_the_postgres_destination_as_it_was(sqlite_source: Path,
                                                                             pg_dsn: str) -> None:
    PostgresJournal(pg_dsn).close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(STALE_CALL)
        # Something in the destination alters what is inserted: the copy's chain does not check.
        conn.execute("CREATE FUNCTION retool() RETURNS trigger LANGUAGE plpgsql AS "
                     "$$ BEGIN NEW.tool := 'other'; RETURN NEW; END $$")
        conn.execute("CREATE TRIGGER retool BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION retool()")
    before = _pg_rows(pg_dsn)
    with pytest.raises(JournalError, match=r"does not verify: seq 1 has been altered.*destination left as it was"):
        copy_journal(str(sqlite_source), pg_dsn)
    assert _pg_rows(pg_dsn) == before
    result = invoke("--from", str(sqlite_source), "--to", pg_dsn)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: the copy in ") and "does not verify" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert _pg_rows(pg_dsn) == before


def seed_more_pending(journal: Any) -> None:
    from guard.store import Decision, EffectEvent, Verdict

    event = EffectEvent(kind="pending", call_id="other", tool="t", attempt=1)
    journal.begin("other", lambda r: Decision(Verdict.RUN, event, r))


def test_a_non_empty_sqlite_destination_is_refused_and_unchanged(pg_dsn: str, tmp_path: Path) -> None:
    with PostgresJournal(pg_dsn) as j:
        seed(j)
    destination = tmp_path / "busy.db"
    with SQLiteJournal(destination) as d:
        seed_more_pending(d)
    before = destination.read_bytes()
    with pytest.raises(JournalError, match="not empty"):
        copy_journal(pg_dsn, str(destination))
    with SQLiteJournal(destination, readonly=True) as d:
        assert [e.call_id for e in d.events()] == ["other"]
    assert destination.read_bytes() == before


def test_a_source_that_does_not_verify_is_not_copied(sqlite_source: Path, pg_dsn: str) -> None:
    with sqlite3.connect(sqlite_source) as conn:  # an intruder with write access to the file
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute("UPDATE events SET value = '{\"charged\":1}' WHERE seq = 2")
    with pytest.raises(JournalError, match=r"does not verify.*seq 2"):
        copy_journal(str(sqlite_source), pg_dsn)
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone() == (0,)


def test_a_missing_source_is_journal_not_found(tmp_path: Path, pg_dsn: str) -> None:
    with pytest.raises(JournalNotFound):
        copy_journal(str(tmp_path / "nope.db"), pg_dsn)
    assert not (tmp_path / "nope.db").exists()


def test_an_empty_source_copies_to_an_empty_journal(tmp_path: Path, pg_dsn: str) -> None:
    SQLiteJournal(tmp_path / "empty.db").close()
    report = copy_journal(str(tmp_path / "empty.db"), pg_dsn)
    assert (report.events, report.calls) == (0, 0)
    with open_journal(pg_dsn, readonly=True, create=False) as j:
        assert j.verify().ok and j.head()[0] == 0


# -- the command ---------------------------------------------------------------------------------


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, ["journal", "copy", *args], env={"AIRLOCK_JOURNAL": None})


def test_the_copy_command_both_ways(sqlite_source: Path, pg_dsn: str, tmp_path: Path) -> None:
    result = invoke("--from", str(sqlite_source), "--to", pg_dsn)
    assert result.exit_code == 0, result.output
    with SQLiteJournal(sqlite_source, readonly=True) as src:
        head = src.head()
    assert f"Copied {head[0]} events (5 calls)" in result.stdout and head[1] in result.stdout
    back = tmp_path / "back.db"
    result = invoke("--from", pg_dsn, "--to", str(back))
    assert result.exit_code == 0, result.output
    with SQLiteJournal(back, readonly=True) as b:
        assert b.head() == head


def test_the_copy_command_refuses_a_non_empty_destination(sqlite_source: Path, pg_dsn: str) -> None:
    assert invoke("--from", str(sqlite_source), "--to", pg_dsn).exit_code == 0
    before = _pg_rows(pg_dsn)
    result = invoke("--from", str(sqlite_source), "--to", pg_dsn)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "not empty" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert _pg_rows(pg_dsn) == before


@pytest.mark.parametrize("args", [["--from", "a.db"], ["--to", "b.db"], ["--from", "a.db", "--to", "a.db"]])
def test_the_copy_command_usage_errors(args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where a.db and b.db would be made
    result = invoke(*args)
    assert result.exit_code == 2
    assert list(tmp_path.iterdir()) == []


def test_the_copy_command_with_a_missing_source(tmp_path: Path) -> None:
    result = invoke("--from", str(tmp_path / "nope.db"), "--to", str(tmp_path / "copy.db"))
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "nope.db" in result.stderr
    assert not (tmp_path / "copy.db").exists() and not (tmp_path / "nope.db").exists()
