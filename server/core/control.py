"""Control state: STOP and task pause / resume / close. Written only by the user (CLI or authenticated HTTP).

A delegation and a steer may also come from the agent (`core.steers` decides what it may write): they carry its
actor and trust `agent`, never the user's.

Every decision is an append-only row in `control`; the current state is derived from the latest row, so the
history of who stopped what, and why, is never overwritten. Pausing or closing a task also preempts its
session: a control event is persisted first, and a run in progress stops at its next step; its helper tasks stop
the same way (`core.helper_tasks`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, select, update

from wakeful.server.core import helper_tasks, inbox, keys
from wakeful.server.errors import Conflict, NotFound
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import (
    Authority,
    ControlKind,
    EventKind,
    SteerState,
    TaskState,
    TimerState,
    WaitState,
    control,
    steer_proposals,
    task_versions,
    tasks,
    timers,
    waits,
)

__all__ = ["StopState", "TaskEnd", "create_task", "on_task_end", "record", "set_stop", "set_task_state", "state_after",
           "steer", "stop_state"]


@dataclass(frozen=True, kw_only=True)
class StopState:
    everything: bool
    users: frozenset[str]

    def blocks(self, user_id: str) -> bool:
        return self.everything or user_id in self.users


def set_stop(conn: Connection, *, stopped: bool, user_id: str | None, actor: str, reason: str, now: datetime) -> str:
    """Write a STOP (or START) record for one user, or for the whole deployment when `user_id` is None."""
    return record(conn, user_id=user_id, task_id=None, kind=ControlKind.STOP if stopped else ControlKind.START,
                  actor=actor, reason=reason, now=now)


def record(conn: Connection, *, user_id: str | None, task_id: str | None, kind: ControlKind, actor: str,
           reason: str, now: datetime, event_id: str | None = None, run_id: str | None = None) -> str:
    """Append one control decision to the history; returns its ID. `event_id` and `run_id` name the message and the
    run a hold, a release or a confirmed pause answers (`core.holds`)."""
    record_id = new_id("ctl")
    conn.execute(control.insert().values(id=record_id, user_id=user_id, task_id=task_id, kind=kind.value,
                                         actor=actor, reason=reason, created_at=now, event_id=event_id,
                                         run_id=run_id))
    return record_id


_STOPS_AND_STARTS = (select(control.c.user_id, control.c.kind)
                     .where(control.c.kind.in_([ControlKind.STOP.value, ControlKind.START.value]))
                     .order_by(control.c.created_at, control.c.id))


def stop_state(conn: Connection) -> StopState:
    """Who is stopped now: the latest STOP/START row per scope decides."""
    latest: dict[str | None, str] = {}
    for row in conn.execute(_STOPS_AND_STARTS):
        latest[row.user_id] = row.kind
    return StopState(
        everything=latest.get(None) == ControlKind.STOP.value,
        users=frozenset(u for u, k in latest.items() if u is not None and k == ControlKind.STOP.value),
    )


def create_task(conn: Connection, *, user_id: str, session_id: str, title: str, now: datetime,
                goal: str | None = None, constraints: Mapping[str, Any] | None = None,
                completion: Sequence[Mapping[str, Any]] = (), actor: str = "user", trust: str = "user",
                task_keys: Sequence[str] = ()) -> str:
    """A responsibility (the whole delegation) with its first task version; `trust` says whose word it is.
    `task_keys` are bound to it at once (`core.keys`): deliveries carrying them wake its session."""
    task_id = new_id("task")
    conn.execute(tasks.insert().values(id=task_id, user_id=user_id, session_id=session_id, title=title,
                                       state=TaskState.ACTIVE.value, current_version=1, created_at=now))
    keys.bind(conn, user_id=user_id, task_id=task_id, keys=task_keys, actor=actor, reason="given at delegation",
              now=now)
    conn.execute(task_versions.insert().values(
        id=new_id("tv"), task_id=task_id, version=1, goal=goal or title, created_by=actor, created_at=now,
        constraints=json.dumps(dict(constraints or {}), sort_keys=True), completion=json.dumps(list(completion)),
    ))
    # The delegation itself is the first event: it wakes the agent, and its time is "request received".
    inbox.record(conn, inbox.Delivery(user_id=user_id, source="delegation", source_id=task_id, kind=EventKind.CONTROL,
                                      trust=trust, authority=Authority(trust), session_id=session_id,
                                      payload={"task_id": task_id, "title": title, "goal": goal or title,
                                               "constraints": dict(constraints or {})}), now=now)
    return task_id


_TRANSITIONS: dict[ControlKind, tuple[frozenset[TaskState], TaskState]] = {
    ControlKind.PAUSE: (frozenset({TaskState.ACTIVE, TaskState.HELD}), TaskState.PAUSED),
    ControlKind.RESUME: (frozenset({TaskState.PAUSED, TaskState.HELD}), TaskState.ACTIVE),
    ControlKind.REVOKE: (frozenset({TaskState.ACTIVE, TaskState.PAUSED, TaskState.HELD}), TaskState.REVOKED),
    ControlKind.CLOSE: (frozenset({TaskState.ACTIVE, TaskState.PAUSED, TaskState.HELD, TaskState.REVOKED}),
                        TaskState.CLOSED),
    ControlKind.REOPEN: (frozenset({TaskState.CLOSED}), TaskState.ACTIVE),
}
"""Task states and the control operations that move between them; only the user's control channel calls these.
A hold (`core.holds`) is lifted by any of them: the user's own word settles what their message left open."""


TaskEnd = Callable[[Connection, str, datetime], object]
"""What else ends with a task: called in the close or revoke transaction with (conn, task_id, now)."""

_TASK_END: list[TaskEnd] = []


def on_task_end(hook: TaskEnd) -> None:
    """Register `hook` to run when a task closes or is revoked. Control imports nothing above it: a room that
    must not inform authorization (memory) is wired in from above (`server.runtime`), never imported here."""
    if hook not in _TASK_END:
        _TASK_END.append(hook)


def state_after(kind: str) -> TaskState | None:
    """The state a control record of `kind` left its task in (None: that kind does not move a task)."""
    move = _TRANSITIONS.get(ControlKind(kind))
    return move[1] if move else None


def set_task_state(conn: Connection, *, user_id: str, task_id: str, kind: ControlKind, actor: str, reason: str,
                   now: datetime) -> TaskState:
    """Pause, resume or close a task the user owns: one guarded transition, one control row, one control event."""
    sources, target = _TRANSITIONS[kind]
    row = conn.execute(
        select(tasks.c.session_id, tasks.c.state).where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id))
    ).first()
    if row is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    moved = conn.execute(
        update(tasks)
        .where(and_(tasks.c.id == task_id, tasks.c.state.in_([s.value for s in sources])))
        .values(state=target.value, closed_at=now if target is TaskState.CLOSED else None)
    ).rowcount
    if moved != 1:
        raise Conflict("invalid_transition", f"task {task_id} is {row.state}; cannot {kind.value} it",
                       task_id=task_id, state=row.state)
    record_id = record(conn, user_id=user_id, task_id=task_id, kind=kind, actor=actor, reason=reason, now=now)
    if target in (TaskState.PAUSED, TaskState.CLOSED, TaskState.REVOKED):  # its helpers stop at their next step
        helper_tasks.stop_for_task(conn, task_id=task_id, reason=f"the task was {target.value}", now=now)
    if target in (TaskState.CLOSED, TaskState.REVOKED):
        # Proactivity closes with its task: timers and pending waits end here, and its keys route to triage again.
        keys.release(conn, task_id=task_id, now=now)
        for hook in _TASK_END:  # memory's task-scoped records expire (`memory.expire_task`, wired by the runtime)
            hook(conn, task_id, now)
        conn.execute(update(timers).where(and_(timers.c.task_id == task_id, timers.c.state == TimerState.ACTIVE.value))
                     .values(state=TimerState.CANCELLED.value, ended_at=now,
                             end_reason=f"the task was {target.value} by {actor}"))
        # ... except reconciliation: a request that already left is still found out about and reported.
        conn.execute(update(waits).where(and_(waits.c.task_id == task_id, waits.c.state == WaitState.PENDING.value,
                                              waits.c.kind != "reconcile"))
                     .values(state=WaitState.CANCELLED.value, resolved_at=now))
    inbox.record(
        conn,
        inbox.Delivery(user_id=user_id, source="control", source_id=record_id, kind=EventKind.CONTROL,
                       trust="user", authority=Authority.USER, session_id=row.session_id,
                       preempt=kind not in (ControlKind.RESUME, ControlKind.REOPEN),
                       payload={"control": kind.value, "task_id": task_id, "reason": reason}),
        now=now,
    )
    return target


def steer(conn: Connection, *, user_id: str, task_id: str, goal: str, constraints: Mapping[str, Any] | None = None,
          completion: Sequence[Mapping[str, Any]] = (), actor: str, now: datetime, trust: str = "user") -> int:
    """The user changed the goal: a new task version. The old version's actions, approvals and objects stop
    counting (admission and dispatch check the version), its pending approval waits are cancelled, and the agent's
    steers still awaiting the user are superseded (they asked against the old version)."""
    row = conn.execute(select(tasks).where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id))
                       .with_for_update()).first()
    if row is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    if row.state in (TaskState.CLOSED.value, TaskState.REVOKED.value):
        hint = "reopen it before steering it" if row.state == TaskState.CLOSED.value else \
            "a revoked task is final: delegate a new one"
        raise Conflict("invalid_transition", f"task {task_id} is {row.state}; {hint}", task_id=task_id,
                       state=row.state)
    version = int(row.current_version) + 1
    conn.execute(task_versions.insert().values(
        id=new_id("tv"), task_id=task_id, version=version, goal=goal, created_by=actor, created_at=now,
        constraints=json.dumps(dict(constraints or {}), sort_keys=True), completion=json.dumps(list(completion)),
    ))
    conn.execute(update(tasks).where(and_(tasks.c.id == task_id, tasks.c.current_version == row.current_version))
                 .values(current_version=version))
    conn.execute(update(waits).where(and_(waits.c.task_id == task_id, waits.c.state == WaitState.PENDING.value,
                                          waits.c.kind == "approval"))
                 .values(state=WaitState.CANCELLED.value, resolved_at=now))
    conn.execute(update(steer_proposals).where(and_(steer_proposals.c.task_id == task_id,
                                                    steer_proposals.c.state == SteerState.AWAITING_USER.value))
                 .values(state=SteerState.SUPERSEDED.value, decided_by=actor, decided_at=now))
    record_id = record(conn, user_id=user_id, task_id=task_id, kind=ControlKind.STEER, actor=actor,
                       reason=f"version {version}: {goal}", now=now)
    inbox.record(conn, inbox.Delivery(user_id=user_id, source="control", source_id=record_id, kind=EventKind.CONTROL,
                                      trust=trust, authority=Authority(trust), session_id=row.session_id,
                                      preempt=True,
                                      payload={"control": "steer", "task_id": task_id, "version": version,
                                               "goal": goal}), now=now)
    return version
