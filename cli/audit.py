"""The audit trail handed over: ``airlock journal keygen`` and ``checkpoint``, what ``export --sign``
writes beside an export, and what ``verify`` checks of signed exports, of several exports and a
journal as one chain, and of a checkpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import click

from journal import Journal, JournalError, VerifyReport, open_journal
from journal.archive import ArchiveRecord, archive_holding, archives_between, recorded_archives
from journal.chain import GAP, GENESIS, ChainCheck, feed_line
from journal.checkpoint import archived_start, checkpoint_problem, line_problem, make_checkpoint, malformed
from journal.manifest import (
    ExportTally,
    digest_problem,
    events_problem,
    manifest_path,
    manifest_problem,
    new_manifest,
)
from journal.signing import (
    SigningKey,
    document_bytes,
    load_public_key,
    new_private_key,
    read_document,
    signature_problem,
)

from .export import NotJsonLines, Tallied, read_export, write_all, write_file
from .files import CHECKPOINT_BYTES, MANIFEST_BYTES, TooBig, check_key_file, check_public_key, is_device, read_small
from .options import db_option, describe, echo, echo_bytes

__all__ = ["CannotCheck", "checkpoint", "export_signed", "keygen", "load_key", "refuse_device", "verify_audit",
           "verify_audit_wanted"]


# -- keygen --------------------------------------------------------------------------------------


@click.command()
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the private key to this file (PEM, mode 0600).")
@click.option("--force", is_flag=True, help="Replace the file if it exists (the old key is then lost).")
def keygen(output: Path, force: bool) -> None:
    """Make an Ed25519 key pair to sign exports and checkpoints with.

    The private key goes to --output (PEM, mode 0600: keep it secret, and give it to
    export --sign and checkpoint --sign). The public key is printed on stdout as 64 hex
    digits: give it to whoever checks your exports (verify --public-key). Needs the extra
    'sign': pip install 'airlock-journal[sign]'.

    Example:

    \b
        airlock journal keygen --output audit-key.pem > audit-key.pub
    """
    pem, public = new_private_key()
    if force:
        try:
            write_file(output, lambda out: write_all(out, pem))
        except OSError as e:
            raise click.ClickException(f"cannot write the key to {output}: {e.strerror or e}") from e
    else:
        try:
            fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as e:
            raise click.ClickException(f"{output} exists: keep that key, or replace it with --force") from e
        except OSError as e:
            raise click.ClickException(f"cannot write the key to {output}: {e.strerror or e}") from e
        try:
            with os.fdopen(fd, "wb") as out:
                write_all(out, pem)
        except OSError as e:
            output.unlink(missing_ok=True)
            raise click.ClickException(f"cannot write the key to {output}: {e.strerror or e}") from e
    echo(public)
    pub = output.with_suffix(".pub") if output.suffix else output.with_name(output.name + ".pub")
    if sys.stdout.isatty():
        where = f"The line above is the public key, which verifiers need: save it, e.g. echo {public} > {pub}"
    else:
        where = f"The public key ({public}) went to standard output: verifiers need it (--public-key)."
    click.echo(f"Wrote the private key to {output} (mode 0600): keep it secret.\n{where}", err=True)


def load_key(path: Path | None) -> SigningKey | None:
    """The signing key at ``path`` (None for none), read before anything is written; a device or a
    file too large to be a key is refused without reading it."""
    if path is None:
        return None
    check_key_file(path)
    return SigningKey.load(path)


# -- checkpoint ----------------------------------------------------------------------------------


@click.command()
@click.option("--sign", "key_file", type=click.Path(dir_okay=False, path_type=Path), metavar="KEY",
              help="Sign the checkpoint with this private key (from keygen).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
              help="Write the checkpoint to this file instead of stdout ('-': stdout).")
@db_option
def checkpoint(key_file: Path | None, output: Path | None, db: str) -> None:
    """Write down the journal's head (seq, hash, at), to keep or publish elsewhere.

    Kept where the journal's writers cannot reach it, a checkpoint later shows whether the
    journal still holds that seq with that hash: verify --checkpoint FILE fails for a log cut
    short or rewritten before that point. Once its seq is archived, it is checked against the
    archives: verify --checkpoint FILE --export A1 ... --db J. With --sign the checkpoint is
    signed (the extra 'sign').

    Example:

    \b
        airlock journal checkpoint --sign audit-key.pem -o checkpoint-2026-12-06.json
    """
    signer = load_key(key_file)
    with open_journal(db, readonly=True, create=False) as j:
        made = make_checkpoint(j)
    if signer is not None:
        made = signer.sign(made)
    content = document_bytes(made)
    if output is None or output == Path("-"):
        echo_bytes(content)
        return
    try:
        write_file(output, lambda out: write_all(out, content))
    except OSError as e:
        raise click.ClickException(f"cannot write the checkpoint to {output}: {e.strerror or e}") from e
    click.echo(f"Wrote the checkpoint of seq {made['seq']} to {output}", err=True)


# -- export --sign ---------------------------------------------------------------------------------


def export_signed(
    output: Path, filters: dict[str, Any], redact: frozenset[str], key: SigningKey,
    write_export: Callable[[BinaryIO], int],
) -> int:
    """Write the export to ``output`` through ``write_export(out)``, then its signed manifest
    beside it (:func:`journal.manifest.manifest_path`); returns the number of events.

    The export is put in place first, then the manifest: a run killed between the two leaves the
    export beside an older manifest (or none), which verify reports as not matching.
    """
    tally = ExportTally()
    target = Path(os.path.realpath(output))
    written = write_file(target, lambda out: write_export(Tallied(out, tally.add)))  # type: ignore[arg-type]
    manifest = key.sign(new_manifest(target, tally, filters, redact))
    content = document_bytes(manifest)
    where = manifest_path(output)
    try:
        write_file(Path(os.path.realpath(where)), lambda out: write_all(out, content))
    except OSError as e:
        raise click.ClickException(f"the manifest could not be written to {where}: {e.strerror or e}") from e
    click.echo(f"Wrote its signed manifest to {where}", err=True)
    return written


# -- verify: signed exports, exports joined to a journal, checkpoints ------------------------------


def verify_audit_wanted(exports: tuple[Path, ...], public_key: str | None, checkpoint_files: tuple[Path, ...],
                        db_given: bool) -> bool:
    """Whether verify goes beyond one unsigned export or the journal alone; raises a usage error
    for options that do not go together."""
    if public_key is not None and not exports and not checkpoint_files:
        raise click.UsageError("--public-key goes with --export FILE or --checkpoint FILE")
    named = {os.path.realpath(e): e for e in exports if str(e) != "-"}
    both = [c for c in checkpoint_files if os.path.realpath(c) in named]
    if both:
        raise click.UsageError(f"{both[0]} is given as --checkpoint and as --export: a checkpoint is one file, "
                               "checked against the exports (the archives) and the journal")
    joined = len(exports) > 1 or (bool(exports) and db_given)
    if (joined or public_key is not None or checkpoint_files) and any(str(f) == "-" for f in exports):
        raise click.UsageError("'-' (stdin) is for one unsigned --export alone: name the files")
    return joined or public_key is not None or bool(checkpoint_files)


class CannotCheck(click.ClickException):
    """A checkpoint that what verify was given cannot check (its seq archived, the archive not
    given): no sign of tampering, and not a pass; ``report`` is what ``--json`` prints."""

    def __init__(self, message: str, report: VerifyReport) -> None:
        super().__init__(message)
        self.report = report


class _Failed(Exception):
    """One part of a verify failed: ``source`` (a file, the journal) and its report."""

    def __init__(self, source: str, report: VerifyReport) -> None:
        super().__init__(report.problem)
        self.source = source
        self.report = report


def _failed(source: str, check: ChainCheck | None, problem: str, seq: int | None = None) -> _Failed:
    events, head = (0, GENESIS) if check is None else (check.report().events, check.head)
    return _Failed(source, VerifyReport(ok=False, events=events, head=head, first_bad_seq=seq, problem=problem))


def _read(path: Path, what: str, limit: int) -> bytes:
    """The bytes of the small file ``path`` (a ``what``); raises :class:`TooBig` for a device or a
    file of more than ``limit`` bytes, and an error naming it when it cannot be read."""
    try:
        return read_small(path, limit, f"a {what}")
    except FileNotFoundError as e:
        raise click.ClickException(f"no {what} {path}") from e
    except OSError as e:
        raise click.ClickException(f"cannot read {what} {path}: {e.strerror or e}") from e


def _signed_manifest(export: Path, public_key: str) -> dict[str, Any]:
    """The manifest beside ``export``, once it is byte for byte as written and signed by
    ``public_key``; raises :class:`_Failed` naming the manifest otherwise."""
    where = manifest_path(export)
    try:
        raw = read_small(where, MANIFEST_BYTES, "a manifest")
    except FileNotFoundError as e:
        raise click.ClickException(f"{export} has no manifest {where}: export it with --sign to check its "
                                   "signature") from e
    except OSError as e:
        raise click.ClickException(f"cannot read {where}: {e.strerror or e}") from e
    except TooBig as e:
        raise _failed(str(where), None, str(e)) from e
    manifest, problem = read_document(raw, exact=True)
    if manifest is not None:
        problem = manifest_problem(manifest) or signature_problem(manifest, public_key)
    if problem is not None or manifest is None:
        raise _failed(str(where), None, problem or "it cannot be read")
    return manifest


def _file_digest(export: Path) -> tuple[str, int]:
    """The sha256 (hex) and the size of the file ``export``, read in large blocks."""
    digest, size = hashlib.sha256(), 0
    with export.open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def _check_export(export: Path, check: ChainCheck, manifest: dict[str, Any] | None, empty_ok: bool,
                  wanted: frozenset[int] = frozenset(), found: dict[int, tuple[Any, Any, str]] | None = None) -> int:
    """Feed the events of ``export`` to ``check`` after the files before it; with its signed
    ``manifest``, check its digest first. An export without events is an error unless its signed
    manifest says so or ``empty_ok``. Returns its event count; raises :class:`_Failed`. The
    ``hash`` and ``at`` of each event whose ``seq`` is ``wanted`` (a checkpoint's) go to ``found``."""
    before = check.report().events
    first: dict[str, Any] | None = None
    last: dict[str, Any] = {}
    problem: str | None = None
    try:
        refuse_device(export)
        if manifest is not None:
            changed = digest_problem(manifest, *_file_digest(export))
            if changed is not None:  # told before anything the changed file shows
                raise _failed(str(export), check, changed)
        with export.open("rb") as stream:
            try:
                for n, line in enumerate(read_export(stream), 1):
                    if first is None:
                        first = line
                    if not feed_line(check, n, line):
                        break
                    last = line
                    if found is not None and line["seq"] in wanted:
                        found[line["seq"]] = (line["hash"], line["at"], str(export))
            except NotJsonLines as e:
                problem = f"it is not a JSON Lines export: {e}"
    except FileNotFoundError as e:
        raise click.ClickException(f"no export {export}") from e
    except OSError as e:
        raise click.ClickException(f"cannot read {export}: {e.strerror or e}") from e
    events = check.report().events - before
    if problem is not None:
        raise _failed(str(export), check, problem)
    if not check.ok:
        raise _Failed(str(export), check.report())
    if manifest is not None:
        seen = {"events": events, "first_seq": (first or {}).get("seq"),
                "first_prev_hash": (first or {}).get("prev_hash"), "last_seq": last.get("seq"),
                "head_hash": last.get("hash")}
        mismatch = events_problem(manifest, seen)
        if mismatch is not None:
            raise _failed(str(export), check, mismatch)
    if not events and manifest is None and not empty_ok:
        raise _failed(str(export), check, "it holds no events, and an empty export is evidence of nothing (an "
                      "export whose filters matched no event verifies with --allow-gaps)")
    return events


def _join_journal(j: Journal, check: ChainCheck, exports: tuple[Path, ...], source: str) -> tuple[int, str]:
    """Check that the journal continues the chain the exports end (at ``check``'s last seq and
    hash), on a journal that verified alone; returns its events beyond the exports and the head."""
    last_seq, last_hash = check.last_seq, check.head
    named = exports[-1]
    if last_seq:
        at_last = next(iter(j.events(after_seq=last_seq - 1)), None)
        if at_last is not None and at_last.seq == last_seq and at_last.hash != last_hash:
            raise _failed(source, check, f"its seq {last_seq} has the hash {at_last.hash}, not the one "
                          f"{named} ends with ({last_hash}): they are not one chain", last_seq)
    following = next(iter(j.events(after_seq=last_seq)), None)
    end_seq, end_hash = j.head()
    if following is None:
        if end_seq < last_seq:
            raise _failed(source, check, f"its log ends at seq {end_seq}, before seq {last_seq} where "
                          f"{named} ends: events have been removed from its end", end_seq + 1)
        return 0, last_hash
    if following.seq != last_seq + 1:
        raise _failed(source, check, f"it goes on at seq {following.seq} after seq {last_seq} where "
                      f"{named} ends: {GAP}", following.seq)
    if following.prev_hash != last_hash:
        raise _failed(source, check, f"its seq {following.seq} does not link to the hash {named} "
                      "ends with: they are not one chain", following.seq)
    return j.count_events(after_seq=last_seq), end_hash


def verify_audit(
    exports: tuple[Path, ...], public_key: str | None, checkpoint_files: tuple[Path, ...], allow_gaps: bool,
    db: str | None,
) -> tuple[VerifyReport, str]:
    """Verify ``exports`` in order as one chain (each against its signed manifest when
    ``public_key`` is given), then the journal ``db`` (when given) as their continuation, and
    ``db`` against each checkpoint of ``checkpoint_files``: its ``seq`` and ``hash`` are looked for
    in the exports (the archives) and then in the journal. Returns the report and what it is of."""
    if public_key is not None:
        check_public_key(public_key)
    key = None if public_key is None else load_public_key(public_key)
    checkpoints = [(path, _read_checkpoint(path, key)) for path in checkpoint_files]
    wanted = frozenset(made["seq"] for _, made in checkpoints)
    seen: dict[int, tuple[Any, Any, str]] = {}
    counted = 0
    check = ChainCheck()
    try:
        manifests = [None if key is None else _signed_manifest(export, key) for export in exports]
        # A signed export made with filters says so: its gaps in seq are expected.
        filtered = len(manifests) == 1 and manifests[0] is not None and any(manifests[0]["filters"].values())
        check = ChainCheck(allow_gaps or filtered)
        for export, manifest in zip(exports, manifests, strict=True):
            counted += _check_export(export, check, manifest, allow_gaps, wanted, seen)
        if db is None:
            return check.report(), ", ".join(str(f) for f in exports)
        with open_journal(db, readonly=True, create=False) as j:
            alone = j.verify()
            if not exports:
                # A checkpoint that does not match first: a log cut short or rewritten (which may
                # verify alone) is what checkpoints are kept to find.
                mismatch = _checkpoints_mismatch(j, checkpoints, seen, exports, db)
                if mismatch is not None:
                    return dataclasses.replace(alone, ok=False, first_bad_seq=None, problem=mismatch[1]), mismatch[0]
                if alone.ok:
                    _matched(checkpoints, seen)
                return alone, describe(db)
            if not alone.ok:
                raise _Failed(describe(db), alone)
            more, head = _join_journal(j, check, exports, describe(db))
            mismatch = _checkpoints_mismatch(j, checkpoints, seen, exports, db)
            if mismatch is not None:
                return VerifyReport(ok=False, events=counted + more, head=head, problem=mismatch[1]), mismatch[0]
    except _Failed as failed:
        return _missing_archives_named(failed, check, exports, db), failed.source
    _matched(checkpoints, seen)
    shown = f"{', '.join(str(f) for f in exports)} and {describe(db)}"
    return VerifyReport(ok=True, events=counted + more, head=head), shown


def _missing_archives_named(failed: _Failed, check: ChainCheck, exports: tuple[Path, ...],
                            db: str | None) -> VerifyReport:
    """The report of ``failed``; for events missing between the exports (or between them and the
    journal) that the journal ``db`` recorded archiving, one that names those archives and where
    they go among the --export files (no --allow-gaps, which would not join them)."""
    report = failed.report
    problem, bad = report.problem or "", report.first_bad_seq
    if db is None or bad is None or not problem.endswith(GAP) or bad <= check.last_seq + 1:
        return report
    first, last = check.last_seq + 1, bad - 1
    try:
        with open_journal(db, readonly=True, create=False) as j:
            recorded = archives_between(recorded_archives(j), first, last)
    except JournalError:
        return report
    if not recorded:
        return report
    files = ", ".join(a.describe() for a in recorded)
    adds = " ".join(f"--export {shlex.quote(a.file)}" for a in recorded)
    if failed.source in {str(e) for e in exports}:
        where = f"before --export {failed.source}"
    else:
        where = f"after --export {exports[-1]}" if exports else "first"
    them = "it (or its copy)" if len(recorded) == 1 else "them (or their copies) in seq order"
    problem = (f"{problem} (seq {first} to {last}): the journal recorded archiving them to {files}; give "
               f"{them}: {adds}, {where}")
    return dataclasses.replace(report, problem=problem)


def _read_checkpoint(checkpoint_file: Path, key: str | None) -> dict[str, Any]:
    """The checkpoint in ``checkpoint_file``, checked against ``key`` when given; raises an error
    naming the file when it cannot be used."""
    try:
        raw = _read(checkpoint_file, "checkpoint", CHECKPOINT_BYTES)
    except TooBig as e:
        raise click.ClickException(f"{checkpoint_file} is not a checkpoint that can be used: {e}") from e
    made, problem = read_document(raw, exact=False)
    if made is not None:
        problem = malformed(made)
    if problem is None and made is not None and key is not None:
        problem = signature_problem(made, key)
    if problem is not None or made is None:
        raise click.ClickException(f"{checkpoint_file} is not a checkpoint that can be used: {problem}")
    if key is None and "signature" in made:
        click.echo(f"The signature of {checkpoint_file} is not checked: give --public-key to check it.", err=True)
    return made


def _checkpoints_mismatch(j: Journal, checkpoints: list[tuple[Path, dict[str, Any]]],
                          seen: dict[int, tuple[Any, Any, str]], exports: tuple[Path, ...],
                          db: str) -> tuple[str, str] | None:
    """The first checkpoint that no longer matches the export line of its seq (``seen``) or else
    the journal: where (an export, or the journal) and the problem; None when each matches. A
    checkpoint whose seq the journal has archived, and no --export holds, raises
    :class:`CannotCheck`, which says what to run."""
    recorded: list[ArchiveRecord] | None = None
    for path, made in checkpoints:
        seq = made["seq"]
        if seq in seen:
            found_hash, at, where = seen[seq]
            problem = line_problem(made, found_hash, at, where)
            source = where
        else:
            if archived_start(j, made) is not None:
                recorded = recorded_archives(j) if recorded is None else recorded
                message = _archived_checkpoint(path, seq, recorded, exports, db)
                raise CannotCheck(message, VerifyReport(ok=False, events=0, head=GENESIS, problem=message))
            problem = checkpoint_problem(j, made)
            source = describe(db)
        if problem is not None:
            return source, f"it no longer matches the checkpoint {path}: {problem}"
    return None


def _archived_checkpoint(path: Path, seq: int, recorded: list[ArchiveRecord], exports: tuple[Path, ...],
                         db: str) -> str:
    """What to say of the checkpoint ``path`` whose ``seq`` the journal ``db`` archived, and which
    no --export given holds: where the journal archived it, and the command that checks it."""
    holding = archive_holding(recorded, seq)
    where = (f"to {holding.file}, as the journal recorded (that archive holds seq {holding.first_seq} to "
             f"{holding.upto_seq})" if holding is not None else "and the journal holds no record of its archive")
    alone = f"{describe(db)} and the --export files given" if exports else f"{describe(db)} alone"
    every = " ".join(f"--export {shlex.quote(a.file)}" for a in recorded) or "--export ARCHIVE ..."
    command = (f"airlock journal verify --checkpoint {shlex.quote(str(path))} {every} "
               f"--db {shlex.quote(describe(db))}")
    return (f"the checkpoint {path} cannot be checked against {alone}: its seq {seq} was archived {where}, "
            "and the journal no longer holds it (no sign of tampering); check it against the archives and the "
            f"journal together, every archive in seq order: {command}")


def _matched(checkpoints: list[tuple[Path, dict[str, Any]]], seen: dict[int, tuple[Any, Any, str]]) -> None:
    """Say on stderr what held each checkpoint's seq with its hash."""
    if len(checkpoints) == 1:
        path, made = checkpoints[0]
        held = "The journal" if made["seq"] not in seen else f"The archive {seen[made['seq']][2]}"
        click.echo(f"{held} holds seq {made['seq']} of the checkpoint {path} with its hash.", err=True)
    elif checkpoints:
        seqs = [made["seq"] for _, made in checkpoints]
        archived = sum(1 for seq in seqs if seq in seen)
        click.echo(f"Each of the {len(checkpoints)} checkpoints (seq {min(seqs)} to {max(seqs)}) matches: "
                   f"{archived} in the archives, {len(checkpoints) - archived} in the journal.", err=True)


def refuse_device(export: Path) -> None:
    """Refuse an ``--export`` FILE that is a device (``/dev/zero``): an export is a file, or a pipe
    (``-``, or a shell's ``<(...)``), and a device's read may never end. Raises ``OSError`` as stat
    does, for the caller to report."""
    if is_device(os.stat(export).st_mode):
        raise click.ClickException(f"cannot read {export}: it is a device, not an export file")


def note_unchecked_manifests(exports: tuple[Path, ...]) -> None:
    """Say on stderr which exports have a manifest that was not checked (no --public-key)."""
    for export in exports:
        if str(export) != "-" and manifest_path(export).exists():
            click.echo(f"{manifest_path(export)} is not checked: give --public-key to check its signature.",
                       file=sys.stderr)
