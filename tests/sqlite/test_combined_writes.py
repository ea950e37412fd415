"""Threads that write to one SQLiteJournal at once share a transaction (and its commit).

Each write still happens whole or not at all: one that fails raises in its own thread and leaves
the others, and the log, as if it had never been tried.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from guard.store import Decision, EffectEvent, Verdict
from journal import JournalError, SQLiteJournal


@pytest.fixture(params=["full", "process"])
def journal(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    j = SQLiteJournal(tmp_path / "j.db", durability=request.param)
    yield j
    j.close()


def _begin(journal: SQLiteJournal, call_id: str) -> Any:
    """A begin that records ``pending`` for ``call_id`` (as the guard's decision for a new call does)."""
    return lambda: journal.begin(call_id, lambda record: Decision(
        Verdict.RUN, EffectEvent("pending", call_id, "charge", attempt=1), record))


def _commits(journal: SQLiteJournal) -> list[str]:
    seen: list[str] = []
    journal.datastore.current.set_trace_callback(lambda sql: seen.append(sql) if sql == "COMMIT" else None)
    return seen


def _queued(journal: SQLiteJournal, writes: list[Any]) -> list[BaseException | None]:
    """Start one thread per write while the journal's lock is held, so that they all queue, then let go."""
    outcomes: list[BaseException | None] = [None] * len(writes)

    def run(i: int) -> None:
        try:
            writes[i]()
        except BaseException as e:
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(writes))]
    with journal.datastore.lock:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(journal.datastore.group._requests) < len(writes) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(journal.datastore.group._requests) == len(writes)
    for t in threads:
        t.join(120)
    return outcomes


def test_writes_queued_together_are_made_in_one_commit(journal: SQLiteJournal) -> None:
    commits = _commits(journal)
    outcomes = _queued(journal, [_begin(journal, f"c{i}") for i in range(3)]
                       + [lambda: journal.append(EffectEvent("refused", None, "charge")) for _ in range(3)])
    assert outcomes == [None] * 6
    assert len(commits) <= 2  # the first may have taken the lock alone; the rest share one commit
    assert journal.head()[0] == 6
    assert sorted(r.call_id for r in journal.calls(limit=None)) == ["c0", "c1", "c2"]
    assert journal.verify().ok


def test_a_failing_write_in_a_shared_transaction_fails_alone(journal: SQLiteJournal) -> None:
    bad = EffectEvent("deleted", "c9", "charge", attempt=1)  # the CHECK constraint refuses the kind
    writes = [_begin(journal, "c0"), _begin(journal, "c1"), lambda: journal.append(bad)]
    writes += [_begin(journal, "c2"), _begin(journal, "c3")]
    outcomes = _queued(journal, writes)
    assert [o is None for o in outcomes] == [True, True, False, True, True]
    assert isinstance(outcomes[2], JournalError) and "CHECK" in str(outcomes[2])
    logged = list(journal.events())
    assert [e.seq for e in logged] == [1, 2, 3, 4]  # no gap where the failed write was undone
    assert sorted(str(e.call_id) for e in logged) == ["c0", "c1", "c2", "c3"]
    assert journal.get("c9") is None
    assert journal.verify().ok


def test_an_exception_in_a_decision_is_raised_in_its_own_thread(journal: SQLiteJournal) -> None:
    def decide(record: Any) -> Any:
        raise RuntimeError("the decision failed")

    writes = [_begin(journal, "c1"), lambda: journal.begin("c2", decide), _begin(journal, "c3")]
    outcomes = _queued(journal, writes)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], RuntimeError)
    assert sorted(str(e.call_id) for e in journal.events()) == ["c1", "c3"]
    assert journal.verify().ok


def test_many_threads_on_one_journal_run_each_tool_once(journal: SQLiteJournal) -> None:
    runs: list[str] = []
    lock = threading.Lock()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        with lock:
            runs.append(account)
        return {"charged": cents}

    ids = [f"call-{i % 40}" for i in range(320)]  # each id asked for by 8 threads
    results: list[Any] = [None] * len(ids)
    barrier = threading.Barrier(8)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(t, len(ids), 8):
            with AirlockContext(metadata={"tool_call_id": ids[i]}):
                results[i] = charge(ids[i], 5)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(runs) == sorted(set(ids))  # one run per id
    for r in results:
        assert r == {"charged": 5} or (is_refusal(r) and r["block_reason"] == "effect_status_unknown")
    assert all(getattr(journal.get(i), "status", None) == "committed" for i in set(ids))
    assert journal.verify().ok


def test_a_batch_that_waits_out_the_busy_deadline_fails_at_it_not_once_a_write(tmp_path: Path) -> None:
    from journal import StoreBusy

    journal = SQLiteJournal(tmp_path / "j.db", durability="process", busy_timeout=1.0)
    other = sqlite3.connect(journal.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        begun = time.monotonic()
        outcomes = _queued(journal, [_begin(journal, f"c{i}") for i in range(4)])
        waited = time.monotonic() - begun
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert all(isinstance(o, StoreBusy) for o in outcomes), outcomes
    assert waited < 2.5  # one deadline for the batch, not one for each write in it
    assert journal.head()[0] == 0
    _begin(journal, "c9")()  # the lock is free again: writes go through
    assert journal.head()[0] == 1
    journal.close()


def _locked_by_another_process(tmp_path: Path) -> tuple[SQLiteJournal, Any, sqlite3.Connection]:
    """A journal with a 1 s busy deadline, a guarded tool on it, and another connection that holds
    its write lock (ROLLBACK it to let go)."""
    journal = SQLiteJournal(tmp_path / "j.db", durability="process", busy_timeout=1.0)

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def pay(n: int) -> int:
        return n

    other = sqlite3.connect(journal.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    return journal, pay, other


def test_threads_queued_behind_a_blocked_writer_are_refused_at_their_own_deadline(tmp_path: Path) -> None:
    # The busy deadline counts from each call's start: threads that queued behind a writer stuck on
    # another process's lock are not given a second deadline of their own once it fails.
    journal, charge, other = _locked_by_another_process(tmp_path)
    took: list[float] = [0.0] * 8
    results: list[Any] = [None] * 8
    start = threading.Barrier(8)

    def call(i: int) -> None:
        start.wait()
        begun = time.monotonic()
        with AirlockContext(metadata={"tool_call_id": f"busy-{i}"}):
            results[i] = charge(i)
        took[i] = time.monotonic() - begun

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert all(is_refusal(r) and r["block_reason"] == "store_unavailable" for r in results), results
    assert max(took) < 1.7, took  # about one deadline; two (2.0 s) before each call kept its own
    with AirlockContext(metadata={"tool_call_id": "busy-after"}):
        assert charge(9) == 9
    journal.close()


def test_a_thread_that_queued_late_waits_its_own_deadline_not_the_batchs(tmp_path: Path) -> None:
    # A starts at 0, B at 0.3 s, C at 0.9 s, each with 1 s to wait; another process holds the lock
    # until 1.6 s. A and B are refused at their deadlines (1.0 and 1.3 s); C gets its turn at 1.6 s.
    journal, pay, other = _locked_by_another_process(tmp_path)
    results: dict[str, Any] = {}

    def call(name: str, delay: float) -> None:
        time.sleep(delay)
        with AirlockContext(metadata={"tool_call_id": name}):
            results[name] = pay(1)

    threads = [threading.Thread(target=call, args=a) for a in (("A", 0.0), ("B", 0.3), ("C", 0.9))]
    for t in threads:
        t.start()
    time.sleep(1.6)
    other.execute("ROLLBACK")
    other.close()
    for t in threads:
        t.join(120)
    assert is_refusal(results["A"]) and results["A"]["block_reason"] == "store_unavailable"
    assert is_refusal(results["B"]) and results["B"]["block_reason"] == "store_unavailable"
    assert results["C"] == 1
    journal.close()


def test_a_child_forked_while_writes_wait_never_makes_the_parents_writes(tmp_path: Path) -> None:
    import os

    journal = SQLiteJournal(tmp_path / "j.db", durability="process")
    _begin(journal, "first")()  # the parent's connection is open before the fork
    outcomes: list[BaseException | None] = [None] * 3

    def run(i: int) -> None:
        try:
            _begin(journal, f"parent-{i}")()
        except BaseException as e:
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    with journal.datastore.lock:  # the parent's threads queue their writes and wait
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(journal.datastore.group._requests) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(journal.datastore.group._requests) == 3
        pid = os.fork()
        if pid == 0:  # the child: its copy of the queue holds the parent's writes
            code = 1
            try:
                _begin(journal, "child")()
                code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for t in threads:
        t.join(120)
    assert outcomes == [None, None, None]
    ids = [e.call_id for e in journal.events()]
    assert sorted(str(i) for i in ids) == ["child", "first", "parent-0", "parent-1", "parent-2"]  # each once
    assert journal.verify().ok
    journal.close()
