"""The operator API of a journal (``journal.Journal``), one suite for every store.

Each test runs on every journal store of tests/journals.py (a SQLite file, a PostgreSQL schema),
made and written the same way: the reads, the exports, verify and rebuild, resolve, settle and
leases, reconcile and archive give an operator the same answers, the same errors and the same
bytes on each."""

from __future__ import annotations

import csv
import io
import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import orjson
import pytest

from guard.leases import OwnerState
from guard.reconcile import Applied, InDoubtCall, NotApplied
from guard.store import EffectEvent, format_at
from journal import CallNotFound, Journal, JournalError, NotResolvable, open_journal
from journal.archive import plan_archive
from journal.chain import GENESIS
from journal.export import CSV_COLUMNS
from tests.cli_support import Tools, invoke, seed_into
from tests.journal_contract_support import (
    AGENT,
    CALLS_NEWEST_FIRST,
    OWNER,
    STATUS,
    History,
    begin_pending,
    exported,
    exported_csv,
    kill,
    leave_pending,
    running_in_child,
    verify_export,
)
from tests.journals import JOURNAL_FACTORIES, JOURNAL_PARAMS, Database, journal_factory


@pytest.fixture
def database(journal_database: Database) -> Database:
    """The database under ``journal`` (tests/conftest.py), for plain SQL."""
    return journal_database


@pytest.fixture
def story(journal: Journal) -> History:
    """The fixed history of tests/journal_contract_support.py (15 events, 6 calls), written into ``journal``."""
    written = History()
    written.write(journal)
    return written


@pytest.fixture
def history(journal: Journal, story: History) -> Journal:
    """``journal`` holding :func:`story`."""
    return journal


@pytest.fixture
def tools(journal: Journal) -> Tools:
    """``journal`` seeded through the real guard (tests/cli_support.py ``seed_into``): call-ok
    committed, call-timeout unknown, call-failed released, call-read committed, call-refused refused."""
    return seed_into(journal)


def state(journal: Journal) -> tuple[tuple[int, str], int, list[Any]]:
    """What a refused operation must leave as it was: the head, the events, every call."""
    return journal.head(), journal.count_events(), journal.calls(limit=None)


# -- reads: calls ----------------------------------------------------------------------------------


def test_call_is_the_current_record_of_the_call(history: Journal, story: History) -> None:
    record = history.call("c-retry")
    assert record is not None
    assert (record.call_id, record.tool, record.status, record.attempt, record.agent_id) == (
        "c-retry", "charge", "committed", 2, "agent-1")
    assert record.value == '{"charge_id":"ch_2","note":"a, \\"b\\""}'
    assert (record.created_at, record.updated_at, record.since, record.last_seq) == (
        story.at(11), story.at(14), story.at(14), 15)
    assert (record.actor, record.owner, record.error, record.reason) == ("guard", OWNER, None, None)
    released = history.call("c-released")
    assert released is not None and released.error == {"type": "ValueError", "message": "card declined"}
    assert released.value is None and released.since == story.at(6)
    assert history.get("c-retry") == record


def test_call_of_an_id_never_seen_or_only_refused_is_none(history: Journal) -> None:
    assert history.call("never-seen") is None
    assert history.call("c-refused") is None
    assert history.call("") is None


def test_calls_are_newest_first_and_limit_none_gives_all(history: Journal) -> None:
    assert [r.call_id for r in history.calls(limit=None)] == CALLS_NEWEST_FIRST
    assert [r.call_id for r in history.calls()] == CALLS_NEWEST_FIRST
    assert {r.call_id: r.status for r in history.calls()} == STATUS
    assert history.calls(limit=None) == [history.call(c) for c in CALLS_NEWEST_FIRST]


def test_calls_filtered_by_one_status(history: Journal) -> None:
    assert [r.call_id for r in history.calls(status="committed")] == ["c-retry", "c-read", "c-ok"]
    assert [r.call_id for r in history.calls(status="unknown")] == ["c-unknown"]
    assert history.calls(status="no-such-status") == []


def test_calls_filtered_by_several_statuses(history: Journal) -> None:
    assert [r.call_id for r in history.calls(status=["pending", "unknown"])] == ["c-pending", "c-unknown"]
    assert [r.call_id for r in history.calls(status=("released", "committed"))] == [
        "c-retry", "c-read", "c-released", "c-ok"]
    assert history.calls(status=[]) == []


def test_calls_filtered_by_tool(history: Journal) -> None:
    assert [r.call_id for r in history.calls(tool="read_balance")] == ["c-read"]
    assert len(history.calls(tool="charge")) == 5
    assert history.calls(tool="refund") == []  # refused only: no call


def test_calls_filtered_by_agent(history: Journal) -> None:
    for agent in ("agent-1", "agent-2", "agent-3"):
        assert [r.call_id for r in history.calls(agent_id=agent)] == [
            c for c in CALLS_NEWEST_FIRST if AGENT[c] == agent]
    assert history.calls(agent_id="agent-9") == []


def test_calls_since_keeps_those_updated_at_or_after(history: Journal, story: History) -> None:
    assert [r.call_id for r in history.calls(since=story.at(8))] == ["c-retry", "c-pending", "c-read"]
    assert [r.call_id for r in history.calls(since=story.at(8) + timedelta(microseconds=1))] == ["c-retry", "c-pending"]
    assert history.calls(since=story.at(15)) == []
    # An aware time in another zone names the same moment.
    east = story.at(8).astimezone(ZoneInfo("Asia/Tokyo"))
    assert [r.call_id for r in history.calls(since=east)] == ["c-retry", "c-pending", "c-read"]


def test_calls_filters_combine(history: Journal, story: History) -> None:
    found = history.calls(status=["committed", "released"], tool="charge", agent_id="agent-1", since=story.at(1))
    assert [r.call_id for r in found] == ["c-retry", "c-ok"]


def test_calls_limit_and_offset_page_through_the_list(history: Journal) -> None:
    pages = [history.calls(limit=4, offset=0), history.calls(limit=4, offset=4), history.calls(limit=4, offset=8)]
    assert [[r.call_id for r in page] for page in pages] == [CALLS_NEWEST_FIRST[:4], CALLS_NEWEST_FIRST[4:], []]
    assert [r.call_id for r in history.calls(limit=None, offset=5)] == ["c-ok"]
    assert history.calls(limit=0) == []


def test_calls_lists_fifty_by_default(journal: Journal) -> None:
    for n in range(55):
        begin_pending(journal, f"p{n:02}")
    assert len(journal.calls()) == 50
    assert len(journal.calls(limit=None)) == 55


@pytest.mark.parametrize("page", [{"limit": -1}, {"offset": -1}, {"limit": 1.5}, {"limit": True}])
def test_calls_refuses_a_page_that_is_not_a_count(history: Journal, page: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="number of calls"):
        history.calls(**page)


# -- reads: the log --------------------------------------------------------------------------------


def test_events_are_the_log_in_seq_order_with_every_field(history: Journal, story: History) -> None:
    events = list(history.events())
    assert [e.seq for e in events] == list(range(1, 16))
    assert [(e.kind, e.call_id, e.at) for e in events] == [(e.kind, e.call_id, e.at) for _, e in story.steps]
    unknown = events[4]
    assert (unknown.kind, unknown.call_id, unknown.at, unknown.attempt) == ("unknown", "c-unknown", story.at(4), 1)
    assert unknown.error == {"type": "TimeoutError", "message": "no answer"}
    assert (unknown.arguments, unknown.idempotency_key, unknown.owner) == (
        '{"account":"acct_1","cents":500}', "a" * 64, OWNER)
    refused = events[9]
    assert (refused.call_id, refused.tool, refused.attempt) == ("c-refused", "refund", 0)
    assert refused.reason == {"code": "policy_violation", "message": "refund is not allowed"}
    assert events[0].prev_hash == GENESIS
    assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(events))


def test_events_filtered_by_call_id(history: Journal) -> None:
    assert [e.seq for e in history.events(call_id="c-retry")] == [12, 13, 14, 15]
    assert [(e.seq, e.kind) for e in history.events(call_id="c-refused")] == [(10, "refused")]
    assert [e.kind for e in history.events(call_id="c-ok")] == ["pending", "committed", "replayed"]


def test_events_filtered_by_tool_and_agent(history: Journal) -> None:
    assert [e.seq for e in history.events(tool="read_balance")] == [8, 9]
    assert [e.seq for e in history.events(tool="refund")] == [10]
    assert [e.seq for e in history.events(agent_id="agent-2")] == [6, 7, 8, 9]
    assert [e.seq for e in history.events(agent_id="agent-2", tool="charge")] == [6, 7]


def test_events_since_and_until_are_half_open(history: Journal, story: History) -> None:
    assert [e.seq for e in history.events(since=story.at(3), until=story.at(6))] == [4, 5, 6]
    assert [e.seq for e in history.events(since=story.at(13))] == [14, 15]
    assert [e.seq for e in history.events(until=story.at(1))] == [1]
    assert list(history.events(since=story.at(6), until=story.at(6))) == []


def test_events_after_seq(history: Journal) -> None:
    assert [e.seq for e in history.events(after_seq=12)] == [13, 14, 15]
    assert [e.seq for e in history.events(call_id="c-retry", after_seq=13)] == [14, 15]
    assert list(history.events(after_seq=15)) == []


def test_a_call_never_seen_has_no_events(history: Journal) -> None:
    assert list(history.events(call_id="never-seen")) == []
    assert history.call_events("never-seen") == []
    assert history.count_events(call_id="never-seen") == 0


def test_call_events_hold_every_event_of_the_call_refusals_and_replays_too(history: Journal) -> None:
    assert [e.kind for e in history.call_events("c-ok")] == ["pending", "committed", "replayed"]
    assert [e.kind for e in history.call_events("c-refused")] == ["refused"]
    assert history.call_events("c-retry") == list(history.events(call_id="c-retry"))


def test_event_rows_are_the_stored_form_of_events(history: Journal, story: History) -> None:
    stored: Any = history  # event_rows: beside the operator's API, what exports and archives read
    rows = list(stored.event_rows(tool="charge"))
    events = list(history.events(tool="charge"))
    assert [r[0] for r in rows] == [e.seq for e in events]
    assert [r[1] for r in rows] == [e.at.isoformat(timespec="microseconds")[:-6] + "Z" for e in events]
    assert rows[0][1] == format_at(story.at(0))
    assert [r[-1] for r in rows] == [e.hash for e in events]
    assert list(stored.event_rows(call_id="never-seen")) == []


@pytest.mark.parametrize(("filters", "count"), [
    ({}, 15),
    ({"call_id": "c-ok"}, 3),
    ({"call_id": "c-refused"}, 1),
    ({"tool": "refund"}, 1),
    ({"agent_id": "agent-3"}, 1),
    ({"since": 10}, 5),
    ({"until": 1}, 1),
    ({"after_seq": 14}, 1),
    ({"tool": "charge", "agent_id": "agent-1", "since": 3}, 6),
    ({"call_id": "never-seen"}, 0),
])
def test_count_events_agrees_with_events(history: Journal, story: History, filters: dict[str, Any],
                                         count: int) -> None:
    filters = {k: story.at(v) if k in ("since", "until") else v for k, v in filters.items()}
    assert history.count_events(**filters) == len(list(history.events(**filters))) == count


def test_head_of_an_empty_and_of_a_used_journal(journal: Journal) -> None:
    assert journal.head() == (0, GENESIS)
    History().write(journal)
    last = list(journal.events())[-1]
    assert journal.head() == (15, last.hash)


def test_stats_count_calls_by_status_and_tool(history: Journal, story: History) -> None:
    stats = history.stats()
    assert (stats.calls, stats.events) == (6, 15)
    assert stats.by_status == {"committed": 3, "pending": 1, "released": 1, "unknown": 1}
    assert stats.by_tool == {"charge": 5, "read_balance": 1}
    assert (stats.oldest_pending_at, stats.oldest_unknown_at) == (story.at(10), story.at(4))


def test_stats_of_an_empty_journal_and_of_refusals_only(journal: Journal) -> None:
    stats = journal.stats()
    assert (stats.calls, stats.events, stats.by_status, stats.by_tool) == (0, 0, {}, {})
    assert (stats.oldest_pending_at, stats.oldest_unknown_at) == (None, None)
    journal.append(EffectEvent("refused", "r1", "refund", reason={"code": "policy_violation", "message": "no"}))
    stats = journal.stats()
    assert (stats.calls, stats.events, stats.by_tool) == (0, 1, {})


def test_stats_follow_the_calls_as_they_move(history: Journal) -> None:
    history.resolve("c-unknown", applied=False, reason="no charge", operator="ops")
    stats = history.stats()
    assert stats.by_status == {"committed": 3, "pending": 1, "released": 2}
    assert (stats.events, stats.oldest_unknown_at) == (16, None)


@pytest.mark.parametrize("tools", [1, 16, 17, 40])
def test_stats_count_each_tool_however_many_there_are(journal: Journal, tools: int) -> None:
    for n in range(tools * 2 + 1):
        call_id, tool = f"c{n:03d}", f"tool_{n % tools:02d}"
        journal.append(EffectEvent("pending", call_id, tool, agent_id="agent-1", attempt=1, arguments="{}"))
        if n % 3:
            journal.append(EffectEvent("committed", call_id, tool, attempt=1, value="1"))
    stats = journal.stats()
    assert stats.by_tool == {f"tool_{t:02d}": 2 + (t == 0) for t in range(tools)}
    expected = {"committed": sum(1 for n in range(tools * 2 + 1) if n % 3)}
    expected["pending"] = tools * 2 + 1 - expected["committed"]
    assert stats.by_status == expected and stats.calls == tools * 2 + 1


def test_texts_beyond_ascii_read_back_as_written(journal: Journal) -> None:
    event = EffectEvent("pending", "appel-é-🧾", "überweisung", agent_id="agent-ü", attempt=1,
                        arguments='{"memo":"naïve · ok"}', idempotency_key="b" * 64)
    journal.append(event)
    record = journal.call("appel-é-🧾")
    assert record is not None and (record.tool, record.agent_id, record.arguments) == (
        "überweisung", "agent-ü", '{"memo":"naïve · ok"}')
    assert [r.call_id for r in journal.calls(tool="überweisung", agent_id="agent-ü")] == ["appel-é-🧾"]
    assert [e.seq for e in journal.events(call_id="appel-é-🧾")] == [1]
    line = orjson.loads(exported(journal))
    assert (line["call_id"], line["arguments"]) == ("appel-é-🧾", {"memo": "naïve · ok"})
    assert journal.verify().ok


@pytest.mark.parametrize("text", ["c-ok\x00", "\x00", "c-\ud800"])
def test_a_text_no_call_can_have_finds_nothing(history: Journal, text: str) -> None:
    assert history.call(text) is None
    assert history.calls(status=text) == [] and history.calls(status=[text, "unknown"]) == history.calls(
        status="unknown")
    assert history.calls(tool=text) == [] and history.calls(agent_id=text) == []
    assert list(history.events(call_id=text)) == [] and history.call_events(text) == []
    assert history.count_events(tool=text) == 0 and history.count_events(agent_id=text) == 0
    assert exported(history, call_id=text) == b""


def test_a_journal_opened_read_only_reads_alike_and_refuses_writes(history: Journal, database: Database) -> None:
    before = state(history)
    with open_journal(database.target, readonly=True) as readonly:
        assert state(readonly) == before
        assert exported(readonly) == exported(history) and readonly.verify() == history.verify()
        assert readonly.stats() == history.stats()
        for write in (lambda: readonly.rebuild(),
                      lambda: readonly.resolve("c-unknown", applied=False, reason="r", operator="ops"),
                      lambda: readonly.append(EffectEvent("refused", "x", "charge")),
                      lambda: readonly.reconcile({"charge": lambda call: NotApplied(evidence="none")})):
            with pytest.raises(JournalError, match="read-only"):
                write()
    assert state(history) == before


def test_a_closed_journal_refuses_every_operation(history: Journal) -> None:
    history.close()
    history.close()  # closing twice is harmless
    for operation in (lambda: history.call("c-ok"), lambda: history.calls(), lambda: list(history.events()),
                      lambda: history.count_events(), lambda: history.head(), lambda: history.stats(),
                      lambda: exported(history), lambda: history.verify(), lambda: history.rebuild(),
                      lambda: history.resolve("c-unknown", applied=False, reason="r", operator="ops")):
        with pytest.raises(JournalError, match="closed"):
            operation()


def test_leaving_the_with_block_closes_the_journal(history: Journal, database: Database) -> None:
    with open_journal(database.target) as again:
        assert again.head() == history.head()
    with pytest.raises(JournalError, match="closed"):
        again.head()


# -- exports ---------------------------------------------------------------------------------------


def test_export_lines_are_one_json_line_an_event_that_verifies(history: Journal) -> None:
    batches = list(history.export_lines())
    assert sum(n for _, n in batches) == 15
    data = b"".join(lines for lines, _ in batches)
    lines = [orjson.loads(line) for line in data.splitlines()]
    assert [line["seq"] for line in lines] == list(range(1, 16))
    assert data.endswith(b"\n") and data.count(b"\n") == 15
    report = verify_export(data)
    assert (report.ok, report.events, report.head) == (True, 15, history.head()[1])


def test_an_export_line_holds_every_field_as_json_values(history: Journal, story: History) -> None:
    line = orjson.loads(exported(history, call_id="c-unknown").splitlines()[1])
    event = history.call_events("c-unknown")[1]
    assert line["at"] == format_at(story.at(4)) and line["at"].endswith("Z") and len(line["at"]) == 27
    assert line["arguments"] == {"account": "acct_1", "cents": 500}
    assert line["error"] == {"type": "TimeoutError", "message": "no answer"}
    assert (line["value"], line["value_sha256"], line["reason"], line["redacted"]) == (None, None, None, [])
    assert line["owner"] == OWNER
    assert line == event.export()
    assert set(line) == {"seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "arguments",
                         "arguments_sha256", "value", "value_sha256", "error", "reason", "actor", "attempt",
                         "owner", "prev_hash", "hash", "redacted"}


@pytest.mark.parametrize("redact", [frozenset({"arguments"}), frozenset({"value"}), frozenset({"arguments", "value"})])
def test_a_redacted_export_blanks_the_fields_and_still_verifies(history: Journal, redact: frozenset[str]) -> None:
    plain = [orjson.loads(line) for line in exported(history).splitlines()]
    data = exported(history, redact=redact)
    lines = [orjson.loads(line) for line in data.splitlines()]
    assert verify_export(data).ok
    for before, after in zip(plain, lines, strict=True):
        assert after["redacted"] == sorted(redact)
        for name in redact:
            assert after[name] is None and after[f"{name}_sha256"] == before[f"{name}_sha256"]
        assert after["hash"] == before["hash"]
    assert b"ch_2" not in data if "value" in redact else b"ch_2" in data


def test_export_lines_filtered(history: Journal, story: History) -> None:
    by_call = exported(history, call_id="c-retry")
    assert [orjson.loads(line)["seq"] for line in by_call.splitlines()] == [12, 13, 14, 15]
    assert verify_export(by_call, allow_gaps=True).ok  # it starts past seq 1: a filtered export allows gaps
    by_agent = exported(history, agent_id="agent-2")
    assert [orjson.loads(line)["seq"] for line in by_agent.splitlines()] == [6, 7, 8, 9]
    by_tool = exported(history, tool="charge", since=story.at(3), until=story.at(12))
    seqs = [orjson.loads(line)["seq"] for line in by_tool.splitlines()]
    assert seqs == [4, 5, 6, 7, 11, 12]
    assert not verify_export(by_tool).ok  # a gap, unless gaps are allowed
    assert verify_export(by_tool, allow_gaps=True).ok
    assert exported(history, call_id="never-seen") == b""


def test_an_empty_journal_exports_nothing_and_a_csv_header(journal: Journal) -> None:
    assert list(journal.export_lines()) == []
    assert exported_csv(journal) == (",".join(CSV_COLUMNS) + "\n").encode()


@pytest.mark.parametrize("export", ["export_lines", "export_csv"])
def test_an_export_refuses_a_field_it_cannot_redact(history: Journal, export: str) -> None:
    with pytest.raises(ValueError, match="cannot redact owner"):
        b"".join(lines for lines, _ in getattr(history, export)(redact=frozenset({"owner"})))


def test_export_csv_has_a_header_and_a_row_an_event(history: Journal) -> None:
    batches = list(history.export_csv())
    assert sum(n for _, n in batches) == 15
    rows = list(csv.reader(io.StringIO(b"".join(lines for lines, _ in batches).decode(), newline="")))
    assert rows[0] == list(CSV_COLUMNS)
    assert len(rows) == 16
    lines = [orjson.loads(line) for line in exported(history).splitlines()]
    for row, line in zip(rows[1:], lines, strict=True):
        cell = dict(zip(CSV_COLUMNS, row, strict=True))
        assert int(cell["seq"]) == line["seq"] and cell["at"] == line["at"] and cell["hash"] == line["hash"]
        assert cell["call_id"] == (line["call_id"] or "") and cell["attempt"] == str(line["attempt"])
        for name in ("arguments", "value", "error", "reason", "owner"):
            assert (orjson.loads(cell[name]) if cell[name] else None) == line[name]
        assert cell["redacted"] == "[]"
    assert dict(zip(CSV_COLUMNS, rows[15], strict=True))["value"] == '{"charge_id":"ch_2","note":"a, \\"b\\""}'


def test_export_csv_redacts_and_filters(history: Journal) -> None:
    rows = list(csv.reader(io.StringIO(exported_csv(history, redact=frozenset({"arguments", "value"}),
                                                    call_id="c-ok").decode(), newline="")))
    assert len(rows) == 4
    cells = [dict(zip(CSV_COLUMNS, row, strict=True)) for row in rows[1:]]
    assert [c["kind"] for c in cells] == ["pending", "committed", "replayed"]
    assert all(c["arguments"] == "" and c["value"] == "" for c in cells)
    assert all(len(c["arguments_sha256"]) == 64 for c in cells) and len(cells[1]["value_sha256"]) == 64
    assert all(c["redacted"] == '["arguments","value"]' for c in cells)
    only_header = exported_csv(history, tool="no-such-tool")
    assert only_header == (",".join(CSV_COLUMNS) + "\n").encode()


# -- the same content gives the same bytes on every store -------------------------------------------


@pytest.fixture(params=[p for p in JOURNAL_PARAMS if p.values != ("sqlite",)])
def other_store(request: pytest.FixtureRequest) -> str:
    """Each store but SQLite, to be compared with it."""
    journal_factory(request)
    return str(request.param)


@pytest.mark.parametrize("export", [
    {"format": "jsonl"},
    {"format": "csv"},
    {"format": "jsonl", "redact": frozenset({"arguments", "value"})},
    {"format": "csv", "redact": frozenset({"value"}), "agent_id": "agent-1"},
    {"format": "jsonl", "tool": "charge", "since": 3, "until": 13},
])
def test_every_store_exports_the_history_sqlite_exports_byte_for_byte(tmp_path: Path, other_store: str,
                                                                      export: dict[str, Any]) -> None:
    story = History()
    filters = {k: story.at(v) if k in ("since", "until") else v for k, v in export.items() if k != "format"}
    outputs = []
    for name in (other_store, "sqlite"):
        made = JOURNAL_FACTORIES[name]
        with made.open(made.target(tmp_path, f"{name}.db")) as journal:
            story.write(journal)
            outputs.append((exported(journal, **filters) if export["format"] == "jsonl"
                            else exported_csv(journal, **filters), journal.head(), journal.verify(),
                            journal.calls(limit=None), journal.stats()))
    assert outputs[0][0]  # not two empty exports
    assert outputs[0] == outputs[1]


# -- verify ----------------------------------------------------------------------------------------


def test_verify_of_a_fresh_journal(journal: Journal) -> None:
    report = journal.verify()
    assert (report.ok, report.events, report.head, report.first_bad_seq, report.problem) == (
        True, 0, GENESIS, None, None)


def test_verify_of_a_used_journal(history: Journal) -> None:
    report = history.verify()
    assert (report.ok, report.events, report.head, report.first_bad_seq) == (True, 15, history.head()[1], None)


def test_verify_with_a_progress_callback_gives_the_same_report(history: Journal) -> None:
    told: list[int] = []
    assert history.verify(advance=told.append) == history.verify()
    assert sum(told) <= 15  # told of whole stretches checked, never of more events than there are


def test_verify_of_a_journal_the_guard_wrote(tools: Tools, journal: Journal) -> None:
    report = journal.verify()
    assert report.ok and report.events == journal.count_events() == journal.head()[0]


@pytest.mark.parametrize(("statement", "call_id"), [
    ("UPDATE calls SET status = 'released' WHERE call_id = 'c-ok'", "c-ok"),
    ("UPDATE calls SET value = '{\"charge_id\":\"ch_9\"}' WHERE call_id = 'c-retry'", "c-retry"),
    ("UPDATE calls SET error = NULL WHERE call_id = 'c-unknown'", "c-unknown"),
    ("UPDATE calls SET agent_id = 'agent-9' WHERE call_id = 'c-read'", "c-read"),
])
def test_verify_finds_a_projection_row_changed_by_hand(history: Journal, database: Database, statement: str,
                                                        call_id: str) -> None:
    record = history.call(call_id)
    assert record is not None
    assert database.execute(statement) == 1
    report = history.verify()
    assert (report.ok, report.first_bad_seq) == (False, record.last_seq)
    assert repr(call_id) in (report.problem or "") and "run rebuild" in (report.problem or "")


def test_verify_finds_a_projection_row_deleted_by_hand(history: Journal, database: Database) -> None:
    assert database.execute("DELETE FROM calls WHERE call_id = 'c-unknown'") == 1
    report = history.verify()
    assert (report.ok, report.first_bad_seq) == (False, 5)
    assert report.problem == "the projection lacks call 'c-unknown'; run rebuild"


def test_verify_finds_a_projection_row_added_by_hand(history: Journal, database: Database) -> None:
    database.execute("INSERT INTO calls SELECT 'c-forged', tool, status, attempt, agent_id, idempotency_key, "
                     "arguments, value, error, reason, actor, owner, created_at, updated_at, since, last_seq "
                     "FROM calls WHERE call_id = 'c-ok'")
    report = history.verify()
    assert not report.ok and "'c-forged'" in (report.problem or "")


@pytest.mark.parametrize("statement", [
    "UPDATE events SET value = '{\"charge_id\":\"ch_9\"}' WHERE seq = 2",
    "UPDATE events SET kind = 'released' WHERE seq = 15",
    "DELETE FROM events WHERE seq = 1",
    "DELETE FROM events",
])
def test_the_database_itself_refuses_to_change_an_event(history: Journal, database: Database,
                                                         statement: str) -> None:
    before = state(history)
    events = list(history.events())
    with pytest.raises(database.append_only_error, match="append-only"):
        database.execute(statement)
    assert state(history) == before and list(history.events()) == events
    assert history.verify().ok


# -- rebuild ---------------------------------------------------------------------------------------


def test_rebuild_restores_a_row_changed_by_hand(history: Journal, database: Database) -> None:
    calls = history.calls(limit=None)
    database.execute("UPDATE calls SET status = 'released', value = NULL WHERE call_id = 'c-ok'")
    assert history.call("c-ok").status == "released"  # type: ignore[union-attr]
    assert history.rebuild() == 6
    assert history.calls(limit=None) == calls
    assert history.verify().ok


def test_rebuild_restores_a_row_deleted_and_drops_one_forged(history: Journal, database: Database) -> None:
    calls = history.calls(limit=None)
    database.execute("DELETE FROM calls WHERE call_id = 'c-pending'")
    database.execute("INSERT INTO calls SELECT 'c-forged', tool, status, attempt, agent_id, idempotency_key, "
                     "arguments, value, error, reason, actor, owner, created_at, updated_at, since, last_seq "
                     "FROM calls WHERE call_id = 'c-ok'")
    assert history.rebuild() == 6
    assert history.calls(limit=None) == calls and history.call("c-forged") is None
    assert history.verify().ok


def test_rebuild_of_a_sound_journal_changes_nothing(history: Journal) -> None:
    before = state(history)
    told: list[int] = []
    assert history.rebuild(advance=told.append) == 6
    assert state(history) == before and history.verify().ok
    assert sum(told) <= 15


def test_rebuild_refuses_a_field_it_cannot_read_and_keeps_the_projection(history: Journal,
                                                                         database: Database) -> None:
    database.execute("UPDATE calls SET status = 'released' WHERE call_id = 'c-unknown'")
    before = database.rows("SELECT * FROM calls ORDER BY call_id")
    database.execute(database.lift_append_only)
    database.execute("UPDATE events SET owner = '{not json' WHERE seq = 2")  # c-ok's committed
    with pytest.raises(JournalError, match="cannot be read"):
        history.rebuild()
    assert database.rows("SELECT * FROM calls ORDER BY call_id") == before


def test_rebuild_tells_its_progress_up_to_every_event(journal: Journal) -> None:
    for n in range(7_000):  # 2 calls in 3 commit and are replayed: some events change no record
        journal.append(EffectEvent("pending", f"c{n:05d}", "charge", agent_id="agent-1", attempt=1, arguments="{}"))
        if n % 3:
            journal.append(EffectEvent("committed", f"c{n:05d}", "charge", attempt=1, value="1"))
            journal.append(EffectEvent("replayed", f"c{n:05d}", "charge", attempt=1))
    before = journal.calls(limit=None)
    told: list[int] = []
    assert journal.rebuild(advance=told.append) == 7_000
    assert sum(told) == journal.head()[0] and len(told) >= 2
    assert journal.calls(limit=None) == before and journal.verify().ok


def test_rebuild_of_an_empty_journal(journal: Journal) -> None:
    assert journal.rebuild() == 0
    assert journal.verify().ok and journal.calls() == []


# -- resolve ---------------------------------------------------------------------------------------


def test_resolve_applied_with_a_value_commits_it_and_replays_return_it(tools: Tools, journal: Journal) -> None:
    head = journal.head()
    event = journal.resolve("call-timeout", applied=True, reason="ledger shows ch_2", operator="alice",
                            value='{"charge_id": "ch_2", "cents": 700}')
    assert (event.seq, event.prev_hash, event.kind, event.actor, event.attempt) == (
        head[0] + 1, head[1], "committed", "operator:alice", 1)
    assert event.value == '{"cents":700,"charge_id":"ch_2"}'
    assert event.reason == {"code": "applied", "message": "ledger shows ch_2"}
    assert journal.head() == (event.seq, event.hash) and journal.call_events("call-timeout")[-1] == event
    record = journal.call("call-timeout")
    assert record is not None and (record.status, record.value, record.actor) == (
        "committed", event.value, "operator:alice")
    again = Tools(journal)
    assert again.call("call-timeout", again.charge, account="acct_2", cents=700) == {"charge_id": "ch_2", "cents": 700}
    assert again.payments.charges == []
    assert journal.verify().ok


@pytest.mark.parametrize(("given", "stored", "replayed"), [
    ('{"b": 1, "a": 2}', '{"a":2,"b":1}', {"a": 2, "b": 1}),
    ("null", "null", None),
    ('"\\u00e9t\\u00e9"', '"été"', "été"),
    ("[1, 2.5, true, \"x\"]", '[1,2.5,true,"x"]', [1, 2.5, True, "x"]),
    ("0", "0", 0),
])
def test_a_resolved_value_is_stored_canonical_exported_and_replayed(
    tools: Tools, journal: Journal, given: str, stored: str, replayed: Any
) -> None:
    event = journal.resolve("call-timeout", applied=True, reason="r", operator="ops", value=given)
    assert event.value == stored and journal.call("call-timeout").value == stored  # type: ignore[union-attr]
    line = orjson.loads(exported(journal, call_id="call-timeout").splitlines()[-1])
    assert line["value"] == replayed and line["value_sha256"] is not None
    assert verify_export(exported(journal)).ok and journal.verify().ok
    again = Tools(journal)
    assert again.call("call-timeout", again.charge, account="acct_2", cents=700) == replayed
    assert again.payments.charges == []


def test_resolve_applied_without_a_value_makes_replays_refused(tools: Tools, journal: Journal) -> None:
    event = journal.resolve("call-timeout", applied=True, reason="ledger has it", operator="alice")
    assert (event.kind, event.value) == ("committed", None)
    again = Tools(journal)
    refused = again.call("call-timeout", again.charge, account="acct_2", cents=700)
    assert refused["block_reason"] == "replay_value_unavailable" and again.payments.charges == []


def test_resolve_not_applied_releases_and_the_call_runs_again(tools: Tools, journal: Journal) -> None:
    event = journal.resolve("call-timeout", applied=False, reason="no such charge", operator="bob")
    assert (event.kind, event.actor, event.value, event.attempt) == ("released", "operator:bob", None, 1)
    assert event.reason == {"code": "not_applied", "message": "no such charge"}
    again = Tools(journal)
    assert again.call("call-timeout", again.charge, account="acct_2", cents=700) == {"charge_id": "ch_1", "cents": 700}
    assert again.payments.charges == [("acct_2", 700)]
    record = journal.call("call-timeout")
    assert record is not None and (record.status, record.attempt, record.actor) == ("committed", 2, "guard")
    assert journal.verify().ok


_REFUSED: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("nobody", {"applied": True}, CallNotFound, "has no call 'nobody'"),
    ("call-refused", {"applied": False}, CallNotFound, "has no call 'call-refused'"),
    ("call-ok", {"applied": False}, NotResolvable, "is committed"),
    ("call-read", {"applied": True, "value": "1"}, NotResolvable, "is committed"),
    ("call-failed", {"applied": True}, NotResolvable, "is released"),
    ("call-timeout", {"applied": False, "value": "1"}, ValueError, "only be given for a call whose effect was applied"),
    ("call-timeout", {"applied": True, "value": "{nope"}, ValueError, "not valid JSON"),
    ("call-timeout", {"applied": True, "value": ""}, ValueError, "not valid JSON"),
    ("call-timeout", {"applied": True, "value": '{"a": 1, "a": 2}'}, ValueError, "twice"),
    ("call-timeout", {"applied": True, "operator": ""}, ValueError, "operator"),
    ("call\x00timeout", {"applied": False}, CallNotFound, "has no call"),
    ("call-\ud800", {"applied": False}, CallNotFound, "has no call"),
]


@pytest.mark.parametrize(("call_id", "arguments", "error", "message"), _REFUSED,
                         ids=[f"{c}-{e.__name__}-{n}" for n, (c, _, e, _m) in enumerate(_REFUSED)])
def test_a_refused_resolve_raises_the_same_error_and_changes_nothing(
    tools: Tools, journal: Journal, call_id: str, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    given = {"reason": "checked", "operator": "ops", **arguments}
    before = state(journal)
    with pytest.raises(error, match=message) as raised:
        journal.resolve(call_id, **given)
    assert type(raised.value) is error
    with pytest.raises(error, match=message) as checked:
        journal.check_resolve(call_id, **given)
    assert type(checked.value) is error
    assert state(journal) == before
    assert journal.verify().ok


def test_a_pending_call_whose_owner_is_alive_is_resolved_only_with_force(journal: Journal) -> None:
    begin_pending(journal, "live")  # this process is its owner, and alive
    before = state(journal)
    for applied in (True, False):
        with pytest.raises(NotResolvable, match="alive"):
            journal.resolve("live", applied=applied, reason="r", operator="ops")
        with pytest.raises(NotResolvable, match="alive"):
            journal.check_resolve("live", applied=applied, reason="r", operator="ops")
    assert state(journal) == before
    journal.check_resolve("live", applied=False, reason="r", operator="ops", force=True)
    assert state(journal) == before
    event = journal.resolve("live", applied=False, reason="ledger is empty", operator="ops", force=True)
    assert event.kind == "released" and journal.call("live").status == "released"  # type: ignore[union-attr]


def test_a_pending_call_running_in_another_process_is_resolved_only_with_force(
    journal: Journal, database: Database
) -> None:
    with running_in_child(database.target, "elsewhere") as child:
        record = journal.call("elsewhere")
        assert record is not None and record.status == "pending"
        assert (record.owner or {}).get("pid") == child.pid
        before = state(journal)
        with pytest.raises(NotResolvable, match=f"pid {child.pid}"):
            journal.resolve("elsewhere", applied=True, reason="r", operator="ops")
        assert state(journal) == before
        event = journal.resolve("elsewhere", applied=True, reason="it went through", operator="ops", force=True)
        assert event.seq == before[0][0] + 1


def test_a_pending_call_whose_process_was_killed_is_resolved_without_force(
    journal: Journal, database: Database
) -> None:
    leave_pending(database.target, "orphan")
    journal.check_resolve("orphan", applied=False, reason="r", operator="ops")
    event = journal.resolve("orphan", applied=False, reason="no charge", operator="ops")
    assert (event.kind, event.attempt) == ("released", 1)
    assert [e.kind for e in journal.call_events("orphan")] == ["pending", "released"]


def test_a_resolved_call_cannot_be_resolved_again(tools: Tools, journal: Journal) -> None:
    journal.resolve("call-timeout", applied=False, reason="none", operator="ops")
    before = state(journal)
    with pytest.raises(NotResolvable, match="is released"):
        journal.resolve("call-timeout", applied=False, reason="none", operator="ops")
    assert state(journal) == before


def test_check_resolve_writes_nothing_and_works_read_only(tools: Tools, journal: Journal,
                                                         database: Database) -> None:
    before = state(journal)
    journal.check_resolve("call-timeout", applied=True, reason="r", operator="ops", value="1")
    assert state(journal) == before
    with open_journal(database.target, readonly=True) as readonly:
        readonly.check_resolve("call-timeout", applied=False, reason="r", operator="ops")
        with pytest.raises(NotResolvable):
            readonly.check_resolve("call-ok", applied=False, reason="r", operator="ops")
        with pytest.raises(JournalError, match="read-only"):
            readonly.resolve("call-timeout", applied=False, reason="r", operator="ops")
    assert state(journal) == before


# -- settle ----------------------------------------------------------------------------------------


def test_settle_chooses_on_the_current_record_and_appends(history: Journal) -> None:
    seen: list[Any] = []

    def choose(record: Any) -> EffectEvent:
        seen.append(record)
        return EffectEvent("released", "c-unknown", record.tool, attempt=record.attempt, actor="reconciler:test",
                           reason={"code": "not_applied", "message": "no charge"})

    seq = history.settle("c-unknown", choose)
    assert seq == 16 and len(seen) == 1
    assert (seen[0].status, seen[0].attempt, seen[0].last_seq) == ("unknown", 1, 5)
    record = history.call("c-unknown")
    assert record is not None and (record.status, record.actor, record.last_seq) == (
        "released", "reconciler:test", 16)
    assert history.verify().ok


def test_settle_that_chooses_nothing_writes_nothing(history: Journal) -> None:
    before = state(history)
    seen: list[Any] = []
    assert history.settle("c-unknown", lambda record: seen.append(record)) is None
    assert seen[0] == history.call("c-unknown")
    assert history.settle("never-seen", lambda record: seen.append(record)) is None
    assert seen[1] is None
    assert state(history) == before


def test_settle_raises_what_the_choice_raises_and_appends_nothing(history: Journal) -> None:
    before = state(history)

    def choose(record: Any) -> EffectEvent:
        raise RuntimeError("the backend is down")

    with pytest.raises(RuntimeError, match="the backend is down"):
        history.settle("c-unknown", choose)
    assert state(history) == before


# -- owner states and leases -----------------------------------------------------------------------


def test_owner_states_of_calls_without_leases(history: Journal) -> None:
    live = begin_pending(history, "live")
    records = [*history.calls(limit=None)]
    states = history.owner_states(records)
    assert set(states) == {r.call_id for r in records}
    assert (states["live"].alive, states["live"].lease_expires_at) == (True, None)
    # Its owner's host is not this one and it took no lease: nothing says it stopped.
    assert states["c-pending"].alive is True
    for call_id in ("c-ok", "c-unknown", "c-released", "c-read", "c-retry"):
        assert (states[call_id].alive, states[call_id].lease_expires_at) == (None, None)
    assert history.owner_states([]) == {}
    assert live.status == "pending"


def test_a_lease_decides_whether_an_unseen_owner_is_alive(journal: Journal) -> None:
    live = begin_pending(journal, "live", owner={"host": "elsewhere", "pid": 1, "lease": "h1"})
    journal.take_lease("live", "h1", 3600)
    state_ = journal.owner_states([live])["live"]
    assert state_.alive is True and state_.lease_expires_at is not None
    assert state_.lease_expires_at > datetime.now(UTC) + timedelta(minutes=30)
    journal.drop_lease("live", "h1")
    journal.take_lease("live", "h1", 0)  # run out at once, and its process cannot be seen: gone
    assert journal.owner_states([live])["live"].alive is False
    journal.check_resolve("live", applied=False, reason="r", operator="ops")
    assert journal.resolve("live", applied=False, reason="lease ran out", operator="ops").kind == "released"


def test_owner_states_of_many_calls_at_once(journal: Journal) -> None:
    records = [begin_pending(journal, f"p{n:04d}", owner={"host": "elsewhere", "pid": 1, "lease": "h1"})
               for n in range(1203)]
    for n in range(0, 1203, 3):  # a live lease on every third call, one run out on every third after it
        journal.take_lease(f"p{n:04d}", "h1", 3600)
        if n + 1 < 1203:
            journal.take_lease(f"p{n + 1:04d}", "h1", 0)
    states = journal.owner_states(records)
    assert [states[f"p{n:04d}"].alive for n in range(1203)] == [n % 3 == 0 for n in range(1203)]
    assert [states[f"p{n:04d}"].lease_expires_at is None for n in range(1203)] == [n % 3 == 2 for n in range(1203)]


def test_a_lease_left_on_a_call_that_ended_is_not_its_owner_state(history: Journal) -> None:
    history.take_lease("c-ok", "h1", 3600)  # as a guard killed after its commit, before dropping it
    record = history.call("c-ok")
    assert record is not None and record.status == "committed"
    assert history.owner_states([record])["c-ok"] == OwnerState(None, None)


def test_a_live_lease_refuses_a_resolve_without_force(journal: Journal) -> None:
    begin_pending(journal, "leased", owner={"host": "elsewhere", "pid": 1, "lease": "h1"})
    journal.take_lease("leased", "h1", 3600)
    before = state(journal)
    with pytest.raises(NotResolvable, match="lease"):
        journal.resolve("leased", applied=True, reason="r", operator="ops")
    assert state(journal) == before
    assert journal.resolve("leased", applied=True, reason="r", operator="ops", force=True).kind == "committed"


def test_the_lease_of_a_killed_process_keeps_its_call_until_it_runs_out(journal: Journal,
                                                                        database: Database) -> None:
    with running_in_child(database.target, "leased", lease=3600) as child:
        kill(child)
    record = journal.call("leased")
    assert record is not None and record.status == "pending"
    owner = journal.owner_states([record])["leased"]
    assert owner.alive is True and owner.lease_expires_at is not None
    with pytest.raises(NotResolvable, match="lease has not run out"):
        journal.resolve("leased", applied=False, reason="r", operator="ops")


def test_renew_and_drop_a_lease(journal: Journal) -> None:
    record = begin_pending(journal, "p", owner={"host": "elsewhere", "pid": 1, "lease": "h1"})
    assert journal.renew_lease("p", "h1", 60) is False  # no lease to renew
    journal.take_lease("p", "h1", 60)
    first = journal.owner_states([record])["p"].lease_expires_at
    assert journal.renew_lease("p", "h1", 7200) is True
    renewed = journal.owner_states([record])["p"].lease_expires_at
    assert first is not None and renewed is not None and renewed > first + timedelta(minutes=60)
    assert journal.renew_lease("p", "h2", 60) is False  # another holder has none
    journal.drop_lease("p", "h1")
    assert journal.renew_lease("p", "h1", 60) is False
    assert journal.owner_states([record])["p"].lease_expires_at is None
    journal.drop_lease("p", "h1")  # dropping twice is harmless
    assert journal.count_events() == 1  # leases are never events


def test_leases_are_per_holder(history: Journal) -> None:
    assert history.claim_lease("never-seen", "h1", 60) is True  # a call not begun yet can be claimed
    assert history.claim_lease("never-seen", "h2", 60) is False
    history.take_lease("c-pending", "h1", 3600)
    history.drop_lease("c-pending", "h2")  # another holder's drop leaves h1's lease
    pending = history.call("c-pending")
    assert pending is not None and history.owner_states([pending])["c-pending"].alive is True
    history.take_lease("c-unknown", "h1", 0)
    assert history.renew_lease("c-unknown", "h1", 60) is True  # run out, but still h1's until dropped
    assert history.count_events() == 15


def test_claim_a_lease_one_holder_at_a_time(history: Journal) -> None:
    assert history.claim_lease("c-unknown", "h1", 3600) is True
    assert history.claim_lease("c-unknown", "h2", 3600) is False  # h1's is alive
    assert history.claim_lease("c-unknown", "h1", 3600) is True  # its own, taken again
    history.drop_lease("c-unknown", "h1")
    assert history.claim_lease("c-unknown", "h2", 3600) is True
    history.take_lease("c-released", "h1", 0)  # run out
    assert history.claim_lease("c-released", "h2", 60) is True


def test_a_pending_call_whose_owner_is_alive_cannot_be_claimed(journal: Journal, database: Database) -> None:
    begin_pending(journal, "live")
    assert journal.claim_lease("live", "checker", 60) is False
    leave_pending(database.target, "orphan")
    assert journal.claim_lease("orphan", "checker", 60) is True
    assert journal.claim_lease("orphan", "another", 60) is False


# -- reconcile -------------------------------------------------------------------------------------


class Backend:
    """What a backend says of each call, by call id: ``applied``, ``not_applied`` or nothing."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.asked: list[InDoubtCall] = []

    def check(self, call: InDoubtCall) -> Applied | NotApplied | None:
        self.asked.append(call)
        answer = self.answers.get(call.call_id)
        if answer == "applied":
            return Applied(value={"charge_id": f"ch_{call.call_id}"}, evidence=f"found {call.idempotency_key}")
        if answer == "not_applied":
            return NotApplied(evidence="no charge")
        if answer == "raise":
            raise ConnectionError("the backend is down")
        return None


def in_doubt(journal: Journal, *call_ids: str) -> None:
    for call_id in call_ids:
        begin_pending(journal, call_id)
        journal.append(EffectEvent("unknown", call_id, "charge", attempt=1,
                                   error={"type": "TimeoutError", "message": "lost"}))


def test_reconcile_settles_as_the_backend_answers(journal: Journal) -> None:
    in_doubt(journal, "u-yes", "u-no", "u-maybe")
    backend = Backend({"u-yes": "applied", "u-no": "not_applied"})
    head = journal.head()[0]
    results = journal.reconcile({"charge": backend.check})
    assert [(r.call_id, r.outcome) for r in results] == [
        ("u-yes", "applied"), ("u-no", "not_applied"), ("u-maybe", "still_unknown")]
    assert [r.seq for r in results] == [head + 1, head + 2, None]
    assert [c.status for c in backend.asked] == ["unknown"] * 3
    yes, no, maybe = (journal.call(c) for c in ("u-yes", "u-no", "u-maybe"))
    assert yes is not None and (yes.status, yes.value, yes.actor) == (
        "committed", '{"charge_id":"ch_u-yes"}', "reconciler:Backend.check")
    assert yes.reason == {"code": "applied", "message": f"found {'a' * 64}"}
    assert no is not None and (no.status, no.reason) == ("released", {"code": "not_applied", "message": "no charge"})
    assert maybe is not None and maybe.status == "unknown"
    assert journal.head()[0] == head + 2 and journal.verify().ok
    assert [r.call_id for r in journal.reconcile({"charge": backend.check})] == ["u-maybe"]


def test_reconcile_dry_run_asks_and_appends_nothing(journal: Journal) -> None:
    in_doubt(journal, "u-yes", "u-no")
    before = state(journal)
    results = journal.reconcile({"charge": Backend({"u-yes": "applied", "u-no": "not_applied"}).check},
                                dry_run=True)
    assert [(r.outcome, r.seq) for r in results] == [("applied", None), ("not_applied", None)]
    assert state(journal) == before


def test_reconcile_reports_a_failing_check_and_a_tool_without_one(journal: Journal) -> None:
    in_doubt(journal, "u-down")
    before = state(journal)
    results = journal.reconcile({"charge": Backend({"u-down": "raise"}).check})
    assert [r.outcome for r in results] == ["error"] and "ConnectionError" in results[0].message
    results = journal.reconcile({"refund": Backend({}).check})
    assert [(r.outcome, r.message) for r in results] == [("skipped", "no check for the tool 'charge'")]
    assert state(journal) == before


def test_reconcile_filters_by_tool_and_age(history: Journal) -> None:
    backend = Backend({"c-unknown": "not_applied"})
    assert history.reconcile({"charge": backend.check}, tool="read_balance") == []
    assert history.reconcile({"charge": backend.check}, older_than=timedelta(days=1)) == []
    assert backend.asked == []
    results = history.reconcile({"charge": backend.check}, tool="charge", older_than=0)
    assert ("c-unknown", "not_applied") in [(r.call_id, r.outcome) for r in results]
    assert [c.call_id for c in backend.asked if c.call_id == "c-unknown"] == ["c-unknown"]
    assert history.call("c-unknown").status == "released"  # type: ignore[union-attr]


def test_reconcile_refuses_checks_and_ages_it_cannot_use(history: Journal) -> None:
    before = state(history)
    with pytest.raises(TypeError, match="mapping of tool name to check"):
        history.reconcile({"charge": "not a check"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="not negative"):
        history.reconcile({"charge": Backend({}).check}, older_than=-1)
    with pytest.raises(TypeError, match="timedelta or a number of seconds"):
        history.reconcile({"charge": Backend({}).check}, older_than="10m")  # type: ignore[arg-type]
    assert state(history) == before


def test_reconcile_never_asks_about_a_pending_call_of_another_host_without_a_lease(history: Journal) -> None:
    backend = Backend({"c-unknown": "not_applied", "c-pending": "not_applied"})
    results = {r.call_id: r for r in history.reconcile({"charge": backend.check})}
    assert (results["c-pending"].outcome, results["c-pending"].seq) == ("skipped", None)
    assert [c.call_id for c in backend.asked] == ["c-unknown"]
    assert history.call("c-pending").status == "pending"  # type: ignore[union-attr]
    assert history.claim_lease("c-pending", "checker", 60) is False  # its owner cannot be seen from here


def test_reconcile_never_asks_about_a_call_whose_owner_is_alive(journal: Journal, database: Database) -> None:
    begin_pending(journal, "live")
    leave_pending(database.target, "orphan")
    backend = Backend({"live": "applied", "orphan": "not_applied"})
    results = {r.call_id: r for r in journal.reconcile({"charge": backend.check})}
    assert results["live"].outcome == "skipped" and "alive" in results["live"].message
    assert results["orphan"].outcome == "not_applied"
    assert [c.call_id for c in backend.asked] == ["orphan"] and backend.asked[0].status == "pending"
    assert journal.call("live").status == "pending"  # type: ignore[union-attr]
    assert journal.call("orphan").status == "released"  # type: ignore[union-attr]


# -- archive ---------------------------------------------------------------------------------------


def test_plan_archive_takes_the_events_before_a_time_never_the_last(history: Journal, story: History) -> None:
    plan = plan_archive(history, story.at(5))
    assert plan is not None and (plan.base_seq, plan.last_seq) == (0, 5)
    assert plan.last_hash == list(history.events())[4].hash
    assert plan_archive(history, story.at(0)) is None
    whole = plan_archive(history, story.at(60))
    assert whole is not None and whole.last_seq == 14  # the last event stays


def test_after_an_archive_the_journal_verifies_rebuilds_and_keeps_every_call(
    history: Journal, database: Database, tmp_path: Path
) -> None:
    cut = begin_pending(history, "c-now").created_at  # written after the history: the archive takes it all
    before = exported(history)
    calls = history.calls(limit=None)
    output = tmp_path / "a1.jsonl"
    done = invoke("journal", "archive", "--db", database.target, "--before", cut.isoformat(), "-o", str(output))
    assert done.exit_code == 0, done.output
    archived = output.read_bytes()
    assert archived.splitlines() == before.splitlines()[:15]
    assert verify_export(archived).ok
    report = history.verify()
    assert (report.ok, report.events, report.head) == (True, 1, history.head()[1])
    assert history.head()[0] == 16 and [e.seq for e in history.events()] == [16]
    assert history.count_events() == 1 and history.count_events(call_id="c-ok") == 0
    stats = history.stats()
    assert (stats.events, stats.calls) == (16, 7)  # every event ever recorded; every call
    assert history.calls(limit=None) == calls  # every call keeps its row
    assert history.call("c-ok") is not None and history.call("c-ok").status == "committed"  # type: ignore[union-attr]
    assert history.rebuild() == 7
    assert history.calls(limit=None) == calls and history.verify().ok
    # A row of an archived call changed by hand is found, and rebuild restores it.
    database.execute("UPDATE calls SET status = 'released' WHERE call_id = 'c-retry'")
    assert not history.verify().ok
    assert history.rebuild() == 7 and history.calls(limit=None) == calls and history.verify().ok


def test_an_archived_call_is_resolved_and_replayed_as_before(tools: Tools, journal: Journal, database: Database,
                                                             tmp_path: Path) -> None:
    tools.call("call-later", tools.charge, account="acct_5", cents=5)
    cut = journal.call("call-later").created_at  # type: ignore[union-attr]
    done = invoke("journal", "archive", "--db", database.target, "--before", cut.isoformat(),
                  "-o", str(tmp_path / "a.jsonl"))
    assert done.exit_code == 0, done.output
    assert journal.call_events("call-ok") == []  # its events moved out
    again = Tools(journal)
    assert again.call("call-ok", again.charge, account="acct_1", cents=500) == {"charge_id": "ch_1", "cents": 500}
    journal.resolve("call-timeout", applied=False, reason="none at the backend", operator="ops")
    assert journal.call("call-timeout").status == "released"  # type: ignore[union-attr]
    assert again.payments.charges == [] and journal.verify().ok
