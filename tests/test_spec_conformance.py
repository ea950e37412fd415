"""The behaviour contract, checked from the outside.

Every test here is written against the behaviour contract alone: it imports only the public names the contract
lists, and asserts only what the contract states (names, shapes, codes, exit codes, event kinds and fields, the
hash rule and the key rule recomputed independently with hashlib and orjson, the SQLite schema seen through a raw
sqlite3 connection, the CLI's commands, flags and messages, and the host adapters fed plain dicts).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import dataclasses
import datetime as dt
import functools
import getpass
import hashlib
import inspect
import io
import itertools
import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli.main import main as cli_main
from guard import (
    Airlock,
    AirlockBlocked,
    AirlockContext,
    OversightRequest,
    OversightResponse,
    OversightVerdict,
    Refusal,
    SecurityPolicy,
    get_current_context,
    is_refusal,
    requires,
)
from guard.effect_guard import (
    EffectGuard,
    EffectOutcomeUnknown,
    EffectStore,
    InMemoryEffectStore,
    idempotency_key,
    reversibility,
)
from journal import NewerSchema, NotAJournal, SQLiteJournal

PYTHON = sys.executable
AIRLOCK = str(Path(sys.executable).with_name("airlock"))
KINDS = {"pending", "committed", "unknown", "released", "replayed", "refused"}
EVENT_FIELDS = [
    "seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "arguments", "value", "error",
    "reason", "actor", "attempt", "owner", "prev_hash", "hash",
]
BODY_FIELDS = [
    "seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "arguments_sha256", "value_sha256",
    "error", "reason", "actor", "attempt", "owner",
]
PROJECTION_COLUMNS = {"call_id", "tool", "status", "attempt", "agent_id", "idempotency_key", "created_at", "updated_at"}
AT_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
ZEROS = "0" * 64


# --------------------------------------------------------------------------------------------------------------
# independent recomputations of the two byte rules


def canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def expected_key(tool: str, arguments: dict[str, Any]) -> str:
    return hashlib.sha256(tool.encode() + b"\x00" + canonical(arguments)).hexdigest()


def sha(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def event_hash(prev_hash: str, event: dict[str, Any]) -> str:
    body = {name: event[name] for name in BODY_FIELDS}
    return hashlib.sha256(prev_hash.encode("ascii") + canonical(body)).hexdigest()


# --------------------------------------------------------------------------------------------------------------
# building blocks


def close(store: Any) -> None:
    closer = getattr(store, "close", None)
    if callable(closer):
        closer()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "journal.db"


@pytest.fixture
def journal(db: Path) -> Iterator[Any]:
    j = SQLiteJournal(str(db))
    try:
        yield j
    finally:
        close(j)


def guard_for(store: Any, *, on_block: str = "return", eg: dict[str, Any] | None = None, **policy: Any) -> Airlock:
    effect_guard = EffectGuard(store=store, **(eg or {}))
    return Airlock(policy=SecurityPolicy(effect_guard=effect_guard, **policy), on_block=on_block)


def ctx(call_id: str | None = None, agent_id: str | None = "agent-1", **extra: Any) -> AirlockContext:
    metadata: dict[str, Any] = dict(extra)
    if call_id is not None:
        metadata["tool_call_id"] = call_id
    return AirlockContext(agent_id=agent_id, metadata=metadata)


def report_field(report: Any, name: str) -> Any:
    if isinstance(report, dict):
        return report[name]
    return getattr(report, name)


def raw(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=10, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    return conn


def table_columns(conn: sqlite3.Connection) -> dict[str, set[str]]:
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    return {t: {r[1] for r in conn.execute(f'PRAGMA table_info("{t}")')} for t in tables}


def events_table(conn: sqlite3.Connection) -> str:
    found = [t for t, cols in table_columns(conn).items() if set(EVENT_FIELDS) <= cols]
    assert len(found) == 1, f"exactly one events table with the columns of section 3, found {found}"
    return found[0]


def projection_table(conn: sqlite3.Connection) -> str:
    found = [t for t, cols in table_columns(conn).items() if cols >= PROJECTION_COLUMNS and "hash" not in cols]
    assert len(found) == 1, f"exactly one projection table, found {found}"
    return found[0]


JSON_COLUMNS = ("arguments", "value", "error", "reason", "owner")


def db_events(path: Path) -> list[dict[str, Any]]:
    conn = raw(path)
    try:
        t = events_table(conn)
        rows = [dict(r) for r in conn.execute(f'SELECT * FROM "{t}" ORDER BY seq')]
    finally:
        conn.close()
    for row in rows:
        for col in JSON_COLUMNS:
            if row[col] is not None:
                row[col + "_raw"] = row[col]
                row[col] = json.loads(row[col])
    return rows


def db_calls(path: Path) -> dict[str, dict[str, Any]]:
    conn = raw(path)
    try:
        t = projection_table(conn)
        rows = [dict(r) for r in conn.execute(f'SELECT * FROM "{t}"')]
    finally:
        conn.close()
    return {r["call_id"]: r for r in rows}


def snapshot(path: Path) -> tuple[Any, Any]:
    return (
        [{k: v for k, v in e.items()} for e in db_events(path)],
        {k: dict(v) for k, v in db_calls(path).items()},
    )


def run_cli(*args: str, env: dict[str, str | None] | None = None) -> Any:
    runner = CliRunner()
    result = runner.invoke(cli_main, list(args), env=env or {}, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError(
            "the CLI raised instead of exiting:\n"
            + "".join(traceback.format_exception(type(result.exception), result.exception,
                                                 result.exception.__traceback__))
        )
    return result


def assert_error_line(result: Any) -> None:
    assert result.exit_code == 1, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output


def export_lines(path: Path, *extra: str) -> list[dict[str, Any]]:
    result = run_cli("journal", "export", "--db", str(path), *extra)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def count(path: Path, kind: str, code: str | None = None) -> int:
    return sum(
        1 for e in db_events(path)
        if e["kind"] == kind and (code is None or (e["reason"] or {}).get("code") == code)
    )


def make_pay(airlock: Airlock, runs: list[Any], tag: str | None = None, name: str = "pay") -> Any:
    def pay(account: str, cents: int = 100) -> dict[str, Any]:
        runs.append((account, cents))
        return {"charged": cents, "account": account}

    pay.__name__ = name
    pay.__qualname__ = name
    if tag is not None:
        pay = reversibility(tag)(pay)
    return airlock(pay)


def populate(journal: Any) -> None:
    """A small journal with every status: committed, replayed, unknown, released, pending-free, refused."""
    airlock = guard_for(journal, denied_tools=["forbidden"])
    runs: list[Any] = []
    pay = make_pay(airlock, runs)

    @airlock
    def ship(order: str) -> str:
        raise TimeoutError("backend timed out")

    @airlock
    def flaky(n: int) -> int:
        raise ValueError("bad input")

    @airlock
    def forbidden(x: int) -> int:
        return x

    with ctx("c-pay", agent_id="alice"):
        pay("acct-1", 500)
    with ctx("c-pay", agent_id="alice"):
        pay("acct-1", 500)  # replayed
    with ctx("c-ship", agent_id="bob"), pytest.raises(TimeoutError):
        ship("o-1")
    with ctx("c-flaky", agent_id="bob"), pytest.raises(ValueError):
        flaky(3)
    with ctx("c-forbidden", agent_id="bob"):
        forbidden(1)


# --------------------------------------------------------------------------------------------------------------
# 1. layout and import direction


def test_guard_imports_neither_journal_nor_cli_nor_any_sdk() -> None:
    code = (
        "import sys, guard, guard.effect_guard\n"
        "bad = [m for m in ('journal', 'cli', 'openai', 'anthropic', 'mcp', 'psycopg') if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_journal_does_not_import_cli() -> None:
    code = "import sys, journal\nprint('cli' in sys.modules, any(m.startswith('cli.') for m in sys.modules))\n"
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False False"


def test_effect_store_is_a_protocol() -> None:
    assert getattr(EffectStore, "_is_protocol", False) is True


# --------------------------------------------------------------------------------------------------------------
# 2.1 decorator and context


def test_wrapper_keeps_name_doc_wrapped_and_signature() -> None:
    airlock = Airlock(policy=SecurityPolicy())

    def transfer(account: str, cents: int = 5) -> int:
        """Move money."""
        return cents

    wrapped = airlock(transfer)
    assert wrapped.__wrapped__ is transfer
    assert wrapped.__name__ == "transfer"
    assert wrapped.__doc__ == "Move money."
    assert inspect.signature(wrapped) == inspect.signature(transfer)


def test_async_tool_stays_awaitable() -> None:
    airlock = Airlock(policy=SecurityPolicy())

    @airlock
    async def lookup(x: int) -> int:
        await asyncio.sleep(0)
        return x * 2

    assert inspect.iscoroutinefunction(lookup)
    result = lookup(21)
    assert inspect.isawaitable(result)
    assert asyncio.run(result) == 42


def test_context_nesting_sync_and_async() -> None:
    assert get_current_context() is None
    outer = AirlockContext(agent_id="outer")
    inner = AirlockContext(agent_id="inner", metadata={"tool_call_id": "x"})
    with outer:
        assert get_current_context() is outer
        with inner:
            assert get_current_context() is inner
        assert get_current_context() is outer
    assert get_current_context() is None

    async def go() -> None:
        async with outer:
            assert get_current_context() is outer
            async with inner:
                assert get_current_context() is inner
            assert get_current_context() is outer
        assert get_current_context() is None

    asyncio.run(go())


def test_context_inside_call_is_a_copy_with_key_and_call_id() -> None:
    seen: list[Any] = []
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    def pay(account: str, cents: int = 100) -> str:
        seen.append(get_current_context())
        return "ok"

    host = AirlockContext(agent_id="a1", metadata={"tool_call_id": "call-7", "other": 1})
    before_meta = dict(host.metadata)
    with host:
        assert pay("acct") == "ok"
    inner = seen[0]
    assert inner is not host
    assert inner.tool_call_id == "call-7"
    assert inner.idempotency_key == expected_key("pay", {"account": "acct", "cents": 100})
    assert inner.agent_id == "a1"
    assert dict(host.metadata) == before_meta
    assert getattr(host, "idempotency_key", None) is None
    assert getattr(host, "tool_call_id", None) in (None, "call-7")


def test_context_inside_call_without_host_context_is_fresh() -> None:
    seen: list[Any] = []

    @Airlock(policy=SecurityPolicy())
    def look(x: int) -> int:
        seen.append(get_current_context())
        return x

    assert get_current_context() is None
    assert look(1) == 1
    assert isinstance(seen[0], AirlockContext)
    assert seen[0].tool_call_id is None
    assert get_current_context() is None


# --------------------------------------------------------------------------------------------------------------
# 2.2 policy


def test_allowed_tools_none_allows_everything_and_list_restricts() -> None:
    @Airlock(policy=SecurityPolicy(allowed_tools=None))
    def anything(x: int) -> int:
        return x

    assert anything(3) == 3

    runs: list[int] = []

    def other(x: int) -> int:
        runs.append(x)
        return x

    restricted = Airlock(policy=SecurityPolicy(allowed_tools=["read_*", "ping"]))(other)
    result = restricted(1)
    assert is_refusal(result)
    assert result["block_reason"] == "policy_violation"
    assert runs == []

    def read_file(x: int) -> int:
        return x

    assert Airlock(policy=SecurityPolicy(allowed_tools=["read_*"]))(read_file)(4) == 4


def test_denied_tools_win_over_allowed() -> None:
    runs: list[int] = []

    def read_secret(x: int) -> int:
        runs.append(x)
        return x

    wrapped = Airlock(policy=SecurityPolicy(allowed_tools=["read_*"], denied_tools=["*_secret"]))(read_secret)
    result = wrapped(1)
    assert is_refusal(result) and result["block_reason"] == "policy_violation"
    assert runs == []


def test_refusal_shape() -> None:
    @Airlock(policy=SecurityPolicy(denied_tools=["drop"]))
    def drop(x: int) -> int:
        return x

    with ctx("tc-1"):
        result = drop(1)
    assert isinstance(result, Refusal)
    assert isinstance(result, dict)
    assert result["success"] is False
    assert result["status"] == "blocked"
    assert result["block_reason"] == "policy_violation"
    assert isinstance(result["error"], str) and result["error"]
    assert isinstance(result["fix_hints"], list) and all(isinstance(h, str) for h in result["fix_hints"])
    assert result["metadata"]["tool"] == "drop"
    assert result["metadata"]["tool_call_id"] == "tc-1"
    assert is_refusal(result)
    assert not is_refusal(dict(result))
    assert not is_refusal({"success": False, "status": "blocked", "block_reason": "policy_violation"})
    assert not is_refusal(None)


def test_on_block_raise() -> None:
    @Airlock(policy=SecurityPolicy(denied_tools=["drop"]), on_block="raise")
    def drop(x: int) -> int:
        return x

    with pytest.raises(AirlockBlocked) as info:
        drop(1)
    assert info.value.block_reason == "policy_violation"
    assert is_refusal(info.value.refusal)
    assert info.value.refusal["block_reason"] == "policy_violation"


def _approver(verdict: OversightVerdict | None, calls: list[OversightRequest], *, other_id: bool = False,
              raise_: bool = False) -> Any:
    def approve(request: OversightRequest) -> OversightResponse:
        calls.append(request)
        if raise_:
            raise RuntimeError("approver down")
        rid = "someone-else" if other_id else request.request_id
        return OversightResponse(request_id=rid, verdict=verdict, approver="carol")

    return approve


def test_escalation_without_approver_is_required() -> None:
    runs: list[Any] = []
    airlock = guard_for(InMemoryEffectStore(), escalate_tools={"pay": "moves money"})
    pay = make_pay(airlock, runs)
    with ctx("e-1"):
        result = pay("a", 1)
    assert is_refusal(result) and result["block_reason"] == "escalation_required"
    assert runs == []


@pytest.mark.parametrize(
    "kind", ["deny", "timeout", "exception", "other_request"],
)
def test_escalation_refused_unless_granted_for_this_request(kind: str) -> None:
    calls: list[OversightRequest] = []
    approver = {
        "deny": _approver(OversightVerdict.DENY, calls),
        "timeout": _approver(OversightVerdict.TIMEOUT, calls),
        "exception": _approver(OversightVerdict.GRANT, calls, raise_=True),
        "other_request": _approver(OversightVerdict.GRANT, calls, other_id=True),
    }[kind]
    runs: list[Any] = []
    airlock = guard_for(InMemoryEffectStore(), escalate_tools={"pa*": "moves money"}, approver=approver)
    pay = make_pay(airlock, runs)
    with ctx("e-2"):
        result = pay("a", 1)
    assert is_refusal(result) and result["block_reason"] == "escalation_denied"
    assert runs == []
    assert len(calls) == 1


def test_escalation_granted_runs_and_request_fields() -> None:
    calls: list[OversightRequest] = []
    runs: list[Any] = []
    airlock = guard_for(InMemoryEffectStore(), escalate_tools={"pay": "moves money"},
                        approver=_approver(OversightVerdict.GRANT, calls))
    pay = make_pay(airlock, runs)
    with ctx("e-3", agent_id="agent-x"):
        assert pay("acct", 7) == {"charged": 7, "account": "acct"}
    assert runs == [("acct", 7)]
    (request,) = calls
    assert request.tool_name == "pay"
    assert request.arguments == {"account": "acct", "cents": 7}
    assert request.reason == "moves money"
    assert request.tool_call_id == "e-3"
    assert request.agent_id == "agent-x"
    assert request.idempotency_key == expected_key("pay", {"account": "acct", "cents": 7})
    assert isinstance(request.request_id, str) and request.request_id
    assert request.requested_at is not None
    with pytest.raises(Exception):  # noqa: B017 - frozen
        request.tool_name = "other"  # type: ignore[misc]


def test_oversight_response_approver_optional() -> None:
    calls: list[OversightRequest] = []

    def approve(request: OversightRequest) -> OversightResponse:
        calls.append(request)
        return OversightResponse(request_id=request.request_id, verdict=OversightVerdict.GRANT)

    airlock = guard_for(InMemoryEffectStore(), escalate_tools={"pay": "r"}, approver=approve)
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    with ctx("e-4"):
        assert not is_refusal(pay("a", 1))
    assert runs == [("a", 1)]


def test_oversight_request_arguments_in_json_form_with_defaults() -> None:
    calls: list[OversightRequest] = []
    airlock = guard_for(InMemoryEffectStore(), escalate_tools={"book": "r"},
                        approver=_approver(OversightVerdict.GRANT, calls))
    when = dt.datetime(2026, 3, 4, 5, 6, 7, tzinfo=dt.UTC)

    @airlock
    def book(when: dt.datetime, tags: tuple[str, ...] = ("a", "b")) -> str:
        return "booked"

    with ctx("e-5"):
        assert book(when) == "booked"
    expected = orjson.loads(orjson.dumps({"when": when, "tags": ("a", "b")}))
    assert calls[0].arguments == expected


def test_requires_above_and_below_airlock() -> None:
    airlock_none = guard_for(InMemoryEffectStore())
    airlock_ok = guard_for(InMemoryEffectStore(), granted_capabilities=("payments:write",))

    def body(x: int) -> int:
        return x

    below_none = airlock_none(requires("payments:write")(body))
    above_none = requires("payments:write")(airlock_none(body))
    below_ok = airlock_ok(requires("payments:write")(body))
    above_ok = requires("payments:write")(airlock_ok(body))
    for i, fn in enumerate([below_none, above_none]):
        with ctx(f"cap-n{i}"):
            result = fn(1)
        assert is_refusal(result) and result["block_reason"] == "capability_denied"
    for i, fn in enumerate([below_ok, above_ok]):
        with ctx(f"cap-o{i}"):
            assert fn(2) == 2


def test_requires_several_capabilities_all_needed() -> None:
    airlock = guard_for(InMemoryEffectStore(), granted_capabilities=("a",))

    @airlock
    @requires("a", "b")
    def both(x: int) -> int:
        return x

    with ctx("cap-2"):
        result = both(1)
    assert is_refusal(result) and result["block_reason"] == "capability_denied"


# --------------------------------------------------------------------------------------------------------------
# 2.4 the gates, in order


def test_gate_order_policy_before_capability() -> None:
    airlock = guard_for(InMemoryEffectStore(), denied_tools=["pay"])

    def pay_(account: str) -> str:
        return account

    pay_.__name__ = "pay"
    fn = airlock(requires("x")(pay_))
    result = fn("a")  # no tool_call_id either
    assert result["block_reason"] == "policy_violation"


def test_gate_order_capability_before_tool_call_id() -> None:
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    @requires("x")
    def pay(account: str) -> str:
        return account

    assert pay("a")["block_reason"] == "capability_denied"


def test_gate_order_tool_call_id_before_target_args() -> None:
    airlock = guard_for(InMemoryEffectStore(), eg={"target_args": ("account",)})
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    assert pay(None)["block_reason"] == "tool_call_id_required"


def test_gate_order_target_args_before_escalation_and_approver_not_consulted() -> None:
    calls: list[OversightRequest] = []
    airlock = guard_for(InMemoryEffectStore(), eg={"target_args": ("account",)}, escalate_tools={"pay": "r"},
                        approver=_approver(OversightVerdict.GRANT, calls))
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    with ctx("g-1"):
        assert pay("")["block_reason"] == "target_args_required"
    assert calls == [] and runs == []


def test_policy_refusal_does_not_consult_approver() -> None:
    calls: list[OversightRequest] = []
    airlock = guard_for(InMemoryEffectStore(), denied_tools=["pay"], escalate_tools={"pay": "r"},
                        approver=_approver(OversightVerdict.GRANT, calls))
    pay = make_pay(airlock, [])
    with ctx("g-2"):
        assert pay("a")["block_reason"] == "policy_violation"
    assert calls == []


def test_approval_never_reused_on_replay(journal: Any) -> None:
    calls: list[OversightRequest] = []
    verdicts = [OversightVerdict.GRANT, OversightVerdict.GRANT, OversightVerdict.DENY]

    def approve(request: OversightRequest) -> OversightResponse:
        calls.append(request)
        return OversightResponse(request_id=request.request_id, verdict=verdicts[len(calls) - 1])

    airlock = guard_for(journal, escalate_tools={"pay": "r"}, approver=approve)
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    for _ in range(2):
        with ctx("g-3"):
            assert pay("a", 3) == {"charged": 3, "account": "a"}
    with ctx("g-3"):
        result = pay("a", 3)
    assert is_refusal(result) and result["block_reason"] == "escalation_denied"
    assert len(calls) == 3
    assert runs == [("a", 3)]


def test_policy_that_now_denies_refuses_the_replay(journal: Any, db: Path) -> None:
    runs: list[Any] = []
    first = make_pay(guard_for(journal), runs)
    later = make_pay(guard_for(journal, denied_tools=["pay"]), runs)
    with ctx("g-4"):
        first("a", 1)
    with ctx("g-4"):
        result = later("a", 1)
    assert is_refusal(result) and result["block_reason"] == "policy_violation"
    assert runs == [("a", 1)]
    assert count(db, "replayed") == 0


@pytest.mark.parametrize("call_id", [None, "", 123])
def test_tool_call_id_required_for_non_reversible(call_id: Any) -> None:
    for tag in (None, "costly", "irreversible"):
        runs: list[Any] = []
        pay = make_pay(guard_for(InMemoryEffectStore()), runs, tag=tag)
        with AirlockContext(metadata={} if call_id is None else {"tool_call_id": call_id}):
            result = pay("a")
        assert is_refusal(result) and result["block_reason"] == "tool_call_id_required", tag
        assert runs == []


def test_reversible_without_tool_call_id_runs_unguarded(journal: Any, db: Path) -> None:
    runs: list[Any] = []
    look = make_pay(guard_for(journal), runs, tag="reversible", name="look")
    assert look("a") == {"charged": 100, "account": "a"}
    assert look("a") == {"charged": 100, "account": "a"}
    assert len(runs) == 2
    assert count(db, "pending") == 0


def test_reversible_without_tool_call_id_still_gets_other_gates() -> None:
    runs: list[Any] = []
    look = make_pay(guard_for(InMemoryEffectStore(), denied_tools=["look"]), runs, tag="reversible", name="look")
    assert look("a")["block_reason"] == "policy_violation"
    assert runs == []


def test_require_tool_call_id_false_lets_a_call_without_id_run() -> None:
    runs: list[Any] = []
    pay = make_pay(guard_for(InMemoryEffectStore(), eg={"require_tool_call_id": False}), runs)
    assert pay("a") == {"charged": 100, "account": "a"}
    assert runs == [("a", 100)]


@pytest.mark.parametrize("value", [None, ""])
def test_target_args_required(value: Any) -> None:
    runs: list[Any] = []
    airlock = guard_for(InMemoryEffectStore(), eg={"target_args": ("account", "iban")})

    @airlock
    def pay(account: Any = None, iban: Any = None, cents: int = 1) -> str:
        runs.append(1)
        return "paid"

    with ctx("t-1"):
        assert pay(account=value, iban=value)["block_reason"] == "target_args_required"
    with ctx("t-2"):
        assert pay(account=value, iban="DE00") == "paid"
    assert runs == [1]


def test_target_args_and_irreversible_approval_apply_to_irreversible_only() -> None:
    airlock = guard_for(InMemoryEffectStore(), eg={"target_args": ("account",),
                                                   "require_approval_for_irreversible": True})
    for tag in ("reversible", "costly"):
        runs: list[Any] = []
        fn = make_pay(airlock, runs, tag=tag, name=f"f_{tag}")
        with ctx(f"t-{tag}"):
            assert fn(None) == {"charged": 100, "account": None}, tag
        assert len(runs) == 1, tag
    runs2: list[Any] = []
    irreversible = make_pay(airlock, runs2, tag="irreversible", name="f_irr")
    with ctx("t-irr-none"):
        assert irreversible(None)["block_reason"] == "target_args_required"
    with ctx("t-irr"):
        assert irreversible("acct")["block_reason"] == "escalation_required"
    assert runs2 == []


def test_require_approval_for_irreversible_untagged_tool() -> None:
    calls: list[OversightRequest] = []
    airlock = guard_for(InMemoryEffectStore(), eg={"require_approval_for_irreversible": True},
                        approver=_approver(OversightVerdict.GRANT, calls))
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    with ctx("t-3"):
        assert pay("a") == {"charged": 100, "account": "a"}
    assert len(calls) == 1


# --------------------------------------------------------------------------------------------------------------
# 2.5 the idempotency key

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tool=st.text(min_size=1, max_size=10), arguments=st.dictionaries(st.text(max_size=6), json_values, max_size=5),
       data=st.data())
def test_idempotency_key_byte_rule(tool: str, arguments: dict[str, Any], data: Any) -> None:
    key = idempotency_key(tool, arguments)
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert key == expected_key(tool, arguments)
    order = data.draw(st.permutations(list(arguments)))
    assert idempotency_key(tool, {k: arguments[k] for k in order}) == key


def test_idempotency_key_nested_key_order_never_matters() -> None:
    a = {"x": {"b": 1, "a": [{"d": 1, "c": 2}]}, "y": 2}
    b = {"y": 2, "x": {"a": [{"c": 2, "d": 1}], "b": 1}}
    assert idempotency_key("t", a) == idempotency_key("t", b) == expected_key("t", a)


def test_idempotency_key_dataclasses_and_pydantic_key_order() -> None:
    import pydantic

    @dataclasses.dataclass
    class BA:
        b: int
        a: str

    @dataclasses.dataclass
    class AB:
        a: str
        b: int

    class PBA(pydantic.BaseModel):
        b: int
        a: str

    plain = {"v": {"a": "s", "b": 1}}
    expected = expected_key("t", plain)
    assert idempotency_key("t", {"v": BA(b=1, a="s")}) == expected
    assert idempotency_key("t", {"v": AB(a="s", b=1)}) == expected
    assert idempotency_key("t", {"v": PBA(b=1, a="s")}) == expected


def test_key_binding_positional_keyword_defaults() -> None:
    keys: list[str] = []
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    def f(account: str, cents: int = 5, note: str = "n") -> str:
        keys.append(get_current_context().idempotency_key)
        return "ok"

    for i, call in enumerate([lambda: f("a", 5), lambda: f(account="a", cents=5), lambda: f("a", cents=5),
                              lambda: f("a")]):
        with ctx(f"k-{i}"):
            call()
    assert len(set(keys)) == 1
    assert keys[0] == expected_key("f", {"account": "a", "cents": 5, "note": "n"})


def test_key_binding_var_args_and_kwargs() -> None:
    keys: list[str] = []
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    def g(a: int, *rest: int, **extra: Any) -> str:
        keys.append(get_current_context().idempotency_key)
        return "ok"

    with ctx("k-va"):
        g(1, 2, 3, x=4, y="z")
    assert keys[0] == expected_key("g", {"a": 1, "rest": [2, 3], "x": 4, "y": "z"})


def test_key_does_not_depend_on_tool_call_id() -> None:
    keys: list[str] = []

    @guard_for(InMemoryEffectStore())
    def h(x: int) -> str:
        keys.append(get_current_context().idempotency_key)
        return "ok"

    for cid in ("one", "two"):
        with ctx(cid):
            h(1)
    assert keys[0] == keys[1] == expected_key("h", {"x": 1})


def test_argument_named_tool_call_id_is_ordinary() -> None:
    seen: list[Any] = []
    runs: list[Any] = []

    @guard_for(InMemoryEffectStore())
    def notify(tool_call_id: str, text: str) -> str:
        runs.append(1)
        c = get_current_context()
        seen.append((c.tool_call_id, c.idempotency_key))
        return "sent"

    result = notify(tool_call_id="abc", text="hi")  # no context id: the argument is not the call's id
    assert is_refusal(result) and result["block_reason"] == "tool_call_id_required"
    assert runs == []
    with ctx("real-id"):
        assert notify(tool_call_id="abc", text="hi") == "sent"
    assert seen[0] == ("real-id", expected_key("notify", {"tool_call_id": "abc", "text": "hi"}))


@pytest.mark.parametrize("bad", [object(), float("nan"), float("inf"), float("-inf")])
def test_non_canonical_arguments_refused_where_key_needed(bad: Any) -> None:
    runs: list[Any] = []
    pay = make_pay(guard_for(InMemoryEffectStore()), runs)
    with ctx("nc-1"):
        result = pay(bad)
    assert is_refusal(result) and result["block_reason"] == "arguments_not_canonical"
    assert runs == []


def test_non_canonical_arguments_refused_for_escalation_before_approver() -> None:
    calls: list[OversightRequest] = []
    runs: list[Any] = []
    look = make_pay(guard_for(InMemoryEffectStore(), escalate_tools={"look": "r"},
                              approver=_approver(OversightVerdict.GRANT, calls)), runs, tag="reversible", name="look")
    result = look(object())
    assert is_refusal(result) and result["block_reason"] == "arguments_not_canonical"
    assert calls == [] and runs == []


def test_non_canonical_refusal_comes_after_gate_four() -> None:
    airlock = guard_for(InMemoryEffectStore(), eg={"target_args": ("account",)})

    @airlock
    def pay(account: Any = None, blob: Any = None) -> str:
        return "x"

    assert pay(None, object())["block_reason"] == "tool_call_id_required"
    with ctx("nc-2"):
        assert pay(None, object())["block_reason"] == "target_args_required"


def test_non_canonical_arguments_run_when_no_key_needed() -> None:
    seen: list[Any] = []
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    @reversibility("reversible")
    def look(thing: Any) -> str:
        seen.append(get_current_context().idempotency_key)
        return "seen"

    assert look(object()) == "seen"
    assert seen == [None]


# --------------------------------------------------------------------------------------------------------------
# 2.6 the effect guard


STORES = ["memory", "sqlite"]


@pytest.fixture(params=STORES)
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    store = InMemoryEffectStore() if request.param == "memory" else SQLiteJournal(str(tmp_path / "s.db"))
    try:
        yield store
    finally:
        close(store)


def test_committed_replays_stored_json_form(any_store: Any) -> None:
    @dataclasses.dataclass
    class Receipt:
        id: str
        cents: int

    when = dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.UTC)
    value = {"pair": (1, 2), "receipt": Receipt("r1", 5), "at": when}
    runs: list[Any] = []

    @guard_for(any_store)
    def pay(account: str) -> Any:
        runs.append(account)
        return value

    with ctx("r-1"):
        first = pay("a")
    assert first is value
    with ctx("r-1"):
        second = pay("a")
    assert runs == ["a"]
    assert second == orjson.loads(orjson.dumps(value))
    assert second == {"pair": [1, 2], "receipt": {"id": "r1", "cents": 5}, "at": "2026-01-02T03:04:05.123456+00:00"}


def test_unencodable_value_returned_first_then_replay_value_unavailable(any_store: Any) -> None:
    token = object()
    runs: list[Any] = []

    @guard_for(any_store)
    def mint(n: int) -> Any:
        runs.append(n)
        return token

    with ctx("u-1"):
        assert mint(1) is token
    for _ in range(2):
        with ctx("u-1"):
            result = mint(1)
        assert is_refusal(result) and result["block_reason"] == "replay_value_unavailable"
    assert runs == [1]


@pytest.mark.parametrize("kind", ["generator", "iterator", "awaitable", "async_generator"])
def test_deferred_result_recorded_unknown_and_returned_untouched(any_store: Any, kind: str) -> None:
    made: list[Any] = []

    def gen() -> Iterator[int]:
        yield 1

    async def coro() -> int:
        return 1

    async def agen() -> Any:
        yield 1

    @guard_for(any_store)
    def stream(n: int) -> Any:
        obj = {"generator": gen, "iterator": lambda: iter([1, 2]), "awaitable": coro, "async_generator": agen}[kind]()
        made.append(obj)
        return obj

    with ctx("d-1"):
        result = stream(1)
    assert result is made[0]
    with ctx("d-1"):
        again = stream(1)
    assert is_refusal(again) and again["block_reason"] == "effect_status_unknown"
    assert again["metadata"]["status"] == "unknown"
    assert len(made) == 1
    if kind == "awaitable":
        result.close()


def test_ambiguous_error_recorded_unknown_and_reraised(any_store: Any) -> None:
    runs: list[Any] = []
    err = TimeoutError("backend timed out")

    @guard_for(any_store)
    def pay(account: str) -> str:
        runs.append(account)
        raise err

    with ctx("a-1"), pytest.raises(TimeoutError) as info:
        pay("a")
    assert info.value is err
    with ctx("a-1"):
        result = pay("a")
    assert is_refusal(result) and result["block_reason"] == "effect_status_unknown"
    md = result["metadata"]
    assert md["status"] == "unknown"
    assert md["idempotency_key"] == expected_key("pay", {"account": "a"})
    assert md["attempt"] == 1
    assert md["since"]
    assert "idempotency" in result["error"].lower()
    assert "retry" in result["error"].lower()
    assert runs == ["a"]


@pytest.mark.parametrize("exc", [ConnectionResetError, ConnectionAbortedError, BrokenPipeError, EffectOutcomeUnknown])
def test_default_ambiguous_errors(exc: type[BaseException]) -> None:
    runs: list[Any] = []

    @guard_for(InMemoryEffectStore())
    def pay(account: str) -> str:
        runs.append(account)
        raise exc("lost")

    with ctx("a-2"), pytest.raises(exc):
        pay("a")
    with ctx("a-2"):
        assert pay("a")["block_reason"] == "effect_status_unknown"
    assert len(runs) == 1


def test_custom_ambiguous_errors() -> None:
    class Lost(Exception):
        pass

    runs: list[Any] = []

    @guard_for(InMemoryEffectStore(), eg={"ambiguous_errors": (Lost,)})
    def pay(account: str) -> str:
        runs.append(account)
        raise Lost("?")

    with ctx("a-3"), pytest.raises(Lost):
        pay("a")
    with ctx("a-3"):
        assert pay("a")["block_reason"] == "effect_status_unknown"


def test_other_exception_released_and_runs_again(any_store: Any) -> None:
    attempts: list[int] = []

    @guard_for(any_store)
    def pay(account: str) -> str:
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            raise ValueError("declined")
        return "paid"

    with ctx("x-1"), pytest.raises(ValueError):
        pay("a")
    with ctx("x-1"):
        assert pay("a") == "paid"
    with ctx("x-1"):
        assert pay("a") == "paid"
    assert attempts == [1, 2]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_base_exception_recorded_unknown(any_store: Any, exc: type[BaseException]) -> None:
    runs: list[Any] = []

    @guard_for(any_store)
    def pay(account: str) -> str:
        runs.append(account)
        raise exc()

    with ctx("b-1"), pytest.raises(exc):
        pay("a")
    with ctx("b-1"):
        result = pay("a")
    assert result["block_reason"] == "effect_status_unknown"
    assert runs == ["a"]


def test_async_tool_awaited_inside_guard_and_cancellation_unknown(any_store: Any) -> None:
    runs: list[Any] = []
    airlock = guard_for(any_store)

    @airlock
    async def pay(account: str) -> dict[str, Any]:
        runs.append(account)
        await asyncio.sleep(0)
        return {"paid": (1, 2)}

    @airlock
    async def hang(account: str) -> str:
        runs.append(account)
        await asyncio.sleep(10)
        return "never"

    async def go() -> None:
        async with ctx("as-1"):
            assert await pay("a") == {"paid": (1, 2)}
        async with ctx("as-1"):
            assert await pay("a") == {"paid": [1, 2]}
        async with ctx("as-2"):
            task = asyncio.ensure_future(hang("h"))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        async with ctx("as-2"):
            result = await hang("h")
        assert result["block_reason"] == "effect_status_unknown"

    asyncio.run(go())
    assert runs == ["a", "h"]


def test_tool_call_id_reused_with_other_arguments_or_tool(any_store: Any) -> None:
    airlock = guard_for(any_store)
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    refund = make_pay(airlock, runs, name="refund")
    with ctx("re-1"):
        pay("a", 1)
    for call in (lambda: pay("a", 2), lambda: refund("a", 1)):
        with ctx("re-1"):
            result = call()
        assert is_refusal(result) and result["block_reason"] == "policy_violation"
        assert result["metadata"]["violation_type"] == "tool_call_id_reused"
    assert runs == [("a", 1)]


@pytest.mark.parametrize("earlier", ["unknown", "released"])
def test_reused_id_with_other_arguments_refused_for_every_status(any_store: Any, earlier: str) -> None:
    runs: list[Any] = []

    @guard_for(any_store)
    @reversibility("reversible")
    def look(q: str) -> str:
        runs.append(q)
        raise (TimeoutError if earlier == "unknown" else ValueError)("x")

    with ctx("re-2"), pytest.raises(TimeoutError if earlier == "unknown" else ValueError):
        look("a")
    assert any_store.get("re-2").status == earlier
    with ctx("re-2"):
        result = look("b")
    assert result["block_reason"] == "policy_violation"
    assert result["metadata"]["violation_type"] == "tool_call_id_reused"
    assert runs == ["a"]


def test_reversible_unknown_runs_again_with_next_attempt(journal: Any, db: Path) -> None:
    runs: list[Any] = []

    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        runs.append(q)
        if len(runs) == 1:
            raise TimeoutError("slow")
        return "found"

    with ctx("rv-1"), pytest.raises(TimeoutError):
        look("a")
    with ctx("rv-1"):
        assert look("a") == "found"
    assert runs == ["a", "a"]
    pendings = [e for e in db_events(db) if e["kind"] == "pending"]
    assert [e["attempt"] for e in pendings] == [1, 2]
    assert db_calls(db)["rv-1"]["attempt"] == 2
    assert db_calls(db)["rv-1"]["status"] == "committed"


def test_costly_is_not_run_again_on_doubt() -> None:
    runs: list[Any] = []

    @guard_for(InMemoryEffectStore())
    @reversibility("costly")
    def render(q: str) -> str:
        runs.append(q)
        raise TimeoutError("slow")

    with ctx("co-1"), pytest.raises(TimeoutError):
        render("a")
    with ctx("co-1"):
        assert render("a")["block_reason"] == "effect_status_unknown"
    assert runs == ["a"]


def test_reversibility_tags() -> None:
    with pytest.raises(ValueError):
        reversibility("maybe")
    with pytest.raises(ValueError):
        reversibility("")

    def tool(q: str) -> str:
        raise TimeoutError("x")

    # strictest tag wins, above or below the decorator
    for name, build in [
        ("above", lambda a: reversibility("irreversible")(a(reversibility("reversible")(tool)))),
        ("below", lambda a: a(reversibility("reversible")(reversibility("costly")(tool)))),
        ("above_only", lambda a: reversibility("costly")(a(tool))),
    ]:
        fn = build(guard_for(InMemoryEffectStore()))
        with ctx(f"tag-{name}"), pytest.raises(TimeoutError):
            fn("q")
        with ctx(f"tag-{name}"):
            assert fn("q")["block_reason"] == "effect_status_unknown", name
    # reversible above the decorator: runs again on doubt, and runs without a tool_call_id
    runs: list[Any] = []

    def look(q: str) -> str:
        runs.append(q)
        return "ok"

    fn = reversibility("reversible")(guard_for(InMemoryEffectStore())(look))
    assert fn("q") == "ok"


def test_effect_guards_without_store_do_not_share() -> None:
    runs: list[Any] = []

    def pay(account: str) -> str:
        runs.append(account)
        return "paid"

    one = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))(pay)
    two = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))(pay)
    with ctx("ns-1"):
        one("a")
    with ctx("ns-1"):
        two("a")
    with ctx("ns-1"):
        one("a")
    assert runs == ["a", "a"]


def test_outcome_recording_failure_keeps_pending(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = SQLiteJournal(str(db), busy_timeout=0.2)
    holder: list[sqlite3.Connection] = []
    runs: list[Any] = []
    try:
        @guard_for(journal)
        def pay(account: str) -> str:
            runs.append(account)
            conn = raw(db)
            conn.execute("BEGIN IMMEDIATE")
            holder.append(conn)
            return "paid"

        caplog.set_level(logging.DEBUG, logger="guard")
        with ctx("of-1"):
            assert pay("a") == "paid"
        holder[0].execute("ROLLBACK")
        holder[0].close()
        assert any(r.name == "guard" or r.name.startswith("guard.") for r in caplog.records)
        with ctx("of-1"):
            result = pay("a")
        assert is_refusal(result) and result["block_reason"] == "effect_status_unknown"
        assert result["metadata"]["status"] == "pending"
        assert runs == ["a"]
        assert db_calls(db)["of-1"]["status"] == "pending"
    finally:
        for c in holder:
            c.close()
        close(journal)


def test_store_unavailable_fails_closed(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = SQLiteJournal(str(db), busy_timeout=0.2)
    conn = raw(db)
    runs: list[Any] = []
    try:
        pay = make_pay(guard_for(journal), runs)
        caplog.set_level(logging.DEBUG, logger="guard")
        conn.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with ctx("su-1"):
            result = pay("a")
        assert time.monotonic() - started < 10
        conn.execute("ROLLBACK")
        assert is_refusal(result) and result["block_reason"] == "store_unavailable"
        assert runs == []
        assert any(r.name == "guard" or r.name.startswith("guard.") for r in caplog.records)
        assert count(db, "refused", "store_unavailable") == 0
        # once the file is free again, the call may run
        with ctx("su-1"):
            assert pay("a") == {"charged": 100, "account": "a"}
    finally:
        conn.close()
        close(journal)


def test_threads_sharing_one_journal_run_the_tool_at_most_once(journal: Any) -> None:
    runs: list[Any] = []
    lock = threading.Lock()

    @guard_for(journal)
    def pay(account: str) -> str:
        with lock:
            runs.append(account)
        time.sleep(0.1)
        return "paid"

    barrier = threading.Barrier(8)
    results: list[Any] = []

    def worker() -> None:
        barrier.wait()
        with ctx("th-1"):
            r = pay("a")
        with lock:
            results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert runs == ["a"]
    assert len(results) == 8
    for r in results:
        assert r == "paid" or (is_refusal(r) and r["block_reason"] == "effect_status_unknown"), r


PROCESS_SCRIPT = r"""
import sys, time, os
from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
db, effects = sys.argv[1], sys.argv[2]
j = SQLiteJournal(db)
@Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=j)))
def charge(account):
    with open(effects, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.05)
    return "charged"
out = []
for _ in range(5):
    with AirlockContext(metadata={"tool_call_id": "proc-1"}):
        r = charge("acct")
    out.append(r["block_reason"] if is_refusal(r) else r)
j.close()
print(",".join(out))
"""


def test_processes_sharing_one_file_run_the_tool_at_most_once(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    close(SQLiteJournal(str(db)))
    effects = tmp_path / "effects.txt"
    procs = [subprocess.Popen([PYTHON, "-c", PROCESS_SCRIPT, str(db), str(effects)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.extend(out.strip().split(","))
    assert len(effects.read_text().splitlines()) == 1
    assert set(outs) <= {"charged", "effect_status_unknown"}
    assert "database is locked" not in " ".join(outs)


def test_late_outcome_appended_with_its_attempt(journal: Any, db: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()
    calls: list[int] = []

    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        calls.append(1)
        if len(calls) == 1:
            entered.set()
            gate.wait(10)
            raise ValueError("late failure")
        return "second"

    errors: list[BaseException] = []

    def first() -> None:
        try:
            with ctx("late-1"):
                look("q")
        except ValueError as e:
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(10)
    with ctx("late-1"):
        assert look("q") == "second"
    gate.set()
    t.join(10)
    assert len(errors) == 1
    events = [e for e in db_events(db) if e["call_id"] == "late-1"]
    kinds = [(e["kind"], e["attempt"]) for e in events]
    assert ("released", 1) in kinds
    assert ("committed", 2) in kinds
    assert kinds.index(("released", 1)) > kinds.index(("committed", 2))
    call = db_calls(db)["late-1"]
    assert call["status"] == "committed" and call["attempt"] == 2
    assert report_field(journal.verify(), "ok") is True
    journal.rebuild()
    assert _projected(db_calls(db)) == _projected({"late-1": call})
    with ctx("late-1"):
        assert look("q") == "second"
    assert len(calls) == 2


# --------------------------------------------------------------------------------------------------------------
# 3. the journal


def test_every_gate_refusal_appends_exactly_one_refused_event(journal: Any, db: Path) -> None:
    @dataclasses.dataclass
    class Case:
        code: str
        call_id: str | None
        build: Any

    def plain(account: Any = "a", cents: int = 1) -> str:
        return "ok"

    def tool(airlock: Airlock, *decorators: Any, name: str = "pay") -> Any:
        fn = functools.wraps(plain)(lambda *a, **k: plain(*a, **k))
        fn.__name__ = name
        for d in decorators:
            fn = d(fn)
        return airlock(fn)

    cases = [
        ("policy_violation", "rf-1", lambda: tool(guard_for(journal, denied_tools=["pay"]))("a")),
        ("policy_violation", None, lambda: tool(guard_for(journal, denied_tools=["pay"]))("a")),
        ("capability_denied", "rf-2", lambda: tool(guard_for(journal), requires("x"))("a")),
        ("tool_call_id_required", None, lambda: tool(guard_for(journal))("a")),
        ("target_args_required", "rf-3", lambda: tool(guard_for(journal, eg={"target_args": ("account",)}))(None)),
        ("escalation_required", "rf-4", lambda: tool(guard_for(journal, escalate_tools={"pay": "r"}))("a")),
        ("escalation_denied", "rf-5",
         lambda: tool(guard_for(journal, escalate_tools={"pay": "r"},
                                approver=_approver(OversightVerdict.DENY, [])))("a")),
        ("arguments_not_canonical", "rf-6", lambda: tool(guard_for(journal))(float("nan"))),
    ]
    for code, call_id, call in cases:
        before = count(db, "refused", code)
        calls_before = db_calls(db)
        if call_id is None:
            result = call()
        else:
            with ctx(call_id):
                result = call()
        assert is_refusal(result) and result["block_reason"] == code, (code, result)
        assert count(db, "refused", code) == before + 1, code
        last = db_events(db)[-1]
        assert last["kind"] == "refused"
        assert last["reason"]["code"] == code
        assert isinstance(last["reason"]["message"], str)
        assert last["call_id"] == call_id
        assert last["tool"] == "pay"
        assert db_calls(db) == calls_before, f"{code} must not create or change a projection row"
    kinds = {e["kind"] for e in db_events(db)}
    assert kinds == {"refused"}


def test_effect_guard_refusals_and_replays_do_not_change_projection(journal: Any, db: Path) -> None:
    runs: list[Any] = []
    airlock = guard_for(journal)
    pay = make_pay(airlock, runs)

    @airlock
    def ship(order: str) -> str:
        raise TimeoutError("t")

    @airlock
    def mint(n: int) -> Any:
        return object()

    with ctx("pj-1"):
        pay("a")
    with ctx("pj-2"), pytest.raises(TimeoutError):
        ship("o")
    with ctx("pj-3"):
        mint(1)
    before = db_calls(db)
    for cid, call, code in [
        ("pj-1", lambda: pay("a"), None),
        ("pj-1", lambda: pay("b"), "policy_violation"),
        ("pj-2", lambda: ship("o"), "effect_status_unknown"),
        ("pj-3", lambda: mint(1), "replay_value_unavailable"),
    ]:
        n_events = len(db_events(db))
        with ctx(cid):
            result = call()
        events = db_events(db)
        assert len(events) == n_events + 1
        if code is None:
            assert events[-1]["kind"] == "replayed"
        else:
            assert result["block_reason"] == code
            assert events[-1]["kind"] == "refused" and events[-1]["reason"]["code"] == code
        assert events[-1]["call_id"] == cid
        assert _projected(db_calls(db)) == _projected(before)


def _projected(calls: dict[str, dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """The projected fields a refusal or a replay must leave alone."""
    return {cid: (r["status"], r["attempt"], r["tool"], r["idempotency_key"], r.get("arguments"))
            for cid, r in calls.items()}


def test_event_columns_and_contents(journal: Any, db: Path) -> None:
    populate(journal)
    events = db_events(db)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert {e["kind"] for e in events} <= KINDS
    by = {(e["call_id"], e["kind"]): e for e in events}
    committed = by[("c-pay", "committed")]
    assert committed["value"] == {"charged": 500, "account": "acct-1"}
    assert committed["arguments"] == {"account": "acct-1", "cents": 500}
    assert committed["arguments_raw"] == canonical({"account": "acct-1", "cents": 500}).decode()
    assert committed["idempotency_key"] == expected_key("pay", {"account": "acct-1", "cents": 500})
    assert committed["tool"] == "pay" and committed["agent_id"] == "alice"
    assert committed["actor"] == "guard" and committed["attempt"] == 1
    assert committed["owner"]["pid"] == os.getpid()
    assert isinstance(committed["owner"]["host"], str) and committed["owner"]["host"]
    assert ("c-pay", "replayed") in by
    unknown = by[("c-ship", "unknown")]
    assert "TimeoutError" in unknown["error"]["type"]
    assert unknown["error"]["message"] == "backend timed out"
    released = by[("c-flaky", "released")]
    assert "ValueError" in released["error"]["type"]
    assert released["error"]["message"] == "bad input"
    refused = by[("c-forbidden", "refused")]
    assert refused["reason"]["code"] == "policy_violation"
    for e in events:
        assert e["actor"] == "guard"
        assert re.fullmatch(r"[0-9a-f]{64}", e["hash"])
    assert events[0]["prev_hash"] == ZEROS
    for a, b in itertools.pairwise(events):
        assert b["prev_hash"] == a["hash"]


def test_projection_columns_and_fold(journal: Any, db: Path) -> None:
    populate(journal)
    calls = db_calls(db)
    assert set(calls) == {"c-pay", "c-ship", "c-flaky"}
    assert calls["c-pay"]["status"] == "committed"
    assert calls["c-ship"]["status"] == "unknown"
    assert calls["c-flaky"]["status"] == "released"
    for cid, row in calls.items():
        transitions = [e for e in db_events(db) if e["call_id"] == cid and e["kind"] not in ("refused", "replayed")]
        assert row["status"] == transitions[-1]["kind"]
        assert row["attempt"] == transitions[-1]["attempt"]
        assert row["tool"] == transitions[-1]["tool"]
        assert row["idempotency_key"] == transitions[-1]["idempotency_key"]
    assert calls["c-pay"]["agent_id"] == "alice"


def test_user_version_and_file_mode(db: Path) -> None:
    close(SQLiteJournal(str(db)))
    assert db.stat().st_mode & 0o777 == 0o600
    conn = raw(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] >= 1
    finally:
        conn.close()


def test_file_mode_0600_even_with_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = tmp_path / "open.db"
        close(SQLiteJournal(str(path)))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600


def test_database_refuses_update_and_delete_of_events(journal: Any, db: Path) -> None:
    populate(journal)
    before = db_events(db)
    conn = raw(db)
    try:
        t = events_table(conn)
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute(f'UPDATE "{t}" SET tool = ? WHERE seq = 1', ("forged",))
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute(f'DELETE FROM "{t}" WHERE seq = 1')
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute(f'DELETE FROM "{t}"')
    finally:
        conn.close()
    assert db_events(db) == before


def test_verify_and_rebuild_api(journal: Any, db: Path) -> None:
    populate(journal)
    events = db_events(db)
    report = journal.verify()
    assert report_field(report, "ok") is True
    assert report_field(report, "events") == len(events)
    assert report_field(report, "head") == events[-1]["hash"]
    assert report_field(report, "first_bad_seq") is None
    assert not report_field(report, "problem")
    before = db_calls(db)
    journal.rebuild()
    assert db_calls(db) == before
    assert report_field(journal.verify(), "ok") is True


def _drop_triggers(conn: sqlite3.Connection) -> None:
    for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'").fetchall():
        conn.execute(f'DROP TRIGGER "{name}"')


def test_verify_finds_an_altered_event(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    conn = raw(db)
    try:
        _drop_triggers(conn)
        conn.execute(f'UPDATE "{events_table(conn)}" SET tool = ? WHERE seq = 3', ("forged",))
    finally:
        conn.close()
    j = SQLiteJournal(str(db))
    try:
        report = j.verify()
        assert report_field(report, "ok") is False
        assert report_field(report, "first_bad_seq") == 3
        assert report_field(report, "problem")
    finally:
        close(j)
    result = run_cli("journal", "verify", "--db", str(db))
    assert result.exit_code == 1
    assert re.search(r"\bseq 3\b", result.output), result.output


def test_verify_checks_projection_and_rebuild_repairs_it(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    conn = raw(db)
    try:
        t = projection_table(conn)
        try:
            conn.execute(f'UPDATE "{t}" SET status = ? WHERE call_id = ?', ("released", "c-pay"))
        except sqlite3.DatabaseError:
            pytest.skip("the projection cannot be altered by hand here")
    finally:
        conn.close()
    result = run_cli("journal", "verify", "--db", str(db))
    assert result.exit_code == 1, result.output
    result = run_cli("journal", "rebuild", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert db_calls(db)["c-pay"]["status"] == "committed"
    assert run_cli("journal", "verify", "--db", str(db)).exit_code == 0


def test_hash_chain_recomputed_from_export(journal: Any, db: Path) -> None:
    populate(journal)
    lines = export_lines(db)
    assert len(lines) == len(db_events(db))
    prev = ZEROS
    for line in lines:
        assert line["prev_hash"] == prev
        assert line["hash"] == event_hash(prev, line), line["seq"]
        prev = line["hash"]
    assert prev == db_events(db)[-1]["hash"]


def test_durability_process_and_busy_timeout_accepted(tmp_path: Path) -> None:
    j = SQLiteJournal(str(tmp_path / "p.db"), durability="process", busy_timeout=5.0)
    try:
        runs: list[Any] = []
        pay = make_pay(guard_for(j), runs)
        with ctx("dp-1"):
            pay("a")
        with ctx("dp-1"):
            pay("a")
        assert runs == [("a", 100)]
    finally:
        close(j)


def test_opening_a_non_journal_is_an_error_and_changes_nothing(tmp_path: Path) -> None:
    text = tmp_path / "notes.db"
    text.write_bytes(b"these are not the droids\n" * 20)
    before = text.read_bytes()
    with pytest.raises(NotAJournal, match="not an airlock journal"):
        SQLiteJournal(str(text))
    assert text.read_bytes() == before

    other = tmp_path / "other.db"
    conn = sqlite3.connect(str(other))
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO customers (name) VALUES ('ada')")
    conn.commit()
    conn.close()
    before = other.read_bytes()
    with pytest.raises(NotAJournal, match="not an airlock journal"):
        SQLiteJournal(str(other))
    assert other.read_bytes() == before
    assert not Path(str(other) + "-wal").exists() or Path(str(other) + "-wal").stat().st_size == 0


def test_opening_a_newer_schema_is_an_error_and_changes_nothing(db: Path) -> None:
    close(SQLiteJournal(str(db)))
    conn = sqlite3.connect(str(db))
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    conn.execute(f"PRAGMA user_version = {version + 100}")
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    before = db.read_bytes()
    with pytest.raises(NewerSchema, match="newer"):
        SQLiteJournal(str(db))
    assert db.read_bytes() == before
    result = run_cli("journal", "stats", "--db", str(db))
    assert_error_line(result)
    assert db.read_bytes() == before


# --------------------------------------------------------------------------------------------------------------
# 4. the CLI

SUBCOMMANDS = ["show", "resolve", "export", "verify", "rebuild", "stats"]


@pytest.mark.parametrize("command", [["journal", c] for c in SUBCOMMANDS] + [["demo"]])
def test_every_help_has_an_example(command: list[str]) -> None:
    result = run_cli(*command, "--help")
    assert result.exit_code == 0
    assert "Example:" in result.output


@pytest.mark.parametrize(
    "args",
    [["show"], ["show", "some-id"], ["show", "--json"], ["export"], ["export", "--format", "csv"], ["verify"],
     ["stats"], ["stats", "--json"],
     ["resolve", "some-id", "--applied", "--reason", "r"], ["resolve", "some-id", "--not-applied", "--reason", "r"]],
)
def test_commands_on_missing_journal_error_and_create_nothing(tmp_path: Path, args: list[str]) -> None:
    path = tmp_path / "missing.db"
    result = run_cli("journal", args[0], "--db", str(path), *args[1:])
    assert_error_line(result)
    assert sorted(os.listdir(tmp_path)) == []


def test_missing_journal_via_env_and_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AIRLOCK_JOURNAL", raising=False)
    assert_error_line(run_cli("journal", "stats", env={"AIRLOCK_JOURNAL": str(tmp_path / "env.db")}))
    assert_error_line(run_cli("journal", "show", env={"AIRLOCK_JOURNAL": None}))
    assert os.listdir(tmp_path) == []


def test_console_script_error_line_on_stderr(tmp_path: Path) -> None:
    path = tmp_path / "missing.db"
    out = subprocess.run([AIRLOCK, "journal", "verify", "--db", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not path.exists()


def test_db_from_env_and_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRLOCK_JOURNAL", raising=False)
    env_db = tmp_path / "env.db"
    j = SQLiteJournal(str(env_db))
    populate(j)
    close(j)
    result = run_cli("journal", "stats", "--json", env={"AIRLOCK_JOURNAL": str(env_db)})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["events"] == len(db_events(env_db))

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    default = work / "airlock-journal.db"
    j = SQLiteJournal(str(default))
    close(j)
    result = run_cli("journal", "stats", "--json", env={"AIRLOCK_JOURNAL": None})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["events"] == 0
    # --db wins over the environment
    result = run_cli("journal", "stats", "--json", "--db", str(default), env={"AIRLOCK_JOURNAL": str(env_db)})
    assert json.loads(result.stdout)["events"] == 0


def test_show_list_json(journal: Any, db: Path) -> None:
    populate(journal)
    result = run_cli("journal", "show", "--db", str(db), "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert [r["call_id"] for r in rows] == ["c-flaky", "c-ship", "c-pay"]  # newest first
    required = {"call_id", "tool", "status", "attempt", "agent_id", "idempotency_key", "created_at", "updated_at"}
    for r in rows:
        assert required <= set(r)
    by = {r["call_id"]: r for r in rows}
    assert by["c-pay"]["status"] == "committed" and by["c-pay"]["tool"] == "pay"
    assert by["c-pay"]["idempotency_key"] == expected_key("pay", {"account": "acct-1", "cents": 500})
    assert by["c-ship"]["agent_id"] == "bob" and by["c-ship"]["attempt"] == 1

    def ids(*extra: str) -> list[str]:
        res = run_cli("journal", "show", "--db", str(db), "--json", *extra)
        assert res.exit_code == 0, res.output
        return [json.loads(line)["call_id"] for line in res.stdout.splitlines() if line.strip()]

    assert ids("--status", "unknown") == ["c-ship"]
    assert ids("--tool", "pay") == ["c-pay"]
    assert ids("--agent", "bob") == ["c-flaky", "c-ship"]
    assert ids("--limit", "1") == ["c-flaky"]
    assert ids("--since", "2000-01-01T00:00:00.000000Z") == ["c-flaky", "c-ship", "c-pay"]
    assert ids("--since", "2999-01-01T00:00:00.000000Z") == []


def test_show_table(journal: Any, db: Path) -> None:
    populate(journal)
    result = run_cli("journal", "show", "--db", str(db))
    assert result.exit_code == 0, result.output
    for cid in ("c-pay", "c-ship", "c-flaky"):
        assert cid in result.stdout


def test_show_limit_defaults_to_50(journal: Any, db: Path) -> None:
    airlock = guard_for(journal)
    runs: list[Any] = []
    pay = make_pay(airlock, runs)
    for i in range(53):
        with ctx(f"many-{i:02d}"):
            pay("a", i)
    result = run_cli("journal", "show", "--db", str(db), "--json")
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(rows) == 50
    assert rows[0]["call_id"] == "many-52"


def test_show_one_call_json(journal: Any, db: Path) -> None:
    populate(journal)
    result = run_cli("journal", "show", "c-pay", "--db", str(db), "--json")
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout)
    assert obj["call_id"] == "c-pay"
    assert obj["status"] == "committed"
    assert obj["tool"] == "pay"
    kinds = [e["kind"] for e in obj["events"]]
    assert sorted(kinds) == sorted(["pending", "committed", "replayed"])
    expected_seqs = {e["seq"] for e in db_events(db) if e["call_id"] == "c-pay"}
    assert {e["seq"] for e in obj["events"]} == expected_seqs
    for e in obj["events"]:
        assert {"seq", "kind", "at", "actor"} <= set(e)
        assert AT_RE.match(e["at"]), e["at"]
        assert e["actor"] == "guard"
    table = run_cli("journal", "show", "c-pay", "--db", str(db))
    assert table.exit_code == 0 and "c-pay" in table.stdout


def test_show_id_with_only_refusals_has_null_status(journal: Any, db: Path) -> None:
    populate(journal)
    result = run_cli("journal", "show", "c-forbidden", "--db", str(db), "--json")
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout)
    assert obj["status"] is None
    assert [e["kind"] for e in obj["events"]] == ["refused"]


def test_show_unknown_id_is_an_error(journal: Any, db: Path) -> None:
    populate(journal)
    assert_error_line(run_cli("journal", "show", "no-such-call", "--db", str(db)))
    assert_error_line(run_cli("journal", "show", "no-such-call", "--db", str(db), "--json"))


def test_stats_json(journal: Any, db: Path) -> None:
    populate(journal)
    result = run_cli("journal", "stats", "--db", str(db), "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    for key in ("calls", "events", "by_status", "by_tool", "oldest_pending_at", "oldest_unknown_at"):
        assert key in stats
    assert stats["calls"] == 3
    assert stats["events"] == len(db_events(db))
    by_status = {k: v for k, v in stats["by_status"].items() if v}
    assert by_status == {"committed": 1, "unknown": 1, "released": 1}
    by_tool = {k: v for k, v in stats["by_tool"].items() if v}
    assert by_tool == {"pay": 1, "ship": 1, "flaky": 1}
    assert stats["oldest_pending_at"] is None
    unknown_at = next(e["at"] for e in export_lines(db) if e["kind"] == "unknown")
    parse = lambda s: dt.datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    assert parse(stats["oldest_unknown_at"]) == parse(unknown_at)
    table = run_cli("journal", "stats", "--db", str(db))
    assert table.exit_code == 0
    assert "committed" in table.stdout and "pay" in table.stdout


def test_verify_cli_ok_prints_count_and_head(journal: Any, db: Path) -> None:
    populate(journal)
    events = db_events(db)
    result = run_cli("journal", "verify", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"OK: {len(events)} events, head {events[-1]['hash']}\n"


def test_rebuild_cli(journal: Any, db: Path) -> None:
    populate(journal)
    before = db_calls(db)
    result = run_cli("journal", "rebuild", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert db_calls(db) == before


# ----- export


def test_export_jsonl_fields(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    out = tmp_path / "audit.jsonl"
    result = run_cli("journal", "export", "--db", str(db), "--output", str(out))
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    events = db_events(db)
    assert len(lines) == len(events)
    assert lines == export_lines(db, "--format", "jsonl")
    for line, ev in zip(lines, events, strict=False):
        for name in [*EVENT_FIELDS, "arguments_sha256", "value_sha256"]:
            assert name in line, name
        assert AT_RE.match(line["at"]), line["at"]
        for name in ("seq", "call_id", "kind", "tool", "agent_id", "idempotency_key", "actor", "attempt",
                     "prev_hash", "hash"):
            assert line[name] == ev[name], name
        for name in JSON_COLUMNS:
            assert line[name] == ev[name], name
            assert not isinstance(line[name], str), name
        assert line["arguments_sha256"] == (sha(line["arguments"]) if line["arguments"] is not None else None)
        if line["kind"] == "committed" and line["value"] is not None:
            assert line["value_sha256"] == sha(line["value"])
        if line["value"] is None and line["kind"] != "committed":
            assert line["value_sha256"] is None
        assert not line.get("redacted")


def test_export_redaction_still_verifies(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    full = export_lines(db)
    out = tmp_path / "redacted.jsonl"
    result = run_cli("journal", "export", "--db", str(db), "--redact", "arguments,value", "--output", str(out))
    assert result.exit_code == 0, result.output
    red = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert len(red) == len(full)
    for r, f in zip(red, full, strict=False):
        assert r["arguments"] is None and r["value"] is None
        assert set(r["redacted"]) <= {"arguments", "value"}
        if f["arguments"] is not None:
            assert "arguments" in r["redacted"]
        if f["value"] is not None:
            assert "value" in r["redacted"]
        assert r["arguments_sha256"] == f["arguments_sha256"]
        assert r["value_sha256"] == f["value_sha256"]
        assert r["hash"] == f["hash"]
        assert r["hash"] == event_hash(r["prev_hash"], r)
    check = run_cli("journal", "verify", "--export", str(out))
    assert check.exit_code == 0, check.output

    only_args = export_lines(db, "--redact", "arguments")
    assert len(only_args) == len(full)
    for r, f in zip(only_args, full, strict=True):
        assert r["arguments"] is None and r["value"] == f["value"]


def test_export_csv(journal: Any, db: Path) -> None:
    populate(journal)
    full = export_lines(db)
    result = run_cli("journal", "export", "--db", str(db), "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert len(rows) == len(full)
    for name in [*EVENT_FIELDS, "arguments_sha256", "value_sha256"]:
        assert name in rows[0], name
    for row, line in zip(rows, full, strict=False):
        assert int(row["seq"]) == line["seq"]
        assert row["hash"] == line["hash"]
        assert row["kind"] == line["kind"]
        for name in JSON_COLUMNS:
            if line[name] is not None:
                assert json.loads(row[name]) == line[name], name


def test_export_filters(journal: Any, db: Path) -> None:
    populate(journal)
    full = export_lines(db)
    by_call = [e["seq"] for e in full if e["call_id"] == "c-pay"]
    assert [e["seq"] for e in export_lines(db, "--call", "c-pay")] == by_call
    assert [e["seq"] for e in export_lines(db, "--tool", "ship")] == [e["seq"] for e in full if e["tool"] == "ship"]
    assert [e["seq"] for e in export_lines(db, "--agent", "bob")] == [e["seq"] for e in full if e["agent_id"] == "bob"]
    mid = full[len(full) // 2]["at"]
    since = export_lines(db, "--since", mid)
    assert all(e["at"] >= mid for e in since)
    assert {e["seq"] for e in full if e["at"] > mid} <= {e["seq"] for e in since}
    until = export_lines(db, "--until", mid)
    assert all(e["at"] <= mid for e in until)
    assert {e["seq"] for e in full if e["at"] < mid} <= {e["seq"] for e in until}


def test_verify_export_gaps_need_allow_gaps(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    out = tmp_path / "pay.jsonl"
    result = run_cli("journal", "export", "--db", str(db), "--tool", "ship", "--output", str(out))
    assert result.exit_code == 0
    seqs = [json.loads(line)["seq"] for line in out.read_text().splitlines() if line.strip()]
    assert seqs and seqs[0] > 1
    no = run_cli("journal", "verify", "--export", str(out))
    assert no.exit_code == 1, no.output
    yes = run_cli("journal", "verify", "--export", str(out), "--allow-gaps")
    assert yes.exit_code == 0, yes.output


def test_verify_export_finds_tampering(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    full = export_lines(db)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(line) + "\n" for line in full))
    ok = run_cli("journal", "verify", "--export", str(good))
    assert ok.exit_code == 0, ok.output
    # an altered field
    altered = [dict(line) for line in full]
    altered[2]["tool"] = "forged"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(line) + "\n" for line in altered))
    result = run_cli("journal", "verify", "--export", str(bad))
    assert result.exit_code == 1
    assert re.search(rf"\bseq {full[2]['seq']}\b", result.output), result.output
    # a broken link: an event removed from the middle is a gap without --allow-gaps
    gap = tmp_path / "gap.jsonl"
    gap.write_text("".join(json.dumps(line) + "\n" for i, line in enumerate(full) if i != 3))
    assert run_cli("journal", "verify", "--export", str(gap)).exit_code == 1


def test_verify_export_relinks_consecutive_only(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    full = export_lines(db)
    # a forged, self-consistent event whose prev_hash does not match its predecessor
    forged = [dict(line) for line in full]
    forged[4]["prev_hash"] = "1" * 64
    forged[4]["hash"] = event_hash(forged[4]["prev_hash"], forged[4])
    path = tmp_path / "forged.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in forged))
    result = run_cli("journal", "verify", "--export", str(path))
    assert result.exit_code == 1
    assert re.search(rf"\bseq {full[4]['seq']}\b", result.output), result.output


# ----- resolve


def _unknown_call(journal: Any) -> tuple[Any, list[Any]]:
    runs: list[Any] = []
    airlock = guard_for(journal)

    @airlock
    def charge(account: str) -> str:
        runs.append(account)
        if len(runs) == 1:
            raise TimeoutError("lost")
        return "charged again"

    with ctx("rs-1"), pytest.raises(TimeoutError):
        charge("acct")
    return charge, runs


def test_resolve_applied_with_value(journal: Any, db: Path) -> None:
    charge, runs = _unknown_call(journal)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), "--applied", "--value", '{"receipt": "r-9"}',
                     "--reason", "backend says it went through", "--operator", "dana")
    assert result.exit_code == 0, result.output
    last = db_events(db)[-1]
    assert last["kind"] == "committed"
    assert last["actor"] == "operator:dana"
    assert last["reason"] == {"code": "applied", "message": "backend says it went through"}
    assert last["value"] == {"receipt": "r-9"}
    assert db_calls(db)["rs-1"]["status"] == "committed"
    with ctx("rs-1"):
        assert charge("acct") == {"receipt": "r-9"}
    assert runs == ["acct"]
    assert db_events(db)[-1]["kind"] == "replayed"


def test_resolve_applied_without_value_default_operator(journal: Any, db: Path) -> None:
    charge, runs = _unknown_call(journal)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), "--applied", "--reason", "seen in ledger")
    assert result.exit_code == 0, result.output
    last = db_events(db)[-1]
    assert last["kind"] == "committed"
    try:
        user = getpass.getuser()
    except Exception:
        user = f"uid:{os.getuid()}"
    assert last["actor"] == f"operator:{user}"
    for _ in range(2):
        with ctx("rs-1"):
            result = charge("acct")
        assert is_refusal(result) and result["block_reason"] == "replay_value_unavailable"
    assert runs == ["acct"]


def test_resolve_not_applied_lets_the_call_run_again(journal: Any, db: Path) -> None:
    charge, runs = _unknown_call(journal)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), "--not-applied", "--reason", "never arrived",
                     "--operator", "dana")
    assert result.exit_code == 0, result.output
    last = db_events(db)[-1]
    assert last["kind"] == "released"
    assert last["actor"] == "operator:dana"
    assert last["reason"] == {"code": "not_applied", "message": "never arrived"}
    assert db_calls(db)["rs-1"]["status"] == "released"
    with ctx("rs-1"):
        assert charge("acct") == "charged again"
    assert runs == ["acct", "acct"]
    assert db_calls(db)["rs-1"]["attempt"] == 2
    assert db_calls(db)["rs-1"]["status"] == "committed"


@pytest.mark.parametrize(
    "flags",
    [
        ["--applied", "--not-applied", "--reason", "r"],
        ["--reason", "r"],
        ["--not-applied", "--value", "1", "--reason", "r"],
        ["--applied", "--value", "{not json", "--reason", "r"],
        ["--applied"],
        ["--applied", "--value", "", "--reason", "r"],
    ],
    ids=["both", "neither", "value-with-not-applied", "bad-json", "no-reason", "empty-value"],
)
def test_resolve_usage_errors_exit_2_and_change_nothing(journal: Any, db: Path, flags: list[str]) -> None:
    _unknown_call(journal)
    before = snapshot(db)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), *flags)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert snapshot(db) == before


def test_resolve_errors_exit_1_and_change_nothing(journal: Any, db: Path) -> None:
    populate(journal)
    before = snapshot(db)
    for cid in ("c-pay", "c-flaky", "c-forbidden", "no-such-call"):
        for flag in ("--applied", "--not-applied"):
            result = run_cli("journal", "resolve", cid, "--db", str(db), flag, "--reason", "r")
            assert_error_line(result)
            assert snapshot(db) == before


def test_resolve_pending_of_live_owner_needs_force(journal: Any, db: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()

    @guard_for(journal)
    def charge(account: str) -> str:
        entered.set()
        gate.wait(10)
        return "late"

    results: list[Any] = []

    def run() -> None:
        with ctx("pf-1"):
            results.append(charge("a"))

    t = threading.Thread(target=run)
    t.start()
    try:
        assert entered.wait(10)
        assert db_calls(db)["pf-1"]["status"] == "pending"
        before = snapshot(db)
        result = run_cli("journal", "resolve", "pf-1", "--db", str(db), "--not-applied", "--reason", "r")
        assert_error_line(result)
        assert snapshot(db) == before
        result = run_cli("journal", "resolve", "pf-1", "--db", str(db), "--not-applied", "--reason", "r", "--force")
        assert result.exit_code == 0, result.output
        assert db_calls(db)["pf-1"]["status"] == "released"
    finally:
        gate.set()
        t.join(10)
    assert results == ["late"]
    # the late outcome is still appended, with the attempt that produced it
    tail = [e for e in db_events(db) if e["call_id"] == "pf-1"]
    assert tail[-1]["kind"] == "committed" and tail[-1]["attempt"] == 1 and tail[-1]["actor"] == "guard"
    # and the projection still equals the fold of the log
    assert report_field(journal.verify(), "ok") is True
    before = _projected(db_calls(db))
    journal.rebuild()
    assert _projected(db_calls(db)) == before


DEAD_OWNER_SCRIPT = r"""
import os, sys
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
j = SQLiteJournal(sys.argv[1])
@Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=j)))
def charge(account):
    os._exit(0)
with AirlockContext(metadata={"tool_call_id": "dead-1"}):
    charge("a")
"""


def test_resolve_pending_of_dead_owner_without_force(db: Path) -> None:
    subprocess.run([PYTHON, "-c", DEAD_OWNER_SCRIPT, str(db)], check=True, timeout=60)
    assert db_calls(db)["dead-1"]["status"] == "pending"
    result = run_cli("journal", "resolve", "dead-1", "--db", str(db), "--not-applied", "--reason", "crashed")
    assert result.exit_code == 0, result.output
    assert db_calls(db)["dead-1"]["status"] == "released"


def test_read_only_commands_change_nothing(journal: Any, db: Path) -> None:
    populate(journal)
    before = snapshot(db)
    for args in (["show"], ["show", "--json"], ["show", "c-pay"], ["export"], ["verify"], ["stats", "--json"]):
        result = run_cli("journal", args[0], "--db", str(db), *args[1:])
        assert result.exit_code == 0, (args, result.output)
    assert snapshot(db) == before


def test_demo(tmp_path: Path) -> None:
    path = tmp_path / "demo.db"
    result = run_cli("demo", "--db", str(path))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    events = db_events(path)
    assert events
    assert {e["kind"] for e in events} <= KINDS
    assert any(e["call_id"] and e["call_id"] in result.stdout for e in events)
    assert run_cli("journal", "verify", "--db", str(path)).exit_code == 0


# --------------------------------------------------------------------------------------------------------------
# 5. host adapters


@pytest.fixture
def adapter_tools(journal: Any) -> tuple[dict[str, Any], list[Any], list[Any]]:
    runs: list[Any] = []
    seen: list[Any] = []
    airlock = guard_for(journal, denied_tools=["wipe"])

    @airlock
    def pay(account: str, cents: int = 1) -> dict[str, Any]:
        c = get_current_context()
        seen.append((c.tool_call_id, c.agent_id))
        runs.append((account, cents))
        return {"paid": cents}

    @airlock
    def wipe(disk: str) -> str:
        runs.append(disk)
        return "wiped"

    @airlock
    def boom(x: int) -> str:
        runs.append(x)
        raise ValueError("boom")

    return {"pay": pay, "wipe": wipe, "boom": boom}, runs, seen


def test_openai_chat_completions_dict(adapter_tools: Any, db: Path) -> None:
    from guard.adapters import openai as oa

    tools, runs, seen = adapter_tools
    call = {"id": "call_A", "type": "function",
            "function": {"name": "pay", "arguments": '{"account": "x", "cents": 3}'}}
    out = oa.dispatch(call, tools, agent_id="bot")
    assert set(out) == {"role", "tool_call_id", "content"}
    assert out["role"] == "tool" and out["tool_call_id"] == "call_A"
    assert json.loads(out["content"]) == {"paid": 3}
    assert seen == [("call_A", "bot")]
    again = oa.dispatch(call, list(tools.values()), agent_id="bot")
    assert json.loads(again["content"]) == {"paid": 3}
    assert runs == [("x", 3)]
    events = [e for e in db_events(db) if e["call_id"] == "call_A"]
    assert [e["kind"] for e in events] == ["pending", "committed", "replayed"]
    assert events[0]["agent_id"] == "bot"


def test_openai_responses_item_dict(adapter_tools: Any) -> None:
    from guard.adapters import openai as oa

    tools, _runs, seen = adapter_tools
    item = {"type": "function_call", "call_id": "fc_1", "name": "pay", "arguments": '{"account": "y"}'}
    out = oa.dispatch(item, tools)
    assert set(out) == {"type", "call_id", "output"}
    assert out["type"] == "function_call_output" and out["call_id"] == "fc_1"
    assert json.loads(out["output"]) == {"paid": 1}
    assert seen[0][0] == "fc_1"


def test_openai_sdk_objects() -> None:
    from openai.types.chat import ChatCompletionMessageToolCall
    from openai.types.chat.chat_completion_message_tool_call import Function

    from guard.adapters import openai as oa

    runs: list[Any] = []

    @guard_for(InMemoryEffectStore())
    def pay(account: str) -> str:
        runs.append(get_current_context().tool_call_id)
        return "ok"

    call = ChatCompletionMessageToolCall(id="call_S", type="function",
                                         function=Function(name="pay", arguments='{"account": "z"}'))
    out = oa.dispatch(call, [pay])
    assert out == {"role": "tool", "tool_call_id": "call_S", "content": json.dumps("ok").replace(" ", "")} or (
        out["role"] == "tool" and json.loads(out["content"]) == "ok")
    assert runs == ["call_S"]


def test_openai_refusal_text(adapter_tools: Any) -> None:
    from guard.adapters import openai as oa

    tools, runs, _ = adapter_tools
    out = oa.dispatch({"id": "call_W", "function": {"name": "wipe", "arguments": '{"disk": "c"}'}}, tools)
    body = json.loads(out["content"])
    assert body["block_reason"] == "policy_violation"
    assert body["error"] and isinstance(body["fix_hints"], list)
    assert runs == []


@pytest.mark.parametrize("arguments", ["{not json", '{"nope": 1}', "{}", '{"account": "x", "extra": 2}'])
def test_openai_bad_arguments_error_result_and_refused_event(adapter_tools: Any, db: Path, arguments: str) -> None:
    from guard.adapters import openai as oa

    tools, runs, _ = adapter_tools
    before = count(db, "refused")
    out = oa.dispatch({"id": "call_B", "type": "function", "function": {"name": "pay", "arguments": arguments}}, tools)
    assert out["role"] == "tool" and out["tool_call_id"] == "call_B"
    assert isinstance(out["content"], str) and out["content"]
    assert runs == []
    assert count(db, "refused") == before + 1
    assert db_events(db)[-1]["call_id"] == "call_B"


def test_anthropic_dict_and_errors(adapter_tools: Any, db: Path) -> None:
    from guard.adapters import anthropic as an

    tools, runs, seen = adapter_tools
    ok = an.dispatch({"type": "tool_use", "id": "toolu_1", "name": "pay", "input": {"account": "q", "cents": 9}},
                     tools, agent_id="assistant-7")
    assert set(ok) == {"type", "tool_use_id", "content", "is_error"}
    assert ok["type"] == "tool_result" and ok["tool_use_id"] == "toolu_1" and ok["is_error"] is False
    assert json.loads(ok["content"]) == {"paid": 9}
    assert seen == [("toolu_1", "assistant-7")]

    refused = an.dispatch({"type": "tool_use", "id": "toolu_2", "name": "wipe", "input": {"disk": "c"}}, tools)
    assert refused["is_error"] is True
    body = json.loads(refused["content"])
    assert body["block_reason"] == "policy_violation" and body["error"] and isinstance(body["fix_hints"], list)

    failed = an.dispatch({"type": "tool_use", "id": "toolu_3", "name": "boom", "input": {"x": 1}}, tools)
    assert failed["type"] == "tool_result" and failed["tool_use_id"] == "toolu_3"
    assert failed["is_error"] is True

    before = count(db, "refused")
    bad = an.dispatch({"type": "tool_use", "id": "toolu_4", "name": "pay", "input": {"wrong": 1}}, tools)
    assert bad["is_error"] is True
    assert count(db, "refused") == before + 1
    assert ("wrong", 1) not in runs and len([r for r in runs if isinstance(r, tuple)]) == 1


def test_anthropic_sdk_block() -> None:
    from anthropic.types import ToolUseBlock

    from guard.adapters import anthropic as an

    runs: list[Any] = []

    @guard_for(InMemoryEffectStore())
    def pay(account: str) -> str:
        runs.append(get_current_context().tool_call_id)
        return "ok"

    block = ToolUseBlock(id="toolu_S", name="pay", input={"account": "z"}, type="tool_use")
    out = an.dispatch(block, {"pay": pay})
    assert out["tool_use_id"] == "toolu_S" and out["is_error"] is False
    assert json.loads(out["content"]) == "ok"
    assert runs == ["toolu_S"]


def test_adispatch_async_tools(journal: Any) -> None:
    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    seen: list[Any] = []

    @guard_for(journal)
    async def lookup(q: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        seen.append(get_current_context().tool_call_id)
        return {"q": q}

    async def go() -> None:
        out = await oa.adispatch({"id": "call_as", "function": {"name": "lookup", "arguments": '{"q": "a"}'}},
                                 [lookup])
        assert out["tool_call_id"] == "call_as" and json.loads(out["content"]) == {"q": "a"}
        out2 = await an.adispatch({"type": "tool_use", "id": "toolu_as", "name": "lookup", "input": {"q": "b"}},
                                  {"lookup": lookup})
        assert out2["tool_use_id"] == "toolu_as" and out2["is_error"] is False
        assert json.loads(out2["content"]) == {"q": "b"}

    asyncio.run(go())
    assert seen == ["call_as", "toolu_as"]


def test_mcp_adapter_importable() -> None:
    import guard.adapters.mcp  # noqa: F401


def test_adapters_import_no_sdk_until_used() -> None:
    code = (
        "import sys, guard, guard.adapters\n"
        "print([m for m in ('openai', 'anthropic', 'mcp') if m in sys.modules])\n"
    )
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------------------------
# further edges of the contract


UNUSUAL_VALUES = {
    "int_keys": lambda: {1: "a"},
    "big_int": lambda: 2**70,
    "set": lambda: {1, 2},
    "nan": lambda: float("nan"),
    "nested_tuple": lambda: {"a": ((1, 2), [3])},
    "naive_datetime": lambda: dt.datetime(2026, 1, 1, 12, 0, 0),
    "date": lambda: dt.date(2026, 1, 1),
}


@pytest.mark.parametrize("name", sorted(UNUSUAL_VALUES))
def test_replay_of_unusual_values_is_the_same_from_every_store(tmp_path: Path, name: str) -> None:
    outcomes = []
    for kind in ("memory", "sqlite"):
        store = InMemoryEffectStore() if kind == "memory" else SQLiteJournal(str(tmp_path / f"{name}.db"))
        runs: list[Any] = []
        try:
            @guard_for(store)
            def give(n: int) -> Any:
                runs.append(n)  # noqa: B023 - called within this iteration
                return UNUSUAL_VALUES[name]()

            with ctx("uv-1"):
                give(1)
            with ctx("uv-1"):
                replay = give(1)
            assert runs == [1]
            outcomes.append(("refusal", replay["block_reason"]) if is_refusal(replay) else ("value", repr(replay)))
        finally:
            close(store)
    assert outcomes[0] == outcomes[1]
    if outcomes[0][0] == "refusal":
        assert outcomes[0][1] == "replay_value_unavailable"


def test_oldest_pending_at_is_when_the_call_entered_pending(journal: Any, db: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()
    calls: list[int] = []

    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError("slow")
        entered.set()
        gate.wait(10)
        return "ok"

    with ctx("op-1"), pytest.raises(TimeoutError):
        look("q")
    time.sleep(0.01)

    def second() -> None:
        with ctx("op-1"):
            look("q")

    t = threading.Thread(target=second)
    t.start()
    try:
        assert entered.wait(10)
        result = run_cli("journal", "stats", "--db", str(db), "--json")
        stats = json.loads(result.stdout)
        pendings = [e for e in export_lines(db) if e["kind"] == "pending"]
        assert len(pendings) == 2
        parse = lambda s: dt.datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
        assert parse(stats["oldest_pending_at"]) == parse(pendings[1]["at"])
        assert stats["oldest_unknown_at"] is None
        assert {k: v for k, v in stats["by_status"].items() if v} == {"pending": 1}
    finally:
        gate.set()
        t.join(10)


def test_stats_and_export_of_an_empty_journal(journal: Any, db: Path) -> None:
    result = run_cli("journal", "stats", "--db", str(db), "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["calls"] == 0 and stats["events"] == 0
    assert stats["oldest_pending_at"] is None and stats["oldest_unknown_at"] is None
    assert not any(stats["by_status"].values()) and not any(stats["by_tool"].values())
    assert export_lines(db) == []
    assert run_cli("journal", "verify", "--db", str(db)).exit_code == 0
    shown = run_cli("journal", "show", "--db", str(db), "--json")
    assert shown.exit_code == 0 and shown.stdout.strip() == ""


def test_fields_absent_where_the_contract_does_not_put_them(journal: Any, db: Path) -> None:
    populate(journal)
    for e in export_lines(db):
        if e["kind"] != "committed":
            assert e["value"] is None and e["value_sha256"] is None, e
        if e["kind"] not in ("unknown", "released"):
            assert e["error"] is None, e
        if e["kind"] == "refused":
            assert set(e["reason"]) == {"code", "message"}
        elif e["actor"] == "guard":
            assert e["reason"] is None, e
        assert set(e["owner"]) >= {"host", "pid"}


def test_refused_event_arguments_are_canonical(journal: Any, db: Path) -> None:
    airlock = guard_for(journal, denied_tools=["drop"], escalate_tools={"pay": "r"})

    @airlock
    def pay(zeta: int, alpha: dict[str, int]) -> str:
        return "x"

    @airlock
    def drop(zeta: int, alpha: dict[str, int]) -> str:
        return "x"

    with ctx("ca-1"):
        pay(1, {"b": 2, "a": 1})
    with ctx("ca-2"):
        drop(1, {"b": 2, "a": 1})
    events = db_events(db)
    assert [e["kind"] for e in events] == ["refused", "refused"]
    text = canonical({"zeta": 1, "alpha": {"a": 1, "b": 2}}).decode()
    assert events[0]["arguments_raw"] == text
    assert events[1].get("arguments_raw") in (None, text)


def test_non_canonical_refusal_is_journaled_and_the_chain_verifies(journal: Any, db: Path, tmp_path: Path) -> None:
    pay = make_pay(guard_for(journal), [])
    with ctx("nc-j"):
        assert pay(float("inf"))["block_reason"] == "arguments_not_canonical"
    with ctx("nc-j2"):
        pay("fine")
    events = db_events(db)
    assert [e["kind"] for e in events] == ["refused", "pending", "committed"]
    assert events[0]["reason"]["code"] == "arguments_not_canonical"
    assert report_field(journal.verify(), "ok") is True
    lines = export_lines(db)
    prev = ZEROS
    for line in lines:
        assert line["hash"] == event_hash(prev, line)
        prev = line["hash"]
    out = tmp_path / "x.jsonl"
    assert run_cli("journal", "export", "--db", str(db), "--output", str(out)).exit_code == 0
    assert run_cli("journal", "verify", "--export", str(out)).exit_code == 0


def test_journal_uses_wal(journal: Any, db: Path) -> None:
    conn = raw(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    finally:
        conn.close()


def test_verify_finds_a_deleted_event_and_a_truncated_tail(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    n = len(db_events(db))
    middle = db.with_name("middle.db")
    tail = db.with_name("tail.db")
    for target in (middle, tail):
        src = sqlite3.connect(str(db))
        dst = sqlite3.connect(str(target))
        src.backup(dst)
        src.close()
        dst.close()
    conn = raw(middle)
    _drop_triggers(conn)
    conn.execute(f'DELETE FROM "{events_table(conn)}" WHERE seq = 3')
    conn.close()
    result = run_cli("journal", "verify", "--db", str(middle))
    assert result.exit_code == 1, result.output
    # the chain up to seq 6 is intact, but the projection says c-flaky is released and c-forbidden absent
    conn = raw(tail)
    _drop_triggers(conn)
    released_seq = next(e["seq"] for e in db_events(tail) if e["call_id"] == "c-flaky" and e["kind"] == "released")
    conn.execute(f'DELETE FROM "{events_table(conn)}" WHERE seq >= ?', (released_seq,))
    conn.close()
    assert released_seq < n
    result = run_cli("journal", "verify", "--db", str(tail))
    assert result.exit_code == 1, result.output


def test_cli_on_a_file_that_is_not_a_journal(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n" * 50)
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    for path in (text, empty):
        before = path.read_bytes()
        for args in (["stats"], ["show"], ["verify"], ["export"]):
            result = run_cli("journal", args[0], "--db", str(path), *args[1:])
            assert_error_line(result)
            assert path.read_bytes() == before


@pytest.mark.parametrize(
    "args",
    [["show", "--limit", "many"], ["show", "--since", "not-a-time"], ["export", "--format", "xml"],
     ["export", "--redact", "password"], ["export", "--since", "yesterday-ish"]],
)
def test_malformed_values_are_usage_errors(journal: Any, db: Path, args: list[str]) -> None:
    populate(journal)
    before = snapshot(db)
    result = run_cli("journal", args[0], "--db", str(db), *args[1:])
    assert result.exit_code == 2, result.output
    assert snapshot(db) == before


def test_verify_export_of_a_malformed_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.jsonl"
    path.write_text('{"seq": 1\nnot json at all\n')
    result = run_cli("journal", "verify", "--export", str(path))
    assert_error_line(result) if not re.search(r"\bseq \d+", result.output) else None
    assert result.exit_code == 1


def test_verify_export_allow_gaps_still_checks_consecutive_links(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    lines = export_lines(db, "--call", "c-pay")  # seqs 1, 2, 3: consecutive
    assert [e["seq"] for e in lines] == [1, 2, 3]
    lines[2]["prev_hash"] = "2" * 64
    lines[2]["hash"] = event_hash(lines[2]["prev_hash"], lines[2])
    path = tmp_path / "f.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    result = run_cli("journal", "verify", "--export", str(path), "--allow-gaps")
    assert result.exit_code == 1
    assert re.search(r"\bseq 3\b", result.output), result.output


def test_show_one_call_has_the_call_fields(journal: Any, db: Path) -> None:
    populate(journal)
    obj = json.loads(run_cli("journal", "show", "c-ship", "--db", str(db), "--json").stdout)
    for key in ("call_id", "tool", "status", "attempt", "agent_id", "idempotency_key", "created_at", "updated_at"):
        assert key in obj, key
    assert obj["status"] == "unknown" and obj["agent_id"] == "bob" and obj["attempt"] == 1
    table = run_cli("journal", "show", "c-forbidden", "--db", str(db))
    assert table.exit_code == 0 and "refused" in table.stdout


def test_resolve_value_json_array_and_force_on_applied(journal: Any, db: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()

    @guard_for(journal)
    def charge(account: str) -> str:
        entered.set()
        gate.wait(10)
        return "late"

    t = threading.Thread(target=lambda: (ctx("fa-1").__enter__(), charge("a")))
    t.start()
    try:
        assert entered.wait(10)
        before = snapshot(db)
        no = run_cli("journal", "resolve", "fa-1", "--db", str(db), "--applied", "--value", "[1, 2]",
                     "--reason", "r")
        assert_error_line(no)
        assert snapshot(db) == before
        yes = run_cli("journal", "resolve", "fa-1", "--db", str(db), "--applied", "--value", "[1, 2]",
                      "--reason", "r", "--force", "--operator", "eve")
        assert yes.exit_code == 0, yes.output
    finally:
        gate.set()
        t.join(10)
    committed = [e for e in db_events(db) if e["kind"] == "committed"]
    assert committed[0]["actor"] == "operator:eve" and committed[0]["value"] == [1, 2]
    # the tool's own late outcome is appended too, with its attempt; the log tells what happened
    assert committed[-1]["actor"] == "guard" and committed[-1]["attempt"] == 1 and committed[-1]["value"] == "late"
    assert report_field(journal.verify(), "ok") is True


def test_reversibility_read_through_other_wrappers() -> None:
    def passthrough(fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(*a: Any, **k: Any) -> Any:
            return fn(*a, **k)

        return inner

    runs: list[Any] = []

    def look(q: str) -> str:
        runs.append(q)
        return "ok"

    airlock = guard_for(InMemoryEffectStore())
    reversible = airlock(passthrough(reversibility("reversible")(look)))
    assert reversible("q") == "ok"  # reversible: runs without a tool_call_id
    strict = airlock(reversibility("costly")(passthrough(reversibility("reversible")(look))))
    assert strict("q")["block_reason"] == "tool_call_id_required"
    with pytest.raises(ValueError):
        reversibility("Reversible")


def test_requires_read_through_other_wrappers() -> None:
    def passthrough(fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(*a: Any, **k: Any) -> Any:
            return fn(*a, **k)

        return inner

    def pay(account: str) -> str:
        return "ok"

    fn = guard_for(InMemoryEffectStore())(passthrough(requires("payments:write")(pay)))
    with ctx("rq-1"):
        assert fn("a")["block_reason"] == "capability_denied"


@pytest.mark.parametrize("response", ["none", "dict", "string_verdict", "deny"])
def test_only_a_real_grant_lets_the_call_through(response: str) -> None:
    runs: list[Any] = []

    def approve(request: OversightRequest) -> Any:
        if response == "none":
            return None
        if response == "dict":
            return {"request_id": request.request_id, "verdict": "grant"}
        if response == "string_verdict":  # the word, not OversightVerdict.GRANT
            return OversightResponse(request_id=request.request_id, verdict="grant", approver="x")  # type: ignore[arg-type]
        return OversightResponse(request_id=request.request_id, verdict=OversightVerdict.DENY, approver="x")

    pay = make_pay(guard_for(InMemoryEffectStore(), escalate_tools={"pay": "r"}, approver=approve), runs)
    with ctx("gr-1"):
        result = pay("a")
    assert is_refusal(result) and result["block_reason"] == "escalation_denied"
    assert runs == []


def test_refusal_raised_is_journaled_once(journal: Any, db: Path) -> None:
    pay = make_pay(guard_for(journal, denied_tools=["pay"], on_block="raise"), [])
    with ctx("rr-1"), pytest.raises(AirlockBlocked):
        pay("a")
    assert count(db, "refused", "policy_violation") == 1


def test_outcome_recording_failure_after_an_exception(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = SQLiteJournal(str(db), busy_timeout=0.2)
    holder: list[sqlite3.Connection] = []
    runs: list[Any] = []
    try:
        @guard_for(journal)
        def pay(account: str) -> str:
            runs.append(account)
            conn = raw(db)
            conn.execute("BEGIN IMMEDIATE")
            holder.append(conn)
            raise ValueError("declined")

        caplog.set_level(logging.DEBUG, logger="guard")
        with ctx("of-2"), pytest.raises(ValueError):
            pay("a")
        holder[0].execute("ROLLBACK")
        with ctx("of-2"):
            result = pay("a")
        assert is_refusal(result) and result["block_reason"] == "effect_status_unknown"
        assert runs == ["a"]
    finally:
        for c in holder:
            c.close()
        close(journal)


@pytest.mark.parametrize("kind", STORES)
def test_async_tasks_with_one_id_run_the_tool_at_most_once(tmp_path: Path, kind: str) -> None:
    store = InMemoryEffectStore() if kind == "memory" else SQLiteJournal(str(tmp_path / "a.db"))
    runs: list[Any] = []
    try:
        @guard_for(store)
        async def charge(account: str) -> str:
            runs.append(account)
            await asyncio.sleep(0.05)
            return "charged"

        async def one() -> Any:
            async with ctx("at-1"):
                return await charge("a")

        async def go() -> list[Any]:
            return await asyncio.gather(*(one() for _ in range(10)))

        results = asyncio.run(go())
    finally:
        close(store)
    assert runs == ["a"]
    for r in results:
        assert r == "charged" or r["block_reason"] == "effect_status_unknown"


def test_in_memory_store_threads_run_the_tool_at_most_once() -> None:
    runs: list[Any] = []
    lock = threading.Lock()

    @guard_for(InMemoryEffectStore())
    def pay(account: str) -> str:
        with lock:
            runs.append(account)
        time.sleep(0.05)
        return "paid"

    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        with ctx("mt-1"):
            pay("a")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert runs == ["a"]


def test_openai_responses_sdk_object_and_ambiguous_errors(journal: Any) -> None:
    from openai.types.responses import ResponseFunctionToolCall

    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    runs: list[Any] = []

    @guard_for(journal)
    def send(to: str) -> str:
        runs.append(to)
        raise TimeoutError("gateway timeout")

    item = ResponseFunctionToolCall(call_id="fc_S", name="send", arguments='{"to": "bob"}', type="function_call")
    first = oa.dispatch(item, [send])
    assert first["type"] == "function_call_output" and first["call_id"] == "fc_S"
    assert isinstance(first["output"], str)
    second = oa.dispatch(item, [send])
    assert json.loads(second["output"])["block_reason"] == "effect_status_unknown"
    assert runs == ["bob"]

    block = {"type": "tool_use", "id": "toolu_T", "name": "send", "input": {"to": "carl"}}
    a1 = an.dispatch(block, [send])
    assert a1["is_error"] is True
    a2 = an.dispatch(block, [send])
    assert a2["is_error"] is True
    assert json.loads(a2["content"])["block_reason"] == "effect_status_unknown"
    assert runs == ["bob", "carl"]


@pytest.mark.parametrize("bad_input", [["not", "a", "dict"], "text", None])
def test_anthropic_input_that_does_not_fit(adapter_tools: Any, db: Path, bad_input: Any) -> None:
    from guard.adapters import anthropic as an

    tools, runs, _ = adapter_tools
    before = count(db, "refused")
    out = an.dispatch({"type": "tool_use", "id": "toolu_X", "name": "pay", "input": bad_input}, tools)
    assert out["type"] == "tool_result" and out["tool_use_id"] == "toolu_X" and out["is_error"] is True
    assert runs == []
    assert count(db, "refused") == before + 1


def test_group_help_examples() -> None:
    for args in (["--help"], ["journal", "--help"]):
        result = run_cli(*args)
        assert result.exit_code == 0
        assert "Example:" in result.output, args


def test_resolve_without_call_id_is_a_usage_error(journal: Any, db: Path) -> None:
    populate(journal)
    before = snapshot(db)
    result = run_cli("journal", "resolve", "--db", str(db), "--applied", "--reason", "r")
    assert result.exit_code == 2
    assert snapshot(db) == before


def test_db_that_is_a_directory_is_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "dir"
    folder.mkdir()
    for args in (["stats"], ["show"], ["verify"], ["export"]):
        assert_error_line(run_cli("journal", args[0], "--db", str(folder), *args[1:]))
    assert os.listdir(folder) == []


def test_reader_commands_do_not_wait_for_a_writer(journal: Any, db: Path) -> None:
    populate(journal)
    conn = raw(db)
    try:
        conn.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        for args in (["stats", "--json"], ["show", "--json"], ["verify"], ["export"]):
            result = run_cli("journal", args[0], "--db", str(db), *args[1:])
            assert result.exit_code == 0, (args, result.output)
        assert time.monotonic() - started < 10
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def test_short_contention_is_waited_out(db: Path) -> None:
    journal = SQLiteJournal(str(db), busy_timeout=10.0)
    conn = raw(db)
    runs: list[Any] = []
    try:
        pay = make_pay(guard_for(journal), runs)
        conn.execute("BEGIN IMMEDIATE")
        timer = threading.Timer(0.3, lambda: conn.execute("ROLLBACK"))
        timer.start()
        with ctx("cw-1"):
            result = pay("a")
        timer.join()
        assert result == {"charged": 100, "account": "a"}
        assert runs == [("a", 100)]
    finally:
        conn.close()
        close(journal)


def test_projection_can_be_rebuilt_from_the_log(journal: Any, db: Path) -> None:
    populate(journal)
    before = _projected(db_calls(db))
    conn = raw(db)
    try:
        try:
            conn.execute(f'DELETE FROM "{projection_table(conn)}"')
        except sqlite3.DatabaseError:
            pytest.skip("the projection cannot be emptied by hand here")
    finally:
        conn.close()
    assert db_calls(db) == {}
    journal.rebuild()
    assert _projected(db_calls(db)) == before
    assert report_field(journal.verify(), "ok") is True


def test_call_id_that_is_not_a_string_is_no_call_id() -> None:
    seen: list[Any] = []

    @guard_for(InMemoryEffectStore())
    @reversibility("reversible")
    def look(q: str) -> str:
        seen.append(get_current_context().tool_call_id)
        return "ok"

    with AirlockContext(metadata={"tool_call_id": 123}):
        assert look("q") == "ok"
    with AirlockContext(metadata={"tool_call_id": ""}):
        assert look("q") == "ok"
    assert seen == [None, None]


def test_per_call_context_does_not_share_metadata_with_the_host() -> None:
    @guard_for(InMemoryEffectStore())
    def pay(account: str) -> str:
        c = get_current_context()
        c.metadata["scribble"] = True
        return "ok"

    host = AirlockContext(agent_id="h", metadata={"tool_call_id": "md-1"})
    with host:
        pay("a")
    assert host.metadata == {"tool_call_id": "md-1"}


def test_journal_files_created_by_the_cli_are_private(tmp_path: Path) -> None:
    path = tmp_path / "demo.db"
    assert run_cli("demo", "--db", str(path)).exit_code == 0
    assert path.stat().st_mode & 0o777 == 0o600


def test_wal_file_is_private_too(journal: Any, db: Path) -> None:
    populate(journal)
    for suffix in ("-wal", "-shm"):
        side = Path(str(db) + suffix)
        if side.exists():
            assert side.stat().st_mode & 0o777 == 0o600, suffix


def test_idempotency_key_nested_models() -> None:
    import pydantic

    class Item(pydantic.BaseModel):
        sku: str
        qty: int

    @dataclasses.dataclass
    class Order:
        lines: list[Any]
        meta: dict[str, Any]

    value = {"order": Order(lines=[Item(qty=2, sku="x")], meta={"z": 1, "a": 2})}
    plain = {"order": {"lines": [{"qty": 2, "sku": "x"}], "meta": {"a": 2, "z": 1}}}
    assert idempotency_key("t", value) == expected_key("t", plain)


def test_verify_export_rejects_duplicate_reordered_and_forged_genesis(journal: Any, db: Path, tmp_path: Path) -> None:
    populate(journal)
    full = export_lines(db)

    def check(lines: list[dict[str, Any]], *flags: str) -> int:
        path = tmp_path / "x.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in lines))
        return run_cli("journal", "verify", "--export", str(path), *flags).exit_code

    assert check(full) == 0
    assert check([*full[:3], full[2], *full[3:]]) == 1
    assert check([*full[:3], full[2], *full[3:]], "--allow-gaps") == 1
    swapped = list(full)
    swapped[2], swapped[3] = swapped[3], swapped[2]
    assert check(swapped) == 1
    assert check(swapped, "--allow-gaps") == 1
    genesis = [dict(e) for e in full]
    genesis[0]["prev_hash"] = "1" * 64
    genesis[0]["hash"] = event_hash(genesis[0]["prev_hash"], genesis[0])
    genesis[1]["prev_hash"] = genesis[0]["hash"]
    rest_prev = genesis[0]["hash"]
    for e in genesis[1:]:
        e["prev_hash"] = rest_prev
        e["hash"] = event_hash(rest_prev, e)
        rest_prev = e["hash"]
    assert check(genesis) == 1


def test_default_operator_is_read_at_run_time(journal: Any, db: Path) -> None:
    _unknown_call(journal)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), "--not-applied", "--reason", "r",
                     env={"LOGNAME": "zed", "USER": "zed", "LNAME": "zed", "USERNAME": "zed"})
    assert result.exit_code == 0, result.output
    assert db_events(db)[-1]["actor"] == "operator:zed"


def test_pending_is_recorded_before_the_tool_runs(tmp_path: Path) -> None:
    for durability in ("full", "process"):
        path = tmp_path / f"{durability}.db"
        journal = SQLiteJournal(str(path), durability=durability)
        seen: list[Any] = []
        try:
            @guard_for(journal)
            def pay(account: str) -> str:
                calls = db_calls(path)  # noqa: B023 - called within this iteration
                seen.append((calls["pb-1"]["status"], [e["kind"] for e in db_events(path)]))  # noqa: B023
                return "ok"

            with ctx("pb-1"):
                pay("a")
        finally:
            close(journal)
        assert seen == [("pending", ["pending"])], durability


def test_approver_is_consulted_before_pending(journal: Any, db: Path) -> None:
    rows: list[Any] = []

    def approve(request: OversightRequest) -> OversightResponse:
        rows.append(dict(db_calls(db)))
        return OversightResponse(request_id=request.request_id, verdict=OversightVerdict.GRANT)

    pay = make_pay(guard_for(journal, escalate_tools={"pay": "r"}, approver=approve), [])
    with ctx("ap-1"):
        pay("a")
    assert rows == [{}]


def test_capability_removed_refuses_the_replay(journal: Any) -> None:
    runs: list[Any] = []

    def pay(account: str) -> str:
        runs.append(account)
        return "ok"

    first = guard_for(journal, granted_capabilities=("pay",))(requires("pay")(pay))
    later = guard_for(journal)(requires("pay")(pay))
    with ctx("cr-1"):
        assert first("a") == "ok"
    with ctx("cr-1"):
        assert later("a")["block_reason"] == "capability_denied"
    assert runs == ["a"]


def test_unencodable_value_is_recorded_committed_without_value(journal: Any, db: Path) -> None:
    @guard_for(journal)
    def mint(n: int) -> Any:
        return {1, 2, 3}

    with ctx("uv-2"):
        assert mint(1) == {1, 2, 3}
    assert db_calls(db)["uv-2"]["status"] == "committed"
    committed = [e for e in db_events(db) if e["kind"] == "committed"]
    assert len(committed) == 1 and committed[0]["value"] is None


@pytest.mark.parametrize(
    ("exc", "status"),
    [(ConnectionRefusedError, "released"), (ConnectionError, "released"), (OSError, "released"),
     (type("SlowError", (TimeoutError,), {}), "unknown")],
)
def test_only_the_listed_errors_are_ambiguous(journal: Any, db: Path, exc: type[BaseException], status: str) -> None:
    @guard_for(journal)
    def pay(account: str) -> str:
        raise exc("x")

    with ctx("am-1"), pytest.raises(exc):
        pay("a")
    assert db_calls(db)["am-1"]["status"] == status


def test_empty_ambiguous_errors_makes_timeouts_released(journal: Any, db: Path) -> None:
    runs: list[Any] = []

    @guard_for(journal, eg={"ambiguous_errors": ()})
    def pay(account: str) -> str:
        runs.append(account)
        raise TimeoutError("x")

    with ctx("am-2"), pytest.raises(TimeoutError):
        pay("a")
    assert db_calls(db)["am-2"]["status"] == "released"
    with ctx("am-2"), pytest.raises(TimeoutError):
        pay("a")
    assert runs == ["a", "a"]


def test_idempotency_key_accepts_any_mapping_and_orjson_native_types() -> None:
    import types
    import uuid

    assert idempotency_key("t", types.MappingProxyType({"b": 1, "a": 2})) == expected_key("t", {"a": 2, "b": 1})
    when = dt.datetime(2026, 5, 6, 7, 8, 9, 10, tzinfo=dt.UTC)
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    args = {"when": when, "day": dt.date(2026, 5, 6), "id": u, "pair": (1, 2)}
    assert idempotency_key("t", args) == expected_key("t", args)


def test_adapter_bad_arguments_for_a_reversible_tool_are_journaled(journal: Any, db: Path) -> None:
    from guard.adapters import openai as oa

    runs: list[Any] = []

    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        runs.append(q)
        return "ok"

    out = oa.dispatch({"id": "call_R", "function": {"name": "look", "arguments": '{"qq": 1}'}}, [look])
    assert out["tool_call_id"] == "call_R"
    assert runs == []
    assert count(db, "refused") == 1


def test_oldest_unknown_at_is_when_the_call_last_entered_unknown(journal: Any, db: Path) -> None:
    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        raise TimeoutError("slow")

    with ctx("ou-1"), pytest.raises(TimeoutError):
        look("q")
    time.sleep(0.01)
    with ctx("ou-1"), pytest.raises(TimeoutError):
        look("q")
    stats = json.loads(run_cli("journal", "stats", "--db", str(db), "--json").stdout)
    unknowns = [e for e in export_lines(db) if e["kind"] == "unknown"]
    parse = lambda s: dt.datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    assert parse(stats["oldest_unknown_at"]) == parse(unknowns[-1]["at"])


@pytest.mark.parametrize("verb", ["INSERT OR REPLACE", "REPLACE"])
def test_database_refuses_replacing_an_event(journal: Any, db: Path, verb: str) -> None:
    populate(journal)
    before = db_events(db)
    conn = raw(db)
    try:
        t = events_table(conn)
        row = dict(conn.execute(f'SELECT * FROM "{t}" WHERE seq = 1').fetchone())
        row["tool"] = "forged"
        cols = list(row)
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute(f'{verb} INTO "{t}" ({",".join(cols)}) VALUES ({",".join("?" * len(cols))})',
                         [row[c] for c in cols])
    finally:
        conn.close()
    assert db_events(db) == before


def test_threads_with_many_ids_keep_the_log_gapless(journal: Any, db: Path) -> None:
    pay = make_pay(guard_for(journal), [])

    def worker(n: int) -> None:
        for i in range(10):
            with ctx(f"w{n}-{i}"):
                pay(f"acct-{n}", i)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    events = db_events(db)
    assert [e["seq"] for e in events] == list(range(1, 121))
    assert len(db_calls(db)) == 60
    assert all(c["status"] == "committed" for c in db_calls(db).values())
    report = journal.verify()
    assert report_field(report, "ok") is True and report_field(report, "events") == 120


MANY_IDS_SCRIPT = r"""
import sys
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
j = SQLiteJournal(sys.argv[1])
@Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=j)))
def charge(account, n):
    return n
for i in range(15):
    with AirlockContext(metadata={"tool_call_id": f"{sys.argv[2]}-{i}"}):
        charge("a", i)
j.close()
"""


def test_processes_with_many_ids_keep_the_log_gapless(tmp_path: Path) -> None:
    db = tmp_path / "many.db"
    close(SQLiteJournal(str(db)))
    procs = [subprocess.Popen([PYTHON, "-c", MANY_IDS_SCRIPT, str(db), f"p{n}"], stderr=subprocess.PIPE, text=True)
             for n in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    events = db_events(db)
    assert [e["seq"] for e in events] == list(range(1, 91))
    assert len({e["owner"]["pid"] for e in events}) == 3
    result = run_cli("journal", "verify", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("OK: 90 events, head ")


def test_show_table_shows_event_times_as_iso(journal: Any, db: Path) -> None:
    populate(journal)
    table = run_cli("journal", "show", "c-pay", "--db", str(db))
    assert table.exit_code == 0
    for e in export_lines(db, "--call", "c-pay"):
        assert e["at"] in table.stdout


def test_unicode_everywhere_hashes_by_the_rule(journal: Any, db: Path, tmp_path: Path) -> None:
    airlock = guard_for(journal)

    @airlock
    def grüßen(name: str, extra: dict[str, Any]) -> dict[str, Any]:
        return {"gruß": name, "emoji": "\U0001f600", "n": 2**63 + 5, "f": 0.1}

    with AirlockContext(agent_id="agént-ß", metadata={"tool_call_id": "ид-1"}):
        grüßen("Zoë", {"ü": 1, "a": [1.5, None, True]})
    with AirlockContext(agent_id="agént-ß", metadata={"tool_call_id": "ид-1"}):
        assert grüßen("Zoë", {"ü": 1, "a": [1.5, None, True]})["gruß"] == "Zoë"
    lines = export_lines(db)
    prev = ZEROS
    for line in lines:
        assert line["hash"] == event_hash(prev, line)
        assert line["arguments_sha256"] == sha(line["arguments"])
        prev = line["hash"]
    committed = next(e for e in lines if e["kind"] == "committed")
    assert committed["value_sha256"] == sha(committed["value"])
    assert committed["value"]["n"] == 2**63 + 5
    out = tmp_path / "u.jsonl"
    assert run_cli("journal", "export", "--db", str(db), "--output", str(out)).exit_code == 0
    assert run_cli("journal", "verify", "--export", str(out)).exit_code == 0


def test_not_a_journal_error_is_clear(tmp_path: Path) -> None:
    text = tmp_path / "notes.db"
    text.write_text("plain text\n" * 30)
    with pytest.raises(NotAJournal) as info:
        SQLiteJournal(str(text))
    assert not isinstance(info.value, sqlite3.Error)
    assert str(info.value) == (
        f"The file {text} is not a SQLite database, not an airlock journal; it was left unchanged."
    )


def test_read_only_commands_never_migrate_an_older_journal(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    conn = sqlite3.connect(str(db))
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    conn.execute(f"PRAGMA user_version = {version - 1}")
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    before = db.read_bytes()
    for args in (["stats", "--json"], ["show", "--json"], ["show", "c-pay"], ["verify"], ["export"]):
        result = run_cli("journal", args[0], "--db", str(db), *args[1:])
        assert result.exit_code in (0, 1), result.output
        assert "Traceback" not in result.output
    conn = sqlite3.connect(str(db))
    assert conn.execute("PRAGMA user_version").fetchone()[0] == version - 1
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    assert db.read_bytes() == before


def test_verify_finds_a_projection_that_differs_from_the_log(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    for mutation in ("DELETE FROM \"{t}\" WHERE call_id = 'c-ship'",
                     "UPDATE \"{t}\" SET attempt = 7 WHERE call_id = 'c-pay'",
                     "UPDATE \"{t}\" SET tool = 'other' WHERE call_id = 'c-flaky'"):
        copy = db.with_name("copy.db")
        if copy.exists():
            copy.unlink()
        src, dst = sqlite3.connect(str(db)), sqlite3.connect(str(copy))
        src.backup(dst)
        src.close()
        dst.close()
        conn = raw(copy)
        try:
            conn.execute(mutation.format(t=projection_table(conn)))
        except sqlite3.DatabaseError:
            conn.close()
            continue
        conn.close()
        result = run_cli("journal", "verify", "--db", str(copy))
        assert result.exit_code == 1, (mutation, result.output)
        j = SQLiteJournal(str(copy))
        try:
            assert report_field(j.verify(), "ok") is False
        finally:
            close(j)


def test_adapter_call_id_wins_over_the_host_context(adapter_tools: Any) -> None:
    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    tools, _runs, seen = adapter_tools
    with AirlockContext(agent_id="host", metadata={"tool_call_id": "outer"}):
        oa.dispatch({"id": "call_in", "function": {"name": "pay", "arguments": '{"account": "x"}'}}, tools)
        an.dispatch({"type": "tool_use", "id": "toolu_in", "name": "pay", "input": {"account": "y"}}, tools)
        assert get_current_context().metadata["tool_call_id"] == "outer"
    assert [s[0] for s in seen] == ["call_in", "toolu_in"]


def test_adapter_refusal_text_is_the_whole_refusal(adapter_tools: Any) -> None:
    from guard.adapters import anthropic as an

    tools, _, _ = adapter_tools
    out = an.dispatch({"type": "tool_use", "id": "toolu_R", "name": "wipe", "input": {"disk": "d"}}, tools)
    body = json.loads(out["content"])
    assert body["success"] is False and body["status"] == "blocked" and body["block_reason"] == "policy_violation"
    assert body["metadata"]["tool"] == "wipe" and body["metadata"]["tool_call_id"] == "toolu_R"


def test_adispatch_with_a_sync_tool(adapter_tools: Any) -> None:
    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    tools, _runs, seen = adapter_tools

    async def go() -> tuple[Any, Any]:
        a = await oa.adispatch({"type": "function_call", "call_id": "fc_sync", "name": "pay",
                                "arguments": '{"account": "s"}'}, tools)
        b = await an.adispatch({"type": "tool_use", "id": "toolu_sync", "name": "pay", "input": {"account": "t"}},
                               tools)
        return a, b

    a, b = asyncio.run(go())
    assert a["type"] == "function_call_output" and json.loads(a["output"]) == {"paid": 1}
    assert b["is_error"] is False and json.loads(b["content"]) == {"paid": 1}
    assert [s[0] for s in seen] == ["fc_sync", "toolu_sync"]


def test_adispatch_bad_arguments(adapter_tools: Any, db: Path) -> None:
    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    tools, runs, _ = adapter_tools

    async def go() -> tuple[Any, Any]:
        a = await oa.adispatch({"id": "call_bad", "function": {"name": "pay", "arguments": "[1,"}}, tools)
        b = await an.adispatch({"type": "tool_use", "id": "toolu_bad", "name": "pay", "input": {"zz": 1}}, tools)
        return a, b

    a, b = asyncio.run(go())
    assert a["tool_call_id"] == "call_bad" and b["is_error"] is True
    assert runs == []
    assert count(db, "refused") == 2


def test_committed_reversible_call_is_replayed_not_run(any_store: Any) -> None:
    runs: list[Any] = []

    @guard_for(any_store)
    @reversibility("reversible")
    def look(q: str) -> dict[str, Any]:
        runs.append(q)
        return {"hits": (len(runs),)}

    with ctx("cr-2"):
        assert look("q") == {"hits": (1,)}
    with ctx("cr-2"):
        assert look("q") == {"hits": [1]}
    assert runs == ["q"]


def test_in_flight_call_with_other_arguments_is_a_reuse(journal: Any, db: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()
    runs: list[Any] = []

    @guard_for(journal)
    def pay(account: str) -> str:
        runs.append(account)
        entered.set()
        gate.wait(10)
        return "paid"

    t = threading.Thread(target=lambda: (ctx("fl-1").__enter__(), pay("a")))
    t.start()
    try:
        assert entered.wait(10)
        with ctx("fl-1"):
            other = pay("b")
        with ctx("fl-1"):
            same = pay("a")
    finally:
        gate.set()
        t.join(10)
    assert other["block_reason"] == "policy_violation"
    assert other["metadata"]["violation_type"] == "tool_call_id_reused"
    assert same["block_reason"] == "effect_status_unknown" and same["metadata"]["status"] == "pending"
    assert runs == ["a"]


def test_an_id_with_only_refusals_is_not_seen(journal: Any, db: Path) -> None:
    runs: list[Any] = []
    denied = make_pay(guard_for(journal, denied_tools=["pay"]), runs)
    allowed = make_pay(guard_for(journal), runs)
    with ctx("or-1"):
        assert denied("a")["block_reason"] == "policy_violation"
    with ctx("or-1"):
        assert allowed("b") == {"charged": 100, "account": "b"}
    assert runs == [("b", 100)]
    assert db_calls(db)["or-1"]["attempt"] == 1


# --------------------------------------------------------------------------------------------------------------
# names and signatures as the contract spells them


def _params(fn: Any) -> dict[str, Any]:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()}


def test_public_signatures() -> None:
    assert _params(SecurityPolicy) == {
        "allowed_tools": None, "denied_tools": (), "escalate_tools": None, "approver": None,
        "granted_capabilities": (), "effect_guard": None,
    }
    eg = _params(EffectGuard)
    assert list(eg)[:5] == ["store", "require_tool_call_id", "require_approval_for_irreversible", "target_args",
                            "ambiguous_errors"]
    assert eg["store"] is None and eg["require_tool_call_id"] is True
    assert eg["require_approval_for_irreversible"] is False and tuple(eg["target_args"]) == ()
    assert tuple(eg["ambiguous_errors"]) == (TimeoutError, ConnectionResetError, ConnectionAbortedError,
                                             BrokenPipeError, EffectOutcomeUnknown)
    air = _params(Airlock)
    assert "policy" in air and air["on_block"] == "return"
    ctxp = _params(AirlockContext)
    assert ctxp["agent_id"] is None and ctxp["metadata"] is None
    j = _params(SQLiteJournal)
    assert next(iter(j)) == "path" and j["durability"] == "full" and j["busy_timeout"] == 30.0
    assert list(_params(idempotency_key))[:2] == ["tool", "arguments"]


def test_adapter_signatures() -> None:
    from guard.adapters import anthropic as an
    from guard.adapters import openai as oa

    for fn, first in ((oa.dispatch, "tool_call"), (oa.adispatch, "tool_call"), (an.dispatch, "block"),
                      (an.adispatch, "block")):
        params = inspect.signature(fn).parameters
        names = list(params)
        assert names[:2] == [first, "tools"], fn
        assert params["agent_id"].kind is inspect.Parameter.KEYWORD_ONLY and params["agent_id"].default is None
    assert inspect.iscoroutinefunction(oa.adispatch) and inspect.iscoroutinefunction(an.adispatch)


def test_distribution_metadata() -> None:
    from importlib import metadata

    dist = metadata.distribution("airlock-journal")
    assert dist.metadata["Requires-Python"].replace(" ", "") == ">=3.11"
    requires = dist.requires or []
    base = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r}
    assert base == {"orjson", "click", "sqlite-utils"}
    pg = [r for r in requires if r.lower().startswith("psycopg") and "extra ==" in r]
    assert any('extra == "postgres"' in r for r in pg)
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {"airlock": "cli.main:main"}


SIZED_EXPORT_SCRIPT = r"""
import sys, tracemalloc
tracemalloc.start()
from cli.main import main
try:
    main(["journal", "export", "--db", sys.argv[1], "--output", sys.argv[2]])
except SystemExit as e:
    assert e.code in (0, None), e.code
print(tracemalloc.get_traced_memory()[1])
"""


def _grow(path: Path, n: int, size: int) -> None:
    j = SQLiteJournal(str(path), durability="process")
    pay = make_pay(guard_for(j), [])
    with ctx("seed"):
        pay("a")
    close(j)
    conn = raw(path)
    try:
        t = events_table(conn)
        row = dict(conn.execute(f'SELECT * FROM "{t}" WHERE seq = 1').fetchone())
        cols = list(row)
        blob = json.dumps({"blob": "x" * size})
        conn.execute("BEGIN")
        for i in range(3, n + 3):
            row.update(seq=i, arguments=blob, call_id=f"b{i}", hash=f"{i:064x}")
            conn.execute(f'INSERT INTO "{t}" ({",".join(cols)}) VALUES ({",".join("?" * len(cols))})',
                         [row[c] for c in cols])
        conn.execute("COMMIT")
    finally:
        conn.close()


def test_export_streams_in_bounded_memory(tmp_path: Path) -> None:
    peaks = []
    for n in (1500, 9000):
        path = tmp_path / f"{n}.db"
        _grow(path, n, 2000)
        out = subprocess.run([PYTHON, "-c", SIZED_EXPORT_SCRIPT, str(path), str(tmp_path / f"{n}.jsonl")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert len((tmp_path / f"{n}.jsonl").read_text().splitlines()) == n + 2
        peaks.append(int(out.stdout.strip().splitlines()[-1]))
    # six times the log, not six times the memory
    assert peaks[1] < peaks[0] * 1.5 + 4_000_000, peaks


@pytest.mark.parametrize("value", [0, False, [], {}, "0", " "])
def test_target_args_any_value_but_none_and_empty_string_counts(value: Any) -> None:
    runs: list[Any] = []

    @guard_for(InMemoryEffectStore(), eg={"target_args": ("account",)})
    def pay(account: Any) -> str:
        runs.append(account)
        return "paid"

    with ctx(f"tv-{value!r}"):
        assert pay(value) == "paid"
    assert runs == [value]


def test_json_columns_hold_json_text(journal: Any, db: Path) -> None:
    populate(journal)
    conn = raw(db)
    try:
        t = events_table(conn)
        for col in JSON_COLUMNS:
            types = {r[0] for r in conn.execute(f'SELECT DISTINCT typeof("{col}") FROM "{t}"')}
            assert types <= {"text", "null"}, (col, types)
    finally:
        conn.close()


def test_projection_is_written_with_its_event(journal: Any, db: Path) -> None:
    pay = make_pay(guard_for(journal), [])
    stop = threading.Event()

    def writer(n: int) -> None:
        i = 0
        while not stop.is_set() and i < 60:
            with ctx(f"tx{n}-{i}"):
                pay("a", i)
            i += 1

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    conn = raw(db)
    mismatches = []
    checks = 0
    try:
        et, pt = events_table(conn), projection_table(conn)
        deadline = time.monotonic() + 20
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            conn.execute("BEGIN")
            events = conn.execute(f'SELECT call_id, kind, attempt FROM "{et}" ORDER BY seq').fetchall()
            calls = {r[0]: (r[1], r[2]) for r in conn.execute(f'SELECT call_id, status, attempt FROM "{pt}"')}
            conn.execute("COMMIT")
            fold: dict[str, tuple[str, int]] = {}
            for cid, kind, attempt in events:
                if kind not in ("refused", "replayed"):
                    fold[cid] = (kind, attempt)
            if fold != calls:
                mismatches.append((len(events), len(calls)))
            checks += 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        conn.close()
    assert checks > 0
    assert mismatches == []


def test_refused_async_call_is_still_awaitable() -> None:
    @guard_for(InMemoryEffectStore(), denied_tools=["den"])
    async def den(x: int) -> int:
        return x

    result = den(1)
    assert inspect.isawaitable(result)
    refusal = asyncio.run(result)
    assert is_refusal(refusal) and refusal["block_reason"] == "policy_violation"

    @guard_for(InMemoryEffectStore(), denied_tools=["den2"], on_block="raise")
    async def den2(x: int) -> int:
        return x

    async def go() -> None:
        with pytest.raises(AirlockBlocked):
            await den2(1)

    asyncio.run(go())


def test_generator_functions_decorated_directly_are_deferred() -> None:
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    def gen(x: int) -> Iterator[int]:
        yield x

    @airlock
    async def agen(x: int) -> Any:
        yield x

    with ctx("gd-1"):
        g = gen(1)
    assert inspect.isgenerator(g) and list(g) == [1]
    with ctx("gd-1"):
        assert gen(1)["block_reason"] == "effect_status_unknown"
    with ctx("gd-2"):
        a = agen(1)
    assert inspect.isasyncgen(a)
    with ctx("gd-2"):
        assert agen(1)["block_reason"] == "effect_status_unknown"


TZ_SCRIPT = r"""
import sys
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import SQLiteJournal
j = SQLiteJournal(sys.argv[1])
@Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=j)))
def charge(account):
    return "ok"
with AirlockContext(metadata={"tool_call_id": "tz-1"}):
    charge("a")
j.close()
"""


def test_times_are_utc_whatever_the_local_zone(tmp_path: Path) -> None:
    db = tmp_path / "tz.db"
    env = dict(os.environ, TZ="America/Los_Angeles")
    before = dt.datetime.now(dt.UTC)
    subprocess.run([PYTHON, "-c", TZ_SCRIPT, str(db)], check=True, timeout=60, env=env)
    after = dt.datetime.now(dt.UTC)
    out = subprocess.run([AIRLOCK, "journal", "export", "--db", str(db)], capture_output=True, text=True,
                         timeout=60, env=env, check=True)
    for line in out.stdout.splitlines():
        at = json.loads(line)["at"]
        assert AT_RE.match(at)
        when = dt.datetime.fromisoformat(at.replace("Z", "+00:00"))
        assert before - dt.timedelta(seconds=2) <= when <= after + dt.timedelta(seconds=2)
    stats = subprocess.run([AIRLOCK, "journal", "show", "tz-1", "--db", str(db), "--json"], capture_output=True,
                           text=True, timeout=60, env=env, check=True)
    for e in json.loads(stats.stdout)["events"]:
        when = dt.datetime.fromisoformat(e["at"].replace("Z", "+00:00"))
        assert before - dt.timedelta(seconds=2) <= when <= after + dt.timedelta(seconds=2)


# --------------------------------------------------------------------------------------------------------------
# the table of 2.6 as a model, against every store

OUTCOMES = ["value", "unencodable", "ambiguous", "error", "deferred"]
call_steps = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["t_irr", "t_rev"]), st.sampled_from([1, 2]),
              st.sampled_from(OUTCOMES)),
    min_size=1, max_size=12,
)


class _Unencodable:
    pass


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(steps=call_steps)
def test_the_effect_table_as_a_model(tmp_path_factory: pytest.TempPathFactory, steps: list[Any]) -> None:
    path = tmp_path_factory.mktemp("model") / "m.db"
    for kind in STORES:
        store = InMemoryEffectStore() if kind == "memory" else SQLiteJournal(str(path), durability="process")
        try:
            _run_model(store, steps, path if kind == "sqlite" else None)
        finally:
            close(store)


def _run_model(store: Any, steps: list[Any], path: Path | None) -> None:
    airlock = guard_for(store)
    ran: list[Any] = []
    plan: dict[str, str] = {}

    def body(name: str, n: int) -> Any:
        ran.append((name, n))
        outcome = plan["next"]
        if outcome == "value":
            return {"n": n, "t": (n,)}
        if outcome == "unencodable":
            return _Unencodable()
        if outcome == "ambiguous":
            raise TimeoutError("lost")
        if outcome == "error":
            raise ValueError("no")
        return iter([n])

    def t_irr(n: int) -> Any:
        return body("t_irr", n)

    def t_rev(n: int) -> Any:
        return body("t_rev", n)

    tools = {"t_irr": airlock(t_irr), "t_rev": airlock(reversibility("reversible")(t_rev))}
    model: dict[str, dict[str, Any]] = {}
    expected_kinds = {"pending": 0, "refused": 0, "replayed": 0}
    for call_id, tool, n, outcome in steps:
        plan["next"] = outcome
        rec = model.get(call_id)
        runs_before = len(ran)
        raised: BaseException | None = None
        with ctx(call_id):
            try:
                result = tools[tool](n)
            except (TimeoutError, ValueError) as e:
                raised, result = e, None
        if rec is not None and (rec["tool"] != tool or rec["n"] != n):
            assert is_refusal(result) and result["block_reason"] == "policy_violation", (call_id, result)
            assert len(ran) == runs_before
            expected_kinds["refused"] += 1
            continue
        if rec is not None and rec["status"] == "committed":
            assert len(ran) == runs_before
            expected_kinds["replayed" if rec["has_value"] else "refused"] += 1
            if rec["has_value"]:
                assert result == {"n": n, "t": [n]}
            else:
                assert is_refusal(result) and result["block_reason"] == "replay_value_unavailable"
            continue
        if rec is not None and rec["status"] == "unknown" and tool == "t_irr":
            assert is_refusal(result) and result["block_reason"] == "effect_status_unknown"
            assert len(ran) == runs_before
            expected_kinds["refused"] += 1
            continue
        # runs: a first attempt, a released call, or a reversible one in doubt
        assert len(ran) == runs_before + 1, (call_id, tool, rec, result)
        expected_kinds["pending"] += 1
        attempt = 1 if rec is None else rec["attempt"] + 1
        status = {"value": "committed", "unencodable": "committed", "ambiguous": "unknown", "error": "released",
                  "deferred": "unknown"}[outcome]
        if outcome == "value":
            assert result == {"n": n, "t": (n,)}
        elif outcome in ("ambiguous", "error"):
            assert raised is not None
        elif outcome == "unencodable":
            assert isinstance(result, _Unencodable)
        else:
            assert list(result) == [n]
        model[call_id] = {"tool": tool, "n": n, "status": status, "attempt": attempt,
                          "has_value": outcome == "value"}
    if path is not None:
        events = db_events(path)
        counted = {k: sum(1 for e in events if e["kind"] == k) for k in expected_kinds}
        assert counted == expected_kinds
        calls = db_calls(path)
        assert {c: (r["status"], r["attempt"], r["tool"]) for c, r in calls.items()} == {
            c: (m["status"], m["attempt"], m["tool"]) for c, m in model.items()}
        assert report_field(store_verify(path), "ok") is True


def store_verify(path: Path) -> Any:
    j = SQLiteJournal(str(path))
    try:
        return j.verify()
    finally:
        close(j)


def test_an_empty_allowed_list_allows_nothing() -> None:
    runs: list[Any] = []

    def ping(x: int) -> int:
        runs.append(x)
        return x

    result = Airlock(policy=SecurityPolicy(allowed_tools=[]))(ping)(1)
    assert is_refusal(result) and result["block_reason"] == "policy_violation"
    assert runs == []


def test_requires_stacked_at_two_levels_needs_both() -> None:
    def pay(account: str) -> str:
        return "ok"

    for granted, ok in ((("a",), False), (("b",), False), (("a", "b"), True)):
        airlock = guard_for(InMemoryEffectStore(), granted_capabilities=granted)
        fn = requires("a")(airlock(requires("b")(pay)))
        with ctx("rs2-1"):
            result = fn("x")
        if ok:
            assert result == "ok"
        else:
            assert is_refusal(result) and result["block_reason"] == "capability_denied", granted


def test_a_tool_returning_none_replays_none(any_store: Any) -> None:
    runs: list[Any] = []

    @guard_for(any_store)
    def notify(x: int) -> None:
        runs.append(x)

    with ctx("none-1"):
        assert notify(1) is None
    with ctx("none-1"):
        assert notify(1) is None
    assert runs == [1]


def test_key_binding_empty_var_args_and_positional_only() -> None:
    keys: list[str] = []
    airlock = guard_for(InMemoryEffectStore())

    @airlock
    def g(a: int, *rest: int, **extra: Any) -> int:
        keys.append(get_current_context().idempotency_key)
        return 1

    @airlock
    def h(a: int, /, b: int, *, c: int = 3) -> int:
        keys.append(get_current_context().idempotency_key)
        return 1

    with ctx("kb-1"):
        g(1)
    with ctx("kb-2"):
        h(1, 2)
    with ctx("kb-3"):
        h(1, b=2, c=3)
    assert keys[0] == expected_key("g", {"a": 1, "rest": []})
    assert keys[1] == keys[2] == expected_key("h", {"a": 1, "b": 2, "c": 3})


def _big_journal(path: Path) -> None:
    j = SQLiteJournal(str(path), durability="process")
    try:
        pay = make_pay(guard_for(j), [])
        for i in range(200):
            with ctx(f"big-{i}"):
                pay("a" * 200, i)
    finally:
        close(j)


def _limited_file_size() -> None:  # runs in the child before exec
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_export_write_failure_to_a_file_is_one_error_line(tmp_path: Path, fmt: str) -> None:
    db = tmp_path / "big.db"
    _big_journal(db)
    out = subprocess.run([AIRLOCK, "journal", "export", "--db", str(db), "--format", fmt,
                          "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=60,
                         preexec_fn=_limited_file_size)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_export_write_failure_to_stdout_is_an_error(tmp_path: Path, fmt: str) -> None:
    db = tmp_path / "big.db"
    _big_journal(db)
    target = tmp_path / "stdout.txt"
    with target.open("wb") as sink:
        out = subprocess.run([AIRLOCK, "journal", "export", "--db", str(db), "--format", fmt], stdout=sink,
                             stderr=subprocess.PIPE, text=True, timeout=60, preexec_fn=_limited_file_size)
    assert target.stat().st_size <= 100_000  # the write did fail part way
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().startswith("Error: ")


def _altered_projection(journal: Any, db: Path) -> None:
    populate(journal)
    close(journal)
    conn = raw(db)
    try:
        t = projection_table(conn)
        if "value" not in table_columns(conn)[t]:
            pytest.skip("the projection keeps no value column")
        conn.execute(f'UPDATE "{t}" SET value = ? WHERE call_id = ?', ("{not json", "c-pay"))
    finally:
        conn.close()


@pytest.mark.parametrize("args", [["show", "--json"], ["show", "c-pay", "--json"]])
def test_show_json_of_an_altered_projection_is_one_error_line(journal: Any, db: Path, args: list[str]) -> None:
    _altered_projection(journal, db)
    out = subprocess.run([AIRLOCK, "journal", args[0], "--db", str(db), *args[1:]], capture_output=True, text=True,
                         timeout=60)
    assert "Traceback" not in out.stderr
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr


def test_altered_projection_is_found_by_verify_and_repaired_by_rebuild(journal: Any, db: Path) -> None:
    _altered_projection(journal, db)
    assert run_cli("journal", "verify", "--db", str(db)).exit_code == 1
    assert run_cli("journal", "rebuild", "--db", str(db)).exit_code == 0
    assert run_cli("journal", "verify", "--db", str(db)).exit_code == 0
    shown = run_cli("journal", "show", "c-pay", "--db", str(db), "--json")
    assert json.loads(shown.stdout)["status"] == "committed"


def test_adapters_import_neither_journal_nor_cli() -> None:
    code = (
        "import sys, guard.adapters.openai, guard.adapters.anthropic, guard.adapters.mcp\n"
        "print([m for m in sys.modules if m.split('.')[0] in ('journal', 'cli')])\n"
    )
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_effect_status_unknown_since_is_when_the_call_entered_that_status(journal: Any, db: Path) -> None:
    @guard_for(journal)
    def pay(account: str) -> str:
        raise TimeoutError("lost")

    with ctx("si-1"), pytest.raises(TimeoutError):
        pay("a")
    time.sleep(0.01)
    with ctx("si-1"):
        result = pay("a")
    unknown_at = next(e["at"] for e in export_lines(db) if e["kind"] == "unknown")
    since = result["metadata"]["since"]
    since_dt = since if isinstance(since, dt.datetime) else dt.datetime.fromisoformat(str(since).replace("Z", "+00:00"))
    assert since_dt == dt.datetime.fromisoformat(unknown_at.replace("Z", "+00:00"))


def test_resolve_value_is_returned_exactly_or_refused(journal: Any, db: Path) -> None:
    charge, _runs = _unknown_call(journal)
    before = snapshot(db)
    result = run_cli("journal", "resolve", "rs-1", "--db", str(db), "--applied", "--value", "18446744073709551617",
                     "--reason", "ledger")
    if result.exit_code == 2:
        assert snapshot(db) == before
        return
    assert result.exit_code == 0
    with ctx("rs-1"):
        replay = charge("acct")
    assert type(replay) is int and replay == 18446744073709551617


def test_csv_scalar_fields_match_the_jsonl_export(journal: Any, db: Path) -> None:
    populate(journal)
    full = export_lines(db)
    rows = list(csv.DictReader(io.StringIO(run_cli("journal", "export", "--db", str(db), "--format", "csv").stdout)))
    assert len(rows) == len(full) > 0
    for row, line in zip(rows, full, strict=True):
        for name in ("seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "actor", "attempt",
                     "prev_hash", "hash", "arguments_sha256", "value_sha256"):
            assert row[name] == ("" if line[name] is None else str(line[name])), name


def test_a_late_outcome_of_an_older_attempt_leaves_the_current_one(journal: Any, db: Path) -> None:
    gates = [threading.Event(), threading.Event()]
    entered = [threading.Event(), threading.Event()]
    count_lock = threading.Lock()
    attempts: list[int] = []

    @guard_for(journal)
    @reversibility("reversible")
    def look(q: str) -> str:
        with count_lock:
            attempts.append(len(attempts))
            mine = attempts[-1]
        entered[mine].set()
        gates[mine].wait(10)
        if mine == 0:
            return "old"
        raise ValueError("new attempt failed")

    def run() -> None:
        with ctx("lo-1"), contextlib.suppress(ValueError):
            look("q")

    t1 = threading.Thread(target=run)
    t1.start()
    assert entered[0].wait(10)
    t2 = threading.Thread(target=run)
    t2.start()
    try:
        assert entered[1].wait(10)
        gates[0].set()
        t1.join(10)
        call = db_calls(db)["lo-1"]
        assert (call["status"], call["attempt"]) == ("pending", 2)
        old = [e for e in db_events(db) if e["kind"] == "committed"]
        assert len(old) == 1 and old[0]["attempt"] == 1
    finally:
        gates[0].set()
        gates[1].set()
        t1.join(10)
        t2.join(10)
    call = db_calls(db)["lo-1"]
    assert (call["status"], call["attempt"]) == ("released", 2)
    assert report_field(journal.verify(), "ok") is True
    before = _projected(db_calls(db))
    journal.rebuild()
    assert _projected(db_calls(db)) == before


def test_non_canonical_arguments_of_a_reversible_call_with_an_id() -> None:
    runs: list[Any] = []
    look = make_pay(guard_for(InMemoryEffectStore()), runs, tag="reversible", name="look")
    with ctx("nc-r"):
        result = look(float("nan"))
    assert is_refusal(result) and result["block_reason"] == "arguments_not_canonical"
    assert runs == []


def test_two_journal_objects_on_one_file(db: Path) -> None:
    one, two = SQLiteJournal(str(db)), SQLiteJournal(str(db))
    runs: list[Any] = []
    try:
        first = make_pay(guard_for(one), runs)
        second = make_pay(guard_for(two), runs)
        with ctx("two-1"):
            assert first("a") == {"charged": 100, "account": "a"}
        with ctx("two-1"):
            assert second("a") == {"charged": 100, "account": "a"}
        assert runs == [("a", 100)]
        assert [e["kind"] for e in db_events(db)] == ["pending", "committed", "replayed"]
    finally:
        close(one)
        close(two)
