"""Where an approval request's one-time link lands (`acting.approval_links`).

    GET /a/{token}     signed in: the link is used up and the card opens (`/approvals/{action_id}`); signed out:
                       the sign-in page first, and back here (the link is not used until the user is signed in)

The session cookie is SameSite=Strict, so a browser does not send it on the navigation a mail or chat app starts:
a first visit without it answers a page of this server that comes straight back (`?again=1`), a same-site
navigation that carries the cookie. Only when that one has none either is the user signed out.

A link that expired, was used, or whose action changed is refused with its code. Deciding is the card's buttons,
which take the signed-in session and its CSRF token like every other form.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Request
from fastapi.responses import RedirectResponse, Response

from wakeful.server.acting import approval_links
from wakeful.server.faces.console.web import SignInFirst, console_router, page, signed_or_none
from wakeful.server.store.db import write

__all__ = ["router"]

router = console_router()


@router.get(approval_links.PATH + "{token}")
def open_link(request: Request, token: Annotated[str, Path(max_length=100, pattern=r"^[A-Za-z0-9_-]+$")],
              again: bool = False) -> Response:
    me = signed_or_none(request)
    if me is None:
        if not again:
            return page(request, "hop.html", me=None, to=f"{approval_links.PATH}{token}?again=1")
        raise SignInFirst
    with write(me.rt.engine) as conn:
        action_id = approval_links.open_link(conn, token, user_id=me.user_id, now=me.rt.clock.now())
    return RedirectResponse(f"/approvals/{action_id}", status_code=303)


