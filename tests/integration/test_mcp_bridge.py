"""`wakeful mcp`, the stdio bridge to a running server's `/mcp`, driven by the real `mcp` client over stdio as Claude
Code drives it: the tools, resources and records are the server's, the bridge holds no database, and it refuses to
start, in one plain line and exit 2, when it has no URL, no credential, or a credential the server refuses."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.server import MCPServer
from mcp.server.mcpserver import Context

from tests.support.computers import FakeComputers
from tests.support.records import messages
from tests.support.serve import WAKEFUL, ServeProcess, free_port, serving
from wakeful.proxy.clock import FakeClock
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store import agents, users
from wakeful.server.store.db import write

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass(frozen=True, kw_only=True)
class Served:
    url: str
    token: str
    data_dir: Path


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without a developer's WAKEFUL_* settings, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}, **extra}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One `wakeful serve` process for the module, with the owner's token."""
    data_dir = tmp_path_factory.mktemp("served")
    token = subprocess.run([str(WAKEFUL), "token", "--data-dir", str(data_dir)], env=_env(), capture_output=True,
                           text=True, check=True, timeout=60).stdout.strip()
    with ServeProcess({"WAKEFUL_DATA_DIR": str(data_dir)}, log_path=data_dir / "serve.log") as server:
        yield Served(url=server.url, token=token, data_dir=data_dir)


def bridge(url: str, token: str, *, cwd: Path | None = None) -> StdioServerParameters:
    """`wakeful mcp` as an MCP client launches it: the URL as an option, the credential in the environment."""
    return StdioServerParameters(command=str(WAKEFUL), args=["mcp", "--url", url], env=_env(WAKEFUL_AGENT_TOKEN=token),
                                 cwd=cwd)


@pytest.mark.parametrize("mode", ["auto", "legacy"], ids=["the 2026 protocol", "the handshake era"])
async def test_a_client_over_stdio_lists_reads_and_writes_through_the_bridge_on_the_servers_records(
        served: Served, tmp_path: Path, mode: Any) -> None:
    async with Client(bridge(served.url, served.token, cwd=tmp_path), mode=mode) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        created = await client.call_tool("create_responsibility", {"title": f"through the bridge ({mode})"})
        task_id = created.structured_content["task_id"]  # type: ignore[index]
        status = await client.call_tool("task_status", {"task_id": task_id})
        sent = await client.call_tool("send_to_user", {"task_id": task_id, "text": "on my way"})
        unknown = await client.call_tool("task_status", {"task_id": "task_nope"})
        resources = {str(r.uri) for r in (await client.list_resources()).resources}
    assert {"create_responsibility", "task_status", "send_to_user"} <= names
    assert not created.is_error and not status.is_error and not sent.is_error
    assert status.structured_content["title"] == f"through the bridge ({mode})"  # type: ignore[index]
    assert unknown.is_error and unknown.content[0].text.startswith("unknown_task: ")  # type: ignore[union-attr]
    assert f"wakeful://tasks/{task_id}" in resources
    # The server holds the records, labelled as the agent's; the bridge wrote no database of its own.
    over_http = httpx.get(f"{served.url}/v1/tasks/{task_id}", headers={"Authorization": f"Bearer {served.token}"})
    assert over_http.status_code == 200, over_http.text
    assert list(tmp_path.iterdir()) == []


def test_the_bridge_refuses_to_start_without_a_url_or_a_credential(tmp_path: Path) -> None:
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    cases = [
        ("missing_url", ["mcp"], _env(WAKEFUL_AGENT_TOKEN="wk_x")),
        ("missing_token", ["mcp", "--url", "http://127.0.0.1:8787"], _env()),
        ("missing_token", ["mcp", "--url", "http://127.0.0.1:8787", "--token-file", str(empty)], _env()),
        ("unreadable_token_file", ["mcp", "--url", "http://127.0.0.1:8787", "--token-file", str(tmp_path / "nope")],
         _env()),
        ("bad_url", ["mcp", "--url", "127.0.0.1:8787"], _env(WAKEFUL_AGENT_TOKEN="wk_x")),
    ]
    for code, args, env in cases:
        result = subprocess.run([str(WAKEFUL), *args], env=env, capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL, cwd=tmp_path)
        assert result.returncode == 2, (code, result.stderr)
        assert result.stderr.startswith(f"wakeful: {code}: "), (code, result.stderr)
        assert "Traceback" not in result.stderr and result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.token"]  # no data directory, no database


def test_a_credential_the_server_refuses_or_a_server_that_is_not_there_is_said_plainly(served: Served,
                                                                                      tmp_path: Path) -> None:
    token_file = tmp_path / "agent.token"
    token_file.write_text("wk_not-a-token-anyone-issued\n")
    for args, code in (([served.url, "--token-file", str(token_file)], "bad_token"),
                       ([f"http://127.0.0.1:{_closed_port()}"], "server_unreachable")):
        result = subprocess.run([str(WAKEFUL), "mcp", "--url", *args], env=_env(WAKEFUL_AGENT_TOKEN=served.token),
                                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"wakeful: {code}: "), result.stderr
        assert "Traceback" not in result.stderr


def test_the_credential_is_read_from_a_file(served: Served, tmp_path: Path) -> None:
    token_file = tmp_path / "agent.token"
    token_file.write_text(served.token + "\n")
    # stdin closed at once: the client is gone, so a bridge that started ends cleanly.
    result = subprocess.run([str(WAKEFUL), "mcp", "--url", served.url, "--token-file", str(token_file)],
                            env=_env(), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr


def _closed_port() -> int:
    return free_port()  # nothing listens there (the kernel just handed it out and it was released)


# -- handoff links live in the server ---------------------------------------------------------------------------------


@pytest.fixture
def runtime_with_computers(settings: Settings, clock: FakeClock) -> Runtime:
    runtime = Runtime(settings, handler=EchoHandler(), clock=clock, computers=FakeComputers(clock))
    runtime.prepare()
    return runtime


async def test_a_handoff_link_made_through_the_bridge_still_opens_after_the_bridge_exits(
        runtime_with_computers: Runtime, settings: Settings) -> None:
    runtime = runtime_with_computers
    with write(runtime.engine) as conn:
        token = users.issue_token(conn, user_id=users.user_id_by_name(conn, "owner"))
    with serving(create_app(runtime, manage_runtime=False)) as url:
        async with Client(bridge(url, token)) as client:
            task_id = (await client.call_tool("create_responsibility", {"title": "a login"})).structured_content[
                "task_id"]  # type: ignore[index]
            observed = await client.call_tool("computer__observe", {"task_id": task_id})
            handed = await client.call_tool("computer__request_handoff", {"task_id": task_id, "reason": "a login"})
        assert not observed.is_error and not handed.is_error, handed.content
        # The client is gone and the bridge process with it: the link is the server's, and opens.
        (link,) = [m["link"] for m in messages(runtime.engine) if m.get("kind") == "handoff"]
        path = link.split(str(settings.port), 1)[1]
        opened = httpx.get(f"{url}{path}", follow_redirects=False)
    assert opened.status_code == 303, opened.text
    assert opened.headers["location"].startswith("/v1/live/s/")


# -- what the bridge relays besides a call and its answer -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "legacy"], ids=["the 2026 protocol", "the handshake era"])
async def test_progress_a_server_streams_during_a_call_reaches_the_client_before_the_answer(mode: Any) -> None:
    # wakeful's own /mcp answers JSON (no handler streams), so a bare SDK server that does: the bridge relays any.
    streaming = MCPServer("streams")

    @streaming.tool()
    async def count(ctx: Context, upto: int) -> dict[str, int]:
        """Report progress, then answer."""
        for i in range(1, upto + 1):
            await ctx.report_progress(i, upto)
        return {"counted": upto}

    seen: list[float] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(progress)

    with serving(streaming.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")) as url:
        async with Client(bridge(url, "unused"), mode=mode) as client:
            result = await client.call_tool("count", {"upto": 3}, progress_callback=on_progress)
    assert not result.is_error and result.structured_content == {"counted": 3}
    assert seen == [1, 2, 3]


async def test_a_credential_revoked_while_the_bridge_runs_fails_the_next_call_plainly_instead_of_hanging(
        runtime_with_computers: Runtime) -> None:
    runtime = runtime_with_computers
    with write(runtime.engine) as conn:
        owner = users.user_id_by_name(conn, "owner")
        token = agents.add(conn, user_id=owner, name="bridge-test", now=runtime.clock.now())
    with serving(create_app(runtime, manage_runtime=False)) as url:
        async with Client(bridge(url, token)) as client:
            created = await client.call_tool("create_responsibility", {"title": "before the revocation"})
            with write(runtime.engine) as conn:
                agents.revoke(conn, user_id=owner, name="bridge-test", now=runtime.clock.now())
            with pytest.raises(MCPError) as refused:
                await client.call_tool("task_status", {"task_id": created.structured_content["task_id"]})  # type: ignore[index]
    assert not created.is_error
    assert "refused the credential (401)" in str(refused.value)
