"""The gate in front of the user's control channel: who is asking is known before a byte of the body is read, and
a body is read only up to `CONTROL_BODY_LIMIT` and parsed within bounds (`server.faces.bodies`) before the routes see
it. Without it a caller with no token could make the server read and parse a 50 MB body only to answer 401. A path
holding NUL (`%00`) is refused here too: every route behind the gate looks its path's IDs up in the database, and
PostgreSQL cannot be asked about text with NUL in it.

The routes still authenticate (the gate does not hand them the user); the gate only decides whether reading on is
worth it. Paths outside the control channel (webhooks, which are signed instead, the live view's one-time links, MCP
with its own token check) pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wakeful.server.errors import BadRequest, WakefulError
from wakeful.server.faces import bodies

__all__ = ["CONTROL_BODY_LIMIT", "GUARDED_PREFIXES", "ControlGate", "guards"]

CONTROL_BODY_LIMIT = 64 * 1024
"""Bytes a control request's body may have: a task with its constraints and completion conditions fits many times."""

GUARDED_PREFIXES = ("/v1/control", "/v1/tasks", "/v1/actions", "/v1/events", "/v1/messages", "/v1/egress",
                    "/v1/live/view", "/v1/preferences", "/v1/memory")


def guards(path: str) -> bool:
    """Whether the gate stands in front of `path`: one of the prefixes, or a path below one (`/v1/tasks/x`, not
    `/v1/tasksx`; `/v1/live/view`, not a live-view link whose token starts with `view`)."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in GUARDED_PREFIXES)


class ControlGate:
    def __init__(self, app: ASGIApp, *, authenticate: Callable[[str | None], str],
                 respond: Callable[[WakefulError], ASGIApp], limit: int = CONTROL_BODY_LIMIT) -> None:
        self.app = app
        self.authenticate = authenticate
        """The user of an `Authorization` header's value; raises `Unauthorized` (it reads the database)."""
        self.respond = respond
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not guards(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            await anyio.to_thread.run_sync(self.authenticate, headers.get("authorization"))
            if "\x00" in scope["path"]:
                raise BadRequest("invalid_parameter", "a path parameter holds NUL (%00), which no ID does")
            bodies.refuse_declared(headers.get("content-length"), self.limit)
            body = await bodies.read(receive, self.limit)
            if body:
                bodies.loads(body, bodies.COLUMN_TEXT)  # the routes parse it again: theirs never sees a hostile one
        except WakefulError as exc:
            await self.respond(exc)(scope, receive, send)
            return
        except bodies.Disconnected:
            return
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then what the client does next (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
