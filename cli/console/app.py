"""The console as an ASGI application: its routes, templates, stylesheet and error pages."""

from __future__ import annotations

from importlib import resources

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from journal.errors import JournalError

from ..options import one_line
from . import actions, auth, pages
from .state import Console

__all__ = ["create_app"]

_TITLES = {400: "Not understood", 403: "Refused", 404: "Not found", 405: "Not allowed", 409: "Refused",
           413: "Too large", 415: "Not a form"}


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(loader=jinja2.PackageLoader("cli.console", "templates"),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined)
    return Jinja2Templates(env=env, context_processors=[auth.context])


def _stylesheet() -> bytes:
    return resources.files("cli.console").joinpath("static", "console.css").read_bytes()


def create_app(console: Console) -> Starlette:
    """The console's application over ``console`` (its journal, mode, operator and sessions)."""

    def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return pages.page(request, "error.html", exc.status_code, title=_TITLES.get(exc.status_code, "Error"),
                          message=exc.detail)

    def journal_error(request: Request, exc: Exception) -> Response:
        # The journal could not be read or written (a server down, a disk full, a damaged file): said in
        # one line, as the CLI says it.
        return pages.page(request, "error.html", 503, title="The journal cannot be used",
                          message=one_line(str(exc) or type(exc).__name__))

    css = _stylesheet()

    def stylesheet(request: Request) -> Response:
        return Response(css, media_type="text/css; charset=utf-8")

    routes = [
        Route("/", pages.overview, name="overview"),
        Route("/calls", pages.calls, name="calls"),
        Route("/calls/{call_id:path}", pages.call, name="call"),
        Route("/events/{seq:int}", pages.event, name="event"),
        Route("/in-doubt", pages.in_doubt, name="in_doubt"),
        Route("/approvals", pages.approvals, name="approvals"),
        Route("/verify", pages.verify, name="verify"),
        Route("/verify/run", pages.run_verify, name="run_verify"),
        Route("/export", pages.export, name="export"),
        Route("/export/download", pages.download, name="download"),
        Route("/resolve", actions.resolve, methods=["POST"], name="resolve"),
        Route("/decide", actions.decide, methods=["POST"], name="decide"),
        Route("/static/console.css", stylesheet, name="stylesheet"),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(auth.Gate, console=console)],
                    exception_handlers={HTTPException: http_error, JournalError: journal_error})
    app.state.console = console
    app.state.templates = _templates()
    return app
