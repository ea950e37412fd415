"""The PostgreSQL journal's appends: compare-and-set on the head, the server-side append, or the head locked."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import orjson

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
from .datastore import Conn, ConnectionLost, NoServerAppend, PostgresDatastore
from .heads import Head, InDoubt, Known, Seen, unique_at, uniquely_timed
from .leases import Leases
from .server_append import _CALL_APPEND_FN, _CALL_FIELDS
from .sql import (
    _APPEND,
    _APPEND_AND_PROJECT,
    _CALL_SELECT,
    _CAS_APPEND,
    _EVENT_SELECT,
    _LOCK_HEAD,
    _LOGGED,
    _RELAXED,
    CasCheck,
)

__all__ = ["APPROVALS_CHANNEL", "Writer"]

_NO_RECORD_NEEDED = frozenset({"refused", "replayed"})  # they never change a call's record

# The channel a decision on a request is told on (NOTIFY, delivered when its transaction commits),
# with the journal's schema and the call's id as a JSON array: see Approvals.wait_for_decision.
APPROVALS_CHANNEL = "airlock_approvals"
_DECISIONS = frozenset({"approved", "denied", "expired"})

_SKIP_AFTER_CONFLICT = 8  # writes that wait for the lock after another writer moved the head


def _check_of(record: CallRecord | None) -> CasCheck:
    """What a compare-and-set requires of a call whose record ``record`` it read at the head."""
    if record is None:
        return "absent"
    return "released" if record.status == "released" else ""


class Writer:
    """The :class:`~guard.store.EffectStore` protocol (``begin``, ``append``, ``get``), the guard's
    lookup of a recent call, and the one write that settling and resolving make
    (:meth:`append_chosen`).

    Right after this object's own write, a write is one compare-and-set of the head; where other
    replicas write (or for a first write), one call of the server-side append; failing both, one
    transaction that locks the head and then reads. :attr:`skip_cas` says how many writes from now
    on go without the compare-and-set.
    """

    def __init__(self, datastore: PostgresDatastore, known: Known, leases: Leases) -> None:
        self.name = datastore.name
        self._datastore = datastore
        self._known = known
        self._owner_alive = leases.owner_alive
        # Bound once: the guard's begin and append reach them on every call.
        self._single_statement = datastore.single_statement
        self._check_writable = datastore.check_writable
        self._decoded = datastore.decoded
        #: Writer still to make without the compare-and-set (by the server-side append, or the head
        #: locked): set after a write finds that another writer moved the head, and counted down by
        #: each write. Set it high to make every write the contended way, as under contention.
        self.skip_cas = 0

    def lock_and_read(self, conn: Conn, call_id: str | None) -> tuple[Head, CallRecord | None]:
        """Lock the head row, then read the call's record (a statement after the lock: it sees the
        last commit), and whether the log has a state-changing event of it; one round trip.

        Where the projection lets the call run (no row, or ``released``) and the log has such an
        event, the record is the fold of the call's events: a row deleted or released by hand
        never lets a call run again (see docs/journal.md, "What a writer with the file can hide")."""
        head = conn.execute(_LOCK_HEAD)
        found = logged = None
        if call_id is not None:
            found = conn.execute(f"{_CALL_SELECT} WHERE call_id = %s", (call_id,))
            logged = conn.execute(_LOGGED, (call_id,))
        seq, prev, generation = head.fetchone() or (0, GENESIS, 0)  # the fetch sends the pipeline
        row = found.fetchone() if found is not None else None
        record = self._decoded(record_from_row, row) if row is not None else None
        if (call_id is not None and logged is not None and logged.fetchone() is not None
                and (record is None or record.status == "released")):
            record = self._as_logged(conn, call_id, record)
        return Head(int(seq), str(prev), int(generation)), record

    def _as_logged(self, conn: Conn, call_id: str, record: CallRecord | None) -> CallRecord | None:
        kept_row = conn.execute("SELECT record FROM calls_archived WHERE call_id = %s", (call_id,)).fetchone()
        # Its row as of the start of the log, kept by an archive.
        kept = None if kept_row is None else self._decoded(record_from_row, (call_id, *orjson.loads(kept_row[0])))
        events = conn.execute(f"{_EVENT_SELECT} WHERE call_id = %s ORDER BY seq", (call_id,)).fetchall()
        return as_logged(call_id, record, kept, events, self._decoded, self.name)

    def append_locked(self, conn: Conn, head: Head, record: CallRecord | None,
                      event: EffectEvent) -> tuple[JournalEvent, Head, CallRecord | None]:
        """Insert ``event`` after ``head`` (locked), fold it into the projection, move the head;
        returns the stored event, the new head and the call's record after it."""
        stored, row = stamp(event, head.seq + 1, head.hash)
        updated = apply(record, event, stored.seq) if event.call_id is not None else None
        if updated is not None and updated is not record:
            conn.execute(_APPEND_AND_PROJECT, (*row, *call_row(updated), stored.seq, stored.hash))
            record = updated
        else:
            conn.execute(_APPEND, (*row, stored.seq, stored.hash))
        if event.call_id is not None and approval_event(event):
            approvals.fold_event(conn, "%s", event, stored.seq)  # the projection of requests too
            if event.kind in _DECISIONS:  # wakes the calls that wait for it, once this commits
                conn.execute(b"SELECT pg_notify(%s, %s)",
                             (APPROVALS_CHANNEL, orjson.dumps([self._datastore.schema, event.call_id]).decode()))
        return stored, Head(stored.seq, stored.hash, head.generation), record

    def _locked_write(self, doing: str, call_id: str | None,
                      choose: Callable[[CallRecord | None], EffectEvent],
                      doubt: JournalEvent | None = None) -> JournalEvent:
        """One transaction: lock the head, read the record, ``choose`` the event, append it.

        ``doubt`` is an event whose one-statement append was cut off with its connection: once the
        head is locked, that statement has committed (and is found: it is returned, nothing more is
        written) or it never will (its compare-and-set finds the head moved).
        """
        recent = self._known.recent
        known = recent[0] if recent is not None else None

        def work(conn: Conn) -> tuple[JournalEvent, Head, CallRecord | None]:
            head, record = self.lock_and_read(conn, call_id)
            if doubt is not None and head.seq >= doubt.seq and conn.execute(
                "SELECT 1 FROM events WHERE seq = %s AND hash = %s", (doubt.seq, doubt.hash)
            ).fetchone():
                return doubt, head, record
            if known is not None and head != known:
                self.skip_cas = _SKIP_AFTER_CONFLICT  # others write too: wait for the lock a while
            event = choose(record)
            if event.kind != "pending":
                conn.execute(_RELAXED)
            return self.append_locked(conn, head, record, event)

        self._known.recent = None
        stored, head, record = self._datastore.write(doing, work)
        projected = record is not None and record.last_seq == stored.seq
        self._known.remember(head, call_id, record, True, stored.hash if projected else None)
        return stored

    def _append_on_server(self, doing: str, choose: Callable[[CallRecord | None], EffectEvent],
                          known: bool, record: CallRecord | None, last_hash: str | None,
                          check: bool) -> JournalEvent:
        """Append the event ``choose`` makes from the call's record by one call of the server-side
        append (see _APPEND_FN), starting from ``record`` (None: no record; ``known``: it is the
        record this object last wrote, ``last_hash`` the hash of its last event where known).
        ``check``: the event must come from the call's current record; when the server finds
        another, the event is made again from that one and sent again, until the busy deadline."""
        after, recent = self._known.floor, self._known.recent
        last_head = recent[0] if recent is not None else None
        head_hash = last_head.hash if last_head is not None and known else None
        generation = last_head.generation if last_head is not None and known else None
        deadline = time.monotonic() + self._datastore.busy_timeout
        while True:
            event = choose(record)
            updated = apply(record, event, 0) if event.call_id is not None else None
            project = updated is not None and updated is not record
            prepared, body_head, body_tail = split_body(event)
            at_text, error_text, reason_text, owner_text = prepared[0]
            calls = call_row(updated)[1:-1] if updated is not None and project else (None,) * len(_CALL_FIELDS)
            row = self._call_server_append(doing, (
                after, check, record.last_seq if record is not None else None, last_hash, head_hash,
                generation if record is not None else None, event.kind != "pending", body_head, body_tail,
                at_text, event.call_id, event.kind, event.tool, event.agent_id, event.idempotency_key,
                event.arguments, event.value, error_text, reason_text, event.actor, event.attempt, owner_text,
                project, *calls,
            ))
            if row[0] == "log":
                raise NoServerAppend()  # the locked way folds the call's events (see lock_and_read)
            if row[0] not in ("changed", "behind"):
                break
            if time.monotonic() > deadline:
                raise StoreBusy(f"cannot {doing}: the record of the call {event.call_id!r} in the journal "
                                f"{self.name} kept changing for {self._datastore.busy_timeout:g} s")
            generation, head_hash = int(row[4]), str(row[3])
            if row[0] == "behind":
                # The server lost events this object saw (it crashed): what the object remembers of
                # them is gone, and so is the place after which an append sent again is looked for.
                self._known.forget()
                self._known.floor = after = int(row[1])
                last_head, record, last_hash = None, None, None
            else:
                record = None if row[5] is None else self._decoded(record_from_row, row[5:5 + len(CALL_COLUMNS)])
                last_hash = row[5 + len(CALL_COLUMNS)]
        seq, prev, digest = int(row[1]), str(row[2]), str(row[3])
        stored, _ = placed(event, prepared, seq, prev, digest)
        # The chain's rule over the event's canonical body at its seq: the bytes the server was sent.
        if hashlib.sha256(b"".join((prev.encode("ascii"), body_head, str(seq).encode(), body_tail))
                          ).hexdigest() != digest:
            raise JournalError(f"cannot {doing}: the journal {self.name} stored event {seq} with the hash "
                               f"{digest}, which is not the chain's; run verify")
        head = Head(seq, digest, int(row[4]))
        if row[0] == "appended" and last_head is not None and (seq - 1, prev) != (last_head.seq, last_head.hash):
            self.skip_cas = _SKIP_AFTER_CONFLICT  # others write too: their appends move the head
        # Unchecked (a refusal or a replay), the record is not known to be current at this head,
        # even if it was the one this object wrote last: another replica may have changed it since.
        if project:
            self._known.remember(head, event.call_id, apply(record, event, seq), True, digest)
        else:
            self._known.remember(head, event.call_id, record, check, last_hash)
        return stored

    def _call_server_append(self, doing: str, params: Sequence[Any]) -> tuple[Any, ...]:
        """One call of the server-side append. A connection that dies meanwhile is replaced and the
        same call made again, once: the server finds the event if the first call appended it, and
        a first call still running there finds the second's."""
        return self._datastore.resendable(doing, _CALL_APPEND_FN, params)

    def _try_append(self, head: Head, record: CallRecord | None, event: EffectEvent, doing: str,
                    check: CasCheck = "", known: bool = True,
                    last_hash: str | None = None) -> tuple[JournalEvent | None, Seen | None]:
        """Append ``event`` after ``head`` in one round trip, if the head is still there and the
        call is as ``check`` requires ("absent": it has no record; "written": its record is still
        ``record``, whose last event has the hash ``last_hash``; "released": ``record``, released,
        is borne out by the log). Returns the stored event, or None
        (and then nothing was written) with what the statement found: the head and the call's
        record, to try again with (None when the connection was lost). ``known``: ``record`` is the
        call's (else it was not read: a refusal or a replay of a call this object does not know)."""
        stored, row = stamp(event, head.seq + 1, head.hash)
        updated = apply(record, event, stored.seq) if event.call_id is not None else None
        project = updated is not None and updated is not record
        cas: tuple[Any, ...] = (stored.seq, stored.hash, head.seq, head.hash, head.generation)
        if check == "absent":
            cas += (event.call_id, event.call_id)
        elif check == "written":
            assert record is not None and last_hash is not None  # a written record is kept with its hash
            cas += (event.call_id, record.last_seq, last_hash, event.call_id, record.last_seq)
        elif check == "released":
            assert record is not None
            cas += (event.call_id, record.last_seq, event.call_id, record.last_seq)
        statement = _CAS_APPEND[project, check, event.kind != "pending"]
        params = (*cas, *row, *call_row(updated)) if updated is not None and project else (*cas, *row)
        try:
            result = self._single_statement(doing, statement, (*params, event.call_id))
        except ConnectionLost:
            # In doubt: the compare-and-set either committed whole or not at all; look for it. Not
            # found yet, it may still be waiting on the server for the head's lock: the caller's
            # locked write looks again once it holds that lock (see _locked_write).
            committed = self._datastore.rows(doing, "SELECT 1 FROM events WHERE seq = %s AND hash = %s",
                                             (stored.seq, stored.hash))
            if not committed:
                raise InDoubt(stored) from None
            result = (1,)
        assert result is not None  # the chain_head row is always there
        if result[0] != 1:
            seen = Head(int(result[1]), str(result[2]), int(result[3]))
            self._known.moved(seen.seq)
            found = None if result[4] is None else self._decoded(record_from_row, result[4:])
            return None, (seen, found)
        after = Head(stored.seq, stored.hash, head.generation)
        if project:
            self._known.remember(after, event.call_id, updated, True, stored.hash)
        else:  # the record as it was: the hash of its last event is known if this object had it
            prior = self._known.recent
            if check != "written":
                last_hash = (prior[3] if prior is not None and prior[1] == event.call_id and prior[2] is record
                             else None)
            self._known.remember(after, event.call_id, record, known, last_hash)
        return stored, None

    def begin(self, call_id: str, decide: Decide) -> Decision:
        """Read the call's record, let ``decide`` choose, append its event, atomically: no other
        append comes between the read and the append (see :meth:`_begin`)."""
        try:
            return self._begin(call_id, decide)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self.name, e) from e

    def _begin(self, call_id: str, decide: Decide) -> Decision:
        """:meth:`begin`.

        Right after this object's own write, in one round trip (a compare-and-set on the head, which
        also reads the record the decision should have been taken on, for one more try); else by
        the server-side append (one round trip, and one more when the call's record was not the one
        this object knew), or in one transaction that locks the head row first (two round trips).
        """
        doing = "record the call"
        self._check_writable(doing)
        recent = self._known.recent
        doubt: JournalEvent | None = None
        doubted: Decision | None = None
        if recent is not None and self.skip_cas <= 0:
            head, known_id, record, last_hash = recent
            check: CasCheck = ""
            if known_id != call_id:
                written = self._known.written(call_id)
                if written is not None:  # a call this object wrote before: the append checks its record
                    (record, last_hash), check = written, "written"
                else:  # decided as for a call never seen; the append checks that it is not
                    record, check = None, "absent"
            for _ in range(2):
                decision = uniquely_timed(decide(record))
                if approval_event(decision.event):
                    break  # an event of a request: appended the locked way, which folds it into the requests
                try:
                    stored, seen = self._try_append(head, record, decision.event, doing, check=check,
                                                    last_hash=last_hash)
                except InDoubt as e:
                    doubt, doubted = e.event, decision
                    break
                if stored is not None:
                    return decision
                if seen is None:
                    break
                # The head the statement found, and the record as of that head: current while the
                # head does not move again (every change of the projection moves it).
                # A call the record lets run is still checked against the log: a row deleted or
                # released by hand must not let it run.
                (head, record), check = seen, _check_of(seen[1])
        self.skip_cas = max(0, self.skip_cas - 1)
        decisions: list[Decision] = []

        def choose(record: CallRecord | None) -> EffectEvent:
            decisions[:] = [uniquely_timed(decide(record))]
            return decisions[0].event

        def choose_on_server(record: CallRecord | None) -> EffectEvent:
            event = choose(record)
            if approval_event(event):
                raise NoServerAppend()  # nothing sent: the locked way folds it into the requests
            return event

        if doubt is None and self._datastore.server_append:
            with contextlib.suppress(NoServerAppend):
                self._append_on_server(doing, choose_on_server, *self._known.record_of(call_id), check=True)
                return decisions[0]
        if self._locked_write(doing, call_id, choose, doubt) is doubt and doubted is not None:
            return doubted  # the cut-off append had committed: that is the decision recorded
        return decisions[0]

    def append(self, event: EffectEvent) -> None:
        """Append an outcome or a refusal (folded into the projection where it applies)."""
        self.append_event(event)

    def append_event(self, event: EffectEvent) -> JournalEvent:
        """:meth:`append`, returning the event as stored (with its ``seq`` and ``hash``)."""
        try:
            return self._append_event(event)
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self.name, e) from e

    def _append_event(self, event: EffectEvent) -> JournalEvent:
        doing = f"record the {event.kind} event"
        self._check_writable(doing)
        event = unique_at(event)
        if event.call_id is not None and approval_event(event):
            return self._locked_write(doing, event.call_id, lambda record: event)  # folded into the requests
        doubt: JournalEvent | None = None
        recent = self._known.recent
        if recent is not None and self.skip_cas <= 0:
            # This object wrote last: if it still did, its head and the call's record are current.
            head, call_id, record, _ = recent
            if call_id == event.call_id or event.call_id is None or event.kind in _NO_RECORD_NEEDED:
                known = call_id == event.call_id
                attempt_record = record if known else None
                for _ in range(2):
                    try:
                        stored, seen = self._try_append(head, attempt_record, event, doing, known=known)
                    except InDoubt as e:
                        doubt = e.event
                        break
                    if stored is not None:
                        return stored
                    if seen is None:
                        break
                    (head, attempt_record), known = seen, True
        self.skip_cas = max(0, self.skip_cas - 1)
        if doubt is None and self._datastore.server_append:
            check = event.call_id is not None and event.kind not in _NO_RECORD_NEEDED
            with contextlib.suppress(NoServerAppend):
                return self._append_on_server(doing, lambda record: event, *self._known.record_of(event.call_id),
                                              check)
        return self._locked_write(doing, event.call_id, lambda record: event, doubt)

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
        """In one transaction that holds the head: the call's record, the event ``choose`` makes of
        it (None: nothing is written), appended; the primitive of
        :class:`~journal.resolving.Resolver`."""

        def work(conn: Conn) -> JournalEvent | None:
            head, record = self.lock_and_read(conn, call_id)
            event = choose(record, lambda: self._owner_alive(conn, record))
            if event is None:
                return None
            return self.append_locked(conn, head, record, event)[0]

        self._known.recent = None
        return self._datastore.write(doing, work, pipeline=False)
