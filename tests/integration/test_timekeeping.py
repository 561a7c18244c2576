"""The agent keeps time (wakeful issue 16): reply waits with deadlines, recurring checks in the user's time zone,
admitted like actions, shown in plain words, paused and closed with their task. The agent is the harness with a
scripted model over real records; replies come through the real webhook endpoint on loopback; the user reads
`GET /v1/tasks/{id}`; the scheduler is the runtime's own tick on a clock that jumps days."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select

from tests.support.acting import World, world
from tests.support.records import event_rows, messages
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import control, inbox, keys
from wakeful.server.core.signatures import sign
from wakeful.server.core.worker import Binding, Worker
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.harness.model import ScriptedModel, calls, quiet
from wakeful.server.harness.wake import Harness
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.sims import serve
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, EventKind, EventStatus, TimerState, WaitState, timers, tool_results
from wakeful.server.store.tables import waits as waits_table
from wakeful.server.store.users import issue_token, set_zone

BOTH_DATABASES = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
DAY = timedelta(days=1)
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)  # 20:00 in Hong Kong


@dataclass
class Agent:
    w: World
    runtime: Runtime
    model: ScriptedModel
    worker: Worker
    url: str
    auth: dict[str, str]
    secret: bytes

    def run(self, *replies: Any) -> bool:
        """One wake of the agent, the model answering with `replies`."""
        self.model.script.extend(replies)
        return self.worker.run_once()

    def later(self, by: timedelta) -> None:
        """Time passes; the scheduler ticks (twice: a second tick changes nothing)."""
        self.w.clock.advance(by)
        self.runtime.scheduler_tick()
        self.runtime.scheduler_tick()

    def reply(self, delivery_id: str, key: str) -> dict[str, Any]:
        """A signed delivery from the webhook source `hook` carrying `key`."""
        body = json.dumps({"session_key": key, "text": "My boss says yes."}).encode()
        headers = sign("generic", secret=self.secret, body=body, now=self.w.clock.now().timestamp(),
                       delivery_id=delivery_id)
        answer = httpx.post(f"{self.url}/v1/hooks/hook", content=body, headers=headers, timeout=10)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def mail(self, task: Binding, source_id: str) -> None:
        """Something new for the task's session (an email its key routed), so that it wakes."""
        with write(self.w.engine) as conn:
            inbox.record(conn, inbox.Delivery(user_id=self.w.owner, source="hook", source_id=source_id,
                                              payload={"text": "any news?"}, session_id=task.session_id),
                         now=self.w.clock.now())

    def status(self, task: Binding) -> dict[str, Any]:
        answer = httpx.get(f"{self.url}/v1/tasks/{task.task_id}", headers=self.auth, timeout=10)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def ledger(self, task: Binding) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/v1/tasks/{task.task_id}/ledger", headers=self.auth, timeout=10)
        assert answer.status_code == 200, answer.text
        return list(answer.json()["entries"])

    def control(self, task: Binding, kind: ControlKind) -> None:
        with write(self.w.engine) as conn:
            control.set_task_state(conn, user_id=self.w.owner, task_id=task.task_id, kind=kind, actor="user:test",
                                   reason="test", now=self.w.clock.now())

    def tool_errors(self) -> list[str | None]:
        with read(self.w.engine) as conn:
            rows = conn.execute(select(tool_results.c.result).order_by(tool_results.c.created_at,
                                                                      tool_results.c.id)).scalars()
            return [json.loads(r).get("error", {}).get("code") for r in rows]


@pytest.fixture
def agent(engine: Engine, clock: FakeClock, owner: str, settings: Settings) -> Iterator[Agent]:
    with world(engine, clock, owner, client_timeout=1.0) as w:
        clock.set(T0)
        runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine, registry=w.tools.registry)
        runtime.prepare()
        runtime.committer.start()  # the inbox's writer
        model = ScriptedModel([])
        harness = Harness(model, registry=w.tools.registry, instructions=None, max_tokens_per_run=100_000)
        with write(engine) as conn:
            token = issue_token(conn, user_id=owner)
            set_zone(conn, user_id=owner, name="Asia/Hong_Kong")
        try:
            with serve(create_app(runtime, manage_runtime=False)) as url:
                yield Agent(w=w, runtime=runtime, model=model, worker=Worker(engine, settings, clock, harness,
                                                                             tools=w.tools),
                            url=url, auth={"Authorization": f"Bearer {token}"},
                            secret=settings.sources["hook"].secret.get_secret_value().encode())
        finally:
            runtime.committer.stop()


def waiting(key: str, on_timeout: str, *, within: timedelta = 2 * DAY) -> tuple[str, dict[str, Any]]:
    return ("wait_for_reply", {"key": key, "within_seconds": int(within.total_seconds()), "on_timeout": on_timeout,
                               "note": "the client's confirmation (they are asking their boss)"})


def delegated(agent: Agent, *tool_calls: tuple[str, dict[str, Any]]) -> Binding:
    """A task whose first wake makes these calls, then stays quiet."""
    task = agent.w.task(title="meet the client in Hong Kong")
    assert agent.run(calls(*tool_calls), quiet("set"))
    return task


def timeouts(engine: Engine) -> list[Any]:
    return [e for e in event_rows(engine) if e.kind == EventKind.WAIT_TIMEOUT]


@BOTH_DATABASES
def test_an_acknowledgement_becomes_a_two_day_wait_that_wakes_the_task_once_and_a_late_reply_wakes_nothing(
        agent: Agent) -> None:
    task = delegated(agent, waiting("thread-42", "follow_up"))
    (shown,) = agent.status(task)["waits"]
    assert shown["said"] == ("waits for the client's confirmation (they are asking their boss) until 2026-12-04 "
                             "20:00 Asia/Hong_Kong; then looks again")
    agent.later(DAY)
    assert timeouts(agent.w.engine) == [] and not agent.run()
    agent.later(DAY)
    (timeout,) = timeouts(agent.w.engine)
    assert timeout.session_id == task.session_id
    assert json.loads(timeout.payload)["awaited"] == "the client's confirmation (they are asking their boss)"
    assert agent.run(quiet("no reply: I will ask again tomorrow"))
    assert "the client's confirmation" in json.dumps(agent.model.seen[-1].messages)
    late = agent.reply("late-1", "thread-42")
    assert late["status"] == EventStatus.LATE
    assert not agent.run()  # nothing to wake for
    assert len(timeouts(agent.w.engine)) == 1
    assert [e["state"] for e in agent.ledger(task) if e["type"] == "wait_ended"] == [WaitState.TIMED_OUT]


@BOTH_DATABASES
def test_a_wait_set_in_answer_to_a_delivery_on_its_key_waits_for_the_next_one_not_that_one(agent: Agent) -> None:
    task = delegated(agent, ("list_timers", {}))
    with write(agent.w.engine) as conn:
        keys.bind(conn, user_id=agent.w.owner, task_id=task.task_id, keys=["thread-45"], actor="user:test",
                  reason="the client's thread", now=agent.w.clock.now())
    agent.reply("ack-1", "thread-45")  # "I'll confirm with my boss", in the task's thread
    agent.later(timedelta(seconds=5))  # its coalescing window
    assert agent.run(calls(waiting("thread-45", "follow_up")), quiet("an acknowledgement: waiting for the reply"))
    (pending,) = agent.status(task)["waits"]  # the acknowledgement it answers is not the reply
    assert pending["match_key"] == "thread-45"
    assert agent.reply("reply-1", "thread-45")["status"] == EventStatus.PENDING
    assert agent.status(task)["waits"] == []
    assert [e["state"] for e in agent.ledger(task) if e["type"] == "wait_ended"] == [WaitState.SATISFIED]


@BOTH_DATABASES
def test_a_wait_that_tells_the_user_at_its_deadline_sends_exactly_one_message_and_wakes_nothing(agent: Agent) -> None:
    delegated(agent, waiting("thread-43", "tell_user", within=timedelta(hours=2)))
    agent.later(timedelta(hours=2))
    agent.later(timedelta(hours=1))
    (told,) = [m for m in messages(agent.w.engine) if m.get("kind") == "wait_timed_out"]
    assert told["text"] == ("No reply came by 2026-12-02 22:00 Asia/Hong_Kong: I was waiting for the client's "
                            "confirmation (they are asking their boss).")
    assert timeouts(agent.w.engine) == [] and not agent.run()


def test_a_wait_that_closes_at_its_deadline_only_ends(agent: Agent) -> None:
    task = delegated(agent, waiting("thread-44", "close", within=timedelta(hours=1)))
    agent.later(timedelta(hours=1))
    assert timeouts(agent.w.engine) == [] and not agent.run()
    assert [m for m in messages(agent.w.engine) if m.get("kind") == "wait_timed_out"] == []
    assert agent.status(task)["waits"] == []
    assert [e["state"] for e in agent.ledger(task) if e["type"] == "wait_ended"] == [WaitState.TIMED_OUT]


@BOTH_DATABASES
def test_a_daily_0900_check_in_hong_kong_is_shown_in_plain_words_and_fires_at_0100_utc(agent: Agent) -> None:
    task = delegated(agent, ("keep_checking", {"note": "hotel prices", "cron": "0 9 * * *"}))
    (check,) = agent.status(task)["timers"]
    assert check["said"] == "checks hotel prices every day at 09:00 Asia/Hong_Kong; next 2026-12-03 09:00"
    assert check["next_at"] == "2026-12-03T01:00:00+00:00"
    assert [e["said"] for e in agent.ledger(task) if e["type"] == "timer"] == [check["said"]]
    agent.later(timedelta(hours=12, minutes=59))  # 00:59 UTC
    assert [e for e in event_rows(agent.w.engine) if e.source == "timer"] == []
    agent.later(timedelta(minutes=1))
    (fired,) = [json.loads(e.payload) for e in event_rows(agent.w.engine) if e.source == "timer"]
    assert fired["slot"] == "2026-12-03T01:00:00+00:00" and fired["note"] == "hotel prices"


@BOTH_DATABASES
def test_a_paused_tasks_check_and_wait_hold_still_and_go_by_their_policy_on_resume(agent: Agent) -> None:
    task = delegated(agent, ("keep_checking", {"note": "prices", "cron": "0 9 * * *"}),
                     waiting("thread-45", "follow_up", within=DAY))
    agent.control(task, ControlKind.PAUSE)
    agent.later(3 * DAY)
    fired = [e for e in event_rows(agent.w.engine) if e.source == "timer"]
    assert fired == [] and timeouts(agent.w.engine) == []
    agent.control(task, ControlKind.RESUME)
    agent.later(timedelta(minutes=1))
    # skip: the slots missed while paused go by; the wait, past its deadline, times out now (once).
    assert [e for e in event_rows(agent.w.engine) if e.source == "timer"] == []
    assert len(timeouts(agent.w.engine)) == 1
    (check,) = agent.status(task)["timers"]
    assert check["next_at"] == "2026-12-06T01:00:00+00:00"


@BOTH_DATABASES
def test_closing_a_task_cancels_its_timers_and_waits_and_the_ledger_says_so(agent: Agent) -> None:
    task = delegated(agent, ("keep_checking", {"note": "prices", "every_seconds": 3600}),
                     ("schedule_followup", {"in_seconds": 7200, "note": "did they pay?"}),
                     waiting("thread-46", "tell_user", within=DAY))
    agent.control(task, ControlKind.CLOSE)
    agent.later(2 * DAY)
    assert [e for e in event_rows(agent.w.engine) if e.source in ("timer", "wait")] == []
    assert [m for m in messages(agent.w.engine) if m.get("kind") == "wait_timed_out"] == []
    with read(agent.w.engine) as conn:
        assert {r.state for r in conn.execute(select(timers.c.state))} == {TimerState.CANCELLED}
        assert conn.execute(select(waits_table.c.state)).scalars().all() == [WaitState.CANCELLED]
    ended = [(e["type"], e["state"]) for e in agent.ledger(task) if e["type"] in ("timer_ended", "wait_ended")]
    assert sorted(ended) == [("timer_ended", "cancelled"), ("timer_ended", "cancelled"),
                             ("wait_ended", "cancelled")]


def test_caps_minimum_interval_and_wake_budget_refuse_with_stable_codes(agent: Agent, settings: Settings) -> None:
    settings.timers_per_task, settings.waits_per_task, settings.check_wakes_per_day = 2, 1, 3
    delegated(agent,
              ("keep_checking", {"note": "too often", "every_seconds": 600}),
              ("keep_checking", {"note": "prices", "cron": "0 9,18 * * *"}),
              ("keep_checking", {"note": "more prices", "cron": "0 12,15 * * *"}),  # 4 wakes a day
              ("schedule_followup", {"in_seconds": 3600}),
              ("schedule_followup", {"in_seconds": 3600}),  # the third timer
              waiting("thread-47", "close"), waiting("thread-48", "close"),
              ("wait_for_reply", {"key": "k", "within_seconds": 3600, "until": "2026-12-03T09:00:00+08:00",
                                  "note": "two deadlines"}),
              ("cancel_timer", {"id": "wait_0000000000000000000000000"}))
    assert agent.tool_errors() == ["interval_too_short", None, "wake_budget_exceeded", None, "too_many_timers",
                                   None, "too_many_waits", "invalid_arguments", "unknown_timer", None]
    with read(agent.w.engine) as conn:
        assert len(conn.execute(select(timers)).all()) == 2
        assert len(conn.execute(select(waits_table)).all()) == 1


def test_the_agent_lists_and_cancels_its_own_timers(agent: Agent) -> None:
    task = delegated(agent, ("keep_checking", {"note": "prices", "every_seconds": 86400}),
                     waiting("thread-49", "follow_up"))
    agent.mail(task, "m-1")
    assert agent.run(calls(("list_timers", {})), quiet("listed"))
    listed = json.loads(agent.model.seen[-1].messages[-1]["content"][0]["content"])
    (check,), (wait,) = listed["timers"], listed["waits"]
    assert check["said"] == "checks prices every day; next 2026-12-03 20:00 Asia/Hong_Kong"
    agent.mail(task, "m-2")
    assert agent.run(calls(("cancel_timer", {"id": check["timer_id"]}), ("cancel_timer", {"id": wait["wait_id"]})),
                     quiet("no longer needed"))
    status = agent.status(task)
    assert status["timers"] == [] and status["waits"] == []
    agent.later(2 * DAY)
    assert [e for e in event_rows(agent.w.engine) if e.source in ("timer", "wait")] == []
