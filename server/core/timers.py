"""Timers: follow-ups (one-shot) and schedules (interval or cron), each belonging to a task.

A timer never starts a run. The scheduler turns a due timer into an ordinary inbox event whose source ID is
`<timer id>@<slot>` (so a double firing is one event) and, in the same transaction, marks the follow-up done or
advances the schedule. Timers of a paused task do not fire (on resume, the slots missed meanwhile go by the
schedule's misfire policy); a closed task's timers are cancelled with it. Creating a timer is itself capped: active
follow-ups per user and a minimum schedule interval (`server.core.agenda` adds the task's caps and wake budget).
A cron schedule is read in the zone it was set in (`tz`: the user's, then). A timer that ends records when and why.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, ScalarSelect, and_, func, select, update

from wakeful.server.core import inbox
from wakeful.server.core.schedule import Misfire, Recurrence, decide, min_gap
from wakeful.server.errors import NotFound, Refused
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import Authority, EventKind, TaskState, TimerKind, TimerState, tasks, timers

__all__ = ["check_followup", "check_interval", "create_followup", "create_schedule", "fire_due", "next_due",
           "recurrence"]

_LIVE = and_(timers.c.state == TimerState.ACTIVE.value, tasks.c.state == TaskState.ACTIVE.value)
"""The timers that fire when due (joined with their tasks): active ones of active tasks. A paused or held task's
timers wait, untouched, for it to be active again."""


def _task_session(conn: Connection, *, user_id: str, task_id: str) -> str:
    row = conn.execute(
        select(tasks.c.session_id, tasks.c.state).where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id))
    ).first()
    if row is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    if row.state == TaskState.CLOSED.value:
        raise Refused("task_closed", f"task {task_id} is closed; it can hold no timers", task_id=task_id)
    return str(row.session_id)


def check_followup(conn: Connection, *, user_id: str, task_id: str, cap: int) -> str:
    """Refuse a follow-up the caps do not allow; returns the task's session."""
    session_id = _task_session(conn, user_id=user_id, task_id=task_id)
    active = conn.execute(
        select(func.count()).select_from(timers).where(
            and_(timers.c.user_id == user_id, timers.c.kind == TimerKind.FOLLOWUP.value,
                 timers.c.state == TimerState.ACTIVE.value)
        )
    ).scalar_one()
    if active >= cap:
        raise Refused("cap_exceeded", f"{active} follow-ups are already active (the cap is {cap}); "
                      "let one fire or close its task first", cap=cap)
    return session_id


def create_followup(conn: Connection, *, user_id: str, task_id: str, due_at: datetime, note: str, now: datetime,
                    cap: int) -> str:
    session_id = check_followup(conn, user_id=user_id, task_id=task_id, cap=cap)
    timer_id = new_id("tmr")
    conn.execute(timers.insert().values(
        id=timer_id, user_id=user_id, task_id=task_id, session_id=session_id, kind=TimerKind.FOLLOWUP.value,
        state=TimerState.ACTIVE.value, due_at=max(due_at, now), anchor=due_at, misfire=Misfire.SKIP.value,
        note=note, fire_count=0, created_at=now,
    ))
    return timer_id


def check_interval(recurrence: Recurrence, *, now: datetime, min_interval: timedelta) -> None:
    """Refuse a schedule that would fire more often than every `min_interval`."""
    gap = min_gap(recurrence, anchor=now)
    if gap < min_interval:
        raise Refused("interval_too_short", f"schedules may not fire more often than every {min_interval}; this one "
                      f"fires every {gap}", min_interval_seconds=min_interval.total_seconds())


def create_schedule(conn: Connection, *, user_id: str, task_id: str, now: datetime, note: str,
                    every: timedelta | None = None, cron: str | None = None, tz: str | None = None,
                    misfire: Misfire = Misfire.SKIP, min_interval: timedelta) -> str:
    """A recurring schedule; `cron` is read on the wall clock of the IANA zone `tz` (UTC when None)."""
    session_id = _task_session(conn, user_id=user_id, task_id=task_id)
    recurrence = Recurrence(interval=every, cron=cron, tz=tz)  # a ScheduleError is a 400 with its code
    check_interval(recurrence, now=now, min_interval=min_interval)
    timer_id = new_id("tmr")
    conn.execute(timers.insert().values(
        id=timer_id, user_id=user_id, task_id=task_id, session_id=session_id, kind=TimerKind.SCHEDULE.value,
        state=TimerState.ACTIVE.value, due_at=recurrence.next_after(now, anchor=now),
        anchor=now, interval_seconds=int(every.total_seconds()) if every else None, cron=cron, tz=tz,
        misfire=misfire.value, note=note, fire_count=0, created_at=now,
    ))
    return timer_id


def recurrence(row: Any) -> Recurrence | None:
    """A timer row's recurrence; None for a follow-up."""
    if row.interval_seconds is None and row.cron is None:
        return None
    return Recurrence(interval=timedelta(seconds=row.interval_seconds) if row.interval_seconds else None,
                      cron=row.cron, tz=row.tz)


def next_due() -> ScalarSelect[datetime]:
    """When the first timer `fire_due` would fire falls due (NULL: none will), as a subquery for the scheduler."""
    return select(func.min(timers.c.due_at)).join(tasks, tasks.c.id == timers.c.task_id).where(_LIVE) \
        .scalar_subquery()


def fire_due(conn: Connection, *, now: datetime, blocked: Callable[[str], bool] = lambda _user: False,
             limit: int = 500) -> int:
    """Turn due timers of active tasks into inbox events; returns how many events were recorded.

    Timers of users under STOP (`blocked`) are left due, untouched, until START."""
    due = conn.execute(
        select(timers)
        .join(tasks, tasks.c.id == timers.c.task_id)
        .where(and_(_LIVE, timers.c.due_at <= now))
        .order_by(timers.c.due_at)
        .limit(limit)
        .with_for_update(of=timers, skip_locked=True)  # PostgreSQL: timers another scheduler is firing are its own
    ).all()
    fired = 0
    for t in due:
        if blocked(t.user_id):
            continue
        decision = decide(due_at=t.due_at, now=now, recurrence=recurrence(t), anchor=t.anchor,
                          misfire=Misfire(t.misfire))
        if decision is None:
            continue
        moved = conn.execute(
            update(timers)
            .where(and_(timers.c.id == t.id, timers.c.state == TimerState.ACTIVE.value, timers.c.due_at == t.due_at))
            .values(
                state=(TimerState.DONE if decision.next_due is None else TimerState.ACTIVE).value,
                due_at=decision.next_due or t.due_at,
                fire_count=t.fire_count + (1 if decision.fire_slot else 0),
                last_slot=decision.fire_slot or t.last_slot,
                ended_at=now if decision.next_due is None else None,
                end_reason="fired" if decision.next_due is None else None,
            )
        ).rowcount
        if moved != 1 or decision.fire_slot is None:
            continue
        inbox.record(conn, inbox.Delivery(
            user_id=t.user_id, source="timer", source_id=f"{t.id}@{decision.fire_slot.isoformat()}",
            kind=EventKind.TIMER, trust="system", authority=Authority.SYSTEM, session_id=t.session_id,
            payload={"timer_id": t.id, "task_id": t.task_id, "kind": t.kind, "slot": decision.fire_slot.isoformat(),
                     "note": t.note, "missed": decision.missed},
        ), now=now)
        fired += 1
    return fired
