"""journal.testing as users meet it: the pytest plugin's fixtures, lost_response, the kill-point
helper's checks, the effect log; and the plugin loads without hypothesis."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard, InMemoryEffectStore, reversibility
from journal import SQLiteJournal
from journal.testing import EffectLog, KillPoints, lost_response

ROOT = Path(__file__).resolve().parent.parent

USER_TEST = '''
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal.testing import lost_response


def test_a_lost_response_is_not_charged_twice(airlock_journal, airlock_effects):
    def charge(account: str, cents: int) -> dict:
        airlock_effects.record("call_1", account=account)
        return {"charged": cents}

    guarded = Airlock(SecurityPolicy(effect_guard=EffectGuard(store=airlock_journal)))(lost_response(charge))
    with AirlockContext(metadata={"tool_call_id": "call_1"}):
        try:
            guarded("acct_1", 500)
        except TimeoutError:
            pass
        retry = guarded("acct_1", 500)
    assert retry["block_reason"] == "effect_status_unknown"
    assert airlock_effects.count("call_1") == 1
    assert airlock_journal.get("call_1").status == "unknown"


def test_each_test_gets_a_fresh_journal(airlock_journal):
    assert airlock_journal.count_events() == 0


# The example of docs/testing.md, as it stands there.
from hypothesis import given, settings
from guard.effect_guard import InMemoryEffectStore
from journal import SQLiteJournal
from journal.testing import call_sequences, play


@settings(max_examples=10, deadline=None)
@given(steps=call_sequences())
def test_my_store_behaves_like_the_in_memory_one(steps, tmp_path_factory):
    with SQLiteJournal(tmp_path_factory.mktemp("j") / "j.db") as journal:
        durable, model = play(steps, journal), play(steps, InMemoryEffectStore())
        assert durable.double_effects() == {}
        assert durable.effects == model.effects
        assert journal.verify().ok
'''


def run_pytest(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_user.py").write_text(USER_TEST)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_user.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )


def test_the_plugin_gives_a_users_tests_its_fixtures_through_the_entry_point(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout


def test_the_plugin_can_be_switched_off_by_its_entry_point_name(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, "-p", "no:airlock_journal")
    assert proc.returncode != 0
    assert "fixture 'airlock_journal' not found" in proc.stdout


def test_the_plugin_loads_without_hypothesis() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["hypothesis"] = None  # as if it were not installed
        import journal.testing
        assert "hypothesis" not in {m for m in sys.modules if sys.modules[m] is not None}
        try:
            journal.testing.call_sequences()
        except ImportError:
            print("strategies need hypothesis")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "strategies need hypothesis"


# -- lost_response -------------------------------------------------------------------------------


def test_lost_response_runs_the_tool_then_raises_timeout(airlock_journal: SQLiteJournal,
                                                         airlock_effects: EffectLog) -> None:
    def quote(symbol: str) -> float:
        """Look up a price."""
        airlock_effects.record("quote", symbol=symbol)
        return 1.5

    lossy = lost_response(quote, times=1)
    assert (lossy.__name__, lossy.__doc__) == ("quote", "Look up a price.")
    policy = SecurityPolicy(effect_guard=EffectGuard(store=airlock_journal))
    guarded = Airlock(policy)(reversibility("reversible")(lossy))
    with AirlockContext(metadata={"tool_call_id": "call_1"}):
        with pytest.raises(TimeoutError, match="quote"):
            guarded("ACME")
        assert airlock_journal.get("call_1").status == "unknown"
        assert guarded("ACME") == 1.5  # reversible: it runs again, and this response arrives
    assert airlock_effects.count("quote") == 2
    assert airlock_journal.get("call_1").status == "committed"


def test_lost_response_of_an_async_tool() -> None:
    ran: list[int] = []

    async def pay(cents: int) -> int:
        ran.append(cents)
        return cents

    guarded = Airlock(SecurityPolicy(effect_guard=EffectGuard(store=InMemoryEffectStore())))(lost_response(pay))

    async def main() -> Any:
        with AirlockContext(metadata={"tool_call_id": "call_1"}):
            with pytest.raises(TimeoutError):
                await guarded(5)
            return await guarded(5)

    assert asyncio.run(main())["block_reason"] == "effect_status_unknown"
    assert ran == [5]


def test_lost_response_refuses_a_negative_count() -> None:
    with pytest.raises(ValueError):
        lost_response(len, times=-1)


# -- KillPoints and EffectLog --------------------------------------------------------------------


def test_kill_points_refuse_an_unknown_point_and_a_store_without_transactions(
    airlock_journal: SQLiteJournal,
) -> None:
    with pytest.raises(ValueError, match="after_pending"):
        KillPoints(airlock_journal, at="before_breakfast")
    with pytest.raises(ValueError, match="during_committed"):
        KillPoints(InMemoryEffectStore(), at="during_committed")


def test_kill_points_without_a_point_only_delegate(airlock_journal: SQLiteJournal) -> None:
    points = KillPoints(airlock_journal, at=None)
    tool = Airlock(SecurityPolicy(effect_guard=EffectGuard(store=points)))(points.tool(lambda: 7))
    with AirlockContext(metadata={"tool_call_id": "call_1"}):
        assert tool() == 7
        assert tool() == 7
    assert [e.kind for e in points.call_events("call_1")] == ["pending", "committed", "replayed"]
    assert points.verify().ok


@pytest.mark.parametrize("at", ["during_pending", "after_pending", "in_tool", "after_effect", "during_committed"])
def test_a_kill_point_for_another_call_id_lets_this_call_through(airlock_journal: SQLiteJournal, at: str) -> None:
    points = KillPoints(airlock_journal, at=at, call_id="call_other")
    tool = Airlock(SecurityPolicy(effect_guard=EffectGuard(store=points)))(points.tool(lambda: 7))
    with AirlockContext(metadata={"tool_call_id": "call_1"}):
        assert tool() == 7
        assert tool() == 7
    assert [e.kind for e in airlock_journal.call_events("call_1")] == ["pending", "committed", "replayed"]


def test_the_effect_log_skips_a_line_torn_by_a_kill(airlock_effects: EffectLog) -> None:
    airlock_effects.record("call_1")
    airlock_effects.record("call_1")
    airlock_effects.record("call_2")
    with open(airlock_effects.path, "ab") as f:
        f.write(b'{"call_id": "call_3", "p')  # the process died inside its write
    assert airlock_effects.counts() == {"call_1": 2, "call_2": 1}
    assert airlock_effects.doubled() == {"call_1": 2}
    assert airlock_effects.count() == 3
