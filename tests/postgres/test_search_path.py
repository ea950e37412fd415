"""Where a PostgreSQL journal lives: the first schema of the search_path, never a later one. A first
schema that does not exist, or that the login may not use, is refused at open; PostgreSQL's own
current_schema() would skip it, and replicas could then split over two journals."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import JournalError, JournalNotFound
from journal.postgres import PostgresJournal
from tests.pgserver import PgServer

pytestmark = pytest.mark.postgres


def with_path(dsn: str, search_path: str, role: str | None = None) -> str:
    scheme, rest = dsn.split("://", 1)
    if role is not None:
        rest = f"{role}@{rest.split('@', 1)[1]}"
    escaped = search_path.replace("\\", "\\\\").replace(" ", "\\ ")  # libpq splits options at spaces
    return f"{scheme}://{rest}?options={quote(f'-csearch_path={escaped}')}"


def admin(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement.encode())


def journal_schemas(dsn: str) -> list[str]:
    """The schemas that hold a journal's tables."""
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(
            "SELECT schemaname FROM pg_tables WHERE tablename = 'events' ORDER BY 1").fetchall()]


@pytest.fixture
def role(pg_server: PgServer, pg_dsn: str) -> Iterator[str]:
    """A login of its own in the test's database (roles belong to the cluster): dropped afterwards."""
    name = f"airlock_replica_{uuid.uuid4().hex[:8]}"
    admin(pg_server.dsn, f"CREATE ROLE {name} LOGIN")
    yield name
    admin(pg_dsn, f"DROP OWNED BY {name}")  # its grants and tables
    admin(pg_server.dsn, f"DROP ROLE {name}")


def test_a_first_schema_that_does_not_exist_is_journal_not_found(pg_dsn: str) -> None:
    for create in (True, False):
        with pytest.raises(JournalNotFound, match=r"schema airlock, the first of its search_path, does not exist"):
            PostgresJournal(with_path(pg_dsn, "airlock,public"), create=create)
    assert journal_schemas(pg_dsn) == []  # not made in public, the next schema of the path


def test_a_first_schema_the_login_may_not_use_is_refused(pg_dsn: str, role: str) -> None:
    # Replica A's login may use the schema airlock; replica B's was not granted USAGE on it, but may
    # create in public (every login's default before PostgreSQL 15).
    admin(pg_dsn, "CREATE SCHEMA airlock", f"GRANT CREATE ON SCHEMA public TO {role}")
    effects: list[str] = []

    def pay(journal: PostgresJournal, replica: str) -> Any:
        @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
        def charge(account: str, cents: int) -> dict[str, int]:
            effects.append(replica)
            return {"paid": cents}

        with AirlockContext(metadata={"tool_call_id": "call-1"}):
            return charge("acct", 500)

    with PostgresJournal(with_path(pg_dsn, "airlock,public")) as a:
        assert pay(a, "A") == {"paid": 500}
    with pytest.raises(JournalError, match=rf"login {role} lacks USAGE on the schema airlock") as info:
        PostgresJournal(with_path(pg_dsn, "airlock,public", role=role))
    assert not isinstance(info.value, JournalNotFound)  # it exists: only this login may not use it
    assert journal_schemas(pg_dsn) == ["airlock"]
    assert effects == ["A"]


def test_a_schema_that_becomes_unusable_later_is_never_left_for_the_next(pg_dsn: str, role: str) -> None:
    # The login's journal is in airlock; public holds another journal it may write to as well.
    admin(pg_dsn, "CREATE SCHEMA airlock", f"GRANT USAGE, CREATE ON SCHEMA airlock TO {role}")
    PostgresJournal(pg_dsn).close()
    admin(pg_dsn, f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
    effects: list[str] = []
    journal = PostgresJournal(with_path(pg_dsn, "airlock,public", role=role))

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(account: str, cents: int) -> dict[str, int]:
        effects.append(account)
        return {"paid": cents}

    try:
        with AirlockContext(metadata={"tool_call_id": "call-1"}):
            assert charge("acct", 500) == {"paid": 500}
        admin(pg_dsn, f"REVOKE USAGE ON SCHEMA airlock FROM {role}")
        with AirlockContext(metadata={"tool_call_id": "call-1"}):  # retried: refused, never run again
            refusal: Any = charge("acct", 500)  # the guard's refusal, not the tool's value
        assert refusal["block_reason"] == "store_unavailable"
    finally:
        journal.close()
    assert effects == ["acct"]
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM public.events").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM airlock.events").fetchone() == (2,)


@pytest.mark.parametrize(("search_path", "schema"), [
    (None, "public"),  # the server's default, "$user", public: no schema is named after the login
    ('"$user", public', "public"),
    ("$user,public", "public"),
    ("  AirLock ,public", "airlock"),  # unquoted: folded to lower case, as PostgreSQL does
    ('"Air ""Lock""", public', 'Air "Lock"'),
])
def test_the_journal_lives_in_the_first_schema_of_the_search_path(
        pg_dsn: str, search_path: str | None, schema: str) -> None:
    admin(pg_dsn, "CREATE SCHEMA airlock", 'CREATE SCHEMA "Air ""Lock"""')
    dsn = pg_dsn if search_path is None else with_path(pg_dsn, search_path)
    with PostgresJournal(dsn) as journal:
        assert journal.head()[0] == 0
    assert journal_schemas(pg_dsn) == [schema]
    with PostgresJournal(dsn, readonly=True) as journal:  # and it is found there again
        assert journal.verify().ok


def test_a_schema_named_after_the_login_comes_first(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        login = str((conn.execute("SELECT current_user").fetchone() or ("",))[0])
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(login)))
    PostgresJournal(pg_dsn).close()
    assert journal_schemas(pg_dsn) == [login]
