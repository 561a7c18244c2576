"""`/mcp` behind the TLS reverse proxy of docs/deploy.md: the proxy forwards the public `Host` (nginx's
`proxy_set_header Host $host`, Caddy by default), and the server answers it when it is `public_url`'s, or the
listen address's; any other `Host` is still refused 421 (DNS-rebinding protection). Real requests, and a real MCP
client session, to a server on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.support.serve import serving
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import write
from wakeful.server.store.users import ensure_user

PUBLIC = "agent.example.org"
LISTEN = "wakeful.internal"
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "curl",
                                                                                            "version": "8"}}}


@contextmanager
def _serve(data_dir: Path, **settings: Any) -> Iterator[tuple[str, str]]:
    runtime = Runtime(Settings(data_dir=data_dir, proxy=False, computers=False, sources={}, **settings),
                      handler=EchoHandler())
    runtime.prepare()
    with write(runtime.engine) as conn:
        _, token = ensure_user(conn, name="someone", now=runtime.clock.now())
    assert token is not None
    try:
        with serving(create_app(runtime, manage_runtime=False)) as url:
            yield url, token
    finally:
        runtime.engine.dispose()


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A server told its public address, listening on loopback (`host` unset), reached there as the proxy does."""
    with _serve(tmp_path_factory.mktemp("proxied"), public_url=f"https://{PUBLIC}") as served:
        yield served


def _initialize(url: str, token: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}/mcp", json=INITIALIZE, timeout=10, headers={
        "Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream", **headers})


ANSWERED = [
    {"Host": PUBLIC, "X-Forwarded-Proto": "https"},  # nginx: `$host` has no port
    {"Host": f"{PUBLIC}:443", "X-Forwarded-Proto": "https"},  # a client that names the port, which Caddy keeps
    {"Host": PUBLIC, "Origin": f"https://{PUBLIC}"},  # a browser on the public address
    {"Host": "localhost:8787", "Origin": "http://localhost:8787"},  # this machine, as before
]
REFUSED = [
    ({"Host": "evil.example"}, 421, "misdirected_request"),
    ({"Host": f"{PUBLIC}.evil.example"}, 421, "misdirected_request"),
    ({"Host": f"evil{PUBLIC}"}, 421, "misdirected_request"),
    ({"Host": PUBLIC, "Origin": "https://evil.example"}, 403, "forbidden"),
    ({"Host": PUBLIC, "Origin": f"http://{PUBLIC}"}, 403, "forbidden"),  # public_url says https
]


def test_behind_the_documented_proxy_mcp_answers_public_url_s_host_and_refuses_any_other(
        proxied: tuple[str, str]) -> None:
    for headers in ANSWERED:
        response = _initialize(*proxied, headers)
        assert response.status_code == 200, (headers, response.text)
        assert response.json()["result"]["serverInfo"]["name"] == "wakeful"
    for headers, status, code in REFUSED:
        response = _initialize(*proxied, headers)
        assert (response.status_code, response.json()["error"]["code"]) == (status, code), headers


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_an_mcp_client_session_through_the_public_host_lists_and_calls_tools(
        proxied: tuple[str, str]) -> None:
    url, token = proxied
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}", "Host": PUBLIC,
                                           "X-Forwarded-Proto": "https"}) as http, \
            Client(streamable_http_client(f"{url}/mcp", http_client=http)) as client:
        names = [t.name for t in (await client.list_tools()).tools]
        created = await client.call_tool("create_responsibility", {"title": "through the proxy"})
    assert "create_responsibility" in names
    assert not created.is_error and created.structured_content["task_id"]


@pytest.mark.parametrize("listen", [LISTEN, "0.0.0.0"])
def test_mcp_answers_the_listen_address_and_refuses_any_other_host(tmp_path: Path, listen: str) -> None:
    """Regression: with `host` not a loopback address (`0.0.0.0` is the container image's) the SDK checked no Host
    at all."""
    with _serve(tmp_path, host=listen) as (url, token):
        assert _initialize(url, token, {"Host": f"{listen}:8787"}).status_code == (200 if listen == LISTEN else 421)
        assert _initialize(url, token, {"Host": "localhost:8787"}).status_code == 200
        assert _initialize(url, token, {"Host": "evil.example"}).status_code == 421
