"""The manifest of a signed export: what the export file holds, its digest, and a signature.

``OUTPUT.manifest.json`` beside an export ``OUTPUT`` is a signed document (:mod:`journal.signing`)
with ``format``, ``file`` (the export's file name), ``events``, ``first_seq``, ``last_seq``,
``first_prev_hash`` and ``head_hash`` (the ``prev_hash`` of its first event and the ``hash`` of its
last: where it joins the chain), ``sha256`` and ``bytes`` (of the export file's bytes), ``filters``,
``redacted``, ``created_at``, ``public_key`` and ``signature``. The signature covers the
canonical JSON of every member but ``signature``; the digest covers every byte of the export, so
no byte of either file can change unnoticed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from .events import at_text

__all__ = ["FORMAT", "ExportTally", "digest_problem", "events_problem", "manifest_path", "manifest_problem",
           "new_manifest"]

FORMAT = "airlock-journal export manifest 1"

_FIELDS = ("format", "file", "events", "first_seq", "last_seq", "first_prev_hash", "head_hash", "sha256", "bytes",
           "filters", "redacted", "created_at", "public_key", "signature")


def manifest_path(export: Path) -> Path:
    """Where the manifest of the export ``export`` is: ``export`` with ``.manifest.json`` added."""
    return export.with_name(export.name + ".manifest.json")


class ExportTally:
    """What an export holds, gathered from its bytes as they are written (in pieces of any size):
    the digest, the size, how many lines (one event each), and the first and last line."""

    __slots__ = ("_digest", "_first", "_last", "_tail", "bytes", "events")

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._first: bytes | None = None
        self._last: bytes | None = None
        self._tail = b""  # the start of a line not ended yet
        self.bytes = 0
        self.events = 0

    def add(self, chunk: bytes) -> None:
        """Count ``chunk``, the next bytes of the file."""
        self._digest.update(chunk)
        self.bytes += len(chunk)
        first_end = chunk.find(b"\n")
        if first_end < 0:
            self._tail += chunk
            return
        last_end = chunk.rindex(b"\n")
        self.events += chunk.count(b"\n")
        if self._first is None:
            self._first = self._tail + chunk[:first_end]
        if first_end == last_end:
            self._last = self._tail + chunk[:last_end]
        else:
            self._last = chunk[chunk.rindex(b"\n", 0, last_end) + 1:last_end]
        self._tail = chunk[last_end + 1:]

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def facts(self) -> dict[str, Any]:
        """``events, first_seq, last_seq, first_prev_hash, head_hash, sha256, bytes`` of the export."""
        first = orjson.loads(self._first) if self._first else {}
        last = orjson.loads(self._last) if self._last else {}
        return {
            "events": self.events, "first_seq": first.get("seq"), "last_seq": last.get("seq"),
            "first_prev_hash": first.get("prev_hash"), "head_hash": last.get("hash"),
            "sha256": self.sha256, "bytes": self.bytes,
        }


def new_manifest(
    export: Path, tally: ExportTally, filters: Mapping[str, Any], redacted: frozenset[str],
    now: datetime | None = None,
) -> dict[str, Any]:
    """The manifest of the export file ``export`` (unsigned): its facts from ``tally``, the
    ``filters`` it was made with (a datetime as its ISO-8601 text) and the ``redacted`` fields."""
    shown = {name: at_text(value) if isinstance(value, datetime) else value for name, value in filters.items()}
    return {
        "format": FORMAT, "file": export.name, **tally.facts(), "filters": shown, "redacted": sorted(redacted),
        "created_at": at_text(now if now is not None else datetime.now(UTC)),
    }


def manifest_problem(manifest: Mapping[str, Any]) -> str | None:
    """Why ``manifest`` is not a manifest (a missing field, another format), as a phrase; None if it is."""
    missing = [name for name in _FIELDS if name not in manifest]
    if missing:
        return f"it lacks {', '.join(missing)}"
    if manifest["format"] != FORMAT:
        return f"its format is {manifest['format']!r}, not {FORMAT!r}"
    if not isinstance(manifest["filters"], dict):
        return "its filters are not an object"
    return None


def digest_problem(manifest: Mapping[str, Any], sha256: str, size: int) -> str | None:
    """Why an export file whose bytes have digest ``sha256`` and ``size`` is not the one
    ``manifest`` signed, as a sentence; None when it is."""
    if sha256 != manifest["sha256"] or size != manifest["bytes"]:
        return (f"its sha256 is {sha256} ({size} bytes), not the signed {manifest['sha256']} "
                f"({manifest['bytes']} bytes): the file has been changed since it was signed")
    return None


def events_problem(manifest: Mapping[str, Any], seen: Mapping[str, Any]) -> str | None:
    """Why an export whose chain verified, and whose events were ``seen`` (``events, first_seq,
    last_seq, first_prev_hash, head_hash``), does not hold what ``manifest`` says; None if it does."""
    for name in ("events", "first_seq", "last_seq", "first_prev_hash", "head_hash"):
        if seen.get(name) != manifest[name]:
            return f"it holds {name} {seen.get(name)!r}, but its manifest says {manifest[name]!r}"
    return None
