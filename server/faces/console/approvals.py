"""Approval cards: each rendered by the server from the immutable action and the recorded facts, decided through
the same function as `POST /v1/actions/{id}/approve|deny` (`acting.approvals.decide`).

    GET  /approvals                   the actions waiting for the user, the longest waiting first
    GET  /approvals/{action_id}       the card: what, to whom, amount against limits, the policy's verdict now,
                                      the approval's validity, the content hash
    POST /approvals/{action_id}/approve|deny   → the result page (re-admitted now: a paused task refuses)
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Path, Request
from fastapi.responses import HTMLResponse
from sqlalchemy import Connection, select

from wakeful.server.acting.actions import load_action
from wakeful.server.acting.admission import admit
from wakeful.server.acting.verdicts import gather_facts, render_card
from wakeful.server.faces import listing, routes
from wakeful.server.faces.console.web import Form, Me, Posted, console_router, page
from wakeful.server.runtime import Runtime
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import tasks, verdicts

__all__ = ["card_of", "router"]

router = console_router()
ActionId = Annotated[str, Path(max_length=40, pattern=r"^[A-Za-z0-9_-]+$")]


@router.get("/approvals")
def pending(request: Request, me: Me) -> HTMLResponse:
    with read(me.rt.engine) as conn:
        rows = listing.pending_approvals(conn, user_id=me.user_id, limit=200)
    return page(request, "approvals.html", me=me, pending=rows)


def card_of(conn: Connection, rt: Runtime, *, user_id: str, action_id: str) -> dict[str, Any]:
    """Everything the card shows, from the action's immutable content and the records as they are now."""
    action = load_action(conn, action_id, user_id=user_id)
    facts = gather_facts(conn, action, policy=rt.policy, now=rt.clock.now())
    card = render_card(action, facts, policy=rt.policy)
    now_says = admit(facts)
    latest = conn.execute(select(verdicts).where(verdicts.c.action_id == action.id)
                          .order_by(verdicts.c.created_at.desc(), verdicts.c.id.desc()).limit(1)).first()
    title = conn.execute(select(tasks.c.title).where(tasks.c.id == action.task_id)).scalar()
    request = action.content.get("request", {})
    return {
        "action": action, "card": card, "task_title": title,
        "to": request.get("url"), "method": request.get("method"),
        "amount": None if action.amount_cents is None else f"{action.amount_cents / 100:.2f} {action.currency or ''}",
        "limits": {"per_action": facts.budgets.per_action_cents, "task_total": facts.budgets.task_total_cents,
                   "daily": facts.budgets.daily_cents, "spent_task": facts.spent_task_cents,
                   "spent_today": facts.spent_today_cents,
                   "task_limit": action.content.get("constraints", {}).get("max_amount_cents")},
        "pending": latest is not None and latest.verdict == "needs_approval",
        "recorded": None if latest is None else {"verdict": latest.verdict, "code": latest.code,
                                                 "reasons": json.loads(latest.reasons)},
        "now": {"verdict": now_says.kind.value, "code": now_says.code, "reason": now_says.reason,
                "refuses": now_says.kind.value == "refused"},
        "expires": facts.objects_problem,
    }


@router.get("/approvals/{action_id}")
def card(request: Request, me: Me, action_id: ActionId) -> HTMLResponse:
    with write(me.rt.engine) as conn:  # gathering facts locks the task, as admission does
        shown = card_of(conn, me.rt, user_id=me.user_id, action_id=action_id)
    return page(request, "card.html", me=me, **shown)


@router.post("/approvals/{action_id}/{decision}")
def decide(request: Request, me: Posted, form: Form, action_id: ActionId,
           decision: Annotated[str, Path(max_length=10)]) -> HTMLResponse:
    answer = routes.decide(me.user_id, me.rt, action_id, decision, routes.ControlIn(reason=form.get("reason", "")))
    return page(request, "decided.html", me=me, action_id=action_id, decision=decision, answer=answer)
