"""Replicas on one PostgreSQL journal: separate processes with separate pools, racing one call id,
killed in the middle of a tool, and running through a restart of the server.

Effects are counted outside the journal, in a file each effect appends one line to (the way a
payment provider's ledger would show them).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal
from guard.effect_guard import EffectGuard
from journal.postgres import PostgresJournal
from tests.pgserver import PgServer, _admin

pytestmark = pytest.mark.postgres

SPAWN = multiprocessing.get_context("spawn")


def effects(path: Path) -> list[str]:
    """The call ids of the effects that happened, one per effect."""
    return path.read_text().split() if path.exists() else []


def make_charge(journal: PostgresJournal, ledger: str, pause: float = 0.0) -> Any:
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        with open(ledger, "a") as f:  # one short O_APPEND write per effect
            f.write(f"{context.tool_call_id}\n")
        if pause:
            time.sleep(pause)
        return {"charged": cents, "account": account}

    return charge


def outcome(result: Any) -> str:
    return f"refused:{result['block_reason']}" if is_refusal(result) else "value"


def _racing_replica(dsn: str, ledger: str, call_ids: list[str], barrier: Any, results: Any) -> None:
    journal = PostgresJournal(dsn, pool_size=2)
    charge = make_charge(journal, ledger, pause=0.002)
    seen = []
    for call_id in call_ids:
        barrier.wait(timeout=300)
        with AirlockContext(agent_id=f"replica-{os.getpid()}", metadata={"tool_call_id": call_id}):
            seen.append((call_id, outcome(charge("acct-1", 500))))
    journal.close()
    results.put(seen)


def test_two_replicas_racing_one_id_make_one_effect(pg_dsn: str, tmp_path: Path) -> None:
    PostgresJournal(pg_dsn).close()  # the schema exists before the race starts
    ledger = tmp_path / "ledger"
    call_ids = [f"race-{n}" for n in range(40)]
    barrier, results = SPAWN.Barrier(2), SPAWN.Queue()
    replicas = [SPAWN.Process(target=_racing_replica, args=(pg_dsn, str(ledger), call_ids, barrier, results))
                for _ in range(2)]
    for p in replicas:
        p.start()
    seen = [results.get(timeout=120) for _ in replicas]
    for p in replicas:
        p.join(timeout=300)
        assert p.exitcode == 0

    happened = effects(ledger)
    assert sorted(happened) == sorted(call_ids)  # every id charged exactly once
    with PostgresJournal(pg_dsn) as journal:
        for n, call_id in enumerate(call_ids):
            outcomes = sorted(s[n][1] for s in seen)
            # One replica ran it; the other replayed the value or was refused while it ran.
            assert outcomes in (["value", "value"], ["refused:effect_status_unknown", "value"]), outcomes
            kinds = sorted(e.kind for e in journal.events(call_id=call_id))
            assert kinds in (["committed", "pending", "replayed"], ["committed", "pending", "refused"])
            assert journal.get(call_id).status == "committed"  # type: ignore[union-attr]
        report = journal.verify()
        assert report.ok and report.events == 3 * len(call_ids)


def _hanging_replica(dsn: str, ledger: str, call_id: str) -> None:
    journal = PostgresJournal(dsn)

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def transfer(to: str, cents: int) -> str:
        with open(ledger, "a") as f:
            f.write(f"{call_id}\n")
        time.sleep(600)  # killed here, in the middle of the tool
        return "done"

    with AirlockContext(metadata={"tool_call_id": call_id}):
        transfer("bob", 700)


def _replaying_replica(dsn: str, ledger: str, call_id: str, results: Any) -> None:
    journal = PostgresJournal(dsn)

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def transfer(to: str, cents: int) -> str:
        with open(ledger, "a") as f:
            f.write(f"{call_id}\n")
        return "done"

    with AirlockContext(metadata={"tool_call_id": call_id}):
        results.put(dict(transfer("bob", 700)))
    journal.close()


def test_sigkill_in_the_middle_of_a_tool_leaves_it_pending_and_the_other_replica_refuses(
    pg_dsn: str, tmp_path: Path
) -> None:
    PostgresJournal(pg_dsn).close()
    ledger = tmp_path / "ledger"
    victim = SPAWN.Process(target=_hanging_replica, args=(pg_dsn, str(ledger), "tx-1"))
    victim.start()
    deadline = time.monotonic() + 60
    while not effects(ledger) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert effects(ledger) == ["tx-1"], "the tool never started"
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=300)
    assert victim.exitcode == -signal.SIGKILL

    results = SPAWN.Queue()
    other = SPAWN.Process(target=_replaying_replica, args=(pg_dsn, str(ledger), "tx-1", results))
    other.start()
    refusal = results.get(timeout=60)
    other.join(timeout=300)
    assert refusal["block_reason"] == "effect_status_unknown"
    assert refusal["metadata"]["status"] == "pending" and refusal["metadata"]["attempt"] == 1
    assert effects(ledger) == ["tx-1"]  # not run again

    with PostgresJournal(pg_dsn) as journal:
        record = journal.get("tx-1")
        assert record is not None and record.status == "pending"
        assert record.owner is not None and record.owner["pid"] == victim.pid
        assert [e.kind for e in journal.events(call_id="tx-1")] == ["pending", "refused"]
        # The owner is dead, so an operator may settle it without --force.
        journal.resolve("tx-1", applied=True, reason="the bank shows the transfer", operator="ops")
        assert journal.verify().ok


# -- a server restart in the middle of a run ----------------------------------------------------


def test_a_restart_during_a_tool_and_the_outage_are_clear_and_lose_nothing(
    pg_server: PgServer, pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if not pg_server.managed:
        pytest.skip("the tests do not restart an external server")
    ledger = tmp_path / "ledger"
    journal = PostgresJournal(pg_dsn, busy_timeout=20.0, connect_timeout=2.0)
    server_stopped = False

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, int]:
        nonlocal server_stopped
        context = get_current_context()
        assert context is not None
        with open(ledger, "a") as f:
            f.write(f"{context.tool_call_id}\n")
        if context.tool_call_id == "c-2":
            pg_server.stop("fast")  # the server goes away while the tool runs
            server_stopped = True
        return {"charged": cents}

    def call(call_id: str) -> Any:
        with AirlockContext(metadata={"tool_call_id": call_id}):
            return charge("acct", 100)

    try:
        assert call("c-1") == {"charged": 100}
        with caplog.at_level(logging.ERROR, logger="guard"):
            assert call("c-2") == {"charged": 100}  # the caller still gets the value
            assert server_stopped
            started = time.monotonic()
            refusal = call("c-3")
            took = time.monotonic() - started
        assert is_refusal(refusal) and refusal["block_reason"] == "store_unavailable"
        assert "cannot be reached" in refusal["metadata"]["store_error"]
        assert took < journal.busy_timeout  # refused at once, not after the busy deadline
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert "could not record committed" in logged and "could not record pending" in logged
    finally:
        pg_server.start()

    assert call("c-4") == {"charged": 100}  # the journal carries on once the server is back
    replay = call("c-2")  # its outcome was lost with the server: pending, so refused, never re-run
    assert is_refusal(replay) and replay["block_reason"] == "effect_status_unknown"
    assert call("c-1") == {"charged": 100}  # a replay of the stored value
    assert effects(ledger) == ["c-1", "c-2", "c-4"]  # c-3 never ran, nothing ran twice
    assert {c: journal.get(c).status for c in ("c-1", "c-2", "c-4")} == {  # type: ignore[union-attr]
        "c-1": "committed", "c-2": "pending", "c-4": "committed"}
    assert journal.get("c-3") is None
    report = journal.verify()
    assert report.ok and report.events == journal.count_events()
    journal.close()


def _steady_replica(dsn: str, ledger: str, prefix: str, started: Any, stop: Any, results: Any,
                    succeeded: Any) -> None:
    logging.disable(logging.CRITICAL)  # the outage is expected; its log lines are not the point
    journal = PostgresJournal(dsn, busy_timeout=20.0, connect_timeout=2.0, pool_size=2)
    charge = make_charge(journal, ledger)
    seen = []
    deadline = time.monotonic() + 900  # a bound for a parent that never says stop
    n = 0
    started.release()
    while not stop.is_set() and time.monotonic() < deadline:
        n += 1
        call_id = f"{prefix}-{n}"
        with AirlockContext(metadata={"tool_call_id": call_id}):
            result = charge("acct", n)
        seen.append((call_id, outcome(result), time.monotonic()))
        if is_refusal(result):
            time.sleep(0.02)
        else:
            with succeeded.get_lock():
                succeeded.value += 1
    journal.close()
    results.put(seen)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_replicas_through_a_server_restart_lose_and_double_nothing(
    pg_server: PgServer, pg_dsn: str, tmp_path: Path, mode: str
) -> None:
    if not pg_server.managed:
        pytest.skip("the tests do not restart an external server")
    PostgresJournal(pg_dsn).close()
    ledger = tmp_path / "ledger"
    results, started, stop = SPAWN.Queue(), SPAWN.Semaphore(0), SPAWN.Event()
    succeeded = SPAWN.Value("i", 0)
    replicas = [SPAWN.Process(target=_steady_replica,
                              args=(pg_dsn, str(ledger), f"r{k}", started, stop, results, succeeded))
                for k in range(2)]
    for p in replicas:
        p.start()
    for _ in replicas:
        assert started.acquire(timeout=60)
    time.sleep(1.0)
    pg_server.restart(mode, down_for=1.0)  # "immediate" is a crash: recovery replays the WAL
    restarted_at = time.monotonic()
    # What is waited for is a call that succeeds after the restart, however long the recovery takes
    # on a loaded machine (it fsyncs the whole data directory after a crash).
    before, deadline = succeeded.value, time.monotonic() + 600
    while succeeded.value <= before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    seen = [call for _ in replicas for call in results.get(timeout=120)]
    for p in replicas:
        p.join(timeout=300)

    happened = effects(ledger)
    assert len(happened) == len(set(happened)), "an effect happened twice"
    with PostgresJournal(pg_dsn) as journal:
        for call_id, result, _at in seen:
            kinds = [e.kind for e in journal.events(call_id=call_id)]
            if result == "value":
                # It ran once; its pending was durable before it ran and survived the restart.
                assert happened.count(call_id) == 1 and kinds[:1] == ["pending"], (call_id, kinds)
            else:
                assert result == "refused:store_unavailable", (call_id, result)
                assert call_id not in happened and "committed" not in kinds
        for call_id in happened:
            assert journal.get(call_id) is not None, f"{call_id} ran but its pending was lost"
        assert any(r == "refused:store_unavailable" for _, r, _ in seen), "the outage was not noticed"
        assert any(r == "value" and at > restarted_at for _, r, at in seen), "no call succeeded after"
        report = journal.verify()
        assert report.ok and report.events == journal.count_events()


def test_a_pending_is_on_disk_before_its_tool_runs_a_crash_of_the_server_keeps_it(
    pg_server: PgServer, pg_dsn: str, tmp_path: Path
) -> None:
    if not pg_server.managed:
        pytest.skip("the tests do not crash an external server")
    # A commit that does not wait for the WAL flush (every event but pending) reaches the disk when
    # the WAL writer flushes, within wal_writer_delay: stretched to 10 s, only a pending committed
    # synchronously is on disk when the server crashes, which it does while the tool runs. The
    # first call of a new journal object locks the head first (the way writes go while other
    # replicas write), the next ones are one compare-and-set statement each: both ways are crashed.
    _admin(pg_server, "ALTER SYSTEM SET wal_writer_delay = '10s'")
    _admin(pg_server, "SELECT pg_reload_conf()")
    journal = PostgresJournal(pg_dsn)
    ledger = tmp_path / "ledger"
    charge = make_charge(journal, str(ledger))

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge_and_crash(n: int) -> int:
        charge_ran = charge.__wrapped__("acct", n)  # the effect, counted in the ledger
        pg_server.stop("immediate")  # no shutdown checkpoint: what is not flushed is lost
        return int(charge_ran["charged"])

    try:
        for n in range(4):
            with AirlockContext(metadata={"tool_call_id": f"crash-{n}"}):
                assert charge_and_crash(n) == n  # its outcome cannot be recorded: the value all the same
            pg_server.start()
            record = journal.get(f"crash-{n}")
            assert record is not None and record.status == "pending", f"crash-{n}: its pending was lost"
        assert effects(ledger) == [f"crash-{n}" for n in range(4)]
    finally:
        if not pg_server.running():
            pg_server.start()
        _admin(pg_server, "ALTER SYSTEM RESET wal_writer_delay")
        _admin(pg_server, "SELECT pg_reload_conf()")
        journal.close()


def crash_losing(pg_server: PgServer, write: Any) -> None:
    """Crash the server (and start it again) right after ``write``, its events not flushed: the
    WAL writer is held off, and only a commit that waits for the flush (a pending's) is on disk.

    The background writer and the checkpointer are held off too: before either writes a page out,
    it flushes the WAL up to that page's last change, which on a slow run took the events with it."""
    import psycopg

    with psycopg.connect(pg_server.dsn) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE backend_type IN ('walwriter', 'background writer', 'checkpointer')").fetchall()
    assert len(rows) == 3, rows
    for (pid,) in rows:
        os.kill(pid, signal.SIGSTOP)
    try:
        write()
    finally:
        pg_server.stop("immediate")
        for (pid,) in rows:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    pg_server.start()


@pytest.mark.parametrize("way", ["sealed at once", "through the inbox"])
def test_after_a_crash_lost_the_last_events_a_replica_never_writes_on_what_it_did_not_see(
    pg_server: PgServer, pg_dsn: str, way: str
) -> None:
    if not pg_server.managed:
        pytest.skip("the tests do not crash an external server")
    from guard.effect_guard import decide_attempt
    from guard.store import EffectEvent, Verdict
    from journal.postgres.writes import QUEUE

    reversible = way == "through the inbox"  # a reversible call may run again: its attempts must still differ

    def decide(record: Any) -> Any:
        return decide_attempt(record, "x", "pay", "k", "{}", None, reversible)

    first, second = PostgresJournal(pg_dsn, pool_size=1), PostgresJournal(pg_dsn, pool_size=1)
    assert first.begin("x", decide).verdict is Verdict.RUN  # pending: on disk before the tool runs
    if way == "through the inbox":
        first.writes.seal_mode = QUEUE
        first.sealer.poke = lambda: None  # nothing seals the outcome (a seal commits synchronously) before the crash
    for replica in (first, second):
        # A session that opens makes its temporary function in a transaction of its own, whose
        # commit would flush the events the crash is to lose: every pool has its sessions first.
        replica.datastore.pool.wait(10)
    crash_losing(pg_server, lambda: first.append(
        EffectEvent("released", "x", "pay", attempt=1, error={"type": "ValueError", "message": "m"})))
    first.datastore.pool.check()  # its pool replaces the dead connection on its own: the journal never sees it die
    assert [e.kind for e in second.events()] == ["pending"], "the crash was to lose the outcome"
    # Another replica brings the head back to seq 2, the lost outcome's place (or x's projection row
    # back to pending): a refusal (x is pending again) or, for a reversible call, its attempt 2. The
    # first replica remembers its lost outcome (released) at that place: decided on it, attempt 2
    # would run a second time.
    second.begin("x", decide)
    first.begin("x", decide)
    pendings = [e.attempt for e in first.events() if e.kind == "pending"]
    assert len(pendings) == len(set(pendings)), pendings
    assert pendings == ([1, 2, 3] if reversible else [1])
    assert first.verify().ok
    first.close()
    second.close()


# -- a journal object inherited through fork -----------------------------------------------------


FORK = multiprocessing.get_context("fork")
CHILD_CALLS = 60


def _forked_child(journal: PostgresJournal, ledger: str, results: Any) -> None:
    charge = make_charge(journal, ledger)
    outcomes = []
    for n in range(CHILD_CALLS):
        with AirlockContext(metadata={"tool_call_id": f"child-{n}"}):
            outcomes.append(outcome(charge("acct", n)))
    results.put(outcomes)


def test_a_journal_inherited_through_fork_gets_a_pool_of_its_own(pg_dsn: str, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    journal = PostgresJournal(pg_dsn)
    charge = make_charge(journal, str(ledger))
    with AirlockContext(metadata={"tool_call_id": "parent-0"}):
        assert outcome(charge("acct", 1)) == "value"
    results = FORK.Queue()
    child = FORK.Process(target=_forked_child, args=(journal, str(ledger), results))
    child.start()
    # Both use the journal at once: a connection shared through fork would mix their sessions.
    for n in range(1, CHILD_CALLS + 1):
        with AirlockContext(metadata={"tool_call_id": f"parent-{n}"}):
            assert outcome(charge("acct", n)) == "value"
    assert results.get(timeout=120) == ["value"] * CHILD_CALLS
    child.join(timeout=300)
    with AirlockContext(metadata={"tool_call_id": "child-0"}):
        assert outcome(charge("acct", 0)) == "value"  # a replay of the child's call
    calls = [f"parent-{n}" for n in range(CHILD_CALLS + 1)] + [f"child-{n}" for n in range(CHILD_CALLS)]
    assert sorted(effects(ledger)) == sorted(calls)
    report = journal.verify()
    assert report.ok and report.events == 2 * len(calls) + 1
    journal.close()


def test_a_child_forked_while_a_thread_holds_the_journals_lock_does_not_hang(pg_dsn: str, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    journal = PostgresJournal(pg_dsn)
    charge = make_charge(journal, str(ledger))
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with journal.datastore._lock:  # as a thread in the middle of its first use in a new process would
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: its copy of the lock would stay held by a thread it does not have
        code = 1
        try:
            with AirlockContext(metadata={"tool_call_id": "forked-0"}):
                code = 0 if outcome(charge("acct", 1)) == "value" else 2
        finally:
            os._exit(code)
    release.set()
    thread.join()
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the journal's lock")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert effects(ledger) == ["forked-0"]
    journal.close()


def test_every_kind_of_use_recovers_after_a_restart(pg_server: PgServer, pg_dsn: str) -> None:
    if not pg_server.managed:
        pytest.skip("the tests do not restart an external server")
    from guard.store import Decision, EffectEvent, Verdict

    def begin(journal: PostgresJournal, call_id: str) -> None:
        event = EffectEvent(kind="pending", call_id=call_id, tool="charge", attempt=1)
        journal.begin(call_id, lambda r: Decision(Verdict.RUN, event, r))

    uses = {
        "verify": lambda j: j.verify().ok,
        "events": lambda j: [e.seq for e in j.events()] == [1],
        "head": lambda j: j.head()[0] == 1,
        "stats": lambda j: j.stats().calls == 1,
        "get": lambda j: j.get("c1") is not None,
        "rebuild": lambda j: j.rebuild() == 1,
    }
    for name, use in uses.items():
        with PostgresJournal(pg_dsn) as journal:
            if name == "verify":
                begin(journal, "c1")
            assert use(journal), name
            pg_server.restart("fast")  # every pooled connection dies with the old server
            assert use(journal), f"{name} after a restart"
