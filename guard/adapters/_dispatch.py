"""The core every host adapter shares: find the tool, check the arguments, run it under the call's id.

A host adapter reads a provider's tool call into a name, an id and the model's arguments, hands them
to :func:`dispatch` or :func:`adispatch`, and shapes the :class:`Outcome` into what the provider
expects next. Nothing here imports an SDK.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import re
import typing
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import orjson

from ..airlock import Airlock, _tool_of
from ..canonical import storable, to_json_value
from ..context import AirlockContext, get_current_context
from ..effect_guard import EffectGuard
from ..offload import offloaded, offloads
from ..outcomes import is_deferred, message_of
from ..refusal import AirlockBlocked, Refusal, is_refusal, make_refusal
from ..scope import stored_call_id
from ..store import EffectEvent

__all__ = ["Outcome", "Tools", "adispatch", "call_id_of", "dispatch", "field", "refusal_text", "tool_table"]

log = logging.getLogger("guard.adapters")

Tools = Mapping[str, Callable[..., Any]] | Iterable[Callable[..., Any]]

_UNKNOWN_TOOL_HINTS = ("Call one of the tools this host offers, by its exact name.",)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one tool call came to.

    ``text`` is what the model reads: the tool's value as JSON, the refusal as JSON, or an error
    object naming the exception. ``is_error`` is true for a refusal or an exception. ``value`` is the
    tool's value, the :class:`~guard.Refusal`, or the exception.
    """

    text: str
    is_error: bool
    value: Any = None


@dataclass(frozen=True, slots=True)
class _Guarded:
    """One tool of the table: the name the model calls it by, and the guard around it."""

    name: str
    fn: Callable[..., Any]
    airlock: Airlock
    guarded: Callable[..., Any]  # the object along the __wrapped__ chain that @Airlock returned


def _find_guard(fn: Callable[..., Any]) -> tuple[Airlock, Callable[..., Any]] | None:
    seen: set[int] = set()
    obj: Any = fn
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        found = obj.__dict__.get("__airlock__") if hasattr(obj, "__dict__") else None
        if isinstance(found, Airlock) and "__airlock_tool__" in obj.__dict__:
            return found, obj
        obj = getattr(obj, "__wrapped__", None)
    return None


def type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s resolved type hints, leaving out those that do not resolve (a name local to a function)."""
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:
        pass
    globalns = getattr(inspect.unwrap(fn), "__globals__", {})
    hints: dict[str, Any] = {}
    for name, annotation in getattr(fn, "__annotations__", {}).items():
        holder = type("_One", (), {"__annotations__": {name: annotation}})
        try:
            hints[name] = typing.get_type_hints(holder, globalns=globalns, include_extras=True)[name]
        except Exception:
            continue
    return hints


# Per tool function: each typed parameter's validator (pydantic's, when it is installed) and default.
_CHECKS: weakref.WeakKeyDictionary[Callable[..., Any], dict[str, tuple[Any, Any]]] = weakref.WeakKeyDictionary()


def _checks(fn: Callable[..., Any]) -> dict[str, tuple[Any, Any]]:
    found = _CHECKS.get(fn)
    if found is not None:
        return found
    found = {}
    try:
        import pydantic
    except ImportError:  # every provider's SDK brings pydantic; without it only names are checked
        pass
    else:
        hints = type_hints(fn)
        for p in inspect.signature(fn).parameters.values():
            hint = hints.get(p.name, Any)
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) or hint is Any:
                continue
            try:
                found[p.name] = (pydantic.TypeAdapter(hint), p.default)
            except Exception:
                continue  # a type pydantic cannot check is taken as it comes
    with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced is checked afresh
        _CHECKS[fn] = found
    return found


def tool_table(tools: Tools) -> dict[str, _Guarded]:
    """The tools by the name the model calls them: a mapping as given, a list by ``__name__``.

    Raises ``TypeError`` for a tool that is not decorated with ``@Airlock`` (it would run
    unguarded) or for ``tools`` of another type, ``ValueError`` for two tools of one name.
    """
    if isinstance(tools, str | bytes) or not isinstance(tools, Mapping | Iterable):
        raise TypeError(
            "tools is a mapping of tool name to guarded function, or a list of guarded functions, "
            f"not {type(tools).__name__}"
        )
    pairs: list[tuple[str, Any]]
    if isinstance(tools, Mapping):
        pairs = list(tools.items())
    else:
        pairs = []
        for fn in tools:
            name = getattr(fn, "__name__", None)
            if not isinstance(name, str):
                raise TypeError(f"a tool in the list must be a guarded function with a __name__, not {fn!r}")
            pairs.append((name, fn))
    table: dict[str, _Guarded] = {}
    for name, fn in pairs:
        if not isinstance(name, str) or not name:
            raise TypeError(f"a tool's name is a non-empty string, not {name!r}")
        if not callable(fn):
            raise TypeError(f"the tool {name!r} is not callable: {fn!r}")
        found = _find_guard(fn)
        if found is None:
            raise TypeError(
                f"the tool {name!r} is not decorated with @Airlock; an adapter only runs guarded tools"
            )
        if name in table:
            raise ValueError(f"two tools are named {name!r}; give them distinct names in a mapping")
        unnamed = [p.name for p in inspect.signature(fn).parameters.values()
                   if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
        if unnamed:
            raise TypeError(f"the tool {name!r} has positional-only parameters ({', '.join(unnamed)}): a model "
                            "names every argument, so it could never call it")
        table[name] = _Guarded(name, fn, found[0], found[1])
    return table


def _shown(obj: Any) -> str:
    """``str(obj)`` as JSON can carry it: storable, or ``<unprintable X>`` when ``__str__`` fails."""
    try:
        return storable(str(obj))
    except Exception:
        return f"<unprintable {type(obj).__name__}>"


def _escaped(obj: Any) -> Any:
    """``obj`` with every string in it storable (a lone surrogate written as its backslash escape)."""
    if isinstance(obj, str):
        return storable(obj)
    if isinstance(obj, Mapping):
        return {_escaped(k): _escaped(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_escaped(v) for v in obj]
    return obj


def _json_text(obj: Any) -> str:
    """``obj`` as JSON text, always: anything else as its ``str()``, and a lone surrogate (which
    has no UTF-8 form) backslash-escaped, so a tool's odd text never makes the adapter raise."""
    try:
        return orjson.dumps(obj, default=_shown).decode()
    except TypeError:
        return orjson.dumps(_escaped(obj), default=_shown).decode()


def _text(value: Any) -> str:
    """The tool's value as the model reads it: its JSON form (the form a replay returns); a value
    that has none, or whose serialisation raises (a model_dump that fails), is sent as the JSON
    string of its ``str()``, so the text is always JSON and the adapter never raises after the
    tool ran."""
    try:
        text = to_json_value(value)
    except Exception:
        text = None
    return text if text is not None else _json_text(_shown(value))


def refusal_text(refusal: Refusal) -> str:
    """The refusal as the JSON object the model reads."""
    return _json_text(dict(refusal))


def _refused(refusal: Refusal) -> Outcome:
    return Outcome(refusal_text(refusal), True, refusal)


def _raised(tool: _Guarded, call_id: str | None, exc: Exception) -> Outcome:
    log.warning("tool %r raised (tool_call_id=%s)", tool.name, call_id, exc_info=exc)
    kind, message = storable(type(exc).__name__), message_of(exc)
    error = {
        "success": False,
        "status": "error",
        "error": f"The tool {tool.name!r} failed with {kind}: {message}",
        "error_type": kind,
        "message": message,
    }
    return Outcome(_json_text(error), True, exc)


def _refuses_this_call(tool: _Guarded, call_id: str | None, result: Any) -> bool:
    """Whether ``result`` is the guard's refusal of this very call, not a value the tool returned
    that happens to be a :class:`~guard.Refusal` (one a guarded call nested in it was given, say;
    that one names its own tool, and no tool call id). A value is sent as a value, as its replay is."""
    if not is_refusal(result):
        return False
    meta = result.get("metadata")
    if not isinstance(meta, Mapping):
        return True
    own_id = call_id if isinstance(call_id, str) and call_id else None  # as the context reads it
    # The name the guard puts in its refusals: the tool's own, whatever the wrapper's __name__ became.
    return meta.get("tool") == _tool_of(tool.guarded).name and meta.get("tool_call_id") == own_id


def _blocked(tool: _Guarded, call_id: str | None, blocked: AirlockBlocked) -> Outcome:
    """The guard's refusal of this call, raised (``on_block="raise"``); or, when the refusal is of
    another call (a guarded call nested in the tool refused that way), an exception the tool raised."""
    if _refuses_this_call(tool, call_id, blocked.refusal):
        return _refused(blocked.refusal)
    return _raised(tool, call_id, blocked)


def _finished(tool: _Guarded, call_id: str | None, result: Any) -> Outcome:
    if _refuses_this_call(tool, call_id, result):
        return _refused(result)
    if is_deferred(result):
        # The guard recorded the call unknown; nothing of it can reach the model as a value.
        kind = type(result).__name__
        if inspect.iscoroutine(result):
            result.close()  # never to be awaited: closed, so it is not reported as forgotten
        error = {
            "success": False,
            "status": "error",
            "error": f"The tool {tool.name!r} returned a {kind}, not a value; its effect, if any, happens "
                     "as it is consumed, so its outcome is unknown. Do not retry this call.",
            "error_type": kind,
        }
        return Outcome(_json_text(error), True, result)
    return Outcome(_text(result), False, result)


def _guards(table: Mapping[str, _Guarded]) -> list[EffectGuard]:
    """The effect guards of the tools, one a store."""
    guards: list[EffectGuard] = []
    for tool in table.values():
        eg = tool.airlock.policy.effect_guard
        if eg is not None and not any(eg.store is g.store for g in guards):
            guards.append(eg)
    return guards


class _Rejection:
    """Arguments that cannot be passed on, and why: the refusal, still to be made."""

    __slots__ = ("arguments", "details", "problem")

    def __init__(self, tool: _Guarded, arguments: Any, problem: str, **details: Any) -> None:
        self.arguments, self.problem, self.details = arguments, problem, details


def _unknown_tool(table: Mapping[str, _Guarded], name: str, call_id: str | None,
                  agent_id: str | None) -> Outcome:
    offered = sorted(table)
    error = f"There is no tool named {name!r}; it was not run. The tools are: {', '.join(offered) or 'none'}."
    refusal = make_refusal(
        "policy_violation", error, _UNKNOWN_TOOL_HINTS,
        {"tool": name, "tool_call_id": call_id, "agent_id": agent_id, "idempotency_key": None,
         "violation_type": "unknown_tool", "tools": offered},
    )
    # The refusal is journaled only where the store is beyond doubt: every tool shares one.
    guards = _guards(table)
    if len(guards) == 1:
        # Under the id the guard keeps the call under, when its tools' guards agree on the scope.
        scopes = {eg.id_scope for t in table.values() if (eg := t.airlock.policy.effect_guard) is not None}
        stored = stored_call_id(scopes.pop(), agent_id, call_id) if call_id is not None and len(scopes) == 1 else None
        try:
            # The name is the model's: a lone surrogate is kept as its backslash escape.
            guards[0].store.append(EffectEvent(
                kind="refused", call_id=stored, tool=storable(name), agent_id=storable(agent_id),
                reason={"code": "policy_violation", "message": storable(error)},
            ))
        except Exception as e:
            log.error("store could not record refused for unknown tool %r (tool_call_id=%s): %r", name, call_id, e)
    return _refused(refusal)


def _refuse_arguments(tool: _Guarded, arguments: Any, problem: str, **details: Any) -> Outcome:
    """The refusal of arguments that cannot be passed on, unless a gate that comes before the
    arguments (policy, capabilities, a missing tool call id) refuses the call first (SPEC 2.4);
    ``arguments`` as the model sent them (decoded where they were JSON), journaled when they have a
    JSON form."""
    error = f"The arguments to {tool.name!r} {problem}; it was not run."
    try:
        refusal = tool.airlock.refuse(tool.guarded, "arguments_not_canonical", error, arguments,
                                      violation_type="arguments_invalid", **details)
    except AirlockBlocked as blocked:
        refusal = blocked.refusal
    return _refused(refusal)


# Nineteen digits in a row: perhaps an integer beyond orjson's range (-2**63 to 2**64 - 1).
_LONG_DIGITS = re.compile(r"[0-9]{19}")
_LONG_DIGIT_BYTES = re.compile(rb"[0-9]{19}")


def _long_digits(text: str | bytes | bytearray) -> bool:
    if isinstance(text, str):
        return _LONG_DIGITS.search(text) is not None
    return _LONG_DIGIT_BYTES.search(text) is not None


def _parse(tool: _Guarded, arguments: Any, refuse: Callable[..., Any] = _refuse_arguments) -> Any:
    """The model's arguments as keyword arguments that fit the tool, or what ``refuse(tool, arguments,
    problem, **details)`` makes of why not (the refusal itself, by default)."""
    if isinstance(arguments, str | bytes | bytearray):
        try:
            decoded = orjson.loads(arguments)
        except orjson.JSONDecodeError as e:
            return refuse(tool, None, f"are not valid JSON ({e})")
        if _long_digits(arguments):
            # orjson reads an integer beyond 64 bits as a rounded float; the standard library keeps
            # it exact, so the tool gets what the model sent and the guard refuses to key it.
            try:
                decoded = json.loads(arguments)
            except RecursionError:  # nested deeper than Python's own stack goes: no key could hold it
                return refuse(tool, None, "nest arrays or objects too deeply to be read")
        arguments = decoded
    if not isinstance(arguments, Mapping):
        return refuse(
            tool, arguments, f"are not a JSON object of named arguments (got {_json_kind(arguments)})",
        )
    kwargs = dict(arguments)
    signature = inspect.signature(tool.fn)
    parameters = signature.parameters
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        return refuse(
            tool, kwargs, f"do not fit its signature ({e})",
            parameters=[p for p in parameters if parameters[p].kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)],
        )
    # The types the tool's annotations (and the schema a host derives from them) promise are
    # checked; the tool still gets the JSON values the model sent, so that the idempotency key is
    # that of the model's arguments, whatever pydantic would make of them. The parameter's own
    # default passes as it is.
    for name, (adapter, default) in _checks(tool.fn).items():
        if name in kwargs and kwargs[name] is not default:
            try:
                adapter.validate_python(kwargs[name])
            except Exception as e:
                errors = getattr(e, "errors", None)
                why = errors()[0].get("msg", str(e)) if callable(errors) and errors() else str(e)
                return refuse(tool, kwargs, f"do not fit its signature ({name!r}: {why})",
                                         argument=name)
    return kwargs


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


def _context(call_id: str | None, agent_id: str | None, metadata: Mapping[str, Any] | None) -> AirlockContext:
    """The call's context: the host's own (its agent and metadata) refined by this call's id."""
    host = get_current_context()
    merged: dict[str, Any] = dict(host.metadata) if host is not None else {}
    if metadata:
        merged.update(metadata)
    merged.pop("tool_call_id", None)
    if call_id is not None:
        merged["tool_call_id"] = call_id
    if agent_id is None and host is not None:
        agent_id = host.agent_id
    return AirlockContext(agent_id=agent_id, metadata=merged)


def dispatch(tools: Tools, name: str, call_id: str | None, arguments: Any, *,
             agent_id: str | None = None, metadata: Mapping[str, Any] | None = None,
             reraise: tuple[type[BaseException], ...] = ()) -> Outcome:
    """Run one tool call of a synchronous host.

    ``arguments`` is the model's JSON text, or an already decoded mapping. ``call_id`` becomes the
    context's ``metadata["tool_call_id"]``. Raises ``TypeError`` for an ``async def`` tool (use
    :func:`adispatch`) and for ``tools`` that are not guarded functions; every problem of the model's
    making (an unknown tool, arguments that do not fit, a refusal, an exception) is an :class:`Outcome`,
    except an exception of a type in ``reraise`` (a framework's own control flow), which propagates.
    """
    table = tool_table(tools)
    with _context(call_id, agent_id, metadata) as ctx:
        tool = table.get(name)
        if tool is None:
            return _unknown_tool(table, name, call_id, ctx.agent_id)
        if inspect.iscoroutinefunction(tool.fn):
            raise TypeError(f"the tool {name!r} is an async def; dispatch it with adispatch")
        kwargs = _parse(tool, arguments)
        if isinstance(kwargs, Outcome):
            return kwargs
        try:
            result = tool.fn(**kwargs)
        except reraise:
            raise
        except AirlockBlocked as blocked:
            return _blocked(tool, call_id, blocked)
        except Exception as e:
            return _raised(tool, call_id, e)
    return _finished(tool, call_id, result)


async def adispatch(tools: Tools, name: str, call_id: str | None, arguments: Any, *,
                    agent_id: str | None = None, metadata: Mapping[str, Any] | None = None,
                    reraise: tuple[type[BaseException], ...] = ()) -> Outcome:
    """Run one tool call of an async host: an ``async def`` tool is awaited, a ``def`` tool called.

    An awaitable that a ``def`` tool returns is awaited too (the guard has recorded that call
    ``unknown``, as for any deferred result). Otherwise as :func:`dispatch`.
    """
    table = tool_table(tools)
    async with _context(call_id, agent_id, metadata) as ctx:
        tool = table.get(name)
        if tool is None:
            if any(offloads(eg.offload) for eg in _guards(table)):
                return cast(Outcome, await offloaded(_unknown_tool, table, name, call_id, ctx.agent_id))
            return _unknown_tool(table, name, call_id, ctx.agent_id)
        kwargs = _parse(tool, arguments, refuse=_Rejection)
        if isinstance(kwargs, _Rejection):  # journaled off the loop, as the guard's own refusals are
            eg = tool.airlock.policy.effect_guard
            refuse = functools.partial(_refuse_arguments, tool, kwargs.arguments, kwargs.problem, **kwargs.details)
            return cast(Outcome, await offloaded(refuse) if eg is not None and offloads(eg.offload) else refuse())
        try:
            result = tool.fn(**kwargs)
            if inspect.isawaitable(result):
                result = await result
        except reraise:
            raise
        except AirlockBlocked as blocked:
            return _blocked(tool, call_id, blocked)
        except Exception as e:
            return _raised(tool, call_id, e)
    return _finished(tool, call_id, result)


def call_id_of(value: Any, what: str) -> str:
    """A tool call's id as the provider gave it: a non-empty string, else ``ValueError``/``TypeError``."""
    if value is None or value == "":
        raise ValueError(f"the {what} has no id; the provider's reply must name the call it answers")
    if not isinstance(value, str):
        raise TypeError(f"the {what}'s id is a string, not {type(value).__name__}")
    return value


def field(obj: Any, name: str) -> Any:
    """``obj[name]`` of a dict, ``obj.name`` of an SDK object; None when absent."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)
