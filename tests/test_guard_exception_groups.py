"""A tool that raises an exception group (asyncio.TaskGroup, ``except*``) is recorded as the worst
exception in it: ``unknown`` when any of them, at any depth, is ambiguous (docs/semantics.md)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard, EffectOutcomeUnknown, reversibility

NAME = os.fsdecode(b"report-\xff.pdf")  # a lone surrogate: 'report-\udcff.pdf'


def guarded(store: Any, fn: Any, **effect_guard: Any) -> Any:
    return Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store, **effect_guard)))(fn)


def call(fn: Any, call_id: str, *args: Any) -> Any:
    with AirlockContext(metadata={"tool_call_id": call_id}):
        return fn(*args)


async def acall(fn: Any, call_id: str, *args: Any) -> Any:
    async with AirlockContext(metadata={"tool_call_id": call_id}):
        return await fn(*args)


def test_a_timeout_inside_an_async_task_group_is_unknown_and_never_runs_again(store: Any) -> None:
    charges: list[int] = []

    async def charge_card(cents: int) -> None:
        charges.append(cents)  # the backend applied it ...
        raise TimeoutError("backend timed out")  # ... and its reply was lost

    async def notify() -> None:
        await asyncio.sleep(0)

    async def pay(cents: int) -> str:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(charge_card(cents))
            tg.create_task(notify())
        return "paid"

    tool = guarded(store, pay)

    async def model_retries() -> tuple[BaseException, Any]:
        try:
            await acall(tool, "c1", 500)
        except BaseException as e:
            first: BaseException = e
        else:
            raise AssertionError("the group did not reach the caller")
        return first, await acall(tool, "c1", 500)

    first, retry = asyncio.run(model_retries())
    assert type(first) is ExceptionGroup and [type(e) for e in first.exceptions] == [TimeoutError]
    record = store.get("c1")
    assert record.status == "unknown"
    assert record.error == {
        "type": "ExceptionGroup",
        "message": "unhandled errors in a TaskGroup (1 sub-exception); among them TimeoutError: backend timed out",
    }
    assert is_refusal(retry) and retry["block_reason"] == "effect_status_unknown"
    assert charges == [500]


def test_a_sync_tool_raising_a_group_gives_the_caller_that_very_group(store: Any) -> None:
    runs: list[int] = []
    raised = ExceptionGroup("two refunds failed", [ValueError("bad account"), ConnectionResetError("peer left")])

    def refund(cents: int) -> str:
        runs.append(cents)
        raise raised

    tool = guarded(store, refund)
    with pytest.raises(ExceptionGroup) as caught:
        call(tool, "r1", 5)
    assert caught.value is raised
    record = store.get("r1")
    assert record.status == "unknown"
    assert record.error == {
        "type": "ExceptionGroup",
        "message": "two refunds failed (2 sub-exceptions); among them ConnectionResetError: peer left",
    }
    assert call(tool, "r1", 5)["block_reason"] == "effect_status_unknown"
    assert runs == [5]


def test_an_ambiguous_error_in_a_nested_group_is_found(store: Any) -> None:
    def sync(path: str) -> None:
        inner = ExceptionGroup("inner", [KeyError("k"), EffectOutcomeUnknown(f"lost {NAME}")])
        try:
            raise ExceptionGroup("outer", [ValueError("ordinary"), ExceptionGroup("middle", [inner])])
        except* ValueError:
            raise  # ``except*`` raises what it caught and what it did not as a group of its own

    tool = guarded(store, sync)
    with pytest.raises(ExceptionGroup):
        call(tool, "n1", "x")
    record = store.get("n1")
    assert record.status == "unknown"
    assert record.error == {
        "type": "ExceptionGroup",
        "message": "outer (2 sub-exceptions); among them EffectOutcomeUnknown: lost report-\\udcff.pdf",
    }
    assert call(tool, "n1", "x")["block_reason"] == "effect_status_unknown"


def test_a_group_nested_deeper_than_python_recurses_reaches_the_caller_and_is_unknown(store: Any) -> None:
    deep: ExceptionGroup[Exception] = ExceptionGroup("innermost", [KeyError("k"), TimeoutError("slow")])
    for level in range(2 * sys.getrecursionlimit()):
        deep = ExceptionGroup(f"level {level}", [ValueError("ordinary"), deep])

    def sync(n: int) -> None:
        raise deep

    tool = guarded(store, sync)
    try:
        call(tool, "d1", 1)
    except BaseException as e:  # outside the except block below: a failure's report must not walk the group
        caught_the_group = e is deep
    else:
        caught_the_group = False
    assert caught_the_group
    record = store.get("d1")
    assert record.status == "unknown"
    assert record.error["message"].endswith("; among them TimeoutError: slow")


def test_a_group_of_only_ordinary_errors_is_released_and_runs_again(store: Any) -> None:
    runs: list[int] = []

    def upload(n: int) -> str:
        runs.append(n)
        if len(runs) == 1:
            raise ExceptionGroup("uploads failed", [ValueError("bad"), ExceptionGroup("inner", [KeyError("k")])])
        return "uploaded"

    tool = guarded(store, upload)
    with pytest.raises(ExceptionGroup):
        call(tool, "u1", 1)
    record = store.get("u1")
    assert record.status == "released"
    assert record.error == {"type": "ExceptionGroup", "message": "uploads failed (2 sub-exceptions)"}
    assert call(tool, "u1", 1) == "uploaded"
    assert runs == [1, 1]


def test_a_group_counts_the_effect_guards_own_ambiguous_errors(store: Any) -> None:
    class BackendBusy(Exception):
        pass

    def upload(n: int) -> None:
        raise ExceptionGroup("uploads failed", [TimeoutError("slow"), BackendBusy("busy")])

    tool = guarded(store, upload, ambiguous_errors=(BackendBusy,))
    with pytest.raises(ExceptionGroup):
        call(tool, "u2", 1)
    record = store.get("u2")  # TimeoutError is ordinary here: the first ambiguous one is BackendBusy
    assert (record.status, record.error["message"]) == (
        "unknown", "uploads failed (2 sub-exceptions); among them BackendBusy: busy")


def test_a_cancellation_inside_a_group_is_unknown_and_named(store: Any) -> None:
    def upload(n: int) -> None:
        raise BaseExceptionGroup("interrupted", [ValueError("bad"), ExceptionGroup("inner", [KeyError("k")]),
                                                 BaseExceptionGroup("stop", [KeyboardInterrupt()])])

    tool = guarded(store, upload)
    with pytest.raises(BaseExceptionGroup):
        call(tool, "u3", 1)
    record = store.get("u3")
    assert record.status == "unknown"
    assert record.error == {
        "type": "BaseExceptionGroup", "message": "interrupted (3 sub-exceptions); among them KeyboardInterrupt",
    }


def test_a_reversible_tool_whose_group_was_ambiguous_runs_again(store: Any) -> None:
    runs: list[int] = []

    @reversibility("reversible")
    def lookup(n: int) -> str:
        runs.append(n)
        if len(runs) == 1:
            raise ExceptionGroup("lookups failed", [TimeoutError("slow")])
        return "found"

    tool = guarded(store, lookup)
    with pytest.raises(ExceptionGroup):
        call(tool, "l1", 1)
    assert store.get("l1").status == "unknown"
    assert call(tool, "l1", 1) == "found"
    assert runs == [1, 1]
