"""The clock a SQLite journal times its leases by: the kernel's boot clock, which a step of the wall
clock does not move.

Every process that shares a SQLite file in WAL mode runs on one kernel, so they share its boot
clock (``CLOCK_BOOTTIME``: seconds since boot, counting suspend). Its readings mean something only
within one boot, so the journal's ``meta`` table names the clock its leases are on
(``lease_clock``: the kernel's boot id, or ``wall`` where the platform has no boot clock). A lease
written in an earlier boot has run out: every process of that boot is gone. The first lease written
in a new boot ends them and names the new clock, in its own transaction.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from guard.liveness import boot_id

from ..leasing import LeaseRow

__all__ = ["CLOCK", "KEY", "adopt", "convert_wall_leases", "lease_rows", "now", "read_clock"]

KEY = "lease_clock"
_BOOT_CLOCK = getattr(time, "CLOCK_BOOTTIME", None)
CLOCK: str = (boot_id() if _BOOT_CLOCK is not None else None) or "wall"


def now() -> float:
    """The time on :data:`CLOCK`, in seconds."""
    return time.clock_gettime(_BOOT_CLOCK) if CLOCK != "wall" and _BOOT_CLOCK is not None else time.time()


def read_clock(conn: sqlite3.Connection) -> str:
    """The clock the journal's leases are on (``wall``: a journal from before the boot clock)."""
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (KEY,)).fetchone()
    return "wall" if row is None else str(row[0])


def adopt(conn: sqlite3.Connection) -> None:
    """Inside a write transaction: put the journal's leases on this boot's clock. Leases of another
    boot have run out; those on the wall clock (a journal from before) are carried over."""
    clock = read_clock(conn)
    if clock == CLOCK:
        return
    if clock == "wall":
        convert_wall_leases(conn)
    else:
        conn.execute("UPDATE leases SET expires_at = -1")  # an earlier boot's: its processes are gone
    conn.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                 (KEY, CLOCK))


def convert_wall_leases(conn: sqlite3.Connection) -> None:
    """Move the leases written on the wall clock onto :data:`CLOCK`."""
    if CLOCK != "wall":
        conn.execute("UPDATE leases SET expires_at = expires_at - ? + ?", (time.time(), now()))


def lease_rows(clock: str, rows: Iterable[tuple[str, float]]) -> list[LeaseRow]:
    """``(holder, expires_at)`` rows on ``clock`` as :data:`~journal.leasing.LeaseRow`: when each
    runs out, in UTC, and whether it still runs."""
    wall, here = datetime.now(UTC), now()
    ours = clock == CLOCK or (clock == "wall" and CLOCK == "wall")
    result: list[LeaseRow] = []
    for holder, until in rows:
        until = float(until)
        if ours:
            result.append((holder, wall + timedelta(seconds=until - here), until > here))
        elif clock == "wall":  # a journal not yet moved onto this boot's clock
            result.append((holder, datetime.fromtimestamp(until, UTC), until > time.time()))
        else:  # another boot's: it ran out by the time this boot began, at the latest
            result.append((holder, wall - timedelta(seconds=here if CLOCK != "wall" else 0.0), False))
    return result
