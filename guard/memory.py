"""The in-memory store: one process's calls, thread-safe, with its own event log."""

from __future__ import annotations

import threading
from dataclasses import replace

from .store import CallRecord, Decide, Decision, EffectEvent, apply

__all__ = ["InMemoryEffectStore"]


class InMemoryEffectStore:
    """An :class:`EffectStore` in this process's memory. Two processes do not see each other's calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, CallRecord] = {}
        self._log: list[EffectEvent] = []

    def begin(self, call_id: str, decide: Decide) -> Decision:
        with self._lock:
            decision = decide(self._records.get(call_id))
            self._append(decision.event)
            return decision

    def append(self, event: EffectEvent) -> None:
        with self._lock:
            self._append(event)

    def _append(self, event: EffectEvent) -> None:
        seq = len(self._log) + 1
        self._log.append(event)
        call_id = event.call_id
        if call_id is not None:
            record = apply(self._records.get(call_id), event, seq)
            if record is not None:
                self._records[call_id] = record

    def get(self, call_id: str) -> CallRecord | None:
        with self._lock:
            return self._records.get(call_id)

    def events(self, call_id: str | None = None) -> list[EffectEvent]:
        """The log in ``seq`` order (each event with its ``seq``), or one call's part of it."""
        with self._lock:
            log = list(enumerate(self._log, 1))
        return [replace(e, seq=s) for s, e in log if call_id is None or e.call_id == call_id]

    def records(self) -> dict[str, CallRecord]:
        with self._lock:
            return dict(self._records)

    def __repr__(self) -> str:
        return f"InMemoryEffectStore(calls={len(self._records)}, events={len(self._log)})"
