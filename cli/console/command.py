"""``airlock journal serve``: the operator console over a journal, in a browser.

Only click and the CLI's own modules are imported here: Starlette, Jinja2 and uvicorn (the ``web``
extra) are imported when the command runs, so that every other command works without them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import click
from click.core import ParameterSource

from journal import Journal, open_journal
from journal.errors import JournalNotFound
from journal.events import REDACTABLE
from journal.urls import is_postgres_url

from ..options import TEXT, FieldList, db_option, default_operator, describe, journal_target, then

__all__ = ["console_url", "listen", "serve"]

def _dsn(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    if not is_postgres_url(value):
        raise click.BadParameter(f"{describe(value)} is not a postgresql:// URL (a SQLite file is named by --db)",
                                 ctx, param)
    return journal_target(ctx, param, value)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (0: any free port), listening; a ClickException when it
    cannot be had (the port taken, a host that is not this machine's)."""
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def console_url(sock: socket.socket, host: str, token: str) -> str:
    """The one-time sign-in URL of the console listening on ``sock``."""
    port = sock.getsockname()[1]
    shown = host
    try:
        if ipaddress.ip_address(host).version == 6:
            shown = f"[{host}]"
    except ValueError:
        pass
    if host in ("0.0.0.0", "::"):  # any address: this machine's own is one of them
        shown = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    return f"http://{shown}:{port}/?token={token}"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command()
@click.option("--dsn", metavar="URL", type=TEXT, callback=_dsn,
              help="A PostgreSQL journal's postgresql:// URL: the same as --db URL.")
@click.option("--host", default="127.0.0.1", show_default=True, type=TEXT,
              help="The address to listen on. Anything but a loopback address lets other machines try to sign in.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535),
              help="The port to listen on (0: any free port; the URL printed says which).")
@click.option("--allow-write", is_flag=True,
              help="Offer the actions: resolve a call, approve or deny a request. Without it the console only reads.")
@click.option("--operator", type=TEXT, help="Who acts, as operator:NAME on what the actions append. "
                                            "[default: your login name]")
@click.option("--redact", type=FieldList(tuple(sorted(REDACTABLE))), multiple=True, metavar="FIELDS",
              help="Never show these fields (arguments,value) on any page or in any export; their sha256 stays.")
@db_option
@click.pass_context
def serve(ctx: click.Context, dsn: str | None, host: str, port: int, allow_write: bool, operator: str | None,
          redact: tuple[frozenset[str], ...], db: str) -> None:
    """Serve the operator console: the journal's calls, its calls in doubt, the approvals inbox,
    verify and export, as web pages on this machine.

    It prints a one-time URL with a random token: open it in a browser to sign in (it sets a
    session cookie; the URL works once). Every page works without JavaScript. With
    --allow-write the console resolves calls and approves or denies requests, each after a
    confirmation, appended by operator:NAME with the same checks as the CLI's commands. It
    never creates a journal. Stop it with Ctrl+C.

    Example:

    \b
        airlock journal serve --db airlock-journal.db

    \b
        airlock journal serve --dsn postgresql://airlock@db.internal/airlock --allow-write --operator alice
    """
    if dsn is not None:
        if ctx.get_parameter_source("db") is ParameterSource.COMMANDLINE:
            raise click.UsageError("give the journal once: --db PATH_OR_URL or --dsn URL")
        target, named_by = dsn, "--dsn"
    else:
        target = db
        source = ctx.get_parameter_source("db")
        named_by = ("--db" if source is ParameterSource.COMMANDLINE
                    else "AIRLOCK_JOURNAL" if source is ParameterSource.ENVIRONMENT else "the default")
    name = default_operator() if operator is None else operator.strip()
    if not name:
        raise click.BadParameter("name who acts", param_hint="--operator")
    try:
        import uvicorn

        from .app import create_app
    except ImportError as e:
        raise click.ClickException(f"the console needs the web extra ({e.name} is not installed): "
                                   "pip install 'airlock-journal[web]'") from e
    from .state import Console

    j = _open(target, named_by)
    try:
        sock = listen(host, port)
        console = Console(journal=j, target=target, allow_write=allow_write, operator=name,
                          redact=frozenset().union(*redact))
        url = console_url(sock, host, console.sessions.token)
        mode = f"writes allowed, as operator:{name}" if allow_write else "read-only"
        click.echo(f"Airlock console for the journal {describe(target)} ({mode}).")
        click.echo(f"Open this URL in a browser to sign in (it works once): {url}")
        click.echo("Stop it with Ctrl+C.")
        sys.stdout.flush()
        if not _loopback(host):
            click.echo(f"Warning: listening on {host}, beyond this machine, over plain HTTP: anyone who sees the "
                       "URL before you open it can sign in. Prefer 127.0.0.1 and an SSH tunnel.", err=True)
        config = uvicorn.Config(create_app(console), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        _run(_quiet_server(uvicorn, config), sock)
    finally:
        j.close()
    click.echo("Stopped.", err=True)


def _open(target: str, named_by: str) -> Journal:
    """The journal, opened read-only for the server's life; never created: one that does not
    exist is an error (exit 1) that says what named it."""
    try:
        return open_journal(target, readonly=True, create=False)
    except JournalNotFound as e:
        advice = {"--db": "It is named by --db: check the path or URL given.",
                  "--dsn": "It is named by --dsn: check the URL given.",
                  "AIRLOCK_JOURNAL": "It is named by AIRLOCK_JOURNAL: set it to the journal's path or URL, "
                                     "or give --db."}.get(named_by, "Name the journal with --db or AIRLOCK_JOURNAL.")
        raise click.ClickException(then(e, advice)) from e


def _quiet_server(uvicorn: Any, config: Any) -> Any:
    """A uvicorn server that stops gracefully on SIGINT or SIGTERM and then returns, instead of
    raising the signal again once stopped (which would end the command as interrupted, exit 130):
    stopping the console is its normal end. A second Ctrl+C stops it at once."""

    class Server(uvicorn.Server):  # type: ignore[misc]
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def _run(server: Any, sock: socket.socket) -> None:
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
