"""guard.adapters.langgraph: a ToolNode's tool calls run at most once per ToolCall id, across
checkpoint resumes, interrupts and forks of a real LangGraph graph driven by LangChain's fake chat model."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import InjectedState, ToolNode, tools_condition
from langgraph.types import Command, interrupt

from guard import Airlock, SecurityPolicy
from guard.adapters.langgraph import airlock_atool_call, airlock_tool_call
from guard.effect_guard import EffectGuard, InMemoryEffectStore, reversibility
from journal import SQLiteJournal
from tests.docs_examples import docs_examples


class Warehouse:
    """The backend: shipments are the effects, counted outside the guard."""

    def __init__(self) -> None:
        self.shipments: list[tuple[str, int]] = []

    def ship(self, sku: str, quantity: int) -> dict[str, Any]:
        self.shipments.append((sku, quantity))
        return {"shipment": len(self.shipments), "sku": sku, "quantity": quantity, "route": ("dock", "truck")}


def calls(*tool_calls: tuple[str, str, dict[str, Any]]) -> AIMessage:
    """The model's turn asking for tool calls (id, name, args)."""
    return AIMessage(content="", tool_calls=[{"id": i, "name": n, "args": a} for i, n, a in tool_calls])


def graph(tools: list[Any], replies: list[AIMessage], checkpointer: Any = None) -> Any:
    """agent -> tools -> agent, with the adapter wired into the ToolNode in its one line."""
    model = GenericFakeChatModel(messages=iter(replies))

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode(tools, wrap_tool_call=airlock_tool_call, awrap_tool_call=airlock_atool_call))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer or InMemorySaver())


def tool_messages(state: Any) -> list[ToolMessage]:
    messages = state["messages"] if isinstance(state, dict) else state.values["messages"]
    return [m for m in messages if isinstance(m, ToolMessage)]


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[SQLiteJournal]:
    j = SQLiteJournal(tmp_path / "journal.db")
    try:
        yield j
    finally:
        j.close()


def test_a_fork_from_the_checkpoint_before_the_tool_step_replays_the_same_message(journal: SQLiteJournal) -> None:
    warehouse = Warehouse()

    @tool
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def ship(sku: str, quantity: int) -> dict[str, Any]:
        """Ship an order."""
        return warehouse.ship(sku, quantity)

    app = graph([ship], [calls(("call_1", "ship", {"sku": "A-1", "quantity": 2})), AIMessage("Shipped."),
                         AIMessage("Shipped, again.")])
    config = {"configurable": {"thread_id": "t1"}}
    first = app.invoke({"messages": [HumanMessage("Ship two A-1.")]}, config)
    [shipped] = tool_messages(first)
    assert shipped.status == "success"
    assert json.loads(shipped.content) == {"quantity": 2, "route": ["dock", "truck"], "shipment": 1, "sku": "A-1"}

    # The graph step is run again from the checkpoint saved before it, with the same AIMessage.
    before_tools = next(s for s in app.get_state_history(config) if s.next == ("tools",))
    forked = app.invoke(None, before_tools.config)
    [again] = tool_messages(forked)
    assert again.content == shipped.content and again.status == "success" and again.tool_call_id == "call_1"
    assert warehouse.shipments == [("A-1", 2)]
    assert [e.kind for e in journal.events(call_id="call_1")] == ["pending", "committed", "replayed"]


def test_a_resume_after_an_interrupt_reruns_the_tool_step_but_not_the_tool_that_already_ran() -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))
    refunds: list[str] = []

    @tool
    @Airlock(policy=policy)
    def ship(sku: str, quantity: int) -> dict[str, Any]:
        """Ship an order."""
        return warehouse.ship(sku, quantity)

    @tool
    @Airlock(policy=policy)
    def refund(order: str) -> str:
        """Refund an order, once a person approves."""
        if interrupt({"approve_refund": order}) != "yes":
            return "not approved"
        refunds.append(order)
        return f"refunded {order}"

    # Both calls are in one AIMessage, so one ToolNode step runs both; the interrupt in the second
    # ends that step unsaved, and the resume runs the whole step again.
    app = graph([ship, refund], [calls(("call_s", "ship", {"sku": "B-2", "quantity": 1}),
                                       ("call_r", "refund", {"order": "o-7"})), AIMessage("Done.")])
    config = {"configurable": {"thread_id": "t2"}}
    paused = app.invoke({"messages": [HumanMessage("Ship B-2 and refund o-7.")]}, config)
    assert paused["__interrupt__"][0].value == {"approve_refund": "o-7"}
    assert warehouse.shipments == [("B-2", 1)]

    done = app.invoke(Command(resume="yes"), config)
    by_id = {m.tool_call_id: m for m in tool_messages(done)}
    assert json.loads(by_id["call_s"].content)["shipment"] == 1
    assert by_id["call_r"].content == '"refunded o-7"' and by_id["call_r"].status == "success"
    assert warehouse.shipments == [("B-2", 1)]
    assert refunds == ["o-7"]
    assert [e.kind for e in store.events("call_s")] == ["pending", "committed", "replayed"]
    # The interrupted attempt did nothing and was released, so the resume ran it as attempt 2.
    assert [(e.kind, e.attempt) for e in store.events("call_r")] == [
        ("pending", 1), ("released", 1), ("pending", 2), ("committed", 2)]


def test_a_refusal_is_an_error_tool_message_that_the_model_reads() -> None:
    store = InMemoryEffectStore()
    policy = SecurityPolicy(denied_tools=["wipe"], effect_guard=EffectGuard(store=store))
    wiped: list[str] = []

    @tool
    @Airlock(policy=policy)
    def wipe(disk: str) -> str:
        """Wipe a disk."""
        wiped.append(disk)
        return "wiped"

    model_replies = [calls(("call_w", "wipe", {"disk": "sda"})), AIMessage("I may not wipe disks.")]
    app = graph([wipe], model_replies)
    state = app.invoke({"messages": [HumanMessage("Wipe sda.")]}, {"configurable": {"thread_id": "t3"}})
    [refused] = tool_messages(state)
    assert refused.status == "error" and refused.tool_call_id == "call_w" and refused.name == "wipe"
    refusal = json.loads(refused.content)
    assert refusal["block_reason"] == "policy_violation"
    assert refusal["error"] and refusal["fix_hints"]
    assert wiped == []
    assert state["messages"][-1].content == "I may not wipe disks."
    assert [e.kind for e in store.events("call_w")] == ["refused"]


def test_a_tool_call_without_an_id_is_refused_for_an_irreversible_tool() -> None:
    warehouse = Warehouse()

    @tool
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def ship(sku: str, quantity: int) -> dict[str, Any]:
        """Ship an order."""
        return warehouse.ship(sku, quantity)

    app = graph([ship], [calls(("", "ship", {"sku": "C", "quantity": 1})), AIMessage("No id, no shipment.")])
    state = app.invoke({"messages": [HumanMessage("Ship C.")]}, {"configurable": {"thread_id": "t-no-id"}})
    [message] = tool_messages(state)
    assert message.status == "error"
    assert json.loads(message.content)["block_reason"] == "tool_call_id_required"
    assert warehouse.shipments == []


def test_async_tools_run_once_across_a_fork_with_ainvoke() -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))

    @tool
    @Airlock(policy=policy)
    async def aship(sku: str, quantity: int) -> dict[str, Any]:
        """Ship an order."""
        await asyncio.sleep(0)
        return warehouse.ship(sku, quantity)

    @tool
    @reversibility("reversible")
    @Airlock(policy=policy)
    def stock(sku: str) -> int:
        """How many are left."""
        return 10 - sum(q for s, q in warehouse.shipments if s == sku)

    app = graph([aship, stock], [calls(("call_a", "aship", {"sku": "D", "quantity": 3}),
                                       ("call_q", "stock", {"sku": "D"})),
                                 AIMessage("ok"), AIMessage("ok again")])
    config = {"configurable": {"thread_id": "t4"}}

    async def scenario() -> tuple[Any, Any]:
        first = await app.ainvoke({"messages": [HumanMessage("Ship 3 D.")]}, config)
        async for snapshot in app.aget_state_history(config):
            if snapshot.next == ("tools",):
                return first, await app.ainvoke(None, snapshot.config)
        raise AssertionError("no checkpoint before the tools step")

    first, forked = asyncio.run(scenario())
    assert [m.content for m in tool_messages(forked)] == [m.content for m in tool_messages(first)]
    assert json.loads(tool_messages(first)[0].content)["shipment"] == 1
    assert warehouse.shipments == [("D", 3)]
    assert [e.kind for e in store.events("call_a")] == ["pending", "committed", "replayed"]


@pytest.mark.parametrize("on_block", ["return", "raise"])
def test_a_tool_with_injected_state_is_run_by_langgraph_under_the_call_id(on_block: str) -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))

    @tool
    @Airlock(policy=policy)
    def ship_for(sku: str, state: Annotated[dict[str, Any], InjectedState]) -> dict[str, Any]:
        """Ship an order for the conversation's customer."""
        return warehouse.ship(sku, len(state["messages"]))

    blocking = SecurityPolicy(denied_tools=["burn"], effect_guard=EffectGuard(store=store))

    @tool
    @Airlock(policy=blocking, on_block=on_block)  # type: ignore[arg-type]
    def burn(sku: str, state: Annotated[dict[str, Any], InjectedState]) -> str:
        """Destroy stock."""
        return "burnt"

    app = graph([ship_for, burn], [calls(("call_i", "ship_for", {"sku": "E"}), ("call_b", "burn", {"sku": "E"})),
                                   AIMessage("ok"), AIMessage("ok again")])
    config = {"configurable": {"thread_id": f"t5-{on_block}"}}
    first = app.invoke({"messages": [HumanMessage("Ship E.")]}, config)
    before_tools = next(s for s in app.get_state_history(config) if s.next == ("tools",))
    forked = app.invoke(None, before_tools.config)
    for state in (first, forked):
        by_id = {m.tool_call_id: m for m in tool_messages(state)}
        assert by_id["call_i"].status == "success"
        assert by_id["call_b"].status == "error"
        assert json.loads(by_id["call_b"].content)["block_reason"] == "policy_violation"
    assert warehouse.shipments == [("E", 2)]
    assert [e.kind for e in store.events("call_i")] == ["pending", "committed", "replayed"]


def test_a_content_and_artifact_tool_replays_both_parts() -> None:
    store = InMemoryEffectStore()
    searches: list[str] = []

    @tool(response_format="content_and_artifact")
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def search(query: str) -> tuple[str, dict[str, Any]]:
        """Search the catalogue."""
        searches.append(query)
        return f"2 hits for {query}", {"hits": ["a", "b"], "query": query}

    app = graph([search], [calls(("call_q", "search", {"query": "lamp"})), AIMessage("ok"), AIMessage("ok")])
    config = {"configurable": {"thread_id": "t7"}}
    [first] = tool_messages(app.invoke({"messages": [HumanMessage("Find a lamp.")]}, config))
    before_tools = next(s for s in app.get_state_history(config) if s.next == ("tools",))
    [again] = tool_messages(app.invoke(None, before_tools.config))
    for message in (first, again):
        assert message.content == "2 hits for lamp"
        assert message.artifact == {"hits": ["a", "b"], "query": "lamp"}
    assert searches == ["lamp"]


def test_an_exception_from_the_tool_is_an_error_message_and_the_call_may_run_again() -> None:
    store = InMemoryEffectStore()
    attempts: list[int] = []

    @tool
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def charge(cents: int) -> str:
        """Charge a card."""
        attempts.append(cents)
        if len(attempts) == 1:
            raise ValueError("card declined")
        return "charged"

    app = graph([charge], [calls(("call_c", "charge", {"cents": 5})), AIMessage("Declined."), AIMessage("Paid.")])
    config = {"configurable": {"thread_id": "t6"}}
    [failed] = tool_messages(app.invoke({"messages": [HumanMessage("Pay 5.")]}, config))
    before_tools = next(s for s in app.get_state_history(config) if s.next == ("tools",))
    [charged] = tool_messages(app.invoke(None, before_tools.config))
    assert failed.status == "error" and "card declined" in json.loads(failed.content)["error"]
    assert charged.status == "success" and charged.content == '"charged"'
    assert attempts == [5, 5]
    assert [e.kind for e in store.events("call_c")] == ["pending", "released", "pending", "committed"]


def test_importing_the_adapters_imports_no_framework() -> None:
    code = ("import sys, guard.adapters, guard.adapters.langgraph, guard.adapters.openai_agents, "
            "guard.adapters.mcp; loaded = {m.split('.')[0] for m in sys.modules}; "
            "print(sorted(loaded & {'langgraph', 'langchain_core', 'agents', 'mcp', 'openai'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_docs_example_runs_and_charges_once(tmp_path: Path) -> None:
    [code] = docs_examples("LangGraph")
    (tmp_path / "example.py").write_text(code)
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ['{"cents":500,"charge_id":"ch_1"}'] * 2 + ["[('acct_1', 500)]"]
