"""SQLiteJournal when the process around it misbehaves: interrupts, forks, symlinks, a moved cwd."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
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


def test_interrupts_at_random_moments_never_wedge_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path, durability="process")
    interrupts = 0

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    deadline = time.monotonic() + 2
    n = 0
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.0003, 0.0003)
        while time.monotonic() < deadline:
            n += 1
            try:
                journal.begin(f"c{n}", run_pending(f"c{n}"))  # type: ignore[arg-type]
            except KeyboardInterrupt:
                interrupts += 1
            except Exception:
                pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupts > 0
    journal.begin("after", run_pending("after"))  # type: ignore[arg-type]
    assert journal.get("after") is not None
    assert other_process_writes(path) == "written"
    assert journal.verify().ok
