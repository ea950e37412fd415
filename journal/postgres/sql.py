"""The statements of the PostgreSQL journal: its reads, and its appends made by compare-and-set."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ..projection import FOLD_COLUMNS
from ..rows import (
    CALL_COLUMNS,
    CHANGING_KINDS,
    EVENT_COLUMNS,
)

_BATCH = 1000

_CALL_SELECT = f"SELECT {', '.join(CALL_COLUMNS)} FROM calls"

_TAKE_LEASE = ("INSERT INTO leases (call_id, holder, expires_at) "
               "VALUES (%s, %s, clock_timestamp() + make_interval(secs => %s)) "
               "ON CONFLICT (call_id, holder) DO UPDATE SET expires_at = excluded.expires_at RETURNING 1")

_RENEW_LEASE = ("UPDATE leases SET expires_at = clock_timestamp() + make_interval(secs => %s) "
                "WHERE call_id = %s AND holder = %s RETURNING 1")

_DROP_LEASE = "DELETE FROM leases WHERE call_id = %s AND holder = %s RETURNING 1"

_LOCK_LEASES = "SELECT pg_advisory_xact_lock(hashtext('airlock-journal:lease:' || %s))"

_LEASES_OF = "SELECT holder, expires_at, expires_at > clock_timestamp() FROM leases WHERE call_id = %s"

_LEASES_OF_CALLS = ("SELECT call_id, holder, expires_at, expires_at > clock_timestamp() FROM leases "
                    "WHERE call_id = ANY(%s)")

_SWEEP_LEASES = ("DELETE FROM leases WHERE expires_at < clock_timestamp() AND call_id NOT IN "
                 "(SELECT call_id FROM calls WHERE status = 'pending') RETURNING 1")

_EVENT_SELECT = f"SELECT {', '.join(EVENT_COLUMNS)} FROM events"

_INSERT_EVENT = (
    f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) VALUES ({', '.join(['%s'] * len(EVENT_COLUMNS))})"
)

_UPSERT_CALL = (
    f"INSERT INTO calls ({', '.join(CALL_COLUMNS)}) VALUES ({', '.join(['%s'] * len(CALL_COLUMNS))}) "
    "ON CONFLICT (call_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in CALL_COLUMNS if c != "call_id")
)

_LOCK_HEAD = "SELECT seq, hash, generation FROM chain_head WHERE id = 1 FOR UPDATE"

# Right after this object's own write, an append needs no read: it is made in one round trip if
# the head is still the one that write left (a compare-and-set on the head row; every change of
# the projection moves the head, so an unmoved head means an unchanged projection). A begin for
# a call id this object does not know is decided as for a call never seen, and the append also
# requires that the call has no projection row.
_TYPES = {"seq": "bigint", "attempt": "integer", "last_seq": "bigint"}

def _casts(columns: Sequence[str]) -> str:
    return ", ".join(f"%s::{_TYPES.get(c, 'text')}" for c in columns)

_CHANGING = f"kind IN {CHANGING_KINDS}"  # the kinds that move a call's record

# What a compare-and-set requires of the call, besides the head: nothing (the call this object
# wrote last, whose record an unmoved head leaves as it was); "absent", no record; "written", the
# record this object wrote earlier (see Known.written in heads.py); "released", a released record
# read by a compare-and-set that failed, which the log must bear out.
CasCheck = Literal["", "absent", "written", "released"]

def _cas_append(project: bool, check: CasCheck, relaxed: bool) -> str:
    # The head as this object left it, by its seq and its hash: after a crash of the server lost the
    # last events (those not committed synchronously), other writers can bring the head back to the
    # same seq, with other events.
    head = "UPDATE chain_head SET seq = %s, hash = %s WHERE id = 1 AND seq = %s AND hash = %s AND generation = %s"
    if check == "absent":
        # A call with no projection row whose log has no state-changing event either: a row deleted
        # by hand makes the compare-and-set fail, and the locked path folds the call's events.
        head += (" AND NOT EXISTS (SELECT 1 FROM calls WHERE call_id = %s) AND NOT EXISTS (SELECT 1 FROM events "
                 f"WHERE call_id = %s AND {_CHANGING})")
    elif check == "written":
        # The call's row still ends at the event this object wrote (by its seq and hash: a crash may
        # have lost that event and others filled its seq), and the log has no later event that
        # changed the call, whatever its row says (a row put back by hand must not hide one).
        head += (" AND EXISTS (SELECT 1 FROM calls c JOIN events e ON e.seq = c.last_seq WHERE c.call_id = %s "
                 "AND c.last_seq = %s AND e.hash = %s) AND NOT EXISTS (SELECT 1 FROM events WHERE call_id = %s "
                 f"AND seq > %s AND {_CHANGING})")
    elif check == "released":
        # A row released by hand must not let the call run: the call's last state-changing event
        # must be the release the row ends at.
        head += (" AND EXISTS (SELECT 1 FROM calls c JOIN events e ON e.seq = c.last_seq WHERE c.call_id = %s "
                 "AND c.last_seq = %s AND e.call_id = c.call_id AND e.kind = 'released') AND NOT EXISTS "
                 f"(SELECT 1 FROM events WHERE call_id = %s AND seq > %s AND {_CHANGING})")
    if relaxed:
        # The statement is its own transaction (autocommit), so SET LOCAL cannot precede it; this
        # sets the same for the transaction it runs in.
        head += " AND set_config('synchronous_commit', 'off', true) = 'off'"
    parts = [
        f"head AS ({head} RETURNING seq)",
        f"event AS (INSERT INTO events ({', '.join(EVENT_COLUMNS)}) SELECT {_casts(EVENT_COLUMNS)} FROM head)",
    ]
    if project:
        parts.append(
            f"call AS (INSERT INTO calls ({', '.join(CALL_COLUMNS)}) SELECT {_casts(CALL_COLUMNS)} FROM head "
            "ON CONFLICT (call_id) DO UPDATE SET "
            + ", ".join(f"{c} = EXCLUDED.{c}" for c in CALL_COLUMNS if c != "call_id") + ")"
        )
    # Whether it moved the head; and, for a retry when it did not, the head and the call's row as
    # the statement found them (its snapshot: the CTEs' own changes are not seen here).
    found = ", ".join(f"c.{c}" for c in CALL_COLUMNS)
    return (
        f"WITH {', '.join(parts)} SELECT (SELECT count(*) FROM head), h.seq, h.hash, h.generation, {found} "
        "FROM chain_head h LEFT JOIN calls c ON c.call_id = %s WHERE h.id = 1"
    )

_CHECKS: tuple[CasCheck, ...] = ("", "absent", "written", "released")

_CAS_APPEND = {(p, c, r): _cas_append(p, c, r)
               for p in (False, True) for c in _CHECKS for r in (False, True)}

_SET_HEAD = "UPDATE chain_head SET seq = %s, hash = %s WHERE id = 1"

# One statement appends: the event, the projection row where it changes, the head.
_APPEND = f"WITH event AS ({_INSERT_EVENT}) {_SET_HEAD}"

_APPEND_AND_PROJECT = f"WITH event AS ({_INSERT_EVENT}), call AS ({_UPSERT_CALL}) {_SET_HEAD}"

# Only pending must be durable before the tool runs; any other event may reach the disk with the
# next flush (a lost outcome leaves the call pending: a replay is then refused, never re-run).
# The WAL is written in order, so only a tail of such events can be lost: never a hole in the chain.
_RELAXED = b"SET LOCAL synchronous_commit = off"
# Whether the log has an event of a call that changes its record (see Writer.lock_and_read).
_LOGGED = (f"SELECT 1 FROM events WHERE call_id = %s AND {_CHANGING} "
           "LIMIT 1")
# The log by call id (ids in binary order, as the projection is read), each call's events together.
_BY_CALL = (f"SELECT {', '.join(FOLD_COLUMNS)} FROM events WHERE call_id IS NOT NULL AND kind IN "
            f"{CHANGING_KINDS} ORDER BY call_id COLLATE \"C\", seq")
