"""The SQLite journal: an EffectStore on one file that processes on one host share.

Writes run in ``BEGIN IMMEDIATE`` transactions on a WAL database; the event insert and the
projection update share one. The transactions of a guarded call commit with ``synchronous=NORMAL``.
With ``durability="full"``, ``begin`` then waits, before it lets the tool run, until the WAL file has
been fsynced after that commit: the first waiting thread fsyncs it for every commit made so far while
the others wait for it (group commit), so a guarded call costs one fsync, and calls made at the same
time by several threads share one. Every other event becomes durable with the next fsync.
"""

from .store import SQLiteJournal

__all__ = ["SQLiteJournal"]
