"""The PostgreSQL journal's appends: under their call's lock, by the server-side append or from the client."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import orjson
from psycopg import errors as pg_errors

from guard.approvals import approval_event
from guard.canonical import NotCanonical
from guard.store import CallRecord, Decide, Decision, EffectEvent, apply, format_at

from .. import approvals
from ..chain import GENESIS
from ..errors import JournalError, StoreBusy, unstorable
from ..events import JournalEvent
from ..rebuilding import as_logged
from ..resolving import Choose
from ..rows import (
    CALL_COLUMNS,
    call_row,
    holds,
    placed,
    record_from_row,
    split_body,
    stamp,
)
from .datastore import Conn, NoServerAppend, PostgresDatastore
from .heads import Known, unique_at, uniquely_timed
from .leases import Leases
from .sealing import Sealer, seal_all, try_seal
from .server_append import _CALL_APPEND_FN, _CALL_FIELDS, _EVENT_FIELDS
from .sql import (
    _APPEND,
    _CALL_SELECT,
    _EVENTS_OF_CALL,
    _LOCK_CALL,
    _LOGGED,
    _RELAXED,
    _UPSERT_CALL,
)

__all__ = ["APPROVALS_CHANNEL", "QUEUE", "SEAL", "SEAL_NOW", "Rebuilt", "Writer"]

T = TypeVar("T")


class Rebuilt(Exception):
    """A rebuild of the projection came between a write's read of a record and its append: the
    write's transaction is rolled back and made again."""


_GENERATION = b"SELECT generation FROM chain_head WHERE id = 1"


def _generation(row: Any) -> int:
    return int(row[0]) if row is not None else 0

_NO_RECORD_NEEDED = frozenset({"refused", "replayed"})  # they never change a call's record

# The channel a decision on a request is told on (NOTIFY, delivered when its transaction commits),
# with the journal's schema and the call's id as a JSON array: see Approvals.wait_for_decision.
APPROVALS_CHANNEL = "airlock_approvals"
_DECISIONS = frozenset({"approved", "denied", "expired"})

# Where an append puts its event (see journal.postgres.sealing): into the inbox; into the log at
# once when no other session is sealing (else the inbox); into the log at once, waiting for a seal
# under way.
QUEUE, SEAL, SEAL_NOW = 0, 1, 2

# After an append of seal mode SEAL found the head held (another session appending or sealing),
# this many seconds of the process's appends go to the inbox without trying the head: under
# contention, one sealer's batch moves them for less than each append's own try and seal.
_CONTENDED_FOR = 1.0

_INBOX_INSERT = (f"INSERT INTO inbox ({', '.join(_EVENT_FIELDS)}, body_head, body_tail) "
                 f"VALUES ({', '.join(['%s'] * (len(_EVENT_FIELDS) + 2))}) RETURNING id")


class Writer:
    """The :class:`~guard.store.EffectStore` protocol (``begin``, ``append``, ``get``), the guard's
    lookup of a recent call, and the one write that settling and resolving make
    (:meth:`append_chosen`).

    A write takes its call's lock alone: one call of the server-side append, or (where sessions
    cannot make it, and for events of requests for approval) one transaction that locks the call
    and then reads. The event goes into the log at once when no other session is sealing, else into
    the inbox, which :class:`~journal.postgres.sealing.Sealer` seals some 30 ms later; for a second
    after an event found the head held, into the inbox without trying the head. :attr:`seal_mode`
    says which: set it to :data:`QUEUE` to send every event through the inbox, as under contention.
    """

    def __init__(self, datastore: PostgresDatastore, known: Known, leases: Leases, sealer: Sealer) -> None:
        self.name = datastore.name
        self._datastore = datastore
        self._known = known
        self._sealer = sealer
        self._owner_alive = leases.owner_alive
        self._check_writable = datastore.check_writable
        self._decoded = datastore.decoded
        #: Where the guard's events go: :data:`SEAL` (the default: into the log at once while no
        #: other session holds the head, into the inbox for a while after one did), or :data:`QUEUE`.
        self.seal_mode = SEAL
        self._contended_until = 0.0

    def _mode(self) -> int:
        """Where the next event goes: :attr:`seal_mode`, but :data:`QUEUE` for a while after an
        append of mode :data:`SEAL` found the head held."""
        if self.seal_mode == SEAL and time.monotonic() < self._contended_until:
            return QUEUE
        return self.seal_mode

    def _placed(self, mode: int, stored: JournalEvent) -> None:
        if mode == SEAL and stored.seq < 0:  # the head was held: others append too
            self._contended_until = time.monotonic() + _CONTENDED_FOR

    def lock_and_read(self, conn: Conn, call_id: str | None) -> tuple[CallRecord | None, int]:
        """Lock the call (no other write of it comes between), then read its record (a statement
        after the lock: it sees the last commit), whether the log has a state-changing event of it,
        and the head's generation (which a rebuild moves); one round trip. Returns the record and
        the generation, for :meth:`append_locked`.

        Where the projection lets the call run (no row, or ``released``) and the log (sealed or
        not) has such an event, the record is the fold of the call's events: a row deleted or
        released by hand never lets a call run again (see docs/journal.md, "What a writer with the
        file can hide")."""
        conn.execute(_LOCK_CALL, (call_id,))
        generation = conn.execute(_GENERATION)
        if call_id is None:
            return None, _generation(generation.fetchone())
        found = conn.execute(f"{_CALL_SELECT} WHERE call_id = %s", (call_id,))
        logged = conn.execute(_LOGGED, (call_id, call_id))
        row = found.fetchone()  # the fetch sends the pipeline
        record = self._decoded(record_from_row, row) if row is not None else None
        if logged.fetchone() is not None and (record is None or record.status == "released"):
            record = self._as_logged(conn, call_id, record)
        return record, _generation(generation.fetchone())

    def _as_logged(self, conn: Conn, call_id: str, record: CallRecord | None) -> CallRecord | None:
        kept_row = conn.execute("SELECT record FROM calls_archived WHERE call_id = %s", (call_id,)).fetchone()
        # Its row as of the start of the log, kept by an archive.
        kept = None if kept_row is None else self._decoded(record_from_row, (call_id, *orjson.loads(kept_row[0])))
        events = conn.execute(_EVENTS_OF_CALL, (call_id, call_id)).fetchall()  # the inbox's after the log's
        return as_logged(call_id, record, kept, events, self._decoded, self.name)

    def append_locked(self, conn: Conn, record: CallRecord | None, event: EffectEvent, mode: int,
                      generation: int) -> tuple[JournalEvent, CallRecord | None]:
        """Append ``event`` (its call locked, its record ``record`` read at ``generation``) where
        ``mode`` says, and fold it into the projection; returns the stored event (its ``seq`` minus
        its inbox id where it went into the inbox) and the call's record after it. An event of a
        request for approval goes into the log at once. Raises :class:`Rebuilt` (the transaction
        must be rolled back and made again) when a rebuild came between the read and the append."""
        changes_request = event.call_id is not None and approval_event(event)
        if changes_request:
            mode = SEAL_NOW  # the requests' projection names their events by seq
        sealed = False
        if mode == SEAL_NOW:
            seal_all(conn)
            sealed = True
        elif mode == SEAL:
            sealed = try_seal(conn)
        if sealed:  # this transaction holds the head's row, and the inbox it sees is empty
            head = conn.execute(b"SELECT seq, hash FROM chain_head WHERE id = 1").fetchone()
            seq, prev = (int(head[0]), str(head[1])) if head is not None else (0, GENESIS)
            stored, row = stamp(event, seq + 1, prev)
            conn.execute(_APPEND, (*row, stored.seq, stored.hash))
        else:
            prepared, body_head, body_tail = split_body(event)
            at_text, error_text, reason_text, owner_text = prepared[0]
            made = conn.execute(_INBOX_INSERT, (
                at_text, event.call_id, event.kind, event.tool, event.agent_id, event.idempotency_key,
                event.arguments, event.value, error_text, reason_text, event.actor, event.attempt, owner_text,
                body_head, body_tail)).fetchone()
            assert made is not None  # RETURNING id
            stored, _ = placed(event, prepared, -int(made[0]), "", "")
        # The head or the inbox may have been waited for behind a rebuild, archive or copy holding
        # the log: one that rebuilt the projection undoes the decision taken on the record read.
        if _generation(conn.execute(_GENERATION).fetchone()) != generation:
            raise Rebuilt()
        updated = apply(record, event, stored.seq) if event.call_id is not None else None
        if updated is not None and updated is not record:
            conn.execute(_UPSERT_CALL, call_row(updated))
            record = updated
        if changes_request:
            approvals.fold_event(conn, "%s", event, stored.seq)  # the projection of requests too
            if event.kind in _DECISIONS:  # wakes the calls that wait for it, once this commits
                conn.execute(b"SELECT pg_notify(%s, %s)",
                             (APPROVALS_CHANNEL, orjson.dumps([self._datastore.schema, event.call_id]).decode()))
        return stored, record

    def appended(self, call_id: str | None, stored: JournalEvent, record: CallRecord | None,
                 generation: int | None) -> None:
        """What a committed write tells: where the log reached, the call's record (in the projection
        of ``generation``), the inbox to seal."""
        if stored.seq > 0:
            self._known.moved(stored.seq)
        else:
            self._sealer.poke()
        if call_id is not None and record is not None:
            self._known.remember(call_id, record, generation)

    def _locked_write(self, doing: str, call_id: str | None,
                      choose: Callable[[CallRecord | None], EffectEvent], mode: int) -> JournalEvent:
        """One transaction: lock the call, read its record, ``choose`` the event, append it."""

        def work(conn: Conn) -> tuple[JournalEvent, CallRecord | None, int]:
            record, generation = self.lock_and_read(conn, call_id)
            event = choose(record)
            if event.kind != "pending":
                conn.execute(_RELAXED)
            return (*self.append_locked(conn, record, event, mode, generation), generation)

        stored, record, generation = self.rebuilt_again(doing, work)
        self.appended(call_id, stored, record, generation)
        self._placed(mode, stored)
        return stored

    def rebuilt_again(self, doing: str, work: Callable[[Conn], T], pipeline: bool = True) -> T:
        """``work`` in one write transaction, made again while a rebuild undoes it (:class:`Rebuilt`),
        until the busy deadline."""
        deadline = time.monotonic() + self._datastore.busy_timeout
        while True:
            try:
                return self._datastore.write(doing, work, pipeline=pipeline)
            except Rebuilt:
                if time.monotonic() > deadline:
                    raise StoreBusy(f"cannot {doing}: the journal {self.name} was rebuilt again and again "
                                    f"for {self._datastore.busy_timeout:g} s") from None

    def _append_on_server(self, doing: str, choose: Callable[[CallRecord | None], EffectEvent],
                          known: tuple[CallRecord | None, int | None], check: bool, mode: int) -> JournalEvent:
        """Append the event ``choose`` makes from the call's record by one call of the server-side
        append (see _APPEND_FN), starting from ``record`` (None: no record), the one this object
        last wrote. ``check``: the event must come from the call's current record; when the server
        finds another, the event is made again from that one and sent again, until the busy deadline."""
        after = self._known.floor
        record, generation = known
        deadline = time.monotonic() + self._datastore.busy_timeout
        while True:
            event = choose(record)
            updated = apply(record, event, 0) if event.call_id is not None else None
            project = updated is not None and updated is not record
            prepared, body_head, body_tail = split_body(event)
            at_text, error_text, reason_text, owner_text = prepared[0]
            calls = call_row(updated)[1:-1] if updated is not None and project else (None,) * len(_CALL_FIELDS)
            expected_at = format_at(record.updated_at) if record is not None else None  # as stored
            try:
                row = self._datastore.resendable(doing, _CALL_APPEND_FN, (
                    after, check, record.last_seq if record is not None else None, expected_at,
                    generation if record is not None else None, event.kind != "pending", mode, body_head, body_tail,
                    at_text, event.call_id, event.kind, event.tool, event.agent_id, event.idempotency_key,
                    event.arguments, event.value, error_text, reason_text, event.actor, event.attempt, owner_text,
                    project, *calls,
                ))
            except JournalError as e:
                if not isinstance(e.__cause__, pg_errors.SerializationFailure):
                    raise
                row = ("rebuilt",)  # nothing was written: a rebuild came while it waited
            if row[0] == "log":
                raise NoServerAppend()  # the locked way folds the call's events (see lock_and_read)
            if row[0] not in ("changed", "behind", "rebuilt"):
                break
            if time.monotonic() > deadline:
                raise StoreBusy(f"cannot {doing}: the record of the call {event.call_id!r} in the journal "
                                f"{self.name} kept changing for {self._datastore.busy_timeout:g} s")
            if row[0] == "rebuilt":
                record, generation = None, None  # the server tells the record as it is now
            elif row[0] == "behind":
                # The server lost events this object saw (it crashed): what the object remembers of
                # them is gone, and so is the place after which an append sent again is looked for.
                self._known.forget()
                self._known.floor = after = int(row[1])
                record = None
            else:
                generation = int(row[4])
                record = None if row[5] is None else self._decoded(record_from_row, row[5:5 + len(CALL_COLUMNS)])
        seq = int(row[1])
        if seq > 0:
            prev, digest = str(row[2]), str(row[3])
            stored, _ = placed(event, prepared, seq, prev, digest)
            # The chain's rule over the event's canonical body at its seq: the bytes the server was sent.
            if hashlib.sha256(b"".join((prev.encode("ascii"), body_head, str(seq).encode(), body_tail))
                              ).hexdigest() != digest:
                raise JournalError(f"cannot {doing}: the journal {self.name} stored event {seq} with the hash "
                                   f"{digest}, which is not the chain's; run verify")
        else:
            stored, _ = placed(event, prepared, seq, "", "")
        if project:
            record = apply(record, event, seq)
        self.appended(event.call_id, stored, record if project or check else None, int(row[4]))
        self._placed(mode, stored)
        return stored

    def begin(self, call_id: str, decide: Decide) -> Decision:
        """Read the call's record, let ``decide`` choose, append its event, atomically: no other
        append of the call comes between the read and the append. One round trip when the call's
        record is the one this object last wrote (or it has none), one more when it is not."""
        try:
            return self._begin(call_id, decide)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self.name, e) from e

    def _begin(self, call_id: str, decide: Decide) -> Decision:
        doing = "record the call"
        self._check_writable(doing)
        decisions: list[Decision] = []

        def choose(record: CallRecord | None) -> EffectEvent:
            decisions[:] = [uniquely_timed(decide(record))]
            return decisions[0].event

        def choose_on_server(record: CallRecord | None) -> EffectEvent:
            event = choose(record)
            if approval_event(event):
                raise NoServerAppend()  # nothing sent: the locked way folds it into the requests
            return event

        if self._datastore.server_append:
            with contextlib.suppress(NoServerAppend):
                self._append_on_server(doing, choose_on_server, self._known.written(call_id), True, self._mode())
                return decisions[0]
        self._locked_write(doing, call_id, choose, self._mode())
        return decisions[0]

    def append(self, event: EffectEvent) -> None:
        """Append an outcome or a refusal (folded into the projection where it applies)."""
        self._append(event, self._mode())

    def append_event(self, event: EffectEvent) -> JournalEvent:
        """:meth:`append`, returning the event as stored in the log (with its ``seq`` and ``hash``:
        it is sealed at once, waiting for a seal under way)."""
        return self._append(event, SEAL_NOW)

    def _append(self, event: EffectEvent, mode: int) -> JournalEvent:
        try:
            return self._append_event(event, mode)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self.name, e) from e

    def _append_event(self, event: EffectEvent, mode: int) -> JournalEvent:
        doing = f"record the {event.kind} event"
        self._check_writable(doing)
        event = unique_at(event)
        call_id = event.call_id
        if call_id is not None and approval_event(event):
            return self._locked_write(doing, call_id, lambda record: event, SEAL_NOW)  # folded into the requests
        check = call_id is not None and event.kind not in _NO_RECORD_NEEDED
        if self._datastore.server_append:
            known = self._known.written(call_id) if check else (None, None)
            with contextlib.suppress(NoServerAppend):
                return self._append_on_server(doing, lambda record: event, known, check, mode)
        return self._locked_write(doing, call_id, lambda record: event, mode)

    def get(self, call_id: str) -> CallRecord | None:
        """The current record of ``call_id``, or None."""
        if not holds(call_id, nul=False):
            return None  # an id with no UTF-8 form (a lone surrogate), or with a NUL, is never stored
        rows = self._datastore.rows("read the call", f"{_CALL_SELECT} WHERE call_id = %s", (call_id,))
        return self._decoded(record_from_row, rows[0]) if rows else None

    def recent_call(self, agent_id: str | None, idempotency_key: str, since: datetime) -> CallRecord | None:
        """The most recent call of ``agent_id`` with ``idempotency_key`` begun at or after ``since`` and
        not released, or None (the lookup of ``EffectGuard(duplicate_window=...)``)."""
        if not holds(idempotency_key, nul=False) or (agent_id is not None and not holds(agent_id, nul=False)):
            return None
        agent, params = ("agent_id IS NULL", ()) if agent_id is None else ("agent_id = %s", (agent_id,))
        rows = self._datastore.rows(
            "look up a recent call",
            f"{_CALL_SELECT} WHERE idempotency_key = %s AND created_at >= %s AND {agent} AND status != 'released' "
            "ORDER BY created_at DESC, call_id DESC LIMIT 1",
            (idempotency_key, format_at(since), *params),
        )
        return self._decoded(record_from_row, rows[0]) if rows else None

    def append_chosen(self, doing: str, call_id: str, choose: Choose) -> JournalEvent | None:
        """In one transaction that holds the call: its record, the event ``choose`` makes of it
        (None: nothing is written), appended and sealed at once; the primitive of
        :class:`~journal.resolving.Resolver`."""

        def work(conn: Conn) -> tuple[JournalEvent | None, CallRecord | None, int]:
            record, generation = self.lock_and_read(conn, call_id)
            event = choose(record, lambda: self._owner_alive(conn, record))
            if event is None:
                return None, record, generation
            return (*self.append_locked(conn, record, event, SEAL_NOW, generation), generation)

        stored, record, generation = self.rebuilt_again(doing, work, pipeline=False)
        if stored is not None:
            self.appended(call_id, stored, record, generation)
        return stored
