"""``export``, ``verify`` and ``rebuild``: the audit trail written out, checked against its hashes
and its projection, and folded again into the projection; each walks the whole log, with a progress
bar when stderr is a terminal."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import click
from click.core import ParameterSource

from journal import Journal, open_journal
from journal.chain import GAP, verify_lines
from journal.events import REDACTABLE, VerifyReport
from journal.signing import SigningKey
from journal.urls import is_postgres_url

from . import audit, render
from .export import NotJsonLines, read_export, write_events, write_file
from .options import MOMENT, TEXT, FieldList, db_option, describe, echo, echo_bytes, json_option, output_failed

T = TypeVar("T")


# -- export --------------------------------------------------------------------------------------


@click.command()
@click.option("--nl", "as_nl", is_flag=True, help="JSON Lines, one event a line (the default).")
@click.option("--csv", "as_csv", is_flag=True, help="CSV: a header row, JSON values as text.")
@click.option("--format", "fmt", type=click.Choice(("jsonl", "csv")), default=None,
              help="The same as --nl or --csv (jsonl or csv).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True, allow_dash=True, path_type=Path),
              help="Write to this file instead of stdout ('-': stdout).")
@click.option("--since", type=MOMENT, help="Only events at or after: ISO-8601, or an age like 10m, 2h, 3d.")
@click.option("--until", type=MOMENT, help="Only events before this time.")
@click.option("--call", "call_id", type=TEXT, help="Only the events of this call.")
@click.option("--tool", type=TEXT, help="Only events of this tool.")
@click.option("--agent", "agent_id", type=TEXT, help="Only events of this agent.")
@click.option("--redact", type=FieldList(tuple(sorted(REDACTABLE))), multiple=True, metavar="FIELDS",
              help="Comma-separated, or the flag repeated: arguments,value. Each becomes null and is named "
                   "in 'redacted'; its sha256 stays, so the export still verifies.")
@click.option("--sign", "key_file", type=click.Path(dir_okay=False, path_type=Path), metavar="KEY",
              help="Sign it: write OUTPUT.manifest.json beside --output, signed with this private key (keygen).")
@db_option
def export(
    as_nl: bool,
    as_csv: bool,
    fmt: str | None,
    output: Path | None,
    since: datetime | None,
    until: datetime | None,
    call_id: str | None,
    tool: str | None,
    agent_id: str | None,
    redact: tuple[frozenset[str], ...],
    key_file: Path | None,
    db: str,
) -> None:
    """Export the audit trail, one event at a time, in seq order.

    Every field of each event, plus arguments_sha256 and value_sha256; arguments, value, error,
    reason and owner are JSON values. A filtered export has gaps in seq: verify it with
    --allow-gaps. Writing to --output replaces the file only once the export is complete.

    Example:

    \b
        airlock journal export --since 2026-12-01 --redact arguments,value -o audit.jsonl

    \b
        airlock journal export --csv --tool charge > charges.csv
    """
    given = [f for f, on in (("jsonl", as_nl), ("csv", as_csv)) if on] + ([fmt] if fmt is not None else [])
    if len(set(given)) > 1:
        raise click.UsageError("--nl, --csv and --format choose one output: give one")
    fmt = given[0] if given else "jsonl"
    if output == Path("."):  # click makes an empty --output the current directory
        raise click.BadParameter("is empty: name the file to write the export to", param_hint="'--output' / '-o'")
    if output == Path("-"):  # the usual name for stdout; a file named so is ./- in full
        output = None
    if key_file is not None and (output is None or fmt != "jsonl"):
        raise click.UsageError("--sign writes a manifest beside the export: it needs --output FILE, in the "
                               "jsonl format")
    signer = audit.load_key(key_file)
    redacted = frozenset().union(*redact)  # every --redact given counts: none is dropped
    filters: dict[str, Any] = {"call_id": call_id, "tool": tool, "agent_id": agent_id, "since": since, "until": until}
    journal_file = None if output is None else _journal_file(output, db)
    if journal_file is not None:
        what = "the journal" if journal_file == db else "a file SQLite keeps with the journal"
        raise click.BadParameter(f"{output} is {what} {db}: write the export to another file",
                                 param_hint="'--output' / '-o'")
    with open_journal(db, readonly=True, create=False) as j:
        if output is None:
            try:
                out = sys.stdout.buffer
                write_events(j, filters, out, fmt=fmt, redact=redacted)
                out.flush()
            except OSError as e:
                output_failed(e, "the export")
            return
        written = _export_to_file(j, filters, output, fmt, redacted, signer)
    click.echo(f"Exported {written} events to {output}", err=True)


def _journal_file(output: Path, db: str) -> str | None:
    """Which of the SQLite journal ``db`` and the files SQLite keeps beside it ``output`` is, or None."""
    if is_postgres_url(db):
        return None
    real = os.path.realpath(db)  # SQLite keeps its side files beside the file a link names
    for name in (db, f"{db}-wal", f"{db}-shm", f"{db}-journal", f"{real}-wal", f"{real}-shm", f"{real}-journal"):
        if os.path.realpath(output) == os.path.realpath(name):  # realpath: a symlink loop is no error
            return name
        try:
            if os.path.samefile(output, name):  # a hard link, say
                return name
        except OSError:  # one of the two does not exist: not the same file
            continue
    return None


def _export_to_file(j: Journal, filters: dict[str, Any], output: Path, fmt: str, redact: frozenset[str],
                    signer: SigningKey | None = None) -> int:
    try:
        replaceable = stat.S_ISREG(output.stat().st_mode)
    except FileNotFoundError:
        replaceable = True
    except OSError as e:
        raise click.ClickException(f"cannot write to {output}: {e.strerror or e}") from e
    if not replaceable:
        if signer is not None:
            raise click.ClickException(f"{output} is not a regular file: a signed export needs one, beside its "
                                       "manifest")
        # A FIFO or a device is written into: renaming a file over it would replace the node.
        try:
            with output.open("wb") as out:
                return _write_export(j, filters, out, fmt, redact)
        except BrokenPipeError:
            sys.exit(1)  # the reader of a pipe went away (-o /dev/stdout | head): as for stdout, quietly
        except OSError as e:
            raise click.ClickException(f"the export could not be written to {output}: {e.strerror or e}") from e
    try:
        if signer is not None:
            return audit.export_signed(output, filters, redact, signer,
                                       lambda out: _write_export(j, filters, out, fmt, redact))
        # A symbolic link stays one: the file it names is the one replaced (/dev/stdout sent to a file, say).
        return write_file(Path(os.path.realpath(output)), lambda out: _write_export(j, filters, out, fmt, redact))
    except OSError as e:
        raise click.ClickException(f"the export could not be written to {output}: {e.strerror or e}") from e


def _write_export(j: Journal, filters: dict[str, Any], out: BinaryIO, fmt: str, redact: frozenset[str]) -> int:
    """Write the export to ``out``, with a progress bar when stderr is a terminal; returns the count."""
    if sys.stderr.isatty():
        with click.progressbar(length=j.count_events(**filters), label="Exporting", file=sys.stderr) as bar:
            return write_events(j, filters, out, fmt=fmt, redact=redact, advance=bar.update)
    return write_events(j, filters, out, fmt=fmt, redact=redact)


# -- verify --------------------------------------------------------------------------------------


EMPTY_EXPORT = ("it holds no events, and an empty export is evidence of nothing (an export whose filters "
                "matched no event verifies with --allow-gaps)")


@click.command()
# A file that is not there (or is a directory) is an error, exit 1, as a journal that is not there is.
@click.option("--export", "export_files", type=click.Path(allow_dash=True, path_type=Path), multiple=True,
              help="Check this exported JSON Lines file offline instead of the journal ('-': stdin). Given "
                   "more than once, the files in order as one chain, and then the journal when --db is given.")
@click.option("--allow-gaps", is_flag=True, help="With --export: accept gaps in seq (a filtered export has them).")
@click.option("--public-key", metavar="PUBFILE_OR_HEX",
              help="Check the signature of each export's manifest (FILE.manifest.json) and the file's sha256, "
                   "or of the checkpoint: 64 hex digits, or a file holding them or a PEM public key.")
@click.option("--checkpoint", "checkpoint_files", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              multiple=True,
              help="Also check that the journal, or an --export (an archive) before it, still holds the "
                   "checkpoint's seq with its hash. May be given more than once.")
@json_option
@db_option
@click.pass_context
def verify(ctx: click.Context, export_files: tuple[Path, ...], allow_gaps: bool, public_key: str | None,
           checkpoint_files: tuple[Path, ...], as_json: bool, db: str) -> None:
    """Recompute the hash chain and check the projection against the log.

    Exit 0 with the event count and head hash; exit 1 naming the seq of the first bad event.
    With --export FILE, check an exported file instead: every event's hash and every link
    between consecutive seqs (no journal is opened); a file with no events is an error unless
    --allow-gaps says the export was filtered. With --public-key, each export must come
    with its signed manifest, and match it byte for byte. Several --export files, and --db
    after them, are checked as one chain in seq order. --checkpoint FILE fails when the journal
    no longer holds the checkpoint's seq with its hash (a log cut short or rewritten); a
    checkpoint whose seq was archived is checked against the archives given as --export, with
    the journal (--db) after them. --checkpoint may be given more than once.

    Example:

    \b
        airlock journal verify

    \b
        airlock journal verify --export audit.jsonl --allow-gaps

    \b
        airlock journal export --since 1d | airlock journal verify --export - --allow-gaps

    \b
        airlock journal verify --export audit.jsonl --public-key audit-key.pub

    \b
        airlock journal verify --checkpoint checkpoint.json --public-key audit-key.pub

    \b
        airlock journal verify --checkpoint checkpoint.json --export archive-2026-10.jsonl --db journal.db
    """
    export_file = export_files[0] if export_files else None
    if allow_gaps and export_file is None:
        raise click.UsageError("--allow-gaps goes with --export FILE")
    db_given = ctx.get_parameter_source("db") is ParameterSource.COMMANDLINE
    if audit.verify_audit_wanted(export_files, public_key, checkpoint_files, db_given):
        try:
            report, source = audit.verify_audit(export_files, public_key, checkpoint_files, allow_gaps,
                                                db if db_given or checkpoint_files else None)
        except audit.CannotCheck as e:  # a checkpoint whose seq is archived, and no archive holding it given
            if as_json:
                echo_bytes(render.dumps_line(dataclasses.asdict(e.report)))
            raise
    elif export_file is not None:
        audit.note_unchecked_manifests(export_files)
        report, source = _verify_export_file(export_file, allow_gaps)
    else:
        with open_journal(db, readonly=True, create=False) as j:
            report = _with_progress(j, "Verifying", j.verify)
        source = describe(db)
    if as_json:
        echo_bytes(render.dumps_line({
            "ok": report.ok, "events": report.events, "head": report.head,
            "first_bad_seq": report.first_bad_seq, "problem": report.problem,
        }))
    if not report.ok:  # with --json too: the JSON on stdout, the one line on stderr
        # The hint of --allow-gaps is for a gap in an export, never in the journal joined to them.
        raise _not_verified(report, source, export_file is not None and source != describe(db))
    if as_json:
        return
    if export_file is not None and not report.events:
        echo("OK: 0 events (an empty export: its filters matched no event)")
        return
    echo(f"OK: {report.events} events, head {report.head}")


def _verify_export_file(export_file: Path, allow_gaps: bool) -> tuple[VerifyReport, str]:
    """The report on an exported JSON Lines file (``-``: stdin), and how messages name the file."""
    from_stdin = str(export_file) == "-"
    source = "the export on stdin" if from_stdin else str(export_file)
    if from_stdin and sys.stdin is None:  # started with stdin closed ("<&-")
        raise click.ClickException(f"cannot read {source}: stdin is closed")
    try:
        if not from_stdin:
            audit.refuse_device(export_file)
        with contextlib.nullcontext(sys.stdin.buffer) if from_stdin else export_file.open("rb") as stream:
            report = verify_lines(read_export(stream), allow_gaps=allow_gaps)
    except NotJsonLines as e:
        raise click.ClickException(f"{source} is not a JSON Lines export: {e}") from e
    except OSError as e:
        raise click.ClickException(f"cannot read {source}: {e.strerror or e}") from e
    if report.ok and not report.events and not allow_gaps:
        # An empty file is evidence of nothing; only an export's filters matching no event explain it.
        report = dataclasses.replace(report, ok=False, problem=EMPTY_EXPORT)
    return report, source


def _not_verified(report: VerifyReport, source: str, from_export: bool) -> click.ClickException:
    """The one line that says where ``source`` does not verify (with a hint for a filtered export)."""
    hint = ""
    if from_export and (report.problem or "").endswith(GAP):
        hint = " (an export filtered by --call, --tool, --agent, --since or --until has gaps: add --allow-gaps)"
    if report.first_bad_seq is not None:
        return click.ClickException(f"{source} does not verify at seq {report.first_bad_seq}: {report.problem}{hint}")
    return click.ClickException(f"{source} does not verify: {report.problem}")


# -- rebuild -------------------------------------------------------------------------------------


@click.command()
@db_option
def rebuild(db: str) -> None:
    """Rebuild the projection (each call's current status) from the log.

    The log is never changed; the projection is folded again from its first event.

    Example:

    \b
        airlock journal rebuild --db /var/lib/agent/airlock-journal.db
    """
    with open_journal(db, create=False) as j:
        calls = _with_progress(j, "Rebuilding", j.rebuild)
    echo(f"Rebuilt the projection: {calls} calls")


def _with_progress(j: Journal, label: str, work: Callable[..., T]) -> T:
    """``work(advance=...)`` with a progress bar over the journal's events on stderr, when stderr
    is a terminal (as export has); ``work()`` otherwise."""
    if not sys.stderr.isatty():
        return work()
    events = j.head()[0]
    with click.progressbar(length=events, label=label, file=sys.stderr) as bar:
        result = work(advance=bar.update)
        bar.update(max(0, events - bar.pos))  # done: the store tells of whole stretches only
        return result

