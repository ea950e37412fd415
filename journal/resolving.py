"""Settling a call and resolving it by hand: written once for both SQL journals.

Each store gives one primitive, ``append_chosen``: in one write transaction, read the call's
record, let a function choose the event from it (and from whether the owner of the pending call is
alive, asked only when needed), and append that event after the log's head. :class:`Resolver` is
built on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from guard.canonical import NotCanonical
from guard.leases import OwnerState, Settle
from guard.store import CallRecord, EffectEvent

from .errors import unstorable
from .events import JournalEvent
from .rows import holds, operator_event

__all__ = ["AppendChosen", "Choose", "Resolver", "check_resolve", "stored_event"]

# Chooses the event to append from the call's record and a question: is its owner alive?
Choose = Callable[[CallRecord | None, Callable[[], bool | None]], EffectEvent | None]

# A store's primitive: ``append_chosen(doing, call_id, choose)``, in one write transaction, the
# call's record, the event ``choose`` makes of it (None: nothing is written) appended; returns the
# stored event.
AppendChosen = Callable[[str, str, Choose], JournalEvent | None]


def stored_event(event: EffectEvent, seq: int, prev_hash: str, digest: str) -> JournalEvent:
    """``event`` as the journal stored it at ``seq``."""
    return JournalEvent(
        seq=seq, at=event.at, call_id=event.call_id, kind=event.kind, tool=event.tool, agent_id=event.agent_id,
        idempotency_key=event.idempotency_key, arguments=event.arguments, value=event.value,
        error=None if event.error is None else dict(event.error),
        reason=None if event.reason is None else dict(event.reason), actor=event.actor, attempt=event.attempt,
        owner=None if event.owner is None else dict(event.owner), prev_hash=prev_hash, hash=digest,
    )


def check_resolve(
    get: Callable[[str], CallRecord | None], owner_states: Callable[[list[CallRecord]], dict[str, OwnerState]],
    label: str, call_id: str, *, applied: bool, reason: str, operator: str, value: str | None = None,
    force: bool = False,
) -> None:
    """Raise what ``resolve`` would raise for these arguments, on the call's current record (read
    with ``get``, its owner judged by ``owner_states``), and write nothing."""
    record = get(call_id)
    owner_alive: bool | None = None
    if record is not None and record.status == "pending":
        owner_alive = owner_states([record])[record.call_id].alive
    operator_event(call_id, record, applied=applied, reason=reason, operator=operator,
                   value=value, force=force, journal=label, owner_alive=owner_alive)


class Resolver:
    """``settle`` (a reconciler's compare-and-set) and ``resolve`` (an operator's) on a store's
    ``append_chosen``; ``check_resolve`` on its ``get`` and ``owner_states``. ``label`` names the
    journal in messages; ``nul``: whether the database holds a NUL in a text."""

    def __init__(self, append_chosen: AppendChosen, label: str, nul: bool,
                 get: Callable[[str], CallRecord | None],
                 owner_states: Callable[[list[CallRecord]], dict[str, OwnerState]]) -> None:
        self._append_chosen = append_chosen
        self._label = label
        self._nul = nul
        self._get = get
        self._owner_states = owner_states

    def settle(self, call_id: str, choose: Settle) -> int | None:
        """Read the call's record, let ``choose`` make the event, append it; in one write
        transaction. Returns the ``seq`` appended (None when ``choose`` chose none)."""
        if not holds(call_id, nul=self._nul):  # no call has it
            choose(None)
            return None
        try:
            stored = self._append_chosen("settle the call", call_id, lambda record, _: choose(record))
        except (UnicodeEncodeError, NotCanonical) as e:
            raise unstorable(self._label, e) from e
        return None if stored is None else stored.seq

    def resolve(
        self,
        call_id: str,
        *,
        applied: bool,
        reason: str,
        operator: str,
        value: str | None = None,
        force: bool = False,
    ) -> JournalEvent:
        """Settle a ``pending`` or ``unknown`` call as the backend confirmed it.

        ``applied=True`` appends ``committed`` (with ``value``, JSON text, stored canonicalised; None
        for none), ``applied=False`` appends ``released``; by ``operator:NAME`` at the call's attempt,
        its status checked in the same transaction. Raises :class:`CallNotFound`,
        :class:`NotResolvable` (another status, or a pending call whose owner is alive, by its lease
        and its process as :mod:`journal.leasing` judges them; unless ``force``), ``ValueError`` for a ``value``
        that is not JSON or given with ``applied=False``. Nothing changes when it raises.
        """
        arguments: dict[str, Any] = {"applied": applied, "reason": reason, "operator": operator, "value": value,
                                     "force": force, "journal": self._label}
        if not holds(call_id, nul=self._nul):  # no call has it: what is wrong with the arguments, else CallNotFound
            operator_event(call_id, None, **arguments)
        stored = self._append_chosen("resolve the call", call_id, lambda record, owner_alive: operator_event(
            call_id, record, owner_alive=owner_alive(), **arguments))
        assert stored is not None  # operator_event makes an event or raises
        return stored

    def check_resolve(
        self, call_id: str, *, applied: bool, reason: str, operator: str, value: str | None = None,
        force: bool = False,
    ) -> None:
        """Raise what :meth:`resolve` would raise for these arguments, on the call's current record,
        and write nothing: a check that also works on a journal opened ``readonly``, so a resolve
        that is refused changes nothing at all (not even an older journal's schema version)."""
        check_resolve(self._get, self._owner_states, self._label, call_id, applied=applied, reason=reason,
                      operator=operator, value=value, force=force)
