"""PostgresJournal's server-side append: how every write of the guard goes. The server takes the
call's lock, checks the call's record and places the event: in the log (computing its seq and hash
itself) when no other session seals, else in the inbox, sealed soon after."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from guard.store import Decision, EffectEvent, Verdict
from journal.chain import hash_of
from journal.postgres import PostgresJournal
from journal.postgres.writes import QUEUE
from tests.pgserver import PgServer, fresh_database

pytestmark = pytest.mark.postgres


def counting_server_appends(journal: PostgresJournal, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    outcomes: list[str] = []
    call = journal.datastore.resendable

    def counted(doing: str, sql: str, params: Any) -> tuple[Any, ...]:
        row = call(doing, sql, params)
        outcomes.append(row[0])
        return row

    monkeypatch.setattr(journal.datastore, "resendable", counted)
    return outcomes


def guarded(journal: PostgresJournal) -> Any:
    policy = SecurityPolicy(denied_tools=["wire"], effect_guard=EffectGuard(store=journal))

    @Airlock(policy=policy)
    def charge(account: str, note: str) -> dict[str, Any]:
        if note == "fail":
            raise ValueError("la carte a été refusée ✗ 𝄞")
        return {"account": account, "note": note, "big": 2**62, "ratio": 0.1, "nested": {"é": [1, None]}}

    @Airlock(policy=policy)
    def wire(account: str) -> str:
        return account

    return charge, wire


def test_replicas_writing_in_turn_through_the_server_chain_every_event_as_the_rule_says(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = PostgresJournal(pg_dsn), PostgresJournal(pg_dsn)
    seen_a, seen_b = counting_server_appends(a, monkeypatch), counting_server_appends(b, monkeypatch)
    for journal in (a, b):
        # As under contention: every event waits in the inbox for its seq, each object's record of
        # the last call it wrote often stale (sealed since, or written by the other).
        monkeypatch.setattr(journal.writes, "seal_mode", QUEUE)
    tools = {a: guarded(a), b: guarded(b)}
    for n in range(12):
        journal = (a, b)[n % 2]
        charge, wire = tools[journal]
        note = "fail" if n % 3 == 0 else f"nöte {n}"
        with AirlockContext(agent_id="agént-✓", metadata={"tool_call_id": f"call-{n}"}):
            for _ in range(2):  # a call, then its replay (or, after a failure, its retry)
                with contextlib.suppress(ValueError):
                    charge("acct-ü", note)
        with AirlockContext():
            wire("acct")  # refused without an id
    assert len(seen_a) > 10 and len(seen_b) > 10 and set(seen_a + seen_b) <= {"appended", "changed"}
    events = list(a.events())
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert all(e.hash == hash_of(e) for e in events)  # the server hashed exactly the canonical body
    assert {e.kind for e in events} == {"pending", "committed", "released", "replayed", "refused"}
    report = b.verify()
    assert report.ok, report.problem
    a.close()
    b.close()


def test_an_append_the_server_is_sent_twice_is_appended_once(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a call made again after its connection was cut sends: the same call, the same event.
    with PostgresJournal(pg_dsn) as journal:
        call = journal.datastore.resendable
        replies: list[tuple[Any, ...]] = []

        def twice(doing: str, sql: str, params: Any) -> tuple[Any, ...]:
            replies.append(call(doing, sql, params))  # this reply lost with its connection, say
            replies.append(call(doing, sql, params))
            return replies[-1]

        monkeypatch.setattr(journal.datastore, "resendable", twice)
        journal.append_event(EffectEvent("pending", "c1", "pay", attempt=1, arguments="{}", idempotency_key="k"))
        refused = EffectEvent("refused", None, "pay", reason={"code": "policy_violation", "message": "m"})
        stored = journal.append_event(refused)
        assert [r[:2] for r in replies] == [("appended", 1), ("found", 1), ("appended", 2), ("found", 2)]
        assert [(e.seq, e.kind) for e in journal.events()] == [(1, "pending"), (2, "refused")]
        assert stored.seq == 2 and stored.hash == journal.head()[1]
        # The same content sent anew (another event, even one made at the same moment) is appended.
        journal.append_event(refused)
        assert journal.count_events() == 3 and journal.verify().ok
        # An event that waits in the inbox is found there (by its inbox id, as minus its seq).
        monkeypatch.setattr(journal.writes, "seal_mode", QUEUE)
        replies.clear()
        journal.append(EffectEvent("committed", "c1", "pay", attempt=1, value='"ok"'))
        assert [r[0] for r in replies] == ["appended", "found"] and replies[0][1] == replies[1][1] < 0
        assert [e.kind for e in journal.call_events("c1")] == ["pending", "committed"]
        assert journal.count_events() == 4 and journal.verify().ok


def test_a_decision_taken_on_a_record_that_changed_is_taken_again_on_the_current_one(pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn) as first, PostgresJournal(pg_dsn) as second:
        event = EffectEvent("pending", "c1", "pay", attempt=1, arguments="{}", idempotency_key="k")
        first.begin("c1", lambda record: Decision(Verdict.RUN, event, record))
        seen: list[Any] = []

        def decide(record: Any) -> Decision:
            seen.append(record and record.status)
            if record is None:  # the second object has not seen c1: it decides as for a call never seen
                return Decision(Verdict.RUN, EffectEvent("pending", "c1", "pay", attempt=1, arguments="{}"))
            return Decision(Verdict.REFUSE, EffectEvent("refused", "c1", "pay", attempt=record.attempt,
                                                        reason={"code": "effect_status_unknown", "message": "m"}))

        decision = second.begin("c1", decide)  # its first write: made by the server-side append
        assert seen == [None, "pending"] and decision.verdict is Verdict.REFUSE
        assert [e.kind for e in first.call_events("c1")] == ["pending", "refused"]


@pytest.fixture
def login_without_temporary_objects(pg_server: PgServer) -> Iterator[str]:
    dsn = fresh_database(pg_server)
    dbname = dsn.rsplit("/", 1)[1].split("?", 1)[0]
    statements = [
        "CREATE ROLE airlock_no_temp LOGIN",
        f'REVOKE TEMPORARY ON DATABASE "{dbname}" FROM PUBLIC',
        f'GRANT CONNECT ON DATABASE "{dbname}" TO airlock_no_temp',
        "CREATE SCHEMA journal AUTHORIZATION airlock_no_temp",
    ]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement.encode())
    scheme, rest = dsn.split("://", 1)
    where = rest.split("@", 1)[1]
    try:
        yield f"{scheme}://airlock_no_temp@{where}?options={quote('-csearch_path=journal')}"
    finally:
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'.encode())
            conn.execute(b"DROP ROLE IF EXISTS airlock_no_temp")


def test_a_login_that_may_not_make_temporary_objects_appends_the_locked_way(
    login_without_temporary_objects: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="journal.postgres")
    with PostgresJournal(login_without_temporary_objects) as journal:
        charge, _wire = guarded(journal)
        with AirlockContext(metadata={"tool_call_id": "c1"}):
            first = charge("acct", "n")
            assert charge("acct", "n") == first  # a replay
        assert not journal.datastore.server_append
        assert [e.kind for e in journal.events()] == ["pending", "committed", "replayed"]
        assert journal.verify().ok
    assert "the login may not make temporary objects" in caplog.text


def test_a_session_without_the_server_side_append_falls_back_to_the_locked_way(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with PostgresJournal(pg_dsn, pool_size=1) as journal:
        journal.append_event(EffectEvent("refused", None, "pay", reason={"code": "policy_violation", "message": "m"}))
        with journal.datastore.pool.connection() as conn:  # the pool's one session loses its function
            conn.execute(b"DROP FUNCTION pg_temp.airlock_append")
        decision = journal.begin("c1", lambda record: Decision(
            Verdict.RUN, EffectEvent("pending", "c1", "pay", attempt=1, arguments="{}"), record))
        assert decision.verdict is Verdict.RUN and not journal.datastore.server_append
        assert [e.kind for e in journal.events()] == ["refused", "pending"]
        assert journal.verify().ok


def test_a_database_whose_default_isolation_is_repeatable_read_takes_concurrent_writes(pg_dsn: str) -> None:
    dbname = pg_dsn.rsplit("/", 1)[1].split("?", 1)[0]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE \"{dbname}\" SET default_transaction_isolation = 'repeatable read'".encode())
    journals = [PostgresJournal(pg_dsn) for _ in range(2)]
    results: list[Any] = []

    def replica(k: int) -> None:
        charge, _wire = guarded(journals[k % 2])
        for n in range(25):
            with AirlockContext(metadata={"tool_call_id": f"r{k}-{n}"}):
                results.append(charge("acct", f"n{n}"))

    threads = [threading.Thread(target=replica, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    refusals = [r for r in results if is_refusal(r)]
    assert len(results) == 100 and refusals == []  # none refused store_unavailable by a serialization error
    assert journals[0].count_events() == 200 and journals[0].verify().ok
    for journal in journals:
        journal.close()


def decide_as_the_guard(call_id: str, at: datetime) -> Any:
    """The replay table's choice for ``call_id``, its event stamped ``at`` (a clock that stands still)."""

    def decide(record: Any) -> Decision:
        if record is None:
            return Decision(Verdict.RUN, EffectEvent("pending", call_id, "pay", at=at, attempt=1, arguments="{}"))
        if record.status == "committed":
            return Decision(Verdict.REPLAY, EffectEvent("replayed", call_id, "pay", at=at, attempt=record.attempt),
                            record)
        return Decision(Verdict.REFUSE, EffectEvent("refused", call_id, "pay", at=at, attempt=record.attempt,
                                                    reason={"code": "effect_status_unknown", "message": "m"}),
                        record)

    return decide


def test_two_objects_of_one_process_on_a_clock_that_stands_still_never_both_run_a_call(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two events of one process alike in every field would look like one append sent twice.
    at = datetime.now(UTC)
    with PostgresJournal(pg_dsn) as first, PostgresJournal(pg_dsn) as second:
        for journal in (first, second):
            monkeypatch.setattr(journal.writes, "seal_mode", QUEUE)
        verdicts = [j.begin("c1", decide_as_the_guard("c1", at)).verdict for j in (first, second)]
        assert verdicts == [Verdict.RUN, Verdict.REFUSE]
        events = list(first.events())
        assert [e.kind for e in events] == ["pending", "refused"]
        assert events[0].at == at and events[1].at > at  # the later one stamped a microsecond on
        refusal = EffectEvent("refused", None, "pay", at=at, reason={"code": "policy_violation", "message": "m"})
        first.append_event(refusal)
        second.append_event(refusal)  # the same refusal, made twice: two events
        assert first.count_events() == 4 and first.verify().ok


@pytest.mark.parametrize("first_write", ["on the server", "a compare-and-set"])
def test_a_refusal_written_for_a_call_another_object_committed_does_not_make_it_look_unseen(
    pg_dsn: str, first_write: str
) -> None:
    at = datetime.now(UTC)
    with PostgresJournal(pg_dsn) as first:
        first.begin("x", decide_as_the_guard("x", at))
        first.append(EffectEvent("committed", "x", "pay", attempt=1, value='"ok"'))
    with PostgresJournal(pg_dsn) as other:  # a new object's first write is made on the server
        if first_write == "a compare-and-set":
            other.begin("y", decide_as_the_guard("y", datetime.now(UTC)))  # the next one is not
        # A gate refuses x (its record not read), then the call comes again: a replay, not a run.
        other.append_event(EffectEvent("refused", "x", "pay", reason={"code": "rate_limited", "message": "m"}))
        decision = other.begin("x", decide_as_the_guard("x", datetime.now(UTC)))
        assert decision.verdict is Verdict.REPLAY
        assert [e.kind for e in other.call_events("x")] == ["pending", "committed", "refused", "replayed"]
        assert other.verify().ok


def test_refusals_made_on_the_server_never_keep_a_record_another_replica_changed(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with PostgresJournal(pg_dsn) as first, PostgresJournal(pg_dsn) as second:
        first.begin("x", decide_as_the_guard("x", datetime.now(UTC)))
        first.append(EffectEvent("released", "x", "pay", attempt=1, error={"type": "E", "message": "m"}))
        second.begin("x", lambda record: Decision(
            Verdict.RUN, EffectEvent("pending", "x", "pay", attempt=2, arguments="{}"), record))
        for _ in range(9):  # a gate refuses x on the first object (its record not read)
            first.append_event(EffectEvent("refused", "x", "pay", reason={"code": "rate_limited", "message": "m"}))
        # Then the first object's begin: decided on the record it wrote, attempt 2 would run again.
        decision = first.begin("x", decide_as_the_guard("x", datetime.now(UTC)))
        assert decision.verdict is Verdict.REFUSE and decision.record is not None
        assert decision.record.attempt == 2 and decision.record.status == "pending"
        assert [e.kind for e in first.call_events("x")].count("pending") == 2  # attempts 1 and 2, once each


def test_a_clock_set_back_and_a_naive_time_still_give_every_event_a_time_of_its_own(pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn) as first, PostgresJournal(pg_dsn) as second:
        first.append_event(EffectEvent("refused", None, "pay", reason={"code": "policy_violation", "message": "m"}))
        back = datetime.now(UTC) - timedelta(hours=1)  # a test's clock, frozen an hour ago
        verdicts = [j.begin("c1", decide_as_the_guard("c1", back)).verdict for j in (first, second)]
        assert verdicts == [Verdict.RUN, Verdict.REFUSE]
        naive = datetime.now()  # a naive local time, as a caller might pass one
        first.append_event(EffectEvent("refused", None, "pay", at=naive,
                                       reason={"code": "policy_violation", "message": "m"}))
        assert first.begin("c2", decide_as_the_guard("c2", datetime.now(UTC))).verdict is Verdict.RUN
        times = [e.at for e in first.events()]
        assert len(set(times)) == len(times) == 5 and times == sorted(times)
        assert first.verify().ok


def test_an_event_of_no_call_takes_the_same_lock_the_locked_way_as_on_the_server(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server-side append keys the lock of events of no call by 0; the locked way must take that
    # same lock, not skip it (a NULL key takes none).
    with PostgresJournal(pg_dsn, pool_size=2) as journal:
        monkeypatch.setattr(journal.datastore, "server_append", False)
        refused = EffectEvent("refused", None, "pay", reason={"code": "policy_violation", "message": "m"})
        with psycopg.connect(pg_dsn) as holder:
            holder.execute(b"SELECT pg_advisory_xact_lock(hashtext(%s), 0)", (journal.schema,))
            done = threading.Event()
            writer = threading.Thread(target=lambda: (journal.append_event(refused), done.set()))
            writer.start()
            with psycopg.connect(pg_dsn, autocommit=True) as watcher:
                deadline = time.monotonic() + 120.0
                while watcher.execute(b"SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                      b"AND wait_event = 'advisory' AND datname = current_database()"
                                      ).fetchone() != (1,):
                    assert time.monotonic() < deadline, "the append never waited for the lock"
                    time.sleep(0.01)
            assert not done.is_set()
            holder.rollback()  # lets go of the lock
            writer.join(timeout=120.0)
        assert done.is_set()
        assert [e.kind for e in journal.events()] == ["refused"]
