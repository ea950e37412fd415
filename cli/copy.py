"""``airlock journal copy``: move a journal between SQLite and PostgreSQL, seq and hashes intact."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING

import click

from journal import Journal, open_journal
from journal.copy import CopyReport, copy_from
from journal.errors import JournalNotFound

from .options import describe, echo, journal_target, then

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar


def _same(source: str, destination: str) -> bool:
    return source.rstrip("/") == destination.rstrip("/")


@click.command()
@click.option("--from", "source", required=True, metavar="PATH_OR_URL", callback=journal_target,
              help="The journal to copy: a SQLite file or a postgresql:// URL (only read).")
@click.option("--to", "destination", required=True, metavar="PATH_OR_URL", callback=journal_target,
              help="Where to copy it: a new SQLite file, or an empty PostgreSQL database or schema.")
def copy(source: str, destination: str) -> None:
    """Copy a journal to another store, preserving every event's seq and hash.

    The events are inserted as they were stored, the projection is folded again from them, and
    the copy is verified: its chain must check and its head hash must equal the source's. The
    destination must hold no events; the source is never changed. Stop the agents writing to the
    source first: events appended during the copy are not part of it. A journal whose oldest
    events were archived is copied with its archived head and the projection as of it, so the
    copy verifies and goes on from the same archives. A copy that fails leaves nothing at --to
    that it made.

    Example:

    \b
        airlock journal copy --from airlock-journal.db --to postgresql://airlock@db.internal/airlock
        airlock journal copy --from postgresql://airlock@db.internal/airlock --to audit-2026-12.db
    """
    if _same(source, destination):
        raise click.UsageError("--from and --to name the same journal")
    # Opened apart, so that a journal that does not exist is blamed on the right flag.
    try:
        src = open_journal(source, readonly=True, create=False)
    except JournalNotFound as e:
        raise click.ClickException(then(e, "--from names the journal to copy.")) from e
    with src:
        try:
            report = _run(src, source, destination)
        except JournalNotFound as e:
            raise click.ClickException(then(e, "--to names the journal to copy into.")) from e
    archived = ""
    if report.archived:
        archived = (f", its log after the archived head (seq {report.archived}), which the copy keeps with the "
                    "projection as of it")
    echo(
        f"Copied {report.events} events ({report.calls} calls) from {describe(source)} to {describe(destination)}"
        f"{archived}; the copy verifies, head {report.head}"
    )


def _run(src: Journal, source: str, destination: str) -> CopyReport:
    if not sys.stderr.isatty():  # progress is for a person; scripts get only the result or the error
        return copy_from(src, destination)
    with contextlib.ExitStack() as stack:
        bars: list[ProgressBar[int]] = []
        copied = [0]

        def on_total(total: int) -> None:
            click.echo(f"Copying {total} events from {describe(source)} to {describe(destination)}", err=True)
            bars.append(stack.enter_context(click.progressbar(length=total, label="Copying", file=sys.stderr)))

        def progress(n: int) -> None:
            copied[0] += n
            if bars and copied[0] >= _STEP:  # the bar redraws in steps: a call per event would slow the copy
                bars[0].update(copied[0])
                copied[0] = 0

        report = copy_from(src, destination, on_total=on_total, progress=progress)
        if bars:
            bars[0].update(copied[0])
        return report


_STEP = 1000
