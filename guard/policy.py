"""The policy gates: which tools may run, which capabilities are granted, which need approval."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, TypeVar

from .oversight import Approver

if TYPE_CHECKING:
    from .effect_guard import EffectGuard

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
        if isinstance(allowed_tools, str) or isinstance(denied_tools, str):
            raise TypeError("allowed_tools and denied_tools take a list of names, not a string")
        if isinstance(granted_capabilities, str):  # a lone string would grant each of its letters
            raise TypeError("granted_capabilities takes a list of capabilities, not a string")
        self.allowed_tools: tuple[str, ...] | None = None if allowed_tools is None else tuple(allowed_tools)
        self.denied_tools: tuple[str, ...] = tuple(denied_tools)
        self.escalate_tools: dict[str, str] = dict(escalate_tools or {})
        self.approver = approver
        self.granted_capabilities: frozenset[str] = frozenset(granted_capabilities)
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


def requires(*capabilities: str) -> Callable[[F], F]:
    """Declare the capabilities a tool needs; works above or below ``@Airlock``."""
    for cap in capabilities:
        if not isinstance(cap, str) or not cap:
            raise ValueError(f"a capability is a non-empty string, not {cap!r}")

    def mark(fn: F) -> F:
        existing = frozenset(getattr(fn, _REQUIRES_ATTR, ()))
        setattr(fn, _REQUIRES_ATTR, existing | frozenset(capabilities))
        return fn

    return mark


def required_capabilities(fn: Callable[..., Any]) -> frozenset[str]:
    """Every capability named along the ``__wrapped__`` chain."""
    found: set[str] = set()
    seen: set[int] = set()
    obj: Any = fn
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        found.update(getattr(obj, _REQUIRES_ATTR, ()))
        obj = getattr(obj, "__wrapped__", None)
    return frozenset(found)
