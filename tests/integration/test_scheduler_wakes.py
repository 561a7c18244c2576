"""When the scheduler wakes: at the earliest due timer or wait deadline, never only at its next idle poll, and never
in a hot loop over what it may not act on yet. The loop is driven one tick at a time on a fake clock (each tick says
how long the loop would sleep, and the clock jumps by exactly that), and once for real under `wakeful serve`."""

from __future__ import annotations

import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from sqlalchemy import Engine, select

from tests.integration.test_cli import WAKEFUL
from tests.support.polling import wait_until
from tests.support.postgres import postgres_database
from tests.support.records import event_rows
from tests.support.serve import ServeProcess
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import agenda, control, inbox, sessions
from wakeful.server.harness.handlers import ScriptedHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, EventKind, OnTimeout, WaitState
from wakeful.server.store.tables import waits as waits_table

BOTH_DATABASES = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
IDLE = 300.0
"""The idle poll, far above the deadlines here: a wait that ends at its deadline was not found by a poll."""


@pytest.fixture
def settings(settings: Settings) -> Settings:
    settings.idle_poll_max = IDLE
    return settings


def new_task(engine: Engine, clock: FakeClock, owner: str) -> str:
    with write(engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        return control.create_task(conn, user_id=owner, session_id=session_id, title="the quote", now=clock.now())


def wait_for_reply(engine: Engine, clock: FakeClock, settings: Settings, owner: str, task_id: str, *,
                   within: timedelta) -> datetime:
    deadline = clock.now() + within
    with write(engine) as conn:
        agenda.add_wait(conn, user_id=owner, task_id=task_id, key="quote-7", deadline=deadline,
                        on_timeout=OnTimeout.TELL_USER, note="the quote", now=clock.now(),
                        limits=agenda.Limits.of(settings))
    return deadline


def follow_up(engine: Engine, clock: FakeClock, settings: Settings, owner: str, task_id: str, *,
              within: timedelta) -> None:
    with write(engine) as conn:
        agenda.add_followup(conn, user_id=owner, task_id=task_id, due_at=clock.now() + within, note="any news?",
                            now=clock.now(), limits=agenda.Limits.of(settings))


def wait_ended(engine: Engine) -> tuple[str, datetime | None]:
    with read(engine) as conn:
        row = conn.execute(select(waits_table.c.state, waits_table.c.resolved_at)).one()
    return row.state, row.resolved_at


def tick_and_sleep(runtime: Runtime, clock: FakeClock) -> float:
    """One round of the scheduler loop: a tick, then the sleep it asks for (the fake clock jumps by it)."""
    sleep = runtime.scheduler_tick()
    clock.advance(timedelta(seconds=sleep))
    return sleep


@BOTH_DATABASES
def test_a_reply_wait_times_out_at_its_deadline_not_at_the_next_idle_poll_after_a_followup_fired(
        runtime: Runtime, engine: Engine, clock: FakeClock, settings: Settings, owner: str) -> None:
    """Regression: a 120 s wait beside a 60 s follow-up ended 30 s late (the idle poll): once the timer had fired,
    the scheduler slept as if nothing else were due."""
    task_id = new_task(engine, clock, owner)
    deadline = wait_for_reply(engine, clock, settings, owner, task_id, within=timedelta(seconds=120))
    follow_up(engine, clock, settings, owner, task_id, within=timedelta(seconds=60))
    sleeps = [tick_and_sleep(runtime, clock) for _ in range(3)]
    assert sleeps[:2] == [60.0, 60.0]  # to the follow-up, then to the wait's deadline
    assert wait_ended(engine) == (WaitState.TIMED_OUT, deadline)


@BOTH_DATABASES
def test_the_scheduler_sleeps_until_a_wait_deadline_when_no_timer_is_due(
        runtime: Runtime, engine: Engine, clock: FakeClock, settings: Settings, owner: str) -> None:
    task_id = new_task(engine, clock, owner)
    deadline = wait_for_reply(engine, clock, settings, owner, task_id, within=timedelta(seconds=45))
    assert tick_and_sleep(runtime, clock) == 45.0
    assert wait_ended(engine) == (WaitState.PENDING, None)
    assert tick_and_sleep(runtime, clock) == IDLE  # nothing is left to wait for
    assert wait_ended(engine) == (WaitState.TIMED_OUT, deadline)


def test_a_wait_a_run_sets_wakes_the_scheduler_which_then_sleeps_to_its_deadline(
        settings: Settings, engine: Engine, clock: FakeClock, owner: str) -> None:
    """A run's commit wakes the scheduler, as an MCP or HTTP write does: what the run set may be due before the
    scheduler's next look."""
    deadline = clock.now() + timedelta(seconds=20)
    runtime = Runtime(settings, clock=clock, engine=engine,
                      handler=ScriptedHandler([lambda ctx: ctx.wait_for("call-3", deadline=deadline)]))
    runtime.prepare()
    with write(engine) as conn:
        inbox.record(conn, inbox.Delivery(user_id=owner, source="hook", source_id="d1", payload={}), now=clock.now())
    clock.advance(timedelta(seconds=5))  # the delivery's coalescing window
    runtime.signals.timers.clear()
    assert runtime.workers[0].run_once()
    assert runtime.signals.timers.is_set()
    assert runtime.scheduler_tick() == (deadline - clock.now()).total_seconds()


@BOTH_DATABASES
def test_a_paused_tasks_due_timer_and_wait_do_not_spin_the_scheduler(
        runtime: Runtime, engine: Engine, clock: FakeClock, settings: Settings, owner: str) -> None:
    """A paused task's timers do not fire and its reply waits do not time out until it resumes (which wakes the
    scheduler): the scheduler does not look again at once, and again, while they stay due."""
    task_id = new_task(engine, clock, owner)
    wait_for_reply(engine, clock, settings, owner, task_id, within=timedelta(seconds=30))
    follow_up(engine, clock, settings, owner, task_id, within=timedelta(seconds=30))
    with write(engine) as conn:
        control.set_task_state(conn, user_id=owner, task_id=task_id, kind=ControlKind.PAUSE, actor="user:test",
                               reason="test", now=clock.now())
    clock.advance(timedelta(minutes=1))
    assert runtime.scheduler_tick() == IDLE
    assert wait_ended(engine) == (WaitState.PENDING, None)
    with write(engine) as conn:
        control.set_task_state(conn, user_id=owner, task_id=task_id, kind=ControlKind.RESUME, actor="user:test",
                               reason="test", now=clock.now())
    runtime.scheduler_tick()
    assert wait_ended(engine)[0] == WaitState.TIMED_OUT
    assert [e.kind for e in event_rows(engine) if e.source == "timer"] == [EventKind.TIMER]


def test_a_stopped_users_due_timer_does_not_spin_the_scheduler(
        runtime: Runtime, engine: Engine, clock: FakeClock, settings: Settings, owner: str) -> None:
    """Under STOP a due timer stays due, untouched: the scheduler looks again after a poll, not at once."""
    task_id = new_task(engine, clock, owner)
    follow_up(engine, clock, settings, owner, task_id, within=timedelta(seconds=30))
    with write(engine) as conn:
        control.set_stop(conn, stopped=True, user_id=owner, actor="user:test", reason="test", now=clock.now())
    clock.advance(timedelta(minutes=1))
    assert runtime.scheduler_tick() == settings.poll_interval
    assert [e for e in event_rows(engine) if e.source == "timer"] == []


# -- under `wakeful serve` -----------------------------------------------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _ledger(url: str, token: str, task_id: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/v1/tasks/{task_id}/ledger", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["entries"])


@pytest.mark.anyio
@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_under_serve_a_reply_wait_ends_at_its_deadline_with_the_idle_poll_minutes_away(
        tmp_path: Path, database: str, request: pytest.FixtureRequest) -> None:
    """The user's case for real: `wait_for_reply` over MCP, the worker process's loops polling every 300 s. The wait
    ends within seconds of its deadline (as the ledger records both); a scheduler blind to deadlines ends it at its
    next poll, minutes later."""
    env = {"WAKEFUL_DATA_DIR": str(tmp_path), "WAKEFUL_POLL_INTERVAL": str(IDLE), "WAKEFUL_IDLE_POLL_MAX": str(IDLE)}
    if database == "postgresql":
        env["WAKEFUL_DATABASE_URL"] = postgres_database(request.getfixturevalue("postgres_server"))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}
    token = subprocess.run([WAKEFUL, "token"], env=clean | env, capture_output=True, text=True,
                           check=True).stdout.strip()
    with ServeProcess(env, log_path=tmp_path / "serve.log") as server:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http, \
                Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as client:
            task_id = (await client.call_tool("create_responsibility", {"title": "the quote"})).structured_content[
                "task_id"]
            soon = datetime.now(UTC) + timedelta(seconds=5)  # `until`: `within_seconds` is at least a minute
            waiting = await client.call_tool("wait_for_reply", {
                "task_id": task_id, "key": "quote-7", "note": "the quote", "until": soon.isoformat(),
                "on_timeout": "tell_user"})
        assert not waiting.is_error, waiting.content
        ended = wait_until(lambda: [e for e in _ledger(server.url, token, task_id) if e["type"] == "wait_ended"],
                           IDLE / 5, f"the wait to end; log:\n{server.log(3000)}")
        (wait,) = [e for e in _ledger(server.url, token, task_id) if e["type"] == "wait"]
        assert server.terminate(grace=60) == (0, False)
    assert [e["state"] for e in ended] == [WaitState.TIMED_OUT]
    late = datetime.fromisoformat(ended[0]["at"]) - datetime.fromisoformat(wait["deadline"])
    assert timedelta(0) <= late < timedelta(seconds=20)
