"""``airlock journal verify`` checks every index of a SQLite journal file against its table.

A real file, made by the real guard (a few hundred transfers, with a duplicate window), closed,
then damaged with plain file I/O or altered behind SQLite's back: bytes written over an index's
pages, an index made again without one entry. SQLite's quick check finds nothing wrong with an
entry whose bytes changed; its integrity check says ``row N missing from index ...``. verify must
fail naming the index, leave the file as it was, and say what to do; doing it must make the
journal verify again.
"""

from __future__ import annotations

import random
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
from journal.sqlite import verify as sqlite_verify
from tests.cli_support import digest, invoke

CALLS = 300
WINDOW = 3600.0  # seconds: every transfer of the test is inside the duplicate window


class Bank:
    """Counts the transfers that reached it."""

    def __init__(self) -> None:
        self.transfers: list[tuple[str | None, str, int]] = []

    def transfer(self, to: str, cents: int) -> dict[str, Any]:
        context = get_current_context()
        self.transfers.append((context.tool_call_id if context else None, to, cents))
        return {"transfer": len(self.transfers), "to": to, "cents": cents}


def transfer_tool(journal: SQLiteJournal, bank: Bank) -> Any:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=journal, duplicate_window=WINDOW)))
    def transfer(to: str, cents: int) -> dict[str, Any]:
        return bank.transfer(to, cents)

    return transfer


def call(tool: Any, tool_call_id: str, *args: Any) -> Any:
    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": tool_call_id}):
        return tool(*args)


@pytest.fixture(scope="module")
def seeded_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A journal of CALLS transfers, each to its own account, made through the guard and closed."""
    path = tmp_path_factory.mktemp("seeded") / "journal.db"
    bank = Bank()
    with SQLiteJournal(path, durability="process") as journal:
        transfer = transfer_tool(journal, bank)
        for n in range(CALLS):
            call(transfer, f"call-{n:04d}", f"acct_{n:04d}", 100 + n)
    assert len(bank.transfers) == CALLS
    return path


@pytest.fixture
def journal_path(seeded_file: Path, tmp_path: Path) -> Path:
    path = tmp_path / "journal.db"
    shutil.copyfile(seeded_file, path)  # closed: the file holds everything, no WAL beside it
    assert invoke("journal", "verify", "--db", str(path)).exit_code == 0
    return path


def sql(path: Path, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return conn.execute(statement, params).fetchall()
    finally:
        conn.close()


# -- the file's own pages, read and written as bytes -----------------------------------------------


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """SQLite's variable-length integer at ``at``: (value, offset after it)."""
    value = 0
    for i in range(8):
        byte = data[at + i]
        value = (value << 7) | (byte & 0x7F)
        if byte < 0x80:
            return value, at + i + 1
    return (value << 8) | data[at + 8], at + 9


def _page(path: Path, number: int, size: int) -> bytes:
    with path.open("rb") as f:
        f.seek((number - 1) * size)
        return f.read(size)


def _cells(page: bytes) -> list[int]:
    """The offsets of a b-tree page's cells, in order (the page is not page 1)."""
    interior = page[0] in (0x02, 0x05)
    header = 12 if interior else 8
    count = int.from_bytes(page[3:5], "big")
    return [int.from_bytes(page[header + 2 * i: header + 2 * i + 2], "big") for i in range(count)]


def root_and_size(path: Path, index: str) -> tuple[int, int]:
    """The root page of ``index`` (from sqlite_master) and the file's page size."""
    root = sql(path, "SELECT rootpage FROM sqlite_master WHERE name = ?", index)[0][0]
    return int(root), int(sql(path, "PRAGMA page_size")[0][0])


def leaf_of(path: Path, index: str) -> int:
    """A leaf page in the middle of ``index``: down from its root through the middle cell's child."""
    number, size = root_and_size(path, index)
    page = _page(path, number, size)
    while page[0] == 0x02:  # an interior page of an index: each cell starts with its child's page number
        cells = _cells(page)
        middle = cells[len(cells) // 2]
        number = int.from_bytes(page[middle: middle + 4], "big")
        page = _page(path, number, size)
    assert page[0] == 0x0A, f"page {number} of {index} is not an index leaf"
    return number


def overwrite(path: Path, at: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        f.write(data)


def flip_root_cells(path: Path, index: str, seed: int = 7) -> None:
    """Random bytes written over the middle of the cell area of ``index``'s root page."""
    number, size = root_and_size(path, index)
    page = _page(path, number, size)
    start = int.from_bytes(page[5:7], "big") or 65536  # where the cell content area begins
    assert start < size
    middle = (start + size) // 2 - 32
    overwrite(path, (number - 1) * size + middle, random.Random(seed).randbytes(64))


def flip_an_entry(path: Path, index: str, seed: int = 7) -> None:
    """Random bytes written over the first column of the middle entry of a leaf in the middle of
    ``index`` (its text, 64 bytes of an idempotency key): the page's structure stays whole."""
    number, size = root_and_size(path, index)
    number = leaf_of(path, index)
    page = _page(path, number, size)
    cells = _cells(page)
    cell = cells[len(cells) // 2]
    _, record = _varint(page, cell)  # the payload's size, then the record: its header's size, the serial types
    header_size, types_at = _varint(page, record)
    serial_type, _ = _varint(page, types_at)
    assert serial_type >= 13 and serial_type % 2 == 1, "the first column is a text"
    length = (serial_type - 13) // 2
    overwrite(path, (number - 1) * size + record + header_size, random.Random(seed).randbytes(length))


def leave_out_an_entry(path: Path, index: str, rowid: int) -> None:
    """Make ``index`` again without the entry of row ``rowid``, behind SQLite's back: its definition
    made partial, the index made again, then its own definition put back (so
    tests/sqlite/test_verify_parts.py alters the index on call id)."""
    definition = sql(path, "SELECT sql FROM sqlite_master WHERE name = ?", index)[0][0]
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute("UPDATE sqlite_master SET sql = ? WHERE name = ?", (f"{definition} WHERE rowid <> {rowid}", index))
    conn.close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(f"REINDEX {index}")
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute("UPDATE sqlite_master SET sql = ? WHERE name = ?", (definition, index))
    conn.close()


def checkpointed(path: Path) -> None:
    """Put the WAL into the file (a damage is written to the file itself, as a disk would)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def quick_check(path: Path) -> list[str]:
    return [row[0] for row in sql(path, "PRAGMA quick_check")]


def integrity_check(path: Path) -> str:
    return "\n".join(row[0] for row in sql(path, "PRAGMA integrity_check"))


def failed_verify(path: Path) -> str:
    """``airlock journal verify --db FILE``, which must fail (exit 1) and leave the file as it was:
    its one line on stderr."""
    before = digest(path)
    result = invoke("journal", "verify", "--db", str(path))
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    assert result.stderr.startswith(f"Error: {path} does not verify") and result.stderr.count("\n") == 1
    assert digest(path) == before  # verify only reads
    return result.stderr


def verified(path: Path) -> None:
    result = invoke("journal", "verify", "--db", str(path))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("OK: ")
    assert integrity_check(path) == "ok"
    assert not path.with_name(path.name + "-damaged").exists()


def rebuilt(path: Path) -> None:
    result = invoke("journal", "rebuild", "--db", str(path))
    assert result.exit_code == 0, result.stderr


# -- the tests -------------------------------------------------------------------------------------


def test_an_entry_of_the_idempotency_index_overwritten_fails_verify_and_rebuild_makes_it_again(
    journal_path: Path,
) -> None:
    """The defect as found: stray bytes in the middle of the file, inside an entry of the index the
    duplicate window reads; SQLite's quick check finds nothing, its integrity check a row missing."""
    flip_an_entry(journal_path, "calls_idempotency_key")
    assert quick_check(journal_path) == ["ok"]
    assert "missing from index calls_idempotency_key" in integrity_check(journal_path)

    said = failed_verify(journal_path)
    assert "the index calls_idempotency_key of table calls" in said
    assert "duplicate window" in said and "run rebuild" in said and "REINDEX" in said

    rebuilt(journal_path)  # what verify says to do
    verified(journal_path)


def test_an_entry_left_out_of_the_idempotency_index_lets_a_copy_run_until_rebuild(journal_path: Path) -> None:
    """An index made again without one entry, behind SQLite's back: the duplicate window no longer
    finds that call, and a re-planned copy of it runs again. verify says so; after rebuild the copy
    is answered as the call it copies."""
    rowid = sql(journal_path, "SELECT rowid FROM calls WHERE call_id = 'call-0150'")[0][0]
    leave_out_an_entry(journal_path, "calls_idempotency_key", rowid)
    assert quick_check(journal_path) == ["ok"]
    assert f"row {rowid} missing from index calls_idempotency_key" in integrity_check(journal_path)

    # What the damage does, on a copy of the damaged file: a copy of call-0150 under a new id runs.
    exposed = journal_path.with_name("exposed.db")
    shutil.copyfile(journal_path, exposed)
    bank = Bank()
    with SQLiteJournal(exposed, durability="process") as journal:
        call(transfer_tool(journal, bank), "call-0150-again", "acct_0150", 250)
    assert bank.transfers == [("call-0150-again", "acct_0150", 250)]  # the transfer ran twice in all

    said = failed_verify(journal_path)
    assert "the index calls_idempotency_key of table calls" in said
    assert "holds 299 entries for 300 rows" in said and "run rebuild" in said

    rebuilt(journal_path)
    verified(journal_path)
    bank = Bank()
    with SQLiteJournal(journal_path, durability="process") as journal:
        again = call(transfer_tool(journal, bank), "call-0150-again", "acct_0150", 250)
    assert bank.transfers == []  # answered as call-0150: it did not run again
    assert again == {"transfer": 151, "to": "acct_0150", "cents": 250}


def test_bytes_over_the_idempotency_index_root_fail_verify_and_a_restored_copy_verifies(
    journal_path: Path, tmp_path: Path
) -> None:
    """Random bytes over the middle of the cell area of the index's root page: SQLite finds the
    pages malformed. verify names the index, marks the file, and advises restoring it (making the
    index again in place could free pages of other tables); rebuild refuses; a restored copy verifies."""
    backup = tmp_path / "backup" / "journal.db"
    backup.parent.mkdir()
    assert invoke("journal", "copy", "--from", str(journal_path), "--to", str(backup)).exit_code == 0
    flip_root_cells(journal_path, "calls_idempotency_key")
    assert quick_check(journal_path) != ["ok"]

    said = failed_verify(journal_path)
    assert "SQLite finds the file damaged" in said
    assert "the index calls_idempotency_key of table calls" in said
    assert "restore the journal as the runbook says" in said and "do not make the index again in place" in said
    assert journal_path.with_name("journal.db-damaged").exists()  # writes are refused until it is restored

    before = digest(journal_path)
    refused = invoke("journal", "rebuild", "--db", str(journal_path))
    assert refused.exit_code == 1 and "is damaged" in refused.stderr
    assert digest(journal_path) == before

    # The runbook: the damaged file's side files removed, a copy put in its place, then verify.
    for side in ("-wal", "-shm"):
        journal_path.with_name(journal_path.name + side).unlink(missing_ok=True)
    shutil.copyfile(backup, journal_path)
    verified(journal_path)


@pytest.mark.parametrize("index", ["calls_updated_at", "sqlite_autoindex_calls_1", "events_call_id"])
def test_an_entry_of_any_other_index_overwritten_fails_verify_naming_it(journal_path: Path, index: str) -> None:
    flip_an_entry(journal_path, index)
    assert quick_check(journal_path) == ["ok"]
    assert f"missing from index {index}" in integrity_check(journal_path)

    said = failed_verify(journal_path)
    assert index in said and "run rebuild" in said

    rebuilt(journal_path)
    verified(journal_path)


@pytest.mark.parametrize("index", ["calls_idempotency_key", "calls_updated_at", "sqlite_autoindex_calls_1"])
def test_verify_in_parts_finds_what_one_pass_finds(journal_path: Path, index: str) -> None:
    """A large journal is verified in parts (child processes): each index is checked by one of them,
    and the one-pass check, which any part that finds a problem falls back on, names it."""
    flip_an_entry(journal_path, index)
    with SQLiteJournal(journal_path, readonly=True) as journal:
        head = journal.head()[0]
        one = journal.verify(parts=1)
        assert not one.ok and index in (one.problem or "")
        for parts in (2, 3):
            assert not all(sqlite_verify.check_part(journal_path, p, parts, head) for p in range(parts))
            assert journal.verify(parts=parts) == one
    rebuilt(journal_path)
    with SQLiteJournal(journal_path, readonly=True) as journal:
        assert journal.verify(parts=2).ok and journal.verify(parts=1).ok
