"""What both SQL journals are: a datastore, the parts built on it, and the calls they make alike.

:class:`SQLJournal` is the base of :class:`~journal.sqlite.SQLiteJournal` and
:class:`~journal.postgres.PostgresJournal`, as DBOS's ``SystemDatabase`` is of its SQLite and
PostgreSQL versions. A store builds its datastore (:class:`~journal.datastore.Datastore`) and its
parts, each a class of its own, and hands them to :class:`SQLJournal`, which builds on them the
parts written once for both (:class:`~journal.resolving.Resolver`,
:class:`~journal.reconcile.Reconciler`) and hands each call to the part that makes it. A store's
class keeps only what differs: how it opens, the head, removing itself, and what it alone offers.

What the base asks of a part is a protocol here (:class:`Writes`, :class:`Leases`,
:class:`Checks`, :class:`Archives`, :class:`Approvals`); the reads are a
:class:`~journal.reading.LogReader`, or a store's subclass of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol, Self

from guard.approvals import ApprovalRequest, ApprovalStep, ApprovalStore, T
from guard.leases import LeaseStore, OwnerState, Settle
from guard.reconcile import DEFAULT_CHECK_TIMEOUT, Check, ReconcileResult
from guard.store import AsyncOffload, CallRecord, Decide, Decision, EffectEvent, EffectStore, RecentCalls

from .archive import ArchivedImporter, ArchivePlan, ArchiveReading, ArchiveRecord
from .datastore import Datastore
from .events import JournalEvent, JournalStats, VerifyReport
from .protocol import EventImporter
from .reading import LogReader
from .reconcile import Reconciler
from .resolving import Choose, Resolver

__all__ = ["Approvals", "Archives", "Checks", "Leases", "SQLJournal", "Writes"]


class Writes(EffectStore, RecentCalls, Protocol):
    """The part that makes a store's writes: the guard's ``begin``, ``append`` and ``get``, the
    lookup of a recent call, and the one write settling and resolving make."""

    def append_chosen(self, doing: str, call_id: str, choose: Choose) -> JournalEvent | None: ...


class Leases(Protocol):
    """The part that keeps the calls' leases: :class:`~guard.leases.LeaseStore` but ``settle``."""

    def take_lease(self, call_id: str, holder: str, seconds: float) -> None: ...

    def renew_lease(self, call_id: str, holder: str, seconds: float) -> bool: ...

    def drop_lease(self, call_id: str, holder: str) -> None: ...

    def claim_lease(self, call_id: str, holder: str, seconds: float) -> bool: ...

    def owner_states(self, records: list[CallRecord]) -> dict[str, OwnerState]: ...


class Checks(EventImporter, Protocol):
    """The part that checks the journal against its log, rebuilds its projection, and imports a copied log."""

    def verify(self, *, advance: Callable[[int], None] | None = None) -> VerifyReport: ...

    def rebuild(self, *, advance: Callable[[int], None] | None = None) -> int: ...


class Archives(ArchiveReading, ArchivedImporter, Protocol):
    """The part that keeps the archives: where the log starts, what the archives kept, the
    transaction that removes archived events, and the copy of an archived journal."""

    def archived_head(self) -> tuple[int, str]: ...

    def commit_archive(self, plan: ArchivePlan, file: str, archived_at: str) -> int: ...


class Approvals(Protocol):
    """The part that takes a step of a call's approval in one write transaction (see
    :class:`~guard.approvals.ApprovalStore`; the requests are read with the other reads)."""

    def approval_step(self, call_id: str, step: ApprovalStep[T]) -> T: ...


class SQLJournal(ABC, LeaseStore, RecentCalls, AsyncOffload, ApprovalStore):
    """A journal made of a datastore and parts (see :mod:`journal.sql_journal`).

    :attr:`datastore` holds the connections and runs the transactions; :attr:`writes` makes the
    guard's writes. ``reads``, ``leases``, ``checks``, ``archives`` and ``approvals`` are the
    parts the other calls go to.
    """

    def __init__(self, datastore: Datastore, *, reads: LogReader, writes: Writes, leases: Leases, checks: Checks,
                 archives: Archives, approvals: Approvals) -> None:
        self.datastore = datastore
        self.writes = writes
        self._reads = reads
        self._leases = leases
        self._checks = checks
        self._archives = archives
        self._approvals = approvals
        self._resolver = resolver = Resolver(writes.append_chosen, datastore.label(), datastore.dialect.nul,
                                             writes.get, leases.owner_states)
        # The guard's calls go straight to the part that makes them, as its bound methods: no frame
        # of this class on their way (the methods below are what the class itself shows).
        vars(self).update(begin=writes.begin, append=writes.append, get=writes.get, take_lease=leases.take_lease,
                          drop_lease=leases.drop_lease, settle=resolver.settle)

    # -- the guard's EffectStore, and the lookup of a recent call --------------------------------

    def begin(self, call_id: str, decide: Decide) -> Decision:
        """Read the call's record, let ``decide`` choose, append its event, atomically: no other
        append comes between the read and the append."""
        return self.writes.begin(call_id, decide)

    def append(self, event: EffectEvent) -> None:
        """Append an outcome or a refusal (folded into the projection where it applies)."""
        self.writes.append(event)

    def get(self, call_id: str) -> CallRecord | None:
        """The current record of ``call_id``, or None."""
        return self.writes.get(call_id)

    def call(self, call_id: str) -> CallRecord | None:
        """The current record of ``call_id``, or None (never seen, or only refusals)."""
        return self.writes.get(call_id)

    def recent_call(self, agent_id: str | None, idempotency_key: str, since: datetime) -> CallRecord | None:
        """The most recent call of ``agent_id`` with ``idempotency_key`` begun at or after ``since`` and
        not released, or None (the lookup of ``EffectGuard(duplicate_window=...)``)."""
        return self.writes.recent_call(agent_id, idempotency_key, since)

    # -- leases --------------------------------------------------------------------------------

    def take_lease(self, call_id: str, holder: str, seconds: float) -> None:
        """Record ``holder``'s lease on ``call_id``, running out ``seconds`` from now by the store's clock."""
        self._leases.take_lease(call_id, holder, seconds)

    def renew_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        """Extend ``holder``'s lease; False when it has none on the call any more."""
        return self._leases.renew_lease(call_id, holder, seconds)

    def drop_lease(self, call_id: str, holder: str) -> None:
        """Forget ``holder``'s lease on ``call_id``."""
        self._leases.drop_lease(call_id, holder)

    def claim_lease(self, call_id: str, holder: str, seconds: float) -> bool:
        """Take a lease on ``call_id`` only if its owner, when it is pending, is gone (see
        :mod:`journal.leasing`) and no other check holds a lease on it that still runs."""
        return self._leases.claim_lease(call_id, holder, seconds)

    def owner_states(self, records: list[CallRecord]) -> dict[str, OwnerState]:
        """Whether each pending record's owner is alive, and when its lease runs out."""
        return self._leases.owner_states(records)

    # -- settling, resolving, reconciling (journal.resolving, journal.reconcile) ------------------

    def settle(self, call_id: str, choose: Settle) -> int | None:
        """See :meth:`journal.resolving.Resolver.settle`."""
        return self._resolver.settle(call_id, choose)

    def resolve(
        self, call_id: str, *, applied: bool, reason: str, operator: str, value: str | None = None,
        force: bool = False,
    ) -> JournalEvent:
        """See :meth:`journal.resolving.Resolver.resolve`."""
        return self._resolver.resolve(call_id, applied=applied, reason=reason, operator=operator, value=value,
                                      force=force)

    def check_resolve(
        self, call_id: str, *, applied: bool, reason: str, operator: str, value: str | None = None,
        force: bool = False,
    ) -> None:
        """See :meth:`journal.resolving.Resolver.check_resolve`."""
        self._resolver.check_resolve(call_id, applied=applied, reason=reason, operator=operator, value=value,
                                     force=force)

    def reconcile(
        self,
        checks: Mapping[str, Check],
        *,
        tool: str | None = None,
        older_than: timedelta | float | None = None,
        dry_run: bool = False,
        timeout: float = DEFAULT_CHECK_TIMEOUT,
    ) -> list[ReconcileResult]:
        """See :meth:`journal.reconcile.Reconciler.reconcile`."""
        return Reconciler(self).reconcile(checks, tool=tool, older_than=older_than, dry_run=dry_run,
                                          timeout=timeout)

    # -- requests for approval -------------------------------------------------------------------

    def approval_step(self, call_id: str, step: ApprovalStep[T]) -> T:
        """See :class:`guard.approvals.ApprovalStore`: one transaction that no other write of the call comes between."""
        return self._approvals.approval_step(call_id, step)

    def approval_requests(
        self, *, call_id: str | None = None, request_id: str | None = None, status: str | None = None,
        tool: str | None = None, limit: int | None = None, offset: int = 0,
    ) -> list[ApprovalRequest]:
        """See :meth:`journal.reading.LogReader.approval_requests`."""
        return self._reads.approval_requests(call_id=call_id, request_id=request_id, status=status, tool=tool,
                                             limit=limit, offset=offset)

    # -- reads (journal.reading) -------------------------------------------------------------------

    def calls(
        self,
        *,
        status: str | Sequence[str] | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        limit: int | None = 50,
        offset: int = 0,
        until: datetime | None = None,
        idempotency_key: str | None = None,
    ) -> list[CallRecord]:
        """See :meth:`journal.reading.LogReader.calls`."""
        return self._reads.calls(status=status, tool=tool, agent_id=agent_id, since=since, limit=limit,
                                 offset=offset, until=until, idempotency_key=idempotency_key)

    def events(
        self,
        *,
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after_seq: int = 0,
    ) -> Iterator[JournalEvent]:
        """See :meth:`journal.reading.LogReader.events`."""
        return self._reads.events(call_id=call_id, tool=tool, agent_id=agent_id, since=since, until=until,
                                  after_seq=after_seq)

    def event_rows(
        self,
        *,
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after_seq: int = 0,
    ) -> Iterator[tuple[Any, ...]]:
        """See :meth:`journal.reading.LogReader.event_rows`."""
        return self._reads.event_rows(call_id=call_id, tool=tool, agent_id=agent_id, since=since, until=until,
                                      after_seq=after_seq)

    def count_events(
        self,
        *,
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after_seq: int = 0,
    ) -> int:
        """See :meth:`journal.reading.LogReader.count_events`."""
        return self._reads.count_events(call_id=call_id, tool=tool, agent_id=agent_id, since=since, until=until,
                                        after_seq=after_seq)

    def call_events(self, call_id: str) -> list[JournalEvent]:
        """Every event of ``call_id`` (refusals included) in ``seq`` order; [] for an id never seen."""
        return self._reads.call_events(call_id)

    def stats(self) -> JournalStats:
        """See :meth:`journal.reading.LogReader.stats`."""
        return self._reads.stats()

    @abstractmethod
    def head(self) -> tuple[int, str]:
        """The last event's seq and hash; ``(0, GENESIS)`` for an empty journal."""

    def export_lines(
        self,
        *,
        redact: frozenset[str] = frozenset(),
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> Iterator[tuple[bytes, int]]:
        """See :meth:`journal.reading.LogReader.export_lines`."""
        return self._reads.export_lines(redact=redact, call_id=call_id, tool=tool, agent_id=agent_id, since=since,
                                        until=until)

    def export_csv(
        self,
        *,
        redact: frozenset[str] = frozenset(),
        call_id: str | None = None,
        tool: str | None = None,
        agent_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> Iterator[tuple[bytes, int]]:
        """See :meth:`journal.reading.LogReader.export_csv`."""
        return self._reads.export_csv(redact=redact, call_id=call_id, tool=tool, agent_id=agent_id, since=since,
                                      until=until)

    # -- checks and repairs ----------------------------------------------------------------------

    def verify(self, *, advance: Callable[[int], None] | None = None) -> VerifyReport:
        """Recompute the hash chain and check the projection and the head against the log, on one
        consistent snapshot. ``advance`` is told of each stretch of events checked (a progress bar's update)."""
        return self._checks.verify(advance=advance)

    def rebuild(self, *, advance: Callable[[int], None] | None = None) -> int:
        """Fold the projection again from the whole log, in one transaction; returns the number of
        calls. ``advance`` is told of each batch of events folded."""
        return self._checks.rebuild(advance=advance)

    def import_events(self, events: Iterable[JournalEvent],
                      check: Callable[[VerifyReport], None] | None = None) -> int:
        """See :meth:`journal.protocol.EventImporter.import_events` (used by :mod:`journal.copy`)."""
        return self._checks.import_events(events, check)

    # -- archives (journal.archive) ----------------------------------------------------------------

    def archived_head(self) -> tuple[int, str]:
        """The seq and hash of the last archived event, where the log now starts; ``(0, GENESIS)``
        when nothing was archived."""
        return self._archives.archived_head()

    def commit_archive(self, plan: ArchivePlan, file: str, archived_at: str) -> int:
        """Remove the events ``plan`` moves, once they are in the archive ``file``, in one
        transaction that records the archive's head; returns how many were removed."""
        return self._archives.commit_archive(plan, file, archived_at)

    def archive_rows(self) -> list[tuple[Any, ...]]:
        """See :meth:`journal.archive.ArchiveReading.archive_rows`."""
        return self._archives.archive_rows()

    def archived_call_last_seq(self, call_id: str) -> int | None:
        """See :meth:`journal.archive.ArchiveReading.archived_call_last_seq`."""
        return self._archives.archived_call_last_seq(call_id)

    def archived_projection(self) -> dict[str, tuple[Any, ...]]:
        """See :meth:`journal.archive.ArchiveReading.archived_projection`."""
        return self._archives.archived_projection()

    def archived_requests(self) -> list[tuple[str, str]]:
        """See :meth:`journal.archive.ArchiveReading.archived_requests`."""
        return self._archives.archived_requests()

    def import_archived(self, records: list[ArchiveRecord], snapshot: dict[str, tuple[Any, ...]],
                        touched: dict[str, tuple[Any, ...]], requests: list[tuple[str, str]],
                        rows: Iterator[tuple[Any, ...]], folded: dict[str, CallRecord],
                        check: Callable[[VerifyReport], None]) -> int:
        """See :meth:`journal.archive.ArchivedImporter.import_archived` (used by :mod:`journal.copy`)."""
        return self._archives.import_archived(records, snapshot, touched, requests, rows, folded, check)

    # -- lifetime --------------------------------------------------------------------------------

    @abstractmethod
    def remove_if_empty(self) -> bool:
        """See :meth:`journal.protocol.Removable.remove_if_empty`."""

    def label(self) -> str:
        """How messages name the journal: a SQLite file's path, a PostgreSQL journal's URL without
        its password."""
        return self.datastore.label()

    def close(self) -> None:
        """Close the journal's connections; it cannot be used afterwards. Closing twice is harmless."""
        self.datastore.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
