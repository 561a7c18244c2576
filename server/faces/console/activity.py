"""Activity, like a durable-execution UI: events, runs, timers and the outbox, each filterable and a stable page at a
time; one run's history loaded a page of steps at a time (a run of 20,000 steps is 400 pages, never one); the egress
audit; and the handoff page, which leads to the live view where the user gives the screen back.

    GET  /activity?view=events|runs|timers|outbox&status=&source=&cursor=
    GET  /runs/{run_id}?cursor=          a page of the run's steps; `wakeful replay RUN` re-runs it from its records
    GET  /egress?verdict=&cursor=
    GET  /handoff                        handoff links the agent sent, and a view-only link on request
    POST /handoff/view                   → a one-time view-only live view (as `POST /v1/live/view`)
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Annotated, Literal

from fastapi import Path, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import and_, select

from wakeful.server.egress import grants as egress
from wakeful.server.errors import NotFound
from wakeful.server.faces import listing
from wakeful.server.faces.console.web import Me, Posted, console_router, page
from wakeful.server.faces.pages import decode_cursor, encode_cursor
from wakeful.server.store.db import read
from wakeful.server.store.tables import outbox

__all__ = ["router"]

router = console_router()
Filter = Annotated[str | None, Query(max_length=100, pattern=r"^[A-Za-z0-9_.:-]*$")]
PageCursor = Annotated[str | None, Query(max_length=512)]
View = Literal["events", "runs", "timers", "outbox"]


@router.get("/activity")
def activity(request: Request, me: Me, view: View = "events", status: Filter = None, source: Filter = None,
             cursor: PageCursor = None) -> HTMLResponse:
    with read(me.rt.engine) as conn:
        if view == "events":
            shown = listing.events_page(conn, user_id=me.user_id, cursor=cursor, source=source or None,
                                        status=status or None)
        elif view == "runs":
            shown = listing.runs_page(conn, user_id=me.user_id, cursor=cursor, outcome=status or None)
        elif view == "timers":
            shown = listing.timers_page(conn, user_id=me.user_id, cursor=cursor, state=status or None)
        else:
            shown = listing.outbox_page(conn, user_id=me.user_id, cursor=cursor, state=status or None)
    return page(request, "activity.html", me=me, view=view, page=shown, status=status or "", source=source or "")


@router.get("/runs/{run_id}")
def run(request: Request, me: Me, run_id: Annotated[str, Path(max_length=40, pattern=r"^[A-Za-z0-9_-]+$")],
        cursor: PageCursor = None) -> HTMLResponse:
    with read(me.rt.engine) as conn:
        found, steps = listing.run_history(conn, user_id=me.user_id, run_id=run_id, cursor=cursor)
    if found is None:
        raise NotFound("unknown_run", f"no run {run_id} for this user", run_id=run_id)
    return page(request, "run.html", me=me, run=found, page=steps)


@router.get("/egress")
def egress_audit(request: Request, me: Me, verdict: Literal["allow", "refuse"] | None = None,
                 cursor: PageCursor = None) -> HTMLResponse:
    after = decode_cursor(cursor, parts=2)
    with read(me.rt.engine) as conn:
        rows = egress.audit_rows(conn, user_id=me.user_id, limit=listing.PAGE + 1, verdict=verdict,
                                 before=(after[0], after[1]) if after else None)
    shown = list(rows[:listing.PAGE])
    following = encode_cursor([shown[-1]["at"], shown[-1]["request_id"]]) if len(rows) > listing.PAGE else None
    return page(request, "egress.html", me=me, rows=shown, next=following, verdict=verdict or "")


@router.get("/handoff")
def handoff(request: Request, me: Me) -> HTMLResponse:
    with read(me.rt.engine) as conn:
        sent = conn.execute(select(outbox.c.body, outbox.c.created_at).where(and_(
            outbox.c.user_id == me.user_id, outbox.c.kind == "user_message", outbox.c.body.like('%"handoff"%')))
            .order_by(outbox.c.created_at.desc()).limit(20)).all()
    offers = [{**json.loads(r.body), "at": r.created_at} for r in sent]
    offers = [o for o in offers if o.get("kind") == "handoff"]
    return page(request, "handoff.html", me=me, offers=offers, live=me.rt.live is not None)


@router.post("/handoff/view")
def view(me: Posted) -> Response:
    if me.rt.live is None:
        raise NotFound("no_tool_computer", "this server runs no tool computers, so there is no screen to watch")
    token, _ = me.rt.live.offer_view(me.user_id, timedelta(minutes=15))
    return RedirectResponse(f"/v1/live/{token}", status_code=303)
