"""Sealing on a real server: events appended to the inbox by real processes, moved into the
hash-chained log in batches (see journal.postgres.sealing), and everything a user relies on still
holding: a gapless chain whose every hash checks, each call's events in the order they were written,
a projection that matches, tampering found (in the log, across batches, and in the inbox before it is
sealed), a sealing process killed by SIGKILL losing and doubling nothing, the replay table driven at
random with every event through the inbox, and a journal of schema version 5 migrated in place."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from hypothesis import HealthCheck, settings

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal
from guard.effect_guard import EffectGuard
from guard.store import Decision, EffectEvent, Verdict
from journal import JournalError, SQLiteJournal
from journal.chain import GENESIS, hash_of
from journal.checkpoint import checkpoint_problem
from journal.events import JournalEvent, text_sha256
from journal.postgres import PostgresJournal
from journal.postgres import schema as pg_schema
from journal.postgres.writes import QUEUE
from journal.projection import fold
from journal.rows import event_row
from tests.cli_support import Tools, invoke, seed
from tests.pgserver import make_old_journal
from tests.postgres.test_journal import snapshot
from tests.state_machine import make_state_machine

pytestmark = pytest.mark.postgres

SPAWN = multiprocessing.get_context("spawn")

# How long a condition the test waits on may take to come true on a loaded machine.
PATIENCE = 120.0


# -- what the tests share -------------------------------------------------------------------------


def wait_for(condition: Callable[[], bool], what: str, seconds: float = PATIENCE) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.005)


def scalar(dsn: str, sql: str, *params: Any) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.encode(), params).fetchone()
    assert row is not None
    return row[0]


def inbox_rows(dsn: str) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM inbox"))


def sealed_events(dsn: str) -> int:
    """The log's events, read without sealing first (as no journal's read does)."""
    return int(scalar(dsn, "SELECT count(*) FROM events"))


def as_superuser(dsn: str, statement: str, *params: Any) -> None:
    """What an intruder with the database's superuser can do: every trigger of the session off."""
    with psycopg.connect(dsn) as conn:
        conn.execute(b"SET session_replication_role = replica")
        conn.execute(statement.encode(), params)


@contextlib.contextmanager
def head_held(dsn: str) -> Iterator[None]:
    """The chain head's row locked by a session of its own, as a seal under way holds it: every seal
    waits (what is appended meanwhile stays in the inbox), appends to the inbox go on."""
    with psycopg.connect(dsn) as conn:
        conn.execute(b"SELECT seq FROM chain_head WHERE id = 1 FOR UPDATE")
        yield
        conn.rollback()


def seal_transactions(dsn: str) -> list[list[int]]:
    """The seqs of the log grouped by the transaction that inserted them (its xmin), in seq order:
    each group is one seal (or one append sealed as it committed)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(b"SELECT seq, xmin::text FROM events ORDER BY seq").fetchall()
    groups: list[list[int]] = []
    last = None
    for seq, xmin in rows:
        if xmin != last:
            groups.append([])
            last = xmin
        groups[-1].append(int(seq))
    return groups


def assert_one_chain(events: list[JournalEvent]) -> None:
    """seq 1..N without a gap, every hash recomputed from its stored fields, each linked to the last."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    prev = GENESIS
    for e in events:
        assert e.prev_hash == prev, f"seq {e.seq} is not linked to the event before it"
        assert e.hash == hash_of(e), f"seq {e.seq} does not carry its hash"
        prev = e.hash


def guarded_charge(journal: PostgresJournal, ledger: list[str] | str) -> Any:
    """A tool guarded on ``journal`` whose every effect is counted outside it (a list, or a file
    each effect appends one line to)."""

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        if isinstance(ledger, list):
            ledger.append(str(context.tool_call_id))
        else:
            with open(ledger, "a") as f:
                f.write(f"{context.tool_call_id}\n")
        return {"account": account, "charged": cents}

    return charge


def call(tool: Any, call_id: str, cents: int, agent: str = "agent-1") -> Any:
    with AirlockContext(agent_id=agent, metadata={"tool_call_id": call_id}):
        return tool("acct", cents)


def queued_journal(dsn: str, **options: Any) -> PostgresJournal:
    journal = PostgresJournal(dsn, **options)
    journal.writes.seal_mode = QUEUE  # every event waits in the inbox for its seq
    return journal


class BatchedLog:
    """A journal whose guarded calls go through the inbox and are sealed in batches the test
    chooses: each batch's calls are made while the head is held (they wait in the inbox), then
    sealed together in one transaction."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.journal = queued_journal(dsn)
        self.effects: list[str] = []
        self.charge = guarded_charge(self.journal, self.effects)
        self.batches: list[list[int]] = []  # the seqs each batch was given

    def batch(self, *call_ids: str) -> list[int]:
        start = self.journal.head()[0]
        with head_held(self.dsn):
            for n, call_id in enumerate(call_ids):
                assert call(self.charge, call_id, n + 1) == {"account": "acct", "charged": n + 1}
            assert inbox_rows(self.dsn) == 2 * len(call_ids)  # nothing sealed while the head is held
        self.journal.seal()
        assert inbox_rows(self.dsn) == 0
        seqs = list(range(start + 1, start + 2 * len(call_ids) + 1))
        assert self.journal.head()[0] == seqs[-1]
        self.batches.append(seqs)
        return seqs

    def close(self) -> None:
        self.journal.close()


@pytest.fixture
def batched(pg_dsn: str) -> Iterator[BatchedLog]:
    log = BatchedLog(pg_dsn)
    try:
        yield log
    finally:
        log.close()


def three_batches(log: BatchedLog) -> None:
    for b in range(3):
        log.batch(*(f"b{b}-c{n}" for n in range(3)))
    # Each batch is one seal's transaction of its own, in the order the batches were made.
    assert seal_transactions(log.dsn) == log.batches
    assert log.journal.verify().ok


# -- 1. several processes writing through the inbox ----------------------------------------------


def _guarded_writer(dsn: str, prefix: str, calls: int, ledger: str, barrier: Any, results: Any) -> None:
    journal = queued_journal(dsn, pool_size=2)
    charge = guarded_charge(journal, ledger)
    barrier.wait(timeout=PATIENCE)
    seen = []
    for n in range(calls):
        call_id = f"{prefix}-{n}"
        first = call(charge, call_id, n, agent=prefix)
        again = call(charge, call_id, n, agent=prefix)  # a retry: replayed from the record
        seen.append((call_id, first, again))
    journal.close()
    results.put(seen)


def test_events_queued_by_several_processes_are_sealed_into_one_gapless_chain(pg_dsn: str, tmp_path: Path) -> None:
    PostgresJournal(pg_dsn).close()  # the schema exists before the writers start
    ledger = tmp_path / "ledger"
    writers, calls = 3, 12
    barrier, results = SPAWN.Barrier(writers), SPAWN.Queue()
    processes = [SPAWN.Process(target=_guarded_writer, args=(pg_dsn, f"w{k}", calls, str(ledger), barrier, results))
                 for k in range(writers)]
    for p in processes:
        p.start()
    seen = [item for _ in processes for item in results.get(timeout=PATIENCE)]
    for p in processes:
        p.join(timeout=PATIENCE)
        assert p.exitcode == 0

    call_ids = [call_id for call_id, _, _ in seen]
    for call_id, first, again in seen:
        n = int(call_id.rsplit("-", 1)[1])
        assert first == again == {"account": "acct", "charged": n}, (call_id, first, again)
    assert sorted(ledger.read_text().split()) == sorted(call_ids)  # each call took effect once

    with PostgresJournal(pg_dsn) as journal:
        journal.seal()
        assert inbox_rows(pg_dsn) == 0
        events = list(journal.events())
        assert len(events) == 3 * len(call_ids)
        assert_one_chain(events)
        for call_id in call_ids:
            assert [e.kind for e in events if e.call_id == call_id] == ["pending", "committed", "replayed"], call_id
        folded = fold(events)
        for call_id in call_ids:
            got, want = journal.get(call_id), folded[call_id]
            assert got is not None
            assert (got.status, got.attempt, got.value, got.last_seq) == (
                want.status, want.attempt, want.value, want.last_seq)
        report = journal.verify()
        assert report.ok and report.events == len(events), report.problem
    assert len(seal_transactions(pg_dsn)) >= 2, "every event was sealed in one transaction"


# -- 2. tampering found on a log sealed in batches ------------------------------------------------


def test_an_event_altered_inside_a_later_batch_is_named(batched: BatchedLog) -> None:
    three_batches(batched)
    altered = batched.batches[1][2]  # inside the second batch, neither its first nor its last
    as_superuser(batched.dsn, "UPDATE events SET value = '{\"charged\":999}' WHERE seq = %s", altered)
    report = batched.journal.verify()
    assert not report.ok and report.first_bad_seq == altered
    assert "altered" in (report.problem or "")


def test_an_event_removed_from_the_middle_of_a_batch_is_found(batched: BatchedLog) -> None:
    three_batches(batched)
    removed = batched.batches[2][2]
    as_superuser(batched.dsn, "DELETE FROM events WHERE seq = %s", removed)
    report = batched.journal.verify()
    assert not report.ok and report.first_bad_seq == removed + 1
    assert "missing" in (report.problem or "")


def test_a_tail_cut_after_a_checkpoint_is_found(batched: BatchedLog, tmp_path: Path) -> None:
    batched.batch("b0-c0", "b0-c1", "b0-c2")
    batched.batch("b1-c0", "b1-c1", "b1-c2")
    output = tmp_path / "checkpoint.json"
    made = invoke("journal", "checkpoint", "--db", batched.dsn, "-o", str(output))
    assert made.exit_code == 0, made.output
    checkpoint = orjson.loads(output.read_bytes())
    assert checkpoint["seq"] == batched.batches[1][-1]
    batched.batch("b2-c0", "b2-c1", "b2-c2")
    assert seal_transactions(batched.dsn) == batched.batches
    ok = invoke("journal", "verify", "--db", batched.dsn, "--checkpoint", str(output))
    assert ok.exit_code == 0, ok.output

    keep = checkpoint["seq"] - 2  # the end of the log removed, across the batches, the checkpoint's event with it
    with psycopg.connect(batched.dsn, autocommit=True) as conn:
        conn.execute(b"ALTER TABLE events DISABLE TRIGGER USER")
        conn.execute(b"DELETE FROM events WHERE seq > %s", (keep,))
        conn.execute("SET airlock.layout = '6'")  # as the journal's own sessions, which may move the head
        conn.execute(b"UPDATE chain_head SET seq = e.seq, hash = e.hash FROM events e WHERE e.seq = %s", (keep,))
        conn.execute(b"ALTER TABLE events ENABLE TRIGGER USER")
    found = invoke("journal", "verify", "--db", batched.dsn, "--checkpoint", str(output))
    assert found.exit_code == 1
    assert found.stderr.endswith(f"it no longer matches the checkpoint {output}: the log ends at seq {keep}, before "
                                 f"the checkpoint's seq {checkpoint['seq']}: events have been removed from the end "
                                 "since the checkpoint\n"), found.stderr
    problem = checkpoint_problem(batched.journal, checkpoint)
    assert problem is not None and "events have been removed from the end" in problem


def test_an_archive_spanning_several_batches_verifies_as_one_chain(batched: BatchedLog, tmp_path: Path) -> None:
    batched.batch("b0-c0", "b0-c1", "b0-c2")
    batched.batch("b1-c0", "b1-c1")
    cut = datetime.now(UTC).isoformat()
    batched.batch("b2-c0", "b2-c1", "b2-c2")
    assert seal_transactions(batched.dsn) == batched.batches
    head_seq, head_hash = batched.journal.head()
    moved = batched.batches[1][-1]  # the first two batches

    output = tmp_path / "a1.jsonl"
    done = invoke("journal", "archive", "--db", batched.dsn, "--before", cut, "-o", str(output))
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith(f"Archived {moved} events (seq 1 to {moved}, ")
    archived = [orjson.loads(line) for line in output.read_bytes().splitlines()]
    assert [line["seq"] for line in archived] == list(range(1, moved + 1))

    kept = head_seq - moved
    for args, checked, head in ((("--db", batched.dsn), kept, head_hash),
                                (("--export", str(output)), moved, archived[-1]["hash"]),
                                (("--export", str(output), "--db", batched.dsn), head_seq, head_hash)):
        result = invoke("journal", "verify", *args)
        assert (result.exit_code, result.stdout) == (0, f"OK: {checked} events, head {head}\n"), result.output
    report = batched.journal.verify()
    assert (report.ok, report.events, report.head) == (True, kept, head_hash)

    # The log goes on from there, through the inbox, and still verifies with the archive.
    batched.batch("b3-c0")
    assert call(batched.charge, "b0-c0", 1) == {"account": "acct", "charged": 1}  # an archived call: replayed
    assert batched.effects.count("b0-c0") == 1
    batched.journal.seal()
    result = invoke("journal", "verify", "--export", str(output), "--db", batched.dsn)
    assert result.exit_code == 0 and result.stdout.startswith(f"OK: {head_seq + 3} events"), result.output


# -- 3. tampering with the inbox before it is sealed ----------------------------------------------


@pytest.mark.parametrize("rewrite", ["value only", "value and the body its hash covers"])
def test_an_inbox_row_changed_before_it_is_sealed_is_found(batched: BatchedLog, rewrite: str) -> None:
    batched.batch("before")
    with head_held(batched.dsn):
        assert call(batched.charge, "victim", 5) == {"account": "acct", "charged": 5}
        assert call(batched.charge, "after", 6) == {"account": "acct", "charged": 6}
        with psycopg.connect(batched.dsn) as conn:
            row = conn.execute(b"SELECT id, value, body_head, body_tail FROM inbox "
                               b"WHERE call_id = 'victim' AND kind = 'committed'").fetchone()
        assert row is not None
        inbox_id, value, body_head, body_tail = row
        forged = '{"account":"acct","charged":5000}'
        old_sha, new_sha = text_sha256(value), text_sha256(forged)
        assert old_sha is not None and new_sha is not None
        if rewrite == "value only":
            as_superuser(batched.dsn, "UPDATE inbox SET value = %s WHERE id = %s", forged, inbox_id)
        else:  # someone who knows the chain's rule: the body sealed is made to match the forged value
            body_head = bytes(body_head).replace(old_sha.encode(), new_sha.encode())
            body_tail = bytes(body_tail).replace(old_sha.encode(), new_sha.encode())
            as_superuser(batched.dsn, "UPDATE inbox SET value = %s, body_head = %s, body_tail = %s WHERE id = %s",
                         forged, body_head, body_tail, inbox_id)
    batched.journal.seal()
    assert inbox_rows(batched.dsn) == 0
    sealed = [e for e in batched.journal.events(call_id="victim") if e.kind == "committed"]
    assert len(sealed) == 1 and sealed[0].value == forged
    report = batched.journal.verify()
    assert not report.ok
    if rewrite == "value only":
        assert report.first_bad_seq == sealed[0].seq and "altered" in (report.problem or ""), report
    else:
        assert "projection of call 'victim' differs from the log" in (report.problem or ""), report


def test_a_projection_row_naming_an_inbox_row_that_is_gone_is_found(batched: BatchedLog) -> None:
    batched.batch("before")
    with head_held(batched.dsn):
        assert call(batched.charge, "gone", 5) == {"account": "acct", "charged": 5}
        assert call(batched.charge, "after", 6) == {"account": "acct", "charged": 6}
        record = batched.journal.get("gone")
        assert record is not None and record.status == "committed" and record.last_seq < 0
        as_superuser(batched.dsn, "DELETE FROM inbox WHERE id = %s", -record.last_seq)
    batched.journal.seal()
    assert inbox_rows(batched.dsn) == 0
    assert [e.kind for e in batched.journal.events(call_id="gone")] == ["pending"]
    report = batched.journal.verify()
    assert not report.ok and "the projection of call 'gone' differs from the log" in (report.problem or ""), report
    with psycopg.connect(batched.dsn) as conn:
        row = conn.execute(b"SELECT last_seq FROM calls WHERE call_id = 'gone'").fetchone()
    assert row == (record.last_seq,)  # it still names the row that is gone


# -- 4. the replay table, every event through the inbox ------------------------------------------


def queued_store(tmp_path: Path) -> PostgresJournal:
    from tests.pgserver import fresh_schema

    return queued_journal(fresh_schema(), pool_size=4)


def test_replay_table_state_machine_with_every_event_queued() -> None:
    machine = make_state_machine(queued_store)
    machine.TestCase.settings = settings(max_examples=20, stateful_step_count=25, deadline=None,
                                         suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()


# -- 5. SIGKILL of a sealing process, and of a writer --------------------------------------------


def _queueing_writer(dsn: str, report: str, prefix: str, started: Any, stop: Any) -> None:
    """Append pending then committed for call after call, every event into the inbox, until told to
    stop; each event reported (one line) once its append returned. It seals nothing itself."""
    journal = queued_journal(dsn, pool_size=1)
    journal.sealer.close()  # the sealing is left to the sealing process
    fd = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    started.release()
    deadline = time.monotonic() + 600  # a bound for a parent that never says stop
    n = 0
    while not stop.is_set() and time.monotonic() < deadline:
        n += 1
        call_id = f"{prefix}-{n}"
        pending = EffectEvent("pending", call_id, "pay", attempt=1, arguments=f'{{"n":{n}}}', idempotency_key="k")
        journal.begin(call_id, lambda record, pending=pending: Decision(Verdict.RUN, pending, record))
        os.write(fd, f"{call_id} pending\n".encode())
        journal.append(EffectEvent("committed", call_id, "pay", attempt=1, value=f'{{"n":{n}}}'))
        os.write(fd, f"{call_id} committed\n".encode())
        time.sleep(0.001)
    os.close(fd)
    journal.close()


def _sealing_process(dsn: str, way: str, commit_first: int, sealed: Any, holding: Any) -> None:
    """Seal the inbox again and again until killed. ``transaction``: each seal in a transaction of
    its own, the first ``commit_first`` that moved rows committed, then one that moved rows kept
    open (``holding`` set) until the process is killed. ``journal``: PostgresJournal.seal()."""
    deadline = time.monotonic() + 600  # a bound for a parent that never kills it
    if way == "journal":
        journal = PostgresJournal(dsn, pool_size=1)
        while time.monotonic() < deadline:
            if journal.seal():
                with sealed.get_lock():
                    sealed.value += 1
            time.sleep(0.002)
        return
    with psycopg.connect(dsn) as conn:
        while time.monotonic() < deadline:
            with conn.transaction():
                row = conn.execute(b"SELECT airlock_seal(50, true)").fetchone()
                moved = int(row[0]) if row is not None else 0
                if moved > 0 and sealed.value >= commit_first:
                    holding.set()
                    time.sleep(600)  # killed here: its seal moved rows it never commits
            if moved > 0:
                with sealed.get_lock():
                    sealed.value += 1
            time.sleep(0.002)


def reported(path: Path) -> list[tuple[str, str]]:
    """What a writer reported appended: whole lines only (a writer killed mid-line left a part)."""
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [(call_id, kind) for call_id, kind in (line.split() for line in lines)]


def kill(process: Any) -> None:
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=PATIENCE)
    assert process.exitcode == -signal.SIGKILL


def test_sigkill_of_sealing_processes_and_of_a_writer_loses_and_doubles_nothing(
    pg_dsn: str, tmp_path: Path
) -> None:
    PostgresJournal(pg_dsn).close()
    started, stop = SPAWN.Semaphore(0), SPAWN.Event()
    reports = [tmp_path / f"w{k}.txt" for k in range(3)]
    writers = [SPAWN.Process(target=_queueing_writer, args=(pg_dsn, str(report), f"w{k}", started, stop))
               for k, report in enumerate(reports)]
    for p in writers:
        p.start()
    try:
        for _ in writers:
            assert started.acquire(timeout=PATIENCE)
        # Sealing processes killed one after another: in the middle of a seal's transaction (after
        # seals of its own committed, or before any), and wherever PostgresJournal.seal() was.
        seals_committed = []
        for way, commit_first in (("transaction", 2), ("journal", 0), ("transaction", 0)):
            sealed, holding = SPAWN.Value("i", 0), SPAWN.Event()
            sealer = SPAWN.Process(target=_sealing_process, args=(pg_dsn, way, commit_first, sealed, holding))
            sealer.start()
            if way == "transaction":
                wait_for(holding.is_set, "a seal that moved rows, not committed")
                assert sealed.value == commit_first
            else:
                wait_for(lambda sealed=sealed: sealed.value >= 3, "three seals by PostgresJournal.seal()")
            seals_committed.append(sealed.value)
            kill(sealer)
        assert seals_committed[0] == 2 and seals_committed[1] >= 3

        # A writer killed while it writes: at most its last event, never committed, is lost.
        victim, victim_report = writers[0], reports[0]
        so_far = len(reported(victim_report))
        wait_for(lambda: len(reported(victim_report)) >= so_far + 6, "the writer to go on writing")
        kill(victim)
        survivors_so_far = [len(reported(r)) for r in reports[1:]]
        wait_for(lambda: all(len(reported(r)) > n + 4 for r, n in zip(reports[1:], survivors_so_far, strict=True)),
                 "the other writers to go on writing")
    finally:
        stop.set()
        for p in writers[1:]:
            p.join(timeout=PATIENCE)
        for p in writers:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in writers[1:]] == [0, 0]

    assert inbox_rows(pg_dsn) > 0  # left by the writers after the last sealing process was killed
    with PostgresJournal(pg_dsn) as journal:
        assert journal.seal() > 0
        assert inbox_rows(pg_dsn) == 0
        events = list(journal.events())
        assert_one_chain(events)
        counts = Counter((e.call_id, e.kind) for e in events)
        doubled = [key for key, n in counts.items() if n != 1]
        assert doubled == [], f"appended more than once: {doubled[:5]}"
        for k, report in enumerate(reports):
            said = reported(report)
            assert said, f"writer {k} reported nothing"
            missing = [key for key in said if key not in counts]
            assert missing == [], f"writer {k}: reported appended but not in the log: {missing[:5]}"
        by_call: dict[str, list[str]] = {}
        for e in events:
            assert e.call_id is not None
            by_call.setdefault(e.call_id, []).append(e.kind)
        unfinished = [call_id for call_id, kinds in by_call.items() if kinds != ["pending", "committed"]]
        # Only the killed writer may have left a call half written (its pending, without its outcome).
        assert all(by_call[c] == ["pending"] and c.startswith("w0-") for c in unfinished), unfinished
        assert len(unfinished) <= 1
        report = journal.verify()
        assert report.ok and report.events == len(events), report.problem


# -- 6. a journal of schema version 5, migrated in place ------------------------------------------


def test_a_version_5_journal_is_migrated_in_place_and_goes_on(pg_dsn: str, tmp_path: Path) -> None:
    old_path = tmp_path / "old.db"
    seed(old_path)  # a real log: calls committed, replayed, in doubt, failed, refused
    with SQLiteJournal(old_path, readonly=True) as old:
        old_events = list(old.events())
    assert {e.kind for e in old_events} == {"pending", "committed", "replayed", "unknown", "refused", "released"}
    make_old_journal(pg_dsn, 5, old_events)
    old_seq, old_hash = old_events[-1].seq, old_events[-1].hash

    # Opened without the right to migrate: refused, naming the version, and left as it is.
    before = snapshot(pg_dsn)
    for options in ({"create": False}, {"readonly": True}):
        with pytest.raises(JournalError, match=r"has schema version 5; open it writable once to migrate it to "
                                               rf"version {pg_schema.SCHEMA_VERSION}"):
            PostgresJournal(pg_dsn, **options)
    assert snapshot(pg_dsn) == before

    with PostgresJournal(pg_dsn) as journal:
        assert scalar(pg_dsn, "SELECT schema_version FROM airlock_journal_meta") == pg_schema.SCHEMA_VERSION == 6
        assert inbox_rows(pg_dsn) == 0
        assert [event_row(e) for e in journal.events()] == [event_row(e) for e in old_events]
        assert journal.head() == (old_seq, old_hash)
        report = journal.verify()
        assert report.ok and report.events == old_seq, report.problem

        tools = Tools(journal)
        # The old calls: a committed one replayed, one in doubt refused; neither runs.
        assert tools.call("call-ok", tools.charge, account="acct_1", cents=500) == {"charge_id": "ch_1", "cents": 500}
        refused = tools.call("call-timeout", tools.charge, account="acct_2", cents=700)
        assert is_refusal(refused) and refused["block_reason"] == "effect_status_unknown"
        assert tools.payments.charges == []
        # New calls: sealed as they commit, then through the inbox.
        tools.call("new-1", tools.charge, account="acct_5", cents=1)
        journal.writes.seal_mode = QUEUE
        tools.call("new-2", tools.charge, account="acct_5", cents=2)
        tools.call("call-ok", tools.charge, account="acct_1", cents=500)
        assert tools.payments.charges == [("acct_5", 1), ("acct_5", 2)]
        journal.seal()
        assert inbox_rows(pg_dsn) == 0

        events = list(journal.events())
        assert [event_row(e) for e in events[:old_seq]] == [event_row(e) for e in old_events]
        assert events[old_seq].prev_hash == old_hash and events[old_seq].seq == old_seq + 1
        assert_one_chain(events)
        assert [e.kind for e in journal.call_events("call-ok")] == ["pending", "committed", "replayed", "replayed",
                                                                    "replayed"]
        report = journal.verify()
        assert report.ok and report.events == len(events) == old_seq + 7, report.problem

    with PostgresJournal(pg_dsn, readonly=True) as journal:  # migrated: opened read-only from now on
        assert journal.verify().ok



# -- under contention, and a seal lost in a crash -------------------------------------------------


def test_once_an_append_finds_the_head_held_the_next_go_through_the_inbox_for_a_while(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from journal.postgres import writes

    monkeypatch.setattr(writes, "_CONTENDED_FOR", 3600.0)  # "a while" outlasts the test, however slow
    journal = PostgresJournal(pg_dsn)  # seal mode SEAL, as shipped
    monkeypatch.setattr(journal.sealer, "poke", lambda: None)  # what waits in the inbox stays there
    effects: list[str] = []
    charge = guarded_charge(journal, effects)
    try:
        call(charge, "alone", 1)
        assert inbox_rows(pg_dsn) == 0 and sealed_events(pg_dsn) == 2  # sealed as they committed
        with head_held(pg_dsn):  # another session seals: the call's events wait in the inbox
            call(charge, "contended", 2)
            assert inbox_rows(pg_dsn) == 2
        # The head is free again, but others were appending a moment ago: no append tries it.
        call(charge, "after", 3)
        assert inbox_rows(pg_dsn) == 4 and sealed_events(pg_dsn) == 2
        record = journal.get("after")
        assert record is not None and record.status == "committed" and record.last_seq < 0
        # Once the while is over, an append takes the head again, sealing what waits first.
        journal.writes._contended_until = 0.0
        call(charge, "later", 4)
        assert inbox_rows(pg_dsn) == 0
        events = list(journal.events())
        assert_one_chain(events)
        assert [(e.call_id, e.kind) for e in events] == [
            (c, k) for c in ("alone", "contended", "after", "later") for k in ("pending", "committed")]
        assert effects == ["alone", "contended", "after", "later"]
        assert all(r.last_seq > 0 for r in journal.calls())
        assert journal.verify().ok
    finally:
        journal.close()


def test_a_seal_lost_in_a_crash_of_the_server_leaves_its_events_in_the_inbox_to_be_sealed_again(
    pg_server: Any, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not pg_server.managed:
        pytest.skip("the tests do not crash an external server")
    from tests.postgres.test_replicas import crash_losing

    journal = queued_journal(pg_dsn)
    monkeypatch.setattr(journal.sealer, "poke", lambda: None)  # sealed only when the test says
    effects: list[str] = []
    charge = guarded_charge(journal, effects)
    try:
        assert journal.seal() == 0  # the sealer's session made before the crash
        for n in range(3):
            call(charge, f"c{n}", n + 1)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(b"CHECKPOINT")  # the outcomes too on disk, committed without waiting for the flush
        assert inbox_rows(pg_dsn) == 6

        # A seal commits without waiting for the WAL flush: the crash loses it, whole.
        crash_losing(pg_server, lambda: journal.seal())

        assert inbox_rows(pg_dsn) == 6 and sealed_events(pg_dsn) == 0
        assert journal.seal() == 6  # on a new session of its own: the one before died with the server
        events = list(journal.events())
        assert_one_chain(events)
        assert [(e.call_id, e.kind) for e in events] == [
            (f"c{n}", k) for n in range(3) for k in ("pending", "committed")]
        for n in range(3):
            record = journal.get(f"c{n}")
            assert record is not None and record.status == "committed" and record.last_seq > 0
        # Nothing ran again: each call is replayed from the journal.
        for n in range(3):
            assert call(charge, f"c{n}", n + 1) == {"account": "acct", "charged": n + 1}
        assert effects == ["c0", "c1", "c2"]
        report = journal.verify()
        assert report.ok, report.problem
    finally:
        journal.close()


def test_the_sealer_thread_does_not_wait_behind_a_session_holding_the_head(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A seal under way elsewhere, or rebuild, archive or copy holding the log, for longer than the
    # journal waits on a lock: the thread looks again and again instead of waiting (and giving up),
    # and says once that the head is held.
    journal = queued_journal(pg_dsn, busy_timeout=0.3)
    effects: list[str] = []
    charge = guarded_charge(journal, effects)

    def told() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "airlock.journal"]

    try:
        with caplog.at_level("WARNING", logger="airlock.journal"), head_held(pg_dsn):
            call(charge, "held", 1)
            wait_for(lambda: any("has held the chain head for over 0.3 s" in m for m in told()),
                     "the thread to say that the head is held")
            assert inbox_rows(pg_dsn) == 2
        wait_for(lambda: inbox_rows(pg_dsn) == 0, "the thread to seal once the head was let go")
        assert len(told()) == 1, told()  # said once, and no seal failed
        assert sealed_events(pg_dsn) == 2 and effects == ["held"]
    finally:
        journal.close()
