"""The benchmark scripts run and print their figures: thread_ceiling.py (whose model records what the
journal records), journal_bench.py, postgres_bench.py and projection_check_bench.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import thread_ceiling

from journal import SQLiteJournal

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "thread_ceiling.py"


def test_the_model_writes_the_journal_tables_a_journal_can_read(tmp_path: Path) -> None:
    model = thread_ceiling.Model(tmp_path / "model.db", fsync=True)
    thread_ceiling.rate(model.call, 4, 40)
    model.conn.close()
    with SQLiteJournal(tmp_path / "model.db", readonly=True) as journal:
        calls = journal.calls(limit=None)
        assert len(calls) == 40 and {c.status for c in calls} == {"committed"}
        assert journal.count_events() == 80  # a pending and a committed a call


def test_the_script_prints_the_bound_and_the_journal(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--rounds", "1", "--calls", "16",
                             "--warmup", "0", "--threads", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-2].startswith("the bound for 2 threads at full") and lines[-2].endswith("x")
    assert lines[-1].startswith("the journal at full, 2 threads / one: ")
    assert list(tmp_path.iterdir()) == []  # its files are gone


def test_a_bad_size_is_a_usage_error(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--threads", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--threads is a number, 1 or more" in result.stderr


def test_journal_bench_prints_the_floors_the_calls_and_the_tables_alone(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "journal_bench.py"), "--dir", str(tmp_path),
                             "--calls", "16", "--rounds", "1", "--warmup", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("floor: raw txn, synchronous=FULL", "fresh call, durability=full", "replay, durability=process",
                  "  one transaction, NORMAL", "  fresh call at process "):
        assert label in out
    assert out.splitlines()[-1].endswith("the NORMAL floor)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.postgres
def test_postgres_bench_prints_the_ratios_and_the_fsync_the_target_needs(pg_dsn: str) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "postgres_bench.py"), "--dsn", pg_dsn,
                             "--calls", "10", "--rounds", "1", "--procs", "2", "--seconds", "0.5"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("(the floor)", "committed without waiting for the flush", "fresh guarded call / floor:",
                  "the floor's wait for its fsync", "guarded fresh calls (2 transactions each)"):
        assert label in out
    line = next(x for x in out.splitlines() if "a fresh call is within 2x of the floor" in x)
    assert "whatever" in line or float(line.split("takes ")[1].split(" ms")[0]) > 0


def test_projection_check_bench_prints_the_ratio_of_each_path() -> None:
    # It times the journal's write statement with the log lookup and with the lookup taken out of
    # it: a statement that no longer holds the lookup stops it before it prints a figure.
    result = subprocess.run([sys.executable, str(BENCHMARKS / "projection_check_bench.py"), "--calls", "20",
                             "--rounds", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert [(row[0], row[1]) for row in rows] == [("process", "fresh"), ("process", "replay"), ("full", "fresh"),
                                                  ("full", "replay")]
    assert all(row[-1].endswith("x") and float(row[-1][:-1]) > 0 for row in rows)
