"""The server-side append: a temporary function each session makes, appending under its call's lock
in one round trip."""

from __future__ import annotations

from ..rows import (
    CALL_COLUMNS,
    CHANGING_KINDS,
    EVENT_COLUMNS,
)
from .sealing import SEAL_BATCH
from .sql import _TYPES, _casts

_CALL_FIELDS = [c for c in CALL_COLUMNS if c not in ("call_id", "last_seq")]

_EVENT_FIELDS = [c for c in EVENT_COLUMNS if c not in ("seq", "prev_hash", "hash")]

# Every append of the guard is one call of this function: the server takes the call's lock (never
# a lock every append waits on), looks at the call's record and appends; the event's seq and hash,
# where it is sealed at once, are computed there from the canonical body the client sends cut around
# its seq. So the lock is held for as long as the server needs, not across a round trip to the
# client and its decision. It is a temporary function, made on each of the journal's sessions in the
# session's own pg_temp schema (which only schema-qualified calls reach): a login needs no right
# beyond the default one to make temporary objects.
#
# seal_mode says where the event goes: 0, into the inbox (see journal.postgres.sealing); 1, into the
# log at once when no other session is sealing (it then seals what the inbox holds first), else into
# the inbox; 2, into the log at once, waiting for a seal under way. Its seq is then the one it was
# given in the log, or minus its inbox id.
#
# Its outcome is 'appended'; or 'found' when the same event (every field alike but its place, the
# owner naming the calling process, after after_seq in the log or in the inbox) is there already: a
# call made again after its connection was cut appends once, and a first call still running on the
# server then finds the second's event. Or 'changed', when the call's record is not the one the
# event was made from (its last event is not the one of expected_last_seq and expected_updated_at,
# NULL for no record, or a rebuild moved the head's generation since expected_generation, the one it
# was read at): nothing was written, and the row holds the call's current record to decide
# again on. Or 'log', when the call's record would let it run (none, or released) and the log has
# state-changing events of it: nothing was written, and the client decides the locked way. Or
# 'behind', when the log ends before after_seq (the server lost events the client saw).
_SAME_EVENT = " AND ".join(f"e.{c} IS NOT DISTINCT FROM e_{c}" for c in _EVENT_FIELDS if c != "call_id")

_NO_ROW = ", ".join(f"NULL::{_TYPES.get(c, 'text')}" for c in CALL_COLUMNS)

# The call's record lets it run, but its log says otherwise: no row while the log (sealed or not)
# has an event that changes it; or a row released by hand, not by the call's last such event. Each
# case its own statement, so that a fresh call's check costs two index probes.
_LOG_DISAGREES = f"""
        IF current_last IS NULL THEN
            disagrees := EXISTS (SELECT 1 FROM events e WHERE e.call_id = e_call_id AND e.kind IN {CHANGING_KINDS})
                OR EXISTS (SELECT 1 FROM inbox e WHERE e.call_id = e_call_id AND e.kind IN {CHANGING_KINDS});
        ELSIF current_status = 'released' AND current_last > 0 THEN
            disagrees := NOT EXISTS (SELECT 1 FROM events e WHERE e.seq = current_last AND e.call_id = e_call_id
                                     AND e.kind = 'released')
                OR EXISTS (SELECT 1 FROM events e WHERE e.call_id = e_call_id AND e.seq > current_last
                           AND e.kind IN {CHANGING_KINDS})
                OR EXISTS (SELECT 1 FROM inbox e WHERE e.call_id = e_call_id AND e.kind IN {CHANGING_KINDS});
        ELSIF current_status = 'released' THEN
            disagrees := NOT EXISTS (SELECT 1 FROM inbox e WHERE e.id = -current_last AND e.call_id = e_call_id
                                     AND e.kind = 'released')
                OR EXISTS (SELECT 1 FROM inbox e WHERE e.call_id = e_call_id AND e.id > -current_last
                           AND e.kind IN {CHANGING_KINDS});
        END IF;"""

_APPEND_FN = f"""
CREATE OR REPLACE FUNCTION pg_temp.airlock_append(
    after_seq bigint, check_record boolean, expected_last_seq bigint, expected_updated_at text,
    expected_generation bigint, relaxed boolean, seal_mode integer, body_head bytea, body_tail bytea,
    {", ".join(f"e_{c} {_TYPES.get(c, 'text')}" for c in _EVENT_FIELDS)},
    project boolean,
    {", ".join(f"c_{c} {_TYPES.get(c, 'text')}" for c in _CALL_FIELDS)}
) RETURNS TABLE (outcome text, new_seq bigint, new_prev_hash text, new_hash text, head_generation bigint,
                 {", ".join(f"r_{c} {_TYPES.get(c, 'text')}" for c in CALL_COLUMNS)})
LANGUAGE plpgsql AS $fn$
DECLARE
    h_seq bigint; h_hash text; f_seq bigint; f_prev text; f_hash text; current_last bigint;
    current_at text; current_status text; n_seq bigint; n_hash text; n_id bigint; sealed boolean := false;
    moved integer; disagrees boolean := false; h_gen bigint;
BEGIN
    -- An event of no call takes a lock of its own: sent again after its connection was cut, it
    -- must find the first if that one committed.
    PERFORM pg_advisory_xact_lock(hashtext(current_schema()), coalesce(hashtext(e_call_id), 0));
    -- Each statement from here on sees every append of the call committed before the lock was taken.
    -- The head's row, where the event may go into the log at once: its seq and hash are those of
    -- the last event sealed, and stay so until this transaction ends.
    IF seal_mode = 2 THEN
        SELECT h.seq, h.hash, h.generation INTO h_seq, h_hash, h_gen FROM chain_head h WHERE h.id = 1 FOR UPDATE;
        sealed := true;
    ELSIF seal_mode = 1 THEN
        SELECT h.seq, h.hash, h.generation INTO h_seq, h_hash, h_gen FROM chain_head h WHERE h.id = 1
            FOR UPDATE SKIP LOCKED;
        sealed := FOUND;
    END IF;
    IF NOT sealed THEN
        SELECT h.seq, h.generation INTO h_seq, h_gen FROM chain_head h WHERE h.id = 1;
    END IF;
    IF after_seq > h_seq THEN
        RETURN QUERY SELECT 'behind'::text, h_seq, NULL::text, NULL::text, h_gen, {_NO_ROW};
        RETURN;
    END IF;
    -- The inbox first: a row sealed meanwhile is in the log when the log is looked at.
    IF e_call_id IS NULL THEN
        SELECT -e.id INTO f_seq FROM inbox e WHERE e.call_id IS NULL AND {_SAME_EVENT} LIMIT 1;
    ELSE
        SELECT -e.id INTO f_seq FROM inbox e WHERE e.call_id = e_call_id AND {_SAME_EVENT} LIMIT 1;
    END IF;
    IF f_seq IS NULL THEN
        IF e_call_id IS NULL THEN
            SELECT e.seq, e.prev_hash, e.hash INTO f_seq, f_prev, f_hash FROM events e
            WHERE e.call_id IS NULL AND e.seq > after_seq AND {_SAME_EVENT} LIMIT 1;
        ELSE
            SELECT e.seq, e.prev_hash, e.hash INTO f_seq, f_prev, f_hash FROM events e
            WHERE e.call_id = e_call_id AND e.seq > after_seq AND {_SAME_EVENT} LIMIT 1;
        END IF;
    END IF;
    IF f_seq IS NOT NULL THEN
        RETURN QUERY SELECT 'found'::text, f_seq, f_prev, f_hash, h_gen, {_NO_ROW};
        RETURN;
    END IF;
    IF check_record THEN
        SELECT c.last_seq, c.updated_at, c.status INTO current_last, current_at, current_status
            FROM calls c WHERE c.call_id = e_call_id;
{_LOG_DISAGREES}
        IF disagrees THEN
            RETURN QUERY SELECT 'log'::text, h_seq, NULL::text, NULL::text, h_gen, {_NO_ROW};
            RETURN;
        END IF;
        -- The record is the one expected when its last event is: the same time (no two events of
        -- a call alike in it), at the same place, or sealed since (an inbox row given its seq).
        -- A rebuild (which moves the head's generation) may have made it another since it was read.
        IF current_last IS DISTINCT FROM expected_last_seq
           AND NOT (expected_last_seq < 0 AND current_last > 0) OR current_at IS DISTINCT FROM expected_updated_at
           OR (expected_generation IS NOT NULL AND h_gen IS DISTINCT FROM expected_generation) THEN
            RETURN QUERY SELECT 'changed'::text, h_seq, NULL::text, NULL::text, h_gen,
                {", ".join(f"c.{c}" for c in CALL_COLUMNS)}
                FROM (SELECT 1) AS one LEFT JOIN calls c ON c.call_id = e_call_id;
            RETURN;
        END IF;
    END IF;
    -- What the inbox holds is sealed first (a statement after the head's lock: it sees every row
    -- committed before it); an empty inbox, the common case, costs no call of the sealer.
    IF sealed AND EXISTS (SELECT 1 FROM inbox) THEN
        LOOP
            moved := airlock_seal({SEAL_BATCH}, true);  -- the head is this transaction's: no wait
            EXIT WHEN moved < {SEAL_BATCH} OR seal_mode = 1;
        END LOOP;
        -- A longer inbox may hold the call's own earlier events: this one then goes after them.
        sealed := moved < {SEAL_BATCH};
        SELECT h.seq, h.hash INTO h_seq, h_hash FROM chain_head h WHERE h.id = 1;
    END IF;
    IF sealed THEN  -- this transaction holds the head's row, and the inbox it sees is empty
        n_seq := h_seq + 1;
        n_hash := encode(sha256(convert_to(h_hash, 'UTF8') || body_head || convert_to(n_seq::text, 'UTF8')
                                || body_tail), 'hex');
        INSERT INTO events ({", ".join(EVENT_COLUMNS)})
            VALUES (n_seq, {", ".join(f"e_{c}" for c in _EVENT_FIELDS)}, h_hash, n_hash);
        UPDATE chain_head SET seq = n_seq, hash = n_hash WHERE id = 1;
    ELSE
        INSERT INTO inbox ({", ".join(_EVENT_FIELDS)}, body_head, body_tail)
            VALUES ({", ".join(f"e_{c}" for c in _EVENT_FIELDS)}, body_head, body_tail) RETURNING id INTO n_id;
        n_seq := -n_id;
        -- The insert waited for a rebuild, archive or copy holding the log: one that rebuilt the
        -- projection since the record was read undoes the decision (the client decides again).
        IF (SELECT h.generation FROM chain_head h WHERE h.id = 1) IS DISTINCT FROM h_gen THEN
            RAISE EXCEPTION 'the projection was rebuilt while the append waited'
                USING ERRCODE = 'serialization_failure';
        END IF;
    END IF;
    IF project THEN
        INSERT INTO calls ({", ".join(CALL_COLUMNS)})
            VALUES (e_call_id, {", ".join(f"c_{c}" for c in _CALL_FIELDS)}, n_seq)
            ON CONFLICT (call_id) DO UPDATE SET
            {", ".join(f"{c} = EXCLUDED.{c}" for c in CALL_COLUMNS if c != "call_id")};
    END IF;
    IF relaxed THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN QUERY SELECT 'appended'::text, n_seq, h_hash, n_hash, h_gen, {_NO_ROW};
END
$fn$
"""

_CALL_APPEND_FN = (
    "SELECT * FROM pg_temp.airlock_append(%s::bigint, %s::boolean, %s::bigint, %s::text, %s::bigint, %s::boolean, "
    "%s::integer, "
    f"%s::bytea, %s::bytea, {_casts(_EVENT_FIELDS)}, %s::boolean, {_casts(_CALL_FIELDS)})"
)
