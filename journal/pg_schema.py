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
  under any number of writers.
"""

from __future__ import annotations

import re

__all__ = ["APPLICATION", "MIGRATIONS", "SCHEMA_VERSION", "TABLES", "USER_SCHEMA", "search_path_schemas"]

APPLICATION = "airlock-journal"

TABLES = ("airlock_journal_meta", "events", "calls", "chain_head")

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
MIGRATIONS: dict[int, tuple[str, ...]] = {1: _V1}
SCHEMA_VERSION = max(MIGRATIONS)


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
