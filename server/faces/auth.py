"""Who is asking: the bearer token of an HTTP request, resolved to its user (every route, the live view and `/mcp`
use it).

`/mcp` takes the same `Authorization: Bearer <token>` and nothing else: no OAuth. Its `401` says so in the plain
RFC 6750 challenge (`WWW-Authenticate: Bearer realm="wakeful"`), naming no resource metadata and no authorization
server, so an MCP client is not sent to discover OAuth endpoints that do not exist; docs/claude-code.md shows the
header to configure instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Final

import anyio
from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from wakeful.server.errors import Unauthorized, WakefulError
from wakeful.server.store import users
from wakeful.server.store.db import read

__all__ = ["MCP_USER", "BearerGate", "User", "bearer", "challenge", "current_user", "user_of"]

MCP_USER: Final = "wakeful.user"
"""The scope key under which `BearerGate` hands the app the user it authenticated."""


def user_of(engine: Engine, authorization: str | None) -> str:
    """The user of an `Authorization: Bearer …` value; `Unauthorized` for a missing or unknown token."""
    scheme, _, token = (authorization or "").partition(" ")
    with read(engine) as conn:
        return users.authenticate(conn, token if scheme.lower() == "bearer" else None)


def challenge(exc: Unauthorized) -> str:
    """The `WWW-Authenticate` value of a refused bearer token (RFC 6750 §3): the scheme and realm, and for a token
    that was sent but is not valid, `error="invalid_token"`. Nothing points to OAuth: there is none to discover."""
    return 'Bearer realm="wakeful"' + (', error="invalid_token"' if exc.code == "bad_token" else "")


bearer = HTTPBearer(auto_error=False, description="a user's token: `wakeful token` issues one")
"""The scheme as the OpenAPI document states it. It decides nothing: `user_of` reads the header as it was sent."""


def current_user(request: Request, _scheme: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]) -> str:
    """The bearer token's user; every record a request touches is filtered by it."""
    return user_of(request.app.state.runtime.engine, request.headers.get("authorization"))


User = Annotated[str, Depends(current_user)]


class BearerGate:
    """In front of the MCP app: a request without a valid bearer token is answered `401` here (through `respond`,
    the app's one error mapping, with `challenge` as its `WWW-Authenticate`); one with a valid token reaches the app
    with its user in `scope[MCP_USER]`, so the MCP handlers never look the token up again."""

    def __init__(self, app: ASGIApp, *, engine: Engine, respond: Callable[[WakefulError], Any]) -> None:
        self.app = app
        self.engine = engine
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            user = await anyio.to_thread.run_sync(user_of, self.engine, Headers(scope=scope).get("authorization"))
        except Unauthorized as exc:
            response = self.respond(exc)
            response.headers["WWW-Authenticate"] = challenge(exc)
            await response(scope, receive, send)
            return
        await self.app({**scope, MCP_USER: user}, receive, send)
