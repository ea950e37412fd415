"""verify in bounded memory: the chain read in seq order, then each call folded from the log read by
call id and compared with its projection row, one call at a time.

On real journals (SQLite files, a PostgreSQL server), intact and altered in many ways, the report is
the one of the one-pass algorithm that folds every call into memory (``verifying.verify_rows``).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.store import CallRecord, EffectEvent, current_owner, parse_at
from journal import SQLiteJournal, verifying
from journal.chain import GENESIS, hash_of
from journal.export import row_hash
from journal.projection import FOLD_COLUMNS, fold_calls, fold_row, folded_onto, record_row
from journal.rows import CALL_COLUMNS, EVENT_COLUMNS, stamp
from journal.sqlite import verify as sqlite_verify
from tests.sqlite.test_verify_parts import _tampers, fill, raw

_EVENTS = ", ".join(EVENT_COLUMNS)
_CALLS = ", ".join(CALL_COLUMNS)


def more_history(journal: Any) -> None:
    """Retries, late outcomes of older attempts, an operator's confirmation, and ids whose order
    depends on every byte (a prefix of another, non-ASCII, upper case before lower)."""
    owner = current_owner()
    at = parse_at("2026-12-01T07:00:00.000000Z")
    for call_id in ("call_0001", "call_0001x", "Call_0001", "call_é", "call_\u4e2d", "call_ 1"):
        journal.append(EffectEvent("pending", call_id, "charge", at, "agent-2", f"k-{call_id}", '{"cents":7}',
                                   owner=owner, attempt=2 if call_id == "call_0001" else 1))
    journal.append(EffectEvent("unknown", "call_0001", "charge", at, error={"type": "TimeoutError"},
                               owner=owner, attempt=1))  # a late outcome of attempt 1: stays in the log alone
    journal.append(EffectEvent("committed", "call_é", "charge", at, value='{"id":"é"}', owner=owner, attempt=1,
                               actor="operator:ana", reason={"code": "applied", "message": "seen in the bank"}))
    journal.append(EffectEvent("released", "call_é", "charge", at, error={"type": "ValueError"}, owner=owner,
                               attempt=1))  # after an operator's confirmation: not taken
    journal.append(EffectEvent("committed", "orphan", "charge", at, value="1", owner=owner, attempt=1))


@pytest.fixture
def journal(tmp_path: Path) -> Any:
    j = SQLiteJournal(tmp_path / "j.db", durability="process")
    fill(j)
    more_history(j)
    yield j
    j.close()


def holding_every_call(conn: sqlite3.Connection) -> verifying.VerifyReport:
    """The report of the algorithm that folds the whole log into memory first."""
    return verifying.verify_rows(conn.execute(f"SELECT {_EVENTS} FROM events ORDER BY seq"),
                                 lambda: conn.execute(f"SELECT {_CALLS} FROM calls ORDER BY call_id"))


def both(journal: SQLiteJournal) -> tuple[Any, Any]:
    conn = sqlite3.connect(f"file:{journal.path}?mode=ro", uri=True, isolation_level=None)
    try:
        conn.execute("BEGIN")
        return sqlite_verify.verify_snapshot(conn), holding_every_call(conn)
    finally:
        conn.close()


def test_an_intact_journal_gets_the_report_of_the_fold_in_memory(journal: SQLiteJournal) -> None:
    by_call, in_memory = both(journal)
    head = journal.head()
    assert by_call == in_memory
    assert (by_call.ok, by_call.events, by_call.head) == (True, head[0], head[1])


def test_a_call_folds_to_the_projection_row_one_call_at_a_time(journal: SQLiteJournal) -> None:
    conn = sqlite3.connect(journal.path)
    try:
        folded = list(fold_calls(conn.execute(sqlite_verify.BY_CALL)))
        stored = conn.execute(f"SELECT {_CALLS} FROM calls ORDER BY call_id").fetchall()
    finally:
        conn.close()
    assert [r.call_id for r in folded] == [row[0] for row in stored]  # the orphan outcome makes no record
    statuses = {r.call_id: (r.status, r.attempt, r.actor) for r in folded}
    assert statuses["call_0001"] == ("pending", 2, "guard")
    assert statuses["call_é"] == ("committed", 1, "operator:ana")


_MORE_TAMPERS = [
    "UPDATE calls SET status = 'released' WHERE call_id = 'call_é'",
    "DELETE FROM calls WHERE call_id = 'call_0001x'",
    "DELETE FROM calls WHERE call_id IN ('Call_0001', 'call_ 1', 'call_0004')",
    "UPDATE calls SET attempt = 3 WHERE call_id = 'call_0001'",
    "UPDATE calls SET last_seq = 10000 WHERE call_id = 'call_\u4e2d'",
    "INSERT INTO calls SELECT 'call_0002a', tool, status, attempt, agent_id, idempotency_key, arguments, value, "
    "error, reason, actor, owner, created_at, updated_at, since, 2 FROM calls LIMIT 1",
    "INSERT INTO calls SELECT x'00ff', tool, status, attempt, agent_id, idempotency_key, arguments, value, "
    "error, reason, actor, owner, created_at, updated_at, since, last_seq FROM calls LIMIT 1",
    "UPDATE calls SET reason = '{\"code\":\"edited\"}' WHERE call_id IN ('call_0005', 'call_0009')",
    "UPDATE events SET hash = 'x' WHERE seq = (SELECT max(seq) FROM events)",
]


@pytest.mark.parametrize("index", range(len(_tampers(100)) + len(_MORE_TAMPERS)))
def test_an_altered_journal_gets_the_report_of_the_fold_in_memory(journal: SQLiteJournal, index: int) -> None:
    tampers = _tampers(journal.head()[0]) + _MORE_TAMPERS
    conn = raw(journal)
    conn.execute(tampers[index])
    conn.close()
    by_call, in_memory = both(journal)
    assert not by_call.ok and by_call.problem
    assert by_call == in_memory
    head = journal.head()[0]
    for parts in (2, 3):
        assert not all(sqlite_verify.check_part(journal.path, p, parts, head) for p in range(parts))
        assert journal.verify(parts=parts) == in_memory


def test_a_projection_ahead_of_its_log_is_not_called_stale(journal: SQLiteJournal) -> None:
    head = journal.head()[0]
    conn = raw(journal)
    last = conn.execute("SELECT call_id FROM events WHERE seq = ?", (head - 2,)).fetchone()[0]
    conn.execute("DELETE FROM events WHERE seq >= ?", (head - 2,))  # the newest events cut off
    conn.close()
    by_call, in_memory = both(journal)
    assert by_call == in_memory
    assert not by_call.ok and "events may have been removed from the end" in (by_call.problem or "")
    assert repr(last) in (by_call.problem or "") and "rebuild" not in (by_call.problem or "")


_ANY_TEXT = st.text(st.characters(codec="utf-8"), max_size=8)  # quotes, backslashes, controls, any script
_OBJECT = st.none() | st.dictionaries(_ANY_TEXT, _ANY_TEXT | st.integers(-(2**53), 2**53), max_size=2)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(("pending", "committed", "unknown", "released", "replayed", "refused")),
       call_id=st.none() | _ANY_TEXT, tool=_ANY_TEXT, agent_id=st.none() | _ANY_TEXT, key=st.none() | _ANY_TEXT,
       arguments=st.none() | _ANY_TEXT.map(lambda t: f'{{"t":"{t.encode("unicode_escape").decode()}"}}'),
       error=_OBJECT, reason=_OBJECT, owner=_OBJECT, actor=_ANY_TEXT, attempt=st.integers(0, 2**40),
       seq=st.integers(1, 2**40))
def test_a_stored_row_rehashes_by_the_rule_of_the_chain(
    kind: str, call_id: str | None, tool: str, agent_id: str | None, key: str | None, arguments: str | None,
    error: Any, reason: Any, owner: Any, actor: str, attempt: int, seq: int,
) -> None:
    event = EffectEvent(kind, call_id, tool, parse_at("2026-12-01T05:23:06.123456Z"), agent_id, key, arguments,
                        '{"v":1}' if kind == "committed" else None, error, reason, actor, attempt, owner)
    stored, row = stamp(event, seq, GENESIS)
    assert row_hash(row) == stored.hash == hash_of(stored)


def _record(call_id: str, last_seq: int) -> CallRecord:
    at = parse_at("2026-12-01T05:00:00.000000Z")
    return CallRecord(call_id, "charge", "pending", 1, None, None, None, None, None, None, "guard", None, at, at, at,
                      last_seq)


def test_calls_out_of_order_are_an_error_not_a_verdict() -> None:
    records = [_record("a", 1), _record("b", 2)]
    rows = [record_row(records[1]), record_row(records[0])]
    with pytest.raises(ValueError, match="not in call id order"):
        verifying.projection_problem(records, rows, 2)
    with pytest.raises(ValueError, match="not in call id order"):
        verifying.projection_problem([_record("b", 1), _record("a", 2)], [], 2)


def test_a_call_the_projection_lacks_is_the_one_whose_last_event_came_first() -> None:
    problem = verifying.projection_problem([_record("a", 9), _record("b", 4), _record("c", 7)], [], 9)
    assert problem == (4, "the projection lacks call 'b'; run rebuild")


def test_verify_in_parts_holds_one_call_at_a_time_and_agrees(journal: SQLiteJournal) -> None:
    one = journal.verify(parts=1)
    for parts in (2, 3):
        assert journal.verify(parts=parts) == one
    conn = raw(journal)
    conn.execute("UPDATE calls SET value = NULL WHERE call_id = 'call_é'")
    conn.close()
    head = journal.head()[0]
    said = [sqlite_verify.check_part(journal.path, p, 2, head) for p in range(2)]
    assert said.count(False) == 1
    assert journal.verify(parts=2) == journal.verify(parts=1) == both(journal)[1]


# -- PostgreSQL: the same algorithm over a server's rows ---------------------------------------------


def pg_by_call(conn: Any) -> verifying.VerifyReport:
    """What a PostgreSQL journal's verify (``Checking.verify_in``) reports without archives, by call id: the ids
    in binary order (``COLLATE "C"``), which is Python's order of text; server-side cursors."""

    def streamed(name: str, sql: str) -> Any:
        with conn.cursor(name=name) as cur:
            cur.itersize = 1000
            cur.execute(sql.encode())
            yield from cur

    kinds = "('committed', 'pending', 'released', 'unknown')"
    return verifying.verify_log(
        streamed("v_events", f"SELECT {_EVENTS} FROM events ORDER BY seq"),
        lambda: fold_calls(streamed("v_by_call", f"SELECT {', '.join(FOLD_COLUMNS)} FROM events WHERE call_id IS "
                                                 f'NOT NULL AND kind IN {kinds} ORDER BY call_id COLLATE "C", seq')),
        lambda: streamed("v_calls", f'SELECT {_CALLS} FROM calls ORDER BY call_id COLLATE "C"'),
    )


def pg_in_memory(conn: Any) -> verifying.VerifyReport:
    return verifying.verify_rows(conn.execute(f"SELECT {_EVENTS} FROM events ORDER BY seq"),
                                 lambda: conn.execute(f'SELECT {_CALLS} FROM calls ORDER BY call_id COLLATE "C"'))


_PG_TAMPERS = [
    None,
    "UPDATE calls SET status = 'released' WHERE call_id = 'call_é'",
    "DELETE FROM calls WHERE call_id IN ('Call_0001', 'call_ 1')",
    "UPDATE calls SET last_seq = 10000 WHERE call_id = 'call_\u4e2d'",
    "UPDATE calls SET attempt = 3 WHERE call_id = 'call_0001'",
    "INSERT INTO calls SELECT 'call_0002a', tool, status, attempt, agent_id, idempotency_key, arguments, value, "
    "error, reason, actor, owner, created_at, updated_at, since, 2 FROM calls LIMIT 1",
    "UPDATE events SET tool = 'refund' WHERE seq = 5",
]


@pytest.mark.parametrize("tamper", _PG_TAMPERS)
def test_postgres_rows_by_call_get_the_report_of_the_fold_in_memory(pg_dsn: str, tamper: str | None) -> None:
    psycopg = pytest.importorskip("psycopg")
    from journal.postgres import PostgresJournal

    journal = PostgresJournal(pg_dsn)
    try:
        fill(journal)  # type: ignore[arg-type]
        more_history(journal)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            if tamper is not None:
                conn.execute("ALTER TABLE events DISABLE TRIGGER USER")
                conn.execute(tamper.encode())
                conn.execute("ALTER TABLE events ENABLE TRIGGER USER")
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                by_call, in_memory = pg_by_call(conn), pg_in_memory(conn)
        assert by_call == in_memory
        assert by_call.ok is (tamper is None)
        if tamper is None:
            assert by_call == journal.verify()
    finally:
        journal.close()


_KINDS = ("pending", "committed", "unknown", "released", "replayed", "refused")
_IDS = st.sampled_from(["a", "b", "ab", "B", "é", "\u4e2d", "a b"])


@settings(max_examples=300, deadline=None)
@given(seeded=st.dictionaries(_IDS, st.tuples(st.sampled_from(("pending", "committed", "unknown", "released")),
                                              st.integers(1, 3), st.sampled_from(("guard", "operator:ana")))),
       log=st.lists(st.tuples(_IDS, st.sampled_from(_KINDS), st.integers(1, 3), st.sampled_from(("guard", "x"))),
                    max_size=25))
def test_a_log_read_by_call_folds_onto_its_archived_projection_as_in_seq_order(
    seeded: dict[str, tuple[str, int, str]], log: list[tuple[str, str, int, str]]
) -> None:
    at = "2026-12-01T05:00:00.000000Z"
    seeds = sorted((call_id, "charge", status, attempt, None, None, "{}", '"v"' if status == "committed" else None,
                    None, None, actor, None, at, at, at, n + 1)
                   for n, (call_id, (status, attempt, actor)) in enumerate(seeded.items()))
    rows = [(n + 100, f"2026-12-01T06:{n:02d}:00.000000Z", call_id, kind, "charge", None, None, "{}",
             '"w"' if kind == "committed" else None, None, None, actor, attempt, None, "p", "h")
            for n, (call_id, kind, attempt, actor) in enumerate(log)]
    expected: dict[str, CallRecord] = {seed[0]: CallRecord(*seed) for seed in seeds}
    for row in rows:  # in seq order, holding every call: the fold a journal with archives is made of
        fold_row(expected, row)
    by_call = sorted((row for row in rows if row[3] in ("pending", "committed", "unknown", "released")),
                     key=lambda row: (row[2], row[0]))
    folded = list(folded_onto(iter(seeds), [
        (r[3], r[2], r[4], r[1], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12], r[13], r[0]) for r in by_call]))
    assert [record_row(r) for r in folded] == [record_row(expected[c]) for c in sorted(expected)]


def test_a_part_read_by_call_finds_a_row_whose_hash_is_not_its_own(journal: SQLiteJournal) -> None:
    conn = sqlite3.connect(f"file:{journal.path}?mode=ro", uri=True)
    try:
        rows = conn.execute(f"SELECT {_EVENTS} FROM events ORDER BY call_id, seq").fetchall()
    finally:
        conn.close()
    records = list(verifying.checked_calls(rows))
    assert [r.call_id for r in records] == [r.call_id for r in fold_calls(
        (row[3], row[2], row[4], row[1], row[5], row[6], row[7], row[8], row[9], row[10], row[11], row[12], row[13],
         row[0]) for row in rows if row[2] is not None)]
    altered = [row if row[0] != 7 else (*row[:11], "operator:eve", *row[12:]) for row in rows]
    with pytest.raises(ValueError, match="seq 7 has been altered"):
        list(verifying.checked_calls(altered))
