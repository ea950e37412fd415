"""PostgresJournal while rebuild, archive or copy hold the log: what waits, what goes on, and what a
rebuild undoes. Real server, real sessions; the waits end on conditions, never on a clock."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from guard.store import Decision, EffectEvent, Verdict
from journal.postgres import PostgresJournal
from journal.postgres.writes import QUEUE

pytestmark = pytest.mark.postgres

PATIENCE = 120.0  # far beyond what a loaded machine takes; only a test gone wrong reaches it


def pending(call_id: str) -> Any:
    return lambda record: Decision(Verdict.RUN, EffectEvent("pending", call_id, "charge", attempt=1,
                                                            arguments='{"a":1}', agent_id="agent-1",
                                                            idempotency_key="k"), record)


def inbox_rows(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM inbox").fetchone()
    assert row is not None
    return int(row[0])


def test_an_append_decided_before_a_rebuild_is_decided_again_after_it(pg_dsn: str) -> None:
    # A projection row edited by hand; another replica reads it (its append is refused: the record
    # it knew is not the row's), then an operator rebuilds. Sent again on the row it read, the
    # append must not write the edited row back over the rebuilt one.
    with PostgresJournal(pg_dsn) as first, PostgresJournal(pg_dsn) as second:
        first.begin("x", pending("x"))
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE calls SET agent_id = 'someone-else' WHERE call_id = 'x'")
        assert not first.verify().ok
        real = second.datastore.resendable
        outcomes: list[str] = []

        def rebuilt_after_the_first_try(doing: str, sql: str, params: Any) -> Any:
            row = real(doing, sql, params)
            outcomes.append(row[0])
            if len(outcomes) == 1:
                assert first.rebuild() == 1 and first.verify().ok
            return row

        second.datastore.resendable = rebuilt_after_the_first_try  # type: ignore[method-assign]
        second.append(EffectEvent("committed", "x", "charge", value='{"ok":true}', agent_id="agent-1",
                                  idempotency_key="k", arguments='{"a":1}', attempt=1))
        assert outcomes[0] == "changed" and outcomes[-1] == "appended" and len(outcomes) == 3
        record = first.get("x")
        assert record is not None and record.status == "committed" and record.agent_id == "agent-1"
        report = first.verify()
        assert report.ok, report.problem


def test_reads_go_on_while_the_log_is_held(pg_dsn: str) -> None:
    # Events wait in the inbox; a rebuild-like transaction holds the log (sealing them, uncommitted).
    # A read does not wait for it: it reads the log as it was, and after the hold ends, all of it.
    with PostgresJournal(pg_dsn) as writer, PostgresJournal(pg_dsn, busy_timeout=600) as reader:
        writer.writes.seal_mode = QUEUE
        writer.sealer.poke = lambda: None  # type: ignore[method-assign]  # nothing seals but the hold
        writer.begin("a", pending("a"))
        reader.seal()
        writer.begin("b", pending("b"))
        assert inbox_rows(pg_dsn) == 1
        with psycopg.connect(pg_dsn) as hold:
            hold.execute("SELECT airlock_hold_log()")
            seen: list[Any] = []
            thread = threading.Thread(target=lambda: seen.extend([reader.head()[0], reader.verify().ok,
                                                                  [e.call_id for e in reader.events()]]))
            thread.start()
            deadline = time.monotonic() + PATIENCE
            while thread.is_alive() and time.monotonic() < deadline:
                thread.join(0.05)
            done_while_held = not thread.is_alive()
            hold.commit()
            thread.join(PATIENCE)
        assert done_while_held, "a read waited for the hold of the log"
        assert seen == [1, True, ["a"]]
        assert [e.call_id for e in reader.events()] == ["a", "b"] and inbox_rows(pg_dsn) == 0


def test_a_journal_whose_events_wait_in_the_inbox_is_not_removed_as_empty(pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn) as journal:
        journal.writes.seal_mode = QUEUE
        journal.sealer.poke = lambda: None  # type: ignore[method-assign]
        journal.begin("a", pending("a"))
        assert inbox_rows(pg_dsn) == 1
        with psycopg.connect(pg_dsn) as conn:
            assert conn.execute("SELECT count(*) FROM events").fetchone() == (0,)
        assert journal.remove_if_empty() is False
    with PostgresJournal(pg_dsn, readonly=True) as journal:
        assert [e.call_id for e in journal.events()] == ["a"] and journal.verify().ok


def test_a_replica_of_an_earlier_version_cannot_append_once_the_journal_is_of_version_6(pg_dsn: str) -> None:
    # An older replica's append, as version 5 made it: the event inserted after the head it locked,
    # and the head moved, in one transaction. Its session has not said it is of version 6.
    from journal.rows import stamp

    with PostgresJournal(pg_dsn) as journal:
        journal.begin("new", pending("new"))
        seq, head = journal.head()
    event = EffectEvent("pending", "old", "charge", attempt=1, arguments="{}")
    stored, row = stamp(event, seq + 1, head)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SELECT seq FROM chain_head WHERE id = 1 FOR UPDATE")
        conn.execute(f"INSERT INTO events VALUES ({', '.join(['%s'] * len(row))})", row)
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="upgrade the replica"):
            conn.execute("UPDATE chain_head SET seq = %s, hash = %s WHERE id = 1", (stored.seq, stored.hash))
        conn.rollback()
    with PostgresJournal(pg_dsn, readonly=True) as journal:
        assert [e.call_id for e in journal.events()] == ["new"] and journal.verify().ok
