"""Tool computers on an isolated network are known by their source address, through the proxy's address listener.

The proxy listens on 127.0.0.1 as always and, for the isolated network, on 127.0.0.2; clients connect from chosen
loopback addresses: 127.0.0.3 is in the address book as user A, 127.0.0.4 is not. The decider checks the credential
the book supplies exactly as it checks one a client presents.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpcore
import pytest
from proxy_world import World, world

from wakeful.proxy.contract import Allow, DecisionRequest, RefusalCode, Verdict, refuse

pytestmark = pytest.mark.anyio

TOKEN_A = "tok_vm_a_canary_61f2"
TOKEN_B = "tok_vm_b_canary_0c9e"
TOKENS = {"usr_a": TOKEN_A, "usr_b": TOKEN_B}
BOOKED, UNKNOWN = "127.0.0.3", "127.0.0.4"


async def checks_the_token(req: DecisionRequest) -> Verdict:
    """The real decider's shape: a tool computer is admitted only with its own known credential."""
    if req.user_id is None or TOKENS.get(req.user_id) != req.client_token:
        return refuse(RefusalCode.NOT_ADMITTED, "this tool computer's proxy credential is unknown or revoked")
    return Allow(credential=None, rule="tool rule", attempt_id=None, action_id=None)


def write_book(path: Path, owners: dict[str, str]) -> None:
    """As the VM manager does: the whole book to a temporary file, renamed over the old one."""
    addresses = {address: {"user_id": user, "token": TOKENS[user]} for address, user in owners.items()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "addresses": addresses}))
    os.replace(tmp, path)


@asynccontextmanager
async def isolated_network(tmp_path: Path) -> AsyncIterator[tuple[World, Path]]:
    book = tmp_path / "address-book.json"
    write_book(book, {BOOKED: "usr_a"})
    async with world(tmp_path, checks_the_token, address_listen=("127.0.0.2", 0), address_book=book) as w:
        yield w, book


class LeavingFrom(httpcore.AsyncNetworkBackend):
    """Every TCP connection bound to `source` first (httpcore's proxy pool does not pass `local_address` on)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_tcp(host, port, timeout, self.source, socket_options)
        assert stream.get_extra_info("socket").getsockname()[0] == self.source
        return stream

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def from_address(w: World, source: str, *, as_user: str | None = None, loopback: bool = False,
                 ) -> httpcore.AsyncHTTPProxy:
    """A client whose connections to the proxy leave from `source`, presenting `as_user`'s credential if given."""
    listener = f"127.0.0.1:{w.proxy.port}" if loopback else f"127.0.0.2:{w.proxy.address_port}"
    return httpcore.AsyncHTTPProxy(
        proxy_url=f"http://{listener}", proxy_auth=(as_user, TOKENS[as_user]) if as_user else None,
        ssl_context=ssl.create_default_context(cafile=str(w.deployment_ca)), network_backend=LeavingFrom(source))


async def get(client: httpcore.AsyncHTTPProxy, url: str) -> tuple[int, str | None]:
    """The status and refusal code of one GET."""
    response = await client.request("GET", url, extensions={"timeout": {"pool": 10, "connect": 10, "read": 10}})
    headers = {name.decode().lower(): value.decode() for name, value in response.headers}
    return response.status, headers.get("x-wakeful-refusal")


async def test_a_booked_address_acts_as_its_tool_computer_without_presenting_anything(tmp_path: Path) -> None:
    async with isolated_network(tmp_path) as (w, _), from_address(w, BOOKED) as client:
        assert await get(client, w.url("plain.test", "/plain", scheme="http")) == (200, None)
        assert await get(client, w.url("merchant.test", "/tls")) == (200, None)
        assert [r.target for r in w.plain.received] == ["/plain"]
        assert [r.target for r in w.merchant.received] == ["/tls"]
        assert not any(r.header("proxy-authorization") for r in w.plain.received)
        assert [(r.path, r.user_id, r.client_token) for r in w.decider.requests] == [
            ("/plain", "usr_a", TOKEN_A), ("/tls", "usr_a", TOKEN_A)]
        records = await w.decider.wait_records(2)
        assert sorted((r.path, r.user_id, r.client, r.verdict) for r in records) == [
            ("/plain", "usr_a", "tool_computer", "allow"), ("/tls", "usr_a", "tool_computer", "allow")]


async def test_an_address_not_in_the_book_is_anonymous_and_not_admitted(tmp_path: Path) -> None:
    async with isolated_network(tmp_path) as (w, _), from_address(w, UNKNOWN) as client:
        assert await get(client, w.url("plain.test", "/plain", scheme="http")) == (403, RefusalCode.NOT_ADMITTED)
        assert await get(client, w.url("merchant.test", "/tls")) == (403, RefusalCode.NOT_ADMITTED)
        assert [(r.user_id, r.client_token) for r in w.decider.requests] == [(None, None), (None, None)]
        assert w.plain.received == [] and w.merchant.received == [] and w.dialled == 0


async def test_another_computers_credential_from_a_booked_address_is_refused_as_an_identity_change(
        tmp_path: Path) -> None:
    async with isolated_network(tmp_path) as (w, _):
        async with from_address(w, BOOKED, as_user="usr_b") as client:
            assert await get(client, w.url("plain.test", "/plain", scheme="http")) == (
                403, RefusalCode.HEADER_MISMATCH)
            with pytest.raises(httpcore.ProxyError):  # the CONNECT itself is refused
                await get(client, w.url("merchant.test", "/tls"))
        [record] = await w.decider.wait_records(1)
        assert (record.path, record.user_id, record.code) == ("/plain", "usr_a", RefusalCode.HEADER_MISMATCH)
        assert w.decider.requests == [] and w.dialled == 0


async def test_any_credential_from_an_address_not_in_the_book_is_refused_as_an_identity_change(
        tmp_path: Path) -> None:
    async with isolated_network(tmp_path) as (w, _), from_address(w, UNKNOWN, as_user="usr_a") as client:
        assert await get(client, w.url("plain.test", "/plain", scheme="http")) == (403, RefusalCode.HEADER_MISMATCH)
        assert w.decider.requests == [] and w.dialled == 0


async def test_the_loopback_listener_still_takes_the_credential_a_client_presents(tmp_path: Path) -> None:
    async with isolated_network(tmp_path) as (w, _):
        async with from_address(w, BOOKED, as_user="usr_b", loopback=True) as client:
            assert await get(client, w.url("plain.test", "/as-b", scheme="http")) == (200, None)
            assert await get(client, w.url("merchant.test", "/as-b-tls")) == (200, None)
        async with from_address(w, BOOKED, loopback=True) as client:  # the book means nothing here
            assert await get(client, w.url("plain.test", "/nobody", scheme="http")) == (
                403, RefusalCode.NOT_ADMITTED)
        assert [(r.path, r.user_id, r.client_token) for r in w.decider.requests] == [
            ("/as-b", "usr_b", TOKEN_B), ("/as-b-tls", "usr_b", TOKEN_B), ("/nobody", None, None)]
        assert [r.target for r in w.plain.received] == ["/as-b"]


async def test_a_book_rewritten_while_the_proxy_runs_applies_to_the_next_connection(tmp_path: Path) -> None:
    async with isolated_network(tmp_path) as (w, book):
        async with from_address(w, BOOKED) as client:
            assert await get(client, w.url("plain.test", "/while-a", scheme="http")) == (200, None)
        write_book(book, {BOOKED: "usr_b"})  # A's computer destroyed, its address given to B's
        async with from_address(w, BOOKED) as client:
            assert await get(client, w.url("plain.test", "/now-b", scheme="http")) == (200, None)
        async with from_address(w, BOOKED, as_user="usr_a") as client:
            assert await get(client, w.url("plain.test", "/a-again", scheme="http")) == (
                403, RefusalCode.HEADER_MISMATCH)
        assert [(r.path, r.user_id) for r in w.decider.requests] == [("/while-a", "usr_a"), ("/now-b", "usr_b")]
        records = await w.decider.wait_records(3)
        assert sorted((r.path, r.user_id) for r in records) == [
            ("/a-again", "usr_b"), ("/now-b", "usr_b"), ("/while-a", "usr_a")]


async def test_the_address_listener_starts_before_the_networks_address_exists(tmp_path: Path) -> None:
    # 192.0.2.1 (TEST-NET-1) is on no interface here, as the bridge's address is not before libvirt starts the
    # network: the proxy starts anyway (IP_FREEBIND) instead of failing until the bridge is up. Nothing is sent to it.
    book = tmp_path / "address-book.json"
    write_book(book, {BOOKED: "usr_a"})
    async with world(tmp_path, checks_the_token, address_listen=("192.0.2.1", 0), address_book=book) as w, \
            from_address(w, BOOKED, as_user="usr_a", loopback=True) as client:
        assert w.proxy.address_host == "192.0.2.1" and w.proxy.address_port > 0
        assert await get(client, w.url("plain.test", "/plain", scheme="http")) == (200, None), "the loopback one works"
