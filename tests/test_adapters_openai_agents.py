"""guard.adapters.openai_agents: guarded tools as the Agents SDK's FunctionTool, keyed on
ToolContext.tool_call_id, driven through the real Runner by the SDK's own ScriptedModel."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, FunctionTool, RunContextWrapper, Runner, set_tracing_disabled
from agents.items import ToolCallOutputItem
from agents.run_state import RunState
from agents.testing import ScriptedModel, assistant_message, function_call

from guard import Airlock, SecurityPolicy, get_current_context
from guard.adapters.openai_agents import guarded_function_tool
from guard.effect_guard import EffectGuard, InMemoryEffectStore
from journal import SQLiteJournal
from tests.docs_examples import docs_examples

set_tracing_disabled(True)  # no trace is exported anywhere from a test run


class Bank:
    """The backend: charges are the effects, counted outside the guard."""

    def __init__(self) -> None:
        self.charges: list[tuple[str, int]] = []

    def charge(self, account: str, cents: int) -> dict[str, Any]:
        self.charges.append((account, cents))
        return {"charge_id": f"ch_{len(self.charges)}", "cents": cents, "legs": ("auth", "capture")}


def outputs(result: Any) -> dict[str, Any]:
    """The text each tool call's output item carries to the model, by call id."""
    return {item.call_id: item.raw_item["output"] for item in result.new_items if isinstance(item, ToolCallOutputItem)}


def agent(tools: list[Any], *steps: list[Any]) -> Agent[Any]:
    return Agent(name="payments", instructions="Charge as asked.", tools=tools, model=ScriptedModel(list(steps)))


def test_the_same_call_id_in_a_second_run_replays_the_first_output(tmp_path: Path) -> None:
    bank = Bank()
    journal = SQLiteJournal(tmp_path / "journal.db")

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        """Charge an account."""
        return bank.charge(account, cents)

    tool = guarded_function_tool(charge)
    assert isinstance(tool, FunctionTool) and tool.name == "charge"
    assert tool.description == "Charge an account."
    assert set(tool.params_json_schema["properties"]) == {"account", "cents"}
    runs = []
    try:
        for _ in range(2):  # the host lost the first run's output and runs the turn again
            runs.append(Runner.run_sync(agent(
                [tool],
                [function_call("charge", {"account": "acct_1", "cents": 500}, call_id="fc_1")],
                [assistant_message("Charged.")],
            ), "Charge acct_1 five dollars."))
        first, again = (outputs(r)["fc_1"] for r in runs)
        assert again == first
        # The SDK renders a value with str(); the adapter hands it the value's JSON form, which a
        # replay returns too, so both read alike (a tuple is a list, keys sorted).
        assert first == str({"cents": 500, "charge_id": "ch_1", "legs": ["auth", "capture"]})
        assert bank.charges == [("acct_1", 500)]
        assert [e.kind for e in journal.events(call_id="fc_1")] == ["pending", "committed", "replayed"]
    finally:
        journal.close()


def test_a_resumed_run_state_does_not_charge_again() -> None:
    """A run paused for approval is saved; it is resumed, the tool runs, and the process dies before
    the result is saved: resuming the same saved state again replays the call."""
    store, bank = InMemoryEffectStore(), Bank()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        """Charge an account."""
        return bank.charge(account, cents)

    tool = guarded_function_tool(charge, needs_approval=True)

    async def scenario() -> list[str]:
        model = ScriptedModel([[function_call("charge", {"account": "acct_2", "cents": 700}, call_id="fc_2")],
                               [assistant_message("Charged.")], [assistant_message("Charged.")]])
        payments = Agent(name="payments", tools=[tool], model=model)
        paused = await Runner.run(payments, "Charge acct_2 seven dollars.")
        [approval] = paused.interruptions
        state = paused.to_state()
        state.approve(approval)
        saved = state.to_string()
        texts = []
        for _ in range(2):
            resumed = await Runner.run(payments, await RunState.from_string(payments, saved))
            texts.append(outputs(resumed)["fc_2"])
        return texts

    first, again = asyncio.run(scenario())
    assert again == first and "'charge_id': 'ch_1'" in first
    assert bank.charges == [("acct_2", 700)]
    assert [e.kind for e in store.events("fc_2")] == ["pending", "committed", "replayed"]


@pytest.mark.parametrize("on_block", ["return", "raise"])
def test_a_refusal_reaches_the_model_as_an_error_with_its_fix_hints(on_block: str) -> None:
    store, bank = InMemoryEffectStore(), Bank()
    policy = SecurityPolicy(escalate_tools={"charge": "charges need a person"}, effect_guard=EffectGuard(store=store))

    @Airlock(policy=policy, on_block=on_block)  # type: ignore[arg-type]
    def charge(account: str, cents: int) -> dict[str, Any]:
        """Charge an account."""
        return bank.charge(account, cents)

    model = ScriptedModel([[function_call("charge", {"account": "acct_3", "cents": 5}, call_id="fc_3")],
                           [assistant_message("I need approval first.")]])
    result = Runner.run_sync(Agent(name="payments", tools=[guarded_function_tool(charge)], model=model), "Pay.")
    refusal = json.loads(outputs(result)["fc_3"])
    assert refusal["success"] is False and refusal["block_reason"] == "escalation_required"
    assert refusal["error"] and refusal["fix_hints"]
    # The text is what the model read in its next turn, as the function call's output.
    [read] = [i for i in model.calls[1].input if isinstance(i, dict) and i.get("type") == "function_call_output"]
    assert json.loads(read["output"]) == refusal
    assert result.final_output == "I need approval first."
    assert bank.charges == []
    assert [e.kind for e in store.events("fc_3")] == ["refused"]


def test_async_tools_run_under_the_call_id_and_replay() -> None:
    store, bank = InMemoryEffectStore(), Bank()
    seen: list[str | None] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    async def acharge(account: str, cents: int) -> dict[str, Any]:
        """Charge an account."""
        await asyncio.sleep(0)
        ctx = get_current_context()
        seen.append(ctx.tool_call_id if ctx else None)
        return bank.charge(account, cents)

    tool = guarded_function_tool(acharge, name_override="charge_async", agent_id="billing")
    assert tool.name == "charge_async"

    async def scenario() -> list[str]:
        texts = []
        for _ in range(2):
            result = await Runner.run(agent([tool], [function_call("charge_async", {"account": "a", "cents": 9},
                                                                   call_id="fc_4")],
                                            [assistant_message("ok")]), "Pay.")
            texts.append(outputs(result)["fc_4"])
        return texts

    first, again = asyncio.run(scenario())
    assert first == again and "'charge_id': 'ch_1'" in first
    assert seen == ["fc_4"]
    assert bank.charges == [("a", 9)]
    assert {e.agent_id for e in store.events("fc_4")} == {"billing"}


def test_an_exception_goes_to_the_sdks_failure_function_and_the_call_may_run_again() -> None:
    store = InMemoryEffectStore()
    attempts: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def charge(cents: int) -> str:
        """Charge."""
        attempts.append(cents)
        if len(attempts) == 1:
            raise ValueError("card declined")
        return "charged"

    def explain(ctx: RunContextWrapper[Any], error: Exception) -> str:
        return f"failed: {error}"

    tool = guarded_function_tool(charge, failure_error_function=explain)
    texts = [outputs(Runner.run_sync(agent([tool], [function_call("charge", {"cents": 5}, call_id="fc_5")],
                                           [assistant_message("ok")]), "Pay."))["fc_5"] for _ in range(2)]
    assert texts == ["failed: card declined", "charged"]
    assert attempts == [5, 5]
    assert [e.kind for e in store.events("fc_5")] == ["pending", "released", "pending", "committed"]


def test_only_guarded_functions_without_the_sdk_context_are_accepted() -> None:
    def plain(cents: int) -> str:
        return "ok"

    with pytest.raises(TypeError, match="not decorated with @Airlock"):
        guarded_function_tool(plain)

    @Airlock(policy=SecurityPolicy())
    def with_context(ctx: RunContextWrapper[Any], cents: int) -> str:
        return "ok"

    with pytest.raises(TypeError, match=r"guard\.get_current_context"):
        guarded_function_tool(with_context)


def test_the_docs_example_runs_and_charges_once(tmp_path: Path) -> None:
    [code] = docs_examples("The OpenAI Agents SDK")
    (tmp_path / "example.py").write_text(code)
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
                                            "OPENAI_AGENTS_DISABLE_TRACING": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["{'cents': 500, 'charge_id': 'ch_1'}"] * 2 + ["[('acct_1', 500)]"]
