"""Durable EffectStores on an append-only, hash-chained event log."""

from .errors import (
    CallNotFound,
    DiskFull,
    JournalDamaged,
    JournalError,
    JournalNotFound,
    NewerSchema,
    NotAJournal,
    NotResolvable,
    StoreBusy,
)
from .events import JournalEvent, JournalStats, VerifyReport
from .open import open_journal
from .protocol import Journal
from .sqlite import SQLiteJournal

__all__ = [
    "CallNotFound",
    "DiskFull",
    "Journal",
    "JournalDamaged",
    "JournalError",
    "JournalEvent",
    "JournalNotFound",
    "JournalStats",
    "NewerSchema",
    "NotAJournal",
    "NotResolvable",
    "SQLiteJournal",
    "StoreBusy",
    "VerifyReport",
    "open_journal",
]
