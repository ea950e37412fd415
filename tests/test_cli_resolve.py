"""``airlock journal resolve``: settling pending and unknown calls, and every way it refuses to."""

from __future__ import annotations

import getpass
from pathlib import Path

import orjson
import pytest

from cli.journal import default_operator
from guard import is_refusal
from journal import SQLiteJournal
from tests.cli_support import (
    Tools,
    count_events,
    digest,
    invoke,
    leave_pending,
    pending_with_live_owner,
    rows,
    seed,
)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "journal.db"
    seed(path)
    return path


def last_event(db: Path) -> tuple[str, str, str, str | None, int]:
    found = rows(db, "SELECT kind, actor, reason, value, attempt FROM events ORDER BY seq DESC LIMIT 1")
    return found[0]


def test_applied_with_a_value_commits_and_replays_return_it(db: Path) -> None:
    before = count_events(db)
    result = invoke("journal", "resolve", "call-timeout", "--applied", "--value", '{"charge_id": "ch_2"}',
                    "--reason", "ledger shows ch_2", "--operator", "alice", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"Appended seq {before + 1}: committed by operator:alice for call call-timeout")
    assert count_events(db) == before + 1
    kind, actor, reason, value, attempt = last_event(db)
    assert (kind, actor, attempt) == ("committed", "operator:alice", 1)
    assert orjson.loads(reason) == {"code": "applied", "message": "ledger shows ch_2"}
    assert orjson.loads(value) == {"charge_id": "ch_2"}
    assert rows(db, "SELECT status FROM calls WHERE call_id = 'call-timeout'") == [("committed",)]
    shown = invoke("journal", "show", "call-timeout", "--db", str(db))
    assert "committed (by operator:alice)" in shown.stdout
    with SQLiteJournal(db) as journal:
        tools = Tools(journal)
        again = tools.call("call-timeout", tools.charge, account="acct_2", cents=700)
    assert again == {"charge_id": "ch_2"}
    assert tools.payments.charges == []


def test_applied_without_a_value_makes_replays_refused_value_unavailable(db: Path) -> None:
    result = invoke("journal", "resolve", "call-timeout", "--applied", "--reason", "ledger has it", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert "replay_value_unavailable" in result.stdout
    with SQLiteJournal(db) as journal:
        tools = Tools(journal)
        again = tools.call("call-timeout", tools.charge, account="acct_2", cents=700)
    assert is_refusal(again) and again["block_reason"] == "replay_value_unavailable"
    assert tools.payments.charges == []


def test_not_applied_releases_so_the_call_runs_again(db: Path) -> None:
    result = invoke("journal", "resolve", "call-timeout", "--not-applied", "--reason", "no charge with that key",
                    "--operator", "bob", "--db", str(db))
    assert result.exit_code == 0, result.output
    kind, actor, reason, value, _ = last_event(db)
    assert (kind, actor, value) == ("released", "operator:bob", None)
    assert orjson.loads(reason)["code"] == "not_applied"
    listed = invoke("journal", "show", "--db", str(db))
    assert "released (by operator:bob)" in listed.stdout  # settled by hand, and it shows
    with SQLiteJournal(db) as journal:
        tools = Tools(journal)
        again = tools.call("call-timeout", tools.charge, account="acct_2", cents=700)
    assert again == {"charge_id": "ch_1", "cents": 700}
    assert tools.payments.charges == [("acct_2", 700)]
    row = [line for line in invoke("journal", "show", "--db", str(db)).stdout.splitlines() if "call-timeout" in line]
    assert "committed" in row[0] and "operator" not in row[0]  # run again by the guard: its own record


def test_json_prints_the_appended_event(db: Path) -> None:
    result = invoke("journal", "resolve", "call-timeout", "--not-applied", "--reason", "none", "--json",
                    "--db", str(db))
    assert result.exit_code == 0
    event = orjson.loads(result.stdout)
    assert event["kind"] == "released" and event["call_id"] == "call-timeout"
    assert event["seq"] == count_events(db) and event["reason"]["message"] == "none"


def test_the_operator_defaults_to_the_login_name(db: Path) -> None:
    assert default_operator() == getpass.getuser()
    invoke("journal", "resolve", "call-timeout", "--not-applied", "--reason", "none", "--db", str(db))
    assert last_event(db)[1] == f"operator:{getpass.getuser()}"


def test_the_operator_falls_back_to_the_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_name() -> str:
        raise OSError("no login name")

    monkeypatch.setattr(getpass, "getuser", no_name)
    import os

    assert default_operator() == f"uid:{os.getuid()}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--applied", "--not-applied", "--reason", "x"], "give exactly one of --applied or --not-applied"),
        (["--reason", "x"], "give exactly one of --applied or --not-applied"),
        (["--not-applied", "--value", "1", "--reason", "x"], "--value goes with --applied only"),
        (["--applied", "--value", "{not json", "--reason", "x"], "is not JSON"),
        (["--applied", "--value", "", "--reason", "x"], "is not JSON"),
        # 2**70 and 2**64: a float for orjson, even where it equals the integer; both would come back changed.
        (["--applied", "--value", "1180591620717411303424", "--reason", "x"], "cannot be stored exactly"),
        (["--applied", "--value", '{"n": [18446744073709551616]}', "--reason", "x"], "cannot be stored exactly"),
        (["--applied", "--value", "-9223372036854775809", "--reason", "x"], "cannot be stored exactly"),
        (["--applied"], "Missing option '--reason'"),
        (["--applied", "--reason", "  "], "say why"),
        (["--applied", "--reason", "x", "--operator", " "], "name who settles the call"),
    ],
)
def test_usage_errors_exit_2_and_change_nothing(db: Path, args: list[str], message: str) -> None:
    before, events = digest(db), count_events(db)
    result = invoke("journal", "resolve", "call-timeout", "--db", str(db), *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert count_events(db) == events
    assert digest(db) == before


@pytest.mark.parametrize(
    ("call_id", "error"),
    [
        ("no-such-call", "Error: The journal {db} has no call 'no-such-call'."),
        ("call-ok", "Error: The call 'call-ok' in {db} is committed; only a pending or unknown call can be resolved."),
        ("call-failed", "Error: The call 'call-failed' in {db} is released; only a pending or unknown call can be "
                        "resolved."),
        ("call-refused", "Error: The journal {db} has no call 'call-refused'."),
    ],
)
def test_only_pending_or_unknown_calls_can_be_resolved(db: Path, call_id: str, error: str) -> None:
    events = count_events(db)
    result = invoke("journal", "resolve", call_id, "--applied", "--reason", "x", "--db", str(db))
    assert result.exit_code == 1
    assert result.stderr == error.format(db=db) + "\n"
    assert count_events(db) == events


def test_resolving_twice_is_refused_the_second_time(db: Path) -> None:
    assert invoke("journal", "resolve", "call-timeout", "--applied", "--reason", "x", "--db", str(db)).exit_code == 0
    events = count_events(db)
    again = invoke("journal", "resolve", "call-timeout", "--not-applied", "--reason", "y", "--db", str(db))
    assert again.exit_code == 1 and "is committed" in again.stderr
    assert count_events(db) == events


def test_a_missing_journal_is_an_error_and_is_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    result = invoke("journal", "resolve", "call-1", "--applied", "--reason", "x", "--db", str(missing))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: There is no journal at {missing}.")
    assert list(tmp_path.iterdir()) == []


def test_a_pending_call_whose_owner_is_alive_needs_force(db: Path) -> None:
    with pending_with_live_owner(db, "call-running") as pid:
        events = count_events(db)
        refused = invoke("journal", "resolve", "call-running", "--not-applied", "--reason", "x", "--db", str(db))
        assert refused.exit_code == 1
        assert refused.stderr == (
            f"Error: The call 'call-running' in {db} is pending and its owner process (pid {pid}) is alive on "
            "this host, so it may still finish; --force overrides.\n"
        )
        assert count_events(db) == events
        forced = invoke("journal", "resolve", "call-running", "--not-applied", "--reason", "x", "--force",
                        "--db", str(db))
        assert forced.exit_code == 0, forced.output
        assert count_events(db) == events + 1


def test_a_pending_call_whose_owner_died_can_be_resolved(db: Path) -> None:
    leave_pending(db, "call-crashed")
    result = invoke("journal", "resolve", "call-crashed", "--applied", "--value", "null", "--reason", "ledger",
                    "--db", str(db))
    assert result.exit_code == 0, result.output
    assert rows(db, "SELECT status, value FROM calls WHERE call_id = 'call-crashed'") == [("committed", "null")]


def test_a_pending_call_whose_owner_was_killed_but_not_reaped_resolves_without_force(tmp_path: Path) -> None:
    # A SIGKILLed process its parent has not waited for is a zombie: it still has a pid, but it will
    # never record an outcome, so it is not an owner that may still finish.
    import os
    import signal
    import subprocess
    import sys
    import time

    from guard.store import EffectEvent, current_owner

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = tmp_path / "j.db"
    try:
        owner = {"host": current_owner()["host"], "pid": child.pid}
        with SQLiteJournal(path, durability="process") as journal:
            journal.append(EffectEvent("pending", "call-z", "charge", attempt=1, arguments="{}", owner=owner))
        alive = invoke("journal", "resolve", "call-z", "--not-applied", "--reason", "x", "--db", str(path))
        assert alive.exit_code == 1 and "is alive on this host" in alive.stderr
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(200):  # until the kernel has made it a zombie (not reaped: no wait() yet)
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                if b") Z" in f.read():
                    break
            time.sleep(0.01)
        gone = invoke("journal", "resolve", "call-z", "--not-applied", "--reason", "x", "--db", str(path))
        assert gone.exit_code == 0, gone.stderr
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("call_id", ["nope", "call-ok"])
def test_a_refused_resolve_leaves_an_older_journal_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              call_id: str) -> None:
    # Opening for writing migrates an older journal; a resolve that is refused must not get that far.
    import sqlite3

    from journal.sqlite import schema

    path = tmp_path / "old.db"
    monkeypatch.setattr(schema, "LATEST", schema.LATEST - 1)
    seed(path)
    monkeypatch.undo()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    before = digest(path)
    result = invoke("journal", "resolve", call_id, "--applied", "--reason", "x", "--db", str(path))
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")
    assert digest(path) == before
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (schema.LATEST - 1,)
    conn.close()
    settled = invoke("journal", "resolve", "call-timeout", "--applied", "--reason", "x", "--db", str(path))
    assert settled.exit_code == 0, settled.output  # an accepted one migrates it, and is made
