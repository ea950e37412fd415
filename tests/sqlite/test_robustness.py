"""SQLiteJournal when the process around it misbehaves: interrupts, forks, symlinks, a moved cwd."""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from guard.store import Decision, EffectEvent, Verdict
from journal import SQLiteJournal


def run_pending(call_id: str) -> object:
    return lambda record: Decision(Verdict.RUN, EffectEvent(kind="pending", call_id=call_id, tool="t", attempt=1))


def other_process_writes(path: Path) -> str:
    code = (
        "from journal import SQLiteJournal\n"
        "from guard.store import EffectEvent\n"
        f"j = SQLiteJournal({str(path)!r}, durability='process', busy_timeout=2)\n"
        "j.append(EffectEvent(kind='refused', call_id=None, tool='t', reason={'code': 'x', 'message': 'm'}))\n"
        "print('written')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or done.stderr.strip().splitlines()[-1]


def test_a_transaction_an_interrupt_left_open_is_ended_before_the_next_write(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path, durability="process")
    journal.begin("c1", run_pending("c1"))  # type: ignore[arg-type]
    # What an interrupt landing between BEGIN and the end of the transaction leaves behind.
    journal.datastore.current.execute("BEGIN IMMEDIATE")
    journal.begin("c2", run_pending("c2"))  # type: ignore[arg-type]
    assert not journal.datastore.current.in_transaction
    assert other_process_writes(path) == "written"
    assert [e.kind for e in journal.events()] == ["pending", "pending", "refused"]
    journal.datastore.current.execute("BEGIN IMMEDIATE")
    assert journal.get("c2") is not None  # a read ends it too
    assert other_process_writes(path) == "written"
    assert journal.verify().ok


def refusal(call_id: str | None = None) -> EffectEvent:
    return EffectEvent(kind="refused", call_id=call_id, tool="t", reason={"code": "x", "message": "m"})


@pytest.mark.parametrize("objects", ["shared", "separate"])
def test_a_fork_while_another_thread_writes_gives_a_child_that_can_write(tmp_path: Path, objects: str) -> None:
    # The child must neither wait for a lock held by a thread it does not have, nor inherit
    # SQLite's record of a write lock that the parent's thread was holding at the fork.
    path = tmp_path / "j.db"
    busy = SQLiteJournal(path, durability="process")
    mine = busy if objects == "shared" else SQLiteJournal(path, durability="process", busy_timeout=2)
    stop = threading.Event()
    # The writer is in the middle of its writes when each fork comes, and then holds off until the
    # child has answered: a thread that writes without a pause would keep the file's write lock
    # nearly all the time, and SQLite lets a waiting process take it only between two commits.
    go = threading.Event()
    go.set()

    def write() -> None:
        while not stop.is_set():
            go.wait()
            busy.append(refusal())

    writer = threading.Thread(target=write)
    writer.start()
    answers = []
    try:
        time.sleep(0.1)
        for n in range(8):
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: one write, its answer down the pipe, and out
                os.close(read_end)
                signal.alarm(10)
                try:
                    mine.append(refusal(f"child-{n}"))
                    answer = b"ok"
                except BaseException as e:
                    answer = type(e).__name__.encode()
                os.write(write_end, answer)
                os._exit(0)
            go.clear()
            os.close(write_end)
            os.waitpid(pid, 0)
            answers.append(os.read(read_end, 100).decode() or "no answer")
            os.close(read_end)
            go.set()
            time.sleep(0.02)  # writing again before the next fork
    finally:
        stop.set()
        go.set()
        writer.join()
    assert answers == ["ok"] * 8
    assert {f"child-{n}" for n in range(8)} <= {e.call_id for e in busy.events()}
    assert busy.verify().ok


def test_a_journal_reached_through_a_symbolic_link_guards_calls_at_full(tmp_path: Path) -> None:
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard

    (tmp_path / "data").mkdir()
    link = tmp_path / "journal.db"
    link.symlink_to(tmp_path / "data" / "journal.db")
    journal = SQLiteJournal(link, durability="full")
    runs = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def pay(cents: int) -> dict[str, int]:
        runs.append(cents)
        return {"paid": cents}

    with AirlockContext(metadata={"tool_call_id": "c1"}):
        assert pay(5) == {"paid": 5}
        assert pay(5) == {"paid": 5}
    assert runs == [5]
    assert journal.get("c1").status == "committed"  # type: ignore[union-attr]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "journal.db"]  # no -wal beside the link
    assert journal.datastore.wal_path == str((tmp_path / "data" / "journal.db-wal").resolve())


def test_a_relative_path_keeps_naming_the_same_file_after_a_chdir(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    journal = SQLiteJournal("j.db", durability="process")
    journal.append(refusal("c1"))
    monkeypatch.chdir(second)
    SQLiteJournal("j.db", durability="process").close()  # another journal of that name in the new cwd
    journal.append(refusal("c2"))
    report = journal.verify()
    assert report.ok and report.events == 2
    assert sum(n for _, n in journal.export_lines()) == 2
    pid = os.fork()
    if pid == 0:  # a child's new connection opens the same file too
        try:
            journal.append(refusal("from-child"))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert [e.call_id for e in journal.events()] == ["c1", "c2", "from-child"]
    assert SQLiteJournal(second / "j.db").head()[0] == 0


def test_close_while_threads_wait_for_their_fsync_leaves_no_descriptor_open(tmp_path: Path) -> None:
    path = tmp_path / "j.db"

    def wal_descriptors() -> int:
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/self/fd/{fd}") == f"{path}-wal"
        return count

    keeper = SQLiteJournal(path, durability="process")  # keeps the WAL, as another process would
    keeper.head()
    baseline = wal_descriptors()
    for round_ in range(100):
        journal = SQLiteJournal(path, durability="full")
        go = threading.Event()

        def call(worker: int, journal: SQLiteJournal = journal, round_: int = round_,
                 go: threading.Event = go) -> None:
            go.wait()
            for n in range(50):
                try:
                    journal.begin(f"r{round_}-{worker}-{n}", run_pending(f"r{round_}-{worker}-{n}"))  # type: ignore[arg-type]
                except Exception:
                    return

        threads = [threading.Thread(target=call, args=(worker,)) for worker in range(4)]
        for thread in threads:
            thread.start()
        go.set()
        time.sleep(random.random() * 0.004)
        journal.close()
        for thread in threads:
            thread.join()
        assert wal_descriptors() == baseline, f"round {round_}"
    keeper.close()


def test_a_write_waits_for_another_threads_long_work_only_until_its_busy_deadline(tmp_path: Path) -> None:
    from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
    from guard.effect_guard import EffectGuard
    from journal import StoreBusy

    journal = SQLiteJournal(tmp_path / "j.db", durability="process", busy_timeout=0.2)
    runs = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def pay(cents: int) -> int:
        runs.append(cents)
        return cents

    held, release = threading.Event(), threading.Event()

    def long_work() -> None:  # what a rebuild of a large journal, on the same object, amounts to
        with journal.datastore.lock:
            held.set()
            release.wait(10)

    worker = threading.Thread(target=long_work)
    worker.start()
    held.wait()
    try:
        started = time.monotonic()
        with pytest.raises(StoreBusy, match=r"busy with another thread's work for 0\.2 s"):
            journal.begin("c1", run_pending("c1"))  # type: ignore[arg-type]
        with AirlockContext(metadata={"tool_call_id": "c2"}):
            refused = pay(5)
        waited = time.monotonic() - started
        with pytest.raises(StoreBusy):
            journal.append(refusal("c3"))
    finally:
        release.set()
        worker.join()
    assert is_refusal(refused) and refused["block_reason"] == "store_unavailable"
    assert runs == [] and waited < 5
    assert list(journal.events()) == []  # the writes given up were not made afterwards
    with AirlockContext(metadata={"tool_call_id": "c2"}):
        assert pay(5) == 5
    assert runs == [5]


def test_an_interrupt_of_the_thread_making_a_shared_transaction_is_its_own(tmp_path: Path) -> None:
    # Threads' writes are made together by whichever holds the connection; an interrupt of that
    # thread must not be raised in the others, whose writes their threads then make themselves.
    journal = SQLiteJournal(tmp_path / "j.db", durability="process")

    def interrupted(record: object) -> Decision:
        raise KeyboardInterrupt

    outcome = interrupted_while_making_another_threads_write(journal, interrupted)
    assert outcome["other"] == Verdict.RUN
    assert [(e.call_id, e.kind) for e in journal.events()] == [("other", "pending")]
    assert journal.verify().ok


def test_the_first_fsync_of_a_new_wal_makes_its_name_durable_too(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    journal = SQLiteJournal(tmp_path / "j.db", durability="full")
    journal.begin("c1", run_pending("c1"))  # type: ignore[arg-type]
    journal.begin("c2", run_pending("c2"))  # type: ignore[arg-type]
    assert synced.count(str(tmp_path)) == 1  # once for the new WAL, not once a call
    journal.close()


class InterruptAfterCommit:
    """The journal's connection, with a KeyboardInterrupt raised as the next COMMIT returns: what
    CPython does with a SIGINT that arrives while SQLite runs the COMMIT."""

    def __init__(self, conn: Any) -> None:
        self._conn, self.armed = conn, True

    def execute(self, sql: str, *args: Any) -> Any:
        cursor = self._conn.execute(sql, *args)
        if sql == "COMMIT" and self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class InterruptAfterPop(collections.deque):  # type: ignore[type-arg]
    """The journal's queue of writes, with a KeyboardInterrupt raised as a popleft() returns."""

    armed = False

    def popleft(self) -> Any:
        item = super().popleft()
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return item


def interrupted_while_making_another_threads_write(journal: SQLiteJournal, decide: Any = None) -> dict[str, Any]:
    """Queue another thread's begin, then make it with this thread's (decided by ``decide``) in one
    transaction, and be interrupted."""
    outcome: dict[str, Any] = {}

    def other() -> None:
        try:
            outcome["other"] = journal.begin("other", run_pending("other")).verdict  # type: ignore[arg-type]
        except BaseException as e:
            outcome["other"] = e

    thread = threading.Thread(target=other)
    with journal.datastore.lock:
        thread.start()
        while not journal.datastore.group._requests:
            time.sleep(0.001)
        with pytest.raises(KeyboardInterrupt):
            journal.begin("mine", decide or run_pending("mine"))  # type: ignore[arg-type]
    thread.join(10)
    return outcome


def test_a_shared_transaction_interrupted_as_its_commit_returns_is_made_once(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="process")
    journal.datastore.current = InterruptAfterCommit(journal.datastore.current)  # type: ignore[assignment]
    outcome = interrupted_while_making_another_threads_write(journal)
    assert outcome["other"] == Verdict.RUN  # told its write was made, as it was
    assert sorted((e.call_id, e.kind) for e in journal.events()) == [("mine", "pending"), ("other", "pending")]


def test_an_interrupt_while_taking_writes_off_the_queue_loses_none(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="process")
    journal.datastore.group._requests = InterruptAfterPop()
    journal.datastore.group._requests.armed = True
    outcome = interrupted_while_making_another_threads_write(journal)
    assert outcome["other"] == Verdict.RUN
    assert [(e.call_id, e.kind) for e in journal.events()] == [("other", "pending")]  # not the interrupted one


_SIGINT_STORM = """
import collections, os, signal, sys, threading, time
from guard.store import Decision, EffectEvent, Verdict
from journal import SQLiteJournal

journal = SQLiteJournal(sys.argv[1], durability="process", busy_timeout=2)
errors = collections.Counter()

def decide_for(call_id):
    def decide(record):
        if record is None:
            return Decision(Verdict.RUN, EffectEvent(kind="pending", call_id=call_id, tool="t", attempt=1))
        return Decision(Verdict.REFUSE, EffectEvent(kind="refused", call_id=call_id, tool="t",
                                                    reason={"code": "again", "message": "made twice"}))
    return decide

stop = time.monotonic() + 3
def worker(n):
    i = 0
    while time.monotonic() < stop:
        try:
            journal.begin(f"w{n}-{i}", decide_for(f"w{n}-{i}"))
        except BaseException as e:
            errors[type(e).__name__] += 1
        i += 1

def pester():  # from when the main thread is in its loop until it is about to leave it
    time.sleep(0.2)
    while time.monotonic() < stop - 0.3:
        time.sleep(0.0003)
        os.kill(os.getpid(), signal.SIGINT)

def watchdog():
    time.sleep(15)
    print("hung", flush=True)
    os._exit(3)

# An interrupt lands anywhere in the main thread's begin, once for each begin, and nowhere else:
# one that landed on the loop's own lines would end the script, not test the journal.
armed = [False]

def interrupt(signum, frame):
    if armed[0]:
        armed[0] = False
        raise KeyboardInterrupt

signal.signal(signal.SIGINT, interrupt)
threading.Thread(target=watchdog, daemon=True).start()
threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)] + [threading.Thread(target=pester)]
for t in threads:
    t.start()
i = 0
while time.monotonic() < stop:
    try:
        armed[0] = True
        journal.begin(f"m-{i}", decide_for(f"m-{i}"))
    except KeyboardInterrupt:
        pass
    finally:
        armed[0] = False
    i += 1
signal.signal(signal.SIGINT, signal.SIG_IGN)
for t in threads:
    t.join()
twice = [e.call_id for e in journal.events() if e.kind == "refused" and e.call_id.startswith("w")]
print(len(twice), dict(errors), journal.datastore.lock._is_owned(), journal.verify().ok)
"""


def test_a_storm_of_interrupts_never_wedges_the_journal_nor_makes_a_write_twice(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _SIGINT_STORM, str(tmp_path / "j.db")], capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split() == ["0", "{}", "False", "True"], (done.stdout, done.stderr[-1500:])


def test_a_pending_committed_just_before_close_is_durable_and_not_refused(tmp_path: Path) -> None:
    # begin commits, the journal is closed by another thread (its checkpoint removes the WAL), then
    # begin waits for its fsync: the checkpoint made the pending durable, so the call may go on.
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path, durability="full")
    journal.begin("c0", run_pending("c0"))  # type: ignore[arg-type]

    def record_pending(conn: Any) -> None:  # what begin's transaction does
        head, record = journal.writes.head_and_record(conn, "c1")
        journal.writes.append_event(conn, EffectEvent(kind="pending", call_id="c1", tool="t", attempt=1), record, head)

    _, ticket = journal.datastore.group.combined(record_pending)
    journal.close()
    assert not Path(f"{path}-wal").exists()
    journal.datastore.group.wait_durable(ticket)  # no JournalError: the call may go on
    with SQLiteJournal(path) as again:
        assert [e.call_id for e in again.events()] == ["c0", "c1"]
