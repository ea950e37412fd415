"""Leases on a PostgreSQL journal, timed by the server's clock."""

from __future__ import annotations

from guard.leases import OwnerState
from guard.store import CallRecord

from ..leasing import SWEEP_EVERY, LeaseRow, claimable, named_lease, owner_state
from ..rows import (
    record_from_row,
)
from .datastore import Conn, PostgresDatastore
from .sql import (
    _CALL_SELECT,
    _DROP_LEASE,
    _LEASES_OF,
    _LEASES_OF_CALLS,
    _LOCK_LEASES,
    _RENEW_LEASE,
    _SWEEP_LEASES,
    _TAKE_LEASE,
)


class Leases:
    """Take, renew, drop and claim leases; the owner state of pending calls."""

    def __init__(self, datastore: PostgresDatastore) -> None:
        self._datastore = datastore
        self._single_statement = datastore.single_statement  # bound once: taking a lease is on the hot path
        self._taken = 0  # leases taken by this object, for the sweep of those run out

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
        """Take a lease on ``call_id`` only if its owner, when it is pending, is gone (see
        :mod:`journal.leasing`) and no other check holds a lease on it that still runs."""

        def work(conn: Conn) -> bool:
            conn.execute(_LOCK_LEASES, (call_id,))  # one claim of the call at a time, on any replica
            leases: list[LeaseRow] = [(h, until, bool(running))
                                      for h, until, running in conn.execute(_LEASES_OF, (call_id,)).fetchall()]
            row = conn.execute(f"{_CALL_SELECT} WHERE call_id = %s", (call_id,)).fetchone()
            record = None if row is None else self._datastore.decoded(record_from_row, row)
            if not claimable(record, leases, holder):
                return False
            conn.execute(_TAKE_LEASE, (call_id, holder, seconds))
            return True

        return self._datastore.write("claim a call", work, pipeline=False)

    def owner_states(self, records: list[CallRecord]) -> dict[str, OwnerState]:
        """Whether each pending record's owner is alive, and when its lease runs out."""
        pending = [r.call_id for r in records if r.status == "pending" and named_lease(r) is not None]
        leases: dict[str, list[LeaseRow]] = {}
        if pending:
            rows = self._datastore.rows("read the leases", _LEASES_OF_CALLS, (pending,))
            for call_id, holder, until, running in rows:
                leases.setdefault(call_id, []).append((holder, until, bool(running)))
        return {r.call_id: owner_state(r, leases.get(r.call_id, ())) for r in records}

    def owner_alive(self, conn: Conn, record: CallRecord | None) -> bool | None:
        """Whether the owner of the pending call is alive; None when the call is not pending."""
        if record is None or record.status != "pending":
            return None
        leases: list[LeaseRow] = []
        if named_lease(record) is not None:
            leases = [(h, until, bool(running))
                      for h, until, running in conn.execute(_LEASES_OF, (record.call_id,)).fetchall()]
        return owner_state(record, leases).alive
