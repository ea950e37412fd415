"""Section 4 of the behaviour contract, the CLI: show, resolve, export, verify, rebuild, stats and the
demo, their flags, messages and exit codes.

Written against the behaviour contract alone: public names only, and only what the contract states."""

from __future__ import annotations

import csv
import datetime as dt
import getpass
import io
import json
import os
import re
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from guard import (
    is_refusal,
)
from guard.effect_guard import (
    reversibility,
)
from journal import SQLiteJournal
from tests.spec.support import (
    AIRLOCK,
    AT_RE,
    EVENT_FIELDS,
    JSON_COLUMNS,
    KINDS,
    PYTHON,
    alter_projection,
    assert_error_line,
    close,
    ctx,
    db_calls,
    db_events,
    event_hash,
    events_table,
    expected_key,
    export_lines,
    guard_for,
    make_pay,
    populate,
    projected_fields,
    raw,
    report_field,
    run_cli,
    sha,
    snapshot,
)

# --------------------------------------------------------------------------------------------------------------
# 4. the CLI


SUBCOMMANDS = ["show", "resolve", "export", "verify", "rebuild", "stats"]


@pytest.mark.parametrize("command", [["journal", c] for c in SUBCOMMANDS] + [["demo"]])
def test_every_help_has_an_example(command: list[str]) -> None:
    result = run_cli(*command, "--help")
    assert result.exit_code == 0
    assert "Example:" in result.output


@pytest.mark.parametrize(
    "args",
    [["show"], ["show", "some-id"], ["show", "--json"], ["export"], ["export", "--format", "csv"], ["verify"],
     ["stats"], ["stats", "--json"],
     ["resolve", "some-id", "--applied", "--reason", "r"], ["resolve", "some-id", "--not-applied", "--reason", "r"]],
)
def test_commands_on_missing_journal_error_and_create_nothing(tmp_path: Path, args: list[str]) -> None:
    path = tmp_path / "missing.db"
    result = run_cli("journal", args[0], "--db", str(path), *args[1:])
    assert_error_line(result)
    assert sorted(os.listdir(tmp_path)) == []


def test_missing_journal_via_env_and_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AIRLOCK_JOURNAL", raising=False)
    assert_error_line(run_cli("journal", "stats", env={"AIRLOCK_JOURNAL": str(tmp_path / "env.db")}))
    assert_error_line(run_cli("journal", "show", env={"AIRLOCK_JOURNAL": None}))
    assert os.listdir(tmp_path) == []


def test_console_script_error_line_on_stderr(tmp_path: Path) -> None:
    path = tmp_path / "missing.db"
    out = subprocess.run([AIRLOCK, "journal", "verify", "--db", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not path.exists()


def test_db_from_env_and_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRLOCK_JOURNAL", raising=False)
    env_db = tmp_path / "env.db"
    j = SQLiteJournal(str(env_db))
    populate(j)
    close(j)
    result = run_cli("journal", "stats", "--json", env={"AIRLOCK_JOURNAL": str(env_db)})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["events"] == len(db_events(env_db))

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    default = work / "airlock-journal.db"
    j = SQLiteJournal(str(default))
    close(j)
    result = run_cli("journal", "stats", "--json", env={"AIRLOCK_JOURNAL": None})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["events"] == 0
    # --db wins over the environment
    result = run_cli("journal", "stats", "--json", "--db", str(default), env={"AIRLOCK_JOURNAL": str(env_db)})
    assert json.loads(result.stdout)["events"] == 0


def test_show_list_json(journal: Any, db: Path) -> None:
    populate(journal)
    result = run_cli("journal", "show", "--db", str(db), "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert [r["call_id"] for r in rows] == ["c-flaky", "c-ship", "c-pay"]  # newest first
    required = {"call_id", "tool", "status", "attempt", "agent_id", "idempotency_key", "created_at", "updated_at"}
    for r in rows:
        assert required <= set(r)
    by = {r["call_id"]: r for r in rows}
    assert by["c-pay"]["status"] == "committed" and by["c-pay"]["tool"] == "pay"
    assert by["c-pay"]["idempotency_key"] == expected_key("pay", {"account": "acct-1", "cents": 500})
    assert by["c-ship"]["agent_id"] == "bob" and by["c-ship"]["attempt"] == 1

    def ids(*extra: str) -> list[str]:
        res = run_cli("journal", "show", "--db", str(db), "--json", *extra)
        assert res.exit_code == 0, res.output
        return [json.loads(line)["call_id"] for line in res.stdout.splitlines() if line.strip()]

    assert ids("--status", "unknown") == ["c-ship"]
    assert ids("--tool", "pay") == ["c-pay"]
    assert ids("--agent", "bob") == ["c-flaky", "c-ship"]
    assert ids("--limit", "1") == ["c-flaky"]
    assert ids("--since", "2000-01-01T00:00:00.000000Z") == ["c-flaky", "c-ship", "c-pay"]
    assert ids("--since", "2999-01-01T00:00:00.000000Z") == []


def test_show_table(journal: Any, db: Path) -> None:
    populate(journal)
    result = run_cli("journal", "show", "--db", str(db))
    assert result.exit_code == 0, result.output
    for cid in ("c-pay", "c-ship", "c-flaky"):
        assert cid in result.stdout


def test_show_limit_defaults_to_50(journal: Any, db: Path) -> None:
    airlock = guard_for(journal)
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    for i in range(53):
        with ctx(f"many-{i:02d}"):
            pay("a", i)
    result = run_cli("journal", "show", "--db", str(db), "--json")
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(rows) == 50
    assert rows[0]["call_id"] == "many-52"


def test_show_one_call_json(journal: Any, db: Path) -> None:
    populate(journal)
    result = run_cli("journal", "show", "c-pay", "--db", str(db), "--json")
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout)
    assert obj["call_id"] == "c-pay"
    assert obj["status"] == "committed"
    assert obj["tool"] == "pay"
    kinds = [e["kind"] for e in obj["events"]]
    assert sorted(kinds) == sorted(["pending", "committed", "replayed"])
    expected_seqs = {e["seq"] for e in db_events(db) if e["call_id"] == "c-pay"}
    assert {e["seq"] for e in obj["events"]} == expected_seqs
    for e in obj["events"]:
        assert {"seq", "kind", "at", "actor"} <= set(e)
        assert AT_RE.match(e["at"]), e["at"]
        assert e["actor"] == "guard"
    table = run_cli("journal", "show", "c-pay", "--db", str(db))
    assert table.exit_code == 0 and "c-pay" in table.stdout


def test_show_id_with_only_refusals_has_null_status(journal: Any, db: Path) -> None:
    populate(journal)
    result = run_cli("journal", "show", "c-forbidden", "--db", str(db), "--json")
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout)
    assert obj["status"] is None
    assert [e["kind"] for e in obj["events"]] == ["refused"]


def test_show_unknown_id_is_an_error(journal: Any, db: Path) -> None:
    populate(journal)
    assert_error_line(run_cli("journal", "show", "no-such-call", "--db", str(db)))
    assert_error_line(run_cli("journal", "show", "no-such-call", "--db", str(db), "--json"))


def test_stats_json(journal: Any, db: Path) -> None:
    populate(journal)
    result = run_cli("journal", "stats", "--db", str(db), "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    for key in ("calls", "events", "by_status", "by_tool", "oldest_pending_at", "oldest_unknown_at"):
        assert key in stats
    assert stats["calls"] == 3
    assert stats["events"] == len(db_events(db))
    by_status = {k: v for k, v in stats["by_status"].items() if v}
    assert by_status == {"committed": 1, "unknown": 1, "released": 1}
    by_tool = {k: v for k, v in stats["by_tool"].items() if v}
    assert by_tool == {"pay": 1, "ship": 1, "flaky": 1}
    assert stats["oldest_pending_at"] is None
    unknown_at = next(e["at"] for e in export_lines(db) if e["kind"] == "unknown")
    parse = lambda s: dt.datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    assert parse(stats["oldest_unknown_at"]) == parse(unknown_at)
    table = run_cli("journal", "stats", "--db", str(db))
    assert table.exit_code == 0
    assert "committed" in table.stdout and "pay" in table.stdout


def test_verify_cli_ok_prints_count_and_head(journal: Any, db: Path) -> None:
    populate(journal)
    events = db_events(db)
    result = run_cli("journal", "verify", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"OK: {len(events)} events, head {events[-1]['hash']}\n"


def test_rebuild_cli(journal: Any, db: Path) -> None:
    populate(journal)
    before = db_calls(db)
    result = run_cli("journal", "rebuild", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert db_calls(db) == before


def test_oldest_pending_at_is_when_the_call_entered_pending(journal: Any, db: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()
    calls: list[int] = []

    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError("slow")
        entered.set()
        gate.wait(120)
        return "ok"

    with ctx("op-1"), pytest.raises(TimeoutError):
        look("q")
    time.sleep(0.01)

    def second() -> None:
        with ctx("op-1"):
            look("q")

    t = threading.Thread(target=second)
    t.start()
    try:
        assert entered.wait(120)
        result = run_cli("journal", "stats", "--db", str(db), "--json")
        stats = json.loads(result.stdout)
        pendings = [e for e in export_lines(db) if e["kind"] == "pending"]
        assert len(pendings) == 2
        parse = lambda s: dt.datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
        assert parse(stats["oldest_pending_at"]) == parse(pendings[1]["at"])
        assert stats["oldest_unknown_at"] is None
        assert {k: v for k, v in stats["by_status"].items() if v} == {"pending": 1}
    finally:
        gate.set()
        t.join(120)


def test_stats_and_export_of_an_empty_journal(journal: Any, db: Path) -> None:
    result = run_cli("journal", "stats", "--db", str(db), "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["calls"] == 0 and stats["events"] == 0
    assert stats["oldest_pending_at"] is None and stats["oldest_unknown_at"] is None
    assert not any(stats["by_status"].values()) and not any(stats["by_tool"].values())
    assert export_lines(db) == []
    assert run_cli("journal", "verify", "--db", str(db)).exit_code == 0
    shown = run_cli("journal", "show", "--db", str(db), "--json")
    assert shown.exit_code == 0 and shown.stdout.strip() == ""


def test_cli_on_a_file_that_is_not_a_journal(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n" * 50)
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    for path in (text, empty):
        before = path.read_bytes()
        for args in (["stats"], ["show"], ["verify"], ["export"]):
            result = run_cli("journal", args[0], "--db", str(path), *args[1:])
            assert_error_line(result)
            assert path.read_bytes() == before


@pytest.mark.parametrize(
    "args",
    [["show", "--limit", "many"], ["show", "--since", "not-a-time"], ["export", "--format", "xml"],
     ["export", "--redact", "password"], ["export", "--since", "yesterday-ish"]],
)
def test_malformed_values_are_usage_errors(journal: Any, db: Path, args: list[str]) -> None:
    populate(journal)
    before = snapshot(db)
    result = run_cli("journal", args[0], "--db", str(db), *args[1:])
    assert result.exit_code == 2, result.output
    assert snapshot(db) == before


def test_verify_export_of_a_malformed_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.jsonl"
    path.write_text('{"seq": 1\nnot json at all\n')
    result = run_cli("journal", "verify", "--export", str(path))
    assert_error_line(result) if not re.search(r"\bseq \d+", result.output) else None
    assert result.exit_code == 1


def test_verify_export_allow_gaps_still_checks_consecutive_links(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    lines = export_lines(db, "--call", "c-pay")  # seqs 1, 2, 3: consecutive
    assert [e["seq"] for e in lines] == [1, 2, 3]
    lines[2]["prev_hash"] = "2" * 64
    lines[2]["hash"] = event_hash(lines[2]["prev_hash"], lines[2])
    path = tmp_path / "f.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    result = run_cli("journal", "verify", "--export", str(path), "--allow-gaps")
    assert result.exit_code == 1
    assert re.search(r"\bseq 3\b", result.output), result.output


def test_show_one_call_has_the_call_fields(journal: Any, db: Path) -> None:
    populate(journal)
    obj = json.loads(run_cli("journal", "show", "c-ship", "--db", str(db), "--json").stdout)
    for key in ("call_id", "tool", "status", "attempt", "agent_id", "idempotency_key", "created_at", "updated_at"):
        assert key in obj, key
    assert obj["status"] == "unknown" and obj["agent_id"] == "bob" and obj["attempt"] == 1
    table = run_cli("journal", "show", "c-forbidden", "--db", str(db))
    assert table.exit_code == 0 and "refused" in table.stdout


def test_group_help_examples() -> None:
    for args in (["--help"], ["journal", "--help"]):
        result = run_cli(*args)
        assert result.exit_code == 0
        assert "Example:" in result.output, args


def test_db_that_is_a_directory_is_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "dir"
    folder.mkdir()
    for args in (["stats"], ["show"], ["verify"], ["export"]):
        assert_error_line(run_cli("journal", args[0], "--db", str(folder), *args[1:]))
    assert os.listdir(folder) == []


def test_reader_commands_do_not_wait_for_a_writer(journal: Any, db: Path) -> None:
    populate(journal)
    conn = raw(db)
    try:
        conn.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        for args in (["stats", "--json"], ["show", "--json"], ["verify"], ["export"]):
            result = run_cli("journal", args[0], "--db", str(db), *args[1:])
            assert result.exit_code == 0, (args, result.output)
        assert time.monotonic() - started < 10
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def test_verify_export_rejects_duplicate_reordered_and_forged_genesis(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    full = export_lines(db)

    def check(lines: list[dict[str, Any]], *flags: str) -> int:
        path = tmp_path / "x.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in lines))
        return run_cli("journal", "verify", "--export", str(path), *flags).exit_code

    assert check(full) == 0
    assert check([*full[:3], full[2], *full[3:]]) == 1
    assert check([*full[:3], full[2], *full[3:]], "--allow-gaps") == 1
    swapped = list(full)
    swapped[2], swapped[3] = swapped[3], swapped[2]
    assert check(swapped) == 1
    assert check(swapped, "--allow-gaps") == 1
    genesis = [dict(e) for e in full]
    genesis[0]["prev_hash"] = "1" * 64
    genesis[0]["hash"] = event_hash(genesis[0]["prev_hash"], genesis[0])
    genesis[1]["prev_hash"] = genesis[0]["hash"]
    rest_prev = genesis[0]["hash"]
    for e in genesis[1:]:
        e["prev_hash"] = rest_prev
        e["hash"] = event_hash(rest_prev, e)
        rest_prev = e["hash"]
    assert check(genesis) == 1


def test_oldest_unknown_at_is_when_the_call_last_entered_unknown(journal: Any, db: Path) -> None:
    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        raise TimeoutError("slow")

    with ctx("ou-1"), pytest.raises(TimeoutError):
        look("q")
    time.sleep(0.01)
    with ctx("ou-1"), pytest.raises(TimeoutError):
        look("q")
    stats = json.loads(run_cli("journal", "stats", "--db", str(db), "--json").stdout)
    unknowns = [e for e in export_lines(db) if e["kind"] == "unknown"]
    parse = lambda s: dt.datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    assert parse(stats["oldest_unknown_at"]) == parse(unknowns[-1]["at"])


def test_show_table_shows_event_times_as_iso(journal: Any, db: Path) -> None:
    populate(journal)
    table = run_cli("journal", "show", "c-pay", "--db", str(db))
    assert table.exit_code == 0
    for e in export_lines(db, "--call", "c-pay"):
        assert e["at"] in table.stdout


def test_read_only_commands_never_migrate_an_older_journal(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    conn = sqlite3.connect(str(db))
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    conn.execute(f"PRAGMA user_version = {version - 1}")
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    before = db.read_bytes()
    for args in (["stats", "--json"], ["show", "--json"], ["show", "c-pay"], ["verify"], ["export"]):
        result = run_cli("journal", args[0], "--db", str(db), *args[1:])
        assert result.exit_code in (0, 1), result.output
        assert "Traceback" not in result.output
    conn = sqlite3.connect(str(db))
    assert conn.execute("PRAGMA user_version").fetchone()[0] == version - 1
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    assert db.read_bytes() == before


@pytest.mark.parametrize("args", [["show", "--json"], ["show", "c-pay", "--json"]])
def test_show_json_of_an_altered_projection_is_one_error_line(journal: Any, db: Path, args: list[str]) -> None:
    alter_projection(journal, db)
    out = subprocess.run([AIRLOCK, "journal", args[0], "--db", str(db), *args[1:]], capture_output=True, text=True,
                         timeout=60)
    assert "Traceback" not in out.stderr
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr


# ----- export


def test_export_jsonl_fields(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    out = tmp_path / "audit.jsonl"
    result = run_cli("journal", "export", "--db", str(db), "--output", str(out))
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    events = db_events(db)
    assert len(lines) == len(events)
    assert lines == export_lines(db, "--format", "jsonl")
    for line, ev in zip(lines, events, strict=False):
        for name in [*EVENT_FIELDS, "arguments_sha256", "value_sha256"]:
            assert name in line, name
        assert AT_RE.match(line["at"]), line["at"]
        for name in ("seq", "call_id", "kind", "tool", "agent_id", "idempotency_key", "actor", "attempt",
                     "prev_hash", "hash"):
            assert line[name] == ev[name], name
        for name in JSON_COLUMNS:
            assert line[name] == ev[name], name
            assert not isinstance(line[name], str), name
        assert line["arguments_sha256"] == (sha(line["arguments"]) if line["arguments"] is not None else None)
        if line["kind"] == "committed" and line["value"] is not None:
            assert line["value_sha256"] == sha(line["value"])
        if line["value"] is None and line["kind"] != "committed":
            assert line["value_sha256"] is None
        assert not line.get("redacted")


def test_export_redaction_still_verifies(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    full = export_lines(db)
    out = tmp_path / "redacted.jsonl"
    result = run_cli("journal", "export", "--db", str(db), "--redact", "arguments,value", "--output", str(out))
    assert result.exit_code == 0, result.output
    red = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert len(red) == len(full)
    for r, f in zip(red, full, strict=False):
        assert r["arguments"] is None and r["value"] is None
        assert set(r["redacted"]) <= {"arguments", "value"}
        if f["arguments"] is not None:
            assert "arguments" in r["redacted"]
        if f["value"] is not None:
            assert "value" in r["redacted"]
        assert r["arguments_sha256"] == f["arguments_sha256"]
        assert r["value_sha256"] == f["value_sha256"]
        assert r["hash"] == f["hash"]
        assert r["hash"] == event_hash(r["prev_hash"], r)
    check = run_cli("journal", "verify", "--export", str(out))
    assert check.exit_code == 0, check.output

    only_args = export_lines(db, "--redact", "arguments")
    assert len(only_args) == len(full)
    for r, f in zip(only_args, full, strict=True):
        assert r["arguments"] is None and r["value"] == f["value"]


def test_export_csv(journal: Any, db: Path) -> None:
    populate(journal)
    full = export_lines(db)
    result = run_cli("journal", "export", "--db", str(db), "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert len(rows) == len(full)
    for name in [*EVENT_FIELDS, "arguments_sha256", "value_sha256"]:
        assert name in rows[0], name
    for row, line in zip(rows, full, strict=False):
        assert int(row["seq"]) == line["seq"]
        assert row["hash"] == line["hash"]
        assert row["kind"] == line["kind"]
        for name in JSON_COLUMNS:
            if line[name] is not None:
                assert json.loads(row[name]) == line[name], name


def test_export_filters(journal: Any, db: Path) -> None:
    populate(journal)
    full = export_lines(db)
    by_call = [e["seq"] for e in full if e["call_id"] == "c-pay"]
    assert [e["seq"] for e in export_lines(db, "--call", "c-pay")] == by_call
    assert [e["seq"] for e in export_lines(db, "--tool", "ship")] == [e["seq"] for e in full if e["tool"] == "ship"]
    assert [e["seq"] for e in export_lines(db, "--agent", "bob")] == [e["seq"] for e in full if e["agent_id"] == "bob"]
    mid = full[len(full) // 2]["at"]
    since = export_lines(db, "--since", mid)
    assert all(e["at"] >= mid for e in since)
    assert {e["seq"] for e in full if e["at"] > mid} <= {e["seq"] for e in since}
    until = export_lines(db, "--until", mid)
    assert all(e["at"] <= mid for e in until)
    assert {e["seq"] for e in full if e["at"] < mid} <= {e["seq"] for e in until}


def test_verify_export_gaps_need_allow_gaps(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    out = tmp_path / "pay.jsonl"
    result = run_cli("journal", "export", "--db", str(db), "--tool", "ship", "--output", str(out))
    assert result.exit_code == 0
    seqs = [json.loads(line)["seq"] for line in out.read_text().splitlines() if line.strip()]
    assert seqs and seqs[0] > 1
    no = run_cli("journal", "verify", "--export", str(out))
    assert no.exit_code == 1, no.output
    yes = run_cli("journal", "verify", "--export", str(out), "--allow-gaps")
    assert yes.exit_code == 0, yes.output


def test_verify_export_finds_tampering(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    full = export_lines(db)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(line) + "\n" for line in full))
    ok = run_cli("journal", "verify", "--export", str(good))
    assert ok.exit_code == 0, ok.output
    # an altered field
    altered = [dict(line) for line in full]
    altered[2]["tool"] = "forged"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(line) + "\n" for line in altered))
    result = run_cli("journal", "verify", "--export", str(bad))
    assert result.exit_code == 1
    assert re.search(rf"\bseq {full[2]['seq']}\b", result.output), result.output
    # a broken link: an event removed from the middle is a gap without --allow-gaps
    gap = tmp_path / "gap.jsonl"
    gap.write_text("".join(json.dumps(line) + "\n" for i, line in enumerate(full) if i != 3))
    assert run_cli("journal", "verify", "--export", str(gap)).exit_code == 1


def test_verify_export_relinks_consecutive_only(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    full = export_lines(db)
    # a forged, self-consistent event whose prev_hash does not match its predecessor
    forged = [dict(line) for line in full]
    forged[4]["prev_hash"] = "1" * 64
    forged[4]["hash"] = event_hash(forged[4]["prev_hash"], forged[4])
    path = tmp_path / "forged.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in forged))
    result = run_cli("journal", "verify", "--export", str(path))
    assert result.exit_code == 1
    assert re.search(rf"\bseq {full[4]['seq']}\b", result.output), result.output


SIZED_EXPORT_SCRIPT = r"""
import sys, tracemalloc
tracemalloc.start()
from cli.main import main
try:
    main(["journal", "export", "--db", sys.argv[1], "--output", sys.argv[2]])
except SystemExit as e:
    assert e.code in (0, None), e.code
print(tracemalloc.get_traced_memory()[1])
"""


def _grow(path: Path, n: int, size: int) -> None:
    j = SQLiteJournal(str(path), durability="process")
    pay = make_pay(guard_for(j), [])
    with ctx("seed"):
        pay("a")
    close(j)
    conn = raw(path)
    try:
        t = events_table(conn)
        row = dict(conn.execute(f'SELECT * FROM "{t}" WHERE seq = 1').fetchone())
        cols = list(row)
        blob = json.dumps({"blob": "x" * size})
        conn.execute("BEGIN")
        for i in range(3, n + 3):
            row.update(seq=i, arguments=blob, call_id=f"b{i}", hash=f"{i:064x}")
            conn.execute(f'INSERT INTO "{t}" ({",".join(cols)}) VALUES ({",".join("?" * len(cols))})',
                         [row[c] for c in cols])
        conn.execute("COMMIT")
    finally:
        conn.close()


def test_export_streams_in_bounded_memory(tmp_path: Path) -> None:
    peaks = []
    for n in (1500, 9000):
        path = tmp_path / f"{n}.db"
        _grow(path, n, 2000)
        out = subprocess.run([PYTHON, "-c", SIZED_EXPORT_SCRIPT, str(path), str(tmp_path / f"{n}.jsonl")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert len((tmp_path / f"{n}.jsonl").read_text().splitlines()) == n + 2
        peaks.append(int(out.stdout.strip().splitlines()[-1]))
    # six times the log, not six times the memory
    assert peaks[1] < peaks[0] * 1.5 + 4_000_000, peaks


def _big_journal(path: Path) -> None:
    j = SQLiteJournal(str(path), durability="process")
    try:
        pay = make_pay(guard_for(j), [])
        for i in range(200):
            with ctx(f"big-{i}"):
                pay("a" * 200, i)
    finally:
        close(j)


def _limited_file_size() -> None:  # runs in the child before exec
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_export_write_failure_to_a_file_is_one_error_line(tmp_path: Path, fmt: str) -> None:
    db = tmp_path / "big.db"
    _big_journal(db)
    out = subprocess.run([AIRLOCK, "journal", "export", "--db", str(db), "--format", fmt,
                          "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=60,
                         preexec_fn=_limited_file_size)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_export_write_failure_to_stdout_is_an_error(tmp_path: Path, fmt: str) -> None:
    db = tmp_path / "big.db"
    _big_journal(db)
    target = tmp_path / "stdout.txt"
    with target.open("wb") as sink:
        out = subprocess.run([AIRLOCK, "journal", "export", "--db", str(db), "--format", fmt], stdout=sink,
                             stderr=subprocess.PIPE, text=True, timeout=60, preexec_fn=_limited_file_size)
    assert target.stat().st_size <= 100_000  # the write did fail part way
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().startswith("Error: ")


def test_csv_scalar_fields_match_the_jsonl_export(journal: Any, db: Path) -> None:
    populate(journal)
    full = export_lines(db)
    rows = list(csv.DictReader(io.StringIO(run_cli("journal", "export", "--db", str(db), "--format", "csv").stdout)))
    assert len(rows) == len(full) > 0
    for row, line in zip(rows, full, strict=True):
        for name in ("seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "actor", "attempt",
                     "prev_hash", "hash", "arguments_sha256", "value_sha256"):
            assert row[name] == ("" if line[name] is None else str(line[name])), name


# ----- resolve


def _unknown_call(journal: Any) -> tuple[Any, list[Any]]:
    runs: list[Any] = []
    airlock = guard_for(journal)

    @airlock
    def charge(account: str) -> str:
        runs.append(account)
        if len(runs) == 1:
            raise TimeoutError("lost")
        return "charged again"

    with ctx("rs-1"), pytest.raises(TimeoutError):
        charge("acct")
    return charge, runs


def test_resolve_applied_with_value(journal: Any, db: Path) -> None:
    charge, runs = _unknown_call(journal)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), "--applied", "--value", '{"receipt": "r-9"}',
                     "--reason", "backend says it went through", "--operator", "dana")
    assert result.exit_code == 0, result.output
    last = db_events(db)[-1]
    assert last["kind"] == "committed"
    assert last["actor"] == "operator:dana"
    assert last["reason"] == {"code": "applied", "message": "backend says it went through"}
    assert last["value"] == {"receipt": "r-9"}
    assert db_calls(db)["rs-1"]["status"] == "committed"
    with ctx("rs-1"):
        assert charge("acct") == {"receipt": "r-9"}
    assert runs == ["acct"]
    assert db_events(db)[-1]["kind"] == "replayed"


def test_resolve_applied_without_value_default_operator(journal: Any, db: Path) -> None:
    charge, runs = _unknown_call(journal)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), "--applied", "--reason", "seen in ledger")
    assert result.exit_code == 0, result.output
    last = db_events(db)[-1]
    assert last["kind"] == "committed"
    try:
        user = getpass.getuser()
    except Exception:
        user = f"uid:{os.getuid()}"
    assert last["actor"] == f"operator:{user}"
    for _ in range(2):
        with ctx("rs-1"):
            result = charge("acct")
        assert is_refusal(result) and result["block_reason"] == "replay_value_unavailable"
    assert runs == ["acct"]


def test_resolve_not_applied_lets_the_call_run_again(journal: Any, db: Path) -> None:
    charge, runs = _unknown_call(journal)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), "--not-applied", "--reason", "never arrived",
                     "--operator", "dana")
    assert result.exit_code == 0, result.output
    last = db_events(db)[-1]
    assert last["kind"] == "released"
    assert last["actor"] == "operator:dana"
    assert last["reason"] == {"code": "not_applied", "message": "never arrived"}
    assert db_calls(db)["rs-1"]["status"] == "released"
    with ctx("rs-1"):
        assert charge("acct") == "charged again"
    assert runs == ["acct", "acct"]
    assert db_calls(db)["rs-1"]["attempt"] == 2
    assert db_calls(db)["rs-1"]["status"] == "committed"


@pytest.mark.parametrize(
    "flags",
    [
        ["--applied", "--not-applied", "--reason", "r"],
        ["--reason", "r"],
        ["--not-applied", "--value", "1", "--reason", "r"],
        ["--applied", "--value", "{not json", "--reason", "r"],
        ["--applied"],
        ["--applied", "--value", "", "--reason", "r"],
    ],
    ids=["both", "neither", "value-with-not-applied", "bad-json", "no-reason", "empty-value"],
)
def test_resolve_usage_errors_exit_2_and_change_nothing(journal: Any, db: Path, flags: list[str]) -> None:
    _unknown_call(journal)
    before = snapshot(db)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), *flags)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert snapshot(db) == before


def test_resolve_errors_exit_1_and_change_nothing(journal: Any, db: Path) -> None:
    populate(journal)
    before = snapshot(db)
    for cid in ("c-pay", "c-flaky", "c-forbidden", "no-such-call"):
        for flag in ("--applied", "--not-applied"):
            result = run_cli("journal", "resolve", cid, "--db", str(db), flag, "--reason", "r")
            assert_error_line(result)
            assert snapshot(db) == before


def test_resolve_pending_of_live_owner_needs_force(journal: Any, db: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()

    @guard_for(journal)
    def charge(account: str) -> str:
        entered.set()
        gate.wait(120)
        return "late"

    results: list[Any] = []

    def run() -> None:
        with ctx("pf-1"):
            results.append(charge("a"))

    t = threading.Thread(target=run)
    t.start()
    try:
        assert entered.wait(120)
        assert db_calls(db)["pf-1"]["status"] == "pending"
        before = snapshot(db)
        result = run_cli("journal", "resolve", "pf-1", "--db", str(db), "--not-applied", "--reason", "r")
        assert_error_line(result)
        assert snapshot(db) == before
        result = run_cli("journal", "resolve", "pf-1", "--db", str(db), "--not-applied", "--reason", "r", "--force")
        assert result.exit_code == 0, result.output
        assert db_calls(db)["pf-1"]["status"] == "released"
    finally:
        gate.set()
        t.join(120)
    assert results == ["late"]
    # the late outcome is still appended, with the attempt that produced it
    tail = [e for e in db_events(db) if e["call_id"] == "pf-1"]
    assert tail[-1]["kind"] == "committed" and tail[-1]["attempt"] == 1 and tail[-1]["actor"] == "guard"
    # and the projection still equals the fold of the log
    assert report_field(journal.verify(), "ok") is True
    before = projected_fields(db_calls(db))
    journal.rebuild()
    assert projected_fields(db_calls(db)) == before


DEAD_OWNER_SCRIPT = r"""
import os, sys
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
j = SQLiteJournal(sys.argv[1])
@Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=j)))
def charge(account):
    os._exit(0)
with AirlockContext(metadata={"tool_call_id": "dead-1"}):
    charge("a")
"""


def test_resolve_pending_of_dead_owner_without_force(db: Path) -> None:
    subprocess.run([PYTHON, "-c", DEAD_OWNER_SCRIPT, str(db)], check=True, timeout=60)
    assert db_calls(db)["dead-1"]["status"] == "pending"
    result = run_cli("journal", "resolve", "dead-1", "--db", str(db), "--not-applied", "--reason", "crashed")
    assert result.exit_code == 0, result.output
    assert db_calls(db)["dead-1"]["status"] == "released"


def test_read_only_commands_change_nothing(journal: Any, db: Path) -> None:
    populate(journal)
    before = snapshot(db)
    for args in (["show"], ["show", "--json"], ["show", "c-pay"], ["export"], ["verify"], ["stats", "--json"]):
        result = run_cli("journal", args[0], "--db", str(db), *args[1:])
        assert result.exit_code == 0, (args, result.output)
    assert snapshot(db) == before


def test_demo(tmp_path: Path) -> None:
    path = tmp_path / "demo.db"
    result = run_cli("demo", "--db", str(path))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    events = db_events(path)
    assert events
    assert {e["kind"] for e in events} <= KINDS
    assert any(e["call_id"] and e["call_id"] in result.stdout for e in events)
    assert run_cli("journal", "verify", "--db", str(path)).exit_code == 0


def test_resolve_value_json_array_and_force_on_applied(journal: Any, db: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()

    @guard_for(journal)
    def charge(account: str) -> str:
        entered.set()
        gate.wait(120)
        return "late"

    t = threading.Thread(target=lambda: (ctx("fa-1").__enter__(), charge("a")))
    t.start()
    try:
        assert entered.wait(120)
        before = snapshot(db)
        no = run_cli("journal", "resolve", "fa-1", "--db", str(db), "--applied", "--value", "[1, 2]",
                     "--reason", "r")
        assert_error_line(no)
        assert snapshot(db) == before
        yes = run_cli("journal", "resolve", "fa-1", "--db", str(db), "--applied", "--value", "[1, 2]",
                      "--reason", "r", "--force", "--operator", "eve")
        assert yes.exit_code == 0, yes.output
    finally:
        gate.set()
        t.join(120)
    committed = [e for e in db_events(db) if e["kind"] == "committed"]
    assert committed[0]["actor"] == "operator:eve" and committed[0]["value"] == [1, 2]
    # the tool's own late outcome is appended too, with its attempt; the log tells what happened
    assert committed[-1]["actor"] == "guard" and committed[-1]["attempt"] == 1 and committed[-1]["value"] == "late"
    assert report_field(journal.verify(), "ok") is True


def test_resolve_without_call_id_is_a_usage_error(journal: Any, db: Path) -> None:
    populate(journal)
    before = snapshot(db)
    result = run_cli("journal", "resolve", "--db", str(db), "--applied", "--reason", "r")
    assert result.exit_code == 2
    assert snapshot(db) == before


def test_default_operator_is_read_at_run_time(journal: Any, db: Path) -> None:
    _unknown_call(journal)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), "--not-applied", "--reason", "r",
                     env={"LOGNAME": "zed", "USER": "zed", "LNAME": "zed", "USERNAME": "zed"})
    assert result.exit_code == 0, result.output
    assert db_events(db)[-1]["actor"] == "operator:zed"


def test_resolve_value_is_returned_exactly_or_refused(journal: Any, db: Path) -> None:
    charge, _runs = _unknown_call(journal)
    before = snapshot(db)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), "--applied", "--value", "18446744073709551617",
                     "--reason", "ledger")
    if result.exit_code == 2:
        assert snapshot(db) == before
        return
    assert result.exit_code == 0
    with ctx("rs-1"):
        replay = charge("acct")
    assert type(replay) is int and replay == 18446744073709551617
