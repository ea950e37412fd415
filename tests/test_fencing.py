"""Fencing: an attempt taken for gone that comes back cannot write its outcome over a later
attempt's record, and the tool learns its attempt number, a token its backend can check."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context
from guard.effect_guard import EffectGuard, reversibility
from journal import SQLiteJournal, open_journal
from tests.cli_support import invoke

ROOT = Path(__file__).resolve().parents[1]
PATIENCE = 120.0  # seconds a loaded machine may take to start a Python process; never a measure


def test_the_tool_learns_its_attempt(tmp_path: Path) -> None:
    seen: list[int | None] = []
    journal = SQLiteJournal(tmp_path / "j.db")

    @reversibility("reversible")
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def sync_ledger(account: str) -> str:
        ctx = get_current_context()
        assert ctx is not None
        seen.append(ctx.attempt)
        if len(seen) == 1:
            raise ValueError("declined")  # released: the next call is attempt 2
        return "ok"

    with AirlockContext(metadata={"tool_call_id": "c1"}):
        with pytest.raises(ValueError):
            sync_ledger("acct")
        assert sync_ledger("acct") == "ok"
    with AirlockContext():  # no id: a reversible tool runs unjournaled, with no attempt
        assert sync_ledger("acct") == "ok"
    assert seen == [1, 2, None]
    journal.close()


# The backend keeps, per idempotency key, the highest attempt that wrote to it and refuses an
# earlier one: the fence the guard's attempt number makes possible.
TOOLS = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path

    from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context
    from guard.effect_guard import EffectGuard
    from journal import open_journal

    BACKEND = Path(os.environ["BACKEND"])
    HOLD = Path(os.environ["HOLD"])

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=open_journal(sys.argv[1]))))
    def charge(account: str, cents: int) -> dict:
        ctx = get_current_context()
        print("started", ctx.attempt, flush=True)
        while ctx.attempt == 1 and HOLD.exists():
            time.sleep(0.05)  # paused: taken for gone meanwhile
        fences = json.loads(BACKEND.read_text()) if BACKEND.exists() else {}
        if fences.get(ctx.idempotency_key, 0) > ctx.attempt:
            return {"fenced": ctx.attempt}
        fences[ctx.idempotency_key] = ctx.attempt
        BACKEND.write_text(json.dumps(fences))
        return {"charged_by": ctx.attempt}

    with AirlockContext(metadata={"tool_call_id": "call_1"}):
        print("result", charge("acct_1", 500), flush=True)
''')


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], PATIENCE)
    line = proc.stdout.readline() if ready else ""
    assert line, proc.communicate()[1] if proc.poll() is not None else "no output"
    return line.strip()


def test_a_late_outcome_of_an_attempt_taken_for_gone_does_not_overwrite_the_next(tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    (tmp_path / "agent.py").write_text(TOOLS)
    (tmp_path / "hold").touch()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BACKEND": str(tmp_path / "backend.json"),
           "HOLD": str(tmp_path / "hold")}
    first = subprocess.Popen([sys.executable, "agent.py", db], cwd=tmp_path, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert _line(first) == "started 1"
        # An operator takes the paused owner for gone and says the charge did not happen.
        forced = invoke("journal", "resolve", "call_1", "--not-applied", "--reason", "stuck", "--force", "--db", db)
        assert forced.exit_code == 0, forced.output
        second = subprocess.run([sys.executable, "agent.py", db], cwd=tmp_path, env=env, text=True,
                                capture_output=True, timeout=PATIENCE)
        assert second.stdout.splitlines() == ["started 2", "result {'charged_by': 2}"], second.stderr
    finally:
        (tmp_path / "hold").unlink()
    assert _line(first) == "result {'fenced': 1}"  # the backend refused the earlier attempt
    first.wait(PATIENCE)

    with open_journal(db, create=False) as j:
        record = j.call("call_1")
        assert record is not None and (record.status, record.attempt) == ("committed", 2)
        assert record.value == '{"charged_by":2}'
        # The late outcome is in the log, with the attempt that produced it; the record is attempt 2's.
        assert [(e.kind, e.attempt) for e in j.call_events("call_1")] == [
            ("pending", 1), ("released", 1), ("pending", 2), ("committed", 2), ("committed", 1)]
        assert j.verify().ok
    replay = subprocess.run([sys.executable, "agent.py", db], cwd=tmp_path, env=env, text=True,
                            capture_output=True, timeout=PATIENCE)
    assert replay.stdout.splitlines() == ["result {'charged_by': 2}"], replay.stderr
