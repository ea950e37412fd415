"""Real processes on one journal file: races, SIGKILL at any moment, a record lost after pending.

Effects are counted outside the journal, by O_APPEND writes of one line per effect to a side file,
the way a payment provider would see them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import shutil
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal

CTX = multiprocessing.get_context("fork")


def effect(side: Path, line: str) -> None:
    fd = os.open(side, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def effects(side: Path) -> Counter[str]:
    return Counter(side.read_text().split()) if side.exists() else Counter()


def charge_tool(journal: SQLiteJournal, side: Path, pause: float = 0.0, copy_to: Path | None = None) -> Any:
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        if copy_to is not None:  # what a power cut right now would leave: pending is all there is
            for suffix in ("", "-wal"):
                shutil.copyfile(f"{journal.path}{suffix}", f"{copy_to}{suffix}")
        effect(side, account)
        time.sleep(pause)
        return {"charged": cents}

    return charge


def call(tool: Any, call_id: str, *args: Any) -> Any:
    with AirlockContext(agent_id="agent", metadata={"tool_call_id": call_id}):
        return tool(*args)


def outcome(result: Any) -> str:
    return f"refused:{result['block_reason']}" if is_refusal(result) else "value"


# -- eight processes, one tool call id -------------------------------------------------------------


def racer(path: Path, side: Path, opened: Any, ready: Any, results: Any) -> None:
    opened.wait()  # every process creates or opens the file at the same moment
    journal = SQLiteJournal(path)
    tool = charge_tool(journal, side, pause=0.2)
    ready.wait()
    results.put(outcome(call(tool, "race", "acct", 5)))
    journal.close()


def test_eight_processes_on_one_id_make_one_effect(tmp_path: Path) -> None:
    path, side = tmp_path / "j.db", tmp_path / "effects"
    opened, ready, results = CTX.Barrier(8), CTX.Barrier(8), CTX.Queue()
    procs = [CTX.Process(target=racer, args=(path, side, opened, ready, results)) for _ in range(8)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    assert sum(effects(side).values()) == 1
    assert outcomes.count("value") >= 1
    assert set(outcomes) <= {"value", "refused:effect_status_unknown"}
    with SQLiteJournal(path) as journal:
        kinds = [e.kind for e in journal.call_events("race")]
        assert kinds.count("pending") == 1 and kinds.count("committed") == 1
        assert len(kinds) == 9  # pending, committed, and one refused or replayed for each of the seven others
        assert journal.verify().ok


# -- SIGKILL in the middle of a tool ------------------------------------------------------------------


def runs_then_hangs(path: Path, side: Path, running: Any) -> None:
    journal = SQLiteJournal(path)

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        effect(side, account)
        running.set()
        time.sleep(60)
        return {"charged": cents}

    call(charge, "k1", "acct", 5)


def replays(path: Path, side: Path, results: Any) -> None:
    journal = SQLiteJournal(path)
    results.put(outcome(call(charge_tool(journal, side), "k1", "acct", 5)))
    journal.close()


def test_sigkill_mid_tool_leaves_pending_and_a_replay_is_refused(tmp_path: Path) -> None:
    path, side = tmp_path / "j.db", tmp_path / "effects"
    running = CTX.Event()
    child = CTX.Process(target=runs_then_hangs, args=(path, side, running))
    child.start()
    assert running.wait(timeout=300)
    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    child.join()
    assert child.exitcode == -signal.SIGKILL
    results = CTX.Queue()
    replay = CTX.Process(target=replays, args=(path, side, results))
    replay.start()
    assert results.get(timeout=300) == "refused:effect_status_unknown"
    replay.join()
    assert effects(side) == Counter({"acct": 1})
    with SQLiteJournal(path) as journal:
        record = journal.get("k1")
        assert (record.status, record.attempt, record.owner["pid"]) == ("pending", 1, child.pid)
        assert [e.kind for e in journal.call_events("k1")] == ["pending", "refused"]
        assert journal.verify().ok
        # The owner is dead, so an operator may settle it without --force.
        assert journal.resolve("k1", applied=True, reason="the bank shows it", operator="ana").kind == "committed"


# -- SIGKILL at random moments -------------------------------------------------------------------------


def keeps_calling(path: Path, side: Path, seed: int) -> None:
    rng = random.Random(seed)
    journal = SQLiteJournal(path)

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        roll = rng.random()
        if roll < 0.1:
            raise ValueError("declined")  # no effect: the call is released and may run again
        effect(side, account)
        if roll < 0.2:
            raise TimeoutError("no answer")  # took effect, but the caller cannot know: unknown
        return {"charged": cents}

    while True:
        n = rng.randrange(300)
        with contextlib.suppress(ValueError, TimeoutError):
            call(charge, f"id{n}", f"id{n}", n)


def test_random_sigkills_never_double_an_effect_or_break_the_journal(tmp_path: Path) -> None:
    path, side = tmp_path / "j.db", tmp_path / "effects"
    rng = random.Random(20261201)
    kills = 0
    while kills < 120:
        child = CTX.Process(target=keeps_calling, args=(path, side, rng.randrange(1 << 30)))
        child.start()
        time.sleep(rng.uniform(0.0, 0.06))
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join()
        if child.exitcode == -signal.SIGKILL:
            kills += 1
    counted = effects(side)
    assert counted, "the children made no calls at all"
    assert max(counted.values()) == 1, [k for k, v in counted.items() if v > 1]
    with SQLiteJournal(path) as journal:
        report = journal.verify()
        assert report.ok, report
        records = {r.call_id: r for r in journal.calls(limit=None)}
        assert journal.stats().by_status.get("pending", 0) > 0, "no kill landed inside a call"
        for call_id in counted:
            assert records[call_id].status in ("pending", "committed", "unknown"), records[call_id]
        for record in records.values():
            if record.status == "committed":
                assert counted[record.call_id] == 1
            if record.status == "released":
                assert counted[record.call_id] == 0


# -- a record lost after pending ------------------------------------------------------------------------


def test_losing_what_was_written_after_pending_only_turns_a_replay_into_a_refusal(tmp_path: Path) -> None:
    path, side, copy = tmp_path / "j.db", tmp_path / "effects", tmp_path / "after-pending.db"
    journal = SQLiteJournal(path, durability="full")
    assert call(charge_tool(journal, side, copy_to=copy), "k1", "acct", 5) == {"charged": 5}
    assert call(charge_tool(journal, side), "k1", "acct", 5) == {"charged": 5}  # the journal replays it
    journal.close()
    results = CTX.Queue()
    replay = CTX.Process(target=replays, args=(copy, side, results))
    replay.start()
    assert results.get(timeout=300) == "refused:effect_status_unknown"
    replay.join()
    assert effects(side) == Counter({"acct": 1})
    with SQLiteJournal(copy) as lost:
        assert lost.get("k1").status == "pending"
        assert lost.verify().ok


# -- a journal inherited through fork ---------------------------------------------------------------------


def uses_inherited(journal: SQLiteJournal, side: Path, results: Any) -> None:
    results.put(outcome(call(charge_tool(journal, side), "f2", "child", 2)))


def test_a_forked_child_uses_its_own_connection(tmp_path: Path) -> None:
    side = tmp_path / "effects"
    journal = SQLiteJournal(tmp_path / "j.db", durability="process")
    assert call(charge_tool(journal, side), "f1", "parent", 1) == {"charged": 1}
    results = CTX.Queue()
    child = CTX.Process(target=uses_inherited, args=(journal, side, results))
    child.start()
    assert results.get(timeout=300) == "value"
    child.join()
    assert call(charge_tool(journal, side), "f3", "parent", 3) == {"charged": 3}
    assert [r.call_id for r in journal.calls()] == ["f3", "f2", "f1"]
    assert journal.verify().ok
    journal.close()


@pytest.mark.parametrize("durability", ["full", "process"])
def test_a_sigkill_right_after_begin_keeps_what_was_committed(tmp_path: Path, durability: str) -> None:
    path, side = tmp_path / "j.db", tmp_path / "effects"
    running = CTX.Event()

    def child_main() -> None:
        journal = SQLiteJournal(path, durability=durability)  # type: ignore[arg-type]
        call(charge_tool(journal, side), "c0", "first", 0)
        runs_then_hangs_with(journal, side, running)

    child = CTX.Process(target=child_main)
    child.start()
    assert running.wait(timeout=300)
    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    child.join()
    with SQLiteJournal(path) as journal:
        assert journal.get("c0").status == "committed"
        assert journal.get("k1").status == "pending"
        assert journal.verify().ok


def runs_then_hangs_with(journal: SQLiteJournal, side: Path, running: Any) -> None:
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        running.set()
        time.sleep(60)
        return {"charged": cents}

    call(charge, "k1", "acct", 5)


# -- reading while others write ------------------------------------------------------------------------


def writes_for(path: Path, side: Path, seconds: float, worker: int) -> None:
    journal = SQLiteJournal(path, durability="process")
    tool = charge_tool(journal, side)
    deadline, n = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        n += 1
        call(tool, f"w{worker}-{n % 50}", f"w{worker}-{n % 50}", n % 50)
    journal.close()


def test_verify_stats_and_export_while_processes_write(tmp_path: Path) -> None:
    from journal.chain import verify_lines

    path, side = tmp_path / "j.db", tmp_path / "effects"
    SQLiteJournal(path).close()
    writers = [CTX.Process(target=writes_for, args=(path, side, 1.5, w)) for w in range(3)]
    for w in writers:
        w.start()
    reports = []
    with SQLiteJournal(path, readonly=True) as reader:
        while any(w.is_alive() for w in writers):
            reports.append(reader.verify())
            stats = reader.stats()
            assert stats.calls == sum(stats.by_status.values()) == sum(stats.by_tool.values())
            assert verify_lines(e.export() for e in reader.events()).ok
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert len(reports) >= 2 and all(r.ok for r in reports), [r for r in reports if not r.ok]
    assert reports[-1].events > 100
    with SQLiteJournal(path) as journal:
        assert journal.verify().ok
        assert max(effects(side).values()) == 1
