"""The live view a user gets when the agent hands them the screen: noVNC in the browser, bridged over a websocket
to x11vnc in the guest (through the guest channel's SSH forward), for as long as the control lease lasts.

    GET  /v1/live/{token}             redeems the one-time token from the handoff link → redirect to the session
    GET  /v1/live/s/{session}         the page: the guest's screen, and a "Return control" button
    WS   /v1/live/s/{session}/ws      RFB bytes both ways (noVNC's "binary" websocket)
    POST /v1/live/s/{session}/return  hands the screen back: the lease ends, the epoch moves, the agent re-observes

The token is good once; the session id that replaces it is random, held only in memory, and dies with the lease.
While the page is connected the VM counts as busy (`live_view`), so the idle reaper leaves it running.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import HTMLResponse, RedirectResponse

from server.computers import Computers

__all__ = ["LiveViews", "NOVNC_DIR", "live_router"]

NOVNC_DIR = Path("/usr/share/novnc")
"""Debian's `novnc` package: the page loads its RFB module from here (served at /novnc)."""


@dataclass
class _Session:
    user_id: str
    lease_id: str


class LiveViews:
    """Handoff tokens waiting to be redeemed, and the live sessions they became."""

    def __init__(self, computers: Computers) -> None:
        self.computers = computers
        self._tokens: dict[str, str] = {}  # sha256(token) -> user
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    def offer(self, user_id: str, token: str) -> None:
        with self._lock:
            self._tokens[hashlib.sha256(token.encode()).hexdigest()] = user_id

    def redeem(self, token: str) -> str | None:
        """A session id for a valid, unused token; None otherwise (unknown, used, expired, control returned)."""
        from vm.observe import Accepted

        with self._lock:
            user_id = self._tokens.pop(hashlib.sha256(token.encode()).hexdigest(), None)
        if user_id is None:
            return None
        tc = self.computers.computer(user_id)
        if not isinstance(tc.redeem_handoff(token), Accepted) or tc.lease is None:
            return None
        session = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[session] = _Session(user_id=user_id, lease_id=tc.lease.lease_id)
        return session

    def live(self, session: str) -> _Session | None:
        """The session while its lease is the one in force; a lease that expired or ended closes it."""
        with self._lock:
            found = self._sessions.get(session)
        if found is None:
            return None
        lease = self.computers.computer(found.user_id).lease
        if lease is None or lease.lease_id != found.lease_id:
            with self._lock:
                self._sessions.pop(session, None)
            return None
        return found

    def give_back(self, session: str) -> int | None:
        found = self.live(session)
        if found is None:
            return None
        with self._lock:
            self._sessions.pop(session, None)
        return self.computers.computer(found.user_id).return_control(found.lease_id)


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>wakeful: your tool computer</title>
<style>body{{margin:0;font-family:sans-serif;background:#222;color:#eee}}
header{{padding:8px 12px;display:flex;gap:12px;align-items:center}}#screen{{width:100vw;height:calc(100vh - 48px)}}
button{{font-size:15px;padding:6px 14px}}</style></head>
<body><header><b>You have the screen.</b><span id="status">connecting…</span>
<form method="post" action="/v1/live/s/{session}/return"><button>Return control</button></form></header>
<div id="screen"></div>
<script type="module">
import RFB from "/novnc/core/rfb.js";
const scheme = location.protocol === "https:" ? "wss" : "ws";
const rfb = new RFB(document.getElementById("screen"), `${{scheme}}://${{location.host}}/v1/live/s/{session}/ws`);
rfb.scaleViewport = true;
rfb.addEventListener("connect", () => document.getElementById("status").textContent = "connected");
rfb.addEventListener("disconnect", () => document.getElementById("status").textContent = "disconnected");
</script></body></html>
"""


def live_router(views: LiveViews) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/live/{token}")
    async def redeem(token: str) -> RedirectResponse:
        session = await anyio.to_thread.run_sync(views.redeem, token)
        if session is None:
            raise HTTPException(410, "this link was used already, or the handoff ended")
        return RedirectResponse(f"/v1/live/s/{session}", status_code=303)

    @router.get("/v1/live/s/{session}")
    async def page(session: str) -> HTMLResponse:
        if await anyio.to_thread.run_sync(views.live, session) is None:
            raise HTTPException(410, "the handoff ended: control is back with the agent")
        return HTMLResponse(_PAGE.format(session=session),
                            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    @router.post("/v1/live/s/{session}/return")
    async def give_back(session: str, request: Request) -> HTMLResponse:
        epoch = await anyio.to_thread.run_sync(views.give_back, session)
        if epoch is None:
            raise HTTPException(410, "the handoff had already ended")
        return HTMLResponse("<p>Control is back with your agent. You can close this tab.</p>")

    @router.websocket("/v1/live/s/{session}/ws")
    async def bridge(websocket: WebSocket, session: str) -> None:
        found = await anyio.to_thread.run_sync(views.live, session)
        if found is None:
            await websocket.close(code=4410)
            return
        port = await anyio.to_thread.run_sync(lambda: views.computers.computer(found.user_id).vnc_port())
        wanted = websocket.headers.get("sec-websocket-protocol", "")
        await websocket.accept(subprotocol="binary" if "binary" in wanted else None)
        with views.computers.activity(found.user_id, "live_view"):
            await _pump(websocket, port, lambda: views.live(session) is not None)

    return router


async def _pump(websocket: WebSocket, port: int, still_live: Any) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def to_vnc() -> None:
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                message = await websocket.receive()
                if message.get("type") == "websocket.disconnect":
                    return
                data = message.get("bytes") or (message.get("text") or "").encode()
                if not await anyio.to_thread.run_sync(still_live):
                    return  # the lease ended: no more input reaches the guest
                writer.write(data)
                await writer.drain()

    async def to_browser() -> None:
        while data := await reader.read(65536):
            await websocket.send_bytes(data)

    tasks = [asyncio.ensure_future(to_vnc()), asyncio.ensure_future(to_browser())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await websocket.close()
