"""Anthropic host adapter: run a model's ``tool_use`` block and build the ``tool_result`` that answers it.

Takes the ``anthropic`` SDK's ``ToolUseBlock`` or a plain dict (``id``, ``name``, ``input``); the SDK
itself is never imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._dispatch import Outcome, Tools, call_id_of, field
from ._dispatch import adispatch as _adispatch
from ._dispatch import dispatch as _dispatch

__all__ = ["adispatch", "dispatch"]


def _read(block: Any) -> tuple[str, str, Any]:
    kind = field(block, "type")
    if kind not in (None, "tool_use"):
        raise TypeError(f"expected a tool_use block (id, name, input), not a block of type {kind!r}")
    if kind is None and not isinstance(block, Mapping) and field(block, "id") is None and field(block, "name") is None:
        raise TypeError(f"expected a tool_use block (id, name, input), not {type(block).__name__}")
    call_id = call_id_of(field(block, "id"), "tool_use block")
    name = field(block, "name")
    if name is None:
        raise ValueError(f"the tool_use block {call_id!r} names no tool")
    if not isinstance(name, str):
        raise TypeError(f"the tool_use block {call_id!r} names its tool by a string, not {type(name).__name__}")
    return call_id, name, field(block, "input")  # an empty name is the model's: a tool there is not


def _reply(call_id: str, outcome: Outcome) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": outcome.text, "is_error": outcome.is_error}


def dispatch(block: Any, tools: Tools, *, agent_id: str | None = None) -> dict[str, Any]:
    """Run ``block`` under ``AirlockContext(metadata={"tool_call_id": block.id})``.

    Returns ``{"type": "tool_result", "tool_use_id": id, "content": text, "is_error": bool}``, where
    ``text`` is the tool's value as JSON, or the refusal or error as a JSON object, and ``is_error`` is
    true for a refusal or an exception. ``input`` may also be JSON text. ``agent_id`` None keeps the host
    context's. Raises ``TypeError``/``ValueError`` for a block that is no ``tool_use``, for ``tools`` that
    are not ``@Airlock`` functions, and for an ``async def`` tool (use :func:`adispatch`).
    """
    call_id, name, arguments = _read(block)
    return _reply(call_id, _dispatch(tools, name, call_id, arguments, agent_id=agent_id))


async def adispatch(block: Any, tools: Tools, *, agent_id: str | None = None) -> dict[str, Any]:
    """As :func:`dispatch`, for async hosts: ``async def`` tools are awaited, ``def`` tools called."""
    call_id, name, arguments = _read(block)
    return _reply(call_id, await _adispatch(tools, name, call_id, arguments, agent_id=agent_id))
