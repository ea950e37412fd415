"""Each index of a SQLite journal checked against its table, for verify and rebuild.

An index holds a copy of some columns of each row of its table, and the row's rowid, in the
index's order. A read through it sees only what it holds: verify's and rebuild's read of the log by
call id, the guard's lookup of a call's row, the duplicate window's lookup of a re-planned call by
its idempotency key. An entry that stray bytes have altered, or that was removed behind SQLite's
back, hides its row from that read. SQLite's quick check looks at the pages of each b-tree, not at
what an index holds; its integrity check compares each row with each of its indexes, one index
lookup a row and an index (1.6 s for the projection of 444,445 calls, a third of verify's whole
time), so verify does not run it. Each index is compared with its table in one read snapshot, in
one of these ways, each exact:

- **by digest**: the number of entries and the sum of a 31-bit hash of each entry (its columns and
  the rowid, as typed values), read from the index alone (a covering scan), against the same over
  the rows, read from the table alone: an entry altered, missing or extra changes the count or the
  sum (two changes that cancel out have a chance of one in 2**31). The hash is Python's, of this
  process: the two sums are only ever compared with each other.
- **by row**: each entry's row looked up by its rowid and compared with it column by column; the
  entries that match (their number, the sum of their rowids) against the table's rows, and the
  number of entries against the number of rows. For an index whose entries come in about the order
  of the rows (``calls_updated_at``): each lookup then reads the page the one before read, which is
  cheaper than a hash in Python for each entry. An index (or table) holding a text that is not
  UTF-8, whose hash cannot be taken, is compared by row too.
- **by count**: the number of entries against the number of rows, for an index whose every entry
  the caller reads in another way: the index on events' call id (verify looks up each event's own
  entry in it, :func:`journal.sqlite.verify.unindexed`) and, in verify's parts, the projection's
  index on call id (each part reads the projection through it, the call id from each entry and the
  other columns from its row, and compares every row with the fold of the log).

An index that is partial or holds an expression is left to SQLite's integrity check of its table
(no journal has one). An index whose pages SQLite cannot read, or whose entries differ from the
rows in a file whose pages SQLite's quick check finds damaged, raises :class:`DamagedIndex`, a
``sqlite3.DatabaseError`` with SQLite's code for a malformed file: the file is then marked damaged,
as for any page SQLite finds malformed, and making the index again in place is not advised (the
pages of a damaged b-tree may point into another's, which dropping it would free).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

__all__ = ["BY_ROW", "CALLS_BY_ID", "EVENTS_BY_CALL", "REPAIR", "RESTORE", "DamagedIndex", "Index", "damaged_index",
           "diagnosed", "first_finding", "indexes", "mismatched", "problem", "quick_check", "unindexed"]

# The hash, registered on the connection that reads (the two sums are compared in that connection).
DIGEST = "airlock_index_digest"
EVENTS_BY_CALL = "events_call_id"
CALLS_BY_ID = "sqlite_autoindex_calls_1"
# Indexes whose entries come in about the order of their table's rows: a call's row is inserted when
# the call begins, and its updated_at moves on with the calls after it.
BY_ROW = frozenset({"calls_updated_at"})

# Whose lookups read each index of a journal, for a problem's sentence.
_READ_BY = {
    EVENTS_BY_CALL: "every read of a call's events (verify's and rebuild's included)",
    CALLS_BY_ID: "every lookup of a call's row (the guard's included)",
    "calls_idempotency_key": "the duplicate window's lookup of a re-planned call",
    "calls_updated_at": "show's list of the newest calls",
}
# What to do about an index whose entries differ from its table's rows, in a file whose pages are sound.
REPAIR = ("the file was damaged or altered behind SQLite's back, though SQLite's quick check finds its pages "
          "sound; run rebuild, which makes the index again from its table (REINDEX: nothing is lost, an index "
          "only copies its table's columns)")
# What to do about one whose pages are damaged.
RESTORE = ("restore the journal as the runbook says; do not make the index again in place (REINDEX): its "
           "damaged pages may point into pages that other tables hold, which dropping it would free")
_UDF_FAILED = "user-defined function raised exception"


def _digest(*values: Any) -> int:
    return hash(values) >> 33  # 31 bits: 2**32 of them sum within SQLite's 64-bit integers


@dataclass(frozen=True, slots=True)
class Index:
    """An index of the journal file; ``columns`` are what each of its entries holds, in order (the
    indexed columns, then ``rowid``, or the primary key's columns of a table without rowids)."""

    name: str
    table: str
    columns: tuple[str, ...]
    row_key: tuple[str, ...]  # what names an entry's row: ("rowid",), or the primary key's columns
    plain: bool  # plain columns and no WHERE: its entries can be compared with the rows

    def said(self, what: str) -> str:
        """A sentence of this index: ``what`` is wrong with it."""
        read_by = _READ_BY.get(self.name)
        return f"the index {self.name} of table {self.table}{f', read by {read_by},' if read_by else ''} {what}"


class DamagedIndex(sqlite3.DatabaseError):
    """An index SQLite cannot read, or whose entries differ from its rows in a file whose pages
    SQLite finds damaged (``index``; what is wrong, ``what``). Its code is SQLite's for a malformed
    file, so that the journal marks the file damaged as for any other malformed page."""

    def __init__(self, index: Index, what: str, e: sqlite3.Error | None = None, pages: str | None = None) -> None:
        super().__init__(index.said(what) + (f"; SQLite finds the file's pages damaged: {pages}" if pages else ""))
        self.index = index
        self.what = what
        self.pages = pages  # what SQLite's quick check finds, when it was run
        self.sqlite_errorcode = getattr(e, "sqlite_errorcode", sqlite3.SQLITE_CORRUPT)
        self.sqlite_errorname = getattr(e, "sqlite_errorname", "SQLITE_CORRUPT")


def damaged_index(e: BaseException) -> DamagedIndex | None:
    """The :class:`DamagedIndex` that ``e`` was raised from (at any depth), or None."""
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        if isinstance(current, DamagedIndex):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def first_finding(found: Iterable[tuple[Any, ...]]) -> str:
    """The first thing SQLite's quick or integrity check says, on one line (it may put several
    lines in one row, under a heading naming the database)."""
    for row in found:
        for line in str(row[0]).splitlines():
            if line.strip() and not line.startswith("*** in database"):
                return line.strip()
    return "it does not say what"


def quick_check(conn: sqlite3.Connection) -> str | None:
    """What SQLite's quick check finds wrong with the file's pages; None when they are sound (the
    check itself failing on a malformed page is a finding too)."""
    found: list[tuple[Any, ...]] = []
    try:
        for row in conn.execute("PRAGMA quick_check"):
            found.append(row)
    except sqlite3.DatabaseError as e:
        if not _malformed(e):
            raise
        found.append((str(e),))
    return None if found == [("ok",)] else first_finding(found)


def _malformed(e: sqlite3.Error) -> bool:
    return (getattr(e, "sqlite_errorcode", 0) & 0xFF) in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _col(name: str) -> str:
    return "rowid" if name == "rowid" else _q(name)


def indexes(conn: sqlite3.Connection) -> list[Index]:
    """Every index of the file's tables, in name order."""
    found: list[Index] = []
    tables: dict[str, tuple[tuple[str, ...], set[str]]] = {}
    for name, table in conn.execute(
        "SELECT name, tbl_name FROM sqlite_master WHERE type = 'index' ORDER BY name"
    ).fetchall():
        if table not in tables:
            partial = {str(r[1]) for r in conn.execute(f"PRAGMA index_list({_q(table)})") if r[4]}
            try:
                conn.execute(f"SELECT rowid FROM {_q(table)} LIMIT 0").fetchall()
                row_key: tuple[str, ...] = ("rowid",)
            except sqlite3.OperationalError:  # a table without rowids: its rows are named by the primary key
                row_key = tuple(str(c[1]) for c in sorted(
                    (c for c in conn.execute(f"PRAGMA table_info({_q(table)})") if c[5]), key=lambda c: c[5]))
            tables[table] = (row_key, partial)
        row_key, partial = tables[table]
        info = conn.execute(f"PRAGMA index_xinfo({_q(name)})").fetchall()  # seqno, cid, name, desc, coll, key
        if not info:
            continue
        plain = name not in partial and all(cid != -2 for _, cid, *_ in info)
        columns = tuple("rowid" if cid == -1 else str(column) for _, cid, column, *_ in info)
        found.append(Index(str(name), str(table), columns, row_key, plain))
    return found


# -- the three ways, and SQLite's own --------------------------------------------------------------


def _read_index(index: Index, step: Callable[[], Any]) -> Any:
    """``step``, a read of ``index`` alone: SQLite finding its pages malformed raises :class:`DamagedIndex`."""
    try:
        return step()
    except sqlite3.DatabaseError as e:
        if isinstance(e, DamagedIndex) or not _malformed(e):
            raise
        raise DamagedIndex(index, f"cannot be read ({e})", e) from e


def _one(conn: sqlite3.Connection, sql: str) -> Any:
    return conn.execute(sql).fetchone()


def _read_whole(conn: sqlite3.Connection, index: Index) -> None:
    """Read every entry of ``index``, every column of each (:class:`DamagedIndex` when SQLite cannot)."""
    _read_index(index, lambda: conn.execute(
        f"SELECT count({_col(index.columns[-1])}) FROM {_q(index.table)} INDEXED BY {_q(index.name)}").fetchone())


# The first event from one seq to another that lacks its own entry in the index on call id.
_UNINDEXED = (f"SELECT t.seq FROM events AS t WHERE t.seq BETWEEN ? AND ? AND NOT EXISTS "
              f"(SELECT 1 FROM events AS i INDEXED BY {EVENTS_BY_CALL} WHERE i.call_id IS t.call_id AND i.seq = t.seq) "
              "ORDER BY t.seq LIMIT 1")


def unindexed(conn: sqlite3.Connection, lo: int, hi: int, index: Index | None = None) -> int | None:
    """The first event from ``lo`` to ``hi`` that the index on call id lacks (under its own call
    id), or None. With ``index`` (that index), SQLite failing to read it raises :class:`DamagedIndex`."""
    try:
        found = conn.execute(_UNINDEXED, (lo, hi)).fetchone()
    except sqlite3.DatabaseError:
        if index is not None:
            _read_whole(conn, index)  # is it the index that SQLite cannot read, or the table?
        raise
    return None if found is None else int(found[0])


def _entries(conn: sqlite3.Connection, index: Index) -> int:
    return int(_read_index(index, lambda: conn.execute(
        f"SELECT count(*) FROM {_q(index.table)} INDEXED BY {_q(index.name)}").fetchone()[0]))


# What a check finds: the index, and what is wrong with it.
Finding = tuple[Index, str]


def _too_many_or_few(index: Index, entries: int, rows: int) -> Finding:
    return index, f"holds {entries} entries for {rows} rows"


def _not_its_rows(index: Index) -> Finding:
    return index, "holds an entry that does not match its row (altered, or standing for another row)"


class _Rows:
    """The number of rows of each table, and the sum of their rowids, each read once (in one snapshot).
    ``known``: the number of rows of a table that the caller knows already (the log's, verified)."""

    def __init__(self, conn: sqlite3.Connection, known: dict[str, int] | None = None) -> None:
        self._conn = conn
        self._read: dict[str, tuple[int, int | None]] = {}
        self._known = dict(known or {})

    def count(self, table: str) -> int:
        if table in self._read:
            return self._read[table][0]
        if table not in self._known:
            self._known[table] = int(self._conn.execute(f"SELECT count(*) FROM {_q(table)} NOT INDEXED").fetchone()[0])
        return self._known[table]

    def summed(self, table: str) -> tuple[int, int | None]:
        """The number of rows and the sum of their rowids (one scan of the table)."""
        if table not in self._read:
            found = self._conn.execute(f"SELECT count(*), sum(rowid) FROM {_q(table)} NOT INDEXED").fetchone()
            self._read[table] = (int(found[0]), found[1])
        return self._read[table]


def by_count(conn: sqlite3.Connection, index: Index, rows: _Rows | None = None) -> Finding | None:
    """The number of ``index``'s entries against the number of its table's rows."""
    entries = _entries(conn, index)
    counted = (rows or _Rows(conn)).count(index.table)
    return None if entries == counted else _too_many_or_few(index, entries, counted)


def by_row(conn: sqlite3.Connection, index: Index, rows: _Rows | None = None) -> Finding | None:
    """Each entry of ``index`` compared, column by column, with its row looked up by its key."""
    table, key = _q(index.table), index.row_key
    same = " AND ".join(f"t.{_col(c)} IS i.{_col(c)}" for c in index.columns if c not in key) or "1"
    joined = " AND ".join(f"t.{_col(c)} = i.{_col(c)}" for c in key)
    summed = "sum(rowid)" if key == ("rowid",) else "0"
    try:
        # CROSS JOIN: the index is the outer loop (a scan of it alone), each row looked up by its key.
        matched = conn.execute(
            f"SELECT count(*), {summed.replace('rowid', 'i.rowid')} FROM {table} AS i INDEXED BY {_q(index.name)} "
            f"CROSS JOIN {table} AS t NOT INDEXED ON {joined} WHERE {same}"
        ).fetchone()
    except sqlite3.DatabaseError:
        _read_whole(conn, index)  # is it the index that SQLite cannot read, or the table?
        raise
    if key == ("rowid",):
        table_rows = (rows or _Rows(conn)).summed(index.table)
    else:
        table_rows = (int(conn.execute(f"SELECT count(*) FROM {table} NOT INDEXED").fetchone()[0]), 0)
    entries = _entries(conn, index)
    if entries != table_rows[0]:
        return _too_many_or_few(index, entries, table_rows[0])
    return None if tuple(matched) == table_rows else _not_its_rows(index)


def by_digest(conn: sqlite3.Connection, table: str, group: list[Index]) -> Finding | None:
    """The indexes ``group`` of ``table``, each by digest: each index read alone, then the table
    once for all of them. One that holds a text that is not UTF-8 (or whose table does) by row."""
    with contextlib.suppress(sqlite3.OperationalError):  # registered already, and a statement of it active
        conn.create_function(DIGEST, -1, _digest, deterministic=True)
    entry = {index.name: ", ".join(_col(c) for c in index.columns) for index in group}
    held: dict[str, tuple[Any, ...] | None] = {}
    for index in group:
        read = f"SELECT count(*), sum({DIGEST}({entry[index.name]})) FROM {_q(table)} INDEXED BY {_q(index.name)}"
        try:
            held[index.name] = tuple(_read_index(index, partial(_one, conn, read)))
        except sqlite3.OperationalError as e:
            if _UDF_FAILED not in str(e):
                raise
            held[index.name] = None
    hashed = [index for index in group if held[index.name] is not None]
    rows: tuple[Any, ...] | None = None
    if hashed:
        sums = ", ".join(f"sum({DIGEST}({entry[index.name]}))" for index in hashed)
        try:
            rows = tuple(conn.execute(f"SELECT count(*), {sums} FROM {_q(table)} NOT INDEXED").fetchone())
        except sqlite3.OperationalError as e:
            if _UDF_FAILED not in str(e):
                raise
    for index in group:
        found = held[index.name]
        if found is None or rows is None:
            problem = by_row(conn, index)
        elif found == (rows[0], rows[1 + hashed.index(index)]):
            problem = None
        elif found[0] != rows[0]:
            problem = _too_many_or_few(index, found[0], rows[0])
        else:
            problem = _not_its_rows(index)
        if problem is not None:
            return problem
    return None


def by_sqlite(conn: sqlite3.Connection, index: Index) -> Finding | None:
    """SQLite's integrity check of ``index``'s table, for an index that is partial or holds an expression."""
    found = conn.execute(f"PRAGMA integrity_check({_q(index.table)})").fetchall()
    return None if found == [("ok",)] else (index, f"does not hold what its table does ({first_finding(found)})")


# -- the checks ------------------------------------------------------------------------------------


def _checks(conn: sqlite3.Connection, part: int, parts: int, calls_read: bool,
            events: int | None) -> list[Callable[[], Finding | None]]:
    """The checks of ``part`` of ``parts``, each of whole indexes in this snapshot: by digest on
    part 0, which starts first (the others start a Python interpreter), by count and by row on the
    last; all of them when ``parts`` is 1. ``calls_read``: the caller reads the projection
    through its index on call id (verify's parts), which is then checked by count. ``events``:
    the number of events, when the caller knows it (the chain it checked)."""
    first, last = part == 0, part == parts - 1
    rows = _Rows(conn, {"events": events} if events is not None else None)
    counted = {EVENTS_BY_CALL, CALLS_BY_ID} if calls_read else {EVENTS_BY_CALL}
    checks: list[Callable[[], Finding | None]] = []
    digests: dict[str, list[Index]] = {}
    for index in indexes(conn):
        if not index.plain:
            if first:
                checks.append(partial(by_sqlite, conn, index))
        elif index.name in counted:
            if last:
                checks.append(partial(by_count, conn, index, rows))
        elif index.name in BY_ROW and index.row_key == ("rowid",):
            if last:
                checks.append(partial(by_row, conn, index, rows))
        elif first:
            digests.setdefault(index.table, []).append(index)
    checks.extend(partial(by_digest, conn, table, group) for table, group in digests.items())
    return checks


def problem(conn: sqlite3.Connection, part: int = 0, parts: int = 1, *, calls_read: bool = False,
            diagnose: bool = True, events: int | None = None) -> str | None:
    """The first index, of those ``part`` of ``parts`` checks, whose entries are not its table's
    rows, and what is wrong with it and what to do; None when there is none. Run in the caller's
    read snapshot. With ``diagnose``, an index that differs is looked at further: SQLite's quick
    check of the file's pages (run only then) says whether making it again is safe, and
    :class:`DamagedIndex` is raised when it is not; so it is when SQLite cannot read an index."""
    for check in _checks(conn, part, parts, calls_read, events):
        found = _finding(check) if diagnose else check()
        if found is None:
            continue
        index, what = found
        return diagnosed(conn, index, what) if diagnose else index.said(what)
    return None


def _finding(check: Callable[[], Finding | None]) -> Finding | None:
    """What ``check`` finds; an index SQLite cannot read is a finding too."""
    try:
        return check()
    except DamagedIndex as e:
        return e.index, e.what


def diagnosed(conn: sqlite3.Connection, index: Index, what: str) -> str:
    """What verify says of ``index``, of which ``what`` is wrong, in a file whose pages SQLite's
    quick check finds sound (:data:`REPAIR`); raises :class:`DamagedIndex` when it finds them damaged."""
    _sound_pages(conn, index, what)
    return f"{index.said(what)}: {REPAIR}"


def _sound_pages(conn: sqlite3.Connection, index: Index, what: str) -> None:
    """Raise :class:`DamagedIndex` when SQLite's quick check finds the file's pages damaged (then
    ``index``, of which ``what`` is wrong, may not be made again in place)."""
    pages = quick_check(conn)
    if pages is not None:
        raise DamagedIndex(index, what, pages=pages)


def mismatched(conn: sqlite3.Connection, first: int, last: int) -> list[Index]:
    """Every index whose entries are not its table's rows (or that SQLite cannot read), each checked
    alone, in this snapshot of a log of events ``first`` to ``last``: the indexes rebuild makes
    again. Raises :class:`DamagedIndex` when there is one and SQLite finds the file's pages damaged."""
    wrong: list[Finding] = []
    digests: dict[str, list[Index]] = {}
    for index in indexes(conn):
        if not index.plain:
            check = partial(by_sqlite, conn, index)
        elif index.name == EVENTS_BY_CALL:
            check = partial(_every_event, conn, index, first, last)
        elif index.name in BY_ROW and index.row_key == ("rowid",):
            check = partial(by_row, conn, index)
        else:
            digests.setdefault(index.table, []).append(index)
            continue
        found = _finding(check)
        if found is not None:
            wrong.append(found)
    for table, group in digests.items():
        # A table's indexes together (one read of the table), then, when one differs, each alone.
        if _finding(partial(by_digest, conn, table, group)) is not None:
            for index in group:
                found = _finding(partial(by_digest, conn, table, [index]))
                if found is not None:
                    wrong.append(found)
    if wrong:
        _sound_pages(conn, *wrong[0])
    return [index for index, _ in wrong]


def _every_event(conn: sqlite3.Connection, index: Index, first: int, last: int) -> Finding | None:
    missing = unindexed(conn, first, last, index)
    return (index, f"lacks seq {missing}") if missing is not None else by_count(conn, index)
