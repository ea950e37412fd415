"""The tables of archiving, as SQLite version 7 lays them out.

``archives`` has a row per archive: ``last_seq`` and ``last_hash`` say where the log starts now,
``upto_seq`` and ``upto_hash`` how far the archive's file goes. The events are removed in short
steps from the bottom, each step moving ``last_seq`` on; a row whose ``last_seq`` is below its
``upto_seq`` is an archive whose removal was stopped half-way (the next archive finishes it).

``calls_archived`` holds the projection as of the log's start, copy-on-write: a call's row there
only once its row in ``calls`` changed (or went) after that point. Every other call's row in
``calls`` is its own row as of the start, so the snapshot costs a row per call that moved, not a
second copy of every call. The triggers below take the copy, in the transaction that changes the
row, whoever changes it (the guard, an operator, rebuild, or someone editing the file by hand).
"""

from __future__ import annotations

import sqlite3

from ..rows import CALL_COLUMNS

__all__ = ["COPY_ON_WRITE", "record_of", "sqlite_v7"]


def record_of(alias: str) -> str:
    """The JSON array of a projection row's columns but ``call_id``: a row of calls_archived."""
    return f"json_array({', '.join(f'{alias}.{c}' for c in CALL_COLUMNS[1:])})"


# The start of the log is the highest last_seq of archives (none: nothing archived, nothing kept).
_KEEP = (
    "INSERT INTO calls_archived (call_id, record) SELECT OLD.call_id, {record} "
    "WHERE NOT EXISTS (SELECT 1 FROM calls_archived WHERE call_id = OLD.call_id)"
)
_WHEN = "OLD.last_seq <= (SELECT max(last_seq) FROM archives)"
COPY_ON_WRITE = tuple(
    f"CREATE TRIGGER calls_keep_archived_on_{op.lower()} BEFORE {op} ON calls WHEN {_WHEN} "
    f"BEGIN {_KEEP.format(record=record_of('OLD'))}; END"
    for op in ("UPDATE", "DELETE")
)


def sqlite_v7(conn: sqlite3.Connection) -> None:
    """Version 7: archives removed in steps, and the archived projection kept copy-on-write.

    A journal archived by version 6 kept a full copy of every call's row; the copies equal to the
    call's row of today are let go here (a call whose row moved keeps its copy)."""
    conn.execute("ALTER TABLE archives ADD COLUMN upto_seq INTEGER")
    conn.execute("ALTER TABLE archives ADD COLUMN upto_hash TEXT")
    conn.execute(
        "DELETE FROM calls_archived WHERE call_id IN (SELECT c.call_id FROM calls c JOIN calls_archived a "
        f"ON a.call_id = c.call_id WHERE c.last_seq <= (SELECT max(last_seq) FROM archives) "
        f"AND a.record = {record_of('c')})"
    )
    for trigger in COPY_ON_WRITE:
        conn.execute(trigger)
