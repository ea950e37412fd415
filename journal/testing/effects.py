"""Counting effects outside the journal, and tools whose response is lost after the effect."""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import orjson

__all__ = ["EffectLog", "lost_response"]

F = TypeVar("F", bound=Callable[..., Any])


class EffectLog:
    """A file of effects, one JSON line each, appended with ``O_APPEND``.

    It plays the backend: a tool calls :meth:`record` at the moment its effect happens. Lines
    from many processes never interleave (each is one ``write`` of less than a pipe buffer), and a
    process killed right after :meth:`record` has still left its line, so the file tells how many
    times each effect really happened, whatever the journal says.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def record(self, call_id: str | None, **fields: Any) -> None:
        """Append one effect of the call ``call_id`` (``fields`` are kept with it, JSON values)."""
        line = orjson.dumps({"call_id": call_id, "pid": os.getpid(), **fields}) + b"\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def entries(self) -> list[dict[str, Any]]:
        """Every recorded effect, in the order written; a torn last line (a kill mid-write) is skipped."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        found: list[dict[str, Any]] = []
        for line in raw.splitlines():
            try:
                found.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
        return found

    def counts(self) -> Counter[str | None]:
        """How many times each call id's effect happened."""
        return Counter(entry["call_id"] for entry in self.entries())

    def count(self, call_id: str | None = None) -> int:
        """Effects of ``call_id``, or of every call when None."""
        entries = self.entries()
        return len(entries) if call_id is None else sum(1 for e in entries if e["call_id"] == call_id)

    def doubled(self) -> dict[str | None, int]:
        """The call ids whose effect happened more than once, with their counts."""
        return {call_id: n for call_id, n in self.counts().items() if n > 1}

    def __repr__(self) -> str:
        return f"EffectLog({str(self.path)!r})"


def lost_response(tool: F, *, times: int | None = None) -> F:
    """``tool`` whose response is lost: it runs (its effect happens), then ``TimeoutError`` is raised
    instead of returning its value, as when the reply of a remote call never arrives.

    With ``times=N`` only the first N calls lose their response; the later ones return normally.
    Works for ``def`` and ``async def``; keeps the name, docstring and signature, so put it under
    ``@Airlock`` as the tool itself: ``Airlock(policy)(lost_response(pay))``.
    """
    if times is not None and times < 0:
        raise ValueError(f"times is a number of calls, 0 or more, not {times}")
    lost = [0]
    counting = threading.Lock()

    def lose() -> bool:
        with counting:
            if times is not None and lost[0] >= times:
                return False
            lost[0] += 1
            return True

    def timeout() -> TimeoutError:
        return TimeoutError(f"the response of {tool.__name__} was lost after its effect")

    if inspect.iscoroutinefunction(tool):

        @functools.wraps(tool)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            result = await tool(*args, **kwargs)
            if lose():
                raise timeout()
            return result

        return cast(F, async_wrapper)

    @functools.wraps(tool)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = tool(*args, **kwargs)
        if lose():
            raise timeout()
        return result

    return cast(F, wrapper)
