"""A journal on a file system that fills up: a small tmpfs mounted for the test, filled by a file.

A full disk is a full disk: every command says so, changes nothing, and leaves nothing beside the
journal; a guarded call is refused ``store_unavailable`` without running, and runs once there is room.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guard import is_refusal
from journal import DiskFull, SQLiteJournal
from tests.cli_support import Tools, digest, invoke, seed_into

FULL = "is full: free some space and try again (nothing was changed)."


def _mount(target: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` on ``target``; the reason it cannot be, or None."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "mounting a file system needs a POSIX system"
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(target)],
                          capture_output=True, text=True, timeout=120)
    return None if done.returncode == 0 else f"mount -t tmpfs was refused here: {done.stderr.strip()}"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a tmpfs of 512 KiB of its own, unmounted after the test."""
    target = tmp_path / "disk"
    target.mkdir()
    why = _mount(target, "512k")
    if why is not None:
        pytest.skip(why)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=120, check=True)


def fill(disk: Path) -> Path:
    """Fill the file system of ``disk`` to its last block with one file; returns that file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (4096, 1):  # then a byte at a time: a smaller write may still find room
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
    finally:
        os.close(fd)
    return filler


def listing(disk: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(disk.iterdir()) if p.name != "filler"}


def seeded_then_full(disk: Path) -> Path:
    """A valid journal on ``disk``, closed (its WAL checked into the file), then the disk filled."""
    path = disk / "journal.db"
    with SQLiteJournal(path) as journal:
        seed_into(journal)
    assert listing(disk) == {"journal.db": path.stat().st_size}  # nothing beside it
    fill(disk)
    return path


COMMANDS = [
    ("show",), ("show", "call-ok"), ("stats",), ("stats", "--json"), ("verify",), ("export",),
    ("export", "--format", "csv"), ("resolve", "call-timeout", "--not-applied", "--reason", "checked"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_on_a_full_disk_says_so_changes_nothing_and_leaves_no_side_files(
    small_disk: Path, command: tuple[str, ...]
) -> None:
    path = seeded_then_full(small_disk)
    before, files = digest(path), listing(small_disk)
    for _ in range(2):  # the second run finds what the first one left, if anything
        result = invoke("journal", *command, "--db", str(path))
        assert result.exit_code == 1, result.output
        assert result.stderr == f"Error: The disk holding the journal {path} {FULL}\n"
        assert result.stdout == ""
        assert listing(small_disk) == files
        assert digest(path) == before


def test_side_files_cut_short_by_an_earlier_read_are_taken_for_a_full_disk_not_a_foreign_file(
    small_disk: Path,
) -> None:
    # What any reader (sqlite3 itself, an earlier version of this library) leaves after the disk
    # filled: an empty -wal and a -shm cut short, which every later ordinary read trips over.
    path = seeded_then_full(small_disk)
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        reader.execute("SELECT count(*) FROM events").fetchall()
    reader.close()
    left = listing(small_disk)
    assert left["journal.db-wal"] == 0 and left["journal.db-shm"] < 32 * 1024
    before = digest(path)
    for command in COMMANDS:
        result = invoke("journal", *command, "--db", str(path))
        assert (result.exit_code, result.stderr) == (1, f"Error: The disk holding the journal {path} {FULL}\n")
    with pytest.raises(DiskFull, match="is full"):
        SQLiteJournal(path)
    assert listing(small_disk) == left
    assert digest(path) == before


@pytest.mark.parametrize("readonly", [False, True], ids=["for writing", "read-only"])
def test_opening_a_journal_on_a_full_disk_raises_disk_full(small_disk: Path, readonly: bool) -> None:
    path = seeded_then_full(small_disk)
    files = listing(small_disk)
    with pytest.raises(DiskFull) as raised:
        SQLiteJournal(path, readonly=readonly)
    assert str(raised.value) == f"The disk holding the journal {path} {FULL}"
    assert listing(small_disk) == files


def test_no_new_journal_file_is_made_on_a_full_disk(small_disk: Path) -> None:
    fill(small_disk)
    with pytest.raises(DiskFull):
        SQLiteJournal(small_disk / "new.db")
    assert listing(small_disk) == {}


def test_a_guarded_call_on_a_disk_that_fills_is_refused_store_unavailable_then_runs_once_there_is_room(
    small_disk: Path,
) -> None:
    path = small_disk / "journal.db"
    journal = SQLiteJournal(path)
    try:
        tools = Tools(journal)
        tools.fail_with = TimeoutError("no answer")
        with pytest.raises(TimeoutError):  # ran, and left unknown: an operator may resolve it
            tools.call("call-1", tools.charge, account="acct_1", cents=100)
        filler = fill(small_disk)
        events = _events(path)
        memo = uuid.uuid4().hex * 64  # arguments that need new pages
        refused = tools.call("call-2", tools.charge, account=memo, cents=200)
        assert is_refusal(refused) and refused["block_reason"] == "store_unavailable"
        assert tools.payments.charges == [("acct_1", 100)]  # not run
        assert _events(path) == events
        with pytest.raises(DiskFull, match="is full"):
            journal.resolve("call-1", applied=True, reason="checked", operator="ops", value="{}")
        record = journal.call("call-1")
        assert record is not None and record.status == "unknown"
        filler.unlink()
        ran = tools.call("call-2", tools.charge, account=memo, cents=200)
        assert ran == {"charge_id": "ch_2", "cents": 200}
        assert tools.call("call-2", tools.charge, account=memo, cents=200) == ran  # replayed, not run again
        assert len(tools.payments.charges) == 2
        assert journal.verify().ok
    finally:
        journal.close()


def _events(path: Path) -> list[Any]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT seq, kind, call_id FROM events ORDER BY seq").fetchall()
    finally:
        conn.close()
