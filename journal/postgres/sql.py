"""The statements of the PostgreSQL journal: its reads, and its appends from the client."""

from __future__ import annotations

from collections.abc import Sequence

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

_TYPES = {"seq": "bigint", "attempt": "integer", "last_seq": "bigint"}


def _casts(columns: Sequence[str]) -> str:
    return ", ".join(f"%s::{_TYPES.get(c, 'text')}" for c in columns)


_CHANGING = f"kind IN {CHANGING_KINDS}"  # the kinds that move a call's record

# A call's lock: every write of the call takes it first (the server-side append too), never a lock
# that writes of other calls wait on. Keyed by the journal's schema and the call's id; the events of
# no call share one, as in the server-side append (a NULL key would take no lock at all).
_LOCK_CALL = "SELECT pg_advisory_xact_lock(hashtext(current_schema()), coalesce(hashtext(%s), 0))"

# The call's events, those in the log and after them those still in the inbox, in one statement (a
# seal may move them meanwhile), as rows of the log's columns (an inbox row's seq is minus its id,
# its hashes empty).
_EVENTS_OF_CALL = (f"SELECT {', '.join(EVENT_COLUMNS)} FROM ("
                   f"SELECT {', '.join(EVENT_COLUMNS)}, 0 AS part, seq AS place FROM events WHERE call_id = %s "
                   "UNION ALL SELECT -id, at, call_id, kind, tool, agent_id, idempotency_key, arguments, value, "
                   "error, reason, actor, attempt, owner, '', '', 1, id FROM inbox WHERE call_id = %s"
                   ") AS logged ORDER BY part, place")

_SET_HEAD = "UPDATE chain_head SET seq = %s, hash = %s WHERE id = 1"

# One statement appends: the event, the projection row where it changes, the head.
_APPEND = f"WITH event AS ({_INSERT_EVENT}) {_SET_HEAD}"

_APPEND_AND_PROJECT = f"WITH event AS ({_INSERT_EVENT}), call AS ({_UPSERT_CALL}) {_SET_HEAD}"

# Only pending must be durable before the tool runs; any other event may reach the disk with the
# next flush (a lost outcome leaves the call pending: a replay is then refused, never re-run).
# The WAL is written in order, so only a tail of such events can be lost: never a hole in the chain.
_RELAXED = b"SET LOCAL synchronous_commit = off"
# Whether the log has an event of a call that changes its record (see Writer.lock_and_read).
_LOGGED = (f"SELECT 1 FROM events WHERE call_id = %s AND {_CHANGING} UNION ALL "
           f"SELECT 1 FROM inbox WHERE call_id = %s AND {_CHANGING} LIMIT 1")
# The log by call id (ids in binary order, as the projection is read), each call's events together.
_BY_CALL = (f"SELECT {', '.join(FOLD_COLUMNS)} FROM events WHERE call_id IS NOT NULL AND kind IN "
            f"{CHANGING_KINDS} ORDER BY call_id COLLATE \"C\", seq")

# The same with the inbox's events after the log's, each call's in the order they were written
# (seq minus the inbox id): what the projection holds while some of its events wait to be sealed.
_INBOX_FOLD = ", ".join("-id AS seq" if c == "seq" else c for c in FOLD_COLUMNS)
_BY_CALL_WITH_INBOX = (
    f"SELECT {', '.join(FOLD_COLUMNS)} FROM ("
    f"SELECT {', '.join(FOLD_COLUMNS)}, 0 AS part, seq AS place FROM events WHERE call_id IS NOT NULL "
    f"AND kind IN {CHANGING_KINDS} UNION ALL "
    f"SELECT {_INBOX_FOLD}, 1 AS part, id AS place FROM inbox WHERE call_id IS NOT NULL AND kind IN {CHANGING_KINDS}"
    ') AS logged ORDER BY call_id COLLATE "C", part, place'
)
