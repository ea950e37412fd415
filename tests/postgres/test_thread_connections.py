"""PostgresJournal keeps a connection per thread for the guard's appends: each thread reuses its
own, gives it back when it ends and when the journal closes, never leaves the other threads without
one, and a forked child never touches the parent's."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal.postgres import PostgresJournal

pytestmark = pytest.mark.postgres

PATIENCE = 60.0  # how long a condition may take to come true on a loaded machine; never a measure


def guarded(journal: PostgresJournal, runs: list[int]) -> Callable[[str], Any]:
    lock = threading.Lock()

    def charge(cents: int) -> dict[str, int]:
        with lock:
            runs[0] += 1
        return {"cents": cents}

    tool = Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))(charge)

    def call(call_id: str) -> Any:
        with AirlockContext(agent_id="agent", metadata={"tool_call_id": call_id}):
            return tool(5)

    return call


def in_threads(count: int, work: Callable[[int], None]) -> None:
    failed: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(n: int) -> None:
        barrier.wait()
        try:
            work(n)
        except BaseException as e:
            failed.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed, failed


def sessions(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND application_name = 'airlock-journal' AND pid <> pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def eventually(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_thread_takes_a_connection_from_the_pool_once_for_many_calls(pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn, pool_size=4) as journal:
        runs = [0]
        call = guarded(journal, runs)
        call("warm")
        before = journal.datastore.pool.get_stats().get("requests_num", 0)
        for n in range(20):
            call(f"c{n}")
            call(f"c{n}")  # and its replay
        taken = journal.datastore.pool.get_stats().get("requests_num", 0) - before
        assert runs[0] == 21
        assert taken == 0  # 40 calls of 2 appends and 1 each, all on the connection the thread kept
        assert journal.verify().ok


def test_more_threads_than_the_pool_holds_all_get_through(pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn, pool_size=2, busy_timeout=PATIENCE) as journal:
        runs = [0]
        call = guarded(journal, runs)

        def work(n: int) -> None:
            for k in range(15):
                call(f"t{n}-{k}")
                assert journal.call(f"t{n}-{k}") is not None  # a read needs a connection of its own

        in_threads(5, work)
        assert runs[0] == 75
        assert journal.verify().ok


def test_connections_go_back_when_their_threads_end_and_all_close_with_the_journal(pg_dsn: str) -> None:
    journal = PostgresJournal(pg_dsn, pool_size=6)
    runs = [0]
    call = guarded(journal, runs)
    in_threads(4, lambda n: [call(f"t{n}-{k}") for k in range(5)])
    gc.collect()
    stats = journal.datastore.pool.get_stats()
    assert stats.get("pool_available", 0) == stats.get("pool_size", -1)  # every connection is back, idle
    call("main")  # this thread keeps one
    journal.close()
    assert eventually(lambda: sessions(pg_dsn) == 0)
    assert runs[0] == 21


def _fork_writes(journal: PostgresJournal, out: Any) -> None:
    try:
        runs = [0]
        guarded(journal, runs)("forked")  # the parent's object, in the child: a pool of its own
        out.send(("ok", runs[0]))
    except BaseException as e:
        out.send(("failed", repr(e)))
    finally:
        os._exit(0)  # as a worker that forked ends: no cleanup of what the parent owns


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_leaves_the_connection_its_parent_kept_alone(pg_dsn: str) -> None:
    with PostgresJournal(pg_dsn, pool_size=4) as journal:
        runs = [0]
        call = guarded(journal, runs)
        call("before")  # this thread now keeps a connection, which the child inherits
        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_fork_writes, args=(journal, send))
        child.start()
        assert receive.poll(PATIENCE)
        result = receive.recv()
        child.join(PATIENCE)
        assert result == ("ok", 1)
        before = journal.datastore.pool.get_stats().get("requests_num", 0)
        call("after")
        # Made on the connection kept before the fork, alive: the child did not end its session.
        assert journal.datastore.pool.get_stats().get("requests_num", 0) == before
        assert runs[0] == 2
        assert [e.call_id for e in journal.events()] == [
            "before", "before", "forked", "forked", "after", "after"]
        assert journal.verify().ok
