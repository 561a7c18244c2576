"""Helper tasks: a read-only sub-task (a comparison, some research) the agent hands to a run of its own.

    check_start     may this task start one more? (the task's state, the cap of open helpers per task; the run
                    that asks checks STOP, `core.worker.RunContext.start_helper`)
    start           the record, the helper's OWN session and its handoff event (authority system): the helper's run
                    starts from the handoff alone, never from the main conversation
    finish          running → returned | failed, and one event into the main task's session carrying the version the
                    handoff was based on (trust `helper`, authority `agent`: information, it satisfies no wait)
    stop_for_task   the task was paused, revoked or closed: running → stopped, and a preempting event in each
                    helper's session, so its run stops at its next step as any preempted run does

What a helper may call (read-only tools and `return_result`) is held by the tool layer and the harness
(`server.tools.layer`, `server.harness.helper_run`); the objects its reads mint are its own (`acting.objects`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, func, select, update

from wakeful.server.core import inbox, sessions
from wakeful.server.errors import NotFound, Refused
from wakeful.server.store.tables import (
    Authority,
    EventKind,
    HelperState,
    TaskState,
    helpers,
    task_versions,
    tasks,
)

__all__ = ["HANDOFF_SOURCE", "RESULT_SOURCE", "Helper", "check_start", "finish", "of_session", "start",
           "stop_for_task"]

HANDOFF_SOURCE = "helper_handoff"
RESULT_SOURCE = "helper"
STOP_SOURCE = "helper_stop"
READ_ONLY = "read-only: nothing is booked, bought, sent or changed"
"""The constraint every handoff carries, whatever the agent wrote."""


@dataclass(frozen=True, kw_only=True)
class Helper:
    id: str
    user_id: str
    task_id: str
    task_version: int
    parent_session_id: str
    session_id: str
    state: HelperState
    max_steps: int
    deadline: datetime


def of_session(conn: Connection, session_id: str | None) -> Helper | None:
    """The helper whose own session this is; None for every other session (and for calls with no session)."""
    if session_id is None:
        return None
    row = conn.execute(select(helpers).where(helpers.c.session_id == session_id)).first()
    if row is None:
        return None
    return Helper(id=row.id, user_id=row.user_id, task_id=row.task_id, task_version=row.task_version,
                  parent_session_id=row.parent_session_id, session_id=row.session_id, state=HelperState(row.state),
                  max_steps=row.max_steps, deadline=row.deadline)


def check_start(conn: Connection, *, user_id: str, task_id: str, cap: int) -> None:
    """Refuse a helper the task may not start now: unless the task is active, or past `cap` open ones."""
    state = conn.execute(select(tasks.c.state).where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id))).scalar()
    if state is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    if state != TaskState.ACTIVE.value:
        raise Refused(state, f"the task is {state}; it starts no helper until the user resumes it", task_id=task_id)
    running = conn.execute(select(func.count()).select_from(helpers).where(and_(
        helpers.c.task_id == task_id, helpers.c.state == HelperState.RUNNING.value))).scalar_one()
    if running >= cap:
        raise Refused("cap_exceeded", f"{running} helpers of this task are running (the cap is {cap}); wait for "
                      "one to return", cap=cap)


def start(conn: Connection, *, helper_id: str, user_id: str, task_id: str, task_version: int,
          parent_session_id: str, goal: str, constraints: Sequence[str], output_form: str, cap: int, max_steps: int,
          deadline: datetime, now: datetime) -> str:
    """Record a helper with a session of its own, and put its handoff there; returns the helper's session."""
    check_start(conn, user_id=user_id, task_id=task_id, cap=cap)
    version = conn.execute(select(task_versions).where(and_(task_versions.c.task_id == task_id,
                                                            task_versions.c.version == task_version))).one()
    session_id = sessions.create_session(conn, user_id=user_id, now=now)
    kept = [*constraints, READ_ONLY]
    conn.execute(helpers.insert().values(
        id=helper_id, user_id=user_id, task_id=task_id, task_version=task_version,
        parent_session_id=parent_session_id, session_id=session_id, goal=goal, constraints=json.dumps(kept),
        output_form=output_form, state=HelperState.RUNNING.value, max_steps=max_steps, deadline=deadline,
        created_at=now))
    handoff = {"helper_id": helper_id, "goal": goal, "constraints": kept, "output_form": output_form,
               "task": {"task_id": task_id, "version": task_version, "goal": version.goal,
                        "constraints": json.loads(version.constraints)},
               "deadline": deadline.isoformat(), "max_steps": max_steps}
    inbox.record(conn, inbox.Delivery(user_id=user_id, source=HANDOFF_SOURCE, source_id=helper_id,
                                      kind=EventKind.CONTROL, trust="agent", authority=Authority.SYSTEM,
                                      session_id=session_id, payload=handoff), now=now)
    return session_id


def finish(conn: Connection, helper: Helper, *, state: HelperState, now: datetime, result: Any = None,
           reason: str | None = None) -> bool:
    """running → `state` (returned or failed), with the event into the main task's session. False, and nothing
    recorded, when the helper is no longer running: it was stopped with its task while its run went on."""
    moved = conn.execute(update(helpers).where(and_(helpers.c.id == helper.id,
                                                    helpers.c.state == HelperState.RUNNING.value))
                         .values(state=state.value, reason=reason, finished_at=now)).rowcount
    if moved != 1:
        return False
    payload: dict[str, Any] = {"helper_id": helper.id, "based_on_version": helper.task_version}
    payload.update({"result": result} if state is HelperState.RETURNED else {"failed": reason})
    inbox.record(conn, inbox.Delivery(user_id=helper.user_id, source=RESULT_SOURCE, source_id=helper.id,
                                      kind=EventKind.CONTROL, trust="helper", authority=Authority.AGENT,
                                      session_id=helper.parent_session_id, payload=payload), now=now)
    return True


def stop_for_task(conn: Connection, *, task_id: str, reason: str, now: datetime) -> list[str]:
    """Stop every running helper of the task; returns their IDs."""
    stopped = conn.execute(update(helpers).where(and_(helpers.c.task_id == task_id,
                                                      helpers.c.state == HelperState.RUNNING.value))
                           .values(state=HelperState.STOPPED.value, reason=reason, finished_at=now)
                           .returning(helpers.c.id, helpers.c.user_id, helpers.c.session_id)).all()
    for row in stopped:
        inbox.record(conn, inbox.Delivery(user_id=row.user_id, source=STOP_SOURCE, source_id=row.id,
                                          kind=EventKind.CONTROL, trust="system", authority=Authority.SYSTEM,
                                          session_id=row.session_id, preempt=True,
                                          payload={"helper_id": row.id, "stopped": reason}), now=now)
    return [row.id for row in stopped]
