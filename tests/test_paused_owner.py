"""An owner paused past its lease is not taken for gone: stopped with SIGSTOP, or seen by a
process whose wall clock was stepped forward. The lease of a SQLite journal runs on the kernel's
boot clock, and a process this host can see running is alive whatever its lease says."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from journal import open_journal
from tests.cli_support import invoke

ROOT = Path(__file__).resolve().parents[1]
PATIENCE = 120.0  # seconds a loaded machine may take to start a Python process; never a measure
LEASE = 1.0

AGENT = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard
    from journal import open_journal

    EFFECTS, HOLD = Path(os.environ["EFFECTS"]), Path(os.environ["HOLD"])

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=open_journal(sys.argv[1]),
                                                            lease=float(sys.argv[2]))))
    def charge(account: str, cents: int) -> dict:
        with EFFECTS.open("a") as f:
            f.write("charged\\n")
        print("started", flush=True)
        while HOLD.exists():
            time.sleep(0.05)
        return {"cents": cents}

    with AirlockContext(metadata={"tool_call_id": "call_1"}):
        result = charge("acct_1", 500)
    print("result", result.get("block_reason", result), flush=True)
''')

# `airlock journal show call_1 --json` from a process whose wall clock is an hour ahead.
STEPPED = textwrap.dedent('''
    import sys, time
    _wall = time.time
    time.time = lambda: _wall() + 3600.0
    from cli.main import main
    sys.argv = ["airlock", "journal", "show", "call_1", "--json", "--db", sys.argv[1]]
    main()
''')


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], PATIENCE)
    line = proc.stdout.readline() if ready else ""
    assert line, proc.communicate()[1] if proc.poll() is not None else "no output"
    return line.strip()


def _shown(db: str) -> dict[str, Any]:
    result = invoke("journal", "show", "call_1", "--json", "--db", db)
    assert result.exit_code == 0, result.output
    found: dict[str, Any] = json.loads(result.stdout)
    return found


def _start(tmp_path: Path, db: str, prefix: list[str]) -> tuple[subprocess.Popen[str], dict[str, str]]:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "hold").touch()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EFFECTS": str(tmp_path / "effects"), "HOLD": str(tmp_path / "hold")}
    child = subprocess.Popen([*prefix, sys.executable, "agent.py", db, str(LEASE)], cwd=tmp_path, env=env,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert _line(child) == "started"
    return child, env


def _wait_lease_ran_out(db: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while True:
        expires = _shown(db)["lease_expires_at"]
        if expires is not None and datetime.fromisoformat(expires.replace("Z", "+00:00")) < datetime.now(UTC):
            return
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.1)


def _finish(tmp_path: Path, child: subprocess.Popen[str], db: str) -> None:
    (tmp_path / "hold").unlink()
    assert _line(child) == "result {'cents': 500}"
    child.wait(PATIENCE)
    assert (tmp_path / "effects").read_text() == "charged\n"
    with open_journal(db, create=False) as j:
        record = j.call("call_1")
        assert record is not None and (record.status, record.attempt) == ("committed", 1)


def test_an_owner_stopped_past_its_lease_is_alive(tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    child, env = _start(tmp_path, db, [])
    child.send_signal(signal.SIGSTOP)
    try:
        _wait_lease_ran_out(db)  # its renewer is stopped with it
        assert _shown(db)["owner_state"] == "alive"
        retry = subprocess.run([sys.executable, "agent.py", db, str(LEASE)], cwd=tmp_path, env=env, text=True,
                               capture_output=True, timeout=PATIENCE)
        assert retry.stdout.splitlines() == ["result effect_status_unknown"], retry.stderr
        refused = invoke("journal", "resolve", "call_1", "--not-applied", "--reason", "stuck", "--db", db)
        assert refused.exit_code == 1 and "--force" in refused.output
    finally:
        child.send_signal(signal.SIGCONT)
    _finish(tmp_path, child, db)


def _can_unshare_uts() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        return subprocess.run(["unshare", "--uts", "true"], capture_output=True, timeout=PATIENCE).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_unshare_uts(), reason="needs root and unshare --uts")
def test_a_wall_clock_step_does_not_end_a_lease(tmp_path: Path) -> None:
    # The owner runs under another host name, so only its lease says whether it runs: a reader
    # whose wall clock is an hour ahead still finds the lease running, on the boot clock.
    db = str(tmp_path / "j.db")
    child, env = _start(tmp_path, db, ["unshare", "--uts", "sh", "-c", 'hostname elsewhere-host && exec "$0" "$@"'])
    assert _shown(db)["owner_state"] == "alive"
    stepped = subprocess.run([sys.executable, "-c", STEPPED, db], cwd=ROOT, env=env, text=True,
                             capture_output=True, timeout=PATIENCE)
    assert stepped.returncode == 0, stepped.stderr
    assert json.loads(stepped.stdout)["owner_state"] == "alive"
    _finish(tmp_path, child, db)
