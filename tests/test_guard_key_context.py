"""The idempotency key's byte rule (2.5) and the context a guarded call sees (2.1)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
from datetime import UTC, datetime
from typing import Any

import orjson
import pydantic
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal
from guard.effect_guard import EffectGuard, InMemoryEffectStore, idempotency_key, reversibility


def test_key_is_the_documented_byte_rule() -> None:
    args = {"cents": 500, "account": "acct_1", "meta": {"z": 1, "a": [1.5, None, True]}}
    body = b'{"account":"acct_1","cents":500,"meta":{"a":[1.5,null,true],"z":1}}'
    want = hashlib.sha256(b"charge\x00" + body).hexdigest()
    assert idempotency_key("charge", args) == want
    assert len(want) == 64 and want == want.lower()
    assert orjson.dumps(args, option=orjson.OPT_SORT_KEYS) == body


def test_key_ignores_dict_order_but_not_values_or_tool() -> None:
    assert idempotency_key("t", {"a": 1, "b": 2}) == idempotency_key("t", {"b": 2, "a": 1})
    assert idempotency_key("t", {"a": 1}) != idempotency_key("t", {"a": 2})
    assert idempotency_key("t", {"a": 1}) != idempotency_key("u", {"a": 1})


@dataclasses.dataclass
class AB:
    b: int
    a: int


@dataclasses.dataclass
class BA:
    a: int
    b: int


class ModelAB(pydantic.BaseModel):
    b: int
    a: datetime


class ModelBA(pydantic.BaseModel):
    a: datetime
    b: int


def test_dataclass_and_pydantic_field_order_never_matters() -> None:
    assert idempotency_key("t", {"x": AB(b=2, a=1)}) == idempotency_key("t", {"x": BA(a=1, b=2)})
    assert idempotency_key("t", {"x": AB(b=2, a=1)}) == idempotency_key("t", {"x": {"a": 1, "b": 2}})
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert idempotency_key("t", {"m": ModelAB(b=1, a=when)}) == idempotency_key("t", {"m": ModelBA(a=when, b=1)})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), object(), {1: "a"}, {1, 2}])
def test_values_without_json_form_cannot_be_keyed(bad: Any) -> None:
    with pytest.raises(ValueError):
        idempotency_key("t", {"x": bad})
    with pytest.raises(ValueError):
        idempotency_key("t", {"x": [1, {"y": bad}]})


def _guarded(store: InMemoryEffectStore, fn: Any) -> Any:
    return Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))(fn)


def test_positional_and_keyword_calls_give_one_key() -> None:
    store = InMemoryEffectStore()
    keys: list[str | None] = []

    def charge(account: str, cents: int, currency: str = "eur") -> str:
        ctx = get_current_context()
        assert ctx is not None
        keys.append(ctx.idempotency_key)
        return "ok"

    tool = _guarded(store, charge)
    for i, (args, kwargs) in enumerate(
        [(("a", 5), {}), ((), {"account": "a", "cents": 5}), (("a",), {"cents": 5}), (("a", 5, "eur"), {})]
    ):
        with AirlockContext(metadata={"tool_call_id": f"k{i}"}):
            assert tool(*args, **kwargs) == "ok"
    assert len(set(keys)) == 1
    assert keys[0] == idempotency_key("charge", {"account": "a", "cents": 5, "currency": "eur"})
    # One id, the same call spelled differently, is a replay, not a reuse.
    with AirlockContext(metadata={"tool_call_id": "k0"}):
        assert tool(account="a", cents=5) == "ok"
    assert [e.kind for e in store.events("k0")] == ["pending", "committed", "replayed"]


def test_var_args_and_kwargs_bind_by_name() -> None:
    store = InMemoryEffectStore()

    def tag(item: str, *labels: str, **extra: int) -> str:
        return "ok"

    tool = _guarded(store, tag)
    with AirlockContext(metadata={"tool_call_id": "v1"}):
        tool("i", "x", "y", weight=3, size=1)
    record = store.get("v1")
    assert orjson.loads(record.arguments) == {"item": "i", "labels": ["x", "y"], "weight": 3, "size": 1}
    assert record.idempotency_key == idempotency_key(
        "tag", {"item": "i", "labels": ["x", "y"], "size": 1, "weight": 3}
    )


def test_a_kwargs_entry_named_like_another_parameter_cannot_be_keyed() -> None:
    # Merged by name it would overwrite the other parameter: f(1, a=2) and f(2, a=2) would share a key.
    store = InMemoryEffectStore()
    ran: list[Any] = []

    def first(a: int, /, **kw: int) -> str:
        ran.append((a, kw))
        return "ok"

    def tagged(a: int, *rest: int, **extra: Any) -> str:
        ran.append((a, rest, extra))
        return "ok"

    tool, other = _guarded(store, first), _guarded(store, tagged)
    with AirlockContext(metadata={"tool_call_id": "clash-1"}):
        refusal = tool(1, a=2)
    assert is_refusal(refusal) and refusal["block_reason"] == "arguments_not_canonical"
    with AirlockContext(metadata={"tool_call_id": "clash-2"}):
        refusal = other(1, rest=[5])
    assert is_refusal(refusal) and refusal["block_reason"] == "arguments_not_canonical"
    assert ran == [] and store.get("clash-1") is None and store.get("clash-2") is None
    with AirlockContext(metadata={"tool_call_id": "clash-3"}):
        assert tool(1, b=2) == "ok"
    with AirlockContext(metadata={"tool_call_id": "clash-4"}):
        assert other(1, 5, size=3) == "ok"
    assert ran == [(1, {"b": 2}), (1, (5,), {"size": 3})]


def test_wrong_arguments_are_refused_when_the_key_is_needed() -> None:
    store = InMemoryEffectStore()
    ran: list[int] = []

    def charge(account: str, cents: int) -> str:
        ran.append(1)
        return "ok"

    tool = _guarded(store, charge)
    with AirlockContext(metadata={"tool_call_id": "w"}):
        refusal = tool("a")
    assert refusal["block_reason"] == "arguments_not_canonical" and "cents" in refusal["error"]
    assert ran == []


def test_not_canonical_runs_when_nothing_needs_the_key() -> None:
    seen: list[Any] = []

    @reversibility("reversible")
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def score(x: float) -> float:
        ctx = get_current_context()
        assert ctx is not None
        seen.append(ctx.idempotency_key)
        return 1.0

    assert score(float("nan")) == 1.0
    assert seen == [None]
    with AirlockContext(metadata={"tool_call_id": "nan"}):
        assert score(float("nan"))["block_reason"] == "arguments_not_canonical"


# -- the context -------------------------------------------------------------------------------


def test_contexts_nest_and_restore() -> None:
    assert get_current_context() is None
    outer = AirlockContext(agent_id="outer")
    inner = AirlockContext(agent_id="inner")
    with outer:
        assert get_current_context() is outer
        with inner:
            assert get_current_context() is inner
        assert get_current_context() is outer
    assert get_current_context() is None


def test_async_with_and_task_isolation() -> None:
    async def agent(name: str) -> str | None:
        async with AirlockContext(agent_id=name):
            await asyncio.sleep(0.01)
            ctx = get_current_context()
            return ctx.agent_id if ctx else None

    async def main() -> list[str | None]:
        return list(await asyncio.gather(agent("a"), agent("b")))

    assert asyncio.run(main()) == ["a", "b"]


LEFT_ELSEWHERE = (
    "an AirlockContext was left in another task or context than the one that entered it; "
    "leave it where it was entered"
)


def test_leaving_a_context_in_a_task_that_did_not_enter_it_is_the_documented_error() -> None:
    host = AirlockContext(agent_id="host", metadata={"tool_call_id": "c1"})

    async def main() -> tuple[str, Any, Any]:
        host.__enter__()

        async def leave_elsewhere() -> tuple[str, Any]:
            try:
                host.__exit__(None, None, None)
            except RuntimeError as e:
                return str(e), get_current_context()  # still entered here, as the task inherited it
            return "left", get_current_context()

        error, seen_in_task = await asyncio.create_task(leave_elsewhere())
        seen_here = get_current_context()
        host.__exit__(None, None, None)  # the task that entered it leaves it
        return error, (seen_in_task, seen_here), get_current_context()

    error, seen, after = asyncio.run(main())
    assert error == LEFT_ELSEWHERE
    assert seen == (host, host) and after is None


def test_leaving_a_context_after_the_task_that_entered_it_left_it_is_the_documented_error() -> None:
    host = AirlockContext(agent_id="host")

    async def main() -> Any:
        release = asyncio.Event()

        async def outlives_it() -> str | None:
            await release.wait()
            try:
                host.__exit__(None, None, None)
            except RuntimeError as e:
                return str(e)
            return None

        with host:
            task = asyncio.create_task(outlives_it())
        release.set()
        return await task, get_current_context()

    assert asyncio.run(main()) == (LEFT_ELSEWHERE, None)


def test_threads_do_not_share_contexts() -> None:
    seen: list[Any] = []

    def worker() -> None:
        seen.append(get_current_context())

    with AirlockContext(agent_id="main"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == [None]


def test_call_context_is_a_copy_with_the_call_fields() -> None:
    host = AirlockContext(agent_id="agent-1", metadata={"tool_call_id": "tc-9", "trace": "t"})
    seen: list[Any] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def charge(account: str) -> str:
        ctx = get_current_context()
        seen.append(ctx)
        assert ctx is not None
        ctx.metadata["scribble"] = True
        return "ok"

    with host:
        charge("a")
        assert get_current_context() is host
    [ctx] = seen
    assert ctx is not host and isinstance(ctx, AirlockContext)
    assert ctx.tool_call_id == "tc-9" and ctx.agent_id == "agent-1" and ctx.metadata["trace"] == "t"
    assert ctx.idempotency_key == idempotency_key("charge", {"account": "a"})
    assert "scribble" not in host.metadata and host.metadata == {"tool_call_id": "tc-9", "trace": "t"}


def test_call_context_without_host_context() -> None:
    seen: list[Any] = []

    @Airlock()
    def ping(x: int) -> int:
        seen.append(get_current_context())
        return x

    assert ping(3) == 3
    [ctx] = seen
    assert ctx is not None and ctx.tool_call_id is None and ctx.agent_id is None
    assert ctx.idempotency_key == idempotency_key("ping", {"x": 3})
    assert get_current_context() is None


def test_nested_guarded_call_does_not_inherit_the_outer_id() -> None:
    store = InMemoryEffectStore()
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))

    @Airlock(policy=policy)
    def inner(x: int) -> str:
        return "inner"

    @Airlock(policy=policy)
    def outer(x: int) -> Any:
        return inner(x)

    with AirlockContext(metadata={"tool_call_id": "o-1"}):
        result = outer(1)
    assert result["block_reason"] == "tool_call_id_required"
    assert store.get("o-1").tool == "outer"
