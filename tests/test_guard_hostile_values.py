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

import guard.airlock
from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.canonical import NotCanonical, canonical_json
from guard.effect_guard import EffectGuard, InMemoryEffectStore
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


class Flaky:
    """A value whose model_dump works for JSON and then fails: storing it raises."""

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        if mode == "json":
            return {"balance": None}
        raise RuntimeError("the connection behind this value is closed")


def test_a_value_that_cannot_be_recorded_still_reaches_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = InMemoryEffectStore()
    value = Flaky()

    tool = guarded(store, lambda cents: value)
    with caplog.at_level(logging.ERROR, logger="guard"):
        assert call(tool, "v1", 5) is value
    assert "could not record committed" in caplog.text and "connection behind this value" in caplog.text
    assert store.get("v1").status == "pending"  # so a retry is refused, never run again
    assert call(tool, "v1", 5)["block_reason"] == "effect_status_unknown"


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
    monkeypatch.setattr(guard.airlock, "current_owner", owner_unknown)  # after the pending, before the outcome
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
    record = store.get("call_\\udcff")
    assert (record.status, record.agent_id) == ("committed", "agent-\\udcff")
    kinds = [(e.kind, e.call_id, e.agent_id) for e in store.events(call_id="call_\\udcff")]
    assert kinds == [("pending", "call_\\udcff", "agent-\\udcff"), ("committed", "call_\\udcff", "agent-\\udcff"),
                     ("replayed", "call_\\udcff", "agent-\\udcff")]


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
