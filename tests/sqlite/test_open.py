"""Opening a journal: what is created, what is refused, and that a refused file is left byte-for-byte unchanged."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from guard.store import EffectEvent
from journal import (
    JournalError,
    JournalNotFound,
    NewerSchema,
    NotAJournal,
    SQLiteJournal,
    StoreBusy,
    open_journal,
)
from journal.sqlite.schema import APPLICATION_ID, LATEST


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def pending(call_id: str = "c1") -> EffectEvent:
    return EffectEvent(kind="pending", call_id=call_id, tool="charge", attempt=1, arguments='{"cents":5}')


def make_journal(path: Path) -> None:
    with SQLiteJournal(path, durability="process") as j:
        j.append(pending())


def foreign_sqlite(path: Path, *, rows: bool) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, name TEXT)")
    if rows:
        conn.execute("INSERT INTO events (name) VALUES ('x')")
    conn.commit()
    conn.close()


# -- what a new journal is ---------------------------------------------------------------------


def test_new_journal_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with SQLiteJournal(path) as j:
        j.append(pending())
        for name in ("j.db", "j.db-wal", "j.db-shm"):
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name


def test_new_journal_has_the_schema_version_and_marker(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    SQLiteJournal(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (LATEST,)
    assert conn.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"events", "calls", "meta"} <= tables
    columns = [r[1] for r in conn.execute("PRAGMA table_info(events)")]
    assert columns == ["seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "arguments",
                       "value", "error", "reason", "actor", "attempt", "owner", "prev_hash", "hash"]
    conn.close()


def test_reopening_keeps_every_event(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    make_journal(path)
    with SQLiteJournal(path) as j:
        assert j.get("c1") is not None
        assert j.head()[0] == 1
        assert j.verify().ok


def test_a_blank_file_becomes_a_journal(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    path.touch()
    with SQLiteJournal(path) as j:
        j.append(pending())
        assert j.verify().ok


def test_create_false_refuses_a_missing_journal(tmp_path: Path) -> None:
    with pytest.raises(JournalNotFound, match=r"j\.db"):
        SQLiteJournal(tmp_path / "j.db", create=False)
    assert listing(tmp_path) == []


# -- read-only opens ---------------------------------------------------------------------------


def test_readonly_open_of_a_missing_journal_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(JournalNotFound, match=r"There is no journal at .*j\.db"):
        SQLiteJournal(tmp_path / "j.db", readonly=True)
    with pytest.raises(JournalNotFound):
        open_journal(str(tmp_path / "j.db"), readonly=True)
    assert listing(tmp_path) == []


def test_readonly_open_reads_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    make_journal(path)
    before = digest(path)
    with SQLiteJournal(path, readonly=True) as j:
        assert j.get("c1") is not None
        assert [e.kind for e in j.events()] == ["pending"]
        assert j.verify().ok
        assert j.stats().calls == 1
        with pytest.raises(JournalError, match="read-only"):
            j.append(pending("c2"))
        with pytest.raises(JournalError, match="read-only"):
            j.rebuild()
    assert digest(path) == before
    with SQLiteJournal(path, readonly=True) as j:
        assert j.head()[0] == 1


def test_a_reader_takes_away_the_side_files_reading_made(tmp_path: Path) -> None:
    # A journal closed cleanly is one file; a read-only open needs a -wal and a -shm to read it, and
    # on close they go again, with the file as it was.
    path = tmp_path / "j.db"
    make_journal(path)
    assert listing(tmp_path) == ["j.db"]
    before = digest(path)
    with SQLiteJournal(path, readonly=True) as j:
        assert j.verify().ok
        assert listing(tmp_path) == ["j.db", "j.db-shm", "j.db-wal"]
    assert listing(tmp_path) == ["j.db"]
    assert digest(path) == before


def test_a_reader_leaves_the_side_files_a_writer_still_needs(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    make_journal(path)
    reader = SQLiteJournal(path, readonly=True)
    assert reader.head()[0] == 1
    with SQLiteJournal(path, durability="process") as writer:
        writer.append(pending("c2"))
        reader.close()  # another connection has the file open: its -wal holds the last event
        assert listing(tmp_path) == ["j.db", "j.db-shm", "j.db-wal"]
        writer.append(pending("c3"))
    with SQLiteJournal(path, readonly=True) as j:
        assert [e.call_id for e in j.events()] == ["c1", "c2", "c3"]
    assert listing(tmp_path) == ["j.db"]


def test_a_reader_of_a_journal_left_with_its_wal_keeps_both_as_they_were(tmp_path: Path) -> None:
    # A writer killed before it closed leaves its last events in the -wal: a reader reads them there
    # and neither copies them into the file nor takes the -wal away.
    path = tmp_path / "j.db"
    make_journal(path)
    script = (
        "import os, sys\n"
        "from guard.store import EffectEvent\n"
        "from journal import SQLiteJournal\n"
        "j = SQLiteJournal(sys.argv[1], durability='process')\n"
        "j.append(EffectEvent(kind='pending', call_id='c2', tool='charge', attempt=1))\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=60)
    wal = tmp_path / "j.db-wal"
    assert wal.stat().st_size > 0
    before = (digest(path), digest(wal))
    with SQLiteJournal(path, readonly=True) as j:
        assert j.head()[0] == 2
    assert (digest(path), digest(wal)) == before
    assert listing(tmp_path) == ["j.db", "j.db-shm", "j.db-wal"]


def test_readonly_blank_file_is_not_a_journal(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    path.touch()
    with pytest.raises(NotAJournal):
        SQLiteJournal(path, readonly=True)
    assert path.read_bytes() == b""


# -- foreign and newer files ---------------------------------------------------------------------


@pytest.mark.parametrize("readonly", [False, True])
def test_garbage_bytes_are_not_a_journal(tmp_path: Path, readonly: bool) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes\n" * 100)
    before = digest(path)
    with pytest.raises(NotAJournal, match=r"notes\.db is not a SQLite database"):
        SQLiteJournal(path, readonly=readonly)
    assert digest(path) == before
    assert listing(tmp_path) == ["notes.db"]


@pytest.mark.parametrize("readonly", [False, True])
def test_a_corrupt_sqlite_file_is_not_a_journal(tmp_path: Path, readonly: bool) -> None:
    path = tmp_path / "j.db"
    path.write_bytes(b"SQLite format 3\x00" + os.urandom(4000))
    before = digest(path)
    with pytest.raises(NotAJournal):
        SQLiteJournal(path, readonly=readonly)
    assert digest(path) == before


@pytest.mark.parametrize("rows", [False, True], ids=["empty", "with-rows"])
@pytest.mark.parametrize("readonly", [False, True])
def test_another_applications_sqlite_db_is_not_a_journal(tmp_path: Path, rows: bool, readonly: bool) -> None:
    path = tmp_path / "app.db"
    foreign_sqlite(path, rows=rows)
    before = digest(path)
    with pytest.raises(NotAJournal, match=r"app\.db is a SQLite database of another application"):
        SQLiteJournal(path, readonly=readonly)
    assert digest(path) == before
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    conn.close()


def test_a_foreign_db_with_only_a_user_version_is_not_a_journal(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 3")
    conn.close()
    before = digest(path)
    with pytest.raises(NotAJournal):
        SQLiteJournal(path)
    assert digest(path) == before


@pytest.mark.parametrize("statement", [
    "CREATE VIEW answer AS SELECT 42 AS value",
    "CREATE TEMP TABLE t (x); CREATE VIEW v AS SELECT 1",
], ids=["a-view", "a-view-beside-a-temporary-table"])
def test_a_db_of_views_alone_is_not_a_journal(tmp_path: Path, statement: str) -> None:
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.executescript(statement)
    conn.close()
    before = digest(path)
    with pytest.raises(NotAJournal, match=r"app\.db is a SQLite database of another application"):
        SQLiteJournal(path)
    assert digest(path) == before
    assert listing(tmp_path) == ["app.db"]


@pytest.mark.parametrize("readonly", [False, True])
def test_a_newer_schema_is_refused_unchanged(tmp_path: Path, readonly: bool) -> None:
    path = tmp_path / "j.db"
    make_journal(path)
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {LATEST + 1}")
    conn.execute("PRAGMA journal_mode = DELETE")  # fold the WAL in, so the one file is all of it
    conn.close()
    before = digest(path)
    with pytest.raises(NewerSchema, match=f"schema version {LATEST + 1}"):
        SQLiteJournal(path, readonly=readonly)
    assert digest(path) == before


@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("what", ["newer", "foreign"])
def test_a_refused_file_in_wal_mode_gains_no_side_files(tmp_path: Path, readonly: bool, what: str) -> None:
    # A WAL-mode database closed cleanly is one file; refusing it leaves no -wal or -shm beside it.
    path = tmp_path / "j.db"
    if what == "newer":
        make_journal(path)
        conn = sqlite3.connect(path)
        conn.execute(f"PRAGMA user_version = {LATEST + 1}")
    else:
        foreign_sqlite(path, rows=True)
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA journal_mode = WAL")
    conn.close()
    before, files = digest(path), listing(tmp_path)
    assert files == ["j.db"]
    with pytest.raises(NewerSchema if what == "newer" else NotAJournal):
        SQLiteJournal(path, readonly=readonly)
    assert (digest(path), listing(tmp_path)) == (before, files)


def test_a_journal_at_the_latest_version_opens_while_another_process_writes(tmp_path: Path) -> None:
    # Opening needs no write lock when there is nothing to make or migrate.
    path = tmp_path / "j.db"
    make_journal(path)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with SQLiteJournal(path, busy_timeout=0.2) as j:
            assert j.head()[0] == 1 and j.get("c1") is not None
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match=re.escape(str(tmp_path))):
        SQLiteJournal(tmp_path)


# -- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize("durability", ["fast", "", None])
def test_bad_durability_is_refused_before_anything_is_created(tmp_path: Path, durability: object) -> None:
    with pytest.raises(ValueError, match="durability"):
        SQLiteJournal(tmp_path / "j.db", durability=durability)  # type: ignore[arg-type]
    assert listing(tmp_path) == []


@pytest.mark.parametrize("timeout", [-1, "5", True, float("nan")])
def test_bad_busy_timeout_is_refused(tmp_path: Path, timeout: object) -> None:
    with pytest.raises(ValueError, match="busy_timeout"):
        SQLiteJournal(tmp_path / "j.db", busy_timeout=timeout)  # type: ignore[arg-type]
    assert listing(tmp_path) == []


@pytest.mark.parametrize("target", [":memory:", "file:j.db?mode=memory"])
def test_only_a_file_path_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="path of a file"):
        SQLiteJournal(target)
    assert listing(tmp_path) == []


def test_open_journal_gives_a_sqlite_journal_for_a_path(tmp_path: Path) -> None:
    with open_journal(str(tmp_path / "j.db"), durability="process") as j:
        assert isinstance(j, SQLiteJournal)
        assert j.durability == "process"
        assert j.path == tmp_path / "j.db"


def test_a_closed_journal_says_so(tmp_path: Path) -> None:
    j = SQLiteJournal(tmp_path / "j.db")
    j.close()
    j.close()
    with pytest.raises(JournalError, match="closed"):
        j.get("c1")


def test_a_journal_locked_by_another_process_is_busy_not_foreign(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    make_journal(path)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        for readonly in (False, True):
            with pytest.raises(StoreBusy, match="locked"):
                SQLiteJournal(path, busy_timeout=0.2, readonly=readonly)
    finally:
        holder.execute("COMMIT")
        holder.close()
    with SQLiteJournal(path) as j:
        assert j.head()[0] == 1


# -- migrations --------------------------------------------------------------------------------


def test_an_older_journal_is_migrated_on_a_writable_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from journal.sqlite import schema

    path = tmp_path / "j.db"
    make_journal(path)

    def add_notes(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE notes (seq INTEGER PRIMARY KEY, text TEXT NOT NULL)")

    monkeypatch.setitem(schema.MIGRATIONS, LATEST + 1, add_notes)
    monkeypatch.setattr(schema, "LATEST", LATEST + 1)
    monkeypatch.setattr(schema, "READABLE_FROM", LATEST + 1)  # a migration that changes what reads see
    with pytest.raises(JournalError, match="needs migrating"):
        SQLiteJournal(path, readonly=True)
    with SQLiteJournal(path) as j:
        assert j.get("c1") is not None and j.verify().ok
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (LATEST + 1,)
    assert conn.execute("SELECT count(*) FROM notes").fetchone() == (0,)
    conn.close()


def test_a_failing_migration_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from journal.sqlite import schema

    path = tmp_path / "j.db"
    make_journal(path)

    def half_done(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE notes (text TEXT)")
        conn.execute("INSERT INTO no_such_table VALUES (1)")

    monkeypatch.setitem(schema.MIGRATIONS, LATEST + 1, half_done)
    monkeypatch.setattr(schema, "LATEST", LATEST + 1)
    with pytest.raises(JournalError, match="no_such_table"):
        SQLiteJournal(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (LATEST,)
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'notes'").fetchone() is None
    conn.close()


def test_a_version_1_journal_gains_the_replace_guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from journal.sqlite import schema

    path = tmp_path / "j.db"
    monkeypatch.setattr(schema, "LATEST", 1)
    make_journal(path)
    monkeypatch.undo()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (1,)
    conn.close()
    before = digest(path)
    with SQLiteJournal(path, readonly=True) as j:  # readable as it is, and left as it was
        assert j.get("c1") is not None and j.verify().ok
    assert digest(path) == before
    with SQLiteJournal(path) as j:
        assert j.verify().ok
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (LATEST,)
    row = conn.execute("SELECT * FROM events WHERE seq = 1").fetchone()
    forged = (*row[:4], "forged", *row[5:])
    for verb in ("INSERT OR REPLACE INTO", "REPLACE INTO"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute(f"{verb} events VALUES ({','.join('?' * len(row))})", forged)
    assert conn.execute("SELECT tool FROM events WHERE seq = 1").fetchone() == (row[4],)
    conn.close()


def test_a_version_2_journal_gets_the_ascending_index_and_lists_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from journal.sqlite import schema

    path = tmp_path / "j.db"
    monkeypatch.setattr(schema, "LATEST", 2)
    with SQLiteJournal(path, durability="process") as j:
        for n in range(5):
            j.append(pending(f"c{n}"))
    monkeypatch.undo()
    before = digest(path)
    with SQLiteJournal(path, readonly=True) as j:  # readable as it is, and left as it was
        old_order = [c.call_id for c in j.calls()]
        assert old_order == ["c4", "c3", "c2", "c1", "c0"]
        assert [c.call_id for c in j.calls(status="pending", limit=2)] == ["c4", "c3"]
    assert digest(path) == before
    with SQLiteJournal(path) as j:
        assert [c.call_id for c in j.calls()] == old_order
        assert j.verify().ok
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (LATEST,)
    sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'calls_updated_at'").fetchone()[0]
    assert "DESC" not in sql and "(updated_at, call_id)" in sql
    conn.close()


@pytest.mark.parametrize("filters", [{}, {"status": "unknown"}, {"tool": "pay", "agent_id": "a1"},
                                     {"since": datetime(2026, 1, 1, tzinfo=UTC)}])
def test_newest_first_reads_walk_the_index_without_sorting(tmp_path: Path, filters: dict[str, Any]) -> None:
    # What `airlock journal show` runs must stop after --limit rows, not sort every call first.
    path = tmp_path / "j.db"
    make_journal(path)
    with SQLiteJournal(path) as j:
        statements: list[str] = []
        j.datastore.current.set_trace_callback(statements.append)
        j.calls(**filters)
        j.datastore.current.set_trace_callback(None)
    select = next(s for s in statements if s.startswith("SELECT") and "FROM calls" in s)
    conn = sqlite3.connect(path)
    details = " | ".join(row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {select}"))
    conn.close()
    assert "calls_updated_at" in details and "TEMP B-TREE" not in details, details


def test_a_fifo_is_not_a_journal_and_is_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "j.db"
    os.mkfifo(fifo)
    code = (f"from journal import SQLiteJournal, NotAJournal\n"
            f"for readonly in (True, False):\n"
            f"    try:\n"
            f"        SQLiteJournal({str(fifo)!r}, readonly=readonly)\n"
            f"    except NotAJournal as e:\n"
            f"        print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines() == [f"The file {fifo} is not a regular file, not an airlock journal; "
                                        "it was left unchanged."] * 2, done.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_journal_with_a_name_that_is_not_utf8_is_read(tmp_path: Path) -> None:
    path = tmp_path / os.fsdecode(b"bad\xff.db")
    make_journal(path)
    with SQLiteJournal(path, readonly=True) as j:
        assert j.get("c1") is not None and j.verify().ok
        assert sum(n for _, n in j.export_lines()) == 1


def test_a_journal_in_a_directory_the_reader_cannot_write_is_read(tmp_path: Path) -> None:
    # An archived journal: closed cleanly, the file and its directory read-only for the reader,
    # who cannot make the -shm file that reading a WAL database needs.
    archive = tmp_path / "archive"
    archive.mkdir()
    path = archive / "j.db"
    make_journal(path)
    assert listing(archive) == ["j.db"]
    prefix: list[str] = []
    if os.geteuid() == 0:  # root writes anywhere; drop the capabilities that let it
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to read as root without the right to ignore file modes")
        prefix = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                  "--bounding-set=-dac_override,-dac_read_search"]
    code = (f"from journal import SQLiteJournal\n"
            f"j = SQLiteJournal({str(path)!r}, readonly=True)\n"
            f"print(j.get('c1').status, j.verify().ok, sum(n for _, n in j.export_lines()))\n")
    path.chmod(0o444)
    archive.chmod(0o555)
    try:
        done = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    finally:
        archive.chmod(0o755)
        path.chmod(0o644)
    assert done.stdout.split() == ["pending", "True", "1"], done.stderr[-1500:]
    assert listing(archive) == ["j.db"]


def test_an_archive_read_sees_a_writer_that_comes_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read as immutable (its directory not writable by the reader), then written by its owner: the
    # reader must not go on reading the file as it was, nor read pages a checkpoint is rewriting.
    from journal.sqlite import schema

    path = tmp_path / "j.db"
    make_journal(path)
    real_access = os.access
    monkeypatch.setattr(schema.os, "access",
                        lambda p, mode: False if Path(p) == tmp_path else real_access(p, mode))
    reader = SQLiteJournal(path, readonly=True)
    assert reader.stats().events == 1
    with SQLiteJournal(path, durability="process") as writer:
        for n in range(2000):
            writer.append(pending(f"w{n}"))
        assert reader.stats().events == 2001
        assert len(reader.calls(limit=None)) == 2001
        assert reader.verify().ok
    reader.close()


# -- damaged journals: refused as they are, with nothing made beside them ------------------------


def test_a_journal_whose_schema_names_are_not_text_is_refused_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    make_journal(path)
    data = bytearray(path.read_bytes())
    where = data.find(b"tableeventsevents")  # the events table's row in SQLite's table of tables
    assert where > 0
    data[where + 5] = 0xFF  # its name is no longer UTF-8
    path.write_bytes(bytes(data))
    before = digest(path)
    for readonly in (True, False):
        with pytest.raises(NotAJournal, match=r"cannot be read as a SQLite database \(its schema is not UTF-8"):
            SQLiteJournal(path, readonly=readonly)
    assert (digest(path), listing(tmp_path)) == (before, ["j.db"])


@pytest.mark.parametrize("keep", [100, 4096, 8192, "half"])
@pytest.mark.parametrize("readonly", [True, False])
def test_a_truncated_journal_is_refused_and_gains_no_side_files(tmp_path: Path, keep: int | str,
                                                                readonly: bool) -> None:
    path = tmp_path / "j.db"
    with SQLiteJournal(path, durability="process") as j:
        for n in range(300):
            j.append(pending(f"c{n}"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep == "half" else keep])  # still a WAL-mode header
    before = digest(path)
    with pytest.raises(NotAJournal, match="cannot be read as a SQLite database"):
        SQLiteJournal(path, readonly=readonly)
    assert (digest(path), listing(tmp_path)) == (before, ["j.db"])


def test_a_journal_named_by_a_link_that_leads_nowhere_is_not_made(tmp_path: Path) -> None:
    # A link to a journal not made yet, in a directory that is there, is where one is made (see
    # test_robustness); one to a missing directory, or a loop, leads nowhere a journal can be.
    dangling, loop = tmp_path / "dangling.db", tmp_path / "loop.db"
    dangling.symlink_to(tmp_path / "gone.db")
    loop.symlink_to(loop)
    for link in (dangling, loop):
        for options in ({"readonly": True}, {"create": False}):
            with pytest.raises(JournalError, match="is a symbolic link that leads to no file"):
                SQLiteJournal(link, **options)  # type: ignore[arg-type]
    with pytest.raises(JournalError, match="is a symbolic link that leads to no file"):
        SQLiteJournal(loop)
    assert listing(tmp_path) == ["dangling.db", "loop.db"]
