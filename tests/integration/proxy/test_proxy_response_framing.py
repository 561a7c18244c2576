"""Upstream answers are parsed by llhttp and re-framed for the client: every framing an upstream may use arrives
whole and unambiguous, hop-by-hop headers and an upstream's `X-Wakeful-Refusal` never reach the client, and a
malformed or cut answer is never passed on as if it were complete."""

from __future__ import annotations

import asyncio
import base64
import ssl
from pathlib import Path

import pytest
from proxy_world import CLIENT_TOKEN, World, allow_tool, world

pytestmark = pytest.mark.anyio


def answer_with(w: World, data: bytes, *, close: bool = False) -> None:
    w.merchant.raw_reply = lambda _received: (data, close)


async def exchange(w: World, requests: list[bytes]) -> bytes:
    """Send `requests` one after another on one tunnel to merchant.test and read until the proxy closes or 2 s of
    silence: the raw bytes the client saw."""
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection("127.0.0.1", w.proxy.port)
        try:
            auth = base64.b64encode(f"usr_1:{CLIENT_TOKEN}".encode()).decode()
            target = f"merchant.test:{w.port_of('merchant.test')}"
            writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}"
                         "\r\n\r\n".encode())
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            await writer.start_tls(ssl.create_default_context(cafile=str(w.deployment_ca)),
                                   server_hostname="merchant.test")
            seen = bytearray()
            for request in requests:
                writer.write(request)
                await writer.drain()
                try:
                    async with asyncio.timeout(0.5):
                        while data := await reader.read(65536):
                            seen += data
                except TimeoutError:
                    continue
                break
            return bytes(seen)
        finally:
            writer.close()


def get(w: World, method: bytes = b"GET", version: bytes = b"1.1") -> bytes:
    return method + b" / HTTP/" + version + b"\r\nHost: merchant.test:" + str(w.port_of("merchant.test")).encode() \
        + b"\r\n\r\n"


async def test_a_content_length_body_arrives_whole_without_hop_by_hop_headers_or_a_forged_refusal(
        tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive, X-Secret-Hop\r\n"
                       b"X-Secret-Hop: 1\r\nKeep-Alive: timeout=5\r\nProxy-Authenticate: Basic\r\nUpgrade: h2c\r\n"
                       b"X-Wakeful-Refusal: not_admitted\r\nX-Kept: yes\r\n\r\nhello")
        seen = await exchange(w, [get(w), get(w)])
        head, _, rest = seen.partition(b"\r\n\r\n")
        lowered = head.lower()
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-kept: yes" in lowered and b"content-length: 5" in lowered
        for dropped in (b"x-secret-hop", b"keep-alive", b"proxy-authenticate", b"upgrade", b"x-wakeful-refusal",
                        b"connection"):
            assert dropped not in lowered
        assert rest.startswith(b"hello") and seen.count(b"HTTP/1.1 200") == 2
        assert w.merchant.connections == 1  # the upstream connection was kept and reused


async def test_a_chunked_body_is_chunked_again_and_the_upstream_connection_is_reused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-T\r\n\r\n"
                       b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-T: 1\r\n\r\n")
        seen = await exchange(w, [get(w), get(w)])
        first = seen[:seen.index(b"0\r\n\r\n") + 5]
        head, _, body = first.partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower() and b"content-length" not in head.lower()
        assert b"trailer" not in head.lower()
        assert body == b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        assert seen.count(b"HTTP/1.1 200") == 2 and w.merchant.connections == 1


async def test_a_close_delimited_body_is_chunked_for_an_http11_client_and_the_upstream_not_reused(
        tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end", close=True)
        seen = await exchange(w, [get(w), get(w)])
        assert seen.count(b"HTTP/1.1 200") == 2 and seen.count(b"d\r\nuntil the end\r\n0\r\n\r\n") == 2
        assert w.merchant.connections == 2


async def test_a_close_delimited_body_to_an_http10_client_ends_with_the_connection(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        seen = await exchange(w, [get(w, version=b"1.0"), get(w)])
        head, _, body = seen.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower() and b"transfer-encoding" not in head.lower()
        assert body == b"abc" and seen.count(b"HTTP/1.1 200") == 1


async def test_a_head_answer_keeps_its_content_length_and_carries_no_body(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")
        seen = await exchange(w, [get(w, b"HEAD"), get(w, b"HEAD")])
        assert seen.count(b"HTTP/1.1 200") == 2 and seen.lower().count(b"content-length: 1234\r\n\r\n") == 2
        assert seen.endswith(b"\r\n\r\n") and w.merchant.connections == 1


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
async def test_a_bodiless_status_carries_no_body_and_the_connection_goes_on(tmp_path: Path, status: bytes) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, b"HTTP/1.1 " + status + b"\r\nETag: \"x\"\r\n\r\n")
        seen = await exchange(w, [get(w), get(w)])
        assert seen.count(b"HTTP/1.1 " + status) == 2 and seen.endswith(b"\r\n\r\n")
        assert b"transfer-encoding" not in seen.lower() and w.merchant.connections == 1


async def test_a_100_continue_before_the_answer_is_skipped(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
        seen = await exchange(w, [get(w)])
        assert seen.startswith(b"HTTP/1.1 201 Created\r\n") and seen.endswith(b"\r\n\r\nok")
        assert b"100 Continue" not in seen


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n b\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nX-Bad: a\x01b\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n",
    b"not http at all\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2; ext\r\nok\r\n0\r\n\r\n",
])
async def test_an_upstream_answer_that_is_not_well_formed_is_upstream_failed(tmp_path: Path, answer: bytes) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, answer, close=True)
        seen = await exchange(w, [get(w)])
        assert seen.startswith(b"HTTP/1.1 502 ") and b"x-wakeful-refusal: upstream_failed" in seen.lower()
        [record] = await w.decider.wait_records(1)
        assert record.verdict == "allow" and record.upstream_status is None


async def test_an_answer_cut_short_cuts_the_client_connection(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", close=True)
        seen = await exchange(w, [get(w), get(w)])
        assert seen.startswith(b"HTTP/1.1 200 OK\r\n") and seen.endswith(b"\r\n\r\nabc")  # and then the close
        [record] = await w.decider.wait_records(1)
        assert record.upstream_status == 200 and record.bytes_down == 3


async def test_an_endless_response_head_is_cut_off_at_the_limit(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, b"HTTP/1.1 200 OK\r\nX-Endless: " + b"a" * 200_000)  # never finished, never closed
        seen = await exchange(w, [get(w)])
        assert seen.startswith(b"HTTP/1.1 502 ") and b"x-wakeful-refusal: upstream_failed" in seen.lower()


async def test_endless_trailers_cut_the_response_off_at_the_limit(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer_with(w, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-T: " + b"a" * 200_000)
        seen = await exchange(w, [get(w)])
        assert seen.startswith(b"HTTP/1.1 200 OK\r\n") and b"2\r\nok\r\n" in seen and not seen.endswith(b"0\r\n\r\n")
        [record] = await w.decider.wait_records(1, within=3.0)  # written once the proxy gave up on the answer
        assert record.upstream_status == 200 and record.bytes_down == 2
