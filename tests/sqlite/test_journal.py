"""SQLiteJournal beyond the store contract: operator reads, resolve, the append-only log, verify,
rebuild, the busy deadline and sharing one object between threads."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.canonical import canonical_json
from guard.effect_guard import EffectGuard, idempotency_key
from guard.store import EffectEvent, current_owner, parse_at
from journal import CallNotFound, JournalError, NotResolvable, SQLiteJournal, StoreBusy
from journal.sqlite import group_commit as journal_sqlite

T0 = parse_at("2026-12-01T05:00:00.000000Z")


@pytest.fixture
def journal(tmp_path: Path) -> Any:
    with SQLiteJournal(tmp_path / "j.db", durability="process") as j:
        yield j


def event(kind: str, call_id: str | None, *, minute: int = 0, attempt: int = 1, tool: str = "charge",
          agent_id: str | None = "a1", owner: dict[str, Any] | None = None, **fields: Any) -> EffectEvent:
    return EffectEvent(
        kind=kind, call_id=call_id, tool=tool, at=T0 + timedelta(minutes=minute), agent_id=agent_id,
        idempotency_key="k" * 64, arguments='{"cents":5}', attempt=attempt,
        owner=owner if owner is not None else {"host": "elsewhere", "pid": 1}, **fields,
    )


def raw(journal: SQLiteJournal) -> sqlite3.Connection:
    """A separate connection to the same file, as a tamperer would open it."""
    return sqlite3.connect(journal.path, isolation_level=None)


def guarded(journal: SQLiteJournal, runs: list[str]) -> Any:
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        runs.append(account)
        return {"charged": cents}

    return charge


def call(tool: Any, call_id: str, *args: Any) -> Any:
    with AirlockContext(agent_id="a1", metadata={"tool_call_id": call_id}):
        return tool(*args)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- reads -------------------------------------------------------------------------------------


def test_calls_are_newest_first_and_filtered(journal: SQLiteJournal) -> None:
    journal.append(event("pending", "c1", minute=1))
    journal.append(event("pending", "c2", minute=2, tool="refund", agent_id="a2"))
    journal.append(event("pending", "c3", minute=3))
    journal.append(event("committed", "c1", minute=4, value='{"ok":true}'))
    journal.append(event("refused", "c9", minute=5, reason={"code": "policy_violation", "message": "no"}))
    assert [c.call_id for c in journal.calls()] == ["c1", "c3", "c2"]
    assert [c.call_id for c in journal.calls(status="pending")] == ["c3", "c2"]
    assert [c.call_id for c in journal.calls(status=("pending", "committed"))] == ["c1", "c3", "c2"]
    assert [c.call_id for c in journal.calls(status=["committed", "unknown"])] == ["c1"]
    assert journal.calls(status=()) == [] and journal.calls(status=["unknown", "\udcff"]) == []
    assert [c.call_id for c in journal.calls(tool="refund")] == ["c2"]
    assert [c.call_id for c in journal.calls(agent_id="a1")] == ["c1", "c3"]
    assert [c.call_id for c in journal.calls(since=T0 + timedelta(minutes=3))] == ["c1", "c3"]
    assert [c.call_id for c in journal.calls(limit=1)] == ["c1"]
    assert len(journal.calls(limit=None)) == 3
    assert journal.call("c1") == journal.get("c1")
    assert journal.call("c9") is None
    with pytest.raises(ValueError, match="limit"):
        journal.calls(limit=-1)


def test_call_events_include_refusals(journal: SQLiteJournal) -> None:
    journal.append(event("pending", "c1"))
    journal.append(event("pending", "c2"))
    journal.append(event("refused", "c1", reason={"code": "effect_status_unknown", "message": "wait"}))
    journal.append(event("refused", "c9", reason={"code": "policy_violation", "message": "no"}))
    assert [(e.seq, e.kind) for e in journal.call_events("c1")] == [(1, "pending"), (3, "refused")]
    assert [e.kind for e in journal.call_events("c9")] == ["refused"]
    assert journal.call_events("nope") == []


def test_events_stream_in_batches_and_filter(journal: SQLiteJournal) -> None:
    for n in range(2500):
        kind = "pending" if n % 2 == 0 else "refused"
        journal.append(event(kind, f"c{n}", minute=n, tool="charge" if n < 2000 else "refund",
                             reason=None if kind == "pending" else {"code": "policy_violation", "message": "no"}))
    assert [e.seq for e in journal.events()] == list(range(1, 2501))
    assert journal.count_events() == 2500
    assert [e.seq for e in journal.events(after_seq=2490)] == list(range(2491, 2501))
    assert journal.count_events(tool="refund") == 500
    assert sum(1 for _ in journal.events(tool="refund")) == 500
    window = list(journal.events(since=T0 + timedelta(minutes=10), until=T0 + timedelta(minutes=20)))
    assert [e.seq for e in window] == list(range(11, 21))
    assert journal.count_events(since=T0 + timedelta(minutes=10), until=T0 + timedelta(minutes=20)) == 10
    assert [e.seq for e in journal.events(call_id="c7")] == [8]
    assert journal.count_events(agent_id="nobody") == 0


def test_events_of_a_long_log_are_not_loaded_whole(journal: SQLiteJournal) -> None:
    for n in range(1500):
        journal.append(event("pending", f"c{n}"))
    stream = journal.events()
    first = next(stream)
    journal.append(event("pending", "late"))  # a writer between batches is not blocked by the reader
    rest = list(stream)
    # The stream ends at the head it began at; what came later is read from there on.
    assert first.seq == 1 and rest[-1].seq == 1500 and len(rest) == 1499
    assert [e.call_id for e in journal.events(after_seq=1500)] == ["late"]


def test_head_and_stats(journal: SQLiteJournal) -> None:
    assert journal.head() == (0, "0" * 64)
    empty = journal.stats()
    assert (empty.calls, empty.events, empty.by_status, empty.oldest_pending_at) == (0, 0, {}, None)
    journal.append(event("pending", "c1", minute=1))
    journal.append(event("pending", "c2", minute=2, tool="refund"))
    journal.append(event("pending", "c3", minute=3))
    journal.append(event("unknown", "c3", minute=4, error={"type": "TimeoutError", "message": "slow"}))
    journal.append(event("pending", "c4", minute=5))
    journal.append(event("committed", "c4", minute=6, value="1"))
    journal.append(event("refused", None, minute=7, reason={"code": "policy_violation", "message": "no"}))
    stats = journal.stats()
    assert (stats.calls, stats.events) == (4, 7)
    assert stats.by_status == {"pending": 2, "unknown": 1, "committed": 1}
    assert stats.by_tool == {"charge": 3, "refund": 1}
    assert stats.oldest_pending_at == T0 + timedelta(minutes=1)
    assert stats.oldest_unknown_at == T0 + timedelta(minutes=4)
    assert journal.head()[0] == 7


def test_stats_count_a_status_the_schema_does_not_know(journal: SQLiteJournal) -> None:
    journal.append(event("pending", "c1", minute=1))
    journal.append(event("pending", "c2", minute=2))
    conn = sqlite3.connect(journal.path)
    conn.execute("PRAGMA ignore_check_constraints = ON")
    conn.execute("UPDATE calls SET status = 'lost' WHERE call_id = 'c2'")
    conn.commit()
    conn.close()
    stats = journal.stats()
    assert (stats.calls, stats.by_status) == (2, {"lost": 1, "pending": 1})


def test_events_round_trip_every_field(journal: SQLiteJournal) -> None:
    journal.append(event("unknown", "c1", error={"type": "TimeoutError", "message": "slow"}, actor="guard"))
    [e] = list(journal.events())
    assert (e.kind, e.call_id, e.tool, e.agent_id, e.attempt, e.actor) == ("unknown", "c1", "charge", "a1", 1, "guard")
    assert e.at == T0 and e.error == {"type": "TimeoutError", "message": "slow"}
    assert e.owner == {"host": "elsewhere", "pid": 1}
    effect = e.to_effect_event()
    assert (effect.seq, effect.kind, effect.error, effect.at) == (1, "unknown", e.error, T0)


# -- resolve -----------------------------------------------------------------------------------


def left_pending(journal: SQLiteJournal, call_id: str, account: str, cents: int, pid: int | None = None) -> None:
    """A call of ``charge(account, cents)`` left pending by a process that is gone."""
    arguments = {"account": account, "cents": cents}
    journal.append(EffectEvent(
        kind="pending", call_id=call_id, tool="charge", attempt=1, agent_id="a1",
        idempotency_key=idempotency_key("charge", arguments), arguments=canonical_json(arguments),
        owner={"host": current_owner()["host"], "pid": pid if pid is not None else dead_pid()},
    ))


def test_resolve_applied_with_a_value_is_replayed(journal: SQLiteJournal) -> None:
    runs: list[str] = []
    tool = guarded(journal, runs)
    left_pending(journal, "r1", "x", 1)
    assert call(tool, "r1", "x", 1)["block_reason"] == "effect_status_unknown"
    resolved = journal.resolve("r1", applied=True, reason="the bank shows ch_1", operator="ana",
                               value='{ "charged" : 1 }')
    assert (resolved.kind, resolved.actor, resolved.attempt) == ("committed", "operator:ana", 1)
    assert resolved.value == '{"charged":1}'
    assert resolved.reason == {"code": "applied", "message": "the bank shows ch_1"}
    assert resolved.seq == journal.head()[0] and resolved.hash == journal.head()[1]
    assert journal.get("r1").status == "committed"
    assert call(tool, "r1", "x", 1) == {"charged": 1}
    assert runs == []
    assert journal.verify().ok


def test_resolve_applied_without_a_value_is_never_rerun(journal: SQLiteJournal) -> None:
    runs: list[str] = []
    tool = guarded(journal, runs)
    left_pending(journal, "r1", "x", 1)
    journal.resolve("r1", applied=True, reason="seen in the ledger", operator="ana")
    record = journal.get("r1")
    assert (record.status, record.value) == ("committed", None)
    assert call(tool, "r1", "x", 1)["block_reason"] == "replay_value_unavailable"
    assert runs == []


def test_resolve_not_applied_lets_the_call_run_again(journal: SQLiteJournal) -> None:
    runs: list[str] = []
    tool = guarded(journal, runs)
    left_pending(journal, "r3", "y", 2)
    released = journal.resolve("r3", applied=False, reason="the bank has no such charge", operator="bo")
    assert (released.kind, released.actor) == ("released", "operator:bo")
    assert released.reason == {"code": "not_applied", "message": "the bank has no such charge"}
    assert call(tool, "r3", "y", 2) == {"charged": 2}
    assert journal.get("r3").attempt == 2
    assert runs == ["y"]


def test_resolve_refuses_a_pending_call_whose_owner_is_alive(journal: SQLiteJournal) -> None:
    journal.append(event("pending", "p1", owner=dict(current_owner())))
    head = journal.head()
    with pytest.raises(NotResolvable, match=r"pid \d+\) is alive.*--force"):
        journal.resolve("p1", applied=False, reason="r", operator="ana")
    assert journal.head() == head
    forced = journal.resolve("p1", applied=False, reason="r", operator="ana", force=True)
    assert forced.kind == "released"


def test_resolve_of_a_pending_call_whose_owner_died(journal: SQLiteJournal) -> None:
    left_pending(journal, "p1", "x", 1)
    assert journal.resolve("p1", applied=True, reason="r", operator="ana").kind == "committed"


@pytest.mark.parametrize("status", ["committed", "released"])
def test_resolve_refuses_a_settled_call(journal: SQLiteJournal, status: str) -> None:
    journal.append(event("pending", "s1"))
    journal.append(event(status, "s1", value="1" if status == "committed" else None))
    head = journal.head()
    with pytest.raises(NotResolvable, match=f"is {status}"):
        journal.resolve("s1", applied=True, reason="r", operator="ana")
    assert journal.head() == head


def test_resolve_of_an_unknown_id_or_refusals_only(journal: SQLiteJournal) -> None:
    journal.append(event("refused", "only-refused", reason={"code": "policy_violation", "message": "no"}))
    for call_id in ("nope", "only-refused"):
        with pytest.raises(CallNotFound, match=call_id):
            journal.resolve(call_id, applied=False, reason="r", operator="ana")
    assert journal.head()[0] == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [({"applied": True, "value": "{not json"}, "not valid JSON"),
     ({"applied": True, "value": "NaN"}, "not valid JSON"),
     # Stored, these would not be the value written: orjson keeps the last key, and rounds the number.
     ({"applied": True, "value": '{"charge_id": "ch_1", "charge_id": "ch_2"}'},
      "the value has the key 'charge_id' twice in one object"),
     ({"applied": True, "value": '{"n": 123456789012345678901234567890}'}, "cannot be stored exactly"),
     ({"applied": False, "value": "1"}, "value can only be given"),
     ({"applied": True, "operator": ""}, "operator")],
)
def test_resolve_bad_input_changes_nothing(journal: SQLiteJournal, options: dict[str, Any], message: str) -> None:
    journal.append(event("pending", "u1"))
    journal.append(event("unknown", "u1", error={"type": "TimeoutError", "message": "slow"}))
    head = journal.head()
    kwargs: dict[str, Any] = {"reason": "r", "operator": "ana", **options}
    with pytest.raises(ValueError, match=message):
        journal.resolve("u1", **kwargs)
    assert journal.head() == head
    assert journal.get("u1").status == "unknown"


def test_resolve_uses_the_current_attempt(journal: SQLiteJournal) -> None:
    journal.append(event("pending", "a1"))
    journal.append(event("released", "a1", error={"type": "ValueError", "message": "bad"}))
    journal.append(event("pending", "a1", attempt=2))
    journal.append(event("unknown", "a1", attempt=2, error={"type": "TimeoutError", "message": "slow"}))
    assert journal.resolve("a1", applied=True, reason="r", operator="ana").attempt == 2


# -- the append-only log, verify and rebuild ---------------------------------------------------


def test_the_database_refuses_to_change_or_delete_an_event(journal: SQLiteJournal) -> None:
    journal.append(event("pending", "c1"))
    conn = raw(journal)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute("UPDATE events SET tool = 'refund' WHERE seq = 1")
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute("DELETE FROM events")
    conn.close()
    assert [e.tool for e in journal.events()] == ["charge"]


def test_the_database_refuses_an_unknown_kind(journal: SQLiteJournal) -> None:
    with pytest.raises(JournalError, match="CHECK"):
        journal.append(event("deleted", "c1"))
    assert journal.head()[0] == 0


def fill(journal: SQLiteJournal) -> None:
    journal.append(event("pending", "c1", minute=1))
    journal.append(event("committed", "c1", minute=2, value='{"id":1}'))
    journal.append(event("pending", "c2", minute=3))
    journal.append(event("unknown", "c2", minute=4, error={"type": "TimeoutError", "message": "slow"}))
    journal.append(event("replayed", "c1", minute=5))


def test_verify_of_an_intact_journal(journal: SQLiteJournal) -> None:
    assert journal.verify().ok
    fill(journal)
    report = journal.verify()
    assert (report.ok, report.events, report.head, report.first_bad_seq) == (True, 5, journal.head()[1], None)


@pytest.mark.parametrize(
    "tamper",
    ["UPDATE events SET value = '{\"id\":2}' WHERE seq = 2",
     "UPDATE events SET at = '2026-12-01T05:02:00.000001Z' WHERE seq = 2",
     "UPDATE events SET attempt = 2 WHERE seq = 2",
     "UPDATE events SET error = '{broken' WHERE seq = 2",
     "UPDATE events SET prev_hash = hash WHERE seq = 2"],
)
def test_verify_finds_a_tampered_event(journal: SQLiteJournal, tamper: str) -> None:
    fill(journal)
    conn = raw(journal)
    conn.execute("DROP TRIGGER events_no_update")
    conn.execute(tamper)
    conn.close()
    report = journal.verify()
    assert (report.ok, report.first_bad_seq) == (False, 2)
    assert "seq 2" in str(report.problem)


def test_an_event_whose_stored_json_was_broken_cannot_be_exported(journal: SQLiteJournal) -> None:
    fill(journal)
    conn = raw(journal)
    conn.execute("DROP TRIGGER events_no_update")
    conn.execute("UPDATE events SET arguments = '{\"cents\":' WHERE seq = 3")
    conn.close()
    third = list(journal.events())[2]
    with pytest.raises(JournalError, match="arguments of event seq 3 are not JSON"):
        third.export()
    assert third.export(frozenset({"arguments"}))["arguments"] is None
    assert journal.verify().first_bad_seq == 3
    with pytest.raises(JournalError, match="arguments of event seq 3 are not JSON"):
        list(journal.export_lines())  # SQLite's own export names the event as well


def test_an_altered_projection_row_is_a_journal_error_everywhere(journal: SQLiteJournal) -> None:
    fill(journal)
    call_id = journal.calls()[0].call_id
    conn = raw(journal)
    conn.execute("UPDATE calls SET owner = 'garbage', since = 'notatime', status = 'pending' WHERE call_id = ?",
                 (call_id,))
    conn.commit()
    conn.close()
    with pytest.raises(JournalError, match="cannot be read"):
        journal.get(call_id)
    with pytest.raises(JournalError, match="cannot be read"):
        journal.stats()
    with pytest.raises(JournalError, match="cannot be read"):
        journal.resolve(call_id, applied=False, reason="checked", operator="ops", force=True)
    before = journal.head()
    with pytest.raises(JournalError, match="cannot be read"):
        journal.append(EffectEvent("committed", call_id, "charge", attempt=1, value="1"))
    assert journal.head() == before


def test_rebuild_keeps_an_event_without_an_owner_as_the_append_did(journal: SQLiteJournal) -> None:
    journal.append(EffectEvent(kind="pending", call_id="c1", tool="t", attempt=1, owner=None))  # type: ignore[arg-type]
    assert journal.verify().ok
    journal.rebuild()
    assert journal.verify().ok
    assert journal.get("c1").owner is None  # type: ignore[union-attr]


def test_verify_finds_a_deleted_event(journal: SQLiteJournal) -> None:
    fill(journal)
    conn = raw(journal)
    conn.execute("DROP TRIGGER events_no_delete")
    conn.execute("DELETE FROM events WHERE seq = 3")
    conn.close()
    report = journal.verify()
    assert (report.ok, report.first_bad_seq, report.events) == (False, 4, 2)


def test_verify_finds_a_projection_that_differs_and_rebuild_repairs_it(journal: SQLiteJournal) -> None:
    fill(journal)
    conn = raw(journal)
    conn.execute("UPDATE calls SET status = 'released', value = NULL WHERE call_id = 'c1'")
    conn.close()
    report = journal.verify()
    assert not report.ok and "c1" in str(report.problem) and "rebuild" in str(report.problem)
    assert journal.rebuild() == 2
    assert journal.verify().ok
    assert (journal.get("c1").status, journal.get("c1").value) == ("committed", '{"id":1}')


def test_verify_finds_a_missing_or_extra_projection_row(journal: SQLiteJournal) -> None:
    fill(journal)
    conn = raw(journal)
    conn.execute("DELETE FROM calls WHERE call_id = 'c2'")
    conn.close()
    assert "lacks call 'c2'" in str(journal.verify().problem)
    journal.rebuild()
    conn = raw(journal)
    conn.execute("INSERT INTO calls SELECT 'ghost', tool, status, attempt, agent_id, idempotency_key, arguments, "
                 "value, error, reason, actor, owner, created_at, updated_at, since, last_seq FROM calls LIMIT 1")
    conn.close()
    assert "ghost" in str(journal.verify().problem)
    assert journal.rebuild() == 2
    assert journal.get("ghost") is None
    assert journal.verify().ok


def test_rebuild_of_a_projection_wiped_out(journal: SQLiteJournal) -> None:
    fill(journal)
    before = {c.call_id: c for c in journal.calls(limit=None)}
    conn = raw(journal)
    conn.execute("DELETE FROM calls")
    conn.close()
    assert journal.calls() == []
    assert journal.rebuild() == 2
    assert {c.call_id: c for c in journal.calls(limit=None)} == before


def test_rebuild_drops_rows_no_call_of_the_log_can_make(journal: SQLiteJournal) -> None:
    fill(journal)
    before = {c.call_id: c for c in journal.calls(limit=None)}
    conn = raw(journal)
    for forged in ("NULL", "NULL", "17", "x'00ff'", "'c1a'"):
        conn.execute(f"INSERT INTO calls SELECT {forged}, tool, status, attempt, agent_id, idempotency_key, "
                     "arguments, value, error, reason, actor, owner, created_at, updated_at, since, last_seq "
                     "FROM calls WHERE call_id = 'c1'")
    conn.close()
    assert not journal.verify().ok
    assert journal.rebuild() == 2
    assert {c.call_id: c for c in journal.calls(limit=None)} == before
    assert journal.verify().ok


def test_rebuild_replaces_a_projection_row_that_is_not_utf8(journal: SQLiteJournal) -> None:
    fill(journal)
    before = {c.call_id: c for c in journal.calls(limit=None)}
    conn = raw(journal)
    conn.execute("UPDATE calls SET tool = CAST(x'ff' AS TEXT) WHERE call_id = 'c1'")
    conn.execute("INSERT INTO calls SELECT CAST(x'c3' AS TEXT), tool, status, attempt, agent_id, idempotency_key, "
                 "arguments, value, error, reason, actor, owner, created_at, updated_at, since, last_seq "
                 "FROM calls WHERE call_id = 'c2'")
    conn.close()
    assert journal.rebuild() == 2
    assert {c.call_id: c for c in journal.calls(limit=None)} == before
    assert journal.verify().ok


def test_rebuild_after_an_archive_drops_a_row_without_a_call_id(journal: SQLiteJournal) -> None:
    from journal.archive import plan_archive

    fill(journal)
    journal.append(event("pending", "c3", minute=9))
    journal.commit_archive(plan_archive(journal, T0 + timedelta(minutes=4, seconds=30)), "a1.jsonl",
                           "2026-12-02T00:00:00.000000Z")
    assert journal.verify().ok
    before = {c.call_id: c for c in journal.calls(limit=None)}
    conn = raw(journal)
    conn.execute("INSERT INTO calls SELECT NULL, tool, status, attempt, agent_id, idempotency_key, arguments, value, "
                 "error, reason, actor, owner, created_at, updated_at, since, last_seq FROM calls "
                 "WHERE call_id = 'c3'")  # its last_seq is past the start of the log
    conn.close()
    assert not journal.verify().ok
    assert journal.rebuild() == 3
    assert {c.call_id: c for c in journal.calls(limit=None)} == before
    assert journal.verify().ok


def test_full_export_of_a_real_journal_verifies_offline(journal: SQLiteJournal) -> None:
    from journal.chain import verify_lines

    runs: list[str] = []
    tool = guarded(journal, runs)
    for n in range(5):
        call(tool, f"e{n}", "acct", n)
        call(tool, f"e{n}", "acct", n)
    lines = [orjson.loads(orjson.dumps(e.export())) for e in journal.events()]
    assert verify_lines(lines).head == journal.verify().head == journal.head()[1]


# -- the busy deadline and threads ------------------------------------------------------------


def hold_write_lock(path: Path, seconds: float, locked: threading.Event) -> threading.Thread:
    def hold() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        locked.set()
        time.sleep(seconds)
        conn.execute("COMMIT")
        conn.close()

    thread = threading.Thread(target=hold)
    thread.start()
    return thread


def test_past_the_busy_deadline_begin_raises_store_busy_and_the_tool_does_not_run(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", busy_timeout=0.3)
    runs: list[str] = []
    tool = guarded(journal, runs)
    locked = threading.Event()
    holder = hold_write_lock(journal.path, 1.5, locked)
    locked.wait()
    try:
        started = time.monotonic()
        with pytest.raises(StoreBusy, match="locked"):
            journal.begin("b1", lambda record: pytest.fail("decided without the lock"))
        assert time.monotonic() - started >= 0.25
        refusal = call(tool, "b1", "acct", 1)
        assert is_refusal(refusal) and refusal["block_reason"] == "store_unavailable"
        assert runs == []
    finally:
        holder.join()
    assert call(tool, "b1", "acct", 1) == {"charged": 1}
    journal.close()


def test_a_busy_timeout_of_zero_refuses_at_once_under_contention(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", busy_timeout=0)
    runs: list[str] = []
    locked = threading.Event()
    holder = hold_write_lock(journal.path, 0.5, locked)
    locked.wait()
    try:
        assert call(guarded(journal, runs), "z1", "acct", 1)["block_reason"] == "store_unavailable"
        assert runs == []
    finally:
        holder.join()
    assert journal.get("z1") is None
    journal.close()


def test_contention_within_the_deadline_is_waited_out(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", busy_timeout=10)
    runs: list[str] = []
    tool = guarded(journal, runs)
    locked = threading.Event()
    holder = hold_write_lock(journal.path, 0.4, locked)
    locked.wait()
    assert call(tool, "w1", "acct", 1) == {"charged": 1}
    holder.join()
    assert runs == ["acct"]
    journal.close()


def test_one_journal_shared_by_threads(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="process")
    runs: list[str] = []
    tool = guarded(journal, runs)
    barrier = threading.Barrier(8)
    failures: list[BaseException] = []

    def work(worker: int) -> None:
        barrier.wait()
        try:
            for n in range(25):
                assert call(tool, f"t{worker}-{n}", f"w{worker}", n) == {"charged": n}
                assert journal.get(f"t{worker}-{n}").status == "committed"
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert len(runs) == 200
    assert journal.head()[0] == 400
    assert journal.stats().by_status == {"committed": 200}
    assert journal.verify().ok
    journal.close()


# -- durability: which transactions are fsynced ------------------------------------------------


class Transactions:
    """The kinds of event each committed transaction inserted, with the synchronous level it ran at,
    and ``("fsync", ())`` for each fsync of the journal's WAL file that the journal makes itself (the
    system call, seen with the file it was made on)."""

    def __init__(self, journal: SQLiteJournal, monkeypatch: pytest.MonkeyPatch) -> None:
        conn = journal.datastore.connection()
        self.level = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[conn.execute("PRAGMA synchronous").fetchone()[0]]
        self.kinds: list[str] = []
        self.committed: list[tuple[str, tuple[str, ...]]] = []
        self.last = ""
        conn.set_trace_callback(self.trace)
        wal = os.path.realpath(journal.datastore.wal_path)
        fdatasync = journal_sqlite._fdatasync

        def recorded_sync(fd: int) -> None:
            synced = os.path.realpath(f"/proc/self/fd/{fd}")
            fdatasync(fd)
            self.committed.append(("fsync", ()) if synced == wal else (f"fsync of {synced}", ()))

        monkeypatch.setattr(journal_sqlite, "_fdatasync", recorded_sync)

    def trace(self, statement: str) -> None:
        text = statement.strip()
        # SQLite traces a statement again as it enters a trigger (the log's BEFORE INSERT guard).
        repeated, self.last = text == self.last, text
        if repeated:
            return
        if text.startswith("PRAGMA synchronous = "):
            self.level = text.rsplit(" ", 1)[1]
        elif text.startswith("INSERT INTO events"):
            self.kinds.append(next(k for k in ("pending", "committed", "unknown", "released", "replayed", "refused")
                                   if f"'{k}'" in text))
        elif text == "COMMIT":
            self.committed.append((self.level, tuple(self.kinds)))
            self.kinds = []
        elif text == "ROLLBACK":
            self.kinds = []


def test_full_durability_fsyncs_only_the_transactions_that_record_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="full")
    seen = Transactions(journal, monkeypatch)
    runs: list[str] = []
    tool = guarded(journal, runs)
    call(tool, "d1", "acct", 1)
    call(tool, "d1", "acct", 1)
    assert call(tool, "d1", "acct", 2)["block_reason"] == "policy_violation"
    assert seen.committed == [("NORMAL", ("pending",)), ("fsync", ()), ("NORMAL", ("committed",)),
                              ("NORMAL", ("replayed",)), ("NORMAL", ("refused",))]
    journal.close()


def test_process_durability_never_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="process")
    seen = Transactions(journal, monkeypatch)
    call(guarded(journal, []), "d1", "acct", 1)
    assert [level for level, _ in seen.committed] == ["NORMAL", "NORMAL"]
    journal.close()


def test_a_reversible_call_run_again_after_unknown_has_its_pending_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guard.effect_guard import reversibility

    journal = SQLiteJournal(tmp_path / "j.db", durability="full")
    seen = Transactions(journal, monkeypatch)
    attempts: list[int] = []

    @reversibility("reversible")
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def lookup(account: str) -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise TimeoutError("slow")
        return "found"

    with pytest.raises(TimeoutError):
        call(lookup, "g1", "acct")
    assert call(lookup, "g1", "acct") == "found"
    assert seen.committed[3:5] == [("NORMAL", ("pending",)), ("fsync", ())]
    assert journal.get("g1").attempt == 2
    assert [e.kind for e in journal.call_events("g1")] == ["pending", "unknown", "pending", "committed"]
    journal.close()


def test_reading_the_events_stops_at_the_head_it_began_at(tmp_path: Path) -> None:
    # A reader of a log that writers keep appending to ends (it does not chase them): `show CALL_ID`
    # of a call that keeps changing used to read for as long as the call kept changing.
    with SQLiteJournal(tmp_path / "j.db", durability="process") as journal:
        for n in range(1, 1201):
            journal.append(EffectEvent("pending", "hot", "charge", attempt=n, arguments="{}"))
        events = journal.events(call_id="hot")
        first = next(events)
        for n in range(1201, 1501):
            journal.append(EffectEvent("pending", "hot", "charge", attempt=n, arguments="{}"))
        assert [first.seq, *(e.seq for e in events)] == list(range(1, 1201))


@pytest.mark.parametrize("redact", [frozenset(), frozenset({"arguments"})])
def test_a_value_nested_as_deep_as_it_can_be_stored_is_exported_and_verifies(
    journal: SQLiteJournal, redact: frozenset[str]
) -> None:
    from journal.chain import verify_lines
    from journal.reading import LogReader

    value: Any = 1
    for _ in range(254):  # as deep as orjson writes, so as deep as a tool's value is ever stored
        value = [value]
    journal.append(event("pending", "c1", minute=1))
    journal.append(event("committed", "c1", minute=2, value=orjson.dumps(value).decode()))
    own = b"".join(lines for lines, _ in journal.export_lines(redact=redact))
    shared_reads = LogReader(journal.datastore)  # PostgreSQL's path
    shared = b"".join(lines for lines, _ in shared_reads.export_lines(redact=redact))
    assert own == shared
    lines = [orjson.loads(line) for line in shared.splitlines()]
    assert verify_lines(lines).ok
    assert lines[1]["value"] == value
