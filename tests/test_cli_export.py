"""``airlock journal export`` and ``verify --export``: the audit trail as JSON Lines or CSV, checked offline."""

from __future__ import annotations

import csv
import io
import itertools
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from journal import SQLiteJournal
from journal.export import CSV_COLUMNS
from tests.cli_support import AIRLOCK, Tools, count_events, digest, invoke, rows, run_airlock, run_on_terminal, seed
from tests.journals import JournalFactory

SECTION_3_FIELDS = {
    "seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "arguments", "value", "error",
    "reason", "actor", "attempt", "owner", "prev_hash", "hash",
}


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "journal.db"
    seed(path)
    return path


def exported(db: Path, *args: str) -> list[dict[str, Any]]:
    result = invoke("journal", "export", "--db", str(db), *args)
    assert result.exit_code == 0, result.output
    return [orjson.loads(line) for line in result.stdout.splitlines()]


def test_jsonl_has_every_event_with_every_field(db: Path) -> None:
    lines = exported(db)
    assert [line["seq"] for line in lines] == list(range(1, count_events(db) + 1))
    for line in lines:
        assert SECTION_3_FIELDS | {"arguments_sha256", "value_sha256", "redacted"} <= set(line)
        assert line["redacted"] == []
    committed = next(line for line in lines if line["kind"] == "committed")
    assert committed["arguments"] == {"account": "acct_1", "cents": 500}
    assert committed["value"] == {"charge_id": "ch_1", "cents": 500}
    assert isinstance(committed["owner"], dict) and committed["at"].endswith("Z")
    unknown = next(line for line in lines if line["kind"] == "unknown")
    assert unknown["error"] == {"type": "TimeoutError", "message": "backend did not answer"}
    refused = [line for line in lines if line["kind"] == "refused"]
    assert {line["reason"]["code"] for line in refused} == {"effect_status_unknown", "policy_violation"}
    assert lines[0]["prev_hash"] == "0" * 64
    assert all(b["prev_hash"] == a["hash"] for a, b in itertools.pairwise(lines))


def test_redacted_fields_are_null_and_named_but_keep_their_digests(db: Path) -> None:
    plain = exported(db)
    redacted = exported(db, "--redact", "arguments,value")
    assert len(plain) == len(redacted)
    for a, b in zip(plain, redacted, strict=True):
        assert b["arguments"] is None and b["value"] is None
        assert b["redacted"] == ["arguments", "value"]
        assert (b["arguments_sha256"], b["value_sha256"]) == (a["arguments_sha256"], a["value_sha256"])
        assert b["hash"] == a["hash"]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_repeated_redact_flag_redacts_every_field_it_names(db: Path, fmt: str) -> None:
    once = invoke("journal", "export", "--db", str(db), "--format", fmt, "--redact", "arguments,value")
    repeated = invoke("journal", "export", "--db", str(db), "--format", fmt, "--redact", "arguments",
                      "--redact", "value")
    assert once.exit_code == repeated.exit_code == 0
    assert repeated.stdout == once.stdout
    if fmt == "jsonl":
        assert all(line["arguments"] is None for line in map(orjson.loads, repeated.stdout.splitlines()))


@pytest.mark.parametrize("value", ["secrets", "arguments,owner", ""])
def test_redacting_an_unknown_field_is_a_usage_error(db: Path, value: str) -> None:
    result = invoke("journal", "export", "--db", str(db), "--redact", value)
    assert result.exit_code == 2
    assert "Invalid value for '--redact'" in result.stderr
    assert result.stdout == ""


def test_filters(db: Path) -> None:
    assert {line["call_id"] for line in exported(db, "--call", "call-ok")} == {"call-ok"}
    assert len(exported(db, "--call", "call-ok")) == 3
    assert {line["tool"] for line in exported(db, "--tool", "read_balance")} == {"read_balance"}
    assert {line["agent_id"] for line in exported(db, "--agent", "agent-2")} == {"agent-2"}
    assert len(exported(db, "--since", "1h")) == count_events(db)
    assert exported(db, "--until", "1h") == []
    tomorrow = (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%d")
    assert len(exported(db, "--until", tomorrow)) == count_events(db)
    bad = invoke("journal", "export", "--db", str(db), "--since", "last week")
    assert bad.exit_code == 2 and "'last week' is not a time" in bad.stderr


def test_csv_has_a_header_and_the_same_fields_as_text(db: Path) -> None:
    result = invoke("journal", "export", "--format", "csv", "--db", str(db))
    assert result.exit_code == 0
    table = list(csv.reader(io.StringIO(result.stdout)))
    assert tuple(table[0]) == CSV_COLUMNS
    assert SECTION_3_FIELDS | {"arguments_sha256", "value_sha256", "redacted"} == set(CSV_COLUMNS)
    records = [dict(zip(table[0], row, strict=True)) for row in table[1:]]
    assert len(records) == count_events(db)
    jsonl = exported(db)
    for record, line in zip(records, jsonl, strict=True):
        assert int(record["seq"]) == line["seq"] and record["hash"] == line["hash"]
        for name in ("arguments", "value", "error", "reason", "owner"):
            assert record[name] == ("" if line[name] is None else orjson.dumps(line[name]).decode())
        assert orjson.loads(record["redacted"]) == []


def test_output_file_and_stdout_are_the_same(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "audit.jsonl"
    result = invoke("journal", "export", "--db", str(db), "--output", str(out))
    assert result.exit_code == 0
    assert result.stdout == ""
    assert result.stderr == f"Exported {count_events(db)} events to {out}\n"
    assert out.read_text() == invoke("journal", "export", "--db", str(db)).stdout
    assert not list(tmp_path.glob("*.partial"))


def test_an_output_file_that_cannot_be_written_is_an_error(db: Path, tmp_path: Path) -> None:
    result = invoke("journal", "export", "--db", str(db), "--output", str(tmp_path / "no-such-dir" / "a.jsonl"))
    assert result.exit_code in (1, 2)
    assert "Error:" in result.stderr and "Traceback" not in result.output


def test_export_never_changes_the_journal(db: Path) -> None:
    before = digest(db)
    exported(db)
    invoke("journal", "export", "--format", "csv", "--db", str(db))
    assert digest(db) == before


def test_export_of_a_missing_journal_is_an_error_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    result = invoke("journal", "export", "--db", str(missing))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: There is no journal at {missing}.")
    assert list(tmp_path.iterdir()) == []


# -- verify --export ----------------------------------------------------------------------------


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def test_an_export_verifies_offline_redacted_or_not(db: Path, tmp_path: Path) -> None:
    head = rows(db, "SELECT hash FROM events ORDER BY seq DESC LIMIT 1")[0][0]
    for args in ([], ["--redact", "arguments,value"]):
        out = tmp_path / "audit.jsonl"
        assert invoke("journal", "export", "--db", str(db), "-o", str(out), *args).exit_code == 0
        result = invoke("journal", "verify", "--export", str(out))
        assert result.exit_code == 0, result.output
        assert result.stdout == f"OK: {count_events(db)} events, head {head}\n"


def test_a_changed_line_fails_with_its_seq(db: Path, tmp_path: Path) -> None:
    lines = exported(db)
    lines[3]["attempt"] = 7
    result = invoke("journal", "verify", "--export", str(write_lines(tmp_path / "a.jsonl", lines)))
    assert result.exit_code == 1
    assert (result.stderr.startswith("Error: ") and " does not verify at seq 4: " in result.stderr)
    lines = exported(db)
    lines[1]["value"] = {"charge_id": "ch_999", "cents": 500}
    result = invoke("journal", "verify", "--export", str(write_lines(tmp_path / "b.jsonl", lines)))
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and " does not verify at seq 2: " in result.stderr
    assert "its value does not match value_sha256" in result.stderr
    lines = exported(db)
    lines[1]["arguments"] = {"account": "acct_9", "cents": 500}
    result = invoke("journal", "verify", "--export", str(write_lines(tmp_path / "c.jsonl", lines)))
    assert result.exit_code == 1 and "its arguments do not match arguments_sha256" in result.stderr


def test_a_gap_fails_unless_allowed(db: Path, tmp_path: Path) -> None:
    lines = exported(db)
    del lines[2]
    path = write_lines(tmp_path / "gap.jsonl", lines)
    result = invoke("journal", "verify", "--export", str(path))
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and " does not verify at seq 4: " in result.stderr
    assert "seq 4 follows seq 2: events are missing" in result.stderr and "add --allow-gaps" in result.stderr
    allowed = invoke("journal", "verify", "--export", str(path), "--allow-gaps")
    assert allowed.exit_code == 0 and allowed.stdout.startswith(f"OK: {len(lines)} events")


def test_a_filtered_export_verifies_with_allow_gaps(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "one.jsonl"
    assert invoke("journal", "export", "--db", str(db), "--call", "call-timeout", "-o", str(out)).exit_code == 0
    assert invoke("journal", "verify", "--export", str(out), "--allow-gaps").exit_code == 0
    refused = invoke("journal", "verify", "--export", str(out))
    first = orjson.loads(out.read_bytes().splitlines()[0])["seq"]
    assert first > 1 and refused.exit_code == 1
    # What went wrong, and what to do: no "seq 0", which no export has.
    assert f"the first event is seq {first}, not seq 1: events are missing" in refused.stderr
    assert "filtered by --call" in refused.stderr and "add --allow-gaps" in refused.stderr
    assert "seq 0" not in refused.stderr


def test_a_file_that_is_not_jsonl_is_an_error_with_its_line(db: Path, tmp_path: Path) -> None:
    good = exported(db)
    path = tmp_path / "broken.jsonl"
    path.write_bytes(orjson.dumps(good[0]) + b"\n" + b"this is not json\n")
    result = invoke("journal", "verify", "--export", str(path))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {path} is not a JSON Lines export: line 2 is not JSON")
    csv_file = tmp_path / "audit.csv"
    csv_file.write_text(invoke("journal", "export", "--format", "csv", "--db", str(db)).stdout)
    result = invoke("journal", "verify", "--export", str(csv_file))
    assert result.exit_code == 1 and "line 1 is not JSON" in result.stderr
    path.write_text("[1, 2]\n")
    result = invoke("journal", "verify", "--export", str(path))
    assert result.exit_code == 1 and "line 1 is not a JSON object" in result.stderr


def test_allow_gaps_without_export_is_a_usage_error(db: Path) -> None:
    result = invoke("journal", "verify", "--allow-gaps", "--db", str(db))
    assert result.exit_code == 2 and "--allow-gaps goes with --export FILE" in result.stderr


def test_verify_export_of_a_missing_file_or_a_directory_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    result = invoke("journal", "verify", "--export", str(missing))
    assert result.exit_code == 1
    assert result.stderr == f"Error: cannot read {missing}: No such file or directory\n"
    result = invoke("journal", "verify", "--export", str(tmp_path))
    assert result.exit_code == 1
    assert result.stderr == f"Error: cannot read {tmp_path}: Is a directory\n"
    assert list(tmp_path.iterdir()) == []


def test_a_progress_bar_only_when_stderr_is_a_terminal_and_the_export_goes_to_a_file(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "audit.jsonl"
    code, seen, stdout = run_on_terminal("journal", "export", "--db", str(db), "-o", str(out), stream="stderr")
    assert code == 0 and stdout == ""
    assert "Exporting" in seen and "100%" in seen
    assert len(out.read_text().splitlines()) == count_events(db)
    code, seen, stdout = run_on_terminal("journal", "export", "--db", str(db), stream="stderr")
    assert code == 0 and "Exporting" not in seen
    assert len(stdout.splitlines()) == count_events(db)
    piped = run_airlock("journal", "export", "--db", str(db), "-o", str(out))
    assert piped.returncode == 0 and piped.stderr == f"Exported {count_events(db)} events to {out}\n"


def test_an_export_with_a_value_that_is_json_null_verifies(tmp_path: Path) -> None:
    # A tool that returned None stored the value null: its digest is sha256("null"), not a missing one.
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard

    path, out = tmp_path / "j.db", tmp_path / "e.jsonl"
    with SQLiteJournal(path, durability="process") as journal:
        @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
        def notify(user: str) -> None:
            return None

        for _ in range(2):  # the call, then its replay
            with AirlockContext(metadata={"tool_call_id": "n1"}):
                assert notify("u1") is None
    assert invoke("journal", "export", "--db", str(path), "-o", str(out)).exit_code == 0
    lines = [orjson.loads(line) for line in out.read_text().splitlines()]
    assert [(line["kind"], line["value"], line["value_sha256"] is not None) for line in lines] == [
        ("pending", None, False), ("committed", None, True), ("replayed", None, False)]
    result = invoke("journal", "verify", "--export", str(out))
    assert result.exit_code == 0, result.output
    lines[1]["value"] = 0  # the digest of null cannot stand for another value
    out.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    result = invoke("journal", "verify", "--export", str(out))
    assert result.exit_code == 1 and "seq 2" in result.stderr


def test_every_json_line_is_one_line_to_splitlines(tmp_path: Path, journal_kind: JournalFactory) -> None:
    # NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR may stand raw in JSON, but str.splitlines() breaks at them.
    odd = "acct\x85one\u2028two\u2029three"
    db = journal_kind.target(tmp_path, own_database=True)
    with journal_kind.open(db) as journal:
        tools = Tools(journal)
        tools.call("call-odd", tools.charge, account=odd, cents=5)
        tools.call("call-odd", tools.charge, account=odd, cents=5)
    outputs = {
        "export": invoke("journal", "export", "--db", db),
        "show": invoke("journal", "show", "--json", "--db", db),
        "show one": invoke("journal", "show", "call-odd", "--json", "--db", db),
    }
    for name, result in outputs.items():
        assert result.exit_code == 0, (name, result.output)
        lines = result.stdout.splitlines()
        assert len(lines) == result.stdout.count("\n"), name
        assert "\\u2028" in result.stdout and "\u2028" not in result.stdout, name
    events = [orjson.loads(line) for line in outputs["export"].stdout.splitlines()]
    assert [e["kind"] for e in events] == ["pending", "committed", "replayed"]
    assert events[0]["arguments"] == {"account": odd, "cents": 5}  # the same value, only written escaped
    [call] = [orjson.loads(line) for line in outputs["show"].stdout.splitlines()]
    assert call["arguments"]["account"] == odd
    exported_file = tmp_path / "odd.jsonl"
    exported_file.write_text(outputs["export"].stdout)
    verified = invoke("journal", "verify", "--export", str(exported_file))
    assert verified.exit_code == 0, verified.output  # the digests are of the values, unchanged


def test_dash_is_stdout_for_export_and_stdin_for_verify(db: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    whole = invoke("journal", "export", "--db", str(db))
    dashed = invoke("journal", "export", "--db", str(db), "-o", "-")
    assert dashed.exit_code == 0 and dashed.stdout == whole.stdout and dashed.stderr == ""
    assert not (tmp_path / "-").exists()

    checked = invoke("journal", "verify", "--export", "-", input=whole.stdout)
    assert checked.exit_code == 0, checked.output
    head = orjson.loads(whole.stdout.splitlines()[-1])["hash"]
    assert checked.stdout == f"OK: {count_events(db)} events, head {head}\n"
    one_call = invoke("journal", "export", "--db", str(db), "--call", "call-timeout").stdout
    gaps = invoke("journal", "verify", "--export", "-", input=one_call)
    assert gaps.exit_code == 1 and gaps.stderr.startswith("Error: the export on stdin does not verify at seq ")
    assert invoke("journal", "verify", "--export", "-", "--allow-gaps", input=one_call).exit_code == 0
    broken = invoke("journal", "verify", "--export", "-", input="{not json\n")
    assert broken.exit_code == 1
    assert broken.stderr.startswith("Error: the export on stdin is not a JSON Lines export: line 1 is not JSON")


def test_verify_export_dash_with_stdin_closed_is_one_error_line(db: Path) -> None:
    done = subprocess.run([AIRLOCK, "journal", "verify", "--export", "-"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60, preexec_fn=lambda: os.close(0))
    assert done.returncode == 1
    assert done.stderr == "Error: cannot read the export on stdin: stdin is closed\n"
