"""The SQLite journal's writes: a call's events and its projection row, in one transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from guard.approvals import approval_event
from guard.canonical import NotCanonical
from guard.leases import OwnerState
from guard.store import CallRecord, Decide, Decision, EffectEvent, apply

from .. import approvals
from ..chain import GENESIS, compute_hash
from ..errors import (
    JournalError,
    unstorable,
)
from ..events import JournalEvent, at_text, text_sha256
from ..leasing import SWEEP_EVERY, claimable, named_lease, owner_state
from ..rebuilding import as_logged
from ..resolving import Choose, stored_event
from ..rows import holds, json_text, record_from_row
from . import lease_clock
from .archives import archived_record
from .datastore import FULL, NORMAL, SQLiteDatastore
from .sql import (
    _DROP_LEASE,
    _INSERT_EVENT,
    _LEASES_A_READ,
    _LEASES_OF,
    _LEASES_OF_CALLS,
    _LOGGED_EVENTS,
    _RENEW_LEASE,
    _SELECT_CALL,
    _SELECT_HEAD_AND_CALL,
    _SELECT_RECENT,
    _SWEEP_LEASES,
    _TAKE_LEASE,
    _UPDATE_CALL,
    _UPSERT_CALL,
)


def _plain(obj: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return obj if obj is None or type(obj) is dict else dict(obj)

def _text(obj: Mapping[str, Any] | None, same: object, done: str | None) -> str | None:
    """The JSON text of ``obj``: ``done`` when it is the object ``same`` that text was made of."""
    return done if obj is same else json_text(obj)


def _time(t: datetime, same: datetime, done: str) -> str:
    return done if t is same else at_text(t)


class Writer:
    """The :class:`~guard.store.EffectStore` protocol, leases, and the primitive of settling and
    resolving: every write of a call's event, with the projection row it folds into, in one
    transaction of ``datastore``."""

    def __init__(self, datastore: SQLiteDatastore) -> None:
        self._label = str(datastore.path)
        self._durability = datastore.durability
        self._durable_sync = datastore.durable_sync
        # Bound once: the guard's calls go through them.
        self._combined = datastore.group.combined
        self._wait_durable = datastore.group.wait_durable
        self._write = datastore.write
        self._read = datastore.read
        self._decoded = datastore.decoded
        self._owner: tuple[object, str | None] = (object(), None)
        self._arguments: tuple[str | None, str | None] = (None, None)
        self._taken = 0  # leases taken by this object, for the sweep of those run out

    def head_and_record(self, conn: sqlite3.Connection,
                         call_id: str | None) -> tuple[tuple[int, str], CallRecord | None]:
        """Inside a write transaction: the log's (seq, hash) head and the current record of ``call_id``.

        The record is the projection's, except where the projection lets the call run (no row, or
        ``released``) and the log has a state-changing event of it: then it is the fold of the call's
        events, so that a row deleted or released by hand never lets a call run again (see
        docs/journal.md, "What a writer with the file can hide")."""
        row = conn.execute(_SELECT_HEAD_AND_CALL, (call_id,)).fetchone()
        head = (0, GENESIS) if row[0] is None else (row[0], row[1])
        record = None
        if row[3] is not None:
            try:
                record = record_from_row(row[3:])
            except (ValueError, TypeError) as e:
                raise JournalError(
                    f"The stored record of the call {call_id!r} cannot be read ({e}); run verify.") from e
        if row[2] is not None and call_id is not None and (record is None or record.status == "released"):
            logged = conn.execute(_LOGGED_EVENTS, (call_id,))
            record = as_logged(call_id, record, archived_record(conn, call_id), logged, self._decoded, self._label)
        return head, record

    def begin(self, call_id: str, decide: Decide, lease: tuple[str, float] | None = None) -> Decision:
        """Decide and record one attempt of ``call_id`` atomically (see :class:`~guard.store.EffectStore`).

        At ``durability="full"``, when the decision records ``pending`` this returns only once an
        fsync of the WAL that began after its commit has completed (one this thread makes, or one
        another thread was making for it too), so the tool never runs before its ``pending`` is on disk.

        Raises :class:`StoreBusy` past the busy deadline, :class:`JournalError` on any other failure
        (an fsync that fails too: the guard then refuses the call, and a retry finds it ``pending``).
        """

        def step(conn: sqlite3.Connection) -> Decision:
            head, record = self.head_and_record(conn, call_id)
            decision = decide(record)
            if lease is not None and decision.event.kind == "pending":  # in the transaction of its pending
                self._on_lease_clock(conn)
                conn.execute(_TAKE_LEASE, (call_id, lease[0], lease_clock.now() + lease[1]))
            self.append_event(conn, decision.event, record, head)
            return decision

        try:
            decision, ticket = self._combined(step)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self._label, e) from e
        if self._durability == "full" and decision.event.kind == "pending":
            self._wait_durable(ticket)
        return decision

    def append(self, event: EffectEvent, drop_lease: str | None = None) -> None:
        """Record an outcome or a refusal outside ``begin``; it becomes durable with the next fsync.
        ``drop_lease``: the holder whose lease on the call ends with this outcome."""

        def step(conn: sqlite3.Connection) -> None:
            head, record = self.head_and_record(conn, event.call_id)
            self.append_event(conn, event, record, head)
            if drop_lease is not None:
                conn.execute(_DROP_LEASE, (event.call_id, drop_lease))

        try:
            if event.kind == "pending" and self._durability == "full":
                self._write(FULL, step)
            else:
                self._combined(step)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self._label, e) from e

    def get(self, call_id: str) -> CallRecord | None:
        """The current record of ``call_id``, or None."""
        if not holds(call_id):
            return None  # an id with no UTF-8 form (a lone surrogate) is never stored
        row = self._read(lambda c: c.execute(_SELECT_CALL, (call_id,)).fetchone())
        return None if row is None else self._decoded(record_from_row, row)

    def recent_call(self, agent_id: str | None, idempotency_key: str, since: datetime) -> CallRecord | None:
        """The most recent call of ``agent_id`` with ``idempotency_key`` begun at or after ``since`` and
        not released, or None (the lookup of ``EffectGuard(duplicate_window=...)``)."""
        if not holds(idempotency_key) or (agent_id is not None and not holds(agent_id)):
            return None
        row = self._read(lambda c: c.execute(_SELECT_RECENT, (idempotency_key, at_text(since), agent_id)).fetchone())
        return None if row is None else self._decoded(record_from_row, row)

    # -- leases (see guard.leases); the store's clock is this boot's, which its processes share -----

    leases_in_begin = True  # begin takes a call's lease and append drops it, in their transactions
    _clock_adopted = False  # this object has put the journal's leases on this boot's clock

    def _on_lease_clock(self, conn: sqlite3.Connection) -> None:
        """Inside a write transaction that writes a lease: the journal's leases on this boot's clock."""
        if not self._clock_adopted:
            lease_clock.adopt(conn)
            self._clock_adopted = True  # a later boot is a later process: this one never sees it

    def take_lease(self, call_id: str, holder: str, seconds: float) -> None:
        """Record ``holder``'s lease on ``call_id``, running out ``seconds`` from now."""
        self._taken += 1
        sweep = self._taken % SWEEP_EVERY == 0

        def step(conn: sqlite3.Connection) -> None:
            self._on_lease_clock(conn)
            now = lease_clock.now()
            conn.execute(_TAKE_LEASE, (call_id, holder, now + seconds))
            if sweep:
                conn.execute(_SWEEP_LEASES, (now,))

        self._combined(step)

    def renew_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        """Extend ``holder``'s lease; False when it has none on the call any more."""

        def step(conn: sqlite3.Connection) -> bool:
            self._on_lease_clock(conn)
            return conn.execute(_RENEW_LEASE, (lease_clock.now() + seconds, call_id, holder)).rowcount > 0

        return self._combined(step)[0]

    def drop_lease(self, call_id: str, holder: str) -> None:
        """Forget ``holder``'s lease on ``call_id``."""
        self._combined(lambda conn: conn.execute(_DROP_LEASE, (call_id, holder)))

    def claim_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        """Take a lease on ``call_id`` only if its owner, when it is pending, is gone (see
        :mod:`journal.leasing`) and no other check holds a lease on it that still runs."""

        def step(conn: sqlite3.Connection) -> bool:
            self._on_lease_clock(conn)
            row = conn.execute(_SELECT_CALL, (call_id,)).fetchone()
            record = None if row is None else record_from_row(row)
            leases = lease_clock.lease_rows(lease_clock.CLOCK, conn.execute(_LEASES_OF, (call_id,)))
            if not claimable(record, leases, holder, one_machine=True):
                return False
            conn.execute(_TAKE_LEASE, (call_id, holder, lease_clock.now() + seconds))
            return True

        return self._write(NORMAL, step)

    def append_chosen(self, doing: str, call_id: str, choose: Choose) -> JournalEvent | None:
        """See :class:`~journal.resolving.Resolver`: one write transaction, at the journal's durability."""

        def step(conn: sqlite3.Connection) -> JournalEvent | None:
            head, record = self.head_and_record(conn, call_id)
            event = choose(record, lambda: self._owner_alive(conn, record))
            if event is None:
                return None
            return stored_event(event, *self.append_event(conn, event, record, head))

        return self._write(self._durable_sync, step)

    def owner_states(self, records: list[CallRecord]) -> dict[str, OwnerState]:
        """Whether each pending record's owner is alive, and when its lease runs out."""
        return self._read(lambda conn: self._owner_states(conn, records))

    def _owner_states(self, conn: sqlite3.Connection, records: list[CallRecord]) -> dict[str, OwnerState]:
        pending = [r.call_id for r in records if r.status == "pending" and named_lease(r) is not None]
        rows: dict[str, list[tuple[str, float]]] = {}
        clock = "wall"
        try:
            if pending:
                clock = lease_clock.read_clock(conn)
            for start in range(0, len(pending), _LEASES_A_READ):
                some = pending[start:start + _LEASES_A_READ]
                for call_id, holder, until in conn.execute(
                        _LEASES_OF_CALLS.format(marks=", ".join("?" * len(some))), some):
                    rows.setdefault(call_id, []).append((holder, until))
        except sqlite3.OperationalError as e:
            if "no such table" not in str(e):
                raise
            rows = {}  # a journal from before leases, read as it is
        return {r.call_id: owner_state(r, lease_clock.lease_rows(clock, rows.get(r.call_id, ())), one_machine=True)
                for r in records}

    def _owner_alive(self, conn: sqlite3.Connection, record: CallRecord | None) -> bool | None:
        """Whether the owner of the pending call is alive; None when the call is not pending."""
        if record is None or record.status != "pending":
            return None
        return self._owner_states(conn, [record])[record.call_id].alive

    def append_event(
        self, conn: sqlite3.Connection, event: EffectEvent, record: CallRecord | None, head: tuple[int, str]
    ) -> tuple[int, str, str]:
        """Insert ``event`` after ``head`` and fold it into the projection; returns (seq, prev, hash)."""
        seq, prev = head[0] + 1, head[1]
        at = at_text(event.at)
        error, reason, owner = _plain(event.error), _plain(event.reason), _plain(event.owner)
        error_text, reason_text = json_text(error), json_text(reason)
        if owner is not self._owner[0]:
            self._owner = (owner, json_text(owner))  # the guard hands every event one owner object
        owner_text = self._owner[1]
        arguments, value = event.arguments, event.value
        if arguments != self._arguments[0]:
            self._arguments = (arguments, text_sha256(arguments))  # a call's events repeat its arguments
        digest = compute_hash(prev, {
            "seq": seq, "at": at, "call_id": event.call_id, "kind": event.kind, "tool": event.tool,
            "agent_id": event.agent_id, "idempotency_key": event.idempotency_key,
            "arguments_sha256": self._arguments[1], "value_sha256": text_sha256(value),
            "error": error, "reason": reason, "actor": event.actor, "attempt": event.attempt, "owner": owner,
        })
        conn.execute(_INSERT_EVENT, (
            seq, at, event.call_id, event.kind, event.tool, event.agent_id, event.idempotency_key,
            arguments, value, error_text, reason_text, event.actor, event.attempt, owner_text, prev, digest,
        ))
        if event.call_id is not None and approval_event(event):
            approvals.fold_event(conn, "?", event, seq)
        folded = apply(record, event, seq)
        if folded is not None and folded is not record:
            # The record's texts that come from this event are the ones made for it above.
            error_text = _text(folded.error, event.error, error_text)
            reason_text = _text(folded.reason, event.reason, reason_text)
            owner_text = _text(folded.owner, event.owner, owner_text)
            updated_at = _time(folded.updated_at, event.at, at)
            since = _time(folded.since, event.at, at)
            # A row there (the call's record was read from it): update what can change. No row (a
            # new call, or a row removed by hand whose record the log gave): write it whole.
            if record is None or not conn.execute(_UPDATE_CALL, (
                folded.status, folded.attempt, folded.agent_id, folded.value, error_text, reason_text,
                folded.actor, owner_text, updated_at, since, seq, folded.call_id,
            )).rowcount:
                conn.execute(_UPSERT_CALL, (
                    folded.call_id, folded.tool, folded.status, folded.attempt, folded.agent_id,
                    folded.idempotency_key, folded.arguments, folded.value, error_text, reason_text, folded.actor,
                    owner_text, _time(folded.created_at, event.at, at), updated_at, since, seq,
                ))
        return seq, prev, digest

