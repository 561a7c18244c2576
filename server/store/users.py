"""Users and their API tokens. Only a token's SHA-256 digest is stored; the token itself is shown once.

An admin user may also STOP / START the whole deployment from the console (`is_admin`); the owner `wakeful serve`
creates is one, `wakeful user-add --admin` makes another.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from sqlalchemy import Connection, bindparam, delete, select, update

from wakeful.server.errors import BadRequest, NotFound, Unauthorized
from wakeful.server.store.ids import new_id, new_token, token_digest
from wakeful.server.store.tables import console_sessions, users

__all__ = ["OWNER", "authenticate", "checked_name", "ensure_user", "is_admin", "issue_token", "name_of", "set_zone",
           "user_id_by_name", "zone"]

OWNER = "owner"
"""The user `wakeful serve` creates on its first start (and `wakeful token` without `--user` names): an admin."""

_NAME: Final = re.compile(r"[a-z0-9][a-z0-9._-]{0,39}")
"""A user's name, as an agent's is (`store.agents`): it is typed on command lines and shown in records."""


def checked_name(name: str) -> str:
    """`name` if it may name a new user; else a 400 `invalid_user_name` saying what a name is."""
    if not _NAME.fullmatch(name):
        raise BadRequest("invalid_user_name", f"{name[:80]!r} is not a user name: 1 to 40 lower-case letters, digits, "
                                              "'.', '_' or '-', starting with a letter or digit (e.g. alice)")
    return name


def ensure_user(conn: Connection, *, name: str, now: datetime, admin: bool = False) -> tuple[str, str | None]:
    """(user_id, token): the token is new (shown once) only when the user was just created, which a name that is
    not one (`checked_name`) never is. `admin` is given to a user created here; an existing user is left as they
    are."""
    existing = conn.execute(select(users.c.id).where(users.c.name == name)).scalar_one_or_none()
    if existing is not None:
        return existing, None
    user_id = new_id("usr")
    conn.execute(users.insert().values(id=user_id, name=checked_name(name), created_at=now, admin=admin))
    return user_id, issue_token(conn, user_id=user_id)


def is_admin(conn: Connection, user_id: str) -> bool:
    """Whether the user may STOP / START the whole deployment (an unknown user is not)."""
    return bool(conn.execute(select(users.c.admin).where(users.c.id == user_id)).scalar())


def issue_token(conn: Connection, *, user_id: str) -> str:
    """A fresh token for the user; the old one stops working, and so does every console sign-in made with it (a
    token is issued again when the old one leaked: a browser signed in with it must not stay in)."""
    token = new_token()
    if conn.execute(update(users).where(users.c.id == user_id).values(token_digest=token_digest(token))).rowcount != 1:
        raise NotFound("unknown_user", f"no user {user_id}")
    conn.execute(delete(console_sessions).where(console_sessions.c.user_id == user_id))
    return token


def user_id_by_name(conn: Connection, name: str) -> str:
    user_id = conn.execute(select(users.c.id).where(users.c.name == name)).scalar_one_or_none()
    if user_id is None:
        raise NotFound("unknown_user", f"no user named {name!r}; create it with `wakeful user-add {name}`")
    return str(user_id)


def name_of(conn: Connection, user_id: str) -> str:
    """A user's name, as records that name who said something show it (the ID when the user has none)."""
    return str(conn.execute(select(users.c.name).where(users.c.id == user_id)).scalar() or user_id)


_BY_DIGEST = select(users.c.id).where(users.c.token_digest == bindparam("digest"))
_ZONE = select(users.c.timezone).where(users.c.id == bindparam("user_id"))
"""Built once: every authenticated request and every status read runs them."""


def authenticate(conn: Connection, token: str | None) -> str:
    if not token:
        raise Unauthorized("missing_token", "send `Authorization: Bearer <token>`: a user's token (`wakeful token`), "
                                            "or for an MCP client an agent credential (`wakeful agent add`)")
    user_id = conn.execute(_BY_DIGEST, {"digest": token_digest(token)}).scalar_one_or_none()
    if user_id is None:
        raise Unauthorized("bad_token", "that token is not valid (it may have been re-issued)")
    return str(user_id)


def zone(conn: Connection, user_id: str) -> ZoneInfo:
    """The user's time zone: cron checks, quiet hours and the daily attention budget are read in it."""
    name = conn.execute(_ZONE, {"user_id": user_id}).scalar_one_or_none()
    if name is None:
        raise NotFound("unknown_user", f"no user {user_id}")
    return ZoneInfo(name)


def in_words(at: datetime, zone: ZoneInfo, *, named: bool = True) -> str:
    """A time as the user reads it: '2026-12-04 22:37 Europe/Paris', the zone named unless the sentence already
    did (a message outlives a move to another zone)."""
    return f"{at.astimezone(zone):%Y-%m-%d %H:%M}" + (f" {zone.key}" if named else "")


def set_zone(conn: Connection, *, user_id: str, name: str) -> ZoneInfo:
    """Set the user's IANA time zone (e.g. `Asia/Hong_Kong`); an unknown name is a 400 `unknown_timezone`."""
    if name not in available_timezones():
        raise BadRequest("unknown_timezone", f"{name!r} is not an IANA time zone name, such as 'Asia/Hong_Kong'")
    try:
        found = ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:  # pragma: no cover - listed names load
        raise BadRequest("unknown_timezone", str(exc)) from exc
    if conn.execute(update(users).where(users.c.id == user_id).values(timezone=name)).rowcount != 1:
        raise NotFound("unknown_user", f"no user {user_id}")
    return found
