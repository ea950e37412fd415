"""What every command shares: the command group that turns journal errors into one line, the
``--db`` and ``--json`` options, the parameter types for moments and field lists, and who is at
the keyboard when ``--operator`` is not given."""

from __future__ import annotations

import errno
import getpass
import io
import os
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import urlsplit, urlunsplit

import click
from click.core import ParameterSource

from guard.store import parse_at
from journal.errors import JournalError, JournalNotFound
from journal.open import without_secrets
from journal.urls import is_postgres_url

from .export import write_all

F = TypeVar("F", bound=Callable[..., Any])

if TYPE_CHECKING:  # generic from click 8.4 on, by the value converted to; older clicks take no argument
    TextType = click.ParamType[str]
    MomentType = click.ParamType[datetime]
    FieldsType = click.ParamType[frozenset[str]]
else:
    TextType = MomentType = FieldsType = click.ParamType

DEFAULT_DB = "airlock-journal.db"
DB_ENVVAR = "AIRLOCK_JOURNAL"
_DB_SOURCE = "airlock.db_source"  # in the context's meta: where --db came from (the flag, DB_ENVVAR, the default)


class UsageFailure(click.ClickException):
    """A usage error (a missing, unknown or conflicting flag, a malformed value), reported as every
    error is: one line ``Error: ...`` on stderr; exit 2."""

    exit_code = 2


# Click (8.2 on) asks for a group's help by raising this when the group is given no command; on
# click 8.1 it is (), which nothing matches.
_HELP_WANTED: type[click.UsageError] | tuple[()] = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _usage_failure(error: click.UsageError) -> click.ClickException:
    if isinstance(error, _HELP_WANTED):
        return error  # prints the group's help, as click does
    return UsageFailure(one_line(error.format_message()))


# The exit status of a command ended by Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130


class Group(click.Group):
    """A click group that reports a journal error as ``Error: ...`` and exit 1, and a usage error
    as ``Error: ...`` and exit 2: one line on stderr, never a traceback.

    This is the one place where the journal's errors and click's usage errors become the CLI's.
    """

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            raise _usage_failure(e) from e

    def main(self, *args: Any, **kwargs: Any) -> Any:
        if sys.stdout is None:  # started with stdout closed (">&-"): writing to it fails, as a write does
            sys.stdout = ClosedStream()
        try:
            return super().main(*args, **kwargs)
        except OSError as e:  # --help or --version, which click writes itself, could not be written
            try:
                output_failed(e)
            except click.ClickException as failed:
                failed.show()
                sys.exit(failed.exit_code)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands with the whole first sentence of each one's help, wrapped, never cut with "...": a
        person chooses a command by it."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is None or command.hidden:
                continue
            rows.append((name, command.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        if sys.stdout is None:
            sys.stdout = ClosedStream()
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise _usage_failure(e) from e
        except JournalNotFound as e:
            raise click.ClickException(_not_found(e, ctx.meta.get(_DB_SOURCE))) from e
        except JournalError as e:
            raise click.ClickException(one_line(str(e) or type(e).__name__)) from e
        except KeyboardInterrupt:
            # Ctrl-C: a write under way is rolled back by its transaction. Exit 130, as a shell
            # reports a command ended by SIGINT, not click's "Aborted!" and 1.
            click.echo("\nInterrupted: a write under way was rolled back.", err=True)
            raise click.exceptions.Exit(INTERRUPTED) from None


class ClosedStream(io.TextIOBase):
    """What stands for a stdout the process was started without: every write fails with EBADF, so
    it is reported as any failed write is."""

    @property
    def buffer(self) -> ClosedStream:
        return self

    def write(self, data: Any) -> int:
        raise OSError(errno.EBADF, "stdout is closed")

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError(errno.EBADF, "stdout is closed")


def echo(text: str = "") -> None:
    """``text`` and a line feed on stdout (as click.echo); a failed write ends the command, see
    :func:`output_failed`."""
    stream = sys.stdout
    binary = getattr(stream, "buffer", None)
    if binary is None or stream.isatty():
        try:
            click.echo(text)
        except OSError as e:
            output_failed(e)
        return
    # Past the text layer, which drops what a short write of a large text leaves over (a table
    # cut short at a full disk or a closed pipe would then end as if whole).
    echo_bytes((text + "\n").encode(stream.encoding or "utf-8", stream.errors or "strict"))


def echo_bytes(*chunks: bytes) -> None:
    """``chunks`` written to stdout as they are, then flushed; a failed write ends the command."""
    try:
        sys.stdout.flush()
        out = sys.stdout.buffer
        for chunk in chunks:
            write_all(out, chunk)
        out.flush()
    except OSError as e:
        output_failed(e)


def output_failed(error: OSError, what: str = "the output") -> NoReturn:
    """End the command after a write to stdout failed: a pipe closed early (``... | head``) exits 1
    without a word, any other error (a full disk) is ``Error: the output could not be written``."""
    try:
        # What is left in stdout's buffer would fail again when Python flushes it at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (a test's): nothing is flushed at exit
        pass
    if isinstance(error, BrokenPipeError):
        sys.exit(1)
    raise click.ClickException(f"{what} could not be written: {error.strerror or error}") from error


def one_line(message: str) -> str:
    """``message`` on one line: a server's messages can hold line breaks, and a damaged file's
    text any control character; those are written as escapes (``\\x0c``)."""
    message = re.sub(r"\s*\n\s*", " ", message).strip()
    return _CONTROL.sub(lambda found: found.group().encode("unicode_escape").decode("ascii"), message)


# What a terminal would act on, or str.splitlines() break a line at: C0 (but the tab), DEL, C1, and
# the line and paragraph separators.
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def _not_found(error: JournalNotFound, source: ParameterSource | None) -> str:
    """The error for a journal that does not exist, saying what named it: ``--db``, the variable
    ``AIRLOCK_JOURNAL``, or neither (the default)."""
    if source is ParameterSource.COMMANDLINE:
        return then(error, "It is named by --db: check the path or URL given.")
    if source is ParameterSource.ENVIRONMENT:
        return then(error, f"It is named by {DB_ENVVAR}: set it to the journal's path or URL, or give --db.")
    return then(error, f"Name the journal with --db or {DB_ENVVAR}.")


def then(error: BaseException, advice: str) -> str:
    """The error's message as one sentence, followed by ``advice``."""
    message = one_line(str(error))
    return f"{message}{'' if message.endswith(('.', '!', '?')) else '.'} {advice}"


def describe(target: str) -> str:
    """The journal ``target`` for a message: a URL without its password."""
    if "://" not in target:
        return target
    target = re.sub(r"(?<=[?&]password=)[^&#]*", "***", target)
    try:
        parts = urlsplit(target)
    except ValueError:
        return target.split("://", 1)[0] + "://..."
    if parts.password is None:
        return target
    userinfo, _, hostport = parts.netloc.rpartition("@")  # the host part as given, a bad port included
    user = userinfo.split(":", 1)[0]
    netloc = f"{user}@{hostport}" if user else hostport
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def db_option(fn: F) -> F:
    """``--db PATH_OR_URL``: the journal a command works on."""
    return click.option(
        "--db",
        "db",
        metavar="PATH_OR_URL",
        envvar=DB_ENVVAR,
        default=DEFAULT_DB,
        show_default=True,
        show_envvar=True,
        help="The journal: a SQLite file, or a postgresql:// URL.",
        callback=journal_target,
    )(fn)


def journal_target(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """``--db`` as given, once it can name a journal: UTF-8, not empty, and a URL that parses. An
    error names the variable ``AIRLOCK_JOURNAL`` when the value came from it, else the flag."""
    source = ctx.get_parameter_source(param.name) if param.name else None
    if param.name == "db":
        ctx.meta[_DB_SOURCE] = source
    hint = DB_ENVVAR if source is ParameterSource.ENVIRONMENT else " / ".join(f"'{flag}'" for flag in param.opts)
    if not is_utf8(value):
        raise click.BadParameter(f"'{shown_bytes(value)}' is not valid UTF-8: name the journal by a path that is "
                                 "(rename the file, or link to it under a UTF-8 name)", ctx, param,
                                 param_hint=hint)
    if not value.strip():
        raise click.BadParameter("is empty: give the path of a journal file or a postgresql:// URL", ctx, param,
                                 param_hint=hint)
    if is_postgres_url(value):
        problem = url_problem(value)
        if problem is not None:
            raise click.BadParameter(f"{describe(value)} is not a PostgreSQL URL: {problem}", ctx, param,
                                     param_hint=hint)
    elif _KEYWORDS.match(value) and not os.path.lexists(value):
        # libpq's other form: taken for a file name it would make a SQLite journal of that name, or
        # say there is none, the password in the message. Named by its keys alone.
        keys = ", ".join(dict.fromkeys(k.lower() for k in re.findall(r"(\w+)\s*=", value)))
        raise click.BadParameter(
            f"is a key=value connection string ({keys}); name a PostgreSQL journal by its URL, "
            "postgresql://USER@HOST:PORT/DBNAME", ctx, param, param_hint=hint)
    return value


# The start of a libpq key=value connection string: one of its keywords, then '='.
_KEYWORDS = re.compile(
    r"^\s*(host|hostaddr|port|dbname|user|password|passfile|service|sslmode|connect_timeout|options|"
    r"application_name|target_session_attrs)\s*=", re.IGNORECASE)


def is_utf8(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8: click reads bytes of the command line that are
    not UTF-8 as lone surrogates, which no journal can store or print."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown_bytes(text: str) -> str:
    """``text`` for a message, each byte that is not UTF-8 written ``\\xNN``."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        raw = text.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


class Text(TextType):
    """A string of valid UTF-8: a call id, a tool, a reason, an operator."""

    name = "text"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if not is_utf8(text):
            self.fail(f"'{shown_bytes(text)}' is not valid UTF-8", param, ctx)
        return text


TEXT = Text()


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a connection URL libpq can use, or None (also when psycopg is not
    installed: opening the journal then says how to install it)."""
    try:
        from psycopg import ProgrammingError
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        return None
    try:
        params = conninfo_to_dict(url)
    except ProgrammingError as e:
        return without_secrets(one_line(str(e)), url)  # libpq's message may quote the password
    port = str(params.get("port", ""))
    # A list of ports for a list of hosts; an empty entry is the default port.
    ports = [p.strip() for p in port.split(",") if p.strip()]
    if not all(p.isdigit() for p in ports):
        return f"the port {port!r} is not a number"
    if not all(1 <= int(p) <= 65535 for p in ports):
        return f"the port {port!r} is not one from 1 to 65535"
    return None


def json_option(fn: F) -> F:
    """``--json``: machine output on stdout instead of a table."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(fn)


_RELATIVE = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$", re.IGNORECASE)
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


class Moment(MomentType):
    """A point in time: ISO-8601 (``2026-12-01T05:00:00Z``, ``2026-12-01``; UTC unless it has an
    offset) or an age before now (``90s``, ``10m``, ``2h``, ``3d``, ``1w``). Converts to a UTC datetime."""

    name = "moment"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> datetime:
        if isinstance(value, datetime):
            return value
        text = str(value).strip()
        relative = _RELATIVE.match(text)
        try:
            if relative:
                amount, unit = int(relative.group(1)), relative.group(2).lower()
                at = datetime.now(UTC) - timedelta(**{_UNITS[unit]: amount})
            else:
                at = parse_at(text)
        except OverflowError:  # beyond datetime's years 1 to 9999, once in UTC
            at = None
        except ValueError:
            if relative:  # an age of more digits than int() reads
                at = None
            else:
                self.fail(
                    f"{value!r} is not a time: give ISO-8601 (2026-12-01T05:00:00Z) or an age like 10m, 2h, 3d",
                    param,
                    ctx,
                )
        if at is None:
            self.fail(f"{value!r} is out of range: give a time in the years 1 to 9999 (UTC)", param, ctx)
        return at


MOMENT = Moment()


class FieldList(FieldsType):
    """A comma-separated list of names, each one of ``choices``; converts to a frozenset."""

    name = "fields"

    def __init__(self, choices: tuple[str, ...]) -> None:
        self.choices = choices

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> frozenset[str]:
        if isinstance(value, frozenset):
            return value
        names = [name.strip() for name in str(value).split(",") if name.strip()]
        if not names:
            self.fail("name at least one field", param, ctx)
        unknown = [name for name in names if name not in self.choices]
        if unknown:
            self.fail(
                f"cannot redact {', '.join(map(repr, unknown))}: choose from {', '.join(self.choices)}",
                param,
                ctx,
            )
        return frozenset(names)


# The deepest value ``resolve --value`` and the console take: orjson writes at most 254 levels, and
# a call's page wraps a value in a few more.
MOST_VALUE_LEVELS = 250


def json_levels(value: Any) -> int:
    """How deeply arrays and objects nest in ``value`` (0 for a scalar), without recursing."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def reason_text(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--reason``: any text but an empty one, which is a usage error (the reason is kept)."""
    if value is not None and not value.strip():
        raise click.BadParameter("say why: the reason is part of the audit trail", ctx, param)
    return value


def default_operator() -> str:
    """Who is at the keyboard: the login name, else ``uid:N``."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = ""
    return name or f"uid:{os.getuid()}"
