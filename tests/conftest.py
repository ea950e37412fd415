from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from journal import Journal
from tests.journals import JOURNAL_PARAMS, Database, JournalFactory, journal_factory
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


@pytest.fixture(params=JOURNAL_PARAMS)
def journal_kind(request: pytest.FixtureRequest) -> JournalFactory:
    """Every journal store of tests/journals.py in turn, what it needs of the session set up."""
    return journal_factory(request)


@pytest.fixture
def journal_target(journal_kind: JournalFactory, tmp_path: Path) -> str:
    """Where a fresh journal of ``journal_kind`` goes, as ``open_journal`` and ``--db`` take it;
    nothing is made there yet."""
    return journal_kind.target(tmp_path)


@pytest.fixture
def journal(journal_kind: JournalFactory, journal_target: str) -> Iterator[Journal]:
    """A fresh, empty journal at ``journal_target``: every journal store in turn."""
    made = journal_kind.open(journal_target)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def journal_database(journal_kind: JournalFactory, journal_target: str) -> Database:
    """The database under the journal at ``journal_target``, for plain SQL."""
    return journal_kind.database(journal_target)


@pytest.fixture
def seeded_db(journal_kind: JournalFactory, tmp_path: Path) -> str:
    """A journal of its own (a database of its own, on a server) seeded by
    ``tests.cli_support.seed_into``, named as ``--db`` takes it."""
    from tests.cli_support import seed_into

    target = journal_kind.target(tmp_path, own_database=True)
    with journal_kind.open(target) as journal:
        seed_into(journal)
    return target
