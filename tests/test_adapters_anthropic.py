"""guard.adapters.anthropic: tool_use blocks dispatched at most once, answered with tool_result blocks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from anthropic.types import Message, ToolUseBlock

from guard import Airlock, SecurityPolicy, get_current_context
from guard.adapters import anthropic as adapter
from guard.effect_guard import EffectGuard, EffectOutcomeUnknown, InMemoryEffectStore, idempotency_key


class Mailer:
    """The backend: every email it sends is one effect, counted outside the guard."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []


def make_tools(store: Any, mailer: Mailer) -> list[Any]:
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))

    @Airlock(policy=policy)
    def send_email(to: str, subject: str) -> dict[str, Any]:
        mailer.sent.append((to, subject))
        return {"message_id": f"m{len(mailer.sent)}", "to": to}

    @Airlock(policy=policy)
    async def asend_email(to: str, subject: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        mailer.sent.append((to, subject))
        return {"message_id": f"m{len(mailer.sent)}", "to": to}

    return [send_email, asend_email]


def model_message(*uses: tuple[str, str, dict[str, Any]]) -> Message:
    """The model's reply as the SDK parses it: an assistant message that stops for tool use."""
    return Message.model_validate({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 10},
        "content": [{"type": "text", "text": "Sending it now."}] + [
            {"type": "tool_use", "id": use_id, "name": name, "input": tool_input}
            for use_id, name, tool_input in uses
        ],
    })


def tool_uses(message: Message) -> list[ToolUseBlock]:
    return [b for b in message.content if isinstance(b, ToolUseBlock)]


def run_turn(message: Message, tools: list[Any]) -> dict[str, Any]:
    """One host turn: answer every tool_use of the message in the next user message."""
    return {"role": "user", "content": [adapter.dispatch(b, tools) for b in tool_uses(message)]}


def test_loop_replays_a_lost_result_and_sends_once() -> None:
    store, mailer = InMemoryEffectStore(), Mailer()
    tools = make_tools(store, mailer)
    message = model_message(("toolu_01", "send_email", {"to": "ann@example.com", "subject": "Invoice"}))

    lost = run_turn(message, tools)  # the host crashes before this reaches the model
    retried = run_turn(message, tools)
    assert retried == lost == {"role": "user", "content": [{
        "type": "tool_result", "tool_use_id": "toolu_01",
        "content": '{"message_id":"m1","to":"ann@example.com"}', "is_error": False,
    }]}
    assert mailer.sent == [("ann@example.com", "Invoice")]
    assert [e.kind for e in store.events("toolu_01")] == ["pending", "committed", "replayed"]


def test_loop_on_a_sqlite_journal_survives_a_host_restart(tmp_path: Path) -> None:
    from journal import SQLiteJournal

    path = tmp_path / "journal.db"
    mailer = Mailer()
    message = model_message(("toolu_02", "send_email", {"to": "bo@example.com", "subject": "Hi"}))
    journal = SQLiteJournal(path)
    try:
        first = run_turn(message, make_tools(journal, mailer))
    finally:
        journal.close()
    # A new process: a fresh journal object on the same file, fresh tools, the same tool_use resent.
    journal = SQLiteJournal(path)
    try:
        again = run_turn(message, make_tools(journal, mailer))
        kinds = [e.kind for e in journal.events(call_id="toolu_02")]
    finally:
        journal.close()
    assert again == first
    assert json.loads(again["content"][0]["content"]) == {"message_id": "m1", "to": "bo@example.com"}
    assert mailer.sent == [("bo@example.com", "Hi")]
    assert kinds == ["pending", "committed", "replayed"]


def test_async_host_awaits_async_tools_and_replays() -> None:
    store, mailer = InMemoryEffectStore(), Mailer()
    tools = make_tools(store, mailer)
    message = model_message(
        ("toolu_a1", "asend_email", {"to": "cy@example.com", "subject": "A"}),
        ("toolu_a2", "send_email", {"to": "di@example.com", "subject": "B"}),
    )

    async def host() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        first = [await adapter.adispatch(b, tools) for b in tool_uses(message)]
        again = [await adapter.adispatch(b, tools) for b in tool_uses(message)]
        return first, again

    first, again = asyncio.run(host())
    assert again == first
    assert [r["is_error"] for r in first] == [False, False]
    assert [json.loads(r["content"])["message_id"] for r in first] == ["m1", "m2"]
    assert mailer.sent == [("cy@example.com", "A"), ("di@example.com", "B")]


def test_input_that_does_not_fit_is_refused_and_not_run() -> None:
    store, mailer = InMemoryEffectStore(), Mailer()
    tools = make_tools(store, mailer)
    block = tool_uses(model_message(("toolu_b", "send_email", {"to": "x@example.com"})))[0]
    result = adapter.dispatch(block, tools)
    assert result["is_error"] is True and result["tool_use_id"] == "toolu_b"
    refusal = json.loads(result["content"])
    assert refusal["block_reason"] == "arguments_not_canonical"
    assert "missing a required argument: 'subject'" in refusal["error"]
    assert refusal["metadata"]["parameters"] == ["to", "subject"]
    assert mailer.sent == []
    assert [e.kind for e in store.events("toolu_b")] == ["refused"]


def test_input_given_as_json_text_is_decoded_and_bad_text_refused() -> None:
    store, mailer = InMemoryEffectStore(), Mailer()
    tools = make_tools(store, mailer)
    good = {"type": "tool_use", "id": "toolu_j1", "name": "send_email", "input": '{"to": "e@x.io", "subject": "S"}'}
    bad = {"type": "tool_use", "id": "toolu_j2", "name": "send_email", "input": "{to: e@x.io}"}
    assert adapter.dispatch(good, tools)["is_error"] is False
    result = adapter.dispatch(bad, tools)
    assert result["is_error"] is True
    assert "not valid JSON" in json.loads(result["content"])["error"]
    assert mailer.sent == [("e@x.io", "S")]


def test_an_argument_named_tool_call_id_is_the_models_not_the_calls_id() -> None:
    store = InMemoryEffectStore()
    seen: list[tuple[str | None, str]] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def label(tool_call_id: str) -> str:
        ctx = get_current_context()
        seen.append((ctx.tool_call_id if ctx else None, tool_call_id))
        return "labelled"

    block = ToolUseBlock(type="tool_use", id="toolu_t", name="label", input={"tool_call_id": "toolu_fake"})
    assert adapter.dispatch(block, [label])["content"] == '"labelled"'
    assert adapter.dispatch(block, [label])["content"] == '"labelled"'
    assert seen == [("toolu_t", "toolu_fake")]
    record = store.get("toolu_t")
    assert record is not None and record.idempotency_key == idempotency_key("label", {"tool_call_id": "toolu_fake"})
    assert store.get("toolu_fake") is None


def test_an_ambiguous_failure_is_an_error_result_and_its_retry_is_refused() -> None:
    store = InMemoryEffectStore()
    attempts: list[str] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def wire(cents: int) -> str:
        attempts.append("wire")
        raise EffectOutcomeUnknown("the bank timed out after the request was sent")

    block = {"type": "tool_use", "id": "toolu_u", "name": "wire", "input": {"cents": 100}}
    first = adapter.dispatch(block, [wire])
    assert first["is_error"] is True
    assert "EffectOutcomeUnknown" in first["content"] and "the bank timed out" in first["content"]
    retry = adapter.dispatch(block, [wire])
    refusal = json.loads(retry["content"])
    assert retry["is_error"] is True
    assert refusal["block_reason"] == "effect_status_unknown"
    assert any("idempotency key" in h for h in refusal["fix_hints"])
    assert attempts == ["wire"]
    assert [e.kind for e in store.events("toolu_u")] == ["pending", "unknown", "refused"]


def test_blocks_that_are_not_tool_use_raise() -> None:
    tools = make_tools(InMemoryEffectStore(), Mailer())
    with pytest.raises(TypeError, match="of type 'text'"):
        adapter.dispatch({"type": "text", "text": "hello"}, tools)
    with pytest.raises(ValueError, match="no id"):
        adapter.dispatch({"type": "tool_use", "name": "send_email", "input": {}}, tools)
    with pytest.raises(TypeError, match="id is a string"):
        adapter.dispatch({"type": "tool_use", "id": 7, "name": "send_email", "input": {}}, tools)
    with pytest.raises(ValueError, match="names no tool"):
        adapter.dispatch({"type": "tool_use", "id": "toolu_n", "input": {}}, tools)
