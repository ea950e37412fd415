"""The PostgreSQL journal's schema: its tables, the append-only trigger and the migrations.

A journal lives in one schema of a database: the first schema of the connection's
``search_path`` (``public`` by default), so several journals can share a database. Never a later
one: :func:`search_path_schemas` reads the setting as PostgreSQL does, for the journal to check
that the schema its statements reach is that first one.

- ``airlock_journal_meta``: one row naming the application and the schema version;
- ``events``: the log, one column per field of an event (JSON fields as canonical text, ``at`` as
  its exported ISO-8601 text, so every hash is recomputed from exactly the stored bytes);
- ``calls``: the projection, one row per call, written in the same transaction as its event;
- ``chain_head``: one row with the last ``seq`` and ``hash`` (and a ``generation`` that ``rebuild``
  moves); every append updates it, so its row lock makes ``seq`` gapless and the chain unbroken
  under any number of writers;
- ``approvals``: the projection of requests for approval, one row per request (see
  :mod:`journal.approvals`), and ``approvals_archived``, the requests as of an archive's head.
"""

from __future__ import annotations

import re

__all__ = [
    "APPLICATION", "MIGRATIONS", "REMOVE", "SCHEMA_VERSION", "TABLES", "USER_SCHEMA", "search_path_schemas",
    "tables_of",
]

APPLICATION = "airlock-journal"

TABLES = ("airlock_journal_meta", "events", "calls", "chain_head", "leases", "archives", "calls_archived", "approvals",
          "approvals_archived", "inbox")

# What takes a journal away again (see Opener.remove_if_empty): its tables, and the functions
# that are not dropped with them.
REMOVE = (
    f"DROP TABLE IF EXISTS {', '.join(TABLES)} CASCADE",
    "DROP FUNCTION IF EXISTS airlock_events_append_only() CASCADE",
    "DROP FUNCTION IF EXISTS airlock_archive_events(bigint, bigint, text, text, text)",
    "DROP FUNCTION IF EXISTS airlock_seal(integer, boolean)",
    "DROP FUNCTION IF EXISTS airlock_hold_log()",
    "DROP FUNCTION IF EXISTS airlock_head_of_version_6() CASCADE",
)

_V1 = (
    """
    CREATE TABLE airlock_journal_meta (
        id smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
        application text NOT NULL,
        schema_version integer NOT NULL
    )
    """,
    """
    CREATE TABLE events (
        seq bigint PRIMARY KEY CHECK (seq >= 1),
        at text NOT NULL,
        call_id text,
        kind text NOT NULL
            CHECK (kind IN ('pending', 'committed', 'unknown', 'released', 'replayed', 'refused')),
        tool text NOT NULL,
        agent_id text,
        idempotency_key text,
        arguments text,
        value text,
        error text,
        reason text,
        actor text NOT NULL,
        attempt integer NOT NULL,
        owner text,
        prev_hash text NOT NULL,
        hash text NOT NULL
    )
    """,
    "CREATE INDEX events_call_id ON events (call_id, seq)",
    "CREATE INDEX events_at ON events (at)",
    """
    CREATE TABLE calls (
        call_id text PRIMARY KEY,
        tool text NOT NULL,
        status text NOT NULL CHECK (status IN ('pending', 'committed', 'unknown', 'released')),
        attempt integer NOT NULL,
        agent_id text,
        idempotency_key text,
        arguments text,
        value text,
        error text,
        reason text,
        actor text NOT NULL,
        owner text,
        created_at text NOT NULL,
        updated_at text NOT NULL,
        since text NOT NULL,
        last_seq bigint NOT NULL
    )
    """,
    "CREATE INDEX calls_updated_at ON calls (updated_at)",
    "CREATE INDEX calls_status ON calls (status, since)",
    """
    CREATE TABLE chain_head (
        id smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
        seq bigint NOT NULL,
        hash text NOT NULL,
        generation bigint NOT NULL DEFAULT 0
    ) WITH (fillfactor = 10)
    """,
    "INSERT INTO chain_head (id, seq, hash) VALUES (1, 0, repeat('0', 64))",
    # The log is append-only: the database refuses to change or remove an event, whoever asks.
    """
    CREATE FUNCTION airlock_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'the airlock journal is append-only: % of events is refused', TG_OP
            USING ERRCODE = 'integrity_constraint_violation';
    END
    $$
    """,
    """
    CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
        FOR EACH ROW EXECUTE FUNCTION airlock_events_append_only()
    """,
    """
    CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
        FOR EACH STATEMENT EXECUTE FUNCTION airlock_events_append_only()
    """,
)

# version -> the statements that bring a journal from version - 1 to it.
_V2_LEASES = (
    # Operational state beside the log (see the SQLite schema's version 4); the times are the
    # server's, so replicas on hosts whose clocks differ agree on which lease has run out.
    """
    CREATE TABLE leases (
        call_id text NOT NULL,
        holder text NOT NULL,
        expires_at timestamptz NOT NULL,
        PRIMARY KEY (call_id, holder)
    )
    """,
)

_V3_CALLS_BY_KEY = (
    # The lookup of a duplicate window: an agent's recent calls with one idempotency key.
    "CREATE INDEX calls_idempotency_key ON calls (idempotency_key, created_at)",
)

_V4_ARCHIVES = (
    # Archiving moves the oldest events out of the log (see the SQLite schema's version 6): each
    # archive's head, and the projection as of that head, which the rest of the log is folded onto.
    """
    CREATE TABLE archives (
        last_seq bigint PRIMARY KEY,
        last_hash text NOT NULL,
        events bigint NOT NULL,
        archived_at text NOT NULL,
        file text NOT NULL
    )
    """,
    # A call's row as of the head: its id, and the other columns of calls as one JSON array.
    "CREATE TABLE calls_archived (call_id text PRIMARY KEY, record text NOT NULL)",
    # The trigger lets a DELETE through only inside airlock_archive_events, which sets the flag for
    # its own statement. Only a role with DELETE on events (the owner: the function runs as it) could
    # set the flag itself, and the owner can drop the trigger anyway.
    """
    CREATE OR REPLACE FUNCTION airlock_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'DELETE' AND current_setting('airlock.archiving', true) = 'on' THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION 'the airlock journal is append-only: % of events is refused', TG_OP
            USING ERRCODE = 'integrity_constraint_violation';
    END
    $$
    """,
    # Run as its owner (SECURITY DEFINER), so an operator needs only EXECUTE on it, never DELETE on
    # events: it removes the events up to upto_seq, never the last one, only where the log still
    # holds upto_seq with upto_hash and the last archive is the one the caller read, and records the
    # archive's head in the same transaction.
    """
    DO $do$
    BEGIN
    EXECUTE format($make$
    CREATE FUNCTION %1$I.airlock_archive_events(
        expected_base bigint, upto_seq bigint, upto_hash text, archived_at text, archive_file text
    ) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER SET search_path = %1$I, pg_temp AS $fn$
    DECLARE h_seq bigint; found_hash text; base bigint; removed bigint;
    BEGIN
        SELECT seq INTO h_seq FROM chain_head WHERE id = 1 FOR UPDATE;
        IF upto_seq >= h_seq THEN
            RAISE EXCEPTION 'the last event of the log (seq %%) stays in it', h_seq
                USING ERRCODE = 'integrity_constraint_violation';
        END IF;
        SELECT coalesce(max(last_seq), 0) INTO base FROM archives;
        IF base <> expected_base THEN
            RAISE EXCEPTION 'another archive moved the log to seq %% meanwhile', base
                USING ERRCODE = 'integrity_constraint_violation';
        END IF;
        SELECT hash INTO found_hash FROM events WHERE seq = upto_seq;
        IF found_hash IS DISTINCT FROM upto_hash THEN
            RAISE EXCEPTION 'event seq %% is not the one archived', upto_seq
                USING ERRCODE = 'integrity_constraint_violation';
        END IF;
        PERFORM set_config('airlock.archiving', 'on', true);
        DELETE FROM events WHERE seq <= upto_seq;
        GET DIAGNOSTICS removed = ROW_COUNT;
        PERFORM set_config('airlock.archiving', '', true);
        INSERT INTO archives (last_seq, last_hash, events, archived_at, file)
            VALUES (upto_seq, upto_hash, removed, archived_at, archive_file);
        RETURN removed;
    END
    $fn$
    $make$, current_schema());
    END
    $do$
    """,
    "REVOKE ALL ON FUNCTION airlock_archive_events(bigint, bigint, text, text, text) FROM PUBLIC",
)

_V5_APPROVALS = (
    # Approvals that wait for a human (guard.approvals): the log takes their five kinds of event.
    # The CHECK is made again, wider: added NOT VALID (no scan under the ACCESS EXCLUSIVE lock the
    # ALTER takes), then validated (a scan that lets reads go on).
    "ALTER TABLE events DROP CONSTRAINT IF EXISTS events_kind_check",
    "ALTER TABLE events ADD CONSTRAINT events_kind_check CHECK (kind IN ('pending', 'committed', 'unknown', "
    "'released', 'replayed', 'refused', 'approval_requested', 'approved', 'denied', 'expired', "
    "'approval_consumed')) NOT VALID",
    "ALTER TABLE events VALIDATE CONSTRAINT events_kind_check",
    # The projection of requests beside the calls (see journal.approvals): a row per request, the
    # whole request as canonical JSON text, written in the transaction of each of its events.
    """
    CREATE TABLE approvals (
        request_id text PRIMARY KEY,
        call_id text NOT NULL,
        tool text NOT NULL,
        status text NOT NULL,
        requested_at text NOT NULL,
        first_seq bigint NOT NULL,
        last_seq bigint NOT NULL,
        request text NOT NULL
    )
    """,
    "CREATE INDEX approvals_call_id ON approvals (call_id, first_seq)",
    "CREATE INDEX approvals_status ON approvals (status, first_seq)",
    "CREATE INDEX approvals_tool ON approvals (tool, first_seq)",
    "CREATE INDEX approvals_first_seq ON approvals (first_seq)",
    # The requests as of the last archive's head, which the rest of the log is folded onto.
    "CREATE TABLE approvals_archived (request_id text PRIMARY KEY, request text NOT NULL)",
)

_INBOX_FIELDS = """at text NOT NULL,
        call_id text,
        kind text NOT NULL CHECK (kind IN ('pending', 'committed', 'unknown', 'released', 'replayed', 'refused',
            'approval_requested', 'approved', 'denied', 'expired', 'approval_consumed')),
        tool text NOT NULL,
        agent_id text,
        idempotency_key text,
        arguments text,
        value text,
        error text,
        reason text,
        actor text NOT NULL,
        attempt integer NOT NULL,
        owner text"""

_V6_INBOX = (
    # Appends no longer wait on the chain head (see journal.postgres.sealing): an event is first a row
    # of the inbox, inserted under its call's lock alone, with its canonical body cut around the seq
    # it does not have yet; the sealer moves committed rows into the log in batches, each given the
    # next seq and chained to the one before. Until then the call's projection row names the inbox
    # row by a negative last_seq (-id).
    f"""
    CREATE TABLE inbox (
        id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        {_INBOX_FIELDS},
        body_head bytea NOT NULL,
        body_tail bytea NOT NULL
    )
    """,
    "CREATE INDEX inbox_call_id ON inbox (call_id, id)",
    # Run as its owner, so a login needs only EXECUTE here (granted to the guard's and the
    # operator's) to seal, never DELETE on the inbox or UPDATE of the projection's last_seq.
    # wait false: when another session seals (it holds the head's row), return -1 at once.
    """
    DO $do$
    BEGIN
    EXECUTE format($make$
    CREATE FUNCTION %1$I.airlock_seal(most integer, wait boolean) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = %1$I, pg_temp AS $fn$
    DECLARE h_seq bigint; h_hash text; n_hash text; r record; ids bigint[] := '{}';
    BEGIN
        PERFORM set_config('airlock.layout', '6', true);  -- it may move the head (see below)
        IF wait THEN
            SELECT seq, hash INTO h_seq, h_hash FROM chain_head WHERE id = 1 FOR UPDATE;
        ELSE
            SELECT seq, hash INTO h_seq, h_hash FROM chain_head WHERE id = 1 FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                RETURN -1;
            END IF;
        END IF;
        -- A statement after the head's lock: it sees every row committed before it, and none that
        -- an earlier sealer moved. A call's rows are in id order (taken under the call's lock).
        FOR r IN SELECT * FROM inbox ORDER BY id LIMIT most LOOP
            h_seq := h_seq + 1;
            n_hash := encode(sha256(convert_to(h_hash, 'UTF8') || r.body_head || convert_to(h_seq::text, 'UTF8')
                                    || r.body_tail), 'hex');
            INSERT INTO events (seq, at, call_id, kind, tool, agent_id, idempotency_key, arguments, value, error,
                                reason, actor, attempt, owner, prev_hash, hash)
                VALUES (h_seq, r.at, r.call_id, r.kind, r.tool, r.agent_id, r.idempotency_key, r.arguments, r.value,
                        r.error, r.reason, r.actor, r.attempt, r.owner, h_hash, n_hash);
            IF r.call_id IS NOT NULL THEN
                UPDATE calls SET last_seq = h_seq WHERE call_id = r.call_id AND last_seq = -r.id;
            END IF;
            h_hash := n_hash;
            ids := ids || r.id;
        END LOOP;
        IF cardinality(ids) > 0 THEN
            DELETE FROM inbox WHERE id = ANY(ids);
            UPDATE chain_head SET seq = h_seq, hash = h_hash WHERE id = 1;
        END IF;
        RETURN cardinality(ids);
    END
    $fn$
    $make$, current_schema());
    END
    $do$
    """,
    # What rebuild, archive and copy do first, in their transaction: hold the head's row, let no new
    # row into the inbox (appends wait, reads go on), and seal every row there, so the log is the
    # whole of what was committed and the projection names only sealed events. As the owner, so an
    # operator needs no grant on the inbox for it.
    """
    DO $do$
    BEGIN
    EXECUTE format($make$
    CREATE FUNCTION %1$I.airlock_hold_log() RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = %1$I, pg_temp AS $fn$
    DECLARE moved integer; total bigint := 0;
    BEGIN
        -- Reads that would seal first see this lock and read instead: this seals all there is.
        PERFORM pg_advisory_xact_lock(hashtext('airlock-journal:hold:' || current_schema()));
        PERFORM 1 FROM chain_head WHERE id = 1 FOR UPDATE;
        LOCK TABLE inbox IN EXCLUSIVE MODE;
        LOOP
            moved := airlock_seal(5000, true);
            total := total + moved;
            EXIT WHEN moved < 5000;
        END LOOP;
        RETURN total;
    END
    $fn$
    $make$, current_schema());
    END
    $do$
    """,
    "REVOKE ALL ON FUNCTION airlock_hold_log() FROM PUBLIC",
    # Whoever may seal holds the head while it does: the guard's and the operator's logins, granted
    # it (see docs/postgres.md), not every login that can read.
    "REVOKE ALL ON FUNCTION airlock_seal(integer, boolean) FROM PUBLIC",
    # A replica of an earlier version, still running, orders its appends by the head alone and would
    # not take the call's lock: it could decide a call unstarted that this version's replica just
    # began. Every one of its appends moves the head; the head now refuses a session that has not
    # said it is of version 6 (the journal's sessions and its functions do), so such a replica
    # refuses its calls store_unavailable until it is upgraded.
    """
    CREATE FUNCTION airlock_head_of_version_6() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'the airlock journal has schema version 6: a replica of an earlier version of '
            'airlock-journal may not append to it; upgrade the replica'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END
    $$
    """,
    """
    CREATE TRIGGER chain_head_of_version_6 BEFORE UPDATE ON chain_head FOR EACH ROW
        WHEN (current_setting('airlock.layout', true) IS DISTINCT FROM '6')
        EXECUTE FUNCTION airlock_head_of_version_6()
    """,
)

MIGRATIONS: dict[int, tuple[str, ...]] = {1: _V1, 2: _V2_LEASES, 3: _V3_CALLS_BY_KEY, 4: _V4_ARCHIVES,
                                          5: _V5_APPROVALS, 6: _V6_INBOX}
SCHEMA_VERSION = max(MIGRATIONS)
# A table that came with a later version than the first.
_SINCE = {"leases": 2, "archives": 4, "calls_archived": 4, "approvals": 5, "approvals_archived": 5, "inbox": 6}


def tables_of(version: int) -> tuple[str, ...]:
    """The tables a journal of schema ``version`` has."""
    return tuple(t for t in TABLES if _SINCE.get(t, 1) <= version)


USER_SCHEMA = "$user"  # a search_path entry that stands for the schema named after the login

# One entry of a search_path: a quoted name ("" for a quote in it) or an unquoted one, then a comma
# or the end. The server has checked the syntax of the setting already.
_PATH_ENTRY = re.compile(r'\s*(?:"((?:[^"]|"")*)"|([^",\s]+))\s*(?:,|$)')
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_NAME_BYTES = 63  # PostgreSQL cuts a longer identifier to this many bytes


def search_path_schemas(search_path: str) -> list[str]:
    """The schema names of a ``search_path`` setting, in order, read as PostgreSQL reads them: an
    unquoted name folded to lower case (ASCII letters only), a quoted one as written, each cut to
    63 bytes; ``$user``, quoted or not, stays :data:`USER_SCHEMA`."""
    names: list[str] = []
    at = 0
    while at < len(search_path) and (found := _PATH_ENTRY.match(search_path, at)) and found.end() > at:
        quoted, bare = found.groups()
        name = quoted.replace('""', '"') if quoted is not None else bare.translate(_ASCII_LOWER)
        names.append(name.encode()[:_NAME_BYTES].decode(errors="ignore"))
        at = found.end()
    return names
