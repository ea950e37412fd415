"""Two ways past PostgreSQL's one chain head, measured against it on one server: partitioned chains and a sequencer.

Every append of the PostgreSQL journal moves the one row of ``chain_head``, so appends are serialised on that
row's lock. This script prototypes two other designs in plain SQL, each in a schema of its own on the same
server, and times them against today's single head:

- **single head** (today, in SQL): the journal's server-side append (journal/postgres/server_append.py)
  reduced to a fresh call's path: lock the head, look for the same event, check the call's record (and, for a
  call with none, that the log has no state-changing event of it), insert the event at the next ``seq`` with
  its hash computed there, upsert the projection row, move the head; the outcome committed without waiting for
  the flush. Also **the journal itself**: ``PostgresJournal`` under airlock's guard, for calibration.
- **chains N** (N = 8, 16, 32): the same statement against N heads; a call's events all go to one chain,
  chosen by a hash of its call id, and an append locks only that chain's head. Each chain has its own
  gapless ``seq`` from 1 and its own hash links. The at-most-once decision is unchanged: the call's
  projection row, read under its chain's lock.
- **sequencer**: an append is a plain INSERT of the event (with ``pg_current_xact_id()``) and the projection
  update, in one transaction (the row's primary key and a compare-and-set on its last event make the
  per-call decision); ``pending`` committed synchronously as today. A sequencer process chains events in
  batches: it takes the events whose transaction id is below ``pg_snapshot_xmin(pg_current_snapshot())``
  (every transaction below it has ended, so no event below it can still appear), orders them by (xid, id)
  after the last one it chained, and inserts their global ``seq``, ``prev_hash`` and ``hash`` into a table of
  its own, with its cursor, in one transaction committed synchronously.

A guarded call is a fresh call: a ``begin`` (``pending`` and the projection row, after the per-call
decision) and an ``append`` of ``committed``, one round trip each. Prints, in one run: raw autocommit INSERT
transactions/s and guarded calls/s of every design for each process count, with their ratio to raw and to
the single head; one process's fresh-call latency (median, p99); the sequencer's sealing delay (from the
event's insert, just before its commit, to the commit of the batch that chained it); a crash check that
SIGKILLs the sequencer in the middle of batches under load; and a check of every design's log (each chain
gapless and re-hashed with journal.chain's rule, each event chained once, each call one pending and one
committed).

Without ``--dsn`` it starts a throwaway cluster (tests/pgserver.py, default settings) and removes it after.

    python benchmarks/pg_chain_designs.py [--dsn URL] [--seconds S] [--procs 8,16,32] [--chains 8,16,32]
        [--calls N] [--kills K]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal.chain import GENESIS, body_bytes, compute_hash, event_body
from journal.events import at_text, text_sha256
from journal.postgres import PostgresJournal
from journal.rows import CHANGING_KINDS

sys.path.insert(0, str(Path(__file__).resolve().parent))

import postgres_bench  # the raw INSERTs: the floor it measures, and the same with a head row locked

_TOOL, _AGENT, _KEY, _ACTOR = "charge", "agent-1", "k" * 64, "guard"
_ARGUMENTS = '{"account":"acct-1","cents":500}'
_VALUE = '{"cents":500,"charge_id":"ch_1"}'
_WARMUP = 20  # calls each process makes before the timed window: connections, plans, caches
_SEAL_LOCK = 7_291_004  # the advisory lock one sequencer at a time holds while it chains a batch
_SEQ_MARK = b',"seq":0,"tool":'  # sorted, a body's seq comes after every nested object

_CALLS_DDL = """
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
    {last} bigint NOT NULL
);
CREATE INDEX calls_updated_at ON calls (updated_at);
CREATE INDEX calls_status ON calls (status, since);
CREATE INDEX calls_idempotency_key ON calls (idempotency_key, created_at);
"""

_EVENT_FIELDS_DDL = """
    at text NOT NULL,
    call_id text,
    kind text NOT NULL CHECK (kind IN ('pending', 'committed', 'unknown', 'released', 'replayed', 'refused')),
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

_APPEND_ONLY = """
CREATE FUNCTION refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'append-only: % of % is refused', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'integrity_constraint_violation';
END
$$;
"""

_EVENT_PARAMS = ("e_at text, e_call_id text, e_kind text, e_tool text, e_agent_id text, e_key text, "
                 "e_arguments text, e_value text, e_actor text, e_attempt integer, e_owner text")
_EVENT_VALUES = ("e_at, e_call_id, e_kind, e_tool, e_agent_id, e_key, e_arguments, e_value, NULL, NULL, e_actor, "
                 "e_attempt, e_owner")
_EVENT_CASTS = "%s::text, %s::text, %s::text, %s::text, %s::text, %s::text, %s::text, %s::text, %s::text, " \
               "%s::integer, %s::text"
# The same event already in the log (an append made again after its connection was cut): the lookup
# the journal's server-side append makes before it decides.
_SAME_EVENT = ("SELECT 1 FROM events e WHERE e.call_id = e_call_id AND e.kind = e_kind AND e.at = e_at "
               "AND e.attempt = e_attempt AND e.owner IS NOT DISTINCT FROM e_owner")

# -- (a) N chains; N = 1 is today's single head ----------------------------------------------------------


def chains_schema(chains: int) -> str:
    """The tables and the append function of ``chains`` heads."""
    return f"""
CREATE TABLE events (
    chain integer NOT NULL,
    seq bigint NOT NULL CHECK (seq >= 1),{_EVENT_FIELDS_DDL},
    prev_hash text NOT NULL,
    hash text NOT NULL,
    PRIMARY KEY (chain, seq)
);
CREATE INDEX events_call_id ON events (call_id, seq);
CREATE INDEX events_at ON events (at);
{_CALLS_DDL.format(last="last_seq")}
CREATE TABLE chain_heads (
    chain integer PRIMARY KEY,
    seq bigint NOT NULL,
    hash text NOT NULL
) WITH (fillfactor = 10);
INSERT INTO chain_heads SELECT c, 0, '{GENESIS}' FROM generate_series(0, {chains - 1}) c;
{_APPEND_ONLY}
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION refuse_change();
CREATE FUNCTION append_event(
    p_chain integer, p_absent boolean, p_last_seq bigint, p_last_hash text, p_relaxed boolean,
    body_head bytea, body_tail bytea, {_EVENT_PARAMS}
) RETURNS TABLE (outcome text, new_seq bigint, new_hash text) LANGUAGE plpgsql AS $fn$
DECLARE h_seq bigint; h_hash text; cur_last bigint; cur_hash text; n_seq bigint; n_hash text;
BEGIN
    SELECT h.seq, h.hash INTO h_seq, h_hash FROM chain_heads h WHERE h.chain = p_chain FOR UPDATE;
    IF EXISTS ({_SAME_EVENT}) THEN
        RETURN QUERY SELECT 'found'::text, NULL::bigint, NULL::text;
        RETURN;
    END IF;
    SELECT c.last_seq, e.hash INTO cur_last, cur_hash FROM calls c
        LEFT JOIN events e ON e.chain = p_chain AND e.seq = c.last_seq WHERE c.call_id = e_call_id;
    IF p_absent THEN
        IF cur_last IS NOT NULL OR EXISTS (
                SELECT 1 FROM events e WHERE e.call_id = e_call_id AND e.kind IN {CHANGING_KINDS}) THEN
            RETURN QUERY SELECT 'changed'::text, cur_last, cur_hash;
            RETURN;
        END IF;
    ELSIF cur_last IS DISTINCT FROM p_last_seq OR cur_hash IS DISTINCT FROM p_last_hash THEN
        RETURN QUERY SELECT 'changed'::text, cur_last, cur_hash;
        RETURN;
    END IF;
    n_seq := h_seq + 1;
    n_hash := encode(sha256(convert_to(h_hash, 'UTF8') || body_head || convert_to(n_seq::text, 'UTF8')
                            || body_tail), 'hex');
    INSERT INTO events VALUES (p_chain, n_seq, {_EVENT_VALUES}, h_hash, n_hash);
    INSERT INTO calls VALUES (e_call_id, e_tool, e_kind, e_attempt, e_agent_id, e_key, e_arguments, e_value,
                              NULL, NULL, e_actor, e_owner, e_at, e_at, e_at, n_seq)
        ON CONFLICT (call_id) DO UPDATE SET status = EXCLUDED.status, attempt = EXCLUDED.attempt,
            value = EXCLUDED.value, owner = EXCLUDED.owner, updated_at = EXCLUDED.updated_at,
            since = EXCLUDED.since, last_seq = EXCLUDED.last_seq;
    UPDATE chain_heads SET seq = n_seq, hash = n_hash WHERE chain = p_chain;
    IF p_relaxed THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN QUERY SELECT 'appended'::text, n_seq, n_hash;
END
$fn$;
"""


_CHAINS_APPEND = ("SELECT * FROM append_event(%s::integer, %s::boolean, %s::bigint, %s::text, %s::boolean, "
                  f"%s::bytea, %s::bytea, {_EVENT_CASTS})")

# -- (b) a sequencer -----------------------------------------------------------------------------------

_SEQUENCER_SCHEMA = f"""
CREATE TABLE events (
    id bigserial PRIMARY KEY,
    xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    staged_at timestamptz NOT NULL DEFAULT clock_timestamp(),{_EVENT_FIELDS_DDL}
);
CREATE INDEX events_xid ON events (xid, id);
CREATE INDEX events_call_id ON events (call_id, id);
CREATE INDEX events_at ON events (at);
{_CALLS_DDL.format(last="last_event")}
CREATE TABLE chain (
    seq bigint PRIMARY KEY CHECK (seq >= 1),
    event_id bigint NOT NULL UNIQUE,
    prev_hash text NOT NULL,
    hash text NOT NULL,
    sealed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE seal_head (
    id smallint PRIMARY KEY CHECK (id = 1),
    seq bigint NOT NULL,
    hash text NOT NULL,
    last_xid xid8 NOT NULL,
    last_id bigint NOT NULL
);
INSERT INTO seal_head VALUES (1, 0, '{GENESIS}', '0', 0);
{_APPEND_ONLY}
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION refuse_change();
CREATE TRIGGER chain_append_only BEFORE UPDATE OR DELETE ON chain
    FOR EACH ROW EXECUTE FUNCTION refuse_change();
CREATE FUNCTION append_event(
    p_absent boolean, p_last_event bigint, p_relaxed boolean, {_EVENT_PARAMS}
) RETURNS TABLE (outcome text, new_id bigint) LANGUAGE plpgsql AS $fn$
DECLARE n_id bigint;
BEGIN
    IF EXISTS ({_SAME_EVENT}) THEN
        RETURN QUERY SELECT 'found'::text, NULL::bigint;
        RETURN;
    END IF;
    n_id := nextval('events_id_seq');
    -- The call's projection row is the decision, and its lock orders the call's appends: a second
    -- begin of the id waits on the key until the first commits, then finds the row.
    IF p_absent THEN
        IF EXISTS (SELECT 1 FROM events e WHERE e.call_id = e_call_id AND e.kind IN {CHANGING_KINDS}) THEN
            RETURN QUERY SELECT 'changed'::text, NULL::bigint;
            RETURN;
        END IF;
        INSERT INTO calls VALUES (e_call_id, e_tool, e_kind, e_attempt, e_agent_id, e_key, e_arguments, e_value,
                                  NULL, NULL, e_actor, e_owner, e_at, e_at, e_at, n_id)
            ON CONFLICT (call_id) DO NOTHING;
    ELSE
        UPDATE calls SET status = e_kind, attempt = e_attempt, value = e_value, owner = e_owner,
                         updated_at = e_at, since = e_at, last_event = n_id
            WHERE call_id = e_call_id AND last_event = p_last_event;
    END IF;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'changed'::text, NULL::bigint;
        RETURN;
    END IF;
    INSERT INTO events (id, at, call_id, kind, tool, agent_id, idempotency_key, arguments, value, error, reason,
                        actor, attempt, owner) VALUES (n_id, {_EVENT_VALUES});
    IF p_relaxed THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN QUERY SELECT 'appended'::text, n_id;
END
$fn$;
"""

_SEQUENCER_APPEND = f"SELECT * FROM append_event(%s::boolean, %s::bigint, %s::boolean, {_EVENT_CASTS})"

_FIELDS = "at, call_id, kind, tool, agent_id, idempotency_key, arguments, value, error, reason, actor, attempt, owner"

# Every transaction below the snapshot's xmin has ended: the events under it are all there is below
# it, so chaining them in (xid, id) order never puts a later-found event before a chained one. A
# call's events keep their order: its next append's transaction takes its xid after the last one
# committed.
# (An ORDER BY of a bare name would sort by the output column of that name: the xid's text.)
_TO_SEAL = (f"SELECT e.id, e.xid::text AS xid_text, {_FIELDS} FROM events e WHERE (e.xid, e.id) > "
            "(%s::xid8, %s::bigint) AND e.xid < pg_snapshot_xmin(pg_current_snapshot()) ORDER BY e.xid, e.id LIMIT %s")


# -- the events of a guarded call ---------------------------------------------------------------------


def chain_of(call_id: str, chains: int) -> int:
    """The chain a call's events go to: a hash of its id, the same in every process and release."""
    return int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big") % chains


def event_hash(prev_hash: str, seq: int, row: Sequence[Any]) -> str:
    """The chain's hash (journal.chain) of an event stored as ``row`` (the columns of ``_FIELDS``) at ``seq``."""
    at, call_id, kind, tool, agent_id, key, arguments, value, error, reason, actor, attempt, owner = row
    return compute_hash(prev_hash, event_body(
        seq=seq, at=at, call_id=call_id, kind=kind, tool=tool, agent_id=agent_id, idempotency_key=key,
        arguments_sha256=text_sha256(arguments), value_sha256=text_sha256(value),
        error=None if error is None else orjson.loads(error), reason=None if reason is None else orjson.loads(reason),
        actor=actor, attempt=attempt, owner=None if owner is None else orjson.loads(owner)))


class CallEvents:
    """The fields of a guarded call's events, as the guard makes them, and their canonical bodies."""

    def __init__(self) -> None:
        self.owner = {"host": "bench", "pid": os.getpid()}
        self.owner_text = orjson.dumps(self.owner, option=orjson.OPT_SORT_KEYS).decode()
        self.arguments_sha256 = text_sha256(_ARGUMENTS)
        self.value_sha256 = text_sha256(_VALUE)

    def fields(self, call_id: str, kind: str) -> tuple[Any, ...]:
        """The event's stored fields (``_FIELDS`` less error and reason), stamped now."""
        value = _VALUE if kind == "committed" else None
        return (at_text(datetime.now(UTC)), call_id, kind, _TOOL, _AGENT, _KEY, _ARGUMENTS, value, _ACTOR, 1,
                self.owner_text)

    def cut(self, fields: tuple[Any, ...]) -> tuple[bytes, bytes]:
        """The event's canonical body cut around its seq, as the journal sends it to be hashed on the server."""
        at, call_id, kind = fields[:3]
        encoded = body_bytes(event_body(
            seq=0, at=at, call_id=call_id, kind=kind, tool=_TOOL, agent_id=_AGENT, idempotency_key=_KEY,
            arguments_sha256=self.arguments_sha256, value_sha256=self.value_sha256 if kind == "committed" else None,
            error=None, reason=None, actor=_ACTOR, attempt=1, owner=self.owner))
        cut = encoded.rfind(_SEQ_MARK) + len(b',"seq":')
        return encoded[:cut], encoded[cut + 1:]


def connect(dsn: str, schema: str | None = None) -> psycopg.Connection[Any]:
    """An autocommit session with the journal's settings, its search_path set to ``schema``."""
    options = "-cplan_cache_mode=force_generic_plan"
    if schema is not None:
        options += f" -csearch_path={schema}"
    return psycopg.connect(make_conninfo(dsn, options=options), autocommit=True)


class ChainCalls:
    """A fresh guarded call against N chains: two appends, each one call of ``append_event``."""

    def __init__(self, dsn: str, schema: str, chains: int) -> None:
        self.conn, self.chains, self.events = connect(dsn, schema), chains, CallEvents()

    def __call__(self, call_id: str) -> None:
        chain = chain_of(call_id, self.chains)
        pending = self.events.fields(call_id, "pending")
        row = self.conn.execute(_CHAINS_APPEND, (chain, True, None, None, False, *self.events.cut(pending),
                                                 *pending)).fetchone()
        if row is None or row[0] != "appended":
            raise RuntimeError(f"begin of {call_id}: {row}")
        committed = self.events.fields(call_id, "committed")
        row = self.conn.execute(_CHAINS_APPEND, (chain, False, row[1], row[2], True, *self.events.cut(committed),
                                                 *committed)).fetchone()
        if row is None or row[0] != "appended":
            raise RuntimeError(f"outcome of {call_id}: {row}")


class SequencedCalls:
    """A fresh guarded call for the sequencer: two appends that insert, each one call of ``append_event``."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.conn, self.events = connect(dsn, schema), CallEvents()

    def __call__(self, call_id: str) -> None:
        row = self.conn.execute(_SEQUENCER_APPEND, (True, None, False, *self.events.fields(call_id, "pending")),
                                ).fetchone()
        if row is None or row[0] != "appended":
            raise RuntimeError(f"begin of {call_id}: {row}")
        row = self.conn.execute(_SEQUENCER_APPEND, (False, row[1], True, *self.events.fields(call_id, "committed")),
                                ).fetchone()
        if row is None or row[0] != "appended":
            raise RuntimeError(f"outcome of {call_id}: {row}")


def journal_calls(dsn: str) -> Callable[[str], None]:
    """A fresh guarded call on PostgresJournal, through airlock's guard."""
    journal = PostgresJournal(dsn, pool_size=1)

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        return {"charge_id": "ch_1", "cents": cents}

    def call(call_id: str) -> None:
        with AirlockContext(agent_id=_AGENT, metadata={"tool_call_id": call_id}):
            charge("acct-1", 500)

    return call


def raw_calls(dsn: str, locked: bool) -> Callable[[str], None]:
    """One raw INSERT of an event-sized row, its own transaction (postgres_bench's floor); ``locked``:
    in a transaction that locks and moves a head row, pipelined into one round trip."""
    run = postgres_bench.raw(dsn, locked=True, pipelined=True) if locked else postgres_bench.raw_single(dsn)

    def call(call_id: str) -> None:
        run(1)

    return call


@dataclass(frozen=True)
class Design:
    """One row of the figures: what a process makes per op, and where."""

    label: str
    kind: str  # raw, raw-locked, journal, chains, sequencer
    schema: str = ""
    chains: int = 1

    def caller(self, dsn: str) -> Callable[[str], None]:
        if self.kind in ("raw", "raw-locked"):
            return raw_calls(dsn, self.kind == "raw-locked")
        if self.kind == "journal":
            return journal_calls(make_conninfo(dsn, options=f"-csearch_path={self.schema}"))
        if self.kind == "chains":
            return ChainCalls(dsn, self.schema, self.chains)
        return SequencedCalls(dsn, self.schema)


def fresh_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # random, as models make them


# -- the sequencer --------------------------------------------------------------------------------------


def seal_batch(conn: psycopg.Connection[Any], limit: int, in_batch: Any = None, pause: float = 0.0) -> int:
    """Chain the next events below the horizon (at most ``limit``), in one transaction; returns how many.

    ``pause``: seconds to wait after the batch's rows are inserted and before its cursor moves and it
    commits, with ``in_batch`` set (for the crash check)."""
    with conn.transaction():
        # One sequencer at a time; an advisory lock takes no transaction id, which would hold the horizon.
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SEAL_LOCK,))
        head = conn.execute("SELECT seq, hash, last_xid::text, last_id FROM seal_head WHERE id = 1").fetchone()
        assert head is not None
        seq, prev, last_xid, last_id = int(head[0]), str(head[1]), str(head[2]), int(head[3])
        rows = conn.execute(_TO_SEAL, (last_xid, last_id, limit)).fetchall()
        if not rows:
            return 0
        seqs, ids, prevs, hashes = [], [], [], []
        for row in rows:
            seq += 1
            digest = event_hash(prev, seq, row[2:])
            seqs.append(seq)
            ids.append(row[0])
            prevs.append(prev)
            hashes.append(digest)
            prev = digest
        conn.execute("INSERT INTO chain (seq, event_id, prev_hash, hash) "
                     "SELECT * FROM unnest(%s::bigint[], %s::bigint[], %s::text[], %s::text[])",
                     (seqs, ids, prevs, hashes))
        if pause:
            in_batch.set()
            time.sleep(pause)
        conn.execute("UPDATE seal_head SET seq = %s, hash = %s, last_xid = %s::xid8, last_id = %s WHERE id = 1",
                     (seq, prev, rows[-1][1], rows[-1][0]))
    return len(rows)


def _sequencer(dsn: str, schema: str, ready: Any, stop: Any, interval: float, limit: int, in_batch: Any,
               pause: float) -> None:
    conn = connect(dsn, schema)
    conn.execute("SET application_name = 'chain sequencer'")
    ready.set()
    while not stop.is_set():
        if seal_batch(conn, limit, in_batch, pause) < limit:
            stop.wait(interval)
    conn.close()


class Sequencer:
    """A sequencer process, running once this returns; :meth:`stop` waits for the backlog to drain first."""

    def __init__(self, dsn: str, schema: str, interval: float, limit: int, pause: float = 0.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.dsn, self.schema = dsn, schema
        ready, self.stopping, self.in_batch = ctx.Event(), ctx.Event(), ctx.Event()
        self.process = ctx.Process(target=_sequencer, args=(dsn, schema, ready, self.stopping, interval, limit,
                                                              self.in_batch, pause), daemon=True)
        self.process.start()
        if not ready.wait(120):
            raise RuntimeError("the sequencer did not start")

    def stop(self, timeout: float = 120.0) -> float:
        """Wait until every event is chained (up to ``timeout``), stop the process; returns the wait."""
        started = time.perf_counter()
        with connect(self.dsn, self.schema) as conn:
            while backlog(conn) and time.perf_counter() - started < timeout and self.process.is_alive():
                time.sleep(0.01)
            left = backlog(conn)
        drained = time.perf_counter() - started
        self.stopping.set()
        self.process.join(30)
        if self.process.exitcode != 0:
            raise RuntimeError(f"the sequencer ended with exit code {self.process.exitcode}")
        if left:
            raise RuntimeError(f"the sequencer left {left} events unchained after {drained:.0f} s")
        return drained

    def kill(self) -> None:
        assert self.process.pid is not None  # started
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(30)


def backlog(conn: psycopg.Connection[Any]) -> int:
    """Events not yet chained."""
    row = conn.execute("SELECT (SELECT count(*) FROM events) - (SELECT count(*) FROM chain)").fetchone()
    return int(row[0]) if row is not None else 0


def last_event(dsn: str, schema: str) -> int:
    with connect(dsn, schema) as conn:
        row = conn.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()
    return int(row[0]) if row is not None else 0


def sealing_delay(dsn: str, schema: str, after: int, upto: int) -> tuple[float, float, float, int]:
    """Median, p99 and max seconds from an event's insert to its chaining, for the events ``after < id <= upto``."""
    with connect(dsn, schema) as conn:
        row = conn.execute(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d), percentile_cont(0.99) WITHIN GROUP (ORDER BY d), "
            "max(d), count(*) FROM (SELECT extract(epoch FROM c.sealed_at - e.staged_at)::float8 AS d FROM chain c "
            "JOIN events e ON e.id = c.event_id WHERE e.id > %s AND e.id <= %s) t", (after, upto)).fetchone()
    if row is None or not row[3]:
        return 0.0, 0.0, 0.0, 0
    return float(row[0]), float(row[1]), float(row[2]), int(row[3])


# -- running them ---------------------------------------------------------------------------------------


def _worker(design: Design, dsn: str, seconds: float, barrier: Any, results: Any) -> None:
    call = design.caller(dsn)
    for _ in range(_WARMUP):
        call(fresh_id())
    barrier.wait()
    done, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        call(fresh_id())
        done += 1
    results.put(done)


def throughput(design: Design, dsn: str, procs: int, seconds: float) -> float:
    """Ops a second that ``procs`` processes make together in ``seconds``, after each made its warm-up."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(design, dsn, seconds, barrier, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        total: int = sum(results.get(timeout=seconds + 600) for _ in workers)
    finally:
        for w in workers:
            w.join(60)
    return total / seconds


def latencies(designs: Sequence[Design], dsn: str, calls: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of each fresh call in one process, rounds of each design in turn (the disk's latency drifts)."""
    callers = {d.label: d.caller(dsn) for d in designs}
    for call in callers.values():
        for _ in range(_WARMUP):
            call(fresh_id())
    times: dict[str, list[float]] = {label: [] for label in callers}
    for _ in range(rounds):
        for label, call in callers.items():
            for _ in range(max(1, calls // rounds)):
                call_id = fresh_id()
                started = time.perf_counter()
                call(call_id)
                times[label].append(time.perf_counter() - started)
    return times


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def crash_check(dsn: str, design: Design, procs: int, kills: int, interval: float, limit: int) -> str:
    """SIGKILL the sequencer ``kills`` times in the middle of a batch (its chain rows inserted, not
    committed) while ``procs`` processes append; a new one takes over each time. Returns what was seen."""
    ctx = multiprocessing.get_context("spawn")
    seconds = 1.0 + kills
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(design, dsn, seconds, barrier, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    killed = 0
    with connect(dsn, design.schema) as conn:
        for _ in range(kills):
            doomed = Sequencer(dsn, design.schema, interval, limit, pause=0.3)
            if not doomed.in_batch.wait(60):
                doomed.kill()
                continue
            chained = conn.execute("SELECT seq FROM seal_head").fetchone()
            doomed.kill()
            killed += 1
            time.sleep(0.05)
            # The killed batch is gone whole: its rows were never committed, the cursor never moved.
            after = conn.execute("SELECT seq, (SELECT count(*) FROM chain) FROM seal_head").fetchone()
            assert after is not None and chained is not None
            if not (after[0] == after[1] and after[0] >= chained[0]):
                raise RuntimeError(f"a killed batch left its mark: seal_head {after[0]}, chain rows {after[1]}")
    survivor = Sequencer(dsn, design.schema, interval, limit)
    total = sum(results.get(timeout=seconds + 600) for _ in workers)
    for w in workers:
        w.join(60)
    drained = survivor.stop()
    return (f"sequencer SIGKILLed {killed} time{'s' if killed != 1 else ''} mid-batch under {procs} processes "
            f"({total} calls); a new one chained the rest in {drained:.2f} s after they stopped")


def stall_check(dsn: str, design: Design, hold: float, interval: float, limit: int) -> str:
    """Hold a transaction with an id open for ``hold`` seconds, as a forgotten session in psql would, while
    calls are made: the horizon stays below it, so nothing after it is chained until it ends."""
    sequencer = Sequencer(dsn, design.schema, interval, limit)
    call = design.caller(dsn)
    with connect(dsn) as holder, connect(dsn, design.schema) as conn:
        holder.execute("BEGIN")
        holder.execute("SELECT pg_current_xact_id()")  # takes a transaction id, as any write would
        started = time.perf_counter()
        made = 0
        while time.perf_counter() - started < hold:
            call(fresh_id())
            made += 1
        waiting = backlog(conn)
        holder.execute("COMMIT")
        ended = time.perf_counter()
        while backlog(conn) and time.perf_counter() - ended < 60:
            time.sleep(0.005)
        caught_up = time.perf_counter() - ended
    sequencer.stop()  # raises if the backlog did not drain
    return (f"a transaction id held open {hold:g} s: {made} calls made meanwhile, {waiting} events unchained "
            f"as it ended, all chained {caught_up * 1e3:.0f} ms after")


# -- checking what the designs wrote ------------------------------------------------------------------


def check_chains(conn: psycopg.Connection[Any]) -> str:
    """Each chain gapless from 1, linked, every hash the chain's rule; each call one pending then one committed,
    in its chain. Returns a summary; raises RuntimeError at the first fault."""
    events = 0
    chains = [int(r[0]) for r in conn.execute("SELECT chain FROM chain_heads ORDER BY chain").fetchall()]
    for chain in chains:
        prev, expected = GENESIS, 1
        for row in conn.execute(f"SELECT seq, {_FIELDS}, prev_hash, hash FROM events WHERE chain = %s "
                                "ORDER BY seq", (chain,)):
            seq = int(row[0])
            if seq != expected or row[14] != prev or event_hash(prev, seq, row[1:14]) != row[15]:
                raise RuntimeError(f"chain {chain} breaks at seq {seq}")
            prev, expected = row[15], expected + 1
        head = conn.execute("SELECT seq, hash FROM chain_heads WHERE chain = %s", (chain,)).fetchone()
        if head is None or (int(head[0]), head[1]) != (expected - 1, prev):
            raise RuntimeError(f"chain {chain}: its head is not its last event")
        events += expected - 1
    misplaced = conn.execute(
        "SELECT count(*) FROM (SELECT call_id FROM events GROUP BY call_id HAVING count(DISTINCT chain) > 1 "
        "OR count(*) FILTER (WHERE kind = 'pending') <> 1 OR count(*) FILTER (WHERE kind = 'committed') <> 1 "
        "OR max(seq) FILTER (WHERE kind = 'pending') > min(seq) FILTER (WHERE kind = 'committed')) t").fetchone()
    if misplaced is None or misplaced[0]:
        raise RuntimeError(f"{misplaced} calls not one pending then one committed in one chain")
    return f"{events} events in {len(chains)} chain{'s' if len(chains) > 1 else ''}"


def check_sequenced(conn: psycopg.Connection[Any]) -> str:
    """The chain gapless from 1, linked, every hash the chain's rule, every event chained once; each call one
    pending then one committed in the chain. Returns a summary; raises RuntimeError at the first fault."""
    prev, expected = GENESIS, 1
    for row in conn.execute(f"SELECT c.seq, {', '.join('e.' + f for f in _FIELDS.split(', '))}, c.prev_hash, "
                            "c.hash FROM chain c JOIN events e ON e.id = c.event_id ORDER BY c.seq"):
        seq = int(row[0])
        if seq != expected or row[14] != prev or event_hash(prev, seq, row[1:14]) != row[15]:
            raise RuntimeError(f"the chain breaks at seq {seq}")
        prev, expected = row[15], expected + 1
    counts = conn.execute("SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM chain), "
                          "(SELECT seq FROM seal_head)").fetchone()
    if counts is None or not counts[0] == counts[1] == counts[2] == expected - 1:
        raise RuntimeError(f"events, chained, sealed head and chain length differ: {counts}, {expected - 1}")
    misplaced = conn.execute(
        "SELECT count(*) FROM (SELECT e.call_id FROM events e JOIN chain c ON c.event_id = e.id GROUP BY e.call_id "
        "HAVING count(*) FILTER (WHERE kind = 'pending') <> 1 OR count(*) FILTER (WHERE kind = 'committed') <> 1 "
        "OR max(c.seq) FILTER (WHERE kind = 'pending') > min(c.seq) FILTER (WHERE kind = 'committed')) t"
    ).fetchone()
    if misplaced is None or misplaced[0]:
        raise RuntimeError(f"{misplaced} calls not one pending then one committed in the chain")
    return f"{expected - 1} events, each chained once, in one chain"


# -- the run --------------------------------------------------------------------------------------------


def numbers(text: str) -> list[int]:
    """A comma-separated list of positive integers."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers, 1 or more, such as 8,16,32")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="an existing server's database (default: a throwaway cluster)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per throughput figure")
    parser.add_argument("--procs", type=numbers, default=[8, 16, 32], help="process counts, the first the main one")
    parser.add_argument("--chains", type=numbers, default=[8, 16, 32], help="chain counts of the partitioned design")
    parser.add_argument("--calls", type=int, default=400, help="calls per design for one process's latency")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs of the sequencer in the crash check (0: none)")
    parser.add_argument("--seal-interval", type=float, default=0.005, help="seconds the sequencer sleeps when idle")
    parser.add_argument("--seal-batch", type=int, default=5000, help="most events the sequencer chains at once")
    args = parser.parse_args()

    server = None
    if args.dsn:
        dsn = args.dsn
    else:
        from tests import pgserver

        server = pgserver.server()
        dsn = pgserver.fresh_database(server)
    single = Design("single head (today's append, in SQL)", "chains", "design_single", 1)
    designs = [
        single,
        Design("the journal (PostgresJournal + guard)", "journal", "design_journal"),
        *(Design(f"{n} chains", "chains", f"design_chains{n}", n) for n in args.chains),
        Design("sequencer", "sequencer", "design_sequencer"),
    ]
    sequenced = designs[-1]
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(postgres_bench._RAW_TABLE.encode())
            for design in designs:
                conn.execute(f"DROP SCHEMA IF EXISTS {design.schema} CASCADE; CREATE SCHEMA {design.schema}".encode())
            version = conn.execute("SHOW server_version").fetchone()
            settings: dict[str, str] = dict(conn.execute("SELECT name, setting FROM pg_settings WHERE name IN "
                                         "('fsync', 'synchronous_commit', 'max_connections')").fetchall())
        for design in designs:
            if design.kind == "journal":
                PostgresJournal(make_conninfo(dsn, options=f"-csearch_path={design.schema}")).close()
                continue
            with connect(dsn, design.schema) as conn:
                ddl = chains_schema(design.chains) if design.kind == "chains" else _SEQUENCER_SCHEMA
                conn.execute(ddl.encode())
        print(f"PostgreSQL {version[0] if version else '?'}: fsync={settings.get('fsync')}, "
              f"synchronous_commit={settings.get('synchronous_commit')}; {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.1f}; {args.seconds:g} s a figure after {_WARMUP} calls a process")

        for procs in args.procs:
            print(f"{procs} processes, distinct fresh ids:")
            raw = throughput(Design("raw INSERT, autocommit", "raw"), dsn, procs, args.seconds)
            print(f"  {'raw INSERT, autocommit':<40} {raw:8.0f} tx/s")
            locked = throughput(Design("raw INSERT + head-row lock", "raw-locked"), dsn, procs, args.seconds)
            print(f"  {'raw INSERT + head-row lock, pipelined':<40} {locked:8.0f} tx/s  {locked / raw:5.2f}x raw")
            base = 0.0
            for design in designs:
                sequencer, before = None, 0
                if design.kind == "sequencer":
                    before = last_event(dsn, design.schema)
                    sequencer = Sequencer(dsn, design.schema, args.seal_interval, args.seal_batch)
                rate = throughput(design, dsn, procs, args.seconds)
                if design is single:
                    base = rate
                versus = f"  {rate / base:5.2f}x single head" if base and design is not single else ""
                print(f"  {design.label:<40} {rate:8.0f} calls/s  {rate / raw:5.2f}x raw{versus}")
                if sequencer is not None:
                    upto = last_event(dsn, design.schema)
                    drained = sequencer.stop()
                    median, high, most, count = sealing_delay(dsn, design.schema, before, upto)
                    print(f"  {'  sealing delay, insert to chained':<40} median {median * 1e3:.1f} ms, "
                          f"p99 {high * 1e3:.1f} ms, max {most * 1e3:.1f} ms ({count} events); "
                          f"backlog chained {drained:.2f} s after the appends stopped")

        print("one process, fresh call latency (median / p99; the median against the single head's):")
        before = last_event(dsn, sequenced.schema)
        sequencer = Sequencer(dsn, sequenced.schema, args.seal_interval, args.seal_batch)
        times = latencies(designs, dsn, args.calls, rounds=max(1, args.calls // 50))
        upto = last_event(dsn, sequenced.schema)
        sequencer.stop()
        base_median = statistics.median(times[single.label])
        for design in designs:
            median = statistics.median(times[design.label])
            print(f"  {design.label:<40} {median * 1e3:7.3f} ms / {p99(times[design.label]) * 1e3:7.3f} ms"
                  f"  {median / base_median:5.2f}x")
        median, high, most, count = sealing_delay(dsn, sequenced.schema, before, upto)
        print(f"  {'  sealing delay, insert to chained':<40} median {median * 1e3:.1f} ms, p99 {high * 1e3:.1f} ms, "
              f"max {most * 1e3:.1f} ms ({count} events)")

        if args.kills:
            print("crash check: " + crash_check(dsn, sequenced, args.procs[0], args.kills, args.seal_interval,
                                                args.seal_batch))
        print("stall check: " + stall_check(dsn, sequenced, 1.0, args.seal_interval, args.seal_batch))
        print("each design's log checks:")
        for design in designs:
            if design.kind == "journal":
                continue
            with connect(dsn, design.schema) as conn:
                found = check_chains(conn) if design.kind == "chains" else check_sequenced(conn)
            print(f"  {design.label:<40} {found}")
    finally:
        if server is not None:
            from tests import pgserver

            pgserver.shutdown()


if __name__ == "__main__":
    main()
