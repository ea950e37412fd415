"""Writing the audit trail as JSON Lines or CSV, one event at a time, in bounded memory, and
putting a file in place whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import orjson

from journal import Journal

T = TypeVar("T")


def write_events(
    journal: Journal,
    filters: dict[str, Any],
    out: BinaryIO,
    *,
    fmt: str,
    redact: frozenset[str] = frozenset(),
    advance: Callable[[int], None] | None = None,
) -> int:
    """Write the filtered events of ``journal`` to ``out`` as ``fmt`` (``jsonl``, or ``csv``, which
    starts with a header row of :data:`journal.export.CSV_COLUMNS`) in batches; ``advance(n)`` is
    told after each batch. Returns the count."""
    if fmt == "csv":
        batches = journal.export_csv(redact=redact, **filters)
    else:
        batches = journal.export_lines(redact=redact, **filters)
    written = 0
    try:
        for chunk, count in batches:
            write_all(out, chunk)
            written += count
            if advance is not None and count:
                advance(count)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # a write that failed stops the journal's reading at once, before the journal is closed
    return written


def write_all(out: BinaryIO, chunk: bytes) -> None:
    """Write all of ``chunk``: a write to stdout may come back short (a pipe whose reader left, a
    full disk), and the retry then raises the error that a cut output must not hide."""
    written = out.write(chunk)  # bytes whole, not a view: a tally of what is written then copies nothing
    view = memoryview(chunk)
    while written != len(view):
        if not written:
            raise OSError(f"the output took no more bytes after {len(chunk) - len(view)} of a batch")
        view = view[written:]
        written = out.write(view)


class NotJsonLines(ValueError):
    """A line of an export file is not one JSON object."""


def read_export(stream: Iterable[bytes]) -> Iterable[dict[str, Any]]:
    """The events of an exported JSON Lines file, one dict a line, read as they are needed.

    Blank lines are skipped; any other line that is not a JSON object raises :class:`NotJsonLines`
    naming its line number.
    """
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise NotJsonLines(f"line {number} is not JSON ({e})") from e
        if not isinstance(event, dict):
            raise NotJsonLines(f"line {number} is not a JSON object but {type(event).__name__}")
        yield event


class Tallied:
    """A binary output that tells ``tally(chunk)`` every byte written to it."""

    def __init__(self, out: BinaryIO, tally: Callable[[bytes], None]) -> None:
        self._out = out
        self._tally = tally

    def write(self, chunk: bytes | memoryview) -> int:
        written = self._out.write(chunk)
        if written:
            self._tally(bytes(chunk[:written]))
        return written or 0

    def flush(self) -> None:
        self._out.flush()


# A file being written is named after its target, its writer's host and pid, and a random part.
_PARTIAL = re.compile(r"\.(?P<name>.+)\.(?P<host>[A-Za-z0-9_-]*)\.(?P<pid>[0-9]+)-[0-9a-f]{16}\.partial")


def _host() -> str:
    """This host's name as it stands in a file name (no dots: they separate its parts)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())


def _partial_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{_host()}.{os.getpid()}-{secrets.token_hex(8)}.partial")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process, alive
        return True
    return True


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove the files of earlier writes of ``target`` that never finished (their writer, on this
    host, is gone: killed mid-way); returns them. Another host's are left: its processes cannot be
    seen from here."""
    removed = []
    host = _host()
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            found = _PARTIAL.fullmatch(entry.name)
            if found is None or found["name"] != target.name or found["host"] != host or _alive(int(found["pid"])):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _unnamed(directory: Path) -> int | None:
    """A new file in ``directory`` that has no name (Linux ``O_TMPFILE``): the system frees it if the
    process dies before it is named. None where the system or the file system has none."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(directory, flag | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None  # a file system without unnamed files: a named one will do
        raise


def _name(fd: int, path: Path) -> None:
    """Give the unnamed file ``fd`` the name ``path``: linkat(2) following /proc/self/fd/N (given
    through a directory descriptor, so that the link follows it rather than link the symlink)."""
    fds = os.open("/proc/self/fd", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.link(str(fd), path, src_dir_fd=fds, follow_symlinks=True)
    finally:
        os.close(fds)


def write_file(target: Path, write: Callable[[BinaryIO], T]) -> T:
    """Write ``target`` (a regular file, or none yet) through ``write(out)`` and put it in place
    whole, replacing the file there only once ``write`` returns; returns what ``write`` returned.

    The file is written without a name where the system allows it (Linux ``O_TMPFILE``), so that
    a write killed mid-way (SIGKILL) leaves nothing behind; elsewhere under a name of its own,
    ``.NAME.HOST.PID-RANDOM.partial``, which the next write of ``target`` on this host removes once
    that process is gone. The new file has mode 0600. Raises ``OSError``; nothing is left behind then.
    """
    remove_stale_partials(target)
    fd = _unnamed(target.parent)
    partial: Path | None = None
    if fd is None:
        partial = _partial_name(target)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            result = write(out)
            out.flush()
            if partial is None:
                # Named only now, and at once moved over the target: a kill between the two leaves
                # a file that the next write recognises by its name and removes.
                partial = _partial_name(target)
                _name(out.fileno(), partial)
        os.replace(partial, target)
    except BaseException:
        if partial is not None:
            with contextlib.suppress(OSError):
                partial.unlink()
        raise
    return result
