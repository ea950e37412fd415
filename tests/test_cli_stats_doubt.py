"""``stats --json`` and its rows carry what the runbook alerts on: the pending calls whose owner is
alive and gone, the calls in doubt and the oldest of them, as the text and Prometheus outputs do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli_support import invoke, leave_pending, pending_with_live_owner, seed
from tests.journals import JournalFactory


def test_stats_json_tells_a_running_call_from_one_in_doubt(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    seed(db)  # call-timeout is unknown
    leave_pending(db, "call-orphan")
    with pending_with_live_owner(db, "call-running"):
        shown = invoke("journal", "stats", "--db", str(db), "--json")
        rows = invoke("journal", "stats", "--db", str(db), "--nl")
    assert shown.exit_code == 0, shown.output
    counted = json.loads(shown.stdout)
    assert counted["by_status"]["pending"] == 2
    assert (counted["pending_owner_alive"], counted["pending_owner_gone"]) == (1, 1)
    assert counted["calls_in_doubt"] == 2  # call-timeout (unknown) and call-orphan; not call-running
    # The unknown call of the seed is older than the orphan: it is the oldest in doubt.
    assert counted["oldest_in_doubt_at"] == counted["oldest_unknown_at"]
    by_name = {(r["group"], r["name"]): r for r in map(json.loads, rows.stdout.splitlines())}
    assert by_name[("doubt", "in_doubt")]["count"] == 2
    assert by_name[("owner", "pending_owner_alive")]["count"] == 1


def test_reconcile_older_than_says_how_many_younger_calls_it_left(tmp_path: Path, monkeypatch: Any) -> None:
    db = tmp_path / "j.db"
    seed(db)  # call-timeout: unknown, just now
    (tmp_path / "checks.py").write_text(
        "from guard.reconcile import NotApplied\nCHECKS = {'charge': lambda call: NotApplied(evidence='none')}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    done = invoke("journal", "reconcile", "--with", "checks:CHECKS", "--older-than", "10m", "--db", str(db))
    assert done.exit_code == 0, done.output
    assert done.output.strip() == ("No call in doubt older than 10m. 1 younger call(s) in doubt were left to the "
                                   "agent's own retry (without --older-than they are checked too).")


def test_show_of_a_tool_never_seen_says_so(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    seed(db)
    done = invoke("journal", "show", "--tool", "chrage", "--db", str(db))
    assert done.exit_code == 0
    assert "The journal has no call of the tool 'chrage' at all" in done.stderr
    known = invoke("journal", "show", "--tool", "charge", "--status", "pending", "--db", str(db))
    assert known.exit_code == 0 and "no call of the tool" not in known.stderr


def test_show_watch_shows_the_queue_again_until_ctrl_c(tmp_path: Path) -> None:
    import os
    import select
    import signal
    import subprocess
    import sys

    db = tmp_path / "j.db"
    seed(db)  # call-timeout is unknown: in the queue
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "cli", "journal", "show", "--watch", "--interval", "0.2",
                             "--db", str(db)], cwd=root, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdout is not None
    stamps = 0
    while stamps < 2:  # two tables, however long a loaded machine takes to print them
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line, proc.stderr.read() if proc.stderr else ""
        if line.startswith("call-timeout"):
            assert "unknown" in line
        stamps += line.startswith("-- ")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err


def test_export_takes_the_flags_of_every_listing_and_keeps_format(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    seed(db)
    by_flag = invoke("journal", "export", "--csv", "--db", str(db))
    by_format = invoke("journal", "export", "--format", "csv", "--db", str(db))
    assert by_flag.exit_code == 0 and by_flag.stdout == by_format.stdout and by_flag.stdout.startswith("seq,")
    assert invoke("journal", "export", "--nl", "--db", str(db)).stdout == invoke(
        "journal", "export", "--db", str(db)).stdout
    both = invoke("journal", "export", "--nl", "--csv", "--db", str(db))
    assert both.exit_code == 2 and "give one" in both.output


@pytest.fixture
def target(journal_kind: JournalFactory, journal_target: str) -> str:
    """A journal of every store (tests/conftest.py) seeded by ``seed_into``."""
    from tests.cli_support import seed_into

    with journal_kind.open(journal_target) as journal:
        seed_into(journal)
    return journal_target


def test_show_finds_a_call_by_the_idempotency_key_the_backend_hands_over(target: str) -> None:
    from journal import open_journal

    with open_journal(target, create=False) as j:
        wanted = j.call("call-timeout")
    assert wanted is not None and wanted.idempotency_key is not None
    found = invoke("journal", "show", "--key", wanted.idempotency_key, "--db", target, "--json")
    assert found.exit_code == 0, found.output
    assert [json.loads(line)["call_id"] for line in found.stdout.splitlines()] == ["call-timeout"]
    none = invoke("journal", "show", "--key", "0" * 64, "--db", target)
    assert none.exit_code == 0 and none.stderr.startswith("No calls match.")


def test_show_until_takes_the_calls_updated_before_a_time(target: str) -> None:
    every = [json.loads(line) for line in invoke("journal", "show", "--db", target, "--json").stdout.splitlines()]
    newest = every[0]["updated_at"]
    before = invoke("journal", "show", "--until", newest, "--db", target, "--json")
    assert before.exit_code == 0, before.output
    ids = [json.loads(line)["call_id"] for line in before.stdout.splitlines()]
    assert every[0]["call_id"] not in ids and ids == [c["call_id"] for c in every if c["updated_at"] < newest]
    one = invoke("journal", "show", "call-ok", "--until", newest, "--db", target)
    assert one.exit_code == 2 and "--until" in one.stderr
