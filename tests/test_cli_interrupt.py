"""Ctrl-C ends a command with exit 130 and one line, never click's "Aborted!" and 1, and changes nothing."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal

ROOT = Path(__file__).resolve().parents[1]
PATIENCE = 120.0

CHECKS = textwrap.dedent('''
    import time
    from guard.reconcile import NotApplied

    def slow(call):
        print("checking", flush=True)
        time.sleep(3600)
        return NotApplied(evidence="never")

    CHECKS = {"charge": slow}
''')


def test_ctrl_c_exits_130_and_appends_nothing(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    with SQLiteJournal(db) as j:
        @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=j)))
        def charge(cents: int) -> None:
            raise TimeoutError("lost")

        with AirlockContext(metadata={"tool_call_id": "c1"}), contextlib.suppress(TimeoutError):
            charge(5)
        before = j.count_events()
    (tmp_path / "checks.py").write_text(CHECKS)
    proc = subprocess.Popen([sys.executable, "-m", "cli", "journal", "reconcile", "--with", "checks:CHECKS",
                             "--db", str(db), "--timeout", "3600"], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], PATIENCE)
    assert ready and proc.stdout.readline().strip() == "checking"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=PATIENCE)
    assert proc.returncode == 130, err
    assert "Aborted!" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "Interrupted: a write under way was rolled back."
    with SQLiteJournal(db) as j:
        assert j.count_events() == before and j.call("c1").status == "unknown"


def test_a_read_tidies_the_empty_side_files_an_interrupted_reader_left(tmp_path: Path) -> None:
    from tests.cli_support import invoke, seed

    db = tmp_path / "j.db"
    seed(db)
    assert not (tmp_path / "j.db-wal").exists()
    # What a reader interrupted before it closed leaves beside a journal that had none: a -wal that
    # holds nothing, and a -shm.
    (tmp_path / "j.db-wal").touch()
    (tmp_path / "j.db-shm").write_bytes(b"\0" * 32768)
    before = db.read_bytes()
    shown = invoke("journal", "show", "--db", str(db), "--limit", "1")
    assert shown.exit_code == 0
    assert not (tmp_path / "j.db-wal").exists() and not (tmp_path / "j.db-shm").exists()
    assert db.read_bytes() == before  # nothing copied into the file
