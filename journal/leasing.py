"""The leases of both journals: the owner test they share, and how often expired leases are swept."""

from __future__ import annotations

from datetime import UTC, datetime

from guard.leases import OwnerState
from guard.store import CallRecord, current_owner

from .owner import owner_alive

__all__ = ["SWEEP_EVERY", "owner_state", "pending_alive", "unclaimable"]

# Every so many leases taken by one journal object, the leases that have run out on calls no
# longer pending are deleted: the table holds the running calls and the orphans, not the history.
SWEEP_EVERY = 256


def pending_alive(record: CallRecord | None, latest: float | datetime | None, now: float | datetime) -> bool | None:
    """Whether the owner of ``record`` is alive: None when the call is not pending; else, when it
    has leases (``latest``: when the last of them runs out), whether that is after ``now``; when it
    never had one (a guard without a lease, or a journal from before leases), the host-and-pid test."""
    if record is None or record.status != "pending":
        return None
    if latest is None:
        return owner_alive(record.owner)
    return latest > now  # type: ignore[operator]


def owner_state(record: CallRecord, latest: float | datetime | None, now: float | datetime) -> OwnerState:
    """The :class:`OwnerState` of ``record``, its leases' latest end ``latest`` (unix seconds or an
    aware datetime, as the store keeps them) seen at the store's ``now``."""
    expires = datetime.fromtimestamp(latest, UTC) if isinstance(latest, float | int) else latest
    return OwnerState(pending_alive(record, latest, now), expires)



def unclaimable(record: CallRecord | None) -> bool:
    """Whether a call that never had a lease must not be given to a check: it is pending and its
    owner is not known to be gone. Only a process of this host that no longer runs is known gone;
    one of another host, or of another PID namespace of this one, cannot be seen from here, so a
    guard that shares a journal across hosts or containers takes leases."""
    if record is None or record.status != "pending":
        return False
    host = (record.owner or {}).get("host")
    return host != current_owner()["host"] or owner_alive(record.owner)
