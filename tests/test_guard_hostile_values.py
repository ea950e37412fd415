"""Values that are legal Python but awkward to store or show: they are keyed, recorded and returned
as the contract says, the same on every store."""

from __future__ import annotations

import enum
import logging
import math
import os
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

import guard.call
from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.canonical import NotCanonical, canonical_json
from guard.effect_guard import EffectGuard, InMemoryEffectStore, idempotency_key
from guard.store import format_at, parse_at

# -- times ------------------------------------------------------------------------------------


def test_a_year_before_1000_has_four_digits_and_sorts_as_a_text() -> None:
    early = datetime(999, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
    assert format_at(early) == "0999-01-02T03:04:05.000006Z"
    assert parse_at(format_at(early)) == early
    moments = [datetime(2026, 12, 1, tzinfo=UTC), early, datetime(1, 1, 1, tzinfo=UTC),
               datetime(1000, 1, 1, tzinfo=UTC)]
    assert sorted(format_at(m) for m in moments) == [format_at(m) for m in sorted(moments)]


def test_an_ordinary_moment_is_written_as_before() -> None:
    # The hash chain covers `at` as exported: the form of every ordinary date stays byte for byte.
    assert format_at(datetime(2026, 12, 1, 5, 23, 6, 123456, tzinfo=UTC)) == "2026-12-01T05:23:06.123456Z"
    assert format_at(datetime(2026, 12, 1, 5, 23, 6, tzinfo=UTC)) == "2026-12-01T05:23:06.000000Z"
    plus_two = timezone(timedelta(hours=2))
    assert format_at(datetime(2026, 1, 1, 1, 0, 0, 7, tzinfo=plus_two)) == "2025-12-31T23:00:00.000007Z"


# -- enum members -----------------------------------------------------------------------------


class Quota(enum.Enum):
    UNLIMITED = math.inf
    UNSET = math.nan
    NONE = 0


def test_an_enum_member_whose_value_is_infinite_cannot_be_keyed() -> None:
    for member in (Quota.UNLIMITED, Quota.UNSET, [Quota.UNLIMITED], {"quota": Quota.UNSET}):
        with pytest.raises(NotCanonical):
            canonical_json(member)
    assert canonical_json(Quota.NONE) == "0"


def test_an_infinite_enum_argument_is_refused_not_replayed_as_none() -> None:
    store = InMemoryEffectStore()
    runs: list[Any] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def set_quota(user: str, quota: Any) -> str:
        runs.append(quota)
        return f"quota of {user} set to {quota}"

    with AirlockContext(metadata={"tool_call_id": "c1"}):
        assert set_quota("bob", None) == "quota of bob set to None"
    with AirlockContext(metadata={"tool_call_id": "c1"}):
        refusal = set_quota("bob", Quota.UNLIMITED)
    assert is_refusal(refusal) and refusal["block_reason"] == "arguments_not_canonical"
    with AirlockContext(metadata={"tool_call_id": "c2"}):
        assert set_quota("bob", Quota.UNLIMITED)["block_reason"] == "arguments_not_canonical"
    assert runs == [None]


def test_an_infinite_enum_value_is_committed_without_a_value() -> None:
    store = InMemoryEffectStore()

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def quota_of(user: str) -> Quota:
        return Quota.UNLIMITED

    with AirlockContext(metadata={"tool_call_id": "q1"}):
        assert quota_of("bob") is Quota.UNLIMITED
    record = store.get("q1")
    assert record is not None and record.status == "committed" and record.value is None
    with AirlockContext(metadata={"tool_call_id": "q1"}):
        assert quota_of("bob")["block_reason"] == "replay_value_unavailable"


# -- exceptions and values that fight back ---------------------------------------------------


def call(fn: Any, call_id: str, *args: Any) -> Any:
    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": call_id}):
        return fn(*args)


def guarded(store: Any, fn: Any) -> Any:
    return Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))(fn)


class BackendError(Exception):
    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = payload

    def __str__(self) -> str:
        return "backend said " + self.payload["msg"]  # a payload without "msg": KeyError


class BackendTimeout(BackendError, TimeoutError):
    pass


@pytest.mark.parametrize(("error", "status"), [(BackendError, "released"), (BackendTimeout, "unknown")])
def test_an_exception_whose_str_fails_reaches_the_caller_and_is_recorded(
    store: Any, error: type[BackendError], status: str,
) -> None:
    def charge(cents: int) -> None:
        raise error({"code": 502})

    tool = guarded(store, charge)
    with pytest.raises(error):
        call(tool, "c1", 5)
    record = store.get("c1")
    assert record.status == status
    assert record.error == {"type": error.__name__, "message": f"<unprintable {error.__name__}>"}


# -- text with a lone surrogate --------------------------------------------------------------

# A file name that is not UTF-8, as os.fsdecode() gives it on Linux: 'report-\udcff.pdf'.
NAME = os.fsdecode(b"report-\xff.pdf")


def test_an_ordinary_error_with_a_lone_surrogate_releases_the_call_on_every_store(store: Any) -> None:
    runs: list[str] = []

    def upload(path: str) -> str:
        runs.append(path)
        if len(runs) == 1:
            raise FileNotFoundError(f"no such file: {NAME}")
        return "uploaded"

    tool = guarded(store, upload)
    with pytest.raises(FileNotFoundError) as raised:
        call(tool, "u1", "x")
    assert str(raised.value) == f"no such file: {NAME}"  # the caller's exception is untouched
    record = store.get("u1")
    assert record.status == "released"
    assert record.error == {"type": "FileNotFoundError", "message": "no such file: report-\\udcff.pdf"}
    assert call(tool, "u1", "x") == "uploaded"  # it may run again
    assert runs == ["x", "x"]


def test_an_ambiguous_error_with_a_lone_surrogate_is_unknown_on_every_store(store: Any) -> None:
    def upload(path: str) -> str:
        raise TimeoutError(f"no answer for {NAME}")

    tool = guarded(store, upload)
    with pytest.raises(TimeoutError):
        call(tool, "u2", "x")
    record = store.get("u2")
    assert (record.status, record.error["message"]) == ("unknown", "no answer for report-\\udcff.pdf")
    assert call(tool, "u2", "x")["block_reason"] == "effect_status_unknown"


def test_a_deferred_result_that_cannot_be_recorded_is_logged_as_unknown(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = InMemoryEffectStore()

    def owner_unknown() -> Any:
        raise OSError("the host name could not be read")

    def pages(count: int) -> Any:
        yield from range(count)

    tool = guarded(store, pages)
    monkeypatch.setattr(guard.call, "current_owner", owner_unknown)  # after the pending, before the outcome
    with caplog.at_level(logging.ERROR, logger="guard"):
        result = call(tool, "g1", 2)
    assert list(result) == [0, 1]
    assert "could not record unknown for pages" in caplog.text and "could not record committed" not in caplog.text
    assert store.get("g1").status == "pending"


def test_a_call_id_and_agent_id_with_a_lone_surrogate_run_once_on_every_store(store: Any) -> None:
    # A model's tool call id decoded from JSON that carried "\udcff" as an escape.
    runs: list[int] = []

    def charge(cents: int) -> dict[str, int]:
        runs.append(cents)
        return {"charged": cents}

    tool = guarded(store, charge)
    odd_id, odd_agent = "call_" + NAME[-5], "agent-" + NAME[-5]
    for _ in range(2):
        with AirlockContext(agent_id=odd_agent, metadata={"tool_call_id": odd_id}):
            assert tool(5) == {"charged": 5}  # run, then replayed
    assert runs == [5]
    record = store.get("agent:%call_%uDCFF")
    assert (record.status, record.agent_id) == ("committed", "agent-\\udcff")
    kinds = [(e.kind, e.call_id, e.agent_id) for e in store.events(call_id="agent:%call_%uDCFF")]
    assert kinds == [(kind, "agent:%call_%uDCFF", "agent-\\udcff") for kind in ("pending", "committed", "replayed")]


def test_a_journal_given_an_id_with_a_lone_surrogate_raises_its_own_error(store: Any) -> None:
    # The guard hands a journal ids every store can keep; called directly, a journal says what is wrong.
    from guard.effect_guard import decide_attempt
    from guard.store import EffectEvent
    from journal import JournalError

    if not hasattr(store, "verify"):
        pytest.skip("a store that serialises nothing keeps any str")
    odd = "c" + NAME[-5]
    with pytest.raises(JournalError, match=r"cannot store this event: .*not valid UTF-8"):
        store.begin(odd, lambda record: decide_attempt(record, odd, "pay", "k" * 64, "{}", None, False))
    with pytest.raises(JournalError, match="cannot store this event"):
        store.append(EffectEvent("refused", "c", "pay", agent_id=odd, reason={"code": "c", "message": "m"}))
    assert store.get(odd) is None and store.head()[0] == 0
    assert store.verify().ok


def test_a_tool_whose_name_has_a_lone_surrogate_runs_once_on_every_store(store: Any) -> None:
    # A name given by setattr (or made up by a host): recorded, and keyed, as its backslash escape.
    runs: list[int] = []

    def tool(cents: int) -> int:
        runs.append(cents)
        return cents

    tool.__name__ = "pay" + NAME[-5]
    guarded_tool = guarded(store, tool)
    assert [call(guarded_tool, "s1", 5), call(guarded_tool, "s1", 5)] == [5, 5]  # run, then replayed
    assert runs == [5]
    record = store.get("s1")
    assert (record.status, record.tool) == ("committed", "pay\\udcff")
    assert record.idempotency_key == idempotency_key("pay\\udcff", {"cents": 5})
    assert idempotency_key("pay" + NAME[-5], {"cents": 5}) == record.idempotency_key


# -- keys that are strings of a subclass -------------------------------------------------------


class Currency(enum.StrEnum):
    EUR = "EUR"
    USD = "USD"


def test_str_enum_keys_are_keyed_as_the_strings_they_are() -> None:
    assert canonical_json({Currency.USD: 2, Currency.EUR: [{Currency.EUR: 1}]}) == '{"EUR":[{"EUR":1}],"USD":2}'
    assert idempotency_key("quote", {"prices": {Currency.EUR: 1}}) == idempotency_key("quote", {"prices": {"EUR": 1}})


def test_two_keys_that_are_one_string_have_no_json_form() -> None:
    class Tag(str):
        __hash__ = object.__hash__

        def __eq__(self, other: object) -> bool:
            return self is other

    with pytest.raises(NotCanonical, match="two keys of one object are the string 'a'"):
        canonical_json({Tag("a"): 1, "a": 2})
    with pytest.raises(NotCanonical):
        canonical_json({1: "an int key is still refused", Currency.EUR: 2})


def test_a_value_keyed_by_a_str_enum_is_replayed_on_every_store(store: Any) -> None:
    runs: list[str] = []

    def quote(prices: dict[Currency, int]) -> dict[Currency, Any]:
        runs.append("quote")
        return {Currency.EUR: 1, Currency.USD: [Currency.EUR]}

    tool = guarded(store, quote)
    first = call(tool, "q1", {Currency.EUR: 1})
    assert first == {Currency.EUR: 1, Currency.USD: [Currency.EUR]}
    replay = call(tool, "q1", {"EUR": 1})  # the same arguments, spelled as a model sends them
    assert replay == {"EUR": 1, "USD": ["EUR"]} and all(type(k) is str for k in replay)
    assert runs == ["quote"]


# -- a model whose own dump fails ---------------------------------------------------------------


class HalfModel:
    """Dumps in JSON mode (with a null in it), but fails in Python mode, which the NaN check reads."""

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        if mode == "json":
            return {"v": None}
        raise RuntimeError("python mode is not supported")


def test_a_model_whose_dump_fails_has_no_json_form() -> None:
    with pytest.raises(NotCanonical, match="RuntimeError"):
        canonical_json(HalfModel())


def test_such_a_model_is_refused_as_an_argument_and_committed_without_a_value(store: Any) -> None:
    runs: list[int] = []

    def tool(x: Any) -> Any:
        runs.append(1)
        return HalfModel()

    guarded_tool = guarded(store, tool)
    assert call(guarded_tool, "h1", HalfModel())["block_reason"] == "arguments_not_canonical"
    assert runs == []
    value = call(guarded_tool, "h2", 1)
    assert isinstance(value, HalfModel) and runs == [1]  # the first caller gets the tool's value
    assert store.get("h2").status == "committed"
    assert call(guarded_tool, "h2", 1)["block_reason"] == "replay_value_unavailable"
    assert runs == [1]


# -- ids no store can hold, looked up ----------------------------------------------------------


@pytest.mark.parametrize("odd", ["a\x00b", "a" + NAME[-5] + "b"], ids=["nul", "lone-surrogate"])
def test_looking_up_an_id_no_store_can_hold_finds_nothing_on_every_store(store: Any, odd: str) -> None:
    from journal import CallNotFound

    assert call(guarded(store, lambda cents: cents), "c1", 5) == 5
    assert store.get(odd) is None
    assert list(store.events(call_id=odd)) == []
    if not hasattr(store, "resolve"):
        return
    assert store.calls(agent_id=odd) == [] and store.calls(tool=odd) == []
    for field in ("call_id", "tool", "agent_id"):
        assert list(store.events(**{field: odd})) == []
        assert list(store.export_lines(**{field: odd})) == []
    with pytest.raises(CallNotFound):
        store.resolve(odd, applied=False, reason="r", operator="ops")
    with pytest.raises(ValueError, match="a value can only be given"):  # the arguments' fault comes first
        store.resolve(odd, applied=False, value="1", reason="r", operator="ops")
    assert store.verify().ok and len(list(store.events())) == 2


# -- nesting ----------------------------------------------------------------------------------


def test_an_argument_nested_past_what_json_is_written_to_is_refused_in_plain_words() -> None:
    store = InMemoryEffectStore()
    runs: list[Any] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def tag(tags: Any) -> str:
        runs.append(tags)
        return "tagged"

    deepest: Any = []
    for _ in range(252):
        deepest = [deepest]  # 254 levels with the argument mapping around it: the most that is written
    with AirlockContext(metadata={"tool_call_id": "call-deep-ok"}):
        assert tag(deepest) == "tagged"
    with AirlockContext(metadata={"tool_call_id": "call-deep"}):
        refusal = tag([deepest])
    assert is_refusal(refusal) and refusal["block_reason"] == "arguments_not_canonical"
    assert "an argument has no JSON form (it nests arrays or objects more than 254 levels deep)" in refusal["error"]
    assert len(runs) == 1 and [e.kind for e in store.events("call-deep")] == ["refused"]
