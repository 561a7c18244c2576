"""From an immutable action to a recorded verdict: gather the facts, admit, and act on the verdict — in the
caller's transaction, which checks the run's fencing token (or is the user's control channel).

    admitted        → the approval (if any) is consumed and a dispatch intent joins the outbox
    needs approval  → an approval wait is registered (once) and the user gets a card rendered from the content
    refused         → recorded with its code; nothing leaves
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, func, select

from wakeful.server.acting import approval_links
from wakeful.server.acting.actions import Action
from wakeful.server.acting.admission import ApprovalFacts, Facts, Verdict, admit
from wakeful.server.acting.leave import LeaveFacts
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control, outbox, waits
from wakeful.server.core.speaking import Level
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import (
    ApprovalDecision,
    Authority,
    OutboxKind,
    Outcome,
    Risk,
    TaskState,
    VerdictKind,
    actions,
    approval_uses,
    approvals,
    attempts,
    objects,
    tasks,
    verdicts,
)
from wakeful.server.store.tables import (
    waits as waits_table,
)

__all__ = ["admit_and_record", "approval_key", "gather_facts", "leave_facts", "lock_task", "objects_problem",
           "render_card", "verdict_status"]


def approval_key(action_id: str) -> str:
    return f"approval:{action_id}"


def lock_task(conn: Connection, task_id: str) -> Any:
    """The task's row, locked: pause, approve, revoke and dispatch all serialize here."""
    return conn.execute(select(tasks).where(tasks.c.id == task_id).with_for_update()).one()


def objects_problem(conn: Connection, action: Action, now: datetime) -> tuple[str, str] | None:
    for name, object_id in sorted(action.content.get("objects", {}).items()):
        row = conn.execute(select(objects.c.expires_at, objects.c.snapshot).where(objects.c.id == object_id)).first()
        if row is None:
            return "unknown_object", f"{name}: {object_id} was never issued"
        if row.expires_at <= now:
            return "unknown_object", f"{name}: {object_id} expired at {row.expires_at.isoformat()}"
        quote_expiry = json.loads(row.snapshot).get("expires_at")
        if isinstance(quote_expiry, str) and datetime.fromisoformat(quote_expiry) <= now:
            return "quote_expired", f"{name}: the quote expired at {quote_expiry}"
    return None


def leave_facts(conn: Connection, action: Action, *, task: Any, now: datetime,
                attempt: tuple[str, str | None] | None = None) -> LeaveFacts:
    """What `leave_check` needs to know about sending `action` now; `task` is its task's row (locked by the
    dispatcher, read by the egress decider)."""
    return LeaveFacts(stopped=control.stop_state(conn).blocks(action.user_id), task_state=TaskState(task.state),
                      current_version=task.current_version, action_version=action.task_version,
                      objects_problem=objects_problem(conn, action, now), attempt=attempt)


def _spent(conn: Connection, *, where: Any) -> int:
    """Money committed by admitted actions that were not certainly blocked."""
    admitted = select(verdicts.c.action_id).where(verdicts.c.verdict == VerdictKind.ADMITTED.value)
    blocked = select(attempts.c.action_id).where(attempts.c.outcome == Outcome.BLOCKED.value)
    total = conn.execute(select(func.coalesce(func.sum(actions.c.amount_cents), 0)).where(
        and_(where, actions.c.id.in_(admitted), actions.c.id.not_in(blocked)))).scalar_one()
    return int(total)


def _latest_approval(conn: Connection, action: Action) -> ApprovalFacts | None:
    row = conn.execute(select(approvals).where(approvals.c.action_id == action.id)
                       .order_by(approvals.c.created_at.desc(), approvals.c.id.desc()).limit(1)).first()
    if row is None:
        return None
    used = conn.execute(select(approval_uses.c.approval_id).where(approval_uses.c.approval_id == row.id)).first()
    return ApprovalFacts(id=row.id, decision=ApprovalDecision(row.decision), approver=row.approver,
                         content_hash=row.content_hash, task_version=row.task_version, valid_until=row.valid_until,
                         amount_ceiling_cents=row.amount_ceiling_cents, used=used is not None)


def gather_facts(conn: Connection, action: Action, *, policy: Policy, now: datetime) -> Facts:
    task = lock_task(conn, action.task_id)
    day_start = now.replace(hour=0, minute=0, second=0, microsecond=0)
    risk, rule = policy.tier(action.tool, Risk(action.risk), action.amount_cents)
    return Facts(
        now=now, stopped=control.stop_state(conn).blocks(action.user_id), task_state=TaskState(task.state),
        current_version=task.current_version, action_version=action.task_version, content_hash=action.content_hash,
        risk=risk, auto_rule=rule, amount_cents=action.amount_cents,
        objects_problem=objects_problem(conn, action, now), budgets=policy.budgets,
        spent_task_cents=_spent(conn, where=and_(actions.c.task_id == action.task_id, actions.c.id != action.id)),
        spent_today_cents=_spent(conn, where=and_(actions.c.user_id == action.user_id, actions.c.id != action.id,
                                                  actions.c.created_at >= day_start)),
        approval=_latest_approval(conn, action),
    )


def admit_and_record(conn: Connection, action: Action, *, policy: Policy, now: datetime,
                     session_id: str) -> Verdict:
    facts = gather_facts(conn, action, policy=policy, now=now)
    verdict = admit(facts)
    conn.execute(verdicts.insert().values(
        id=new_id("vrd"), action_id=action.id, verdict=verdict.kind.value, code=verdict.code,
        reasons=json.dumps([{"check": c.name, "ok": c.ok, "detail": c.detail} for c in verdict.checks]),
        approver=verdict.approver, approval_id=verdict.approval_id, created_at=now,
    ))
    if verdict.kind is VerdictKind.ADMITTED:
        if verdict.approval_id is not None:
            conn.execute(approval_uses.insert().values(approval_id=verdict.approval_id, action_id=action.id,
                                                       used_at=now))
        outbox.enqueue(conn, user_id=action.user_id, kind=OutboxKind.DISPATCH, session_id=session_id,
                       run_id=action.run_id, now=now, message_id=f"dsp_{action.id}",
                       body={"action_id": action.id})
    elif verdict.kind is VerdictKind.NEEDS_APPROVAL:
        already = conn.execute(select(waits_table.c.id).where(and_(
            waits_table.c.user_id == action.user_id, waits_table.c.match_key == approval_key(action.id)))).first()
        if already is None:
            waits.register(conn, user_id=action.user_id, session_id=session_id, match_key=approval_key(action.id),
                           kind="approval", authority=Authority.USER, deadline=now + policy.approval_ttl, now=now,
                           task_id=action.task_id)
            opens = approval_links.mint(conn, action, now=now, expires_at=now + policy.approval_ttl)
            outbox.enqueue(conn, user_id=action.user_id, session_id=session_id, run_id=action.run_id, now=now,
                           message_id=f"card_{action.id}", level=Level.ASK,
                           body={"kind": "approval_request", "card": render_card(action, facts, policy=policy),
                                 "open": opens})
    return verdict


def render_card(action: Action, facts: Facts, *, policy: Policy) -> dict[str, Any]:
    """What the user sees before approving, built only from the immutable action content and recorded facts."""
    content = action.content
    lines = [f"{content.get('description') or action.tool}"]
    for name, snapshot in sorted(content.get("snapshots", {}).items()):
        shown = ", ".join(f"{k}={v}" for k, v in sorted(snapshot.items()))
        lines.append(f"{name}: {shown}")
    if action.amount_cents is not None:
        lines.append(f"amount: {action.amount_cents / 100:.2f} {action.currency or ''}".rstrip())
    ceiling = content.get("constraints", {}).get("max_amount_cents")
    if isinstance(ceiling, int) and action.amount_cents is not None and ceiling > 0 and action.amount_cents > ceiling:
        lines.append(f"policy check: exceeds the task's limit of {ceiling / 100:.2f} by "
                     f"{(action.amount_cents - ceiling) * 100 // ceiling}%")
    request = content.get("request", {})
    lines.append(f"request: {request.get('method')} {request.get('url')}")
    return {
        "action_id": action.id, "content_hash": action.content_hash, "tool": action.tool, "lines": lines,
        "approve_with": f"wakeful approve {action.id}", "deny_with": f"wakeful deny {action.id}",
        "valid_for_seconds": int(policy.approval_ttl.total_seconds()),
        "budget": {"spent_task_cents": facts.spent_task_cents, "task_total_cents": policy.task_total_cents},
    }


def verdict_status(conn: Connection, action_id: str) -> dict[str, Any]:
    """What the latest verdict on an action says, as a tool result."""
    v = conn.execute(select(verdicts).where(verdicts.c.action_id == action_id)
                     .order_by(verdicts.c.created_at.desc(), verdicts.c.id.desc()).limit(1)).one()
    failed = [r for r in json.loads(v.reasons) if not r["ok"]]
    return {"action_id": action_id, "status": v.verdict, "code": v.code,
            "reason": failed[0]["detail"] if failed else "admitted: it will be sent by the dispatcher"}
