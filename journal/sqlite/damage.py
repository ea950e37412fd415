"""A journal file known to be damaged, so that every process that writes it refuses to until it is restored.

SQLite reports damage only when a statement reads a damaged page, and the pages a guarded call
writes are few: ``verify`` or an export may find the file malformed while the guard's writes still
succeed, each adding to a file that can no longer be read whole. So the first process that sees
SQLite call the file malformed leaves a mark beside it, ``JOURNAL-damaged`` (one line of JSON: when,
and what SQLite said), and every write transaction of every process looks for the mark first (one
``access()`` of a file that is not there, about a microsecond). The mark goes only when ``verify``
finds the file whole again (its chain, its projection, and SQLite's ``PRAGMA quick_check``), that
is once an operator has restored it.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import orjson

__all__ = ["clear", "damaged", "mark", "mark_path", "marked"]

SUFFIX = "-damaged"
# Python's sqlite3 reading a stored text that is not UTF-8: bytes of the file were overwritten.
_UNDECODABLE = "Could not decode to UTF-8 column"
_CODES = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def mark_path(file: Path) -> Path:
    """Where the mark of the journal ``file`` (its real path) is kept."""
    return file.with_name(file.name + SUFFIX)


def damaged(e: sqlite3.Error) -> bool:
    """Whether SQLite's ``e`` says the file itself is damaged (malformed, not a database, a stored
    text that is not UTF-8), rather than busy, full or unreadable."""
    return (getattr(e, "sqlite_errorcode", 0) & 0xFF) in _CODES or _UNDECODABLE in str(e)


def mark(file: Path, problem: str) -> None:
    """Leave the mark beside ``file``, saying ``problem``. Where the directory cannot be written,
    no mark is left; the object that saw the damage still refuses writes."""
    line = orjson.dumps({"at": datetime.now(UTC).isoformat(), "problem": problem}) + b"\n"
    with contextlib.suppress(OSError):
        fd = os.open(mark_path(file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def marked(mark: str) -> str | None:
    """What SQLite said when the mark at ``mark`` (the :func:`mark_path` of a journal) was left, or
    None when there is none. A mark that cannot be read (not JSON, say) still marks the file."""
    if not os.access(mark, os.F_OK):  # the common case, and without the cost of an exception
        return None
    try:
        with open(mark, "rb") as f:
            text = f.read(64 * 1024)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"its mark {os.path.basename(mark)} cannot be read: {e.strerror}"
    try:
        return str(orjson.loads(text)["problem"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return f"its mark {os.path.basename(mark)} says so"


def clear(file: Path) -> None:
    """Take the mark away (the file has been found whole)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(mark_path(file))
