"""The user's chat about a task, and the hold it puts on the task until a run has read it (principle 9).

    say            the user writes about a task (HTTP, the CLI). One transaction records the message as an event
                   that preempts the task's session (kind `message`, trust and authority `user`) and holds the task
                   (a `hold` control row naming the user and that event); a run in progress stops at its next step
    confirm_pause  the run that reads the message turns the hold into a pause: a narrowing, recorded as the agent's
    release_read   a run that read the message ended without confirming a pause: the system lifts the hold,
                   recorded with that run, and wakes the session so the work goes on. No tool lifts a hold

A held task is treated like a paused one: nothing is admitted, the dispatcher sends nothing new, its timers wait.
A run that failed or was interrupted, or ran out of budget, leaves the hold in place: better over-paused than a
pause missed. The user's own resume, pause, revoke or close settles a hold too (`control.set_task_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from sqlalchemy import Connection, and_, bindparam, select, update

from wakeful.server.core import control, inbox
from wakeful.server.errors import Conflict, NotFound, Refused
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import Authority, ControlKind, EventKind, EventStatus, TaskState, events, tasks
from wakeful.server.store.tables import control as control_table

__all__ = ["CHAT_SOURCE", "Held", "Said", "confirm_pause", "current_hold", "release_read", "say"]

CHAT_SOURCE: Final = "chat"
"""The source of the user's messages about a task."""


@dataclass(frozen=True, kw_only=True)
class Said:
    """A recorded message: its event, and the task's state afterwards (held, or paused when it already was)."""

    event_id: str
    task_id: str
    state: TaskState


@dataclass(frozen=True, kw_only=True)
class Held:
    """The hold a task is under: since when, by whom, for which message."""

    hold_id: str
    event_id: str
    held_by: str
    since: datetime


def say(conn: Connection, *, user_id: str, task_id: str, text: str, actor: str, now: datetime) -> Said:
    """The user's message about their task: recorded, and the task held, in the caller's transaction."""
    task = conn.execute(select(tasks.c.session_id, tasks.c.state)
                        .where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id)).with_for_update()).first()
    if task is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    if task.state in (TaskState.CLOSED.value, TaskState.REVOKED.value):
        raise Conflict("invalid_transition", f"task {task_id} is {task.state}; nobody works on it to read a message",
                       task_id=task_id, state=task.state)
    message = inbox.record(conn, inbox.Delivery(
        user_id=user_id, source=CHAT_SOURCE, source_id=new_id("msg"), kind=EventKind.MESSAGE, trust="user",
        authority=Authority.USER, session_id=task.session_id, preempt=True,
        payload={"task_id": task_id, "text": text}), now=now)
    if task.state == TaskState.PAUSED.value:  # already stopped: the message waits for the user's resume
        return Said(event_id=message.event_id, task_id=task_id, state=TaskState.PAUSED)
    # The same transaction commits the hold with the event: no run can see the message before the hold.
    moved = conn.execute(update(tasks).where(and_(tasks.c.id == task_id, tasks.c.state.in_(
        [TaskState.ACTIVE.value, TaskState.HELD.value]))).values(state=TaskState.HELD.value)).rowcount
    if moved != 1:
        raise Conflict("invalid_transition", f"task {task_id} moved on while the message was recorded",
                       task_id=task_id)
    control.record(conn, user_id=user_id, task_id=task_id, kind=ControlKind.HOLD, actor=actor,
                   reason="the user wrote about the task: nothing new goes out until a run has read it", now=now,
                   event_id=message.event_id)
    return Said(event_id=message.event_id, task_id=task_id, state=TaskState.HELD)


_LATEST_HOLD = (select(control_table.c.id, control_table.c.event_id, control_table.c.actor,
                       control_table.c.created_at)
                .where(control_table.c.kind == ControlKind.HOLD.value)
                .order_by(control_table.c.created_at.desc(), control_table.c.id.desc())
                .limit(1))


_STATE = select(tasks.c.state).where(tasks.c.id == bindparam("task_id"))


def current_hold(conn: Connection, *, task_id: str) -> Held | None:
    """The hold the task is under now (its latest message's); None unless the task is held."""
    state = conn.execute(_STATE, {"task_id": task_id}).scalar_one_or_none()
    if state != TaskState.HELD.value:
        return None
    row = conn.execute(_LATEST_HOLD.where(control_table.c.task_id == task_id)).one()
    return Held(hold_id=row.id, event_id=row.event_id, held_by=row.actor, since=row.created_at)


def confirm_pause(conn: Connection, *, user_id: str, task_id: str, run_id: str, reason: str, actor: str,
                  now: datetime) -> None:
    """The run read the user's message as "stop": the hold becomes a pause, which only the user resumes."""
    moved = conn.execute(update(tasks).where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id,
                                                  tasks.c.state == TaskState.HELD.value))
                         .values(state=TaskState.PAUSED.value)).rowcount
    if moved != 1:
        state = conn.execute(select(tasks.c.state).where(tasks.c.id == task_id)).scalar_one_or_none()
        raise Refused("not_held", f"the task is {state or 'unknown'}: a pause is confirmed only while the user's "
                                  "message holds the task; any other pause is the user's to make")
    hold = conn.execute(_LATEST_HOLD.where(control_table.c.task_id == task_id)).one()
    control.record(conn, user_id=user_id, task_id=task_id, kind=ControlKind.PAUSE, actor=actor,
                   reason=reason or "the agent read the user's message as a pause", now=now, event_id=hold.event_id,
                   run_id=run_id)


def release_read(conn: Connection, *, event_ids: Sequence[str], run_id: str, now: datetime) -> list[str]:
    """After a run that completed having read `event_ids`: lift the holds of the messages among them that it did not
    confirm as pauses, unless a message it did not read holds the task too. Returns the released tasks' IDs."""
    if not event_ids:
        return []
    read_holds = conn.execute(select(control_table.c.task_id, control_table.c.user_id, control_table.c.event_id)
                              .where(and_(control_table.c.kind == ControlKind.HOLD.value,
                                          control_table.c.event_id.in_(list(event_ids))))).all()
    released = []
    for task_id, user_id in sorted({(r.task_id, r.user_id) for r in read_holds}):
        unread = conn.execute(select(control_table.c.id).join(events, events.c.id == control_table.c.event_id).where(
            and_(control_table.c.task_id == task_id, control_table.c.kind == ControlKind.HOLD.value,
                 events.c.status == EventStatus.PENDING.value, events.c.id.not_in(list(event_ids)))).limit(1)).first()
        if unread is not None:  # a newer message holds it too: the run that reads that one decides
            continue
        session_id = conn.execute(update(tasks).where(and_(tasks.c.id == task_id,
                                                           tasks.c.state == TaskState.HELD.value))
                                  .values(state=TaskState.ACTIVE.value).returning(tasks.c.session_id)).scalar()
        if session_id is None:  # confirmed as a pause, or the user has decided since
            continue
        message = max(r.event_id for r in read_holds if r.task_id == task_id)
        reason = f"run {run_id} read the user's message and did not confirm a pause"
        record_id = control.record(conn, user_id=user_id, task_id=task_id, kind=ControlKind.RELEASE, actor="system",
                                   reason=reason, now=now, event_id=message, run_id=run_id)
        inbox.record(conn, inbox.Delivery(  # the work goes on: the next run may act again
            user_id=user_id, source="control", source_id=record_id, kind=EventKind.CONTROL, trust="system",
            authority=Authority.SYSTEM, session_id=session_id,
            payload={"control": ControlKind.RELEASE.value, "task_id": task_id, "reason": reason}), now=now)
        released.append(task_id)
    return released
