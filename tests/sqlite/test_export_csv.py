"""The SQLite journal writes its CSV export itself: byte for byte what the row path writes (and
PostgreSQL, through it), quoted so that any CSV reader gives back every cell, special characters
included."""

from __future__ import annotations

import csv
import io
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guard.canonical import canonical_json
from guard.store import EffectEvent, current_owner
from journal import JournalError, SQLiteJournal
from journal.export import CSV_COLUMNS, csv_cell
from journal.reading import LogReader

TEXT = st.text(alphabet=st.sampled_from(list('ab ,"\r\n\t\'é€😀\\x')), max_size=8)


def _row_path(journal: SQLiteJournal, **kwargs: Any) -> bytes:
    return b"".join(chunk for chunk, _ in LogReader(journal.datastore).export_csv(**kwargs))


def _sqlite_path(journal: SQLiteJournal, **kwargs: Any) -> bytes:
    return b"".join(chunk for chunk, _ in journal.export_csv(**kwargs))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(TEXT, TEXT, TEXT, st.one_of(st.none(), TEXT)), min_size=1, max_size=6))
def test_sqlite_writes_the_csv_the_row_path_writes(tmp_path_factory: Any, calls: list[Any]) -> None:
    journal = SQLiteJournal(tmp_path_factory.mktemp("csv") / "j.db", durability="process")
    try:
        for n, (call_id, tool, text, agent) in enumerate(calls):
            arguments = canonical_json({"note": text, "n": n})
            journal.append(EffectEvent("pending", f"{call_id}-{n}", tool or "t", agent_id=agent,
                                       idempotency_key=text, arguments=arguments, attempt=1, owner=current_owner()))
            journal.append(EffectEvent("committed", f"{call_id}-{n}", tool or "t", arguments=arguments,
                                       value=canonical_json([text, None, 1.5]), reason={"why": text},
                                       attempt=1, owner=current_owner()))
            journal.append(EffectEvent("refused", None, tool or "t", error={"type": text}, owner=current_owner()))
        for redact in (frozenset(), frozenset({"arguments"}), frozenset({"arguments", "value"})):
            fast = _sqlite_path(journal, redact=redact)
            assert fast == _row_path(journal, redact=redact)
            table = list(csv.reader(io.StringIO(fast.decode(), newline="")))
            assert table[0] == list(CSV_COLUMNS) and len(table) == 1 + 3 * len(calls)
            by_seq = {e.seq: e for e in journal.events()}
            for cells in table[1:]:
                event = by_seq[int(cells[0])]
                assert cells[2] == (event.call_id or "") and cells[4] == event.tool
                assert cells[5] == (event.agent_id or "") and cells[6] == (event.idempotency_key or "")
                shown = "" if "arguments" in redact or event.arguments is None else event.arguments
                assert cells[7] == shown
        assert _sqlite_path(journal, tool=calls[0][1] or "t") == _row_path(journal, tool=calls[0][1] or "t")
    finally:
        journal.close()


@pytest.mark.parametrize("text,cell", [
    ("plain", "plain"), ("", ""), ("a,b", '"a,b"'), ('say "hi"', '"say ""hi"""'), ("two\nlines", '"two\nlines"'),
    ("cr\rhere", '"cr\rhere"'), ("tab\tand space ", "tab\tand space "),
])
def test_a_cell_is_quoted_only_when_it_must_be(text: str, cell: str) -> None:
    assert csv_cell(text) == cell


def test_a_stored_text_that_is_not_json_is_named(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="process")
    journal.append(EffectEvent("pending", "c1", "charge", arguments='{"a":1}', attempt=1, owner=current_owner()))
    journal.append(EffectEvent("pending", "c2", "charge", arguments='{"a":2}', attempt=1, owner=current_owner()))
    conn = sqlite3.connect(journal.path, isolation_level=None)
    conn.execute("DROP TRIGGER events_no_update")
    conn.execute("UPDATE events SET owner = '{broken' WHERE seq = 2")
    conn.close()
    with pytest.raises(JournalError, match="owner of event seq 2 is not JSON"):
        _sqlite_path(journal)
    with pytest.raises(JournalError, match="owner of event seq 2 is not JSON"):
        _row_path(journal)
    journal.close()


def test_an_altered_row_of_other_types_is_still_one_csv_line(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="process")
    journal.append(EffectEvent("pending", "c1", "charge", arguments='{"a":1}', attempt=1, owner=current_owner()))
    conn = sqlite3.connect(journal.path, isolation_level=None)
    conn.execute("DROP TRIGGER events_no_update")
    conn.execute("UPDATE events SET call_id = 12, tool = 'a,b', attempt = 'one' WHERE seq = 1")
    conn.close()
    fast = _sqlite_path(journal)
    assert fast == _row_path(journal)
    table = list(csv.reader(io.StringIO(fast.decode(), newline="")))
    assert len(table) == 2 and table[1][2] == "12" and table[1][4] == "a,b" and table[1][14] == "one"
    journal.close()


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_an_export_whose_reader_stalls_is_a_snapshot_that_does_not_hold_the_wal(tmp_path: Path, fmt: str) -> None:
    # An export read slowly (into a pager, say) while the guard writes: it holds the events up to
    # the head it began at, and between its pages no read transaction keeps SQLite from
    # checkpointing, so the WAL does not grow for as long as the reader stalls.
    path = tmp_path / "j.db"
    big = '{"note":"' + "x" * 4000 + '"}'  # about 4 KB an event: a JSON Lines batch is a megabyte
    with SQLiteJournal(path, durability="process") as journal:
        for n in range(1, 601):
            journal.append(EffectEvent("pending", f"c{n}", "charge", attempt=1, arguments=big))
        head = journal.head()[0]
        batches = journal.export_csv() if fmt == "csv" else journal.export_lines()
        first = next(batches)
        for n in range(601, 651):  # written while the export is half read
            journal.append(EffectEvent("pending", f"c{n}", "charge", attempt=1, arguments=big))
        other = sqlite3.connect(path, isolation_level=None)
        busy, _, _ = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        other.close()
        assert busy == 0  # nothing held the WAL: it was checkpointed and cut to nothing
        assert (path.parent / "j.db-wal").stat().st_size == 0
        exported = first[1] + sum(count for _, count in batches)
    assert exported == head == 600
