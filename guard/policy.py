"""The policy gates: which tools may run, which capabilities are granted, which need approval."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from typing import Any, TypeVar

from .approvals import ApprovalQueue
from .effect_guard import EffectGuard, tag_along, wrapped_chain
from .oversight import Approver

__all__ = ["SecurityPolicy", "required_capabilities", "requires"]

F = TypeVar("F", bound=Callable[..., Any])
_REQUIRES_ATTR = "__airlock_requires__"


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(name == p or fnmatchcase(name, p) for p in patterns)


class SecurityPolicy:
    """What an agent may call.

    Args:
        allowed_tools: names or fnmatch globs; None allows every tool.
        denied_tools: names or globs that are refused; they win over ``allowed_tools``.
        escalate_tools: ``{name_or_glob: reason}``; a matching call must be granted by ``approver``.
        approver: called with an :class:`OversightRequest`, returns an :class:`OversightResponse`.
        granted_capabilities: the capabilities that ``@requires`` may ask for.
        effect_guard: an :class:`EffectGuard` for at-most-once dispatch.
    """

    def __init__(
        self,
        allowed_tools: Iterable[str] | None = None,
        denied_tools: Iterable[str] = (),
        escalate_tools: Mapping[str, str] | None = None,
        approver: Approver | None = None,
        granted_capabilities: Iterable[str] = (),
        effect_guard: EffectGuard | None = None,
    ) -> None:
        self.allowed_tools: tuple[str, ...] | None = (
            None if allowed_tools is None else _names("allowed_tools", allowed_tools, "tool names")
        )
        self.denied_tools: tuple[str, ...] = _names("denied_tools", denied_tools, "tool names")
        if escalate_tools is not None and not isinstance(escalate_tools, Mapping):
            raise TypeError(f"escalate_tools maps tool names or globs to reasons, not {type(escalate_tools).__name__}")
        self.escalate_tools: dict[str, str] = dict(escalate_tools or {})
        for pattern, reason in self.escalate_tools.items():
            if not isinstance(pattern, str) or not isinstance(reason, str):
                raise TypeError(f"escalate_tools maps a tool name or glob to the reason to ask, as strings; "
                                f"not {pattern!r}: {reason!r}")
        if approver is not None and not callable(approver):
            raise TypeError(f"approver is a function of an OversightRequest, not {approver!r}")
        if isinstance(approver, ApprovalQueue):
            if effect_guard is None:
                raise TypeError("an ApprovalQueue keeps its requests in the effect guard's store: give the "
                                "policy an effect_guard=EffectGuard(store=...)")
            if effect_guard.approvals is None:
                raise TypeError(f"an ApprovalQueue needs a store that keeps approvals (InMemoryEffectStore, "
                                f"SQLiteJournal, PostgresJournal), not {type(effect_guard.store).__name__}")
        self.approver = approver
        # A lone string would grant each of its letters.
        self.granted_capabilities: frozenset[str] = frozenset(
            _names("granted_capabilities", granted_capabilities, "capabilities"))
        if effect_guard is not None and not isinstance(effect_guard, EffectGuard):
            raise TypeError(
                f"effect_guard is an EffectGuard (EffectGuard(store=...)), not {type(effect_guard).__name__}")
        self.effect_guard = effect_guard

    def violation(self, tool: str) -> str | None:
        """``"tool_denied"`` or ``"tool_not_allowed"`` when the policy refuses ``tool``, else None."""
        if self.allowed_tools is None and not self.denied_tools:
            return None
        if _matches(tool, self.denied_tools):
            return "tool_denied"
        if self.allowed_tools is not None and not _matches(tool, self.allowed_tools):
            return "tool_not_allowed"
        return None

    def missing_capabilities(self, required: frozenset[str]) -> list[str]:
        return sorted(required - self.granted_capabilities)

    def escalation_reason(self, tool: str) -> str | None:
        """The reason an ``escalate_tools`` entry gives for ``tool``, or None when none matches."""
        if not self.escalate_tools:
            return None
        exact = self.escalate_tools.get(tool)
        if exact is not None:
            return exact  # the tool's own entry wins over any glob that matches it too
        for pattern, reason in self.escalate_tools.items():
            if fnmatchcase(tool, pattern):
                return reason
        return None

    def __repr__(self) -> str:
        return (
            f"SecurityPolicy(allowed_tools={self.allowed_tools!r}, denied_tools={self.denied_tools!r}, "
            f"escalate_tools={self.escalate_tools!r}, granted_capabilities={sorted(self.granted_capabilities)!r}, "
            f"effect_guard={self.effect_guard!r})"
        )


def _names(what: str, names: Iterable[str], of: str) -> tuple[str, ...]:
    """``names`` as a tuple of strings; a lone string, or anything but strings in it, is a TypeError."""
    if isinstance(names, str | bytes):
        raise TypeError(f"{what} takes a list of {of}, not a string")
    try:
        found = tuple(names)
    except TypeError:
        raise TypeError(f"{what} takes a list of {of}, not {type(names).__name__}") from None
    for name in found:
        if not isinstance(name, str):
            raise TypeError(f"{what} takes a list of {of} as strings, not {name!r}")
    return found


def requires(*capabilities: str) -> Callable[[F], F]:
    """Declare the capabilities a tool needs; works above or below ``@Airlock``."""
    for cap in capabilities:
        if not isinstance(cap, str) or not cap:
            raise ValueError(f"a capability is a non-empty string, not {cap!r}")

    def union(existing: Any) -> frozenset[str]:
        return frozenset(existing or ()) | frozenset(capabilities)

    def mark(fn: F) -> F:
        tag_along(fn, _REQUIRES_ATTR, union)
        return fn

    return mark


def required_capabilities(fn: Callable[..., Any]) -> frozenset[str]:
    """Every capability named along the ``__wrapped__`` chain."""
    found: set[str] = set()
    for obj in wrapped_chain(fn):
        found.update(getattr(obj, _REQUIRES_ATTR, ()))
    return frozenset(found)
