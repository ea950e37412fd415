"""The adapters' replies go back to the provider through the real SDK clients, over HTTP.

A local HTTP server stands in for the provider: it answers with scripted model replies and keeps
every request body the SDK sent, so the tests see exactly what the model would be given.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anthropic
import openai
import pytest

from guard import Airlock, SecurityPolicy
from guard.adapters import anthropic as anthropic_adapter
from guard.adapters import openai as openai_adapter
from guard.effect_guard import EffectGuard, InMemoryEffectStore


class Provider:
    """A scripted provider endpoint on 127.0.0.1."""

    def __init__(self) -> None:
        self.replies: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                provider.requests.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                body = json.dumps(provider.replies.pop(0)).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def provider() -> Iterator[Provider]:
    p = Provider()
    try:
        yield p
    finally:
        p.close()


def charging_tool(charges: list[int]) -> tuple[Any, InMemoryEffectStore]:
    store = InMemoryEffectStore()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        charges.append(cents)
        return {"charge_id": f"ch_{len(charges)}", "account": account}

    return charge, store


def test_openai_chat_completions_round_trip_after_a_crash(provider: Provider) -> None:
    charges: list[int] = []
    charge, store = charging_tool(charges)
    provider.replies = [
        {"id": "c1", "object": "chat.completion", "created": 1, "model": "gpt-test", "choices": [{
            "index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_w1", "type": "function",
                            "function": {"name": "charge", "arguments": '{"account": "acct_1", "cents": 500}'}}]}}]},
        {"id": "c2", "object": "chat.completion", "created": 2, "model": "gpt-test", "choices": [{
            "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Charged."}}]},
    ]
    client = openai.OpenAI(api_key="test", base_url=provider.url + "/v1", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Charge acct_1 $5."}]
    assistant = client.chat.completions.create(model="gpt-test", messages=messages).choices[0].message
    messages.append(assistant)
    for call in assistant.tool_calls or []:
        openai_adapter.dispatch(call, [charge])  # the host crashes here; the reply is lost
    for call in assistant.tool_calls or []:  # restarted, it answers the saved assistant message again
        messages.append(openai_adapter.dispatch(call, [charge]))
    final = client.chat.completions.create(model="gpt-test", messages=messages)

    assert final.choices[0].message.content == "Charged."
    assert provider.requests[1]["messages"][-1] == {
        "role": "tool", "tool_call_id": "call_w1", "content": '{"account":"acct_1","charge_id":"ch_1"}',
    }
    assert charges == [500]
    assert [e.kind for e in store.events("call_w1")] == ["pending", "committed", "replayed"]


def test_openai_responses_round_trip_after_a_crash(provider: Provider) -> None:
    charges: list[int] = []
    charge, store = charging_tool(charges)

    def response(rid: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": rid, "object": "response", "created_at": 1, "model": "gpt-test", "status": "completed",
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "output": output}

    provider.replies = [
        response("resp_1", [{"type": "function_call", "id": "fc_1", "call_id": "call_r1", "name": "charge",
                             "arguments": '{"account": "acct_2", "cents": 70}', "status": "completed"}]),
        response("resp_2", [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                             "content": [{"type": "output_text", "text": "Charged.", "annotations": []}]}]),
    ]
    client = openai.OpenAI(api_key="test", base_url=provider.url + "/v1", max_retries=0)
    first = client.responses.create(model="gpt-test", input="Charge acct_2 70 cents.")
    calls = [item for item in first.output if item.type == "function_call"]
    for item in calls:
        openai_adapter.dispatch(item, [charge])  # lost
    outputs = [openai_adapter.dispatch(item, [charge]) for item in calls]
    final = client.responses.create(model="gpt-test", previous_response_id=first.id, input=outputs)  # type: ignore[arg-type]

    assert final.output_text == "Charged."
    assert provider.requests[1]["input"] == [
        {"type": "function_call_output", "call_id": "call_r1", "output": '{"account":"acct_2","charge_id":"ch_1"}'},
    ]
    assert charges == [70]
    assert [e.kind for e in store.events("call_r1")] == ["pending", "committed", "replayed"]


def test_anthropic_messages_round_trip_after_a_crash(provider: Provider) -> None:
    charges: list[int] = []
    charge, store = charging_tool(charges)

    def message(mid: str, stop: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": mid, "type": "message", "role": "assistant", "model": "claude-test", "stop_reason": stop,
                "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}, "content": content}

    provider.replies = [
        message("msg_1", "tool_use", [{"type": "tool_use", "id": "toolu_w1", "name": "charge",
                                       "input": {"account": "acct_3", "cents": 9}}]),
        message("msg_2", "end_turn", [{"type": "text", "text": "Charged."}]),
    ]
    client = anthropic.Anthropic(api_key="test", base_url=provider.url, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Charge acct_3 9 cents."}]
    reply = client.messages.create(model="claude-test", max_tokens=100, messages=messages)
    messages.append({"role": "assistant", "content": reply.content})
    uses = [block for block in reply.content if block.type == "tool_use"]
    for block in uses:
        anthropic_adapter.dispatch(block, [charge])  # lost
    messages.append({"role": "user", "content": [anthropic_adapter.dispatch(b, [charge]) for b in uses]})
    final = client.messages.create(model="claude-test", max_tokens=100, messages=messages)

    assert final.content[0].type == "text" and final.content[0].text == "Charged."
    assert provider.requests[1]["messages"][-1] == {"role": "user", "content": [{
        "type": "tool_result", "tool_use_id": "toolu_w1",
        "content": '{"account":"acct_3","charge_id":"ch_1"}', "is_error": False,
    }]}
    assert charges == [9]
    assert [e.kind for e in store.events("toolu_w1")] == ["pending", "committed", "replayed"]
