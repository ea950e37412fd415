"""``airlock journal reconcile``: ask the backend about every call in doubt, with the tools' checks."""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import sys
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import click

from guard.effect_guard import wrapped_chain
from guard.reconcile import DEFAULT_CHECK_TIMEOUT, Check, ReconcileResult, reconciler_of
from journal import open_journal
from journal.reconcile import in_doubt, tools_without_calls

from . import render
from .options import TEXT, db_option, echo, echo_bytes, one_line

__all__ = ["MOST_CHECK_SECONDS", "load_checks", "reconcile"]

# The longest --timeout: a day. A check asks a backend and answers in seconds; a longer wait is a
# mistake, and past what a clock or a lease can count (inf, 1e308) no wait can be kept at all.
MOST_CHECK_SECONDS = 86400.0

if TYPE_CHECKING:  # generic from click 8.4 on, by the value converted to; older clicks take no argument
    AgeType = click.ParamType[timedelta]
    SecondsType = click.ParamType[float]
else:
    AgeType = SecondsType = click.ParamType

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class Age(AgeType):
    """A length of time: ``90s``, ``10m``, ``2h``, ``3d``, ``1w`` (a bare number is seconds)."""

    name = "age"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> timedelta:
        if isinstance(value, timedelta):
            return value
        found = _AGE.match(str(value))
        if not found:
            self.fail(f"{value!r} is not a length of time: give one like 90s, 10m, 2h, 3d", param, ctx)
        try:
            age = timedelta(seconds=float(found.group(1)) * _SECONDS[found.group(2).lower()])
            datetime.now(UTC) - age  # the calls older than that begin after the year 1: time only moves on
        except OverflowError:  # a float past timedelta's days, or now less the age before the year 1
            self.fail(f"{value!r} is out of range: give an age that reaches back no further than the year 1, "
                      "such as 10m, 2h, 3d", param, ctx)
        return age


class Seconds(SecondsType):
    """A number of seconds from ``least`` to ``most``: never NaN or infinite (``1e400`` reads as
    infinite), which no deadline can be kept for."""

    name = "seconds"

    def __init__(self, least: float, most: float, most_said: str) -> None:
        self.least, self.most, self.most_said = least, most, most_said

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float) and self.least <= value <= self.most:
            return value
        span = f"{self.least:g}<=x<={self.most:g} (seconds: at most {self.most_said})"
        try:
            seconds = float(str(value).strip())
        except ValueError:
            self.fail(f"{value!r} is not a number of seconds: give one in the range {span}", param, ctx)
        if not self.least <= seconds <= self.most:  # NaN is in no range
            self.fail(f"{value!r} is not in the range {span}", param, ctx)
        return seconds


def _said(error: BaseException) -> str:
    """``error`` as ``Type: message`` (its type alone when its ``str()`` fails too)."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:
        return type(error).__name__


def _dotted(name: str) -> bool:
    """Whether ``name`` is a dotted Python name: identifiers joined by dots, no space anywhere."""
    return all(part.isidentifier() for part in name.split("."))


def _guarded(obj: object) -> bool:
    return callable(obj) and any("__airlock__" in getattr(o, "__dict__", {}) for o in wrapped_chain(obj))


def load_checks(spec: str) -> dict[str, Check]:
    """The checks ``MODULE[:ATTR]`` names: with ``:ATTR``, that mapping of tool name to check;
    without, the check of every guarded function of the module that carries ``@reconciled_by``.

    ``MODULE`` and ``ATTR`` are each a dotted Python name (``payments.checks:CHECKS``,
    ``payments:registry.CHECKS``), as an entry point names an object.

    Raises ``click.UsageError`` for a ``spec`` of another form (``payments:``, ``:CHECKS``, a
    space), a module that does not import, an attribute that is missing or is no such mapping, or
    a module without any check.
    """
    module_name, colon, attr = spec.partition(":")
    if not _dotted(module_name) or (colon and not _dotted(attr)):
        raise click.UsageError(f"--with takes MODULE or MODULE:ATTR, each a dotted Python name (payments, "
                               f"payments:CHECKS), not {spec!r}")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # the current directory first, as `python -m` has it
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise click.UsageError(f"--with: the module {module_name!r} does not import: {_said(e)}") from e
    if attr:
        found: Any = module
        for part in attr.split("."):
            try:
                found = getattr(found, part, None)
            except Exception:  # a module's __getattr__, a property, that fails: no such mapping here
                found = None
        if not isinstance(found, Mapping):
            raise click.UsageError(f"--with: {module_name}.{attr} is not a dict of tool name to check")
        checks = dict(found)
        wrong = [name for name, check in checks.items() if not isinstance(name, str) or not callable(check)]
        if wrong:
            raise click.UsageError(f"--with: {module_name}.{attr} maps {wrong[0]!r} to something that is not a check")
    else:
        checks = {}
        for name, obj in inspect.getmembers(module, _guarded):
            check = reconciler_of(obj)
            if check is not None:
                checks[getattr(obj, "__name__", name)] = check
    if not checks:
        raise click.UsageError(f"--with: no check found in {spec!r} (put @reconciled_by(check) on its guarded tools, "
                               "or name a dict of tool name to check as MODULE:ATTR)")
    return checks


_MARK = {"applied": "applied", "not_applied": "not applied", "still_unknown": "still unknown",
         "error": "error", "skipped": "skipped"}


def _line(result: ReconcileResult) -> str:
    seq = f" (seq {result.seq})" if result.seq is not None else ""
    # One line a call, whatever the check's evidence holds (a line break, a control character).
    return one_line(f"{result.call_id}  {result.tool}  {_MARK[result.outcome]}{seq}  {result.message}")


@click.command()
@click.option("--with", "spec", required=True, type=TEXT, metavar="MODULE[:ATTR]",
              help="Where the checks are: a module whose guarded tools carry @reconciled_by, or MODULE:ATTR "
                   "naming a dict of tool name to check. The current directory is searched first.")
@click.option("--tool", type=TEXT, help="Only the calls of this tool.")
@click.option("--older-than", type=Age(), metavar="AGE",
              help="Only calls in doubt for longer than this: 90s, 10m, 2h, 3d.")
@click.option("--dry-run", is_flag=True, help="Ask the backend, print what it says, append nothing.")
@click.option("--timeout", type=Seconds(0.001, MOST_CHECK_SECONDS, "a day"), default=DEFAULT_CHECK_TIMEOUT,
              show_default=True,
              help="Seconds a check may take, at most 86400 (a day); past it the call's result is an error.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON Lines, one call a line.")
@db_option
def reconcile(spec: str, tool: str | None, older_than: timedelta | None, dry_run: bool, timeout: float,
              as_json: bool, db: str) -> None:
    """Settle the calls in doubt by asking the backend, with the tools' checks.

    Each pending or unknown call whose tool has a check, and whose owner is not alive, is given to
    the check: Applied appends "committed", NotApplied appends "released" (the actor is
    reconciler:NAME), None leaves it in doubt. An outcome is appended only if the call has not
    moved on meanwhile. A line per call (call id, tool, outcome, evidence), then a summary.

    Exit status: 0 when every check ran (some calls may still be in doubt), 1 when a check
    failed or the journal cannot be used, 2 on a usage error.

    Example:

    \b
        airlock journal reconcile --with payments --older-than 10m

    \b
        */10 * * * * cd /srv/agent && airlock journal reconcile --with payments:CHECKS --json >> reconcile.log
    """
    # Each call's line says what its check did; the guard logger's warnings would say it twice.
    logging.getLogger("guard").addHandler(logging.NullHandler())
    checks = load_checks(spec)
    if tool is not None:
        if tool not in checks:
            raise click.UsageError(f"--tool: no check for the tool {tool!r} in {spec!r}")
        checks = {tool: checks[tool]}
    with open_journal(db, readonly=dry_run, create=False) as j:
        for name in tools_without_calls(j, sorted(checks)):
            click.echo(f"Note: the journal has no call of the tool {name!r}; its check was not used.", err=True)
        results: list[ReconcileResult] = j.reconcile(
            checks, tool=tool, older_than=older_than, dry_run=dry_run, timeout=timeout)
        # The calls in doubt that --older-than left to the agent's own retry: said, not hidden.
        younger = 0 if older_than is None else len(in_doubt(j, tool)) - len(in_doubt(j, tool, older_than))
    counts = {outcome: 0 for outcome in _MARK}
    for result in results:
        counts[result.outcome] += 1
        if as_json:
            echo_bytes(render.dumps_line({
                "call_id": result.call_id, "tool": result.tool, "outcome": result.outcome,
                "message": result.message, "seq": result.seq, "dry_run": dry_run,
            }))
        else:
            echo(_line(result))
    summary = ", ".join(f"{n} {_MARK[o]}" for o, n in counts.items() if n)
    said = f"{len(results)} call(s) in doubt: {summary}." if results else "No call in doubt."
    if younger > 0:
        past = f"older than {_age_text(older_than)}"
        said = (f"{len(results)} call(s) in doubt {past}: {summary}." if results else f"No call in doubt {past}.")
        said += (f" {younger} younger call(s) in doubt were left to the agent's own retry "
                 "(without --older-than they are checked too).")
    click.echo(f"Dry run (nothing appended): {said}" if dry_run else said, err=as_json)
    if counts["error"]:
        sys.exit(1)


def _age_text(age: timedelta | None) -> str:
    """``--older-than`` as a person reads it: 10m, 2h, 3d, 90s."""
    seconds = 0 if age is None else int(age.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
