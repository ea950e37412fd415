"""The journal's one error tree: every storage error reaches a caller as a :class:`JournalError`."""

from __future__ import annotations

__all__ = [
    "CallNotFound",
    "DiskFull",
    "JournalDamaged",
    "JournalError",
    "JournalNotFound",
    "NewerSchema",
    "NotAJournal",
    "NotResolvable",
    "StoreBusy",
]


class JournalError(Exception):
    """Something went wrong in a journal; the message is one sentence naming the journal."""


class JournalNotFound(JournalError):
    """A read (or an open with ``create=False``) of a journal that does not exist."""


class NotAJournal(JournalError):
    """The file or database exists but is not an airlock journal; it was left unchanged."""


class NewerSchema(JournalError):
    """The journal was written by a newer version of this library; it was left unchanged."""


class CallNotFound(JournalError):
    """No call with that id is in the journal."""


class NotResolvable(JournalError):
    """The call cannot be resolved: it is not pending or unknown, or its owner process is alive."""


class StoreBusy(JournalError):
    """The journal's write lock was not obtained before the busy deadline."""


class DiskFull(JournalError):
    """The file system holding the journal has no room left; nothing was changed."""


class JournalDamaged(JournalError):
    """The journal's file is known to be damaged (SQLite found it malformed): it refuses writes
    until it is restored."""


def unstorable(journal: str, e: ValueError) -> JournalError:
    """The error for an event with a text that has no UTF-8 form (a lone surrogate in an id, say),
    which no journal can store; ``e`` is the encoder's error."""
    why = f"a text in it is not valid UTF-8: {e.reason}" if isinstance(e, UnicodeEncodeError) else str(e)
    return JournalError(f"The journal {journal} cannot store this event: {why}.")
