"""``airlock journal stats --format prometheus``, read back by prometheus_client's own parser of the
text format, on SQLite and on PostgreSQL."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.prometheus import JournalGauges, escape_label, render_gauges
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from guard.store import utc_now
from journal import SQLiteJournal
from journal.copy import copy_journal
from tests.cli_support import digest, invoke, leave_pending, pending_with_live_owner, run_airlock, seed

FAMILIES = ["airlock_calls", "airlock_events", "airlock_calls_in_doubt", "airlock_oldest_in_doubt_age_seconds",
            "airlock_approvals_open", "airlock_oldest_open_approval_age_seconds"]


def parsed(text: str) -> dict[str, Any]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert list(families) == FAMILIES
    for family in families.values():
        assert family.type == "gauge" and family.documentation
    return families


def calls_of(families: dict[str, Any]) -> dict[tuple[str, str], float]:
    return {(s.labels["status"], s.labels["tool"]): s.value for s in families["airlock_calls"].samples}


def value(families: dict[str, Any], name: str) -> float:
    (sample,) = families[name].samples
    assert sample.labels == {}
    return float(sample.value)


def stats(db: str) -> str:
    result = invoke("journal", "stats", "--format", "prometheus", "--db", db)
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


@pytest.fixture
def seeded(tmp_path: Path) -> Path:
    """A journal with one call of each status; call-timeout unknown, call-dead pending, its owner gone."""
    path = tmp_path / "j.db"
    seed(path)
    leave_pending(path, "call-dead")
    return path


def test_each_family_has_help_and_type_and_the_counts_of_the_journal(seeded: Path) -> None:
    text = stats(str(seeded))
    for name in FAMILIES:
        assert f"# HELP {name} " in text and f"# TYPE {name} gauge\n" in text
    families = parsed(text)
    assert calls_of(families) == {
        ("committed", "charge"): 1, ("pending", "charge"): 1, ("unknown", "charge"): 1, ("released", "charge"): 1,
        ("committed", "read_balance"): 1, ("pending", "read_balance"): 0, ("unknown", "read_balance"): 0,
        ("released", "read_balance"): 0,
    }
    with SQLiteJournal(seeded, readonly=True) as journal:
        assert value(families, "airlock_events") == journal.count_events() == 12
    assert value(families, "airlock_calls_in_doubt") == 2  # call-timeout (unknown) and call-dead (pending, gone)


def test_the_oldest_in_doubt_age_is_from_the_status_of_the_oldest_such_call(seeded: Path) -> None:
    with SQLiteJournal(seeded, readonly=True) as journal:
        timeout, dead = journal.call("call-timeout"), journal.call("call-dead")
    assert timeout is not None and dead is not None
    oldest = min(timeout.since, dead.since)
    before = utc_now()
    age = value(parsed(stats(str(seeded))), "airlock_oldest_in_doubt_age_seconds")
    after = utc_now()
    # Printed to the millisecond, from a clock read between these two.
    assert (before - oldest).total_seconds() - 0.001 <= age <= (after - oldest).total_seconds() + 0.001


def test_a_pending_call_whose_owner_runs_is_not_in_doubt(tmp_path: Path) -> None:
    path = tmp_path / "live.db"
    seed(path)
    with pending_with_live_owner(path, "call-running"):
        families = parsed(stats(str(path)))
        assert calls_of(families)[("pending", "charge")] == 1
        assert value(families, "airlock_calls_in_doubt") == 1  # call-timeout only
    leave_pending(path, "call-dead")
    assert value(parsed(stats(str(path))), "airlock_calls_in_doubt") == 2


def test_nothing_in_doubt_is_zero_and_zero_seconds(tmp_path: Path) -> None:
    path = tmp_path / "calm.db"
    with SQLiteJournal(path) as journal:
        policy = SecurityPolicy(effect_guard=EffectGuard(store=journal))

        @Airlock(policy=policy)
        def charge(account: str, cents: int) -> int:
            return cents

        with AirlockContext(metadata={"tool_call_id": "c1"}):
            charge("acct_1", 5)
    families = parsed(stats(str(path)))
    assert calls_of(families)[("committed", "charge")] == 1
    assert value(families, "airlock_calls_in_doubt") == 0
    assert value(families, "airlock_oldest_in_doubt_age_seconds") == 0


def test_an_empty_journal_still_has_every_family(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    SQLiteJournal(path).close()
    families = parsed(stats(str(path)))
    assert families["airlock_calls"].samples == []
    assert value(families, "airlock_events") == 0 and value(families, "airlock_calls_in_doubt") == 0


@pytest.mark.parametrize("tool", ['say "hi"', "back\\slash", "two\nlines", "naïve ☃", 'all \\ of "them"\n'])
def test_a_tool_name_comes_back_whole_from_its_escaped_label(tmp_path: Path, tool: str) -> None:
    path = tmp_path / "odd.db"
    with SQLiteJournal(path) as journal:

        def fn(account: str) -> str:
            if account == "lost":
                raise TimeoutError("no answer")
            return account

        fn.__name__ = tool
        guarded = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))(fn)
        with AirlockContext(metadata={"tool_call_id": "c1"}):
            guarded("a")
        with AirlockContext(metadata={"tool_call_id": "c2"}), pytest.raises(TimeoutError):
            guarded("lost")
    text = stats(str(path))
    assert "\n" + f'airlock_calls{{status="committed",tool="{escape_label(tool)}"}} 1' + "\n" in text
    families = parsed(text)
    assert calls_of(families)[("committed", tool)] == 1 and calls_of(families)[("unknown", tool)] == 1
    assert value(families, "airlock_calls_in_doubt") == 1


def test_escape_label_follows_the_text_format() -> None:
    assert escape_label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    gauges = JournalGauges(calls={("committed", 'x"y'): 3}, events=7, in_doubt=1,
                           oldest_in_doubt=datetime.fromisoformat("2026-12-01T05:00:00+00:00"))
    text = render_gauges(gauges, now=datetime.fromisoformat("2026-12-01T05:01:30.5+00:00"))
    assert "\nairlock_oldest_in_doubt_age_seconds 90.500\n" in text and text.endswith("\n")
    assert 'airlock_calls{status="committed",tool="x\\"y"} 3\n' in text


def test_it_only_reads(seeded: Path) -> None:
    before = digest(seeded)
    stats(str(seeded))
    assert digest(seeded) == before


def test_json_and_prometheus_together_is_a_usage_error(seeded: Path) -> None:
    result = invoke("journal", "stats", "--format", "prometheus", "--json", "--db", str(seeded))
    assert result.exit_code == 2
    assert "--json and --format prometheus are two outputs: give one" in result.stderr
    assert result.stdout == ""


def test_an_unknown_format_is_a_usage_error(seeded: Path) -> None:
    result = invoke("journal", "stats", "--format", "openmetrics", "--db", str(seeded))
    assert result.exit_code == 2 and "'openmetrics' is not one of 'text', 'prometheus'" in result.stderr


def test_a_journal_that_does_not_exist_is_an_error_and_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "none.db"
    result = invoke("journal", "stats", "--format", "prometheus", "--db", str(path))
    assert result.exit_code == 1 and result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1
    assert result.stdout == "" and not path.exists()


def test_the_installed_command_writes_a_file_a_textfile_collector_reads(seeded: Path, tmp_path: Path) -> None:
    done = run_airlock("journal", "stats", "--format", "prometheus", "--db", str(seeded))
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n")
    assert value(parsed(done.stdout), "airlock_calls_in_doubt") == 2


@pytest.mark.postgres
def test_postgres_prints_the_same_gauges_as_sqlite(seeded: Path, pg_dsn: str) -> None:
    copy_journal(str(seeded), pg_dsn)
    on_sqlite, on_pg = parsed(stats(str(seeded))), parsed(stats(pg_dsn))
    assert calls_of(on_pg) == calls_of(on_sqlite)
    for name in ("airlock_events", "airlock_calls_in_doubt"):
        assert value(on_pg, name) == value(on_sqlite, name)
    assert value(on_pg, "airlock_calls_in_doubt") == 2
    assert value(on_pg, "airlock_oldest_in_doubt_age_seconds") > 0


@pytest.mark.postgres
def test_postgres_a_call_in_doubt_appears_and_settles(pg_dsn: str) -> None:
    from journal.postgres import PostgresJournal

    with PostgresJournal(pg_dsn) as journal:
        policy = SecurityPolicy(effect_guard=EffectGuard(store=journal))

        @Airlock(policy=policy)
        def wire(account: str) -> None:
            raise TimeoutError("the bank did not answer")

        with AirlockContext(metadata={"tool_call_id": "w1"}), pytest.raises(TimeoutError):
            wire("acct_1")
    families = parsed(stats(pg_dsn))
    assert calls_of(families) == {("committed", "wire"): 0, ("pending", "wire"): 0, ("unknown", "wire"): 1,
                                  ("released", "wire"): 0}
    assert value(families, "airlock_calls_in_doubt") == 1
    settled = invoke("journal", "resolve", "w1", "--not-applied", "--reason", "no transfer", "--operator", "ops",
                     "--db", pg_dsn)
    assert settled.exit_code == 0, settled.stderr
    families = parsed(stats(pg_dsn))
    assert calls_of(families)[("released", "wire")] == 1
    assert value(families, "airlock_calls_in_doubt") == 0
    assert value(families, "airlock_oldest_in_doubt_age_seconds") == 0
