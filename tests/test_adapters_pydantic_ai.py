"""The Pydantic AI adapter, driven by the framework's own ``TestModel`` and ``FunctionModel``: one
tool call id runs its tool once, across a resumed history and a crashed process; a refusal is a
failed tool result the model reads; ``TestModel``'s reused ids never hand one run another's value."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.toolsets import FunctionToolset

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context
from guard.adapters.pydantic_ai import AirlockToolset, asking_run, reused_by_test_model
from guard.effect_guard import EffectGuard, InMemoryEffectStore
from journal import SQLiteJournal

ROOT = Path(__file__).resolve().parents[1]


class Payments:
    """A payment backend that counts its charges, by the tool call id the guard ran each under."""

    def __init__(self) -> None:
        self.charges: list[str | None] = []

    def charge(self, account: str, cents: int) -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        self.charges.append(context.tool_call_id)
        return {"charge_id": f"ch_{len(self.charges)}", "account": account, "cents": cents}


def charge_tool(payments: Payments, store: Any, **options: Any) -> Callable[..., Any]:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store, **options)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        """Charge an account; not reversible."""
        return payments.charge(account, cents)

    return charge


def answers(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    """The tool results the model was sent in the last request."""
    last = messages[-1]
    assert isinstance(last, ModelRequest)
    return [p for p in last.parts if isinstance(p, ToolReturnPart)]


def calling(
    tool: str, args: dict[str, Any], tool_call_id: str, seen: list[ToolReturnPart] | None = None
) -> FunctionModel:
    """A model that asks for one tool call, then ends with the text of what it was sent back."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
            returned = answers(messages)
            if seen is not None:
                seen.extend(returned)
            return ModelResponse(parts=[TextPart(orjson.dumps([r.content for r in returned]).decode())])
        return ModelResponse(parts=[ToolCallPart(tool, args, tool_call_id=tool_call_id)])

    return FunctionModel(model)


# -- one id, one effect ---------------------------------------------------------------------------


def test_a_tool_call_runs_under_the_frameworks_id() -> None:
    payments = Payments()
    charge = charge_tool(payments, InMemoryEffectStore())
    agent = Agent(calling("charge", {"account": "acc_1", "cents": 500}, "call_abc"),
                  toolsets=[AirlockToolset(FunctionToolset([charge]))])
    result = agent.run_sync("charge acc_1 five dollars")
    assert payments.charges == ["call_abc"]
    assert orjson.loads(result.output) == [{"charge_id": "ch_1", "account": "acc_1", "cents": 500}]


def test_a_resumed_history_does_not_run_the_tool_again(tmp_path: Path) -> None:
    payments = Payments()
    journal = SQLiteJournal(tmp_path / "j.db")
    charge = charge_tool(payments, journal)
    seen: list[ToolReturnPart] = []
    agent = Agent(calling("charge", {"account": "acc_1", "cents": 500}, "call_abc", seen),
                  toolsets=[AirlockToolset(FunctionToolset([charge]))])
    first = agent.run_sync("charge acc_1")
    # The result was lost: the host saved the history up to the model's request for the call.
    saved = first.all_messages()[:2]
    assert isinstance(saved[-1], ModelResponse)
    second = agent.run_sync(None, message_history=saved)
    assert payments.charges == ["call_abc"]
    assert orjson.loads(second.output) == orjson.loads(first.output)  # the value, as the journal keeps it
    assert [r.outcome for r in seen] == ["success", "success"]
    assert [e.kind for e in journal.call_events("call_abc")] == ["pending", "committed", "replayed"]
    journal.close()


def test_an_async_tool_is_guarded_the_same_way() -> None:
    payments = Payments()
    store = InMemoryEffectStore()

    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store)))
    async def charge(account: str, cents: int) -> dict[str, Any]:
        await asyncio.sleep(0)
        return payments.charge(account, cents)

    agent = Agent(calling("charge", {"account": "acc_1", "cents": 500}, "call_async"),
                  toolsets=[AirlockToolset(FunctionToolset([charge]))])

    async def twice() -> tuple[str, str]:
        first = await agent.run("charge")
        again = await agent.run(None, message_history=first.all_messages()[:2])
        return first.output, again.output

    first, again = asyncio.run(twice())
    assert orjson.loads(first) == orjson.loads(again) and payments.charges == ["call_async"]


def test_parallel_calls_of_one_response_each_run_under_their_own_id() -> None:
    payments = Payments()
    store = InMemoryEffectStore()
    charge = charge_tool(payments, store)

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if isinstance(messages[-1], ModelRequest) and answers(messages):
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[
            ToolCallPart("charge", {"account": "acc_1", "cents": 100}, tool_call_id="call_a"),
            ToolCallPart("charge", {"account": "acc_2", "cents": 200}, tool_call_id="call_b"),
        ])

    agent = Agent(FunctionModel(model), toolsets=[AirlockToolset(FunctionToolset([charge]))])
    first = agent.run_sync("charge both")
    assert sorted(payments.charges) == ["call_a", "call_b"]
    agent.run_sync(None, message_history=first.all_messages()[:2])
    assert sorted(payments.charges) == ["call_a", "call_b"]
    assert {store.records()[c].arguments for c in ("call_a", "call_b")} == {
        '{"account":"acc_1","cents":100}', '{"account":"acc_2","cents":200}'}


# -- TestModel's reused ids -----------------------------------------------------------------------


def test_test_models_id_is_scoped_by_its_run_so_a_second_run_is_a_new_call() -> None:
    payments = Payments()
    store = InMemoryEffectStore()
    charge = charge_tool(payments, store)
    agent = Agent(TestModel(), toolsets=[AirlockToolset(FunctionToolset([charge]))])
    first = agent.run_sync("charge")
    second = agent.run_sync("charge")
    # Both runs asked for pyd_ai_tool_call_id__charge; the second got its own charge, not the first's.
    assert orjson.loads(first.output)["charge"]["charge_id"] == "ch_1"
    assert orjson.loads(second.output)["charge"]["charge_id"] == "ch_2"
    assert len(payments.charges) == 2 and payments.charges[0] != payments.charges[1]
    assert all(c is not None and c.startswith("run:") and c.endswith("/pyd_ai_tool_call_id__charge")
               for c in payments.charges)
    assert sorted(store.records()) == sorted(payments.charges)


def test_test_models_resumed_history_keeps_its_runs_id() -> None:
    payments = Payments()
    store = InMemoryEffectStore()
    charge = charge_tool(payments, store)
    agent = Agent(TestModel(), toolsets=[AirlockToolset(FunctionToolset([charge]))])
    first = agent.run_sync("charge")
    resumed = agent.run_sync(None, message_history=first.all_messages()[:2])
    assert orjson.loads(resumed.output) == orjson.loads(first.output)
    assert len(payments.charges) == 1
    (call_id,) = store.records()
    assert [e.kind for e in store.events(call_id)] == ["pending", "committed", "replayed"]


def test_run_scoping_follows_the_run_of_the_response_that_asked() -> None:
    response = ModelResponse(parts=[ToolCallPart("charge", {}, tool_call_id="pyd_ai_tool_call_id__charge")],
                             run_id="run-1")
    later = ModelResponse(parts=[TextPart("done")], run_id="run-2")
    assert asking_run([response, later], "pyd_ai_tool_call_id__charge") == "run-1"
    assert asking_run([later], "pyd_ai_tool_call_id__charge") is None
    assert reused_by_test_model("pyd_ai_tool_call_id__charge")
    assert not reused_by_test_model("call_abc") and not reused_by_test_model("pyd_ai_0af1")


def test_every_id_can_be_scoped_for_a_model_that_reuses_its_own() -> None:
    payments = Payments()
    charge = charge_tool(payments, InMemoryEffectStore())
    # A local server that numbers its calls call_0, call_1, ... afresh in every run.
    agent = Agent(calling("charge", {"account": "acc_1", "cents": 500}, "call_0"),
                  toolsets=[AirlockToolset(FunctionToolset([charge]), run_scoped=lambda _: True)])
    agent.run_sync("charge")
    agent.run_sync("charge")
    assert len(payments.charges) == 2


# -- refusals -------------------------------------------------------------------------------------


def test_a_refusal_is_a_failed_tool_result_the_model_reads() -> None:
    payments = Payments()
    store = InMemoryEffectStore()
    charge = charge_tool(payments, store)
    with AirlockContext(metadata={"tool_call_id": "call_abc"}):
        charge("acc_1", 500)  # call_abc was a charge of 500 already
    seen: list[ToolReturnPart] = []
    agent = Agent(calling("charge", {"account": "acc_1", "cents": 900}, "call_abc", seen),
                  toolsets=[AirlockToolset(FunctionToolset([charge]))])
    result = agent.run_sync("charge")
    (answer,) = seen
    assert answer.outcome == "failed"  # the provider's error channel, never a success
    refusal = orjson.loads(answer.content)
    assert refusal["block_reason"] == "policy_violation" and refusal["status"] == "blocked"
    assert refusal["error"] and refusal["fix_hints"]
    assert orjson.loads(result.output) == [answer.content]
    assert payments.charges == ["call_abc"]


def test_a_call_in_doubt_is_refused_to_the_model_not_run() -> None:
    store = InMemoryEffectStore()
    attempts: list[str | None] = []

    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store)), on_block="raise")
    def transfer(to: str, cents: int) -> str:
        context = get_current_context()
        assert context is not None
        attempts.append(context.tool_call_id)
        raise TimeoutError("the bank did not answer")

    with AirlockContext(metadata={"tool_call_id": "call_t"}), pytest.raises(TimeoutError):
        transfer("bob", 100)
    seen: list[ToolReturnPart] = []
    agent = Agent(calling("transfer", {"to": "bob", "cents": 100}, "call_t", seen),
                  toolsets=[AirlockToolset(FunctionToolset([transfer]))])
    agent.run_sync("pay bob")
    (answer,) = seen
    assert answer.outcome == "failed"
    refusal = orjson.loads(answer.content)
    assert refusal["block_reason"] == "effect_status_unknown"
    assert any("Do not retry" in hint for hint in refusal["fix_hints"])
    assert attempts == ["call_t"]


def test_a_re_planned_copy_gets_the_earlier_value(tmp_path: Path) -> None:
    payments = Payments()
    journal = SQLiteJournal(tmp_path / "j.db")
    charge = charge_tool(payments, journal, duplicate_window=300)
    toolset = AirlockToolset(FunctionToolset([charge]), agent_id="support-bot")
    first = Agent(calling("charge", {"account": "acc_1", "cents": 500}, "call_1"), toolsets=[toolset])
    again = Agent(calling("charge", {"account": "acc_1", "cents": 500}, "call_2"), toolsets=[toolset])
    assert orjson.loads(first.run_sync("charge").output) == orjson.loads(again.run_sync("charge again").output)
    assert payments.charges == ["call_1"]
    (copy,) = journal.call_events("call_2")
    assert copy.kind == "replayed" and copy.reason == {"code": "duplicate_of", "message": "call_1"}
    journal.close()


def test_the_agent_id_may_come_from_the_run_context() -> None:
    payments = Payments()
    store = InMemoryEffectStore()
    charge = charge_tool(payments, store, id_scope="agent")
    toolset: AirlockToolset[str] = AirlockToolset(FunctionToolset([charge]), agent_id=lambda ctx: ctx.deps)
    agent = Agent(calling("charge", {"account": "acc_1", "cents": 500}, "call_1"), deps_type=str,
                  toolsets=[toolset])
    agent.run_sync("charge", deps="user-a")
    agent.run_sync("charge", deps="user-b")
    assert len(payments.charges) == 2  # one id, two users: two calls
    assert sorted(store.records()) == ["agent:user-a/call_1", "agent:user-b/call_1"]


# -- what it refuses to wrap ----------------------------------------------------------------------


def test_an_unguarded_tool_is_refused_when_wrapped() -> None:
    def plain(account: str) -> str:
        return account

    with pytest.raises(TypeError, match="not decorated with @Airlock"):
        AirlockToolset(FunctionToolset([plain]))


def test_a_guarded_tool_that_takes_the_run_context_is_refused() -> None:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard()))
    def with_context(ctx: RunContext[None], account: str) -> str:
        return account

    with pytest.raises(TypeError, match="takes a RunContext"):
        AirlockToolset(FunctionToolset([with_context]))


def test_a_tool_added_after_wrapping_is_checked_when_the_agent_lists_the_tools() -> None:
    functions: FunctionToolset[None] = FunctionToolset([])
    agent = Agent(TestModel(), toolsets=[AirlockToolset(functions)])

    @functions.tool_plain
    def plain(account: str) -> str:
        return account

    with pytest.raises(TypeError, match="not decorated with @Airlock"):
        agent.run_sync("go")


def test_importing_the_adapters_imports_no_framework() -> None:
    code = ("import sys, guard.adapters, guard.adapters.pydantic_ai; "
            "assert 'pydantic_ai' not in sys.modules, 'imported'; "
            "from guard.adapters.pydantic_ai import AirlockToolset; assert 'pydantic_ai' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
    # Without Pydantic AI installed, the adapter says what to install.
    missing = ("import sys; sys.modules['pydantic_ai'] = None\n"
               "try:\n    from guard.adapters.pydantic_ai import AirlockToolset\n"
               "except ImportError as e:\n    print(e)")
    said = subprocess.run([sys.executable, "-c", missing], check=True, cwd=ROOT, timeout=120,
                          capture_output=True, text=True)
    assert "pip install 'airlock-journal[pydantic-ai]'" in said.stdout


# -- a crash between the effect and its record ----------------------------------------------------

_HOST = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path
    import orjson
    from pydantic_ai import Agent
    from pydantic_ai.messages import (
        ModelMessagesTypeAdapter, ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart,
    )
    from pydantic_ai.models.function import FunctionModel
    from pydantic_ai.toolsets import FunctionToolset
    from guard import Airlock, SecurityPolicy
    from guard.adapters.pydantic_ai import AirlockToolset
    from guard.effect_guard import EffectGuard
    from journal import SQLiteJournal

    journal_path, history_path, backend_path, mode = sys.argv[1:5]

    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=SQLiteJournal(journal_path))))
    def charge(account: str, cents: int) -> dict:
        with open(backend_path, "a") as backend:  # the effect: the bank has the charge
            backend.write(f"{account} {cents}\\n")
        if mode == "crash":
            os.kill(os.getpid(), signal.SIGKILL)  # dies before the guard records the outcome
        return {"charged": cents}

    def model(messages, info):
        last = messages[-1]
        if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
            returned = [p for p in last.parts if isinstance(p, ToolReturnPart)]
            return ModelResponse(parts=[TextPart(orjson.dumps([[r.outcome, r.content] for r in returned]).decode())])
        return ModelResponse(parts=[ToolCallPart("charge", {"account": "acc_1", "cents": 500}, tool_call_id="call_k")])

    agent = Agent(FunctionModel(model), toolsets=[AirlockToolset(FunctionToolset([charge]))])

    async def main():
        if mode == "crash":
            async with agent.iter("charge acc_1") as run:
                async for node in run:
                    if Agent.is_call_tools_node(node):
                        # Save the assistant turn before its tool calls are dispatched.
                        Path(history_path).write_bytes(ModelMessagesTypeAdapter.dump_json(run.all_messages()))
        else:
            history = ModelMessagesTypeAdapter.validate_json(Path(history_path).read_bytes())
            result = await agent.run(None, message_history=history)
            print(result.output)

    import asyncio
    asyncio.run(main())
''')


def test_a_history_resumed_after_a_crash_in_the_tool_refuses_instead_of_charging_again(tmp_path: Path) -> None:
    script = tmp_path / "host.py"
    script.write_text(_HOST)
    journal, history, backend = tmp_path / "j.db", tmp_path / "history.json", tmp_path / "bank.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(script), str(journal), str(history), str(backend)]
    crashed = subprocess.run([*args, "crash"], env=env, capture_output=True, text=True, timeout=120)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert backend.read_text() == "acc_1 500\n"
    resumed = subprocess.run([*args, "resume"], env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert backend.read_text() == "acc_1 500\n"  # charged once
    ((outcome, content),) = orjson.loads(resumed.stdout)
    assert outcome == "failed"
    assert orjson.loads(content)["block_reason"] == "effect_status_unknown"
    events = SQLiteJournal(journal).call_events("call_k")
    assert [e.kind for e in events] == ["pending", "refused"]


def test_the_example_of_the_docs_runs_and_charges_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    page = (ROOT / "docs" / "adapters.md").read_text()
    example = page.split("\n## Pydantic AI\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(example, "docs/adapters.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        '{"charge":{"charge_id":"ch_1","cents":0}}',
        '{"charge":{"cents":0,"charge_id":"ch_1"}}',
        "[('a', 0)]",
    ]
    # Each line of the example says what it prints.
    said = [line.split("# ", 1)[1] for line in example.splitlines() if line.startswith("print(")]
    assert len(said) == len(printed) and all(said[n].startswith(printed[n]) for n in range(len(said)))
