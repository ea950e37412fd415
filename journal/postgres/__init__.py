"""PostgresJournal: an EffectStore on PostgreSQL, for replicas of an agent on many hosts.

Every write of a call takes that call's lock, reads its projection row, decides and writes, so two
``begin`` for one call id can never interleave, and writes of other calls never wait on it. The
event goes into the hash-chained log at once when no other session is sealing, else (and for a
while after, as long as others append) into the inbox, which is sealed into the log (the next
``seq``, the hash of the one before) within tens of milliseconds, in the order each call's events
were written: ``seq`` stays gapless and the chain unbroken under any number of writers (see
:mod:`journal.postgres.sealing`). A guard's write is one call of a function that appends on the
server (one round trip); where that function cannot be made, a transaction that locks the call and
then reads (two). docs/postgres.md explains both. Only ``pending`` is committed synchronously.

While the server cannot be reached, writes raise :class:`~journal.errors.JournalError` within
the connect timeout (the guard refuses the call ``store_unavailable`` and runs nothing); after
it comes back the pool replaces its dead connections and the journal carries on.
"""

from .store import PostgresJournal

__all__ = ["PostgresJournal"]
