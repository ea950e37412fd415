"""The context a host opens around a model's tool call, and the per-call copy a tool sees."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, Protocol

__all__ = ["AirlockContext", "CallContext", "get_current_context"]

class CallScope(Protocol):
    """A guarded call in progress: it makes its :class:`CallContext` only when a tool asks for it."""

    def call_context(self) -> CallContext: ...


# Holds the host's AirlockContext, or during a guarded call the call's CallScope.
_current: ContextVar[Any] = ContextVar("airlock_context", default=None)
# The contexts entered in this thread or task, with the tokens that restore what each replaced:
# kept per contextvars context, so one AirlockContext object may be entered by many tasks at once.
_entered: ContextVar[tuple[tuple[Any, Token[Any]], ...]] = ContextVar("airlock_entered", default=())


class AirlockContext:
    """Who is calling, and on behalf of which model tool call.

    A context manager (``with`` and ``async with``); contexts nest, the inner one wins. The host
    or an adapter puts the model's tool call id at ``metadata["tool_call_id"]``.
    """

    __slots__ = ("agent_id", "metadata")

    def __init__(self, agent_id: str | None = None, metadata: Mapping[str, Any] | None = None) -> None:
        if agent_id is not None and not isinstance(agent_id, str):
            raise TypeError(f"agent_id is a string or None, not {type(agent_id).__name__}")
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata is a mapping (a dict) or None, not {type(metadata).__name__}")
        self.agent_id = agent_id
        self.metadata: dict[str, Any] = dict(metadata) if metadata else {}

    @property
    def tool_call_id(self) -> str | None:
        """``metadata["tool_call_id"]`` when it is a non-empty string, else None."""
        value = self.metadata.get("tool_call_id")
        return value if isinstance(value, str) and value else None

    @property
    def idempotency_key(self) -> str | None:
        return None

    def __enter__(self) -> AirlockContext:
        _entered.set((*_entered.get(), (self, _current.set(self))))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        entered = _entered.get()
        if not entered or entered[-1][0] is not self:
            raise RuntimeError("an AirlockContext was left that is not the innermost one entered here")
        try:
            _current.reset(entered[-1][1])
        except (ValueError, RuntimeError) as e:
            # A task made while it was entered inherits that nesting, yet cannot undo what the
            # entering task set; the context stays entered where it was entered.
            raise RuntimeError(
                "an AirlockContext was left in another task or context than the one that entered "
                "it; leave it where it was entered"
            ) from e
        _entered.set(entered[:-1])

    async def __aenter__(self) -> AirlockContext:
        return self.__enter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(agent_id={self.agent_id!r}, metadata={self.metadata!r})"


class CallContext(AirlockContext):
    """The copy of the active context that one guarded call sees.

    It carries the call's ``tool``, ``tool_call_id`` and ``idempotency_key``, and once the effect
    guard has recorded the call ``pending``, its ``attempt``: a fencing token for the backend (a
    backend that keeps the highest attempt it has seen for an idempotency key can refuse a write
    of an earlier one, from an owner taken for gone that came back). The host's own context object
    is never changed.
    """

    __slots__ = ("_attempt", "_idempotency_key", "_tool_call_id", "tool")

    def __init__(
        self,
        agent_id: str | None,
        metadata: Mapping[str, Any] | None,
        *,
        tool: str,
        tool_call_id: str | None,
        idempotency_key: str | None,
        attempt: int | None = None,
    ) -> None:
        self.agent_id = agent_id
        self.metadata = dict(metadata) if metadata else {}
        self.tool = tool
        self._tool_call_id = tool_call_id
        self._idempotency_key = idempotency_key
        self._attempt = attempt

    @property
    def tool_call_id(self) -> str | None:
        return self._tool_call_id

    @property
    def idempotency_key(self) -> str | None:
        return self._idempotency_key

    @property
    def attempt(self) -> int | None:
        """The attempt this run of the tool is (1, 2, ...), as the journal records it; None when the
        effect guard does not journal the call (no effect guard, or no id to key it on)."""
        return self._attempt

    def __repr__(self) -> str:
        return (
            f"CallContext(tool={self.tool!r}, tool_call_id={self._tool_call_id!r}, "
            f"idempotency_key={self._idempotency_key!r}, agent_id={self.agent_id!r}, attempt={self._attempt!r})"
        )


def get_current_context() -> AirlockContext | None:
    """The active context; inside a guarded call, that call's :class:`CallContext`."""
    current = _current.get()
    if current is None or isinstance(current, AirlockContext):
        return current
    context: CallContext = current.call_context()
    return context


# The pipeline's three steps on the context variable, bound once: a guarded call takes each of them,
# and a wrapper function around each would cost a Python frame.

#: The host's context, or the guarded call in progress (a :class:`CallScope`), or None.
active: Callable[[], AirlockContext | CallScope | None] = _current.get
#: Make a guarded call the current scope while its tool runs; returns the token for leave_call.
enter_call: Callable[[CallScope], Token[Any]] = _current.set
#: Put back what was current before enter_call.
leave_call: Callable[[Token[Any]], None] = _current.reset
