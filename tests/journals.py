"""The journals every journal test runs on: add a factory here and a new journal store gets every
test that takes the ``journal`` fixture of tests/conftest.py (or ``journal_kind``, or ``seeded_db``),
the operator contract of tests/test_journal_contract.py first.

A factory says where a fresh journal of its store goes (a target, as ``open_journal`` and ``--db``
take it), how to open one there, what of the test session it needs and the marks its tests carry,
and how to reach the database under it with the driver's own connection (as an intruder or a
careless operator would), for the tests that change a journal behind its back.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import pytest

from journal import Journal, SQLiteJournal


class Database(Protocol):
    """The database under a journal, reached with its driver's own connection."""

    @property
    def target(self) -> str:
        """What ``open_journal`` and ``--db`` take for the journal."""
        ...

    @property
    def append_only_error(self) -> type[Exception]:
        """The driver's error for a statement the database refuses on an integrity rule."""
        ...

    @property
    def lift_append_only(self) -> str:
        """The statement that lets events be changed (as only an owner of the tables can)."""
        ...

    def execute(self, statement: str, params: tuple[Any, ...] = ()) -> int:
        """Run one statement (``?`` for each of ``params``) in its own transaction; how many rows it changed."""
        ...

    def rows(self, statement: str) -> list[tuple[Any, ...]]:
        """The rows a query reads."""
        ...

    def write_lock(self) -> AbstractContextManager[None]:
        """The journal's write lock, taken by another connection and held for the ``with`` block."""
        ...

    def remains(self) -> list[str]:
        """What is at the target: the files of a store kept in files, the tables and functions of one
        kept in a database. Nothing, where no journal was made or a failed one was taken away."""
        ...


@dataclass(frozen=True)
class SQLiteDatabase:
    """A journal's SQLite file, through ``sqlite3``."""

    target: str
    append_only_error: ClassVar[type[Exception]] = sqlite3.IntegrityError
    lift_append_only: ClassVar[str] = "DROP TRIGGER events_no_update"

    def execute(self, statement: str, params: tuple[Any, ...] = ()) -> int:
        conn = sqlite3.connect(self.target, isolation_level=None)
        try:
            return conn.execute(statement, params).rowcount
        finally:
            conn.close()

    def rows(self, statement: str) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(f"file:{self.target}?mode=ro", uri=True)
        try:
            return list(conn.execute(statement))
        finally:
            conn.close()

    @contextmanager
    def write_lock(self) -> Iterator[None]:
        conn = sqlite3.connect(self.target, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield
            conn.execute("ROLLBACK")
        finally:
            conn.close()

    def remains(self) -> list[str]:
        path = Path(self.target)
        return sorted(p.name for p in path.parent.glob(f"{path.name}*"))  # the file, its -wal, its -shm


@dataclass(frozen=True)
class PostgresDatabase:
    """A journal's PostgreSQL schema or database, through ``psycopg``."""

    target: str
    lift_append_only: ClassVar[str] = "ALTER TABLE events DISABLE TRIGGER events_append_only"

    @property
    def append_only_error(self) -> type[Exception]:
        import psycopg

        return psycopg.errors.IntegrityConstraintViolation

    def execute(self, statement: str, params: tuple[Any, ...] = ()) -> int:
        import psycopg

        with psycopg.connect(self.target, autocommit=True) as pg:
            return pg.execute(statement.replace("?", "%s") if params else statement, params).rowcount

    def rows(self, statement: str) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.target, autocommit=True) as pg:
            return list(pg.execute(statement))

    @contextmanager
    def write_lock(self) -> Iterator[None]:
        import psycopg

        with psycopg.connect(self.target) as conn:
            # The head's row and the inbox, as rebuild, archive and copy hold them: appends wait.
            conn.execute("SELECT seq FROM chain_head WHERE id = 1 FOR UPDATE")
            conn.execute("LOCK TABLE inbox IN EXCLUSIVE MODE")
            yield
            conn.rollback()

    def remains(self) -> list[str]:
        return [name for (name,) in self.rows(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() UNION ALL "
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = current_schema() ORDER BY 1")]


class Place(Protocol):
    """Where a fresh, empty journal goes, nothing made there yet: in ``tmp_path`` as ``name`` for a
    store kept in a file; ``own_database`` asks for a database of its own, for a store that
    otherwise keeps each test's journal apart in a shared one."""

    def __call__(self, tmp_path: Path, name: str = "journal.db", *, own_database: bool = False) -> str: ...


@dataclass(frozen=True)
class JournalFactory:
    """One journal store, as the tests make and reach its journals."""

    target: Place
    """Where a fresh journal goes: the target ``open``, ``open_journal`` and ``--db`` take."""
    open: Callable[..., Journal]
    """``(target, **options)``: the journal at ``target``, ``options`` going to its constructor."""
    database: Callable[[str], Database]
    """The database under the journal at a target."""
    marks: tuple[pytest.MarkDecorator, ...] = ()
    needs: tuple[str, ...] = ()
    """The session's fixtures its journals need (a test without them is skipped, or failed under CI)."""
    quick: Mapping[str, Any] = field(default_factory=dict)
    """Constructor options for a test of many calls that is not about surviving a power cut."""
    verifies_in_parts: bool = False
    """Whether ``verify(parts=n)`` checks the journal in parts, as SQLite does a journal too large for one pass."""
    holds_nul: bool = True
    """Whether its text holds NUL (PostgreSQL's text does not: such an id is refused before anything runs)."""
    disarm: Callable[[str], None] = lambda target: None
    """Take away what a kill point of ``journal.testing`` leaves in the journal at a target when its
    process dies at it (PostgreSQL's trigger; SQLite's point lives in the process and dies with it)."""


def _sqlite_target(tmp_path: Path, name: str = "journal.db", *, own_database: bool = False) -> str:
    return str(tmp_path / name)


def _postgres_target(tmp_path: Path, name: str = "journal.db", *, own_database: bool = False) -> str:
    # A fresh schema on the session's throwaway server, or a fresh database when asked for one.
    from tests.pgserver import fresh_database, fresh_schema

    return fresh_database() if own_database else fresh_schema()


def _disarm_postgres(target: str) -> None:
    from journal.testing import remove_postgres_kill_point

    remove_postgres_kill_point(target)


def _open_postgres(target: str, **options: Any) -> Journal:
    from journal.postgres import PostgresJournal

    return PostgresJournal(target, **{"pool_size": 4, **options})


# name -> factory, in the order their tests run.
JOURNAL_FACTORIES: dict[str, JournalFactory] = {
    "sqlite": JournalFactory(
        target=_sqlite_target, open=SQLiteJournal, database=SQLiteDatabase, quick={"durability": "process"},
        verifies_in_parts=True,
    ),
    "postgres": JournalFactory(
        target=_postgres_target, open=_open_postgres, database=PostgresDatabase, marks=(pytest.mark.postgres,),
        needs=("pg_server",), holds_nul=False, disarm=_disarm_postgres,
    ),
}

# The parameters of a fixture that runs on every journal store: each store's name, with its marks.
JOURNAL_PARAMS = [pytest.param(name, marks=made.marks, id=name) for name, made in JOURNAL_FACTORIES.items()]


def journal_factory(request: pytest.FixtureRequest, name: str | None = None) -> JournalFactory:
    """The factory named ``name`` (by default the fixture's parameter), with what it needs of the
    session set up first."""
    made = JOURNAL_FACTORIES[request.param if name is None else name]
    for fixture in made.needs:
        request.getfixturevalue(fixture)
    return made
