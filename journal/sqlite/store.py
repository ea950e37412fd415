"""The SQLite journal: one object that threads share, and what it is made of.

:class:`SQLiteJournal` builds the journal's datastore
(:class:`~journal.sqlite.datastore.SQLiteDatastore`: the file, the connection, transactions,
group commit, forks) and the parts built on it, each a class of its own that takes what it needs
in its constructor: the writes and leases (:class:`~journal.sqlite.writes.Writer`), the reads
(:class:`~journal.sqlite.reads.Reader`, the shared :class:`~journal.reading.LogReader` made
quicker where SQLite can), the checks (:class:`~journal.sqlite.checking.Checker`), the archives
(:class:`~journal.sqlite.archives.Archiver`) and the requests for approval
(:class:`~journal.sqlite.approvals.Approvals`). :class:`~journal.sql_journal.SQLJournal`, the base
both SQL journals share, hands each call to its part; this class adds only what is SQLite's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from guard.store import Decide, Decision, EffectEvent, LeasesInBegin

from ..archive import ArchivePlan
from ..events import VerifyReport
from ..sql_journal import SQLJournal
from .approvals import Approvals
from .archives import Archiver
from .checking import Checker
from .datastore import Durability, SQLiteDatastore
from .reads import Reader
from .writes import Writer

__all__ = ["SQLiteJournal"]


class SQLiteJournal(SQLJournal, LeasesInBegin):
    """An :class:`~guard.store.EffectStore` on a SQLite file, with the operator's reads and repairs.

    Args:
        path: the journal file; created (mode 0600) when missing unless ``create=False`` or ``readonly``.
        durability: ``"full"`` fsyncs ``pending`` before the tool runs (survives power loss);
            ``"process"`` survives a crash of the process only, and is faster.
        busy_timeout: seconds a write waits for the lock before :class:`StoreBusy`.
        readonly: open without creating or changing anything; writes raise :class:`JournalError`.
        create: make the journal when the file does not exist.

    Raises :class:`JournalNotFound` (no file, and it may not be created), :class:`NotAJournal`
    (a foreign file), :class:`NewerSchema`; in the last two cases the file is left unchanged.
    One object is safe to share between threads; after a fork the child opens its own connection.

    :attr:`datastore` holds the file and its connection (the test kit traces or wraps
    ``datastore.current``, under ``datastore.lock``), and :attr:`writes` the guard's writes.
    """

    datastore: SQLiteDatastore
    writes: Writer

    #: Set it true (on the object or a subclass) to have ``async def`` tools make this journal's
    #: writes on a worker thread rather than on the event loop.
    offload_async = False

    leases_in_begin = True  # begin takes a call's lease and append drops it, in their transactions

    def __init__(
        self,
        path: str | os.PathLike[str],
        durability: Durability = "full",
        busy_timeout: float = 30.0,
        *,
        readonly: bool = False,
        create: bool = True,
    ) -> None:
        if durability not in ("full", "process"):
            raise ValueError(f"durability is 'full' or 'process', not {durability!r}")
        if isinstance(busy_timeout, bool) or not isinstance(busy_timeout, int | float) or not busy_timeout >= 0:
            raise ValueError(f"busy_timeout is a number of seconds, 0 or more, not {busy_timeout!r}")
        if str(path) == ":memory:" or str(path).startswith("file:"):
            raise ValueError(f"SQLiteJournal takes the path of a file, not {str(path)!r}")
        datastore = SQLiteDatastore(path, durability, busy_timeout, readonly=readonly, create=create)
        writer = Writer(datastore)
        self._reader = reader = Reader(datastore)
        self._checker = checker = Checker(datastore)
        self._archiver = archiver = Archiver(datastore, checker.verified_log)
        super().__init__(datastore, reads=reader, writes=writer, leases=writer, checks=checker, archives=archiver,
                         approvals=Approvals(datastore, writer))

    # What it was opened with: fixed for the journal's life (its parts were made with them).

    @property
    def path(self) -> Path:
        """The journal file, as given."""
        return self.datastore.path

    @property
    def durability(self) -> Durability:
        return self.datastore.durability

    @property
    def busy_timeout(self) -> float:
        return self.datastore.busy_timeout

    @property
    def readonly(self) -> bool:
        return self.datastore.readonly

    # -- the guard's EffectStore, a call's lease taken and dropped in its transactions ------------

    def begin(self, call_id: str, decide: Decide, lease: tuple[str, float] | None = None) -> Decision:
        """See :meth:`journal.sqlite.writes.Writer.begin`."""
        return self.writes.begin(call_id, decide, lease)

    def append(self, event: EffectEvent, drop_lease: str | None = None) -> None:
        """See :meth:`journal.sqlite.writes.Writer.append`."""
        self.writes.append(event, drop_lease)

    def head(self) -> tuple[int, str]:
        """The last event's seq and hash; ``(0, GENESIS)`` for an empty journal."""
        return self._reader.head()

    def verify(self, *, parts: int | None = None, advance: Callable[[int], None] | None = None) -> VerifyReport:
        """See :meth:`journal.sqlite.checking.Checker.verify`."""
        return self._checker.verify(parts=parts, advance=advance)

    # -- archives removed in steps (journal.sqlite.archives) --------------------------------------

    def unfinished_archive(self) -> tuple[ArchivePlan, str] | None:
        """See :meth:`journal.sqlite.archives.Archiver.unfinished_archive`."""
        return self._archiver.unfinished_archive()

    def check_archive(self) -> VerifyReport:
        """See :meth:`journal.sqlite.archives.Archiver.check_archive`."""
        return self._archiver.check_archive()

    def reclaim_space(self, pages: int = 256) -> int:
        """See :meth:`journal.sqlite.archives.Archiver.reclaim_space`."""
        return self._archiver.reclaim_space(pages)

    # -- lifetime ------------------------------------------------------------------------------

    def remove_if_empty(self) -> bool:
        """See :meth:`journal.sqlite.datastore.SQLiteDatastore.remove_if_empty`."""
        return self.datastore.remove_if_empty()

    def __repr__(self) -> str:
        mode = ", readonly=True" if self.readonly else ""
        return f"SQLiteJournal({str(self.path)!r}, durability={self.durability!r}{mode})"
