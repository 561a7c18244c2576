"""Actions: an intended external effect with immutable canonical content and its SHA-256 content hash.

The content holds everything an approver must see and everything the dispatcher will send: the tool, the
arguments as given, the external references they resolved to, the prepared request (method, URL, body digest),
the amount, and snapshots of the objects involved (price, quote expiry). Approvals bind to the hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, select

from wakeful.server.errors import NotFound
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import actions

__all__ = ["Action", "canonical", "content_hash", "create_action", "load_action"]


def canonical(content: Any) -> str:
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_hash(content: Any) -> str:
    return hashlib.sha256(canonical(content).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Action:
    id: str
    user_id: str
    task_id: str
    task_version: int
    run_id: str | None
    tool: str
    content: dict[str, Any]
    content_hash: str
    risk: str
    amount_cents: int | None
    currency: str | None
    created_at: datetime


def create_action(conn: Connection, *, user_id: str, task_id: str, task_version: int, run_id: str | None, tool: str,
                  content: dict[str, Any], risk: str, amount_cents: int | None, currency: str | None,
                  now: datetime, decision_id: str | None = None) -> Action:
    action = Action(id=new_id("act"), user_id=user_id, task_id=task_id, task_version=task_version, run_id=run_id,
                    tool=tool, content=content, content_hash=content_hash(content), risk=risk,
                    amount_cents=amount_cents, currency=currency, created_at=now)
    conn.execute(actions.insert().values(
        id=action.id, user_id=user_id, task_id=task_id, task_version=task_version, run_id=run_id,
        decision_id=decision_id, tool=tool,
        content=canonical(content), content_hash=action.content_hash, risk=risk, amount_cents=amount_cents,
        currency=currency, created_at=now,
    ))
    return action


def load_action(conn: Connection, action_id: str, *, user_id: str | None = None) -> Action:
    query = select(actions).where(actions.c.id == action_id)
    if user_id is not None:
        query = query.where(actions.c.user_id == user_id)
    row = conn.execute(query).first()
    if row is None:
        raise NotFound("unknown_action", f"no action {action_id} for this user", action_id=action_id)
    content = json.loads(row.content)
    return Action(id=row.id, user_id=row.user_id, task_id=row.task_id, task_version=row.task_version,
                  run_id=row.run_id, tool=row.tool, content=content, content_hash=row.content_hash, risk=row.risk,
                  amount_cents=row.amount_cents, currency=row.currency, created_at=row.created_at)
