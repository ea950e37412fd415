"""At-most-once dispatch: the effect guard's options, reversibility, and the replay table."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, TypeVar

from .approvals import ApprovalStore
from .canonical import idempotency_key
from .leases import LeaseStore, Leasing, leases_in_begin
from .memory import InMemoryEffectStore
from .store import (
    GUARD_ACTOR,
    AsyncOffload,
    CallRecord,
    Decision,
    EffectEvent,
    EffectStore,
    RecentCalls,
    SettlingStore,
    Verdict,
    current_owner,
    format_at,
    utc_now,
)

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
    "tag_along",
    "wrapped_chain",
]

F = TypeVar("F", bound=Callable[..., Any])
Reversibility = Literal["reversible", "costly", "irreversible"]
_RANK = {"reversible": 0, "costly": 1, "irreversible": 2}
_REVERSIBILITY_ATTR = "__airlock_reversibility__"
_ABOVE_ATTR = "__airlock_reversibility_above__"  # on an @Airlock wrapper: the strictest tag put on above it
# What @Airlock sets on its wrapper (functools.wraps copies both onto a decorator above it).
_GUARDED_ATTR = "__airlock_tool__"
_RETAG_ATTR = "__airlock_retag__"
# Held while a tag is merged in and while a guard reads its tags into its cache, so that a tag is
# never lost between the two; a call whose tags are cached never takes it.
TAGS_LOCK = threading.RLock()
if hasattr(os, "register_at_fork"):  # a child must not wait for a thread of its parent that it lacks
    # typeshed does not declare the lock's own reinit, which threading uses for its locks at a fork.
    os.register_at_fork(after_in_child=TAGS_LOCK._at_fork_reinit)  # type: ignore[attr-defined]
# An enum member costs a class attribute lookup each time on Python 3.11; the hot path keeps them.
_RUN, _REPLAY, _REFUSE = Verdict.RUN, Verdict.REPLAY, Verdict.REFUSE


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
    if not isinstance(tag, str) or tag not in _RANK:
        raise ValueError(f"reversibility takes 'reversible', 'costly' or 'irreversible', not {tag!r}")

    def stricter(previous: Any) -> Any:
        return tag if previous not in _RANK or _RANK[tag] > _RANK[previous] else previous

    def mark(fn: F) -> F:
        # Recorded on the @Airlock wrapper below as a tag from above, apart from its own: a tool
        # has one reversibility, the strictest of all its tags, whatever order they came in.
        tag_along(fn, _REVERSIBILITY_ATTR, stricter, below=_ABOVE_ATTR)
        return fn

    return mark


def wrapped_chain(fn: Callable[..., Any]) -> Iterator[Any]:
    """``fn`` and each object along its ``__wrapped__`` chain, each once."""
    seen: set[int] = set()
    obj: Any = fn
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        yield obj
        obj = getattr(obj, "__wrapped__", None)


def tag_along(fn: Callable[..., Any], attr: str, merge: Callable[[Any], Any], below: str | None = None) -> None:
    """Set ``attr`` of ``fn`` to ``merge(its current value)``, and the same (``below`` instead of
    ``attr`` when given) on each ``@Airlock`` wrapper along its ``__wrapped__`` chain below ``fn``.

    A tag put above ``@Airlock`` with another decorator in between is on no object the guard
    reads from its own wrapper down; so it is recorded on that wrapper too, and a guard that has
    already read its tags (at its first call) reads them again. Under :data:`TAGS_LOCK`, so that
    two tags put on at once both hold and a guard reading its tags meanwhile sees this one.
    """
    with TAGS_LOCK:
        for obj in wrapped_chain(fn):
            own = getattr(obj, "__dict__", None)
            if not isinstance(own, dict):
                own = {}
            guarded = _GUARDED_ATTR in own
            if obj is not fn and not guarded:
                continue
            name = attr if obj is fn or below is None else below
            previous = getattr(obj, name, None)
            value = merge(previous)
            if value != previous:
                setattr(obj, name, value)
                if guarded:
                    retag = own.get(_RETAG_ATTR)
                    if callable(retag):
                        retag()


def reversibility_of(fn: Callable[..., Any]) -> Reversibility:
    """The strictest tag along the ``__wrapped__`` chain, with those put on decorators above a
    guarded tool of the chain; an untagged tool is irreversible."""
    best: Reversibility | None = None
    for obj in wrapped_chain(fn):
        for tag in (getattr(obj, _REVERSIBILITY_ATTR, None), getattr(obj, _ABOVE_ATTR, None)):
            if tag in _RANK and (best is None or _RANK[tag] > _RANK[best]):
                best = tag
    return "irreversible" if best is None else best


class EffectGuard:
    """The options of at-most-once dispatch; goes into ``SecurityPolicy(effect_guard=...)``.

    Args:
        store: where calls' statuses live; None makes a fresh :class:`InMemoryEffectStore`.
        require_tool_call_id: refuse a call to a tool that is not reversible when the context has no
            ``tool_call_id``, since it cannot be run at most once.
        require_approval_for_irreversible: escalate every call to an irreversible tool.
        target_args: an irreversible call must pass one of these arguments with a value.
        ambiguous_errors: the exceptions that record a call ``unknown`` instead of ``released``.
        reconcile_on_retry: when a retry finds a non-reversible call in doubt and the tool has a
            check (``@reconciled_by``), run the check before refusing (section 6 of the contract).
        lease: seconds; while a tool runs its call's lease is renewed at least every ``lease / 3``
            seconds, and a ``pending`` call whose lease ran out by the store's clock has no live owner.
            None: no lease (a pending call's owner is judged by host and process).
        id_scope: ``"global"`` keys a call on its ``tool_call_id`` alone; ``"agent"`` on
            ``(agent_id, tool_call_id)``, so one agent's id never returns another agent's value.
        duplicate_window: seconds; a call with a new ``tool_call_id`` whose idempotency key matches a
            call of the same agent begun within the window and not released is answered as that
            call (a re-planned copy). None: off.
        on_event: called with each event the guard journaled, after it is stored, off the tool's
            path; an exception in it is logged, never raised into the call.

    What the store can do beyond :class:`EffectStore` is read here, once (each attribute is the
    store itself, typed as the capability, or None): ``settling`` (a
    :class:`~guard.store.SettlingStore`), ``recent_calls`` (:class:`~guard.store.RecentCalls`),
    ``offload`` (:class:`~guard.store.AsyncOffload`, whose flag is read at each call),
    ``approvals`` (:class:`~guard.approvals.ApprovalStore`); and ``leasing``, the calls' leases
    when ``lease`` is given (:class:`~guard.leases.Leasing`).
    """

    def __init__(
        self,
        store: EffectStore | None = None,
        require_tool_call_id: bool = True,
        require_approval_for_irreversible: bool = False,
        target_args: Iterable[str] = (),
        ambiguous_errors: Iterable[type[BaseException]] = DEFAULT_AMBIGUOUS_ERRORS,
        *,
        reconcile_on_retry: bool = True,
        lease: float | None = None,
        id_scope: Literal["global", "agent"] = "global",
        duplicate_window: float | None = None,
        on_event: Callable[[EffectEvent], Any] | None = None,
    ) -> None:
        if isinstance(target_args, str | bytes):
            raise TypeError("target_args takes a list of argument names, not a string")
        if store is not None and not isinstance(store, EffectStore):
            raise TypeError(f"store is an EffectStore (SQLiteJournal, PostgresJournal, InMemoryEffectStore, or "
                            f"one of your own with begin, append and get), not {type(store).__name__}")
        self.store: EffectStore = store if store is not None else InMemoryEffectStore()
        self.require_tool_call_id = bool(require_tool_call_id)
        self.require_approval_for_irreversible = bool(require_approval_for_irreversible)
        self.target_args: tuple[str, ...] = tuple(target_args)
        if not all(isinstance(name, str) for name in self.target_args):
            raise TypeError(f"target_args takes argument names as strings, not {self.target_args!r}")
        # One exception class, or any number of them.
        errors: Any = (ambiguous_errors,) if isinstance(ambiguous_errors, type) else ambiguous_errors
        self.ambiguous_errors: tuple[type[BaseException], ...] = tuple(errors)
        for error in self.ambiguous_errors:
            if not (isinstance(error, type) and issubclass(error, BaseException)):
                raise TypeError(f"ambiguous_errors takes exception classes, not {error!r}")
        self.reconcile_on_retry = bool(reconcile_on_retry)
        store = self.store
        # Declared by the store, or found on it by its methods: either way once, not at each call.
        self.settling: SettlingStore | None = store if isinstance(store, SettlingStore) else None
        self.recent_calls: RecentCalls | None = store if isinstance(store, RecentCalls) else None
        self.offload: AsyncOffload | None = store if isinstance(store, AsyncOffload) else None
        self.approvals: ApprovalStore | None = store if isinstance(store, ApprovalStore) else None
        self.lease: float | None = _seconds("lease", lease)
        self.leasing: Leasing | None = None
        if self.lease is not None:
            if not isinstance(store, LeaseStore):
                raise TypeError(f"lease needs a store that keeps leases (SQLiteJournal, PostgresJournal, "
                                f"InMemoryEffectStore, or one with the methods of guard.leases.LeaseStore), not "
                                f"{type(store).__name__}")
            self.leasing = Leasing(store, self.lease, store if leases_in_begin(store) else None)
        if id_scope not in ("global", "agent"):
            raise ValueError(f"id_scope is 'global' or 'agent', not {id_scope!r}")
        self.id_scope: Literal["global", "agent"] = id_scope
        self.duplicate_window: float | None = _seconds("duplicate_window", duplicate_window)
        if self.duplicate_window is not None and self.recent_calls is None:
            raise TypeError(f"duplicate_window needs a store that can look calls up by agent and idempotency key "
                            f"(a recent_call method), which {type(store).__name__} has not")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event takes a callable (called with each journaled event), not {on_event!r}")
        self.on_event = on_event

    def __repr__(self) -> str:
        return (
            f"EffectGuard(store={self.store!r}, require_tool_call_id={self.require_tool_call_id}, "
            f"require_approval_for_irreversible={self.require_approval_for_irreversible}, "
            f"target_args={self.target_args!r})"
        )


def _seconds(name: str, value: float | None) -> float | None:
    """A positive, finite number of seconds, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ValueError(f"{name} is a positive number of seconds or None, not {value!r}")
    return float(value)


def decide_attempt(
    record: CallRecord | None,
    call_id: str,
    tool: str,
    key: str,
    arguments: str,
    agent_id: str | None,
    reversible: bool,
    approval: dict[str, str] | None = None,
) -> Decision:
    """The replay table: what a call with a ``tool_call_id`` does, given the record of that id.

    Returns the :class:`Decision` with the event to append: ``pending`` (RUN), ``replayed``
    (REPLAY) or ``refused`` (REFUSE). ``approval`` is the approver's grant, kept on ``pending``.
    """
    if record is None:
        return Decision(_RUN, EffectEvent(
            "pending", call_id, tool, utc_now(), agent_id, key, arguments, None, None, approval, GUARD_ACTOR, 1,
            current_owner(),
        ))
    if record.tool != tool or record.idempotency_key != key:
        other = "another tool" if record.tool != tool else "other arguments"
        return _refuse(
            record, call_id, tool, key, arguments, agent_id,
            "policy_violation",
            f"The tool call id {call_id!r} was already used for {other}; every tool call needs its own id.",
            violation_type="tool_call_id_reused", earlier_tool=record.tool,
        )
    status = record.status
    if status == "committed":
        if record.value is None:
            return _refuse(
                record, call_id, tool, key, arguments, agent_id,
                "replay_value_unavailable",
                "This call already took effect, but its result was not stored, so it cannot be "
                "returned; it will not be run again.",
                status=status, idempotency_key=key, attempt=record.attempt,
            )
        return Decision(_REPLAY, EffectEvent(
            "replayed", call_id, tool, utc_now(), agent_id, key, arguments, None, None, None, GUARD_ACTOR,
            record.attempt, current_owner(),
        ), record)
    if status == "released" or reversible:
        return Decision(_RUN, EffectEvent(
            "pending", call_id, tool, utc_now(), agent_id, key, arguments, None, None, approval, GUARD_ACTOR,
            record.attempt + 1, current_owner(),
        ), record)
    return _refuse(
        record, call_id, tool, key, arguments, agent_id,
        "effect_status_unknown",
        f"An earlier attempt of this call is {status} and may have taken effect: do not retry it; "
        f"ask the backend whether idempotency key {key} was applied.",
        status=status, idempotency_key=key, attempt=record.attempt, since=format_at(record.since),
    )


def _refuse(
    record: CallRecord, call_id: str, tool: str, key: str, arguments: str, agent_id: str | None,
    code: str, message: str, **details: Any,
) -> Decision:
    event = EffectEvent(
        "refused", call_id, tool, utc_now(), agent_id, key, arguments, None, None,
        {"code": code, "message": message}, GUARD_ACTOR, record.attempt, current_owner(),
    )
    return Decision(_REFUSE, event, record, code, message, details)
