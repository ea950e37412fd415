"""Pydantic AI adapter: every tool call of an agent runs under its own ``tool_call_id``.

One line wires it in::

    agent = Agent(model, toolsets=[AirlockToolset(FunctionToolset([charge, refund]))])

The tools are ``@Airlock`` functions in a ``FunctionToolset``, registered without a ``RunContext``
parameter (a guarded tool reads its call through ``guard.get_current_context()``). The call's id is
``RunContext.tool_call_id``, the id of the ``ToolCallPart`` in the model's response, so a run
resumed from a saved history (``message_history=``) that still has to answer that call replays the
stored result instead of running the tool again. A refusal reaches the model as a failed tool
result (Pydantic AI's ``ToolFailed``) whose text is the refusal as JSON, its ``error`` and
``fix_hints``; never as a successful one.

Pydantic AI's ``TestModel`` names every call of a tool ``pyd_ai_tool_call_id__<tool>``, in every
run, so a second run would be given the first run's stored value. Such an id is scoped by the run
whose model response asked for the call: it is kept as ``run:<run_id>/<tool_call_id>``. A resumed
history keeps its responses' ``run_id``, so its calls keep their ids; a new run's calls are new.
``AirlockToolset(..., run_scoped=...)`` says which ids a model reuses (``TestModel``'s by default).

Nothing here imports Pydantic AI until :class:`AirlockToolset` is first looked up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._pydantic_ai_toolset import AirlockToolset

__all__ = ["TEST_MODEL_ID_PREFIX", "AirlockToolset", "asking_run", "reused_by_test_model", "run_scoped_id"]

TEST_MODEL_ID_PREFIX = "pyd_ai_tool_call_id__"
"""How every tool call id that Pydantic AI's ``TestModel`` makes begins."""


def reused_by_test_model(tool_call_id: str) -> bool:
    """Whether ``tool_call_id`` has the form ``TestModel`` gives a tool's call in every run."""
    return tool_call_id.startswith(TEST_MODEL_ID_PREFIX)


def run_scoped_id(run_id: str, tool_call_id: str) -> str:
    """The id a call that a model's response in run ``run_id`` asked for is kept under."""
    return f"run:{run_id}/{tool_call_id}"


def asking_run(messages: Iterable[Any], tool_call_id: str) -> str | None:
    """The ``run_id`` of the latest model response in ``messages`` that asks for ``tool_call_id``
    (a ``ToolCallPart`` of that id), or None when no response there does or it carries no run id."""
    for message in reversed(list(messages)):
        if getattr(message, "kind", None) != "response":
            continue
        for part in getattr(message, "parts", ()):
            if getattr(part, "part_kind", None) == "tool-call" and getattr(part, "tool_call_id", None) == tool_call_id:
                run_id = getattr(message, "run_id", None)
                return run_id if isinstance(run_id, str) and run_id else None
    return None


def call_id_for(ctx: Any, run_scoped: Callable[[str], bool]) -> str | None:
    """The ``tool_call_id`` a call of this ``RunContext`` runs under: the framework's id, scoped by
    the run that asked for it when ``run_scoped`` says the model reuses it; None without an id."""
    tool_call_id = getattr(ctx, "tool_call_id", None)
    if not isinstance(tool_call_id, str) or not tool_call_id:
        return None
    if not run_scoped(tool_call_id):
        return tool_call_id
    run_id = asking_run(getattr(ctx, "messages", ()), tool_call_id) or getattr(ctx, "run_id", None)
    if not isinstance(run_id, str) or not run_id:
        return None  # no run to scope it by: without an id the guard refuses what it cannot run once
    return run_scoped_id(run_id, tool_call_id)


def own_refusal(result: Any, call_id: str | None) -> Mapping[str, Any] | None:
    """``result`` when it is the guard's refusal of the call ``call_id`` (not a value a tool returned
    that a guarded call nested in it was given: that one carries no tool call id), else None."""
    from ..refusal import is_refusal

    if not is_refusal(result):
        return None
    meta = result.get("metadata")
    if isinstance(meta, Mapping) and meta.get("tool_call_id") != call_id:
        return None
    return result  # type: ignore[no-any-return]


def __getattr__(name: str) -> Any:
    if name == "AirlockToolset":
        try:
            from ._pydantic_ai_toolset import AirlockToolset
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] != "pydantic_ai":
                raise
            raise ImportError(
                "AirlockToolset needs Pydantic AI: pip install 'airlock-journal[pydantic-ai]'"
            ) from e
        return AirlockToolset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
