"""The memory page: what the agent learnt about the user and what they told it to keep, with their hand on it
(`server.memory`, through the same views as `/v1/memory` and `wakeful memory`: `faces.memory_views`).

    GET  /memory?show=pending|review|active|all   records, newest first: what waits for the user first
    GET  /memory/{id}                             one record: versions, who said it, evidence, what derives from it,
                                                  the runs that recalled it, its changes
    POST /memory/{id}/confirm|reject|forget|reviewed|correct   → back to the record
"""

from __future__ import annotations

from typing import Annotated, Final

from fastapi import Path, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from wakeful.server.errors import BadRequest, NotFound
from wakeful.server.faces import memory_views
from wakeful.server.faces.console.web import Form, Me, Posted, console_router, page
from wakeful.server.store.db import read, write

__all__ = ["OPERATIONS", "SHOWS", "router"]

router = console_router()
MemoryId = Annotated[str, Path(max_length=40, pattern=r"^[A-Za-z0-9_-]+$")]
SHOWS: Final[dict[str, tuple[str | None, bool | None]]] = {
    "pending": ("pending", None), "review": (None, True), "active": ("active", None), "all": (None, None)}
"""The page's views as (state, review): what waits for the user, what the system retired without them, what is in
force, everything."""
_ANSWER: Final = {"confirm": memory_views.confirm, "reject": memory_views.reject, "reviewed": memory_views.reviewed}
OPERATIONS: Final = (*_ANSWER, "forget", "correct")
PAGE: Final = 100


@router.get("/memory")
def listing(request: Request, me: Me, show: Annotated[str, Query(max_length=10)] = "pending") -> HTMLResponse:
    if show not in SHOWS:
        raise BadRequest("invalid_parameter", f"show one of: {', '.join(SHOWS)}")
    with read(me.rt.engine) as conn:
        state, review = SHOWS[show]
        shown = memory_views.page(conn, me.user_id, form=None, state=state, review=review, task_id=None, after=None,
                                  limit=PAGE)
    return page(request, "memory.html", me=me, show=show, shows=list(SHOWS), records=shown["records"],
                more=shown["next"] is not None)


@router.get("/memory/{memory_id}")
def record(request: Request, me: Me, memory_id: MemoryId) -> HTMLResponse:
    with read(me.rt.engine) as conn:
        shown = memory_views.detail(conn, me.user_id, memory_id)
    return page(request, "memory_record.html", me=me, **shown)


@router.post("/memory/{memory_id}/{operation}")
def change(me: Posted, form: Form, memory_id: MemoryId, operation: Annotated[str, Path(max_length=10)]) -> Response:
    if operation not in OPERATIONS:
        raise NotFound("unknown_operation", f"memory has no button {operation!r}; one of: {', '.join(OPERATIONS)}")
    reason, text = form.get("reason", "").strip()[:2000], form.get("text", "").strip()[:2000]
    if operation in ("forget", "correct") and not reason:
        raise BadRequest("invalid_memory", f"say why you {operation} it: the reason is kept with the change")
    now = me.rt.clock.now()
    with write(me.rt.engine) as conn:
        if operation == "correct":  # the corrected record, retired, shows what the correction reached
            memory_views.correct(conn, me.user_id, memory_id, reason=reason, text=text or None, now=now)
            return RedirectResponse(f"/memory/{memory_id}", status_code=303)
        if operation == "forget":
            answer = memory_views.forget(conn, me.user_id, memory_id, reason=reason, now=now)
        else:
            answer = _ANSWER[operation](conn, me.user_id, memory_id, now=now)
    return RedirectResponse(f"/memory/{answer['memory_id']}", status_code=303)  # a confirmation is a new version
