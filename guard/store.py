"""The seam between the guard and its storage: events, call records, the fold, the protocols.

The guard decides; a store makes the decision atomic and durable. Every transition reaches the
store as one :class:`EffectEvent`. The current state of a call is :class:`CallRecord`, and
:func:`apply` is the one pure fold from an event to the next record, shared by every store.

:class:`EffectStore` is all a store must be. What it can do beyond that it declares by taking the
protocols of those capabilities as bases (:class:`SettlingStore`, :class:`RecentCalls`,
:class:`AsyncOffload`, :class:`LeasesInBegin`, and :class:`~guard.leases.LeaseStore`); a store
that only has their methods is found to have them too. The guard reads which it has once, when an
:class:`~guard.effect_guard.EffectGuard` is given the store.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from functools import partial
from typing import Any, Protocol, runtime_checkable

from .liveness import process_identity

__all__ = [
    "AsyncOffload",
    "CallRecord",
    "CallStatus",
    "Decision",
    "EffectEvent",
    "EffectStore",
    "EventKind",
    "LeasesInBegin",
    "RecentCalls",
    "Settle",
    "SettlingStore",
    "Verdict",
    "apply",
    "current_owner",
    "format_at",
    "parse_at",
    "utc_now",
]


class EventKind(StrEnum):
    """The six kinds of event, exactly."""

    PENDING = "pending"
    COMMITTED = "committed"
    UNKNOWN = "unknown"
    RELEASED = "released"
    REPLAYED = "replayed"
    REFUSED = "refused"


class CallStatus(StrEnum):
    """The projected status of a call."""

    PENDING = "pending"
    COMMITTED = "committed"
    UNKNOWN = "unknown"
    RELEASED = "released"


# Kinds that move a call's status; `replayed` and `refused` only leave a trace in the log.
TRANSITIONS: frozenset[str] = frozenset({"pending", "committed", "unknown", "released"})
GUARD_ACTOR = "guard"


# The time now, aware in UTC; a partial, so that taking it costs no Python frame.
utc_now: Callable[[], datetime] = partial(datetime.now, UTC)


def format_at(at: datetime) -> str:
    """ISO-8601 in UTC with microseconds and a ``Z``: ``2026-12-01T05:23:06.123456Z``.

    The year always has four digits (``0999-...``), so the texts sort as the moments do.
    """
    # isoformat pads the year; strftime's %Y does not on every platform.
    return at.astimezone(UTC).isoformat(timespec="microseconds")[:-6] + "Z"


def parse_at(text: str) -> datetime:
    """The inverse of :func:`format_at`; also accepts any ISO-8601 string with an offset."""
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    at = datetime.fromisoformat(text)
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC)


_OWNER: dict[str, Any] = process_identity()


def _new_owner() -> None:
    global _OWNER
    _OWNER = process_identity()


def current_owner() -> Mapping[str, Any]:
    """``{host, pid}`` of this process, with ``boot``, ``pid_ns`` and ``start`` where the platform
    tells them (see :mod:`guard.liveness`); shared, so treat it as read-only (a fork gets its own)."""
    if _AT_FORK:
        return _OWNER
    if _OWNER["pid"] != os.getpid():
        _new_owner()
    return _OWNER


# Where the platform can tell us about a fork, the child renews the owner then, and a call
# does not pay for os.getpid().
_AT_FORK = hasattr(os, "register_at_fork")
if _AT_FORK:
    os.register_at_fork(after_in_child=_new_owner)


@dataclass(slots=True)
class EffectEvent:
    """One transition, as the guard (or an operator) hands it to a store. Treat it as immutable
    (it is not frozen only because a frozen dataclass costs microseconds on the hot path).

    ``arguments`` and ``value`` are canonical JSON text (or None); a store keeps them as they are.
    A store assigns ``seq`` (gapless, from 1) and, for a chained journal, ``prev_hash`` and ``hash``.
    """

    kind: str
    call_id: str | None
    tool: str
    at: datetime = field(default_factory=utc_now)
    agent_id: str | None = None
    idempotency_key: str | None = None
    arguments: str | None = None
    value: str | None = None
    error: Mapping[str, Any] | None = None
    reason: Mapping[str, Any] | None = None
    actor: str = GUARD_ACTOR
    attempt: int = 0
    owner: Mapping[str, Any] = field(default_factory=current_owner)
    seq: int = 0  # 0 until a store has appended it


@dataclass(slots=True)
class CallRecord:
    """The current state of one call: one row of the projection.

    ``value`` is the stored JSON text of the committed value; ``None`` when there is none
    (not committed, a value that could not be stored, or an operator's confirmation without one).
    ``since`` is when the call entered its current status.
    """

    call_id: str
    tool: str
    status: str
    attempt: int
    agent_id: str | None
    idempotency_key: str | None
    arguments: str | None
    value: str | None
    error: Mapping[str, Any] | None
    reason: Mapping[str, Any] | None
    actor: str
    owner: Mapping[str, Any] | None
    created_at: datetime
    updated_at: datetime
    since: datetime
    last_seq: int = 0


def apply(record: CallRecord | None, event: EffectEvent, seq: int = 0) -> CallRecord | None:
    """Fold one event into a call's record: the projection is ``reduce(apply, log)``.

    - ``replayed`` and ``refused`` never change a record, nor create one.
    - ``pending`` starts the attempt it names (a new record at its first attempt).
    - ``committed``, ``unknown`` and ``released`` are outcomes: taken only when their attempt is
      the call's current one, so a late outcome of an older attempt stays in the log alone.
    - Once an operator has confirmed the effect (``committed`` by ``operator:NAME``), only another
      ``committed`` is taken: a tool that was still running and then fails cannot make the call
      one that may run again, nor refuse the replays of a value the operator gave.
    """
    kind = event.kind
    if kind not in TRANSITIONS or event.call_id is None:
        return record
    if kind == "pending":
        if record is None:
            return CallRecord(
                event.call_id, event.tool, "pending", event.attempt, event.agent_id, event.idempotency_key,
                event.arguments, None, None, None, event.actor, event.owner, event.at, event.at, event.at, seq,
            )
        return CallRecord(
            record.call_id, record.tool, "pending", event.attempt, event.agent_id, record.idempotency_key,
            record.arguments, None, None, None, event.actor, event.owner, record.created_at, event.at, event.at,
            seq,
        )
    if record is None or event.attempt != record.attempt:
        return record
    if record.status == "committed" and kind != "committed" and record.actor.startswith("operator:"):
        return record
    return CallRecord(
        record.call_id, record.tool, kind, record.attempt, record.agent_id, record.idempotency_key,
        record.arguments, event.value if kind == "committed" else None, event.error, event.reason, event.actor,
        event.owner, record.created_at, event.at, event.at if kind != record.status else record.since, seq,
    )


class Verdict(StrEnum):
    """What the replay table decided for one attempt."""

    RUN = "run"
    REPLAY = "replay"
    REFUSE = "refuse"


@dataclass(slots=True)
class Decision:
    """The outcome of :meth:`EffectStore.begin`.

    ``event`` is what the store appends in the same atomic step (``pending`` for RUN,
    ``replayed`` for REPLAY, ``refused`` for REFUSE). ``record`` is the record the decision was
    taken on (None for a call never seen). For a refusal, ``code``, ``message`` and ``details``
    say why.
    """

    verdict: Verdict
    event: EffectEvent
    record: CallRecord | None = None
    code: str | None = None
    message: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def attempt(self) -> int:
        return self.event.attempt


Decide = Callable[[CallRecord | None], Decision]


@runtime_checkable
class EffectStore(Protocol):
    """Where calls' statuses live. Implement these three methods for another backend.

    ``begin`` is the one atomic step: read the record of ``call_id``, call ``decide`` with it
    (None for a call never seen), append ``decision.event`` and fold it into the record, in one
    step that no other ``begin`` for that id can interleave with; then return the decision.
    ``decide`` is pure and fast; it may be called again if the store retries its transaction.
    When ``begin`` returns a RUN decision, its ``pending`` event must be durable.
    Raise any ``Exception`` when the store cannot do it: the guard then refuses the call
    ``store_unavailable`` and does not run the tool.

    ``append`` records an outcome (``committed``, ``unknown``, ``released``) or a ``refused``
    event outside ``begin``; ``get`` returns a call's current record or None.
    """

    def begin(self, call_id: str, decide: Decide) -> Decision: ...

    def append(self, event: EffectEvent) -> None: ...

    def get(self, call_id: str) -> CallRecord | None: ...


# -- what a store may declare beside EffectStore ------------------------------------------------

# The callback of :meth:`SettlingStore.settle`: given the call's record (None for a call never
# seen), the event to append, or None.
Settle = Callable[[CallRecord | None], EffectEvent | None]


@runtime_checkable
class SettlingStore(Protocol):
    """A store that can settle a call in doubt by itself, without an operator.

    ``settle`` reads the call's record, calls ``choose`` with it (None for a call never seen) and
    appends the event ``choose`` returns, in one atomic step that no other write of the call can
    interleave with; it returns the ``seq`` appended, or None when ``choose`` chose none. What
    ``choose`` raises is raised, and nothing is appended.

    A store that declares it lets a retry run the tool's check on a call in doubt before refusing
    it (``EffectGuard(reconcile_on_retry=True)``), and ``reconcile`` settle its calls.
    """

    def settle(self, call_id: str, choose: Settle) -> int | None: ...


@runtime_checkable
class RecentCalls(Protocol):
    """A store that can look a call up by its agent and idempotency key.

    ``recent_call`` returns the most recent call of ``agent_id`` (None matches the calls made
    without one) with ``idempotency_key``, whose ``created_at`` is at or after ``since`` (aware, UTC)
    and whose status is not ``released``; or None. A store that declares it can be given
    ``EffectGuard(duplicate_window=...)``, which makes the lookup just before ``begin``.
    """

    def recent_call(self, agent_id: str | None, idempotency_key: str, since: datetime) -> CallRecord | None: ...


@runtime_checkable
class AsyncOffload(Protocol):
    """A store that says where an ``async def`` tool's store work is made.

    ``offload_async`` True: the store's calls may wait for a network or a lock, and it is safe to
    call from several threads at once, so ``begin`` and ``append`` of an ``async def`` tool are made
    in the guard's own threads, off the event loop (:mod:`guard.offload`). False: in the loop's
    thread. It is read at each call, so it may be changed on a store in use.
    """

    offload_async: bool


@runtime_checkable
class LeasesInBegin(EffectStore, Protocol):
    """An :class:`EffectStore` that keeps a call's lease (:mod:`guard.leases`) in the transactions of
    its events, so that a lease costs no write of its own.

    ``begin(..., lease=(holder, seconds))`` takes ``holder``'s lease on the call for ``seconds`` in
    the transaction that records the decision, when that decision records ``pending`` (and takes
    none otherwise). ``append(..., drop_lease=holder)`` drops that lease in the transaction of the
    outcome. Without either argument they are :class:`EffectStore`'s. ``leases_in_begin`` is True
    when the store does so (a store may turn it off); the guard uses it only with a ``lease``, on a
    store that is a :class:`~guard.leases.LeaseStore` too, and reads it once, when the guard is made.
    """

    leases_in_begin: bool

    def begin(self, call_id: str, decide: Decide, lease: tuple[str, float] | None = None) -> Decision: ...

    def append(self, event: EffectEvent, drop_lease: str | None = None) -> None: ...
