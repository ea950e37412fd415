"""The in-memory store: one process's calls, thread-safe, with its own event log."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from datetime import datetime, timedelta

from .approvals import ApprovalRequest, ApprovalStep, ApprovalStore, T, apply_approval, approval_event
from .leases import LeaseStore, OwnerState, Settle
from .store import AsyncOffload, CallRecord, Decide, Decision, EffectEvent, EffectStore, RecentCalls, apply, utc_now

__all__ = ["InMemoryEffectStore"]


def _named_lease(record: CallRecord | None) -> str | None:
    """The lease the owner of a pending ``record`` named when its attempt began, or None."""
    if record is None or record.status != "pending" or not record.owner:
        return None
    holder = record.owner.get("lease")
    return holder if isinstance(holder, str) else None


class InMemoryEffectStore(EffectStore, LeaseStore, RecentCalls, AsyncOffload, ApprovalStore):
    """An :class:`EffectStore` in this process's memory. Two processes do not see each other's calls.

    It keeps leases and settles calls (:class:`~guard.leases.LeaseStore`), looks calls up for a
    duplicate window (:class:`~guard.store.RecentCalls`) and keeps approvals
    (:class:`~guard.approvals.ApprovalStore`); its work is quick and made in the caller's thread.
    """

    offload_async = False  # nothing here waits for a network: made in the event loop's thread

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, CallRecord] = {}
        self._log: list[EffectEvent] = []
        self._leases: dict[str, dict[str, float]] = {}  # call id -> holder -> when it runs out (monotonic)
        # (agent_id, idempotency_key) -> its calls' ids, oldest first: the lookup of recent_call,
        # made at its first use (a store whose guard has no duplicate window never pays for it).
        self._by_key: dict[tuple[str | None, str], list[str]] | None = None
        self._requests: dict[str, ApprovalRequest] = {}  # request id -> the request, as its events fold
        self._latest_request: dict[str, str] = {}  # call id -> the id of its latest request

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
        if call_id is not None and approval_event(event):
            self._fold_request(call_id, event, seq)
        if call_id is not None:
            before = self._records.get(call_id)
            record = apply(before, event, seq)
            if record is not None:
                self._records[call_id] = record
                if before is None and self._by_key is not None and record.idempotency_key is not None:
                    self._by_key.setdefault((record.agent_id, record.idempotency_key), []).append(call_id)

    def get(self, call_id: str) -> CallRecord | None:
        with self._lock:
            return self._records.get(call_id)

    # -- approvals (see guard.approvals) -----------------------------------------------------------

    def _fold_request(self, call_id: str, event: EffectEvent, seq: int) -> None:
        if event.kind == "approval_requested":
            request = apply_approval(None, event, seq)
            if request is not None:
                self._requests[request.request_id] = request
                self._latest_request[call_id] = request.request_id
            return
        rid = self._latest_request.get(call_id)
        if rid is not None:
            folded = apply_approval(self._requests[rid], event, seq)
            if folded is not None:
                self._requests[rid] = folded

    def approval_step(self, call_id: str, step: ApprovalStep[T]) -> T:
        with self._lock:
            rid = self._latest_request.get(call_id)
            events, result = step(self._records.get(call_id), None if rid is None else self._requests[rid])
            for event in events:
                self._append(event)
            return result

    def approval_requests(
        self, *, call_id: str | None = None, request_id: str | None = None, status: str | None = None,
        tool: str | None = None, limit: int | None = None, offset: int = 0,
    ) -> list[ApprovalRequest]:
        with self._lock:
            found = [r for r in self._requests.values()
                     if (call_id is None or r.call_id == call_id) and (request_id is None or r.request_id == request_id)
                     and (status is None or r.status == status) and (tool is None or r.tool == tool)]
        found.sort(key=lambda r: r.first_seq, reverse=True)
        return found[offset:] if limit is None else found[offset:offset + limit]

    # -- leases (see guard.leases); the store's clock is this process's monotonic clock ----------

    def take_lease(self, call_id: str, holder: str, seconds: float) -> None:
        with self._lock:
            self._leases.setdefault(call_id, {})[holder] = time.monotonic() + seconds

    def renew_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        with self._lock:
            held = self._leases.get(call_id)
            if held is None or holder not in held:
                return False
            held[holder] = time.monotonic() + seconds
            return True

    def drop_lease(self, call_id: str, holder: str) -> None:
        with self._lock:
            held = self._leases.get(call_id)
            if held is not None:
                held.pop(holder, None)
                if not held:
                    del self._leases[call_id]

    def claim_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        with self._lock:
            now = time.monotonic()
            held = self._leases.setdefault(call_id, {})
            record = self._records.get(call_id)
            if self._alive(record):
                return False
            owners = _named_lease(record)
            if any(until > now for other, until in held.items() if other not in (holder, owners)):
                return False  # another check holds it
            held[holder] = now + seconds
            return True

    def settle(self, call_id: str, choose: Settle) -> int | None:
        with self._lock:
            record = self._records.get(call_id)
            event = choose(record)
            if event is None:
                return None
            self._append(event)
            return len(self._log)

    def owner_states(self, records: list[CallRecord]) -> dict[str, OwnerState]:
        with self._lock:
            now, wall = time.monotonic(), utc_now()
            states: dict[str, OwnerState] = {}
            for record in records:
                holder = _named_lease(record)
                until = self._leases.get(record.call_id, {}).get(holder) if holder is not None else None
                expires = None if until is None else wall + timedelta(seconds=until - now)
                states[record.call_id] = OwnerState(self._alive(record), expires)
            return states

    def _alive(self, record: CallRecord | None) -> bool | None:
        """Whether the owner of a pending call is alive: every owner is this process, so by the lease
        its attempt named alone (see :mod:`guard.liveness`); one without began under a guard
        without a lease, in this process, which runs."""
        if record is None or record.status != "pending":
            return None
        holder = _named_lease(record)
        if holder is None:
            return True
        until = self._leases.get(record.call_id, {}).get(holder)
        return until is not None and until > time.monotonic()

    def recent_call(self, agent_id: str | None, idempotency_key: str, since: datetime) -> CallRecord | None:
        """The most recent call of ``agent_id`` with ``idempotency_key`` begun at or after ``since`` and
        not released, or None (the lookup of ``EffectGuard(duplicate_window=...)``)."""
        with self._lock:
            by_key = self._by_key
            if by_key is None:
                # Each call under the agent and key of the pending event that began it, as _append files it.
                self._by_key = by_key = {}
                seen: set[str] = set()
                for event in self._log:
                    call_id = event.call_id
                    if event.kind == "pending" and call_id is not None and call_id not in seen:
                        seen.add(call_id)
                        if event.idempotency_key is not None:
                            by_key.setdefault((event.agent_id, event.idempotency_key), []).append(call_id)
            for call_id in reversed(by_key.get((agent_id, idempotency_key), ())):
                record = self._records[call_id]
                if record.created_at < since:
                    break
                if record.status != "released":
                    return record
        return None

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
