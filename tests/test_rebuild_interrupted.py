"""Ctrl-C during `airlock journal rebuild` of a large journal, as a real SIGINT to a real process:
the rebuild is rolled back and says so in one line, and nothing more is printed (no "Exception
ignored in: <generator object _readable ...>" from a cursor closed after its connection)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.cli_bench import seed
from tests.cli_support import AIRLOCK, ROOT

EVENTS = 300_000  # a rebuild of a few seconds: long enough to be interrupted in the middle


def rebuild(db: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    return subprocess.Popen([AIRLOCK, "journal", "rebuild", "--db", str(db)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def in_its_write(db: Path) -> bool:
    """Whether another process holds the journal's write lock (the rebuild, in its transaction)."""
    conn = sqlite3.connect(db, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        conn.close()


@pytest.mark.slow
def test_ctrl_c_during_a_rebuild_says_one_line_and_nothing_else(tmp_path: Path) -> None:
    db = tmp_path / "big.db"
    seed(db, EVENTS)  # the log alone: the first rebuild writes every row of the projection
    first = rebuild(db)
    out, err = first.communicate(timeout=600)
    assert (first.returncode, err) == (0, ""), err
    assert out.startswith("Rebuilt the projection: ")

    interrupted = 0
    for into in (0.2, 0.5, 0.8, 1.1):
        proc = rebuild(db)
        deadline = time.monotonic() + 120
        while not in_its_write(db) and proc.poll() is None:  # started (imports done), its write begun
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(into)  # then a while into reading and folding the log
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=600)
        if proc.returncode == 0:  # it was done first
            continue
        interrupted += 1
        assert (proc.returncode, out, err) == (130, "", "\nInterrupted: a write under way was rolled back.\n")
    assert interrupted, "no rebuild was interrupted: the journal is too small for this machine"
    done = subprocess.run([AIRLOCK, "journal", "verify", "--db", str(db)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
