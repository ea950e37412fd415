"""PostgresJournal on a real server: its schema, the append-only log, foreign and newer databases,
tamper evidence, read-only use and bad input."""

from __future__ import annotations

import random
import socket
import string
import threading
from typing import Any

import orjson
import psycopg
import pytest

from guard.store import Decision, EffectEvent, Verdict
from journal import CallNotFound, JournalError, JournalNotFound, NewerSchema, NotAJournal, NotResolvable
from journal.chain import GENESIS
from journal.postgres import PostgresJournal
from journal.postgres import schema as pg_schema
from tests.pgserver import PgServer

pytestmark = pytest.mark.postgres


def run(journal: PostgresJournal, call_id: str, tool: str = "charge", attempt: int = 1) -> Decision:
    event = EffectEvent(kind="pending", call_id=call_id, tool=tool, arguments='{"cents":5}', attempt=attempt,
                        idempotency_key="k" * 64)
    return journal.begin(call_id, lambda record: Decision(Verdict.RUN, event, record))


def commit(journal: PostgresJournal, call_id: str, value: str = '{"ok":true}', attempt: int = 1) -> None:
    journal.append(EffectEvent(kind="committed", call_id=call_id, tool="charge", value=value, attempt=attempt))


def snapshot(dsn: str) -> dict[str, Any]:
    """Everything a test can see in the database's public schema: tables, columns, rows, triggers."""
    with psycopg.connect(dsn) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1")]
        columns = conn.execute(
            "SELECT table_name, column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = 'public' ORDER BY 1, 2").fetchall()
        rows = {t: sorted(map(repr, conn.execute(f'SELECT * FROM "{t}"').fetchall())) for t in tables}
        triggers = conn.execute(
            "SELECT tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
            "WHERE NOT t.tgisinternal ORDER BY 1").fetchall()
        functions = conn.execute(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'public' ORDER BY 1").fetchall()
    return {"tables": tables, "columns": columns, "rows": rows, "triggers": triggers, "functions": functions}


@pytest.fixture
def journal(pg_dsn: str) -> Any:
    j = PostgresJournal(pg_dsn)
    yield j
    j.close()


# -- the schema ----------------------------------------------------------------------------------


def test_tables_columns_and_version(journal: PostgresJournal, pg_dsn: str) -> None:
    run(journal, "c1")
    with psycopg.connect(pg_dsn) as conn:
        meta = conn.execute("SELECT application, schema_version FROM airlock_journal_meta").fetchall()
        event_columns = [r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'events' ORDER BY ordinal_position")]
        stored = conn.execute("SELECT at, arguments, owner FROM events WHERE seq = 1").fetchone()
    assert meta == [("airlock-journal", pg_schema.SCHEMA_VERSION)]
    assert event_columns == ["seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "arguments",
                             "value", "error", "reason", "actor", "attempt", "owner", "prev_hash", "hash"]
    assert stored is not None
    at, arguments, owner = stored
    assert at.endswith("Z") and len(at) == len("2026-12-01T05:23:06.123456Z")
    assert arguments == '{"cents":5}'
    assert orjson.loads(owner)["host"] == socket.gethostname()


def test_reopening_keeps_everything(pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn) as j:
        run(j, "c1")
        commit(j, "c1")
        head = j.head()
    with PostgresJournal(pg_dsn, create=False) as j:
        assert j.head() == head
        assert j.get("c1") is not None and j.get("c1").status == "committed"  # type: ignore[union-attr]
        assert j.verify().ok


def test_replicas_opening_an_empty_database_together_make_one_journal(pg_dsn: str) -> None:
    opened: list[PostgresJournal] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def open_one() -> None:
        barrier.wait()
        try:
            opened.append(PostgresJournal(pg_dsn, pool_size=1))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for n, j in enumerate(opened):
        run(j, f"c{n}")
    assert opened[0].head()[0] == 6 and opened[0].verify().ok
    for j in opened:
        j.close()


# -- append-only ---------------------------------------------------------------------------------


@pytest.mark.parametrize("statement", [
    "UPDATE events SET value = '{\"ok\":false}' WHERE seq = 2",
    "DELETE FROM events WHERE seq = 1",
    "TRUNCATE events",
    "INSERT INTO events SELECT * FROM events WHERE seq = 2 ON CONFLICT (seq) DO UPDATE SET value = NULL",
])
def test_the_database_refuses_to_change_an_event(journal: PostgresJournal, pg_dsn: str, statement: str) -> None:
    run(journal, "c1")
    commit(journal, "c1")
    before = snapshot(pg_dsn)
    with psycopg.connect(pg_dsn) as conn, pytest.raises(psycopg.errors.IntegrityConstraintViolation,
                                                        match="append-only"):
        conn.execute(statement)  # type: ignore[arg-type]
    assert snapshot(pg_dsn) == before
    assert journal.verify().ok


# -- tamper evidence -----------------------------------------------------------------------------


def _as_superuser_bypassing_triggers(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SET session_replication_role = replica")  # what an intruder with superuser can do
        conn.execute(statement)  # type: ignore[arg-type]


def test_verify_names_an_altered_event(journal: PostgresJournal, pg_dsn: str) -> None:
    for n in range(1, 4):
        run(journal, f"c{n}")
        commit(journal, f"c{n}")
    assert journal.verify().ok
    _as_superuser_bypassing_triggers(pg_dsn, "UPDATE events SET value = '{\"ok\":false}' WHERE seq = 4")
    report = journal.verify()
    assert not report.ok and report.first_bad_seq == 4
    assert "altered" in (report.problem or "")


def test_verify_names_a_removed_event(journal: PostgresJournal, pg_dsn: str) -> None:
    for n in range(1, 4):
        run(journal, f"c{n}")
    _as_superuser_bypassing_triggers(pg_dsn, "DELETE FROM events WHERE seq = 2")
    report = journal.verify()
    assert not report.ok and report.first_bad_seq == 3
    assert "missing" in (report.problem or "")


def test_verify_names_the_first_event_cut_from_the_end(journal: PostgresJournal, pg_dsn: str) -> None:
    for n in range(1, 4):
        run(journal, f"c{n}")
    _as_superuser_bypassing_triggers(pg_dsn, "DELETE FROM events WHERE seq = 3")
    report = journal.verify()
    assert (report.ok, report.events, report.first_bad_seq) == (False, 2, 3)
    assert (report.problem or "").startswith("seq 3 is missing: the log ends at seq 2")


def test_verify_names_a_rewritten_tail(journal: PostgresJournal, pg_dsn: str) -> None:
    run(journal, "c1")
    run(journal, "c2")
    # A consistent rewrite of the last event and the head row still breaks the link to it.
    _as_superuser_bypassing_triggers(pg_dsn, "UPDATE events SET prev_hash = repeat('1', 64) WHERE seq = 2")
    report = journal.verify()
    assert not report.ok and report.first_bad_seq == 2


def test_verify_finds_a_projection_that_differs_and_rebuild_repairs_it(journal: PostgresJournal,
                                                                       pg_dsn: str) -> None:
    run(journal, "c1")
    commit(journal, "c1")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("UPDATE calls SET status = 'released' WHERE call_id = 'c1'")
    report = journal.verify()
    assert not report.ok and "projection" in (report.problem or "") and report.first_bad_seq == 2
    assert journal.rebuild() == 1
    assert journal.verify().ok
    assert journal.get("c1").status == "committed"  # type: ignore[union-attr]


def test_verify_finds_a_head_row_that_is_not_the_log_s_last_event(journal: PostgresJournal, pg_dsn: str) -> None:
    for call_id in ("c1", "c2"):
        run(journal, call_id)
        commit(journal, call_id)
    assert journal.verify().ok
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
        conn.execute("DELETE FROM events WHERE seq >= 3")  # the log cut short; the head row still says 4
    report = journal.verify()
    assert (report.ok, report.events, report.first_bad_seq) == (False, 2, 3)
    assert report.problem == "seq 3 to 4 are missing: the log ends at seq 2 but the chain head row records seq 4"
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SET airlock.layout = '6'")  # as the journal's own sessions, which may move the head
        conn.execute("UPDATE chain_head SET seq = 2, hash = %s WHERE id = 1", ("0" * 64,))
    report = journal.verify()
    assert (report.ok, report.first_bad_seq) == (False, 2)
    assert "the chain head row" in (report.problem or "") and "does not match the last event" in (report.problem or "")


def test_verify_of_an_empty_journal(journal: PostgresJournal) -> None:
    report = journal.verify()
    assert report.ok and report.events == 0 and report.head == GENESIS
    assert journal.head() == (0, GENESIS)


# -- databases that are not (this version of) a journal ------------------------------------------


def test_a_database_of_another_application_is_refused_and_left_unchanged(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("CREATE TABLE events (id serial PRIMARY KEY, title text)")
        conn.execute("CREATE TABLE users (id int)")
        conn.execute("INSERT INTO events (title) VALUES ('launch'), ('review')")
    before = snapshot(pg_dsn)
    for options in ({}, {"readonly": True}, {"create": False}):
        with pytest.raises(NotAJournal, match=r"not an airlock journal.*left unchanged"):
            PostgresJournal(pg_dsn, **options)
    assert snapshot(pg_dsn) == before


def test_a_meta_table_of_another_application_is_refused(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("CREATE TABLE airlock_journal_meta (id smallint PRIMARY KEY, application text, "
                     "schema_version int)")
        conn.execute("INSERT INTO airlock_journal_meta VALUES (1, 'something-else', 1)")
    before = snapshot(pg_dsn)
    with pytest.raises(NotAJournal, match="something-else"):
        PostgresJournal(pg_dsn)
    assert snapshot(pg_dsn) == before


@pytest.mark.parametrize("table", [
    "CREATE TABLE airlock_journal_meta (id smallint PRIMARY KEY, application text, schema_version text)",
    "CREATE TABLE airlock_journal_meta (id smallint PRIMARY KEY, owner text, note text)",
])
def test_a_meta_table_of_another_shape_is_refused_without_a_traceback(pg_dsn: str, table: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(table)
        if "schema_version" in table:
            conn.execute("INSERT INTO airlock_journal_meta VALUES (1, 'airlock-journal', 'one')")
    before = snapshot(pg_dsn)
    for options in ({}, {"readonly": True}):
        with pytest.raises(NotAJournal, match=r"airlock_journal_meta is not a journal's meta table.*left unchanged"):
            PostgresJournal(pg_dsn, **options)
    assert snapshot(pg_dsn) == before


def test_a_journal_of_a_newer_schema_is_refused_and_left_unchanged(pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn) as j:
        run(j, "c1")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("UPDATE airlock_journal_meta SET schema_version = 99")
    before = snapshot(pg_dsn)
    for options in ({}, {"readonly": True}):
        with pytest.raises(NewerSchema, match=r"version 99.*left unchanged"):
            PostgresJournal(pg_dsn, **options)
    assert snapshot(pg_dsn) == before


def test_a_missing_database_is_journal_not_found(pg_server: PgServer) -> None:
    with pytest.raises(JournalNotFound, match="does not exist"):
        PostgresJournal(pg_server.dsn_for("no_such_database_here"))


@pytest.mark.parametrize("options", [{"readonly": True}, {"create": False}])
def test_an_empty_database_is_not_made_a_journal_without_create(pg_dsn: str, options: dict[str, bool]) -> None:
    with pytest.raises(JournalNotFound):
        PostgresJournal(pg_dsn, **options)
    assert snapshot(pg_dsn)["tables"] == []


def test_an_unknown_search_path_schema_is_journal_not_found(pg_server: PgServer, pg_dsn: str) -> None:
    dbname = pg_dsn.rsplit("/", 1)[1]
    with pytest.raises(JournalNotFound, match="schema"):
        PostgresJournal(pg_server.dsn_for(dbname, options="-csearch_path=nowhere"))


# -- read-only and bad input ---------------------------------------------------------------------


def test_readonly_reads_and_refuses_every_write(pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn) as j:
        run(j, "c1")
    before = snapshot(pg_dsn)
    with PostgresJournal(pg_dsn, readonly=True) as ro:
        assert [e.kind for e in ro.events()] == ["pending"]
        assert ro.verify().ok
        with pytest.raises(JournalError, match="read-only"):
            run(ro, "c2")
        with pytest.raises(JournalError, match="read-only"):
            commit(ro, "c1")
        with pytest.raises(JournalError, match="read-only"):
            ro.resolve("c1", applied=False, reason="checked", operator="ops", force=True)
        with pytest.raises(JournalError, match="read-only"):
            ro.rebuild()
    assert snapshot(pg_dsn) == before


@pytest.mark.parametrize(("dsn", "problem"), [
    ("postgresql://[broken", "not a PostgreSQL connection string (end of string reached"),
    ("host=127.0.0.1 port=notaport", 'libpq does not take (connection is bad: invalid integer value "notaport"'),
    ("postgresql://127.0.0.1:99999/x", 'a value libpq does not take (connection is bad: invalid port number: "99999")'),
    ("postgresql://127.0.0.1:1/x?target_session_attrs=any-but-this", "invalid target_session_attrs value"),
])
def test_a_malformed_dsn_is_a_clear_error(dsn: str, problem: str) -> None:
    with pytest.raises(JournalError) as info:
        PostgresJournal(dsn)
    assert problem in str(info.value) and "cannot be reached" not in str(info.value)


@pytest.mark.parametrize("options", [{"pool_size": 0}, {"busy_timeout": 0}, {"connect_timeout": -1}])
def test_bad_options_are_refused(pg_dsn: str, options: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PostgresJournal(pg_dsn, **options)  # type: ignore[arg-type]
    assert snapshot(pg_dsn)["tables"] == []


def test_an_event_that_cannot_be_stored_is_refused_and_changes_nothing(journal: PostgresJournal) -> None:
    run(journal, "c1")
    head = journal.head()
    with pytest.raises(JournalError, match="cannot store this event"):
        journal.append(EffectEvent(kind="unknown", call_id="c1", tool="charge", attempt=1,
                                   error={"type": "X", "message": object()}))
    assert journal.head() == head and journal.get("c1").status == "pending"  # type: ignore[union-attr]


def test_resolve_checks_in_its_transaction_and_changes_nothing_when_refused(journal: PostgresJournal) -> None:
    run(journal, "live")  # pending, owned by this (live) process
    run(journal, "done")
    commit(journal, "done")
    head = journal.head()
    with pytest.raises(CallNotFound):
        journal.resolve("nobody", applied=True, reason="r", operator="ops")
    with pytest.raises(NotResolvable, match="committed"):
        journal.resolve("done", applied=False, reason="r", operator="ops")
    with pytest.raises(NotResolvable, match="alive"):
        journal.resolve("live", applied=True, reason="r", operator="ops")
    with pytest.raises(ValueError, match="not valid JSON"):
        journal.resolve("live", applied=True, reason="r", operator="ops", value="{nope", force=True)
    with pytest.raises(ValueError):
        journal.resolve("live", applied=False, reason="r", operator="ops", value="1", force=True)
    assert journal.head() == head
    event = journal.resolve("live", applied=True, reason="ledger shows it", operator="ops",
                            value='{"b": 1, "a": 2}', force=True)
    assert (event.seq, event.kind, event.actor, event.value) == (4, "committed", "operator:ops", '{"a":2,"b":1}')
    assert event.reason == {"code": "applied", "message": "ledger shows it"}
    assert journal.get("live").value == '{"a":2,"b":1}'  # type: ignore[union-attr]
    assert journal.head() == (4, event.hash) and journal.verify().ok


def test_closed_journal_refuses_use(pg_dsn: str) -> None:
    j = PostgresJournal(pg_dsn)
    j.close()
    j.close()
    with pytest.raises(JournalError, match="closed"):
        run(j, "c1")


# -- reads ---------------------------------------------------------------------------------------


def test_events_stream_in_batches_and_filter(journal: PostgresJournal) -> None:
    for n in range(2500):
        run(journal, f"c{n}", tool="a" if n % 2 else "b")
    assert journal.count_events() == 2500
    seqs = [e.seq for e in journal.events()]
    assert seqs == list(range(1, 2501))
    assert [e.seq for e in journal.events(after_seq=2490)] == list(range(2491, 2501))
    assert journal.count_events(tool="a") == 1250
    assert all(e.tool == "a" for e in journal.events(tool="a"))
    assert [e.call_id for e in journal.events(call_id="c7")] == ["c7"]
    stats = journal.stats()
    assert (stats.calls, stats.events, stats.by_status, stats.by_tool) == (
        2500, 2500, {"pending": 2500}, {"a": 1250, "b": 1250})
    assert stats.oldest_pending_at == journal.get("c0").since  # type: ignore[union-attr]
    newest = journal.calls(limit=3)
    assert [r.call_id for r in newest] == ["c2499", "c2498", "c2497"]


# -- the one-round-trip path ---------------------------------------------------------------------


def decide_like_the_guard(call_id: str, seen: list[Any]) -> Any:
    """Run a call never seen; replay a committed one; refuse anything else (and note what was seen)."""

    def decide(record: Any) -> Decision:
        seen.append(None if record is None else record.status)
        if record is None:
            return Decision(Verdict.RUN, EffectEvent(kind="pending", call_id=call_id, tool="charge", attempt=1))
        kind, verdict = ("replayed", Verdict.REPLAY) if record.status == "committed" else ("refused", Verdict.REFUSE)
        return Decision(verdict, EffectEvent(kind=kind, call_id=call_id, tool="charge", attempt=record.attempt),
                        record)

    return decide


def test_an_older_call_is_decided_on_its_record_after_other_calls(journal: PostgresJournal) -> None:
    seen: list[Any] = []
    for call_id in ("old", "new"):
        journal.begin(call_id, decide_like_the_guard(call_id, seen))
        commit(journal, call_id)
    decision = journal.begin("old", decide_like_the_guard("old", seen))
    assert decision.verdict is Verdict.REPLAY
    assert [e.kind for e in journal.events(call_id="old")] == ["pending", "committed", "replayed"]
    assert journal.verify().ok


def test_two_journals_interleaving_keep_one_gapless_chain(pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn) as a, PostgresJournal(pg_dsn) as b:
        for n in range(20):
            first, second = (a, b) if n % 2 else (b, a)
            first.begin(f"c{n}", decide_like_the_guard(f"c{n}", []))
            second.begin(f"c{n}", decide_like_the_guard(f"c{n}", []))  # refused: it is pending
            commit(first, f"c{n}")
            assert second.begin(f"c{n}", decide_like_the_guard(f"c{n}", [])).verdict is Verdict.REPLAY
        report = a.verify()
        assert report.ok and report.events == 80
        assert [e.seq for e in b.events()] == list(range(1, 81))
        assert {r.status for r in a.calls(limit=None)} == {"committed"}


def test_a_lock_held_past_the_busy_deadline_is_store_busy_and_the_guard_refuses(pg_dsn: str) -> None:
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard
    from journal import StoreBusy

    ran: list[str] = []
    with PostgresJournal(pg_dsn, busy_timeout=1.0) as journal:
        @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
        def charge(account: str, cents: int) -> int:
            ran.append(account)
            return cents

        with AirlockContext(metadata={"tool_call_id": "c0"}):
            assert charge("a", 1) == 1
        with psycopg.connect(pg_dsn) as other:  # another writer that holds the calls' locks
            for call_id in ("c1", "c2"):
                other.execute("SELECT pg_advisory_xact_lock(hashtext(current_schema()), hashtext(%s))", (call_id,))
            with pytest.raises(StoreBusy, match="locked"):
                run(journal, "c1")
            with AirlockContext(metadata={"tool_call_id": "c2"}):
                refusal = charge("b", 2)
            assert refusal["block_reason"] == "store_unavailable"
            assert "StoreBusy" in refusal["metadata"]["store_error"]
            with AirlockContext(metadata={"tool_call_id": "c3"}):
                assert charge("c", 3) == 3  # another call does not wait on them
        with AirlockContext(metadata={"tool_call_id": "c2"}):
            assert charge("b", 2) == 2  # the lock is gone: the call runs
        assert ran == ["a", "c", "b"]
        assert journal.verify().ok and journal.get("c1") is None


def test_a_nul_character_cannot_be_stored_and_changes_nothing(journal: PostgresJournal) -> None:
    run(journal, "c1")
    head = journal.head()
    with pytest.raises(JournalError, match="NUL"):
        run(journal, "bad\x00id")
    with pytest.raises(JournalError, match="NUL"):
        journal.append(EffectEvent(kind="refused", call_id="c1", tool="charge\x00", attempt=1))
    assert journal.head() == head
    run(journal, "c2")  # the journal carries on
    assert journal.verify().ok and journal.head()[0] == 2


@pytest.mark.parametrize(("value", "problem"), [
    ('{"charge_id": "ch_1", "charge_id": "ch_2"}', "has the key 'charge_id' twice in one object"),
    ("123456789012345678901234567890", "cannot be stored exactly"),
])
def test_resolve_refuses_a_value_that_would_not_be_stored_as_written(
    journal: PostgresJournal, value: str, problem: str
) -> None:
    run(journal, "u1")
    head = journal.head()
    with pytest.raises(ValueError, match=problem):
        journal.resolve("u1", applied=True, value=value, reason="r", operator="ops", force=True)
    assert journal.head() == head and journal.get("u1").status == "pending"


def test_a_call_id_too_long_to_index_is_refused_clearly_and_changes_nothing(journal: PostgresJournal) -> None:
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard

    ran: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(cents: int) -> int:
        ran.append(cents)
        return cents

    run(journal, "c1")
    head = journal.head()
    rng = random.Random(1)  # text that PostgreSQL cannot compress into an index entry
    long_id = "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(3000))
    with AirlockContext(metadata={"tool_call_id": long_id}):
        refusal = charge(5)
    assert refusal["block_reason"] == "store_unavailable" and ran == []
    assert "longer than the journal" in refusal["metadata"]["store_error"]
    assert "cannot be reached" not in refusal["metadata"]["store_error"]
    assert journal.head() == head
    with AirlockContext(metadata={"tool_call_id": long_id[:2000]}):  # long, but within the limit
        assert charge(6) == 6
    assert ran == [6] and journal.verify().ok


def test_a_replay_of_a_call_written_earlier_is_one_statement_and_takes_no_lock(
    journal: PostgresJournal, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decision is taken on the record this object wrote, checked by the server to be still
    the call's: one statement, whatever other replicas append meanwhile."""
    from guard.effect_guard import decide_attempt

    def decide_like_the_guard(call_id: str) -> Any:
        return lambda record: decide_attempt(record, call_id, "charge", "k" * 64, '{"cents":5}', None, False, None)

    for n in range(3):
        run(journal, f"c{n}")
        commit(journal, f"c{n}", value=f'{{"n":{n}}}')
    with PostgresJournal(pg_dsn) as other:  # another replica writes meanwhile
        run(other, "elsewhere")
    statements: list[str] = []
    locked: list[str] = []
    writes = journal.writes  # the part that makes the appends: each way of making one counted
    on_server, locked_write = journal.datastore.resendable, writes._locked_write
    monkeypatch.setattr(journal.datastore, "resendable",
                        lambda d, sql, p: statements.append(sql) or on_server(d, sql, p))
    monkeypatch.setattr(writes, "_locked_write", lambda *a: locked.append(a[0]) or locked_write(*a))
    for n in (0, 1):  # neither is the call this object wrote last
        decision = journal.begin(f"c{n}", decide_like_the_guard(f"c{n}"))
        assert decision.verdict is Verdict.REPLAY and decision.record is not None
        assert decision.record.value == f'{{"n":{n}}}'
    decision = journal.begin("c3", decide_like_the_guard("c3"))
    assert decision.verdict is Verdict.RUN
    assert (len(statements), locked) == (3, [])
    assert [e.kind for e in journal.call_events("c0")] == ["pending", "committed", "replayed"]
    assert journal.verify().ok


def test_reading_the_events_stops_at_the_head_it_began_at(journal: PostgresJournal) -> None:
    # A reader of a log that writers keep appending to ends (it does not chase them).
    for _ in range(1200):
        journal.append(EffectEvent("refused", None, "charge", reason={"code": "policy_violation", "message": "x"}))
    events = journal.events()
    first = next(events)
    for _ in range(300):
        journal.append(EffectEvent("refused", None, "charge", reason={"code": "policy_violation", "message": "x"}))
    assert [first.seq, *(e.seq for e in events)] == list(range(1, 1201))


def test_connections_give_up_on_a_server_the_network_cut_off(pg_dsn: str) -> None:
    # A statement whose packets go unacknowledged, or an idle connection whose keepalives go
    # unanswered, ends within about busy_timeout + connect_timeout, not the kernel's minutes.
    with PostgresJournal(pg_dsn, busy_timeout=3, connect_timeout=2) as j, j.datastore.pool.connection() as conn:
        settings = conn.info.get_parameters()
    assert settings["tcp_user_timeout"] == "5000"
    assert (settings["keepalives"], settings["keepalives_idle"], settings["keepalives_count"]) == ("1", "2", "3")
    with PostgresJournal(pg_dsn + ("&" if "?" in pg_dsn else "?") + "tcp_user_timeout=9000") as j, \
            j.datastore.pool.connection() as conn:
        assert conn.info.get_parameters()["tcp_user_timeout"] == "9000"  # the DSN's own setting stands
