"""The tool-computer tools through the real MCP client, over real SQLite, with the vm layer's in-memory guest and
browser: observe is a read, every act is an action through admission with its attempt recorded, a stale ref never
reaches the page, acts on "Pay"-like elements wait for the user's approval, and a handoff shuts the agent out."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from mcp import Client
from sqlalchemy import Engine, select
from starlette.websockets import WebSocketDisconnect

from tests.support.computers import FakeComputers
from tests.support.polling import wait_until
from tests.support.records import messages
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting import approvals
from wakeful.server.acting.policy import Policy
from wakeful.server.computers.handoff import CONTROL_VNC_PORT, VIEW_VNC_PORT
from wakeful.server.computers.pool import VmComputers, observe
from wakeful.server.core import control, sessions
from wakeful.server.core.worker import Binding
from wakeful.server.errors import Refused
from wakeful.server.faces.http import create_app
from wakeful.server.faces.mcpserver import WakefulMCP
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import actions, attempts, refusals, verdicts
from wakeful.server.store.users import ensure_user
from wakeful.vm.fake import FakeDisks, FakeHypervisor
from wakeful.vm.fake_browser import FakeBrowser
from wakeful.vm.fake_guest import FakeChannel
from wakeful.vm.guest import RunResult
from wakeful.vm.hypervisor import ProxyCredential
from wakeful.vm.lifecycle import VmInfo, VmManager, VmSettings
from wakeful.vm.toolcomputer import SHED_CACHE, ToolComputer

pytestmark = pytest.mark.anyio

@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def setup(engine: Engine, clock: FakeClock, owner: str, settings: Settings) -> tuple[Runtime, FakeComputers, str]:
    computers = FakeComputers(clock)
    runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine, computers=computers)
    runtime.prepare()
    with write(engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        task_id = control.create_task(conn, user_id=owner, session_id=session_id, title="buy the thing",
                                      now=clock.now())
    return runtime, computers, task_id


def _mcp(runtime: Runtime, settings: Settings) -> WakefulMCP:
    return WakefulMCP(engine=runtime.engine, clock=runtime.clock, settings=settings, tools=runtime.tools,
                      local_user="owner")


async def _observe(client: Client, task_id: str) -> tuple[dict[str, Any], dict[str, str]]:
    result = await client.call_tool("computer__observe", {"task_id": task_id})
    assert not result.is_error, result.content
    body = json.loads(result.content[0].text)  # type: ignore[union-attr]
    assert result.content[1].type == "image" and result.content[1].mime_type == "image/png"  # type: ignore[union-attr]
    refs = {line.split('"')[1]: line.split("]")[0][1:] for line in body["text"].splitlines()
            if line.startswith("[") and '"' in line}
    return body, refs


async def test_observe_then_fill_and_click_by_ref_each_act_an_action_with_its_attempt(
        setup: tuple[Runtime, FakeComputers, str], settings: Settings) -> None:
    runtime, computers, task_id = setup
    async with Client(_mcp(runtime, settings).server) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert tools["computer__observe"].annotations.read_only_hint is True  # type: ignore[union-attr]
        assert tools["computer__act"].annotations.destructive_hint is True  # type: ignore[union-attr]
        _, refs = await _observe(client, task_id)
        filled = await client.call_tool("computer__act", {"task_id": task_id, "act": {
            "kind": "fill", "ref": refs["Name"], "text": "Ada"}})
        again, refs = await _observe(client, task_id)
        clicked = await client.call_tool("computer__act", {"task_id": task_id, "act": {
            "kind": "click", "ref": refs["Next"]}})
    for result in (filled, clicked):
        assert not result.is_error and result.structured_content["outcome"] == "accepted"  # type: ignore[index]
    assert [a[0] for a in computers.browser.acts] == ["fill", "click"]
    with read(runtime.engine) as conn:
        rows = conn.execute(select(actions.c.tool, actions.c.content, verdicts.c.verdict)
                            .join(verdicts, verdicts.c.action_id == actions.c.id)
                            .order_by(actions.c.created_at)).all()
        outcomes = conn.execute(select(attempts.c.outcome).order_by(attempts.c.created_at)).scalars().all()
    assert [(r.tool, r.verdict) for r in rows] == [("computer__act", "admitted")] * 2
    contents = [json.loads(r.content) for r in rows]
    assert contents[0]["element"] == {"role": "textbox", "name": "Name"} and contents[0]["act"]["text"] == "Ada"
    assert contents[1]["observation"] == again["observation"]
    assert outcomes == ["accepted", "accepted"]
    assert computers.activities == ["observe", "act", "observe", "act"]  # the reaper sees each as busy


async def test_a_ref_from_before_an_act_is_refused_and_nothing_runs(
        setup: tuple[Runtime, FakeComputers, str], settings: Settings) -> None:
    runtime, computers, task_id = setup
    async with Client(_mcp(runtime, settings).server) as client:
        _, refs = await _observe(client, task_id)
        await client.call_tool("computer__act", {"task_id": task_id, "act": {"kind": "click", "ref": refs["Next"]}})
        stale = await client.call_tool("computer__act", {"task_id": task_id, "act": {
            "kind": "fill", "ref": refs["Name"], "text": "late"}})
    assert stale.is_error and stale.structured_content["error"]["code"] == "observation_required"  # type: ignore[index]
    assert [a[0] for a in computers.browser.acts] == ["click"]
    with read(runtime.engine) as conn:
        assert conn.execute(select(actions)).all().__len__() == 1  # the refused act never became an action
        assert conn.execute(select(refusals.c.code)).scalars().all() == ["observation_required"]


async def test_clicking_pay_waits_for_approval_and_runs_once_approved(
        setup: tuple[Runtime, FakeComputers, str], settings: Settings) -> None:
    runtime, computers, task_id = setup
    async with Client(_mcp(runtime, settings).server) as client:
        _, refs = await _observe(client, task_id)
        held = await client.call_tool("computer__act", {"task_id": task_id, "act": {
            "kind": "click", "ref": refs["Pay 19.99 EUR"]}})
    assert held.structured_content["status"] == "needs_approval"  # type: ignore[index]
    assert computers.browser.acts == []  # nothing touched the page
    (card,) = [m for m in messages(runtime.engine) if m.get("kind") == "approval_request"]
    assert "click button 'Pay 19.99 EUR'" in card["card"]["lines"][0]
    with write(runtime.engine) as conn:
        approvals.decide(conn, user_id=_owner(runtime), action_id=card["card"]["action_id"], approve=True,
                         actor="user:test", policy=Policy(), now=runtime.clock.now())
    assert runtime.actions.drain() == 1
    assert [a[0] for a in computers.browser.acts] == ["click"]
    assert runtime.actions.drain() == 0 and len(computers.browser.acts) == 1


def _owner(runtime: Runtime) -> str:
    from wakeful.server.store import users

    with read(runtime.engine) as conn:
        return users.user_id_by_name(conn, "owner")


async def test_an_approved_act_whose_observation_went_stale_is_blocked_not_run(
        setup: tuple[Runtime, FakeComputers, str], settings: Settings) -> None:
    runtime, computers, task_id = setup
    async with Client(_mcp(runtime, settings).server) as client:
        _, refs = await _observe(client, task_id)
        held = await client.call_tool("computer__act", {"task_id": task_id, "act": {
            "kind": "click", "ref": refs["Pay 19.99 EUR"]}})
        await _observe(client, task_id)  # the agent looked again meanwhile: the approved ref is no longer current
    action_id = held.structured_content["action_id"]  # type: ignore[index]
    with write(runtime.engine) as conn:
        approvals.decide(conn, user_id=_owner(runtime), action_id=action_id, approve=True, actor="user:test",
                         policy=Policy(), now=runtime.clock.now())
    runtime.actions.drain()
    assert computers.browser.acts == []
    with read(runtime.engine) as conn:
        attempt = conn.execute(select(attempts)).one()
    assert attempt.outcome == "blocked" and attempt.detail.startswith("stale_observation")


async def test_a_handoff_sends_the_user_a_link_and_refuses_agent_acts_until_control_returns(
        setup: tuple[Runtime, FakeComputers, str], settings: Settings) -> None:
    runtime, computers, task_id = setup
    async with Client(_mcp(runtime, settings).server) as client:
        _, refs = await _observe(client, task_id)
        handed = await client.call_tool("computer__request_handoff", {"task_id": task_id, "reason": "CAPTCHA"})
        refused = await client.call_tool("computer__act", {"task_id": task_id, "act": {
            "kind": "click", "ref": refs["Next"]}})
        assert not handed.is_error
        assert refused.is_error and refused.structured_content["error"]["code"] == "human_in_control"  # type: ignore[index]
        (link,) = [m["link"] for m in messages(runtime.engine) if m.get("kind") == "handoff"]
        assert link.startswith(f"http://{settings.host}:{settings.port}/v1/live/")
        computers.tc.return_control()
        after = await client.call_tool("computer__act", {"task_id": task_id, "act": {
            "kind": "click", "ref": refs["Next"]}})
        assert after.is_error  # control is back, but the epoch moved: observe first
        _, refs = await _observe(client, task_id)
        ok = await client.call_tool("computer__act", {"task_id": task_id, "act": {
            "kind": "click", "ref": refs["Next"]}})
    assert not ok.is_error and computers.browser.acts == [("click", 3)]
    assert "handoff" in computers.activities


async def test_a_paused_task_cannot_act_and_a_malformed_act_is_refused_with_its_field(
        setup: tuple[Runtime, FakeComputers, str], settings: Settings) -> None:
    runtime, computers, task_id = setup
    async with Client(_mcp(runtime, settings).server) as client:
        bad = await client.call_tool("computer__act", {"task_id": task_id, "act": {"kind": "click"}})
        assert bad.is_error and bad.content[0].text.startswith(  # type: ignore[union-attr]
            "invalid_arguments: computer__act: act.click.ref: Field required")
        _, refs = await _observe(client, task_id)
        with write(runtime.engine) as conn:
            from wakeful.server.store.tables import ControlKind

            control.set_task_state(conn, user_id=_owner(runtime), task_id=task_id, kind=ControlKind.PAUSE,
                                   actor="user:test", reason="wait", now=runtime.clock.now())
        paused = await client.call_tool("computer__act", {"task_id": task_id, "act": {
            "kind": "click", "ref": refs["Next"]}})
    assert paused.is_error and "paused" in paused.content[0].text  # type: ignore[union-attr]
    assert computers.browser.acts == []


@pytest.mark.parametrize(("tool", "args"), [
    ("computer__observe", {}), ("computer__act", {"act": {"kind": "click", "ref": "r1"}}),
    ("computer__request_handoff", {"reason": "CAPTCHA"})])
async def test_an_unknown_or_foreign_task_on_a_computer_tool_is_unknown_task_and_the_computer_is_not_asked(
        setup: tuple[Runtime, FakeComputers, str], settings: Settings, tool: str, args: dict[str, Any]) -> None:
    """Regression: SQLAlchemy's "No row was found" leaked out for a task that does not exist."""
    runtime, computers, owners_task = setup
    with write(runtime.engine) as conn:
        ensure_user(conn, name="mallory", now=runtime.clock.now())
    async with Client(_mcp(runtime, settings).server) as client:
        unknown = await client.call_tool(tool, {"task_id": "task_00nosuchtask", **args})
    mallory = WakefulMCP(engine=runtime.engine, clock=runtime.clock, settings=settings, tools=runtime.tools,
                         local_user="mallory")
    async with Client(mallory.server) as client:
        foreign = await client.call_tool(tool, {"task_id": owners_task, **args})
    for result in (unknown, foreign):
        assert result.is_error and result.content[0].text.startswith("unknown_task: "), result.content
        assert "No row" not in result.content[0].text  # type: ignore[union-attr]
    assert computers.activities == [] and computers.browser.acts == []


def test_the_sweeper_reaps_idle_tool_computers(setup: tuple[Runtime, FakeComputers, str]) -> None:
    runtime, computers, _ = setup
    runtime.sweep_once()
    assert computers.reaped == 1


class FakeVnc:
    """A loopback TCP server that greets like x11vnc and keeps what the viewer sent."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.connections += 1
                with conn:
                    conn.sendall(b"RFB 003.008\n")
                    while data := conn.recv(4096):
                        self.received += data

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def vnc(setup: tuple[Runtime, FakeComputers, str]) -> Iterator[dict[int, FakeVnc]]:
    """The guest's two x11vnc servers: 5900 takes input (handoff), 5901 is view only."""
    servers = {CONTROL_VNC_PORT: FakeVnc(), VIEW_VNC_PORT: FakeVnc()}
    setup[1].tc.vnc_port = lambda guest_port=CONTROL_VNC_PORT: servers[guest_port].port  # type: ignore[method-assign]
    yield servers
    for server in servers.values():
        server.close()


def test_the_live_view_link_works_once_bridges_the_screen_and_returning_control_ends_it(
        setup: tuple[Runtime, FakeComputers, str], settings: Settings, vnc: dict[int, FakeVnc]) -> None:
    runtime, computers, task_id = setup
    owner = _owner(runtime)
    binding = Binding(user_id=owner, task_id=task_id)
    before = runtime.tools.call(binding, "computer__observe", {})["epoch"]
    runtime.tools.call(binding, "computer__request_handoff", {"reason": "a CAPTCHA"})
    (link,) = [m["link"] for m in messages(runtime.engine) if m.get("kind") == "handoff"]
    path = link.split(str(settings.port), 1)[1]
    with TestClient(create_app(runtime, manage_runtime=False)) as client:
        redirect = client.get(path, follow_redirects=False)
        assert redirect.status_code == 303
        session_path = redirect.headers["location"]
        assert client.get(path, follow_redirects=False).status_code == 410  # the token works once
        page = client.get(session_path)
        assert page.status_code == 200 and "Return control" in page.text and "/novnc/core/rfb.js" in page.text
        assert "rfb.viewOnly = false" in page.text
        assert client.get("/novnc/core/rfb.js").status_code == 200
        with client.websocket_connect(f"{session_path}/ws", subprotocols=["binary"], headers=ORIGIN) as ws:
            assert ws.receive_bytes() == b"RFB 003.008\n"
            ws.send_bytes(b"RFB 003.008\n")
            with pytest.raises(Refused) as refused:
                runtime.tools.call(binding, "computer__act", {"act": {"kind": "scroll", "dy": 100,
                                                                      "observation": 1}})
            assert refused.value.code == "human_in_control"
        control = vnc[CONTROL_VNC_PORT]
        assert wait_until(lambda: bytes(control.received) == b"RFB 003.008\n", 5, "the viewer's bytes at x11vnc")
        assert vnc[VIEW_VNC_PORT].connections == 0
        assert client.post(f"{session_path}/return").status_code == 200
        assert client.get(session_path).status_code == 410  # the session ended with the lease
    assert computers.tc.lease is None
    seen = runtime.tools.call(binding, "computer__observe", {})
    assert seen["epoch"] > before  # control came back: a new epoch, observed afresh


ORIGIN = {"origin": "http://testserver"}
"""What a browser showing the live view's page on this server sends with its websocket."""


def test_a_leaked_live_view_url_is_worthless_in_any_browser_but_the_one_that_used_the_link(
        setup: tuple[Runtime, FakeComputers, str], settings: Settings, vnc: dict[int, FakeVnc]) -> None:
    runtime, computers, task_id = setup
    runtime.tools.call(Binding(user_id=_owner(runtime), task_id=task_id), "computer__request_handoff",
                       {"reason": "a login"})
    (link,) = [m["link"] for m in messages(runtime.engine) if m.get("kind") == "handoff"]
    with TestClient(create_app(runtime, manage_runtime=False)) as client:
        session_path = client.get(link.split(str(settings.port), 1)[1], follow_redirects=False).headers["location"]
        users_cookies = dict(client.cookies)
        client.cookies.clear()  # from here on, another browser that got hold of the URL
        assert client.get(session_path).status_code == 410
        assert client.post(f"{session_path}/return").status_code == 410
        with pytest.raises(WebSocketDisconnect) as closed, \
                client.websocket_connect(f"{session_path}/ws", headers=ORIGIN) as ws:
            ws.receive_bytes()
        assert closed.value.code == 4410
        assert computers.tc.lease is not None, "the stranger took nothing from the user"
        assert vnc[CONTROL_VNC_PORT].connections == 0
        client.cookies.update(users_cookies)
        assert client.get(session_path).status_code == 200


@pytest.mark.parametrize("origin", [{"origin": "http://evil.example"}, {"origin": "null"}, {}],
                         ids=["another site", "an opaque origin", "no browser"])
def test_the_live_view_websocket_refuses_a_page_that_is_not_the_servers_own(
        setup: tuple[Runtime, FakeComputers, str], settings: Settings, vnc: dict[int, FakeVnc],
        origin: dict[str, str]) -> None:
    runtime, _, task_id = setup
    runtime.tools.call(Binding(user_id=_owner(runtime), task_id=task_id), "computer__request_handoff",
                       {"reason": "a login"})
    (link,) = [m["link"] for m in messages(runtime.engine) if m.get("kind") == "handoff"]
    with TestClient(create_app(runtime, manage_runtime=False)) as client:
        session_path = client.get(link.split(str(settings.port), 1)[1], follow_redirects=False).headers["location"]
        with pytest.raises(WebSocketDisconnect) as closed, \
                client.websocket_connect(f"{session_path}/ws", headers=origin) as ws:
            ws.receive_bytes()
        assert closed.value.code == 4403
        assert client.post(f"{session_path}/return", headers={"origin": "http://evil.example"}).status_code == 403
        assert client.get(session_path).status_code == 200, "the refusals ended nothing"
    assert vnc[CONTROL_VNC_PORT].connections == 0


def _token(runtime: Runtime) -> str:
    from wakeful.server.store import users

    with write(runtime.engine) as conn:
        return users.issue_token(conn, user_id=_owner(runtime))


def test_a_view_only_link_shows_the_screen_from_the_view_only_server_and_takes_no_control(
        setup: tuple[Runtime, FakeComputers, str], clock: FakeClock, vnc: dict[int, FakeVnc]) -> None:
    runtime, computers, task_id = setup
    binding = Binding(user_id=_owner(runtime), task_id=task_id)
    auth = {"Authorization": f"Bearer {_token(runtime)}"}
    with TestClient(create_app(runtime, manage_runtime=False)) as client:
        assert client.post("/v1/live/view").status_code == 401
        too_short = client.post("/v1/live/view", headers=auth, json={"minutes": 0})
        assert too_short.status_code == 400 and too_short.json()["error"]["code"] == "malformed_body"
        issued = client.post("/v1/live/view", headers=auth, json={"minutes": 5})
        assert issued.status_code == 200 and issued.json()["view_only"] is True
        path = issued.json()["link"].removeprefix(str(client.base_url))
        session_path = client.get(path, follow_redirects=False).headers["location"]
        assert client.get(path, follow_redirects=False).status_code == 410  # once
        page = client.get(session_path)
        assert page.status_code == 200 and "view only" in page.text and "rfb.viewOnly = true" in page.text
        assert "Return control" not in page.text
        with client.websocket_connect(f"{session_path}/ws", subprotocols=["binary"], headers=ORIGIN) as ws:
            assert ws.receive_bytes() == b"RFB 003.008\n"
            ws.send_bytes(b"RFB 003.008\n")
            # Watching takes nothing from the agent: no lease, and its acts go on.
            assert computers.tc.lease is None
            seen = runtime.tools.call(binding, "computer__observe", {})
            assert runtime.tools.call(binding, "computer__act", {"act": {
                "kind": "scroll", "dy": 100, "observation": seen["observation"]}})["status"] == "done"
            assert client.post(f"{session_path}/return").status_code == 410  # no control to give back
            view = vnc[VIEW_VNC_PORT]
            assert wait_until(lambda: bytes(view.received) == b"RFB 003.008\n", 5, "the bytes at the view server")
            clock.advance(timedelta(minutes=5))  # the link's time is up: the open view is closed within a second
            with pytest.raises(WebSocketDisconnect):
                while True:
                    ws.receive_bytes()
        assert vnc[CONTROL_VNC_PORT].connections == 0, "a view-only session never reaches the server taking input"
        assert client.get(session_path).status_code == 410
        expired = client.post("/v1/live/view", headers=auth, json={"minutes": 1}).json()["link"]
        clock.advance(timedelta(minutes=1))
        assert client.get(expired.removeprefix(str(client.base_url)), follow_redirects=False).status_code == 410


async def test_the_policy_file_in_the_docs_makes_every_act_ask(engine: Engine, clock: FakeClock, owner: str,
                                                               settings: Settings) -> None:
    settings.policies.mkdir(parents=True, exist_ok=True)
    (settings.policies / "policy.toml").write_text('tiers = { computer__act = "ask" }\n')
    computers = FakeComputers(clock)
    runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine, computers=computers)
    runtime.prepare()
    binding = Binding(user_id=owner, task_id=_task(runtime, owner))
    seen = runtime.tools.call(binding, "computer__observe", {})
    ref = next(line.split("]")[0][1:] for line in seen["text"].splitlines() if '"Next"' in line)
    held = runtime.tools.call(binding, "computer__act", {"act": {"kind": "click", "ref": ref}})
    assert held["status"] == "needs_approval" and computers.browser.acts == []


def _task(runtime: Runtime, owner: str) -> str:
    with write(runtime.engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=runtime.clock.now())
        return control.create_task(conn, user_id=owner, session_id=session_id, title="t", now=runtime.clock.now())


def _fake_manager(tmp_path: Path, clock: FakeClock) -> VmManager:
    images = tmp_path / "images"
    images.mkdir()
    (images / "vmlinux").write_bytes(b"\x7fELF")
    (images / "base.qcow2").write_text("fake qcow2 size=1073741824\n")
    return VmManager(VmSettings(data_dir=tmp_path / "data", base_image=images / "base.qcow2",
                                kernel=images / "vmlinux", initrd=None, proxy_port=3129, idle_after=timedelta(0),
                                domain_prefix="wkt-"), FakeHypervisor(), clock=clock, disks=FakeDisks(),
                     port_free=lambda port: True)


def test_one_users_tool_computer_still_booting_holds_no_other_user_up(tmp_path: Path, clock: FakeClock) -> None:
    booting, release = threading.Event(), threading.Event()

    def connect(info: VmInfo) -> ToolComputer:
        if info.user == "usr_slow":  # its guest is still booting: connecting waits for it
            booting.set()
            release.wait(30)
        return FakeComputers(clock).tc

    computers = VmComputers(_fake_manager(tmp_path, clock), connect)
    slow = threading.Thread(target=computers.computer, args=("usr_slow",))
    slow.start()
    try:
        assert booting.wait(10)
        assert observe(computers, "usr_fast", "browser").title == "Checkout"  # not queued behind usr_slow's boot
        assert slow.is_alive()
    finally:
        release.set()
        slow.join(10)


def test_vm_computers_provision_with_a_proxy_credential_and_reconnect_after_a_restore(
        tmp_path: Path, clock: FakeClock) -> None:
    manager = _fake_manager(tmp_path, clock)
    built: list[FakeComputers] = []

    def connect(info: VmInfo) -> ToolComputer:
        built.append(FakeComputers(clock))
        return built[-1].tc

    computers = VmComputers(manager, connect,
                            credential=lambda user: ProxyCredential(user_id=user, token="tok-" + user))
    # A user's very first observe, as the tools make it (the VM is marked busy before it is asked for): provisions.
    epoch = observe(computers, "usr_1", "browser").observation.epoch
    assert manager.get("usr_1").proxy_credential == ProxyCredential(user_id="usr_1", token="tok-usr_1")
    tc = computers.computer("usr_1")
    clock.advance(timedelta(seconds=1))
    assert computers.reap() == ["usr_1"]  # idle (idle_after 0): suspended to disk
    assert computers.computer("usr_1") is tc  # restored in place, same tool computer, reconnected by the hook
    assert tc.observe().observation.epoch > epoch and len(built) == 1


def test_the_reaper_has_the_guest_drop_its_page_cache_before_suspending_it_and_suspends_it_if_that_fails(
        tmp_path: Path, clock: FakeClock) -> None:
    # Freed guest pages are zeroed and cost nothing to save: the saved state, and the restore, shrink by the cache.
    manager = _fake_manager(tmp_path, clock)
    channel = FakeChannel()

    def connect(info: VmInfo) -> ToolComputer:
        tc = ToolComputer(vm_id=info.name, channel=channel, clock=clock, browser=FakeBrowser())
        tc.connect()
        return tc

    computers = VmComputers(manager, connect)
    computers.computer("usr_1")
    clock.advance(timedelta(seconds=1))
    assert computers.reap() == ["usr_1"]
    assert channel.commands == [SHED_CACHE]
    computers.computer("usr_1")
    channel.handler = lambda cmd, data: RunResult(status=1, stdout=b"", stderr=b"Permission denied")
    clock.advance(timedelta(seconds=1))
    assert computers.reap() == ["usr_1"]
    assert manager.get("usr_1").state == "suspended"
