"""The live view of a user's tool computer in the browser: noVNC, bridged over a websocket to x11vnc in the guest
(through the guest channel's SSH forward). Two kinds of link lead to it:

- a handoff link (`computer__request_handoff`): the user takes the screen — keyboard and mouse — for as long as
  the control lease lasts, and gives it back with "Return control";
- a view-only link the user asks for (`POST /v1/live/view`): they watch, for a bounded time, and hold no control.
  It is bridged to a second x11vnc in the guest started with `-viewonly`, so the VNC server itself drops their
  input; the page does not even send it.

    POST /v1/live/view                a view-only link (bearer token; body {"minutes": 1..120}, default 15)
    GET  /v1/live/{token}             redeems a one-time token → redirect to the session, with its binder cookie
    GET  /v1/live/s/{session}         the page: the guest's screen (and, with control, a "Return control" button)
    WS   /v1/live/s/{session}/ws      RFB bytes both ways (noVNC's "binary" websocket)
    POST /v1/live/s/{session}/return  hands the screen back: the lease ends, the epoch moves, the agent re-observes

A token is good once; the session it becomes answers only the browser that redeemed it (its binder cookie, see
`server.computers.handoff`), and dies with the lease (or when the view-only link expires): an open websocket is
closed within a second of that. The websocket and the return form must come from this server's own page (`Origin`).
While a page is connected the VM counts as busy (`live_view`), so the idle reaper leaves it running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Body, Cookie, Depends, Header, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.datastructures import URL

from wakeful.server.computers.handoff import CONTROL_VNC_PORT, VIEW_MINUTES, VIEW_VNC_PORT, LiveViews
from wakeful.server.errors import WakefulError
from wakeful.server.faces.auth import current_user
from wakeful.server.faces.schemas import ViewLink, refusals

__all__ = ["COOKIE", "live_router"]

COOKIE = "wakeful_live"
"""Holds a live session's binder: only the browser that redeemed the link has it."""
Binder = Annotated[str | None, Cookie(alias=COOKIE, description="the binder the redeemed link set")]

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>wakeful: your tool computer</title>
<style>body{{margin:0;font-family:sans-serif;background:#222;color:#eee}}
header{{padding:8px 12px;display:flex;gap:12px;align-items:center}}#screen{{width:100vw;height:calc(100vh - 48px)}}
button{{font-size:15px;padding:6px 14px}}</style></head>
<body><header><b>{headline}</b><span id="status">connecting…</span>{controls}</header>
<div id="screen"></div>
<script type="module">
import RFB from "/novnc/core/rfb.js";
const scheme = location.protocol === "https:" ? "wss" : "ws";
const rfb = new RFB(document.getElementById("screen"), `${{scheme}}://${{location.host}}/v1/live/s/{session}/ws`);
rfb.scaleViewport = true;
rfb.viewOnly = {view_only};
rfb.addEventListener("connect", () => document.getElementById("status").textContent = "connected");
rfb.addEventListener("disconnect", () => document.getElementById("status").textContent = "disconnected");
</script></body></html>
"""
_RETURN = ('<form method="post" action="/v1/live/s/{session}/return"><button>Return control</button></form>')


def _same_origin(origin: str | None, url: URL, *, required: bool) -> bool:
    """Whether a browser request came from a page of this server: its `Origin` is this URL's scheme and host.
    Browsers always send it on websockets. A form POST from our page says `null` (the page's `no-referrer` policy
    hides its origin) or nothing: there the binder cookie, which is SameSite=Lax and so never rides a cross-site
    POST, is what proves the page; a foreign origin is still refused outright."""
    if origin is None or (origin == "null" and not required):
        return not required
    scheme = {"ws": "http", "wss": "https"}.get(url.scheme, url.scheme)
    return origin == f"{scheme}://{url.netloc}"


def _page(session: str, view_only: bool) -> str:
    if view_only:
        return _PAGE.format(headline="Watching your tool computer (view only).", controls="", session=session,
                            view_only="true")
    return _PAGE.format(headline="You have the screen.", controls=_RETURN.format(session=session), session=session,
                        view_only="false")


def live_router(views: LiveViews) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/live/view", response_model=ViewLink)
    async def view_link(request: Request, user: str = Depends(current_user),
                        minutes: int = Body(15, embed=True, ge=VIEW_MINUTES[0], le=VIEW_MINUTES[1], strict=True),
                        ) -> dict[str, Any]:
        """A one-time link to watch the user's tool computer without taking control."""
        token, expires_at = views.offer_view(user, timedelta(minutes=minutes))
        base = request.app.state.runtime.settings.public_url or str(request.base_url)
        return {"link": f"{base.rstrip('/')}/v1/live/{token}", "view_only": True,
                "expires_at": expires_at.isoformat()}

    @router.get("/v1/live/{token}", status_code=303, response_class=RedirectResponse, responses=refusals("gone"))
    async def redeem(request: Request, token: str) -> RedirectResponse:
        redeemed = await anyio.to_thread.run_sync(views.redeem, token)
        if redeemed is None:
            raise HTTPException(410, "this link was used already, or it expired, or the handoff ended")
        session, binder = redeemed
        response = RedirectResponse(f"/v1/live/s/{session}", status_code=303)
        # Lax, not Strict: the link is opened from a mail or chat (another site), and the redirect that follows
        # must carry the cookie; a cross-site POST or websocket does not get it.
        response.set_cookie(COOKIE, binder, path=f"/v1/live/s/{session}", httponly=True, samesite="lax",
                            secure=request.url.scheme == "https")
        return response

    @router.get("/v1/live/s/{session}", response_class=HTMLResponse, responses=refusals("gone"))
    async def page(session: str, binder: Binder = None) -> HTMLResponse:
        found = await anyio.to_thread.run_sync(views.live, session, binder)
        if found is None:
            raise HTTPException(410, "this live view ended (control is back with the agent, or the link expired), "
                                     "or it was opened in another browser than the one that used the link")
        return HTMLResponse(_page(session, found.view_only),
                            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    @router.post("/v1/live/s/{session}/return", response_class=HTMLResponse, responses=refusals("forbidden", "gone"))
    async def give_back(request: Request, session: str, binder: Binder = None,
                        origin: Annotated[str | None, Header()] = None) -> HTMLResponse:
        if not _same_origin(origin, request.url, required=False):
            raise HTTPException(403, "control is returned from the live view's own page")
        epoch = await anyio.to_thread.run_sync(views.give_back, session, binder)
        if epoch is None:
            raise HTTPException(410, "there is no control to return: the handoff had ended, or this view is "
                                     "view only")
        return HTMLResponse("<p>Control is back with your agent. You can close this tab.</p>")

    @router.websocket("/v1/live/s/{session}/ws")
    async def bridge(websocket: WebSocket, session: str) -> None:
        if not _same_origin(websocket.headers.get("origin"), websocket.url, required=True):
            await websocket.close(code=4403)  # a page on another site (or no browser at all) opened this socket
            return
        binder = websocket.cookies.get(COOKIE)
        found = await anyio.to_thread.run_sync(views.live, session, binder)
        if found is None:
            await websocket.close(code=4410)
            return
        guest_port = VIEW_VNC_PORT if found.view_only else CONTROL_VNC_PORT
        try:
            port = await anyio.to_thread.run_sync(
                lambda: views.computers.computer(found.user_id).vnc_port(guest_port))
        except WakefulError as exc:
            await websocket.close(code=1011, reason=exc.code)
            return
        wanted = websocket.headers.get("sec-websocket-protocol", "")
        await websocket.accept(subprotocol="binary" if "binary" in wanted else None)
        with views.computers.activity(found.user_id, "live_view"):
            await _pump(websocket, port, lambda: views.live(session, binder) is not None)

    return router


async def _pump(websocket: WebSocket, port: int, still_live: Callable[[], bool]) -> None:
    """RFB bytes both ways until either side closes or the session ends (checked before each viewer message
    reaches the guest, and every second in between)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def live() -> bool:
        return await anyio.to_thread.run_sync(still_live)

    async def to_vnc() -> None:
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                message = await websocket.receive()
                if message.get("type") == "websocket.disconnect":
                    return
                data = message.get("bytes") or (message.get("text") or "").encode()
                if not await live():
                    return  # the session ended: no more input reaches the guest
                writer.write(data)
                await writer.drain()

    async def to_browser() -> None:
        while data := await reader.read(65536):
            await websocket.send_bytes(data)

    async def until_ended() -> None:
        # The session can end on another thread (expiry, "Return control" from another tab): look once a second.
        while await live():  # noqa: ASYNC110
            await asyncio.sleep(1.0)

    tasks = [asyncio.ensure_future(to_vnc()), asyncio.ensure_future(to_browser()),
             asyncio.ensure_future(until_ended())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await websocket.close()
