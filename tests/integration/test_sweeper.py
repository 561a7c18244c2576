"""The sweeper's repairs, each from a state only a crash or a lost write leaves behind, on a real SQLite file."""

from __future__ import annotations

from sqlalchemy import Engine, delete, func, select, update

from tests.support.records import event_rows, messages
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import inbox, sessions
from wakeful.server.core.sweeper import sweep
from wakeful.server.runtime import Runtime
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import EventStatus, events, todos


def deliver(engine: Engine, clock: FakeClock, owner: str, source_id: str) -> inbox.Recorded:
    with write(engine) as conn:
        return inbox.record(conn, inbox.Delivery(user_id=owner, source="hook", source_id=source_id,
                                                 payload={"n": source_id}), now=clock.now())


def todo_count(engine: Engine) -> int:
    with read(engine) as conn:
        return int(conn.execute(select(func.count()).select_from(todos)).scalar_one())


def test_a_pending_event_that_lost_its_todo_gets_one_and_is_processed(runtime: Runtime, engine: Engine,
                                                                      clock: FakeClock, owner: str) -> None:
    deliver(engine, clock, owner, "d1")
    with write(engine) as conn:
        conn.execute(delete(todos))
    assert not runtime.workers[0].run_once()  # nothing tells the workers about it
    report = sweep(engine, now=clock.now(), event_max_attempts=runtime.settings.event_max_attempts)
    assert report.rescheduled == 1 and todo_count(engine) == 1
    assert runtime.workers[0].run_once()
    assert [e.status for e in event_rows(engine)] == [EventStatus.PROCESSED]
    assert [m["text"] for m in messages(engine)] == ["Received 1 event(s): hook:d1"]


def test_a_todo_with_nothing_pending_is_dropped(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                owner: str) -> None:
    recorded = deliver(engine, clock, owner, "d1")
    assert runtime.workers[0].run_once() and todo_count(engine) == 0
    with write(engine) as conn:  # a wake-up whose events were already handled
        sessions.wake(conn, session_id=recorded.session_id, user_id=owner, due_at=clock.now())
    report = sweep(engine, now=clock.now(), event_max_attempts=runtime.settings.event_max_attempts)
    assert report.dropped_todos == 1 and todo_count(engine) == 0


def test_an_event_past_the_attempt_cap_that_no_run_holds_is_failed_and_the_user_told(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    deliver(engine, clock, owner, "d1")
    with write(engine) as conn:  # its runs died one after another
        conn.execute(update(events).values(attempts=runtime.settings.event_max_attempts))
    report = sweep(engine, now=clock.now(), event_max_attempts=runtime.settings.event_max_attempts)
    assert report.failed_events == 1
    assert [e.status for e in event_rows(engine)] == [EventStatus.FAILED]
    assert [m["kind"] for m in messages(engine)] == ["event_failed"]


def test_a_healthy_database_is_left_as_it_is(runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    deliver(engine, clock, owner, "d1")
    report = sweep(engine, now=clock.now(), event_max_attempts=runtime.settings.event_max_attempts)
    assert (report.abandoned_runs, report.failed_events, report.rescheduled, report.dropped_todos) == (0, 0, 0, 0)
    assert todo_count(engine) == 1 and [e.status for e in event_rows(engine)] == [EventStatus.PENDING]
