"""``airlock journal archive``: move the oldest events out of the journal into an export file."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import click

from journal import JournalError, archive_run, open_journal
from journal.archive import ArchivePlan, ArchiveStore, archive_lines, plan_archive, recorded_archives
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
    Of two archives run at once, the first to let go of events archives; the other archives
    nothing, says which archive took the events, and removes its own file (exit 0).

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
            shared: list[int] = []
            try:
                done = archive_run.finish(j, rest, file, shared)
            except JournalError as e:
                raise click.ClickException(f"{one_line(str(e))}; nothing was archived") from e
            if shared:
                # Not stopped: another archive run was letting go of its events at the same time.
                echo(f"Nothing archived: another archive, run at the same time, was letting go of the events of "
                     f"{file} (seq {rest.archive.base_seq + 1} to {rest.last_seq}), which this run helped finish; "
                     f"it archived nothing new, and nothing was written to {output}.")
                return
            click.echo(f"Finished the archive to {file} that was stopped: let go of {done} more events "
                       f"(seq {rest.base_seq + 1} to {rest.last_seq}).", err=True)
        checked = archive_run.check(j)
        if not checked.ok:
            raise click.ClickException(f"the journal {describe(db)} does not verify (at seq {checked.first_bad_seq}: "
                                       f"{checked.problem}); nothing was archived")
        target = Path(os.path.realpath(output))
        base = j.archived_head()
        try:
            plan = plan_archive(j, before)
        except JournalError:
            # The log's start moved while the plan was made: another archive at the same time.
            _yield_to_another(j, ArchivePlan(base[0], base[1], base[0], base[1]), target, output, signer, False)
            raise
        if plan is None:
            echo(f"Nothing to archive: no event before {at_text(before)} but the journal's last.")
            return
        marks: list[tuple[int, str]] = []
        try:
            _write_archive(j, plan, target, before, signer, marks)
        except JournalError:
            # Its events went while they were read: another archive took them first.
            _yield_to_another(j, plan, target, output, signer, False)
            raise
        try:
            removed, freed = archive_run.commit(j, plan, marks, str(target), at_text(datetime.now(UTC)))
        except archive_run.ArchivedMeanwhile as e:
            _archived_meanwhile(e, output, target, signer is not None, True)
            return
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


def _yield_to_another(j: ArchiveStore, plan: ArchivePlan, target: Path, output: Path, signer: SigningKey | None,
                      written: bool) -> None:
    """When the start of the log moved past ``plan``'s base while this run planned or wrote its
    archive, another archive took the events: say so (see :func:`_archived_meanwhile`) and end
    the command; else return (the caller raises what went wrong)."""
    if j.archived_head()[0] == plan.base_seq:
        return
    others = [a for a in recorded_archives(j) if a.file != str(target) and a.upto_seq > plan.base_seq]
    if others:
        _archived_meanwhile(archive_run.ArchivedMeanwhile(plan, str(target), others), output, target,
                            signer is not None, written)
        raise click.exceptions.Exit(0)


def _archived_meanwhile(lost: archive_run.ArchivedMeanwhile, output: Path, target: Path, signed: bool,
                        written: bool) -> None:
    """Another archive run at the same time let go of this one's events first: say what it
    archived, and take back this run's file, which holds no event that is not in that archive or
    still in the journal (this run let go of none). Exit 0 when that archive holds every event
    this run was to archive (the journal is as asked, as for "Nothing to archive"); exit 1 when
    some are still in the journal (the command did not do what it was asked)."""
    plan, others = lost.plan, lost.others
    planned = "This run let go of none"
    if plan.last_seq > plan.base_seq:
        planned = f"This run (of seq {plan.base_seq + 1} to {plan.last_seq}) let go of none"
    theirs = {os.path.realpath(o.file) for o in others}
    named = "; ".join(f"{o.file} holds seq {o.first_seq} to {o.upto_seq}"
                      + ("" if o.finished else " (the journal is still letting go of them)") for o in others)
    said = f"another archive, run at the same time, took these events first: {named}. {planned}"
    where = "that archive holds" if lost.covered else "that archive or the journal holds"
    if not written:
        what = f"; nothing was written to {output}"
    elif str(target) in theirs:
        what = f"; {output} is that archive's file: keep it"
    else:
        removed: list[Path] = []
        what = ""
        for path in (target, manifest_path(target)) if signed else (target,):
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                what = (f"; {output} holds only copies of events {where}, but could not be removed "
                        f"({e.strerror or e}): remove it")
                break
        if not what:
            also, were = (" and its manifest", "were") if len(removed) > 1 else ("", "was")
            what = f"; {output}{also}, written before, held only copies of events {where}, and {were} removed"
    if lost.covered:
        echo(f"Nothing archived: {said}{what}.")
        return
    rest = max(o.upto_seq for o in others) + 1
    raise click.ClickException(f"{said}{what}; the events seq {rest} to {plan.last_seq} are still in the journal: "
                               "run the command again to archive them")


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
