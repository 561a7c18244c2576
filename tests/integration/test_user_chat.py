"""The user's chat about a task (issue 16, seed §3.4 "Mid-run Steering"): the message holds the task before the
running run stops, an approval meanwhile sends nothing, and the next run reads it and confirms a pause or lets the
system lift the hold. The simulators' own records are the judge of what left."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select

from tests.integration.test_cli import run
from tests.support.acting import CANCEL_VERIFIED, World, world
from tests.support.records import event_rows, messages, run_rows
from wakeful.proxy.clock import FakeClock, SystemClock
from wakeful.server.acting.connectors import load_connectors
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control, holds, inbox, sessions
from wakeful.server.core.worker import Binding, Worker
from wakeful.server.egress.grants import issue_client_token
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.harness.model import ModelReply, ModelRequest, ScriptedModel, calls, quiet
from wakeful.server.harness.wake import Harness
from wakeful.server.runtime import Runtime
from wakeful.server.settings import EXAMPLE_POLICIES, Settings
from wakeful.server.sims import serve
from wakeful.server.store.db import make_engine, read, write
from wakeful.server.store.tables import ControlKind, EventStatus, RunOutcome, TaskState, actions, tasks, tool_results
from wakeful.server.store.tables import control as control_table
from wakeful.server.store.users import ensure_user, issue_token
from wakeful.server.tools.specs import Face, tool_specs

BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
WORDS = "don't cancel it yet, I may keep it"


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner, policy=Policy()) as w:
        yield w


def worker(w: World, settings: Settings, model: ScriptedModel) -> Worker:
    harness = Harness(model, registry=w.tools.registry, instructions=None, max_tokens_per_run=100_000)
    return Worker(w.engine, settings, w.clock, harness, tools=w.tools)


def say(w: World, task_id: str, text: str = WORDS) -> str:
    with write(w.engine) as conn:
        return holds.say(conn, user_id=w.owner, task_id=task_id, text=text, actor="user:test",
                         now=w.clock.now()).event_id


def state(w: World, task_id: str) -> str:
    with read(w.engine) as conn:
        return str(conn.execute(select(tasks.c.state).where(tasks.c.id == task_id)).scalar_one())


def decisions(w: World, task_id: str) -> list[Any]:
    """The task's control history, kinds from this feature only (hold, release, pause, resume)."""
    kinds = [k.value for k in (ControlKind.HOLD, ControlKind.RELEASE, ControlKind.PAUSE, ControlKind.RESUME)]
    with read(w.engine) as conn:
        return conn.execute(select(control_table).where(control_table.c.task_id == task_id)
                            .where(control_table.c.kind.in_(kinds))
                            .order_by(control_table.c.created_at, control_table.c.id)).all()


def cancel_first(request: ModelRequest) -> ModelReply:
    listed = json.loads(request.messages[-1]["content"][0]["content"])
    return calls(("merchant__cancel_renewal", {"subscription": listed["objects"][0]["id"]}))


def held_mid_run(w: World, settings: Settings, model: ScriptedModel) -> tuple[Binding, str, str]:
    """A cancellation waits for approval; while a later run works, the user writes. Returns (task, the waiting
    action, the message's event)."""
    task = w.task(completion=CANCEL_VERIFIED)
    model.script.extend([calls(("merchant__list_subscriptions", {})), cancel_first, quiet("asked for approval")])
    assert worker(w, settings, model).run_once()
    with read(w.engine) as conn:
        action_id = str(conn.execute(select(actions.c.id)).scalar_one())
    with write(w.engine) as conn:  # the merchant writes: a second run starts
        inbox.record(conn, inbox.Delivery(user_id=w.owner, source="hook", source_id="mail-1",
                                          session_id=task.session_id, payload={"text": "your renewal is due"}),
                     now=w.clock.now())
    written: list[tuple[str, str]] = []

    def user_writes_mid_run(request: ModelRequest) -> ModelReply:
        event_id = say(w, task.task_id)
        written.append((event_id, state(w, task.task_id)))
        return calls(("send_to_user", {"text": "cancelling it now"}))

    model.script.append(user_writes_mid_run)
    assert worker(w, settings, model).run_once()
    ((message, seen),) = written
    assert seen == TaskState.HELD  # committed before the run reached its next step
    return task, action_id, message


@BOTH
def test_the_users_message_holds_the_task_before_the_run_stops_and_an_approval_meanwhile_sends_nothing(
        w: World, settings: Settings) -> None:
    model = ScriptedModel([])
    task, action_id, message = held_mid_run(w, settings, model)
    *_, interrupted = run_rows(w.engine)
    assert interrupted.outcome == RunOutcome.INTERRUPTED and "wrote about the task" in interrupted.reason
    assert "cancelling it now" not in [m.get("text") for m in messages(w.engine)]  # its buffered message is dropped
    (hold,) = decisions(w, task.task_id)
    assert (hold.kind, hold.actor, hold.event_id) == (ControlKind.HOLD, "user:test", message)
    assert w.approve(action_id) == "held"  # the approval from another device is recorded, and admits nothing
    assert w.dispatcher.drain() == 0
    assert w.merchant.effects == []
    assert state(w, task.task_id) == TaskState.HELD


@BOTH
def test_the_next_run_reads_the_message_and_a_confirmed_pause_stays_until_the_user_resumes(
        w: World, settings: Settings) -> None:
    model = ScriptedModel([])
    task, _, message = held_mid_run(w, settings, model)
    model.script.extend([calls(("confirm_pause", {"reason": "the user asked me not to cancel yet"})),
                         quiet("paused as asked")])
    assert worker(w, settings, model).run_once()
    assert WORDS in json.dumps(model.seen[-2].messages)  # the message is an event in the reading run's tail
    *_, reading = run_rows(w.engine)
    assert reading.outcome == RunOutcome.COMPLETED
    assert state(w, task.task_id) == TaskState.PAUSED
    hold, pause = decisions(w, task.task_id)
    assert (pause.kind, pause.run_id, pause.event_id) == (ControlKind.PAUSE, reading.id, message)
    assert pause.actor.startswith("agent:")  # the agent's narrowing, never recorded as the user's word
    assert not worker(w, settings, model).run_once()  # nothing more to do: no release woke the session
    with write(w.engine) as conn:
        control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.RESUME,
                               actor="user:test", reason="", now=w.clock.now())
    assert state(w, task.task_id) == TaskState.ACTIVE
    assert w.merchant.effects == []


@BOTH
def test_a_run_that_reads_the_message_without_confirming_a_pause_ends_the_hold_recorded_with_that_run(
        w: World, settings: Settings) -> None:
    model = ScriptedModel([])
    task, _, message = held_mid_run(w, settings, model)
    model.script.append(quiet("the user only told me their view; nothing to stop"))
    assert worker(w, settings, model).run_once()
    assert WORDS in json.dumps(model.seen[-1].messages)
    *_, reading = run_rows(w.engine)
    assert state(w, task.task_id) == TaskState.ACTIVE
    hold, release = decisions(w, task.task_id)
    assert (release.kind, release.actor, release.run_id, release.event_id) == (
        ControlKind.RELEASE, "system", reading.id, message)
    model.script.append(quiet("back to work"))
    assert worker(w, settings, model).run_once()  # the release woke the session: the work goes on
    assert "release" in json.dumps(model.seen[-1].messages)


def test_a_run_that_fails_after_reading_the_message_leaves_the_hold(w: World, settings: Settings) -> None:
    model = ScriptedModel([])
    task, _, _ = held_mid_run(w, settings, model)

    def model_breaks(request: ModelRequest) -> ModelReply:
        raise RuntimeError("the model's connection dropped")

    model.script.append(model_breaks)
    assert worker(w, settings, model).run_once()
    assert run_rows(w.engine)[-1].outcome == RunOutcome.FAILED
    assert state(w, task.task_id) == TaskState.HELD  # better over-paused than a pause missed
    assert [d.kind for d in decisions(w, task.task_id)] == [ControlKind.HOLD]
    message = [e for e in event_rows(w.engine) if e.source == holds.CHAT_SOURCE]
    assert [e.status for e in message] == [EventStatus.PENDING]  # read again by the next run


def test_the_agent_cannot_pause_a_task_no_message_holds(w: World, settings: Settings) -> None:
    task = w.task()
    model = ScriptedModel([calls(("confirm_pause", {"reason": "I would rather stop"})), quiet("done")])
    assert worker(w, settings, model).run_once()
    with read(w.engine) as conn:
        result = json.loads(conn.execute(select(tool_results.c.result)
                                         .where(tool_results.c.tool == "confirm_pause")).scalar_one())
    assert result["error"]["code"] == "not_held"
    assert state(w, task.task_id) == TaskState.ACTIVE and decisions(w, task.task_id) == []


# -- over HTTP: the user's token only ---------------------------------------------------------------------------------


@pytest.fixture
def api(engine: Engine, clock: FakeClock, owner: str, settings: Settings) -> Iterator[tuple[str, dict[str, str]]]:
    """The real app on loopback (no loops running: nothing moves unless a test moves it), and the owner's token."""
    runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine)
    runtime.prepare()
    with write(engine) as conn:
        token = issue_token(conn, user_id=owner)
    with serve(create_app(runtime, manage_runtime=False)) as url:
        yield url, {"Authorization": f"Bearer {token}"}


def delegate(url: str, auth: dict[str, str]) -> str:
    answer = httpx.post(f"{url}/v1/tasks", json={"title": "watch my flight"}, headers=auth, timeout=10)
    assert answer.status_code == 201, answer.text
    return str(answer.json()["task_id"])


@BOTH
def test_a_message_over_http_holds_the_task_and_status_and_ledger_show_the_hold_until_the_user_resumes(
        api: tuple[str, dict[str, str]], owner: str) -> None:
    url, auth = api
    task_id = delegate(url, auth)
    answer = httpx.post(f"{url}/v1/tasks/{task_id}/messages", json={"text": WORDS}, headers=auth, timeout=10)
    assert answer.status_code == 201, answer.text
    said = answer.json()
    assert (said["task_id"], said["state"]) == (task_id, "held") and said["event_id"].startswith("ev_")
    status = httpx.get(f"{url}/v1/tasks/{task_id}", headers=auth, timeout=10).json()
    assert status["state"] == "held"
    assert (status["hold"]["event_id"], status["hold"]["held_by"]) == (said["event_id"], f"user:{owner}")
    entries = httpx.get(f"{url}/v1/tasks/{task_id}/ledger", headers=auth, timeout=10).json()["entries"]
    (hold,) = [e for e in entries if e["type"] == "control" and e["kind"] == "hold"]
    assert hold["event_id"] == said["event_id"]
    (event,) = [e for e in entries if e["type"] == "event" and e.get("source") == holds.CHAT_SOURCE]
    assert (event["kind"], event["trust"], event["authority"], event["preempt"]) == ("message", "user", "user", True)
    resumed = httpx.post(f"{url}/v1/tasks/{task_id}/resume", headers=auth, timeout=10)
    assert resumed.json()["state"] == "active"
    assert httpx.get(f"{url}/v1/tasks/{task_id}", headers=auth, timeout=10).json()["hold"] is None


def test_the_agents_credentials_cannot_write_as_the_user(api: tuple[str, dict[str, str]], engine: Engine,
                                                          clock: FakeClock, owner: str) -> None:
    """The agent's tool computer holds a proxy credential of the user's; it opens no door to the user's chat (and the
    MCP face and the harness have no tool that writes one)."""
    url, auth = api
    task_id = delegate(url, auth)
    with write(engine) as conn:
        _, computer_token = issue_client_token(conn, user_id=owner, label="tool computer", now=clock.now())
    for headers, code in (({}, "missing_token"), ({"Authorization": f"Bearer {computer_token}"}, "bad_token")):
        answer = httpx.post(f"{url}/v1/tasks/{task_id}/messages", json={"text": "go ahead, pay"}, headers=headers,
                            timeout=10)
        assert (answer.status_code, answer.json()["error"]["code"]) == (401, code)
    assert [e for e in event_rows(engine) if e.source == holds.CHAT_SOURCE] == []
    names = {s.name for face in Face for s in tool_specs(load_connectors(EXAMPLE_POLICIES / "connectors"), face,
                                                         computers=True)}
    assert not any("message" in name or "say" in name or "release" in name for name in names)


@pytest.mark.parametrize(("body", "field"), [
    (b"{}", "text"),
    (b'{"text": ""}', "text"),
    (b'{"text": 7}', "text"),
    (b'{"text": "hi", "authority": "user"}', "authority"),
    (json.dumps({"text": "x" * 4001}).encode(), "text"),
    (b'{"text": "hi"', None),
])
def test_a_bad_message_body_is_a_400_naming_the_field_and_holds_nothing(api: tuple[str, dict[str, str]],
                                                                        engine: Engine, body: bytes,
                                                                        field: str | None) -> None:
    url, auth = api
    task_id = delegate(url, auth)
    answer = httpx.post(f"{url}/v1/tasks/{task_id}/messages", content=body,
                        headers=auth | {"content-type": "application/json"}, timeout=10)
    error = answer.json()["error"]
    assert (answer.status_code, error["code"]) == (400, "malformed_body")
    if field is not None:
        assert any(field in json.dumps(d) for d in error["details"]), error
    with read(engine) as conn:
        assert conn.execute(select(tasks.c.state).where(tasks.c.id == task_id)).scalar_one() == "active"


def test_a_message_to_an_unknown_or_closed_task_is_refused(api: tuple[str, dict[str, str]]) -> None:
    url, auth = api
    unknown = httpx.post(f"{url}/v1/tasks/task_nope/messages", json={"text": "hi"}, headers=auth, timeout=10)
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "unknown_task")
    task_id = delegate(url, auth)
    assert httpx.post(f"{url}/v1/tasks/{task_id}/close", headers=auth, timeout=10).status_code == 200
    closed = httpx.post(f"{url}/v1/tasks/{task_id}/messages", json={"text": "hi"}, headers=auth, timeout=10)
    assert (closed.status_code, closed.json()["error"]["code"]) == (409, "invalid_transition")


def test_say_from_the_cli_holds_the_task_in_the_users_name(tmp_path: Path) -> None:
    run(tmp_path, "migrate")
    engine = make_engine(f"sqlite:///{tmp_path / 'wakeful.db'}")
    now = SystemClock().now()
    with write(engine) as conn:
        owner, _ = ensure_user(conn, name="owner", now=now)
        session_id = sessions.create_session(conn, user_id=owner, now=now)
        task_id = control.create_task(conn, user_id=owner, session_id=session_id, title="rebook me", now=now)
    assert f"{task_id} is held" in run(tmp_path, "say", task_id, "wait, call me first").stdout
    empty = run(tmp_path, "say", task_id, "  ", check=False)
    assert empty.returncode == 2 and "invalid_parameter" in empty.stderr
    unknown = run(tmp_path, "say", "task_nope", "hi", check=False)
    assert unknown.returncode == 2 and "unknown_task" in unknown.stderr
    with read(engine) as conn:
        rows = conn.execute(select(control_table.c.kind, control_table.c.actor)
                            .where(control_table.c.kind == ControlKind.HOLD.value)).all()
        held = conn.execute(select(tasks.c.state).where(tasks.c.id == task_id)).scalar_one()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("hold", "cli:owner")] and held == "held"
