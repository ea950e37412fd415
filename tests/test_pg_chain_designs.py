"""benchmarks/pg_chain_designs.py runs and prints its figures, and its sequencer never chains an event
before one of a transaction still open, nor lets a wrong hash through its check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pg_chain_designs as designs

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = pytest.mark.postgres


def _sequencer_schema(dsn: str) -> psycopg.Connection[Any]:
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("CREATE SCHEMA design_sequencer")
    conn = designs.connect(dsn, "design_sequencer")
    conn.execute(designs._SEQUENCER_SCHEMA.encode())
    return conn


def test_the_script_prints_every_design_and_checks_their_logs(pg_dsn: str) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "pg_chain_designs.py"), "--dsn", pg_dsn,
                             "--seconds", "0.5", "--procs", "2", "--chains", "2", "--calls", "10", "--kills", "1"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("raw INSERT, autocommit", "single head (today's append, in SQL)", "the journal (PostgresJournal",
                  "2 chains", "x single head", "sealing delay, insert to chained", "fresh call latency",
                  "crash check: sequencer SIGKILLed 1 time mid-batch", "stall check:"):
        assert label in out
    checks = out.split("each design's log checks:")[1]
    assert " in 2 chains" in checks and "each chained once, in one chain" in checks


def test_a_bad_list_of_processes_is_a_usage_error() -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "pg_chain_designs.py"), "--procs", "8,0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "is not a list of numbers, 1 or more" in result.stderr


def test_an_open_transaction_holds_back_every_later_event(pg_dsn: str) -> None:
    conn = _sequencer_schema(pg_dsn)
    calls = designs.SequencedCalls(pg_dsn, "design_sequencer")
    early = designs.connect(pg_dsn, "design_sequencer")
    early.execute("BEGIN")
    early.execute(designs._SEQUENCER_APPEND, (True, None, False, *calls.events.fields("early", "pending")))
    calls("later")  # its two events commit first, with higher transaction ids
    assert designs.seal_batch(conn, 100) == 0  # below the open transaction there is nothing
    early.execute("COMMIT")
    assert designs.seal_batch(conn, 100) == 3
    order = conn.execute("SELECT e.call_id, e.kind FROM chain c JOIN events e ON e.id = c.event_id "
                         "ORDER BY c.seq").fetchall()
    assert order == [("early", "pending"), ("later", "pending"), ("later", "committed")]
    assert designs.backlog(conn) == 0
    # The check wants each call's two events: the early call has its pending only.
    with pytest.raises(RuntimeError, match="not one pending then one committed"):
        designs.check_sequenced(conn)


def test_events_are_chained_in_the_order_of_their_transaction_ids_as_numbers(pg_dsn: str) -> None:
    conn = _sequencer_schema(pg_dsn)
    events = designs.CallEvents()
    # Ids long ended (the server's own are past them): 10 sorts before 9 as text, after it as a number.
    for xid, call_id in (("10", "ten"), ("9", "nine")):
        conn.execute(f"INSERT INTO events (xid, {designs._FIELDS}) VALUES (%s::xid8, %s, %s, %s, %s, %s, %s, %s, "
                     "%s, NULL, NULL, %s, %s, %s)", (xid, *events.fields(call_id, "pending")))
    assert designs.seal_batch(conn, 100) == 2
    assert designs.seal_batch(conn, 100) == 0  # the cursor is past both: neither is chained again
    order = conn.execute("SELECT e.call_id FROM chain c JOIN events e ON e.id = c.event_id ORDER BY c.seq").fetchall()
    assert order == [("nine",), ("ten",)]


def test_the_check_finds_a_wrong_hash(pg_dsn: str) -> None:
    conn = _sequencer_schema(pg_dsn)
    calls = designs.SequencedCalls(pg_dsn, "design_sequencer")
    for n in range(3):
        calls(f"call-{n}")
    designs.seal_batch(conn, 100)
    assert designs.check_sequenced(conn) == "6 events, each chained once, in one chain"
    calls("call-3")
    row = conn.execute("SELECT seq, hash FROM seal_head").fetchone()
    assert row is not None
    staged = conn.execute("SELECT id FROM events ORDER BY id").fetchall()[-2:]
    for offset, (event_id,) in enumerate(staged, start=1):  # chained by hand, with hashes of nothing
        conn.execute("INSERT INTO chain (seq, event_id, prev_hash, hash) VALUES (%s, %s, %s, %s)",
                     (row[0] + offset, event_id, row[1] if offset == 1 else "0" * 64, "0" * 64))
    conn.execute("UPDATE seal_head SET seq = seq + 2")
    with pytest.raises(RuntimeError, match="the chain breaks at seq 7"):
        designs.check_sequenced(conn)
