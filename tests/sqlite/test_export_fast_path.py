"""The SQLite journal's JSON Lines export (lines built by SQLite a page at a time, read ahead on a
thread, digests added in Python) writes byte for byte what the row path writes: jsonl_lines over
event_rows, each line kept one line. On values that are awkward to write: characters beyond
ASCII, line and paragraph separators, nulls, JSON null, large arguments, redaction, filters, and
stored texts altered by hand."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from guard.canonical import canonical_json
from guard.store import EffectEvent, current_owner
from journal import JournalError, SQLiteJournal
from journal.export import LineCloser, jsonl_lines, one_line_each
from journal.reading import LogReader

REDACTIONS = [frozenset(), frozenset({"arguments"}), frozenset({"value"}), frozenset({"arguments", "value"})]

AWKWARD = [
    "plain", "café ☕ 😀", "line\u2028separator", "para\u2029graph", "next\x85line", "tab\tnew\nline\r",
    'quote " and \\ backslash', "nul \x00 and \x01 control", "", "comma, and } brace ]",
]


def fast(journal: SQLiteJournal, **filters: Any) -> bytes:
    return b"".join(chunk for chunk, _ in journal.export_lines(**filters))


def row_path(journal: SQLiteJournal, redact: frozenset[str] = frozenset(), **filters: Any) -> bytes:
    return one_line_each(b"".join(jsonl_lines(journal.event_rows(**filters), redact)))


def seed(journal: SQLiteJournal, calls: int) -> None:
    """Calls that commit, fail, are refused or stay pending, with awkward text in every field that takes it."""
    for n in range(calls):
        text = AWKWARD[n % len(AWKWARD)]
        call_id = f"call-{n}-{text}" if n % 7 else f"call-{n}"
        agent = None if n % 5 == 0 else f"agent-{text}"
        arguments = canonical_json({"note": text, "n": n % 40, "nested": [None, True, 1.5, {"é": text}]})
        if n % 97 == 3:
            arguments = canonical_json({"blob": "x" * 300_000 + text, "n": n})  # larger than a page of others
        journal.append(EffectEvent("pending", call_id, f"tool-{n % 3}", agent_id=agent, idempotency_key=f"k{n}",
                                   arguments=arguments, attempt=1, owner=current_owner()))
        if n % 4 == 0:
            journal.append(EffectEvent("unknown", call_id, f"tool-{n % 3}", agent_id=agent, arguments=arguments,
                                       error={"type": "TimeoutError", "message": text}, attempt=1,
                                       owner=current_owner()))
            journal.append(EffectEvent("refused", call_id, f"tool-{n % 3}", agent_id=agent,
                                       reason={"code": "effect_status_unknown", "message": text},
                                       owner=current_owner()))
        elif n % 4 == 1:
            value = "null" if n % 8 == 1 else canonical_json({"text": text, "list": [text, None, 0]})
            journal.append(EffectEvent("committed", call_id, f"tool-{n % 3}", agent_id=agent, arguments=arguments,
                                       value=value, attempt=1, owner=current_owner()))
            journal.append(EffectEvent("replayed", call_id, f"tool-{n % 3}", agent_id=agent, arguments=arguments,
                                       owner=current_owner()))
        elif n % 4 == 2:
            journal.append(EffectEvent("refused", None, f"tool-{n % 3}", agent_id=agent,
                                       reason={"code": "tool_denied", "message": text}, owner=current_owner()))


@pytest.fixture(scope="module")
def awkward(tmp_path_factory: pytest.TempPathFactory) -> Any:
    journal = SQLiteJournal(tmp_path_factory.mktemp("fast") / "j.db", durability="process")
    seed(journal, 400)  # about 700 events: several pages, some far larger than others
    yield journal
    journal.close()


@pytest.mark.parametrize("redact", REDACTIONS, ids=lambda r: ",".join(sorted(r)) or "none")
def test_the_fast_path_writes_the_row_paths_bytes(awkward: SQLiteJournal, redact: frozenset[str]) -> None:
    written = fast(awkward, redact=redact)
    assert written == row_path(awkward, redact)
    assert written == b"".join(chunk for chunk, _ in LogReader(awkward.datastore).export_lines(redact=redact))
    lines = written.decode().splitlines()  # every event one line, separators included
    assert len(lines) == awkward.count_events()
    events = [orjson.loads(line) for line in lines]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert {e["call_id"] for e in events} >= {"call-2-line\u2028separator", "call-3-para\u2029graph"}
    assert any(e["value"] is None and e["value_sha256"] == hashlib.sha256(b"null").hexdigest() for e in events)
    big = next(e for e in events if e["call_id"] == "call-3-para\u2029graph" and e["kind"] == "pending")
    stored = next(row[7] for row in awkward.event_rows(call_id="call-3-para\u2029graph"))
    assert len(stored) > 300_000 and big["arguments_sha256"] == hashlib.sha256(stored.encode()).hexdigest()
    assert big["arguments"] == (None if "arguments" in redact else orjson.loads(stored))
    assert big["redacted"] == sorted(redact)


def test_filters_give_the_row_paths_bytes(awkward: SQLiteJournal) -> None:
    for filters in ({"tool": "tool-1"}, {"call_id": "call-1-café ☕ 😀"}, {"agent_id": "agent-café ☕ 😀"},
                    {"tool": "no such tool"},
                    {"call_id": "call-2-line\u2028separator", "redact": frozenset({"value"})}):
        assert fast(awkward, **filters) == row_path(awkward, **filters), filters
    assert fast(awkward, tool="no such tool") == b""


def test_batches_count_their_events_and_stay_near_a_megabyte(awkward: SQLiteJournal) -> None:
    batches = list(awkward.export_lines())
    assert sum(n for _, n in batches) == awkward.count_events()
    for chunk, n in batches:
        assert chunk.count(b"\n") == n
    assert all(len(chunk) < 8 << 20 for chunk, _ in batches)


def _alter(journal: SQLiteJournal, sql: str) -> None:
    conn = sqlite3.connect(journal.path, isolation_level=None)
    conn.execute("DROP TRIGGER IF EXISTS events_no_update")
    conn.execute(sql)
    conn.close()


def test_a_redacted_text_that_is_not_json_is_exported_as_the_row_path_does(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="process")
    seed(journal, 150)
    # Redacted, the arguments are not shown, only their digest: a text holding the character that
    # joins a page's fields must not shift the fields after it.
    _alter(journal, "UPDATE events SET arguments = 'not json \x01 at all\x01' WHERE seq = 40")
    _alter(journal, "UPDATE events SET value = '' WHERE seq = (SELECT min(seq) FROM events WHERE value IS NOT NULL)")
    redact = frozenset({"arguments", "value"})
    written = fast(journal, redact=redact)
    assert written == row_path(journal, redact)
    line = orjson.loads(written.splitlines()[39])
    assert line["arguments_sha256"] == hashlib.sha256(b"not json \x01 at all\x01").hexdigest()
    with pytest.raises(JournalError, match="arguments of event seq 40 are not JSON"):
        fast(journal, redact=frozenset({"value"}))
    journal.close()


def test_an_export_left_early_stops_its_reader(awkward: SQLiteJournal) -> None:
    before = {t.ident for t in threading.enumerate()}
    batches = awkward.export_lines()
    next(batches)
    batches.close()  # the writer failed, say
    assert {t.ident for t in threading.enumerate()} <= before
    assert fast(awkward) == row_path(awkward)  # the journal reads on as before


def test_remembered_digests_are_the_digests() -> None:
    closer = LineCloser()
    texts = [canonical_json({"n": n % 5000}) for n in range(12_000)] + ["x" * 5000, "x" * 5000, None]
    rows = [(n, '{"seq":1', text, None if n % 2 else text) for n, text in enumerate(texts)]
    by_rows = closer.lines(rows)
    by_page = closer.joined([line for _, line, _, _ in rows], [text or "" for _, _, text, _ in rows],
                            [value or "" for _, _, _, value in rows])
    assert by_page == by_rows
    for (_, _, text, value), line in zip(rows, by_rows.splitlines(), strict=True):
        closed = orjson.loads(line)
        digest = None if text is None else hashlib.sha256(text.encode()).hexdigest()
        assert closed["arguments_sha256"] == digest
        assert closed["value_sha256"] == (None if value is None else digest)
