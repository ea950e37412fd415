"""Leases: how a store tells a call whose tool is still running from one whose process is gone.

While a tool runs, its call holds a lease in the store, renewed by a thread of the guard's at least
every third of its length; the call's owner is *alive* while the lease has not run out by the
store's clock, and *gone* after, whatever host or PID namespace it ran in. A lease is operational
state beside the log, never an event. A store that keeps leases has the methods of
:class:`LeaseStore`; a ``pending`` call that never had one is judged by its owner's host and pid.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from .store import CallRecord, EffectEvent

__all__ = ["LeaseStore", "OwnerState", "Settle", "Renewer", "renewer"]

log = logging.getLogger("guard")

# The callback of :meth:`LeaseStore.settle`: given the call's record (None for a call never seen),
# the event to append, or None.
Settle = Callable[[CallRecord | None], EffectEvent | None]


@dataclass(frozen=True, slots=True)
class OwnerState:
    """Whether a pending call's owner is ``alive`` (None: the call is not pending), and when its
    lease runs out (None: it has none, or the call is not pending: a lease left on a call that
    ended says nothing of it)."""

    alive: bool | None
    lease_expires_at: datetime | None = None


@runtime_checkable
class LeaseStore(Protocol):
    """What a store that keeps leases provides beside :class:`~guard.store.EffectStore`.

    - ``take_lease``: record (or extend) ``holder``'s lease on the call for ``seconds``.
    - ``renew_lease``: extend it; False when the holder has no lease on the call any more.
    - ``drop_lease``: forget it.
    - ``claim_lease``: take it only when no other holder has a live lease on the call and, for a
      pending call that never had a lease, its owner is known to be gone (a process of this host
      that no longer runs; an owner on another host cannot be seen, so such a call is not
      claimed); True when taken. At most one holder at a time gets a claim, across threads and
      processes.
    - ``settle``: in one atomic step, read the call's record, let the callback choose the event, and
      append it; returns the ``seq`` appended, or None when the callback chose
      none. What the callback raises is raised, and nothing is appended.
    - ``owner_states``: the :class:`OwnerState` of each of the records given.
    """

    def take_lease(self, call_id: str, holder: str, seconds: float) -> None: ...

    def renew_lease(self, call_id: str, holder: str, seconds: float) -> bool: ...

    def drop_lease(self, call_id: str, holder: str) -> None: ...

    def claim_lease(self, call_id: str, holder: str, seconds: float) -> bool: ...

    def settle(self, call_id: str, choose: Settle) -> int | None: ...

    def owner_states(self, records: list[CallRecord]) -> dict[str, OwnerState]: ...


class Renewer:
    """One thread per process that renews the leases of the tools running in it.

    ``hold`` starts renewing a lease (every ``seconds / 3``), ``let_go`` stops it. A renewal that
    fails is logged on the ``guard`` logger and tried again at the next turn; a lease that cannot be
    renewed runs out, and its call's owner is then taken for gone.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition(threading.Lock())
        self._due: list[tuple[float, int, tuple[int, str, str]]] = []
        self._held: dict[tuple[int, str, str], tuple[Any, float]] = {}
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def hold(self, store: LeaseStore, call_id: str, holder: str, seconds: float) -> None:
        key = (id(store), call_id, holder)
        with self._lock:
            self._held[key] = (store, seconds)
            entry = (time.monotonic() + seconds / 3, next(self._order), key)
            heapq.heappush(self._due, entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="airlock-leases", daemon=True)
                self._thread.start()
            if self._due[0] is entry:
                # Due before anything the thread waits for: wake it. Most calls end long before
                # their first renewal, and never wake it at all.
                self._lock.notify()

    def let_go(self, store: LeaseStore, call_id: str, holder: str) -> None:
        with self._lock:
            self._held.pop((id(store), call_id, holder), None)

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    while self._due and self._due[0][2] not in self._held:
                        heapq.heappop(self._due)  # let go of meanwhile
                    now = time.monotonic()
                    if self._due and self._due[0][0] <= now:
                        _, _, key = heapq.heappop(self._due)
                        store, seconds = self._held[key]
                        break
                    self._lock.wait(self._due[0][0] - now if self._due else None)
            _, call_id, holder = key
            try:
                kept = store.renew_lease(call_id, holder, seconds)
            except Exception as e:
                log.warning("could not renew the lease of %s (it runs out in under %g s): %r", call_id, seconds, e)
                kept = True  # tried again at the next turn
            with self._lock:
                if kept and key in self._held:
                    heapq.heappush(self._due, (time.monotonic() + seconds / 3, next(self._order), key))

    def _forked(self) -> None:
        # The child has no renewing thread and holds none of its parent's running tools.
        self._lock = threading.Condition(threading.Lock())
        self._due, self._held, self._thread = [], {}, None


renewer = Renewer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=renewer._forked)
