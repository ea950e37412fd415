"""``journal.Journal``: the operator API both stores implement and ``open_journal`` returns.

mypy checks the signatures (journal/protocol.py); these tests check the same at run time, on the
journals ``open_journal`` really opens, so that a method added to one store's operator API and not
to the other, or to the stores and not to the protocol the CLI is typed against, is found."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from journal import Journal, SQLiteJournal, open_journal
from journal.protocol import EventImporter

# Public methods both stores have that the operator does not call: how the stores read their rows
# (``Journal.events`` is the operator's form of it), and the guard's lookup for re-planned copies
# (optional for a store, see guard/duplicates.py).
NOT_OPERATOR_API = {"event_rows", "recent_call"}


def protocol_methods() -> dict[str, inspect.Signature]:
    names = {name for cls in Journal.__mro__ if cls not in (object,) for name in vars(cls)
             if callable(getattr(Journal, name, None)) and (not name.startswith("_") or name in ("__enter__",
                                                                                                "__exit__"))}
    return {name: inspect.signature(getattr(Journal, name)) for name in sorted(names)}


def store_classes() -> list[type[Any]]:
    from journal.postgres import PostgresJournal

    return [SQLiteJournal, PostgresJournal]


def accepts(method: inspect.Signature, wanted: inspect.Signature) -> str | None:
    """Why ``method`` cannot be called as ``wanted`` is (a parameter missing, of another kind or
    default), or None."""
    params = method.parameters
    if any(p.kind is p.VAR_POSITIONAL for p in wanted.parameters.values()):
        return None if any(p.kind is p.VAR_POSITIONAL for p in params.values()) else "takes no *args"
    for name, param in wanted.parameters.items():
        if name not in params:
            return f"has no parameter {name!r}"
        if params[name].kind is not param.kind:
            return f"takes {name!r} as {params[name].kind.description}, not {param.kind.description}"
        if params[name].default != param.default:
            return f"defaults {name!r} to {params[name].default!r}, not {param.default!r}"
    extra = [n for n, p in params.items() if n not in wanted.parameters and p.default is p.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return f"requires {extra} beyond the protocol" if extra else None


@pytest.mark.parametrize("method", sorted(protocol_methods()))
def test_every_store_implements_the_protocols_method_as_it_is_declared(method: str) -> None:
    wanted = protocol_methods()[method]
    for store in store_classes():
        implemented = getattr(store, method, None)
        assert callable(implemented), f"{store.__name__} has no {method}"
        problem = accepts(inspect.signature(implemented), wanted)
        assert problem is None, f"{store.__name__}.{method} {problem}"


def test_what_both_stores_offer_the_operator_is_in_the_protocol() -> None:
    def public(cls: type[Any]) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name))}

    shared = set.intersection(*(public(store) for store in store_classes()))
    missing = shared - set(protocol_methods()) - NOT_OPERATOR_API
    assert not missing, f"add to journal.protocol.Journal (or to NOT_OPERATOR_API here): {sorted(missing)}"


def test_open_journal_gives_a_sqlite_journal_that_is_a_journal(tmp_path: Path) -> None:
    with open_journal(str(tmp_path / "j.db")) as j:
        assert isinstance(j, SQLiteJournal) and isinstance(j, Journal)
        assert j.head()[0] == 0 and j.calls() == [] and j.verify().ok


@pytest.mark.postgres
def test_open_journal_gives_a_postgres_journal_that_is_a_journal_and_takes_imports(pg_dsn: str) -> None:
    with open_journal(pg_dsn) as j:
        assert type(j).__name__ == "PostgresJournal"
        assert isinstance(j, Journal) and isinstance(j, EventImporter)
        assert j.head()[0] == 0 and j.calls() == [] and j.verify().ok


def test_a_journal_is_an_effect_store() -> None:
    from guard.store import EffectStore

    assert issubclass(Journal, EffectStore)
    assert {"begin", "append", "get"} <= set(protocol_methods())
