"""verify() in parts: child processes each check a range of the chain and a share of the calls.

Whatever the journal, the verdict (and, on a problem, the report naming the first bad event) is
the one-pass verdict; a child that cannot run changes only the speed.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from guard.store import EffectEvent, current_owner, parse_at
from journal import SQLiteJournal
from journal.export import row_hash
from journal.rows import EVENT_COLUMNS
from journal.sqlite import verify as sqlite_verify

CALLS = 30


def fill(journal: SQLiteJournal) -> None:
    """Thirty calls, their events interleaved: most commit (some replayed), some end unknown."""
    owner = current_owner()
    for n in range(CALLS):
        at = parse_at(f"2026-12-01T05:{n % 60:02d}:00.000000Z")
        call_id = f"call_{n:04d}"
        journal.append(EffectEvent("pending", call_id, "charge", at, "agent-1", f"k{n}", '{"cents":5}',
                                   owner=owner, attempt=1))
        if n % 3 == 0:
            journal.append(EffectEvent("refused", None, "charge", at, reason={"code": "rate_limited"},
                                       owner=owner))
        if n % 5 == 4:
            journal.append(EffectEvent("unknown", call_id, "charge", at, error={"type": "TimeoutError"},
                                       owner=owner, attempt=1))
        elif n % 2 == 1:
            journal.append(EffectEvent("committed", f"call_{n - 1:04d}", "charge", at, value='{"id":1}',
                                       owner=owner, attempt=1))
            journal.append(EffectEvent("committed", call_id, "charge", at, value=f'{{"id":{n}}}',
                                       owner=owner, attempt=1))
    journal.append(EffectEvent("replayed", "call_0001", "charge", owner=owner, attempt=1))


@pytest.fixture
def journal(tmp_path: Path) -> Any:
    j = SQLiteJournal(tmp_path / "j.db", durability="process")
    fill(j)
    yield j
    j.close()


def raw(journal: SQLiteJournal) -> sqlite3.Connection:
    conn = sqlite3.connect(journal.path, isolation_level=None)
    conn.execute("DROP TRIGGER IF EXISTS events_no_update")
    conn.execute("DROP TRIGGER IF EXISTS events_no_delete")
    return conn


def test_an_intact_journal_verifies_in_parts_as_in_one_pass(journal: SQLiteJournal) -> None:
    head = journal.head()
    one = journal.verify(parts=1)
    assert (one.ok, one.events, one.head) == (True, head[0], head[1])
    for parts in (2, 3, 4):
        assert journal.verify(parts=parts) == one
        assert all(sqlite_verify.check_part(journal.path, p, parts, head[0]) for p in range(parts))


def _tampers(head: int) -> list[str]:
    middle = head // 2
    return [
        "UPDATE events SET value = '{\"id\":999}' WHERE seq = 2",
        f"UPDATE events SET at = '2026-12-01T06:00:00.000000Z' WHERE seq = {middle}",
        f"UPDATE events SET attempt = 'one' WHERE seq = {middle + 1}",
        f"UPDATE events SET owner = '{{\"host\":\"elsewhere\"}}' WHERE seq = {head}",
        f"UPDATE events SET prev_hash = hash WHERE seq = {middle}",
        f"UPDATE events SET arguments = '{{\"cents\":' WHERE seq = {middle - 1}",
        "UPDATE events SET tool = 'refund' WHERE seq = 1",
        f"DELETE FROM events WHERE seq = {middle}",
        f"DELETE FROM events WHERE seq = {head - 1}",
        "UPDATE calls SET status = 'released', value = NULL WHERE call_id = 'call_0003'",
        "UPDATE calls SET last_seq = last_seq + 1 WHERE call_id = 'call_0020'",
        "DELETE FROM calls WHERE call_id = 'call_0017'",
        "INSERT INTO calls SELECT 'ghost', tool, status, attempt, agent_id, idempotency_key, arguments, value, "
        "error, reason, actor, owner, created_at, updated_at, since, last_seq FROM calls LIMIT 1",
        "INSERT INTO calls SELECT NULL, tool, status, attempt, agent_id, idempotency_key, arguments, value, "
        "error, reason, actor, owner, created_at, updated_at, since, last_seq FROM calls LIMIT 1",
        "UPDATE calls SET call_id = 17 WHERE call_id = 'call_0017'",
        "INSERT INTO events SELECT -1, at, call_id, kind, tool, agent_id, idempotency_key, arguments, value, error, "
        "reason, actor, attempt, owner, prev_hash, hash FROM events WHERE seq = 1",
        "INSERT INTO events SELECT 0, at, NULL, 'refused', tool, agent_id, idempotency_key, arguments, value, error, "
        "reason, actor, attempt, owner, prev_hash, hash FROM events WHERE seq = 1",
    ]


@pytest.mark.parametrize("index", range(17))
def test_a_tampered_journal_gets_the_one_pass_report(journal: SQLiteJournal, index: int) -> None:
    tamper = _tampers(journal.head()[0])[index]
    conn = raw(journal)
    conn.execute(tamper)
    conn.close()
    one = journal.verify(parts=1)
    assert not one.ok and one.problem
    head = journal.head()[0]
    for parts in (2, 3):
        # At least one part sees the problem, and the report is the one-pass report.
        assert not all(sqlite_verify.check_part(journal.path, p, parts, head) for p in range(parts))
        assert journal.verify(parts=parts) == one


def _rehash(journal: SQLiteJournal, seq: int, change: str) -> None:
    """Alter event ``seq`` with ``change`` and give it the hash its new fields give: the row is
    sound on its own, and only the link from the event after it is broken."""
    conn = raw(journal)
    conn.execute(f"UPDATE events SET {change} WHERE seq = ?", (seq,))
    row = conn.execute(f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE seq = ?", (seq,)).fetchone()
    conn.execute("UPDATE events SET hash = ? WHERE seq = ?", (row_hash(row), seq))
    conn.close()


@pytest.mark.parametrize("where", ["first", "boundary", "before boundary", "middle"])
@pytest.mark.parametrize("parts", [2, 3])
def test_an_event_rehashed_to_match_its_change_breaks_the_next_link(
    journal: SQLiteJournal, where: str, parts: int
) -> None:
    head = journal.head()[0]
    boundary = sqlite_verify._range(1, parts, head)[0]  # the first event of the second part's range
    seq = {"first": 1, "boundary": boundary, "before boundary": boundary - 1, "middle": head // 2}[where]
    _rehash(journal, seq, "actor = 'operator:mallory'")
    one = journal.verify(parts=1)
    assert not one.ok and one.first_bad_seq == seq + 1
    assert not all(sqlite_verify.check_part(journal.path, p, parts, head) for p in range(parts))
    assert journal.verify(parts=parts) == one


def test_an_event_without_a_call_is_checked_too(journal: SQLiteJournal) -> None:
    conn = raw(journal)
    seq = conn.execute("SELECT min(seq) FROM events WHERE call_id IS NULL").fetchone()[0]
    conn.execute("UPDATE events SET reason = '{\"code\":\"edited\"}' WHERE seq = ?", (seq,))
    conn.close()
    one = journal.verify(parts=1)
    assert not one.ok and one.first_bad_seq == seq
    head = journal.head()[0]
    for parts in (2, 3):
        said = [sqlite_verify.check_part(journal.path, p, parts, head) for p in range(parts)]
        assert said[0] is False  # the part that reads the events without a call id
        assert journal.verify(parts=parts) == one


def _rehash_from(journal: SQLiteJournal, seq: int, change: str) -> None:
    """Alter event ``seq`` with ``change`` and hash the chain again from there, as someone who
    rewrites the whole log after it would: every hash and every link then checks out."""
    conn = raw(journal)
    conn.execute(f"UPDATE events SET {change} WHERE seq = ?", (seq,))
    before = conn.execute("SELECT hash FROM events WHERE seq = ?", (seq - 1,)).fetchone()[0]
    for row in conn.execute(f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE seq >= ? ORDER BY seq",
                            (seq,)).fetchall():
        digest = row_hash((*row[:14], before, row[15]))
        conn.execute("UPDATE events SET prev_hash = ?, hash = ? WHERE seq = ?", (before, digest, row[0]))
        before = digest
    conn.close()


def test_a_log_rewritten_with_an_attempt_that_is_no_number_gets_a_report(journal: SQLiteJournal) -> None:
    conn = raw(journal)
    seq = conn.execute("SELECT seq FROM events WHERE call_id = 'call_0004' AND kind = 'pending'").fetchone()[0]
    conn.close()
    _rehash_from(journal, seq, "attempt = 'one'")
    report = journal.verify(parts=1)
    assert not report.ok and "call_0004" in (report.problem or "")
    for parts in (2, 3):
        assert journal.verify(parts=parts) == report


def _parts_say(journal: SQLiteJournal, parts: int) -> bool:
    """What the parts say together, each checked in this process."""
    head = journal.head()[0]
    return all(sqlite_verify.check_part(journal.path, p, parts, head) for p in range(parts))


def _index_as(journal: SQLiteJournal, definition: str) -> None:
    """Make the index on call id again by ``definition`` (a CREATE INDEX statement) behind SQLite's
    back, then put its own definition back: its quick check does not look at what it holds."""
    conn = raw(journal)
    sql = conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'events_call_id'").fetchone()[0]
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute("UPDATE sqlite_schema SET sql = ? WHERE name = 'events_call_id'", (definition,))
    conn.close()
    conn = raw(journal)
    conn.execute("REINDEX events_call_id")
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute("UPDATE sqlite_schema SET sql = ? WHERE name = 'events_call_id'", (sql,))
    conn.close()


@pytest.mark.parametrize("callless", [True, False])
def test_an_event_the_index_by_call_leaves_out_is_still_hashed(journal: SQLiteJournal, callless: bool) -> None:
    """The parts read the log through the index on call id: an index that lacks an event (its
    definition made partial behind SQLite's back, then put back) must not hide that event's change."""
    conn = raw(journal)
    where = "call_id IS NULL" if callless else "call_id = 'call_0007'"
    seq = conn.execute(f"SELECT min(seq) FROM events WHERE {where}").fetchone()[0]
    conn.close()
    _index_as(journal, f"CREATE INDEX events_call_id ON events (call_id, seq) WHERE seq <> {seq}")
    # The parts cannot vouch for an event they did not read: the one pass, which reads the table in
    # seq order, gives the report.
    assert not _parts_say(journal, 2)
    assert journal.verify(parts=2) == journal.verify(parts=1)
    conn = raw(journal)
    conn.execute("UPDATE events SET actor = 'operator:mallory' WHERE seq = ?", (seq,))
    assert conn.execute("PRAGMA quick_check").fetchall() == [("ok",)]
    conn.close()
    one = journal.verify(parts=1)
    assert not one.ok and one.first_bad_seq == seq
    for parts in (2, 3, 4):
        assert not _parts_say(journal, parts)
        assert journal.verify(parts=parts) == one


def test_an_event_moved_to_another_call_under_its_old_index_key_is_found(journal: SQLiteJournal) -> None:
    """The parts read each event's call id from the table, not from the index's copy of it."""
    conn = raw(journal)
    seq = conn.execute("SELECT seq FROM events WHERE call_id = 'call_0001' AND kind = 'committed'").fetchone()[0]
    conn.execute("UPDATE events SET call_id = 'call_0005' WHERE seq = ?", (seq,))
    conn.close()
    _index_as(journal, f"CREATE INDEX events_call_id ON events "
                       f"(CASE WHEN seq = {seq} THEN 'call_0001' ELSE call_id END, seq)")
    one = journal.verify(parts=1)
    assert not one.ok and one.first_bad_seq == seq
    for parts in (2, 3, 4):
        assert not _parts_say(journal, parts)
        assert journal.verify(parts=parts) == one


def test_an_index_that_files_an_event_under_another_call_is_reported_and_rebuilt(journal: SQLiteJournal) -> None:
    """The table intact, only the index wrong: verify names the event the index lacks, and
    rebuild, which reads the log through the index, makes the index again before it folds."""
    calls = journal.calls(limit=None)
    conn = raw(journal)
    seq = conn.execute("SELECT seq FROM events WHERE call_id = 'call_0001' AND kind = 'committed'").fetchone()[0]
    conn.close()
    _index_as(journal, f"CREATE INDEX events_call_id ON events "
                       f"(CASE WHEN seq = {seq} THEN 'call_0005' ELSE call_id END, seq)")
    one = journal.verify(parts=1)
    assert (one.ok, one.first_bad_seq) == (False, seq) and "index" in (one.problem or "")
    for parts in (2, 3):
        assert journal.verify(parts=parts) == one
    journal.rebuild()
    assert journal.calls(limit=None) == calls  # call_0001 still committed: a retry is replayed, never run
    assert journal.verify(parts=1).ok and journal.verify(parts=2).ok


def test_each_call_is_checked_by_exactly_one_part(journal: SQLiteJournal) -> None:
    head = journal.head()[0]
    for n in range(CALLS):
        conn = raw(journal)
        conn.execute("UPDATE calls SET reason = '{\"code\":\"edited\"}' WHERE call_id = ?", (f"call_{n:04d}",))
        conn.close()
        said = [sqlite_verify.check_part(journal.path, p, 3, head) for p in range(3)]
        assert said.count(False) == 1, (n, said)
        journal.rebuild()


def test_a_child_that_cannot_start_leaves_the_verdict_unchanged(
    journal: SQLiteJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    intact = journal.verify(parts=1)
    monkeypatch.setattr(sqlite_verify.sys, "executable", "/nonexistent/python")
    assert journal.verify(parts=2) == intact
    conn = raw(journal)
    conn.execute("UPDATE events SET kind = 'released' WHERE seq = 3")
    conn.close()
    tampered = journal.verify(parts=2)
    assert not tampered.ok and tampered == journal.verify(parts=1)


def test_a_large_journal_is_verified_in_parts_by_default(
    journal: SQLiteJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []
    start = sqlite_verify.start_part

    def counting(*args: Any) -> Any:
        started.append(args[1])
        return start(*args)

    monkeypatch.setattr(sqlite_verify, "start_part", counting)
    assert journal.verify().ok
    assert started == []  # a small journal: one pass
    monkeypatch.setattr(sqlite_verify, "PARALLEL_FROM", 10)
    assert journal.verify().ok
    assert started and started[0] == 1


def test_a_part_runs_as_a_command(journal: SQLiteJournal) -> None:
    head = str(journal.head()[0])
    done = subprocess.run([sys.executable, "-m", "journal.sqlite.verify", str(journal.path), "1", "2", head],
                          capture_output=True)
    assert (done.returncode, done.stdout) == (0, b'{"ok":true}\n')
    done = subprocess.run([sys.executable, "-m", "journal.sqlite.verify"], capture_output=True)
    assert done.returncode == 2 and b"usage" in done.stderr and done.stdout == b""


@pytest.mark.parametrize("parts", [0, -1, True, 1.5])
def test_parts_must_be_a_positive_number(journal: SQLiteJournal, parts: Any) -> None:
    with pytest.raises(ValueError, match="parts"):
        journal.verify(parts=parts)


def test_an_interpreter_that_is_not_python_checks_in_one_pass(
    journal: SQLiteJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    intact = journal.verify(parts=1)
    monkeypatch.setattr(sqlite_verify.sys, "executable", "/usr/sbin/some-server")  # embedded Python
    assert sqlite_verify.start_part(journal.path, 1, 2, journal.head()[0]) is None
    assert journal.verify(parts=2) == intact


def test_a_child_that_hangs_is_killed_and_the_journal_checked_in_one_pass(
    journal: SQLiteJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []

    def hanging(*args: Any) -> subprocess.Popen[bytes]:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE)
        started.append(child)
        return child

    monkeypatch.setattr(sqlite_verify, "start_part", hanging)
    monkeypatch.setattr(sqlite_verify, "PATIENCE", 0.5)
    begun = time.monotonic()
    assert journal.verify(parts=2) == journal.verify(parts=1)
    assert time.monotonic() - begun < 30
    assert started and all(child.poll() is not None for child in started)  # none is left running
