"""The MCP server through the real `mcp` client: in-process, over stdio (the docs' command) and streamable HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from sqlalchemy import Engine

from tests.support.acting import World, world
from tests.support.records import messages
from tests.support.serve import ServeProcess
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting.policy import Policy
from wakeful.server.faces.mcpserver import WakefulMCP
from wakeful.server.store.db import write
from wakeful.server.store.users import ensure_user

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


async def test_followups_are_capped(w: World, settings: Any) -> None:
    settings.followup_cap = 1
    async with Client(mcp_for(w, settings).server) as client:
        task_id = (await client.call_tool("create_responsibility", {"title": "t"})).structured_content["task_id"]
        first = await client.call_tool("schedule_followup", {"task_id": task_id, "in_seconds": 3600})
        second = await client.call_tool("schedule_followup", {"task_id": task_id, "in_seconds": 3600})
    assert not first.is_error
    assert second.is_error and second.content[0].text.startswith("cap_exceeded")


async def test_the_stdio_command_from_the_docs_lists_tools_and_calls_one(tmp_path: Path) -> None:
    wakeful = str(Path(sys.executable).parent / "wakeful")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")},
           "WAKEFUL_DATA_DIR": str(tmp_path)}
    async with Client(StdioServerParameters(command=wakeful, args=["mcp"], env=env)) as client:
        names = [t.name for t in (await client.list_tools()).tools]
        created = await client.call_tool("create_responsibility", {"title": "over stdio"})
    assert "create_responsibility" in names
    assert created.structured_content["task_id"].startswith("task_")




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
