"""Hostile call ids, tool names and arguments are stored and shown exactly, never run as SQL;
redacted exports hold none of the redacted text; the journal's files are private to their owner."""

from __future__ import annotations

import csv
import io
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from journal import Journal, SQLiteJournal
from journal.testing import EffectLog
from tests.cli_support import invoke
from tests.journals import JournalFactory

MARK = "SECRET-MARK-7f3a9c"
BIG = "A" * 1_000_000 + MARK  # a 1 MB string
CALL_IDS = [
    "call'; DROP TABLE events; --",
    'call" OR "1"="1',
    "call\x00after-nul",
    "\u202ecall\u200b\U0001f9e8\u0645",
    "-rf",
    "call\nsecond line",
    "%s %d {} $1 ?",
    "\x1b]0;title\x07\x1b[2J",
]
TOOL_NAMES = ["pay'; DROP TABLE calls; --", 'pay"\\', "\u043f\u043b\u0430\u0442\u0451\u0436\U0001f4b8", "pay\x00x"]
ARGUMENTS = {
    "note": "'); DELETE FROM events; --",
    "nul": "a\x00b",
    "unicode": "\u202e\U0001f4b3\U0010ffff\u00e9",
    "nested": {"k'\x00\"": ["\\", "\x1b[31m", None]},
}
NUL_FREE = [c for c in CALL_IDS if "\x00" not in c]


def make_tool(store: Any, name: str, effects: EffectLog) -> Any:
    def body(note: str, nul: str, unicode: str, nested: dict[str, Any], big: str = "") -> dict[str, Any]:
        effects.record(name)
        return {"echo": [note, nul, unicode, nested], "big_tail": big[-len(MARK):], "big_len": len(big)}

    body.__name__ = name
    return Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store)))(body)


def run_hostile_calls(store: Any, effects: EffectLog, call_ids: list[str], tools: list[str]) -> dict[str, Any]:
    """One call per id, tools in turn, the hostile arguments (the first with a 1 MB string)."""
    made = {name: make_tool(store, name, effects) for name in tools}
    values: dict[str, Any] = {}
    for n, call_id in enumerate(call_ids):
        tool = tools[n % len(tools)]
        with AirlockContext(agent_id="agent'\"\u202e", metadata={"tool_call_id": call_id}):
            values[call_id] = made[tool](**ARGUMENTS, big=BIG if n == 0 else "")
            assert made[tool](**ARGUMENTS, big=BIG if n == 0 else "") == values[call_id]  # a replay
    return values


def expected_arguments(n: int) -> dict[str, Any]:
    return {**ARGUMENTS, "big": BIG if n == 0 else ""}


@pytest.fixture
def any_journal(journal_kind: JournalFactory, journal_target: str) -> Iterator[Journal]:
    """A fresh journal of every store (tests/conftest.py), opened for many calls."""
    journal = journal_kind.open(journal_target, **journal_kind.quick)
    try:
        yield journal
    finally:
        journal.close()


def test_hostile_ids_tools_and_arguments_are_stored_and_read_back_exactly(journal_kind: JournalFactory,
                                                                          any_journal: Any, tmp_path: Path) -> None:
    journal = any_journal
    effects = EffectLog(tmp_path / "effects.jsonl")
    # PostgreSQL text cannot hold NUL: those ids and names are covered by the next test.
    ids = CALL_IDS if journal_kind.holds_nul else NUL_FREE
    tools = TOOL_NAMES if journal_kind.holds_nul else [t for t in TOOL_NAMES if "\x00" not in t]
    values = run_hostile_calls(journal, effects, ids, tools)

    assert effects.count() == len(ids)  # every call ran once; every replay ran nothing
    for n, call_id in enumerate(ids):
        record = journal.get(call_id)
        assert record is not None, call_id
        assert (record.call_id, record.tool, record.status) == (call_id, tools[n % len(tools)], "committed")
        assert record.agent_id == "agent'\"\u202e"
        assert json.loads(record.arguments) == expected_arguments(n)
        assert json.loads(record.value) == values[call_id]
        events = journal.call_events(call_id)
        assert [e.kind for e in events] == ["pending", "committed", "replayed"]
        assert {(e.call_id, e.tool) for e in events} == {(call_id, tools[n % len(tools)])}
    assert values[ids[0]]["big_tail"] == MARK and values[ids[0]]["big_len"] == len(BIG)
    report = journal.verify()
    assert report.ok, report.problem
    assert report.events == 3 * len(ids)


@pytest.mark.postgres
def test_postgres_refuses_a_nul_in_an_id_or_tool_name_before_running_anything(tmp_path: Path) -> None:
    # PostgreSQL text cannot hold NUL: the call cannot be recorded, so it is refused and not run.
    from journal.postgres import PostgresJournal
    from tests.pgserver import fresh_schema

    effects = EffectLog(tmp_path / "effects.jsonl")
    with PostgresJournal(fresh_schema(), pool_size=2) as journal:
        for call_id, tool in (("call\x00nul", "pay"), ("call_ok", "pay\x00x")):
            with AirlockContext(metadata={"tool_call_id": call_id}):
                refusal = make_tool(journal, tool, effects)(**ARGUMENTS)
            assert refusal["block_reason"] == "store_unavailable"
        assert effects.count() == 0
        assert journal.count_events() == 0
        assert journal.verify().ok


def test_an_unencodable_argument_is_refused_and_an_unencodable_id_is_kept_escaped(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    tool = make_tool(airlock_journal, "pay", airlock_effects)
    with AirlockContext(metadata={"tool_call_id": "call_1"}):
        bad_argument = tool(**{**ARGUMENTS, "note": "lone \ud800 surrogate"})
    assert bad_argument["block_reason"] == "arguments_not_canonical"
    assert airlock_effects.count() == 0
    assert airlock_journal.get("call_1") is None
    for _ in range(2):  # run once, then replayed
        with AirlockContext(metadata={"tool_call_id": "call_\udfff"}):
            assert not is_refusal(tool(**ARGUMENTS))
    assert airlock_effects.count() == 1
    assert airlock_journal.get("agent:%call_%uDFFF").status == "committed"
    assert airlock_journal.verify().ok


# -- the CLI shows them exactly ------------------------------------------------------------------


@pytest.fixture
def hostile_journal(airlock_journal: SQLiteJournal, airlock_journal_path: Path, airlock_effects: EffectLog) -> Path:
    run_hostile_calls(airlock_journal, airlock_effects, CALL_IDS, TOOL_NAMES)
    return airlock_journal_path


def test_show_json_gives_every_hostile_call_exactly(hostile_journal: Path) -> None:
    result = invoke("journal", "show", "--json", "--limit", "100", "--db", str(hostile_journal))
    assert result.exit_code == 0, result.stderr
    shown = [json.loads(line) for line in result.stdout.splitlines()]
    assert {c["call_id"]: c["tool"] for c in shown} == {
        call_id: TOOL_NAMES[n % len(TOOL_NAMES)] for n, call_id in enumerate(CALL_IDS)}
    for call in shown:
        n = CALL_IDS.index(call["call_id"])
        assert call["arguments"] == expected_arguments(n)


@pytest.mark.parametrize("call_id", [c for c in NUL_FREE if "\n" not in c])
def test_show_one_hostile_call_by_its_id(hostile_journal: Path, call_id: str) -> None:
    result = invoke("journal", "show", "--json", "--db", str(hostile_journal), "--", call_id)
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["call_id"] == call_id
    assert [e["kind"] for e in shown["events"]] == ["pending", "committed", "replayed"]
    assert shown["arguments"] == expected_arguments(CALL_IDS.index(call_id))


def test_export_gives_every_hostile_event_exactly_in_jsonl_and_csv(hostile_journal: Path) -> None:
    jsonl = invoke("journal", "export", "--db", str(hostile_journal))
    assert jsonl.exit_code == 0, jsonl.stderr
    events = [json.loads(line) for line in jsonl.stdout_bytes.splitlines()]
    assert len(events) == 3 * len(CALL_IDS)
    for event in events:
        n = CALL_IDS.index(event["call_id"])
        assert event["tool"] == TOOL_NAMES[n % len(TOOL_NAMES)]
        assert event["arguments"] == expected_arguments(n)

    out = invoke("journal", "export", "--format", "csv", "--db", str(hostile_journal))
    assert out.exit_code == 0, out.stderr
    limit = csv.field_size_limit(8 * len(BIG))  # the 1 MB argument is one field
    try:
        rows = list(csv.DictReader(io.StringIO(out.stdout_bytes.decode("utf-8"), newline="")))
    finally:
        csv.field_size_limit(limit)
    assert [(r["call_id"], r["tool"]) for r in rows] == [(e["call_id"], e["tool"]) for e in events]
    assert [json.loads(r["arguments"]) for r in rows] == [e["arguments"] for e in events]


def test_the_table_never_writes_a_control_character_to_the_terminal(hostile_journal: Path) -> None:
    listing = invoke("journal", "show", "--limit", "100", "--db", str(hostile_journal))
    one = invoke("journal", "show", "--db", str(hostile_journal), "--", CALL_IDS[-1])
    for result in (listing, one):
        assert result.exit_code == 0, result.stderr
        for line in result.stdout.splitlines():
            assert line.isprintable(), repr(line)
    assert "\\x1b]0;title\\x07" in listing.stdout  # shown escaped, so an operator can tell
    assert "\\x00" in listing.stdout


@pytest.mark.parametrize("option", ["--tool", "--agent", "--status"])
def test_a_filter_made_of_sql_matches_nothing(hostile_journal: Path, option: str) -> None:
    result = invoke("journal", "show", "--json", option, "x' OR '1'='1", "--db", str(hostile_journal))
    if option == "--status":
        assert result.exit_code == 2  # not one of the statuses: a usage error
    else:
        assert (result.exit_code, result.stdout) == (0, "")
    exported = invoke("journal", "export", "--call", "x' OR '1'='1", "--db", str(hostile_journal))
    assert (exported.exit_code, exported.stdout) == (0, "")
    exact = invoke("journal", "export", "--call", CALL_IDS[0], "--db", str(hostile_journal))
    assert len(exact.stdout_bytes.splitlines()) == 3


def test_the_hostile_names_did_not_reach_the_schema(hostile_journal: Path) -> None:
    import sqlite3

    with sqlite3.connect(f"file:{hostile_journal}?mode=ro", uri=True) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        triggers = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
    assert {"events", "calls", "meta"} <= tables
    assert {"events_no_update", "events_no_delete"} <= triggers
    assert invoke("journal", "verify", "--db", str(hostile_journal)).exit_code == 0


# -- redaction -----------------------------------------------------------------------------------


@pytest.fixture
def secret_journal(airlock_journal: SQLiteJournal, airlock_journal_path: Path, airlock_effects: EffectLog) -> Path:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=airlock_journal)))
    def store_password(user: str, password: str) -> dict[str, Any]:
        airlock_effects.record(user)
        return {"stored": True, "hint": f"starts {password[:6]}", "token": f"tok-{MARK}"}

    for n in range(3):
        with AirlockContext(metadata={"tool_call_id": f"call_{n}"}):
            store_password(f"user_{n}", f"{MARK}-{n}")
            store_password(f"user_{n}", f"{MARK}-{n}")  # a replay
    with AirlockContext(metadata={"tool_call_id": "call_0"}):
        store_password("user_0", f"{MARK}-other")  # a reuse for other arguments: refused, journaled
    return airlock_journal_path


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_redacted_export_holds_none_of_the_redacted_text(secret_journal: Path, tmp_path: Path, fmt: str) -> None:
    plain = invoke("journal", "export", "--format", fmt, "--db", str(secret_journal))
    assert plain.exit_code == 0
    assert MARK.encode() in plain.stdout_bytes  # the marker is there to be found

    redacted = invoke("journal", "export", "--format", fmt, "--redact", "arguments,value", "--db", str(secret_journal))
    assert redacted.exit_code == 0, redacted.stderr
    assert MARK.encode() not in redacted.stdout_bytes
    assert MARK[:10].encode() not in redacted.stdout_bytes
    assert len(redacted.stdout_bytes.splitlines()) == len(plain.stdout_bytes.splitlines())

    output = tmp_path / f"export.{fmt}"
    to_file = invoke("journal", "export", "--format", fmt, "--redact", "arguments,value", "--output", str(output),
                     "--db", str(secret_journal))
    assert to_file.exit_code == 0, to_file.stderr
    assert MARK.encode() not in output.read_bytes()
    if fmt == "jsonl":
        # Redacted, it still verifies: the chain holds the digests of what was left out.
        checked = invoke("journal", "verify", "--export", str(output))
        assert checked.exit_code == 0, checked.stderr + checked.stdout


# -- file modes ------------------------------------------------------------------------------------


def test_the_journal_and_its_wal_and_shm_files_are_private_even_with_umask_0(tmp_path: Path) -> None:
    path = tmp_path / "private.db"
    old = os.umask(0)
    try:
        with SQLiteJournal(path) as journal:
            with AirlockContext(metadata={"tool_call_id": "call_1"}):
                Airlock(SecurityPolicy(effect_guard=EffectGuard(store=journal)))(lambda: 1)()
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    finally:
        os.umask(old)
    assert modes["private.db"] == 0o600
    assert {"private.db-wal", "private.db-shm"} <= set(modes)
    for name in ("private.db-wal", "private.db-shm"):
        assert modes[name] == 0o600, (name, oct(modes[name]))  # as private as the journal itself


def test_hostile_ids_and_arguments_through_the_adapters_are_kept_exactly(
    airlock_journal: SQLiteJournal, airlock_effects: EffectLog
) -> None:
    from guard.adapters import anthropic, openai

    tool = make_tool(airlock_journal, "pay", airlock_effects)
    arguments = {**ARGUMENTS, "big": BIG}
    for n, call_id in enumerate(CALL_IDS[:4]):
        if n % 2 == 0:
            reply = openai.dispatch({"id": call_id, "type": "function",
                                     "function": {"name": "pay", "arguments": json.dumps(arguments)}}, [tool])
            assert reply["tool_call_id"] == call_id
            content = reply["content"]
        else:
            reply = anthropic.dispatch({"type": "tool_use", "id": call_id, "name": "pay", "input": arguments},
                                       {"pay": tool})
            assert (reply["tool_use_id"], reply["is_error"]) == (call_id, False)
            content = reply["content"]
        assert json.loads(content)["big_tail"] == MARK
        record = airlock_journal.get(call_id)
        assert record is not None and json.loads(record.arguments) == arguments
    assert airlock_effects.count() == 4
    assert airlock_journal.verify().ok
