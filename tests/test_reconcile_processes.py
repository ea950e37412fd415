"""Leases and reconcilers with real processes: a child blocked inside its tool is alive to every
other process (also from another PID namespace), is never reconciled and cannot be resolved without
--force; once it is killed (SIGKILL) and its lease has run out, it is reconciled once."""

from __future__ import annotations

import json
import os
import select
import shutil
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

# The agent's tools and the check that asks its backend: a file of charges keyed on the
# idempotency key, written by the tool before it blocks (the effect happened, the response never came).
TOOLS = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path

    from guard import Airlock, SecurityPolicy, get_current_context
    from guard.effect_guard import EffectGuard
    from guard.reconcile import Applied, NotApplied, reconciled_by
    from journal import open_journal

    LEDGER = Path(os.environ["LEDGER"])

    def charge_exists(call):
        charges = json.loads(LEDGER.read_text()) if LEDGER.exists() else {}
        found = charges.get(call.idempotency_key)
        if found is None:
            return NotApplied(evidence="no charge for " + call.idempotency_key)
        return Applied(value=found, evidence="found " + found["charge_id"])

    CHECKS = {"charge": charge_exists}

    def make_charge(db, lease):
        policy = SecurityPolicy(effect_guard=EffectGuard(store=open_journal(db), lease=lease))

        @reconciled_by(charge_exists)
        @Airlock(policy=policy)
        def charge(account: str, cents: int) -> dict:
            key = get_current_context().idempotency_key
            LEDGER.write_text(json.dumps({key: {"charge_id": "ch_1", "cents": cents}}))
            print("started", flush=True)
            time.sleep(3600)  # blocked inside the tool until killed
            return {"charge_id": "ch_1"}

        return charge
''')

CHILD = textwrap.dedent('''
    import sys
    from guard import AirlockContext
    from agent_tools import make_charge

    charge = make_charge(sys.argv[1], float(sys.argv[2]))
    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": "call_k1"}):
        charge("acct_1", 500)
''')

LEASE = 3.0
PATIENCE = 120.0  # seconds a loaded machine may take to start a Python process; never a measure


def can_unshare_pid() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        tried = subprocess.run([unshare, "--pid", "--fork", "true"], capture_output=True, timeout=PATIENCE)
        return tried.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture
def db(journal_target: str) -> str:
    """Where the journal of every store (tests/conftest.py) is to be."""
    return journal_target


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "agent_tools.py").write_text(TOOLS)
    (tmp_path / "child.py").write_text(CHILD)
    monkeypatch.setenv("LEDGER", str(tmp_path / "ledger.json"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("agent_tools", None)


def start_child(agent: Path, db: str, prefix: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(agent), str(ROOT)])}
    child = subprocess.Popen([*prefix, sys.executable, str(agent / "child.py"), db, str(LEASE)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=agent)
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], PATIENCE)
    line = child.stdout.readline() if ready else ""
    if line.strip() != "started":
        child.kill()
        raise AssertionError(f"the child did not reach its tool: {line!r} {child.communicate()[1]}")
    return child


def owner_state(db: str) -> dict[str, Any]:
    result = invoke("journal", "show", "--db", db, "--status", "pending", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.splitlines()[0])


def wait_until_gone(db: str) -> None:
    # The lease runs out LEASE seconds after its last renewal; what is waited for is that state,
    # however long a loaded machine takes to get there.
    deadline = time.monotonic() + PATIENCE
    while owner_state(db)["owner_state"] != "gone":
        assert time.monotonic() < deadline, "the killed child's lease never ran out"
        time.sleep(0.2)


def blocked_child_is_alive_then_reconciled_once(agent: Path, db: str, prefix: list[str]) -> None:
    child = start_child(agent, db, prefix)
    try:
        shown = owner_state(db)
        assert (shown["call_id"], shown["status"], shown["owner_state"]) == ("call_k1", "pending", "alive")
        assert shown["lease_expires_at"] is not None
        table = invoke("journal", "show", "--db", db)
        assert "pending (owner alive)" in table.stdout

        refused = invoke("journal", "resolve", "call_k1", "--not-applied", "--reason", "looks stuck", "--db", db)
        assert refused.exit_code == 1 and "--force" in refused.output
        asked = invoke("journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db, "--json")
        assert asked.exit_code == 0, asked.output
        assert [json.loads(line)["outcome"] for line in asked.stdout.splitlines()] == ["skipped"]
        # The lease is renewed while the tool runs: its end moves on, past what it was, and the owner
        # stays alive. What is waited for is two renewals, however long a loaded machine takes.
        first = shown["lease_expires_at"]
        deadline = time.monotonic() + PATIENCE
        while True:
            now = owner_state(db)
            if now["lease_expires_at"] > first:
                renewed = now["lease_expires_at"]
                break
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.2)
        while owner_state(db)["lease_expires_at"] == renewed:
            assert time.monotonic() < deadline, "the lease was renewed only once"
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(PATIENCE)
    wait_until_gone(db)
    assert "pending (owner gone)" in invoke("journal", "show", "--db", db).stdout

    settled = invoke("journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db, "--json")
    assert settled.exit_code == 0, settled.output
    lines = [json.loads(line) for line in settled.stdout.splitlines()]
    assert [(r["call_id"], r["outcome"], r["message"]) for r in lines] == [("call_k1", "applied", "found ch_1")]
    again = invoke("journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db)
    assert again.exit_code == 0 and again.output == "No call in doubt.\n"

    with open_journal(db, create=False) as j:
        record = j.call("call_k1")
        assert record is not None and record.status == "committed"
        assert record.actor == "reconciler:charge_exists"
        assert [e.kind for e in j.call_events("call_k1")] == ["pending", "committed"]
        assert j.verify().ok
    # The agent's retry gets the backend's value; the tool never runs again.
    import agent_tools

    from guard import AirlockContext

    charge = agent_tools.make_charge(db, LEASE)
    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": "call_k1"}):
        assert charge("acct_1", 500) == {"charge_id": "ch_1", "cents": 500}


def test_a_killed_child_is_reconciled_once_after_its_lease(agent: Path, db: str) -> None:
    blocked_child_is_alive_then_reconciled_once(agent, db, [])


@pytest.mark.skipif(not can_unshare_pid(), reason="this machine does not allow unshare --pid")
def test_a_child_in_another_pid_namespace_is_alive_while_its_tool_runs(agent: Path, db: str) -> None:
    # Same host name, another PID namespace (a container sharing the host's network): its pid
    # means nothing here, and only its lease tells whether it runs.
    blocked_child_is_alive_then_reconciled_once(agent, db, ["unshare", "--pid", "--fork", "--kill-child"])
