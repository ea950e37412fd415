"""The operator's API of a journal: what the CLI and the copy ask of a store, whichever store it is.

:class:`Journal` is what :func:`journal.open_journal` returns. :class:`~journal.SQLiteJournal` and
:class:`~journal.postgres.PostgresJournal` implement it, and mypy checks both where
``open_journal`` returns them. A new operator method is written once, in the base both take
(:class:`journal.sql_journal.SQLJournal`), or in both stores where they differ, and declared here,
in the group it belongs to, with the same keyword names and defaults; the CLI then calls it with
no cast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Protocol, Self, runtime_checkable

from guard.approvals import ApprovalRequest, ApprovalStep, T
from guard.leases import LeaseStore
from guard.reconcile import DEFAULT_CHECK_TIMEOUT, Check, ReconcileResult
from guard.store import CallRecord, EffectStore

from .archive import ArchivedImporter, ArchiveReading, ArchiveStore
from .events import JournalEvent, JournalStats, VerifyReport

__all__ = ["EventImporter", "Journal", "Removable"]


@runtime_checkable
class EventImporter(Protocol):
    """A journal that takes a copied log in one transaction of its own (see :mod:`journal.copy`)."""

    def import_events(self, events: Iterable[JournalEvent],
                      check: Callable[[VerifyReport], None] | None = None) -> int:
        """Insert stored ``events`` (``seq`` from 1, in order) as they are, and the projection folded
        from them, into this empty journal; ``check`` is given the verify report before the commit,
        and raises to refuse it. Returns the number of calls."""
        ...


@runtime_checkable
class Removable(Protocol):
    """A journal that takes itself away while its log is empty (what a failed copy made, see
    :mod:`journal.copy`)."""

    def remove_if_empty(self) -> bool:
        """When the log holds no event, remove the journal (a SQLite file and the files beside it,
        or the tables and functions of a PostgreSQL journal) and close this object; returns whether
        it was removed (False: it holds events, and was left as it is). Raises
        :class:`~journal.errors.JournalError` when it cannot be written."""
        ...


@runtime_checkable
class Journal(EffectStore, LeaseStore, ArchiveStore, ArchiveReading, ArchivedImporter, EventImporter, Removable,
              Protocol):
    """A durable :class:`~guard.store.EffectStore` (``begin``, ``append``, ``get``) that keeps
    leases (:class:`~guard.leases.LeaseStore`, ``owner_states`` among them), requests for approval
    (:class:`~guard.approvals.ApprovalStore`) and archives its log
    (:class:`~journal.archive.ArchiveStore`), with the operator's reads, checks and repairs. What
    :mod:`journal.copy` and :mod:`journal.archive` read of a journal's archives and give a copy
    (:class:`~journal.archive.ArchiveReading`, :class:`~journal.archive.ArchivedImporter`,
    :class:`EventImporter`, :class:`Removable`) every journal offers too. Use it as a context
    manager: leaving it closes it."""

    # -- calls ---------------------------------------------------------------------------------

    def call(self, call_id: str) -> CallRecord | None:
        """The current record of ``call_id``, or None (never seen, or only refusals)."""
        ...

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
        """Calls newest first (by ``updated_at``, then ``call_id``), filtered by status (one, or any
        of several), tool, agent and ``updated_at >= since``; at most ``limit`` (None: all), after
        the first ``offset``."""
        ...

    def stats(self) -> JournalStats:
        """Counts of calls by status and by tool, the number of events, and when the oldest pending
        and unknown calls entered that status, as of one moment."""
        ...

    # -- the log -------------------------------------------------------------------------------

    def call_events(self, call_id: str) -> list[JournalEvent]:
        """Every event of ``call_id`` (refusals included) in ``seq`` order; [] for an id never seen."""
        ...

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
        """The events in ``seq`` order, filtered (``since <= at < until``, ``seq > after_seq``), read
        in batches up to the head as it was when the read began."""
        ...

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
        """How many events :meth:`events` with the same filters would give now."""
        ...

    def head(self) -> tuple[int, str]:
        """The last event's ``seq`` and hash; ``(0, 64 zeros)`` for an empty journal."""
        ...

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
        """The JSON Lines export of the filtered events, in batches: (the lines, how many)."""
        ...

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
        """The CSV export of the filtered events, its header first, in batches: (the lines, how many
        events)."""
        ...

    # -- checks and repairs --------------------------------------------------------------------

    def verify(self, *, advance: Callable[[int], None] | None = None) -> VerifyReport:
        """Recompute the hash chain, check that ``seq`` is gapless from 1 and that the projection
        equals the fold of the log, on one consistent snapshot. ``advance``, when given, is told of
        each stretch of events checked (how many), for a progress bar."""
        ...

    def rebuild(self, *, advance: Callable[[int], None] | None = None) -> int:
        """Fold the projection again from the whole log, in one transaction; returns the number of calls.
        ``advance`` as for :meth:`verify`."""
        ...

    def check_resolve(
        self, call_id: str, *, applied: bool, reason: str, operator: str, value: str | None = None,
        force: bool = False,
    ) -> None:
        """Raise what :meth:`resolve` would raise for these arguments, and write nothing (it works on
        a journal opened ``readonly``)."""
        ...

    def resolve(
        self, call_id: str, *, applied: bool, reason: str, operator: str, value: str | None = None,
        force: bool = False,
    ) -> JournalEvent:
        """Settle a ``pending`` or ``unknown`` call as the backend confirmed it: append ``committed``
        (``applied``, with ``value`` as JSON text) or ``released`` by ``operator:NAME``. Raises
        :class:`~journal.errors.CallNotFound` or :class:`~journal.errors.NotResolvable`, changing nothing."""
        ...

    # -- approvals (see guard.approvals) ---------------------------------------------------------

    def approval_step(self, call_id: str, step: ApprovalStep[T]) -> T:
        """In one write transaction that no other write of the call comes between: the call's
        record and its latest request, the events ``step`` chooses from them appended in order (each
        folded into the calls and the requests, durable as ``begin``'s ``pending`` is); returns what
        ``step`` returned. What ``step`` raises is raised, and nothing is appended."""
        ...

    def approval_requests(
        self, *, call_id: str | None = None, request_id: str | None = None, status: str | None = None,
        tool: str | None = None, limit: int | None = None, offset: int = 0,
    ) -> list[ApprovalRequest]:
        """The requests for approval, newest first, filtered by call, request id, status (``open``,
        ``approved``, ``denied``, ``expired``, ``consumed``) and tool; at most ``limit`` (None: all)
        after the first ``offset``."""
        ...

    # -- settling doubt ------------------------------------------------------------------------

    def reconcile(
        self,
        checks: Mapping[str, Check],
        *,
        tool: str | None = None,
        older_than: timedelta | float | None = None,
        dry_run: bool = False,
        timeout: float = DEFAULT_CHECK_TIMEOUT,
    ) -> list[ReconcileResult]:
        """Ask each call in doubt's tool check (``checks`` by tool name) whether its effect happened,
        oldest first, and settle the call as the check says; ``dry_run`` appends nothing."""
        ...

    # -- lifetime ------------------------------------------------------------------------------

    def label(self) -> str:
        """How messages name the journal: a SQLite file's path, a PostgreSQL journal's URL without
        its password."""
        ...

    def close(self) -> None:
        """Close the journal; it cannot be used afterwards. Closing twice is harmless."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...
