"""``EffectGuard(duplicate_window=N)``: a call with a new ``tool_call_id`` that repeats a recent call
of its agent (a model that asked again under a new id) is answered as that call, on every store
that has the lookup; the tool does not run again."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal
from guard.effect_guard import EffectGuard, reversibility
from journal import SQLiteJournal
from tests.cli_support import invoke
from tests.stores import STORE_FACTORIES, close_store, guide_store, store_events

DOCS = Path(__file__).resolve().parents[1] / "docs" / "custom-store.md"


def guide_store_with_window(tmp_path: Path) -> Any:
    # The example of docs/custom-store.md with the lookup that page adds to it, both read from the page.
    page = DOCS.read_text()
    example = page.split("## An example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    lookup = page.split("## Optional: `recent_call", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(example + "\n" + lookup, str(DOCS), "exec"), namespace)
    return namespace["JsonLinesStoreWithWindow"](tmp_path / "effects.jsonl")


# Every store of tests/stores.py that has the lookup, and the guide's store once the page adds it.
LOOKUP_FACTORIES = {name: make for name, make in STORE_FACTORIES.items() if name != "guide"}
LOOKUP_FACTORIES["guide-window"] = guide_store_with_window


@pytest.fixture(params=sorted(LOOKUP_FACTORIES))
def lookup_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    made = LOOKUP_FACTORIES[request.param](tmp_path)
    try:
        yield made
    finally:
        close_store(made)


class Bank:
    """Counts the transfers that reached it; ``fail_with`` makes the next one fail after it started."""

    def __init__(self) -> None:
        self.transfers: list[tuple[str | None, str, int]] = []
        self.fail_with: Exception | None = None

    def transfer(self, to: str, cents: int) -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        self.transfers.append((context.tool_call_id, to, cents))
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        return {"transfer": len(self.transfers), "to": to, "cents": cents}


def transfer_tool(store: Any, bank: Bank, window: float | None = 60.0, **options: Any) -> Any:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store, duplicate_window=window, **options)))
    def transfer(to: str, cents: int) -> dict[str, Any]:
        return bank.transfer(to, cents)

    return transfer


def call(fn: Any, tool_call_id: str, *args: Any, agent_id: str | None = "agent-1") -> Any:
    with AirlockContext(agent_id=agent_id, metadata={"tool_call_id": tool_call_id}):
        return fn(*args)


def test_a_copy_under_a_new_id_returns_the_earlier_value(lookup_store: Any) -> None:
    bank = Bank()
    transfer = transfer_tool(lookup_store, bank)
    first = call(transfer, "call_1", "bob", 500)
    again = call(transfer, "call_2", "bob", 500)
    assert again == first
    assert bank.transfers == [("call_1", "bob", 500)]
    events = store_events(lookup_store, "call_2")
    assert [(e.kind, dict(e.reason or {})) for e in events] == [
        ("replayed", {"code": "duplicate_of", "message": "call_1"})
    ]
    assert lookup_store.get("call_2") is None  # a copy is no call of its own: no projection row


def test_a_copy_of_a_call_in_doubt_gets_its_refusal(lookup_store: Any) -> None:
    bank = Bank()
    transfer = transfer_tool(lookup_store, bank)
    bank.fail_with = TimeoutError("the bank did not answer")
    with pytest.raises(TimeoutError):
        call(transfer, "call_1", "bob", 500)
    refused = call(transfer, "call_2", "bob", 500)
    assert is_refusal(refused) and refused["block_reason"] == "effect_status_unknown"
    assert refused["metadata"]["duplicate_of"] == "call_1"
    assert refused["metadata"]["status"] == "unknown"
    assert "call_1" in refused["error"] and refused["fix_hints"]
    assert len(bank.transfers) == 1
    events = store_events(lookup_store, "call_2")
    assert [(e.kind, dict(e.reason or {})) for e in events] == [
        ("refused", {"code": "duplicate_of", "message": "call_1"})
    ]


def test_a_copy_of_a_call_committed_without_a_value_is_refused(lookup_store: Any) -> None:
    bank = Bank()

    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=lookup_store, duplicate_window=60)))
    def open_socket(host: str) -> object:
        bank.transfer(host, 0)
        return object()  # no JSON form: committed without a value

    call(open_socket, "call_1", "db")
    refused = call(open_socket, "call_2", "db")
    assert refused["block_reason"] == "replay_value_unavailable"
    assert refused["metadata"]["duplicate_of"] == "call_1"
    assert len(bank.transfers) == 1


def test_a_copy_of_a_released_call_runs(lookup_store: Any) -> None:
    bank = Bank()
    transfer = transfer_tool(lookup_store, bank)
    bank.fail_with = ValueError("account closed")  # not ambiguous: released, it may run again
    with pytest.raises(ValueError):
        call(transfer, "call_1", "bob", 500)
    second = call(transfer, "call_2", "bob", 500)
    assert second == {"transfer": 2, "to": "bob", "cents": 500}
    assert [t[0] for t in bank.transfers] == ["call_1", "call_2"]


def test_other_arguments_another_agent_or_no_window_are_calls_of_their_own(lookup_store: Any) -> None:
    bank = Bank()
    transfer = transfer_tool(lookup_store, bank)
    call(transfer, "call_1", "bob", 500)
    call(transfer, "call_2", "bob", 700)
    call(transfer, "call_3", "bob", 500, agent_id="agent-2")
    call(transfer, "call_4", "bob", 500, agent_id=None)
    unwindowed = transfer_tool(lookup_store, bank, window=None)
    call(unwindowed, "call_5", "bob", 500)
    assert [t[0] for t in bank.transfers] == ["call_1", "call_2", "call_3", "call_4", "call_5"]
    # A call without an agent matches calls without one.
    assert call(transfer, "call_6", "bob", 500, agent_id=None) == {"transfer": 4, "to": "bob", "cents": 500}
    assert len(bank.transfers) == 5


def test_a_call_begun_before_the_window_is_not_matched(lookup_store: Any) -> None:
    bank = Bank()
    narrow = transfer_tool(lookup_store, bank, window=0.05)
    call(narrow, "call_1", "bob", 500)
    time.sleep(0.1)  # call_1 began more than the window ago, however slow the machine
    assert call(narrow, "call_2", "bob", 500) == {"transfer": 2, "to": "bob", "cents": 500}
    # With a window of ten minutes, a copy is answered as the most recent of them.
    wide = transfer_tool(lookup_store, bank, window=600)
    assert call(wide, "call_3", "bob", 500) == {"transfer": 2, "to": "bob", "cents": 500}
    assert [dict(e.reason or {}) for e in store_events(lookup_store, "call_3")] == [
        {"code": "duplicate_of", "message": "call_2"}
    ]
    assert len(bank.transfers) == 2


def test_a_retry_of_the_earlier_id_is_its_own_replay(lookup_store: Any) -> None:
    bank = Bank()
    transfer = transfer_tool(lookup_store, bank)
    first = call(transfer, "call_1", "bob", 500)
    call(transfer, "call_2", "bob", 500)
    assert call(transfer, "call_1", "bob", 500) == first
    assert [(e.kind, e.reason) for e in store_events(lookup_store, "call_1")][-1] == ("replayed", None)
    # The copy's own id, asked again, is still answered as a copy.
    assert call(transfer, "call_2", "bob", 500) == first
    assert len(bank.transfers) == 1


def test_a_reversible_tool_is_answered_from_the_earlier_call_too(lookup_store: Any) -> None:
    reads: list[str | None] = []

    @reversibility("reversible")
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=lookup_store, duplicate_window=60)))
    def quote(symbol: str) -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        reads.append(context.tool_call_id)
        return {"symbol": symbol, "price": len(reads)}

    assert call(quote, "call_1", "ACME") == call(quote, "call_2", "ACME") == {"symbol": "ACME", "price": 1}
    assert reads == ["call_1"]


def test_a_window_with_agent_scoped_ids_names_the_scoped_call(lookup_store: Any) -> None:
    bank = Bank()
    transfer = transfer_tool(lookup_store, bank, id_scope="agent")
    first = call(transfer, "call_1", "bob", 500, agent_id="alice")
    assert call(transfer, "call_2", "bob", 500, agent_id="alice") == first
    assert call(transfer, "call_1", "bob", 500, agent_id="carol")["transfer"] == 2
    events = store_events(lookup_store, "agent:alice/call_2")
    assert [(e.kind, dict(e.reason or {})) for e in events] == [
        ("replayed", {"code": "duplicate_of", "message": "agent:alice/call_1"})
    ]


def test_an_async_tool_is_answered_from_the_earlier_call(lookup_store: Any) -> None:
    bank = Bank()

    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=lookup_store, duplicate_window=60)))
    async def transfer(to: str, cents: int) -> dict[str, Any]:
        return bank.transfer(to, cents)

    async def both() -> tuple[Any, Any]:
        async with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": "call_1"}):
            first = await transfer("bob", 500)
        async with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": "call_2"}):
            again = await transfer("bob", 500)
        return first, again

    first, again = asyncio.run(both())
    assert again == first and len(bank.transfers) == 1


def test_a_store_without_the_lookup_cannot_be_given_a_window(tmp_path: Path) -> None:
    store = guide_store(tmp_path)  # the three required methods only
    with pytest.raises(TypeError, match="duplicate_window needs a store"):
        EffectGuard(store=store, duplicate_window=60)
    EffectGuard(store=store)  # and without a window it is a store like any


@pytest.mark.parametrize("window", [0, -1, float("inf"), float("nan"), "60", True])
def test_a_window_is_a_positive_number_of_seconds(window: Any) -> None:
    with pytest.raises(ValueError, match="duplicate_window"):
        EffectGuard(duplicate_window=window)


def test_show_and_export_name_the_earlier_call(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path)
    bank = Bank()
    transfer = transfer_tool(journal, bank)
    call(transfer, "call_1", "bob", 500)
    call(transfer, "call_2", "bob", 500)
    journal.close()
    shown = invoke("journal", "show", "call_2", "--db", str(path))
    assert shown.exit_code == 0, shown.output
    assert "duplicate_of: call_1" in shown.stdout and "replayed" in shown.stdout
    as_json = invoke("journal", "show", "call_2", "--db", str(path), "--json")
    one = json.loads(as_json.stdout)
    assert one["status"] is None and one["duplicate_of"] == "call_1"
    assert [(e["kind"], e["reason"]) for e in one["events"]] == [
        ("replayed", {"code": "duplicate_of", "message": "call_1"})
    ]
    exported = invoke("journal", "export", "--db", str(path), "--call", "call_2")
    (line,) = [orjson.loads(text) for text in exported.stdout.splitlines()]
    assert line["kind"] == "replayed" and line["reason"] == {"code": "duplicate_of", "message": "call_1"}
    assert invoke("journal", "verify", "--db", str(path)).exit_code == 0


# -- the index the lookup reads, on journals made before it ---------------------------------------


def test_an_sqlite_journal_of_the_version_before_gets_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from journal.sqlite import schema

    path = tmp_path / "j.db"
    latest, before_index = schema.LATEST, 4  # version 5 added the index
    monkeypatch.setattr(schema, "LATEST", before_index)
    bank = Bank()
    old = SQLiteJournal(path)
    call(transfer_tool(old, bank), "call_1", "bob", 500)
    old.close()
    monkeypatch.undo()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (before_index,)
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'calls_idempotency_key'").fetchall() == []
    conn.close()
    with SQLiteJournal(path) as journal:  # a writable open migrates it
        assert call(transfer_tool(journal, bank), "call_2", "bob", 500)["transfer"] == 1
        assert journal.verify().ok
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (latest,)
    plan = " ".join(str(row) for row in conn.execute(
        "EXPLAIN QUERY PLAN SELECT call_id FROM calls WHERE idempotency_key = 'k' AND created_at >= 'x' "
        "ORDER BY created_at DESC"))
    assert "calls_idempotency_key" in plan
    conn.close()
    assert len(bank.transfers) == 1


@pytest.mark.postgres
def test_a_postgres_journal_of_the_version_before_gets_the_index(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg

    from journal.postgres import PostgresJournal
    from journal.postgres import schema as pg_schema

    latest, before_index = pg_schema.SCHEMA_VERSION, 2  # version 3 added the index
    monkeypatch.setattr(pg_schema, "SCHEMA_VERSION", before_index)
    bank = Bank()
    old = PostgresJournal(pg_dsn)
    call(transfer_tool(old, bank), "call_1", "bob", 500)
    old.close()
    monkeypatch.undo()

    def indexes() -> list[str]:
        with psycopg.connect(pg_dsn) as conn:
            return [r[0] for r in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'calls' AND indexname = 'calls_idempotency_key'")]

    assert indexes() == []
    journal = PostgresJournal(pg_dsn)
    try:
        assert call(transfer_tool(journal, bank), "call_2", "bob", 500)["transfer"] == 1
    finally:
        journal.close()
    assert indexes() == ["calls_idempotency_key"]
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT schema_version FROM airlock_journal_meta").fetchone() == (latest,)
    assert len(bank.transfers) == 1
