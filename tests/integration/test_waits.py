"""Waits: pending → satisfied | timed_out | cancelled, terminal states final; early answers are not lost."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import Engine, select

from tests.support.records import event_rows
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import inbox, sessions, waits
from wakeful.server.errors import Conflict
from wakeful.server.runtime import Runtime
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import Authority, EventKind, EventStatus, WaitState, todos
from wakeful.server.store.tables import waits as waits_table


def reply(engine: Engine, clock: FakeClock, owner: str, source_id: str, key: str) -> inbox.Recorded:
    with write(engine) as conn:
        return inbox.record(conn, inbox.Delivery(user_id=owner, source="hook", source_id=source_id,
                                                 payload={"answer": "yes"}, corr_key=key), now=clock.now())


def register(engine: Engine, clock: FakeClock, owner: str, key: str, deadline: timedelta | None = None) -> str:
    with write(engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        waits.register(conn, user_id=owner, session_id=session_id, match_key=key, kind="reply",
                       authority=Authority.ANY_SOURCE, deadline=clock.now() + deadline if deadline else None,
                       now=clock.now())
    return session_id


def wait_state(engine: Engine, key: str) -> str:
    with read(engine) as conn:
        return str(conn.execute(select(waits_table.c.state).where(waits_table.c.match_key == key)).scalar_one())


def has_todo(engine: Engine, session_id: str) -> bool:
    with read(engine) as conn:
        return conn.execute(select(todos.c.session_id).where(todos.c.session_id == session_id)).first() is not None


def test_reply_matching_a_pending_wait_satisfies_it_and_wakes_its_session(engine: Engine, clock: FakeClock,
                                                                          owner: str) -> None:
    session_id = register(engine, clock, owner, "call-1")
    recorded = reply(engine, clock, owner, "r1", "call-1")
    assert recorded.session_id == session_id and recorded.status == EventStatus.PENDING
    assert wait_state(engine, "call-1") == WaitState.SATISFIED
    assert has_todo(engine, session_id)


def test_late_callback_after_a_wait_timed_out_is_recorded_and_wakes_nothing(runtime: Runtime, engine: Engine,
                                                                            clock: FakeClock, owner: str) -> None:
    session_id = register(engine, clock, owner, "quote-7", deadline=timedelta(minutes=5))
    clock.advance(timedelta(minutes=6))
    runtime.scheduler_tick()
    assert wait_state(engine, "quote-7") == WaitState.TIMED_OUT
    timeout = [e for e in event_rows(engine) if e.kind == EventKind.WAIT_TIMEOUT]
    assert len(timeout) == 1 and timeout[0].session_id == session_id
    with write(engine) as conn:  # the timeout's run happened; the session is idle
        conn.execute(todos.delete())
    late = reply(engine, clock, owner, "late-approval", "quote-7")
    assert late.status == EventStatus.LATE
    assert wait_state(engine, "quote-7") == WaitState.TIMED_OUT  # never resurrected
    assert not has_todo(engine, session_id)


def test_answer_that_arrives_before_its_wait_is_registered_is_not_lost(engine: Engine, clock: FakeClock,
                                                                       owner: str) -> None:
    early = reply(engine, clock, owner, "fast-reply", "call-9")
    session_id = register(engine, clock, owner, "call-9")
    assert wait_state(engine, "call-9") == WaitState.SATISFIED
    (event,) = [e for e in event_rows(engine) if e.id == early.event_id]
    assert event.session_id == session_id and event.status == EventStatus.PENDING
    assert has_todo(engine, session_id)


def test_wait_keys_are_single_use(engine: Engine, clock: FakeClock, owner: str) -> None:
    register(engine, clock, owner, "k")
    with pytest.raises(Conflict) as refused:
        register(engine, clock, owner, "k")
    assert refused.value.code == "wait_key_taken"


def wait_id_of(engine: Engine, key: str) -> str:
    with read(engine) as conn:
        return str(conn.execute(select(waits_table.c.id).where(waits_table.c.match_key == key)).scalar_one())


def wait_row(engine: Engine, key: str) -> dict[str, object]:
    with read(engine) as conn:
        return dict(conn.execute(select(waits_table).where(waits_table.c.match_key == key)).one()._mapping)


def test_cancelled_wait_cannot_be_satisfied(engine: Engine, clock: FakeClock, owner: str) -> None:
    register(engine, clock, owner, "k2")
    with write(engine) as conn:
        waits.cancel(conn, wait_id=wait_id_of(engine, "k2"), now=clock.now())
    assert reply(engine, clock, owner, "r", "k2").status == EventStatus.LATE
    assert wait_state(engine, "k2") == WaitState.CANCELLED


def end_wait(runtime: Runtime, engine: Engine, clock: FakeClock, owner: str, key: str, state: WaitState) -> None:
    """Bring a wait to `state` the way the server does: an answer, the scheduler past its deadline, a cancel."""
    register(engine, clock, owner, key, deadline=timedelta(minutes=5))
    if state is WaitState.SATISFIED:
        reply(engine, clock, owner, f"answer-{key}", key)
    elif state is WaitState.TIMED_OUT:
        clock.advance(timedelta(minutes=6))
        runtime.scheduler_tick()
    else:
        with write(engine) as conn:
            waits.cancel(conn, wait_id=wait_id_of(engine, key), now=clock.now())
    assert wait_state(engine, key) == state


@pytest.mark.parametrize("attempted", sorted(waits.TERMINAL))
@pytest.mark.parametrize("ended", sorted(waits.TERMINAL))
def test_a_wait_that_ended_refuses_every_transition_and_its_row_stays_as_it_was(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str, ended: WaitState,
        attempted: WaitState) -> None:
    end_wait(runtime, engine, clock, owner, "k3", ended)
    before = wait_row(engine, "k3")
    clock.advance(timedelta(hours=1))  # a changed row would show a new resolved_at
    with pytest.raises(Conflict) as refused, write(engine) as conn:
        waits.resolve(conn, wait_id=str(before["id"]), to=attempted, now=clock.now())
    assert refused.value.code == "wait_terminal"
    assert wait_row(engine, "k3") == before


@pytest.mark.parametrize("ended", sorted(waits.TERMINAL))
def test_a_wait_that_ended_is_left_alone_by_cancel_settle_and_the_deadline_sweep(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str, ended: WaitState) -> None:
    end_wait(runtime, engine, clock, owner, "k4", ended)
    before = wait_row(engine, "k4")
    clock.advance(timedelta(hours=1))
    with pytest.raises(Conflict) as refused, write(engine) as conn:
        waits.cancel(conn, wait_id=str(before["id"]), now=clock.now())
    assert refused.value.code == "wait_terminal"
    with write(engine) as conn:
        assert waits.settle(conn, user_id=owner, match_key="k4", now=clock.now()) is False
        waits.expire_due(conn, now=clock.now())
    assert wait_row(engine, "k4") == before


@pytest.mark.parametrize("to", sorted(waits.TERMINAL))
def test_a_pending_wait_moves_once_to_the_terminal_state_asked_for(engine: Engine, clock: FakeClock, owner: str,
                                                                    to: WaitState) -> None:
    register(engine, clock, owner, "k5")
    with write(engine) as conn:
        waits.resolve(conn, wait_id=wait_id_of(engine, "k5"), to=to, now=clock.now())
    assert wait_state(engine, "k5") == to
    with pytest.raises(Conflict), write(engine) as conn:
        waits.resolve(conn, wait_id=wait_id_of(engine, "k5"), to=to, now=clock.now())


def test_a_wait_is_never_moved_back_to_pending(engine: Engine, clock: FakeClock, owner: str) -> None:
    register(engine, clock, owner, "k6")
    with pytest.raises(ValueError), write(engine) as conn:
        waits.resolve(conn, wait_id=wait_id_of(engine, "k6"), to=WaitState.PENDING, now=clock.now())
    assert wait_state(engine, "k6") == WaitState.PENDING