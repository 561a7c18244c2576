"""Console sessions: a user signs in with their token and the browser holds a random session ID in a cookie.

Only the ID's SHA-256 digest is stored, beside the user, the session's CSRF token and its expiry: a database reader
cannot sign in as anyone. Every form carries the CSRF token and every POST is checked against it
(`check_csrf`); signing out deletes the row. A token issued again with `wakeful token` ends every session signed in
with the old one (`users.issue_token`): it is how a user answers a leaked token, and only the browser that signed
in could end its session otherwise.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection, and_, delete, select

from wakeful.server.errors import Refused
from wakeful.server.faces.auth import authenticate, the_user
from wakeful.server.store.ids import token_digest
from wakeful.server.store.tables import console_sessions

__all__ = ["SESSION_TTL", "ConsoleSession", "check_csrf", "session_of", "sign_in", "sign_out"]

SESSION_TTL = timedelta(hours=12)
"""How long a sign-in lasts: a working day, then the token again."""


@dataclass(frozen=True, kw_only=True)
class ConsoleSession:
    user_id: str
    csrf_token: str
    expires_at: datetime


def sign_in(conn: Connection, *, token: str, now: datetime, ttl: timedelta = SESSION_TTL) -> tuple[str, ConsoleSession]:
    """(the new session's ID for the cookie, the session); `Unauthorized` for a token that is no user's, `Refused`
    (`user_credential_required`) for an agent credential: the console is the user's control channel."""
    user_id = the_user(authenticate(conn, token.strip() or None))
    session_id, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    conn.execute(console_sessions.insert().values(id_digest=token_digest(session_id), user_id=user_id,
                                                  csrf_token=csrf, created_at=now, expires_at=now + ttl))
    return session_id, ConsoleSession(user_id=user_id, csrf_token=csrf, expires_at=now + ttl)


def session_of(conn: Connection, session_id: str | None, *, now: datetime) -> ConsoleSession | None:
    """The live session a cookie names; None for no cookie, an unknown or ended session, or an expired one."""
    if not session_id or len(session_id) > 100:
        return None
    row = conn.execute(select(console_sessions).where(and_(
        console_sessions.c.id_digest == token_digest(session_id), console_sessions.c.expires_at > now))).first()
    return None if row is None else ConsoleSession(user_id=row.user_id, csrf_token=row.csrf_token,
                                                   expires_at=row.expires_at)


def sign_out(conn: Connection, session_id: str | None) -> None:
    if session_id:
        conn.execute(delete(console_sessions).where(console_sessions.c.id_digest == token_digest(session_id)))


def check_csrf(expected: str, given: str | None) -> None:
    """A POST must carry the CSRF token of the session it is sent in: a form another site forged cannot know it."""
    if not given or not hmac.compare_digest(expected.encode(), given.encode()):
        raise Refused("bad_csrf_token", "this form did not come from your console page (its CSRF token is missing or "
                                        "wrong); reload the page and try again")
