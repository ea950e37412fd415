"""PostgresJournal remembers the calls it wrote: their replays and refusals take one statement, and
stay right when other replicas, or a hand on the projection, changed those calls meanwhile."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from journal.postgres import PostgresJournal

pytestmark = pytest.mark.postgres


class Tools:
    """``charge`` (returns a value), ``lost`` (raises TimeoutError: left unknown) and ``flaky``
    (raises ValueError: released), guarded on one journal; ``runs`` counts each tool's runs."""

    def __init__(self, journal: PostgresJournal) -> None:
        self.runs = {"charge": 0, "lost": 0, "flaky": 0}
        policy = SecurityPolicy(effect_guard=EffectGuard(store=journal))

        def charge(cents: int) -> dict[str, int]:
            self.runs["charge"] += 1
            return {"cents": cents, "run": self.runs["charge"]}

        def lost(cents: int) -> None:
            self.runs["lost"] += 1
            raise TimeoutError("the backend did not answer")

        def flaky(cents: int) -> dict[str, int]:
            self.runs["flaky"] += 1
            if self.runs["flaky"] == 1:
                raise ValueError("rejected")
            return {"cents": cents, "flaky_run": self.runs["flaky"]}

        self.charge, self.lost, self.flaky = (Airlock(policy=policy)(f) for f in (charge, lost, flaky))

    def call(self, tool: Callable[[int], Any], call_id: str) -> Any:
        with AirlockContext(agent_id="agent", metadata={"tool_call_id": call_id}), \
                contextlib.suppress(TimeoutError, ValueError):
            return tool(5)
        return None


def round_trips(journal: PostgresJournal, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The journal's writes from now on, one entry a round trip to the server (a locked write: two)."""
    made: list[str] = []
    writes = journal.writes  # the part that makes the appends
    on_server, locked = journal.datastore.resendable, writes._locked_write

    def counted_on_server(doing: str, sql: str, params: Any) -> Any:
        made.append("server append")
        return on_server(doing, sql, params)

    def counted_locked(*args: Any) -> Any:
        made.extend(["locked", "locked"])
        return locked(*args)

    monkeypatch.setattr(journal.datastore, "resendable", counted_on_server)
    monkeypatch.setattr(writes, "_locked_write", counted_locked)
    return made


@pytest.fixture
def journal(pg_dsn: str) -> Any:
    j = PostgresJournal(pg_dsn)
    yield j
    j.close()


def test_a_replay_and_a_refusal_of_calls_written_earlier_are_one_round_trip_each(
    journal: PostgresJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = Tools(journal)
    first = tools.call(tools.charge, "c-committed")
    tools.call(tools.lost, "c-unknown")
    for n in range(5):
        tools.call(tools.charge, f"c-later-{n}")  # neither call is the one this object wrote last
    made = round_trips(journal, monkeypatch)

    assert tools.call(tools.charge, "c-committed") == first
    refusal = tools.call(tools.lost, "c-unknown")

    assert is_refusal(refusal) and refusal["block_reason"] == "effect_status_unknown"
    assert made == ["server append", "server append"]
    assert tools.runs == {"charge": 6, "lost": 1, "flaky": 0}
    assert [e.kind for e in journal.call_events("c-committed")] == ["pending", "committed", "replayed"]
    assert [e.kind for e in journal.call_events("c-unknown")] == ["pending", "unknown", "refused"]
    assert journal.verify().ok


def test_a_call_another_replica_resolved_is_replayed_with_its_value_after_this_one_wrote_again(
    journal: PostgresJournal, pg_dsn: str
) -> None:
    tools = Tools(journal)
    tools.call(tools.lost, "c1")
    with PostgresJournal(pg_dsn) as other:
        other.resolve("c1", applied=True, value='{"charge_id":"ch_9"}', reason="the backend has it",
                      operator="ops")
    tools.call(tools.charge, "c2")  # this object's head is current again; its record of c1 is not

    assert tools.call(tools.lost, "c1") == {"charge_id": "ch_9"}
    assert tools.runs["lost"] == 1
    assert [e.kind for e in journal.call_events("c1")] == ["pending", "unknown", "committed", "replayed"]
    assert journal.verify().ok


def test_a_released_call_that_another_replica_ran_again_is_not_run_a_third_time(
    journal: PostgresJournal, pg_dsn: str
) -> None:
    tools = Tools(journal)
    tools.call(tools.flaky, "c1")  # released: it may run again
    with PostgresJournal(pg_dsn) as other:
        elsewhere = Tools(other)
        elsewhere.runs["flaky"] = 1  # its next run succeeds
        value = elsewhere.call(elsewhere.flaky, "c1")
    tools.call(tools.charge, "c2")

    assert tools.call(tools.flaky, "c1") == value
    assert tools.runs["flaky"] == 1 and elsewhere.runs["flaky"] == 2
    assert [e.kind for e in journal.call_events("c1")] == [
        "pending", "released", "pending", "committed", "replayed"]


def test_a_row_put_back_by_hand_to_the_release_this_object_wrote_never_lets_the_call_run_again(
    journal: PostgresJournal, pg_dsn: str
) -> None:
    tools = Tools(journal)
    tools.call(tools.flaky, "c1")
    released = journal.call("c1")
    assert released is not None and released.status == "released"
    with PostgresJournal(pg_dsn) as other:
        elsewhere = Tools(other)
        elsewhere.runs["flaky"] = 1
        value = elsewhere.call(elsewhere.flaky, "c1")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # the row as this object left it, by hand
        conn.execute("UPDATE calls SET status = 'released', value = NULL, last_seq = %s, attempt = 1 "
                     "WHERE call_id = 'c1'", (released.last_seq,))
    tools.call(tools.charge, "c2")  # the hand moved no head: this object's head is current

    assert tools.call(tools.flaky, "c1") == value
    assert tools.runs["flaky"] == 1 and elsewhere.runs["flaky"] == 2
    assert journal.call_events("c1")[-1].kind == "replayed"


def test_a_released_call_this_object_wrote_runs_again_as_the_next_attempt(journal: PostgresJournal) -> None:
    tools = Tools(journal)
    tools.call(tools.flaky, "c1")
    tools.call(tools.charge, "c2")

    assert tools.call(tools.flaky, "c1") == {"cents": 5, "flaky_run": 2}
    record = journal.call("c1")
    assert record is not None and (record.status, record.attempt) == ("committed", 2)
    assert journal.verify().ok


def test_after_a_rebuild_a_remembered_call_is_still_replayed_right(journal: PostgresJournal) -> None:
    tools = Tools(journal)
    first = tools.call(tools.charge, "c1")
    tools.call(tools.charge, "c2")
    journal.rebuild()

    assert tools.call(tools.charge, "c1") == first
    assert tools.runs["charge"] == 2
    assert journal.verify().ok


def test_after_a_crash_lost_an_outcome_this_object_wrote_its_replay_returns_what_the_journal_holds(
    pg_server: Any, pg_dsn: str
) -> None:
    if not pg_server.managed:
        pytest.skip("the tests do not crash an external server")
    from guard.effect_guard import decide_attempt
    from guard.store import EffectEvent, Verdict
    from tests.postgres.test_replicas import crash_losing

    def decide(call_id: str) -> Any:
        return lambda record: decide_attempt(record, call_id, "pay", "k" * 64, "{}", None, False)

    # One connection each, which the pool replaces on its own: the first object never sees it die.
    first, second = PostgresJournal(pg_dsn, pool_size=1), PostgresJournal(pg_dsn, pool_size=1)
    assert first.begin("x", decide("x")).verdict is Verdict.RUN  # pending: on disk before the tool runs
    for replica in (first, second):
        replica.datastore.pool.wait(10)  # sessions made first: their setup commits would flush what is to be lost
    crash_losing(pg_server, lambda: first.append(
        EffectEvent("committed", "x", "pay", value='{"charge":"lost"}', attempt=1)))
    first.datastore.pool.check()
    # Another replica's outcome of x takes the lost one's place in the chain, with its own value.
    second.resolve("x", applied=True, value='{"charge":"kept"}', reason="the backend has it", operator="ops",
                   force=True)
    assert first.begin("y", decide("y")).verdict is Verdict.RUN  # the first object's head is current again

    decision = first.begin("x", decide("x"))

    assert decision.verdict is Verdict.REPLAY and decision.record is not None
    assert decision.record.value == '{"charge":"kept"}'
    assert first.verify().ok
    first.close()
    second.close()
