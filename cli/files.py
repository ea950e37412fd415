"""Small files the CLI reads whole: a checkpoint, a manifest, a key. Each is read up to a bound, so
that a device (``/dev/zero``) or a file far too large is an error at once, not a read without end."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import click

__all__ = [
    "KEY_BYTES",
    "CHECKPOINT_BYTES",
    "MANIFEST_BYTES",
    "TooBig",
    "check_key_file",
    "check_public_key",
    "is_device",
    "read_small",
    "size_text",
]

# A checkpoint is a JSON object of a few short members (seq, hash, at, a signature): under 1 KiB.
CHECKPOINT_BYTES = 64 * 1024
# A manifest holds the export's filters as given as well: room for long ones.
MANIFEST_BYTES = 1024 * 1024
# A PEM key, or 64 hex digits: well under 1 KiB.
KEY_BYTES = 64 * 1024

_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")


class TooBig(Exception):
    """A small file that is not small, or not a file: the message is a phrase, ``it is ...``."""


def size_text(size: int) -> str:
    """``size`` bytes as ``64 KiB`` or ``1 MiB``."""
    return f"{size // (1024 * 1024)} MiB" if size % (1024 * 1024) == 0 else f"{size // 1024} KiB"


def is_device(mode: int) -> bool:
    """Whether ``mode`` (a stat's) is that of a character or block device."""
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def read_small(path: Path, limit: int, what: str) -> bytes:
    """The bytes of the file ``path``, at most ``limit`` of them.

    Raises :class:`TooBig` for a device (refused before it is opened: a read of ``/dev/zero`` never
    ends, and opening some devices acts) or a file of more than ``limit`` bytes (``what``, such as
    ``a checkpoint``, says in the message what the file should have been); ``OSError`` as opening or
    reading raises it. A FIFO is read as a file is, up to the bound.
    """
    if is_device(os.stat(path).st_mode):
        raise TooBig("it is a device, not a file")
    with open(path, "rb") as stream:
        if is_device(os.fstat(stream.fileno()).st_mode):  # replaced by one since the stat
            raise TooBig("it is a device, not a file")
        content = stream.read(limit + 1)
    if len(content) > limit:
        raise TooBig(f"it is larger than {size_text(limit)} ({what} is a small JSON file)")
    return content


def _size_problem(path: str | os.PathLike[str], limit: int, noun: str) -> str | None:
    """Why the file ``path`` cannot be a key: a device, or a regular file over ``limit`` bytes; None
    when it can be read (or cannot be looked at: the reader then says why)."""
    try:
        found = os.stat(path)
    except (OSError, ValueError):
        return None
    if is_device(found.st_mode):
        return f"is a device, not {noun}"
    if stat.S_ISREG(found.st_mode) and found.st_size > limit:
        return f"is larger than {size_text(limit)}: it is not {noun}"
    return None


def check_key_file(path: Path) -> None:
    """Refuse a ``--sign KEY`` that is a device or a file too large to be a key, before it is read."""
    problem = _size_problem(path, KEY_BYTES, "a key file")
    if problem is not None:
        raise click.ClickException(f"the key {path} {problem}")


def check_public_key(given: str) -> None:
    """Refuse a ``--public-key`` naming a device or a file too large to hold a key, before it is
    read; 64 hex digits are a key, not a file, and are not looked up."""
    if _HEX_KEY.fullmatch(given.strip()):
        return
    problem = _size_problem(given, KEY_BYTES, "a file holding a key")
    if problem is not None:
        raise click.ClickException(f"the public key {given} {problem}")
