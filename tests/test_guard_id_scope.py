"""``EffectGuard(id_scope="agent")``: a call is keyed on its agent and its tool call id together, on
every store, so one agent's id never returns another agent's stored value."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal
from guard.effect_guard import EffectGuard, reversibility
from guard.scope import agent_scoped_id, split_scoped_id
from journal import SQLiteJournal
from tests.cli_support import invoke
from tests.stores import store_events


class Ledger:
    """A payment backend: every charge that reached it, with the agent whose call made it."""

    def __init__(self) -> None:
        self.charges: list[tuple[str | None, str, int]] = []
        self.lock = threading.Lock()

    def charge(self, to: str, cents: int) -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        with self.lock:
            self.charges.append((context.agent_id, to, cents))
            return {"charge": len(self.charges), "agent": context.agent_id, "to": to, "cents": cents}


def charge_tool(store: Any, ledger: Ledger, **options: Any) -> Any:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store, **options)))
    def charge(to: str, cents: int) -> dict[str, Any]:
        return ledger.charge(to, cents)

    return charge


def as_agent(agent_id: str | None, tool_call_id: str, fn: Any, *args: Any) -> Any:
    with AirlockContext(agent_id=agent_id, metadata={"tool_call_id": tool_call_id}):
        return fn(*args)


def test_two_agents_with_one_id_are_two_calls(store: Any) -> None:
    ledger = Ledger()
    charge = charge_tool(store, ledger, id_scope="agent")
    alice = as_agent("alice", "call_1", charge, "shop", 500)
    bob = as_agent("bob", "call_1", charge, "shop", 500)
    assert alice["agent"] == "alice" and bob["agent"] == "bob"
    assert ledger.charges == [("alice", "shop", 500), ("bob", "shop", 500)]
    # Each agent's retry of its own id is replayed with its own value, and charges nothing.
    assert as_agent("bob", "call_1", charge, "shop", 500) == bob
    assert as_agent("alice", "call_1", charge, "shop", 500) == alice
    assert len(ledger.charges) == 2


def test_one_agents_id_with_other_arguments_is_not_another_agents_reuse(store: Any) -> None:
    ledger = Ledger()
    charge = charge_tool(store, ledger, id_scope="agent")
    as_agent("alice", "call_1", charge, "shop", 500)
    bob = as_agent("bob", "call_1", charge, "cafe", 300)
    assert not is_refusal(bob) and bob["to"] == "cafe"
    assert ledger.charges == [("alice", "shop", 500), ("bob", "cafe", 300)]


def test_the_global_scope_keys_on_the_id_alone(store: Any) -> None:
    # The default, as the seed: an id is one call whoever sends it.
    ledger = Ledger()
    charge = charge_tool(store, ledger)
    alice = as_agent("alice", "call_1", charge, "shop", 500)
    assert as_agent("bob", "call_1", charge, "shop", 500) == alice
    assert len(ledger.charges) == 1


def test_the_store_keeps_the_pair_under_one_readable_id(store: Any) -> None:
    ledger = Ledger()
    charge = charge_tool(store, ledger, id_scope="agent")
    as_agent("alice", "call_1", charge, "shop", 500)
    record = store.get("agent:alice/call_1")
    assert record is not None and record.status == "committed" and record.agent_id == "alice"
    assert store.get("call_1") is None
    assert [e.kind for e in store_events(store, "agent:alice/call_1")] == ["pending", "committed"]


def test_an_agents_refusals_are_journaled_under_its_scoped_id(store: Any) -> None:
    ledger = Ledger()
    charge = charge_tool(store, ledger, id_scope="agent")
    as_agent("alice", "call_1", charge, "shop", 500)
    refused = as_agent("alice", "call_1", charge, "shop", 900)  # the same id for another charge
    assert refused["block_reason"] == "policy_violation"
    assert refused["metadata"]["tool_call_id"] == "call_1"  # the model's own id, as it sent it
    events = store_events(store, "agent:alice/call_1")
    assert [e.kind for e in events] == ["pending", "committed", "refused"]
    assert len(ledger.charges) == 1


def test_a_global_guard_refuses_an_id_of_the_agent_form(store: Any) -> None:
    ledger = Ledger()
    scoped = charge_tool(store, ledger, id_scope="agent")
    alice = as_agent("alice", "call_1", scoped, "shop", 500)
    # A host on the same journal without scoping, sent an id that names alice's call.
    unscoped = charge_tool(store, ledger)
    refused = as_agent("mallory", "agent:alice/call_1", unscoped, "shop", 500)
    assert is_refusal(refused) and refused["block_reason"] == "policy_violation"
    assert refused["metadata"]["violation_type"] == "tool_call_id_reserved"
    assert "charge" not in refused and alice != refused
    assert len(ledger.charges) == 1
    # Journaled without the id it named: alice's call shows only its own events.
    assert [e.kind for e in store_events(store, "agent:alice/call_1")] == ["pending", "committed"]
    assert [e.reason["code"] for e in store_events(store) if e.kind == "refused"] == ["policy_violation"]


def test_agent_names_with_a_slash_do_not_collide(store: Any) -> None:
    ledger = Ledger()
    charge = charge_tool(store, ledger, id_scope="agent")
    first = as_agent("a/b", "c", charge, "shop", 500)
    second = as_agent("a", "b/c", charge, "shop", 500)
    third = as_agent("a%2Fb", "c", charge, "shop", 500)
    assert [first["agent"], second["agent"], third["agent"]] == ["a/b", "a", "a%2Fb"]
    assert len(ledger.charges) == 3


def test_a_call_without_an_agent_is_in_the_scope_of_no_name(store: Any) -> None:
    ledger = Ledger()
    charge = charge_tool(store, ledger, id_scope="agent")
    nobody = as_agent(None, "call_1", charge, "shop", 500)
    named = as_agent("alice", "call_1", charge, "shop", 500)
    assert nobody["agent"] is None and named["agent"] == "alice"
    assert as_agent(None, "call_1", charge, "shop", 500) == nobody
    assert store.get("agent:/call_1") is not None
    assert len(ledger.charges) == 2


def test_an_agents_call_in_doubt_refuses_only_that_agents_retry(store: Any) -> None:
    attempts: list[str | None] = []

    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store, id_scope="agent")))
    def transfer(to: str) -> str:
        context = get_current_context()
        assert context is not None
        attempts.append(context.agent_id)
        if context.agent_id == "alice":
            raise TimeoutError("the bank did not answer")
        return "sent"

    with pytest.raises(TimeoutError):
        as_agent("alice", "call_1", transfer, "bob")
    assert as_agent("alice", "call_1", transfer, "bob")["block_reason"] == "effect_status_unknown"
    assert as_agent("carol", "call_1", transfer, "bob") == "sent"
    assert attempts == ["alice", "carol"]


def test_a_reversible_tool_is_scoped_too(store: Any) -> None:
    reads: list[str | None] = []

    @reversibility("reversible")
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store, id_scope="agent")))
    def balance(account: str) -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        reads.append(context.agent_id)
        return {"account": account, "for": context.agent_id}

    assert as_agent("alice", "call_1", balance, "acc")["for"] == "alice"
    assert as_agent("bob", "call_1", balance, "acc")["for"] == "bob"
    assert reads == ["alice", "bob"]


@given(agent=st.one_of(st.none(), st.text()), tool_call_id=st.text(min_size=1))
def test_a_scoped_id_names_exactly_its_agent_and_id(agent: str | None, tool_call_id: str) -> None:
    scoped = agent_scoped_id(agent, tool_call_id)
    if not any(0xD800 <= ord(c) <= 0xDFFF for c in (agent or "") + tool_call_id):  # kept as escapes otherwise
        assert split_scoped_id(scoped) == (agent or "", tool_call_id)
    assert scoped.startswith("agent:")


def test_show_lists_and_shows_a_scoped_call(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path)
    ledger = Ledger()
    charge = charge_tool(journal, ledger, id_scope="agent")
    as_agent("alice", "call_1", charge, "shop", 500)
    as_agent("bob", "call_1", charge, "shop", 500)
    journal.close()
    listed = invoke("journal", "show", "--db", str(path), "--json")
    assert listed.exit_code == 0, listed.output
    calls = {c["call_id"]: c["agent_id"] for c in map(json.loads, listed.stdout.splitlines())}
    assert calls == {"agent:alice/call_1": "alice", "agent:bob/call_1": "bob"}
    one = invoke("journal", "show", "agent:bob/call_1", "--db", str(path))
    assert one.exit_code == 0, one.output
    assert "agent:bob/call_1" in one.stdout and "bob" in one.stdout
    exported = invoke("journal", "export", "--db", str(path), "--call", "agent:alice/call_1")
    lines = [orjson.loads(line) for line in exported.stdout.splitlines()]
    assert [(e["kind"], e["call_id"], e["agent_id"]) for e in lines] == [
        ("pending", "agent:alice/call_1", "alice"), ("committed", "agent:alice/call_1", "alice"),
    ]
