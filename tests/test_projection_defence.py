"""A projection edited by hand (a call's row deleted, or set to ``released``, with plain SQL) never
lets a call run again: the write that decides the call checks the log where the row would let it
run (docs/journal.md, "What a writer with the file can hide").

Each test edits the real tables the way an operator would, with the driver's own connection
(tests/journals.py: sqlite3 on the file, psycopg on the schema), and then retries the call through
the guard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from tests.journals import JOURNAL_PARAMS, journal_factory
from tests.stores import contended

# Every journal store; and PostgreSQL written as while other replicas write too (every write by the
# server-side append), and with its calls made by one object and their retries by another.
STORES = [*JOURNAL_PARAMS, *(pytest.param(f"postgres-{how}", marks=pytest.mark.postgres)
                             for how in ("contended", "other-object"))]


class Rig:
    """A journal, a way to run plain SQL on its tables, and a guarded tool that counts its runs."""

    def __init__(self, journal: Any, sql: Callable[[str, tuple[Any, ...]], object],
                 reopen: Callable[[], Any]) -> None:
        self.journal = journal
        self.sql = sql
        self.reopen = reopen  # another journal object on the same tables (another replica)
        self.runs: list[str] = []
        self.fail_with: BaseException | None = None

    def tool(self, journal: Any | None = None) -> Callable[..., Any]:
        policy = SecurityPolicy(allowed_tools=["charge"], effect_guard=EffectGuard(store=journal or self.journal))

        @Airlock(policy=policy)
        def charge(account: str) -> dict[str, str]:
            self.runs.append(account)
            if self.fail_with is not None:
                raise self.fail_with
            return {"charged": account}

        return charge

    def call(self, call_id: str, journal: Any | None = None) -> Any:
        with AirlockContext(agent_id="agent", metadata={"tool_call_id": call_id}):
            return self.tool(journal)(account="acct_1")


@pytest.fixture(params=STORES)
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    store, _, how = str(request.param).partition("-")
    made = journal_factory(request, store)
    target = made.target(tmp_path)
    opened = [made.open(target)]

    def reopen() -> Any:
        opened.append(made.open(target))
        return opened[-1]

    journal: Any = opened[0]
    if how == "contended":
        contended(journal)  # every write by the server-side append
    rig = Rig(journal, made.database(target).execute, reopen)
    if how == "other-object":
        rig.journal = reopen()  # the calls are made by one object, the retries by another (below)
        rig.reopen = lambda: journal
    yield rig
    for one in opened:
        one.close()


def test_a_committed_call_whose_row_was_deleted_is_replayed_not_run(rig: Rig,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    first = rig.call("c1")
    rig.sql("DELETE FROM calls WHERE call_id = ?", ("c1",))
    with caplog.at_level(logging.WARNING):
        retry = rig.call("c1", rig.reopen())
    assert retry == first == {"charged": "acct_1"}
    assert rig.runs == ["acct_1"]
    assert "differs from its log" in caplog.text
    report = rig.journal.verify()
    assert not report.ok and "run rebuild" in (report.problem or "")
    rig.journal.rebuild()
    assert rig.journal.verify().ok
    assert rig.journal.call("c1").status == "committed"


def test_a_committed_call_set_to_released_by_hand_is_replayed_not_run(rig: Rig) -> None:
    first = rig.call("c1")
    rig.sql("UPDATE calls SET status = 'released' WHERE call_id = ?", ("c1",))
    assert rig.call("c1") == first
    assert rig.call("c1", rig.reopen()) == first
    assert rig.runs == ["acct_1"]


def test_an_unknown_call_released_by_hand_is_still_refused(rig: Rig) -> None:
    rig.fail_with = TimeoutError("the backend did not answer")
    with pytest.raises(TimeoutError):
        rig.call("c1")
    rig.fail_with = None
    rig.sql("UPDATE calls SET status = 'released' WHERE call_id = ?", ("c1",))
    retry = rig.call("c1", rig.reopen())
    assert is_refusal(retry) and retry["block_reason"] == "effect_status_unknown"
    rig.sql("DELETE FROM calls WHERE call_id = ?", ("c1",))
    retry = rig.call("c1")
    assert is_refusal(retry) and retry["block_reason"] == "effect_status_unknown"
    assert rig.runs == ["acct_1"]


def test_a_call_released_by_the_journal_itself_still_runs_again(rig: Rig) -> None:
    rig.fail_with = ValueError("card declined")
    with pytest.raises(ValueError):
        rig.call("c1")
    rig.fail_with = None
    assert rig.call("c1", rig.reopen()) == {"charged": "acct_1"}
    assert rig.runs == ["acct_1", "acct_1"]
    record = rig.journal.call("c1")
    assert (record.status, record.attempt) == ("committed", 2)
    assert rig.journal.verify().ok


def test_refusals_alone_make_no_row_and_the_call_still_runs(rig: Rig) -> None:
    refused = rig.journal.append  # a refusal of the id recorded first, as a gate would
    from guard.store import EffectEvent

    refused(EffectEvent("refused", "c1", "charge", reason={"code": "policy_violation", "message": "m"}))
    assert rig.call("c1") == {"charged": "acct_1"}
    assert rig.runs == ["acct_1"]


def test_an_operator_resolves_a_call_whose_row_was_deleted_from_its_log(rig: Rig) -> None:
    rig.fail_with = TimeoutError("the backend did not answer")
    with pytest.raises(TimeoutError):
        rig.call("c1")
    rig.sql("DELETE FROM calls WHERE call_id = ?", ("c1",))
    event = rig.journal.resolve("c1", applied=True, reason="the backend has it", operator="ops", value='{"id":1}')
    assert event.kind == "committed" and event.attempt == 1
    rig.journal.rebuild()
    assert rig.journal.call("c1").status == "committed"
    assert rig.call("c1") == {"id": 1}
    assert rig.runs == ["acct_1"]
