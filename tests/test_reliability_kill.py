"""SIGKILL at each named point of a call's life, on each journal; then a retry in a new process.

The effect is counted outside the journal (an O_APPEND file the tool writes at its effect), so a
second effect cannot hide. After every kill the retry must make no second effect of a tool that
is not reversible, ``verify()`` must pass, and the call's status must be what the replay table says.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from journal import Journal
from journal.testing import KILL_POINTS, EffectLog
from tests.journals import JournalFactory

ROOT = Path(__file__).resolve().parent.parent
CALL_ID = "call_kill_1"
CHILD = "import sys; from tests.test_reliability_kill import child_main; child_main(sys.argv[1])"


def child_main(spec_text: str) -> None:
    """Run one guarded call as the spec says, in this (child) process; print its result as JSON."""
    from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context
    from guard.effect_guard import EffectGuard, reversibility
    from journal import open_journal
    from journal.testing import KillPoints

    spec = json.loads(spec_text)
    store = open_journal(spec["db"])
    points = KillPoints(store, at=spec["at"], call_id=spec["call_id"])
    effects = EffectLog(spec["effects"])

    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=points)))
    @reversibility(spec["reversibility"])
    @points.tool
    def pay(account: str, cents: int) -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        effects.record(context.tool_call_id, account=account, cents=cents)
        return {"paid": cents, "account": account}

    with AirlockContext(agent_id="agent-kill", metadata={"tool_call_id": spec["call_id"]}):
        result = pay("acct_7", 500)
    sys.stdout.write(json.dumps({"result": result}) + "\n")
    sys.stdout.flush()
    store.close()


def run_child(db: str, effects: Path, at: str | None, reversibility: str = "irreversible") -> tuple[int, Any]:
    """Run the call in a new process; returns (exit status, the result it printed or None)."""
    spec = json.dumps({"db": db, "at": at, "call_id": CALL_ID, "effects": str(effects),
                       "reversibility": reversibility})
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, spec],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    if proc.returncode != 0 and proc.returncode != -signal.SIGKILL:
        raise AssertionError(f"the child failed ({proc.returncode}): {proc.stderr}")
    printed = json.loads(proc.stdout)["result"] if proc.returncode == 0 else None
    return proc.returncode, printed


@pytest.fixture
def db(journal_kind: JournalFactory, journal_target: str, journal: Journal) -> Iterator[str]:
    """What the child opens: the journal of every store (tests/conftest.py) that ``journal`` is, open
    in this process."""
    yield journal_target
    journal_kind.disarm(journal_target)


def kinds(journal: Any) -> list[str]:
    return [e.kind for e in journal.call_events(CALL_ID)]


def assert_verified(journal: Any) -> None:
    report = journal.verify()
    assert report.ok, report.problem


# What each kill leaves, and what the retry of an irreversible call then gets.
BEFORE_EFFECT = ("after_pending", "in_tool")
AFTER_EFFECT = ("after_effect", "during_committed")


def test_the_kill_points_are_the_documented_ones() -> None:
    assert KILL_POINTS == (
        "during_pending", "after_pending", "in_tool", "after_effect", "during_committed", "during_replay",
    )


def test_a_kill_while_pending_is_written_records_nothing_and_the_retry_runs_once(
    db: str, journal: Any, tmp_path: Path
) -> None:
    effects = EffectLog(tmp_path / "effects.jsonl")

    status, _ = run_child(db, effects.path, "during_pending")
    assert status == -signal.SIGKILL
    assert effects.count(CALL_ID) == 0
    assert journal.get(CALL_ID) is None
    assert journal.count_events() == 0  # the pending event died with its transaction
    assert_verified(journal)

    status, value = run_child(db, effects.path, None)
    assert (status, value) == (0, {"paid": 500, "account": "acct_7"})
    assert effects.count(CALL_ID) == 1
    assert kinds(journal) == ["pending", "committed"]
    assert_verified(journal)


@pytest.mark.parametrize("at", BEFORE_EFFECT + AFTER_EFFECT)
def test_a_kill_before_committed_leaves_pending_and_the_retry_is_refused(
    db: str, journal: Any, tmp_path: Path, at: str
) -> None:
    effects = EffectLog(tmp_path / "effects.jsonl")

    status, _ = run_child(db, effects.path, at)
    assert status == -signal.SIGKILL
    expected_effects = 0 if at in BEFORE_EFFECT else 1
    assert effects.count(CALL_ID) == expected_effects
    assert journal.get(CALL_ID).status == "pending"
    assert kinds(journal) == ["pending"]  # during_committed: the committed event died with its transaction
    assert_verified(journal)

    status, retried = run_child(db, effects.path, None)
    assert status == 0
    assert retried["block_reason"] == "effect_status_unknown"
    assert retried["metadata"]["status"] == "pending"
    assert effects.count(CALL_ID) == expected_effects  # the retry ran nothing
    assert journal.get(CALL_ID).status == "pending"
    assert kinds(journal) == ["pending", "refused"]
    assert_verified(journal)


def test_a_kill_during_a_replay_and_the_retry_replays_the_same_value(db: str, journal: Any, tmp_path: Path) -> None:
    effects = EffectLog(tmp_path / "effects.jsonl")

    status, first = run_child(db, effects.path, None)
    assert (status, first) == (0, {"paid": 500, "account": "acct_7"})
    status, _ = run_child(db, effects.path, "during_replay")
    assert status == -signal.SIGKILL
    assert kinds(journal) == ["pending", "committed", "replayed"]
    assert_verified(journal)

    status, replayed = run_child(db, effects.path, None)
    assert (status, replayed) == (0, first)
    assert effects.count(CALL_ID) == 1
    assert journal.get(CALL_ID).status == "committed"
    assert kinds(journal) == ["pending", "committed", "replayed", "replayed"]
    assert_verified(journal)


@pytest.mark.parametrize("at", ["after_effect", "during_committed"])
def test_a_reversible_tool_killed_after_its_effect_runs_again(db: str, journal: Any, tmp_path: Path, at: str) -> None:
    # Only a reversible tool may run twice on doubt; the second run is attempt 2 and commits.
    effects = EffectLog(tmp_path / "effects.jsonl")

    status, _ = run_child(db, effects.path, at, reversibility="reversible")
    assert status == -signal.SIGKILL
    status, value = run_child(db, effects.path, None, reversibility="reversible")
    assert (status, value) == (0, {"paid": 500, "account": "acct_7"})
    assert effects.count(CALL_ID) == 2
    record = journal.get(CALL_ID)
    assert (record.status, record.attempt) == ("committed", 2)
    assert kinds(journal) == ["pending", "pending", "committed"]
    assert_verified(journal)


def test_after_a_kill_an_operator_settles_the_call_and_the_retry_replays_it(
    db: str, journal: Any, tmp_path: Path
) -> None:
    # What an operator meets after a crash: a pending call whose owner is gone, settled without --force.
    from tests.cli_support import invoke

    effects = EffectLog(tmp_path / "effects.jsonl")
    status, _ = run_child(db, effects.path, "after_effect")
    assert status == -signal.SIGKILL

    shown = invoke("journal", "show", "--json", "--db", db, CALL_ID)
    assert shown.exit_code == 0, shown.stderr
    call = json.loads(shown.stdout)
    assert (call["status"], call["owner_alive"]) == ("pending", False)

    settled = invoke("journal", "resolve", CALL_ID, "--applied", "--value", '{"paid": 500, "account": "acct_7"}',
                     "--reason", "the bank shows the charge", "--operator", "ops", "--db", db)
    assert settled.exit_code == 0, settled.stderr
    status, replayed = run_child(db, effects.path, None)
    assert (status, replayed) == (0, {"paid": 500, "account": "acct_7"})
    assert effects.count(CALL_ID) == 1
    assert kinds(journal) == ["pending", "committed", "replayed"]
    assert journal.call_events(CALL_ID)[1].actor == "operator:ops"
    assert_verified(journal)


DISARMED_CHILD = """
import sys
from guard.effect_guard import decide_attempt
from journal import open_journal
from journal.testing import KillPoints

def decide(call_id):
    return lambda record: decide_attempt(record, call_id, "pay", "k", "{}", None, False)

points = KillPoints(open_journal(sys.argv[1]), at="during_pending", call_id=sys.argv[2])
print(points.begin(sys.argv[2], decide(sys.argv[2])).verdict.value)  # a replay: the point is not reached
print(points.begin("another-call", decide("another-call")).verdict.value)  # never the point's call
"""


def test_a_kill_point_not_reached_is_disarmed_for_the_calls_after_it(db: str, journal: Any) -> None:
    from guard.effect_guard import decide_attempt
    from guard.store import EffectEvent

    journal.begin(CALL_ID, lambda record: decide_attempt(record, CALL_ID, "pay", "k", "{}", None, False))
    journal.append(EffectEvent("committed", CALL_ID, "pay", attempt=1, value='"ok"'))
    proc = subprocess.run([sys.executable, "-c", DISARMED_CHILD, db, CALL_ID], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.split()) == (0, ["replay", "run"]), proc.stderr
    assert [e.kind for e in journal.call_events("another-call")] == ["pending"]
    assert_verified(journal)
