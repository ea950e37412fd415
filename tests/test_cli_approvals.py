"""``airlock journal approvals | approve | deny`` as an operator types them, on SQLite and PostgreSQL:
the queue listed in every form, decisions appended with compare-and-set, and every bad input a
clear error with nothing appended."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.approvals import ApprovalQueue
from guard.effect_guard import EffectGuard
from journal import open_journal
from tests.cli_support import invoke

PATIENCE = 120.0


@pytest.fixture
def db(journal_target: str) -> str:
    """Where the journal of every store (tests/conftest.py) is to be."""
    return journal_target


class Agent:
    """An agent whose refunds wait for an operator, on the journal ``db``."""

    def __init__(self, db: str, ttl: float = 3600.0, quorum: int = 1) -> None:
        self.journal = open_journal(db)
        self.refunds: list[int] = []
        policy = SecurityPolicy(escalate_tools={"refund": "gives money back"},
                                approver=ApprovalQueue(ttl=ttl, quorum=quorum),
                                effect_guard=EffectGuard(store=self.journal))

        @Airlock(policy=policy)
        def refund(charge_id: str, cents: int) -> dict[str, Any]:
            self.refunds.append(cents)
            return {"refund_id": f"re_{len(self.refunds)}", "cents": cents}

        self.refund = refund

    def call(self, call_id: str, cents: int = 500, agent: str = "agent-1") -> Any:
        with AirlockContext(agent_id=agent, metadata={"tool_call_id": call_id}):
            return self.refund("ch_1", cents)


@pytest.fixture
def agent(db: str) -> Iterator[Agent]:
    made = Agent(db)
    try:
        yield made
    finally:
        made.journal.close()


def events(db: str) -> list[tuple[int, str, str]]:
    with open_journal(db, create=False) as j:
        return [(e.seq, e.kind, e.actor) for e in j.events()]


def test_the_queue_in_every_form_then_approved_and_run_once(agent: Agent, db: str) -> None:
    for _ in range(3):
        assert agent.call("call_a")["block_reason"] == "approval_pending"  # one request, however often
    assert agent.call("call_b", cents=900, agent="agent-2")["block_reason"] == "approval_pending"
    table = invoke("journal", "approvals", "--db", db)
    assert table.exit_code == 0, table.output
    header, *lines = table.stdout.splitlines()
    assert header.split()[:5] == ["REQUEST", "CALL", "ID", "TOOL", "STATUS"]
    assert [line.split()[1] for line in lines] == ["call_b", "call_a"]  # newest first
    assert all("open" in line and "0/1" in line and "gives money back" in line for line in lines)
    as_json = [json.loads(line) for line in invoke("journal", "approvals", "--db", db, "--json").stdout.splitlines()]
    assert [(r["call_id"], r["tool"], r["agent_id"], r["status"], r["arguments"]) for r in as_json] == [
        ("call_b", "refund", "agent-2", "open", {"charge_id": "ch_1", "cents": 900}),
        ("call_a", "refund", "agent-1", "open", {"charge_id": "ch_1", "cents": 500})]
    assert invoke("journal", "approvals", "--db", db, "--nl").stdout == invoke(
        "journal", "approvals", "--db", db, "--json").stdout
    rows = list(csv.DictReader(io.StringIO(invoke("journal", "approvals", "--db", db, "--csv").stdout)))
    assert [r["call_id"] for r in rows] == ["call_b", "call_a"] and rows[0]["votes"] == "0/1"
    paged = invoke("journal", "approvals", "--db", db, "--limit", "1", "--offset", "1", "--json")
    assert [json.loads(line)["call_id"] for line in paged.stdout.splitlines()] == ["call_a"]
    assert invoke("journal", "approvals", "--db", db, "--tool", "charge").stderr.strip() == "No requests match."

    done = invoke("journal", "approve", "call_a", "--operator", "alice", "--reason", "agreed", "--db", db)
    assert done.exit_code == 0, done.output
    assert "approved by operator:alice for call call_a" in done.stdout
    assert agent.call("call_a") == {"refund_id": "re_1", "cents": 500}
    assert agent.refunds == [500]
    statuses = {r["call_id"]: r["status"] for r in map(json.loads, invoke(
        "journal", "approvals", "--db", db, "--json").stdout.splitlines())}
    assert statuses == {"call_a": "consumed", "call_b": "open"}
    consumed = invoke("journal", "approvals", "--db", db, "--status", "consumed", "--json").stdout.splitlines()
    assert [json.loads(line)["call_id"] for line in consumed] == ["call_a"]
    shown = invoke("journal", "show", "call_a", "--db", db, "--json")
    kinds = [e["kind"] for e in json.loads(shown.stdout)["events"]]
    assert kinds[0] == "approval_requested" and "approved" in kinds and "approval_consumed" in kinds
    timeline = invoke("journal", "show", "call_a", "--db", db)
    assert "approval_requested" in timeline.stdout and "operator:alice" in timeline.stdout
    assert invoke("journal", "verify", "--db", db).exit_code == 0


def test_deny_needs_a_reason_and_refuses_the_retries_with_it(agent: Agent, db: str) -> None:
    agent.call("call_d")
    before = events(db)
    no_reason = invoke("journal", "deny", "call_d", "--db", db)
    assert no_reason.exit_code == 2 and "--reason" in no_reason.stderr
    blank = invoke("journal", "deny", "call_d", "--reason", "  ", "--db", db)
    assert blank.exit_code == 2
    assert events(db) == before
    denied = invoke("journal", "deny", "call_d", "--reason", "above the limit", "--operator", "bob", "--db", db)
    assert denied.exit_code == 0, denied.output
    refused = agent.call("call_d")
    assert refused["block_reason"] == "escalation_denied" and "above the limit" in refused["error"]
    assert agent.refunds == []


@pytest.mark.parametrize("case", ["unknown call", "decided", "consumed", "same operator", "empty operator"])
def test_a_decision_that_cannot_be_taken_is_an_error_and_appends_nothing(agent: Agent, db: str, case: str) -> None:
    agent.call("call_x")
    call_id, operator, code = "call_x", "alice", 1
    if case == "unknown call":
        call_id = "call_nope"
    elif case == "decided":
        assert invoke("journal", "deny", "call_x", "--reason", "no", "--db", db).exit_code == 0
    elif case == "consumed":
        assert invoke("journal", "approve", "call_x", "--operator", "bob", "--db", db).exit_code == 0
        assert not is_refusal(agent.call("call_x"))
    elif case == "same operator":
        agent.journal.close()
        twice = Agent(db, quorum=2)
        twice.call("call_y")
        call_id = "call_y"
        assert invoke("journal", "approve", "call_y", "--operator", "alice", "--db", db).exit_code == 0
        twice.journal.close()
    else:
        operator, code = "  ", 2
    before = events(db)
    result = invoke("journal", "approve", call_id, "--operator", operator, "--db", db)
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("Error:") and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output
    assert events(db) == before


def test_an_expired_request_is_listed_expired_and_denied_by_default(db: str) -> None:
    agent = Agent(db, ttl=0.05)
    try:
        assert agent.call("call_e")["block_reason"] == "approval_pending"
        deadline = time.monotonic() + PATIENCE
        while True:  # past its expiry, by whatever the machine's pace
            shown = invoke("journal", "approvals", "--db", db, "--json").stdout
            listed = [json.loads(line) for line in shown.splitlines()]
            if listed[0]["status"] == "expired":
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        late = invoke("journal", "approve", "call_e", "--db", db)
        assert late.exit_code == 1 and "expired" in late.stderr
        refused = agent.call("call_e")
        assert refused["block_reason"] == "escalation_denied" and "expired" in refused["error"]
        assert agent.call("call_e")["block_reason"] == "approval_pending"  # a later retry asks again
        assert agent.refunds == []
    finally:
        agent.journal.close()


def test_a_journal_that_does_not_exist_is_an_error_and_is_not_made(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    for command in (["approvals"], ["approve", "c1"], ["deny", "c1", "--reason", "r"]):
        result = invoke("journal", *command, "--db", str(missing))
        assert result.exit_code == 1 and result.stderr.startswith("Error:")
    assert not missing.exists()


def test_every_command_has_an_example() -> None:
    for command in ("approvals", "approve", "deny"):
        assert "Example:" in invoke("journal", command, "--help").stdout
