"""The same commands on a PostgreSQL journal, named by a postgresql:// URL (a real server)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from journal import open_journal
from tests.cli_support import Tools, invoke, seed_into

pytestmark = pytest.mark.postgres


@pytest.fixture
def dsn(pg_dsn: str) -> str:
    from journal.postgres import PostgresJournal

    with PostgresJournal(pg_dsn) as journal:
        seed_into(journal)
    return pg_dsn


def events_in(dsn: str) -> int:
    with open_journal(dsn, readonly=True) as journal:
        return int(journal.count_events())


def json_lines(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in text.splitlines()]


def test_show_list_and_one_call(dsn: str) -> None:
    listed = invoke("journal", "show", "--json", "--db", dsn)
    assert listed.exit_code == 0, listed.output
    assert [c["call_id"] for c in json_lines(listed.stdout)] == ["call-read", "call-failed", "call-timeout", "call-ok"]
    unknown = invoke("journal", "show", "--status", "unknown", "--db", dsn)
    assert unknown.exit_code == 0
    assert unknown.stdout.splitlines()[1].split()[:3] == ["call-timeout", "charge", "unknown"]
    in_doubt = invoke("journal", "show", "--status", "unknown", "--status", "released", "--json", "--db", dsn)
    assert [c["call_id"] for c in json_lines(in_doubt.stdout)] == ["call-failed", "call-timeout"]
    with open_journal(dsn, readonly=True) as journal:
        assert journal.calls(status=()) == []
        assert [c.call_id for c in journal.calls(status=["unknown", "a\x00"])] == ["call-timeout"]
    one = orjson.loads(invoke("journal", "show", "call-timeout", "--json", "--db", dsn).stdout)
    assert [e["kind"] for e in one["events"]] == ["pending", "unknown", "refused"]
    refused_only = orjson.loads(invoke("journal", "show", "call-refused", "--json", "--db", dsn).stdout)
    assert refused_only["status"] is None
    missing = invoke("journal", "show", "nope", "--db", dsn)
    assert missing.exit_code == 1 and missing.stderr.startswith("Error: no call 'nope' in the journal postgresql://")


def test_resolve_then_replay(dsn: str) -> None:
    before = events_in(dsn)
    bad = invoke("journal", "resolve", "call-timeout", "--applied", "--value", "{x", "--reason", "r", "--db", dsn)
    assert bad.exit_code == 2 and events_in(dsn) == before
    wrong = invoke("journal", "resolve", "call-ok", "--applied", "--reason", "r", "--db", dsn)
    assert wrong.exit_code == 1 and "is committed" in wrong.stderr and events_in(dsn) == before
    done = invoke("journal", "resolve", "call-timeout", "--applied", "--value", '{"charge_id": "ch_9"}',
                  "--reason", "ledger", "--operator", "alice", "--db", dsn)
    assert done.exit_code == 0, done.output
    assert events_in(dsn) == before + 1
    from journal.postgres import PostgresJournal

    with PostgresJournal(dsn) as journal:
        tools = Tools(journal)
        assert tools.call("call-timeout", tools.charge, account="acct_2", cents=700) == {"charge_id": "ch_9"}
    assert tools.payments.charges == []


def test_export_verify_rebuild_stats(dsn: str, tmp_path: Any) -> None:
    out = tmp_path / "audit.jsonl"
    assert invoke("journal", "export", "--db", dsn, "-o", str(out), "--redact", "value").exit_code == 0
    lines = json_lines(out.read_text())
    assert len(lines) == events_in(dsn) and all(line["redacted"] == ["value"] for line in lines)
    offline = invoke("journal", "verify", "--export", str(out))
    online = invoke("journal", "verify", "--db", dsn)
    assert offline.exit_code == 0 and online.exit_code == 0 and offline.stdout == online.stdout
    rebuilt = invoke("journal", "rebuild", "--db", dsn)
    assert rebuilt.exit_code == 0 and rebuilt.stdout == "Rebuilt the projection: 4 calls\n"
    counted = orjson.loads(invoke("journal", "stats", "--json", "--db", dsn).stdout)
    assert counted["by_status"] == {"committed": 2, "unknown": 1, "released": 1}
    assert counted["oldest_unknown_at"] is not None and counted["oldest_pending_at"] is None


def test_an_empty_database_is_no_journal_and_stays_empty(pg_dsn: str) -> None:
    import psycopg

    for args in (["show"], ["stats"], ["export"], ["verify"], ["resolve", "c1", "--not-applied", "--reason", "r"]):
        result = invoke("journal", *args, "--db", pg_dsn)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1
    with psycopg.connect(pg_dsn) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables "
            "WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
        ).fetchone()
    assert tables == (0,)
