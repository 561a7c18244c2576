"""The MCP server through the real `mcp` client: in-process and over streamable HTTP (stdio goes through the bridge:
test_mcp_bridge.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from sqlalchemy import Engine, select

from tests.support.acting import CANCEL_VERIFIED, World, world
from tests.support.computers import FakeComputers
from tests.support.records import messages
from tests.support.serve import ServeProcess
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control, inbox
from wakeful.server.faces.mcpserver import WakefulMCP
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, task_versions, tasks
from wakeful.server.store.users import ensure_user, set_zone

pytestmark = pytest.mark.anyio

CONTROL_OPERATIONS = {"approve", "deny", "pause", "resume", "revoke", "stop", "start", "close", "reopen"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner, policy=Policy()) as w:
        yield w


def mcp_for(w: World, settings: Any, user: str = "owner") -> WakefulMCP:
    return WakefulMCP(engine=w.engine, clock=w.clock, settings=settings, tools=w.tools, local_user=user)


HINTS = ("read_only_hint", "destructive_hint", "idempotent_hint", "open_world_hint")
ANNOTATIONS = {  # read-only, destructive, idempotent, open-world
    "create_responsibility": (False, False, False, False),   # a new task on every call
    "steer_responsibility": (False, True, False, False),     # voids the old version's approvals and objects
    "task_status": (True, False, True, False),
    "send_to_user": (False, False, False, True),             # a message leaves for the user
    "schedule_followup": (False, False, False, False),       # a new timer on every call
    "wait_for_reply": (False, False, False, False),          # a new wait on every call
    "keep_checking": (False, False, False, False),           # a new check on every call
    "list_timers": (True, False, True, False),
    "cancel_timer": (False, False, True, False),             # narrows; a second call finds nothing open
    "add_task_key": (False, False, False, False),            # a binding record, each with its reason
    "remember": (False, False, False, False),                # a proposed memory record, or its refusal: both kept
    **dict.fromkeys(["merchant__list_subscriptions", "merchant__get_subscription", "airline__get_booking",
                     "airline__search_flights", "hotel__quote_stay", "hotel__get_quote", "mail__read_thread",
                     "airline__read_booking"],
                    (True, False, True, True)),
    # a write proposes an action (admitted or held for the user's approval); the same call again is that action
    **dict.fromkeys(["merchant__cancel_renewal", "airline__order_flight", "hotel__book_quote", "mail__reply"],
                    (False, True, True, True)),
    "computer__observe": (True, False, True, True),
    "computer__act": (False, True, False, True),
    "computer__request_handoff": (False, False, False, True),  # the user gets a link; nothing is lost
}


async def test_every_listed_tools_annotations_are_true_to_what_it_does(w: World, settings: Any) -> None:
    w.tools.attach_computers(FakeComputers(w.clock), dispatch_now=lambda action_id: None,
                             notify=lambda binding, token: None)
    async with Client(mcp_for(w, settings).server) as client:
        listed = {t.name: t.annotations for t in (await client.list_tools()).tools}
    assert {name: tuple(getattr(a, hint) for hint in HINTS) for name, a in listed.items()} == ANNOTATIONS


async def test_every_tool_has_schemas_and_honest_annotations(w: World, settings: Any) -> None:
    async with Client(mcp_for(w, settings).server) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert {"create_responsibility", "task_status", "send_to_user", "schedule_followup",
            "merchant__list_subscriptions", "merchant__cancel_renewal"} <= set(tools)
    for tool in tools.values():
        assert tool.input_schema["type"] == "object" and tool.output_schema is not None
        assert tool.annotations is not None
    assert tools["merchant__list_subscriptions"].annotations.read_only_hint is True
    cancel = tools["merchant__cancel_renewal"]
    assert cancel.annotations.destructive_hint is True and cancel.annotations.read_only_hint is False
    assert "task_id" in cancel.input_schema["required"]


@pytest.mark.parametrize("uri", ["wakeful://tasks/tsk_nope", "wakeful://tasks/tsk_nope/ledger", "wakeful://nothing"])
async def test_reading_an_unknown_resource_is_a_coded_error_not_an_internal_one(w: World, settings: Any,
                                                                                uri: str) -> None:
    from mcp.shared.exceptions import MCPError

    async with Client(mcp_for(w, settings).server) as client:
        with pytest.raises(MCPError) as refused:
            await client.read_resource(uri)
    assert refused.value.error.message.startswith(("unknown_task: ", "unknown_resource: ")), refused.value.error


async def test_control_operations_are_not_tools(w: World, settings: Any) -> None:
    async with Client(mcp_for(w, settings).server) as client:
        names = [t.name for t in (await client.list_tools()).tools]
        refused = await client.call_tool("approve", {"action_id": "act_x"})
    assert not [n for n in names if any(part in CONTROL_OPERATIONS for part in n.split("_"))]
    assert refused.is_error


async def test_a_delegation_read_and_write_end_in_an_approval_request_not_an_effect(w: World, settings: Any) -> None:
    async with Client(mcp_for(w, settings).server) as client:
        created = await client.call_tool("create_responsibility", {"title": "cancel my subscription"})
        task_id = created.structured_content["task_id"]
        listed = await client.call_tool("merchant__list_subscriptions", {"task_id": task_id})
        (sub,) = listed.structured_content["objects"]
        proposed = await client.call_tool("merchant__cancel_renewal", {"task_id": task_id, "subscription": sub["id"]})
        status = await client.call_tool("task_status", {"task_id": task_id})
        approvals = await client.read_resource("wakeful://approvals")
    assert proposed.structured_content["status"] == "needs_approval"
    assert status.structured_content["actions"][0]["verdict"] == "needs_approval"
    assert proposed.structured_content["action_id"] in approvals.contents[0].text
    w.dispatcher.drain()
    assert w.merchant.effects == []  # only the user's approval, on the control channel, can release it


async def test_a_made_up_object_id_is_an_error_with_a_stable_code(w: World, settings: Any) -> None:
    async with Client(mcp_for(w, settings).server) as client:
        task_id = (await client.call_tool("create_responsibility", {"title": "t"})).structured_content["task_id"]
        result = await client.call_tool("merchant__cancel_renewal", {"task_id": task_id, "subscription": "sub_1"})
    assert result.is_error and result.content[0].text.startswith("unknown_object: ")
    assert w.merchant.effects == []


async def test_another_users_task_is_unknown_to_this_user(w: World, settings: Any) -> None:
    with write(w.engine) as conn:
        ensure_user(conn, name="mallory", now=w.clock.now())
    async with Client(mcp_for(w, settings).server) as owner_client:
        task_id = (await owner_client.call_tool("create_responsibility", {"title": "mine"})).structured_content[
            "task_id"]
    async with Client(mcp_for(w, settings, user="mallory").server) as other:
        status = await other.call_tool("task_status", {"task_id": task_id})
        listed = await other.call_tool("merchant__list_subscriptions", {"task_id": task_id})
    assert status.is_error and status.content[0].text.startswith("unknown_task")
    assert listed.is_error and listed.content[0].text.startswith("unknown_task")


async def test_keys_given_at_delegation_and_added_later_lead_deliveries_to_the_task(w: World, settings: Any) -> None:
    with write(w.engine) as conn:
        ensure_user(conn, name="mallory", now=w.clock.now())
    async with Client(mcp_for(w, settings).server) as client:
        created = await client.call_tool("create_responsibility", {"title": "trip", "keys": ["PNR7Q2"]})
        task_id = created.structured_content["task_id"]
        added = await client.call_tool("add_task_key", {"task_id": task_id, "key": "ORDER-42", "reason": "found it"})
        taken = await client.call_tool("create_responsibility", {"title": "again", "keys": ["ORDER-42"]})
        absurd = await client.call_tool("add_task_key", {"task_id": task_id, "key": "a b", "reason": "x"})
        status = await client.call_tool("task_status", {"task_id": task_id})
    async with Client(mcp_for(w, settings, user="mallory").server) as other:
        foreign = await other.call_tool("add_task_key", {"task_id": task_id, "key": "MINE", "reason": "steal it"})
        theirs = await other.call_tool("create_responsibility", {"title": "theirs", "keys": ["PNR7Q2"]})
    assert added.structured_content == {"task_id": task_id, "key": "ORDER-42", "bound": True}
    assert taken.is_error and taken.content[0].text.startswith("task_key_taken: ")
    assert absurd.is_error and absurd.content[0].text.startswith("invalid_arguments: ")
    assert foreign.is_error and foreign.content[0].text.startswith("unknown_task: ")
    assert not theirs.is_error  # another user's identical key is their own
    keys = status.structured_content["keys"]
    assert [(k["key"], k["bound_by"]) for k in keys] == [("PNR7Q2", f"agent:{w.owner} via mcp"),
                                                         ("ORDER-42", f"agent:{w.owner} via mcp")]
    with write(w.engine) as conn:
        recorded = inbox.record(conn, inbox.Delivery(user_id=w.owner, source="hook", source_id="d-1", payload={},
                                                     corr_key="ORDER-42"), now=w.clock.now())
        assert recorded.session_id == conn.execute(select(tasks.c.session_id).where(tasks.c.id == task_id)).scalar()


async def test_followups_are_capped(w: World, settings: Any) -> None:
    settings.followup_cap = 1
    async with Client(mcp_for(w, settings).server) as client:
        task_id = (await client.call_tool("create_responsibility", {"title": "t"})).structured_content["task_id"]
        first = await client.call_tool("schedule_followup", {"task_id": task_id, "in_seconds": 3600})
        second = await client.call_tool("schedule_followup", {"task_id": task_id, "in_seconds": 3600})
    assert not first.is_error
    assert second.is_error and second.content[0].text.startswith("cap_exceeded")


async def test_an_mcp_client_keeps_time_for_a_task_within_its_caps(w: World, settings: Any) -> None:
    settings.check_wakes_per_day = 1
    with write(w.engine) as conn:
        set_zone(conn, user_id=w.owner, name="Asia/Hong_Kong")
    w.clock.set(datetime(2026, 12, 2, 12, 0, tzinfo=UTC))
    async with Client(mcp_for(w, settings).server) as client:
        task_id = (await client.call_tool("create_responsibility", {"title": "trip"})).structured_content["task_id"]
        check = await client.call_tool("keep_checking", {"task_id": task_id, "note": "prices", "cron": "0 9 * * *"})
        over = await client.call_tool("keep_checking", {"task_id": task_id, "note": "more", "cron": "0 21 * * *"})
        wait = await client.call_tool("wait_for_reply", {"task_id": task_id, "key": "thread-9", "note": "the client",
                                                         "until": "2026-12-04T09:00:00+08:00"})
        listed = await client.call_tool("list_timers", {"task_id": task_id})
        cancelled = await client.call_tool("cancel_timer", {"task_id": task_id,
                                                            "id": wait.structured_content["wait_id"]})
        again = await client.call_tool("cancel_timer", {"task_id": task_id, "id": wait.structured_content["wait_id"]})
        status = await client.call_tool("task_status", {"task_id": task_id})
    assert check.structured_content["said"] == "checks prices every day at 09:00 Asia/Hong_Kong; next 2026-12-03 09:00"
    assert over.is_error and over.content[0].text.startswith("wake_budget_exceeded: ")
    assert wait.structured_content["deadline"] == "2026-12-04T01:00:00+00:00"
    assert [x["said"] for x in listed.structured_content["waits"]] == [
        "waits for the client until 2026-12-04 09:00 Asia/Hong_Kong; then looks again"]
    assert not cancelled.is_error and again.is_error and again.content[0].text.startswith("unknown_timer: ")
    assert status.structured_content["waits"] == [] and len(status.structured_content["timers"]) == 1


async def test_a_paused_or_stopped_task_takes_no_new_timers_or_waits(w: World, settings: Any) -> None:
    def control_as_user(**change: Any) -> None:
        with write(w.engine) as conn:
            if "kind" in change:
                control.set_task_state(conn, user_id=w.owner, actor="user:test", reason="test", now=w.clock.now(),
                                       **change)
            else:
                control.set_stop(conn, user_id=w.owner, actor="user:test", reason="test", now=w.clock.now(),
                                 **change)

    async with Client(mcp_for(w, settings).server) as client:
        task_id = (await client.call_tool("create_responsibility", {"title": "t"})).structured_content["task_id"]
        control_as_user(task_id=task_id, kind=ControlKind.PAUSE)
        paused = await client.call_tool("keep_checking", {"task_id": task_id, "note": "n", "every_seconds": 3600})
        control_as_user(task_id=task_id, kind=ControlKind.RESUME)
        control_as_user(stopped=True)
        stopped = await client.call_tool("wait_for_reply", {"task_id": task_id, "key": "k", "note": "n",
                                                            "within_seconds": 3600})
        listed = await client.call_tool("list_timers", {"task_id": task_id})
    assert paused.is_error and paused.content[0].text.startswith("paused: ")
    assert stopped.is_error and stopped.content[0].text.startswith("stopped: ")
    assert listed.structured_content == {"timers": [], "waits": []}


async def test_streamable_http_on_wakeful_serve_needs_the_users_token(tmp_path: Path) -> None:
    wakeful = str(Path(sys.executable).parent / "wakeful")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}, "WAKEFUL_DATA_DIR": str(tmp_path)}
    token = subprocess.run([wakeful, "token"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    other = subprocess.run([wakeful, "user-add", "mallory"], env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    with ServeProcess({"WAKEFUL_DATA_DIR": str(tmp_path)}, log_path=tmp_path / "serve.log") as server:
        url = f"{server.url}/mcp"
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http, \
                Client(streamable_http_client(url, http_client=http)) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            task_id = (await client.call_tool("create_responsibility", {"title": "over http"})).structured_content[
                "task_id"]
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {other}"}) as http, \
                Client(streamable_http_client(url, http_client=http)) as client:
            foreign = await client.call_tool("task_status", {"task_id": task_id})
        for headers in ({}, {"Authorization": "Bearer wk_not-a-token"}):
            response = httpx.post(url, headers=headers | {"Accept": "application/json, text/event-stream"},
                                  json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            assert response.status_code == 401
    assert "create_responsibility" in names
    assert foreign.is_error and foreign.content[0].text.startswith("unknown_task")


async def test_send_to_user_goes_through_the_outbox_to_the_user_only(w: World, settings: Any) -> None:
    async with Client(mcp_for(w, settings).server) as client:
        task_id = (await client.call_tool("create_responsibility", {"title": "t"})).structured_content["task_id"]
        sent = await client.call_tool("send_to_user", {"task_id": task_id, "text": "All done."})
        to_someone = await client.call_tool("send_to_user", {"task_id": task_id, "text": "x", "to": "a@evil.test"})
    assert sent.structured_content["state"] == "queued"
    assert [m["text"] for m in messages(w.engine) if m.get("via") == "mcp"] == ["All done."]
    assert to_someone.is_error and to_someone.content[0].text.startswith("invalid_arguments")


async def test_a_completion_with_a_verify_read_is_accepted_not_a_dangling_schema_reference(
        w: World, settings: Any) -> None:
    """Regression: the nested `Verify` model's `$defs` were lost when the completion schema was embedded, so a
    schema-valid `verify` failed with `PointerToNowhere: '/$defs/Verify'` instead of being recorded."""
    async with Client(mcp_for(w, settings).server) as client:
        created = await client.call_tool("create_responsibility", {"title": "cancel", "completion": CANCEL_VERIFIED})
        task_id = created.structured_content["task_id"]
        # the same goal and conditions: a steer that widens nothing applies at once, even from the agent
        steered = await client.call_tool("steer_responsibility", {"task_id": task_id, "goal": "cancel",
                                                                  "completion": CANCEL_VERIFIED})
    assert not created.is_error, created.content
    assert not steered.is_error and steered.structured_content["version"] == 2, steered.content
    with read(w.engine) as conn:
        recorded = conn.execute(select(task_versions.c.completion).where(task_versions.c.task_id == task_id)
                                .order_by(task_versions.c.version)).scalars().all()
    assert [json.loads(c) for c in recorded] == [CANCEL_VERIFIED, CANCEL_VERIFIED]


@pytest.mark.parametrize("tool", ["merchant__list_subscriptions", "merchant__cancel_renewal"])
async def test_an_unknown_task_on_a_connector_tool_is_unknown_task_not_a_database_error(
        w: World, settings: Any, tool: str) -> None:
    """Regression: SQLAlchemy's "No row was found" leaked out of the tool layer for a task that does not exist."""
    async with Client(mcp_for(w, settings).server) as client:
        result = await client.call_tool(tool, {"task_id": "task_00nosuchtask", "subscription": "obj_01abc"}
                                        if tool.endswith("cancel_renewal") else {"task_id": "task_00nosuchtask"})
    assert result.is_error
    assert result.content[0].text.startswith("unknown_task: "), result.content[0].text
    assert "task_00nosuchtask" in result.content[0].text and "No row" not in result.content[0].text
