"""Leases on a PostgreSQL journal, timed by the server's clock."""

from __future__ import annotations

from datetime import datetime

from guard.leases import OwnerState
from guard.store import CallRecord, utc_now

from ..leasing import SWEEP_EVERY, owner_state, unclaimable
from ..rows import (
    record_from_row,
)
from .connection import Conn, Connection
from .sql import (
    _CALL_SELECT,
    _DROP_LEASE,
    _LATEST_LEASE,
    _LATEST_LEASES,
    _LEASES_OF,
    _LOCK_LEASES,
    _RENEW_LEASE,
    _SWEEP_LEASES,
    _TAKE_LEASE,
)


class Leases(Connection):
    """Take, renew, drop and claim leases; the owner state of pending calls."""

    def take_lease(self, call_id: str, holder: str, seconds: float) -> None:
        """Record ``holder``'s lease on ``call_id``, running out ``seconds`` from the server's now."""
        self._taken += 1
        self._single_statement("take a lease", _TAKE_LEASE, (call_id, holder, seconds))
        if self._taken % SWEEP_EVERY == 0:
            self._single_statement("sweep the leases", _SWEEP_LEASES, ())

    def renew_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        """Extend ``holder``'s lease; False when it has none on the call any more."""
        return self._single_statement("renew a lease", _RENEW_LEASE, (seconds, call_id, holder)) is not None

    def drop_lease(self, call_id: str, holder: str) -> None:
        """Forget ``holder``'s lease on ``call_id``."""
        self._single_statement("drop a lease", _DROP_LEASE, (call_id, holder))

    def claim_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        """Take a lease on ``call_id`` only if no other holder has a live one and the call is not
        pending with an owner alive by the host-and-pid test (one that never had a lease)."""

        def work(conn: Conn) -> bool:
            conn.execute(_LOCK_LEASES, (call_id,))  # one claim of the call at a time, on any replica
            rows = conn.execute(_LEASES_OF, (call_id,)).fetchall()
            others = [r for r in rows if r[0] != holder]
            if others:
                if any(alive for _, alive in others):
                    return False
            else:
                row = conn.execute(f"{_CALL_SELECT} WHERE call_id = %s", (call_id,)).fetchone()
                record = None if row is None else self._decoded(record_from_row, row)
                if unclaimable(record):
                    return False
            conn.execute(_TAKE_LEASE, (call_id, holder, seconds))
            return True

        return self._write("claim a call", work, pipeline=False)

    def owner_states(self, records: list[CallRecord]) -> dict[str, OwnerState]:
        """Whether each pending record's owner is alive, and when its lease runs out."""
        pending = [r.call_id for r in records if r.status == "pending"]
        latest: dict[str, datetime] = {}
        now = None
        if pending:
            for call_id, until, at in self._read("read the leases", _LATEST_LEASES, (pending,)):
                latest[call_id], now = until, at
        return {r.call_id: owner_state(r, latest.get(r.call_id), now if now is not None else utc_now())
                for r in records}

    def _lease_alive(self, conn: Conn, record: CallRecord | None) -> bool | None:
        """Whether a lease on the pending call has not run out; None when it has none."""
        if record is None or record.status != "pending":
            return None
        until, now = conn.execute(_LATEST_LEASE, (record.call_id,)).fetchone() or (None, None)
        return None if until is None else bool(until > now)
