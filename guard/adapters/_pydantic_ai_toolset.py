"""The Pydantic AI wrapper toolset itself; imported (with Pydantic AI) when it is first used."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic_ai import RunContext, ToolFailed
from pydantic_ai.tools import AgentDepsT
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset, ToolsetTool, WrapperToolset

from ..refusal import AirlockBlocked
from ._dispatch import _context, _find_guard, refusal_text
from ._pydantic_ai_calls import call_id_for, own_refusal, reused_by_test_model

__all__ = ["AirlockToolset"]


@dataclass
class AirlockToolset(WrapperToolset[AgentDepsT]):
    """Run every call of the wrapped toolset's tools under its own ``tool_call_id``.

    ``Agent(model, toolsets=[AirlockToolset(FunctionToolset([charge]))])``. Every tool of the wrapped
    toolset is an ``@Airlock`` function without a ``RunContext`` parameter; anything else is a
    ``TypeError`` (when the toolset is wrapped, and again when the agent lists the tools), since it
    would run unguarded or could not be keyed.

    Args:
        wrapped: the toolset whose tools are guarded.
        agent_id: the calls' ``agent_id``: a string, or a function of the ``RunContext`` (its ``deps``
            name the user, say); None takes the host's ``AirlockContext``'s, if any.
        run_scoped: which tool call ids the model reuses across runs; such an id is kept as
            ``run:<run_id>/<id>``, ``run_id`` that of the run whose model response asked for the call.
            By default the ids of ``TestModel``.

    A refusal is raised as ``ToolFailed`` with the refusal as JSON: the model reads a failed tool
    result, and the run goes on.
    """

    agent_id: str | Callable[[RunContext[AgentDepsT]], str | None] | None = None
    run_scoped: Callable[[str], bool] = reused_by_test_model

    def __post_init__(self) -> None:
        if not isinstance(self.wrapped, AbstractToolset):
            raise TypeError(f"AirlockToolset wraps a toolset (a FunctionToolset of @Airlock functions), "
                            f"not {type(self.wrapped).__name__}")
        if self.agent_id is not None and not isinstance(self.agent_id, str) and not callable(self.agent_id):
            raise TypeError(f"agent_id is a string, a function of the RunContext, or None, not {self.agent_id!r}")
        if not callable(self.run_scoped):
            raise TypeError(f"run_scoped is a function of a tool call id, not {self.run_scoped!r}")
        self.wrapped.apply(_check_guarded)

    async def get_tools(self, ctx: RunContext[AgentDepsT]) -> dict[str, ToolsetTool[AgentDepsT]]:
        self.wrapped.apply(_check_guarded)  # a tool added to the toolset after it was wrapped
        return await self.wrapped.get_tools(ctx)

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[AgentDepsT], tool: ToolsetTool[AgentDepsT]
    ) -> Any:
        call_id = call_id_for(ctx, self.run_scoped)
        agent_id = self.agent_id(ctx) if callable(self.agent_id) else self.agent_id
        async with _context(call_id, agent_id, None):
            try:
                result = await self.wrapped.call_tool(name, tool_args, ctx, tool)
            except AirlockBlocked as blocked:  # a guard with on_block="raise"
                if own_refusal(blocked.refusal, call_id) is None:
                    raise  # a guarded call nested in the tool was refused: the tool's own exception
                raise ToolFailed(refusal_text(blocked.refusal)) from None
        if own_refusal(result, call_id) is not None:
            raise ToolFailed(refusal_text(result))
        return result


def _check_guarded(toolset: AbstractToolset[Any]) -> None:
    """Raise ``TypeError`` unless every tool of this leaf toolset is a guarded function without a
    ``RunContext`` parameter."""
    if not isinstance(toolset, FunctionToolset):
        raise TypeError(
            f"AirlockToolset guards the tools of FunctionToolsets of @Airlock functions; {toolset.label} holds "
            "tools it cannot guard"
        )
    for name, tool in toolset.tools.items():
        if _find_guard(tool.function) is None:
            raise TypeError(f"the tool {name!r} is not decorated with @Airlock; AirlockToolset only runs guarded tools")
        if tool.takes_ctx:
            raise TypeError(
                f"the tool {name!r} takes a RunContext, which has no JSON form to key the call on; register it "
                "without one (a guarded tool reads its call through guard.get_current_context())"
            )
