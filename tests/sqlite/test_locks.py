"""The locks SQLite holds on a journal file, kept through everything a process does with it.

SQLite marks a connection's use of a WAL journal with POSIX locks on the file. Those locks are the
process's, not the connection's: closing any descriptor of the file in the process takes them all
away, and a forked child inherits SQLite's record of them but not the locks themselves. Either way
another process, finding no lock, takes itself for the file's last user when it closes: it copies
the WAL into the file and deletes it, and the commits made after that into the deleted WAL are
lost. These tests make that happen with real processes and check that no write is lost: a second
journal object opened in the same process, forks with the journal open, and interrupts (a real
SIGINT) at every step of the group commit and of a write waiting its turn.
"""

from __future__ import annotations

import os
import resource
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from guard.store import Decision, EffectEvent, Verdict
from journal import SQLiteJournal
from journal.errors import JournalError
from journal.sqlite import forks as journal_sqlite
from journal.sqlite.group_commit import GroupCommit

ROOT = Path(__file__).resolve().parents[2]


def run_pending(call_id: str) -> Any:
    return lambda record: Decision(Verdict.RUN, EffectEvent("pending", call_id, "t", attempt=1))


def in_another_process(path: Path, call_id: str) -> None:
    """Open the journal in a new process, record ``call_id`` pending, and close it."""
    code = (
        "import sys\n"
        "from journal import SQLiteJournal\n"
        "from guard.store import Decision, EffectEvent, Verdict\n"
        f"j = SQLiteJournal({str(path)!r}, durability='process')\n"
        f"j.begin({call_id!r}, lambda r: Decision(Verdict.RUN, EffectEvent('pending', {call_id!r}, 't', attempt=1)))\n"
        "j.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


class Keeper:
    """Another process that has the journal open (and so a WAL) until it is told to go."""

    def __init__(self, path: Path) -> None:
        code = (
            "import sys\n"
            "from journal import SQLiteJournal\n"
            f"j = SQLiteJournal({str(path)!r}, durability='process')\n"
            "j.head()\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "j.close()\n"
        )
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "ready"

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        assert self.process.wait(300) == 0


def call_ids_seen_elsewhere(path: Path) -> list[str]:
    """The call ids of the journal's events, as a new process reads them (with verify passing)."""
    code = (
        "import orjson\n"
        "from journal import SQLiteJournal\n"
        f"j = SQLiteJournal({str(path)!r}, readonly=True)\n"
        "assert j.verify().ok\n"
        "print(orjson.dumps([e.call_id for e in j.events()]).decode())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    return list(__import__("orjson").loads(out.stdout))


@pytest.mark.parametrize("durability", ["process", "full"])
@pytest.mark.parametrize("second", ["readonly", "writable"])
def test_a_second_journal_object_on_the_file_keeps_the_first_ones_writes(
    tmp_path: Path, durability: str, second: str
) -> None:
    path = tmp_path / "j.db"
    service = SQLiteJournal(path, durability=durability)  # a long-running process's journal
    service.begin("s1", run_pending("s1"))
    SQLiteJournal(path, readonly=second == "readonly").close()  # a status page reading it once, say
    in_another_process(path, "cli-1")  # another process opens, writes and closes the journal
    assert os.path.exists(f"{path}-wal")  # it knew the service still had the journal open
    keeper = Keeper(path)
    try:
        assert service.begin("s2", run_pending("s2")).verdict is Verdict.RUN
    finally:
        keeper.go()
    assert service.verify().ok
    assert call_ids_seen_elsewhere(path) == ["s1", "cli-1", "s2"]
    service.close()


def test_a_wal_taken_away_under_the_journal_refuses_the_call_at_full(tmp_path: Path) -> None:
    # Code of the application that opens and closes the file itself takes SQLite's locks away too;
    # at full the journal notices that its WAL is not the file's any more before the tool runs.
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path, durability="full")
    runs: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def pay(cents: int) -> int:
        runs.append(cents)
        return cents

    with AirlockContext(metadata={"tool_call_id": "c1"}):
        assert pay(1) == 1
    with open(path, "rb") as f:  # the application's own look at the file
        f.read(16)
    in_another_process(path, "other")  # closes as the last user: the WAL is copied in and deleted
    assert not os.path.exists(f"{path}-wal")
    keeper = Keeper(path)  # a new WAL, another file
    try:
        with AirlockContext(metadata={"tool_call_id": "c2"}):
            refused = pay(2)
    finally:
        keeper.go()
    assert is_refusal(refused) and refused["block_reason"] == "store_unavailable"
    assert "lost its WAL" in refused["metadata"]["store_error"]
    assert runs == [1]
    with AirlockContext(metadata={"tool_call_id": "c3"}):  # the journal opens a new connection and goes on
        assert pay(3) == 3
    assert runs == [1, 3]
    # Whether c2's pending reached the new WAL is SQLite's affair; if it did, a retry is refused.
    assert [i for i in call_ids_seen_elsewhere(path) if i != "c2"] == ["c1", "c1", "other", "c3", "c3"]
    journal.close()


def fork_child(body: Any, alarm: int = 30) -> tuple[int, int, int]:
    """Fork; the child runs ``body(to_parent_fd, from_parent_fd)`` and exits. Returns (pid, r, w)."""
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(alarm)  # a child that hangs is killed, and says nothing
        try:
            body(to_parent_w, to_child_r)
        except BaseException as e:  # the report says what went wrong
            os.write(to_parent_w, f"|error:{type(e).__name__}:{e}".encode())
        finally:
            os._exit(0)
    os.close(to_parent_w)
    os.close(to_child_r)
    return pid, to_parent_r, to_child_w


def read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode()


@pytest.mark.parametrize("durability", ["process", "full"])
@pytest.mark.parametrize("objects", ["inherited", "new"])
def test_a_forked_childs_writes_outlive_the_parent_closing_the_journal(
    tmp_path: Path, durability: str, objects: str
) -> None:
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path, durability=durability)
    journal.begin("parent", run_pending("parent"))

    def child(out: int, inbox: int) -> None:
        mine = journal if objects == "inherited" else SQLiteJournal(path, durability=durability)
        os.write(out, f"b:{mine.begin('b', run_pending('b')).verdict.name}".encode())
        os.read(inbox, 1)  # the parent has closed its journal, and another process wrote
        os.write(out, f" c:{mine.begin('c', run_pending('c')).verdict.name}".encode())
        mine.close()

    pid, from_child, to_child = fork_child(child)
    assert os.read(from_child, 5) == b"b:RUN"
    journal.close()  # the parent is done with the journal; the child goes on
    in_another_process(path, "d")
    os.write(to_child, b"x")
    assert os.waitpid(pid, 0)[1] == 0
    assert read_all(from_child) == " c:RUN"
    assert call_ids_seen_elsewhere(path) == ["parent", "b", "d", "c"]


def test_a_child_forked_during_an_fsync_can_close_the_journal_and_write(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="full")
    stop = threading.Event()

    def calls() -> None:
        n = 0
        while not stop.is_set():
            journal.begin(f"w{n}", run_pending(f"w{n}"))
            n += 1

    worker = threading.Thread(target=calls)
    worker.start()
    reports = []
    try:
        for n in range(50):
            deadline = time.monotonic() + 5
            # a thread's fsync is under way
            while not journal.datastore.group._syncing and time.monotonic() < deadline:
                pass

            def child(out: int, inbox: int, n: int = n) -> None:
                journal.close()  # a child that does not use the journal, and closes it
                os.write(out, b"closed")
                with SQLiteJournal(journal.path, durability="full") as mine:
                    os.write(out, f" {mine.begin(f'child-{n}', run_pending(f'child-{n}')).verdict.name}".encode())

            pid, from_child, to_child = fork_child(child, alarm=5)
            os.close(to_child)
            os.waitpid(pid, 0)
            reports.append(read_all(from_child))
            if reports[-1] != "closed RUN":
                break
    finally:
        stop.set()
        worker.join()
    assert reports == ["closed RUN"] * 50, f"child {len(reports) - 1} said {reports[-1]!r}"
    ids = {e.call_id for e in journal.events()}
    assert {f"child-{n}" for n in range(50)} <= ids
    assert journal.verify().ok
    journal.close()


def test_an_fsync_after_a_fork_let_go_of_the_connection_finds_the_wal_checkpointed(tmp_path: Path) -> None:
    # The moments of the race above, one at a time: a commit is made and its fsync has the WAL open;
    # a fork lets go of the connection, the file's last, so SQLite copies the WAL into the file and
    # removes it; another process makes a new WAL. The fsync that comes next must not fail the call:
    # the commit is in the journal file, which the checkpoint synced.
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path, durability="full")
    assert journal.begin("before", run_pending("before")).verdict is Verdict.RUN  # its fsync opened the WAL
    pid, from_child, to_child = fork_child(lambda out, inbox: None)  # the fork lets go of the connection
    os.close(to_child)
    os.waitpid(pid, 0)
    read_all(from_child)
    assert not os.path.exists(f"{path}-wal")  # checkpointed into the file by its last connection
    journal.datastore.group.sync_wal()  # the WAL is gone
    journal.datastore.group.sync_wal()
    keeper = Keeper(path)  # another WAL, another process's
    try:
        journal.datastore.group.sync_wal()  # the WAL is another file now
        assert journal.begin("after", run_pending("after")).verdict is Verdict.RUN
    finally:
        keeper.go()
    assert call_ids_seen_elsewhere(path) == ["before", "after"]
    assert journal.verify().ok
    journal.close()


def test_a_failed_first_open_in_a_child_fails_that_call_alone(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path, durability="process")
    journal.begin("parent", run_pending("parent"))

    def child(out: int, inbox: int) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        fillers = []
        try:  # no descriptor left for a moment: the child's first open fails
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        try:
            journal.begin("a", run_pending("a"))
            os.write(out, b"a:ran")
        except JournalError as e:
            os.write(out, b"a:JournalError" if "open files" in str(e) else str(e).encode())
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        os.write(out, f" b:{journal.begin('b', run_pending('b')).verdict.name}".encode())
        used = any(c is journal.datastore.current for c in journal_sqlite.INHERITED)
        os.write(out, f" inherited-used:{used}".encode())
        journal.close()

    pid, from_child, to_child = fork_child(child)
    os.close(to_child)
    os.waitpid(pid, 0)
    assert read_all(from_child) == "a:JournalError b:RUN inherited-used:False"
    journal.close()
    assert call_ids_seen_elsewhere(path) == ["parent", "b"]  # the refused write was never made


def test_a_call_interrupted_while_its_write_waits_its_turn_is_never_recorded(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path, durability="process", busy_timeout=10)
    runs: list[str] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str) -> str:
        runs.append(account)
        return account

    other = sqlite3.connect(path, isolation_level=None)  # another process's writer holds the file's lock
    other.execute("BEGIN IMMEDIATE")

    def writer() -> None:  # a thread of this process whose write waits for it, holding the connection
        journal.append(EffectEvent("refused", None, "t", reason={"code": "policy_violation", "message": "m"}))

    waiting = threading.Thread(target=writer)
    waiting.start()
    time.sleep(0.3)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while the call waits
    with pytest.raises(KeyboardInterrupt), AirlockContext(metadata={"tool_call_id": "x"}):
        charge("acct")
    other.execute("ROLLBACK")
    other.close()
    waiting.join(120)
    assert journal.get("x") is None
    with AirlockContext(metadata={"tool_call_id": "x"}):  # the retry of a call that never ran runs it
        assert charge("acct") == "acct"
    assert runs == ["acct"]
    assert [e.kind for e in journal.events() if e.call_id == "x"] == ["pending", "committed"]
    journal.close()


def test_an_interrupt_at_any_step_of_the_group_commit_leaves_it_working(tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "j.db", durability="full", busy_timeout=5)
    journal.begin("warm", run_pending("warm"))
    code = GroupCommit.wait_durable.__code__
    lines = sorted({line for _, _, line in code.co_lines() if line is not None and line > code.co_firstlineno})
    interrupted = 0
    for n, target in enumerate(lines):
        def tracer(frame: FrameType, event: str, arg: Any, target: int = target) -> Any:
            if frame.f_code is not code:
                return None

            def local(frame: FrameType, event: str, arg: Any) -> Any:
                if event == "line" and frame.f_lineno == target:
                    sys.settrace(None)
                    frame.f_trace = None
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives at this step
                return local

            return local

        sys.settrace(tracer)
        try:
            journal.begin(f"m{n}", run_pending(f"m{n}"))
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            sys.settrace(None)
        answers: list[object] = []

        def another(n: int = n, answers: list[object] = answers) -> None:
            answers.append(journal.begin(f"t{n}", run_pending(f"t{n}")).verdict)

        other = threading.Thread(target=another)
        other.start()
        other.join(120)
        assert answers == [Verdict.RUN], f"after an interrupt at line {target}, another thread's begin got {answers}"
        assert not journal.datastore.group._syncing
    assert interrupted >= len(lines) // 2  # the interrupts did land inside the group commit
    assert journal.verify().ok
    journal.close()
