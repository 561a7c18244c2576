"""Approve or deny an action: only through the user's control channel (authenticated HTTP or the CLI).

An approval binds to the action's ID and content hash, the task version, an amount ceiling and an expiry, and
is single-use. Deciding locks the task first, so an approval and a pause from two devices are ordered; the
action is then re-admitted against the facts as they are now, and the approval wait is answered through the
inbox so the agent hears of it on its next run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, select

from wakeful.server.acting.actions import load_action
from wakeful.server.acting.admission import Verdict
from wakeful.server.acting.policy import Policy
from wakeful.server.acting.verdicts import admit_and_record, approval_key, lock_task
from wakeful.server.core import control, inbox
from wakeful.server.errors import Conflict
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import (
    ApprovalDecision,
    Authority,
    ControlKind,
    EventKind,
    VerdictKind,
    approvals,
    verdicts,
)

__all__ = ["Decided", "decide"]


@dataclass(frozen=True, kw_only=True)
class Decided:
    approval_id: str
    verdict: Verdict


def decide(conn: Connection, *, user_id: str, action_id: str, approve: bool, actor: str, policy: Policy,
           now: datetime, reason: str = "") -> Decided:
    action = load_action(conn, action_id, user_id=user_id)
    task = lock_task(conn, action.task_id)
    latest = conn.execute(select(verdicts.c.verdict).where(verdicts.c.action_id == action.id)
                          .order_by(verdicts.c.created_at.desc(), verdicts.c.id.desc()).limit(1)).scalar()
    if latest != VerdictKind.NEEDS_APPROVAL.value:
        raise Conflict("not_awaiting_approval", f"action {action_id} is not waiting for approval (it is {latest})",
                       action_id=action_id, verdict=latest)
    approval_id = new_id("apr")
    decision = ApprovalDecision.APPROVED if approve else ApprovalDecision.DENIED
    conn.execute(approvals.insert().values(
        id=approval_id, action_id=action.id, content_hash=action.content_hash, task_id=action.task_id,
        task_version=task.current_version, decision=decision.value, approver=actor,
        amount_ceiling_cents=action.amount_cents, valid_until=now + policy.approval_ttl, created_at=now,
    ))
    control.record(conn, user_id=user_id, task_id=action.task_id,
                   kind=ControlKind.APPROVE if approve else ControlKind.DENY, actor=actor,
                   reason=reason or f"{decision.value} {action.id}", now=now)
    verdict = admit_and_record(conn, action, policy=policy, now=now, session_id=task.session_id)
    inbox.record(conn, inbox.Delivery(
        user_id=user_id, source="approval", source_id=approval_id, kind=EventKind.CONTROL, trust="user",
        authority=Authority.USER, corr_key=approval_key(action.id),
        payload={"action_id": action.id, "decision": decision.value, "verdict": verdict.kind.value,
                 "code": verdict.code, "reason": verdict.reason},
    ), now=now)
    return Decided(approval_id=approval_id, verdict=verdict)
