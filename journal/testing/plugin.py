"""The pytest fixtures of ``journal.testing`` (a plugin through the ``pytest11`` entry point)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .effects import EffectLog

if TYPE_CHECKING:
    from journal.sqlite import SQLiteJournal

__all__ = ["airlock_effects", "airlock_journal", "airlock_journal_path"]


@pytest.fixture
def airlock_journal_path(tmp_path: Path) -> Path:
    """Where :func:`airlock_journal` keeps its file (a fresh path in the test's ``tmp_path``)."""
    return tmp_path / "airlock-journal.db"


@pytest.fixture
def airlock_journal(airlock_journal_path: Path) -> Iterator[SQLiteJournal]:
    """A fresh, empty :class:`~journal.SQLiteJournal` for one test, closed after it.

    Opened with ``durability="process"``: it survives the test's processes being killed, and a
    test does not pay an fsync per call.
    """
    from journal.sqlite import SQLiteJournal

    journal = SQLiteJournal(airlock_journal_path, durability="process")
    try:
        yield journal
    finally:
        journal.close()


@pytest.fixture
def airlock_effects(tmp_path: Path) -> EffectLog:
    """An empty :class:`EffectLog` in the test's ``tmp_path``: a tool records its effect there."""
    return EffectLog(tmp_path / "airlock-effects.jsonl")
