"""PostgresJournal when a connection is cut while its statement still runs on the server."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Any

import psycopg
import pytest

from guard.store import Decision, EffectEvent, Verdict
from journal import JournalError
from journal.postgres import PostgresJournal
from tests.pgserver import PgServer

pytestmark = pytest.mark.postgres


class CuttingProxy:
    """A TCP relay to the server whose client sides can be reset (as a NAT or a load balancer
    does), leaving the server's side, and the statement running there, alive."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.clients: list[socket.socket] = []
        self.servers: list[socket.socket] = []
        # A cut resets the clients of that moment only: a connection the journal makes again right
        # after it (accepted while the cut is under way) must go through.
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:  # the server is down (restarting): this client is refused, as it would be
                client.close()
                continue
            with self.lock:
                self.clients.append(client)
                self.servers.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):  # one side ended (the server went away, say): so does the other
            b.shutdown(socket.SHUT_WR)

    def cut_clients(self) -> None:
        with self.lock:
            clients, self.clients = self.clients, []
        for client in clients:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            client.close()

    def close(self) -> None:
        self.listener.close()
        for s in self.servers:
            s.close()


@pytest.fixture
def proxied(pg_server: PgServer, pg_dsn: str) -> Any:
    if not pg_server.port or f":{pg_server.port}/" not in pg_dsn:
        pytest.skip("needs the managed server's port in the DSN")
    PostgresJournal(pg_dsn).close()  # the schema, made directly
    proxy = CuttingProxy(pg_server.port)
    journal = PostgresJournal(pg_dsn.replace(f":{pg_server.port}/", f":{proxy.port}/"), pool_size=1, busy_timeout=10)
    yield journal, proxy
    journal.close()
    proxy.close()


def events_of(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT seq, kind, call_id, attempt FROM events ORDER BY seq").fetchall()


# Waits here end when what they wait for is seen; the bound is only for a test that has gone wrong,
# and is far beyond what the slowest loaded machine takes.
PATIENCE = 300.0


def waiting_for_a_lock(pg_dsn: str) -> int:
    """How many sessions of the database wait on the server for a lock (the head row's)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, f"still not so after {PATIENCE:g} s: {what}"
        time.sleep(0.05)


def settled(pg_dsn: str) -> None:
    """Wait until no other session of the database runs a statement: a call whose client was cut
    off has finished on the server too."""

    def idle() -> bool:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND state = 'active' AND pid <> pg_backend_pid()").fetchone()
        return row == (0,)

    until(idle, "a statement still runs on the server")


def cut_while_blocked(pg_dsn: str, proxy: CuttingProxy, write: Any, block: Any) -> Any:
    """Run ``write`` while another transaction holds what ``block`` takes on its connection, cut
    its connection while its statement waits on the server for that, then let it go; what ``write``
    returned or raised."""
    blocker = psycopg.connect(pg_dsn)
    block(blocker)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = write()
        except Exception as e:
            result["value"] = e

    thread = threading.Thread(target=run)
    thread.start()
    # The one-statement append waits on the server for the lock.
    until(lambda: waiting_for_a_lock(pg_dsn) >= 1, "the write waits for the lock")
    proxy.cut_clients()
    # Sent again (or gone the locked way), it waits too, or gave up at once.
    until(lambda: waiting_for_a_lock(pg_dsn) >= 2 or not thread.is_alive(), "the write waits again or ends")
    blocker.rollback()
    blocker.close()
    thread.join(PATIENCE)
    assert not thread.is_alive()
    return result["value"]


def cut_while_waiting_for_the_head(pg_dsn: str, proxy: CuttingProxy, write: Any, call_id: str) -> Any:
    """:func:`cut_while_blocked` behind the chain's head and the lock of the call ``call_id``."""

    def block(blocker: psycopg.Connection[Any]) -> None:
        blocker.execute("SELECT * FROM chain_head FOR UPDATE")
        blocker.execute("SELECT pg_advisory_xact_lock(hashtext(current_schema()), hashtext(%s))", (call_id,))

    return cut_while_blocked(pg_dsn, proxy, write, block)


def run_unless_seen(call_id: str) -> Any:
    """The guard's choice in short: run a call never seen, refuse one that is."""

    def decide(record: Any) -> Decision:
        if record is None:
            return Decision(Verdict.RUN, EffectEvent("pending", call_id, "pay", attempt=1, arguments="{}"))
        return Decision(Verdict.REFUSE, EffectEvent("refused", call_id, "pay", attempt=record.attempt,
                                                    reason={"code": "effect_status_unknown", "message": "m"}))

    return decide


def test_an_outcome_cut_off_in_doubt_is_appended_once(proxied: Any, pg_dsn: str) -> None:
    journal, proxy = proxied
    journal.append(EffectEvent("pending", "c1", "pay", attempt=1, arguments="{}", idempotency_key="k"))
    stored = cut_while_waiting_for_the_head(pg_dsn, proxy, lambda: journal.append_event(
        EffectEvent("committed", "c1", "pay", attempt=1, value='{"ok":1}')), "c1")
    assert not isinstance(stored, Exception), stored
    assert events_of(pg_dsn) == [(1, "pending", "c1", 1), (2, "committed", "c1", 1)]
    assert stored.seq == 2
    assert journal.get("c1").status == "committed"
    assert journal.verify().ok


def test_a_pending_cut_off_in_doubt_is_recorded_once(proxied: Any, pg_dsn: str) -> None:
    journal, proxy = proxied
    journal.append(EffectEvent("refused", None, "pay", attempt=0, reason={"code": "x", "message": "m"}))

    decision = cut_while_waiting_for_the_head(pg_dsn, proxy, lambda: journal.begin("c2", run_unless_seen("c2")), "c2")
    assert not isinstance(decision, Exception), decision
    assert decision.verdict == Verdict.RUN  # the pending this caller made, not a refusal by its own record
    assert events_of(pg_dsn) == [(1, "refused", None, 0), (2, "pending", "c2", 1)]
    assert journal.verify().ok


def test_a_first_write_cut_off_while_the_server_waits_for_the_head_is_recorded_once(proxied: Any, pg_dsn: str) -> None:
    # A write is the server-side append; cut off, it is sent again, and whichever of the two gets
    # the call's lock first appends, the other finds that event.
    journal, proxy = proxied

    decision = cut_while_waiting_for_the_head(pg_dsn, proxy, lambda: journal.begin("c3", run_unless_seen("c3")), "c3")
    assert not isinstance(decision, Exception), decision
    assert decision.verdict == Verdict.RUN
    settled(pg_dsn)  # the first call, its client gone, has finished on the server too
    assert events_of(pg_dsn) == [(1, "pending", "c3", 1)]
    assert journal.verify().ok


def test_a_server_append_cut_off_is_never_made_again_the_locked_way(
    proxied: Any, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The session the call is sent again on has no server-side append (one that could not make it):
    # the locked way cannot tell the first call's event, so the write fails rather than doubling.
    journal, proxy = proxied
    journal.append(EffectEvent("pending", "c5", "pay", attempt=1, arguments="{}", idempotency_key="k"))
    monkeypatch.setattr(journal.datastore, "session_setup", "SELECT 1")  # sessions from now on go without it
    outcome = cut_while_waiting_for_the_head(pg_dsn, proxy, lambda: journal.append_event(
        EffectEvent("committed", "c5", "pay", attempt=1, value='{"ok":1}')), "c5")
    assert isinstance(outcome, JournalError), outcome
    settled(pg_dsn)  # the first call, its client gone, has finished on the server
    assert events_of(pg_dsn) == [(1, "pending", "c5", 1), (2, "committed", "c5", 1)]
    assert journal.verify().ok


def test_after_a_crash_lost_events_an_append_cut_off_on_the_server_is_still_found_once(
    proxied: Any, pg_server: PgServer, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not pg_server.managed:
        pytest.skip("the tests do not crash an external server")
    from tests.postgres.test_replicas import crash_losing

    journal, proxy = proxied
    journal.begin("x", run_unless_seen("x"))  # seq 1, on disk
    journal.datastore.pool.wait(PATIENCE)  # no session opens (and commits its temporary function) as the crash comes
    crash_losing(pg_server, lambda: (  # seq 2 and 3: lost, so the head goes back below what the object saw
        journal.append(EffectEvent("released", "x", "pay", attempt=1, error={"type": "E", "message": "m"})),
        journal.append(EffectEvent("refused", None, "pay", reason={"code": "c", "message": "m"}))))
    assert journal.head()[0] == 1
    decision = cut_while_waiting_for_the_head(pg_dsn, proxy, lambda: journal.begin("y", run_unless_seen("y")), "y")
    assert not isinstance(decision, Exception), decision
    assert decision.verdict == Verdict.RUN  # its own pending found, not taken for another's
    settled(pg_dsn)
    assert events_of(pg_dsn) == [(1, "pending", "x", 1), (2, "pending", "y", 1)]
    assert journal.verify().ok


def test_an_event_of_no_call_cut_off_while_the_log_is_held_is_appended_once(proxied: Any, pg_dsn: str) -> None:
    # An event of no call waits, like any append, behind a rebuild, archive or copy holding the log;
    # cut off there and sent again, the two calls take one lock in turn, so the second finds the first.
    journal, proxy = proxied
    journal.append(EffectEvent("refused", None, "pay", attempt=0, reason={"code": "x", "message": "m"}))
    result = cut_while_blocked(  # behind what rebuild, archive and copy do first
        pg_dsn, proxy,
        lambda: journal.append(EffectEvent("refused", None, "wire", attempt=0, reason={"code": "y", "message": "m"})),
        lambda blocker: blocker.execute("SELECT airlock_hold_log()"))
    assert result is None, result  # appended (append returns nothing), not an error
    settled(pg_dsn)  # the first call, its client gone, has finished on the server too
    journal.seal()
    with psycopg.connect(pg_dsn) as conn:
        wires = conn.execute("SELECT count(*) FROM events WHERE tool = 'wire'").fetchone()
    assert wires == (1,)
    assert journal.verify().ok
