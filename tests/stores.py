"""The stores every contract test runs on: add a factory here and a new store gets every test.

A factory takes pytest's ``tmp_path`` and returns a fresh, empty store; ``closer`` (optional)
releases it after the test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from guard.effect_guard import InMemoryEffectStore

StoreFactory = Callable[[Path], Any]


def memory_store(tmp_path: Path) -> Any:
    return InMemoryEffectStore()


def sqlite_store(tmp_path: Path) -> Any:
    from journal import SQLiteJournal

    return SQLiteJournal(tmp_path / "j.db")


def postgres_store(tmp_path: Path) -> Any:
    # A fresh schema on the session's throwaway server (skipped without PostgreSQL, failed under CI).
    from journal.postgres import PostgresJournal
    from tests.pgserver import fresh_schema

    return PostgresJournal(fresh_schema(), pool_size=4)


def contended(journal: Any) -> Any:
    """``journal`` (a PostgreSQL one) with every write made the way it is while other replicas
    write too: its event waits in the inbox for another session's seal, the call's projection row
    naming it until then. Raises ``AttributeError`` for a journal without that way, rather than
    leave its writes as they were."""
    from journal.postgres.writes import QUEUE

    writes = journal.writes
    if not hasattr(writes, "seal_mode"):
        raise AttributeError(f"{journal!r} has no contended way to write (no writes.seal_mode)")
    writes.seal_mode = QUEUE
    return journal


def postgres_contended_store(tmp_path: Path) -> Any:
    return contended(postgres_store(tmp_path))


def guide_store(tmp_path: Path) -> Any:
    # The example of docs/custom-store.md, taken from the page itself, so the guide stays true.
    page = (Path(__file__).resolve().parents[1] / "docs" / "custom-store.md").read_text()
    example = page.split("## An example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(example, "docs/custom-store.md", "exec"), namespace)
    return namespace["JsonLinesStore"](tmp_path / "effects.jsonl")


# name -> factory; the journal modules add theirs below.
STORE_FACTORIES: dict[str, StoreFactory] = {
    "memory": memory_store,
    "sqlite": sqlite_store,
    "postgres": postgres_store,
    "postgres-contended": postgres_contended_store,
    "guide": guide_store,
}


def store_events(store: Any, call_id: str | None = None) -> list[Any]:
    """The store's log in seq order (objects with at least seq, kind, call_id, tool, attempt, reason)."""
    return list(store.events(call_id=call_id))


def close_store(store: Any) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        close()
