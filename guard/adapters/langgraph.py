"""LangGraph adapter: every tool call of a ``ToolNode`` runs under its own ``tool_call_id``.

One line wires it in::

    ToolNode(tools, wrap_tool_call=airlock_tool_call, awrap_tool_call=airlock_atool_call)

The call's id is the ``ToolCall``'s ``id`` (the one in the ``AIMessage`` the checkpointer saved), so a
graph step that runs again (a resume after a crash or an ``interrupt()``, a fork from an earlier
checkpoint) replays the stored result instead of running the tool again. A refusal is a ``ToolMessage``
with ``status="error"`` whose content is the refusal as JSON (its ``error`` and ``fix_hints`` are what
the model reads). ``langgraph`` and ``langchain_core`` are imported only when a tool call is wrapped.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from ..refusal import AirlockBlocked, Refusal, make_refusal
from ._dispatch import Outcome, _context, _find_guard, _Guarded, _refuses_this_call, refusal_text, tool_table
from ._dispatch import adispatch as _adispatch
from ._dispatch import dispatch as _dispatch

if TYPE_CHECKING:
    from langchain_core.messages import ToolMessage
    from langgraph.prebuilt.tool_node import ToolCallRequest
    from langgraph.types import Command

__all__ = ["airlock_atool_call", "airlock_tool_call"]


def _call_id(request: ToolCallRequest) -> str | None:
    value = request.tool_call.get("id")
    return value if isinstance(value, str) and value else None


def _guarded_fn(request: ToolCallRequest, *, for_async: bool) -> Callable[..., Any] | None:
    """The ``@Airlock`` function behind the request's tool, when the adapter can call it itself.

    That is a tool made from a guarded function (``@tool`` or ``StructuredTool.from_function``) whose
    every parameter comes from the model: a tool that takes an injected argument (graph state, the
    store, ``ToolRuntime``, its own call id) is run by LangGraph, which alone can inject it.
    """
    tool = request.tool
    if tool is None:
        return None
    fn = (getattr(tool, "coroutine", None) if for_async else None) or getattr(tool, "func", None)
    if not callable(fn) or _find_guard(fn) is None:
        return None
    if inspect.iscoroutinefunction(fn) and not for_async:
        return None  # LangGraph says itself that a sync graph cannot run an async tool
    model_args = set(getattr(tool, "args", {}) or {})
    named = {p.name for p in inspect.signature(fn).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return fn if named <= model_args else None


def _message(request: ToolCallRequest, outcome: Outcome) -> ToolMessage:
    from langchain_core.messages import ToolMessage

    call = request.tool_call
    content: Any = outcome.text
    artifact: Any = None
    if not outcome.is_error and getattr(request.tool, "response_format", "content") == "content_and_artifact":
        # The (content, artifact) pair, read from its JSON form: the form a replay has too.
        pair = orjson.loads(outcome.text)
        if isinstance(pair, list) and len(pair) == 2:
            content = pair[0] if isinstance(pair[0], str) else orjson.dumps(pair[0]).decode()
            artifact = pair[1]
    return ToolMessage(
        content=content, artifact=artifact, name=call["name"], tool_call_id=call["id"],
        status="error" if outcome.is_error else "success",
    )


def _refusal_in(tool: _Guarded, call_id: str | None, message: Any) -> Refusal | None:
    """The refusal of this call that LangGraph rendered as a successful ``ToolMessage``'s content."""
    content = getattr(message, "content", None)
    if getattr(message, "status", None) == "error" or not isinstance(content, str) or '"blocked"' not in content:
        return None
    try:
        found = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(found, Mapping) or not isinstance(found.get("fix_hints"), list):
        return None
    meta = found.get("metadata")
    refusal = make_refusal(str(found.get("block_reason")), str(found.get("error")), found["fix_hints"],
                           meta if isinstance(meta, Mapping) else {})
    return refusal if _refuses_this_call(tool, call_id, refusal) else None


def _as_error(request: ToolCallRequest, refusal: Refusal) -> ToolMessage:
    return _message(request, Outcome(refusal_text(refusal), True, refusal))


def _settled(request: ToolCallRequest, tool: _Guarded | None, result: Any) -> Any:
    if tool is not None:
        refusal = _refusal_in(tool, _call_id(request), result)
        if refusal is not None:
            return _as_error(request, refusal)
    return result


def _table_entry(request: ToolCallRequest) -> _Guarded | None:
    """The guard of the request's tool, whatever LangGraph does with it; None for an unguarded tool."""
    tool = request.tool
    fn = getattr(tool, "coroutine", None) or getattr(tool, "func", None)
    if not callable(fn) or _find_guard(fn) is None:
        return None
    return tool_table({request.tool_call["name"]: fn})[request.tool_call["name"]]


def _bubbling() -> tuple[type[BaseException], ...]:
    from langgraph.errors import GraphBubbleUp

    return (GraphBubbleUp,)  # an interrupt() in the tool, a Command to the parent graph: LangGraph's own


def _interrupt_for(request: ToolCallRequest, outcome: Outcome) -> ToolMessage:
    """The call waits for an operator's approval: ``interrupt()`` with the request, so the run stops
    here and is resumed (``Command(resume=...)``) after the decision, when the node runs again and
    the guard finds it. Resumed while the request is still undecided, the refusal is the message."""
    from langgraph.types import interrupt

    refusal = outcome.value
    assert isinstance(refusal, Refusal)
    meta = dict(refusal.get("metadata") or {})
    interrupt({"airlock": "approval_pending", "tool": request.tool_call["name"], "tool_call_id": _call_id(request),
               "args": dict(request.tool_call.get("args") or {}), "request_id": meta.get("request_id"),
               "expires_at": meta.get("expires_at"), "error": refusal.get("error")})
    return _message(request, outcome)


def _pending_approval(outcome: Outcome) -> bool:
    return isinstance(outcome.value, Refusal) and outcome.value.get("block_reason") == "approval_pending"


def _refusal_of(result: Any) -> Refusal | None:
    content = getattr(result, "content", None)
    if getattr(result, "status", None) != "error" or not isinstance(content, str):
        return None
    try:
        found = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    if isinstance(found, Mapping) and found.get("block_reason") == "approval_pending":
        return make_refusal("approval_pending", str(found.get("error")), list(found.get("fix_hints") or []),
                            dict(found.get("metadata") or {}))
    return None


def _finished(request: ToolCallRequest, tool: _Guarded | None, result: Any, interrupt_on_approval: bool) -> Any:
    """What LangGraph's own run of the tool came to: its message, a refusal of the guarded call as an
    error message, or, with ``interrupt_on_approval``, the interrupt of a call that waits for approval."""
    settled = _settled(request, tool, result)
    pending = _refusal_of(settled) if interrupt_on_approval else None
    if pending is not None:
        return _interrupt_for(request, Outcome(refusal_text(pending), True, pending))
    return settled


def airlock_tool_call(
    request: ToolCallRequest | None = None,
    execute: Callable[[ToolCallRequest], ToolMessage | Command[Any]] | None = None,
    *,
    interrupt_on_approval: bool = False,
) -> Any:
    """``ToolNode(..., wrap_tool_call=airlock_tool_call)``: run the call under its ``ToolCall`` id.

    A tool made from an ``@Airlock`` function is called by the adapter: the model's arguments are
    checked against its signature, and the ``ToolMessage`` holds the value as JSON (the form a replay
    returns, so a replay reads exactly like the first call), or, with ``status="error"``, the refusal
    or the tool's exception as a JSON object. Any other tool (one that takes injected arguments, or
    an unguarded one) is run by ``execute`` under the same context; a refusal of its guarded call is
    still an error ``ToolMessage``. An ``interrupt()`` inside a tool propagates, as LangGraph needs.

    ``interrupt_on_approval=True`` (``wrap_tool_call=airlock_tool_call(interrupt_on_approval=True)``)
    turns a call refused ``approval_pending`` (``guard.approvals.ApprovalQueue``) into LangGraph's
    ``interrupt()`` carrying the request; resuming the graph after the operator's decision runs the
    node again, and the guard lets the approved call through once.
    """
    if request is None or execute is None:
        if request is not None or execute is not None:
            raise TypeError("airlock_tool_call takes a request and execute, or only interrupt_on_approval")

        def configured(request: ToolCallRequest, execute: Callable[[ToolCallRequest], Any]) -> Any:
            return airlock_tool_call(request, execute, interrupt_on_approval=interrupt_on_approval)

        return configured
    fn = _guarded_fn(request, for_async=False)
    call_id = _call_id(request)
    if fn is not None:
        outcome = _dispatch({request.tool_call["name"]: fn}, request.tool_call["name"], call_id,
                            dict(request.tool_call.get("args") or {}), reraise=_bubbling())
        if interrupt_on_approval and _pending_approval(outcome):
            return _interrupt_for(request, outcome)
        return _message(request, outcome)
    tool = _table_entry(request)
    with _context(call_id, None, None):
        try:
            result = execute(request)
        except AirlockBlocked as blocked:
            if tool is not None and _refuses_this_call(tool, call_id, blocked.refusal):
                result = _as_error(request, blocked.refusal)
            else:
                raise
    return _finished(request, tool, result, interrupt_on_approval)


def airlock_atool_call(
    request: ToolCallRequest | None = None,
    execute: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]] | None = None,
    *,
    interrupt_on_approval: bool = False,
) -> Any:
    """``ToolNode(..., awrap_tool_call=airlock_atool_call)``: as :func:`airlock_tool_call`, for
    ``ainvoke``/``astream``; an ``async def`` tool is awaited, a ``def`` tool called.
    ``airlock_atool_call(interrupt_on_approval=True)`` as for :func:`airlock_tool_call`."""
    if request is None or execute is None:
        if request is not None or execute is not None:
            raise TypeError("airlock_atool_call takes a request and execute, or only interrupt_on_approval")

        async def configured(request: ToolCallRequest, execute: Callable[[ToolCallRequest], Awaitable[Any]]) -> Any:
            return await _atool_call(request, execute, interrupt_on_approval)

        return configured
    return _atool_call(request, execute, interrupt_on_approval)


async def _atool_call(
    request: ToolCallRequest, execute: Callable[[ToolCallRequest], Awaitable[Any]], interrupt_on_approval: bool,
) -> Any:
    fn = _guarded_fn(request, for_async=True)
    call_id = _call_id(request)
    if fn is not None:
        outcome = await _adispatch({request.tool_call["name"]: fn}, request.tool_call["name"], call_id,
                                   dict(request.tool_call.get("args") or {}), reraise=_bubbling())
        if interrupt_on_approval and _pending_approval(outcome):
            return _interrupt_for(request, outcome)
        return _message(request, outcome)
    tool = _table_entry(request)
    async with _context(call_id, None, None):
        try:
            result = await execute(request)
        except AirlockBlocked as blocked:
            if tool is not None and _refuses_this_call(tool, call_id, blocked.refusal):
                result = _as_error(request, blocked.refusal)
            else:
                raise
    return _finished(request, tool, result, interrupt_on_approval)
