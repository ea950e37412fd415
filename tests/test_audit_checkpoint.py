"""Checkpoints (``airlock journal checkpoint``, ``verify --checkpoint``) and a projection ahead of its
log: a log cut short or rewritten behind the journal's back is found, on both stores."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest

from journal import open_journal
from journal.chain import GENESIS
from journal.export import row_hash
from journal.rows import EVENT_COLUMNS
from tests.cli_support import Tools, invoke, seed


@pytest.fixture
def db(seeded_db: str) -> str:
    """A seeded journal: a SQLite file, or a PostgreSQL database (``seeded_db``)."""
    return seeded_db


@pytest.fixture
def key(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "audit-key.pem"
    made = invoke("journal", "keygen", "--output", str(path))
    assert made.exit_code == 0, made.output
    return path, made.stdout.strip()


def more_calls(db: str, count: int = 3) -> None:
    with open_journal(db) as journal:
        tools = Tools(journal)
        for n in range(count):
            tools.call(f"call-more-{n}", tools.charge, account="acct_7", cents=n + 1)


def cut_after(db: str, keep: int) -> None:
    """Remove every event after seq ``keep`` as someone with access to the database's files could:
    the append-only trigger dropped with plain SQL (and, in PostgreSQL, the head row set to match)."""
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("DROP TRIGGER events_append_only ON events")
            conn.execute("DELETE FROM events WHERE seq > %s", (keep,))
            conn.execute("SET airlock.layout = '6'")  # as the journal's own sessions, which may move the head
            conn.execute("UPDATE chain_head SET seq = e.seq, hash = e.hash FROM events e WHERE e.seq = %s", (keep,))
        return
    conn = sqlite3.connect(db)
    try:
        conn.execute("DROP TRIGGER events_no_delete")
        conn.execute("DELETE FROM events WHERE seq > ?", (keep,))
        conn.commit()
    finally:
        conn.close()


def checkpoint_of(db: str, *args: str) -> dict[str, Any]:
    made = invoke("journal", "checkpoint", "--db", db, *args)
    assert made.exit_code == 0, made.output
    return orjson.loads(made.stdout)  # type: ignore[no-any-return]


def test_a_checkpoint_is_the_head_of_the_journal(db: str, tmp_path: Path) -> None:
    made = checkpoint_of(db)
    with open_journal(db, readonly=True) as journal:
        seq, head_hash = journal.head()
        last = next(iter(journal.events(after_seq=seq - 1)))
    assert (made["seq"], made["hash"], made["at"]) == (seq, head_hash, last.export()["at"])
    assert made["format"] == "airlock-journal checkpoint 1" and made["created_at"].endswith("Z")
    assert "signature" not in made

    output = tmp_path / "checkpoint.json"
    written = invoke("journal", "checkpoint", "--db", db, "--output", str(output))
    assert written.exit_code == 0 and written.stdout == ""
    assert written.stderr == f"Wrote the checkpoint of seq {seq} to {output}\n"
    assert {k: v for k, v in orjson.loads(output.read_bytes()).items() if k != "created_at"} == {
        k: v for k, v in made.items() if k != "created_at"}
    ok = invoke("journal", "verify", "--db", db, "--checkpoint", str(output))
    assert ok.exit_code == 0, ok.output
    assert ok.stdout == f"OK: {seq} events, head {head_hash}\n"


def test_a_checkpoint_of_an_empty_journal_is_seq_0(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    open_journal(str(path)).close()
    made = checkpoint_of(str(path))
    assert (made["seq"], made["hash"], made["at"]) == (0, GENESIS, None)


def test_a_signed_checkpoint_is_checked_with_the_public_key(db: str, tmp_path: Path, key: tuple[Path, str]) -> None:
    key_file, public = key
    output = tmp_path / "checkpoint.json"
    assert invoke("journal", "checkpoint", "--db", db, "--sign", str(key_file), "-o", str(output)).exit_code == 0
    made = orjson.loads(output.read_bytes())
    assert made["public_key"] == public and len(made["signature"]) == 128
    ok = invoke("journal", "verify", "--db", db, "--checkpoint", str(output), "--public-key", public)
    assert ok.exit_code == 0, ok.output

    forged = dict(made, seq=made["seq"] - 1)  # an earlier head, claimed under the same signature
    output.write_bytes(orjson.dumps(forged))
    bad = invoke("journal", "verify", "--db", db, "--checkpoint", str(output), "--public-key", public)
    assert bad.exit_code == 1
    assert bad.stderr == (f"Error: {output} is not a checkpoint that can be used: its signature does not match "
                          "its contents\n")
    unsigned = tmp_path / "unsigned.json"
    unsigned.write_bytes(invoke("journal", "checkpoint", "--db", db).stdout_bytes)
    not_signed = invoke("journal", "verify", "--db", db, "--checkpoint", str(unsigned), "--public-key", public)
    assert not_signed.exit_code == 1
    assert not_signed.stderr == f"Error: {unsigned} is not a checkpoint that can be used: it is not signed\n"
    mixed = invoke("journal", "verify", "--db", db, "--checkpoint", str(unsigned), "--export", str(unsigned))
    assert mixed.exit_code == 2


def test_a_log_cut_short_after_a_checkpoint_is_found(db: str, tmp_path: Path, key: tuple[Path, str]) -> None:
    key_file, public = key
    output = tmp_path / "checkpoint.json"
    assert invoke("journal", "checkpoint", "--db", db, "--sign", str(key_file), "-o", str(output)).exit_code == 0
    checkpoint = orjson.loads(output.read_bytes())
    more_calls(db)
    assert invoke("journal", "verify", "--db", db, "--checkpoint", str(output)).exit_code == 0

    keep = checkpoint["seq"] - 2  # the end of the log removed, the checkpoint's event with it
    cut_after(db, keep)

    # The projection still remembers calls whose events are gone: verify says so, and never
    # advises the rebuild that would erase that.
    plain = invoke("journal", "verify", "--db", db)
    assert plain.exit_code == 1
    assert "events may have been removed from the end" in plain.stderr
    assert "rebuild" not in plain.stderr

    found = invoke("journal", "verify", "--db", db, "--checkpoint", str(output), "--public-key", public)
    assert found.exit_code == 1
    assert found.stderr.endswith(f"does not verify: it no longer matches the checkpoint {output}: the log ends at seq "
                                 f"{keep}, before the checkpoint's seq {checkpoint['seq']}: events have been removed "
                                 "from the end since the checkpoint\n")

    # Made to agree with itself, the shorter journal verifies alone: only the checkpoint still tells.
    assert invoke("journal", "rebuild", "--db", db).exit_code == 0
    assert invoke("journal", "verify", "--db", db).exit_code == 0
    more_calls(db, 5)  # and new events past the old seq do not hide it either
    still = invoke("journal", "verify", "--db", db, "--checkpoint", str(output), "--public-key", public)
    assert still.exit_code == 1
    assert f"the log has been rewritten at or before seq {checkpoint['seq']} since the checkpoint" in still.stderr


def test_a_log_rewritten_before_a_checkpoint_is_found(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    seed(path)
    output = tmp_path / "checkpoint.json"
    assert invoke("journal", "checkpoint", "--db", str(path), "-o", str(output)).exit_code == 0
    # A committed value changed, and every hash from there on computed again.
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER events_no_update")
    conn.execute("UPDATE events SET value = '{\"charge_id\":\"ch_999\",\"cents\":500}' WHERE seq = 2")
    prev = GENESIS
    for row in conn.execute(f"SELECT {', '.join(EVENT_COLUMNS)} FROM events ORDER BY seq").fetchall():
        fixed = (*row[:14], prev, row[15])
        prev = row_hash(fixed)
        conn.execute("UPDATE events SET prev_hash = ?, hash = ? WHERE seq = ?", (fixed[14], prev, row[0]))
    conn.commit()
    conn.close()
    assert invoke("journal", "rebuild", "--db", str(path)).exit_code == 0
    assert invoke("journal", "verify", "--db", str(path)).exit_code == 0  # consistent with itself
    found = invoke("journal", "verify", "--db", str(path), "--checkpoint", str(output))
    assert found.exit_code == 1
    seq = orjson.loads(output.read_bytes())["seq"]
    assert f"the log has been rewritten at or before seq {seq} since the checkpoint" in found.stderr


def test_a_stale_projection_is_told_from_one_ahead_of_its_log(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    seed(path)
    conn = sqlite3.connect(path)
    before = conn.execute("SELECT * FROM calls WHERE call_id = 'call-timeout'").fetchone()
    conn.close()
    resolved = invoke("journal", "resolve", "call-timeout", "--not-applied", "--reason", "no charge", "--db",
                      str(path))
    assert resolved.exit_code == 0, resolved.output
    # The row as it was before the resolve: behind its log, which a rebuild puts right.
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM calls WHERE call_id = 'call-timeout'")
    conn.execute(f"INSERT INTO calls VALUES ({', '.join('?' * len(before))})", before)
    conn.commit()
    conn.close()
    stale = invoke("journal", "verify", "--db", str(path))
    assert stale.exit_code == 1
    assert stale.stderr.endswith("the projection of call 'call-timeout' differs from the log; run rebuild\n")
    assert "removed from the end" not in stale.stderr
    assert invoke("journal", "rebuild", "--db", str(path)).exit_code == 0
    assert invoke("journal", "verify", "--db", str(path)).exit_code == 0

    # The resolve's event removed from the end: the projection is now ahead of its log.
    head = invoke("journal", "checkpoint", "--db", str(path))
    cut_after(str(path), orjson.loads(head.stdout)["seq"] - 1)
    ahead = invoke("journal", "verify", "--db", str(path), "--json")
    assert ahead.exit_code == 1
    report = orjson.loads(ahead.stdout)
    assert report["problem"].startswith("the projection of call 'call-timeout' records seq")
    assert "events may have been removed from the end" in report["problem"]
    assert "rebuild" not in report["problem"] and "rebuild" not in ahead.stderr
