"""Leases: how a store tells a call whose tool is still running from one whose process is gone.

While a tool runs, its call holds a lease in the store, renewed by a thread of the guard's at least
every third of its length; the call's owner is *alive* while the lease has not run out by the
store's clock, and *gone* after, whatever host or PID namespace it ran in. A lease is operational
state beside the log, never an event. A store that keeps leases has the methods of
:class:`LeaseStore`; a ``pending`` call that never had one is judged by its owner's host and pid.
An effect guard with a ``lease`` takes, renews and drops its calls' leases through one
:class:`Leasing`, in the store's own transactions where it takes them there
(:class:`~guard.store.LeasesInBegin`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeGuard, runtime_checkable

from .store import CallRecord, LeasesInBegin, Settle, SettlingStore

__all__ = ["LeaseStore", "Leasing", "OwnerState", "Settle", "Renewer", "leases_in_begin", "renewer"]

log = logging.getLogger("guard")


@dataclass(frozen=True, slots=True)
class OwnerState:
    """Whether a pending call's owner is ``alive`` (None: the call is not pending), and when its
    lease runs out (None: it has none, or the call is not pending: a lease left on a call that
    ended says nothing of it)."""

    alive: bool | None
    lease_expires_at: datetime | None = None


@runtime_checkable
class LeaseStore(SettlingStore, Protocol):
    """What a store that keeps leases provides beside :class:`~guard.store.EffectStore`; it settles
    calls too (:class:`~guard.store.SettlingStore`), as a check that claimed a call must.

    - ``take_lease``: record (or extend) ``holder``'s lease on the call for ``seconds``.
    - ``renew_lease``: extend it; False when the holder has no lease on the call any more.
    - ``drop_lease``: forget it.
    - ``claim_lease``: take it only when no other holder has a live lease on the call and, for a
      pending call that never had a lease, its owner is known to be gone (a process of this host
      that no longer runs; an owner on another host cannot be seen, so such a call is not
      claimed); True when taken. At most one holder at a time gets a claim, across threads and
      processes.
    - ``settle``: see :class:`~guard.store.SettlingStore`.
    - ``owner_states``: the :class:`OwnerState` of each of the records given.
    """

    def take_lease(self, call_id: str, holder: str, seconds: float) -> None: ...

    def renew_lease(self, call_id: str, holder: str, seconds: float) -> bool: ...

    def drop_lease(self, call_id: str, holder: str) -> None: ...

    def claim_lease(self, call_id: str, holder: str, seconds: float) -> bool: ...

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


def leases_in_begin(store: object) -> TypeGuard[LeasesInBegin]:
    """Whether ``store`` takes a call's lease in its ``begin`` and drops it with its outcome, in the
    same transactions (a :class:`~guard.store.LeasesInBegin` whose ``leases_in_begin`` is True)."""
    return isinstance(store, LeasesInBegin) and store.leases_in_begin is True


class Leasing:
    """The leases of one guard's calls on its store: taken as a call begins (by the store's own
    ``begin`` where it takes them there: ``in_begin``), renewed by :data:`renewer` while the tool
    runs, dropped with its outcome. ``seconds`` is the length of each."""

    __slots__ = ("in_begin", "seconds", "store")

    def __init__(self, store: LeaseStore, seconds: float, in_begin: LeasesInBegin | None) -> None:
        self.store = store
        self.seconds = seconds
        self.in_begin = in_begin

    def take(self, call_id: str) -> str:
        """A lease on ``call_id`` for a call about to begin, left to the store's ``begin`` where it
        takes it there; returns its holder's token."""
        holder = uuid.uuid4().hex
        if self.in_begin is None:
            self.store.take_lease(call_id, holder, self.seconds)
        return holder

    def take_now(self, call_id: str) -> str:
        """A lease on ``call_id`` taken at once (before a step of the store that takes none);
        returns its holder's token."""
        holder = uuid.uuid4().hex
        self.store.take_lease(call_id, holder, self.seconds)
        return holder

    def keep(self, call_id: str, holder: str) -> None:
        """Renew the lease while the tool runs."""
        renewer.hold(self.store, call_id, holder, self.seconds)

    def stop_renewing(self, call_id: str, holder: str) -> None:
        """Stop renewing a lease the store has dropped."""
        renewer.let_go(self.store, call_id, holder)

    def let_go(self, call_id: str, holder: str) -> None:
        """Stop renewing the lease and drop it; a failure is logged (the lease then runs out)."""
        renewer.let_go(self.store, call_id, holder)
        try:
            self.store.drop_lease(call_id, holder)
        except Exception as e:
            log.warning("could not drop the lease of %s (it runs out by itself): %r", call_id, e)
