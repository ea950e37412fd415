"""benchmarks/compare.py stops, printing no figures, when a system does not do what its row says."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compare

from guard.effect_guard import InMemoryEffectStore
from journal import SQLiteJournal


def unguarded(name: str) -> compare.System:
    ran = [0]
    tool = compare.make_tool(ran)
    return compare.System(name, "-", lambda call_id: tool("acct_1", 500), ran, synced=False)


def keyed_on_arguments_only() -> compare.System:
    """Replays whatever was stored for the arguments, whatever the id: the id is not in the key."""
    ran = [0]
    tool = compare.make_tool(ran)
    stored: dict[str, Any] = {}

    def call(call_id: str) -> Any:
        if "acct_1" not in stored:
            stored["acct_1"] = tool("acct_1", 500)
        return stored["acct_1"]

    return compare.System("keyed on arguments", "-", call, ran, synced=False)


def test_this_projects_stores_pass_the_checks(tmp_path: Path) -> None:
    for system in (
        compare.ours("memory", "-", InMemoryEffectStore(), synced=False),
        compare.ours("sqlite", "-", SQLiteJournal(tmp_path / "j.db", durability="process"), synced=False),
        compare.floor(tmp_path / "floor.db", "FULL", 1),
    ):
        compare.check(system, "run")


def test_a_system_that_runs_the_tool_on_a_replay_stops_the_run() -> None:
    with pytest.raises(compare.Misconfigured, match="a replay ran the tool again"):
        compare.check(unguarded("no guard"), "run")


def test_a_system_whose_key_ignores_the_id_stops_the_run() -> None:
    with pytest.raises(compare.Misconfigured, match="the id is not part of the key"):
        compare.check(keyed_on_arguments_only(), "run")


def test_a_sqlite_file_at_another_synchronous_level_stops_the_run(tmp_path: Path) -> None:
    system = compare.floor(tmp_path / "floor.db", "FULL", 1)
    assert system.check_sqlite is not None
    conn: sqlite3.Connection = system.check_sqlite[0]
    conn.execute("PRAGMA synchronous = NORMAL")
    with pytest.raises(compare.Misconfigured, match="synchronous=NORMAL, not wal and FULL"):
        compare.check(system, "run")
