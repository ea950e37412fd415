"""The ``@Airlock`` decorator: each call of a guarded tool through the gates (:mod:`guard.gates`),
its approver (:mod:`guard.escalation`), the effect guard's begin (:mod:`guard.attempt`) and the
tool, its outcome recorded (:mod:`guard.call`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, TypeVar, cast

from . import telemetry
from .approvals import ApprovalQueue
from .attempt import begin
from .call import GuardedCall, GuardedTool
from .canonical import NotCanonical, canonical_bytes, key_from_canonical
from .context import enter_call, leave_call
from .effect_guard import TAGS_LOCK
from .escalation import approval_failed, approval_request, check_approval
from .gates import first_gates, gates
from .offload import offloaded, offloads
from .outcomes import error_of, message_of
from .policy import SecurityPolicy
from .refusal import AirlockBlocked, Refusal
from .store import Verdict

__all__ = ["Airlock", "airlock_of", "error_of", "message_of"]

F = TypeVar("F", bound=Callable[..., Any])
# An enum member costs a class attribute lookup each time on Python 3.11; the hot path keeps them.
_REPLAY = Verdict.REPLAY


def gates_and_begin(call: GuardedCall) -> Refusal | None:
    """Gates 1 to 5 and, unless one refused or the call must be approved first, the begin."""
    refusal = gates(call)
    if refusal is None and (call.escalation is None or call.queue is not None):
        refusal = begin(call)
    return refusal


def approved_and_begin(call: GuardedCall, response: Any) -> Refusal | None:
    """The approver's verdict and, when it grants the call, the begin."""
    refusal = check_approval(call, response)
    return begin(call) if refusal is None else refusal


class Airlock:
    """Guard a tool: ``@Airlock(policy=SecurityPolicy(...), on_block="return")``.

    The decorated ``def`` or ``async def`` keeps its name, docstring and signature. A refused call
    does not run: it returns a :class:`Refusal` (``on_block="return"``) or raises
    :class:`AirlockBlocked` (``on_block="raise"``).
    """

    def __init__(self, policy: SecurityPolicy | None = None, on_block: Literal["return", "raise"] = "return") -> None:
        if on_block not in ("return", "raise"):
            raise ValueError(f"on_block is 'return' or 'raise', not {on_block!r}")
        if policy is not None and not isinstance(policy, SecurityPolicy):
            raise TypeError(f"policy is a SecurityPolicy, not {type(policy).__name__}")
        self.policy = policy if policy is not None else SecurityPolicy()
        self.on_block = on_block

    def blocked(self, refusal: Refusal) -> Any:
        if self.on_block == "raise":
            raise AirlockBlocked(refusal)
        return refusal

    def refuse(self, fn: Callable[..., Any], code: str, error: str, arguments: Any = None, **details: Any) -> Any:
        """Refuse a call to ``fn`` before it reaches the tool (for adapters), journaled like any refusal.

        Gates 1-3 come first: when one of them refuses the call, that refusal is the answer, not
        ``code`` (the first gate that refuses ends the call). ``arguments`` are the model's decoded
        arguments. When they are a JSON object with a JSON form, the refusal journals their
        canonical form and key as sent, not bound to the signature (they may not fit it); otherwise
        it journals no arguments and no key.
        """
        tool = _tool_of(fn)
        call = GuardedCall(self.policy, tool, (), {})
        if isinstance(arguments, Mapping):
            try:
                canonical = canonical_bytes(dict(arguments))
            except NotCanonical:
                pass
            else:
                call.key = key_from_canonical(tool.key_prefix, canonical)
                call.arguments = canonical.decode()

        def refused(call: GuardedCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            refusal = first_gates(call, bind=False)
            return self.blocked(refusal if refusal is not None else call.refuse(code, error, bind=False, **details))

        return telemetry.traced(call, refused, (), {}) if telemetry.on else refused(call, (), {})

    def __call__(self, fn: F) -> F:
        if not callable(fn) or not isinstance(getattr(fn, "__name__", None), str):
            raise TypeError(f"@Airlock decorates a function (a def or async def, named by __name__), not {fn!r}")
        if "__airlock__" in getattr(fn, "__dict__", {}):
            # The inner guard would see a nested call without an id and refuse it; the outer one
            # would then commit that refusal as the tool's value.
            raise TypeError(f"{fn.__name__!r} is already guarded by an @Airlock; give a tool one Airlock")
        cache: list[GuardedTool] = []

        def tool() -> GuardedTool:
            # Off the hot path (a call reads cache[0] once it is filled); the lock keeps a tag
            # put on meanwhile from being overwritten by the tags read before it.
            with TAGS_LOCK:
                if not cache:
                    cache.append(GuardedTool(fn, wrapper))
                return cache[0]

        def retag() -> None:
            # A @reversibility or @requires put on above this wrapper after its first call.
            with TAGS_LOCK:
                if cache:
                    cache[0] = GuardedTool(fn, wrapper)

        make = self._async_wrapper if inspect.iscoroutinefunction(fn) else self._sync_wrapper
        wrapper = make(fn, cache, tool)
        wrapper.__dict__.update(__airlock__=self, __airlock_tool__=tool, __airlock_retag__=retag)
        return cast(F, wrapper)

    def _sync_wrapper(self, fn: Callable[..., Any], cache: list[GuardedTool],
                      tool: Callable[[], GuardedTool]) -> Callable[..., Any]:
        """The guarded ``def`` tool: each call through the gates and the effect guard, then ``fn``."""
        guarded = functools.partial(self._guarded, fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            call = GuardedCall(self.policy, cache[0] if cache else tool(), args, kwargs)
            if telemetry.on:  # the one check a call pays when OpenTelemetry is absent
                return telemetry.traced(call, guarded, args, kwargs)
            return guarded(call, args, kwargs)

        return wrapper

    def _async_wrapper(self, fn: Callable[..., Any], cache: list[GuardedTool],
                       tool: Callable[[], GuardedTool]) -> Callable[..., Any]:
        """The guarded ``async def`` tool, as :meth:`_sync_wrapper`."""
        guarded = functools.partial(self._guarded_async, fn)

        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            call = GuardedCall(self.policy, cache[0] if cache else tool(), args, kwargs)
            if telemetry.on:  # the one check a call pays when OpenTelemetry is absent
                return await telemetry.atraced(call, guarded, args, kwargs)
            return await guarded(call, args, kwargs)

        return wrapper

    def _guarded(self, fn: Callable[..., Any], call: GuardedCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of a ``def`` tool: the gates, an approval where one is needed, the store's begin;
        then the replay, the refusal, or the tool run and its outcome recorded."""
        refusal = gates(call)
        if refusal is None and call.escalation is not None and call.queue is None:
            refusal = self._approved(call)
        if refusal is None:
            refusal = begin(call)
        if refusal is not None:
            return self.blocked(refusal)
        if call.verdict is _REPLAY:
            return call.replay_value
        token = enter_call(call)
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            call.raised(e)
            raise
        finally:
            leave_call(token)
        call.returned(result)
        return result

    def _approved(self, call: GuardedCall) -> Refusal | None:
        """The approver's answer for a ``def`` tool's escalated call: None when it approves."""
        approver = self.policy.approver
        assert approver is not None  # gate 5 refused the call otherwise
        try:
            response = approver(approval_request(call))
            if inspect.isawaitable(response):
                if inspect.iscoroutine(response):
                    response.close()
                raise TypeError("the approver is async; a def tool needs an approver that is a "
                                "plain function (an async approver serves async def tools)")
        except Exception as e:
            return approval_failed(call, e)
        return check_approval(call, response)

    async def _guarded_async(self, fn: Callable[..., Any], call: GuardedCall, args: tuple[Any, ...],
                             kwargs: dict[str, Any]) -> Any:
        """One call of an ``async def`` tool, as :meth:`_guarded`; the store's work made in the
        guard's threads where the store asks for it (``offload_async``)."""
        off_loop = call.eg is not None and offloads(call.eg.offload)
        queue = self.policy.approver
        if off_loop or (isinstance(queue, ApprovalQueue) and queue.wait > 0):
            # A call that may wait for an operator's decision waits in the guard's threads, so the
            # event loop keeps running.
            refusal = await offloaded(gates_and_begin, call, droppable=True, after=call.abandoned)
        else:
            refusal = gates_and_begin(call)
        if refusal is None and call.escalation is not None and call.queue is None:
            refusal = await self._approved_async(call, off_loop)
        if refusal is not None:
            return self.blocked(refusal)
        if call.verdict is _REPLAY:
            return call.replay_value
        token = enter_call(call)
        try:
            result = await cast(Callable[..., Awaitable[Any]], fn)(*args, **kwargs)
        except BaseException as e:
            if off_loop and not isinstance(e, GeneratorExit):
                await offloaded(call.raised, e)
            else:  # a coroutine being closed may not wait for anything
                call.raised(e)
            raise
        finally:
            # A coroutine closed outside its task's context (destroyed with its loop) cannot
            # reset the variable: the context it set it in is gone with the task.
            with contextlib.suppress(ValueError):
                leave_call(token)
        if off_loop:
            await offloaded(call.returned, result)
        else:
            call.returned(result)
        return result

    async def _approved_async(self, call: GuardedCall, off_loop: bool) -> Refusal | None:
        """The approver's answer for an ``async def`` tool's escalated call (the approver may be
        async), and the call's begin once approved: None when it may run."""
        approver = self.policy.approver
        assert approver is not None  # gate 5 refused the call otherwise
        try:
            response: Any = approver(approval_request(call))
            if inspect.isawaitable(response):
                response = await response
        except Exception as e:
            return await offloaded(approval_failed, call, e) if off_loop else approval_failed(call, e)
        # Not given up even for a caller that left meanwhile: a denial is journaled.
        if off_loop:
            return cast(Refusal | None, await offloaded(approved_and_begin, call, response, after=call.abandoned))
        return approved_and_begin(call, response)


def _tool_of(fn: Callable[..., Any]) -> GuardedTool:
    resolve = getattr(fn, "__airlock_tool__", None)
    if resolve is None:
        raise TypeError(f"{fn!r} is not decorated with @Airlock")
    return cast(GuardedTool, resolve())


def airlock_of(fn: Callable[..., Any]) -> Airlock | None:
    """The :class:`Airlock` that guards ``fn`` (looked up along the ``__wrapped__`` chain), or None."""
    seen: set[int] = set()
    obj: Any = fn
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        found = obj.__dict__.get("__airlock__") if hasattr(obj, "__dict__") else None
        if isinstance(found, Airlock):
            return found
        obj = getattr(obj, "__wrapped__", None)
    return None
