"""What every adapter shares: the tools table, the text the model reads, errors, refusals, laziness."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, requires
from guard.adapters import _dispatch, anthropic, openai
from guard.effect_guard import EffectGuard, InMemoryEffectStore, idempotency_key, reversibility
from tests.stores import store_events


def chat(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def use(call_id: str, name: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


def guarded(store: InMemoryEffectStore | None = None, **policy: Any) -> Airlock:
    return Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store), **policy))


# -- the tools table ---------------------------------------------------------------------------


def test_tools_as_a_list_by_name_or_as_a_mapping_by_the_models_name() -> None:
    store = InMemoryEffectStore()
    ran: list[str] = []

    @guarded(store)
    def charge(cents: int) -> int:
        ran.append("charge")
        return cents

    assert openai.dispatch(chat("c1", "charge", {"cents": 1}), [charge])["content"] == "1"
    assert openai.dispatch(chat("c2", "pay", {"cents": 2}), {"pay": charge})["content"] == "2"
    refusal = json.loads(openai.dispatch(chat("c3", "charge", {"cents": 3}), {"pay": charge})["content"])
    assert refusal["metadata"]["violation_type"] == "unknown_tool" and refusal["metadata"]["tools"] == ["pay"]
    assert ran == ["charge", "charge"]
    # The journal names the function; the model's name for it is the host's business.
    assert [e.tool for e in store.events("c2")] == ["charge", "charge"]


def test_tools_that_cannot_be_dispatched_raise() -> None:
    @guarded()
    def charge(cents: int) -> int:
        return cents

    def unguarded(cents: int) -> int:
        return cents

    call = chat("c1", "charge", {"cents": 1})
    with pytest.raises(TypeError, match="'unguarded' is not decorated with @Airlock"):
        openai.dispatch(call, [charge, unguarded])
    with pytest.raises(ValueError, match="two tools are named 'charge'"):
        openai.dispatch(call, [charge, charge])
    with pytest.raises(TypeError, match="not callable"):
        openai.dispatch(call, {"charge": "charge"})
    with pytest.raises(TypeError, match="not str"):
        openai.dispatch(call, "charge")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="non-empty string"):
        openai.dispatch(call, {"": charge})


# -- unknown tools -----------------------------------------------------------------------------


def test_an_unknown_tool_is_journaled_in_the_store_all_tools_share() -> None:
    store = InMemoryEffectStore()

    @guarded(store)
    def charge(cents: int) -> int:
        return cents

    result = anthropic.dispatch(use("toolu_1", "refund", {"cents": 5}), [charge], agent_id="agent-9")
    assert result["is_error"] is True
    refusal = json.loads(result["content"])
    assert refusal["block_reason"] == "policy_violation"
    assert "no tool named 'refund'" in refusal["error"] and "charge" in refusal["error"]
    assert refusal["fix_hints"]
    [event] = store.events()
    assert (event.kind, event.call_id, event.tool, event.agent_id) == ("refused", "toolu_1", "refund", "agent-9")
    assert event.reason is not None and event.reason["code"] == "policy_violation"
    assert store.get("toolu_1") is None


def test_an_unknown_tool_among_tools_of_several_stores_is_only_an_error_result() -> None:
    first, second = InMemoryEffectStore(), InMemoryEffectStore()

    @guarded(first)
    def charge(cents: int) -> int:
        return cents

    @guarded(second)
    def refund(cents: int) -> int:
        return cents

    result = anthropic.dispatch(use("toolu_2", "void", {}), [charge, refund])
    assert result["is_error"] is True
    assert json.loads(result["content"])["metadata"]["violation_type"] == "unknown_tool"
    assert first.events() == [] and second.events() == []


# -- refusals and errors -----------------------------------------------------------------------


@pytest.mark.parametrize("on_block", ["return", "raise"])
def test_a_refusal_reaches_the_model_with_its_error_and_fix_hints(on_block: Any) -> None:
    store = InMemoryEffectStore()
    airlock = Airlock(policy=SecurityPolicy(denied_tools=["delete_*"], effect_guard=EffectGuard(store=store)),
                      on_block=on_block)
    ran: list[str] = []

    @airlock
    def delete_repo(name: str) -> str:
        ran.append(name)
        return "deleted"

    result = anthropic.dispatch(use("toolu_3", "delete_repo", {"name": "prod"}), [delete_repo])
    assert result["is_error"] is True
    refusal = json.loads(result["content"])
    assert refusal["success"] is False and refusal["status"] == "blocked"
    assert refusal["block_reason"] == "policy_violation"
    assert "denied" in refusal["error"]
    assert refusal["fix_hints"] == ["Do not call this tool again in this session; choose an allowed tool."]
    assert refusal["metadata"]["tool_call_id"] == "toolu_3"
    assert ran == []
    assert [e.kind for e in store.events("toolu_3")] == ["refused"]
    message = openai.dispatch(chat("c4", "delete_repo", {"name": "prod"}), [delete_repo])
    assert json.loads(message["content"])["block_reason"] == "policy_violation"


@pytest.mark.parametrize("host", ["anthropic", "openai", "anthropic async"])
def test_a_refusal_the_tool_returns_as_its_value_reads_the_same_on_the_replay(host: str) -> None:
    # The tool ran and returned what a guarded call nested in it was given: a value, committed.
    store = InMemoryEffectStore()

    @Airlock(policy=SecurityPolicy(denied_tools=["inner"]))
    def inner() -> int:
        return 1

    runs: list[int] = []

    @guarded(store)
    def outer() -> Any:
        runs.append(1)
        return inner()

    def send() -> tuple[str, bool]:
        if host == "openai":
            return openai.dispatch(chat("c9", "outer", {}), [outer])["content"], False
        block = use("toolu_9", "outer", {})
        result = asyncio.run(anthropic.adispatch(block, [outer])) if "async" in host else \
            anthropic.dispatch(block, [outer])
        return result["content"], result["is_error"]

    first, replay = send(), send()
    assert runs == [1]
    assert first == replay
    assert first[1] is False
    assert json.loads(first[0])["block_reason"] == "policy_violation"
    call_id = "c9" if host == "openai" else "toolu_9"
    assert [e.kind for e in store.events(call_id)] == ["pending", "committed", "replayed"]


def test_a_refusal_of_a_tool_renamed_after_decoration_is_still_a_refusal() -> None:
    @Airlock(policy=SecurityPolicy(denied_tools=["charge"]))
    def charge(cents: int) -> int:
        return cents

    charge.__name__ = "pay"  # the host renamed the wrapper; the guard still calls it charge
    result = anthropic.dispatch(use("toolu_8", "pay", {"cents": 1}), {"pay": charge})
    assert result["is_error"] is True
    assert json.loads(result["content"])["block_reason"] == "policy_violation"


def test_bad_arguments_are_refused_under_on_block_raise_too() -> None:
    store = InMemoryEffectStore()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)), on_block="raise")
    def charge(cents: int) -> int:
        return cents

    result = anthropic.dispatch(use("toolu_4", "charge", {"euros": 1}), [charge])
    assert result["is_error"] is True
    assert json.loads(result["content"])["block_reason"] == "arguments_not_canonical"
    # The hint speaks of what the model got wrong, not of NaN and 64-bit integers.
    [hint] = json.loads(result["content"])["fix_hints"]
    assert "fits its parameters" in hint and "NaN" not in hint
    assert [e.kind for e in store.events("toolu_4")] == ["refused"]


def test_a_refusal_of_bad_arguments_journals_what_the_model_sent_not_the_defaults() -> None:
    store = InMemoryEffectStore()

    @guarded(store)
    def refund(account: str = "acct_default", cents: int = 100) -> str:
        return "refunded"

    sent = {"account": "acct_9", "cents": "lots"}
    results = {
        "r1": openai.dispatch({"id": "r1", "function": {"name": "refund", "arguments": "{not json"}}, [refund]),
        "r2": openai.dispatch(chat("r2", "refund", sent), [refund]),
        "r3": openai.dispatch(chat("r3", "refund", {**sent, "cents": 5, "note": "x"}), [refund]),
        "r4": openai.dispatch(chat("r4", "refund", ["acct_9", 5]), [refund]),
    }
    journaled = {e.call_id: (e.arguments, e.idempotency_key) for e in store.events() if e.kind == "refused"}
    key = idempotency_key("refund", sent)
    assert journaled["r1"] == (None, None)
    assert journaled["r2"] == ('{"account":"acct_9","cents":"lots"}', key)
    wrong_name = {**sent, "cents": 5, "note": "x"}
    assert journaled["r3"] == ('{"account":"acct_9","cents":5,"note":"x"}', idempotency_key("refund", wrong_name))
    assert journaled["r4"] == (None, None)  # not an object of named arguments
    keys = {call_id: json.loads(r["content"])["metadata"]["idempotency_key"] for call_id, r in results.items()}
    assert keys == {call_id: k for call_id, (_, k) in journaled.items()}
    assert idempotency_key("refund", {"account": "acct_default", "cents": 100}) not in keys.values()


def test_the_policy_refuses_before_the_arguments_are_looked_at() -> None:
    store = InMemoryEffectStore()
    policy = SecurityPolicy(denied_tools=["drop_table"], effect_guard=EffectGuard(store=store))

    @Airlock(policy=policy)
    def drop_table(name: str) -> str:
        return name

    @requires("payments:write")
    @Airlock(policy=policy)
    def refund(cents: int) -> int:
        return cents

    denied = json.loads(openai.dispatch({"id": "c7", "function": {"name": "drop_table", "arguments": "{oops"}},
                                        [drop_table])["content"])
    assert denied["block_reason"] == "policy_violation" and denied["metadata"]["violation_type"] == "tool_denied"
    lacking = json.loads(anthropic.dispatch(use("toolu_8", "refund", {"euros": 1}), [refund])["content"])
    assert lacking["block_reason"] == "capability_denied"
    assert lacking["metadata"]["missing_capabilities"] == ["payments:write"]
    assert [(e.call_id, e.reason["code"]) for e in store.events() if e.reason] == [
        ("c7", "policy_violation"), ("toolu_8", "capability_denied"),
    ]


def test_an_exception_is_an_error_result_released_so_the_retry_runs(caplog: pytest.LogCaptureFixture) -> None:
    store = InMemoryEffectStore()
    attempts: list[int] = []

    @guarded(store)
    def charge(cents: int) -> str:
        attempts.append(cents)
        if len(attempts) == 1:
            raise ValueError("card declined")
        return "charged"

    with caplog.at_level(logging.WARNING, logger="guard.adapters"):
        failed = anthropic.dispatch(use("toolu_5", "charge", {"cents": 9}), [charge])
    assert failed["is_error"] is True
    error = json.loads(failed["content"])
    assert error["error_type"] == "ValueError" and error["message"] == "card declined"
    assert "ValueError: card declined" in error["error"]
    assert any("charge" in r.getMessage() and r.exc_info for r in caplog.records)
    retried = anthropic.dispatch(use("toolu_5", "charge", {"cents": 9}), [charge])
    assert retried == {"type": "tool_result", "tool_use_id": "toolu_5", "content": '"charged"', "is_error": False}
    assert attempts == [9, 9]
    assert [e.kind for e in store.events("toolu_5")] == ["pending", "released", "pending", "committed"]


def test_an_interrupt_is_not_swallowed() -> None:
    store = InMemoryEffectStore()

    @guarded(store)
    def charge(cents: int) -> str:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        openai.dispatch(chat("c6", "charge", {"cents": 1}), [charge])
    assert [e.kind for e in store.events("c6")] == ["pending", "unknown"]


# -- the text the model reads ------------------------------------------------------------------


@dataclass
class Receipt:
    id: str
    lines: tuple[int, ...]


class Opaque:
    def __str__(self) -> str:
        return "<opaque 42>"


def test_values_are_json_and_a_replay_reads_exactly_as_the_first_call() -> None:
    store = InMemoryEffectStore()

    @guarded(store)
    def receipt() -> Receipt:
        return Receipt(id="r1", lines=(3, 4))

    @guarded(store)
    def greet() -> str:
        return "ok"

    @guarded(store)
    def nothing() -> None:
        return None

    texts = [openai.dispatch(chat(f"c-{n}-{i}", n, {}), [receipt, greet, nothing])["content"]
             for n in ("receipt", "greet", "nothing") for i in (1, 1)]
    assert texts == ['{"id":"r1","lines":[3,4]}'] * 2 + ['"ok"'] * 2 + ["null"] * 2
    assert [e.kind for e in store.events("c-receipt-1")] == ["pending", "committed", "replayed"]


def test_a_value_with_no_json_form_is_the_json_string_of_its_str_and_cannot_be_replayed() -> None:
    store = InMemoryEffectStore()

    @guarded(store)
    def handle() -> Opaque:
        return Opaque()

    first = anthropic.dispatch(use("toolu_6", "handle", {}), [handle])
    assert first == {"type": "tool_result", "tool_use_id": "toolu_6", "content": '"<opaque 42>"', "is_error": False}
    assert json.loads(first["content"]) == "<opaque 42>"  # the text is JSON, whatever the value
    again = anthropic.dispatch(use("toolu_6", "handle", {}), [handle])
    assert again["is_error"] is True
    assert json.loads(again["content"])["block_reason"] == "replay_value_unavailable"


class Flaky:
    """A value whose model_dump works for JSON and then fails: it has no JSON form to store."""

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        if mode == "json":
            return {"balance": None}
        raise RuntimeError("the connection behind this value is closed")

    def __str__(self) -> str:
        return "<balance of a closed connection>"


def test_a_value_whose_serialisation_raises_is_the_json_string_of_its_str() -> None:
    store = InMemoryEffectStore()
    runs: list[str] = []

    @guarded(store)
    def balance(account: str) -> Flaky:
        runs.append(account)
        return Flaky()

    first = anthropic.dispatch(use("toolu_7", "balance", {"account": "a"}), [balance])
    assert first == {"type": "tool_result", "tool_use_id": "toolu_7",
                     "content": '"<balance of a closed connection>"', "is_error": False}
    # A value with no JSON form: the call is committed without one, and a retry is refused.
    record = store.get("toolu_7")
    assert record.status == "committed" and record.value is None
    again = asyncio.run(openai.adispatch(chat("toolu_7", "balance", {"account": "a"}), [balance]))
    assert json.loads(again["content"])["block_reason"] == "replay_value_unavailable"
    assert runs == ["a"]


# A file name that is not UTF-8, as os.fsdecode() gives it on Linux: 'report-\udcff.txt'.
ODD_NAME = os.fsdecode(b"report-\xff.txt")


def readable(text: str) -> Any:
    """What a provider's SDK does with the text: encode it as UTF-8, and the model parses the JSON."""
    return json.loads(text.encode("utf-8"))


def test_a_value_with_a_lone_surrogate_reaches_the_model_escaped() -> None:
    @guarded()
    def list_files(folder: str) -> str:
        return ODD_NAME

    result = openai.dispatch(chat("c1", "list_files", {"folder": "/tmp"}), [list_files])
    assert readable(result["content"]) == "report-\\udcff.txt"


def test_a_dict_with_a_lone_surrogate_is_the_json_string_of_its_str_and_cannot_be_replayed(store: Any) -> None:
    @guarded(store)
    def list_files(folder: str) -> dict[str, list[str]]:
        return {"files": [ODD_NAME]}

    first = openai.dispatch(chat("c1", "list_files", {"folder": "/tmp"}), [list_files])
    assert readable(first["content"]) == "{'files': ['report-\\udcff.txt']}"  # a string, not an object
    record = store.get("c1")
    assert record.status == "committed" and record.value is None
    again = openai.dispatch(chat("c1", "list_files", {"folder": "/tmp"}), [list_files])
    assert readable(again["content"])["block_reason"] == "replay_value_unavailable"


def test_an_exception_with_a_lone_surrogate_is_an_error_result() -> None:
    store = InMemoryEffectStore()

    @guarded(store)
    def open_file(path: str) -> str:
        raise FileNotFoundError(f"no such file: {ODD_NAME}")

    result = anthropic.dispatch(use("toolu_1", "open_file", {"path": "x"}), [open_file])
    assert result["is_error"] is True
    error = readable(result["content"])
    assert error["error_type"] == "FileNotFoundError"
    assert error["message"] == "no such file: report-\\udcff.txt"
    assert [e.kind for e in store.events("toolu_1")] == ["pending", "released"]


def test_an_exception_whose_str_fails_is_an_error_result() -> None:
    class BackendError(Exception):
        def __str__(self) -> str:
            raise KeyError("msg")

    @guarded()
    def charge(cents: int) -> str:
        raise BackendError()

    result = anthropic.dispatch(use("toolu_2", "charge", {"cents": 1}), [charge])
    assert result["is_error"] is True
    assert readable(result["content"])["message"] == "<unprintable BackendError>"


def test_an_unknown_tool_name_with_a_lone_surrogate_is_refused_in_json() -> None:
    @guarded()
    def charge(cents: int) -> int:
        return cents

    odd = "charge" + ODD_NAME[-5]  # 'charge\udcff'
    result = openai.dispatch({"id": "c2", "function": {"name": odd, "arguments": "{}"}}, [charge])
    refusal = readable(result["content"])
    assert refusal["block_reason"] == "policy_violation" and refusal["metadata"]["tool"] == "charge\\udcff"


def test_a_refusal_naming_a_lone_surrogate_is_journaled_on_every_store(store: Any) -> None:
    @requires("admin")
    @guarded(store)
    def charge(cents: int) -> int:
        return cents

    odd_name, odd_id = "charge" + ODD_NAME[-5], "call_" + ODD_NAME[-5]
    unknown = openai.dispatch({"id": odd_id, "function": {"name": odd_name, "arguments": "{}"}}, [charge],
                              agent_id="agent-" + ODD_NAME[-5])
    assert readable(unknown["content"])["metadata"]["violation_type"] == "unknown_tool"
    denied = anthropic.dispatch(use(odd_id, "charge", {"cents": 1}), [charge])
    assert readable(denied["content"])["block_reason"] == "capability_denied"
    # Each refusal is one refused event, its name and ids kept as the model reads them.
    events = store_events(store)
    assert [(e.kind, e.tool, e.call_id, e.reason["code"]) for e in events] == [
        ("refused", "charge\\udcff", "agent:%call_%uDCFF", "policy_violation"),
        ("refused", "charge", "agent:%call_%uDCFF", "capability_denied"),
    ]
    assert events[0].agent_id == "agent-\\udcff"


def test_adispatch_awaits_an_awaitable_a_def_tool_returns() -> None:
    store = InMemoryEffectStore()

    async def later() -> str:
        return "sent"

    @guarded(store)
    def send() -> Any:
        return later()

    result = asyncio.run(anthropic.adispatch(use("toolu_7", "send", {}), [send]))
    assert result["content"] == '"sent"' and result["is_error"] is False
    # The guard saw a deferred result: the call's effect is in doubt, so it is not replayed.
    assert [e.kind for e in store.events("toolu_7")] == ["pending", "unknown"]


def test_simultaneous_deliveries_of_one_tool_call_run_it_once() -> None:
    store = InMemoryEffectStore()
    ran: list[int] = []
    barrier = threading.Barrier(4)

    @guarded(store)
    def charge(cents: int) -> str:
        ran.append(cents)
        time.sleep(0.2)
        return "charged"

    results: list[dict[str, Any]] = []

    def deliver() -> None:
        barrier.wait()
        results.append(openai.dispatch(chat("c-dup", "charge", {"cents": 5}), [charge]))

    threads = [threading.Thread(target=deliver) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ran == [5]
    assert len(results) == 4
    contents = sorted(r["content"] for r in results)
    assert contents.count('"charged"') == 1
    assert all(json.loads(c)["block_reason"] == "effect_status_unknown" for c in contents if c != '"charged"')


@reversibility("reversible")
@guarded()
def lookup(sku: str) -> int:
    return len(sku)


def test_the_adapters_import_and_dispatch_without_any_sdk_installed() -> None:
    script = """
import sys
for name in ("openai", "anthropic", "mcp", "pydantic"):
    sys.modules[name] = None  # an import of any of them now fails
import guard.adapters
from guard.adapters import anthropic, mcp, openai
from tests.test_adapters_core import lookup
print(openai.dispatch({"id": "c", "function": {"name": "lookup", "arguments": '{"sku": "abc"}'}}, [lookup])["content"])
block = {"type": "tool_use", "id": "t", "name": "lookup", "input": {"sku": "ab"}}
print(anthropic.dispatch(block, [lookup])["content"])
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "2"]


# -- the types the annotations promise ---------------------------------------------------------


def test_arguments_of_the_wrong_type_are_refused_and_the_tool_not_run() -> None:
    store = InMemoryEffectStore()
    ran: list[Any] = []

    @guarded(store)
    def charge(account: str, cents: int, memo: str | None = None) -> str:
        ran.append((account, cents, memo))
        return "ok"

    reply = openai.dispatch(chat("call_t1", "charge", {"account": "a", "cents": "lots"}), [charge])
    refusal = json.loads(reply["content"])
    assert refusal["block_reason"] == "arguments_not_canonical"
    assert "'cents'" in refusal["error"] and "integer" in refusal["error"]
    assert ran == [] and [e.kind for e in store.events()] == ["refused"]
    # A value the type takes as it is, and a parameter left at its default (null for None), run.
    assert openai.dispatch(chat("call_t2", "charge", {"account": "a", "cents": 5, "memo": None}),
                           [charge])["content"] == '"ok"'
    assert ran == [("a", 5, None)]


try:
    import pydantic
except ImportError:  # a test below imports this module with every SDK (and pydantic) hidden
    pydantic = None
else:
    class Address(pydantic.BaseModel):
        city: str
        postcode: str


def test_an_integer_beyond_64_bits_is_not_rounded_into_another_call() -> None:
    store = InMemoryEffectStore()
    got: list[Any] = []

    @guarded(store)
    def transfer(units: Any) -> str:
        got.append(units)
        return "sent"

    @reversibility("reversible")
    @guarded(store)
    def quote(units: Any, note: str) -> str:
        got.append(units)
        return "quoted"

    def block(call_id: str, text: str) -> dict[str, Any]:
        return {"type": "tool_use", "id": call_id, "name": "transfer", "input": text}

    for units in ("18446744073709551617", "18446744073709551616", "-9223372036854775809"):
        refusal = json.loads(anthropic.dispatch(block("toolu_9", f'{{"units": {units}}}'), [transfer])["content"])
        assert refusal["block_reason"] == "arguments_not_canonical" and "64-bit" in refusal["error"]
    assert got == [] and store.get("toolu_9") is None  # nothing ran, so the id is still unused
    # The largest integer orjson reads exactly is keyed and passed as it is.
    assert anthropic.dispatch(block("toolu_10", '{"units": 18446744073709551615}'), [transfer])["content"] == '"sent"'
    assert got == [18446744073709551615]
    # A reversible tool called without an id needs no key: it gets the exact integer, never a float.
    text = b'{"units": 18446744073709551617, "note": "0000000000000000000"}'
    outcome = _dispatch.dispatch([quote], "quote", None, text)
    assert outcome.text == '"quoted"' and got[-1] == 18446744073709551617


def test_a_json_object_is_checked_against_the_model_its_parameter_names() -> None:
    seen: list[Any] = []

    @guarded()
    def ship(order: str, to: Address) -> str:
        seen.append(to)
        return to["city"]  # type: ignore[index]

    result = anthropic.dispatch(use("toolu_m1", "ship", {"order": "o1", "to": {"city": "Oslo", "postcode": "0150"}}),
                                [ship])
    assert result["is_error"] is False and json.loads(result["content"]) == "Oslo"
    assert seen == [{"city": "Oslo", "postcode": "0150"}]  # checked, and passed on as the model sent it
    bad = anthropic.dispatch(use("toolu_m2", "ship", {"order": "o1", "to": {"city": "Oslo"}}), [ship])
    assert bad["is_error"] is True and "'to'" in json.loads(bad["content"])["error"]


def test_checked_arguments_keep_the_key_of_what_the_model_sent() -> None:
    # A float parameter sent 5, a Decimal sent 12.5: the tool gets them as sent, so the key is the
    # one a direct call with the same JSON values makes, and a value pydantic would turn into an
    # object with no JSON form (a Decimal, a set) does not make the call unkeyable.
    from decimal import Decimal

    store = InMemoryEffectStore()
    got: list[Any] = []

    @guarded(store)
    def pay(amount: float, fee: Decimal, tags: set[str]) -> str:
        got.append((amount, fee, tags))
        return "paid"

    reply = openai.dispatch(chat("call_k1", "pay", {"amount": 5, "fee": 12.5, "tags": ["a"]}), [pay])
    assert reply["content"] == '"paid"'
    assert got == [(5, 12.5, ["a"])] and type(got[0][0]) is int
    with AirlockContext(metadata={"tool_call_id": "direct"}):
        pay(5, 12.5, ["a"])  # type: ignore[arg-type]
    assert store.get("call_k1").idempotency_key == store.get("direct").idempotency_key  # type: ignore[union-attr]


def test_an_annotation_that_does_not_resolve_leaves_only_its_own_parameter_unchecked() -> None:
    class Local:  # a name local to this function: the tool's annotation cannot be resolved
        pass

    ran: list[Any] = []

    @guarded()
    def tag(item: Local, weight: int) -> str:
        ran.append((item, weight))
        return "ok"

    assert json.loads(openai.dispatch(chat("call_u1", "tag", {"item": "x", "weight": "heavy"}),
                                      [tag])["content"])["block_reason"] == "arguments_not_canonical"
    assert openai.dispatch(chat("call_u2", "tag", {"item": "x", "weight": 3}), [tag])["content"] == '"ok"'
    assert ran == [("x", 3)]


def test_a_tool_with_positional_only_parameters_cannot_be_offered_to_a_model() -> None:
    @guarded()
    def scale(factor: int, /, by: int) -> int:
        return factor * by

    with pytest.raises(TypeError, match=r"positional-only parameters \(factor\)"):
        openai.dispatch(chat("call_p1", "scale", {"by": 2}), [scale])


# -- what a model or a host may send that is odd --------------------------------------------------


def test_arguments_nested_deeper_than_python_reads_with_a_long_number_are_an_error_result() -> None:
    # A run of 19 digits makes the adapter read the text again with the standard library (to keep a
    # big integer exact), which stops near Python's recursion limit where orjson goes on to 1024 (on
    # Python 3.11; 3.13 reads it, and the key's JSON form then stops at orjson's 254 levels).
    store = InMemoryEffectStore()
    ran: list[str] = []

    @guarded(store)
    def note(text: str, tags: Any = None) -> str:
        ran.append(text)
        return text

    deep = '{"text": "order 1234567890123456789", "tags": ' + "[" * 1000 + "]" * 1000 + "}"
    chat_reply = openai.dispatch({"id": "call_d", "function": {"name": "note", "arguments": deep}}, [note])
    block_reply = anthropic.dispatch({"type": "tool_use", "id": "toolu_d", "name": "note", "input": deep}, [note])
    for reply, call_id in ((json.loads(chat_reply["content"]), "call_d"),
                           (json.loads(block_reply["content"]), "toolu_d")):
        assert reply["block_reason"] == "arguments_not_canonical"
        assert re.search(r"nests? arrays or objects (too deeply|more than 254 levels deep)", reply["error"])
        assert [e.kind for e in store.events(call_id)] == ["refused"]
    assert block_reply["is_error"] is True and ran == []


def test_a_nested_call_refused_by_raising_is_an_exception_of_the_tool_not_its_refusal() -> None:
    store = InMemoryEffectStore()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)), on_block="raise")
    def send_email(to: str) -> str:
        return "sent"

    @guarded(store)
    def notify(to: str) -> str:
        return send_email(to)  # no tool call id of its own: refused, by raising AirlockBlocked

    reply = anthropic.dispatch(use("toolu_n", "notify", {"to": "a@example.com"}), [notify])
    shown = json.loads(reply["content"])
    assert reply["is_error"] is True
    assert shown["status"] == "error" and shown["error_type"] == "AirlockBlocked"
    assert shown["error"].startswith("The tool 'notify' failed with AirlockBlocked: The tool 'send_email' ")
    assert [e.kind for e in store.events("toolu_n")] == ["pending", "released"]  # notify ran, and raised

    @Airlock(policy=SecurityPolicy(denied_tools=["charge"], effect_guard=EffectGuard(store=store)), on_block="raise")
    def charge(cents: int) -> int:
        return cents

    refused = json.loads(openai.dispatch(chat("call_r", "charge", {"cents": 5}), [charge])["content"])
    assert refused["status"] == "blocked" and refused["block_reason"] == "policy_violation"  # its own refusal


def test_an_empty_tool_name_is_an_unknown_tool_and_a_missing_one_a_host_error() -> None:
    store = InMemoryEffectStore()

    @guarded(store)
    def charge(cents: int) -> int:
        return cents

    replies = [
        json.loads(openai.dispatch({"id": "call_e", "function": {"name": "", "arguments": "{}"}}, [charge])["content"]),
        json.loads(anthropic.dispatch(use("toolu_e", "", {}), [charge])["content"]),
    ]
    for reply in replies:
        assert reply["block_reason"] == "policy_violation" and reply["metadata"]["violation_type"] == "unknown_tool"
    assert [e.kind for e in store.events()] == ["refused", "refused"]
    with pytest.raises(ValueError, match="names no function"):
        openai.dispatch({"type": "function_call", "call_id": "c", "arguments": "{}"}, [charge])
    with pytest.raises(TypeError, match="names its tool by a string, not int"):
        anthropic.dispatch({"type": "tool_use", "id": "toolu_7", "name": 7, "input": {}}, [charge])


@pytest.mark.parametrize("item", [
    {"type": "function_call", "name": "charge", "arguments": "{}"},
    {"type": "function_call", "call_id": None, "name": "charge", "arguments": "{}"},
])
def test_a_responses_item_without_its_call_id_is_a_missing_id(item: dict[str, Any]) -> None:
    @guarded()
    def charge(cents: int) -> int:
        return cents

    with pytest.raises(ValueError, match="the function_call item has no id"):
        openai.dispatch(item, [charge])


@pytest.mark.parametrize("block", [42, "tool_use", [1], None])
def test_what_is_no_tool_use_block_at_all_is_a_type_error(block: Any) -> None:
    @guarded()
    def charge(cents: int) -> int:
        return cents

    with pytest.raises(TypeError, match="expected a tool_use block"):
        anthropic.dispatch(block, [charge])
