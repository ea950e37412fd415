"""The leases of both journals: how a pending call's owner is judged, and how often expired leases
are swept.

A pending call is judged by its current attempt's owner and that owner's lease alone: the lease
its pending event names (``owner["lease"]``), never another holder's row (a reconciler's claim, a
retry's, an earlier attempt's), so that a stale row left by a killed process says nothing of a
live call. See :mod:`guard.liveness` for the rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from guard.leases import OwnerState
from guard.liveness import LeaseSeen, owner_alive
from guard.store import CallRecord

__all__ = ["SWEEP_EVERY", "LeaseRow", "claimable", "named_lease", "owner_state"]

# Every so many leases taken by one journal object, the leases that have run out on calls no
# longer pending are deleted: the table holds the running calls and the orphans, not the history.
SWEEP_EVERY = 256

# One lease as a store reads it: its holder, when it runs out (aware UTC), and whether it still runs
# by the store's clock.
LeaseRow = tuple[str, datetime, bool]


def named_lease(record: CallRecord | None) -> str | None:
    """The holder of the lease that the owner of a pending ``record`` took, or None (not pending,
    or begun by a guard without a lease, or by a version that did not name it)."""
    if record is None or record.status != "pending" or not record.owner:
        return None
    holder = record.owner.get("lease")
    return holder if isinstance(holder, str) else None


def owner_state(record: CallRecord, leases: Iterable[LeaseRow], one_machine: bool = False) -> OwnerState:
    """The :class:`OwnerState` of ``record``, given the call's lease rows (any holders: only the
    one its owner named counts). ``one_machine``: see :func:`guard.liveness.process_seen`."""
    if record.status != "pending":
        return OwnerState(None, None)
    holder = named_lease(record)
    if holder is None:
        return OwnerState(owner_alive(record.owner, None, one_machine), None)
    row = next((r for r in leases if r[0] == holder), None)
    seen: LeaseSeen = "ended" if row is None or not row[2] else "running"
    return OwnerState(owner_alive(record.owner, seen, one_machine), None if row is None else row[1])


def claimable(record: CallRecord | None, leases: Iterable[LeaseRow], holder: str, one_machine: bool = False) -> bool:
    """Whether ``holder`` may claim the call to check it: its owner, when it is pending, is gone,
    and no other holder than the owner and ``holder`` has a lease on it that still runs (another
    check, or a retry deciding)."""
    rows = list(leases)
    if record is not None and record.status == "pending" and owner_state(record, rows, one_machine).alive:
        return False
    owners = named_lease(record)
    return not any(running for other, _, running in rows if other not in (holder, owners))
