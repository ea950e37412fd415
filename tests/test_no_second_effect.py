"""No second effect in the default configuration (no lease), with real processes: a reconciler
killed mid-check leaves its claim in the leases table, and a guard in another PID namespace has a
pid that means nothing here. Neither may make a live call look gone: while the first attempt's
tool runs, ``show`` says its owner is alive, a retry's inline check, a bulk reconcile and a resolve
without --force all leave it alone, and the tool takes effect once."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from journal import open_journal
from tests.cli_support import invoke

ROOT = Path(__file__).resolve().parents[1]
PATIENCE = 120.0  # seconds a loaded machine may take to start a Python process; never a measure

# The agent's tool and its check: the tool appends one line to the effects file per effect, and
# blocks while the file HOLD exists; the check blocks while CHECK_HOLD exists (a reconciler is
# killed there) and otherwise asks the effects file.
TOOLS = textwrap.dedent('''
    import os, time
    from pathlib import Path

    from guard import Airlock, SecurityPolicy, get_current_context
    from guard.effect_guard import EffectGuard
    from guard.reconcile import Applied, NotApplied, reconciled_by
    from journal import open_journal

    EFFECTS = Path(os.environ["EFFECTS"])
    HOLD = Path(os.environ["HOLD"])
    CHECK_HOLD = Path(os.environ["CHECK_HOLD"])

    def effects():
        return EFFECTS.read_text().splitlines() if EFFECTS.exists() else []

    def charge_exists(call):
        if CHECK_HOLD.exists():
            print("checking", flush=True)
            while CHECK_HOLD.exists():
                time.sleep(0.05)
        if any(line.startswith(call.call_id + " ") for line in effects()):
            return Applied(evidence="charged")
        return NotApplied(evidence="no charge")

    CHECKS = {"charge": charge_exists}

    def make_charge(db, fail_first=False):
        policy = SecurityPolicy(effect_guard=EffectGuard(store=open_journal(db)))

        @reconciled_by(charge_exists)
        @Airlock(policy=policy)
        def charge(account: str, cents: int) -> dict:
            ctx = get_current_context()
            if fail_first:
                raise TimeoutError("the backend did not answer")  # nothing charged
            with EFFECTS.open("a") as f:
                f.write(f"{ctx.tool_call_id} {account} {cents}\\n")
            print("started", flush=True)
            while HOLD.exists():
                time.sleep(0.05)
            return {"charged": cents}

        return charge
''')

CHILD = textwrap.dedent('''
    import sys
    from guard import AirlockContext, is_refusal
    from agent_tools import make_charge

    charge = make_charge(sys.argv[1], fail_first=sys.argv[2] == "fail")
    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": "call_1"}):
        try:
            result = charge("acct_1", 500)
        except TimeoutError:
            result = "timeout"
    print("result", result.get("block_reason") if is_refusal(result) else result, flush=True)
''')


@pytest.fixture
def db(journal_target: str) -> str:
    """Where the journal of every store (tests/conftest.py) is to be."""
    return journal_target


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "agent_tools.py").write_text(TOOLS)
    (tmp_path / "child.py").write_text(CHILD)
    for name in ("EFFECTS", "HOLD", "CHECK_HOLD"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("agent_tools", None)


def effects(agent: Path) -> list[str]:
    path = agent / "effects"
    return path.read_text().splitlines() if path.exists() else []


def spawn(agent: Path, argv: list[str], prefix: list[str] = ()) -> subprocess.Popen[str]:  # type: ignore[assignment]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(agent), str(ROOT)])}
    return subprocess.Popen([*prefix, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=agent)


def read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], PATIENCE)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        raise AssertionError(f"the process said nothing: {proc.communicate()[1]}")
    return line.strip()


def sigkill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(PATIENCE)


def shown(db: str) -> dict[str, Any]:
    result = invoke("journal", "show", "call_1", "--db", db, "--json")
    assert result.exit_code == 0, result.output
    found: dict[str, Any] = json.loads(result.stdout)
    return found


def leave_a_stale_claim(agent: Path, db: str) -> None:
    """call_1 in doubt (its first attempt timed out, nothing charged); a reconciler killed while
    its check ran; the claim it left runs out; an operator releases the call."""
    first = spawn(agent, [sys.executable, "child.py", db, "fail"])
    assert read_line(first) == "result timeout"
    first.wait(PATIENCE)
    (agent / "check_hold").touch()
    reconciler = spawn(agent, [sys.executable, "-m", "cli", "journal", "reconcile", "--with", "agent_tools:CHECKS",
                               "--db", db, "--timeout", "0.5"])
    assert read_line(reconciler) == "checking"
    sigkill(reconciler)
    (agent / "check_hold").unlink()
    with open_journal(db, create=False) as j:
        deadline = time.monotonic() + PATIENCE
        # The claim runs out by the store's own clock a few seconds after it was taken.
        while j.claim_lease("call_1", "probe", 0.001) is False:
            assert time.monotonic() < deadline, "the killed reconciler's claim never ran out"
            time.sleep(0.2)
        j.take_lease("call_1", "stale", 0.0)  # a row left behind, run out, as the killed claim's
    released = invoke("journal", "resolve", "call_1", "--not-applied", "--reason", "backend says no charge",
                      "--db", db)
    assert released.exit_code == 0, released.output


def a_live_call_is_left_alone(agent: Path, db: str, prefix: list[str] = ()) -> None:  # type: ignore[assignment]
    """call_1's next attempt runs in a child (no lease) and blocks inside its tool; nothing another
    process does makes it run a second time."""
    (agent / "hold").touch()
    child = spawn(agent, [sys.executable, "child.py", db, "run"], prefix)
    try:
        assert read_line(child) == "started"
        assert len(effects(agent)) == 1

        call = shown(db)
        assert (call["status"], call["owner_state"]) == ("pending", "alive")
        assert "pending (owner alive)" in invoke("journal", "show", "--db", db).stdout

        # A retry with its inline check: refused, the check not even asked.
        retry = spawn(agent, [sys.executable, "child.py", db, "run"])
        assert read_line(retry) == "result effect_status_unknown"
        retry.wait(PATIENCE)
        bulk = invoke("journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db, "--json")
        assert bulk.exit_code == 0, bulk.output
        assert [json.loads(line)["outcome"] for line in bulk.stdout.splitlines()] == ["skipped"]
        refused = invoke("journal", "resolve", "call_1", "--not-applied", "--reason", "looks stuck", "--db", db)
        assert refused.exit_code == 1 and "--force" in refused.output
        assert shown(db)["status"] == "pending"
        assert len(effects(agent)) == 1
    finally:
        (agent / "hold").unlink()
    assert read_line(child) == "result {'charged': 500}"
    child.wait(PATIENCE)
    assert effects(agent) == ["call_1 acct_1 500"]
    with open_journal(db, create=False) as j:
        record = j.call("call_1")
        assert record is not None and (record.status, record.attempt) == ("committed", 2)
        assert j.verify().ok


def test_a_killed_reconcilers_stale_claim_does_not_hide_a_live_owner(agent: Path, db: str) -> None:
    leave_a_stale_claim(agent, db)
    a_live_call_is_left_alone(agent, db)


def _free_pid() -> int:
    """A pid no process of this namespace has (nor, likely, will soon)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(min(top, 4_000_000) - 2, 300, -997):
        if not Path(f"/proc/{pid}").exists() and not Path(f"/proc/{pid + 1}").exists():
            return pid
    raise AssertionError("no free pid")


def can_unshare() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        tried = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                               timeout=PATIENCE)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return tried.returncode == 0


@pytest.mark.skipif(not can_unshare(), reason="needs root and unshare --pid --mount-proc")
def test_a_guard_in_another_pid_namespace_is_never_judged_by_its_pid(agent: Path, db: str) -> None:
    # Same host name, another PID namespace (a container sharing the host's name), no lease. Its pid
    # there is one no process here has: a pid test from here would call it gone.
    first = spawn(agent, [sys.executable, "child.py", db, "fail"])
    assert read_line(first) == "result timeout"
    first.wait(PATIENCE)
    assert invoke("journal", "resolve", "call_1", "--not-applied", "--reason", "no charge", "--db", db).exit_code == 0
    pid = _free_pid()
    prefix = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
              f'echo {pid} > /proc/sys/kernel/ns_last_pid && "$0" "$@"']
    a_live_call_is_left_alone(agent, db, prefix)
    with open_journal(db, create=False) as j:
        owners = [e.owner for e in j.call_events("call_1") if e.kind == "pending"]
    assert owners[-1]["pid"] == pid + 1 and not Path(f"/proc/{pid + 1}").exists()
    assert owners[-1]["pid_ns"] != owners[0]["pid_ns"]
