"""Tool computers under the split: the API's runtime holds them, the worker's reaches them over the socket. A run in
the worker observes, acts and hands the screen over on the API's computer (the link it sends opens in the API's live
view), an act the user approved runs once from the worker's dispatcher, the worker's sweeper reaps through the API,
and with the API gone an act is blocked with a reason, never run twice or lost."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from mcp import Client
from sqlalchemy import Engine, select

from tests.support.computers import FakeComputers
from tests.support.polling import wait_until
from tests.support.records import messages
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting import approvals
from wakeful.server.acting.policy import Policy
from wakeful.server.computers.remote import RemoteComputers
from wakeful.server.core import control, sessions
from wakeful.server.core.worker import Binding
from wakeful.server.faces.http import create_app
from wakeful.server.faces.mcpserver import WakefulMCP
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Role, Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import attempts

pytestmark = pytest.mark.anyio
BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Split:
    def __init__(self, api: Runtime, worker: Runtime, computers: FakeComputers, task_id: str, owner: str) -> None:
        self.api, self.worker, self.computers, self.task_id, self.owner = api, worker, computers, task_id, owner

    @property
    def binding(self) -> Binding:
        return Binding(user_id=self.owner, task_id=self.task_id)


@pytest.fixture
def split(settings: Settings, engine: Engine, clock: FakeClock, owner: str) -> Iterator[Split]:
    computers = FakeComputers(clock)
    api = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine, computers=computers, role=Role.API)
    api.prepare()
    worker = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine, role=Role.WORKER)
    with write(engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        task_id = control.create_task(conn, user_id=owner, session_id=session_id, title="buy the thing",
                                      now=clock.now())
    api.start()  # the committer and the computers' socket; the worker's loops are driven by hand
    try:
        yield Split(api, worker, computers, task_id, owner)
    finally:
        api.stop()


@BOTH
def test_the_worker_reaches_the_apis_computers_not_its_own(split: Split) -> None:
    assert isinstance(split.worker.computers, RemoteComputers) and split.worker.live is None
    assert split.api.computers is split.computers and split.api.live is not None


@BOTH
def test_a_run_in_the_worker_observes_acts_and_hands_off_on_the_apis_computer(split: Split,
                                                                                settings: Settings) -> None:
    tools = split.worker.tools
    seen = tools.call(split.binding, "computer__observe", {})
    ref = next(line.split("]")[0][1:] for line in seen["text"].splitlines() if '"Next"' in line)
    done = tools.call(split.binding, "computer__act", {"act": {"kind": "click", "ref": ref}})
    assert done["outcome"] == "accepted" and split.computers.browser.acts == [("click", 3)]
    tools.call(split.binding, "computer__request_handoff", {"reason": "a CAPTCHA"})
    assert split.computers.tc.lease is not None  # the API's computer: the human holds it
    (link,) = [m["link"] for m in messages(split.api.engine) if m.get("kind") == "handoff"]
    with TestClient(create_app(split.api, manage_runtime=False)) as client:
        redirect = client.get(link.split(str(settings.port), 1)[1], follow_redirects=False)
        assert redirect.status_code == 303  # the link the worker sent opens in the API's live view
        assert client.post(f"{redirect.headers['location']}/return", headers={"origin": "null"}).status_code == 200
    assert split.computers.tc.lease is None
    assert split.computers.activities == ["observe", "act", "handoff"]


@BOTH
async def test_an_act_the_user_approved_runs_once_from_the_workers_dispatcher(split: Split, settings: Settings) -> None:
    mcp = WakefulMCP(engine=split.api.engine, clock=split.api.clock, settings=settings, tools=split.api.tools,
                     local_user="owner")
    async with Client(mcp.server) as client:
        seen = await client.call_tool("computer__observe", {"task_id": split.task_id})
        text = seen.structured_content["text"]  # type: ignore[index]
        ref = next(line.split("]")[0][1:] for line in text.splitlines() if "Pay 19.99 EUR" in line)
        held = await client.call_tool("computer__act", {"task_id": split.task_id,
                                                        "act": {"kind": "click", "ref": ref}})
    assert held.structured_content["status"] == "needs_approval"  # type: ignore[index]
    (card,) = [m for m in messages(split.api.engine) if m.get("kind") == "approval_request"]
    with write(split.api.engine) as conn:
        approvals.decide(conn, user_id=split.owner, action_id=card["card"]["action_id"], approve=True,
                         actor="user:test", policy=Policy(), now=split.api.clock.now())
    assert split.worker.actions.drain() == 1
    assert split.computers.browser.acts == [("click", 4)]
    assert split.worker.actions.drain() == 0 and len(split.computers.browser.acts) == 1
    with read(split.api.engine) as conn:
        assert conn.execute(select(attempts.c.outcome)).scalars().all() == ["accepted"]


@BOTH
def test_the_workers_sweeper_reaps_through_the_api(split: Split) -> None:
    split.worker.sweep_once()
    assert split.computers.reaped == 1


@BOTH
def test_with_the_api_gone_an_approved_act_is_blocked_with_its_reason_and_nothing_runs(split: Split) -> None:
    tools = split.worker.tools
    seen = tools.call(split.binding, "computer__observe", {})
    ref = next(line.split("]")[0][1:] for line in seen["text"].splitlines() if "Pay 19.99 EUR" in line)
    held = tools.call(split.binding, "computer__act", {"act": {"kind": "click", "ref": ref}})
    with write(split.api.engine) as conn:
        approvals.decide(conn, user_id=split.owner, action_id=held["action_id"], approve=True, actor="user:test",
                         policy=Policy(), now=split.api.clock.now())
    split.api.stop()
    assert split.worker.actions.drain() == 1
    with read(split.api.engine) as conn:
        attempt = conn.execute(select(attempts)).one()
    assert attempt.outcome == "blocked" and attempt.detail.startswith("computers_unreachable")
    assert split.computers.browser.acts == []
    assert split.worker.sweep_once() == 0.0  # the sweeper goes on without its reaping


@BOTH
def test_an_act_the_api_runs_now_is_not_taken_for_a_dead_one_by_the_workers_dispatcher(split: Split) -> None:
    """The API executes an act it admitted within the tool call; the worker's dispatcher finding the same intent due
    meanwhile waits for it instead of settling the running attempt as unknown."""
    gate, results = threading.Event(), {}
    split.computers.browser.on_click[3] = lambda _: gate.wait(60)  # "Next" takes as long as the test says
    seen = split.api.tools.call(split.binding, "computer__observe", {})
    ref = next(line.split("]")[0][1:] for line in seen["text"].splitlines() if '"Next"' in line)
    acting = threading.Thread(target=lambda: results.update(api=split.api.tools.call(
        split.binding, "computer__act", {"act": {"kind": "click", "ref": ref}})), daemon=True)
    acting.start()
    wait_until(lambda: split.computers.browser.acts, 30, "the act to be running in the API")
    draining = threading.Thread(target=lambda: results.update(worker=split.worker.actions.drain()), daemon=True)
    draining.start()
    assert "worker" not in results or results["worker"] == 0
    gate.set()
    acting.join(timeout=60)
    draining.join(timeout=60)
    assert results["api"]["outcome"] == "accepted"
    with read(split.api.engine) as conn:
        assert conn.execute(select(attempts.c.outcome)).scalars().all() == ["accepted"]
    assert split.computers.browser.acts == [("click", 3)]
