"""Two kinds of credential (issue 18): an agent credential (`wakeful agent add NAME`) reaches the agent's tools at
`/mcp` and nothing else; the user's token reaches the control channel. Every route of the app that is not open to
anyone, and not the agent's own channel, answers an agent credential 403 `user_credential_required` — the routes
are listed from the app itself, so a route added later is checked without anyone remembering to.

Through the public surfaces: the CLI as a process, the real HTTP app on a loopback port, a real MCP client session
over streamable HTTP; on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from fastapi import FastAPI
from fastapi.routing import APIWebSocketRoute
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from sqlalchemy import Engine, select
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute

from tests.integration.test_cli import run
from tests.support.serve import serving
from wakeful.server.faces.auth import Kind, Principal
from wakeful.server.faces.gate import ControlGate
from wakeful.server.faces.http import ExactPath, WebhookInbox, create_app
from wakeful.server.runtime import Runtime
from wakeful.server.store.db import read
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import agent_credentials, events, steer_proposals, task_keys, task_versions, tasks

pytestmark = pytest.mark.anyio
BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)

REFUSED = "user_credential_required"
CONTROL_VERBS = ("approve", "deny", "pause", "resume", "revoke", "close", "reopen", "stop", "start", "confirm",
                 "reject", "preference", "secret", "grant", "egress")

OPEN: dict[tuple[str, str], str] = {
    ("GET", "/healthz"): "answers anyone: it says only that the server is up",
    ("GET", "/readyz"): "answers anyone: whether the database, proxy and libvirt answer; it names no user",
    ("GET", "/metrics"): "answers anyone on the listen address: aggregate numbers, no user's ID or name in a label",
    ("POST", "/v1/wake"): "takes no credential: it carries nothing and changes nothing",
    ("POST", "/v1/noop"): "takes no credential: the benchmarks' baseline",
    ("GET", "/v1/live/{token}"): "the one-time link is the credential",
    ("GET", "/v1/live/s/{session}"): "the redeeming browser's binder cookie is the credential",
    ("POST", "/v1/live/s/{session}/return"): "the redeeming browser's binder cookie is the credential",
    ("WS", "/v1/live/s/{session}/ws"): "the redeeming browser's binder cookie is the credential",
    ("GET", "/novnc/{path}"): "static files",
}
"""Routes that ask for no bearer token at all, and why. Nothing else is open."""

AGENT_CHANNEL = {("POST", "/mcp"), ("GET", "/mcp"), ("DELETE", "/mcp")}
"""The agent's own channel: an agent credential is for this."""


def console_route(route: tuple[str, str]) -> bool:
    """A page of the console (`server.faces.console`): its credential is a signed-in session's cookie, which only a
    user credential opens (`test_the_console_does_not_sign_in_an_agent_credential`); a bearer header is not read."""
    path = route[1]
    return not path.startswith(("/v1/", "/mcp", "/novnc/", "/.well-known/")) and path not in OPERATOR_PATHS


OPERATOR_PATHS = {"/healthz", "/readyz", "/metrics"}
"""For the operator's probes and scrapers, not for people: no console page."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def db_url(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def cli(tmp_path: Path, db_url: str, *args: str, check: bool = True) -> Any:
    return run(tmp_path, *args, "--database-url", db_url, check=check)


@pytest.fixture
def app(runtime: Runtime) -> Any:
    return create_app(runtime, manage_runtime=False)


@pytest.fixture
def base(app: Any) -> Iterator[str]:
    with serving(app) as url:
        yield url


def _routes(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(method, path) of every route the app serves (as tests/unit/test_docs.py lists them)."""
    for route in routes:
        if hasattr(route, "original_router"):  # FastAPI keeps an included router whole, with its prefix
            yield from _routes(route.original_router.routes, prefix + route.include_context.prefix)
        elif isinstance(route, Mount):
            yield "GET", prefix + route.path + "/{path}"
        elif isinstance(route, WebSocketRoute | APIWebSocketRoute):
            yield "WS", prefix + route.path
        elif isinstance(route, Route):
            for method in sorted((route.methods or {"GET"}) - {"HEAD", "OPTIONS"}):
                yield method, prefix + route.path
        else:
            raise AssertionError(f"a kind of route this test does not know how to list: {route!r}")


def served_routes(app: Any) -> set[tuple[str, str]]:
    assert isinstance(app, WebhookInbox) and isinstance(app.app, ExactPath)  # `/mcp` first, then the rest
    assert isinstance(app.app.app, ControlGate) and isinstance(app.app.app.app, FastAPI)
    return set(_routes(app.app.app.app.router.routes)) | {("POST", WebhookInbox.PREFIX + "{source}")}


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "x1", path)


def _code(response: httpx.Response) -> str | None:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


# -- the CLI ---------------------------------------------------------------------------------------------------


@BOTH
def test_agent_credentials_are_added_listed_and_revoked_with_the_cli(
        tmp_path: Path, db_url: str, engine: Engine, base: str) -> None:
    credential = cli(tmp_path, db_url, "agent", "add", "claude-code").stdout.strip()
    other = cli(tmp_path, db_url, "agent", "add", "cursor").stdout.strip()
    assert credential.startswith("wka_") and other.startswith("wka_") and credential != other
    again = cli(tmp_path, db_url, "agent", "add", "claude-code", check=False)
    assert again.returncode == 2 and "agent_exists" in again.stderr
    bad = cli(tmp_path, db_url, "agent", "add", "Claude Code", check=False)
    assert bad.returncode == 2 and "invalid_agent_name" in bad.stderr
    with read(engine) as conn:  # only digests are stored
        stored = {row.token_digest for row in conn.execute(select(agent_credentials))}
    assert credential not in stored and other not in stored and len(stored) == 2

    listed = json.loads(cli(tmp_path, db_url, "agent", "list", "--json").stdout)
    assert [(c["name"], c["revoked_at"]) for c in listed] == [("claude-code", None), ("cursor", None)]
    assert credential not in cli(tmp_path, db_url, "agent", "list").stdout

    tools_list = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    accept = {"Accept": "application/json, text/event-stream"}

    def mcp_status(token: str) -> httpx.Response:
        return httpx.post(f"{base}/mcp", headers=accept | {"Authorization": f"Bearer {token}"}, json=tools_list)

    assert mcp_status(credential).status_code != 401
    assert "claude-code is revoked" in cli(tmp_path, db_url, "agent", "revoke", "claude-code").stdout
    refused = mcp_status(credential)
    assert (refused.status_code, _code(refused)) == (401, "bad_token"), refused.text
    assert mcp_status(other).status_code != 401  # revoking one client leaves the others
    twice = cli(tmp_path, db_url, "agent", "revoke", "claude-code", check=False)
    assert twice.returncode == 2 and "unknown_agent" in twice.stderr
    listed = json.loads(cli(tmp_path, db_url, "agent", "list", "--json").stdout)
    assert [c["name"] for c in listed if c["revoked_at"]] == ["claude-code"]
    # the name is free again: a new credential, and the revoked one stays revoked
    renewed = cli(tmp_path, db_url, "agent", "add", "claude-code").stdout.strip()
    assert mcp_status(renewed).status_code != 401 and mcp_status(credential).status_code == 401


# -- the control channel refuses an agent credential, at every route -------------------------------------------


@BOTH
def test_an_agent_credential_is_refused_at_every_route_but_the_agents_own_and_the_open_ones(
        tmp_path: Path, db_url: str, app: Any, base: str) -> None:
    credential = cli(tmp_path, db_url, "agent", "add", "claude-code").stdout.strip()
    token = cli(tmp_path, db_url, "token").stdout.strip()
    routes = served_routes(app)
    assert ("POST", "/v1/actions/{action_id}/{decision}") in routes and ("POST", "/v1/live/view") in routes
    guarded = sorted(r for r in routes if r not in OPEN and r not in AGENT_CHANNEL and not console_route(r)
                     and not r[1].startswith(WebhookInbox.PREFIX))  # a webhook's signature authenticates it
    assert len(guarded) >= 15, guarded  # the control routes are listed, not missed

    def call(method: str, path: str, bearer: str, body: bytes = b"{}") -> httpx.Response:
        return httpx.request(method, f"{base}{_concrete(path)}", headers={
            "Authorization": f"Bearer {bearer}", "Content-Type": "application/json"},
            content=body if method in ("POST", "PUT", "PATCH") else None)

    let_through = []
    for method, path in guarded:
        assert method != "WS", f"a websocket route that asks for a token: {path}"
        for body in (b"{}", b'{"reason": "x", "text": "x", "title": "x", "goal": "x"}', b"not json"):
            answer = call(method, path, credential, body)
            if (answer.status_code, _code(answer)) != (403, REFUSED):
                let_through.append((method, path, body, answer.status_code, answer.text[:200]))
    assert not let_through, let_through

    # the user's token passes the same guard on every one of them (what the route then says is its own business)
    for method, path in guarded:
        answer = call(method, path, token)
        assert _code(answer) not in (REFUSED, "missing_token", "bad_token"), (method, path, answer.text)

    # and an open route asks for nothing: an exemption that starts asking for a token must leave this list
    for method, path in OPEN:
        if method != "WS" and (method, path) in routes:
            assert _code(call(method, path, credential)) not in (REFUSED, "missing_token", "bad_token"), path

    # the console's pages ignore a bearer header: without a session a page sends the browser to sign in, and a
    # form is refused (no session, no CSRF token), so an agent credential changes nothing there either
    pages = sorted(r for r in routes if console_route(r))
    assert ("POST", "/approvals/{action_id}/{decision}") in pages and ("POST", "/stop") in pages
    for method, path in pages:
        answer = httpx.request(method, f"{base}{_concrete(path)}", headers={"Authorization": f"Bearer {credential}"},
                               data={"reason": "x"} if method == "POST" else None)
        signed_out_pages = {("GET", "/signin"), ("GET", "/a/{token}")}  # the sign-in form; a link's bounce page
        allowed = (200, 303, 400, 401, 403, 404) if (method, path) in signed_out_pages else (303, 400, 401, 403, 404)
        assert answer.status_code in allowed, (method, path, answer.status_code)
        if answer.status_code == 303:
            assert answer.headers["location"].startswith("/signin"), (method, path)


@BOTH
def test_the_console_does_not_sign_in_an_agent_credential(tmp_path: Path, db_url: str, base: str) -> None:
    credential = cli(tmp_path, db_url, "agent", "add", "claude-code").stdout.strip()
    token = cli(tmp_path, db_url, "token").stdout.strip()
    with httpx.Client(base_url=base) as browser:
        form = browser.get("/signin")
        csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
        assert csrf, form.text
        refused = browser.post("/signin", data={"csrf": csrf.group(1), "token": credential, "next": "/"})
        assert refused.status_code == 403 and "agent credential" in refused.text
        assert "wakeful_console" not in browser.cookies
        csrf = re.search(r'name="csrf" value="([^"]+)"', browser.get("/signin").text)
        assert csrf
        signed_in = browser.post("/signin", data={"csrf": csrf.group(1), "token": token, "next": "/"})
        assert signed_in.status_code == 303 and signed_in.headers["location"] == "/"
        assert "wakeful_console" in browser.cookies


@BOTH
def test_the_refusal_comes_before_the_body_is_read_and_says_what_to_do(
        tmp_path: Path, db_url: str, base: str) -> None:
    credential = cli(tmp_path, db_url, "agent", "add", "claude-code").stdout.strip()
    huge = httpx.post(f"{base}/v1/tasks", headers={"Authorization": f"Bearer {credential}"},
                      content=b"x" * (1 << 20))
    assert (huge.status_code, _code(huge)) == (403, REFUSED)
    assert "wakeful token" in huge.json()["error"]["message"]
    documented = httpx.get(f"{base}/openapi.json", headers={
        "Authorization": f"Bearer {cli(tmp_path, db_url, 'token').stdout.strip()}"}).json()
    forbidden = documented["paths"]["/v1/actions/{action_id}/{decision}"]["post"]["responses"]["403"]
    assert REFUSED in forbidden["x-error-codes"]
    assert REFUSED not in json.dumps(documented["paths"]["/mcp"])


# -- the agent's channel takes it ------------------------------------------------------------------------------


@BOTH
async def test_an_agent_credential_calls_the_tools_over_streamable_http_and_is_recorded_as_that_agent(
        tmp_path: Path, db_url: str, engine: Engine, base: str) -> None:
    credential = cli(tmp_path, db_url, "agent", "add", "claude-code").stdout.strip()
    token = cli(tmp_path, db_url, "token").stdout.strip()
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {credential}"}) as http, \
            Client(streamable_http_client(f"{base}/mcp", http_client=http)) as agent:
        names = [t.name for t in (await agent.list_tools()).tools]
        created = await agent.call_tool("create_responsibility", {"title": "cancel my subscription"})
        assert not created.is_error, created.content
        task_id = created.structured_content["task_id"]
        status = await agent.call_tool("task_status", {"task_id": task_id})
        keyed = await agent.call_tool("add_task_key", {"task_id": task_id, "key": "ORD-1", "reason": "the order"})
        approvals = await agent.read_resource("wakeful://approvals")
    assert not status.is_error and status.structured_content["task_id"] == task_id, status.content
    assert not keyed.is_error, keyed.content
    assert json.loads(approvals.contents[0].text) == {"pending": []}  # type: ignore[union-attr]
    assert not [n for n in names if any(verb in n for verb in CONTROL_VERBS)], names  # no tool reaches control

    with read(engine) as conn:
        (version,) = conn.execute(select(task_versions).where(task_versions.c.task_id == task_id)).all()
        session_id = conn.execute(select(tasks.c.session_id).where(tasks.c.id == task_id)).scalar_one()
        said = conn.execute(select(events.c.trust, events.c.authority).where(events.c.session_id == session_id)).all()
    owner = version.created_by.removeprefix("agent:").split("/")[0]
    assert version.created_by == f"agent:{owner}/claude-code via mcp"
    assert said and {(e.trust, e.authority) for e in said} == {("agent", "agent")}  # its word satisfies no wait

    # the user sees it on the control channel, the agent does not get there
    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{base}/v1/tasks/{task_id}", headers=auth).json()["keys"][0]["bound_by"] == \
        f"agent:{owner}/claude-code via mcp"
    refused = httpx.post(f"{base}/v1/tasks/{task_id}/pause", headers={"Authorization": f"Bearer {credential}"})
    assert (refused.status_code, _code(refused)) == (403, REFUSED)
    assert httpx.post(f"{base}/v1/tasks/{task_id}/pause", headers=auth).json()["state"] == "paused"

    # the user's own token still works at /mcp, and what comes through it is still the agent's word
    async with httpx2.AsyncClient(headers=auth) as http, \
            Client(streamable_http_client(f"{base}/mcp", http_client=http)) as agent:
        second = (await agent.call_tool("create_responsibility", {"title": "book a table"})).structured_content
    with read(engine) as conn:
        by = conn.execute(select(task_versions.c.created_by).where(
            task_versions.c.task_id == second["task_id"])).scalar_one()
    assert by == f"agent:{owner} via mcp"


def test_the_longest_named_agent_fits_every_column_that_names_an_actor() -> None:
    longest = Principal(user_id=new_id("usr"), kind=Kind.AGENT, agent="a" * 40).actor
    columns = [task_versions.c.created_by, task_keys.c.bound_by, steer_proposals.c.proposed_by]
    assert all(len(longest) <= column.type.length for column in columns), (longest, len(longest))
