"""At-most-once dispatch: the effect guard's options, reversibility, and the replay table."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

from .canonical import idempotency_key
from .memory import InMemoryEffectStore
from .store import CallRecord, Decision, EffectEvent, EffectStore, Verdict, format_at, utc_now

__all__ = [
    "DEFAULT_AMBIGUOUS_ERRORS",
    "EffectGuard",
    "EffectOutcomeUnknown",
    "EffectStore",
    "InMemoryEffectStore",
    "decide_attempt",
    "idempotency_key",
    "reversibility",
    "reversibility_of",
]

F = TypeVar("F", bound=Callable[..., Any])
Reversibility = Literal["reversible", "costly", "irreversible"]
_RANK = {"reversible": 0, "costly": 1, "irreversible": 2}
_REVERSIBILITY_ATTR = "__airlock_reversibility__"


class EffectOutcomeUnknown(Exception):
    """Raised by a tool that cannot tell whether its effect happened: the call is recorded unknown."""


DEFAULT_AMBIGUOUS_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    ConnectionResetError,
    ConnectionAbortedError,
    BrokenPipeError,
    EffectOutcomeUnknown,
)


def reversibility(tag: Reversibility) -> Callable[[F], F]:
    """Tag a tool ``"reversible"``, ``"costly"`` or ``"irreversible"`` (above or below ``@Airlock``).

    Raises ``ValueError`` at once for any other tag.
    """
    if tag not in _RANK:
        raise ValueError(f"reversibility takes 'reversible', 'costly' or 'irreversible', not {tag!r}")

    def mark(fn: F) -> F:
        previous = getattr(fn, _REVERSIBILITY_ATTR, None)
        if previous is None or _RANK[tag] > _RANK[previous]:
            setattr(fn, _REVERSIBILITY_ATTR, tag)
        return fn

    return mark


def reversibility_of(fn: Callable[..., Any]) -> Reversibility:
    """The strictest tag along the ``__wrapped__`` chain; an untagged tool is irreversible."""
    best: str | None = None
    seen: set[int] = set()
    obj: Any = fn
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        tag = getattr(obj, _REVERSIBILITY_ATTR, None)
        if tag in _RANK and (best is None or _RANK[tag] > _RANK[best]):
            best = tag
        obj = getattr(obj, "__wrapped__", None)
    result: Reversibility = "irreversible" if best is None else best  # type: ignore[assignment]
    return result


class EffectGuard:
    """The options of at-most-once dispatch; goes into ``SecurityPolicy(effect_guard=...)``.

    Args:
        store: where calls' statuses live; None makes a fresh :class:`InMemoryEffectStore`.
        require_tool_call_id: refuse a call to a tool that is not reversible when the context has no
            ``tool_call_id``, since it cannot be run at most once.
        require_approval_for_irreversible: escalate every call to an irreversible tool.
        target_args: an irreversible call must pass one of these arguments with a value.
        ambiguous_errors: the exceptions that record a call ``unknown`` instead of ``released``.
    """

    def __init__(
        self,
        store: EffectStore | None = None,
        require_tool_call_id: bool = True,
        require_approval_for_irreversible: bool = False,
        target_args: Iterable[str] = (),
        ambiguous_errors: Iterable[type[BaseException]] = DEFAULT_AMBIGUOUS_ERRORS,
    ) -> None:
        if isinstance(target_args, str):
            raise TypeError("target_args takes a list of argument names, not a string")
        self.store: EffectStore = store if store is not None else InMemoryEffectStore()
        self.require_tool_call_id = bool(require_tool_call_id)
        self.require_approval_for_irreversible = bool(require_approval_for_irreversible)
        self.target_args: tuple[str, ...] = tuple(target_args)
        self.ambiguous_errors: tuple[type[BaseException], ...] = tuple(ambiguous_errors)

    def __repr__(self) -> str:
        return (
            f"EffectGuard(store={self.store!r}, require_tool_call_id={self.require_tool_call_id}, "
            f"require_approval_for_irreversible={self.require_approval_for_irreversible}, "
            f"target_args={self.target_args!r})"
        )


def decide_attempt(
    record: CallRecord | None,
    *,
    call_id: str,
    tool: str,
    key: str,
    arguments: str,
    agent_id: str | None,
    reversible: bool,
    approval: dict[str, str] | None = None,
) -> Decision:
    """The replay table: what a call with a ``tool_call_id`` does, given the record of that id."""
    at = utc_now()

    def event(kind: str, attempt: int, reason: dict[str, str] | None = None) -> EffectEvent:
        return EffectEvent(
            kind=kind, call_id=call_id, tool=tool, at=at, agent_id=agent_id, idempotency_key=key,
            arguments=arguments, reason=reason, attempt=attempt,
        )

    def refuse(code: str, message: str, **details: Any) -> Decision:
        assert record is not None
        return Decision(
            Verdict.REFUSE, event("refused", record.attempt, {"code": code, "message": message}),
            record, code, message, details,
        )

    if record is None:
        return Decision(Verdict.RUN, event("pending", 1, approval))
    if record.tool != tool or record.idempotency_key != key:
        return refuse(
            "policy_violation",
            f"The tool call id {call_id!r} was already used for "
            + ("another tool" if record.tool != tool else "other arguments")
            + "; every tool call needs its own id.",
            violation_type="tool_call_id_reused",
            earlier_tool=record.tool,
        )
    status = record.status
    if status == "committed":
        if record.value is None:
            return refuse(
                "replay_value_unavailable",
                "This call already took effect, but its result was not stored, so it cannot be "
                "returned; it will not be run again.",
                status=status, idempotency_key=key, attempt=record.attempt,
            )
        return Decision(Verdict.REPLAY, event("replayed", record.attempt), record)
    if status == "released" or reversible:
        return Decision(Verdict.RUN, event("pending", record.attempt + 1, approval), record)
    return refuse(
        "effect_status_unknown",
        f"An earlier attempt of this call is {status} and may have taken effect: do not retry it; "
        f"ask the backend whether idempotency key {key} was applied.",
        status=status, idempotency_key=key, attempt=record.attempt, since=format_at(record.since),
    )
