"""Canonical JSON, argument binding and the idempotency key (the byte rule of docs/semantics.md).

``canonical_json(x)`` is orjson with sorted keys and no whitespace; dataclasses and pydantic
models enter as objects of their fields, so their key order never matters. A value with no JSON
form (an arbitrary object, NaN, an infinity, a non-string key, a set) raises
:class:`NotCanonical`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import math
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, overload

import orjson

__all__ = [
    "NotCanonical",
    "bind_arguments",
    "canonical_json",
    "idempotency_key",
    "key_from_canonical",
    "key_prefix",
    "storable",
    "to_json_value",
]

_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS


class NotCanonical(ValueError):
    """The value has no canonical JSON form."""


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    model_dump = getattr(obj, "model_dump", None)
    if callable(model_dump) and not isinstance(obj, type):
        return model_dump(mode="json")
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


def _has_nonfinite(obj: Any) -> bool:
    """orjson writes NaN and infinities as null; find them in what was serialised."""
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, Mapping):
        return any(_has_nonfinite(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_nonfinite(v) for v in obj)
    if isinstance(obj, enum.Enum):
        return _has_nonfinite(obj.value)  # orjson writes a member as its value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(_has_nonfinite(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if callable(getattr(obj, "model_dump", None)) and not isinstance(obj, type):
        return _has_nonfinite(obj.model_dump(mode="python"))
    return False


def _str_keys(obj: Any) -> Any:
    """``obj`` made of what orjson writes without a ``default``, as orjson writes it: every key that
    is a ``str`` of a subclass (a ``StrEnum`` member, say) as the plain string it is, a tuple of a
    subclass (a ``NamedTuple``) as the list of its items, a float of a subclass as its float, other
    enum members as their values, dataclasses and models as their fields. Other keys and values are
    left for orjson to refuse. Two keys that become one string raise NotCanonical."""
    # In orjson's order: a str or int of a subclass (an enum member too) is written as itself,
    # any other enum member as its value.
    if isinstance(obj, dict):
        out: dict[Any, Any] = {}
        for k, v in dict.items(obj):  # what orjson reads, whatever a subclass's items() says
            key = str.__str__(k) if isinstance(k, str) else k
            if key in out:
                raise NotCanonical(f"two keys of one object are the string {key!r}")
            out[key] = _str_keys(v)
        return out
    if isinstance(obj, list):
        return [_str_keys(v) for v in list.__iter__(obj)]
    if isinstance(obj, str | int):
        return obj
    if isinstance(obj, enum.Enum):
        return _str_keys(obj.value)
    if isinstance(obj, tuple):
        return [_str_keys(v) for v in tuple.__iter__(obj)]
    if isinstance(obj, float):
        return float.__float__(obj)  # an exact float, of a subclass's value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _str_keys(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if callable(getattr(obj, "model_dump", None)) and not isinstance(obj, type):
        return _str_keys(obj.model_dump(mode="json"))
    return obj


def canonical_bytes(obj: Any) -> bytes:
    """The canonical JSON bytes of ``obj``, or :class:`NotCanonical`."""
    try:
        # Plain JSON types need no ``default``, and orjson is faster without one.
        out = orjson.dumps(obj, option=_OPTIONS)
    except orjson.JSONEncodeError as first:
        out = _fallback_bytes(obj, str(first))
    # find, not ``in``: bytes' ``in`` tries its operand as an int first, an exception a call.
    if out.find(b"null") >= 0:
        try:
            nonfinite = _has_nonfinite(obj)
        except Exception as e:  # a model whose dump in Python mode fails: no form can be trusted
            raise NotCanonical(f"{type(e).__name__} while checking its JSON form: {e}") from e
        if nonfinite:
            raise NotCanonical("NaN and infinities have no JSON form")
    return out


_DEEP = "Recursion limit reached"  # orjson writes at most 254 levels of nesting


def _fallback_bytes(obj: Any, first: str) -> bytes:
    """The canonical bytes of ``obj``, which orjson alone could not write (its error: ``first``).

    Dataclasses and models go through ``default``, as they always have. What orjson refuses even so
    (a key or a tuple or float of a subclass, met anywhere, inside a dataclass too) is written from
    ``_str_keys(obj)``, which gives the same bytes for whatever the other way can write: so the form
    of a value never depends on which of its parts orjson meets first.
    """
    try:
        if "Dict key must be str" not in first:
            try:
                return orjson.dumps(obj, default=_default, option=_OPTIONS)
            except orjson.JSONEncodeError as e:
                if str(e) == _DEEP:
                    raise
        return orjson.dumps(_str_keys(obj), default=_default, option=_OPTIONS)
    except NotCanonical:
        raise
    except (TypeError, orjson.JSONEncodeError) as e:
        if str(e) == _DEEP:
            raise NotCanonical("it nests arrays or objects more than 254 levels deep") from e
        raise NotCanonical(str(e)) from e
    except Exception as e:  # a model's own dump failing, or nesting too deep to walk
        raise NotCanonical(f"{type(e).__name__} while making its JSON form: {e}") from e


def canonical_json(obj: Any) -> str:
    """The canonical JSON text of ``obj``, or :class:`NotCanonical`."""
    return canonical_bytes(obj).decode()


def to_json_value(obj: Any) -> str | None:
    """The stored JSON form of a tool's value (canonical), or None when it cannot be stored."""
    try:
        return canonical_bytes(obj).decode()
    except NotCanonical:
        return None


@overload
def storable(text: str) -> str: ...


@overload
def storable(text: None) -> None: ...


def storable(text: str | None) -> str | None:
    """``text`` as every store can keep it: a lone surrogate (an ``os.fsdecode``'d file name, say)
    has no UTF-8 form, so it is written as its backslash escape (``\\udcff``). None stays None."""
    if text is None or text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def key_prefix(tool: str) -> bytes:
    """The bytes the key of every call to ``tool`` starts with: its name and a NUL."""
    return storable(tool).encode() + b"\x00"  # a lone surrogate as its escape, as the journal records it


def key_from_canonical(tool: str | bytes, arguments_json: bytes) -> str:
    """The idempotency key of ``tool`` (a name, or its :func:`key_prefix`) called with these
    canonical arguments."""
    prefix = tool if isinstance(tool, bytes) else key_prefix(tool)
    return hashlib.sha256(prefix + arguments_json).hexdigest()


def idempotency_key(tool: str, arguments: Mapping[str, Any]) -> str:
    """``sha256(tool.encode() + b"\\x00" + canonical_json(arguments))`` as 64 lowercase hex.

    ``arguments`` are the call's arguments bound by name (see :func:`bind_arguments`).
    Raises :class:`NotCanonical` when they have no JSON form.
    """
    return key_from_canonical(tool, canonical_bytes(dict(arguments)))


class Binder:
    """Binds a call's arguments to one function's signature (cached per tool)."""

    __slots__ = ("_all_positional", "_defaults", "_n_positional", "_names", "_nameset", "_simple",
                 "_var_keyword", "_var_positional", "signature")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.signature = inspect.signature(fn)
        params = list(self.signature.parameters.values())
        self._var_positional = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
        self._var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        # A signature of plain parameters binds without inspect on the fast path.
        self._simple = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
        self._names = tuple(p.name for p in params)
        self._nameset = frozenset(self._names)
        self._n_positional = sum(1 for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
        # (index, name) of every parameter, when all of them may be passed by position.
        self._all_positional = tuple(enumerate(self._names)) if self._n_positional == len(params) else ()
        self._defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def bind(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], AbstractSet[str]]:
        """The arguments by name with defaults applied, and the names the caller passed.

        Raises ``TypeError`` when they do not fit the signature, as the call itself would.
        """
        names = self._names
        if not kwargs and self._simple and len(args) == len(names) and self._all_positional:
            # The commonest call: every argument by position (a loop is faster than dict(zip())).
            bound = {}
            for i, name in self._all_positional:
                bound[name] = args[i]
            return bound, bound.keys()
        if self._simple and len(args) <= self._n_positional and kwargs.keys() <= self._nameset:
            bound = dict(zip(names, args, strict=False))
            if not kwargs or not bound.keys() & kwargs.keys():
                if kwargs:
                    bound.update(kwargs)
                if len(bound) == len(names):
                    return bound, bound.keys()
                defaults = self._defaults
                if all(n in bound or n in defaults for n in names):
                    return {n: bound[n] if n in bound else defaults[n] for n in names}, bound.keys()
        ba = self.signature.bind(*args, **kwargs)
        passed = set(ba.arguments)
        ba.apply_defaults()
        bound = {}
        for name, value in ba.arguments.items():
            if name == self._var_positional:
                bound[name] = list(value)
            elif name == self._var_keyword:
                clash = value.keys() & bound.keys()
                if clash:
                    # Merged by name, these would overwrite another parameter: two different
                    # calls would share one key, and the approver would see what the tool does not get.
                    raise TypeError(
                        f"the keyword argument {min(clash)!r} has the name of another parameter, so the "
                        "call's arguments cannot be told apart by name"
                    )
                passed.discard(name)
                passed.update(value)
                bound.update(value)
            else:
                bound[name] = value
        return bound, passed


def bind_arguments(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The arguments of ``fn(*args, **kwargs)`` by name, defaults applied, ``*args`` as a list."""
    return Binder(fn).bind(args, kwargs)[0]
