"""Who is asking: a bearer token resolved to its principal, the one place the two kinds of credential are told apart.

    user credential   `wk_…` (`wakeful token`): the user. It reaches everything the user may do: the control
                      channel (`/v1`), and the MCP tools, where what it does is still recorded as the agent's.
    agent credential  `wka_…` (`wakeful agent add NAME`): one MCP client of the user. It reaches the agent's tools
                      (`/mcp`) and nothing else: every `/v1` route answers it 403 `user_credential_required`, reads
                      included (the agent reads through its tools; what it may see is what they show it).

Every `/v1` route takes its user from `current_user` (the `User` parameter, and the router's own dependency, so a
route that forgets the parameter is guarded all the same); the control gate in front of them asks `user_of`, the same
check, before a byte of a body is read. The MCP server asks `principal_of` and records whatever reaches it as the
agent's (principle 9): over `/mcp` the channel, not the credential, decides whose word it is.

`/mcp` takes the same `Authorization: Bearer <token>` and nothing else: no OAuth. `BearerGate` checks it once in
front of the MCP app; its `401` says so in the plain RFC 6750 challenge (`WWW-Authenticate: Bearer realm="wakeful"`),
naming no resource metadata and no authorization server, so an MCP client is not sent to discover OAuth endpoints
that do not exist; docs/claude-code.md shows the header to configure instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Final

import anyio
from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Connection, Engine
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from wakeful.server.errors import Refused, Unauthorized, WakefulError
from wakeful.server.store import agents, users
from wakeful.server.store.db import read

__all__ = ["MCP_CALLER", "BearerGate", "Kind", "Principal", "User", "authenticate", "bearer", "challenge",
           "current_user", "principal_of", "the_user", "user_of"]

MCP_CALLER: Final = "wakeful.caller"
"""The scope key under which `BearerGate` hands the MCP app the principal it authenticated, heard as the agent."""


class Kind(StrEnum):
    USER = "user"
    AGENT = "agent"


@dataclass(frozen=True, kw_only=True)
class Principal:
    """Who a request speaks for: the user whose records it touches, and whether it is that user or their agent."""

    user_id: str
    kind: Kind
    agent: str | None = None
    """The agent credential's name (`claude-code`); None for the user, and for an agent with no credential of its
    own (the stdio server started for a local user, or a client holding the user's token)."""

    def as_agent(self) -> Principal:
        """The same caller heard through the agent's channel (MCP): the agent, whatever credential it holds."""
        return self if self.kind is Kind.AGENT else Principal(user_id=self.user_id, kind=Kind.AGENT)

    @property
    def actor(self) -> str:
        """Who the records it writes name: `user:<id>`, or `agent:<id> via mcp` (`agent:<id>/<name> via mcp` with
        a named credential)."""
        if self.kind is Kind.USER:
            return f"user:{self.user_id}"
        return f"agent:{self.user_id}{'/' + self.agent if self.agent else ''} via mcp"


def authenticate(conn: Connection, token: str | None) -> Principal:
    """The principal of a bearer token; `Unauthorized` for a missing, unknown or revoked one."""
    if token and token.startswith(agents.PREFIX):
        user_id, name = agents.authenticate(conn, token)
        return Principal(user_id=user_id, kind=Kind.AGENT, agent=name)
    return Principal(user_id=users.authenticate(conn, token), kind=Kind.USER)


def principal_of(engine: Engine, authorization: str | None) -> Principal:
    """The principal of an `Authorization: Bearer …` value."""
    scheme, _, token = (authorization or "").partition(" ")
    with read(engine) as conn:
        return authenticate(conn, token if scheme.lower() == "bearer" else None)


def user_of(engine: Engine, authorization: str | None) -> str:
    """The user of an `Authorization` value that holds a user credential: `Unauthorized` without a valid one, and
    `Refused` (403 `user_credential_required`) for an agent credential. The one guard of the control channel."""
    return the_user(principal_of(engine, authorization))


def the_user(principal: Principal) -> str:
    """The user a principal is, if it holds a user credential; `Refused` (403 `user_credential_required`) for an
    agent credential. Every way into the control channel (the `/v1` routes, the console's sign-in) asks this."""
    if principal.kind is not Kind.USER:
        raise Refused("user_credential_required",
                      f"this is the user's control channel, and an agent credential ({principal.agent}) reaches only "
                      "the agent's tools at /mcp; send the user's own token (`wakeful token`)")
    return principal.user_id


bearer = HTTPBearer(auto_error=False, description="a user's token: `wakeful token` issues one")
"""The scheme as the OpenAPI document states it. It decides nothing: `user_of` reads the header as it was sent."""


def current_user(request: Request, _scheme: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]) -> str:
    """The bearer token's user, who must hold a user credential; every record a request touches is filtered by it."""
    return user_of(request.app.state.runtime.engine, request.headers.get("authorization"))


User = Annotated[str, Depends(current_user)]


def challenge(exc: Unauthorized) -> str:
    """The `WWW-Authenticate` value of a refused bearer token (RFC 6750 §3): the scheme and realm, and for a token
    that was sent but is not valid, `error="invalid_token"`. Nothing points to OAuth: there is none to discover."""
    return 'Bearer realm="wakeful"' + (', error="invalid_token"' if exc.code == "bad_token" else "")


class BearerGate:
    """In front of the MCP app: a request without a valid bearer token (a user's or an agent credential) is answered
    `401` here (through `respond`, the app's one error mapping, with `challenge` as its `WWW-Authenticate`); one with
    a valid token reaches the app with its principal, as the agent, in `scope[MCP_CALLER]`, so the MCP handlers never
    look the token up again."""

    def __init__(self, app: ASGIApp, *, engine: Engine, respond: Callable[[WakefulError], Any]) -> None:
        self.app = app
        self.engine = engine
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            caller = await anyio.to_thread.run_sync(principal_of, self.engine,
                                                    Headers(scope=scope).get("authorization"))
        except Unauthorized as exc:
            response = self.respond(exc)
            response.headers["WWW-Authenticate"] = challenge(exc)
            await response(scope, receive, send)
            return
        await self.app({**scope, MCP_CALLER: caller.as_agent()}, receive, send)
