"""The clock of a SQLite journal's leases: the kernel's boot clock, named in ``meta`` by the boot
it belongs to. A lease of an earlier boot has run out; leases of a journal from before are carried
over from the wall clock; an owner of an earlier boot has ended (one machine, restarted since)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from guard.liveness import boot_id
from guard.store import Decision, EffectEvent, Verdict, current_owner
from journal import SQLiteJournal
from journal.sqlite import lease_clock, schema

pytestmark = pytest.mark.skipif(lease_clock.CLOCK == "wall", reason="this platform has no boot clock")


def begin(journal: SQLiteJournal, call_id: str, owner: dict[str, object]) -> None:
    event = EffectEvent(kind="pending", call_id=call_id, tool="charge", arguments="{}", attempt=1,
                        idempotency_key="k" * 64, owner=owner)
    journal.begin(call_id, lambda record: Decision(Verdict.RUN, event, record))


def alive(path: Path, call_id: str) -> bool | None:
    with SQLiteJournal(path) as j:
        record = j.call(call_id)
        assert record is not None
        return j.owner_states([record])[call_id].alive


def test_leases_are_on_this_boots_clock(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with SQLiteJournal(path) as j:
        begin(j, "c1", {"host": "elsewhere", "pid": 1, "lease": "h1"})
        j.take_lease("c1", "h1", 3600)
    conn = sqlite3.connect(path)
    (clock,) = conn.execute("SELECT value FROM meta WHERE key = 'lease_clock'").fetchone()
    (until,) = conn.execute("SELECT expires_at FROM leases").fetchone()
    conn.close()
    assert clock == boot_id()
    # Seconds since boot, not since 1970: a step of the wall clock does not move it.
    assert abs(until - (time.clock_gettime(time.CLOCK_BOOTTIME) + 3600)) < 600
    assert alive(path, "c1") is True


def test_a_lease_of_an_earlier_boot_has_run_out(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with SQLiteJournal(path) as j:
        begin(j, "c1", {"host": "elsewhere", "pid": 1, "lease": "h1"})
        j.take_lease("c1", "h1", 10 ** 9)  # would run for decades on this boot's clock
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = 'an-earlier-boot' WHERE key = 'lease_clock'")
    conn.commit()
    conn.close()
    assert alive(path, "c1") is False  # its owner cannot be seen, and its lease ended with its boot
    with SQLiteJournal(path) as j:
        j.take_lease("c2", "h2", 60)  # the first lease of this boot moves the journal onto its clock
        assert j.claim_lease("c1", "checker", 60) is True
    assert sqlite3.connect(path).execute("SELECT value FROM meta WHERE key = 'lease_clock'").fetchone() == (
        boot_id(),)


def test_wall_clock_leases_of_a_journal_from_before_are_carried_over(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with SQLiteJournal(path) as j:
        begin(j, "c1", {"host": "elsewhere", "pid": 1, "lease": "h1"})
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("DELETE FROM meta WHERE key = 'lease_clock'")
    conn.execute("INSERT INTO leases VALUES ('c1', 'h1', ?)", (time.time() + 3600,))  # as version 7 wrote it
    conn.execute("PRAGMA user_version = 7")  # the version before the boot clock
    conn.close()
    assert alive(path, "c1") is True  # the open migrated it onto the boot clock, the lease still runs
    conn = sqlite3.connect(path)
    (until,) = conn.execute("SELECT expires_at FROM leases").fetchone()
    assert conn.execute("PRAGMA user_version").fetchone() == (schema.LATEST,)
    conn.close()
    assert abs(until - (time.clock_gettime(time.CLOCK_BOOTTIME) + 3600)) < 600


def test_an_owner_of_an_earlier_boot_has_ended_on_one_machine(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    owner = {**current_owner(), "boot": "an-earlier-boot"}  # this host, a pid that runs now, another boot
    with SQLiteJournal(path) as j:
        begin(j, "c1", owner)
        begin(j, "c2", {**current_owner(), "pid_ns": 1})  # this boot, another PID namespace: not seen
    assert alive(path, "c1") is False
    assert alive(path, "c2") is True
