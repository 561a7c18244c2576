"""Timers through the real scheduler tick: deterministic firings, misfire policies, caps, pause and close."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, select, update

from tests.support.records import event_rows
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import control, sessions, timers
from wakeful.server.core.schedule import Misfire
from wakeful.server.errors import BadRequest, Refused
from wakeful.server.runtime import Runtime
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, TimerState
from wakeful.server.store.tables import timers as timers_table


def new_task(engine: Engine, clock: FakeClock, owner: str) -> str:
    with write(engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        return control.create_task(conn, user_id=owner, session_id=session_id, title="watch", now=clock.now())


def timer_events(engine: Engine) -> list[dict[str, object]]:
    return [json.loads(e.payload) for e in event_rows(engine) if e.source == "timer"]


def test_followup_fires_once_with_a_deterministic_event_id(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                           owner: str) -> None:
    task = new_task(engine, clock, owner)
    with write(engine) as conn:
        timer_id = timers.create_followup(conn, user_id=owner, task_id=task, due_at=clock.now() + timedelta(hours=1),
                                          note="did they reply?", now=clock.now(), cap=5)
    runtime.scheduler_tick()
    assert timer_events(engine) == []
    clock.advance(timedelta(hours=1))
    runtime.scheduler_tick()
    runtime.scheduler_tick()
    assert [(e["timer_id"], e["note"]) for e in timer_events(engine)] == [(timer_id, "did they reply?")]
    # A second firing of the same slot (the timer row's advance lost) is the same event, not a new one.
    with write(engine) as conn:
        conn.execute(update(timers_table).values(state=TimerState.ACTIVE.value))
    runtime.scheduler_tick()
    assert len(timer_events(engine)) == 1


@pytest.mark.parametrize(("misfire", "expected_slots"), [
    (Misfire.SKIP, []),
    (Misfire.CATCH_UP_ONCE, ["2026-01-04T09:00:00+00:00"]),
])
def test_daily_schedule_after_three_days_of_downtime(runtime: Runtime, engine: Engine, clock: FakeClock, owner: str,
                                                     misfire: Misfire, expected_slots: list[str]) -> None:
    clock.set(datetime(2026, 1, 1, 8, 0, tzinfo=UTC))
    task = new_task(engine, clock, owner)
    with write(engine) as conn:
        timers.create_schedule(conn, user_id=owner, task_id=task, now=clock.now(), note="digest",
                               cron="0 9 * * *", misfire=misfire, min_interval=timedelta(minutes=1))
    clock.set(datetime(2026, 1, 1, 9, 0, 0, 300_000, tzinfo=UTC))
    runtime.scheduler_tick()
    assert [e["slot"] for e in timer_events(engine)] == ["2026-01-01T09:00:00+00:00"]
    clock.set(datetime(2026, 1, 4, 12, 0, tzinfo=UTC))  # down from Jan 1 09:00 until Jan 4 noon
    runtime.scheduler_tick()
    assert [e["slot"] for e in timer_events(engine)][1:] == expected_slots
    with read(engine) as conn:
        due = conn.execute(select(timers_table.c.due_at)).scalar_one()
    assert due == datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
    clock.set(due)
    runtime.scheduler_tick()
    assert [e["slot"] for e in timer_events(engine)][-1] == "2026-01-05T09:00:00+00:00"


def test_timers_of_a_paused_task_do_not_fire_until_it_resumes(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                              owner: str) -> None:
    task = new_task(engine, clock, owner)
    with write(engine) as conn:
        timers.create_followup(conn, user_id=owner, task_id=task, due_at=clock.now() + timedelta(minutes=1),
                               note="n", now=clock.now(), cap=5)
        control.set_task_state(conn, user_id=owner, task_id=task, kind=ControlKind.PAUSE, actor="user", reason="",
                               now=clock.now())
    clock.advance(timedelta(minutes=5))
    runtime.scheduler_tick()
    assert timer_events(engine) == []
    with write(engine) as conn:
        control.set_task_state(conn, user_id=owner, task_id=task, kind=ControlKind.RESUME, actor="user", reason="",
                               now=clock.now())
    runtime.scheduler_tick()
    assert len(timer_events(engine)) == 1


def test_closing_a_task_cancels_its_timers(runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    task = new_task(engine, clock, owner)
    with write(engine) as conn:
        timers.create_schedule(conn, user_id=owner, task_id=task, now=clock.now(), note="n",
                               every=timedelta(hours=1), min_interval=timedelta(minutes=1))
        control.set_task_state(conn, user_id=owner, task_id=task, kind=ControlKind.CLOSE, actor="user", reason="",
                               now=clock.now())
    clock.advance(timedelta(hours=3))
    runtime.scheduler_tick()
    assert timer_events(engine) == []
    with read(engine) as conn:
        assert conn.execute(select(timers_table.c.state)).scalar_one() == TimerState.CANCELLED
    with write(engine) as conn, pytest.raises(Refused) as refused:
        timers.create_followup(conn, user_id=owner, task_id=task, due_at=clock.now(), note="n", now=clock.now(),
                               cap=5)
    assert refused.value.code == "task_closed"


def test_followups_beyond_the_cap_are_refused(engine: Engine, clock: FakeClock, owner: str) -> None:
    task = new_task(engine, clock, owner)
    with write(engine) as conn:
        for _ in range(2):
            timers.create_followup(conn, user_id=owner, task_id=task, due_at=clock.now(), note="n",
                                   now=clock.now(), cap=2)
        with pytest.raises(Refused) as refused:
            timers.create_followup(conn, user_id=owner, task_id=task, due_at=clock.now(), note="n",
                                   now=clock.now(), cap=2)
    assert refused.value.code == "cap_exceeded"


@pytest.mark.parametrize(("every", "cron"), [(timedelta(seconds=10), None), (None, "* * * * *")])
def test_schedules_more_frequent_than_the_minimum_interval_are_refused(engine: Engine, clock: FakeClock, owner: str,
                                                                       every: timedelta | None,
                                                                       cron: str | None) -> None:
    task = new_task(engine, clock, owner)
    with write(engine) as conn, pytest.raises(Refused) as refused:
        timers.create_schedule(conn, user_id=owner, task_id=task, now=clock.now(), note="n", every=every, cron=cron,
                               min_interval=timedelta(minutes=5))
    assert refused.value.code == "interval_too_short"


def test_an_invalid_cron_expression_is_a_clear_error(engine: Engine, clock: FakeClock, owner: str) -> None:
    task = new_task(engine, clock, owner)
    with write(engine) as conn, pytest.raises(BadRequest) as refused:
        timers.create_schedule(conn, user_id=owner, task_id=task, now=clock.now(), note="n", cron="61 * * * *",
                               min_interval=timedelta(minutes=1))
    assert refused.value.code == "invalid_schedule"


def test_timers_of_a_stopped_user_wait_for_start(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                 owner: str) -> None:
    task = new_task(engine, clock, owner)
    with write(engine) as conn:
        timers.create_followup(conn, user_id=owner, task_id=task, due_at=clock.now(), note="n", now=clock.now(), cap=5)
        control.set_stop(conn, stopped=True, user_id=owner, actor="user", reason="", now=clock.now())
    runtime.scheduler_tick()
    assert timer_events(engine) == []
    with write(engine) as conn:
        control.set_stop(conn, stopped=False, user_id=owner, actor="user", reason="", now=clock.now())
    runtime.scheduler_tick()
    assert len(timer_events(engine)) == 1
