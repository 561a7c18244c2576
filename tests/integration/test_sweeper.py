"""The sweeper's repairs, each from a state only a crash or a lost write leaves behind, on a real SQLite file; and
its clearing of what expired (console sessions, approval links), on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import Engine, delete, func, select, update

from tests.support.acting import world
from tests.support.records import event_rows, messages
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting import approval_links
from wakeful.server.acting.actions import load_action
from wakeful.server.core import inbox, sessions
from wakeful.server.core.sweeper import LINK_KEPT, sweep
from wakeful.server.faces.console.signin import SESSION_TTL, session_of, sign_in
from wakeful.server.runtime import Runtime
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import EventStatus, events, todos
from wakeful.server.store.tables import approval_links as approval_links_table
from wakeful.server.store.users import issue_token


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


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
def test_expired_console_sessions_and_long_expired_approval_links_are_deleted(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    with write(engine) as conn:
        token = issue_token(conn, user_id=owner)
    with world(engine, clock, owner) as w:
        task = w.task("cancel my subscription")
        (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
        action_id = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    start = clock.now()
    with write(engine) as conn:
        old_session, _ = sign_in(conn, token=token, now=start)
        action = load_action(conn, action_id, user_id=owner)
        approval_links.mint(conn, action, now=start, expires_at=start + timedelta(hours=1))   # expires, then kept
        approval_links.mint(conn, action, now=start, expires_at=start + timedelta(days=30))  # still good
    clock.advance(SESSION_TTL - timedelta(hours=1))
    with write(engine) as conn:
        live_session, _ = sign_in(conn, token=token, now=clock.now())
    clock.advance(timedelta(hours=2))  # the first sign-in is over, the second is not
    report = sweep(engine, now=clock.now(), event_max_attempts=runtime.settings.event_max_attempts)
    assert report.expired_sessions == 1 and report.expired_links == 0
    with read(engine) as conn:
        assert session_of(conn, old_session, now=start) is None  # gone, not merely past its time
        assert session_of(conn, live_session, now=clock.now()) is not None
        links_before = conn.execute(select(func.count()).select_from(approval_links_table)).scalar_one()
    clock.set(start + timedelta(hours=1) + LINK_KEPT + timedelta(seconds=1))
    report = sweep(engine, now=clock.now(), event_max_attempts=runtime.settings.event_max_attempts)
    assert report.expired_links == 1 and report.expired_sessions == 1
    with read(engine) as conn:
        left = conn.execute(select(approval_links_table.c.expires_at)).scalars().all()
        assert len(left) == links_before - 1 and all(at > clock.now() - LINK_KEPT for at in left)
    again = sweep(engine, now=clock.now(), event_max_attempts=runtime.settings.event_max_attempts)
    assert (again.expired_sessions, again.expired_links) == (0, 0)
