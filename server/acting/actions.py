"""Actions: an intended external effect with immutable canonical content and its SHA-256 content hash.

The content holds everything an approver must see and everything the dispatcher will send: the tool, the
arguments as given, the external references they resolved to, the prepared request (method, URL, body digest),
the amount, and snapshots of the objects involved (price, quote expiry). Approvals bind to the hash.

Two hashes, for two questions. The content hash asks "is this exactly what was approved?": it covers everything,
the action's own idempotency key included, so no two actions share it. The operation hash asks "is this the same
thing done to the world?": the connector, the tool and the request as the remote receives it (method, URL and body,
by digest), without the headers (the idempotency key rides there) or anything the server keeps beside it (object
IDs, snapshots, amounts, times). Two reads of one subscription give two object IDs for one external reference, and
cancelling through either is the same operation. Within a task version, a proposal whose operation is that of an
action still standing (pending, admitted, unknown or done: `STANDING`) is that action, never a second one
(`standing_action`); a refused, denied, voided or blocked action stands for nothing, and a new task version starts
afresh. Tool-computer acts carry no operation hash: the same click twice can be two intended effects.

An action's state is derived from its records, never stored (actions are append-only):

    done      the remote accepted it, by its answer or as reconciliation found
    unknown   an attempt's outcome is unknown (it may have happened): reconciled, never re-proposed
    admitted  admitted, not yet settled: queued, held by a pause, or on the wire
    pending   awaiting the user's approval
    blocked   admitted, and every attempt certainly did nothing
    refused   refused by admission, denied by the user, or voided before it was sent
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, and_, select

from wakeful.proxy.contract import EgressRequest
from wakeful.server.errors import NotFound
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import Outcome, VerdictKind, actions, attempts, evidence, verdicts

__all__ = ["STANDING", "Action", "ActionState", "action_state", "canonical", "content_hash", "create_action",
           "load_action", "operation_hash", "standing_action"]


def canonical(content: Any) -> str:
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_hash(content: Any) -> str:
    return hashlib.sha256(canonical(content).encode()).hexdigest()


def operation_hash(*, connector: str, tool: str, request: Mapping[str, Any]) -> str:
    """What the remote would be asked to do, and nothing the server keeps beside it (see the module docstring);
    `request` is the stored form of the action's request (`EgressRequest.to_json`)."""
    sent = EgressRequest.from_json(request)
    return content_hash({"connector": connector, "tool": tool, "method": sent.method, "url": sent.url,
                         "body_sha256": sent.body_sha256})


class ActionState(StrEnum):
    PENDING = "pending"
    ADMITTED = "admitted"
    UNKNOWN = "unknown"
    DONE = "done"
    BLOCKED = "blocked"
    REFUSED = "refused"


STANDING = frozenset({ActionState.PENDING, ActionState.ADMITTED, ActionState.UNKNOWN, ActionState.DONE})
"""The states in which an action stands for its operation in its task version."""


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
    operation_hash: str | None = None


def create_action(conn: Connection, *, user_id: str, task_id: str, task_version: int, run_id: str | None, tool: str,
                  content: dict[str, Any], risk: str, amount_cents: int | None, currency: str | None,
                  now: datetime, decision_id: str | None = None, operation: str | None = None) -> Action:
    """`operation`: the operation hash (`operation_hash`); None for an act that is never the same as another."""
    action = Action(id=new_id("act"), user_id=user_id, task_id=task_id, task_version=task_version, run_id=run_id,
                    tool=tool, content=content, content_hash=content_hash(content), risk=risk,
                    amount_cents=amount_cents, currency=currency, created_at=now, operation_hash=operation)
    conn.execute(actions.insert().values(
        id=action.id, user_id=user_id, task_id=task_id, task_version=task_version, run_id=run_id,
        decision_id=decision_id, tool=tool,
        content=canonical(content), content_hash=action.content_hash, operation_hash=operation, risk=risk,
        amount_cents=amount_cents, currency=currency, created_at=now,
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
                  amount_cents=row.amount_cents, currency=row.currency, created_at=row.created_at,
                  operation_hash=row.operation_hash)


def action_state(conn: Connection, action_id: str) -> ActionState:
    """The action's state from its records (see the module docstring): the remote's word first, then what may have
    happened, then the latest verdict."""
    outcomes = [o for (o,) in conn.execute(select(attempts.c.outcome).where(attempts.c.action_id == action_id))]
    reconciled = conn.execute(select(evidence.c.id).where(and_(
        evidence.c.action_id == action_id, evidence.c.source == "reconcile",
        evidence.c.verdict == Outcome.ACCEPTED.value))).first()
    if Outcome.ACCEPTED.value in outcomes or reconciled is not None:
        return ActionState.DONE
    if Outcome.UNKNOWN.value in outcomes:  # whatever became of a resend or the intent since: it may have happened
        return ActionState.UNKNOWN
    if None in outcomes:
        return ActionState.ADMITTED  # persisted, and on the wire now (or the dispatcher stopped: then unknown)
    verdict = conn.execute(select(verdicts.c.verdict).where(verdicts.c.action_id == action_id)
                           .order_by(verdicts.c.created_at.desc(), verdicts.c.id.desc()).limit(1)).scalar()
    if verdict == VerdictKind.NEEDS_APPROVAL.value:
        return ActionState.PENDING
    if verdict == VerdictKind.ADMITTED.value:
        return ActionState.BLOCKED if outcomes else ActionState.ADMITTED
    return ActionState.REFUSED


def standing_action(conn: Connection, *, task_id: str, task_version: int,
                    operation: str) -> tuple[str, ActionState] | None:
    """The action of this task version that stands for `operation`, with its state; None when none does.

    Race-free only under the task's lock (`verdicts.lock_task`), which every proposal takes before it looks."""
    candidates = conn.execute(select(actions.c.id).where(and_(
        actions.c.task_id == task_id, actions.c.task_version == task_version, actions.c.operation_hash == operation))
        .order_by(actions.c.created_at, actions.c.id)).scalars().all()
    for action_id in candidates:
        state = action_state(conn, action_id)
        if state in STANDING:
            return action_id, state
    return None
