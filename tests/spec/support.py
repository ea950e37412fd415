"""What the tests of the behaviour contract share: the two byte rules recomputed independently with hashlib
and orjson, the SQLite schema seen through a raw sqlite3 connection, the CLI run in-process, and a small
journal with every status."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from cli.main import main as cli_main
from guard import (
    Airlock,
    AirlockContext,
    OversightRequest,
    OversightResponse,
    OversightVerdict,
    SecurityPolicy,
)
from guard.effect_guard import (
    EffectGuard,
    reversibility,
)

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


def canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def expected_key(tool: str, arguments: dict[str, Any]) -> str:
    return hashlib.sha256(tool.encode() + b"\x00" + canonical(arguments)).hexdigest()


def sha(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def event_hash(prev_hash: str, event: dict[str, Any]) -> str:
    body = {name: event[name] for name in BODY_FIELDS}
    return hashlib.sha256(prev_hash.encode("ascii") + canonical(body)).hexdigest()


def close(store: Any) -> None:
    closer = getattr(store, "close", None)
    if callable(closer):
        closer()


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


def alter_projection(journal: Any, db: Path) -> None:
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


def answering(verdict: OversightVerdict | None, calls: list[OversightRequest], *, other_id: bool = False,
              raise_: bool = False) -> Any:
    """An approver that keeps each request in ``calls`` and answers ``verdict`` (or raises, or
    answers for another request)."""

    def approve(request: OversightRequest) -> OversightResponse:
        calls.append(request)
        if raise_:
            raise RuntimeError("approver down")
        rid = "someone-else" if other_id else request.request_id
        return OversightResponse(request_id=rid, verdict=verdict, approver="carol")

    return approve


def projected_fields(calls: dict[str, dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """The projected fields a refusal or a replay must leave alone."""
    return {cid: (r["status"], r["attempt"], r["tool"], r["idempotency_key"], r.get("arguments"))
            for cid, r in calls.items()}
