"""What every console page shares: the templates, the signed-in dependency, posted forms with their CSRF check, and
refusals rendered as pages.

A page asked for without a session redirects to the sign-in page (and back afterwards). A refusal (`WakefulError`)
or a query parameter that does not parse is a page with its status and stable code, never a 500 and never JSON: the
console is read by people. A POST is read only up to `FORM_LIMIT` bytes and must carry the session's CSRF token.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, quote

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates

from wakeful.server.core import control
from wakeful.server.errors import BadRequest, WakefulError
from wakeful.server.faces import bodies
from wakeful.server.faces.console.signin import ConsoleSession, check_csrf, session_of
from wakeful.server.runtime import Runtime
from wakeful.server.store.db import read
from wakeful.server.store.tables import users

__all__ = ["COOKIE", "FORM_LIMIT", "TEMPLATES", "ConsoleRoute", "Form", "Me", "Posted", "SignInFirst", "Signed",
           "console_router", "page", "runtime_of", "signed_or_none"]

COOKIE = "wakeful_console"
"""Holds the console session's ID: HttpOnly, SameSite=Strict, Secure when the public URL is https."""
FORM_LIMIT = 16 * 1024
"""Bytes a console form may post: a reason and a few hidden fields."""
TEMPLATES = Jinja2Templates(directory=Path(__file__).parent / "templates")


def _when(value: datetime | str | None) -> str:
    """A recorded time as people read it: to the second, in UTC (the records' own zone)."""
    if value is None:
        return ""
    at = datetime.fromisoformat(value) if isinstance(value, str) else value
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


TEMPLATES.env.filters["when"] = _when


class SignInFirst(Exception):
    """A page asked for without a live session: answered with a redirect to the sign-in page."""


@dataclass(frozen=True, kw_only=True)
class Signed:
    """Who is signed in, and the runtime the page reads."""

    user_id: str
    name: str
    csrf_token: str
    rt: Runtime
    admin: bool = False
    """An admin also sees the STOP / START over the whole deployment (the forms refuse anyone else all the same)."""


def runtime_of(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def _signed(request: Request) -> Signed:
    me = signed_or_none(request)
    if me is None:
        raise SignInFirst
    return me


def signed_or_none(request: Request) -> Signed | None:
    """Who is signed in, or None (no cookie, or a session that ended)."""
    rt = runtime_of(request)
    with read(rt.engine) as conn:
        session: ConsoleSession | None = session_of(conn, request.cookies.get(COOKIE), now=rt.clock.now())
        user = None if session is None else conn.execute(
            users.select().with_only_columns(users.c.name, users.c.admin).where(users.c.id == session.user_id)).first()
    if session is None or user is None:
        return None
    return Signed(user_id=session.user_id, name=user.name, csrf_token=session.csrf_token, rt=rt,
                  admin=bool(user.admin))


Me = Annotated[Signed, Depends(_signed)]
"""The signed-in user of a page (a sync dependency: it reads the database on the thread pool)."""


async def read_form(request: Request) -> dict[str, str]:
    """A posted `application/x-www-form-urlencoded` form, first value of each field, bounded."""
    bodies.refuse_declared(request.headers.get("content-length"), FORM_LIMIT)
    raw = await bodies.read(request.receive, FORM_LIMIT)
    try:
        fields = parse_qsl(raw.decode(), keep_blank_values=True, max_num_fields=50, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        raise BadRequest("malformed_form", "the form could not be read") from None
    form: dict[str, str] = {}
    for key, value in fields:
        if "\x00" in value or "\x00" in key:
            raise BadRequest("malformed_form", "a form field holds NUL")
        form.setdefault(key, value)
    return form


Form = Annotated[dict[str, str], Depends(read_form)]


def _posted(me: Me, form: Form) -> Signed:
    check_csrf(me.csrf_token, form.get("csrf"))
    return me


Posted = Annotated[Signed, Depends(_posted)]
"""The signed-in user of a POST whose form carried the session's CSRF token (else 403 `bad_csrf_token`)."""


def page(request: Request, template: str, *, me: Signed | None, status_code: int = 200,
         **context: Any) -> HTMLResponse:
    """A rendered page; with `me`, the header shows who is signed in and whether a STOP is in force."""
    stop = None
    if me is not None:
        with read(me.rt.engine) as conn:
            state = control.stop_state(conn)
        stop = {"stopped": state.blocks(me.user_id), "global_stop": state.everything,
                "own": me.user_id in state.users}  # the user's own STOP, which their START lifts
    response = TEMPLATES.TemplateResponse(request, template, {"me": me, "stop": stop, **context},
                                          status_code=status_code)
    response.headers["Cache-Control"] = "no-store"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"
    return response


def _refusal(request: Request, exc: WakefulError, status: int) -> HTMLResponse:
    return TEMPLATES.TemplateResponse(request, "refused.html", {"me": None, "stop": None, "error": exc},
                                      status_code=status, headers={"Cache-Control": "no-store"})


class ConsoleRoute(APIRoute):
    """A console route: no session → the sign-in page; a refusal or a bad parameter → a page saying so."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except SignInFirst:
                if request.method != "GET":
                    return _refusal(request, WakefulError("signed_out", "sign in again: your session ended"), 401)
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse(f"/signin?next={quote(target, safe='')}", status_code=303)
            except bodies.Disconnected:
                return Response(status_code=400)
            except WakefulError as exc:
                return _refusal(request, exc, exc.http_status)
            except RequestValidationError:
                error = BadRequest("invalid_parameter", "a path or query parameter is not valid; go back and retry")
                return _refusal(request, error, 400)

        return answer


def console_router() -> APIRouter:
    return APIRouter(route_class=ConsoleRoute, include_in_schema=False)
