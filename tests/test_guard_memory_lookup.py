"""The in-memory store finds the calls that ``duplicate_window`` looks up even when they were made
before any guard asked it to look (its lookup is made from the log at the first use)."""

from __future__ import annotations

from typing import Any

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard, InMemoryEffectStore


def _tool(store: InMemoryEffectStore, runs: list[int], **options: Any) -> Any:
    def charge(account: str, cents: int) -> dict[str, Any]:
        runs.append(cents)
        return {"charge": len(runs), "account": account}

    return Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store, **options)))(charge)


def _call(tool: Any, call_id: str, agent: str, cents: int) -> Any:
    with AirlockContext(agent_id=agent, metadata={"tool_call_id": call_id}):
        return tool("acct_1", cents)


def test_calls_made_before_the_first_lookup_are_found() -> None:
    store, runs = InMemoryEffectStore(), []
    plain = _tool(store, runs)
    first = _call(plain, "call_1", "agent-a", 500)
    _call(plain, "call_2", "agent-b", 500)  # another agent's: never the answer to agent-a
    windowed = _tool(store, runs, duplicate_window=60.0)

    again = _call(windowed, "call_3", "agent-a", 500)  # a new id, the same charge: a re-planned copy
    assert again == first and runs == [500, 500]
    assert [e.kind for e in store.events("call_3")] == ["replayed"]
    assert store.events("call_3")[0].reason == {"code": "duplicate_of", "message": "call_1"}

    other = _call(windowed, "call_4", "agent-c", 500)  # no call of agent-c: it runs
    assert not is_refusal(other) and runs == [500, 500, 500]
    # Calls made after the lookup exists are filed in it as they begin.
    assert _call(windowed, "call_5", "agent-c", 500) == other and runs == [500, 500, 500]
