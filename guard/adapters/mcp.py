"""MCP host adapter: serve guarded functions as the tools of an ``mcp`` SDK server.

The call's ``tool_call_id`` is ``params._meta["tool_call_id"]`` of the ``tools/call`` request. The
JSON-RPC request id cannot serve: a client numbers its requests per connection, so a call resent
after a reconnect gets a new one (and the SDK uses that same request id as the progress token). A
``_meta`` entry is the client's own: a client that resends a call sends the same ``_meta``, so the
retry keeps the id, across reconnects and server restarts. A call without one is refused
``tool_call_id_required`` by the guard unless its tool is reversible.

Served by a low-level server (:func:`serve`) or added to the SDK's ``MCPServer`` (:func:`add_tools`);
a client sets the id with :func:`call_tool`, and an OpenAI Agents SDK agent with
:func:`tool_meta_resolver`. The ``mcp`` SDK is imported only when a server is built or a result made,
never by importing this module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from ..canonical import to_json_value
from ..refusal import is_refusal
from ._dispatch import Outcome, Tools, field, refusal_text, tool_table, type_hints
from ._dispatch import adispatch as _adispatch
from ._signature import with_parameter

if TYPE_CHECKING:
    from mcp.server.lowlevel import Server
    from mcp.server.mcpserver import MCPServer
    from mcp.types import CallToolResult, Tool

__all__ = ["META_KEY", "add_tools", "adispatch", "call_tool", "input_schema", "list_tools", "serve",
           "tool_meta_resolver"]

META_KEY = "tool_call_id"
"""The key of the request's ``_meta`` whose value becomes the call's ``tool_call_id``."""


def input_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON Schema of ``fn``'s keyword arguments, from its signature and type hints.

    An annotation that has no JSON Schema is left open (any value); ``*args`` and positional-only
    parameters cannot be named by a JSON object and are left out; ``**kwargs`` allows other properties.
    """
    from pydantic import TypeAdapter

    hints = type_hints(fn)  # one that does not resolve leaves its parameters untyped
    properties: dict[str, Any] = {}
    required: list[str] = []
    definitions: dict[str, Any] = {}
    open_ended = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_POSITIONAL or p.kind is p.POSITIONAL_ONLY:
            continue
        if p.kind is p.VAR_KEYWORD:
            open_ended = True
            continue
        try:
            schema: dict[str, Any] = TypeAdapter(hints.get(p.name, Any)).json_schema()
        except Exception:
            schema = {}
        # Nested models refer to "#/$defs/...": hoist their definitions to the root.
        definitions.update(schema.pop("$defs", {}))
        if p.default is p.empty:
            required.append(p.name)
        else:
            default = to_json_value(p.default)
            if default is not None:
                schema["default"] = orjson.loads(default)
        properties[p.name] = schema
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    if not open_ended:
        out["additionalProperties"] = False
    if definitions:
        out["$defs"] = definitions
    return out


def list_tools(tools: Tools) -> list[Tool]:
    """The tools as MCP ``Tool`` definitions: name, docstring as description, input schema."""
    from mcp.types import Tool

    return [
        Tool(name=name, description=inspect.getdoc(t.fn) or None, input_schema=input_schema(t.fn))
        for name, t in tool_table(tools).items()
    ]


def _result(outcome: Outcome) -> CallToolResult:
    from mcp.types import CallToolResult, TextContent

    return CallToolResult(content=[TextContent(type="text", text=outcome.text)], is_error=outcome.is_error)


def _read(params: Any) -> tuple[str, Any, Mapping[str, Any]]:
    inner = field(params, "params")
    if field(params, "method") == "tools/call" and inner is not None:
        params = inner  # a whole CallToolRequest
    name = field(params, "name")
    if not isinstance(name, str):  # an empty name is the client's, and a tool there is not
        raise ValueError(f"a tools/call request names its tool: no name in {params!r}")
    meta = params.get("_meta") if isinstance(params, Mapping) else getattr(params, "meta", None)
    arguments = field(params, "arguments")
    return name, {} if arguments is None else arguments, meta if isinstance(meta, Mapping) else {}


async def adispatch(params: Any, tools: Tools, *, agent_id: str | None = None,
                    meta_key: str = META_KEY) -> CallToolResult:
    """Run one ``tools/call`` under ``AirlockContext(metadata={"tool_call_id": params._meta[meta_key]})``.

    ``params`` is a ``CallToolRequestParams`` (or the whole ``CallToolRequest``, or a dict of ``name``,
    ``arguments`` and ``_meta``). Returns a ``CallToolResult`` whose one ``TextContent`` holds the tool's
    value as JSON, or the refusal or error as a JSON object, with ``is_error`` true for a refusal or an
    exception. An absent or non-string id leaves the call without one.
    """
    name, arguments, meta = _read(params)
    call_id = meta.get(meta_key)
    if not isinstance(call_id, str) or not call_id:
        call_id = None
    outcome = await _adispatch(tools, name, call_id, arguments, agent_id=agent_id)
    if outcome.is_error and is_refusal(outcome.value) and outcome.value["block_reason"] == "tool_call_id_required":
        # The guard's hint speaks to a host; over MCP the client is the one who can fix it.
        outcome.value["fix_hints"] = [
            f"Send the tools/call with params._meta[{meta_key!r}] set to an id of this call that stays the "
            "same when the call is resent."
        ]
        outcome = Outcome(refusal_text(outcome.value), True, outcome.value)
    return _result(outcome)


def serve(tools: Tools, *, name: str = "airlock", version: str = "", instructions: str | None = None,
          agent_id: str | None = None, meta_key: str = META_KEY) -> Server[Any]:
    """A low-level ``mcp.server.lowlevel.Server`` offering ``tools``, each call run through the guard.

    Run it like any such server (``await server.run(read, write, server.create_initialization_options())``,
    ``server.streamable_http_app()``), or connect ``mcp.Client(server)`` in-process. Raises ``TypeError``
    or ``ValueError`` at once for tools that are not ``@Airlock`` functions or share a name.
    """
    from mcp.server.lowlevel import Server
    from mcp.types import ListToolsResult

    table = {tool_name: t.fn for tool_name, t in tool_table(tools).items()}
    definitions = list_tools(table)

    async def on_list_tools(ctx: Any, params: Any) -> ListToolsResult:
        return ListToolsResult(tools=definitions)

    async def on_call_tool(ctx: Any, params: Any) -> CallToolResult:
        return await adispatch(params, table, agent_id=agent_id, meta_key=meta_key)

    return Server(
        name, version=version, instructions=instructions,
        on_list_tools=on_list_tools, on_call_tool=on_call_tool,
    )


def add_tools(server: MCPServer[Any], tools: Tools, *, agent_id: str | None = None,
              meta_key: str = META_KEY) -> MCPServer[Any]:
    """Add ``tools`` to an ``mcp.server.mcpserver.MCPServer`` (mcp 2's name for ``FastMCP``); returns it.

    Each tool keeps its name, docstring and signature; the server derives its input schema and checks
    the arguments as for any of its tools, then the call runs through the guard under
    ``params._meta[meta_key]``, and its result is a ``CallToolResult`` as from :func:`adispatch`
    (``isError`` true for a refusal or an exception). Raises ``TypeError`` or ``ValueError`` at once
    for tools that are not ``@Airlock`` functions or share a name.
    """
    from mcp.server.mcpserver import Context

    for tool_name, tool in tool_table(tools).items():
        server.add_tool(_mcpserver_runner(tool_name, tool.fn, Context, agent_id, meta_key), name=tool_name,
                        description=inspect.getdoc(tool.fn) or None, structured_output=False)
    return server


def _mcpserver_runner(tool_name: str, fn: Callable[..., Any], context_type: type, agent_id: str | None,
                      meta_key: str) -> Callable[..., Any]:
    table = {tool_name: fn}
    context_name = ""

    async def run(**kwargs: Any) -> CallToolResult:
        ctx = kwargs.pop(context_name)
        meta = ctx.request_context.meta if ctx is not None else None
        params = {"name": tool_name, "arguments": kwargs, "_meta": dict(meta) if meta else {}}
        return await adispatch(params, table, agent_id=agent_id, meta_key=meta_key)

    from mcp.types import CallToolResult as Result

    context_name = with_parameter(run, fn, "ctx", context_type, kind=inspect.Parameter.KEYWORD_ONLY,
                                  returns=Result)
    return run


async def call_tool(session: Any, name: str, arguments: Mapping[str, Any] | None = None, *, tool_call_id: str,
                    meta: Mapping[str, Any] | None = None, **kwargs: Any) -> CallToolResult:
    """``session.call_tool(name, arguments, meta={..., "tool_call_id": tool_call_id})``.

    ``session`` is an ``mcp.Client`` or a ``ClientSession``; ``tool_call_id`` is the model's id for
    this call (an OpenAI ``tool_call.id``, an Anthropic ``tool_use.id``), which a resent call must
    carry again. ``meta`` adds other ``_meta`` entries; ``kwargs`` (``read_timeout_seconds``, ...) go
    to ``call_tool``. Raises ``ValueError``/``TypeError`` for an empty or non-string id.
    """
    if not isinstance(tool_call_id, str):
        raise TypeError(f"tool_call_id is a string, not {type(tool_call_id).__name__}")
    if not tool_call_id:
        raise ValueError("tool_call_id is the model's id for this call, not an empty string")
    result: CallToolResult = await session.call_tool(
        name, dict(arguments) if arguments is not None else None,
        meta={**(meta or {}), META_KEY: tool_call_id}, **kwargs,
    )
    return result


def tool_meta_resolver(context: Any) -> dict[str, Any] | None:
    """The ``_meta`` of an OpenAI Agents SDK MCP tool call: ``{"tool_call_id": <the model's call_id>}``.

    Pass it as ``tool_meta_resolver=`` of ``MCPServerStdio``, ``MCPServerStreamableHttp`` or
    ``MCPServerSse``; the SDK calls it with an ``MCPToolMetaContext`` whose ``run_context`` is the
    tool call's ``ToolContext``. None (no ``_meta``) when the run context carries no call id.
    """
    call_id = getattr(getattr(context, "run_context", None), "tool_call_id", None)
    return {META_KEY: call_id} if isinstance(call_id, str) and call_id else None
