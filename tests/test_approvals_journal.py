"""Approvals that wait for a human (SPEC section 10) in every store, driven through the real guard:
an ``ApprovalQueue`` keeps its requests in the effect guard's store, operators decide them with
``decide_request``, an overdue one expires. On the two journals, the requests are on the hash chain
and in a projection that verify checks, rebuild makes again, copy carries over, an archive never
takes an open one from, and an older journal gets by migration."""

from __future__ import annotations

import asyncio
import multiprocessing
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.approvals import ApprovalQueue, ApprovalRequest, NotDecidable, decide_request, expire_overdue
from guard.effect_guard import EffectGuard, InMemoryEffectStore
from guard.store import Decision, EffectEvent, Verdict, utc_now
from journal import JournalError, SQLiteJournal
from tests.cli_support import invoke
from tests.journals import JOURNAL_FACTORIES, JOURNAL_PARAMS, Database, journal_factory
from tests.postgres.test_roles import deployed  # noqa: F401  (the roles of docs/postgres.md, deployed)
from tests.stores import contended

SPAWN = multiprocessing.get_context("spawn")
STORES = ["memory", *JOURNAL_PARAMS]
RAN = {"charged": 500}


# -- the stores ------------------------------------------------------------------------------------


def open_store(kind: str, target: str) -> Any:
    """Another object of the journal at ``target``, of the store named ``kind`` in tests/journals.py."""
    return JOURNAL_FACTORIES[kind].open(target)


class Place:
    """Where a test's store lives: ``open()`` gives an object of it (the one in-memory store itself)."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.memory: InMemoryEffectStore | None = None
        if kind == "memory":
            self.target = ""
            self.memory = InMemoryEffectStore()
        else:
            self.target = JOURNAL_FACTORIES[kind].target(tmp_path)

    @property
    def database(self) -> Database:
        """The database under the journal, for plain SQL."""
        return JOURNAL_FACTORIES[self.kind].database(self.target)

    def open(self) -> Any:
        return self.memory if self.memory is not None else open_store(self.kind, self.target)


@pytest.fixture(params=STORES)
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param != "memory":
        journal_factory(request)
    return Place(request.param, tmp_path)


@pytest.fixture(params=JOURNAL_PARAMS)
def journal_place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    journal_factory(request)
    return Place(request.param, tmp_path)


@pytest.fixture
def store(place: Place) -> Iterator[Any]:
    made = place.open()
    yield made
    with suppress(AttributeError):
        made.close()


@pytest.fixture
def journal(journal_place: Place) -> Iterator[Any]:
    made = journal_place.open()
    yield made
    made.close()


class Charger:
    """A guarded ``charge`` tool that must be approved; each run appends a line to ``effects``
    (so effects are counted across processes)."""

    def __init__(self, store: Any, queue: ApprovalQueue, effects: Path) -> None:
        self.effects = effects
        policy = SecurityPolicy(escalate_tools={"charge": "moves money"}, approver=queue,
                                effect_guard=EffectGuard(store=store))

        @Airlock(policy=policy)
        def charge(account: str, cents: int) -> dict[str, int]:
            with effects.open("a") as f:
                f.write(f"{account} {cents}\n")
            return {"charged": cents}

        self.charge = charge
        self.charge_async = _async_charge(policy, effects)

    def __call__(self, call_id: str, cents: int = 500) -> Any:
        with AirlockContext(metadata={"tool_call_id": call_id}):
            return self.charge("acct_1", cents)

    async def call_async(self, call_id: str, cents: int = 500) -> Any:
        with AirlockContext(metadata={"tool_call_id": call_id}):
            return await self.charge_async("acct_1", cents)

    def ran(self) -> int:
        """How many times the tool has run (in any process)."""
        return len(self.effects.read_text().splitlines()) if self.effects.exists() else 0


def _async_charge(policy: SecurityPolicy, effects: Path) -> Any:
    """The ``async def`` form of the tool, under the same name (``charge``, which must be approved)."""

    @Airlock(policy=policy)
    async def charge(account: str, cents: int) -> dict[str, int]:
        with effects.open("a") as f:
            f.write(f"{account} {cents}\n")
        return {"charged": cents}

    return charge


def charger(store: Any, tmp_path: Path, **queue: Any) -> Charger:
    return Charger(store, ApprovalQueue(**queue), tmp_path / "effects.txt")


def code(result: Any) -> str | None:
    """The refusal code of a guarded call's result (None when the tool ran)."""
    return result["block_reason"] if isinstance(result, dict) and "block_reason" in result else None


def kinds(store: Any, call_id: str) -> list[str]:
    return [e.kind for e in store.events(call_id=call_id)]


def verified(store: Any) -> None:
    """A journal verifies (the in-memory store has no verify)."""
    verify = getattr(store, "verify", None)
    if verify is not None:
        report = verify()
        assert report.ok, report


def wait_until(condition: Callable[[], Any], seconds: float = 30.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.01)
    raise AssertionError("the condition was not met")


def approve(store: Any, call_id: str, operator: str = "alice", reason: str = "looks right") -> ApprovalRequest:
    return decide_request(store, call_id, approve=True, operator=operator, reason=reason)[1]


def only_request(store: Any, call_id: str) -> ApprovalRequest:
    found = store.approval_requests(call_id=call_id)
    assert len(found) == 1, found
    return found[0]


# -- asking, granting, denying, expiring (every store) ---------------------------------------------


def test_a_request_is_asked_once_however_often_the_agent_retries(store: Any, tmp_path: Path) -> None:
    tool = charger(store, tmp_path)
    results = [tool("c1") for _ in range(3)]
    assert [code(r) for r in results] == ["approval_pending"] * 3
    rids = {r["metadata"]["request_id"] for r in results}
    assert len(rids) == 1
    request = only_request(store, "c1")
    assert (request.request_id, request.status, request.tool, request.reason, request.replay) == (
        rids.pop(), "open", "charge", "moves money", False)
    assert request.arguments == '{"account":"acct_1","cents":500}'
    assert results[0]["metadata"]["expires_at"] == request.to_json()["expires_at"]
    assert kinds(store, "c1") == ["approval_requested", "refused", "refused", "refused"]
    assert tool.ran() == 0 and store.get("c1") is None
    if hasattr(store, "stats"):
        stats = store.stats()
        assert (stats.approvals_open, stats.oldest_open_approval_at) == (1, request.requested_at)
        assert stats.calls == 0  # a request makes no call
    verified(store)


def test_an_approval_lets_exactly_one_attempt_through(store: Any, tmp_path: Path) -> None:
    tool = charger(store, tmp_path)
    first = tool("c1")
    granted = approve(store, "c1")
    assert (granted.status, granted.approvers, granted.decision_reason) == ("approved", ("operator:alice",),
                                                                            "looks right")
    assert tool("c1") == RAN
    assert tool.ran() == 1
    consumed = store.approval_requests(request_id=first["metadata"]["request_id"])[0]
    assert (consumed.status, consumed.consumed_attempt) == ("consumed", 1)
    assert kinds(store, "c1")[-4:] == ["approved", "approval_consumed", "pending", "committed"]
    # The grant is spent: the next attempt (a replay of the committed call) asks again.
    again = tool("c1")
    assert code(again) == "approval_pending" and again["metadata"]["request_id"] != consumed.request_id
    assert tool.ran() == 1
    with pytest.raises(NotDecidable, match="not the call's current one"):
        decide_request(store, "c1", approve=True, operator="bob", reason=None, request_id=consumed.request_id)
    if hasattr(store, "stats"):
        assert store.stats().approvals_open == 1
    verified(store)


def test_other_arguments_under_an_approved_id_are_refused(store: Any, tmp_path: Path) -> None:
    tool = charger(store, tmp_path)
    tool("c1", 500)
    approve(store, "c1")
    other = tool("c1", 900)
    assert code(other) == "policy_violation" and "other arguments" in other["error"]
    assert tool.ran() == 0 and only_request(store, "c1").status == "approved"  # the grant is not spent
    assert tool("c1", 500) == RAN
    assert tool.ran() == 1
    verified(store)


def test_a_denied_call_is_refused_with_the_operators_reason(store: Any, tmp_path: Path) -> None:
    tool = charger(store, tmp_path)
    tool("c1")
    event, request = decide_request(store, "c1", approve=False, operator="bob", reason="card is stolen")
    assert (event.kind, event.actor, request.status) == ("denied", "operator:bob", "denied")
    for _ in range(2):
        refused = tool("c1")
        assert code(refused) == "escalation_denied"
        assert "card is stolen" in refused["error"] and "bob" in refused["error"]
    assert tool.ran() == 0
    with pytest.raises(NotDecidable, match="already denied"):
        approve(store, "c1")
    verified(store)


def test_an_undecided_request_expires_then_a_retry_asks_again(store: Any, tmp_path: Path) -> None:
    tool = charger(store, tmp_path, ttl=0.2)
    first = tool("c1")
    request = only_request(store, "c1")
    wait_until(lambda: request.overdue(utc_now()))
    with pytest.raises(NotDecidable, match="expired"):
        approve(store, "c1")  # too late: nothing appended
    expired = tool("c1")
    assert code(expired) == "escalation_denied" and "expired" in expired["error"]
    asked = tool("c1")
    assert code(asked) == "approval_pending"
    assert asked["metadata"]["request_id"] != first["metadata"]["request_id"]
    statuses = [(r.request_id == request.request_id, r.status, r.answered) for r in store.approval_requests(
        call_id="c1")]
    assert statuses == [(False, "open", False), (True, "expired", True)]  # newest first
    assert kinds(store, "c1") == ["approval_requested", "refused", "expired", "refused", "approval_requested",
                                  "refused"]
    assert tool.ran() == 0
    verified(store)


def test_a_listing_expires_an_overdue_request(store: Any, tmp_path: Path) -> None:
    tool = charger(store, tmp_path, ttl=0.2)
    tool("c1")
    request = only_request(store, "c1")
    if hasattr(store, "stats"):
        wait_until(lambda: request.overdue(utc_now()))
        assert store.stats().approvals_open == 1  # overdue, but open until it is marked expired
    wait_until(lambda: request.overdue(utc_now()))
    assert [r.request_id for r in expire_overdue(store)] == [request.request_id]
    assert expire_overdue(store) == []  # once
    assert only_request(store, "c1").status == "expired"
    assert code(tool("c1")) == "escalation_denied"
    if hasattr(store, "stats"):
        assert store.stats().approvals_open == 0
    verified(store)


def test_a_quorum_needs_distinct_operators(store: Any, tmp_path: Path) -> None:
    tool = charger(store, tmp_path, quorum=2)
    tool("c1")
    assert approve(store, "c1", "alice").status == "open"
    with pytest.raises(NotDecidable, match="already approved"):
        approve(store, "c1", "alice")  # the same operator twice counts once
    assert code(tool("c1")) == "approval_pending" and tool.ran() == 0
    assert approve(store, "c1", "bob").approvers == ("operator:alice", "operator:bob")
    assert tool("c1") == RAN and tool("c1") != RAN
    assert tool.ran() == 1
    assert kinds(store, "c1").count("approved") == 2
    verified(store)


def test_a_replay_of_a_committed_call_needs_its_own_grant(store: Any, tmp_path: Path) -> None:
    tool = charger(store, tmp_path)
    tool("c1")
    approve(store, "c1")
    assert tool("c1") == RAN
    replay = tool("c1")
    assert code(replay) == "approval_pending"
    request = store.approval_requests(call_id="c1", status="open")[0]
    assert request.replay is True and request.attempt == 1
    approve(store, "c1")
    assert tool("c1") == RAN  # the stored result, replayed
    assert tool.ran() == 1
    assert kinds(store, "c1")[-2:] == ["approval_consumed", "replayed"]
    assert [r.status for r in store.approval_requests(call_id="c1")] == ["consumed", "consumed"]
    verified(store)


def test_a_waiting_call_is_released_by_an_approval_from_another_thread(store: Any, tmp_path: Path) -> None:
    tool = charger(store, tmp_path, wait=60)
    results: list[Any] = []
    waiting = threading.Thread(target=lambda: results.append(tool("c1")))
    waiting.start()
    try:
        wait_until(lambda: store.approval_requests(call_id="c1", status="open"))
        approve(store, "c1")
    finally:
        waiting.join(90)
    assert results == [RAN]  # released by the decision, long before its wait ran out
    assert tool.ran() == 1
    assert kinds(store, "c1") == ["approval_requested", "approved", "approval_consumed", "pending", "committed"]
    verified(store)


def test_an_async_call_waits_while_its_event_loop_keeps_running(store: Any, tmp_path: Path) -> None:
    tool = charger(store, tmp_path, wait=60)

    async def scenario() -> tuple[Any, int, int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        ticking = asyncio.create_task(ticker())
        call = asyncio.create_task(tool.call_async("c1"))
        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(store.approval_requests, call_id="c1", status="open"):
            assert time.monotonic() < deadline and not call.done(), "the call did not ask for approval"
            await asyncio.sleep(0.01)
        asked = ticks
        await asyncio.sleep(0.05)  # the call waits; the loop goes on
        waited = ticks
        await asyncio.to_thread(approve, store, "c1")
        result = await asyncio.wait_for(call, 90)
        stop.set()
        await ticking
        return result, asked, waited

    result, asked, waited = asyncio.run(scenario())
    assert result == RAN and tool.ran() == 1
    assert waited > asked  # the counter went on while the call waited for the operator
    verified(store)


# -- the journals: processes, NOTIFY, verify and rebuild ------------------------------------------------


def _race(kind: str, target: str, effects: str, barrier: Any, out: Any) -> None:
    store = open_store(kind, target)
    try:
        tool = Charger(store, ApprovalQueue(), Path(effects))
        barrier.wait(60)
        result = tool("c-race")
        out.put("ran" if result == RAN else code(result))
    finally:
        store.close()


def _approve_in_child(kind: str, target: str, call_id: str) -> None:
    store = open_store(kind, target)
    try:
        approve(store, call_id, "carol", "from another process")
    finally:
        store.close()


def test_six_processes_retrying_a_granted_call_run_it_once(journal_place: Place, journal: Any,
                                                           tmp_path: Path) -> None:
    tool = charger(journal, tmp_path)
    assert code(tool("c-race")) == "approval_pending"
    approve(journal, "c-race")
    barrier, out = SPAWN.Barrier(6), SPAWN.Queue()
    racers = [SPAWN.Process(target=_race, args=(journal_place.kind, journal_place.target, str(tool.effects),
                                                barrier, out)) for _ in range(6)]
    for racer in racers:
        racer.start()
    outcomes = [out.get(timeout=120) for _ in racers]
    for racer in racers:
        racer.join(30)
        assert racer.exitcode == 0
    assert tool.ran() == 1  # one effect, whatever the race
    assert sorted(outcomes) == ["approval_pending"] * 5 + ["ran"]
    assert [e.kind for e in journal.events(call_id="c-race")].count("approval_consumed") == 1
    assert len(journal.approval_requests(call_id="c-race", status="open")) == 1  # the next attempt's, asked once
    verified(journal)


def test_a_waiting_call_is_released_by_an_approval_from_another_process(journal_place: Place, journal: Any,
                                                                        tmp_path: Path) -> None:
    tool = charger(journal, tmp_path, wait=60)
    results: list[Any] = []
    waiting = threading.Thread(target=lambda: results.append(tool("c1")))
    waiting.start()
    try:
        wait_until(lambda: journal.approval_requests(call_id="c1", status="open"))
        child = SPAWN.Process(target=_approve_in_child, args=(journal_place.kind, journal_place.target, "c1"))
        child.start()
        child.join(60)
        assert child.exitcode == 0
    finally:
        waiting.join(90)
    assert results == [RAN] and tool.ran() == 1
    assert [e.actor for e in journal.events(call_id="c1") if e.kind == "approved"] == ["operator:carol"]
    verified(journal)


@pytest.mark.postgres
def test_on_postgres_a_waiting_call_wakes_on_the_notification(tmp_path: Path) -> None:
    import psycopg

    from tests.pgserver import fresh_schema

    dsn = fresh_schema()
    journal = open_store("postgres", dsn)
    try:
        woken: list[bool] = []
        wait = journal.wait_for_decision

        def recorded(call_id: str, seconds: float) -> bool:
            found: bool = wait(call_id, seconds)
            woken.append(found)
            return found

        journal.wait_for_decision = recorded  # type: ignore[method-assign]
        assert wait("nobody", 0.05) is False  # no decision: the wait runs out
        tool = charger(journal, tmp_path, wait=60)
        results: list[Any] = []
        waiting = threading.Thread(target=lambda: results.append(tool("c1")))
        waiting.start()
        try:
            with psycopg.connect(dsn, autocommit=True) as admin:

                def listening() -> bool:
                    row = admin.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                        "'airlock-journal approval waiter' AND state = 'idle' AND query LIKE '%approvals%'").fetchone()
                    return row is not None and row[0] > 0

                wait_until(listening)  # LISTENing, the request found open
                approve(journal, "c1")
        finally:
            waiting.join(90)
        assert results == [RAN] and tool.ran() == 1
        assert True in woken  # by the NOTIFY sent with the approval
        verified(journal)
    finally:
        journal.close()


def test_rebuild_puts_back_a_deleted_request_row(journal_place: Place, journal: Any, tmp_path: Path) -> None:
    tool = charger(journal, tmp_path)
    tool("c1")
    tool("c2")
    approve(journal, "c1")
    assert tool("c1") == RAN
    before = [r.to_json() for r in journal.approval_requests()]
    removed = journal.approval_requests(call_id="c1")[0]
    plain_sql(journal_place, "DELETE FROM approvals WHERE call_id = 'c1'")
    report = journal.verify()
    assert not report.ok and report.problem == (f"the approvals projection lacks request {removed.request_id!r} "
                                                "(call 'c1'); run rebuild")
    assert report.first_bad_seq == removed.last_seq
    if JOURNAL_FACTORIES[journal_place.kind].verifies_in_parts:  # as a journal of millions of events is: the same
        assert journal.verify(parts=2).problem == report.problem
    journal.rebuild()
    assert [r.to_json() for r in journal.approval_requests()] == before
    verified(journal)


def test_verify_reports_a_request_row_edited_by_hand(journal_place: Place, journal: Any, tmp_path: Path) -> None:
    tool = charger(journal, tmp_path)
    tool("c1")
    request = only_request(journal, "c1")
    forged = {**request.to_json(), "status": "approved", "approvers": ["operator:mallory"]}
    plain_sql(journal_place, "UPDATE approvals SET status = 'approved', request = {mark} WHERE call_id = 'c1'",
              orjson.dumps(forged, option=orjson.OPT_SORT_KEYS).decode())
    report = journal.verify()
    assert not report.ok and report.first_bad_seq == request.last_seq
    assert report.problem == (f"the approvals projection of request {request.request_id!r} (call 'c1') differs "
                              "from the log; run rebuild")
    # The guard takes a grant from the log, not from the edited row: the call does not run.
    assert code(tool("c1")) == "approval_pending" and tool.ran() == 0
    journal.rebuild()
    assert only_request(journal, "c1").status == "open"
    verified(journal)


def plain_sql(place: Place, statement: str, *params: Any) -> None:
    """Run ``statement`` on the journal's database by hand (``{mark}``: a parameter's place)."""
    place.database.execute(statement.format(mark="?"), params)


@pytest.mark.parametrize("fast", [True, False], ids=["first-try", "contended"])
def test_begin_and_append_fold_a_refusal_that_names_a_request(journal: Any, tmp_path: Path, fast: bool) -> None:
    # The guard records its refusals of a request in its own step; a refusal that names a request
    # reaching the journal by begin or append is folded into the requests all the same.
    if not fast and type(journal).__name__ == "PostgresJournal":
        contended(journal)  # PostgreSQL's writes as under contention: the server-side append
    tool = charger(journal, tmp_path, ttl=0.2)
    tool("c1")
    tool("c2")
    for call_id in ("c1", "c2"):
        request = only_request(journal, call_id)
        wait_until(lambda r=request: r.overdue(utc_now()))
    expire_overdue(journal)

    def refusal(call_id: str) -> EffectEvent:
        rid = only_request(journal, call_id).request_id
        return EffectEvent("refused", call_id, "charge", reason={"code": "escalation_denied", "message": "expired",
                                                                 "request_id": rid})

    event = refusal("c1")
    decision = journal.begin("c1", lambda record: Decision(Verdict.REFUSE, event, record, "escalation_denied"))
    assert decision.event.kind == "refused" and decision.event.reason == event.reason
    journal.append(refusal("c2"))
    assert [only_request(journal, c).answered for c in ("c1", "c2")] == [True, True]
    assert code(tool("c1")) == "approval_pending"  # answered: the next retry asks again
    verified(journal)


# -- export, migration, copy, archive ---------------------------------------------------------------


def test_the_export_carries_the_requests_redacted_and_verifies(journal_place: Place, journal: Any,
                                                               tmp_path: Path) -> None:
    tool = charger(journal, tmp_path)
    tool("c1")
    approve(journal, "c1")
    tool("c1")
    tool("c2")
    decide_request(journal, "c2", approve=False, operator="bob", reason="no")
    journal.close()
    out = tmp_path / "export.jsonl"
    result = invoke("journal", "export", "--db", journal_place.target, "--redact", "arguments", "-o", str(out))
    assert result.exit_code == 0, result.output
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert {line["kind"] for line in lines} >= {"approval_requested", "approved", "approval_consumed", "denied"}
    asked = [line for line in lines if line["kind"] == "approval_requested"]
    assert all(line["arguments"] is None and line["arguments_sha256"] for line in asked)
    assert invoke("journal", "verify", "--export", str(out)).exit_code == 0
    csv_out = tmp_path / "export.csv"
    result = invoke("journal", "export", "--db", journal_place.target, "--format", "csv", "-o", str(csv_out))
    assert result.exit_code == 0, result.output
    assert csv_out.read_text().count(",approval_requested,") == 2


def test_a_sqlite_journal_of_the_previous_version_is_read_and_migrated(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from journal.sqlite import schema

    path = tmp_path / "old.db"
    previous = schema.LATEST - 1
    monkeypatch.setattr(schema, "LATEST", previous)
    with SQLiteJournal(path) as old:
        plain = SecurityPolicy(effect_guard=EffectGuard(store=old))

        @Airlock(policy=plain)
        def refund(cents: int) -> int:
            return cents

        with AirlockContext(metadata={"tool_call_id": "r1"}):
            assert refund(5) == 5
        head = old.head()
    monkeypatch.undo()

    def version() -> int:
        conn = sqlite3.connect(path)
        try:
            return int(conn.execute("PRAGMA user_version").fetchone()[0])
        finally:
            conn.close()

    assert version() == previous
    with SQLiteJournal(path, readonly=True) as reader:  # read as it is: nothing of approvals in it
        assert reader.approval_requests() == [] and reader.stats().approvals_open == 0
        assert reader.verify().ok
    assert version() == previous
    with SQLiteJournal(path) as journal:  # a writable open migrates it in place
        assert journal.head() == head and journal.verify().ok
        tool = charger(journal, tmp_path)
        tool("c1")
        approve(journal, "c1")
        assert tool("c1") == RAN
        verified(journal)
    assert version() == schema.LATEST
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        triggers = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
        assert {"events_no_update", "events_no_delete", "events_no_replace"} <= triggers
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("UPDATE events SET kind = 'denied' WHERE seq = 1")
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            conn.execute("INSERT INTO events SELECT seq + 1000, at, call_id, 'granted', tool, agent_id, "
                         "idempotency_key, arguments, value, error, reason, actor, attempt, owner, prev_hash, hash "
                         "FROM events WHERE seq = 1")
    finally:
        conn.close()


@pytest.mark.postgres
def test_a_postgres_journal_of_the_previous_version_is_migrated(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg

    from journal.postgres import PostgresJournal
    from journal.postgres import schema as pg_schema
    from tests.pgserver import fresh_schema, make_old_journal

    dsn = fresh_schema()
    latest = pg_schema.SCHEMA_VERSION
    with SQLiteJournal(tmp_path / "old.db") as old:  # a log as version 4 held it: before the requests
        plain = SecurityPolicy(effect_guard=EffectGuard(store=old))

        @Airlock(policy=plain)
        def refund(cents: int) -> int:
            return cents

        with AirlockContext(metadata={"tool_call_id": "r1"}):
            assert refund(5) == 5
        head = old.head()
        make_old_journal(dsn, 4, list(old.events()))
    with pytest.raises(JournalError, match="open it writable once"):
        PostgresJournal(dsn, readonly=True)
    with PostgresJournal(dsn) as journal:
        assert journal.head() == head
        tool = charger(journal, tmp_path)
        tool("c1")
        approve(journal, "c1")
        assert tool("c1") == RAN
        verified(journal)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT schema_version FROM airlock_journal_meta").fetchone() == (latest,)
        assert conn.execute("SELECT convalidated FROM pg_constraint WHERE conname = 'events_kind_check'").fetchone() \
            == (True,)


@pytest.mark.postgres
def test_a_copy_from_sqlite_to_postgres_keeps_the_requests(tmp_path: Path) -> None:
    from journal.copy import copy_journal
    from tests.pgserver import fresh_schema

    path = tmp_path / "source.db"
    with SQLiteJournal(path) as source:
        tool = charger(source, tmp_path)
        tool("c-run")
        approve(source, "c-run")
        tool("c-run")
        tool("c-run")  # the replay asks again
        tool("c-deny")
        decide_request(source, "c-deny", approve=False, operator="bob", reason="no")
        tool("c-deny")
        tool("c-open", 700)
        requests = [r.to_json() for r in source.approval_requests()]
        stats = source.stats()
    assert len(requests) == 4
    dsn = fresh_schema()
    report = copy_journal(str(path), dsn)
    with open_store("postgres", dsn) as copy:
        assert [r.to_json() for r in copy.approval_requests()] == requests
        assert (copy.stats().approvals_open, copy.stats().oldest_open_approval_at) == (
            stats.approvals_open, stats.oldest_open_approval_at) == (2, stats.oldest_open_approval_at)
        assert copy.head()[1] == report.head
        verified(copy)
        # The copy carries on: the open request is decided there, and the call runs once.
        approve(copy, "c-open")
        again = Charger(copy, ApprovalQueue(), tmp_path / "effects.txt")
        assert again("c-open", 700) == {"charged": 700}
        verified(copy)


def _archive(place: Place, tmp_path: Path) -> list[dict[str, Any]]:
    """``airlock journal archive`` of every event it may take; returns the archive's lines."""
    out = tmp_path / "archive.jsonl"
    result = invoke("journal", "archive", "--db", place.target, "--before", datetime.now(UTC).isoformat(),
                    "-o", str(out))
    assert result.exit_code == 0, result.output
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


def test_an_archive_never_takes_an_open_request(journal_place: Place, journal: Any, tmp_path: Path) -> None:
    from journal.archive import ArchivePlan

    tool = charger(journal, tmp_path)
    tool("c-done")
    approve(journal, "c-done")
    assert tool("c-done") == RAN
    tool("c-denied")
    decide_request(journal, "c-denied", approve=False, operator="bob", reason="no")
    tool("c-open")
    for n in range(3):
        tool(f"c-later-{n}")  # more requests after it, so the log goes on past the open one
    opened = only_request(journal, "c-open")
    done = only_request(journal, "c-done")
    head = journal.head()
    # A plan made by hand that would take the open request's events is refused, and nothing moves.
    with pytest.raises(JournalError, match="still open"):
        journal.commit_archive(ArchivePlan(0, "0" * 64, head[0] - 1,
                                           next(journal.events(after_seq=head[0] - 2)).hash), "x.jsonl",
                               "2026-12-01T00:00:00.000000Z")
    assert journal.head() == head and journal.archived_head()[0] == 0
    archived = _archive(journal_place, tmp_path)
    assert archived[-1]["seq"] == opened.first_seq - 1  # the cut moved back to just before the open request
    assert {line["call_id"] for line in archived} == {"c-done", "c-denied"}
    assert journal.archived_head()[0] == opened.first_seq - 1
    assert next(journal.events(call_id="c-open")).kind == "approval_requested"
    assert only_request(journal, "c-done").to_json() == done.to_json()  # archived, its row kept
    assert journal.stats().approvals_open == 4
    verified(journal)
    # The rest of the log is folded onto the requests as of the archive: rebuild and verify agree.
    plain_sql(journal_place, "DELETE FROM approvals WHERE call_id = 'c-done'")
    assert not journal.verify().ok
    journal.rebuild()
    assert only_request(journal, "c-done").to_json() == done.to_json()
    approve(journal, "c-open")
    assert tool("c-open") == RAN and tool.ran() == 2
    verified(journal)
    journal.rebuild()
    verified(journal)
    assert [r.status for r in journal.approval_requests(status="consumed")] == ["consumed", "consumed"]


@pytest.mark.postgres
def test_each_postgres_role_of_the_deployment_guide_does_its_part(deployed: str, tmp_path: Path) -> None:  # noqa: F811
    from journal.postgres import PostgresJournal
    from tests.postgres.test_roles import as_role

    with PostgresJournal(as_role(deployed, "airlock_guard")) as guard:
        tool = charger(guard, tmp_path)
        assert code(tool("c1")) == "approval_pending"  # the guard's login asks
        with PostgresJournal(as_role(deployed, "airlock_operator")) as operator:
            approve(operator, "c1")  # the operator's decides
            assert tool("c1") == RAN and tool.ran() == 1
            assert operator.rebuild() == 1  # and rebuilds, the requests included
        with PostgresJournal(as_role(deployed, "airlock_auditor"), readonly=True) as auditor:
            assert auditor.verify().ok and auditor.stats().approvals_open == 0
            assert [r.status for r in auditor.approval_requests()] == ["consumed"]
            with pytest.raises(JournalError, match="read-only"):
                approve(auditor, "c1")
