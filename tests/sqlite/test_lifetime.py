"""A journal nobody closed is freed, its connection with it, as soon as its last reference goes."""

from __future__ import annotations

import gc
import sqlite3
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard.store import EffectEvent
from journal import SQLiteJournal


@pytest.fixture
def no_collector() -> Iterator[None]:
    # Only reference counting frees anything meanwhile: a cycle among the journal's parts would keep
    # the journal, its connection and its file's locks until the collector happened to run.
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def test_an_unclosed_journal_is_freed_when_its_last_reference_goes(tmp_path: Path, no_collector: None) -> None:
    path = tmp_path / "j.db"
    journal = SQLiteJournal(path, durability="full")
    journal.append(EffectEvent("refused", "call-0", "charge"))
    journal.take_lease("call-0", "holder", 30.0)
    assert [event.kind for event in journal.events()] == ["refused"]
    assert journal.verify().ok
    assert journal.reconcile({}) == []
    assert journal.stats().events == 1

    freed, datastore = weakref.ref(journal), weakref.ref(journal.datastore)
    del journal
    assert freed() is None
    assert datastore() is None
    # Its connection went with it: nothing holds the file, and another may take its write lock at once.
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    conn.execute("ROLLBACK")
    conn.close()
