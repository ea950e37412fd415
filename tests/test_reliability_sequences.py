"""Random sequences of calls (new ids, retries, reuses; values, lost responses, errors), played on a
durable journal and on the in-memory store: no effect twice, the same answers, a log that verifies."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from guard.effect_guard import InMemoryEffectStore
from journal import SQLiteJournal
from journal.testing import CallStep, call_ids, call_sequences, play

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def answers(results: list[Any]) -> list[Any]:
    """What a caller can tell apart: a value, a refusal's code, an exception's type."""
    shown = []
    for r in results:
        if isinstance(r, Exception):
            shown.append(("raised", type(r).__name__))
        elif isinstance(r, dict) and r.get("status") == "blocked":
            shown.append(("refused", r["block_reason"]))
        else:
            shown.append(("value", r))
    return shown


def check_sequence(steps: list[CallStep], journal: Any) -> None:
    durable = play(steps, journal)
    model = play(steps, InMemoryEffectStore())
    assert durable.double_effects() == {}
    assert answers(durable.results) == answers(model.results)
    assert durable.effects == model.effects
    report = journal.verify()
    assert report.ok, report.problem
    for step, result in zip(steps, durable.results, strict=True):
        if not isinstance(result, Exception) and not (isinstance(result, dict) and result.get("status")):
            # A value is the first value that call id returned, unless it is a reversible re-run.
            first = durable.first_values[step.call_id]
            assert result == first or step.tool == "quote"


@SETTINGS
@given(steps=call_sequences(max_calls=20))
def test_sqlite_sequences_run_each_effect_at_most_once(steps: list[CallStep]) -> None:
    with tempfile.TemporaryDirectory() as tmp, SQLiteJournal(Path(tmp) / "j.db", durability="process") as journal:
        check_sequence(steps, journal)


@pytest.mark.postgres
def test_postgres_sequences_run_each_effect_at_most_once() -> None:
    from journal.postgres import PostgresJournal
    from tests.pgserver import fresh_schema, require_server

    require_server()

    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(steps=call_sequences(max_calls=15, ids=call_ids(nul=False)))
    def run(steps: list[CallStep]) -> None:
        with PostgresJournal(fresh_schema(), pool_size=1) as journal:
            check_sequence(steps, journal)

    run()
