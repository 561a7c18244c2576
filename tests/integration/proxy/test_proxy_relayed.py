"""Tool computers on another host's isolated network reach the proxy through the api's SSH tunnel, on the proxy's
relay socket: each connection begins with a PROXY line naming the computer's address, and is then known by that
address exactly as a connection on the address listener is known by its source address.

As in test_proxy_by_address.py, 127.0.0.3 is in the address book as user A and 127.0.0.4 is not; here they are
only named in the PROXY line (the connection itself comes over a unix socket).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import ssl
import stat
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpcore
import pytest
from proxy_world import World, short_socket_dir, world
from test_proxy_by_address import BOOKED, TOKEN_A, TOKENS, UNKNOWN, checks_the_token, get, write_book

from wakeful.proxy.contract import RefusalCode
from wakeful.proxy.proxyline import ProxyLine, format_proxy_line

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def relaying(tmp_path: Path) -> AsyncIterator[tuple[World, Path]]:
    book = tmp_path / "address-book.json"
    write_book(book, {BOOKED: "usr_a"})
    run = short_socket_dir()
    relay = run / "relay" / "proxy-relay.sock"
    try:
        async with world(tmp_path, checks_the_token, address_listen=("127.0.0.2", 0), address_book=book,
                         relay_socket=relay) as w:
            yield w, relay
    finally:
        shutil.rmtree(run, ignore_errors=True)


def line_from(source: str) -> bytes:
    return format_proxy_line(ProxyLine(source=source, source_port=40112, destination="10.77.0.1",
                                       destination_port=3128))


class RelayedFrom(httpcore.AsyncNetworkBackend):
    """What the host tunnel does for each guest connection: the relay socket, a PROXY line naming `source`, then the
    connection's own bytes."""

    def __init__(self, relay: Path, source: str) -> None:
        self.relay, self.source = relay, source
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_unix_socket(str(self.relay), timeout)
        await stream.write(line_from(self.source))
        return stream

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def relayed(w: World, relay: Path, source: str, *, as_user: str | None = None) -> httpcore.AsyncHTTPProxy:
    return httpcore.AsyncHTTPProxy(
        proxy_url="http://10.77.0.1:3128", proxy_auth=(as_user, TOKENS[as_user]) if as_user else None,
        ssl_context=ssl.create_default_context(cafile=str(w.deployment_ca)), network_backend=RelayedFrom(relay, source))


async def raw_exchange(relay: Path, data: bytes) -> bytes:
    """Send `data` on the relay socket, end the sending side, and read until the proxy closes (bounded)."""
    reader, writer = await asyncio.open_unix_connection(str(relay))
    writer.write(data)
    await writer.drain()
    writer.write_eof()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_a_relayed_connection_naming_a_booked_address_acts_as_its_tool_computer(tmp_path: Path) -> None:
    async with relaying(tmp_path) as (w, relay), relayed(w, relay, BOOKED) as client:
        assert await get(client, w.url("plain.test", "/plain", scheme="http")) == (200, None)
        assert await get(client, w.url("merchant.test", "/tls")) == (200, None)
        assert [(r.path, r.user_id, r.client_token) for r in w.decider.requests] == [
            ("/plain", "usr_a", TOKEN_A), ("/tls", "usr_a", TOKEN_A)]
        records = await w.decider.wait_records(2)
        assert sorted((r.path, r.user_id, r.client) for r in records) == [
            ("/plain", "usr_a", "tool_computer"), ("/tls", "usr_a", "tool_computer")]
        assert not any(r.header("proxy-authorization") for r in w.plain.received)


async def test_a_relayed_address_not_in_the_book_is_anonymous_and_not_admitted(tmp_path: Path) -> None:
    async with relaying(tmp_path) as (w, relay), relayed(w, relay, UNKNOWN) as client:
        assert await get(client, w.url("plain.test", "/plain", scheme="http")) == (403, RefusalCode.NOT_ADMITTED)
        assert [(r.user_id, r.client_token) for r in w.decider.requests] == [(None, None)]
        assert w.plain.received == [] and w.dialled == 0


async def test_another_computers_credential_on_a_relayed_connection_is_refused_as_an_identity_change(
        tmp_path: Path) -> None:
    async with relaying(tmp_path) as (w, relay), relayed(w, relay, BOOKED, as_user="usr_b") as client:
        assert await get(client, w.url("plain.test", "/plain", scheme="http")) == (403, RefusalCode.HEADER_MISMATCH)
        assert w.decider.requests == [] and w.dialled == 0


@pytest.mark.parametrize("head", [
    b"GET http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\n\r\n",  # no PROXY line at all
    b"PROXY TCP6 fd00::23 fd00::1 40112 3128\r\nGET http://plain.test/ HTTP/1.1\r\n\r\n",
    b"PROXY UNKNOWN\r\nGET http://plain.test/ HTTP/1.1\r\n\r\n",
    b"PROXY TCP4 127.0.0.3 10.77.0.1 40112 3128" + b" " * 300 + b"\r\n",  # longer than any PROXY line
    b"PROXY TCP4 127.0.0.3 10.77.0.1 40112",  # then the sender leaves
])
async def test_a_connection_without_one_strict_proxy_line_is_closed_and_nothing_is_relayed(
        tmp_path: Path, head: bytes, caplog: pytest.LogCaptureFixture) -> None:
    async with relaying(tmp_path) as (w, relay):
        with caplog.at_level(logging.WARNING, logger="wakeful.proxy"):
            assert await raw_exchange(relay, head) == b""
        assert w.decider.requests == [] and w.dialled == 0 and w.plain.received == []
        assert any("PROXY line" in r.getMessage() for r in caplog.records), caplog.text


async def test_the_relay_socket_is_the_wakeful_users_alone(tmp_path: Path) -> None:
    async with relaying(tmp_path) as (w, relay):
        assert stat.S_IMODE(relay.stat().st_mode) == 0o600 and stat.S_ISSOCK(relay.stat().st_mode)
        assert stat.S_IMODE(relay.parent.stat().st_mode) == 0o700
        assert w.proxy.relay_socket == relay
    assert not relay.exists(), "removed when the proxy stops"


async def test_a_stale_relay_socket_left_by_a_killed_proxy_is_replaced(tmp_path: Path) -> None:
    run = short_socket_dir()
    relay = run / "proxy-relay.sock"
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(relay))  # bound and never listened on: what a killed proxy leaves
    book = tmp_path / "address-book.json"
    write_book(book, {BOOKED: "usr_a"})
    try:
        async with world(tmp_path, checks_the_token, address_listen=("127.0.0.2", 0), address_book=book,
                         relay_socket=relay) as w, relayed(w, relay, BOOKED) as client:
            assert await get(client, w.url("plain.test", "/plain", scheme="http")) == (200, None)
    finally:
        shutil.rmtree(run, ignore_errors=True)
