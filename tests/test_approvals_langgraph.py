"""LangGraph and durable approvals: with ``interrupt_on_approval=True`` a call that waits for an
operator interrupts the run (a real checkpointer keeps it); resumed with ``Command(resume=...)``
after the decision, the node runs again and the tool runs once."""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command

from guard import Airlock, SecurityPolicy
from guard.adapters.langgraph import airlock_atool_call, airlock_tool_call
from guard.approvals import ApprovalQueue, decide_request
from guard.effect_guard import EffectGuard, InMemoryEffectStore


def build(store: Any, charges: list[int]) -> Any:
    policy = SecurityPolicy(escalate_tools={"charge": "moves money"}, approver=ApprovalQueue(ttl=3600),
                            effect_guard=EffectGuard(store=store))

    @tool
    @Airlock(policy=policy)
    def charge(account: str, cents: int) -> dict[str, Any]:
        """Charge an account."""
        charges.append(cents)
        return {"charged": cents}

    model = GenericFakeChatModel(messages=iter([
        AIMessage(content="", tool_calls=[{"id": "call_pay_1", "name": "charge",
                                           "args": {"account": "acct_1", "cents": 500}}]),
        AIMessage(content="done"),
    ]))

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([charge], wrap_tool_call=airlock_tool_call(interrupt_on_approval=True),
                                       awrap_tool_call=airlock_atool_call(interrupt_on_approval=True)))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=InMemorySaver())


def test_a_run_waits_for_the_operator_and_runs_the_tool_once_on_resume() -> None:
    store, charges = InMemoryEffectStore(), []
    app = build(store, charges)
    config = {"configurable": {"thread_id": "t1"}}
    first = app.invoke({"messages": [HumanMessage(content="pay")]}, config)
    waiting = first["__interrupt__"][0].value
    assert (waiting["airlock"], waiting["tool"], waiting["tool_call_id"]) == (
        "approval_pending", "charge", "call_pay_1")
    assert waiting["args"] == {"account": "acct_1", "cents": 500} and waiting["request_id"]
    assert charges == []
    # Resumed before anyone decided: the run interrupts again, and nothing is charged.
    again = app.invoke(Command(resume="checked"), config)
    assert charges == [] and [m.status for m in again["messages"] if isinstance(m, ToolMessage)] == ["error"]

    store2, charges2 = InMemoryEffectStore(), []
    app2 = build(store2, charges2)
    config2 = {"configurable": {"thread_id": "t2"}}
    first2 = app2.invoke({"messages": [HumanMessage(content="pay")]}, config2)
    assert first2["__interrupt__"]
    decide_request(store2, "call_pay_1", approve=True, operator="alice", reason="agreed")
    done = app2.invoke(Command(resume="approved"), config2)
    messages = [m for m in done["messages"] if isinstance(m, ToolMessage)]
    assert [(m.status, m.content) for m in messages] == [("success", '{"charged":500}')]
    assert charges2 == [500]
    assert [r.status for r in store2.approval_requests()] == ["consumed"]
    assert done["messages"][-1].content == "done"


def test_the_async_graph_interrupts_and_resumes_the_same_way() -> None:
    store, charges = InMemoryEffectStore(), []
    app = build(store, charges)
    config = {"configurable": {"thread_id": "a1"}}

    async def run() -> Any:
        first = await app.ainvoke({"messages": [HumanMessage(content="pay")]}, config)
        assert first["__interrupt__"][0].value["request_id"]
        decide_request(store, "call_pay_1", approve=True, operator="alice", reason="agreed")
        return await app.ainvoke(Command(resume="approved"), config)

    done = asyncio.run(run())
    assert charges == [500]
    assert [m.status for m in done["messages"] if isinstance(m, ToolMessage)] == ["success"]
