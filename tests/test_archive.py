"""``airlock journal archive`` on both stores: the oldest events move into an export file, the journal
verifies alone from the archive's head, archives and journal verify as one chain, and no call is
forgotten (a retry of an archived call is replayed or refused, never run again)."""

from __future__ import annotations

import sqlite3
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest

from journal import JournalError, open_journal
from journal.archive import ArchiveStore
from journal.chain import GENESIS
from tests.cli_support import Tools, invoke, seed


@pytest.fixture
def db(seeded_db: str) -> str:
    """A seeded journal: a SQLite file, or a PostgreSQL database (``seeded_db``)."""
    return seeded_db


def now() -> str:
    return datetime.now(UTC).isoformat()


def more_calls(db: str, prefix: str, count: int = 3) -> Tools:
    with open_journal(db) as journal:
        tools = Tools(journal)
        for n in range(count):
            tools.call(f"{prefix}-{n}", tools.charge, account="acct_9", cents=n + 1)
    return tools


def archive(db: str, before: str, output: Path, *more: str) -> None:
    done = invoke("journal", "archive", "--db", db, "--before", before, "--output", str(output), *more)
    assert done.exit_code == 0, done.output


def verify(*args: str) -> tuple[int, str, str]:
    result = invoke("journal", "verify", *args)
    return result.exit_code, result.stdout, result.stderr


def export_lines(db: str) -> list[bytes]:
    result = invoke("journal", "export", "--db", db)
    assert result.exit_code == 0, result.output
    return result.stdout_bytes.splitlines()


def archived(journal: object) -> tuple[int, str]:
    assert isinstance(journal, ArchiveStore)
    return journal.archived_head()


def test_archive_moves_the_older_events_into_an_export_and_the_rest_verifies(db: str, tmp_path: Path) -> None:
    cut = now()
    more_calls(db, "later")
    before = export_lines(db)
    with open_journal(db, readonly=True) as journal:
        head = journal.head()
        kept = [e.seq for e in journal.events(since=datetime.fromisoformat(cut))]
    output = tmp_path / "a1.jsonl"
    done = invoke("journal", "archive", "--db", db, "--before", cut, "-o", str(output))
    assert done.exit_code == 0, done.output
    moved = head[0] - len(kept)
    last = orjson.loads(before[moved - 1])
    assert done.stdout == f"Archived {moved} events (seq 1 to {moved}, head {last['hash']}) to {output}.\n"

    # The archive is the export of those events, byte for byte; the journal holds the others.
    assert output.read_bytes().splitlines() == before[:moved]
    assert export_lines(db) == before[moved:]
    with open_journal(db, readonly=True) as journal:
        assert journal.head() == head
        assert archived(journal) == (moved, last["hash"])
        assert [e.seq for e in journal.events()] == kept
        report = journal.verify()
    assert (report.ok, report.events, report.head) == (True, len(kept), head[1])

    assert verify("--db", db) == (0, f"OK: {len(kept)} events, head {head[1]}\n", "")
    assert verify("--export", str(output)) == (0, f"OK: {moved} events, head {last['hash']}\n", "")
    assert verify("--export", str(output), "--db", db) == (0, f"OK: {head[0]} events, head {head[1]}\n", "")


def test_an_archived_call_is_never_run_again(db: str, tmp_path: Path) -> None:
    archive(db, now(), tmp_path / "a1.jsonl")
    with open_journal(db) as journal:
        tools = Tools(journal)
        # call-ok committed: its retry replays the value; call-timeout unknown: refused; neither runs.
        assert tools.call("call-ok", tools.charge, account="acct_1", cents=500) == {"charge_id": "ch_1", "cents": 500}
        refused = tools.call("call-timeout", tools.charge, account="acct_2", cents=700)
        assert isinstance(refused, dict) and refused["block_reason"] == "effect_status_unknown"
        assert tools.payments.charges == []
        # call-failed was released: it may run again, and does, once.
        tools.call("call-failed", tools.charge, account="acct_3", cents=900)
        assert tools.payments.charges == [("acct_3", 900)]
        assert [e.kind for e in journal.call_events("call-ok")] == ["replayed"]
        # The operator settles the archived call in doubt; the journal still verifies.
        journal.resolve("call-timeout", applied=False, reason="no charge at the backend", operator="ops")
        record = journal.call("call-timeout")
        assert record is not None and record.status == "released"
        assert journal.verify().ok


def test_rebuild_after_an_archive_folds_the_rest_of_the_log_onto_the_archived_projection(
    db: str, tmp_path: Path
) -> None:
    archive(db, now(), tmp_path / "a1.jsonl")
    more_calls(db, "later")
    with open_journal(db, readonly=True) as journal:
        calls = journal.calls(limit=None)
    # The projection altered by hand, for an archived call and a later one: verify finds both.
    for call_id in ("call-ok", "later-1"):
        _delete_call(db, call_id)
        code, _, stderr = verify("--db", db)
        assert code == 1 and f"the projection lacks call {call_id!r}; run rebuild" in stderr
        rebuilt = invoke("journal", "rebuild", "--db", db)
        assert rebuilt.exit_code == 0 and rebuilt.stdout == f"Rebuilt the projection: {len(calls)} calls\n"
        with open_journal(db, readonly=True) as journal:
            assert journal.calls(limit=None) == calls
        assert verify("--db", db)[0] == 0
    # An archived call in doubt set to released by hand (so that it would run again) is found too.
    _sql(db, "UPDATE calls SET status = 'released' WHERE call_id = 'call-timeout'")
    code, _, stderr = verify("--db", db)
    assert code == 1 and "the projection of call 'call-timeout' differs from the log; run rebuild" in stderr
    assert invoke("journal", "rebuild", "--db", db).exit_code == 0
    with open_journal(db, readonly=True) as journal:
        assert journal.calls(limit=None) == calls
    # A row no event made, past the start, is dropped; a projection wiped out comes back whole.
    _sql(db, "INSERT INTO calls SELECT 'forged', tool, status, attempt, agent_id, idempotency_key, arguments, "
             "value, error, reason, actor, owner, created_at, updated_at, since, last_seq FROM calls "
             "WHERE call_id = 'later-1'")
    assert verify("--db", db)[0] == 1
    assert invoke("journal", "rebuild", "--db", db).exit_code == 0
    _sql(db, "DELETE FROM calls")
    assert verify("--db", db)[0] == 1
    rebuilt = invoke("journal", "rebuild", "--db", db)
    assert rebuilt.exit_code == 0 and rebuilt.stdout == f"Rebuilt the projection: {len(calls)} calls\n"
    with open_journal(db, readonly=True) as journal:
        assert journal.calls(limit=None) == calls
    assert verify("--db", db)[0] == 0


def _delete_call(db: str, call_id: str) -> None:
    _sql(db, f"DELETE FROM calls WHERE call_id = '{call_id}'")


def _sql(db: str, statement: str) -> None:
    """Change the journal's tables behind its back, as anyone with access to its files could."""
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(statement.encode())
        return
    conn = sqlite3.connect(db)
    with conn:
        conn.execute(statement)
    conn.close()


def test_archiving_twice_continues_from_the_last_archived_head(db: str, tmp_path: Path) -> None:
    first, second = tmp_path / "a1.jsonl", tmp_path / "a2.jsonl"
    archive(db, now(), first)
    more_calls(db, "middle")
    cut = now()
    more_calls(db, "later")
    archive(db, cut, second)
    with open_journal(db, readonly=True) as journal:
        head = journal.head()
        journal_events = journal.count_events()
        last_archived = archived(journal)
    a1 = [orjson.loads(line) for line in first.read_bytes().splitlines()]
    a2 = [orjson.loads(line) for line in second.read_bytes().splitlines()]
    assert a2[0]["seq"] == a1[-1]["seq"] + 1 and a2[0]["prev_hash"] == a1[-1]["hash"]
    assert last_archived == (a2[-1]["seq"], a2[-1]["hash"])
    assert len(a1) + len(a2) + journal_events == head[0]

    assert verify("--export", str(first), "--export", str(second), "--db", db) == (
        0, f"OK: {head[0]} events, head {head[1]}\n", "")
    # The second archive alone starts after the first: its start is not checked without the first.
    code, _, stderr = verify("--export", str(second))
    assert code == 1 and f"the first event is seq {a2[0]['seq']}, not seq 1" in stderr
    assert verify("--export", str(second), "--allow-gaps")[0] == 0
    # Left out, or out of order, an archive breaks the chain.
    code, _, stderr = verify("--export", str(first), "--db", db)
    assert code == 1 and "events are missing" in stderr
    code, _, stderr = verify("--export", str(second), "--export", str(first))
    assert code == 1


def test_a_signed_archive_verifies_alone_and_in_the_chain(db: str, tmp_path: Path) -> None:
    key_file = tmp_path / "key.pem"
    made = invoke("journal", "keygen", "--output", str(key_file))
    assert made.exit_code == 0, made.output
    public = made.stdout.strip()
    first, second = tmp_path / "a1.jsonl", tmp_path / "a2.jsonl"
    archive(db, now(), first, "--sign", str(key_file))
    more_calls(db, "later")
    archive(db, now(), second, "--sign", str(key_file))
    manifest = orjson.loads((tmp_path / "a2.jsonl.manifest.json").read_bytes())
    lines = second.read_bytes().splitlines()
    assert manifest["events"] == len(lines) and manifest["first_seq"] == orjson.loads(lines[0])["seq"]
    assert verify("--export", str(second), "--public-key", public)[0] == 0
    with open_journal(db, readonly=True) as journal:
        head = journal.head()
    assert verify("--export", str(first), "--export", str(second), "--public-key", public, "--db", db) == (
        0, f"OK: {head[0]} events, head {head[1]}\n", "")
    second.write_bytes(second.read_bytes().replace(b'"acct_9"', b'"acct_8"', 1))
    code, _, stderr = verify("--export", str(second), "--public-key", public)
    assert code == 1 and "the file has been changed since it was signed" in stderr


def test_the_log_stays_append_only_after_an_archive(db: str, tmp_path: Path) -> None:
    archive(db, now(), tmp_path / "a1.jsonl")
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as conn, pytest.raises(psycopg.errors.IntegrityConstraintViolation):
            conn.execute("DELETE FROM events")
        with psycopg.connect(db, autocommit=True) as conn, pytest.raises(psycopg.errors.IntegrityConstraintViolation):
            # The flag the archive's own function sets lets nothing through outside it for a role
            # without DELETE; for the owner, who may switch triggers off anyway, it is documented.
            conn.execute("UPDATE events SET tool = 'x'")
        return
    conn = sqlite3.connect(db)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("DELETE FROM events")
    finally:
        conn.close()


def _state(db: str) -> tuple[tuple[int, str], tuple[int, str], list[bytes]]:
    with open_journal(db, readonly=True) as journal:
        return journal.head(), archived(journal), export_lines(db)


@pytest.mark.parametrize(("before", "code", "message"), [
    ("last tuesday", 2, "Error: Invalid value for '--before': 'last tuesday' is not a time"),
    ("2999-01-01", 2, "Error: Invalid value for '--before': 2999-01-01T00:00:00.000000Z is in the future"),
])
def test_a_bad_date_is_one_error_line_and_changes_nothing(db: str, tmp_path: Path, before: str, code: int,
                                                          message: str) -> None:
    state = _state(db)
    output = tmp_path / "a1.jsonl"
    result = invoke("journal", "archive", "--db", db, "--before", before, "-o", str(output))
    assert result.exit_code == code
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert not output.exists() and _state(db) == state


def test_an_output_that_exists_is_an_error_and_changes_nothing(db: str, tmp_path: Path) -> None:
    state = _state(db)
    output = tmp_path / "a1.jsonl"
    output.write_bytes(b"keep me\n")
    result = invoke("journal", "archive", "--db", db, "--before", now(), "-o", str(output))
    assert (result.exit_code, result.stderr) == (
        1, f"Error: {output} exists: an archive is written to a new file (keep that one)\n")
    assert output.read_bytes() == b"keep me\n" and _state(db) == state
    missing = invoke("journal", "archive", "--db", db, "--before", now())
    assert missing.exit_code == 2 and "Missing option '--output'" in missing.stderr


def test_nothing_older_than_the_date_archives_nothing(db: str, tmp_path: Path) -> None:
    state = _state(db)
    output = tmp_path / "a1.jsonl"
    long_ago = (datetime.now(UTC) - timedelta(days=3650)).isoformat()
    result = invoke("journal", "archive", "--db", db, "--before", long_ago, "-o", str(output))
    assert result.exit_code == 0 and result.stdout.startswith("Nothing to archive")
    assert not output.exists() and _state(db) == state


def test_the_last_event_always_stays_in_the_journal(db: str, tmp_path: Path) -> None:
    with open_journal(db, readonly=True) as journal:
        head = journal.head()
    archive(db, now(), tmp_path / "a1.jsonl")
    with open_journal(db, readonly=True) as journal:
        assert [e.seq for e in journal.events()] == [head[0]]
        assert archived(journal)[0] == head[0] - 1
    again = invoke("journal", "archive", "--db", db, "--before", now(), "-o", str(tmp_path / "a2.jsonl"))
    assert again.exit_code == 0 and again.stdout.startswith("Nothing to archive")
    # New calls chain on from the event that stayed.
    more_calls(db, "later", 1)
    assert verify("--export", str(tmp_path / "a1.jsonl"), "--db", db)[0] == 0


def test_a_journal_that_does_not_verify_is_not_archived(db: str, tmp_path: Path) -> None:
    _delete_call(db, "call-ok")
    state = _state(db)
    output = tmp_path / "a1.jsonl"
    result = invoke("journal", "archive", "--db", db, "--before", now(), "-o", str(output))
    assert result.exit_code == 1
    assert "does not verify" in result.stderr and result.stderr.endswith("nothing was archived\n")
    assert not output.exists() and _state(db) == state


def test_a_plan_made_stale_by_another_archive_is_refused(db: str, tmp_path: Path) -> None:
    from journal.archive import plan_archive

    cut = datetime.now(UTC)
    more_calls(db, "later")
    with open_journal(db) as journal:
        assert isinstance(journal, ArchiveStore)
        plan = plan_archive(journal, cut)
        assert plan is not None and (plan.base_seq, plan.base_hash) == (0, GENESIS)
        assert journal.commit_archive(plan, "a1.jsonl", now()) == plan.events
        with pytest.raises(JournalError, match="another archive moved the start of the log"):
            journal.commit_archive(plan, "again.jsonl", now())
        assert journal.verify().ok


def test_archive_help_has_an_example() -> None:
    result = invoke("journal", "archive", "--help")
    assert result.exit_code == 0 and "Example:" in result.stdout
    assert "airlock journal archive --before 90d" in result.stdout


def test_sqlite_gives_the_space_back(tmp_path: Path) -> None:
    path = tmp_path / "big.db"
    with open_journal(str(path)) as journal:
        tools = Tools(journal)
        for n in range(300):
            with suppress(Exception):
                tools.call(f"c{n}", tools.charge, account="x" * 2000, cents=n)
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA auto_vacuum").fetchone() == (2,)  # a new journal: incremental
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        moved = conn.execute("SELECT sum(length(arguments)) FROM events").fetchone()[0]
    finally:
        conn.close()
    size = path.stat().st_size
    archive(str(path), now(), tmp_path / "a1.jsonl")
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA freelist_count").fetchone() == (0,)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    # The events' pages are given back (each call keeps its row, and its row as of the archive).
    assert path.stat().st_size < size - moved * 0.8


def test_copy_of_a_journal_whose_start_is_archived_verifies_with_its_archive(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    seed(path)
    archive(str(path), now(), tmp_path / "a1.jsonl")
    copied = invoke("journal", "copy", "--from", str(path), "--to", str(tmp_path / "copy.db"))
    assert copied.exit_code == 0, copied.output
    assert verify("--db", str(tmp_path / "copy.db"))[0] == 0
    assert verify("--export", str(tmp_path / "a1.jsonl"), "--db", str(tmp_path / "copy.db"))[0] == 0


def test_an_output_in_a_directory_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    seed(path)
    state = _state(str(path))
    output = tmp_path / "no-such-dir" / "a1.jsonl"
    result = invoke("journal", "archive", "--db", str(path), "--before", now(), "-o", str(output))
    assert (result.exit_code, result.stderr) == (
        1, f"Error: cannot write the archive to {output}: its directory does not exist\n")
    assert _state(str(path)) == state
