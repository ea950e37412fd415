"""A tool's signature with one more parameter: the framework's context, which the framework fills in.

A framework that reads a tool's schema from its signature (the OpenAI Agents SDK, the ``mcp`` SDK's
``MCPServer``) passes its per-call context only to a parameter it finds there. An adapter's runner
takes that context (to read the call's id) and the tool's own arguments; its signature is the tool's
with that parameter added, and its annotations are resolved here, so that the framework need not
resolve names from the tool's module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ._dispatch import type_hints

__all__ = ["with_parameter"]


def _free_name(taken: set[str], wanted: str) -> str:
    name = wanted
    while name in taken:
        name = f"_{name}"
    return name


def with_parameter(runner: Callable[..., Any], fn: Callable[..., Any], wanted: str, annotation: Any, *,
                   kind: inspect._ParameterKind, returns: Any) -> str:
    """Give ``runner`` ``fn``'s name, docstring and signature with one parameter added.

    The parameter is named ``wanted`` (underscores are prefixed while ``fn`` has a parameter of that
    name) and has ``annotation``; ``kind`` is ``POSITIONAL_ONLY`` (it goes first) or ``KEYWORD_ONLY``
    (before ``**kwargs``). The other annotations are ``fn``'s, resolved; one that does not resolve is
    ``Any``. Returns the parameter's name.
    """
    signature = inspect.signature(fn)
    hints = type_hints(fn)
    params = [p.replace(annotation=hints.get(p.name, Any)) for p in signature.parameters.values()]
    name = _free_name(set(signature.parameters), wanted)
    added = inspect.Parameter(name, kind, annotation=annotation)
    if kind is inspect.Parameter.POSITIONAL_ONLY:
        params.insert(0, added)
    else:
        at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
        params.insert(at, added)
    runner.__dict__["__signature__"] = signature.replace(parameters=params, return_annotation=returns)
    runner.__annotations__ = {**{p.name: p.annotation for p in params}, "return": returns}
    runner.__name__ = fn.__name__
    runner.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
    runner.__doc__ = inspect.getdoc(fn)
    runner.__module__ = fn.__module__
    return name
