"""A Pydantic AI tool call's id, and the guard's refusal of it: what :class:`AirlockToolset` needs
that does not need Pydantic AI itself (see :mod:`guard.adapters.pydantic_ai`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..refusal import is_refusal

__all__ = [
    "TEST_MODEL_ID_PREFIX", "asking_run", "call_id_for", "own_refusal", "reused_by_test_model", "run_scoped_id",
]

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
    if not is_refusal(result):
        return None
    meta = result.get("metadata")
    if isinstance(meta, Mapping) and meta.get("tool_call_id") != call_id:
        return None
    refusal: Mapping[str, Any] = result
    return refusal
