"""The user's control channel over HTTP (bearer token): tasks, approvals, STOP, the ledger, the message feed.

    POST /v1/control/stop|start                 STOP / START for the caller
    POST /v1/control/everything/stop|start      STOP / START over the whole deployment: admins only
    GET  /v1/control
    POST /v1/tasks                              delegate: title, goal, constraints, completion conditions, keys
    POST /v1/tasks/{id}/steer                   a new task version
    POST /v1/tasks/{id}/steers/{steer}/confirm|reject   answer a steer the agent proposed (it asked for more)
    POST /v1/tasks/{id}/messages                the user's chat about the task: holds it until a run reads it
    POST /v1/tasks/{id}/pause|resume|revoke|close|reopen
    GET  /v1/tasks/{id}                         status: the four facts, waits, actions with verdicts and outcomes
    GET  /v1/tasks/{id}/ledger                  the whole history in order
    GET  /v1/actions/{id}                       the action and its approval card
    POST /v1/actions/{id}/approve|deny
    GET  /v1/events/{id}, /v1/messages          the feed: ?after=SEQ in feed order, or newest first by cursor
    GET|PUT /v1/preferences                     time zone, quiet hours, daily attention budget
    GET  /v1/egress                             the egress proxy's audit of the caller's requests

Every write wakes the runtime's loops (`Signals.wake_all`, as MCP writes and `POST /v1/wake` do), so what it
gave them to do starts now rather than at their next idle poll.

Every query is filtered by the token's user: another user's records answer 404, never their contents. Nothing
here is reachable by a model: MCP tools and run handlers have no route to control state, and an agent credential is
refused here with 403 `user_credential_required` (`server.faces.auth`), reads included.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, Field
from sqlalchemy import and_, select

from wakeful.server.acting import approvals, ledger
from wakeful.server.acting.actions import load_action
from wakeful.server.acting.connectors import Registry
from wakeful.server.acting.verdicts import gather_facts, render_card
from wakeful.server.core import control, holds, sessions, speaking, steers
from wakeful.server.core import outbox as outbox_core
from wakeful.server.core.keys import MAX_KEYS
from wakeful.server.egress import grants as egress
from wakeful.server.errors import BadRequest, NotFound, Refused
from wakeful.server.faces import listing
from wakeful.server.faces.auth import User, current_user
from wakeful.server.faces.pages import Cursor, Limit, decode_cursor, encode_cursor
from wakeful.server.faces.schemas import (
    ActionView,
    Decision,
    EgressPage,
    EventView,
    Ledger,
    MessagePage,
    MessageRecorded,
    PreferencesView,
    SteerDecision,
    StopAnswer,
    StopRecorded,
    TaskCreated,
    TaskPage,
    TaskStateAnswer,
    TaskStatus,
    TaskVersionAnswer,
    refusals,
)
from wakeful.server.runtime import Runtime
from wakeful.server.store import users
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, TaskState, events, outbox
from wakeful.server.tools.layer import Completion
from wakeful.server.tools.specs import Constraints

__all__ = ["ControlIn", "decide", "router", "set_everything_stop", "set_stop", "transition"]

router = APIRouter(dependencies=[Depends(current_user)])
"""Every route here is the user's: the router itself asks for a user credential (an agent's is 403
`user_credential_required`), so a route added without the `User` parameter is guarded all the same."""


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


Rt = Annotated[Runtime, Depends(_runtime)]
After = Annotated[int | None, Query(ge=0, le=2**62, description="the `after` of the previous answer; 0 at first")]

TASK_OPERATIONS = {k.value: k for k in (ControlKind.PAUSE, ControlKind.RESUME, ControlKind.REVOKE, ControlKind.CLOSE,
                                        ControlKind.REOPEN)}
TaskOperation = Annotated[str, Path(json_schema_extra={"enum": list(TASK_OPERATIONS)})]
ActionDecision = Annotated[str, Path(json_schema_extra={"enum": ["approve", "deny"]})]
SteerAnswer = Annotated[str, Path(json_schema_extra={"enum": ["confirm", "reject"]})]


class TaskIn(BaseModel):
    model_config = {"extra": "forbid"}
    title: str = Field(min_length=1, max_length=2000)
    goal: str | None = Field(default=None, max_length=4000)
    constraints: Constraints
    completion: list[Completion] = Field(default_factory=list)
    keys: list[str] = Field(default_factory=list, max_length=MAX_KEYS,
                            description="Correlation keys of the task (a PNR, an order number, a mail thread ID): a "
                                        "delivery carrying one wakes this task")


class SteerIn(BaseModel):
    model_config = {"extra": "forbid"}
    goal: str = Field(min_length=1, max_length=4000)
    constraints: Constraints
    completion: list[Completion] = Field(default_factory=list)


class MessageIn(BaseModel):
    model_config = {"extra": "forbid"}
    text: str = Field(min_length=1, max_length=4000)


class ControlIn(BaseModel):
    reason: str = Field(default="", max_length=2000)


def check_completion(registry: Registry, completion: list[Completion]) -> list[dict[str, Any]]:
    """Completion conditions must name declared tools: a write as the effect, a read to verify it."""
    for condition in completion:
        if registry.operation(condition.effect).effect != "write":
            raise BadRequest("invalid_completion", f"{condition.effect} is not a write tool")
        if condition.verify is not None and registry.operation(condition.verify.read).effect != "read":
            raise BadRequest("invalid_completion", f"{condition.verify.read} is not a read tool")
    return [c.model_dump(by_alias=True, exclude_none=True) for c in completion]


@router.post("/v1/control/stop", response_model=StopRecorded, response_model_exclude_unset=True)
def stop(user: User, rt: Rt, body: ControlIn | None = None) -> dict[str, Any]:
    return set_stop(user, rt, stopped=True, reason=body.reason if body else "")


@router.post("/v1/control/start", response_model=StopRecorded, response_model_exclude_unset=True)
def start(user: User, rt: Rt, body: ControlIn | None = None) -> dict[str, Any]:
    return set_stop(user, rt, stopped=False, reason=body.reason if body else "")


def set_stop(user: str, rt: Runtime, *, stopped: bool, reason: str) -> dict[str, Any]:
    """Record the caller's STOP or START and answer what is true afterwards: a START does not lift a STOP over
    everything, which only an admin (`set_everything_stop`) or the operator (`wakeful start`) records."""
    with write(rt.engine) as conn:
        record = control.set_stop(conn, stopped=stopped, user_id=user, actor=f"user:{user}", reason=reason,
                                  now=rt.clock.now())
        state = control.stop_state(conn)
    rt.signals.wake_all()
    answer: dict[str, Any] = {"stopped": state.blocks(user), "global_stop": state.everything, "record_id": record}
    if not stopped and state.everything:
        answer["note"] = "your START is recorded, but a STOP over everything is in force: nothing goes out until " \
                         "an admin lifts it (on the console's home page, or `wakeful start`)"
    return answer


@router.post("/v1/control/everything/stop", response_model=StopRecorded, response_model_exclude_unset=True,
             responses=refusals("admin_required"))
def stop_everything(user: User, rt: Rt, body: ControlIn | None = None) -> dict[str, Any]:
    return set_everything_stop(user, rt, stopped=True, reason=body.reason if body else "")


@router.post("/v1/control/everything/start", response_model=StopRecorded, response_model_exclude_unset=True,
             responses=refusals("admin_required"))
def start_everything(user: User, rt: Rt, body: ControlIn | None = None) -> dict[str, Any]:
    return set_everything_stop(user, rt, stopped=False, reason=body.reason if body else "")


def set_everything_stop(user: str, rt: Runtime, *, stopped: bool, reason: str) -> dict[str, Any]:
    """An admin's STOP or START over the whole deployment (what `wakeful stop` without `--user` records); anyone
    else is refused `admin_required`. Answers what is true for the caller afterwards."""
    with write(rt.engine) as conn:
        if not users.is_admin(conn, user):
            raise Refused("admin_required", "only an admin stops or starts the whole deployment; your own STOP / "
                                            "START is on the home page")
        record = control.set_stop(conn, stopped=stopped, user_id=None, actor=f"admin:{user}", reason=reason,
                                  now=rt.clock.now())
        state = control.stop_state(conn)
    rt.signals.wake_all()
    return {"stopped": state.blocks(user), "global_stop": state.everything, "record_id": record}


@router.get("/v1/control", response_model=StopAnswer)
def control_state(user: User, rt: Rt) -> dict[str, Any]:
    with read(rt.engine) as conn:
        state = control.stop_state(conn)
    return {"stopped": state.blocks(user), "global_stop": state.everything}


@router.post("/v1/tasks", status_code=201, response_model=TaskCreated,
             responses=refusals("invalid_completion", "unknown_tool", "invalid_task_key", "task_key_taken"))
def create_task(user: User, rt: Rt, body: TaskIn) -> dict[str, Any]:
    completion = check_completion(rt.registry, body.completion)
    now = rt.clock.now()
    with write(rt.engine) as conn:
        session_id = sessions.create_session(conn, user_id=user, now=now)
        task_id = control.create_task(conn, user_id=user, session_id=session_id, title=body.title, now=now,
                                      goal=body.goal, constraints=body.constraints, completion=completion,
                                      actor=f"user:{user}", task_keys=body.keys)
    rt.signals.wake_all()  # the delegation is the task's first event: its run starts now, not at the next poll
    return {"task_id": task_id, "session_id": session_id, "version": 1}


@router.post("/v1/tasks/{task_id}/steer", response_model=TaskVersionAnswer,
             responses=refusals("invalid_completion", "unknown_tool", "unknown_task", "invalid_transition"))
def steer(user: User, rt: Rt, task_id: str, body: SteerIn) -> dict[str, Any]:
    completion = check_completion(rt.registry, body.completion)
    with write(rt.engine) as conn:
        version = control.steer(conn, user_id=user, task_id=task_id, goal=body.goal, constraints=body.constraints,
                                completion=completion, actor=f"user:{user}", now=rt.clock.now())
    rt.signals.wake_all()
    return {"task_id": task_id, "version": version}


@router.post("/v1/tasks/{task_id}/steers/{steer_id}/{decision}", response_model=SteerDecision,
             responses=refusals("unknown_steer", "unknown_operation", "not_awaiting_user", "invalid_transition"))
def decide_steer(user: User, rt: Rt, task_id: str, steer_id: str, decision: SteerAnswer) -> dict[str, Any]:
    """The user's answer to a steer the agent proposed: confirmed, it becomes the task's next version."""
    if decision not in ("confirm", "reject"):
        raise NotFound("unknown_operation", f"proposed steers have no operation {decision!r}; confirm or reject")
    answer = steers.confirm if decision == "confirm" else steers.reject
    with write(rt.engine) as conn:
        decided = answer(conn, user_id=user, steer_id=steer_id, task_id=task_id, actor=f"user:{user}",
                         now=rt.clock.now())
    rt.signals.wake_all()
    return {"steer_id": steer_id, "task_id": task_id, "state": decided.state.value, "version": decided.version}


@router.post("/v1/tasks/{task_id}/messages", status_code=201, response_model=MessageRecorded,
             responses=refusals("unknown_task", "invalid_transition"))
def say(user: User, rt: Rt, task_id: str, body: MessageIn) -> dict[str, Any]:
    """The user writes about a task (their token only: the agent has no route here). The task is held and the
    message recorded in one transaction; a run in progress stops at its next step, and the next run reads it."""
    with write(rt.engine) as conn:
        said = holds.say(conn, user_id=user, task_id=task_id, text=body.text, actor=f"user:{user}",
                         now=rt.clock.now())
    rt.signals.wake_all()
    return {"task_id": task_id, "event_id": said.event_id, "state": said.state.value}


def transition(rt: Runtime, user: str, task_id: str, kind: ControlKind, reason: str) -> dict[str, Any]:
    with write(rt.engine) as conn:
        state = control.set_task_state(conn, user_id=user, task_id=task_id, kind=kind, actor=f"user:{user}",
                                       reason=reason, now=rt.clock.now())
    rt.signals.wake_all()
    return {"task_id": task_id, "state": state.value}


@router.post("/v1/tasks/{task_id}/{operation}", response_model=TaskStateAnswer,
             responses=refusals("unknown_task", "unknown_operation", "invalid_transition"))
def task_control(user: User, rt: Rt, task_id: str, operation: TaskOperation,
                 body: ControlIn | None = None) -> dict[str, Any]:
    if operation not in TASK_OPERATIONS:
        raise NotFound("unknown_operation",
                       f"tasks have no operation {operation!r}; one of: {', '.join(TASK_OPERATIONS)}")
    return transition(rt, user, task_id, TASK_OPERATIONS[operation], body.reason if body else "")


@router.get("/v1/tasks", response_model=TaskPage, responses=refusals("bad_cursor"))
def list_tasks(user: User, rt: Rt, limit: Limit = 100, cursor: Cursor = None,
               state: TaskState | None = None) -> dict[str, Any]:
    """The caller's delegations, newest first (the console's task list, as JSON)."""
    with read(rt.engine) as conn:
        page = listing.tasks_page(conn, user_id=user, cursor=cursor, state=state, limit=limit)
    return {"tasks": [{"task_id": t["id"], "title": t["title"], "state": t["state"], "version": t["current_version"],
                       "created_at": t["created_at"].isoformat()} for t in page.rows], "next": page.next}


@router.get("/v1/tasks/{task_id}", response_model=TaskStatus, responses=refusals("unknown_task"))
def task_status(user: User, rt: Rt, task_id: str) -> dict[str, Any]:
    with read(rt.engine) as conn:
        return ledger.task_status(conn, user_id=user, task_id=task_id)


@router.get("/v1/tasks/{task_id}/ledger", response_model=Ledger, responses=refusals("unknown_task"))
def task_ledger(user: User, rt: Rt, task_id: str) -> dict[str, Any]:
    with read(rt.engine) as conn:
        return {"task_id": task_id, "entries": ledger.entries(conn, task_id=task_id, user_id=user)}


@router.get("/v1/actions/{action_id}", response_model=ActionView, responses=refusals("unknown_action"))
def get_action(user: User, rt: Rt, action_id: str) -> dict[str, Any]:
    with write(rt.engine) as conn:  # gathering facts locks the task, as admission does
        action = load_action(conn, action_id, user_id=user)
        facts = gather_facts(conn, action, policy=rt.policy, now=rt.clock.now())
    return {"action_id": action.id, "tool": action.tool, "content_hash": action.content_hash,
            "content": action.content, "card": render_card(action, facts, policy=rt.policy)}


@router.post("/v1/actions/{action_id}/{decision}", response_model=Decision,
             responses=refusals("unknown_action", "unknown_operation", "not_awaiting_approval"))
def decide(user: User, rt: Rt, action_id: str, decision: ActionDecision,
           body: ControlIn | None = None) -> dict[str, Any]:
    if decision not in ("approve", "deny"):
        raise NotFound("unknown_operation", f"actions have no operation {decision!r}; approve or deny")
    with write(rt.engine) as conn:
        decided = approvals.decide(conn, user_id=user, action_id=action_id, approve=decision == "approve",
                                   actor=f"user:{user}", policy=rt.policy, now=rt.clock.now(),
                                   reason=body.reason if body else "")
    rt.signals.wake_all()
    return {"action_id": action_id, "approval_id": decided.approval_id, "verdict": decided.verdict.kind.value,
            "code": decided.verdict.code, "reason": decided.verdict.reason}


@router.get("/v1/events/{event_id}", response_model=EventView, responses=refusals("unknown_event"))
def get_event(user: User, rt: Rt, event_id: str) -> dict[str, Any]:
    with read(rt.engine) as conn:
        row = conn.execute(select(events).where(and_(events.c.id == event_id, events.c.user_id == user))).first()
    if row is None:
        raise NotFound("unknown_event", f"no event {event_id} for this user", event_id=event_id)
    return {"event_id": row.id, "source": row.source, "source_id": row.source_id, "session_id": row.session_id,
            "status": row.status, "attempts": row.attempts, "run_id": row.run_id,
            "received_at": row.received_at.isoformat()}


@router.get("/v1/messages", response_model=MessagePage, response_model_exclude_unset=True,
            responses=refusals("bad_cursor"))
def messages(user: User, rt: Rt, limit: Limit = 100, cursor: Cursor = None, after: After = None) -> dict[str, Any]:
    """The messages to the user: with `after=SEQ`, those the user was sent after SEQ in feed order (poll with the
    answer's `after`: none is missed or repeated); else every message, held ones too, newest first, by cursor."""
    query = select(outbox).where(and_(outbox.c.user_id == user, outbox.c.kind == "user_message"))
    if after is not None:
        if cursor is not None:
            raise BadRequest("invalid_parameter", "pass `after` or `cursor`, not both")
        with read(rt.engine) as conn:
            rows = conn.execute(query.where(outbox.c.seq > after).order_by(outbox.c.seq).limit(limit)).all()
        return {"messages": [_message(r, rt.settings.base_url) for r in rows], "next": None,
                "after": rows[-1].seq if rows else after}
    before = decode_cursor(cursor, parts=1)
    if before is not None:
        query = query.where(outbox.c.id < before[0])
    with read(rt.engine) as conn:
        rows = conn.execute(query.order_by(outbox.c.id.desc()).limit(limit + 1)).all()
    page = rows[:limit]
    return {"messages": [_message(r, rt.settings.base_url) for r in page],
            "next": encode_cursor([page[-1].id]) if len(rows) > limit else None}


def _message(row: Any, base_url: str) -> dict[str, Any]:
    return {"id": row.id, "seq": row.seq, "state": row.state, "created_at": row.created_at.isoformat(),
            "body": outbox_core.linked(json.loads(row.body), base_url), "gate": row.gate,
            "summary_id": row.summary_id,
            "held_until": row.held_until.isoformat() if row.held_until else None}


@router.get("/v1/egress", response_model=EgressPage, responses=refusals("bad_cursor"))
def egress_audit(user: User, rt: Rt, limit: Limit = 100, cursor: Cursor = None,
                 verdict: Literal["allow", "refuse"] | None = None) -> dict[str, Any]:
    """What the egress proxy did with this user's requests, newest first (never headers, bodies or queries)."""
    after = decode_cursor(cursor, parts=2)
    with read(rt.engine) as conn:
        rows = egress.audit_rows(conn, user_id=user, limit=limit + 1, verdict=verdict,
                                 before=(after[0], after[1]) if after else None)
    page = list(rows[:limit])
    return {"requests": page,
            "next": encode_cursor([page[-1]["at"], page[-1]["request_id"]]) if len(rows) > limit else None}


class QuietHoursIn(BaseModel):
    model_config = {"extra": "forbid"}
    start: str = Field(pattern=speaking.HH_MM, description="local time, HH:MM (24-hour)")
    end: str = Field(pattern=speaking.HH_MM, description="local time, HH:MM; before `start`: they cross midnight")


class PreferencesIn(BaseModel):
    """A field left out keeps its value; `null` clears quiet hours or the budget."""

    model_config = {"extra": "forbid"}
    timezone: str = Field(default="UTC", max_length=64, description="IANA name, e.g. Asia/Hong_Kong")
    quiet_hours: QuietHoursIn | None = None
    attention_budget: int | None = Field(default=None, ge=0, le=1000, strict=True, description="messages per local day")


@router.get("/v1/preferences", response_model=PreferencesView)
def get_preferences(user: User, rt: Rt) -> dict[str, Any]:
    with read(rt.engine) as conn:
        return speaking.describe(speaking.preferences(conn, user))


@router.put("/v1/preferences", response_model=PreferencesView,
            responses=refusals("unknown_timezone", "invalid_quiet_hours"))
def put_preferences(user: User, rt: Rt, body: PreferencesIn) -> dict[str, Any]:
    """The user's time zone, quiet hours and daily attention budget: control state, so only this channel sets it."""
    changes = {name: getattr(body, name) for name in body.model_fields_set}
    if body.quiet_hours is not None:
        changes["quiet_hours"] = speaking.QuietHours.parse(body.quiet_hours.start, body.quiet_hours.end)
    with write(rt.engine) as conn:
        return speaking.describe(speaking.change_preferences(conn, user_id=user, changes=changes))
