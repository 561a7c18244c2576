"""A task's agenda: the reply waits, follow-ups and recurring checks the agent sets for it, admitted like actions.

Setting one is an authorization, not a side effect (principle 7). `admit` refuses it with a stable code the model
sees as a tool error:

    stopped / paused / revoked / task_closed   the user's STOP is in force, or the task is not active
    too_many_timers       the task holds `timers_per_task` open follow-ups and checks
    too_many_waits        the task holds `waits_per_task` open reply waits
    interval_too_short    a check would fire more often than `schedule_min_interval` (`server.core.timers`)
    wake_budget_exceeded  the task's checks together would wake it more than `check_wakes_per_day` times a day

Each one is a row that the task's ledger and `GET /v1/tasks/{id}` show in plain words (`said`), in the user's time
zone ("checks prices every day at 09:00 Asia/Hong_Kong; next 2026-12-03 09:00"). It lives with its task: while the
task is paused its timers do not fire and its reply waits do not time out (on resume a check's missed slots go by
its misfire policy, a wait past its deadline times out then); closing or revoking the task cancels them
(`server.core.control`). The agent may narrow its own agenda (`cancel`), never the server's waits (an approval, a
reconciliation).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from sqlalchemy import Connection, and_, bindparam, func, select, update

from wakeful.server.core import control, timers, waits
from wakeful.server.core.authority import of_source
from wakeful.server.core.schedule import Misfire, Recurrence
from wakeful.server.errors import BadRequest, Conflict, NotFound, Refused
from wakeful.server.settings import Settings
from wakeful.server.store import users
from wakeful.server.store.tables import (
    Authority,
    OnTimeout,
    TaskState,
    TimerKind,
    TimerState,
    WaitState,
    tasks,
)
from wakeful.server.store.tables import timers as timers_table
from wakeful.server.store.tables import waits as waits_table

__all__ = ["LONGEST_WAIT", "REPLY", "Limits", "Planned", "add_check", "add_followup", "add_wait", "admit_timer",
           "admit_wait", "cancel", "check_deadline", "check_open", "listing", "said_of_timer", "said_of_wait",
           "wakes_per_day"]

REPLY = "reply"
"""The kind of the waits the agent sets (`wait_for_reply`): the only waits it may cancel."""

LONGEST_WAIT = timedelta(days=90)
"""The furthest deadline a reply wait may have (as far as a follow-up may lie ahead)."""

_DAY = timedelta(days=1)
_WEEK = timedelta(days=7)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one task may hold (`server.settings`)."""

    timers_per_task: int
    waits_per_task: int
    min_interval: timedelta
    wakes_per_day: float
    followups_per_user: int

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(timers_per_task=settings.timers_per_task, waits_per_task=settings.waits_per_task,
                   min_interval=settings.schedule_min_interval, wakes_per_day=settings.check_wakes_per_day,
                   followups_per_user=settings.followup_cap)


@dataclass(frozen=True, kw_only=True)
class Planned:
    """What a run set for the task but has not committed yet (it commits at the run's end): counted as held."""

    timers: int = 0
    waits: int = 0
    wakes_per_day: float = 0.0


def wakes_per_day(recurrence: Recurrence, *, now: datetime) -> float:
    """How often a check is expected to wake its task per day."""
    if recurrence.interval is not None:
        return _DAY / recurrence.interval
    fired = recurrence._count_in(now, now + _WEEK, anchor=now)[0]
    return fired / 7


def _active_task(conn: Connection, *, user_id: str, task_id: str) -> Any:
    row = conn.execute(select(tasks.c.session_id, tasks.c.state)
                       .where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id))).first()
    if row is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    if row.state == TaskState.CLOSED.value:
        raise Refused("task_closed", f"task {task_id} is closed; it can hold no timers or waits", task_id=task_id)
    if row.state != TaskState.ACTIVE.value:
        raise Refused(row.state, f"the task is {row.state}; it takes no new timers or waits until the user resumes it",
                      task_id=task_id)
    if control.stop_state(conn).blocks(user_id):
        raise Refused("stopped", "STOP is in force: nothing new is set until the user says START")
    return row


_OPEN_CHECKS = select(timers_table).where(and_(timers_table.c.task_id == bindparam("task_id"),
                                               timers_table.c.state == TimerState.ACTIVE.value))
_PENDING_WAITS = (select(waits_table).where(and_(waits_table.c.task_id == bindparam("task_id"),
                                                 waits_table.c.state == WaitState.PENDING.value))
                  .order_by(waits_table.c.created_at, waits_table.c.id))
"""Built once: `listing` runs on every status read, and building a statement cost more than running it."""


def _open_checks(conn: Connection, task_id: str) -> Sequence[Any]:
    return conn.execute(_OPEN_CHECKS, {"task_id": task_id}).all()


def admit_timer(conn: Connection, *, user_id: str, task_id: str, limits: Limits, now: datetime,
                recurrence: Recurrence | None, planned: Planned = Planned()) -> str:
    """Refuse a follow-up (`recurrence` None) or a check the task may not hold; returns the task's session."""
    task = _active_task(conn, user_id=user_id, task_id=task_id)
    held = _open_checks(conn, task_id)
    if len(held) + planned.timers >= limits.timers_per_task:
        raise Refused("too_many_timers", f"the task already holds {len(held) + planned.timers} open follow-ups and "
                      f"checks (the cap is {limits.timers_per_task}); cancel one first", cap=limits.timers_per_task)
    if recurrence is None:
        return str(task.session_id)
    timers.check_interval(recurrence, now=now, min_interval=limits.min_interval)
    wakes = sum(wakes_per_day(check, now=now) for check in map(timers.recurrence, held) if check is not None)
    wakes += planned.wakes_per_day + wakes_per_day(recurrence, now=now)
    if wakes > limits.wakes_per_day:
        raise Refused("wake_budget_exceeded", f"with this check the task's checks would wake it {wakes:.1f} times a "
                      f"day (the budget is {limits.wakes_per_day:g}); check less often or cancel a check",
                      budget=limits.wakes_per_day)
    return str(task.session_id)


def admit_wait(conn: Connection, *, user_id: str, task_id: str, limits: Limits, planned: Planned = Planned()) -> str:
    """Refuse a reply wait the task may not hold; returns the task's session."""
    task = _active_task(conn, user_id=user_id, task_id=task_id)
    held = conn.execute(select(func.count()).select_from(waits_table).where(and_(
        waits_table.c.task_id == task_id, waits_table.c.kind == REPLY,
        waits_table.c.state == WaitState.PENDING.value))).scalar_one()
    if held + planned.waits >= limits.waits_per_task:
        raise Refused("too_many_waits", f"the task already waits for {held + planned.waits} replies (the cap is "
                      f"{limits.waits_per_task}); cancel one first", cap=limits.waits_per_task)
    return str(task.session_id)


def add_followup(conn: Connection, *, user_id: str, task_id: str, due_at: datetime, note: str, now: datetime,
                 limits: Limits) -> str:
    admit_timer(conn, user_id=user_id, task_id=task_id, limits=limits, now=now, recurrence=None)
    return timers.create_followup(conn, user_id=user_id, task_id=task_id, due_at=due_at, note=note, now=now,
                                  cap=limits.followups_per_user)


def add_check(conn: Connection, *, user_id: str, task_id: str, note: str, now: datetime, limits: Limits,
              every: timedelta | None = None, cron: str | None = None, misfire: Misfire = Misfire.SKIP) -> str:
    """A recurring check; a cron is read in the user's time zone as it is now."""
    tz = users.zone(conn, user_id).key if cron is not None else None
    recurrence = Recurrence(interval=every, cron=cron, tz=tz)  # a ScheduleError is a 400 with its code
    admit_timer(conn, user_id=user_id, task_id=task_id, limits=limits, now=now, recurrence=recurrence)
    return timers.create_schedule(conn, user_id=user_id, task_id=task_id, now=now, note=note, every=every, cron=cron,
                                  tz=tz, misfire=misfire, min_interval=limits.min_interval)


def add_wait(conn: Connection, *, user_id: str, task_id: str, key: str, deadline: datetime, on_timeout: OnTimeout,
             note: str, now: datetime, limits: Limits, source: str | None = None,
             replying_to: Collection[str] = ()) -> str:
    """A wait for a delivery carrying `key` from `source` (any webhook source when None), ending at `deadline`.
    Only a later delivery answers it: not the events `replying_to` names (those the setting run read), nor any
    a run already took (`waits.register`)."""
    check_deadline(deadline, now=now)
    session_id = admit_wait(conn, user_id=user_id, task_id=task_id, limits=limits)
    return waits.register(conn, user_id=user_id, session_id=session_id, match_key=key, kind=REPLY,
                          authority=of_source(source) if source is not None else Authority.ANY_SOURCE,
                          deadline=deadline, now=now, task_id=task_id, on_timeout=on_timeout, note=note,
                          replying_to=replying_to)


def _open_item(conn: Connection, *, user_id: str, task_id: str, item_id: str) -> Any:
    """Which of the task's own open items `item_id` names: its active timer, or a pending reply wait."""
    if item_id.startswith("tmr_"):
        return conn.execute(select(timers_table.c.id).where(and_(
            timers_table.c.id == item_id, timers_table.c.task_id == task_id, timers_table.c.user_id == user_id,
            timers_table.c.state == TimerState.ACTIVE.value))).first()
    return conn.execute(select(waits_table.c.id).where(and_(
        waits_table.c.id == item_id, waits_table.c.task_id == task_id, waits_table.c.user_id == user_id,
        waits_table.c.kind == REPLY, waits_table.c.state == WaitState.PENDING.value))).first()


def check_open(conn: Connection, *, user_id: str, task_id: str, item_id: str) -> None:
    """Refuse to cancel what is not one of the task's open timers or reply waits."""
    if _open_item(conn, user_id=user_id, task_id=task_id, item_id=item_id) is None:
        raise NotFound("unknown_timer", f"this task has no open timer or reply wait {item_id[:60]!r}: list_timers "
                       "shows the open ones", item_id=item_id[:60])


def cancel(conn: Connection, *, user_id: str, task_id: str, item_id: str, reason: str, now: datetime) -> bool:
    """End one of the task's open timers or reply waits; False if it was not open (any more)."""
    if _open_item(conn, user_id=user_id, task_id=task_id, item_id=item_id) is None:
        return False
    if item_id.startswith("tmr_"):
        return conn.execute(update(timers_table).where(and_(timers_table.c.id == item_id,
                                                            timers_table.c.state == TimerState.ACTIVE.value))
                            .values(state=TimerState.CANCELLED.value, ended_at=now, end_reason=reason)).rowcount == 1
    try:
        waits.cancel(conn, wait_id=item_id, now=now)
    except Conflict:
        return False
    return True


def check_deadline(deadline: datetime, *, now: datetime) -> None:
    """A wait's deadline lies ahead, and no further than a follow-up may."""
    if deadline <= now:
        raise BadRequest("deadline_passed", f"the deadline {deadline.isoformat()} has already passed")
    if deadline - now > LONGEST_WAIT:
        raise BadRequest("deadline_too_far", f"a wait may last at most {LONGEST_WAIT.days} days")


# -- in plain words ----------------------------------------------------------------------------------------------


_WEEKDAYS = {"0": "Sunday", "1": "Monday", "2": "Tuesday", "3": "Wednesday", "4": "Thursday", "5": "Friday",
             "6": "Saturday", "7": "Sunday"}


def _how_often(row: Any) -> str:
    if row.interval_seconds:
        seconds = int(row.interval_seconds)
        for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
            if seconds % size == 0:
                count = seconds // size
                return f"every {unit}" if count == 1 else f"every {count} {unit}s"
        return f"every {seconds} seconds"
    minute, hour, day, month, weekday = str(row.cron).split()
    zone = row.tz or "UTC"
    if minute.isdigit() and hour.isdigit() and day == "*" and month == "*":
        at = f"{int(hour):02d}:{int(minute):02d} {zone}"
        if weekday == "*":
            return f"every day at {at}"
        if weekday in _WEEKDAYS:
            return f"every {_WEEKDAYS[weekday]} at {at}"
    return f"on the schedule '{row.cron}' ({zone})"


def said_of_timer(row: Any, zone: ZoneInfo) -> str:
    """A follow-up or a check in the user's words: 'checks prices every day at 09:00 Asia/Hong_Kong; next …' (the
    zone said once, unless the schedule's is another)."""
    what = row.note or "this task"
    if row.kind == TimerKind.FOLLOWUP.value:
        return f"follows up on {what} at {users.in_words(row.due_at, zone)}"
    said = row.cron is not None and (row.tz or "UTC") == zone.key  # the schedule named the zone
    return f"checks {what} {_how_often(row)}; next {users.in_words(row.due_at, zone, named=not said)}"


_ON_TIMEOUT_SAID = {OnTimeout.FOLLOW_UP.value: "then looks again", OnTimeout.TELL_USER.value: "then tells you",
                    OnTimeout.CLOSE.value: "then stops waiting"}


def said_of_wait(row: Any, zone: ZoneInfo) -> str | None:
    """A reply wait the agent set, in the user's words; None for the server's own waits."""
    if row.on_timeout is None:
        return None
    what = row.note or f"a reply carrying {row.match_key}"
    return f"waits for {what} until {users.in_words(row.deadline, zone)}; {_ON_TIMEOUT_SAID[row.on_timeout]}"


def listing(conn: Connection, *, user_id: str, task_id: str) -> dict[str, list[dict[str, Any]]]:
    """The task's open timers and pending waits, each with what it is in plain words."""
    zone = users.zone(conn, user_id)
    open_timers = [{"timer_id": t.id, "kind": t.kind, "note": t.note, "next_at": t.due_at.isoformat(),
                    "said": said_of_timer(t, zone)}
                   for t in sorted(_open_checks(conn, task_id), key=lambda t: (t.due_at, t.id))]
    pending = conn.execute(_PENDING_WAITS, {"task_id": task_id}).all()
    open_waits = [{"wait_id": w.id, "kind": w.kind, "match_key": w.match_key, "authority": w.authority,
                   "deadline": w.deadline.isoformat() if w.deadline else None, "on_timeout": w.on_timeout,
                   "note": w.note, "said": said_of_wait(w, zone)} for w in pending]
    return {"timers": open_timers, "waits": open_waits}
