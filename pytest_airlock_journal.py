"""The pytest plugin of airlock-journal (entry point ``pytest11``, name ``airlock_journal``).

Installed with the distribution, it is loaded in every pytest run of the environment, so it imports
nothing of airlock (``guard``, ``journal``, ``cli``) until a test asks for one of its fixtures: a
project with a package of its own named ``journal``, ``guard`` or ``cli`` keeps it. Switch it off with
``pytest -p no:airlock_journal``. The fixtures are documented in ``journal.testing``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from journal.sqlite import SQLiteJournal
    from journal.testing.effects import EffectLog

__all__ = ["airlock_effects", "airlock_journal", "airlock_journal_path"]


def _airlock_module(name: str) -> ModuleType:
    """Import ``name`` of airlock-journal, or fail the test saying which package holds that import name."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = name.partition(".")[0]
        taken = getattr(sys.modules.get(top), "__file__", None)
        missing = e.name or ""
        # Another package took the name when a module of ours is missing from it (not a dependency).
        if taken is None or not missing.startswith(f"{top}.") or not f"{name}.".startswith(f"{missing}."):
            raise
        pytest.fail(
            f"airlock's fixtures need its package {top!r}, but in this test run that import name is {taken} "
            f"({e}); see 'Import names' in airlock-journal's docs/testing.md",
            pytrace=False,
        )


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
    sqlite = _airlock_module("journal.sqlite")
    journal: SQLiteJournal = sqlite.SQLiteJournal(airlock_journal_path, durability="process")
    try:
        yield journal
    finally:
        journal.close()


@pytest.fixture
def airlock_effects(tmp_path: Path) -> EffectLog:
    """An empty :class:`~journal.testing.EffectLog` in the test's ``tmp_path``: a tool records its effect there."""
    effects = _airlock_module("journal.testing.effects")
    log: EffectLog = effects.EffectLog(tmp_path / "airlock-effects.jsonl")
    return log
