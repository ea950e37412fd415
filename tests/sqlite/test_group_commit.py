"""Group commit: threads of one process share the fsync of their pending records, and lose none.

At ``durability="full"`` a tool runs only after its own ``pending`` is on disk, however many threads
call at once; each non-reversible effect happens once; a process killed right after ``begin`` returned
leaves a ``pending`` for every effect its tools made.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
from journal.sqlite import group_commit as journal_sqlite

CTX = multiprocessing.get_context("fork")
THREADS = 8


def call(tool: Any, call_id: str, *args: Any) -> Any:
    with AirlockContext(agent_id="agent", metadata={"tool_call_id": call_id}):
        return tool(*args)


class SyncedUpTo:
    """Wraps the system call that fsyncs the journal's WAL: ``seq`` is the last event an fsync of
    that file, completed, covers; ``syncs`` counts them, and ``others`` names any other file synced."""

    def __init__(self, journal: SQLiteJournal, monkeypatch: pytest.MonkeyPatch) -> None:
        self.journal = journal
        self.seq = 0
        self.syncs = 0
        self.others: list[str] = []
        self.lock = threading.Lock()
        wal = os.path.realpath(journal.datastore.wal_path)
        real = journal_sqlite._fdatasync

        def sync(fd: int) -> None:
            synced = os.path.realpath(f"/proc/self/fd/{fd}")
            covered = journal.head()[0]  # every event up to here was committed before this fsync began
            real(fd)
            with self.lock:
                if synced != wal:
                    self.others.append(synced)
                    return
                self.seq = max(self.seq, covered)
                self.syncs += 1

        monkeypatch.setattr(journal_sqlite, "_fdatasync", sync)


def test_eight_threads_at_full_run_every_effect_once_and_only_once_its_pending_is_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="full")
    synced = SyncedUpTo(journal, monkeypatch)
    effects: Counter[str] = Counter()
    early: list[str] = []
    lock = threading.Lock()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        context = get_current_context()
        assert context is not None and context.tool_call_id is not None
        call_id = context.tool_call_id
        pending_seq = max(e.seq for e in journal.call_events(call_id) if e.kind == "pending")
        with lock:
            effects[call_id] += 1
            if pending_seq > synced.seq:
                early.append(call_id)
        return {"charged": cents, "account": account}

    distinct, shared = 30, 12
    barrier = threading.Barrier(THREADS)
    results: dict[str, list[Any]] = {f"shared-{i}": [] for i in range(shared)}
    failures: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            barrier.wait()
            for i in range(distinct):
                result = call(charge, f"t{n}-{i}", f"acct-{n}", i)
                assert result == {"charged": i, "account": f"acct-{n}"}
                if i % 3 == 0:  # every thread also calls the shared ids, all at once
                    for j in range(i // 3, shared, distinct // 3):
                        outcome = call(charge, f"shared-{j}", "acct-shared", j)
                        with lock:
                            results[f"shared-{j}"].append(outcome)
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert early == [], "a tool ran before its pending was fsynced"
    assert set(effects.values()) == {1}, "an effect happened twice"
    assert len(effects) == THREADS * distinct + shared
    for call_id, outcomes in results.items():
        assert len(outcomes) == THREADS
        for outcome in outcomes:  # the value (the call that ran, or a replay) or a refusal while pending
            assert outcome == {"charged": int(call_id.split("-")[1]), "account": "acct-shared"} or (
                is_refusal(outcome) and outcome["block_reason"] == "effect_status_unknown"
            ), outcome
    assert journal.stats().by_status == {"committed": THREADS * distinct + shared}
    assert 1 <= synced.syncs <= THREADS * distinct + shared
    assert synced.others == []
    assert journal.verify().ok
    journal.close()


def test_threads_calling_at_once_share_an_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="full")
    syncs: list[int] = []
    real = journal_sqlite._fdatasync

    def slow_sync(fd: int) -> None:  # a slow disk: whoever commits meanwhile waits for the next fsync
        syncs.append(fd)
        time.sleep(0.25)
        real(fd)

    monkeypatch.setattr(journal_sqlite, "_fdatasync", slow_sync)
    ran: list[str] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> int:
        ran.append(account)
        return cents

    barrier = threading.Barrier(THREADS)
    results: list[Any] = []

    def worker(n: int) -> None:
        barrier.wait()
        results.append(call(charge, f"g{n}", f"acct-{n}", n))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(THREADS))
    assert sorted(ran) == sorted(f"acct-{n}" for n in range(THREADS))
    # The first fsync covers the first commit; those made while it ran share the next one (or two, or
    # three, on a machine so loaded that a thread commits a quarter of a second late): never one each.
    assert 1 <= len(syncs) <= 4
    journal.close()


def _keep_calling(path: str, side: str, threads: int) -> None:
    """In a child process: threads calling a guarded tool with fresh ids at full, until killed."""
    journal = SQLiteJournal(path, durability="full")

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> int:
        context = get_current_context()
        assert context is not None
        # The effect, as the outside world would see it: written only once begin has returned.
        fd = os.open(side, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{context.tool_call_id}\n".encode())
        finally:
            os.close(fd)
        return cents

    def worker(n: int) -> None:
        i = 0
        while True:
            call(charge, f"p{os.getpid()}-t{n}-{i}", f"acct-{n}", i)
            i += 1

    for n in range(threads):
        threading.Thread(target=worker, args=(n,), daemon=True).start()
    while True:
        time.sleep(1)


def test_a_process_killed_right_after_begin_keeps_a_pending_for_every_effect(tmp_path: Path) -> None:
    path, side = tmp_path / "j.db", tmp_path / "effects.txt"
    SQLiteJournal(path, durability="full").close()
    for wanted in (40, 120):  # killed at two different moments
        child = CTX.Process(target=_keep_calling, args=(str(path), str(side), THREADS))
        child.start()
        deadline = time.monotonic() + 60
        while (len(side.read_text().split()) if side.exists() else 0) < wanted:
            assert time.monotonic() < deadline, "the child made no progress"
            assert child.is_alive()
            time.sleep(0.005)
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
    journal = SQLiteJournal(path, durability="full")
    ran = side.read_text().split()
    assert len(ran) == len(set(ran))
    pending = {e.call_id for e in journal.events() if e.kind == "pending"}
    assert set(ran) <= pending, f"effects without a pending: {sorted(set(ran) - pending)[:5]}"
    assert journal.verify().ok
    journal.close()


def test_a_journal_opened_by_a_relative_path_keeps_syncing_after_the_process_changes_directory(
    tmp_path: Path, monkeypatch: Any
) -> None:
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    journal = SQLiteJournal("j.db", durability="full")
    ran: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> int:
        ran.append(cents)
        return cents

    assert call(charge, "c1", "acct", 1) == 1
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert call(charge, "c2", "acct", 2) == 2  # not refused store_unavailable: the WAL is still found
    assert ran == [1, 2]
    journal.close()
