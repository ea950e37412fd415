"""Section 3 of the behaviour contract, the journal: events, the SQLite schema, the append-only log,
the projection, the hash chain, durability, concurrency and the file's mode.

Written against the behaviour contract alone: public names only, and only what the contract states."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import itertools
import json
import os
import re
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from guard import (
    Airlock,
    AirlockBlocked,
    AirlockContext,
    OversightVerdict,
    is_refusal,
    requires,
)
from journal import NewerSchema, NotAJournal, SQLiteJournal
from tests.spec.support import (
    AIRLOCK,
    AT_RE,
    JSON_COLUMNS,
    KINDS,
    PYTHON,
    ZEROS,
    alter_projection,
    answering,
    assert_error_line,
    canonical,
    close,
    count,
    ctx,
    db_calls,
    db_events,
    event_hash,
    events_table,
    expected_key,
    export_lines,
    guard_for,
    make_pay,
    populate,
    projected_fields,
    projection_table,
    raw,
    report_field,
    run_cli,
    sha,
)

# --------------------------------------------------------------------------------------------------------------
# 3. the journal


def test_every_gate_refusal_appends_exactly_one_refused_event(journal: Any, db: Path) -> None:
    @dataclasses.dataclass
    class Case:
        code: str
        call_id: str | None
        build: Any

    def plain(account: Any = "a", cents: int = 1) -> str:
        return "ok"

    def tool(airlock: Airlock, *decorators: Any, name: str = "pay") -> Any:
        fn = functools.wraps(plain)(lambda *a, **k: plain(*a, **k))
        fn.__name__ = name
        for d in decorators:
            fn = d(fn)
        return airlock(fn)

    cases = [
        ("policy_violation", "rf-1", lambda: tool(guard_for(journal, denied_tools=["pay"]))("a")),
        ("policy_violation", None, lambda: tool(guard_for(journal, denied_tools=["pay"]))("a")),
        ("capability_denied", "rf-2", lambda: tool(guard_for(journal), requires("x"))("a")),
        ("tool_call_id_required", None, lambda: tool(guard_for(journal))("a")),
        ("target_args_required", "rf-3", lambda: tool(guard_for(journal, eg={"target_args": ("account",)}))(None)),
        ("escalation_required", "rf-4", lambda: tool(guard_for(journal, escalate_tools={"pay": "r"}))("a")),
        ("escalation_denied", "rf-5",
         lambda: tool(guard_for(journal, escalate_tools={"pay": "r"},
                                approver=answering(OversightVerdict.DENY, [])))("a")),
        ("arguments_not_canonical", "rf-6", lambda: tool(guard_for(journal))(float("nan"))),
    ]
    for code, call_id, call in cases:
        before = count(db, "refused", code)
        calls_before = db_calls(db)
        if call_id is None:
            result = call()
        else:
            with ctx(call_id):
                result = call()
        assert is_refusal(result) and result["block_reason"] == code, (code, result)
        assert count(db, "refused", code) == before + 1, code
        last = db_events(db)[-1]
        assert last["kind"] == "refused"
        assert last["reason"]["code"] == code
        assert isinstance(last["reason"]["message"], str)
        assert last["call_id"] == call_id
        assert last["tool"] == "pay"
        assert db_calls(db) == calls_before, f"{code} must not create or change a projection row"
    kinds = {e["kind"] for e in db_events(db)}
    assert kinds == {"refused"}


def test_effect_guard_refusals_and_replays_do_not_change_projection(journal: Any, db: Path) -> None:
    runs: list[Any] = []
    airlock = guard_for(journal)
    pay = make_pay(airlock, runs)

    @airlock
    def ship(order: str) -> str:
        raise TimeoutError("t")

    @airlock
    def mint(n: int) -> Any:
        return object()

    with ctx("pj-1"):
        pay("a")
    with ctx("pj-2"), pytest.raises(TimeoutError):
        ship("o")
    with ctx("pj-3"):
        mint(1)
    before = db_calls(db)
    for cid, call, code in [
        ("pj-1", lambda: pay("a"), None),
        ("pj-1", lambda: pay("b"), "policy_violation"),
        ("pj-2", lambda: ship("o"), "effect_status_unknown"),
        ("pj-3", lambda: mint(1), "replay_value_unavailable"),
    ]:
        n_events = len(db_events(db))
        with ctx(cid):
            result = call()
        events = db_events(db)
        assert len(events) == n_events + 1
        if code is None:
            assert events[-1]["kind"] == "replayed"
        else:
            assert result["block_reason"] == code
            assert events[-1]["kind"] == "refused" and events[-1]["reason"]["code"] == code
        assert events[-1]["call_id"] == cid
        assert projected_fields(db_calls(db)) == projected_fields(before)


def test_event_columns_and_contents(journal: Any, db: Path) -> None:
    populate(journal)
    events = db_events(db)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert {e["kind"] for e in events} <= KINDS
    by = {(e["call_id"], e["kind"]): e for e in events}
    committed = by[("c-pay", "committed")]
    assert committed["value"] == {"charged": 500, "account": "acct-1"}
    assert committed["arguments"] == {"account": "acct-1", "cents": 500}
    assert committed["arguments_raw"] == canonical({"account": "acct-1", "cents": 500}).decode()
    assert committed["idempotency_key"] == expected_key("pay", {"account": "acct-1", "cents": 500})
    assert committed["tool"] == "pay" and committed["agent_id"] == "alice"
    assert committed["actor"] == "guard" and committed["attempt"] == 1
    assert committed["owner"]["pid"] == os.getpid()
    assert isinstance(committed["owner"]["host"], str) and committed["owner"]["host"]
    assert ("c-pay", "replayed") in by
    unknown = by[("c-ship", "unknown")]
    assert "TimeoutError" in unknown["error"]["type"]
    assert unknown["error"]["message"] == "backend timed out"
    released = by[("c-flaky", "released")]
    assert "ValueError" in released["error"]["type"]
    assert released["error"]["message"] == "bad input"
    refused = by[("c-forbidden", "refused")]
    assert refused["reason"]["code"] == "policy_violation"
    for e in events:
        assert e["actor"] == "guard"
        assert re.fullmatch(r"[0-9a-f]{64}", e["hash"])
    assert events[0]["prev_hash"] == ZEROS
    for a, b in itertools.pairwise(events):
        assert b["prev_hash"] == a["hash"]


def test_projection_columns_and_fold(journal: Any, db: Path) -> None:
    populate(journal)
    calls = db_calls(db)
    assert set(calls) == {"c-pay", "c-ship", "c-flaky"}
    assert calls["c-pay"]["status"] == "committed"
    assert calls["c-ship"]["status"] == "unknown"
    assert calls["c-flaky"]["status"] == "released"
    for cid, row in calls.items():
        transitions = [e for e in db_events(db) if e["call_id"] == cid and e["kind"] not in ("refused", "replayed")]
        assert row["status"] == transitions[-1]["kind"]
        assert row["attempt"] == transitions[-1]["attempt"]
        assert row["tool"] == transitions[-1]["tool"]
        assert row["idempotency_key"] == transitions[-1]["idempotency_key"]
    assert calls["c-pay"]["agent_id"] == "alice"


def test_user_version_and_file_mode(db: Path) -> None:
    close(SQLiteJournal(str(db)))
    assert db.stat().st_mode & 0o777 == 0o600
    conn = raw(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] >= 1
    finally:
        conn.close()


def test_file_mode_0600_even_with_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = tmp_path / "open.db"
        close(SQLiteJournal(str(path)))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600


def test_database_refuses_update_and_delete_of_events(journal: Any, db: Path) -> None:
    populate(journal)
    before = db_events(db)
    conn = raw(db)
    try:
        t = events_table(conn)
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute(f'UPDATE "{t}" SET tool = ? WHERE seq = 1', ("forged",))
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute(f'DELETE FROM "{t}" WHERE seq = 1')
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute(f'DELETE FROM "{t}"')
    finally:
        conn.close()
    assert db_events(db) == before


def test_verify_and_rebuild_api(journal: Any, db: Path) -> None:
    populate(journal)
    events = db_events(db)
    report = journal.verify()
    assert report_field(report, "ok") is True
    assert report_field(report, "events") == len(events)
    assert report_field(report, "head") == events[-1]["hash"]
    assert report_field(report, "first_bad_seq") is None
    assert not report_field(report, "problem")
    before = db_calls(db)
    journal.rebuild()
    assert db_calls(db) == before
    assert report_field(journal.verify(), "ok") is True


def _drop_triggers(conn: sqlite3.Connection) -> None:
    for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'").fetchall():
        conn.execute(f'DROP TRIGGER "{name}"')


def test_verify_finds_an_altered_event(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    conn = raw(db)
    try:
        _drop_triggers(conn)
        conn.execute(f'UPDATE "{events_table(conn)}" SET tool = ? WHERE seq = 3', ("forged",))
    finally:
        conn.close()
    j = SQLiteJournal(str(db))
    try:
        report = j.verify()
        assert report_field(report, "ok") is False
        assert report_field(report, "first_bad_seq") == 3
        assert report_field(report, "problem")
    finally:
        close(j)
    result = run_cli("journal", "verify", "--db", str(db))
    assert result.exit_code == 1
    assert re.search(r"\bseq 3\b", result.output), result.output


def test_verify_checks_projection_and_rebuild_repairs_it(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    conn = raw(db)
    try:
        t = projection_table(conn)
        try:
            conn.execute(f'UPDATE "{t}" SET status = ? WHERE call_id = ?', ("released", "c-pay"))
        except sqlite3.DatabaseError:
            pytest.skip("the projection cannot be altered by hand here")
    finally:
        conn.close()
    result = run_cli("journal", "verify", "--db", str(db))
    assert result.exit_code == 1, result.output
    result = run_cli("journal", "rebuild", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert db_calls(db)["c-pay"]["status"] == "committed"
    assert run_cli("journal", "verify", "--db", str(db)).exit_code == 0


def test_hash_chain_recomputed_from_export(journal: Any, db: Path) -> None:
    populate(journal)
    lines = export_lines(db)
    assert len(lines) == len(db_events(db))
    prev = ZEROS
    for line in lines:
        assert line["prev_hash"] == prev
        assert line["hash"] == event_hash(prev, line), line["seq"]
        prev = line["hash"]
    assert prev == db_events(db)[-1]["hash"]


def test_durability_process_and_busy_timeout_accepted(tmp_path: Path) -> None:
    j = SQLiteJournal(str(tmp_path / "p.db"), durability="process", busy_timeout=5.0)
    try:
        runs: list[Any] = []
        pay = make_pay(guard_for(j), runs)
        with ctx("dp-1"):
            pay("a")
        with ctx("dp-1"):
            pay("a")
        assert runs == [("a", 100)]
    finally:
        close(j)


def test_opening_a_non_journal_is_an_error_and_changes_nothing(tmp_path: Path) -> None:
    text = tmp_path / "notes.db"
    text.write_bytes(b"these are not the droids\n" * 20)
    before = text.read_bytes()
    with pytest.raises(NotAJournal, match="not an airlock journal"):
        SQLiteJournal(str(text))
    assert text.read_bytes() == before

    other = tmp_path / "other.db"
    conn = sqlite3.connect(str(other))
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO customers (name) VALUES ('ada')")
    conn.commit()
    conn.close()
    before = other.read_bytes()
    with pytest.raises(NotAJournal, match="not an airlock journal"):
        SQLiteJournal(str(other))
    assert other.read_bytes() == before
    assert not Path(str(other) + "-wal").exists() or Path(str(other) + "-wal").stat().st_size == 0


def test_opening_a_newer_schema_is_an_error_and_changes_nothing(db: Path) -> None:
    close(SQLiteJournal(str(db)))
    conn = sqlite3.connect(str(db))
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    conn.execute(f"PRAGMA user_version = {version + 100}")
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    before = db.read_bytes()
    with pytest.raises(NewerSchema, match="newer"):
        SQLiteJournal(str(db))
    assert db.read_bytes() == before
    result = run_cli("journal", "stats", "--db", str(db))
    assert_error_line(result)
    assert db.read_bytes() == before


def test_fields_absent_where_the_contract_does_not_put_them(journal: Any, db: Path) -> None:
    populate(journal)
    for e in export_lines(db):
        if e["kind"] != "committed":
            assert e["value"] is None and e["value_sha256"] is None, e
        if e["kind"] not in ("unknown", "released"):
            assert e["error"] is None, e
        if e["kind"] == "refused":
            assert set(e["reason"]) == {"code", "message"}
        elif e["actor"] == "guard":
            assert e["reason"] is None, e
        assert set(e["owner"]) >= {"host", "pid"}


def test_refused_event_arguments_are_canonical(journal: Any, db: Path) -> None:
    airlock = guard_for(journal, denied_tools=["drop"], escalate_tools={"pay": "r"})

    @airlock
    def pay(zeta: int, alpha: dict[str, int]) -> str:
        return "x"

    @airlock
    def drop(zeta: int, alpha: dict[str, int]) -> str:
        return "x"

    with ctx("ca-1"):
        pay(1, {"b": 2, "a": 1})
    with ctx("ca-2"):
        drop(1, {"b": 2, "a": 1})
    events = db_events(db)
    assert [e["kind"] for e in events] == ["refused", "refused"]
    text = canonical({"zeta": 1, "alpha": {"a": 1, "b": 2}}).decode()
    assert events[0]["arguments_raw"] == text
    assert events[1].get("arguments_raw") in (None, text)


def test_non_canonical_refusal_is_journaled_and_the_chain_verifies(journal: Any, db: Path, tmp_path: Path) -> None:
    pay = make_pay(guard_for(journal), [])
    with ctx("nc-j"):
        assert pay(float("inf"))["block_reason"] == "arguments_not_canonical"
    with ctx("nc-j2"):
        pay("fine")
    events = db_events(db)
    assert [e["kind"] for e in events] == ["refused", "pending", "committed"]
    assert events[0]["reason"]["code"] == "arguments_not_canonical"
    assert report_field(journal.verify(), "ok") is True
    lines = export_lines(db)
    prev = ZEROS
    for line in lines:
        assert line["hash"] == event_hash(prev, line)
        prev = line["hash"]
    out = tmp_path / "x.jsonl"
    assert run_cli("journal", "export", "--db", str(db), "--output", str(out)).exit_code == 0
    assert run_cli("journal", "verify", "--export", str(out)).exit_code == 0


def test_journal_uses_wal(journal: Any, db: Path) -> None:
    conn = raw(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    finally:
        conn.close()


def test_verify_finds_a_deleted_event_and_a_truncated_tail(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    n = len(db_events(db))
    middle = db.with_name("middle.db")
    tail = db.with_name("tail.db")
    for target in (middle, tail):
        src = sqlite3.connect(str(db))
        dst = sqlite3.connect(str(target))
        src.backup(dst)
        src.close()
        dst.close()
    conn = raw(middle)
    _drop_triggers(conn)
    conn.execute(f'DELETE FROM "{events_table(conn)}" WHERE seq = 3')
    conn.close()
    result = run_cli("journal", "verify", "--db", str(middle))
    assert result.exit_code == 1, result.output
    # the chain up to seq 6 is intact, but the projection says c-flaky is released and c-forbidden absent
    conn = raw(tail)
    _drop_triggers(conn)
    released_seq = next(e["seq"] for e in db_events(tail) if e["call_id"] == "c-flaky" and e["kind"] == "released")
    conn.execute(f'DELETE FROM "{events_table(conn)}" WHERE seq >= ?', (released_seq,))
    conn.close()
    assert released_seq < n
    result = run_cli("journal", "verify", "--db", str(tail))
    assert result.exit_code == 1, result.output


def test_refusal_raised_is_journaled_once(journal: Any, db: Path) -> None:
    pay = make_pay(guard_for(journal, denied_tools=["pay"], on_block="raise"), [])
    with ctx("rr-1"), pytest.raises(AirlockBlocked):
        pay("a")
    assert count(db, "refused", "policy_violation") == 1


def test_short_contention_is_waited_out(db: Path) -> None:
    journal = SQLiteJournal(str(db), busy_timeout=10.0)
    conn = raw(db)
    runs: list[Any] = []
    try:
        pay = make_pay(guard_for(journal), runs)
        conn.execute("BEGIN IMMEDIATE")
        timer = threading.Timer(0.3, lambda: conn.execute("ROLLBACK"))
        timer.start()
        with ctx("cw-1"):
            result = pay("a")
        timer.join()
        assert result == {"charged": 100, "account": "a"}
        assert runs == [("a", 100)]
    finally:
        conn.close()
        close(journal)


def test_projection_can_be_rebuilt_from_the_log(journal: Any, db: Path) -> None:
    populate(journal)
    before = projected_fields(db_calls(db))
    conn = raw(db)
    try:
        try:
            conn.execute(f'DELETE FROM "{projection_table(conn)}"')
        except sqlite3.DatabaseError:
            pytest.skip("the projection cannot be emptied by hand here")
    finally:
        conn.close()
    assert db_calls(db) == {}
    journal.rebuild()
    assert projected_fields(db_calls(db)) == before
    assert report_field(journal.verify(), "ok") is True


def test_journal_files_created_by_the_cli_are_private(tmp_path: Path) -> None:
    path = tmp_path / "demo.db"
    assert run_cli("demo", "--db", str(path)).exit_code == 0
    assert path.stat().st_mode & 0o777 == 0o600


def test_wal_file_is_private_too(journal: Any, db: Path) -> None:
    populate(journal)
    for suffix in ("-wal", "-shm"):
        side = Path(str(db) + suffix)
        if side.exists():
            assert side.stat().st_mode & 0o777 == 0o600, suffix


@pytest.mark.parametrize("verb", ["INSERT OR REPLACE", "REPLACE"])
def test_database_refuses_replacing_an_event(journal: Any, db: Path, verb: str) -> None:
    populate(journal)
    before = db_events(db)
    conn = raw(db)
    try:
        t = events_table(conn)
        row = dict(conn.execute(f'SELECT * FROM "{t}" WHERE seq = 1').fetchone())
        row["tool"] = "forged"
        cols = list(row)
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute(f'{verb} INTO "{t}" ({",".join(cols)}) VALUES ({",".join("?" * len(cols))})',
                         [row[c] for c in cols])
    finally:
        conn.close()
    assert db_events(db) == before


def test_threads_with_many_ids_keep_the_log_gapless(journal: Any, db: Path) -> None:
    pay = make_pay(guard_for(journal), [])

    def worker(n: int) -> None:
        for i in range(10):
            with ctx(f"w{n}-{i}"):
                pay(f"acct-{n}", i)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    events = db_events(db)
    assert [e["seq"] for e in events] == list(range(1, 121))
    assert len(db_calls(db)) == 60
    assert all(c["status"] == "committed" for c in db_calls(db).values())
    report = journal.verify()
    assert report_field(report, "ok") is True and report_field(report, "events") == 120


MANY_IDS_SCRIPT = r"""
import sys
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
j = SQLiteJournal(sys.argv[1])
@Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=j)))
def charge(account, n):
    return n
for i in range(15):
    with AirlockContext(metadata={"tool_call_id": f"{sys.argv[2]}-{i}"}):
        charge("a", i)
j.close()
"""


def test_processes_with_many_ids_keep_the_log_gapless(tmp_path: Path) -> None:
    db = tmp_path / "many.db"
    close(SQLiteJournal(str(db)))
    procs = [subprocess.Popen([PYTHON, "-c", MANY_IDS_SCRIPT, str(db), f"p{n}"], stderr=subprocess.PIPE, text=True)
             for n in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    events = db_events(db)
    assert [e["seq"] for e in events] == list(range(1, 91))
    assert len({e["owner"]["pid"] for e in events}) == 3
    result = run_cli("journal", "verify", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("OK: 90 events, head ")


def test_unicode_everywhere_hashes_by_the_rule(journal: Any, db: Path, tmp_path: Path) -> None:
    airlock = guard_for(journal)

    @airlock
    def grüßen(name: str, extra: dict[str, Any]) -> dict[str, Any]:
        return {"gruß": name, "emoji": "\U0001f600", "n": 2**63 + 5, "f": 0.1}

    with AirlockContext(agent_id="agént-ß", metadata={"tool_call_id": "ид-1"}):
        grüßen("Zoë", {"ü": 1, "a": [1.5, None, True]})
    with AirlockContext(agent_id="agént-ß", metadata={"tool_call_id": "ид-1"}):
        assert grüßen("Zoë", {"ü": 1, "a": [1.5, None, True]})["gruß"] == "Zoë"
    lines = export_lines(db)
    prev = ZEROS
    for line in lines:
        assert line["hash"] == event_hash(prev, line)
        assert line["arguments_sha256"] == sha(line["arguments"])
        prev = line["hash"]
    committed = next(e for e in lines if e["kind"] == "committed")
    assert committed["value_sha256"] == sha(committed["value"])
    assert committed["value"]["n"] == 2**63 + 5
    out = tmp_path / "u.jsonl"
    assert run_cli("journal", "export", "--db", str(db), "--output", str(out)).exit_code == 0
    assert run_cli("journal", "verify", "--export", str(out)).exit_code == 0


def test_not_a_journal_error_is_clear(tmp_path: Path) -> None:
    text = tmp_path / "notes.db"
    text.write_text("plain text\n" * 30)
    with pytest.raises(NotAJournal) as info:
        SQLiteJournal(str(text))
    assert not isinstance(info.value, sqlite3.Error)
    assert str(info.value) == (
        f"The file {text} is not a SQLite database, not an airlock journal; it was left unchanged."
    )


def test_verify_finds_a_projection_that_differs_from_the_log(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    for mutation in ("DELETE FROM \"{t}\" WHERE call_id = 'c-ship'",
                     "UPDATE \"{t}\" SET attempt = 7 WHERE call_id = 'c-pay'",
                     "UPDATE \"{t}\" SET tool = 'other' WHERE call_id = 'c-flaky'"):
        copy = db.with_name("copy.db")
        if copy.exists():
            copy.unlink()
        src, dst = sqlite3.connect(str(db)), sqlite3.connect(str(copy))
        src.backup(dst)
        src.close()
        dst.close()
        conn = raw(copy)
        try:
            conn.execute(mutation.format(t=projection_table(conn)))
        except sqlite3.DatabaseError:
            conn.close()
            continue
        conn.close()
        result = run_cli("journal", "verify", "--db", str(copy))
        assert result.exit_code == 1, (mutation, result.output)
        j = SQLiteJournal(str(copy))
        try:
            assert report_field(j.verify(), "ok") is False
        finally:
            close(j)


def test_an_id_with_only_refusals_is_not_seen(journal: Any, db: Path) -> None:
    runs: list[Any] = []
    denied = make_pay(guard_for(journal, denied_tools=["pay"]), runs)
    allowed = make_pay(guard_for(journal), runs)
    with ctx("or-1"):
        assert denied("a")["block_reason"] == "policy_violation"
    with ctx("or-1"):
        assert allowed("b") == {"charged": 100, "account": "b"}
    assert runs == [("b", 100)]
    assert db_calls(db)["or-1"]["attempt"] == 1


def test_json_columns_hold_json_text(journal: Any, db: Path) -> None:
    populate(journal)
    conn = raw(db)
    try:
        t = events_table(conn)
        for col in JSON_COLUMNS:
            types = {r[0] for r in conn.execute(f'SELECT DISTINCT typeof("{col}") FROM "{t}"')}
            assert types <= {"text", "null"}, (col, types)
    finally:
        conn.close()


def test_projection_is_written_with_its_event(journal: Any, db: Path) -> None:
    pay = make_pay(guard_for(journal), [])
    stop = threading.Event()

    def writer(n: int) -> None:
        i = 0
        while not stop.is_set() and i < 60:
            with ctx(f"tx{n}-{i}"):
                pay("a", i)
            i += 1

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    conn = raw(db)
    mismatches = []
    checks = 0
    try:
        et, pt = events_table(conn), projection_table(conn)
        deadline = time.monotonic() + 20
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            conn.execute("BEGIN")
            events = conn.execute(f'SELECT call_id, kind, attempt FROM "{et}" ORDER BY seq').fetchall()
            calls = {r[0]: (r[1], r[2]) for r in conn.execute(f'SELECT call_id, status, attempt FROM "{pt}"')}
            conn.execute("COMMIT")
            fold: dict[str, tuple[str, int]] = {}
            for cid, kind, attempt in events:
                if kind not in ("refused", "replayed"):
                    fold[cid] = (kind, attempt)
            if fold != calls:
                mismatches.append((len(events), len(calls)))
            checks += 1
    finally:
        stop.set()
        for t in threads:
            t.join(300)
        conn.close()
    assert checks > 0
    assert mismatches == []


TZ_SCRIPT = r"""
import sys
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
j = SQLiteJournal(sys.argv[1])
@Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=j)))
def charge(account):
    return "ok"
with AirlockContext(metadata={"tool_call_id": "tz-1"}):
    charge("a")
j.close()
"""


def test_times_are_utc_whatever_the_local_zone(tmp_path: Path) -> None:
    db = tmp_path / "tz.db"
    env = dict(os.environ, TZ="America/Los_Angeles")
    before = dt.datetime.now(dt.UTC)
    subprocess.run([PYTHON, "-c", TZ_SCRIPT, str(db)], check=True, timeout=60, env=env)
    after = dt.datetime.now(dt.UTC)
    out = subprocess.run([AIRLOCK, "journal", "export", "--db", str(db)], capture_output=True, text=True,
                         timeout=60, env=env, check=True)
    for line in out.stdout.splitlines():
        at = json.loads(line)["at"]
        assert AT_RE.match(at)
        when = dt.datetime.fromisoformat(at.replace("Z", "+00:00"))
        assert before - dt.timedelta(seconds=2) <= when <= after + dt.timedelta(seconds=2)
    stats = subprocess.run([AIRLOCK, "journal", "show", "tz-1", "--db", str(db), "--json"], capture_output=True,
                           text=True, timeout=60, env=env, check=True)
    for e in json.loads(stats.stdout)["events"]:
        when = dt.datetime.fromisoformat(e["at"].replace("Z", "+00:00"))
        assert before - dt.timedelta(seconds=2) <= when <= after + dt.timedelta(seconds=2)


def test_altered_projection_is_found_by_verify_and_repaired_by_rebuild(journal: Any, db: Path) -> None:
    alter_projection(journal, db)
    assert run_cli("journal", "verify", "--db", str(db)).exit_code == 1
    assert run_cli("journal", "rebuild", "--db", str(db)).exit_code == 0
    assert run_cli("journal", "verify", "--db", str(db)).exit_code == 0
    shown = run_cli("journal", "show", "c-pay", "--db", str(db), "--json")
    assert json.loads(shown.stdout)["status"] == "committed"


def test_two_journal_objects_on_one_file(db: Path) -> None:
    one, two = SQLiteJournal(str(db)), SQLiteJournal(str(db))
    runs: list[Any] = []
    try:
        first = make_pay(guard_for(one), runs)
        second = make_pay(guard_for(two), runs)
        with ctx("two-1"):
            assert first("a") == {"charged": 100, "account": "a"}
        with ctx("two-1"):
            assert second("a") == {"charged": 100, "account": "a"}
        assert runs == [("a", 100)]
        assert [e["kind"] for e in db_events(db)] == ["pending", "committed", "replayed"]
    finally:
        close(one)
        close(two)
