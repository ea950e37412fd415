"""Settling doubt without a human: a tool's check asks the backend whether its effect happened.

``@reconciled_by(check)`` puts a check on a tool (above or below ``@Airlock``, like
``@reversibility``). ``check(call: InDoubtCall)`` is a ``def`` or an ``async def`` that asks the
backend, usually by ``call.idempotency_key``, and returns :class:`Applied` (the effect happened),
:class:`NotApplied` (it did not) or None (the backend cannot tell yet). A check only asks: it must
never run the effect itself.

The guard runs a tool's check when a retry finds the call in doubt (``EffectGuard(reconcile_on_retry=
True)``, the default); ``journal.reconcile(checks)`` and ``airlock journal reconcile`` run the checks
of every call in doubt. Either way the outcome is appended only if the call is still in the status
and attempt the check was given, with the actor ``reconciler:NAME``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypeVar

import orjson

from .canonical import storable
from .effect_guard import tag_along, wrapped_chain
from .store import CallRecord, EffectEvent, current_owner, utc_now

__all__ = [
    "Applied",
    "Check",
    "CheckFailed",
    "InDoubtCall",
    "NotApplied",
    "Outcome",
    "ReconcileResult",
    "Verdict",
    "arun_check",
    "check_name",
    "in_doubt_call",
    "reconciled_by",
    "reconciler_actor",
    "reconciler_of",
    "run_check",
    "settlement",
]

log = logging.getLogger("guard")
F = TypeVar("F", bound=Callable[..., Any])
_CHECK_ATTR = "__airlock_reconciler__"
_ABOVE_ATTR = "__airlock_reconciler_above__"  # on an @Airlock wrapper: a check put on above it
# The check's deadline when none is given: a check that asks a backend answers in seconds.
DEFAULT_CHECK_TIMEOUT = 10.0


class _NoValue:
    """The value of an :class:`Applied` that carries none (``None`` is a value: JSON null)."""

    _instance: _NoValue | None = None

    def __new__(cls) -> _NoValue:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NO_VALUE"

    def __bool__(self) -> bool:
        return False


NO_VALUE: Any = _NoValue()


@dataclass(frozen=True, slots=True)
class Applied:
    """The backend confirms the effect happened. ``value`` (optional) is what replays return; without
    one, replays are refused ``replay_value_unavailable``. ``evidence`` says what was found."""

    value: Any = NO_VALUE
    evidence: str = ""

    @property
    def has_value(self) -> bool:
        return self.value is not NO_VALUE


@dataclass(frozen=True, slots=True)
class NotApplied:
    """The backend confirms the effect did not happen: the call may run again."""

    evidence: str = ""


Verdict = Applied | NotApplied | None
Outcome = Literal["applied", "not_applied", "still_unknown", "error", "skipped"]


@dataclass(frozen=True, slots=True)
class InDoubtCall:
    """What a check is given: a call whose outcome is in doubt.

    ``arguments`` are the call's arguments in their JSON form; ``status`` is ``"pending"`` or
    ``"unknown"``; ``since`` (aware, UTC) is when the call entered that status; ``error`` the
    ``{type, message}`` an ``unknown`` call recorded (None for a pending one).
    """

    call_id: str
    tool: str
    arguments: dict[str, Any]
    idempotency_key: str | None
    agent_id: str | None
    attempt: int
    status: Literal["pending", "unknown"]
    since: datetime
    error: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    """What reconciling one call did: ``outcome`` is ``"applied"``, ``"not_applied"``,
    ``"still_unknown"`` (the check returned None), ``"error"`` (it raised, returned something else
    or evidence that cannot be stored, or timed out) or ``"skipped"`` (its owner is alive, or it
    moved on meanwhile); ``seq`` is that of the event appended, or None."""

    call_id: str
    tool: str
    outcome: Outcome
    message: str = ""
    seq: int | None = None
    evidence: str = field(default="", repr=False)


Check = Callable[[InDoubtCall], "Verdict | Awaitable[Verdict]"]


class CheckFailed(Exception):
    """A check raised, returned something that is not a verdict (or a verdict whose evidence cannot
    be stored), or did not answer in time."""


def reconciled_by(check: Check) -> Callable[[F], F]:
    """Put ``check`` on a tool, above or below ``@Airlock``: ``@reconciled_by(payment_exists)``.

    Raises ``TypeError`` at once for a ``check`` that is not callable.
    """
    if not callable(check):
        raise TypeError(f"reconciled_by takes a check (a function of an InDoubtCall), not {check!r}")

    def mark(fn: F) -> F:
        tag_along(fn, _CHECK_ATTR, lambda previous: check, below=_ABOVE_ATTR)
        return fn

    return mark


def reconciler_of(fn: Callable[..., Any]) -> Check | None:
    """The check put on ``fn`` (or on anything along its ``__wrapped__`` chain), or None.

    The outermost wins: a check put on above ``@Airlock`` overrides one put on below it.
    """
    for obj in wrapped_chain(fn):
        for attr in (_ABOVE_ATTR, _CHECK_ATTR):
            check: Check | None = getattr(obj, attr, None)
            if callable(check):
                return check
    return None


def check_name(check: Check) -> str:
    """The check's ``__qualname__`` (its ``__name__``, or its type's name, when it has none), as
    every store can keep it (a lone surrogate as its escape)."""
    name = getattr(check, "__qualname__", None) or getattr(check, "__name__", None)
    return storable(str(name) if isinstance(name, str) and name else type(check).__qualname__)


def reconciler_actor(check: Check) -> str:
    """The actor of the events a check settles: ``reconciler:NAME``."""
    return f"reconciler:{check_name(check)}"


def in_doubt_call(record: CallRecord) -> InDoubtCall:
    """The :class:`InDoubtCall` a check is given for ``record`` (pending or unknown)."""
    arguments: Any = orjson.loads(record.arguments) if record.arguments else {}
    status: Literal["pending", "unknown"] = "pending" if record.status == "pending" else "unknown"
    return InDoubtCall(
        call_id=record.call_id, tool=record.tool, arguments=arguments if isinstance(arguments, dict) else {},
        idempotency_key=record.idempotency_key, agent_id=record.agent_id, attempt=record.attempt,
        status=status, since=record.since, error=dict(record.error) if record.error else None,
    )


def _said(error: BaseException) -> str:
    """``error`` for a message: its type and its text, the text as every store and output can keep
    it (a lone surrogate as its escape); an error whose ``str()`` itself raises is named by its type."""
    try:
        text = str(error)
    except Exception as e:
        return f"{type(error).__name__} (its message could not be read: {type(e).__name__})"
    return f"{type(error).__name__}: {storable(text)}" if text else type(error).__name__


def _verdict(result: object, name: str) -> Verdict:
    """The check's answer as a verdict whose evidence the journal can store, or :class:`CheckFailed`.

    The evidence is the ``reason`` of the event that settles the call: evidence that has no text
    (its ``str()`` raises) or whose text is not valid UTF-8 (a lone surrogate) cannot be stored, so
    the answer is not used, as if the check had raised: the store did not fail, the check's answer did.
    """
    if result is None:
        return None
    if not isinstance(result, Applied | NotApplied):
        raise CheckFailed(f"the check {name} returned {type(result).__name__}, not Applied, NotApplied or None")
    unusable = f"the check {name} returned evidence that cannot be stored"
    try:
        value = result.value if isinstance(result, Applied) else NO_VALUE
        evidence: Any = result.evidence
    except Exception as e:  # a subclass's property
        raise CheckFailed(f"the check {name} returned a verdict that cannot be read: {_said(e)}") from e
    try:
        evidence = str(evidence)
    except Exception as e:
        raise CheckFailed(f"{unusable}: its str() raised {_said(e)}") from e
    try:
        evidence.encode("utf-8")
    except UnicodeEncodeError as e:
        raise CheckFailed(f"{unusable}: it is not valid UTF-8 ({e.reason} at {e.start})") from e
    # A plain verdict of that text: what settles the call cannot change between asking and storing.
    return Applied(value=value, evidence=evidence) if isinstance(result, Applied) else NotApplied(evidence=evidence)


def run_check(check: Check, call: InDoubtCall, timeout: float = DEFAULT_CHECK_TIMEOUT) -> Verdict:
    """Run ``check`` on ``call`` from synchronous code and return its verdict.

    A ``def`` check runs in a thread of its own and an ``async def`` one in an event loop of that
    thread, so that a check that hangs is given up after ``timeout`` seconds (it is left to finish
    on its own; what it returns then is ignored). Raises :class:`CheckFailed` when it raises,
    returns anything but a verdict, returns evidence the journal cannot store (text that is not
    valid UTF-8, or an object whose ``str()`` raises), or does not answer in time.
    """
    name = check_name(check)
    answer: list[Verdict] = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            result: Any = check(call)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
        except BaseException as e:  # handed to the caller's thread, which says what happened
            failure.append(e)
            return
        try:
            answer.append(_verdict(result, name))  # here, within the deadline: it reads the answer
        except CheckFailed as e:
            failure.append(e)

    worker = threading.Thread(target=body, name=f"airlock-check-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise CheckFailed(f"the check {name} did not answer within {timeout:g} s")
    if failure:
        e = failure[0]
        if isinstance(e, CheckFailed):
            raise e
        raise CheckFailed(f"the check {name} raised {_said(e)}") from e
    return answer[0]


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


async def arun_check(check: Check, call: InDoubtCall, timeout: float = DEFAULT_CHECK_TIMEOUT) -> Verdict:
    """Run ``check`` on ``call`` from a coroutine: an ``async def`` check is awaited on the running
    loop (with ``timeout``), a ``def`` one in a thread. Raises :class:`CheckFailed` as :func:`run_check`."""
    name = check_name(check)
    if not inspect.iscoroutinefunction(check):
        return await asyncio.to_thread(run_check, check, call, timeout)
    try:
        async with asyncio.timeout(timeout):
            result: Any = await check(call)
    except TimeoutError as e:
        raise CheckFailed(f"the check {name} did not answer within {timeout:g} s") from e
    except Exception as e:
        raise CheckFailed(f"the check {name} raised {_said(e)}") from e
    return _verdict(result, name)


def settlement(record: CallRecord, verdict: Applied | NotApplied, actor: str, value: str | None) -> EffectEvent:
    """The event that settles ``record`` as ``verdict`` says, by ``actor``: ``committed`` (with
    ``value``, canonical JSON text, or None) or ``released``, at the call's attempt."""
    applied = isinstance(verdict, Applied)
    return EffectEvent(
        kind="committed" if applied else "released", call_id=record.call_id, tool=record.tool, at=utc_now(),
        agent_id=record.agent_id, idempotency_key=record.idempotency_key, arguments=record.arguments,
        value=value if applied else None, error=None,
        reason={"code": "applied" if applied else "not_applied", "message": str(verdict.evidence)},
        actor=actor, attempt=record.attempt, owner=current_owner(),
    )

