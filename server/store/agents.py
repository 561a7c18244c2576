"""Agent credentials: one per MCP client of a user, named, listed and revocable. Only a credential's SHA-256 digest
is stored; the credential itself is shown once, when it is added. What a credential may reach is
`server.faces.auth`'s to decide (the agent's tools, nothing else); this module only keeps them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from sqlalchemy import Connection, and_, select, update

from wakeful.server.errors import BadRequest, Conflict, NotFound, Unauthorized
from wakeful.server.store.ids import new_id, new_token, token_digest
from wakeful.server.store.tables import agent_credentials

__all__ = ["PREFIX", "AgentCredential", "add", "authenticate", "listing", "revoke"]

PREFIX: Final = "wka_"
"""How an agent credential begins (a user's token begins `wk_`): the server knows which kind it was sent."""

_NAME: Final = re.compile(r"[a-z0-9][a-z0-9._-]{0,39}")


@dataclass(frozen=True, kw_only=True)
class AgentCredential:
    """One credential as `wakeful agent list` shows it (never the credential itself)."""

    name: str
    created_at: datetime
    revoked_at: datetime | None


def _checked(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise BadRequest("invalid_agent_name", f"{name[:80]!r} is not an agent name: 1 to 40 lower-case letters, "
                                               "digits, '.', '_' or '-', starting with a letter or digit "
                                               "(e.g. claude-code)")
    return name


def add(conn: Connection, *, user_id: str, name: str, now: datetime) -> str:
    """A new credential named `name` for the user's agent; answers the credential (shown once)."""
    live = and_(agent_credentials.c.user_id == user_id, agent_credentials.c.name == _checked(name),
                agent_credentials.c.revoked_at.is_(None))
    if conn.execute(select(agent_credentials.c.id).where(live)).first() is not None:
        raise Conflict("agent_exists", f"an agent credential named {name!r} exists; revoke it first with "
                                       f"`wakeful agent revoke {name}`, or pick another name", name=name)
    token = new_token(PREFIX)
    conn.execute(agent_credentials.insert().values(id=new_id("agc"), user_id=user_id, name=name,
                                                   token_digest=token_digest(token), created_at=now))
    return token


def listing(conn: Connection, *, user_id: str) -> list[AgentCredential]:
    """The user's credentials, oldest first, revoked ones too (with when)."""
    rows = conn.execute(select(agent_credentials.c.name, agent_credentials.c.created_at, agent_credentials.c.revoked_at)
                        .where(agent_credentials.c.user_id == user_id)
                        .order_by(agent_credentials.c.created_at, agent_credentials.c.id)).all()
    return [AgentCredential(name=r.name, created_at=r.created_at, revoked_at=r.revoked_at) for r in rows]


def revoke(conn: Connection, *, user_id: str, name: str, now: datetime) -> None:
    """The live credential named `name` stops working at once (its row stays, with when it was revoked)."""
    moved = conn.execute(update(agent_credentials).where(and_(
        agent_credentials.c.user_id == user_id, agent_credentials.c.name == name,
        agent_credentials.c.revoked_at.is_(None))).values(revoked_at=now)).rowcount
    if moved != 1:
        raise NotFound("unknown_agent", f"no live agent credential named {name[:80]!r}; `wakeful agent list` shows "
                                        "them", name=name[:80])


def authenticate(conn: Connection, token: str) -> tuple[str, str]:
    """(user_id, name) of a live credential; `Unauthorized` for an unknown or revoked one."""
    row = conn.execute(select(agent_credentials.c.user_id, agent_credentials.c.name).where(and_(
        agent_credentials.c.token_digest == token_digest(token), agent_credentials.c.revoked_at.is_(None)))).first()
    if row is None:
        raise Unauthorized("bad_token", "that agent credential is not valid (it may have been revoked)")
    return str(row.user_id), str(row.name)
