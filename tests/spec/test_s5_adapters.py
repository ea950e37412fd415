"""Section 5 of the behaviour contract, the host adapters: OpenAI, Anthropic and MCP, fed plain dicts
and SDK objects.

Written against the behaviour contract alone: public names only, and only what the contract states."""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from guard import (
    AirlockContext,
    get_current_context,
)
from guard.effect_guard import (
    InMemoryEffectStore,
    reversibility,
)
from tests.spec.support import (
    PYTHON,
    count,
    db_events,
    guard_for,
)

# --------------------------------------------------------------------------------------------------------------
# 5. host adapters


@pytest.fixture
def adapter_tools(journal: Any) -> tuple[dict[str, Any], list[Any], list[Any]]:
    runs: list[Any] = []
    seen: list[Any] = []
    airlock = guard_for(journal, denied_tools=["wipe"])

    @airlock
    def pay(account: str, cents: int = 1) -> dict[str, Any]:
        c = get_current_context()
        seen.append((c.tool_call_id, c.agent_id))
        runs.append((account, cents))
        return {"paid": cents}

    @airlock
    def wipe(disk: str) -> str:
        runs.append(disk)
        return "wiped"

    @airlock
    def boom(x: int) -> str:
        runs.append(x)
        raise ValueError("boom")

    return {"pay": pay, "wipe": wipe, "boom": boom}, runs, seen


def test_openai_chat_completions_dict(adapter_tools: Any, db: Path) -> None:
    from guard.adapters import openai as oa

    tools, runs, seen = adapter_tools
    call = {"id": "call_A", "type": "function",
            "function": {"name": "pay", "arguments": '{"account": "x", "cents": 3}'}}
    out = oa.dispatch(call, tools, agent_id="bot")
    assert set(out) == {"role", "tool_call_id", "content"}
    assert out["role"] == "tool" and out["tool_call_id"] == "call_A"
    assert json.loads(out["content"]) == {"paid": 3}
    assert seen == [("call_A", "bot")]
    again = oa.dispatch(call, list(tools.values()), agent_id="bot")
    assert json.loads(again["content"]) == {"paid": 3}
    assert runs == [("x", 3)]
    events = [e for e in db_events(db) if e["call_id"] == "call_A"]
    assert [e["kind"] for e in events] == ["pending", "committed", "replayed"]
    assert events[0]["agent_id"] == "bot"


def test_openai_responses_item_dict(adapter_tools: Any) -> None:
    from guard.adapters import openai as oa

    tools, _runs, seen = adapter_tools
    item = {"type": "function_call", "call_id": "fc_1", "name": "pay", "arguments": '{"account": "y"}'}
    out = oa.dispatch(item, tools)
    assert set(out) == {"type", "call_id", "output"}
    assert out["type"] == "function_call_output" and out["call_id"] == "fc_1"
    assert json.loads(out["output"]) == {"paid": 1}
    assert seen[0][0] == "fc_1"


def test_openai_sdk_objects() -> None:
    from openai.types.chat import ChatCompletionMessageToolCall
    from openai.types.chat.chat_completion_message_tool_call import Function

    from guard.adapters import openai as oa

    runs: list[Any] = []

    @guard_for(InMemoryEffectStore())
    def pay(account: str) -> str:
        runs.append(get_current_context().tool_call_id)
        return "ok"

    call = ChatCompletionMessageToolCall(id="call_S", type="function",
                                         function=Function(name="pay", arguments='{"account": "z"}'))
    out = oa.dispatch(call, [pay])
    assert out == {"role": "tool", "tool_call_id": "call_S", "content": json.dumps("ok").replace(" ", "")} or (
        out["role"] == "tool" and json.loads(out["content"]) == "ok")
    assert runs == ["call_S"]


def test_openai_refusal_text(adapter_tools: Any) -> None:
    from guard.adapters import openai as oa

    tools, runs, _ = adapter_tools
    out = oa.dispatch({"id": "call_W", "function": {"name": "wipe", "arguments": '{"disk": "c"}'}}, tools)
    body = json.loads(out["content"])
    assert body["block_reason"] == "policy_violation"
    assert body["error"] and isinstance(body["fix_hints"], list)
    assert runs == []


@pytest.mark.parametrize("arguments", ["{not json", '{"nope": 1}', "{}", '{"account": "x", "extra": 2}'])
def test_openai_bad_arguments_error_result_and_refused_event(adapter_tools: Any, db: Path, arguments: str) -> None:
    from guard.adapters import openai as oa

    tools, runs, _ = adapter_tools
    before = count(db, "refused")
    out = oa.dispatch({"id": "call_B", "type": "function", "function": {"name": "pay", "arguments": arguments}}, tools)
    assert out["role"] == "tool" and out["tool_call_id"] == "call_B"
    assert isinstance(out["content"], str) and out["content"]
    assert runs == []
    assert count(db, "refused") == before + 1
    assert db_events(db)[-1]["call_id"] == "call_B"


def test_anthropic_dict_and_errors(adapter_tools: Any, db: Path) -> None:
    from guard.adapters import anthropic as an

    tools, runs, seen = adapter_tools
    ok = an.dispatch({"type": "tool_use", "id": "toolu_1", "name": "pay", "input": {"account": "q", "cents": 9}},
                     tools, agent_id="assistant-7")
    assert set(ok) == {"type", "tool_use_id", "content", "is_error"}
    assert ok["type"] == "tool_result" and ok["tool_use_id"] == "toolu_1" and ok["is_error"] is False
    assert json.loads(ok["content"]) == {"paid": 9}
    assert seen == [("toolu_1", "assistant-7")]

    refused = an.dispatch({"type": "tool_use", "id": "toolu_2", "name": "wipe", "input": {"disk": "c"}}, tools)
    assert refused["is_error"] is True
    body = json.loads(refused["content"])
    assert body["block_reason"] == "policy_violation" and body["error"] and isinstance(body["fix_hints"], list)

    failed = an.dispatch({"type": "tool_use", "id": "toolu_3", "name": "boom", "input": {"x": 1}}, tools)
    assert failed["type"] == "tool_result" and failed["tool_use_id"] == "toolu_3"
    assert failed["is_error"] is True

    before = count(db, "refused")
    bad = an.dispatch({"type": "tool_use", "id": "toolu_4", "name": "pay", "input": {"wrong": 1}}, tools)
    assert bad["is_error"] is True
    assert count(db, "refused") == before + 1
    assert ("wrong", 1) not in runs and len([r for r in runs if isinstance(r, tuple)]) == 1


def test_anthropic_sdk_block() -> None:
    from anthropic.types import ToolUseBlock

    from guard.adapters import anthropic as an

    runs: list[Any] = []

    @guard_for(InMemoryEffectStore())
    def pay(account: str) -> str:
        runs.append(get_current_context().tool_call_id)
        return "ok"

    block = ToolUseBlock(id="toolu_S", name="pay", input={"account": "z"}, type="tool_use")
    out = an.dispatch(block, {"pay": pay})
    assert out["tool_use_id"] == "toolu_S" and out["is_error"] is False
    assert json.loads(out["content"]) == "ok"
    assert runs == ["toolu_S"]


def test_adispatch_async_tools(journal: Any) -> None:
    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    seen: list[Any] = []

    @guard_for(journal)
    async def lookup(q: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        seen.append(get_current_context().tool_call_id)
        return {"q": q}

    async def go() -> None:
        out = await oa.adispatch({"id": "call_as", "function": {"name": "lookup", "arguments": '{"q": "a"}'}},
                                 [lookup])
        assert out["tool_call_id"] == "call_as" and json.loads(out["content"]) == {"q": "a"}
        out2 = await an.adispatch({"type": "tool_use", "id": "toolu_as", "name": "lookup", "input": {"q": "b"}},
                                  {"lookup": lookup})
        assert out2["tool_use_id"] == "toolu_as" and out2["is_error"] is False
        assert json.loads(out2["content"]) == {"q": "b"}

    asyncio.run(go())
    assert seen == ["call_as", "toolu_as"]


def test_mcp_adapter_importable() -> None:
    import guard.adapters.mcp  # noqa: F401


def test_adapters_import_no_sdk_until_used() -> None:
    code = (
        "import sys, guard, guard.adapters\n"
        "print([m for m in ('openai', 'anthropic', 'mcp') if m in sys.modules])\n"
    )
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_openai_responses_sdk_object_and_ambiguous_errors(journal: Any) -> None:
    from openai.types.responses import ResponseFunctionToolCall

    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    runs: list[Any] = []

    @guard_for(journal)
    def send(to: str) -> str:
        runs.append(to)
        raise TimeoutError("gateway timeout")

    item = ResponseFunctionToolCall(call_id="fc_S", name="send", arguments='{"to": "bob"}', type="function_call")
    first = oa.dispatch(item, [send])
    assert first["type"] == "function_call_output" and first["call_id"] == "fc_S"
    assert isinstance(first["output"], str)
    second = oa.dispatch(item, [send])
    assert json.loads(second["output"])["block_reason"] == "effect_status_unknown"
    assert runs == ["bob"]

    block = {"type": "tool_use", "id": "toolu_T", "name": "send", "input": {"to": "carl"}}
    a1 = an.dispatch(block, [send])
    assert a1["is_error"] is True
    a2 = an.dispatch(block, [send])
    assert a2["is_error"] is True
    assert json.loads(a2["content"])["block_reason"] == "effect_status_unknown"
    assert runs == ["bob", "carl"]


@pytest.mark.parametrize("bad_input", [["not", "a", "dict"], "text", None])
def test_anthropic_input_that_does_not_fit(adapter_tools: Any, db: Path, bad_input: Any) -> None:
    from guard.adapters import anthropic as an

    tools, runs, _ = adapter_tools
    before = count(db, "refused")
    out = an.dispatch({"type": "tool_use", "id": "toolu_X", "name": "pay", "input": bad_input}, tools)
    assert out["type"] == "tool_result" and out["tool_use_id"] == "toolu_X" and out["is_error"] is True
    assert runs == []
    assert count(db, "refused") == before + 1


def test_adapter_bad_arguments_for_a_reversible_tool_are_journaled(journal: Any, db: Path) -> None:
    from guard.adapters import openai as oa

    runs: list[Any] = []

    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        runs.append(q)
        return "ok"

    out = oa.dispatch({"id": "call_R", "function": {"name": "look", "arguments": '{"qq": 1}'}}, [look])
    assert out["tool_call_id"] == "call_R"
    assert runs == []
    assert count(db, "refused") == 1


def test_adapter_call_id_wins_over_the_host_context(adapter_tools: Any) -> None:
    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    tools, _runs, seen = adapter_tools
    with AirlockContext(agent_id="host", metadata={"tool_call_id": "outer"}):
        oa.dispatch({"id": "call_in", "function": {"name": "pay", "arguments": '{"account": "x"}'}}, tools)
        an.dispatch({"type": "tool_use", "id": "toolu_in", "name": "pay", "input": {"account": "y"}}, tools)
        assert get_current_context().metadata["tool_call_id"] == "outer"
    assert [s[0] for s in seen] == ["call_in", "toolu_in"]


def test_adapter_refusal_text_is_the_whole_refusal(adapter_tools: Any) -> None:
    from guard.adapters import anthropic as an

    tools, _, _ = adapter_tools
    out = an.dispatch({"type": "tool_use", "id": "toolu_R", "name": "wipe", "input": {"disk": "d"}}, tools)
    body = json.loads(out["content"])
    assert body["success"] is False and body["status"] == "blocked" and body["block_reason"] == "policy_violation"
    assert body["metadata"]["tool"] == "wipe" and body["metadata"]["tool_call_id"] == "toolu_R"


def test_adispatch_with_a_sync_tool(adapter_tools: Any) -> None:
    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    tools, _runs, seen = adapter_tools

    async def go() -> tuple[Any, Any]:
        a = await oa.adispatch({"type": "function_call", "call_id": "fc_sync", "name": "pay",
                                "arguments": '{"account": "s"}'}, tools)
        b = await an.adispatch({"type": "tool_use", "id": "toolu_sync", "name": "pay", "input": {"account": "t"}},
                               tools)
        return a, b

    a, b = asyncio.run(go())
    assert a["type"] == "function_call_output" and json.loads(a["output"]) == {"paid": 1}
    assert b["is_error"] is False and json.loads(b["content"]) == {"paid": 1}
    assert [s[0] for s in seen] == ["fc_sync", "toolu_sync"]


def test_adispatch_bad_arguments(adapter_tools: Any, db: Path) -> None:
    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    tools, runs, _ = adapter_tools

    async def go() -> tuple[Any, Any]:
        a = await oa.adispatch({"id": "call_bad", "function": {"name": "pay", "arguments": "[1,"}}, tools)
        b = await an.adispatch({"type": "tool_use", "id": "toolu_bad", "name": "pay", "input": {"zz": 1}}, tools)
        return a, b

    a, b = asyncio.run(go())
    assert a["tool_call_id"] == "call_bad" and b["is_error"] is True
    assert runs == []
    assert count(db, "refused") == 2


def test_adapter_signatures() -> None:
    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    for fn, first in ((oa.dispatch, "tool_call"), (oa.adispatch, "tool_call"), (an.dispatch, "block"),
                      (an.adispatch, "block")):
        params = inspect.signature(fn).parameters
        names = list(params)
        assert names[:2] == [first, "tools"], fn
        assert params["agent_id"].kind is inspect.Parameter.KEYWORD_ONLY and params["agent_id"].default is None
    assert inspect.iscoroutinefunction(oa.adispatch) and inspect.iscoroutinefunction(an.adispatch)
