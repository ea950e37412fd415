"""``airlock demo``: the story runs, charges once per payment, and its closing command settles the call."""

from __future__ import annotations

import shlex
from pathlib import Path

import orjson

from tests.cli_support import count_events, invoke, rows, run_airlock


def resolve_command(output: str) -> list[str]:
    """The resolve command the demo prints, as a shell would split it (continuation lines joined)."""
    lines = output.splitlines()
    start = next(n for n, line in enumerate(lines) if line.strip().startswith("airlock journal resolve "))
    command = []
    for line in lines[start:]:
        command.append(line.strip().removesuffix("\\"))
        if not line.endswith("\\"):
            break
    return shlex.split(" ".join(command))[1:]


def test_demo_charges_once_per_payment_and_ends_with_what_the_operator_sees(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    result = invoke("demo", "--db", str(db))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "The backend's ledger: 3 charges for 3 intended payments" in out
    assert "replayed the stored receipt" in out
    assert "refused effect_status_unknown" in out
    assert "asked the backend first: the backend has ch_3 for this key" in out
    assert f"airlock journal show --db {db} --limit 4" in out
    table = out.split("shows the operator:", 1)[1].splitlines()
    assert table[1].split()[:3] == ["CALL", "ID", "TOOL"]
    assert table[2].split()[:4] == ["call_r1_4", "charge", "committed", "(by"]
    assert table[4].split()[:3] == ["call_r1_2", "charge", "unknown"]
    assert rows(db, "SELECT call_id, status, actor FROM calls ORDER BY call_id") == [
        ("call_r1_1", "committed", "guard"), ("call_r1_2", "unknown", "guard"),
        ("call_r1_3", "committed", "guard"), ("call_r1_4", "committed", "reconciler:PaymentBackend.charge_made"),
    ]
    kinds = [k for (k,) in rows(db, "SELECT kind FROM events ORDER BY seq")]
    assert kinds.count("replayed") == 2 and kinds.count("refused") == 1
    assert len(out.splitlines()) < 60


def test_demo_with_approvals_shows_a_refund_wait_approved_from_the_cli_then_run_once(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    result = invoke("demo", "--approvals", "--db", str(db))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "refused approval_pending" in out
    assert "airlock journal approve call_r1_5 --operator demo-operator" in out
    assert "approved by operator:demo-operator for call call_r1_5" in out
    assert "refunded re_1 (12.50 of ch_1); 1 refund in all" in out
    table = out.split("shows the operator:", 1)[1].splitlines()
    assert table[2].split()[:3] == ["call_r1_5", "refund", "committed"]
    kinds = [k for (k,) in rows(db, "SELECT kind FROM events WHERE call_id = 'call_r1_5' ORDER BY seq")]
    assert kinds == ["approval_requested", "refused", "approved", "approval_consumed", "pending", "committed"]
    assert invoke("journal", "verify", "--db", str(db)).exit_code == 0


def test_the_printed_resolve_command_settles_the_unknown_call(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    out = invoke("demo", "--db", str(db)).stdout
    args = resolve_command(out)
    assert args[:5] == ["journal", "resolve", "call_r1_2", "--db", str(db)]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    status, value = rows(db, "SELECT status, value FROM calls WHERE call_id = 'call_r1_2'")[0]
    assert status == "committed"
    assert orjson.loads(value) == {"account": "acct_bob", "cents": 4200, "charge_id": "ch_2", "status": "succeeded"}


def test_demo_reruns_on_the_same_journal_with_fresh_calls(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    assert invoke("demo", "--db", str(db)).exit_code == 0
    first = count_events(db)
    again = invoke("demo", "--db", str(db))
    assert again.exit_code == 0, again.output
    assert "run 2" in again.stdout and "call_r2_2" in again.stdout
    assert count_events(db) == 2 * first
    assert invoke("journal", "verify", "--db", str(db)).exit_code == 0


def test_demo_defaults_to_airlock_demo_db_in_the_current_directory(tmp_path: Path) -> None:
    result = run_airlock("demo", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "airlock-demo.db").exists()
    shown = run_airlock("journal", "show", "--db", "airlock-demo.db", cwd=tmp_path)
    assert shown.returncode == 0 and "call_r1_2" in shown.stdout


def test_demo_on_a_file_that_is_not_a_journal_is_an_error(tmp_path: Path) -> None:
    other = tmp_path / "notes.db"
    other.write_text("not a database")
    result = invoke("demo", "--db", str(other))
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "not an airlock journal" in result.stderr
    assert other.read_text() == "not a database"
