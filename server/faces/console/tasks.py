"""Tasks: the list, a page at a time, and one task with everything its records say.

    GET  /tasks?state=&cursor=         newest first
    GET  /tasks/{task_id}              versions (goal, constraints, completion conditions), the four facts with
                                       their times, evidence, waits, timers, actions with verdicts, attempts and
                                       outcomes, messages sent, approvals waiting
    POST /tasks/{task_id}/pause|resume|revoke|close   through the same function as `POST /v1/tasks/{id}/…`
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Path, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import Connection, and_, select

from wakeful.server.acting import ledger
from wakeful.server.core import control
from wakeful.server.errors import NotFound
from wakeful.server.faces import listing, routes
from wakeful.server.faces.console.web import Form, Me, Posted, console_router, page
from wakeful.server.store.db import read
from wakeful.server.store.tables import actions, attempts, evidence, outbox, task_versions

__all__ = ["router"]

router = console_router()
TaskId = Annotated[str, Path(max_length=40, pattern=r"^[A-Za-z0-9_-]+$")]
Filter = Annotated[str | None, Query(max_length=40, pattern=r"^[a-z_]*$")]
PageCursor = Annotated[str | None, Query(max_length=512)]
BUTTONS = ("pause", "resume", "revoke", "close")


@router.get("/tasks")
def task_list(request: Request, me: Me, state: Filter = None, cursor: PageCursor = None) -> HTMLResponse:
    with read(me.rt.engine) as conn:
        shown = listing.tasks_page(conn, user_id=me.user_id, cursor=cursor, state=state or None)
    return page(request, "tasks.html", me=me, page=shown, state=state or "")


def _details(conn: Connection, task_id: str, session_id: str) -> dict[str, Any]:
    versions = [{**dict(v._mapping), "constraints": json.loads(v.constraints), "completion": json.loads(v.completion)}
                for v in conn.execute(select(task_versions).where(task_versions.c.task_id == task_id)
                                      .order_by(task_versions.c.version.desc()).limit(20))]
    found = [dict(e._mapping) for e in conn.execute(
        select(evidence.c.source, evidence.c.verdict, evidence.c.action_id, evidence.c.checked_at)
        .where(evidence.c.task_id == task_id).order_by(evidence.c.checked_at.desc()).limit(50))]
    tried = [dict(a._mapping) for a in conn.execute(
        select(attempts.c.id, attempts.c.action_id, attempts.c.seq, attempts.c.outcome, attempts.c.created_at)
        .where(attempts.c.action_id.in_(select(actions.c.id).where(actions.c.task_id == task_id)))
        .order_by(attempts.c.created_at.desc()).limit(50))]
    sent = []
    for m in conn.execute(select(outbox.c.id, outbox.c.state, outbox.c.body, outbox.c.created_at)
                          .where(and_(outbox.c.session_id == session_id, outbox.c.kind == "user_message"))
                          .order_by(outbox.c.created_at.desc()).limit(50)):
        body = json.loads(m.body)
        sent.append({"id": m.id, "state": m.state, "at": m.created_at,
                     "text": str(body.get("text") or body.get("kind") or "")[:500]})
    return {"versions": versions, "evidence": found, "attempts": tried, "messages": sent}


@router.get("/tasks/{task_id}")
def task(request: Request, me: Me, task_id: TaskId) -> HTMLResponse:
    with read(me.rt.engine) as conn:
        status = ledger.task_status(conn, user_id=me.user_id, task_id=task_id)
        details = _details(conn, task_id, status["session_id"])
        waiting = listing.pending_approvals(conn, user_id=me.user_id, task_id=task_id)
    buttons = [kind.value for kind in control.operations_from(status["state"]) if kind.value in BUTTONS]
    return page(request, "task.html", me=me, task=status, waiting=waiting, buttons=buttons, **details)


@router.post("/tasks/{task_id}/{operation}")
def control_task(me: Posted, form: Form, task_id: TaskId,
                 operation: Annotated[str, Path(max_length=20)]) -> Response:
    if operation not in BUTTONS:
        raise NotFound("unknown_operation", f"tasks have no button {operation!r}; one of: {', '.join(BUTTONS)}")
    routes.transition(me.rt, me.user_id, task_id, routes.TASK_OPERATIONS[operation], form.get("reason", "")[:2000])
    return RedirectResponse(f"/tasks/{task_id}", status_code=303)
