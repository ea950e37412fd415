"""OpenAI Agents SDK adapter: a guarded function as the SDK's ``FunctionTool``, keyed on the call's id.

One line wires it in::

    Agent(name="payments", tools=[guarded_function_tool(charge)])

Each invocation runs under ``AirlockContext(metadata={"tool_call_id": ToolContext.tool_call_id})``: the
``call_id`` of the model's ``function_call`` item, which a run resumed from saved history (a
``Session``, a ``RunState``, a replayed ``to_input_list()``) sends again for the same call. The SDK is
imported only when :func:`guarded_function_tool` is called.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, get_origin

import orjson

from ..refusal import AirlockBlocked
from ._dispatch import Outcome, _blocked, _context, _finished, _Guarded, tool_table, type_hints
from ._signature import with_parameter

if TYPE_CHECKING:
    from agents import FunctionTool
    from agents.tool_context import ToolContext

__all__ = ["guarded_function_tool"]


def _reply(outcome: Outcome) -> Any:
    """What the SDK hands the model: the value's JSON form (the form its replay has, so both read
    alike), or the text of a refusal or of a result that cannot be a value."""
    return outcome.text if outcome.is_error else orjson.loads(outcome.text)


def _takes_sdk_context(fn: Callable[..., Any]) -> bool:
    from agents.run_context import RunContextWrapper

    params = list(inspect.signature(fn).parameters)
    if not params:
        return False
    hint = type_hints(fn).get(params[0])
    origin = get_origin(hint) or hint
    return isinstance(origin, type) and issubclass(origin, RunContextWrapper)


def _runner(tool: _Guarded, agent_id: str | None) -> Callable[..., Any]:
    fn = tool.fn

    def settle(call_id: str | None, result: Any) -> Any:
        return _reply(_finished(tool, call_id, result))

    def refused(call_id: str | None, blocked: AirlockBlocked) -> Any:
        outcome = _blocked(tool, call_id, blocked)
        if not outcome.is_error or outcome.value is not blocked.refusal:
            raise blocked  # a nested call's refusal: the tool's own exception
        return outcome.text

    if inspect.iscoroutinefunction(fn):
        async def run_async(ctx: ToolContext[Any], /, *args: Any, **kwargs: Any) -> Any:
            call_id = ctx.tool_call_id or None
            async with _context(call_id, agent_id, None):
                try:
                    result = await fn(*args, **kwargs)
                except AirlockBlocked as blocked:
                    return refused(call_id, blocked)
            return settle(call_id, result)

        return run_async

    def run(ctx: ToolContext[Any], /, *args: Any, **kwargs: Any) -> Any:
        call_id = ctx.tool_call_id or None
        with _context(call_id, agent_id, None):
            try:
                result = fn(*args, **kwargs)
            except AirlockBlocked as blocked:
                return refused(call_id, blocked)
        return settle(call_id, result)

    return run


def guarded_function_tool(fn: Callable[..., Any], *, agent_id: str | None = None,
                          **function_tool_kwargs: Any) -> FunctionTool:
    """The SDK's ``FunctionTool`` for the ``@Airlock`` function ``fn``, made by ``agents.function_tool``.

    ``function_tool_kwargs`` are ``agents.function_tool``'s (``name_override``, ``failure_error_function``,
    ``strict_mode``, ``needs_approval``, ``timeout``, ...); the schema and description come from ``fn``'s
    signature and docstring as for any function tool. ``agent_id`` None keeps the host context's.

    The model reads the value's JSON form, the same on the first call and on its replay; a refusal
    (returned, or raised with ``on_block="raise"``) as the refusal's JSON object, whose ``error`` and
    ``fix_hints`` say what to do; any other exception goes to the SDK's ``failure_error_function``.
    Raises ``TypeError`` for a function that is not ``@Airlock``-guarded, or that takes the SDK's
    context (a guarded call's arguments enter its idempotency key; read the call's id with
    ``guard.get_current_context()`` instead).
    """
    from agents import function_tool
    from agents.tool_context import ToolContext

    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"guarded_function_tool takes an @Airlock function, not {fn!r}")
    tool = tool_table({name: fn})[name]
    if _takes_sdk_context(fn):
        raise TypeError(
            f"the tool {name!r} takes the SDK's context as an argument, which has no JSON form for its "
            "idempotency key; drop it and read guard.get_current_context() inside the tool"
        )
    runner = _runner(tool, agent_id)
    with_parameter(runner, fn, "context", ToolContext[Any], kind=inspect.Parameter.POSITIONAL_ONLY, returns=Any)
    made: FunctionTool = function_tool(runner, **function_tool_kwargs)
    return made
