"""One-time links in approval requests: a message to the user carries `open: /a/<token>`, and the link opens the
action's card in the console. The link is not an approval: deciding still takes the user signed in to the console.

A link is bound to the action's ID and content hash and expires with the approval wait. It opens once, for its own
user; it refuses when it expired, was used, or the action changed (the task was steered since, so the action is
void, or it is no longer waiting for approval). Only the token's digest is stored.
"""

from __future__ import annotations

import secrets
from datetime import datetime

from sqlalchemy import Connection, and_, select, update

from wakeful.server.acting.actions import Action, load_action
from wakeful.server.errors import Conflict, NotFound
from wakeful.server.store.ids import token_digest
from wakeful.server.store.tables import VerdictKind, approval_links, tasks, verdicts

__all__ = ["PATH", "mint", "open_link"]

PATH = "/a/"
"""Where the console serves the links: `/a/<token>`."""


def mint(conn: Connection, action: Action, *, now: datetime, expires_at: datetime) -> str:
    """A new link's path (`/a/<token>`) for `action`'s approval request."""
    token = secrets.token_urlsafe(24)
    conn.execute(approval_links.insert().values(token_digest=token_digest(token), user_id=action.user_id,
                                                action_id=action.id, content_hash=action.content_hash,
                                                created_at=now, expires_at=expires_at))
    return PATH + token


def open_link(conn: Connection, token: str, *, user_id: str, now: datetime) -> str:
    """The action a link opens, the link used up; refused (with a stable code) when it may not open."""
    link = conn.execute(select(approval_links).where(approval_links.c.token_digest == token_digest(token))).first()
    if link is None or link.user_id != user_id:
        raise NotFound("unknown_link", "this approval link is not one of yours: open your approvals in the console")
    if link.used_at is not None:
        raise Conflict("link_used", "this approval link was opened already; the card is under Approvals")
    if link.expires_at <= now:
        raise Conflict("link_expired", "this approval link expired, and so did the approval it asked for")
    action = load_action(conn, link.action_id, user_id=user_id)
    current = conn.execute(select(tasks.c.current_version).where(tasks.c.id == action.task_id)).scalar()
    latest = conn.execute(select(verdicts.c.verdict).where(verdicts.c.action_id == action.id)
                          .order_by(verdicts.c.created_at.desc(), verdicts.c.id.desc()).limit(1)).scalar()
    if action.content_hash != link.content_hash or current != action.task_version:
        raise Conflict("action_changed", "the task changed since this link was sent, so the action it asked about "
                                         "is void; the agent asks again if it still needs to")
    if latest != VerdictKind.NEEDS_APPROVAL.value:
        raise Conflict("not_awaiting_approval", f"this action is no longer waiting for approval (it is {latest})")
    used = conn.execute(update(approval_links).where(and_(approval_links.c.token_digest == link.token_digest,
                                                          approval_links.c.used_at.is_(None)))
                        .values(used_at=now))
    if used.rowcount != 1:
        raise Conflict("link_used", "this approval link was opened already; the card is under Approvals")
    return action.id
