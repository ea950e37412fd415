"""guard.adapters.mcp: guarded functions served as MCP tools, keyed on params._meta["tool_call_id"]."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator, ValidationError
from mcp import Client, MCPError, StdioServerParameters
from mcp.types import CallToolRequest, CallToolRequestParams, CallToolResult, TextContent
from pydantic import BaseModel

from guard import Airlock, SecurityPolicy, get_current_context
from guard.adapters import mcp as adapter
from guard.effect_guard import EffectGuard, InMemoryEffectStore, idempotency_key, reversibility


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
    async def aship(sku: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        warehouse.shipments.append((sku, 1))
        return {"shipment": len(warehouse.shipments), "sku": sku}

    @reversibility("reversible")
    @Airlock(policy=policy)
    def stock(sku: str) -> int:
        return 10 - sum(q for s, q in warehouse.shipments if s == sku)

    return [ship, aship, stock]


def text(result: CallToolResult) -> str:
    assert len(result.content) == 1 and isinstance(result.content[0], TextContent)
    return result.content[0].text


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_retry_after_a_lost_result_and_a_reconnect_replays_and_ships_once(mode: str) -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    server = adapter.serve(make_tools(store, warehouse), name="warehouse")

    async def scenario() -> tuple[CallToolResult, CallToolResult]:
        async with Client(server, mode=mode) as client:  # type: ignore[arg-type]
            listed = await client.list_tools()
            assert [t.name for t in listed.tools] == ["ship", "aship", "stock"]
            lost = await client.call_tool("ship", {"sku": "A-1", "quantity": 2}, meta={"tool_call_id": "mcp-1"})
        # The client lost that result (it went away before using it); a new connection resends the call.
        async with Client(server, mode=mode) as client:  # type: ignore[arg-type]
            again = await client.call_tool("ship", {"sku": "A-1", "quantity": 2}, meta={"tool_call_id": "mcp-1"})
        return lost, again

    lost, again = run(scenario)
    assert again.is_error is False
    assert text(again) == text(lost) == '{"quantity":2,"shipment":1,"sku":"A-1"}'
    assert warehouse.shipments == [("A-1", 2)]
    assert [e.kind for e in store.events("mcp-1")] == ["pending", "committed", "replayed"]


def test_async_tools_are_awaited_and_replayed() -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    server = adapter.serve(make_tools(store, warehouse))

    async def scenario() -> list[CallToolResult]:
        async with Client(server) as client:
            return [await client.call_tool("aship", {"sku": "B-2"}, meta={"tool_call_id": "mcp-a"})
                    for _ in range(2)]

    first, again = run(scenario)
    assert text(first) == text(again) == '{"shipment":1,"sku":"B-2"}'
    assert warehouse.shipments == [("B-2", 1)]


def test_a_call_without_an_id_is_refused_for_an_irreversible_tool_and_runs_for_a_reversible_one() -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    server = adapter.serve(make_tools(store, warehouse))

    async def scenario() -> tuple[CallToolResult, CallToolResult]:
        async with Client(server) as client:
            refused = await client.call_tool("ship", {"sku": "C-3"})
            read = await client.call_tool("stock", {"sku": "C-3"})
            return refused, read

    refused, read = run(scenario)
    assert refused.is_error is True
    refusal = json.loads(text(refused))
    assert refusal["block_reason"] == "tool_call_id_required"
    assert any("_meta['tool_call_id']" in h for h in refusal["fix_hints"])
    assert warehouse.shipments == []
    assert read.is_error is False and text(read) == "10"
    assert [(e.kind, e.call_id) for e in store.events()] == [("refused", None)]


def test_a_call_without_an_id_is_refused_for_the_id_before_its_arguments_are_looked_at() -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    tools = make_tools(store, warehouse)

    async def scenario() -> list[dict[str, Any]]:
        calls = [("ship", {"sku": "E", "quantity": "many"}), ("ship", {"quantity": 2}), ("ship", "not an object"),
                 ("stock", {"sku": 5, "extra": 1})]
        return [json.loads(text(await adapter.adispatch({"name": name, "arguments": arguments}, tools)))
                for name, arguments in calls]

    unfit_ship_1, unfit_ship_2, unfit_ship_3, unfit_stock = run(scenario)
    for refusal in (unfit_ship_1, unfit_ship_2, unfit_ship_3):
        assert refusal["block_reason"] == "tool_call_id_required"
        assert any("_meta['tool_call_id']" in h for h in refusal["fix_hints"])
    # A reversible tool needs no id: its arguments are what is wrong.
    assert unfit_stock["block_reason"] == "arguments_not_canonical"
    assert warehouse.shipments == []
    assert [e.reason["code"] for e in store.events()] == ["tool_call_id_required"] * 3 + ["arguments_not_canonical"]


def test_unknown_tool_and_arguments_that_do_not_fit_are_error_results() -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    server = adapter.serve(make_tools(store, warehouse))

    async def scenario() -> tuple[CallToolResult, CallToolResult]:
        async with Client(server) as client:
            unknown = await client.call_tool("restock", {"sku": "D"}, meta={"tool_call_id": "mcp-u"})
            unfit = await client.call_tool("ship", {"sku": "D", "item": 1}, meta={"tool_call_id": "mcp-f"})
            unnamed = await client.call_tool("", {}, meta={"tool_call_id": "mcp-n"})  # not a protocol error
            assert unnamed.is_error is True
            assert json.loads(text(unnamed))["metadata"]["violation_type"] == "unknown_tool"
            return unknown, unfit

    unknown, unfit = run(scenario)
    assert unknown.is_error is True
    assert json.loads(text(unknown))["metadata"]["violation_type"] == "unknown_tool"
    assert [e.kind for e in store.events("mcp-n")] == ["refused"]
    assert unfit.is_error is True
    refusal = json.loads(text(unfit))
    assert refusal["block_reason"] == "arguments_not_canonical"
    assert "unexpected keyword argument 'item'" in refusal["error"]
    assert warehouse.shipments == []
    assert [e.kind for e in store.events("mcp-u")] == ["refused"]
    assert [e.kind for e in store.events("mcp-f")] == ["refused"]


def test_an_argument_named_tool_call_id_is_the_models_not_the_calls_id() -> None:
    store = InMemoryEffectStore()
    seen: list[tuple[str | None, str]] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def note(tool_call_id: str) -> str:
        ctx = get_current_context()
        seen.append((ctx.tool_call_id if ctx else None, tool_call_id))
        return "noted"

    async def scenario() -> None:
        async with Client(adapter.serve([note])) as client:
            for _ in range(2):
                await client.call_tool("note", {"tool_call_id": "from-model"}, meta={"tool_call_id": "mcp-n"})

    run(scenario)
    assert seen == [("mcp-n", "from-model")]
    record = store.get("mcp-n")
    assert record is not None and record.idempotency_key == idempotency_key("note", {"tool_call_id": "from-model"})
    assert store.get("from-model") is None


def test_adispatch_takes_the_sdk_params_the_whole_request_or_a_dict() -> None:
    store, warehouse = InMemoryEffectStore(), Warehouse()
    tools = make_tools(store, warehouse)
    params = CallToolRequestParams(name="ship", arguments={"sku": "E"}, _meta={"tool_call_id": "mcp-e"})

    async def scenario() -> list[CallToolResult]:
        return [
            await adapter.adispatch(params, tools),
            await adapter.adispatch(CallToolRequest(params=params), tools),
            await adapter.adispatch({"name": "ship", "arguments": {"sku": "E"}, "_meta": {"tool_call_id": "mcp-e"}},
                                    tools),
            await adapter.adispatch({"name": "ship", "arguments": {"sku": "E"}, "_meta": {"op": "mcp-e"}},
                                    tools, meta_key="op"),
        ]

    results = run(scenario)
    assert {text(r) for r in results} == {'{"quantity":1,"shipment":1,"sku":"E"}'}
    assert warehouse.shipments == [("E", 1)]
    assert [e.kind for e in store.events("mcp-e")] == ["pending", "committed", "replayed", "replayed", "replayed"]
    with pytest.raises(ValueError, match="names its tool"):
        run(lambda: adapter.adispatch({"arguments": {}}, tools))


class Address(BaseModel):
    street: str
    city: str


def test_input_schemas_come_from_the_signatures() -> None:
    policy = SecurityPolicy()

    @Airlock(policy=policy)
    def deliver(to: Address, items: list[str], stops: list[Address], express: bool = False,
                note: str | None = None) -> None: ...

    @Airlock(policy=policy)
    def anything(name, *args: int, **extra: Any) -> None: ...  # type: ignore[no-untyped-def]

    schema = adapter.input_schema(deliver)
    assert schema["type"] == "object" and schema["required"] == ["to", "items", "stops"]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["items"] == {"type": "array", "items": {"type": "string"}}
    assert schema["properties"]["express"] == {"type": "boolean", "default": False}
    assert schema["properties"]["to"]["required"] == ["street", "city"]
    # A nested model's definition is hoisted to the root, where its "$ref" points.
    assert schema["properties"]["stops"]["items"] == {"$ref": "#/$defs/Address"}
    assert schema["$defs"]["Address"]["required"] == ["street", "city"]
    validator = Draft202012Validator(schema)
    stop = {"street": "1 Main St", "city": "Oslo"}
    validator.validate({"to": stop, "items": ["box"], "stops": [stop]})
    with pytest.raises(ValidationError):
        validator.validate({"to": stop, "items": ["box"], "stops": [{"street": "x"}]})
    open_schema = adapter.input_schema(anything)
    assert open_schema == {"type": "object", "properties": {"name": {}}, "required": ["name"]}
    [tool] = adapter.list_tools({"deliver_parcel": deliver})
    assert tool.name == "deliver_parcel" and tool.input_schema == schema


def test_serve_refuses_tools_that_are_not_guarded() -> None:
    def plain(sku: str) -> None: ...

    with pytest.raises(TypeError, match="not decorated with @Airlock"):
        adapter.serve([plain])


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_a_call_the_client_gave_up_on_is_in_doubt_and_its_retry_is_refused(mode: str) -> None:
    store = InMemoryEffectStore()
    transfers: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    async def transfer(cents: int) -> str:
        transfers.append(cents)  # the effect happens, then the response never comes back
        await asyncio.sleep(30)
        return "done"

    async def scenario() -> CallToolResult:
        async with Client(adapter.serve([transfer]), mode=mode) as client:  # type: ignore[arg-type]
            with pytest.raises(MCPError, match=r"(?i)timed out"):
                await client.call_tool("transfer", {"cents": 5}, read_timeout_seconds=0.3,
                                       meta={"tool_call_id": "mcp-t"})
            return await client.call_tool("transfer", {"cents": 5}, read_timeout_seconds=5,
                                          meta={"tool_call_id": "mcp-t"})

    retry = run(scenario)
    assert retry.is_error is True
    refusal = json.loads(text(retry))
    assert refusal["block_reason"] == "effect_status_unknown"
    assert refusal["metadata"]["status"] == "unknown"
    assert transfers == [5]
    assert [e.kind for e in store.events("mcp-t")] == ["pending", "unknown", "refused"]


SERVER_SCRIPT = '''
import sys

import anyio
from mcp.server.stdio import stdio_server

from guard import Airlock, SecurityPolicy
from guard.adapters.mcp import serve
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal

journal_path, effects_path = sys.argv[1], sys.argv[2]
policy = SecurityPolicy(effect_guard=EffectGuard(store=SQLiteJournal(journal_path)))


@Airlock(policy=policy)
def ship(sku: str, quantity: int) -> dict:
    with open(effects_path, "a") as effects:
        effects.write(f"{sku} {quantity}\\n")
    return {"sku": sku, "quantity": quantity}


async def main() -> None:
    server = serve([ship], name="warehouse")
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())

anyio.run(main)
'''


def test_a_retry_to_a_restarted_server_over_stdio_replays_from_the_journal(tmp_path: Path) -> None:
    script, effects = tmp_path / "server.py", tmp_path / "effects.txt"
    script.write_text(SERVER_SCRIPT)
    params = StdioServerParameters(command=sys.executable, args=[str(script), str(tmp_path / "j.db"), str(effects)])

    async def scenario() -> list[CallToolResult]:
        results = []
        for _ in range(2):  # each connection starts a new server process on the same journal file
            async with Client(params) as client:
                results.append(await client.call_tool("ship", {"sku": "Z-9", "quantity": 3},
                                                      meta={"tool_call_id": "mcp-stdio-1"}))
        return results

    first, again = run(scenario)
    assert first.is_error is False and again.is_error is False
    assert text(again) == text(first) == '{"quantity":3,"sku":"Z-9"}'
    assert effects.read_text() == "Z-9 3\n"
    from journal import SQLiteJournal

    journal = SQLiteJournal(tmp_path / "j.db")
    try:
        assert [e.kind for e in journal.events(call_id="mcp-stdio-1")] == ["pending", "committed", "replayed"]
    finally:
        journal.close()
