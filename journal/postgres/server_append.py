"""The server-side append: a temporary function each session makes, appending under the head's lock.
in one round trip.
"""

from __future__ import annotations

from ..rows import (
    CALL_COLUMNS,
    CHANGING_KINDS,
    EVENT_COLUMNS,
)
from .sql import _TYPES, _casts

_CALL_FIELDS = [c for c in CALL_COLUMNS if c not in ("call_id", "last_seq")]

_EVENT_FIELDS = [c for c in EVENT_COLUMNS if c not in ("seq", "prev_hash", "hash")]

# Where other replicas write too (and for an object's first write), an append is one call of this
# function: the server takes the chain head's lock, looks at the call's record and appends, the
# event's seq and hash computed there from the canonical body the client sends cut around its seq.
# So the lock is held for as long as the server needs, not across a round trip to the client and
# its decision. It is a temporary function, made on each of the journal's sessions in the session's
# own pg_temp schema (which only schema-qualified calls reach): every journal, whatever its schema
# version, has it, and a login needs no right beyond the default one to make temporary objects.
#
# Its outcome is 'appended'; or 'found' when the same event (every field alike but its place in the
# chain, the owner naming the calling process, after after_seq) is there already: a call made again
# after its connection was cut appends once, and a first call still running on the server then
# finds the second's event. Or 'changed', when the call's record is not the one the event was made
# from (its last_seq is not expected_last_seq, NULL for no record; or a rebuild moved the head's
# generation): nothing was written, and the row holds the call's current record to decide again on.
# Or 'log', when the call's record would let it run (none, or released) and the log has
# state-changing events of it: nothing was written, and the client decides the locked way.
_SAME_EVENT = " AND ".join(f"e.{c} IS NOT DISTINCT FROM e_{c}" for c in _EVENT_FIELDS if c != "call_id")

_NO_ROW = ", ".join(f"NULL::{_TYPES.get(c, 'text')}" for c in CALL_COLUMNS)

_APPEND_FN = f"""
CREATE OR REPLACE FUNCTION pg_temp.airlock_append(
    after_seq bigint, check_record boolean, expected_last_seq bigint, expected_last_hash text,
    expected_head_hash text, expected_generation bigint, relaxed boolean, body_head bytea, body_tail bytea,
    {", ".join(f"e_{c} {_TYPES.get(c, 'text')}" for c in _EVENT_FIELDS)},
    project boolean,
    {", ".join(f"c_{c} {_TYPES.get(c, 'text')}" for c in _CALL_FIELDS)}
) RETURNS TABLE (outcome text, new_seq bigint, new_prev_hash text, new_hash text, head_generation bigint,
                 {", ".join(f"r_{c} {_TYPES.get(c, 'text')}" for c in CALL_COLUMNS)}, r_last_hash text)
LANGUAGE plpgsql AS $fn$
DECLARE
    h_seq bigint; h_hash text; h_gen bigint; f_seq bigint; f_prev text; f_hash text; current_last bigint;
    current_hash text; current_status text; n_seq bigint; n_hash text;
BEGIN
    SELECT h.seq, h.hash, h.generation INTO h_seq, h_hash, h_gen FROM chain_head h WHERE h.id = 1 FOR UPDATE;
    -- Each statement from here on sees every append committed before the lock was taken.
    IF after_seq > h_seq THEN  -- the server lost events the client saw (a crash): it must look again
        RETURN QUERY SELECT 'behind'::text, h_seq, NULL::text, h_hash, h_gen, {_NO_ROW}, NULL::text;
        RETURN;
    END IF;
    IF e_call_id IS NULL THEN
        SELECT e.seq, e.prev_hash, e.hash INTO f_seq, f_prev, f_hash FROM events e
        WHERE e.call_id IS NULL AND e.seq > after_seq AND {_SAME_EVENT} LIMIT 1;
    ELSE
        SELECT e.seq, e.prev_hash, e.hash INTO f_seq, f_prev, f_hash FROM events e
        WHERE e.call_id = e_call_id AND e.seq > after_seq AND {_SAME_EVENT} LIMIT 1;
    END IF;
    IF f_seq IS NOT NULL THEN
        RETURN QUERY SELECT 'found'::text, f_seq, f_prev, f_hash, h_gen, {_NO_ROW}, NULL::text;
        RETURN;
    END IF;
    IF check_record THEN
        -- The record is the one expected when its last event is: by seq and by hash (a crash may
        -- have lost an event whose seq others have filled since), or, where its hash is not
        -- known, when the whole head is the one the client left.
        SELECT c.last_seq, e.hash, c.status INTO current_last, current_hash, current_status
            FROM calls c LEFT JOIN events e ON e.seq = c.last_seq WHERE c.call_id = e_call_id;
        -- A record that lets the call run (none, or released) is checked against the log: a call
        -- with state-changing events is decided the locked way, which folds them, unless the record
        -- is released by the call's last such event (a row released by hand is not).
        IF (current_last IS NULL AND EXISTS (
                SELECT 1 FROM events e WHERE e.call_id = e_call_id
                AND e.kind IN {CHANGING_KINDS}))
           OR (current_status = 'released' AND (NOT EXISTS (
                SELECT 1 FROM events e WHERE e.seq = current_last AND e.call_id = e_call_id
                AND e.kind = 'released') OR EXISTS (
                SELECT 1 FROM events e WHERE e.call_id = e_call_id AND e.seq > current_last
                AND e.kind IN {CHANGING_KINDS}))) THEN
            RETURN QUERY SELECT 'log'::text, h_seq, NULL::text, h_hash, h_gen, {_NO_ROW}, NULL::text;
            RETURN;
        END IF;
        IF current_last IS DISTINCT FROM expected_last_seq
           OR (expected_generation IS NOT NULL AND h_gen <> expected_generation)
           OR (current_last IS NOT NULL AND CASE WHEN expected_last_hash IS NOT NULL
                                                 THEN current_hash IS DISTINCT FROM expected_last_hash
                                                 ELSE h_hash IS DISTINCT FROM expected_head_hash END) THEN
            RETURN QUERY SELECT 'changed'::text, h_seq, NULL::text, h_hash, h_gen,
                {", ".join(f"c.{c}" for c in CALL_COLUMNS)}, le.hash
                FROM (SELECT 1) AS one LEFT JOIN calls c ON c.call_id = e_call_id
                LEFT JOIN events le ON le.seq = c.last_seq;
            RETURN;
        END IF;
    END IF;
    n_seq := h_seq + 1;
    n_hash := encode(sha256(convert_to(h_hash, 'UTF8') || body_head || convert_to(n_seq::text, 'UTF8')
                            || body_tail), 'hex');
    INSERT INTO events ({", ".join(EVENT_COLUMNS)})
        VALUES (n_seq, {", ".join(f"e_{c}" for c in _EVENT_FIELDS)}, h_hash, n_hash);
    IF project THEN
        INSERT INTO calls ({", ".join(CALL_COLUMNS)})
            VALUES (e_call_id, {", ".join(f"c_{c}" for c in _CALL_FIELDS)}, n_seq)
            ON CONFLICT (call_id) DO UPDATE SET
            {", ".join(f"{c} = EXCLUDED.{c}" for c in CALL_COLUMNS if c != "call_id")};
    END IF;
    UPDATE chain_head SET seq = n_seq, hash = n_hash WHERE id = 1;
    IF relaxed THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN QUERY SELECT 'appended'::text, n_seq, h_hash, n_hash, h_gen, {_NO_ROW}, NULL::text;
END
$fn$
"""

_CALL_APPEND_FN = (
    "SELECT * FROM pg_temp.airlock_append(%s::bigint, %s::boolean, %s::bigint, %s::text, %s::text, %s::bigint, "
    "%s::boolean, "
    f"%s::bytea, %s::bytea, {_casts(_EVENT_FIELDS)}, %s::boolean, {_casts(_CALL_FIELDS)})"
)
