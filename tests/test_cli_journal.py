"""``verify``, ``rebuild``, ``stats``, ``--help`` of every command, and the installed ``airlock`` script."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import click
import orjson
import pytest

from cli.main import main
from tests.cli_support import count_events, digest, invoke, leave_pending, rows, run_airlock, seed


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "journal.db"
    seed(path)
    return path


def tamper(db: Path, sql: str) -> None:
    """Change the file behind the journal's back, the way an attacker with the file would."""
    conn = sqlite3.connect(db)
    try:
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute("DROP TRIGGER events_no_delete")
        conn.execute(sql)
        conn.commit()
    finally:
        conn.close()


# -- verify --------------------------------------------------------------------------------------


def test_verify_prints_the_count_and_head(db: Path) -> None:
    before = digest(db)
    result = invoke("journal", "verify", "--db", str(db))
    assert result.exit_code == 0
    head = rows(db, "SELECT hash FROM events ORDER BY seq DESC LIMIT 1")[0][0]
    assert result.stdout == f"OK: {count_events(db)} events, head {head}\n"
    as_json = orjson.loads(invoke("journal", "verify", "--json", "--db", str(db)).stdout)
    assert as_json == {"ok": True, "events": count_events(db), "head": head, "first_bad_seq": None, "problem": None}
    assert digest(db) == before


def test_verify_names_the_first_altered_event(db: Path) -> None:
    tamper(db, "UPDATE events SET arguments = '{\"account\":\"acct_1\",\"cents\":5}' WHERE seq = 2")
    result = invoke("journal", "verify", "--db", str(db))
    assert result.exit_code == 1
    assert (result.stderr.startswith("Error: ") and " does not verify at seq 2: " in result.stderr)
    as_json = invoke("journal", "verify", "--json", "--db", str(db))
    assert as_json.exit_code == 1 and orjson.loads(as_json.stdout)["first_bad_seq"] == 2


def test_verify_names_events_deleted_from_the_start_of_the_log(db: Path) -> None:
    tamper(db, "DELETE FROM events WHERE seq = 1")
    result = invoke("journal", "verify", "--db", str(db))
    assert result.exit_code == 1
    assert "does not verify at seq 2: the first event is seq 2, not seq 1: events are missing" in result.stderr
    assert "--allow-gaps" not in result.stderr  # a journal's own log has no gaps to allow


def test_verify_catches_a_projection_that_differs_and_rebuild_repairs_it(db: Path) -> None:
    conn = sqlite3.connect(db)
    conn.execute("UPDATE calls SET status = 'released' WHERE call_id = 'call-timeout'")
    conn.commit()
    conn.close()
    result = invoke("journal", "verify", "--db", str(db))
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and " does not verify at seq " in result.stderr
    assert "call-timeout" in result.stderr
    events = count_events(db)
    rebuilt = invoke("journal", "rebuild", "--db", str(db))
    assert rebuilt.exit_code == 0
    assert rebuilt.stdout == "Rebuilt the projection: 4 calls\n"
    assert rows(db, "SELECT status FROM calls WHERE call_id = 'call-timeout'") == [("unknown",)]
    assert count_events(db) == events
    assert invoke("journal", "verify", "--db", str(db)).exit_code == 0


@pytest.mark.parametrize("command", ["verify", "stats", "rebuild"])
def test_a_missing_journal_is_an_error_and_is_not_created(tmp_path: Path, command: str) -> None:
    missing = tmp_path / "missing.db"
    result = invoke("journal", command, "--db", str(missing))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: There is no journal at {missing}.")
    assert list(tmp_path.iterdir()) == []


# -- what reading leaves behind --------------------------------------------------------------------


def test_the_read_only_commands_leave_a_closed_journal_one_file_as_it_was(db: Path, tmp_path: Path) -> None:
    # SQLite reads a WAL journal through a -wal and a -shm beside it; a command that only reads
    # takes them away again, so the directory is as it was, the journal's bytes too.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.db"]
    before = db.read_bytes()
    out = tmp_path.parent / f"{tmp_path.name}-export.jsonl"
    for args in (["show"], ["show", "--json"], ["show", "call-ok"], ["show", "--status", "unknown"],
                 ["export"], ["export", "--format", "csv"], ["export", "-o", str(out)], ["verify"],
                 ["verify", "--json"], ["stats"], ["stats", "--json"]):
        result = invoke("journal", *args, "--db", str(db))
        assert result.exit_code == 0, (args, result.output)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.db"], args
    assert db.read_bytes() == before
    out.unlink()


# -- stats ---------------------------------------------------------------------------------------


def test_stats_json(db: Path) -> None:
    leave_pending(db, "call-crashed")
    before = digest(db)
    result = invoke("journal", "stats", "--json", "--db", str(db))
    assert result.exit_code == 0
    counted = orjson.loads(result.stdout)
    assert counted["calls"] == 5 and counted["events"] == count_events(db)
    assert counted["by_status"] == {"committed": 2, "unknown": 1, "released": 1, "pending": 1}
    assert counted["by_tool"] == {"charge": 4, "read_balance": 1}
    unknown_since = rows(db, "SELECT since FROM calls WHERE call_id = 'call-timeout'")[0][0]
    assert counted["oldest_unknown_at"] == unknown_since
    assert datetime.fromisoformat(counted["oldest_pending_at"]) <= datetime.now(UTC)
    assert digest(db) == before


def test_stats_table(db: Path) -> None:
    result = invoke("journal", "stats", "--db", str(db))
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert "calls   4" in lines and f"events  {count_events(db)}" in lines
    assert any(line.split() == ["unknown", "1"] for line in lines)
    assert any(line.split() == ["charge", "3"] for line in lines)
    assert any(line.startswith("oldest unknown  20") and line.endswith("s ago)") for line in lines)
    assert "oldest pending  -" in lines


def test_stats_of_an_empty_journal(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    from journal import SQLiteJournal

    SQLiteJournal(path).close()
    counted = orjson.loads(invoke("journal", "stats", "--json", "--db", str(path)).stdout)
    assert counted == {"calls": 0, "events": 0, "by_status": {}, "by_tool": {},
                       "oldest_pending_at": None, "oldest_unknown_at": None, "approvals_open": 0,
                       "pending_owner_alive": 0, "pending_owner_gone": 0, "calls_in_doubt": 0,
                       "oldest_in_doubt_at": None}


# -- help ----------------------------------------------------------------------------------------


def all_commands() -> list[list[str]]:
    found: list[list[str]] = [[]]

    def walk(group: click.Group, prefix: list[str]) -> None:
        for name, command in group.commands.items():
            found.append([*prefix, name])
            if isinstance(command, click.Group):
                walk(command, [*prefix, name])

    walk(main, [])
    return found


def test_the_commands_of_the_contract_are_there() -> None:
    assert {" ".join(c) for c in all_commands()} >= {
        "", "demo", "journal", "journal show", "journal resolve", "journal export", "journal verify",
        "journal rebuild", "journal stats",
    }


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: " ".join(c) or "airlock")
def test_every_help_has_an_example(command: list[str]) -> None:
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert "Example:" in result.stdout
    assert "airlock " in result.stdout.split("Example:", 1)[1]


USAGE_ERRORS = [
    (["--bogus"], "--bogus"),  # click's own words differ between its versions: the flag is named
    (["journal", "bogus"], "'bogus'"),
    (["journal", "show", "--limit", "0"], "Invalid value for '--limit': 0 is not in the range x>=1."),
    (["journal", "show", "--status", "lost"], "'--status'"),
    (["journal", "resolve"], "CALL_ID"),
    (["journal", "resolve", "c1", "--applied", "--not-applied", "--reason", "r"],
     "give exactly one of --applied or --not-applied"),
    (["journal", "export", "--format", "xml"], "'--format'"),
    (["demo", "--bogus"], "--bogus"),
]


@pytest.mark.parametrize(("args", "named"), USAGE_ERRORS, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_a_usage_error_is_one_error_line_and_exit_2(args: list[str], named: str, db: Path) -> None:
    before = digest(db)
    result = invoke(*args, "--db", str(db)) if args[0] == "journal" and len(args) > 1 else invoke(*args)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("Error: "), result.stderr
    assert named in result.stderr
    assert digest(db) == before


def test_a_group_without_a_command_prints_its_help() -> None:
    result = invoke("journal")
    assert result.exit_code in (0, 2)  # 2 from click 8.2 on
    assert "Usage: " in result.stdout + result.stderr and "Commands:" in result.stdout + result.stderr


# -- the installed script ------------------------------------------------------------------------


def test_script_show_and_verify(db: Path) -> None:
    shown = run_airlock("journal", "show", "--json", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    assert len(shown.stdout.splitlines()) == 4
    verified = run_airlock("journal", "verify", env={"AIRLOCK_JOURNAL": str(db)})
    assert verified.returncode == 0 and verified.stdout.startswith(f"OK: {count_events(db)} events, head ")


def test_script_errors_are_one_line_without_a_traceback(db: Path, tmp_path: Path) -> None:
    missing = run_airlock("journal", "stats", "--db", str(tmp_path / "missing.db"))
    assert missing.returncode == 1
    assert missing.stderr.count("\n") == 1 and missing.stderr.startswith("Error: There is no journal at ")
    assert missing.stdout == ""
    assert not (tmp_path / "missing.db").exists()
    unknown = run_airlock("journal", "show", "nope", "--db", str(db))
    assert (unknown.returncode, unknown.stderr) == (1, f"Error: no call 'nope' in the journal {db}\n")


def test_script_usage_error_exits_2_and_changes_nothing(db: Path) -> None:
    events = count_events(db)
    both = run_airlock("journal", "resolve", "call-timeout", "--applied", "--not-applied", "--reason", "x",
                       "--db", str(db))
    assert both.returncode == 2
    assert both.stderr.splitlines()[-1] == "Error: give exactly one of --applied or --not-applied"
    assert count_events(db) == events


def test_script_resolve_then_export_to_a_pipe(db: Path) -> None:
    settled = run_airlock("journal", "resolve", "call-timeout", "--not-applied", "--reason", "no charge",
                          "--db", str(db))
    assert settled.returncode == 0, settled.stderr
    exported = run_airlock("journal", "export", "--db", str(db), "--call", "call-timeout")
    kinds = [orjson.loads(line)["kind"] for line in exported.stdout.splitlines()]
    assert kinds == ["pending", "unknown", "refused", "released"]


def test_script_version() -> None:
    result = run_airlock("--version")
    assert result.returncode == 0 and result.stdout.startswith("airlock, version ")


@pytest.mark.parametrize(
    "args",
    [
        ["show"], ["show", "--json"], ["show", "call-timeout"], ["show", "call-ok", "--json"],
        ["export"], ["export", "--format", "csv"], ["verify"], ["verify", "--json"], ["stats"], ["stats", "--json"],
    ],
    ids=" ".join,
)
def test_a_command_that_only_reads_leaves_the_journal_as_it_was(db: Path, args: list[str]) -> None:
    leave_pending(db, "call-crashed")  # a WAL that no writer has checkpointed yet
    before = digest(db)
    result = invoke("journal", *args, "--db", str(db))
    assert result.exit_code == 0, result.output
    assert digest(db) == before


@pytest.mark.parametrize("command", ["show", "export", "verify", "stats", "rebuild"])
def test_an_empty_db_is_a_usage_error(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("journal", command, "--db", " ")
    assert result.exit_code == 2
    assert "Invalid value for '--db'" in result.stderr and "is empty" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["rebuild"], ["resolve", "call-1", "--applied", "--reason", "x"]])
def test_a_command_that_writes_does_not_make_a_journal_of_an_empty_file(tmp_path: Path, args: list[str]) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    result = invoke("journal", *args, "--db", str(empty))
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "not an airlock journal" in result.stderr
    assert empty.read_bytes() == b"" and [p.name for p in tmp_path.iterdir()] == ["empty.db"]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("postgresql://bad host/x", 'unexpected spaces found in "bad host"'),
        ("postgresql://127.0.0.1/x?foo=bar", 'invalid URI query parameter: "foo"'),
        ("postgresql://airlock:s3cret@db:notaport/x", "the port 'notaport' is not a number"),
        ("postgresql://airlock:s3cret@db:99999/x", "the port '99999' is not one from 1 to 65535"),
        ("postgresql://airlock:s3cret@db:5432,db2:0/x", "the port '5432,0' is not one from 1 to 65535"),
        # libpq quotes the bad part, the password included: it is blanked as written and decoded.
        ("postgresql://airlock:s3cret%zz@db/x", 'invalid percent-encoded token: "***"'),
        ("postgresql://airlock:s3cret@[db/x", 'in URI: "postgresql://airlock:***@[db/x"'),
        ("postgresql://db/x?password=s3cret%zz&application_name=a", 'invalid percent-encoded token: "***"'),
    ],
)
def test_a_malformed_postgresql_url_is_a_usage_error_on_one_line(url: str, problem: str) -> None:
    result = invoke("journal", "stats", "--db", url)
    assert result.exit_code == 2
    error = result.stderr.splitlines()[-1]
    assert error.startswith("Error: Invalid value for '--db'") and problem in error
    assert "s3cret" not in result.stderr  # the password is never printed


def test_a_connection_string_value_libpq_refuses_is_told_from_a_server_out_of_reach() -> None:
    result = run_airlock("journal", "stats", "--db", "postgresql://airlock:s3cret@127.0.0.1:1/j?sslmode=sometimes")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line == ("Error: cannot open the journal: the connection string of the journal postgresql://127.0.0.1:1/j "
                    'has a value libpq does not take (connection is bad: invalid sslmode value: "sometimes")')


def test_a_server_that_cannot_be_reached_is_one_error_line() -> None:
    result = run_airlock("journal", "stats", "--db", "postgresql://127.0.0.1:1/journal")
    assert result.returncode == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: ") and "cannot be reached" in line


def test_a_list_of_hosts_with_a_default_port_is_a_url_not_a_usage_error() -> None:
    # libpq's empty entry in the port list is the default port: the URL is tried, not refused.
    result = run_airlock("journal", "stats", "--db", "postgresql://127.0.0.1,127.0.0.2:1/journal")
    assert result.returncode == 1 and result.stderr.startswith("Error: ")
    assert "Invalid value for '--db'" not in result.stderr
