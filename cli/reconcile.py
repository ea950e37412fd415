"""``airlock journal reconcile``: ask the backend about every call in doubt, with the tools' checks."""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click

from guard.effect_guard import wrapped_chain
from guard.reconcile import DEFAULT_CHECK_TIMEOUT, Check, ReconcileResult, reconciler_of
from journal import open_journal
from journal.reconcile import tools_without_calls

from . import render
from .options import TEXT, db_option, echo, echo_bytes

__all__ = ["load_checks", "reconcile"]

if TYPE_CHECKING:  # generic from click 8.4 on, by the value converted to; older clicks take no argument
    AgeType = click.ParamType[timedelta]
else:
    AgeType = click.ParamType

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
            return timedelta(seconds=float(found.group(1)) * _SECONDS[found.group(2).lower()])
        except OverflowError:
            self.fail(f"{value!r} is too long a time", param, ctx)


def _guarded(obj: object) -> bool:
    return callable(obj) and any("__airlock__" in getattr(o, "__dict__", {}) for o in wrapped_chain(obj))


def load_checks(spec: str) -> dict[str, Check]:
    """The checks ``MODULE[:ATTR]`` names: with ``:ATTR``, that mapping of tool name to check;
    without, the check of every guarded function of the module that carries ``@reconciled_by``.

    Raises ``click.UsageError`` for a module that does not import, an attribute that is missing or
    is no such mapping, or a module without any check.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise click.UsageError(f"--with takes MODULE or MODULE:ATTR, not {spec!r}")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # the current directory first, as `python -m` has it
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise click.UsageError(f"--with: the module {module_name!r} does not import: {type(e).__name__}: {e}") from e
    if attr:
        found = getattr(module, attr, None)
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
    return f"{result.call_id}  {result.tool}  {_MARK[result.outcome]}{seq}  {result.message}".rstrip()


@click.command()
@click.option("--with", "spec", required=True, type=TEXT, metavar="MODULE[:ATTR]",
              help="Where the checks are: a module whose guarded tools carry @reconciled_by, or MODULE:ATTR "
                   "naming a dict of tool name to check. The current directory is searched first.")
@click.option("--tool", type=TEXT, help="Only the calls of this tool.")
@click.option("--older-than", type=Age(), metavar="AGE",
              help="Only calls in doubt for longer than this: 90s, 10m, 2h, 3d.")
@click.option("--dry-run", is_flag=True, help="Ask the backend, print what it says, append nothing.")
@click.option("--timeout", type=click.FloatRange(min=0.001), default=DEFAULT_CHECK_TIMEOUT, show_default=True,
              help="Seconds a check may take; past it the call's result is an error.")
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
    click.echo(f"Dry run (nothing appended): {said}" if dry_run else said, err=as_json)
    if counts["error"]:
        sys.exit(1)

