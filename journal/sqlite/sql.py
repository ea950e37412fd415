"""The statements of the SQLite journal's writes and reads."""

from __future__ import annotations

from ..rows import CALL_COLUMNS, CHANGING_KINDS, EVENT_COLUMNS

_EVENT_COLUMNS = ", ".join(EVENT_COLUMNS)
_CALL_COLUMNS = ", ".join(CALL_COLUMNS)

_INSERT_EVENT = f"INSERT INTO events ({_EVENT_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"

_UPSERT_CALL = (
    f"INSERT INTO calls ({_CALL_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
    "ON CONFLICT (call_id) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _CALL_COLUMNS.split(", ")[1:])
)

# An outcome (or a later attempt's pending) of a call that has a row: only what apply can change,
# so that the indexes on columns a call keeps (its key, when it was created) are left alone.
_UPDATE_CALL = ("UPDATE calls SET status = ?, attempt = ?, agent_id = ?, value = ?, error = ?, reason = ?, actor = ?, "
                "owner = ?, updated_at = ?, since = ?, last_seq = ? WHERE call_id = ?")
_SELECT_CALL = f"SELECT {_CALL_COLUMNS} FROM calls WHERE call_id = ?"

_TAKE_LEASE = ("INSERT INTO leases (call_id, holder, expires_at) VALUES (?, ?, ?) "
               "ON CONFLICT (call_id, holder) DO UPDATE SET expires_at = excluded.expires_at")

_RENEW_LEASE = "UPDATE leases SET expires_at = ? WHERE call_id = ? AND holder = ?"

_DROP_LEASE = "DELETE FROM leases WHERE call_id = ? AND holder = ?"

_LEASES_OF = "SELECT holder, expires_at FROM leases WHERE call_id = ?"

# The leases of many calls at once ({marks}: a placeholder each), so many at a time.
_LEASES_OF_CALLS = "SELECT call_id, holder, expires_at FROM leases WHERE call_id IN ({marks})"
_LEASES_A_READ = 500

_SWEEP_LEASES = ("DELETE FROM leases WHERE expires_at < ? AND call_id NOT IN "
                 "(SELECT call_id FROM calls WHERE status = 'pending')")

# The kinds of event that change a call's record.
_SELECT_HEAD = "SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1"

_SELECT_RECENT = (
    f"SELECT {_CALL_COLUMNS} FROM calls WHERE idempotency_key = ? AND created_at >= ? AND agent_id IS ? "
    "AND status != 'released' ORDER BY created_at DESC, call_id DESC LIMIT 1"
)

# The head of the log and the call's row in one round trip: the read of every write transaction.
_SELECT_HEAD_AND_CALL = (
    "SELECT (SELECT seq FROM events ORDER BY seq DESC LIMIT 1), (SELECT hash FROM events ORDER BY seq DESC LIMIT 1), "
    # Whether the log has an event of the call that changes its record, looked up only where the
    # projection says the call never ran, or was released: it is not trusted alone there (see
    # _LOGGED_EVENTS).
    f"CASE WHEN calls.status IS NULL OR calls.status = 'released' THEN "
    f"(SELECT 1 FROM events WHERE call_id = ?1 AND kind IN {CHANGING_KINDS}) END, "
    + ", ".join(f"calls.{c}" for c in _CALL_COLUMNS.split(", "))
    + " FROM (SELECT 1) LEFT JOIN calls ON calls.call_id = ?1"
)
# The events of a call, to fold when its projection row may have been edited by hand.
_LOGGED_EVENTS = f"SELECT {_EVENT_COLUMNS} FROM events WHERE call_id = ? ORDER BY seq"
