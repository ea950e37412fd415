"""A deadline on every exchange between a PostgreSQL journal and its server, kept by the client.

A server that is frozen (stopped by a signal, a VM paused, a disk that hangs) still has a kernel
that acknowledges what is sent to it and answers TCP keepalives, so neither keepalives nor
``tcp_user_timeout`` notice it; ``statement_timeout`` and ``lock_timeout`` are kept by the server,
which does not run; and a cancel request goes to the postmaster, which does not run either. The
client must give up itself. Each exchange (a statement sent and its answer read, a batch of a
cursor fetched) of a :class:`DeadlineConnection` notes when it is due; one thread of this process
looks at the connections a few times a second, and shuts down the socket of one that is late: the
exchange then fails as a connection lost (``conn.broken``), and the journal's own handling of a
lost connection (a write in doubt checked, or found never to have committed) takes over.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from typing import Any

import psycopg

__all__ = ["DeadlineConnection"]


# How often the watchdog looks at the connections: a deadline is kept to within this much.
_LOOK_EVERY = 0.25


class _Watchdog:
    """The connections of this process, and the thread that cuts those whose exchange is late.

    An exchange only writes its deadline on its connection (a fraction of a microsecond); the
    thread looks at every connection a few times a second, so that the journal's hot path never
    waits for it or wakes it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connections: weakref.WeakSet[DeadlineConnection] = weakref.WeakSet()
        self.thread: threading.Thread | None = None

    def watch(self, conn: DeadlineConnection) -> None:
        with self.lock:
            self.connections.add(conn)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="airlock-pg-deadline", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(_LOOK_EVERY)
            now = time.monotonic()
            with self.lock:
                late = [c for c in self.connections if c._due is not None and c._due <= now]
            for conn in late:
                conn._cut_if_late(now)


_WATCHDOG = _Watchdog()


def _forked() -> None:
    global _WATCHDOG
    _WATCHDOG = _Watchdog()  # the parent's thread is not the child's; nor are its connections


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class DeadlineConnection(psycopg.Connection[tuple[Any, ...]]):
    """A psycopg connection on which each exchange with the server ends within :attr:`answer_within`
    seconds (None: no deadline; set it with :meth:`set_deadline`), or fails with
    ``OperationalError`` saying so, the connection broken."""

    answer_within: float | None = None
    _due: float | None = None  # when the exchange under way is late
    _timed_out = False

    def set_deadline(self, seconds: float | None) -> None:
        """Give each exchange from now on ``seconds`` to end (None: no deadline)."""
        self._exchange = threading.Lock()  # held while the exchange's deadline is set or cut
        self.answer_within = seconds
        if seconds is not None:
            _WATCHDOG.watch(self)

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        seconds = self.answer_within
        if seconds is None or self._timed_out:
            return super().wait(gen, *args, **kwargs)
        self._due = time.monotonic() + seconds
        try:
            return super().wait(gen, *args, **kwargs)
        except psycopg.OperationalError as e:
            if self._timed_out:
                raise psycopg.OperationalError(f"the server did not answer within {seconds:g} s") from e
            raise
        finally:
            with self._exchange:  # not cut once it has ended: the connection goes back to its pool whole
                self._due = None

    def _cut_if_late(self, now: float) -> None:
        """Shut the socket down (from the watchdog's thread) if the exchange under way is late: the
        exchange finds it closed. The descriptor itself stays the connection's, closed with it."""
        with self._exchange:
            due = self._due
            if due is None or due > now:
                return
            self._timed_out = True
            try:
                with socket.socket(fileno=os.dup(self.pgconn.socket)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except (OSError, psycopg.Error):
                pass  # closed meanwhile
