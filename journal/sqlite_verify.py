"""Verifying a large SQLite journal in parts, on several cores at once.

Each part checks a contiguous range of ``seq`` (every hash recomputed, every link, no gaps) and
the calls of one share of call ids (their events folded with the guard's ``apply`` and compared
with their projection rows). The parts together check what the one-pass ``SQLiteJournal.verify``
checks; they only say whether all is well. When any part finds a problem, the journal is verified
again in one pass, which names the first bad event exactly as it always does.

A part runs in this process or in a child: ``python -m journal.sqlite_verify PATH PART PARTS HEAD``
prints ``{"ok":true}`` or ``{"ok":false}``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import orjson

from guard.store import CallRecord

from .chain import GENESIS
from .export import row_hash
from .projection import fold_row, record_row
from .rows import CALL_COLUMNS, EVENT_COLUMNS
from .sqlite import schema

__all__ = ["PARALLEL_FROM", "PATIENCE", "check_part", "child_said_ok", "start_part"]

# Below this many events one pass is quicker than starting another interpreter.
PARALLEL_FROM = 200_000
# How long a child may take beyond three times this process's own part before it is given up.
PATIENCE = 60.0

_EVENT_COLUMNS = ", ".join(EVENT_COLUMNS)
_CALL_COLUMNS = ", ".join(CALL_COLUMNS)


def _share(parts: int) -> str:
    """The SQL expression giving a call id's share, 0 to ``parts - 1``. Any total function of the id
    is correct (a call's events and its projection row go to the same part); this one is cheap and
    spreads typical ids."""
    return f"((coalesce(unicode(substr(call_id, -1)), 0) + length(call_id)) % {int(parts)})"


def _range(part: int, parts: int, head: int) -> tuple[int, int]:
    size = -(-head // parts)
    return part * size + 1, min(head, (part + 1) * size)


def _log_ok(conn: sqlite3.Connection, lo: int, hi: int, part: int, parts: int) -> dict[str, CallRecord] | None:
    """Events ``lo..hi`` are all there, each links to the one before and each hash matches its
    fields; returns the calls of this part's share folded from the whole log, or None at the first
    problem. The log is read in ``seq`` order: the share's events before ``lo``, every event of
    ``lo..hi``, the share's events after ``hi``."""
    folded: dict[str, CallRecord] = {}
    share = _share(parts)
    try:
        if lo > 1:
            for row in conn.execute(
                f"SELECT {_EVENT_COLUMNS} FROM events WHERE seq < ? AND {share} = ? ORDER BY seq", (lo, part)
            ):
                fold_row(folded, row)
            link = conn.execute("SELECT hash FROM events WHERE seq = ?", (lo - 1,)).fetchone()
            if link is None:
                return None
            prev = link[0]
        else:
            if conn.execute("SELECT 1 FROM events WHERE seq < 1 LIMIT 1").fetchone() is not None:
                return None  # an event before the first (seq starts at 1)
            prev = GENESIS
        expected = lo
        for row in conn.execute(
            f"SELECT {_EVENT_COLUMNS}, {share} FROM events WHERE seq BETWEEN ? AND ? ORDER BY seq", (lo, hi)
        ):
            if row[0] != expected or row[14] != prev or row_hash(row) != row[15]:
                return None
            prev = row[15]
            expected += 1
            if row[16] == part:
                fold_row(folded, row)
        if expected != hi + 1:
            return None
        for row in conn.execute(
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE seq > ? AND {share} = ? ORDER BY seq", (hi, part)
        ):
            fold_row(folded, row)
    except (ValueError, TypeError, AttributeError):
        return None  # a stored field that cannot be read: the one-pass check names it
    return folded


def _projection_ok(conn: sqlite3.Connection, folded: dict[str, CallRecord], part: int, parts: int) -> bool:
    """The calls of this share, folded from the log, are exactly their stored projection rows
    (part 0 also takes any row without a call id, which only an altered journal has)."""
    share = _share(parts)
    for row in conn.execute(
        f"SELECT {_CALL_COLUMNS} FROM calls WHERE {share} = :part OR (:part = 0 AND {share} IS NULL)", {"part": part}
    ):
        record = folded.pop(row[0], None)
        if record is None or record_row(record) != row:
            return False
    return not folded


def check_part(path: str | os.PathLike[str], part: int, parts: int, head: int) -> bool:
    """Check one part of the journal at ``path`` whose head was ``head`` (a snapshot of its own:
    events are only ever appended, so events up to ``head`` are the same in any later snapshot)."""
    conn = sqlite3.connect(schema.reader_uri(Path(path)), uri=True, isolation_level=None)
    try:
        conn.execute("BEGIN")  # the projection and the log it is compared with, at one moment
        lo, hi = _range(part, parts, head)
        folded = _log_ok(conn, lo, hi, part, parts)
        return folded is not None and _projection_ok(conn, folded, part, parts)
    except sqlite3.Error:
        return False
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.close()


def start_part(path: Path, part: int, parts: int, head: int) -> subprocess.Popen[bytes] | None:
    """Start a child checking one part; None when no child can be started (the caller does it),
    or when this interpreter is not a ``python`` program (embedded in another one, say)."""
    if not os.path.basename(sys.executable or "").lower().startswith(("python", "pypy")):
        return None
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "journal.sqlite_verify", str(path), str(part), str(parts), str(head)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env,
        )
    except OSError:
        return None


def child_said_ok(child: subprocess.Popen[bytes], timeout: float) -> bool | None:
    """What a child said: True or False; None when it said nothing readable within ``timeout``
    seconds (it failed, or hangs: it is then killed)."""
    try:
        out, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return None
    if child.returncode != 0:
        return None
    try:
        said = orjson.loads(out)
    except orjson.JSONDecodeError:
        return None
    return said.get("ok") if isinstance(said, dict) and isinstance(said.get("ok"), bool) else None


def main(argv: list[str]) -> int:
    try:
        path, part, parts, head = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
        if len(argv) != 4 or not 0 <= part < parts:
            raise ValueError
    except (IndexError, ValueError):
        sys.stderr.write("usage: python -m journal.sqlite_verify PATH PART PARTS HEAD\n")
        return 2
    sys.stdout.buffer.write(orjson.dumps({"ok": check_part(path, part, parts, head)}) + b"\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
