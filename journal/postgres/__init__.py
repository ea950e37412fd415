"""PostgresJournal: an EffectStore on PostgreSQL, for replicas of an agent on many hosts.

Every append moves the one ``chain_head`` row in the transaction that inserts the event (with the
next ``seq`` and its hash) and updates the call's projection row, so that row's lock orders all
appends: ``seq`` stays gapless and the chain unbroken under any number of writers, and two
``begin`` for one call id can never interleave. Right after this object's own write, a write is one
compare-and-set of the head (one round trip); while other replicas write, one call of a function
that appends on the server under the head's lock (one round trip, the lock held only there); and
where that function cannot be made, or to settle a compare-and-set cut off in doubt, a transaction
that locks the head and then reads (two round trips). docs/postgres.md explains all three. Only
``pending`` is committed synchronously.

While the server cannot be reached, writes raise :class:`~journal.errors.JournalError` within
the connect timeout (the guard refuses the call ``store_unavailable`` and runs nothing); after
it comes back the pool replaces its dead connections and the journal carries on.
"""

from .store import PostgresJournal

__all__ = ["PostgresJournal"]
