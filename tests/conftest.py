from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pgserver import _pg_shutdown, pg_dsn, pg_server  # noqa: F401  (the PostgreSQL fixtures)
from tests.stores import STORE_FACTORIES, close_store


@pytest.fixture(params=sorted(STORE_FACTORIES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A fresh, empty EffectStore: every store in tests/stores.py in turn."""
    made = STORE_FACTORIES[request.param](tmp_path)
    try:
        yield made
    finally:
        close_store(made)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def seeded_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A journal seeded by ``tests.cli_support.seed_into``, named as ``--db`` takes it: a SQLite
    file, or a PostgreSQL database."""
    from tests.cli_support import seed, seed_into

    if request.param == "sqlite":
        path = tmp_path / "journal.db"
        seed(path)
        yield str(path)
        return
    dsn: str = request.getfixturevalue("pg_dsn")
    from journal.postgres import PostgresJournal

    with PostgresJournal(dsn) as journal:
        seed_into(journal)
    yield dsn
