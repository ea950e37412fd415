"""``verify --export`` of a file without events: evidence of nothing, so an error, unless the export
was filtered (``--allow-gaps``), whose filters may have matched no event."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.cli_support import invoke, seed

EMPTY = ("does not verify: it holds no events, and an empty export is evidence of nothing (an export whose "
         "filters matched no event verifies with --allow-gaps)\n")


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"], ids=["empty", "blank lines"])
def test_an_export_without_events_is_an_error(tmp_path: Path, content: bytes) -> None:
    export = tmp_path / "audit.jsonl"
    export.write_bytes(content)
    result = invoke("journal", "verify", "--export", str(export))
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == f"Error: {export} {EMPTY}"


def test_an_empty_export_on_stdin_is_an_error() -> None:
    result = invoke("journal", "verify", "--export", "-", input="")
    assert result.exit_code == 1
    assert result.stderr == f"Error: the export on stdin {EMPTY}"


def test_with_json_the_report_says_not_ok_and_the_error_line_follows(tmp_path: Path) -> None:
    export = tmp_path / "audit.jsonl"
    export.write_bytes(b"")
    result = invoke("journal", "verify", "--export", str(export), "--json")
    assert result.exit_code == 1
    report = orjson.loads(result.stdout)
    assert (report["ok"], report["events"], report["first_bad_seq"]) == (False, 0, None)
    assert report["problem"].startswith("it holds no events")
    assert result.stderr == f"Error: {export} {EMPTY}"


def test_a_filtered_export_that_matched_nothing_verifies_with_allow_gaps(tmp_path: Path) -> None:
    db = tmp_path / "journal.db"
    seed(db)
    export = tmp_path / "none.jsonl"
    made = invoke("journal", "export", "--tool", "no_such_tool", "-o", str(export), "--db", str(db))
    assert made.exit_code == 0, made.stderr
    assert export.read_bytes() == b""
    assert invoke("journal", "verify", "--export", str(export)).exit_code == 1
    result = invoke("journal", "verify", "--export", str(export), "--allow-gaps")
    assert (result.exit_code, result.stdout) == (0, "OK: 0 events (an empty export: its filters matched no event)\n")


def test_an_export_with_events_verifies_as_before(tmp_path: Path) -> None:
    db = tmp_path / "journal.db"
    seed(db)
    export = tmp_path / "all.jsonl"
    assert invoke("journal", "export", "-o", str(export), "--db", str(db)).exit_code == 0
    result = invoke("journal", "verify", "--export", str(export))
    assert result.exit_code == 0 and result.stdout.startswith("OK: 11 events, head "), result.output
