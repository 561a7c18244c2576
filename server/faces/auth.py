"""Who is asking: the bearer token of an HTTP request, resolved to its user (every route and the live view use it)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine

from wakeful.server.store import users
from wakeful.server.store.db import read

__all__ = ["User", "bearer", "current_user", "user_of"]


def user_of(engine: Engine, authorization: str | None) -> str:
    """The user of an `Authorization: Bearer …` value; `Unauthorized` for a missing or unknown token."""
    scheme, _, token = (authorization or "").partition(" ")
    with read(engine) as conn:
        return users.authenticate(conn, token if scheme.lower() == "bearer" else None)


bearer = HTTPBearer(auto_error=False, description="a user's token: `wakeful token` issues one")
"""The scheme as the OpenAPI document states it. It decides nothing: `user_of` reads the header as it was sent."""


def current_user(request: Request, _scheme: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]) -> str:
    """The bearer token's user; every record a request touches is filtered by it."""
    return user_of(request.app.state.runtime.engine, request.headers.get("authorization"))


User = Annotated[str, Depends(current_user)]
