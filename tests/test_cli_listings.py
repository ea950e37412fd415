"""Listings an operator acts on: `show` and `stats` as a table, CSV, TSV and JSON Lines; paging and
the note when a list is cut, in every output; tables in a narrow terminal and with wide characters;
progress bars on a terminal; and the errors that name where the journal came from."""

from __future__ import annotations

import csv
import io
import os
import pty
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from cli import render
from guard.store import CallRecord
from journal import SQLiteJournal, open_journal
from tests.cli_support import AIRLOCK, Tools, invoke, seed
from tests.journals import JournalFactory

CALLS = 7  # more than a page of 3, so a list of them is cut


def seed_calls(journal: Any, count: int = CALLS) -> list[str]:
    """``count`` charges through the real guard, one tool call id each; their ids, newest first."""
    tools = Tools(journal)
    ids = [f"call-{n}" for n in range(count)]
    for n, call_id in enumerate(ids):
        tools.call(call_id, tools.charge, account=f"acct_{n}", cents=100 + n)
    return ids[::-1]


@pytest.fixture
def target(journal_kind: JournalFactory, tmp_path: Path) -> tuple[str, list[str]]:
    """A journal of CALLS charges on each store (tests/conftest.py): (its --db, its call ids newest first)."""
    db = journal_kind.target(tmp_path, "j.db", own_database=True)
    with journal_kind.open(db) as journal:
        return db, seed_calls(journal)


def json_ids(text: str) -> list[str]:
    return [orjson.loads(line)["call_id"] for line in text.splitlines()]


def csv_rows(text: str, delimiter: str = ",") -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text), delimiter=delimiter))


# -- paging, and the note when a list is cut -------------------------------------------------------


def test_the_store_pages_calls_with_an_offset(target: tuple[str, list[str]]) -> None:
    db, ids = target
    with open_journal(db, readonly=True, create=False) as j:
        pages = [[r.call_id for r in j.calls(limit=3, offset=offset)] for offset in (0, 3, 6, 9)]
        assert pages == [ids[0:3], ids[3:6], ids[6:7], []]
        assert [r.call_id for r in j.calls(limit=None, offset=5)] == ids[5:]
        with pytest.raises(ValueError, match="offset"):
            j.calls(offset=-1)


@pytest.mark.parametrize("output", [[], ["--json"], ["--nl"], ["--csv"], ["--tsv"]])
def test_a_cut_list_says_so_on_stderr_in_every_output(target: tuple[str, list[str]], output: list[str]) -> None:
    db, _ = target
    cut = invoke("journal", "show", "--limit", "3", *output, "--db", db)
    assert cut.exit_code == 0, cut.stderr
    assert cut.stderr == "(the newest 3; more match: pass --limit for more, --offset 3 for the next page, or --all)\n"
    whole = invoke("journal", "show", "--limit", str(CALLS), *output, "--db", db)
    assert whole.exit_code == 0 and whole.stderr == ""  # exactly as many as match: nothing was left out


def test_pages_cover_every_call_once_and_all_lists_them_whole(target: tuple[str, list[str]]) -> None:
    db, ids = target
    seen: list[str] = []
    notes = []
    for offset in range(0, CALLS, 3):
        page = invoke("journal", "show", "--limit", "3", "--offset", str(offset), "--json", "--db", db)
        assert page.exit_code == 0
        seen += json_ids(page.stdout)
        notes.append(page.stderr)
    assert seen == ids
    assert notes == [
        "(the newest 3; more match: pass --limit for more, --offset 3 for the next page, or --all)\n",
        "(calls 4 to 6, newest first; more match: pass --offset 6 for the next page, or --all)\n",
        "",  # the last page: nothing more
    ]
    every = invoke("journal", "show", "--all", "--json", "--db", db)
    assert json_ids(every.stdout) == ids and every.stderr == ""
    past = invoke("journal", "show", "--offset", "50", "--db", db)
    assert past.exit_code == 0 and past.stdout == "" and past.stderr == "No calls match past the first 50.\n"


def test_the_runbooks_pipeline_handles_every_stuck_call(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    with SQLiteJournal(db) as journal:
        tools = Tools(journal)
        for n in range(60):  # more than show's default page of 50
            tools.fail_with = TimeoutError("backend did not answer")
            with pytest.raises(TimeoutError):
                tools.call(f"stuck-{n}", tools.charge, account="acct", cents=n)
    runbook = (Path(__file__).resolve().parents[1] / "docs" / "runbook.md").read_text()
    [command] = [line for line in runbook.splitlines() if line.endswith("--all --csv > stuck.csv")]
    args = command.split(">")[0].split()[1:]
    listed = invoke(*args, "--db", str(db))
    assert listed.exit_code == 0 and listed.stderr == ""
    rows = csv_rows(listed.stdout)
    assert sorted(r["call_id"] for r in rows) == sorted(f"stuck-{n}" for n in range(60))
    assert all(len(r["idempotency_key"]) == 64 and r["status"] == "unknown" for r in rows)


# -- CSV, TSV, JSON Lines, no headers --------------------------------------------------------------


def test_show_csv_and_tsv_hold_the_fields_of_json(tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    seed(Path(db))
    as_json = [orjson.loads(line) for line in invoke("journal", "show", "--json", "--db", db).stdout.splitlines()]
    for flag, delimiter in (("--csv", ","), ("--tsv", "\t")):
        result = invoke("journal", "show", flag, "--db", db)
        assert result.exit_code == 0, result.stderr
        assert result.stdout.splitlines()[0] == delimiter.join(render.CALL_COLUMNS)
        rows = csv_rows(result.stdout, delimiter)
        assert [r["call_id"] for r in rows] == [c["call_id"] for c in as_json]
        for row, call in zip(rows, as_json, strict=True):
            assert row["status"] == call["status"] and row["attempt"] == str(call["attempt"])
            assert orjson.loads(row["arguments"]) == call["arguments"]  # JSON values as their JSON text
            assert row["value"] == ("" if call["value"] is None else orjson.dumps(call["value"]).decode())
        headless = invoke("journal", "show", flag, "--no-headers", "--db", db)
        assert headless.stdout.splitlines() == result.stdout.splitlines()[1:]
    as_nl = invoke("journal", "show", "--nl", "--db", db).stdout
    assert as_nl == invoke("journal", "show", "--json", "--db", db).stdout
    assert set(as_json[0]) == set(render.CALL_COLUMNS)  # CSV leaves no field of --json out


def test_a_cell_with_commas_quotes_and_line_breaks_survives_csv(tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    with SQLiteJournal(db) as journal:
        tools = Tools(journal)
        tools.call('odd,"id"\nline', tools.charge, agent="a\tb", account='x,"y"', cents=1)
    for flag, delimiter in (("--csv", ","), ("--tsv", "\t")):
        [row] = csv_rows(invoke("journal", "show", flag, "--db", db).stdout, delimiter)
        assert row["call_id"] == 'odd,"id"\nline' and row["agent_id"] == "a\tb"
        assert orjson.loads(row["arguments"]) == {"account": 'x,"y"', "cents": 1}


def test_the_table_without_headers(tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    seed(Path(db))
    table = invoke("journal", "show", "--db", db).stdout.splitlines()
    assert table[0].startswith("CALL ID")
    assert invoke("journal", "show", "--no-headers", "--db", db).stdout.splitlines() == table[1:]


def test_stats_as_rows(tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    seed(Path(db))
    summary = orjson.loads(invoke("journal", "stats", "--json", "--db", db).stdout)
    result = invoke("journal", "stats", "--csv", "--db", db)
    assert result.exit_code == 0, result.stderr
    rows = csv_rows(result.stdout)
    assert list(rows[0]) == ["group", "name", "count", "oldest_at"]
    counts = {(r["group"], r["name"]): int(r["count"]) for r in rows}
    assert counts[("total", "calls")] == summary["calls"] and counts[("total", "events")] == summary["events"]
    assert {n: c for (g, n), c in counts.items() if g == "status" and c} == summary["by_status"]
    assert {n: c for (g, n), c in counts.items() if g == "tool"} == summary["by_tool"]
    [unknown] = [r for r in rows if (r["group"], r["name"]) == ("status", "unknown")]
    assert unknown["oldest_at"] == summary["oldest_unknown_at"]
    as_lines = [orjson.loads(line) for line in invoke("journal", "stats", "--nl", "--db", db).stdout.splitlines()]
    assert [{k: str(v) if v is not None else "" for k, v in row.items()} for row in as_lines] == rows
    tsv = invoke("journal", "stats", "--tsv", "--no-headers", "--db", db).stdout
    assert tsv.splitlines()[0] == "total\tcalls\t4\t"


@pytest.mark.parametrize(("args", "message"), [
    (["show", "--json", "--csv"], "Error: --json and --csv are outputs of their own: give one"),
    (["show", "--nl", "--tsv"], "Error: --tsv and --nl are outputs of their own: give one"),
    (["show", "--json", "--no-headers"], "Error: --no-headers goes with the table, --csv or --tsv: --json has no "
                                         "header line"),
    (["show", "--all", "--limit", "5"], "Error: --all shows every call; it cannot be combined with --limit"),
    (["show", "--offset", "-1"], "Error: Invalid value for '--offset': -1 is not in the range x>=0."),
    (["show", "call-ok", "--offset", "2"], "Error: --offset filters the list of calls; it cannot be combined "
                                           "with CALL_ID, which shows one call"),
    (["show", "call-ok", "--csv"], "Error: --csv goes with the list of calls; for the events of one call: "
                                   "airlock journal export --call CALL_ID --format csv"),
    (["stats", "--no-headers"], "Error: --no-headers goes with --csv or --tsv: the summary has no header line"),
    (["stats", "--csv", "--json"], "Error: --json and --csv are outputs of their own: give one"),
    (["stats", "--csv", "--format", "prometheus"], "Error: --csv and --format prometheus are two outputs: give one"),
])
def test_conflicting_outputs_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    db = str(tmp_path / "j.db")
    seed(Path(db))
    result = invoke("journal", *args, "--db", db)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", message + "\n")


# -- tables for a person ---------------------------------------------------------------------------


def record(call_id: str, tool: str = "charge", agent: str = "agent-1") -> CallRecord:
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    return CallRecord(call_id=call_id, tool=tool, status="committed", attempt=1, agent_id=agent,
                      idempotency_key="0" * 64, arguments="{}", value=None, error=None, reason=None, actor="guard",
                      owner={"host": "h", "pid": 1}, created_at=now, updated_at=now, since=now, last_seq=1)


def test_a_narrow_table_never_cuts_a_call_id() -> None:
    ids = [f"call_2026120105_batch_{n:04d}" for n in (7, 8, 17, 1234)]
    lines = render.calls_table([record(i) for i in ids], width=50)
    assert [line.split()[0] for line in lines[1:]] == ids  # what the operator copies, whole


def test_at_80_columns_the_status_mark_is_cut_before_the_agent_is_left_out() -> None:
    settled = record("ca_r2_4_x")
    settled.actor = "reconciler:make_state_machine.<locals>.GuardMachine.charge_exists_in_the_ledger"
    records = [settled, record("ca_r2_5_y")]
    for width in (80, 100):
        lines = render.calls_table(records, width=width)
        assert lines[0].split() == ["CALL", "ID", "TOOL", "STATUS", "ATTEMPT", "AGENT", "AGE"]
        assert [line.split()[0] for line in lines[1:]] == ["ca_r2_4_x", "ca_r2_5_y"]
        assert lines[1].split()[2] == "committed"
        assert render.ELLIPSIS in lines[1]
        assert max(render.display_width(line) for line in lines) <= width


def test_a_very_narrow_terminal_leaves_out_agent_then_attempt() -> None:
    records = [record("call-1", agent="billing-agent-with-a-long-name")]
    assert render.calls_table(records, width=45)[0].split() == ["CALL", "ID", "TOOL", "STATUS", "ATTEMPT", "AGE"]
    lines = render.calls_table(records, width=35)
    assert lines[0].split() == ["CALL", "ID", "TOOL", "STATUS", "AGE"]
    assert lines[1].split()[:3] == ["call-1", "charge", "committed"]
    assert max(render.display_width(line) for line in lines) <= 35


def test_wide_characters_are_aligned_by_their_width_on_a_terminal() -> None:
    records = [record("call-1", tool="支払い", agent="エージェント"), record("call-2", tool="charge", agent="a")]
    lines = render.calls_table(records)
    # the STATUS column starts at one display column in every line
    starts = {render.display_width(line[: line.index(word)]) for line, word in
              zip(lines, ["STATUS", "committed", "committed"], strict=True)}
    assert len(starts) == 1
    assert render.display_width("支払い") == 6 and render.display_width("e\u0301") == 1
    narrow = render.calls_table(records, width=44)
    assert max(render.display_width(line) for line in narrow) <= 44


def test_stats_aligns_wide_tool_names(tmp_path: Path) -> None:
    from journal.events import JournalStats

    stats = JournalStats(calls=2, events=2, by_status={"committed": 2}, by_tool={"支払い": 1, "charge": 1},
                         oldest_pending_at=None, oldest_unknown_at=None)
    tools = [line for line in render.stats_lines(stats) if line.endswith("  1")]
    assert len({render.display_width(line) for line in tools}) == 1


# -- progress bars on a terminal -----------------------------------------------------------------


def on_a_terminal(*args: str, cwd: Path) -> tuple[int, str, str]:
    """Run ``airlock ARGS`` with stderr a terminal (a pseudo-terminal) and stdout a pipe; (exit
    status, stdout, what the terminal showed)."""
    main, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    proc = subprocess.Popen([AIRLOCK, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=follower, env=env)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the terminal closed: the process is done with it
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out.decode(), shown.decode(errors="replace")


@pytest.mark.parametrize(("command", "label"), [
    (["journal", "verify", "--db", "j.db"], "Verifying"),
    (["journal", "rebuild", "--db", "j.db"], "Rebuilding"),
    (["journal", "copy", "--from", "j.db", "--to", "copy.db"], "Copying"),
])
def test_long_commands_show_a_progress_bar_on_a_terminal_only(tmp_path: Path, command: list[str],
                                                              label: str) -> None:
    with SQLiteJournal(tmp_path / "j.db") as journal:
        seed_calls(journal, 30)
    code, out, shown = on_a_terminal(*command, cwd=tmp_path)
    assert code == 0, shown
    assert label in shown and "100%" in shown
    assert label not in out  # the result on stdout stays clean
    (tmp_path / "copy.db").unlink(missing_ok=True)
    piped = subprocess.run([AIRLOCK, *command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and piped.stderr == ""


# -- where the journal came from -------------------------------------------------------------------


def test_errors_name_the_variable_only_when_it_named_the_journal(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.db")
    given = invoke("journal", "show", "--db", missing, env={"AIRLOCK_JOURNAL": str(tmp_path / "other.db")})
    assert given.stderr == (f"Error: There is no journal at {missing}. It is named by --db: check the path or URL "
                            "given.\n")
    from_env = invoke("journal", "show", env={"AIRLOCK_JOURNAL": missing})
    assert from_env.stderr == (f"Error: There is no journal at {missing}. It is named by AIRLOCK_JOURNAL: set it to "
                               "the journal's path or URL, or give --db.\n")
    bad_flag = invoke("journal", "stats", "--db", "postgresql://u@h:0/db")
    assert bad_flag.exit_code == 2 and "AIRLOCK_JOURNAL" not in bad_flag.stderr
    assert bad_flag.stderr.startswith("Error: Invalid value for '--db': ")
    bad_env = invoke("journal", "stats", env={"AIRLOCK_JOURNAL": "postgresql://u@h:0/db"})
    assert bad_env.exit_code == 2 and bad_env.stderr.startswith("Error: Invalid value for AIRLOCK_JOURNAL: ")


def test_a_bare_word_as_value_is_refused_with_how_to_quote_it(tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    seed(Path(db))
    result = invoke("journal", "resolve", "call-timeout", "--applied", "--value", "ok", "--reason", "r", "--db", db)
    assert result.exit_code == 2
    assert result.stderr.endswith("""; a string is given in JSON's quotes: --value '"ok"'\n""")
    quoted = invoke("journal", "resolve", "call-timeout", "--applied", "--value", '"ok"', "--reason", "r", "--db", db)
    assert quoted.exit_code == 0 and 'Replays of this call now return "ok".' in quoted.stdout


# -- the operator's commands on a large journal ----------------------------------------------------


def test_the_cli_benchmark_prints_every_command_with_its_target(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cli_bench.py"
    done = subprocess.run([os.fspath(Path(AIRLOCK).with_name("python")), str(script), "--events", "3000"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for label, target in [("show (newest 50 calls), the command itself", "target < 50 ms"),
                          ("show CALL_ID, the command itself", "target < 50 ms"),
                          ("stats, the command itself", "target < 500 ms"),
                          ("export --format jsonl (to a file)", "target >= 200,000/s"),
                          ("export peak memory", "target < 100 MB"),
                          ("verify (chain and projection)", "target >= 200,000/s"),
                          ("verify peak memory", "target < 100 MB"),
                          ("rebuild (the projection folded again)", "events/s"),
                          ("rebuild peak memory", "MB")]:
        [line] = [line for line in done.stdout.splitlines() if line.startswith(label)]
        assert target in line
