"""SQLiteJournal when the process around it misbehaves: interrupts, forks, symlinks, a moved cwd."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from guard.store import Decision, EffectEvent, Verdict
from journal import SQLiteJournal


def run_pending(call_id: str) -> object:
    return lambda record: Decision(Verdict.RUN, EffectEvent(kind="pending", call_id=call_id, tool="t", attempt=1))


def other_process_writes(path: Path) -> str:
    code = (
        "from journal import SQLiteJournal\n"
        "from guard.store import EffectEvent\n"
        f"j = SQLiteJournal({str(path)!r}, durability='process', busy_timeout=2)\n"
        "j.append(EffectEvent(kind='refused', call_id=None, tool='t', reason={'code': 'x', 'message': 'm'}))\n"
        "print('written')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or done.stderr.strip().splitlines()[-1]


def test_a_transaction_an_interrupt_left_open_is_ended_before_the_next_write(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path, durability="process")
    journal.begin("c1", run_pending("c1"))  # type: ignore[arg-type]
    # What an interrupt landing between BEGIN and the end of the transaction leaves behind.
    journal._conn.execute("BEGIN IMMEDIATE")
    journal.begin("c2", run_pending("c2"))  # type: ignore[arg-type]
    assert not journal._conn.in_transaction
    assert other_process_writes(path) == "written"
    assert [e.kind for e in journal.events()] == ["pending", "pending", "refused"]
    journal._conn.execute("BEGIN IMMEDIATE")
    assert journal.get("c2") is not None  # a read ends it too
    assert other_process_writes(path) == "written"
    assert journal.verify().ok
