"""Who is asking: the bearer token of an HTTP request, resolved to its user (every route and the live view use it)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy import Engine

from wakeful.server.store import users
from wakeful.server.store.db import read

__all__ = ["User", "current_user", "user_of"]


def user_of(engine: Engine, authorization: str | None) -> str:
    """The user of an `Authorization: Bearer …` value; `Unauthorized` for a missing or unknown token."""
    scheme, _, token = (authorization or "").partition(" ")
    with read(engine) as conn:
        return users.authenticate(conn, token if scheme.lower() == "bearer" else None)


def current_user(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    """The bearer token's user; every record a request touches is filtered by it."""
    return user_of(request.app.state.runtime.engine, authorization)


User = Annotated[str, Depends(current_user)]
