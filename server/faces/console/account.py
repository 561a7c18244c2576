"""Signing in and out, the home page, and STOP / START for the signed-in user.

    GET  /             what needs the user: pending approvals, active tasks (the sign-in page when signed out)
    GET  /signin       the form: paste a user token (`wakeful serve` prints the owner's at its first start)
    POST /signin       → a console session cookie, then the page asked for (`next`, a path on this server only)
    POST /signout      ends the session
    POST /stop|start   the user's STOP / START, through the same function as `POST /v1/control/stop|start`
    POST /everything/stop|start   an admin's STOP / START over the whole deployment, as
                       `POST /v1/control/everything/stop|start`: anyone else is refused `403 admin_required`
"""

from __future__ import annotations

import hmac
import secrets
from typing import Annotated

from fastapi import Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import func, select

from wakeful.server.errors import Refused, Unauthorized
from wakeful.server.faces import listing
from wakeful.server.faces.console.signin import SESSION_TTL, sign_in, sign_out
from wakeful.server.faces.console.web import COOKIE, Form, Me, Posted, console_router, page, runtime_of
from wakeful.server.faces.routes import set_everything_stop, set_stop
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import TaskState, tasks

__all__ = ["SIGNIN_COOKIE", "router"]

router = console_router()

SIGNIN_COOKIE = "wakeful_signin"
"""The sign-in form's own CSRF token (double submit): a form another site posts cannot know it."""
Next = Annotated[str, Query(max_length=2000)]
ACTIVE_SHOWN = 999
"""Active tasks the home page counts; past it, "999+" (a count of everything would read every task)."""


def _safe_next(target: str) -> str:
    """Only a path on this server: `//evil.example` or `https://…` would send the user elsewhere after signing in."""
    return target if target.startswith("/") and not target.startswith(("//", "/\\")) else "/"


def _secure(request: Request) -> bool:
    return (runtime_of(request).settings.public_url or "").startswith("https://")


@router.get("/")
def home(request: Request, me: Me) -> HTMLResponse:
    with read(me.rt.engine) as conn:
        pending = listing.pending_approvals(conn, user_id=me.user_id, limit=20)
        active = conn.execute(select(func.count()).select_from(select(tasks.c.id).where(
            tasks.c.user_id == me.user_id, tasks.c.state == TaskState.ACTIVE.value).limit(ACTIVE_SHOWN + 1)
            .subquery())).scalar_one()
    return page(request, "home.html", me=me, pending=pending,
                active=f"{ACTIVE_SHOWN}+" if active > ACTIVE_SHOWN else str(active))


@router.get("/signin")
def signin_form(request: Request, next: Next = "/", error: str | None = None) -> HTMLResponse:
    return _signin_page(request, next=next, error=error)


def _signin_page(request: Request, *, next: str, error: str | None, status: int = 401) -> HTMLResponse:
    csrf = secrets.token_urlsafe(24)
    response = page(request, "signin.html", me=None, next=_safe_next(next), csrf=csrf, error=error,
                    status_code=status if error else 200)
    response.set_cookie(SIGNIN_COOKIE, csrf, max_age=3600, httponly=True, samesite="strict", secure=_secure(request),
                        path="/signin")
    return response


@router.post("/signin")
def signin(request: Request, form: Form) -> Response:
    expected = request.cookies.get(SIGNIN_COOKIE) or ""
    given = form.get("csrf") or ""
    if not expected or not hmac.compare_digest(expected.encode(), given.encode()):
        raise Refused("bad_csrf_token", "this sign-in form did not come from this server's page; open /signin "
                                             "and try again")
    rt = runtime_of(request)
    try:
        with write(rt.engine) as conn:
            session_id, _session = sign_in(conn, token=form.get("token", ""), now=rt.clock.now())
    except Unauthorized:
        return signin_form(request, next=form.get("next", "/"),
                           error="That token is not valid: paste your latest token (`wakeful token` issues a new one).")
    except Refused as refused:  # an agent credential
        return _signin_page(request, next=form.get("next", "/"), error=refused.message[:1].upper()
                            + refused.message[1:] + ".", status=403)
    response = RedirectResponse(_safe_next(form.get("next", "/")), status_code=303)
    response.set_cookie(COOKIE, session_id, max_age=int(SESSION_TTL.total_seconds()), httponly=True,
                        samesite="strict", secure=_secure(request), path="/")
    response.delete_cookie(SIGNIN_COOKIE, path="/signin")
    return response


@router.post("/signout")
def signout(request: Request, me: Posted) -> Response:
    with write(me.rt.engine) as conn:
        sign_out(conn, request.cookies.get(COOKIE))
    response = RedirectResponse("/signin", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


@router.post("/stop")
def stop(request: Request, me: Posted, form: Form) -> HTMLResponse:
    answer = set_stop(me.user_id, me.rt, stopped=True, reason=form.get("reason", "")[:2000])
    return page(request, "stopped.html", me=me, answer=answer, stopped=True)


@router.post("/start")
def start(request: Request, me: Posted, form: Form) -> HTMLResponse:
    answer = set_stop(me.user_id, me.rt, stopped=False, reason=form.get("reason", "")[:2000])
    return page(request, "stopped.html", me=me, answer=answer, stopped=False)


@router.post("/everything/stop")
def stop_everything(request: Request, me: Posted, form: Form) -> HTMLResponse:
    answer = set_everything_stop(me.user_id, me.rt, stopped=True, reason=form.get("reason", "")[:2000])
    return page(request, "stopped.html", me=me, answer=answer, stopped=True, everything=True)


@router.post("/everything/start")
def start_everything(request: Request, me: Posted, form: Form) -> HTMLResponse:
    answer = set_everything_stop(me.user_id, me.rt, stopped=False, reason=form.get("reason", "")[:2000])
    return page(request, "stopped.html", me=me, answer=answer, stopped=False, everything=True)
