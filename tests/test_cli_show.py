"""``airlock journal show``: the list of calls, one call with its events, and their error paths."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from cli import render
from guard.store import CallRecord, current_owner
from journal import SQLiteJournal
from tests.cli_support import (
    Tools,
    digest,
    invoke,
    leave_pending,
    pending_with_live_owner,
    run_on_terminal,
    seed,
)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "journal.db"
    seed(path)
    return path


def json_lines(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in text.splitlines()]


def test_show_lists_calls_newest_first(db: Path) -> None:
    result = invoke("journal", "show", "--db", str(db))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["CALL", "ID", "TOOL", "STATUS", "ATTEMPT", "AGENT", "AGE"]
    ids = [line.split()[0] for line in lines[1:]]
    assert ids == ["call-read", "call-failed", "call-timeout", "call-ok"]
    by_id = {line.split()[0]: line.split() for line in lines[1:]}
    assert by_id["call-timeout"][1:4] == ["charge", "unknown", "1"]
    assert by_id["call-read"][4] == "agent-2"
    assert by_id["call-ok"][-2:] == ["0s", "ago"]
    assert "call-refused" not in result.stdout  # refusals make no call


@pytest.mark.parametrize(("limit", "cut"), [("3", True), ("4", False), ("5", False)])
def test_show_says_the_list_was_cut_only_when_it_was(db: Path, limit: str, cut: bool) -> None:
    result = invoke("journal", "show", "--limit", limit, "--db", str(db))  # the journal has 4 calls
    assert result.exit_code == 0
    assert len(result.stdout.splitlines()) == 1 + min(int(limit), 4)
    assert ("pass --limit for more" in result.stderr) is cut


def test_show_json_lines_have_the_call_fields(db: Path) -> None:
    result = invoke("journal", "show", "--json", "--db", str(db))
    assert result.exit_code == 0
    calls = {c["call_id"]: c for c in json_lines(result.stdout)}
    assert set(calls) == {"call-ok", "call-timeout", "call-failed", "call-read"}
    ok = calls["call-ok"]
    assert ok["tool"] == "charge" and ok["status"] == "committed" and ok["attempt"] == 1
    assert ok["agent_id"] == "agent-1" and len(ok["idempotency_key"]) == 64
    assert ok["arguments"] == {"account": "acct_1", "cents": 500}
    assert ok["value"] == {"charge_id": "ch_1", "cents": 500}
    assert ok["created_at"].endswith("Z") and datetime.fromisoformat(ok["updated_at"]) <= datetime.now(UTC)
    assert calls["call-timeout"]["error"] == {"type": "TimeoutError", "message": "backend did not answer"}
    assert calls["call-failed"]["status"] == "released" and calls["call-failed"]["value"] is None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--status", "unknown"], ["call-timeout"]),
        (["--status", "committed"], ["call-read", "call-ok"]),
        (["--status", "unknown", "--status", "released"], ["call-failed", "call-timeout"]),
        (["--status", "UNKNOWN", "--status", "unknown"], ["call-timeout"]),
        (["--tool", "read_balance"], ["call-read"]),
        (["--agent", "agent-2"], ["call-read"]),
        (["--limit", "2"], ["call-read", "call-failed"]),
        (["--since", "1h"], ["call-read", "call-failed", "call-timeout", "call-ok"]),
        (["--since", (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")], []),
    ],
)
def test_show_filters(db: Path, args: list[str], expected: list[str]) -> None:
    result = invoke("journal", "show", "--json", "--db", str(db), *args)
    assert result.exit_code == 0, result.output
    assert [c["call_id"] for c in json_lines(result.stdout)] == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "yesterday"], "'yesterday' is not a time"),
        (["--since", "10x"], "'10x' is not a time"),
        (["--limit", "0"], "0 is not in the range x>=1"),
        (["--limit", "many"], "'many' is not a valid integer"),
        (["--status", "done"], "'done' is not one of"),
        (["call-ok", "--status", "unknown"], "--status filters the list of calls; it cannot be combined with CALL_ID"),
        (["call-ok", "--limit", "3", "--tool", "charge"],
         "--tool, --limit filter the list of calls; they cannot be combined with CALL_ID"),
    ],
)
def test_show_usage_errors_exit_2(db: Path, args: list[str], message: str) -> None:
    before = digest(db)
    result = invoke("journal", "show", "--db", str(db), *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert digest(db) == before


def test_show_one_call_with_its_events(db: Path) -> None:
    result = invoke("journal", "show", "call-timeout", "--db", str(db))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "status     unknown" in out
    assert "TimeoutError: backend did not answer" in out
    kinds = [line.split()[2] for line in out.split("SEQ", 1)[1].splitlines()[1:] if line.strip()[:1].isdigit()]
    assert kinds == ["pending", "unknown", "refused"]
    assert "effect_status_unknown" in out
    assert "airlock journal resolve call-timeout --applied" in out


def test_show_one_call_json(db: Path) -> None:
    result = invoke("journal", "show", "call-ok", "--json", "--db", str(db))
    assert result.exit_code == 0
    shown = orjson.loads(result.stdout)
    assert shown["call_id"] == "call-ok" and shown["status"] == "committed"
    assert [e["kind"] for e in shown["events"]] == ["pending", "committed", "replayed"]
    assert [e["actor"] for e in shown["events"]] == ["guard"] * 3
    seqs = [e["seq"] for e in shown["events"]]
    assert seqs == sorted(seqs) and all(e["at"].endswith("Z") for e in shown["events"])
    assert shown["events"][1]["value"] == {"charge_id": "ch_1", "cents": 500}


def test_show_an_id_with_only_refusals_has_a_null_status(db: Path) -> None:
    result = invoke("journal", "show", "call-refused", "--json", "--db", str(db))
    assert result.exit_code == 0, result.output
    shown = orjson.loads(result.stdout)
    assert shown["status"] is None and shown["tool"] == "refund"
    assert [(e["kind"], e["reason"]["code"]) for e in shown["events"]] == [("refused", "policy_violation")]
    text = invoke("journal", "show", "call-refused", "--db", str(db))
    assert text.exit_code == 0 and "only refusals" in text.stdout and "policy_violation" in text.stdout


def test_show_unknown_call_id_is_an_error(db: Path) -> None:
    before = digest(db)
    result = invoke("journal", "show", "no-such-call", "--db", str(db))
    assert result.exit_code == 1
    assert result.stderr == f"Error: no call 'no-such-call' in the journal {db}\n"
    assert digest(db) == before


@pytest.mark.parametrize("args", [[], ["call-ok"], ["--json"]])
def test_show_of_a_missing_journal_is_an_error_and_creates_nothing(tmp_path: Path, args: list[str]) -> None:
    missing = tmp_path / "missing.db"
    result = invoke("journal", "show", "--db", str(missing), *args)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: There is no journal at {missing}.")
    assert list(tmp_path.iterdir()) == []


def test_show_of_a_file_that_is_not_a_journal(tmp_path: Path) -> None:
    other = tmp_path / "notes.txt"
    other.write_text("shopping list\n")
    result = invoke("journal", "show", "--db", str(other))
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "not an airlock journal" in result.stderr
    assert other.read_text() == "shopping list\n"


def test_show_reads_the_journal_from_the_environment_then_the_default(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from_env = invoke("journal", "show", "--json", env={"AIRLOCK_JOURNAL": str(db)})
    assert from_env.exit_code == 0 and len(json_lines(from_env.stdout)) == 4
    monkeypatch.chdir(tmp_path)
    missing_default = invoke("journal", "show")
    assert missing_default.exit_code == 1
    assert "There is no journal at airlock-journal.db." in missing_default.stderr
    db.rename(tmp_path / "airlock-journal.db")
    assert invoke("journal", "show").exit_code == 0


def test_show_marks_whether_a_pending_calls_owner_is_alive(db: Path) -> None:
    leave_pending(db, "call-crashed")
    with pending_with_live_owner(db, "call-running"):
        result = invoke("journal", "show", "--db", str(db))
        as_json = {c["call_id"]: c for c in json_lines(invoke("journal", "show", "--json", "--db", str(db)).stdout)}
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "pending (owner alive)" in rows["call-running"]
    assert "pending (owner gone)" in rows["call-crashed"]
    assert as_json["call-running"]["owner_alive"] is True
    assert as_json["call-crashed"]["owner_alive"] is False
    assert as_json["call-ok"]["owner_alive"] is None


def _record(call_id: str, tool: str = "charge", status: str = "committed") -> CallRecord:
    now = datetime.now(UTC)
    return CallRecord(
        call_id=call_id, tool=tool, status=status, attempt=1, agent_id="agent-1", idempotency_key="k",
        arguments="{}", value=None, error=None, reason=None, actor="guard", owner=current_owner(),
        created_at=now, updated_at=now - timedelta(minutes=12), since=now,
    )


def test_a_table_never_cuts_a_call_id_even_past_the_terminal_width() -> None:
    long_id = "toolu_" + "x" * 60
    lines = render.calls_table([_record(long_id), _record("short")], width=80)
    assert lines[1].startswith(long_id + " ")  # what the operator copies, whole
    assert lines[2].startswith("short ")
    assert lines[1].endswith("12m ago")
    assert lines[0].split()[:3] == ["CALL", "ID", "TOOL"] and "AGENT" not in lines[0]  # left out to make room
    fits = render.calls_table([_record("toolu_01"), _record("short")], width=80)
    assert all(len(line) <= 80 for line in fits)


def test_ages_read_like_a_person_would_say_them() -> None:
    now = datetime.now(UTC)
    assert render.age(now - timedelta(seconds=5), now) == "5s ago"
    assert render.age(now - timedelta(minutes=12, seconds=30), now) == "12m ago"
    assert render.age(now - timedelta(hours=3), now) == "3h ago"
    assert render.age(now - timedelta(days=3), now) == "3d ago"


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert render.use_colour(Tty()) is True
    monkeypatch.setenv("NO_COLOR", "1")
    assert render.use_colour(Tty()) is False
    monkeypatch.delenv("NO_COLOR")
    lines = render.calls_table([_record("c1", status="unknown")], colour=True)
    assert "\x1b[" in lines[1]
    assert "\x1b[" not in "".join(render.calls_table([_record("c1", status="unknown")], colour=False))


def test_show_output_through_a_pipe_has_no_colour(db: Path) -> None:
    result = invoke("journal", "show", "--db", str(db))
    assert result.exit_code == 0 and "CALL ID" in result.stdout
    assert "\x1b[" not in result.stdout


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_on_a_terminal_the_table_fits_its_width_and_is_coloured(db: Path) -> None:
    long_id = "toolu_01" + "A" * 70
    with SQLiteJournal(db) as journal:
        tools = Tools(journal)
        tools.call(long_id, tools.charge, account="acct_7", cents=100)
    code, seen, _ = run_on_terminal("journal", "show", "--db", str(db), stream="stdout", env={"COLUMNS": "70"})
    assert code == 0
    lines = [ANSI.sub("", line) for line in seen.splitlines() if line]
    assert lines[0].startswith("CALL ID") and "AGENT" not in lines[0]
    assert lines[1].startswith(long_id + " ")  # never cut, though wider than the terminal
    assert "\x1b[" in seen
    code, plain, _ = run_on_terminal("journal", "show", "--db", str(db), stream="stdout",
                                     env={"COLUMNS": "70", "NO_COLOR": "1"})
    assert code == 0 and "\x1b[" not in plain and long_id in plain
    piped = invoke("journal", "show", "--db", str(db))
    assert long_id in piped.stdout


def test_show_call_id_gives_a_state_that_its_events_explain_while_a_writer_goes_on(tmp_path: Path) -> None:
    # Another process keeps one call moving (pending, released, pending again, ...): every `show
    # CALL_ID --json` must print the state that the fold of the events it prints gives.
    import subprocess
    import sys
    import time

    from guard.store import apply

    path = tmp_path / "j.db"
    SQLiteJournal(path).close()
    flipper = subprocess.Popen([sys.executable, "-c", f"""
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard, reversibility
import time
from journal import SQLiteJournal
journal = SQLiteJournal({str(path)!r}, durability="process")
@reversibility("reversible")
@Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
def flip() -> None:
    raise ValueError("declined")  # released: the next call runs it again, attempt + 1
while True:
    with AirlockContext(metadata={{"tool_call_id": "flip-1"}}):
        try:
            flip()
        except ValueError:
            pass
    time.sleep(0.001)
"""])
    try:
        deadline = time.monotonic() + 30
        while SQLiteJournal(path, readonly=True).head()[0] < 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(10):
            result = invoke("journal", "show", "flip-1", "--json", "--db", str(path))
            assert result.exit_code == 0, result.output
            shown = orjson.loads(result.stdout)
            record = None
            for event in SQLiteJournal(path, readonly=True).call_events("flip-1"):
                if event.seq <= shown["events"][-1]["seq"]:
                    record = apply(record, event.to_effect_event(), event.seq)
            assert record is not None
            assert (shown["status"], shown["attempt"]) == (record.status, record.attempt)
    finally:
        flipper.kill()
        flipper.wait()
