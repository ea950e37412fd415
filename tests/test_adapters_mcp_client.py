"""guard.adapters.mcp: the SDK's MCPServer, the client helper that sends the call's id, and the
OpenAI Agents SDK's MCP client, which sends it through tool_meta_resolver."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, Runner, set_tracing_disabled
from agents.items import ToolCallOutputItem
from agents.mcp import MCPServerStdio
from agents.testing import ScriptedModel, assistant_message, function_call
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, TextContent
from pydantic import BaseModel

from guard import Airlock, SecurityPolicy
from guard.adapters import mcp as adapter
from guard.effect_guard import EffectGuard, InMemoryEffectStore, reversibility
from tests.docs_examples import docs_examples

set_tracing_disabled(True)  # no trace is exported anywhere from a test run


class Address(BaseModel):
    street: str
    city: str


class Warehouse:
    """The backend: shipments are the effects, counted outside the guard."""

    def __init__(self) -> None:
        self.shipments: list[tuple[str, int]] = []


def make_tools(store: InMemoryEffectStore, warehouse: Warehouse) -> list[Any]:
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))

    @Airlock(policy=policy)
    def ship(sku: str, quantity: int = 1) -> dict[str, Any]:
        """Ship an order from the warehouse."""
        warehouse.shipments.append((sku, quantity))
        return {"shipment": len(warehouse.shipments), "sku": sku, "quantity": quantity}

    @Airlock(policy=policy)
    async def deliver(to: Address, sku: str) -> str:
        """Deliver an order to an address."""
        await asyncio.sleep(0)
        warehouse.shipments.append((sku, 1))
        return f"{sku} to {to.city}" if isinstance(to, Address) else f"{sku} to {to['city']}"

    @reversibility("reversible")
    @Airlock(policy=policy)
    def stock(sku: str) -> int:
        """Units left of a product."""
        return 10 - sum(q for s, q in warehouse.shipments if s == sku)

    return [ship, deliver, stock]


def text(result: CallToolResult) -> str:
    assert len(result.content) == 1 and isinstance(result.content[0], TextContent)
    return result.content[0].text


def mcpserver(store: InMemoryEffectStore, warehouse: Warehouse) -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("warehouse")

    @server.tool()
    def hello(name: str) -> str:  # a tool of the server's own, beside the guarded ones
        return f"hello {name}"

    return adapter.add_tools(server, make_tools(store, warehouse))


@pytest.mark.parametrize("kind", ["mcpserver", "lowlevel"])
def test_a_retry_with_the_same_id_replays_and_a_stock_call_without_one_is_refused(kind: str) -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    server: Any = (mcpserver(store, warehouse) if kind == "mcpserver"
                   else adapter.serve(make_tools(store, warehouse)))

    async def scenario() -> list[CallToolResult]:
        results = []
        for _ in range(2):  # a new connection each time: the first result was lost with the old one
            async with Client(server) as client:
                results.append(await adapter.call_tool(client, "ship", {"sku": "A-1", "quantity": 2},
                                                       tool_call_id="call_1"))
        async with Client(server) as client:
            results.append(await client.call_tool("ship", {"sku": "A-1", "quantity": 2}))  # a stock client
            results.append(await client.call_tool("stock", {"sku": "A-1"}))
        return results

    first, again, stock_call, read = asyncio.run(scenario())
    assert first.is_error is False and again.is_error is False
    assert text(again) == text(first) == '{"quantity":2,"shipment":1,"sku":"A-1"}'
    assert stock_call.is_error is True
    refusal = json.loads(text(stock_call))
    assert refusal["block_reason"] == "tool_call_id_required"
    assert any("_meta['tool_call_id']" in hint for hint in refusal["fix_hints"])
    assert read.is_error is False and text(read) == "8"  # a reversible tool needs no id
    assert warehouse.shipments == [("A-1", 2)]
    assert [e.kind for e in store.events("call_1")] == ["pending", "committed", "replayed"]


def test_mcpserver_lists_the_guarded_tools_with_their_schemas_and_awaits_async_ones() -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    server = mcpserver(store, warehouse)

    async def scenario() -> tuple[Any, list[CallToolResult]]:
        async with Client(server) as client:
            listed = await client.list_tools()
            calls = [await adapter.call_tool(client, "deliver", {"to": {"street": "1 Main St", "city": "Oslo"},
                                                                 "sku": "B"}, tool_call_id="call_d")
                     for _ in range(2)]
            calls.append(await client.call_tool("hello", {"name": "you"}))
            calls.append(await adapter.call_tool(client, "ship", {"sku": "C", "quantity": "lots"},
                                                 tool_call_id="call_bad"))
            return listed, calls

    listed, (delivered, again, hello, bad) = asyncio.run(scenario())
    tools = {t.name: t for t in listed.tools}
    assert set(tools) == {"hello", "ship", "deliver", "stock"}
    assert tools["ship"].description == "Ship an order from the warehouse."
    assert set(tools["ship"].input_schema["properties"]) == {"sku", "quantity"}
    assert tools["ship"].input_schema["required"] == ["sku"]
    assert text(delivered) == text(again) == '"B to Oslo"'
    assert text(hello) == "hello you"
    assert bad.is_error is True  # the server checks the arguments before the guard is reached
    assert warehouse.shipments == [("B", 1)]
    assert [e.kind for e in store.events("call_d")] == ["pending", "committed", "replayed"]
    assert store.events("call_bad") == []


def test_a_refusal_from_mcpserver_is_an_error_result() -> None:
    store = InMemoryEffectStore()
    server: MCPServer[Any] = MCPServer("ops")

    @Airlock(policy=SecurityPolicy(denied_tools=["wipe"], effect_guard=EffectGuard(store=store)))
    def wipe(disk: str) -> str:
        """Wipe a disk."""
        return "wiped"

    adapter.add_tools(server, {"wipe_disk": wipe})

    async def scenario() -> CallToolResult:
        async with Client(server) as client:
            return await adapter.call_tool(client, "wipe_disk", {"disk": "sda"}, tool_call_id="call_w")

    result = asyncio.run(scenario())
    assert result.is_error is True
    refusal = json.loads(text(result))
    assert refusal["block_reason"] == "policy_violation" and refusal["error"] and refusal["fix_hints"]
    assert [e.kind for e in store.events("call_w")] == ["refused"]


def test_call_tool_needs_an_id_and_keeps_other_meta() -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    server = adapter.serve(make_tools(store, warehouse), meta_key="tool_call_id")

    async def scenario() -> CallToolResult:
        async with Client(server) as client:
            with pytest.raises(ValueError, match="empty"):
                await adapter.call_tool(client, "ship", {"sku": "D"}, tool_call_id="")
            with pytest.raises(TypeError):
                await adapter.call_tool(client, "ship", {"sku": "D"}, tool_call_id=7)  # type: ignore[arg-type]
            return await adapter.call_tool(client, "ship", {"sku": "D"}, tool_call_id="call_m",
                                           meta={"trace": "t-1"}, read_timeout_seconds=30)

    assert asyncio.run(scenario()).is_error is False
    assert warehouse.shipments == [("D", 1)]


def test_tool_meta_resolver_reads_the_call_id_from_the_tool_context() -> None:
    from agents.mcp.util import MCPToolMetaContext
    from agents.run_context import RunContextWrapper
    from agents.tool_context import ToolContext

    in_tool = ToolContext(context=None, tool_name="ship", tool_call_id="fc_9", tool_arguments="{}")
    assert adapter.tool_meta_resolver(MCPToolMetaContext(in_tool, "warehouse", "ship", {})) == {
        "tool_call_id": "fc_9"}
    outside = RunContextWrapper(context=None)
    assert adapter.tool_meta_resolver(MCPToolMetaContext(outside, "warehouse", "ship", {})) is None


SERVER_SCRIPT = '''
import sys

from mcp.server.mcpserver import MCPServer

from guard import Airlock, SecurityPolicy
from guard.adapters.mcp import add_tools
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal

journal_path, effects_path = sys.argv[1], sys.argv[2]
policy = SecurityPolicy(effect_guard=EffectGuard(store=SQLiteJournal(journal_path)))


@Airlock(policy=policy)
def ship(sku: str, quantity: int) -> dict:
    """Ship an order."""
    with open(effects_path, "a") as effects:
        effects.write(f"{sku} {quantity}\\n")
    return {"sku": sku, "quantity": quantity}


add_tools(MCPServer("warehouse"), [ship]).run("stdio")
'''


def outputs(result: Any) -> dict[str, Any]:
    return {item.call_id: item.raw_item["output"] for item in result.new_items if isinstance(item, ToolCallOutputItem)}


def test_an_agents_sdk_run_sends_its_call_id_over_stdio_with_tool_meta_resolver(tmp_path: Path) -> None:
    script, effects = tmp_path / "server.py", tmp_path / "effects.txt"
    script.write_text(SERVER_SCRIPT)
    params = {"command": sys.executable, "args": [str(script), str(tmp_path / "j.db"), str(effects)],
              "cwd": str(Path(__file__).resolve().parent.parent)}

    async def run_turn(resolver: Any, call_id: str) -> str:
        async with MCPServerStdio(params=params, tool_meta_resolver=resolver, name="warehouse") as server:
            model = ScriptedModel([[function_call("ship", {"sku": "Z", "quantity": 3}, call_id=call_id)],
                                   [assistant_message("ok")]])
            result = await Runner.run(Agent(name="shipper", mcp_servers=[server], model=model), "Ship 3 Z.")
            return str(outputs(result)[call_id])

    async def scenario() -> list[str]:
        # Each turn starts a new server process on the same journal file.
        return [await run_turn(adapter.tool_meta_resolver, "fc_m"), await run_turn(adapter.tool_meta_resolver, "fc_m"),
                await run_turn(None, "fc_stock")]

    first, again, stock = asyncio.run(scenario())
    assert again == first and '"sku":"Z"' in first
    assert effects.read_text() == "Z 3\n"
    assert "tool_call_id_required" in stock  # without the resolver the server gets no id and refuses


CHARGE = '''
from guard import Airlock, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal

policy = SecurityPolicy(effect_guard=EffectGuard(store=SQLiteJournal("airlock-journal.db")))


@Airlock(policy=policy)
def charge(account: str, cents: int) -> dict:
    """Charge an account."""
    return {"charge_id": "ch_1", "cents": cents}
'''


def test_the_docs_mcpserver_and_client_examples_run(tmp_path: Path) -> None:
    examples = docs_examples("MCP")
    server_code = next(c for c in examples if "add_tools(MCPServer" in c)
    client_code = next(c for c in examples if "call_tool(client" in c)
    (tmp_path / "example.py").write_text(CHARGE + server_code + client_code)
    runner = "import runpy; runpy.run_path('example.py', run_name='example')"  # not __main__: no stdio server
    done = subprocess.run([sys.executable, "-c", runner], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == 'False {"cents":500,"charge_id":"ch_1"}'
