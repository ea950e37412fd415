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

from typing import TYPE_CHECKING, Any

from ._pydantic_ai_calls import TEST_MODEL_ID_PREFIX, asking_run, reused_by_test_model, run_scoped_id

if TYPE_CHECKING:
    from ._pydantic_ai_toolset import AirlockToolset

__all__ = ["TEST_MODEL_ID_PREFIX", "AirlockToolset", "asking_run", "reused_by_test_model", "run_scoped_id"]


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
