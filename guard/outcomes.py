"""What a tool's result or exception is recorded as: deferred or plain, its error, its doubt."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Iterator
from typing import Any

from .canonical import storable

__all__ = ["PLAIN", "ambiguous_in", "error_of", "is_deferred", "message_of"]

# Results that are never deferred: a call's commonest results skip the checks of is_deferred.
PLAIN = frozenset({dict, list, str, int, float, bool, type(None), tuple, bytes})


def message_of(exc: object) -> str:
    """``str(exc)`` (of an exception, or any object), storable; ``<unprintable X>`` when its
    ``__str__`` fails."""
    try:
        text = str(exc)
    except Exception:
        text = f"<unprintable {type(exc).__name__}>"
    return storable(text)


def error_of(exc: BaseException) -> dict[str, str]:
    """The ``{type, message}`` of an exception as an event records it."""
    return {"type": storable(type(exc).__name__), "message": message_of(exc)}


def ambiguous_in(group: BaseExceptionGroup[Any], ambiguous: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception in ``group`` (depth first, nested groups included) that leaves a call's
    outcome in doubt: an instance of ``ambiguous``, or one that is no ``Exception``; None if none is."""
    # A loop, not recursion: groups may nest deeper than Python recurses. A nested group comes
    # after its members, which say better what happened.
    pending: list[tuple[BaseException, bool]] = [(e, False) for e in reversed(group.exceptions)]
    while pending:
        exc, members_seen = pending.pop()
        if isinstance(exc, BaseExceptionGroup) and not members_seen:
            pending.append((exc, True))
            pending.extend((e, False) for e in reversed(exc.exceptions))
        elif isinstance(exc, ambiguous) or not isinstance(exc, Exception):
            return exc
    return None


def is_deferred(result: Any) -> bool:
    """A result whose effect happens as it is consumed: an awaitable, a generator, an iterator."""
    if type(result) in PLAIN:
        return False
    return (
        inspect.isawaitable(result)
        or inspect.isgenerator(result)
        or inspect.isasyncgen(result)
        or isinstance(result, Iterator | AsyncIterator)
    )
