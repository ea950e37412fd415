"""``airlock journal archive``: move the oldest events out of the journal into an export file."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import click

from journal import JournalError, archive_run, open_journal
from journal.archive import ArchivePlan, ArchiveStore, archive_lines, plan_archive
from journal.events import at_text
from journal.manifest import manifest_path
from journal.signing import SigningKey

from . import audit
from .export import write_all, write_file
from .options import MOMENT, db_option, describe, echo, one_line


@click.command()
@click.option("--before", required=True, type=MOMENT,
              help="Archive the events older than this: ISO-8601 (2026-11-01), or an age like 90d.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the archive to this new file (JSON Lines, as export writes).")
@click.option("--sign", "key_file", type=click.Path(dir_okay=False, path_type=Path), metavar="KEY",
              help="Sign it: write OUTPUT.manifest.json beside it, signed with this private key (keygen).")
@db_option
def archive(before: datetime, output: Path, key_file: Path | None, db: str) -> None:
    """Move the events older than --before out of the journal into an archive file.

    The archive holds them as export writes them (verify --export checks it). It is written
    whole and synced to disk before the journal lets go of its events; each transaction that
    removes some records where the log now starts (SQLite removes them a few thousand at a
    time, so guarded calls go on meanwhile). A run stopped at any point leaves the journal
    whole, or the journal from a later start plus the complete archive; the next run finishes
    what a stopped one began. The journal's last event always stays. Every call keeps its row,
    so a retry of an archived call is still replayed or refused. The journal must verify
    first. Archives and the journal then verify as one chain: verify --export A1 --export A2 --db J.

    Example:

    \b
        airlock journal archive --before 90d --sign audit-key.pem -o archive-2026-11.jsonl

    \b
        airlock journal verify --export archive-2026-10.jsonl --export archive-2026-11.jsonl
    """
    now = datetime.now(UTC)
    if before > now:
        raise click.BadParameter(f"{at_text(before)} is in the future: an archive moves only events older than now "
                                 "(and the journal keeps its last event)", param_hint="'--before'")
    if output == Path(".") or output == Path("-"):
        raise click.BadParameter("name the new file to write the archive to", param_hint="'--output' / '-o'")
    if os.path.lexists(output):
        raise click.ClickException(f"{output} exists: an archive is written to a new file (keep that one)")
    if not output.resolve().parent.is_dir():
        raise click.ClickException(f"cannot write the archive to {output}: its directory does not exist")
    signer = audit.load_key(key_file)
    with open_journal(db, create=False) as j:
        if not isinstance(j, ArchiveStore):
            raise click.ClickException(f"the journal {describe(db)} cannot be archived")
        stopped = archive_run.unfinished(j)
        if stopped is not None:
            rest, file = stopped
            try:
                done = archive_run.finish(j, rest, file)
            except JournalError as e:
                raise click.ClickException(f"{one_line(str(e))}; nothing was archived") from e
            click.echo(f"Finished the archive to {file} that was stopped: let go of {done} more events "
                       f"(seq {rest.base_seq + 1} to {rest.last_seq}).", err=True)
        checked = archive_run.check(j)
        if not checked.ok:
            raise click.ClickException(f"the journal {describe(db)} does not verify (at seq {checked.first_bad_seq}: "
                                       f"{checked.problem}); nothing was archived")
        plan = plan_archive(j, before)
        if plan is None:
            echo(f"Nothing to archive: no event before {at_text(before)} but the journal's last.")
            return
        target = Path(os.path.realpath(output))
        marks: list[tuple[int, str]] = []
        _write_archive(j, plan, target, before, signer, marks)
        try:
            removed, freed = archive_run.commit(j, plan, marks, str(target), at_text(datetime.now(UTC)))
        except JournalError as e:
            start = j.archived_head()
            if start == (plan.base_seq, plan.base_hash):
                raise click.ClickException(f"{one_line(str(e))}; nothing was archived, and {output} (written "
                                           "before) holds no event the journal needs: remove it") from e
            raise click.ClickException(f"{one_line(str(e))}; the journal let go of the events up to seq {start[0]} "
                                       f"only: keep {output}, and archive again to finish") from e
        freed += j.reclaim_space() if hasattr(j, "reclaim_space") else 0
    echo(f"Archived {removed} events (seq {plan.base_seq + 1} to {plan.last_seq}, head {plan.last_hash}) to {output}.")
    if freed:
        click.echo(f"Gave {freed} free pages back to the file system.", err=True)


def _write_archive(j: ArchiveStore, plan: ArchivePlan, target: Path, before: datetime,
                   signer: SigningKey | None, marks: list[tuple[int, str]]) -> None:
    """Write the archive (and its signed manifest) to ``target`` whole, and sync both and their
    directory to disk: only then may the journal let go of the events. ``marks`` gets where the
    steps that let go of them end."""

    def write(out: BinaryIO) -> int:
        marks.clear()
        for chunk in archive_lines(j, plan, marks, archive_run.STEP):
            write_all(out, chunk)
        return plan.events

    try:
        if signer is not None:
            filters: dict[str, Any] = {"archived_before": before, "after_seq": plan.base_seq}
            audit.export_signed(target, filters, frozenset(), signer, write)
            _sync(manifest_path(target))
        else:
            write_file(target, write)
        _sync(target)
        _sync(target.parent)
    except OSError as e:
        raise click.ClickException(f"the archive could not be written to {target}: {e.strerror or e}; nothing was "
                                   "archived") from e


def _sync(path: Path) -> None:
    """fsync a file or a directory (any descriptor of it syncs it)."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
