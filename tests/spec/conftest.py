"""The fixtures every section's tests share: a journal file's path, and a SQLiteJournal on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from journal import SQLiteJournal
from tests.spec.support import close


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "journal.db"


@pytest.fixture
def journal(db: Path) -> Iterator[Any]:
    j = SQLiteJournal(str(db))
    try:
        yield j
    finally:
        close(j)
