"""The live view of a user's tool computer in the browser: noVNC, bridged over a websocket to x11vnc in the guest
(through the guest channel's SSH forward). Two kinds of link lead to it:

- a handoff link (`computer__request_handoff`): the user takes the screen — keyboard and mouse — for as long as
  the control lease lasts, and gives it back with "Return control";
- a view-only link the user asks for (`POST /v1/live/view`): they watch, for a bounded time, and hold no control.
  It is bridged to a second x11vnc in the guest started with `-viewonly`, so the VNC server itself drops their
  input; the page does not even send it.

    POST /v1/live/view                a view-only link (bearer token; body {"minutes": 1..120}, default 15)
    GET  /v1/live/{token}             redeems a one-time token → redirect to the session
    GET  /v1/live/s/{session}         the page: the guest's screen (and, with control, a "Return control" button)
    WS   /v1/live/s/{session}/ws      RFB bytes both ways (noVNC's "binary" websocket)
    POST /v1/live/s/{session}/return  hands the screen back: the lease ends, the epoch moves, the agent re-observes

A token is good once; the session id that replaces it is random, held only in memory, and dies with the lease (or
when the view-only link expires): an open websocket is closed within a second of that. While a page is connected
the VM counts as busy (`live_view`), so the idle reaper leaves it running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, Body, Depends, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import HTMLResponse, RedirectResponse

from server.clock import Clock
from server.computers import Computers
from server.errors import WakefulError

__all__ = ["CONTROL_VNC_PORT", "LiveViews", "NOVNC_DIR", "VIEW_VNC_PORT", "live_router"]

NOVNC_DIR = Path("/usr/share/novnc")
"""Debian's `novnc` package: the page loads its RFB module from here (served at /novnc)."""
CONTROL_VNC_PORT = 5900
"""x11vnc on the guest's loopback taking input: what a handoff bridges to."""
VIEW_VNC_PORT = 5901
"""x11vnc on the guest's loopback started with `-viewonly`: what a view-only link bridges to."""
VIEW_MINUTES = (1, 120)


@dataclass(frozen=True)
class _Session:
    user_id: str
    view_until: datetime | None = None
    """When a view-only link (and the session it became) expires; None for a handoff, which its lease bounds."""
    lease_id: str | None = None
    """The handoff lease this session holds the screen under (known once the link is redeemed)."""

    @property
    def view_only(self) -> bool:
        return self.view_until is not None


class LiveViews:
    """Tokens waiting to be redeemed, and the live sessions they became."""

    def __init__(self, computers: Computers, clock: Clock) -> None:
        self.computers = computers
        self._clock = clock
        self._tokens: dict[str, _Session] = {}  # sha256(token) -> the session it becomes (lease id not yet known)
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    def offer(self, user_id: str, token: str) -> None:
        """The one-time token of a handoff link (the tool computer checks it against its lease on redemption)."""
        with self._lock:
            self._tokens[_digest(token)] = _Session(user_id=user_id)

    def offer_view(self, user_id: str, ttl: timedelta) -> tuple[str, datetime]:
        """A new one-time token for a view-only link, and when it (and the view it opens) expires."""
        token = secrets.token_urlsafe(32)
        now = self._clock.now()
        with self._lock:
            for digest, offered in list(self._tokens.items()):  # forget view links that expired unused
                if offered.view_until is not None and offered.view_until <= now:
                    del self._tokens[digest]
            self._tokens[_digest(token)] = _Session(user_id=user_id, view_until=now + ttl)
        return token, now + ttl

    def redeem(self, token: str) -> str | None:
        """A session id for a valid, unused token; None otherwise (unknown, used, expired, control returned)."""
        from vm.observe import Accepted

        with self._lock:
            offered = self._tokens.pop(_digest(token), None)
        if offered is None:
            return None
        if offered.view_until is not None:
            if self._clock.now() >= offered.view_until:
                return None
            found = offered
        else:
            tc = self.computers.computer(offered.user_id)
            if not isinstance(tc.redeem_handoff(token), Accepted) or tc.lease is None:
                return None
            found = dataclasses.replace(offered, lease_id=tc.lease.lease_id)
        session = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[session] = found
        return session

    def live(self, session: str) -> _Session | None:
        """The session while it lasts: a handoff's while its lease is the one in force, a view-only one until its
        link expires. One that ended is forgotten."""
        with self._lock:
            found = self._sessions.get(session)
        if found is None:
            return None
        if found.view_until is not None:
            ended = self._clock.now() >= found.view_until
        else:
            lease = self.computers.computer(found.user_id).lease
            ended = lease is None or lease.lease_id != found.lease_id
        if ended:
            with self._lock:
                self._sessions.pop(session, None)
            return None
        return found

    def give_back(self, session: str) -> int | None:
        """Ends a handoff session and returns control (the new epoch); None if there is no control to return."""
        found = self.live(session)
        if found is None or found.view_only:
            return None
        with self._lock:
            self._sessions.pop(session, None)
        return self.computers.computer(found.user_id).return_control(found.lease_id)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


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


def _page(session: str, view_only: bool) -> str:
    if view_only:
        return _PAGE.format(headline="Watching your tool computer (view only).", controls="", session=session,
                            view_only="true")
    return _PAGE.format(headline="You have the screen.", controls=_RETURN.format(session=session), session=session,
                        view_only="false")


def live_router(views: LiveViews) -> APIRouter:
    from server.routes import current_user  # the routes import the runtime, which imports this module

    router = APIRouter()

    @router.post("/v1/live/view")
    async def view_link(request: Request, user: str = Depends(current_user),
                        minutes: int = Body(15, embed=True, ge=VIEW_MINUTES[0], le=VIEW_MINUTES[1]),
                        ) -> dict[str, Any]:
        """A one-time link to watch the user's tool computer without taking control."""
        token, expires_at = views.offer_view(user, timedelta(minutes=minutes))
        return {"link": f"{str(request.base_url).rstrip('/')}/v1/live/{token}", "view_only": True,
                "expires_at": expires_at.isoformat()}

    @router.get("/v1/live/{token}")
    async def redeem(token: str) -> RedirectResponse:
        session = await anyio.to_thread.run_sync(views.redeem, token)
        if session is None:
            raise HTTPException(410, "this link was used already, or it expired, or the handoff ended")
        return RedirectResponse(f"/v1/live/s/{session}", status_code=303)

    @router.get("/v1/live/s/{session}")
    async def page(session: str) -> HTMLResponse:
        found = await anyio.to_thread.run_sync(views.live, session)
        if found is None:
            raise HTTPException(410, "this live view ended (control is back with the agent, or the link expired)")
        return HTMLResponse(_page(session, found.view_only),
                            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    @router.post("/v1/live/s/{session}/return")
    async def give_back(session: str) -> HTMLResponse:
        epoch = await anyio.to_thread.run_sync(views.give_back, session)
        if epoch is None:
            raise HTTPException(410, "there is no control to return: the handoff had ended, or this view is "
                                     "view only")
        return HTMLResponse("<p>Control is back with your agent. You can close this tab.</p>")

    @router.websocket("/v1/live/s/{session}/ws")
    async def bridge(websocket: WebSocket, session: str) -> None:
        found = await anyio.to_thread.run_sync(views.live, session)
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
            await _pump(websocket, port, lambda: views.live(session) is not None)

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
