"""Principle 9 over MCP: the agent is recorded as the agent, and what it writes to a delegation never widens it.

An MCP client is the agent, not the user: its delegations and steers are labelled `agent:<user> via mcp` with
trust `agent`. A steer that narrows (or keeps) the task version takes effect at once; one that widens it is only
proposed, and takes effect when the user confirms it on the control channel. A paused, revoked or closed task and
a STOP refuse every agent steer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from fastapi.testclient import TestClient
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from sqlalchemy import Engine, select

from tests.integration.test_cli import run
from tests.support.acting import CANCEL_VERIFIED, World, world
from tests.support.serve import ServeProcess
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control
from wakeful.server.faces.http import create_app
from wakeful.server.faces.mcpserver import WakefulMCP
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, task_versions
from wakeful.server.store.users import issue_token

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- end to end on `wakeful serve`: the agent over streamable HTTP, the user over the HTTP API and the CLI ----------


def _ledger(server: ServeProcess, auth: dict[str, str], task_id: str) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = httpx.get(f"{server.url}/v1/tasks/{task_id}/ledger", headers=auth).json()[
        "entries"]
    return entries


async def test_the_agent_raising_its_own_spending_limit_waits_for_the_user_and_a_stop_refuses_it(
        tmp_path: Path) -> None:
    """The bug: over MCP, `steer_responsibility` raised the task's limit at once and was recorded as the user's."""
    token = run(tmp_path, "token").stdout.strip()
    auth = {"Authorization": f"Bearer {token}"}
    with ServeProcess({"WAKEFUL_DATA_DIR": str(tmp_path)}, log_path=tmp_path / "serve.log") as server:
        async with httpx2.AsyncClient(headers=auth) as http, \
                Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as agent:
            created = await agent.call_tool("create_responsibility", {
                "title": "cancel my subscription", "constraints": {"max_amount_cents": 5000}})
            task_id = created.structured_content["task_id"]
            raised = await agent.call_tool("steer_responsibility", {
                "task_id": task_id, "goal": "cancel my subscription", "constraints": {"max_amount_cents": 500000}})
            assert not raised.is_error, raised.content
            proposal = raised.structured_content
            assert (proposal["state"], proposal["version"]) == ("awaiting_user", 1), proposal
            assert any("max_amount_cents" in w and "500000" in w for w in proposal["widens"]), proposal

            status = httpx.get(f"{server.url}/v1/tasks/{task_id}", headers=auth).json()
            assert status["version"] == 1 and [s["steer_id"] for s in status["proposed_steers"]] == [
                proposal["steer_id"]]
            cards = [m["body"]["card"] for m in httpx.get(f"{server.url}/v1/messages", headers=auth).json()["messages"]
                     if m["body"].get("kind") == "steer_request"]
            assert [c["steer_id"] for c in cards] == [proposal["steer_id"]]
            assert any("raises max_amount_cents from 5000 to 500000" in line for line in cards[0]["lines"]), cards

            confirmed = httpx.post(f"{server.url}/v1/tasks/{task_id}/steers/{proposal['steer_id']}/confirm",
                                   headers=auth)
            assert confirmed.status_code == 200, confirmed.text
            assert (confirmed.json()["state"], confirmed.json()["version"]) == ("confirmed", 2)
            again = httpx.post(f"{server.url}/v1/tasks/{task_id}/steers/{proposal['steer_id']}/confirm", headers=auth)
            assert again.status_code == 409 and again.json()["error"]["code"] == "not_awaiting_user"

            entries = _ledger(server, auth, task_id)
            versions = {e["version"]: e for e in entries if e["type"] == "task_version"}
            assert versions[1]["created_by"].startswith("agent:") and versions[1]["created_by"].endswith(" via mcp")
            assert versions[2]["created_by"].startswith("user:")
            assert versions[2]["constraints"] == {"max_amount_cents": 500000}
            delegation = next(e for e in entries if e["type"] == "event" and e["source"] == "delegation")
            assert delegation["trust"] == "agent"
            (proposed,) = [e for e in entries if e["type"] == "steer_proposal"]
            assert proposed["proposed_by"].startswith("agent:") and proposed["state"] == "confirmed"
            said = [str(e.get("actor") or e.get("created_by") or "") for e in entries]
            assert not [who for who in said if who.startswith("user:") and "via mcp" in who], said

            run(tmp_path, "stop", "--reason", "enough")  # the STOP over everything, from the deployment's CLI
            lowered = await agent.call_tool("steer_responsibility", {
                "task_id": task_id, "goal": "cancel my subscription", "constraints": {"max_amount_cents": 100}})
            another = await agent.call_tool("create_responsibility", {"title": "while stopped"})
            assert lowered.is_error and lowered.content[0].text.startswith("stopped: "), lowered.content
            assert another.is_error and another.content[0].text.startswith("stopped: "), another.content
            assert httpx.get(f"{server.url}/v1/tasks/{task_id}", headers=auth).json()["version"] == 2


# -- in process: the MCP client against the server object, the user's HTTP app on the same database -------------


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner, policy=Policy(per_action_cents=10000)) as w:
        yield w


@pytest.fixture
def user_http(w: World, settings: Settings) -> Iterator[tuple[TestClient, dict[str, str]]]:
    runtime = Runtime(settings, handler=EchoHandler(), clock=w.clock, engine=w.engine, registry=w.tools.registry)
    runtime.prepare()
    with write(w.engine) as conn:
        token = issue_token(conn, user_id=w.owner)
    with TestClient(create_app(runtime, manage_runtime=False)) as client:
        yield client, {"Authorization": f"Bearer {token}"}


def mcp_for(w: World, settings: Settings) -> WakefulMCP:
    return WakefulMCP(engine=w.engine, clock=w.clock, settings=settings, tools=w.tools, local_user="owner")


def _versions(w: World, task_id: str) -> list[Any]:
    with read(w.engine) as conn:
        return conn.execute(select(task_versions).where(task_versions.c.task_id == task_id)
                            .order_by(task_versions.c.version)).all()


async def _delegated(agent: Client, **args: Any) -> str:
    created = await agent.call_tool("create_responsibility", {"title": "cancel it", **args})
    assert not created.is_error, created.content
    task_id: str = created.structured_content["task_id"]
    return task_id


async def _raise_proposed(w: World, settings: Settings) -> tuple[str, str]:
    """A delegation with a 5,000-cent limit whose agent asks to raise it to 9,000: the task and the proposal."""
    async with Client(mcp_for(w, settings).server) as agent:
        task_id = await _delegated(agent, constraints={"max_amount_cents": 5000})
        steered = await agent.call_tool("steer_responsibility", {
            "task_id": task_id, "goal": "cancel it", "constraints": {"max_amount_cents": 9000}})
    steer_id: str = steered.structured_content["steer_id"]
    return task_id, steer_id


async def test_a_steer_that_only_lowers_a_limit_takes_effect_at_once_as_the_agents(
        w: World, settings: Settings) -> None:
    async with Client(mcp_for(w, settings).server) as agent:
        task_id = await _delegated(agent, constraints={"max_amount_cents": 5000}, completion=CANCEL_VERIFIED)
        steered = await agent.call_tool("steer_responsibility", {
            "task_id": task_id, "goal": "cancel it", "constraints": {"max_amount_cents": 2000},
            "completion": CANCEL_VERIFIED})
    assert (steered.structured_content["state"], steered.structured_content["version"]) == ("applied", 2), steered
    v2 = _versions(w, task_id)[1]
    assert v2.created_by == f"agent:{w.owner} via mcp" and json.loads(v2.constraints) == {"max_amount_cents": 2000}


@pytest.mark.parametrize("change", [
    {"goal": "cancel it and order a flight"},
    {"completion": []},
    {"constraints": {"max_amount_cents": 5000, "recipients": ["a@example.com"]}},
    {"constraints": {}},
])
async def test_a_steer_that_widens_anything_is_only_proposed(w: World, settings: Settings,
                                                             change: dict[str, Any]) -> None:
    async with Client(mcp_for(w, settings).server) as agent:
        task_id = await _delegated(agent, constraints={"max_amount_cents": 5000}, completion=CANCEL_VERIFIED)
        steered = await agent.call_tool("steer_responsibility", {
            "task_id": task_id, "goal": "cancel it", "constraints": {"max_amount_cents": 5000},
            "completion": CANCEL_VERIFIED, **change})
    assert steered.structured_content["state"] == "awaiting_user", steered.content
    assert len(_versions(w, task_id)) == 1


async def test_the_user_rejects_a_proposed_steer_over_http_and_it_never_takes_effect(
        w: World, settings: Settings, user_http: tuple[TestClient, dict[str, str]]) -> None:
    client, auth = user_http
    task_id, steer_id = await _raise_proposed(w, settings)
    rejected = client.post(f"/v1/tasks/{task_id}/steers/{steer_id}/reject", headers=auth)
    assert rejected.status_code == 200 and rejected.json()["state"] == "rejected", rejected.text
    late = client.post(f"/v1/tasks/{task_id}/steers/{steer_id}/confirm", headers=auth)
    assert late.status_code == 409 and late.json()["error"]["code"] == "not_awaiting_user"
    assert len(_versions(w, task_id)) == 1
    assert client.post(f"/v1/tasks/{task_id}/steers/{steer_id}/maybe", headers=auth).json()["error"]["code"] == \
        "unknown_operation"
    assert client.post(f"/v1/tasks/{task_id}/steers/stp_nope/confirm", headers=auth).json()["error"]["code"] == \
        "unknown_steer"


async def test_a_proposal_the_user_steered_past_can_no_longer_be_confirmed(
        w: World, settings: Settings, user_http: tuple[TestClient, dict[str, str]]) -> None:
    client, auth = user_http
    task_id, steer_id = await _raise_proposed(w, settings)
    assert client.post(f"/v1/tasks/{task_id}/steer", json={"goal": "keep it"}, headers=auth).json()["version"] == 2
    stale = client.post(f"/v1/tasks/{task_id}/steers/{steer_id}/confirm", headers=auth)
    assert stale.status_code == 409 and "superseded" in stale.json()["error"]["message"], stale.text
    assert [v.goal for v in _versions(w, task_id)] == ["cancel it", "keep it"]


@pytest.mark.parametrize("kinds", [(ControlKind.PAUSE,), (ControlKind.REVOKE,), (ControlKind.CLOSE,)])
async def test_a_paused_revoked_or_closed_task_refuses_every_agent_steer(
        w: World, settings: Settings, kinds: tuple[ControlKind, ...]) -> None:
    async with Client(mcp_for(w, settings).server) as agent:
        task_id = await _delegated(agent, constraints={"max_amount_cents": 5000})
        with write(w.engine) as conn:
            for kind in kinds:
                control.set_task_state(conn, user_id=w.owner, task_id=task_id, kind=kind, actor="user:test",
                                       reason="", now=w.clock.now())
        narrowing = await agent.call_tool("steer_responsibility", {
            "task_id": task_id, "goal": "cancel it", "constraints": {"max_amount_cents": 100}})
    expected = {ControlKind.PAUSE: "paused", ControlKind.REVOKE: "revoked", ControlKind.CLOSE: "closed"}[kinds[-1]]
    assert narrowing.is_error and narrowing.content[0].text.startswith(f"{expected}: "), narrowing.content
    assert narrowing.structured_content["error"]["code"] == expected
    assert len(_versions(w, task_id)) == 1


async def test_a_users_own_stop_refuses_agent_steers_and_delegations(w: World, settings: Settings) -> None:
    async with Client(mcp_for(w, settings).server) as agent:
        task_id = await _delegated(agent)
        with write(w.engine) as conn:
            control.set_stop(conn, stopped=True, user_id=w.owner, actor=f"user:{w.owner}", reason="",
                             now=w.clock.now())
        steered = await agent.call_tool("steer_responsibility", {"task_id": task_id, "goal": "cancel it"})
        created = await agent.call_tool("create_responsibility", {"title": "another"})
    assert steered.is_error and steered.content[0].text.startswith("stopped: ")
    assert created.is_error and created.content[0].text.startswith("stopped: ")


async def test_an_agent_delegation_may_not_set_a_limit_above_the_users_policy(w: World, settings: Settings) -> None:
    async with Client(mcp_for(w, settings).server) as agent:
        over = await agent.call_tool("create_responsibility", {"title": "t",
                                                               "constraints": {"max_amount_cents": 10001}})
        within = await agent.call_tool("create_responsibility", {"title": "t",
                                                                 "constraints": {"max_amount_cents": 10000}})
    assert over.is_error and over.content[0].text.startswith("exceeds_user_limit: "), over.content
    assert not within.is_error, within.content


def test_the_user_confirms_a_proposed_steer_from_the_cli(w: World, settings: Settings, tmp_path: Path) -> None:
    mcp = mcp_for(w, settings)
    task_id = mcp.dispatch_tool(w.owner, "create_responsibility", {"title": "t",
                                                                   "constraints": {"max_amount_cents": 10}})["task_id"]
    steer_id = mcp.dispatch_tool(w.owner, "steer_responsibility", {"task_id": task_id, "goal": "t",
                                                                   "constraints": {"max_amount_cents": 99}})["steer_id"]
    assert f"{steer_id}: confirmed; {task_id} is at version 2" in run(tmp_path, "confirm", steer_id).stdout
    refused = run(tmp_path, "reject", steer_id, check=False)
    assert refused.returncode == 2 and "not_awaiting_user" in refused.stderr
    assert json.loads(_versions(w, task_id)[-1].constraints) == {"max_amount_cents": 99}
    assert _versions(w, task_id)[-1].created_by.startswith("cli:owner")
