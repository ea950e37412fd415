"""Checkpoints: the head of a journal (``seq``, ``hash``, ``at``) written down at a moment, to be
kept or published somewhere the journal's writers cannot reach.

The chain makes every event's hash depend on all the events before it, so a journal that still
holds the checkpoint's ``seq`` with the checkpoint's ``hash`` has not lost or rewritten anything up
to that point; one that does not was cut short or rewritten. A checkpoint may be signed
(:mod:`journal.signing`); its signature covers every member but ``signature``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .chain import GENESIS
from .events import JournalEvent, at_text

if TYPE_CHECKING:
    from .protocol import Journal

__all__ = ["FORMAT", "archived_start", "checkpoint_problem", "line_problem", "make_checkpoint", "malformed"]

FORMAT = "airlock-journal checkpoint 1"

_HASH = re.compile(r"[0-9a-f]{64}")


def _event_at(journal: Journal, seq: int) -> JournalEvent | None:
    """Event ``seq`` of ``journal``, or None when the log does not hold it."""
    event = next(iter(journal.events(after_seq=seq - 1)), None)
    return event if event is not None and event.seq == seq else None


def make_checkpoint(journal: Journal, now: datetime | None = None) -> dict[str, Any]:
    """The checkpoint of ``journal``'s head: ``format``, ``seq``, ``hash``, ``at`` (the head event's
    time; null for an empty journal) and ``created_at`` (``now``, default the current time)."""
    seq, head_hash = journal.head()
    at = None
    if seq:
        event = _event_at(journal, seq)
        at = None if event is None else at_text(event.at)
    return {
        "format": FORMAT, "seq": seq, "hash": head_hash, "at": at,
        "created_at": at_text(now if now is not None else datetime.now(UTC)),
    }


def malformed(checkpoint: Mapping[str, Any]) -> str | None:
    """Why ``checkpoint`` is not a checkpoint, as a phrase; None when it is one."""
    if checkpoint.get("format") != FORMAT:
        return f"its format is {checkpoint.get('format')!r}, not {FORMAT!r}"
    seq, head_hash = checkpoint.get("seq"), checkpoint.get("hash")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        return f"its seq {seq!r} is not a number, 0 or more"
    if not isinstance(head_hash, str) or not _HASH.fullmatch(head_hash):
        return f"its hash {head_hash!r} is not 64 lowercase hex digits"
    if seq == 0 and head_hash != GENESIS:
        return "it is of an empty journal (seq 0) but its hash is not the first prev_hash (64 zeros)"
    return None


def archived_start(journal: Journal, checkpoint: Mapping[str, Any]) -> int | None:
    """The ``seq`` of the last event ``journal`` has archived (let go of into an archive file),
    when the checkpoint's ``seq`` is one of them: the journal alone cannot check it; None otherwise."""
    seq = checkpoint["seq"]
    if not seq:
        return None
    start = int(journal.archived_head()[0])
    return start if seq <= start else None


def line_problem(checkpoint: Mapping[str, Any], seq_hash: str, at: str | None, where: str) -> str | None:
    """Why event ``seq`` as ``where`` holds it (its ``hash`` and ``at``) does not match
    ``checkpoint``, as a sentence; None when it does."""
    seq, head_hash, made_at = checkpoint["seq"], checkpoint["hash"], checkpoint.get("at")
    if seq_hash != head_hash:
        return (f"event seq {seq} in {where} has the hash {seq_hash}, not the checkpoint's {head_hash}: the log has "
                f"been rewritten at or before seq {seq} since the checkpoint")
    if made_at is not None and at != made_at:
        return (f"event seq {seq} in {where} is at {at}, not at the checkpoint's {made_at}: the checkpoint has "
                "been altered")
    return None


def checkpoint_problem(journal: Journal, checkpoint: Mapping[str, Any]) -> str | None:
    """Why ``journal`` no longer matches ``checkpoint`` (which :func:`malformed` accepts), as a
    sentence; None when its event ``seq`` is there with the checkpoint's ``hash`` (and ``at``).

    A checkpoint whose ``seq`` the journal has archived cannot be checked against the journal
    alone (:func:`archived_start` tells it): the sentence then says so, and that the archives
    check it; it is no sign of tampering."""
    seq = checkpoint["seq"]
    if seq == 0:
        return None
    event = _event_at(journal, seq)
    if event is None:
        end = journal.head()[0]
        if end < seq:
            return (f"the log ends at seq {end}, before the checkpoint's seq {seq}: events have been removed "
                    "from the end since the checkpoint")
        start = archived_start(journal, checkpoint)
        if start is not None:
            return (f"its seq {seq} was archived (the log starts after seq {start}): check the checkpoint against "
                    "the archives (verify --checkpoint FILE --export ARCHIVE ... --db JOURNAL)")
        return f"the log has no event seq {seq}, which the checkpoint records"
    if event.hash != checkpoint["hash"]:
        return (f"event seq {seq} has the hash {event.hash}, not the checkpoint's {checkpoint['hash']}: the log has "
                f"been rewritten at or before seq {seq} since the checkpoint")
    at = checkpoint.get("at")
    if at is not None and at_text(event.at) != at:
        return (f"event seq {seq} is at {at_text(event.at)}, not at the checkpoint's {at}: the checkpoint has "
                "been altered")
    return None
