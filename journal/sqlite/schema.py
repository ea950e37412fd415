"""The SQLite schema of a journal, its version, and how an existing file is recognised and migrated.

A journal is marked twice: ``PRAGMA application_id`` and a ``meta`` table naming the application.
``PRAGMA user_version`` is the schema version; ``MIGRATIONS[v]`` takes a journal from ``v - 1`` to ``v``.
"""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import sqlite_utils

from guard.approvals import APPROVAL_KINDS

from ..errors import JournalError
from . import archive_schema, lease_clock

__all__ = [
    "APPLICATION",
    "APPLICATION_ID",
    "LATEST",
    "MIGRATIONS",
    "NO_DELETE_TRIGGER",
    "OPENING",
    "READABLE_FROM",
    "SIDE_ROOM",
    "FileKind",
    "full_disk_error",
    "inspect",
    "migrate",
    "no_room",
    "read_kind",
    "reader_uri",
    "readonly_uri",
]

APPLICATION = "airlock-journal"
APPLICATION_ID = 0x41524C4B  # "ARLK"
_HEADER = b"SQLite format 3\x00"
# Held while this process opens a descriptor of a journal file: closing any descriptor of a file
# drops every POSIX lock the process holds on it, SQLite's included (see inspect).
OPENING = threading.Lock()
KINDS = ("pending", "committed", "unknown", "released", "replayed", "refused")
STATUSES = ("pending", "committed", "unknown", "released")


def _kinds(names: tuple[str, ...]) -> str:
    return ", ".join(f"'{n}'" for n in names)


_V1 = f"""
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
INSERT INTO meta (key, value) VALUES ('application', '{APPLICATION}');
CREATE TABLE events (
    seq INTEGER PRIMARY KEY,
    at TEXT NOT NULL,
    call_id TEXT,
    kind TEXT NOT NULL CHECK (kind IN ({_kinds(KINDS)})),
    tool TEXT NOT NULL,
    agent_id TEXT,
    idempotency_key TEXT,
    arguments TEXT,
    value TEXT,
    error TEXT,
    reason TEXT,
    actor TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    owner TEXT,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE INDEX events_call_id ON events (call_id, seq);
CREATE TRIGGER events_no_update BEFORE UPDATE ON events
BEGIN
    SELECT RAISE(ABORT, 'the event log is append-only: an event cannot be changed');
END;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events
BEGIN
    SELECT RAISE(ABORT, 'the event log is append-only: an event cannot be deleted');
END;
CREATE TABLE calls (
    call_id TEXT PRIMARY KEY,
    tool TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ({_kinds(STATUSES)})),
    attempt INTEGER NOT NULL,
    agent_id TEXT,
    idempotency_key TEXT,
    arguments TEXT,
    value TEXT,
    error TEXT,
    reason TEXT,
    actor TEXT NOT NULL,
    owner TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    since TEXT NOT NULL,
    last_seq INTEGER NOT NULL
);
CREATE INDEX calls_updated_at ON calls (updated_at DESC, call_id);
"""


def _create_v1(conn: sqlite3.Connection) -> None:
    # executescript would COMMIT the open transaction; run the statements one by one inside it.
    for statement in _split(_V1):
        conn.execute(statement)


def _split(script: str) -> list[str]:
    statements, current = [], ""
    for line in script.strip().splitlines():
        current += line + "\n"
        if sqlite3.complete_statement(current):
            statements.append(current.strip())
            current = ""
    return statements


def _v2_no_replace(conn: sqlite3.Connection) -> None:
    # INSERT OR REPLACE deletes the old row without firing the DELETE trigger: refuse it up front.
    conn.execute(
        "CREATE TRIGGER events_no_replace BEFORE INSERT ON events "
        "WHEN EXISTS (SELECT 1 FROM events WHERE seq = NEW.seq) "
        "BEGIN SELECT RAISE(ABORT, 'the event log is append-only: an event cannot be replaced'); END"
    )


def _v3_updated_at_ascending(conn: sqlite3.Connection) -> None:
    # Descending, every new entry goes to the index's leftmost leaf, which SQLite splits and
    # rebalances with its siblings about every other insert (four pages written, not one);
    # ascending, entries are appended at the right edge, and newest-first reads scan it backwards.
    conn.execute("DROP INDEX calls_updated_at")
    conn.execute("CREATE INDEX calls_updated_at ON calls (updated_at, call_id)")


def _v4_leases(conn: sqlite3.Connection) -> None:
    # Operational state beside the log, never events: a running call's lease, renewed while its tool
    # runs, tells a live owner from a gone one on any host or in any PID namespace. A call may have
    # several (a retry takes its own while it decides); the call's owner is alive while any is.
    conn.execute(
        "CREATE TABLE leases (call_id TEXT NOT NULL, holder TEXT NOT NULL, expires_at REAL NOT NULL, "
        "PRIMARY KEY (call_id, holder)) WITHOUT ROWID"
    )


def _v5_calls_by_key(conn: sqlite3.Connection) -> None:
    # The lookup of a duplicate window: an agent's recent calls with one idempotency key.
    conn.execute("CREATE INDEX calls_idempotency_key ON calls (idempotency_key, created_at)")


# The delete trigger of version 1, which an archive drops and makes again in its own transaction.
NO_DELETE_TRIGGER = (
    "CREATE TRIGGER events_no_delete BEFORE DELETE ON events "
    "BEGIN SELECT RAISE(ABORT, 'the event log is append-only: an event cannot be deleted'); END"
)


def _v6_archives(conn: sqlite3.Connection) -> None:
    # Archiving moves the oldest events out of the log: each archive's head (its last seq and hash,
    # where the log now starts) is kept, and the projection as of that head, which the rest of the
    # log is folded onto by rebuild and verify.
    conn.execute(
        "CREATE TABLE archives (last_seq INTEGER PRIMARY KEY, last_hash TEXT NOT NULL, events INTEGER NOT NULL, "
        "archived_at TEXT NOT NULL, file TEXT NOT NULL)"
    )
    # A call's row as of the head: its id, and the other columns of calls as one JSON array.
    conn.execute("CREATE TABLE calls_archived (call_id TEXT PRIMARY KEY, record TEXT NOT NULL) WITHOUT ROWID")


def _v8_lease_clock(conn: sqlite3.Connection) -> None:
    # Leases timed by the kernel's boot clock, which a step of the wall clock does not move; meta
    # names the boot whose clock they are on (see lease_clock).
    lease_clock.adopt(conn)


# The kinds of event of version 9 on: the approvals' own beside the calls'.
KINDS_V9 = KINDS + APPROVAL_KINDS
_KIND_CHECK = re.compile(r"CHECK \(kind IN \(([^()]*)\)\)")


def _v9_approvals(conn: sqlite3.Connection) -> None:
    """Version 9: approvals that wait for a human (guard.approvals).

    The log takes the approvals' five kinds of event. SQLite cannot alter a CHECK constraint: the
    events table's text in the schema is edited in place (``PRAGMA writable_schema``), as SQLite's
    documentation allows for a constraint that only gets looser (every row already meets the wider
    one): the table, its rows, indexes and append-only triggers stay as they are, and no event is
    copied. The schema's version cookie is moved on in the same transaction, so every other
    connection reads the new text before its next statement. Then the projection of requests
    (journal.approvals) and the requests kept as of an archive's head."""
    row = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'events'").fetchone()
    found = _KIND_CHECK.findall(row[0]) if row is not None else []
    if len(found) != 1:
        raise JournalError("the journal's events table is not the one airlock-journal made (its CHECK on kind "
                           "cannot be found); it was left unchanged")
    wide = f"CHECK (kind IN ({_kinds(KINDS_V9)}))"
    if wide not in row[0]:  # made again harmlessly on a journal whose version was set back by hand
        cookie = conn.execute("PRAGMA schema_version").fetchone()[0]
        conn.execute("PRAGMA writable_schema = ON")
        try:
            conn.execute("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = 'events'",
                         (_KIND_CHECK.sub(wide, row[0]),))
            conn.execute(f"PRAGMA schema_version = {int(cookie) + 1}")
        finally:
            conn.execute("PRAGMA writable_schema = OFF")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS approvals (request_id TEXT PRIMARY KEY, call_id TEXT NOT NULL, "
        "tool TEXT NOT NULL, status TEXT NOT NULL, requested_at TEXT NOT NULL, first_seq INTEGER NOT NULL, "
        "last_seq INTEGER NOT NULL, request TEXT NOT NULL)"
    )
    conn.execute("CREATE INDEX IF NOT EXISTS approvals_call_id ON approvals (call_id, first_seq)")
    conn.execute("CREATE INDEX IF NOT EXISTS approvals_status ON approvals (status, first_seq)")
    conn.execute("CREATE INDEX IF NOT EXISTS approvals_tool ON approvals (tool, first_seq)")
    conn.execute("CREATE INDEX IF NOT EXISTS approvals_first_seq ON approvals (first_seq)")
    conn.execute("CREATE TABLE IF NOT EXISTS approvals_archived (request_id TEXT PRIMARY KEY, request TEXT NOT NULL) "
                 "WITHOUT ROWID")


MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _create_v1, 2: _v2_no_replace, 3: _v3_updated_at_ascending, 4: _v4_leases, 5: _v5_calls_by_key,
    6: _v6_archives, 7: archive_schema.sqlite_v7, 8: _v8_lease_clock, 9: _v9_approvals,
}
LATEST = max(MIGRATIONS)
# The oldest version a read-only open can read as it is (versions 2 and 3 changed no table; a
# journal without the leases of version 4 is read with the host-and-pid test of a call's owner;
# version 5 added an index only; a journal without the archives of version 6 has none; one before
# version 8 has its leases on the wall clock; one before version 9 has no approvals, nor any of
# their events, which its CHECK on kind refuses).
READABLE_FROM = 1


@dataclass(frozen=True, slots=True)
class FileKind:
    """What an existing file is: ``blank`` (empty, a journal may be made in it), ``journal`` (of
    ``version``), or ``foreign`` (with ``why``: a sentence fragment)."""

    kind: str
    version: int = 0
    why: str = ""
    damaged: bool = False  # foreign because SQLite found it malformed, or not a database at all


def has_approvals(conn: sqlite3.Connection) -> bool:
    """Whether the journal has the requests for approval (a journal of a version before them, read
    as it is, has not)."""
    found = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'approvals'").fetchone()
    return found is not None


def read_kind(conn: sqlite3.Connection) -> FileKind:
    """Classify the database behind ``conn`` without writing to it."""
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = set(sqlite_utils.Database(conn, recursive_triggers=False, execute_plugins=False).table_names())
    # Blank means nothing in it at all: a database of views alone is someone else's too.
    empty = not tables and conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)
    if empty and app_id == 0 and version == 0:
        return FileKind("blank")
    marked = "meta" in tables and conn.execute(
        "SELECT value FROM meta WHERE key = 'application'"
    ).fetchone() == (APPLICATION,)
    if app_id not in (0, APPLICATION_ID) or not marked:
        return FileKind("foreign", why="is a SQLite database of another application")
    return FileKind("journal", version)


# SQLite maps a WAL journal's -shm file in pieces of 32 KiB, and makes it (with an empty -wal) beside
# a journal that has none as soon as the journal is read the ordinary way.
SIDE_ROOM = 32 * 1024
_NO_ROOM = (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_FULL, sqlite3.SQLITE_CANTOPEN)


def no_room(path: Path) -> bool:
    """Whether the file system holding ``path`` has too little room left (or no inode) for the
    files SQLite makes beside a journal; False where that cannot be told."""
    try:
        st = os.statvfs(path.parent)
    except (OSError, AttributeError):  # no statvfs on this platform
        return False
    root = getattr(os, "geteuid", lambda: -1)() == 0
    free = (st.f_bfree if root else st.f_bavail) * st.f_frsize  # root may use the blocks kept for it
    return free < SIDE_ROOM or (st.f_files > 0 and st.f_favail == 0)


def full_disk_error(path: Path, e: sqlite3.Error) -> bool:
    """Whether SQLite's ``e`` on the journal at ``path`` is its file system being full (an I/O
    error making the -shm file, say), not something wrong with the file itself."""
    return (getattr(e, "sqlite_errorcode", 0) & 0xFF) in _NO_ROOM and no_room(path)


def inspect(path: Path, timeout: float = 5.0) -> FileKind:
    """Classify the file at ``path`` (which exists) through a read-only connection; changes nothing
    in it. A file of zero bytes is blank.

    Raises ``OSError`` when the file cannot be read (``ENOSPC`` when its file system is too full to
    open it), and ``sqlite3.OperationalError`` when it stays locked by another process for
    ``timeout`` seconds (a busy file is not a foreign one).
    """
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(mode):  # a FIFO would block the read below until a writer comes
        return FileKind("foreign", why="is not a regular file")
    with OPENING:
        header = None if _open_here(path) else _header(path)
    if header is not None:
        if not header:
            return FileKind("blank")
        if header != _HEADER:
            return FileKind("foreign", why="is not a SQLite database")
    if not Path(f"{path}-wal").exists():
        # No WAL beside it: the file holds everything, and reading it as immutable creates no -wal
        # or -shm beside a file that may be refused. A file that cannot be read so is looked at
        # again the ordinary way if it may have been written meanwhile (a -wal has come, or the file
        # changed); a damaged file left as it was is refused as it is, with nothing made beside it.
        before = signature(path)
        kind = _read(path, readonly_uri(path) + "&immutable=1", timeout)
        if kind.kind != "foreign" or not kind.why.startswith("cannot be"):
            return kind
        if kind.damaged and signature(path) == before:
            return kind
    return _read(path, readonly_uri(path), timeout)


def _header(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(len(_HEADER))


def _open_here(path: Path) -> bool:
    """Whether this process has ``path`` open already (a connection of another journal object, say).

    Then its header is not read with a descriptor of this module's own: closing it would take
    away the locks SQLite holds on the file for that connection, and another process could then
    check the WAL into the file and delete it under the connection, whose later commits are lost.
    Where the open descriptors cannot be listed, the file is taken to be open.
    """
    st = os.stat(path)
    try:
        fds = os.listdir("/proc/self/fd")
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return True  # no /proc here; other failures (no descriptor left, say) are the caller's to report
    for fd in fds:
        try:
            other = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile, or the descriptor of the listing itself
        if other.st_ino == st.st_ino and other.st_dev == st.st_dev:
            return True
    return False


def signature(path: Path) -> tuple[int, int, int, bool]:
    """What changes when a file is written: its inode, size and mtime, and whether a WAL is beside it."""
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0, False)
    return (st.st_ino, st.st_size, st.st_mtime_ns, os.path.exists(f"{path}-wal"))


def _read(path: Path, uri: str, timeout: float) -> FileKind:
    try:
        with OPENING:
            conn = sqlite3.connect(uri, uri=True, timeout=timeout)
    except sqlite3.Error as e:
        _raise_if_full(path, e)
        return FileKind("foreign", why=f"cannot be opened as a SQLite database ({e})")
    try:
        return read_kind(conn)
    except sqlite3.Error as e:
        code = getattr(e, "sqlite_errorcode", 0) & 0xFF
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            raise
        _raise_if_full(path, e)
        return FileKind("foreign", why=f"cannot be read as a SQLite database ({e})",
                        damaged=code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB))
    except UnicodeDecodeError:  # the names in its schema are not text: its first pages are damaged
        return FileKind("foreign", why="cannot be read as a SQLite database (its schema is not UTF-8 text)",
                        damaged=True)
    finally:
        conn.close()


def _raise_if_full(path: Path, e: sqlite3.Error) -> None:
    # A full disk is not a foreign file: the journal may be whole, and is read once there is room.
    if full_disk_error(path, e):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e


def readonly_uri(path: Path) -> str:
    """The URI that opens ``path`` read-only: nothing can be written through it."""
    return f"file:{quote(os.fsencode(path.resolve()))}?mode=ro"


def reader_uri(path: Path) -> str:
    """The URI the journal's readers open ``path`` with: :func:`readonly_uri`, and immutable when
    the file has no WAL beside it and this process cannot write its directory, where SQLite could
    not make the ``-shm`` file that reading a WAL database needs (a journal archived read-only)."""
    uri = readonly_uri(path)
    if not Path(f"{path}-wal").exists() and not os.access(path.resolve().parent, os.W_OK):
        uri += "&immutable=1"
    return uri


def migrate(conn: sqlite3.Connection, version: int) -> int:
    """Bring a journal of ``version`` (0: blank) to :data:`LATEST` inside the caller's write
    transaction; returns the new version."""
    for target in range(version + 1, LATEST + 1):
        MIGRATIONS[target](conn)
        conn.execute(f"PRAGMA user_version = {target}")
    if version == 0:
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    return LATEST
