"""Where an approval request's one-time link lands (`acting.approval_links`).

    GET /a/{token}     signed in: the link is used up and the card opens (`/approvals/{action_id}`); signed out:
                       the sign-in page first, and back here (the link is not used until the user is signed in)

A link that expired, was used, or whose action changed is refused with its code. Deciding is the card's buttons,
which take the signed-in session and its CSRF token like every other form.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path
from fastapi.responses import RedirectResponse

from wakeful.server.acting import approval_links
from wakeful.server.faces.console.web import Me, console_router
from wakeful.server.store.db import write

__all__ = ["router"]

router = console_router()


@router.get(approval_links.PATH + "{token}")
def open_link(me: Me, token: Annotated[str, Path(max_length=100, pattern=r"^[A-Za-z0-9_-]+$")]) -> RedirectResponse:
    with write(me.rt.engine) as conn:
        action_id = approval_links.open_link(conn, token, user_id=me.user_id, now=me.rt.clock.now())
    return RedirectResponse(f"/approvals/{action_id}", status_code=303)
