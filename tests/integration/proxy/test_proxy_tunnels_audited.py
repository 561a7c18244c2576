"""An accepted CONNECT is audited itself, beside the requests inside it: the target, what became of the tunnel (the
TLS server name the client asked for, and for a tunnel that is not intercepted whether it matched), who opened it
(the user, and the label of the tool computer's credential once the server's decider has checked it).

The server's own decider and audit store (SQLite); rows read back through the reader of `GET /v1/egress`.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from pathlib import Path

import httpx
import pytest
from proxy_world import World, allow_rules, audited, recorded_world
from sqlalchemy import Engine

from wakeful.proxy.clock import FakeClock
from wakeful.server.egress import grants as egress
from wakeful.server.settings import Settings
from wakeful.server.store.db import write

pytestmark = pytest.mark.anyio


def credential(engine: Engine, clock: FakeClock, owner: str, label: str) -> str:
    with write(engine) as conn:
        _, token = egress.issue_client_token(conn, user_id=owner, label=label, now=clock.now())
    return f"{owner}:{token}"


async def open_tunnel(w: World, host: str, auth: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", w.proxy.port)
    target = f"{host}:{w.port_of(host)}"
    basic = base64.b64encode(auth.encode()).decode()
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {basic}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return reader, writer


async def test_an_intercepted_connect_has_its_own_row_before_the_requests_inside_it(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings, owner: str) -> None:
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        allow_rules(settings, w, ("shop", "merchant.test", '["GET"]'))
        auth = credential(engine, clock, owner, "laptop")
        request = f"GET /a HTTP/1.1\r\nHost: merchant.test:{w.merchant.port}\r\n\r\n".encode()
        assert (await w.raw(request, auth=auth))[0] == 200
        inside, tunnel = await audited(w, engine)
    assert (tunnel["method"], tunnel["host"], tunnel["port"], tunnel["path"], tunnel["verdict"], tunnel["code"],
            tunnel["user_id"], tunnel["client"]) == (
        "CONNECT", "merchant.test", w.merchant.port, "", "allow", None, owner, "tool_computer")
    assert "intercepted" in tunnel["rule"] and "TLS server name merchant.test" in tunnel["rule"]
    assert (inside["method"], inside["path"], inside["verdict"]) == ("GET", "/a", "allow")
    assert "laptop" in inside["rule"]  # the decider names the tool computer's credential by its label
    assert auth.partition(":")[2] not in str([inside, tunnel])


async def test_an_intercepted_connect_whose_client_never_speaks_tls_is_recorded_as_such(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings, owner: str) -> None:
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        reader, writer = await open_tunnel(w, "merchant.test", credential(engine, clock, owner, "laptop"))
        writer.write(b"GET / HTTP/1.1\r\nHost: merchant.test\r\n\r\n")  # plain HTTP where a ClientHello belongs
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # the proxy closes the tunnel
        writer.close()
        [row] = await audited(w, engine)
    assert (row["method"], row["host"], row["verdict"], row["user_id"]) == ("CONNECT", "merchant.test", "refuse", owner)
    assert "TLS handshake" in row["rule"]


async def test_a_tunnel_that_is_not_intercepted_records_the_server_name_check_and_the_client_label(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings, owner: str) -> None:
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        allow_rules(settings, w, ("pinned", "pinned.test", '["CONNECT"]'))
        auth = credential(engine, clock, owner, "laptop")
        user, _, token = auth.partition(":")
        async with httpx.AsyncClient(proxy=f"http://{user}:{token}@127.0.0.1:{w.proxy.port}", trust_env=False,
                                     verify=ssl.create_default_context(cafile=str(w.ca_file)), timeout=10) as client:
            assert (await client.get(w.url("pinned.test", "/"))).text == "pinned ok"
        reader, writer = await open_tunnel(w, "pinned.test", auth)
        fronted = ssl.create_default_context(cafile=str(w.ca_file))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            async with asyncio.timeout(10):  # another name through the pinned tunnel: closed, nothing relayed
                await writer.start_tls(fronted, server_hostname="other.test")
                await reader.read()
        writer.close()
        fronting, tunnelled = await audited(w, engine)
    assert (tunnelled["method"], tunnelled["host"], tunnelled["verdict"], tunnelled["user_id"]) == (
        "CONNECT", "pinned.test", "allow", owner)
    assert "TLS server name pinned.test matches" in tunnelled["rule"] and "laptop" in tunnelled["rule"]
    assert (fronting["method"], fronting["verdict"], fronting["code"]) == ("CONNECT", "refuse", "header_mismatch")
    assert "other.test" in fronting["rule"]


async def test_a_connect_that_names_no_one_is_recorded_as_the_connector_calls(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings) -> None:
    async with recorded_world(tmp_path, engine, clock, settings) as w, httpx.AsyncClient(
            proxy=f"http://127.0.0.1:{w.proxy.port}", trust_env=False, timeout=10,
            verify=ssl.create_default_context(cafile=str(w.deployment_ca))) as connector:
        response = await connector.get(w.url("merchant.test", "/v1/order"), headers={"X-Wakeful-Attempt": "no-grant"})
        assert response.headers["x-wakeful-refusal"] == "not_admitted"
        await connector.aclose()
        inside, tunnel = await audited(w, engine)
    assert (tunnel["method"], tunnel["client"], tunnel["user_id"], tunnel["verdict"]) == (
        "CONNECT", "connector", None, "allow")
    assert (inside["client"], inside["code"]) == ("connector", "not_admitted")
