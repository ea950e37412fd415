"""The ids a store keeps calls under are injective: no two ``(agent_id, tool_call_id)`` pairs, and no
two global ids, share one, whatever they hold (a lone surrogate, the backslash text of one, ``%``,
``/``, NUL, ``agent:``). Plain ids keep the form they always had; a call kept under an id's old,
ambiguous form is never run again."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal
from guard.adapters import openai
from guard.canonical import canonical_json, storable
from guard.effect_guard import EffectGuard, InMemoryEffectStore, idempotency_key
from guard.scope import (
    agent_scoped_id,
    global_call_id,
    old_call_id,
    split_global_id,
    split_scoped_id,
    stored_call_id,
)
from guard.store import EffectEvent
from journal import SQLiteJournal
from tests.cli_support import invoke
from tests.stores import close_store, store_events

SURROGATE = "\udcff"  # what JSON's "\udcff" decodes to: a lone surrogate, no UTF-8 form
SPELLED = "\\udcff"  # a backslash and five letters: what storable wrote for the surrogate

# Pieces that make ids hard to keep apart, mixed with any other character (surrogates included).
_PIECES = st.sampled_from([
    SURROGATE, "\ud800", "\udfff", SPELLED, "\\ud800", "\\udfff", "\\", "%", "%25", "%2F", "%u", "%uDCFF",
    "/", "\x00", "agent:", "agent:%", "u", "d", "c", "f", "8", "é", "😀",
])
_CHARS = st.characters(exclude_categories=())  # every code point, lone surrogates too
TEXT = st.lists(st.one_of(_PIECES, _CHARS), max_size=8).map("".join)
# Pieces one spelling of which a store might take for the other: ids made of them are near-twins.
_TWINS = [
    (SURROGATE, SPELLED), ("\ud800", "\\ud800"), ("%", "%25"), ("/", "%2F"), ("%uDCFF", SURROGATE),
    ("agent:", "agent:%"), ("\x00", "\\x00"), ("\\", "%5C"), ("a", "a"),
]
TWINS = st.lists(st.tuples(st.sampled_from(_TWINS), st.booleans()), max_size=6).map(
    lambda picks: ("".join(a for (a, _), _ in picks), "".join(b if swap else a for (a, b), swap in picks)))


# -- the rule --------------------------------------------------------------------------------------


@given(first=st.tuples(st.one_of(st.none(), TEXT), TEXT), second=st.tuples(st.one_of(st.none(), TEXT), TEXT))
def test_distinct_pairs_are_kept_under_distinct_ids(
    first: tuple[str | None, str], second: tuple[str | None, str]
) -> None:
    # None and "" are one scope, as before.
    if (first[0] or "", first[1]) != (second[0] or "", second[1]):
        assert agent_scoped_id(*first) != agent_scoped_id(*second)


@given(agent=st.one_of(st.none(), TEXT), tool_call_id=TEXT)
def test_a_scoped_id_reads_back_as_its_pair_and_is_storable(agent: str | None, tool_call_id: str) -> None:
    scoped = agent_scoped_id(agent, tool_call_id)
    assert split_scoped_id(scoped) == (agent or "", tool_call_id)
    assert split_global_id(scoped) is None
    assert storable(scoped) == scoped  # valid UTF-8: every store keeps it as it is
    assert stored_call_id("agent", agent, tool_call_id) == scoped


@given(agents=TWINS, ids=TWINS, cross=st.booleans())
def test_near_twins_are_kept_apart(agents: tuple[str, str], ids: tuple[str, str], cross: bool) -> None:
    # A lone surrogate and its backslash text, "%" and "%25", "/" and "%2F": one spelling each before.
    first = (agents[0], ids[0])
    second = (agents[1], ids[0] if cross else ids[1])
    if first != second:
        assert agent_scoped_id(*first) != agent_scoped_id(*second)
    if ids[0] != ids[1]:
        assert global_call_id(ids[0]) != global_call_id(ids[1])


@given(first=TEXT, second=TEXT)
def test_distinct_global_ids_are_kept_under_distinct_ids(first: str, second: str) -> None:
    if first != second:
        assert global_call_id(first) != global_call_id(second)


@given(tool_call_id=TEXT)
def test_a_global_id_reads_back_and_names_no_agent(tool_call_id: str) -> None:
    kept = global_call_id(tool_call_id)
    assert split_global_id(kept) == tool_call_id
    assert split_scoped_id(kept) is None
    assert storable(kept) == kept
    assert stored_call_id("global", "any agent", tool_call_id) == kept


@given(tool_call_id=TEXT, agent=st.one_of(st.none(), TEXT), other=TEXT)
def test_the_scopes_never_share_an_id(tool_call_id: str, agent: str | None, other: str) -> None:
    assert global_call_id(tool_call_id) != agent_scoped_id(agent, other)


@given(agent=st.one_of(st.none(), TEXT), tool_call_id=TEXT, other_agent=st.one_of(st.none(), TEXT), other=TEXT)
def test_no_id_is_kept_under_another_ids_old_form(
    agent: str | None, tool_call_id: str, other_agent: str | None, other: str
) -> None:
    # So a call found under an old form was recorded before this rule: never by a call made since.
    for scope in ("global", "agent"):
        old = old_call_id(scope, other_agent, other)
        if old is not None:
            assert old != global_call_id(tool_call_id)
            assert old != agent_scoped_id(agent, tool_call_id)


@given(agent=st.one_of(st.none(), st.text()), tool_call_id=st.text(min_size=1))
def test_ordinary_ids_keep_their_form(agent: str | None, tool_call_id: str) -> None:
    # st.text() has no lone surrogate; an id without a backslash is ordinary whatever else it holds.
    if "\\" in (agent or "") + tool_call_id:
        return
    name = (agent or "").replace("%", "%25").replace("/", "%2F")
    assert agent_scoped_id(agent, tool_call_id) == f"agent:{name}/{tool_call_id}"
    assert old_call_id("agent", agent, tool_call_id) is None
    if not tool_call_id.startswith("agent:"):
        assert global_call_id(tool_call_id) == tool_call_id
        assert old_call_id("global", agent, tool_call_id) is None


def test_the_forms_of_the_two_bobs() -> None:
    # The exact rule, as docs/semantics.md states it.
    assert agent_scoped_id("bob" + SURROGATE, "call_1") == "agent:bob%uDCFF%/call_1"
    assert agent_scoped_id("bob" + SPELLED, "call_1") == "agent:bob\\udcff%/call_1"
    assert agent_scoped_id("bob", "c/1" + SURROGATE) == "agent:bob%/c%2F1%uDCFF"
    assert agent_scoped_id(None, "x" + SURROGATE) == "agent:%/x%uDCFF"
    assert agent_scoped_id("a/b%", "call_1") == "agent:a%2Fb%25/call_1"
    assert global_call_id("x" + SURROGATE) == "agent:%x%uDCFF"
    assert global_call_id("x" + SPELLED) == "agent:%x\\udcff"
    assert global_call_id("agent:alice/call_1") == "agent:%agent:alice%2Fcall_1"
    assert global_call_id("C:\\tmp\\uDCFF") == "C:\\tmp\\uDCFF"  # upper case is no surrogate's escape
    assert old_call_id("agent", "bob" + SURROGATE, "call_1") == "agent:bob\\udcff/call_1"
    assert old_call_id("agent", "bob" + SPELLED, "call_1") == "agent:bob\\udcff/call_1"
    assert old_call_id("global", None, "x" + SURROGATE) == old_call_id("global", None, "x" + SPELLED) == "x\\udcff"


# -- end to end, on a SQLite file and in memory -----------------------------------------------------


@pytest.fixture(params=["sqlite", "memory"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Stores:
    """A store of one kind, opened again (a SQLite file is closed and reopened) between runs."""

    def __init__(self, kind: str, path: Path) -> None:
        self.kind, self.path = kind, path
        self.memory = InMemoryEffectStore()
        self.opened: list[Any] = []

    def open(self) -> Any:
        if self.kind == "memory":
            return self.memory
        journal = SQLiteJournal(self.path)
        self.opened.append(journal)
        return journal

    def close(self) -> None:
        for journal in self.opened:
            close_store(journal)


@pytest.fixture
def stores(kind: str, tmp_path: Path) -> Iterator[Stores]:
    made = Stores(kind, tmp_path / "j.db")
    try:
        yield made
    finally:
        made.close()


class Ledger:
    """A payment backend: every charge that reached it."""

    def __init__(self) -> None:
        self.charges: list[tuple[str | None, str | None]] = []
        self.lock = threading.Lock()

    def charge(self, to: str, cents: int) -> dict[str, Any]:
        context = get_current_context()
        assert context is not None
        with self.lock:
            self.charges.append((context.agent_id, context.tool_call_id))
            return {"charge": len(self.charges), "to": to, "cents": cents}


def charge_tool(store: Any, ledger: Ledger, **options: Any) -> Any:
    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store, **options)))
    def charge(to: str, cents: int) -> dict[str, Any]:
        return ledger.charge(to, cents)

    return charge


def as_agent(agent_id: str | None, tool_call_id: str, fn: Any, *args: Any) -> Any:
    with AirlockContext(agent_id=agent_id, metadata={"tool_call_id": tool_call_id}):
        return fn(*args)


@pytest.mark.parametrize("first", [SURROGATE, SPELLED])
def test_the_two_bobs_each_run_their_own_call(stores: Stores, first: str) -> None:
    second = SPELLED if first == SURROGATE else SURROGATE
    ledger = Ledger()
    store = stores.open()
    charge = charge_tool(store, ledger, id_scope="agent")
    one = as_agent("bob" + first, "call_1", charge, "shop", 500)
    two = as_agent("bob" + second, "call_1", charge, "shop", 500)
    assert not is_refusal(one) and not is_refusal(two)
    assert (one["charge"], two["charge"]) == (1, 2)  # two effects, each its own value
    assert ledger.charges == [("bob" + first, "call_1"), ("bob" + second, "call_1")]
    # Each bob's retry, on the store opened again, is replayed with his own value and charges nothing.
    charge = charge_tool(stores.open(), ledger, id_scope="agent")
    assert as_agent("bob" + second, "call_1", charge, "shop", 500) == two
    assert as_agent("bob" + first, "call_1", charge, "shop", 500) == one
    assert len(ledger.charges) == 2
    for bob in (first, second):
        record = store.get(agent_scoped_id("bob" + bob, "call_1"))
        assert record is not None and record.status == "committed"


@pytest.mark.parametrize("first", [SURROGATE, SPELLED])
def test_two_global_ids_spelled_alike_before_each_run_their_own_call(stores: Stores, first: str) -> None:
    second = SPELLED if first == SURROGATE else SURROGATE
    ledger = Ledger()
    charge = charge_tool(stores.open(), ledger)
    one = as_agent("alice", "x" + first, charge, "shop", 500)
    two = as_agent("alice", "x" + second, charge, "shop", 500)
    assert not is_refusal(one) and not is_refusal(two)
    assert (one["charge"], two["charge"]) == (1, 2)
    charge = charge_tool(stores.open(), ledger)
    assert as_agent("alice", "x" + second, charge, "shop", 500) == two
    assert as_agent("alice", "x" + first, charge, "shop", 500) == one
    assert ledger.charges == [("alice", "x" + first), ("alice", "x" + second)]


def test_a_global_call_with_a_surrogate_is_journaled_under_its_escaped_id(stores: Stores) -> None:
    ledger = Ledger()
    store = stores.open()
    charge = charge_tool(store, ledger)
    as_agent("alice", "x" + SURROGATE, charge, "shop", 500)
    as_agent("alice", "x" + SURROGATE, charge, "shop", 900)  # the same id for another charge: refused
    events = store_events(store, "agent:%x%uDCFF")
    assert [(e.kind, e.call_id) for e in events] == [
        ("pending", "agent:%x%uDCFF"), ("committed", "agent:%x%uDCFF"), ("refused", "agent:%x%uDCFF"),
    ]
    assert store.get("x\\udcff") is None  # the old form, which a plain id owns now


def _legacy_call(store: Any, call_id: str, agent_id: str | None) -> None:
    """What a guard before this rule left in the journal: a committed charge under ``call_id``."""
    arguments = {"to": "shop", "cents": 500}
    key = idempotency_key("charge", arguments)
    text = canonical_json(arguments)
    store.append(EffectEvent("pending", call_id, "charge", agent_id=agent_id, idempotency_key=key,
                             arguments=text, attempt=1))
    store.append(EffectEvent("committed", call_id, "charge", agent_id=agent_id, idempotency_key=key,
                             arguments=text, value=orjson.dumps({"charge": 1, "to": "shop", "cents": 500}).decode(),
                             attempt=1))


@pytest.mark.parametrize("bob", [SURROGATE, SPELLED])
def test_a_call_kept_under_an_ambiguous_old_agent_form_is_never_run_again(stores: Stores, bob: str) -> None:
    # Before this rule both bobs' call_1 was kept under "agent:bob\udcff/call_1" (the backslash text).
    _legacy_call(stores.open(), "agent:bob\\udcff/call_1", "bob\\udcff")
    ledger = Ledger()
    store = stores.open()
    charge = charge_tool(store, ledger, id_scope="agent")
    refused = as_agent("bob" + bob, "call_1", charge, "shop", 500)
    assert is_refusal(refused) and refused["block_reason"] == "policy_violation"
    assert refused["metadata"]["violation_type"] == "tool_call_id_ambiguous"
    assert refused["metadata"]["old_call_id"] == "agent:bob\\udcff/call_1"
    assert ledger.charges == []  # whichever bob it was, it is not run a second time
    # The refusal is journaled under the call's id now; the old record is left as it was.
    new_id = agent_scoped_id("bob" + bob, "call_1")
    assert [e.kind for e in store_events(store, new_id)] == ["refused"]
    assert store.get(new_id) is None
    record = store.get("agent:bob\\udcff/call_1")
    assert record is not None and record.status == "committed"
    # Another agent's call_1, and bob's other calls, run as ever.
    assert as_agent("carol", "call_1", charge, "shop", 500)["charge"] == 1
    assert as_agent("bob" + bob, "call_2", charge, "shop", 500)["charge"] == 2


@pytest.mark.parametrize("spelling", [SURROGATE, SPELLED])
def test_a_call_kept_under_an_ambiguous_old_global_form_is_never_run_again(stores: Stores, spelling: str) -> None:
    _legacy_call(stores.open(), "x\\udcff", "alice")
    ledger = Ledger()
    charge = charge_tool(stores.open(), ledger)
    refused = as_agent("alice", "x" + spelling, charge, "shop", 500)
    assert is_refusal(refused) and refused["metadata"]["violation_type"] == "tool_call_id_ambiguous"
    assert ledger.charges == []


def test_a_plain_old_call_is_replayed_as_ever(stores: Stores) -> None:
    # An ordinary id's form never changed: its old record is its own, and a retry is a replay.
    _legacy_call(stores.open(), "agent:bob/call_1", "bob")
    _legacy_call(stores.open(), "call_1", "bob")
    ledger = Ledger()
    store = stores.open()
    assert as_agent("bob", "call_1", charge_tool(store, ledger, id_scope="agent"), "shop", 500)["charge"] == 1
    assert as_agent("bob", "call_1", charge_tool(store, ledger), "shop", 500)["charge"] == 1
    assert ledger.charges == []


def test_a_global_id_of_the_agent_form_is_refused_with_a_surrogate_too(stores: Stores) -> None:
    ledger = Ledger()
    store = stores.open()
    scoped = charge_tool(store, ledger, id_scope="agent")
    as_agent("bob" + SURROGATE, "call_1", scoped, "shop", 500)
    unscoped = charge_tool(store, ledger)
    for sent in ("agent:bob%uDCFF%/call_1", "agent:bob" + SURROGATE + "%/call_1", "agent:%x"):
        refused = as_agent("mallory", sent, unscoped, "shop", 500)
        assert is_refusal(refused) and refused["metadata"]["violation_type"] == "tool_call_id_reserved"
    assert len(ledger.charges) == 1


def test_an_unknown_tool_is_journaled_under_the_scoped_id(stores: Stores) -> None:
    store = stores.open()

    @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=store, id_scope="agent")))
    def charge(cents: int) -> int:
        return cents

    result = openai.dispatch({"id": "c" + SURROGATE, "function": {"name": "pay", "arguments": "{}"}}, [charge],
                             agent_id="bob")
    assert json.loads(result["content"])["metadata"]["violation_type"] == "unknown_tool"
    assert [(e.kind, e.call_id) for e in store_events(store)] == [("refused", "agent:bob%/c%uDCFF")]


def test_show_finds_each_bobs_call(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path)
    ledger = Ledger()
    charge = charge_tool(journal, ledger, id_scope="agent")
    as_agent("bob" + SURROGATE, "call_1", charge, "shop", 500)
    as_agent("bob" + SPELLED, "call_1", charge, "shop", 500)
    journal.close()
    listed = invoke("journal", "show", "--db", str(path), "--json")
    assert listed.exit_code == 0, listed.output
    calls = sorted(c["call_id"] for c in map(json.loads, listed.stdout.splitlines()))
    assert calls == ["agent:bob%uDCFF%/call_1", "agent:bob\\udcff%/call_1"]
    assert {split_scoped_id(c) for c in calls} == {("bob" + SURROGATE, "call_1"), ("bob" + SPELLED, "call_1")}
    for call_id in calls:
        one = invoke("journal", "show", call_id, "--db", str(path), "--json")
        assert one.exit_code == 0, one.output
        assert json.loads(one.stdout.splitlines()[0])["call_id"] == call_id

