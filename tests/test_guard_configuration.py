"""A mistake in how the guard is set up is a TypeError or ValueError where it is made, naming what
to pass; none is left to surface later as a wrong refusal, a stuck call or a crash inside a call."""

from __future__ import annotations

import asyncio
import functools
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from guard import (
    Airlock,
    AirlockContext,
    OversightRequest,
    OversightResponse,
    OversightVerdict,
    SecurityPolicy,
    get_current_context,
    is_refusal,
)
from guard.adapters import anthropic, openai
from guard.effect_guard import EffectGuard, InMemoryEffectStore, reversibility
from journal import JournalError, SQLiteJournal


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SecurityPolicy(allowed_tools=["charge", 5]), "allowed_tools takes a list of tool names as strings"),
        (lambda: SecurityPolicy(allowed_tools=b"charge"), "allowed_tools takes a list of tool names, not a string"),
        (lambda: SecurityPolicy(denied_tools=5), "denied_tools takes a list of tool names, not int"),
        (lambda: SecurityPolicy(escalate_tools=["charge"]), "escalate_tools maps tool names or globs to reasons"),
        (lambda: SecurityPolicy(escalate_tools={"charge": None}), "escalate_tools maps a tool name or glob"),
        (lambda: SecurityPolicy(approver="alice"), "approver is a function of an OversightRequest"),
        (lambda: SecurityPolicy(effect_guard=InMemoryEffectStore()), "effect_guard is an EffectGuard"),
        (lambda: Airlock(policy=EffectGuard()), "policy is a SecurityPolicy, not EffectGuard"),
        (lambda: EffectGuard(store="journal.db"), "store is an EffectStore"),
        (lambda: EffectGuard(target_args=[5]), "target_args takes argument names as strings"),
        (lambda: EffectGuard(ambiguous_errors=(TimeoutError, "ConnectionError")), "takes exception classes"),
        (lambda: EffectGuard(ambiguous_errors=(int,)), "takes exception classes"),
        (lambda: AirlockContext(agent_id=7), "agent_id is a string or None, not int"),
        (lambda: AirlockContext(metadata="tool_call_id"), "metadata is a mapping"),
        (lambda: AirlockContext(metadata=[("tool_call_id", "c1")]), "metadata is a mapping"),
    ],
)
def test_a_wrong_setting_is_a_type_error_at_once(make: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        make()


def test_one_exception_class_is_taken_as_ambiguous_errors() -> None:
    store = InMemoryEffectStore()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store, ambiguous_errors=LookupError)))
    def lookup(key: str) -> str:
        raise KeyError(key)

    with AirlockContext(metadata={"tool_call_id": "l1"}), pytest.raises(KeyError):
        lookup("k")
    assert store.get("l1").status == "unknown"  # type: ignore[union-attr]


@pytest.mark.parametrize("tag", [["reversible"], None, 1])
def test_reversibility_of_a_tag_that_is_no_string_is_a_value_error(tag: Any) -> None:
    with pytest.raises(ValueError, match="reversibility takes"):
        reversibility(tag)


def test_a_tool_guarded_twice_is_refused_when_decorated() -> None:
    # Two Airlocks would refuse every call inside and commit that refusal as the tool's value.
    inner = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))

    def pay(cents: int) -> int:
        return cents

    with pytest.raises(TypeError, match="'pay' is already guarded by an @Airlock"):
        Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))(inner(pay))


@pytest.mark.parametrize("fn", [functools.partial(max, 1), type("Callable", (), {"__call__": lambda self: 1})()])
def test_only_a_named_function_can_be_guarded(fn: Any) -> None:
    with pytest.raises(TypeError, match="@Airlock decorates a function"):
        Airlock()(fn)


def test_an_async_approver_for_a_def_tool_refuses_with_a_reason_and_no_warning(
    recwarn: pytest.WarningsRecorder, caplog: pytest.LogCaptureFixture,
) -> None:
    async def approver(request: OversightRequest) -> OversightResponse:
        return OversightResponse(request.request_id, OversightVerdict.GRANT)

    @Airlock(policy=SecurityPolicy(escalate_tools={"refund": "money leaves"}, approver=approver))
    def refund(order: str) -> str:
        return "refunded"

    refusal = refund("o1")
    assert is_refusal(refusal) and refusal["block_reason"] == "escalation_denied"
    assert "a def tool needs an approver that is a plain function" in caplog.text
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_one_context_object_entered_by_many_tasks_at_once() -> None:
    # A host's shared context (its agent, say) entered in overlapping tasks: each task keeps its own nesting.
    shared = AirlockContext(agent_id="agent-1")
    seen: list[str | None] = []

    async def task(n: int) -> None:
        async with shared:
            await asyncio.sleep(0.01 * (n + 1))  # the first to enter leaves first: not a stack order
            async with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": f"t{n}"}):
                await asyncio.sleep(0)
                context = get_current_context()
                assert context is not None
                seen.append(context.tool_call_id)
            assert get_current_context() is shared

    async def main() -> None:
        await asyncio.gather(*(task(n) for n in range(3)))

    asyncio.run(main())
    assert sorted(seen) == ["t0", "t1", "t2"]  # type: ignore[type-var]
    assert get_current_context() is None


def test_leaving_a_context_that_is_not_the_innermost_is_an_error() -> None:
    outer, inner = AirlockContext(), AirlockContext()
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="not the innermost"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)


def test_a_generator_a_tool_returns_reaches_the_model_as_an_error_not_a_success() -> None:
    store = InMemoryEffectStore()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def stream(n: int) -> Any:
        yield n

    call = {"id": "call_g1", "type": "function", "function": {"name": "stream", "arguments": '{"n": 1}'}}
    reply = openai.dispatch(call, [stream])
    assert reply["tool_call_id"] == "call_g1"
    assert "returned a generator, not a value" in reply["content"]
    block = {"type": "tool_use", "id": "toolu_g2", "name": "stream", "input": {"n": 2}}
    result = anthropic.dispatch(block, [stream])
    assert result["is_error"] is True and "Do not retry" in result["content"]
    assert store.get("call_g1").status == "unknown"  # type: ignore[union-attr]


def test_a_journal_file_that_cannot_be_written_is_refused_when_opened(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "j.db"
    SQLiteJournal(path).close()
    before = path.read_bytes()
    path.chmod(0o444)
    if os.geteuid() == 0:  # root may write any file: the permission is taken as another user would find it
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(path) else
                            real_access(p, mode, **kw))
    with pytest.raises(JournalError, match=r"Cannot write the journal .*readonly=True"):
        SQLiteJournal(path)
    assert path.read_bytes() == before
    monkeypatch.undo()
    with SQLiteJournal(path, readonly=True) as j:
        assert j.head()[0] == 0
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] >= 1
