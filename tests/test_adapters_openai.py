"""guard.adapters.openai: Chat Completions and Responses tool calls, dispatched at most once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall
from openai.types.responses import Response, ResponseFunctionToolCall

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context
from guard.adapters import openai as adapter
from guard.effect_guard import EffectGuard, InMemoryEffectStore, idempotency_key


class Bank:
    """The backend the tools act on; it counts effects outside the guard."""

    def __init__(self) -> None:
        self.charges: list[tuple[str, int]] = []

    def charge(self, account: str, cents: int) -> str:
        self.charges.append((account, cents))
        return f"ch_{len(self.charges)}"


def make_tools(store: InMemoryEffectStore, bank: Bank) -> dict[str, Any]:
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))

    @Airlock(policy=policy)
    def charge(account: str, cents: int, memo: str = "") -> dict[str, Any]:
        """Charge an account."""
        return {"charge_id": bank.charge(account, cents), "cents": cents, "memo": memo}

    @Airlock(policy=policy)
    async def acharge(account: str, cents: int) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"charge_id": bank.charge(account, cents), "cents": cents}

    return {"charge": charge, "acharge": acharge}


def chat_completion(*tool_calls: tuple[str, str, str]) -> ChatCompletion:
    """The model's reply as the SDK parses it: one assistant message asking for tool calls."""
    return ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1_764_000_000, "model": "gpt-test",
        "choices": [{
            "index": 0, "finish_reason": "tool_calls",
            "message": {
                "role": "assistant", "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                    for call_id, name, arguments in tool_calls
                ],
            },
        }],
    })


def responses_reply(*calls: tuple[str, str, str]) -> Response:
    return Response.model_validate({
        "id": "resp_1", "object": "response", "created_at": 1_764_000_000, "model": "gpt-test",
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "output": [
            {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
             "arguments": arguments, "status": "completed"}
            for call_id, name, arguments in calls
        ],
    })


def kinds(store: InMemoryEffectStore, call_id: str) -> list[str]:
    return [e.kind for e in store.events(call_id)]


# -- whole loops -------------------------------------------------------------------------------


def test_chat_completions_loop_replays_a_lost_response_and_charges_once() -> None:
    store, bank = InMemoryEffectStore(), Bank()
    tools = make_tools(store, bank)
    completion = chat_completion(("call_a1", "charge", '{"account": "acct_1", "cents": 500}'))
    tool_calls = completion.choices[0].message.tool_calls
    assert tool_calls is not None
    call = tool_calls[0]
    assert isinstance(call, ChatCompletionMessageToolCall)

    first = adapter.dispatch(call, tools)  # the host loses this reply before sending it on
    assert bank.charges == [("acct_1", 500)]

    again = adapter.dispatch(call, tools)  # the host retries the same tool call
    assert again == {
        "role": "tool", "tool_call_id": "call_a1",
        "content": '{"cents":500,"charge_id":"ch_1","memo":""}',
    }
    assert again == first
    assert bank.charges == [("acct_1", 500)]
    assert kinds(store, "call_a1") == ["pending", "committed", "replayed"]


def test_responses_loop_replays_a_lost_response_and_charges_once() -> None:
    store, bank = InMemoryEffectStore(), Bank()
    tools = make_tools(store, bank)
    response = responses_reply(("call_r1", "charge", '{"account": "acct_2", "cents": 7}'))
    item = response.output[0]
    assert isinstance(item, ResponseFunctionToolCall)

    first = adapter.dispatch(item, tools)
    again = adapter.dispatch(item, tools)
    assert again == first == {
        "type": "function_call_output", "call_id": "call_r1",
        "output": '{"cents":7,"charge_id":"ch_1","memo":""}',
    }
    assert bank.charges == [("acct_2", 7)]
    # The journal keys the call on call_id, not on the item's own id (fc_...).
    assert kinds(store, "call_r1") == ["pending", "committed", "replayed"]
    assert store.get("fc_call_r1") is None


def test_async_host_with_async_and_sync_tools_replays_both() -> None:
    store, bank = InMemoryEffectStore(), Bank()
    tools = make_tools(store, bank)
    completion = chat_completion(
        ("call_x1", "acharge", '{"account": "acct_3", "cents": 1}'),
        ("call_x2", "charge", '{"account": "acct_3", "cents": 2}'),
    )
    calls = completion.choices[0].message.tool_calls or []

    async def host() -> list[list[dict[str, Any]]]:
        rounds = []
        for _ in range(2):  # the second round is the retry after the replies were lost
            rounds.append(await asyncio.gather(*(adapter.adispatch(c, tools) for c in calls)))
        return rounds

    first, again = asyncio.run(host())
    assert again == first
    assert [m["tool_call_id"] for m in first] == ["call_x1", "call_x2"]
    values = [json.loads(m["content"]) for m in first]
    assert [v["cents"] for v in values] == [1, 2]
    assert {v["charge_id"] for v in values} == {"ch_1", "ch_2"}
    assert sorted(bank.charges) == [("acct_3", 1), ("acct_3", 2)]
    assert kinds(store, "call_x1") == ["pending", "committed", "replayed"]
    assert kinds(store, "call_x2") == ["pending", "committed", "replayed"]


def test_plain_dicts_of_both_shapes() -> None:
    store, bank = InMemoryEffectStore(), Bank()
    tools = make_tools(store, bank)
    chat = {"id": "call_d1", "type": "function",
            "function": {"name": "charge", "arguments": '{"account": "a", "cents": 3}'}}
    item = {"type": "function_call", "call_id": "call_d2", "name": "charge",
            "arguments": '{"account": "a", "cents": 4}'}
    assert adapter.dispatch(chat, tools)["tool_call_id"] == "call_d1"
    assert adapter.dispatch(item, tools)["call_id"] == "call_d2"
    assert adapter.dispatch(chat, tools)["content"] == '{"cents":3,"charge_id":"ch_1","memo":""}'
    assert bank.charges == [("a", 3), ("a", 4)]


# -- the model's mistakes become error results -------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ('{"account": "a", "cents": ', "not valid JSON"),
        ("NaN", "not valid JSON"),
        ('["a", 5]', "not a JSON object"),
        ('{"account": "a"}', "missing a required argument: 'cents'"),
        ('{"account": "a", "cents": 5, "currency": "EUR"}', "unexpected keyword argument 'currency'"),
    ],
)
def test_bad_arguments_are_refused_and_journaled_without_running(arguments: str, says: str) -> None:
    store, bank = InMemoryEffectStore(), Bank()
    tools = make_tools(store, bank)
    reply = adapter.dispatch(chat_completion(("call_bad", "charge", arguments)).choices[0].message.tool_calls[0],
                             tools)
    refusal = json.loads(reply["content"])
    assert reply["tool_call_id"] == "call_bad"
    assert refusal["block_reason"] == "arguments_not_canonical"
    assert refusal["metadata"]["violation_type"] == "arguments_invalid"
    assert says in refusal["error"]
    assert refusal["fix_hints"]
    assert bank.charges == []
    events = store.events("call_bad")
    assert [e.kind for e in events] == ["refused"]
    assert events[0].reason is not None and events[0].reason["code"] == "arguments_not_canonical"
    # A refusal leaves the id unused: the corrected call under the same id runs.
    fixed = {"id": "call_bad", "function": {"name": "charge", "arguments": '{"account": "a", "cents": 5}'}}
    assert json.loads(adapter.dispatch(fixed, tools)["content"])["charge_id"] == "ch_1"


def test_an_argument_named_tool_call_id_is_the_models_not_the_calls_id() -> None:
    store = InMemoryEffectStore()
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))
    seen: list[tuple[str | None, str]] = []

    @Airlock(policy=policy)
    def tag(tool_call_id: str) -> str:
        ctx = get_current_context()
        seen.append((ctx.tool_call_id if ctx else None, tool_call_id))
        return tool_call_id

    def call(call_id: str, value: str) -> dict[str, Any]:
        return {"id": call_id, "function": {"name": "tag", "arguments": json.dumps({"tool_call_id": value})}}

    assert adapter.dispatch(call("call_t1", "from-model"), [tag])["content"] == '"from-model"'
    assert seen == [("call_t1", "from-model")]
    record = store.get("call_t1")
    assert record is not None
    assert record.idempotency_key == idempotency_key("tag", {"tool_call_id": "from-model"})
    assert store.get("from-model") is None
    # The argument enters the key: the same call id with another value is a reuse, refused.
    reused = json.loads(adapter.dispatch(call("call_t1", "other"), [tag])["content"])
    assert reused["block_reason"] == "policy_violation"
    assert reused["metadata"]["violation_type"] == "tool_call_id_reused"
    assert len(seen) == 1


def test_host_context_agent_is_kept_unless_agent_id_is_given() -> None:
    store = InMemoryEffectStore()
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))
    seen: list[tuple[str | None, dict[str, Any]]] = []

    @Airlock(policy=policy)
    def whoami() -> str:
        ctx = get_current_context()
        assert ctx is not None
        seen.append((ctx.agent_id, dict(ctx.metadata)))
        return "ok"

    host = AirlockContext(agent_id="host-agent", metadata={"session": "s1", "tool_call_id": "stale"})
    with host:
        adapter.dispatch({"id": "call_w1", "function": {"name": "whoami", "arguments": "{}"}}, [whoami])
        adapter.dispatch({"id": "call_w2", "function": {"name": "whoami", "arguments": "{}"}}, [whoami],
                         agent_id="agent-7")
        assert get_current_context() is host
    assert host.metadata["tool_call_id"] == "stale"
    assert seen[0][0] == "host-agent" and seen[1][0] == "agent-7"
    assert seen[0][1]["session"] == "s1" and seen[0][1]["tool_call_id"] == "call_w1"
    assert [(e.call_id, e.agent_id) for e in store.events() if e.kind == "pending"] == [
        ("call_w1", "host-agent"), ("call_w2", "agent-7"),
    ]


# -- what the host gets wrong raises -----------------------------------------------------------


def test_things_that_are_not_function_tool_calls_raise() -> None:
    tools = make_tools(InMemoryEffectStore(), Bank())
    custom = {"id": "call_c", "type": "custom", "custom": {"name": "charge", "input": "x"}}
    with pytest.raises(TypeError, match="of type 'custom'"):
        adapter.dispatch(custom, tools)
    with pytest.raises(TypeError, match="function_call item"):
        adapter.dispatch({"name": "charge"}, tools)
    with pytest.raises(ValueError, match="no id"):
        adapter.dispatch({"id": "", "function": {"name": "charge", "arguments": "{}"}}, tools)
    with pytest.raises(ValueError, match="names no function"):
        adapter.dispatch({"id": "call_n", "function": {"arguments": "{}"}}, tools)


def test_sync_dispatch_of_an_async_tool_raises_and_runs_nothing() -> None:
    store, bank = InMemoryEffectStore(), Bank()
    tools = make_tools(store, bank)
    with pytest.raises(TypeError, match="adispatch"):
        adapter.dispatch({"id": "call_s", "function": {"name": "acharge", "arguments": "{}"}}, tools)
    assert bank.charges == [] and store.events() == []
