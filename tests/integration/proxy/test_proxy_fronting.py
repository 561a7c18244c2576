"""Fronting through an untouched tunnel: for a host in `egress_no_intercept`, the TLS server name the client asks
for must be the CONNECT target's. The ClientHello is read before anything is relayed; a mismatch or a missing
server name closes the tunnel and nothing reaches the upstream."""

from __future__ import annotations

import asyncio
import base64
import ssl
from pathlib import Path

import pytest
from proxy_world import CLIENT_TOKEN, World, allow_tool, world

pytestmark = pytest.mark.anyio


async def through_pinned_tunnel(w: World, sni: str | None) -> bytes:
    """CONNECT pinned.test, then a TLS handshake naming `sni` and one request; what came back (b"" if cut)."""
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection("127.0.0.1", w.proxy.port)
        try:
            auth = base64.b64encode(f"usr_1:{CLIENT_TOKEN}".encode()).decode()
            target = f"pinned.test:{w.pinned.port}"
            writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
                         .encode())
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            context = ssl.create_default_context(cafile=str(w.ca_file))
            context.check_hostname = False  # the upstream's leaf names every test host: the name is the attack
            try:
                await writer.start_tls(context, server_hostname=sni)
            except (ssl.SSLError, ConnectionError):
                return b""
            writer.write(b"GET /fronted HTTP/1.1\r\nHost: evil.test\r\n\r\n")
            await writer.drain()
            try:
                return await reader.read(65536)
            except (ssl.SSLError, ConnectionError):
                return b""
        finally:
            writer.close()


@pytest.mark.parametrize("sni", ["evil.test", None])
async def test_a_client_hello_naming_another_host_or_none_is_refused_before_anything_is_relayed(
        tmp_path: Path, sni: str | None) -> None:
    async with world(tmp_path, allow_tool(None)) as w:
        answer = await through_pinned_tunnel(w, sni)
        assert b"pinned ok" not in answer
        assert w.pinned.connections == 0 and bytes(w.pinned.received) == b""
        [record] = await w.decider.wait_records(1, tunnels=True)
        assert (record.method, record.verdict, record.code) == ("CONNECT", "refuse", "header_mismatch")
        assert record.bytes_up == 0


async def test_a_client_hello_naming_the_connect_target_is_relayed(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None)) as w:
        answer = await through_pinned_tunnel(w, "PINNED.test")
        assert b"pinned ok" in answer and b"GET /fronted" in bytes(w.pinned.received)
        [record] = await w.decider.wait_records(1, tunnels=True)
        assert (record.method, record.verdict) == ("CONNECT", "allow")
