"""The console's gate: the one-time sign-in token, the session cookie, read-only refusals, the CSRF
check of every form, and the security headers of every response."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .state import Console

__all__ = ["SESSION", "Gate", "read_form"]

SESSION = "airlock.session"  # the scope key of the request's session id
MOST_FORM_BYTES = 1 << 20

# No script, no frame, no asset from anywhere but this server; forms post only here.
_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
                                "frame-ancestors 'none'; base-uri 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

_PLAIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title} · Airlock console</title></head>
<body><main><h1>{title}</h1><p>{message}</p></main></body></html>
"""


def _page(status: int, title: str, message: str) -> Response:
    return HTMLResponse(_PLAIN.format(title=title, message=message), status_code=status)


class Gate:
    """ASGI middleware: a request with the sign-in token gets a session (an HttpOnly, SameSite=Strict
    cookie) and is sent on to the same page without the token; a request without a valid session
    gets 401; a POST to a read-only console gets 403. Adds :data:`_HEADERS` to every response."""

    def __init__(self, app: ASGIApp, console: Console) -> None:
        self.app = app
        self.console = console

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in _HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        response = self._refusal(scope)
        if response is not None:
            await response(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)

    def _refusal(self, scope: Scope) -> Response | None:
        """The response that ends the request here (sign-in, 401, 403), or None to serve it; sets
        the request's session in ``scope``."""
        request = Request(scope)
        sessions = self.console.sessions
        session = request.cookies.get(sessions.cookie)
        signed_in = sessions.csrf(session) is not None
        token = request.query_params.get("token")
        if token is not None:
            rest = [(k, v) for k, v in parse_qsl(request.url.query, keep_blank_values=True) if k != "token"]
            target = request.url.path + ("?" + urlencode(rest) if rest else "")
            if signed_in:
                return RedirectResponse(target, status_code=303)
            new = sessions.redeem(token)
            if new is None:
                return _page(401, "Not signed in", "This sign-in link is not valid, or it has been used: each "
                                                   "link works once. Restart <code>airlock journal serve</code> "
                                                   "for a new one.")
            response = RedirectResponse(target, status_code=303)
            response.set_cookie(sessions.cookie, new, httponly=True, samesite="strict", path="/")
            return response
        if not signed_in:
            return _page(401, "Not signed in", "Open the one-time URL that <code>airlock journal serve</code> "
                                               "printed when it started.")
        if request.method not in ("GET", "HEAD") and not self.console.allow_write:
            return _page(403, "Read-only", "This console only reads the journal: start it with "
                                           "<code>--allow-write</code> to resolve calls or decide approvals.")
        scope[SESSION] = session
        return None


def csrf_token(request: Request) -> str:
    """The CSRF token of the request's session (every form carries it)."""
    console: Console = request.app.state.console
    return console.sessions.csrf(request.scope.get(SESSION)) or ""


async def read_form(request: Request) -> dict[str, str]:
    """The fields of a posted form (``application/x-www-form-urlencoded``), after its CSRF token
    was checked against the session's: 403 when it is missing or wrong, 413 for a body over 1 MiB."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise HTTPException(415, "A form is posted as application/x-www-form-urlencoded.")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MOST_FORM_BYTES:
            raise HTTPException(413, "The form is larger than 1 MiB.")
    try:
        fields: Mapping[str, str] = dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True,
                                                   errors="strict"))
    except (UnicodeDecodeError, ValueError) as e:
        raise HTTPException(400, "The form is not valid UTF-8.") from e
    expected = csrf_token(request)
    given = fields.get("csrf_token", "")
    if not expected or not secrets.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(403, "The form's CSRF token is missing or wrong: reload the page and try again.")
    return dict(fields)


NAVIGATION = (("/", "Overview"), ("/calls", "Calls"), ("/in-doubt", "In doubt"), ("/approvals", "Approvals"),
              ("/verify", "Verify"), ("/export", "Export"))


def _current(path: str) -> str | None:
    """The navigation entry ``path`` belongs to (a call's page is under Calls)."""
    for href, _label in reversed(NAVIGATION):
        if path == href or (href != "/" and path.startswith(href + "/")):
            return href
    return None


def context(request: Request) -> dict[str, Any]:
    """What every template is given: the console's mode, the navigation, and the CSRF token for its forms."""
    console: Console = request.app.state.console
    return {"console": console, "csrf_token": csrf_token(request), "navigation": NAVIGATION,
            "current": _current(request.url.path)}
