"""Hosts that are not intercepted: one decision for the CONNECT, then bytes both ways, and no credential ever."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import pytest
from proxy_world import CLIENT_TOKEN, SECRET, allow_tool, refusal_code, refuse_all, world

pytestmark = pytest.mark.anyio



def end_to_end(w_proxy_port: int, upstream_ca: Path) -> httpx.AsyncClient:
    # The client verifies the upstream's own certificate: the proxy is not in the TLS session at all.
    return httpx.AsyncClient(proxy=f"http://usr_1:{CLIENT_TOKEN}@127.0.0.1:{w_proxy_port}", trust_env=False,
                             verify=ssl.create_default_context(cafile=str(upstream_ca)), timeout=10)


async def test_a_pinned_host_is_decided_once_as_connect_and_tunnelled_without_injection(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api", rule="pinned ok")) as w:
        async with end_to_end(w.proxy.port, w.ca_file) as client:
            response = await client.get(w.url("pinned.test", "/account?x=1"), headers={"Authorization": "mine"})
        assert response.status_code == 200 and response.text == "pinned ok"
        [asked] = w.decider.requests
        assert (asked.method, asked.path, asked.query, asked.host, asked.port) == (
            "CONNECT", "", "", "pinned.test", w.pinned.port)
        assert asked.client_token == CLIENT_TOKEN and asked.user_id == "usr_1"
        assert b"GET /account?x=1 HTTP/1.1" in w.pinned.received
        assert b"Authorization: mine" in w.pinned.received and SECRET.encode() not in w.pinned.received
        [record] = await w.decider.wait_records(1, tunnels=True)
        assert (record.method, record.path, record.verdict, record.credential) == ("CONNECT", "", "allow", None)
        assert record.bytes_up > 0 and record.bytes_down > 0


async def test_a_refused_pinned_host_is_never_dialled(tmp_path: Path) -> None:
    async with world(tmp_path, refuse_all()) as w:
        async with end_to_end(w.proxy.port, w.ca_file) as client:
            with pytest.raises(httpx.ProxyError):
                await client.get(w.url("pinned.test", "/"))
        assert w.pinned.connections == 0 and w.resolve.looked_up == []
        [record] = await w.decider.wait_records(1, tunnels=True)
        assert (record.method, record.verdict, record.code) == ("CONNECT", "refuse", "not_admitted")


async def test_an_intercepted_tunnel_presents_a_leaf_of_the_deployment_ca(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None)) as w:
        async with end_to_end(w.proxy.port, w.ca_file) as client:  # trusts only the upstream's CA
            with pytest.raises(httpx.ConnectError):
                await client.get(w.url("merchant.test", "/"))
        assert w.decider.requests == [] and w.dialled == 0
        async with w.client() as client:  # trusts the deployment CA
            assert (await client.get(w.url("merchant.test", "/"))).status_code == 200


async def test_a_client_slower_at_its_tls_handshake_than_the_upstream_bound_is_served(tmp_path: Path) -> None:
    # A tool computer's Chromium under TCG took 10 s for a first handshake; the upstream bound (handshake_timeout)
    # used to cut it, and the guest saw net::ERR_SOCKET_NOT_CONNECTED. A client's handshake has client_timeout.
    async with world(tmp_path, allow_tool("merchant_api"), handshake_timeout=0.2, client_timeout=10) as w:
        request = f"GET /slow-client HTTP/1.1\r\nHost: merchant.test:{w.merchant.port}\r\n\r\n".encode()
        status, _, body = await w.raw(request, handshake_after=0.6)
        assert status == 200, body
        [received] = w.merchant.received
        assert received.target == "/slow-client" and received.header("authorization") == [f"Bearer {SECRET}"]


async def test_a_client_that_does_not_start_its_tls_handshake_within_client_timeout_is_cut_off(
        tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api"), client_timeout=0.3) as w:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await w.raw(b"GET / HTTP/1.1\r\nHost: merchant.test\r\n\r\n", handshake_after=1.0)
        assert w.merchant.received == [] and w.decider.requests == []


async def test_an_upstream_that_fails_its_tls_check_is_a_bad_gateway_and_gets_nothing(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api"), upstream_cafile=None) as w, w.client() as client:
        response = await client.get(w.url("merchant.test", "/"))  # the system trust store does not know the test CA
        assert response.status_code == 502 and refusal_code(response) == "upstream_failed"
        assert w.merchant.received == []
        [record] = await w.decider.wait_records(1)
        # The credential was put into the request, which never left: TLS to an unverified server failed first.
        assert (record.verdict, record.upstream_status, record.credential) == ("allow", None, "merchant_api")


async def test_an_upstream_that_does_not_answer_in_time_is_a_gateway_timeout(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None), upstream_timeout=0.3) as w, w.client() as client:
        w.merchant.hold = asyncio.Event()
        response = await client.get(w.url("merchant.test", "/slow"))
        assert response.status_code == 504 and refusal_code(response) == "upstream_timeout"
        assert [r.target for r in w.merchant.received] == ["/slow"]
