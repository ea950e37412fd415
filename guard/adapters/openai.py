"""OpenAI host adapter: run a model's function tool call and build the message that answers it.

Takes a Chat Completions tool call (``id``, ``function.name``, ``function.arguments``) or a Responses
API ``function_call`` item (``call_id``, ``name``, ``arguments``), as the ``openai`` SDK's objects or as
plain dicts; the SDK itself is never imported.
"""

from __future__ import annotations

from typing import Any, Literal

from ._dispatch import Outcome, Tools, call_id_of, field
from ._dispatch import adispatch as _adispatch
from ._dispatch import dispatch as _dispatch

__all__ = ["adispatch", "dispatch"]

_Shape = Literal["chat", "responses"]


def _read(tool_call: Any) -> tuple[_Shape, str, str, Any]:
    kind = field(tool_call, "type")
    function = field(tool_call, "function")
    if function is not None and kind in (None, "function"):
        shape: _Shape = "chat"
        call_id = call_id_of(field(tool_call, "id"), "tool call")
        name, arguments = field(function, "name"), field(function, "arguments")
    elif kind == "function_call" or (kind is None and field(tool_call, "call_id") is not None):
        shape = "responses"
        call_id = call_id_of(field(tool_call, "call_id"), "function_call item")
        name, arguments = field(tool_call, "name"), field(tool_call, "arguments")
    else:
        raise TypeError(
            "expected a Chat Completions function tool call (id, function.name, function.arguments) or a "
            "Responses function_call item (call_id, name, arguments), not "
            + (f"a tool call of type {kind!r}" if kind is not None else repr(tool_call))
        )
    if name is None:
        raise ValueError(f"the tool call {call_id!r} names no function")
    if not isinstance(name, str):
        raise TypeError(f"the tool call {call_id!r} names its function by a string, not {type(name).__name__}")
    return shape, call_id, name, arguments  # an empty name is the model's: a tool there is not


def _reply(shape: _Shape, call_id: str, outcome: Outcome) -> dict[str, Any]:
    if shape == "chat":
        return {"role": "tool", "tool_call_id": call_id, "content": outcome.text}
    return {"type": "function_call_output", "call_id": call_id, "output": outcome.text}


def dispatch(tool_call: Any, tools: Tools, *, agent_id: str | None = None) -> dict[str, Any]:
    """Run ``tool_call`` under ``AirlockContext(metadata={"tool_call_id": <its id>})``.

    Returns ``{"role": "tool", "tool_call_id": id, "content": text}`` for a Chat Completions tool call,
    ``{"type": "function_call_output", "call_id": id, "output": text}`` for a Responses item. ``text``
    is the tool's value as JSON, or the refusal or error as a JSON object. ``agent_id`` None keeps the
    host context's. Raises ``TypeError``/``ValueError`` for something that is not a function tool call,
    for ``tools`` that are not ``@Airlock`` functions, and for an ``async def`` tool (use :func:`adispatch`).
    """
    shape, call_id, name, arguments = _read(tool_call)
    return _reply(shape, call_id, _dispatch(tools, name, call_id, arguments, agent_id=agent_id))


async def adispatch(tool_call: Any, tools: Tools, *, agent_id: str | None = None) -> dict[str, Any]:
    """As :func:`dispatch`, for async hosts: ``async def`` tools are awaited, ``def`` tools called."""
    shape, call_id, name, arguments = _read(tool_call)
    return _reply(shape, call_id, await _adispatch(tools, name, call_id, arguments, agent_id=agent_id))
