"""The PostgreSQL journal: one object that threads share, and the parts it is made of.

:class:`PostgresJournal` builds one :class:`~journal.postgres.datastore.PostgresDatastore` (the
connections and transactions) and hands it to each part: :class:`~journal.postgres.opening.Opener`
(the schema, checked or made), :class:`~journal.postgres.leases.Leases`,
:class:`~journal.postgres.writes.Writer` (the guard's appends), :class:`~journal.postgres.reads.Reader`
(the shared :class:`~journal.reading.LogReader`, and the head),
:class:`~journal.postgres.checking.Checker` (verify, rebuild, import),
:class:`~journal.postgres.archiving.Archiver` and :class:`~journal.postgres.approving.Approvals`.
The writes and the approvals share what this object's own writes tell it of the log
(:class:`~journal.postgres.heads.Known`). :class:`~journal.sql_journal.SQLJournal`, the base both
SQL journals share, hands each call to its part; this class adds only what is PostgreSQL's own.
"""

from __future__ import annotations

from guard.store import EffectEvent

from ..events import JournalEvent
from ..sql_journal import SQLJournal
from .approving import Approvals
from .archiving import Archiver
from .checking import Checker
from .datastore import PostgresDatastore
from .heads import Known
from .leases import Leases
from .opening import Opener
from .reads import Reader
from .sealing import Sealer, SealingReads
from .server_append import _APPEND_FN
from .writes import Writer

__all__ = ["PostgresJournal"]


class PostgresJournal(SQLJournal):
    """A journal in a PostgreSQL database (its tables in the first schema of the connection's
    search_path, named by :attr:`schema` once open).

    ``PostgresJournal(dsn, busy_timeout=30.0, pool_size=8, readonly=False, create=True,
    connect_timeout=5.0, timeout=10.0)``. ``dsn`` is a libpq URL or key=value string. ``create`` makes the
    tables in an empty schema; the database itself must exist, in the UTF8 or SQL_ASCII encoding.
    ``busy_timeout`` bounds the wait for the journal's write lock and for a free pooled connection
    (then :class:`StoreBusy`); ``connect_timeout`` bounds a connection attempt; ``timeout`` is how
    long the server may take to answer, past the lock wait ``busy_timeout`` allows: an exchange
    with the server that takes longer than ``busy_timeout + timeout`` seconds (a frozen server) is
    cut off by the client, and the journal treats it as a lost connection (``begin`` then raises,
    and the guard refuses the call ``store_unavailable``). One object is safe to share between threads.

    Raises :class:`JournalNotFound` (no such database or schema, or an empty one and ``create``
    false), :class:`NotAJournal` (the schema holds another application's tables),
    :class:`NewerSchema`, or :class:`JournalError` (the server cannot be reached, the database has
    another encoding, the login may not use the schema); in every case nothing is changed.

    :attr:`datastore` holds the connections (its :attr:`~PostgresDatastore.pool` among them), and
    :attr:`writes` the guard's appends (set ``journal.writes.seal_mode`` to
    :data:`~journal.postgres.writes.QUEUE` to send every event through the inbox, as under contention).
    """

    datastore: PostgresDatastore
    writes: Writer

    #: Whether ``async def`` tools make this journal's writes on a thread of their own, so that the
    #: loop runs on while a write waits for the server (set it false to keep them on the loop).
    offload_async = True

    def __init__(
        self,
        dsn: str,
        *,
        busy_timeout: float = 30.0,
        pool_size: int = 8,
        readonly: bool = False,
        create: bool = True,
        connect_timeout: float = 5.0,
        timeout: float = 10.0,
    ) -> None:
        if busy_timeout <= 0 or connect_timeout <= 0:
            raise ValueError("busy_timeout and connect_timeout must be positive")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"timeout is a number of seconds, more than 0, not {timeout!r}")
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        datastore = PostgresDatastore(dsn, busy_timeout=busy_timeout, connect_timeout=connect_timeout,
                                      timeout=float(timeout), pool_size=pool_size, readonly=readonly,
                                      session_setup=_APPEND_FN)
        self._opening = opening = Opener(datastore)
        opened = opening.open(create=create and not readonly)
        known = Known(opened.head_seq)
        datastore.when_lost(known.forget)
        leases = Leases(datastore)
        #: Seals what this process's appends left in the inbox (see :mod:`journal.postgres.sealing`).
        self.sealer = sealer = Sealer(datastore)
        writes = Writer(datastore, known, leases, sealer)
        sealed = SealingReads(datastore, sealer)  # operators' reads seal what is committed first
        checking = Checker(sealed)
        self._reader = reads = Reader(sealed)
        self._approving = approvals = Approvals(datastore, writes)
        datastore.start(opened.schema)
        super().__init__(datastore, reads=reads, writes=writes, leases=leases, checks=checking,
                         archives=Archiver(sealed, checking.verify_in), approvals=approvals)

    # What it was opened with: fixed for the journal's life (its parts were made with them).

    @property
    def dsn(self) -> str:
        """The libpq URL or key=value string it was opened with."""
        return self.datastore.dsn

    @property
    def name(self) -> str:
        """The journal for messages: its URL without the password."""
        return self.datastore.name

    @property
    def readonly(self) -> bool:
        return self.datastore.readonly

    @property
    def busy_timeout(self) -> float:
        return self.datastore.busy_timeout

    @property
    def connect_timeout(self) -> float:
        return self.datastore.connect_timeout

    @property
    def timeout(self) -> float:
        return self.datastore.timeout

    @property
    def pool_size(self) -> int:
        return self.datastore.pool_size

    @property
    def schema(self) -> str:
        """The schema its tables are in."""
        return self.datastore.schema

    def append_event(self, event: EffectEvent) -> JournalEvent:
        """:meth:`append`, returning the event as stored (with its ``seq`` and ``hash``)."""
        return self.writes.append_event(event)

    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last event; ``(0, GENESIS)`` for an empty journal."""
        return self._reader.head()

    def wait_for_decision(self, call_id: str, seconds: float) -> bool:
        """Block up to ``seconds`` until a decision on a request of ``call_id`` is committed (told by
        ``NOTIFY``); False after ``seconds``, or when the call's latest request was no longer open
        as the wait began. See :class:`guard.approvals.ApprovalWaiter`."""
        return self._approving.wait_for_decision(call_id, seconds)

    def close(self) -> None:
        """Seal what this process left in the inbox, and close the journal's connections; it cannot
        be used afterwards. Closing twice is harmless."""
        self.sealer.close()
        super().close()

    def seal(self) -> int:
        """Seal every event committed to the inbox into the log now (waiting for a seal under way);
        returns how many were moved. Reads do it themselves, and writers soon after they append."""
        return self.sealer.seal()

    def remove_if_empty(self) -> bool:
        """See :meth:`journal.protocol.Removable.remove_if_empty`: the tables and functions of the
        journal are dropped (the login needs to own them)."""
        removed = self._opening.remove_if_empty()
        if removed:
            self.close()
        return removed

    def __repr__(self) -> str:
        return f"PostgresJournal({self.name!r}{', readonly' if self.readonly else ''})"
