"""Slow and greedy clients: a whole-head and a whole-body deadline however short each pause, no body read before
the client says who it is, and caps on connections and on the request bodies held, per client and in all.

Deadlines are configured small (0.3 s) and the slow client drips for far longer (seconds); every assertion is on
the answer and what reached the decider and the upstream, never on how long anything took."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from pathlib import Path

import h11
import pytest
from proxy_world import CLIENT_TOKEN, World, allow_tool, refusal_code, world

pytestmark = pytest.mark.anyio


def basic(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{CLIENT_TOKEN}".encode()).decode()


async def drip(w: World, head: bytes, pieces: list[bytes], pause: float = 0.05) -> tuple[int, dict[str, str]]:
    """Send `head`, then each piece `pause` seconds apart, while reading the answer; (status, headers) of it, and
    the connection must then be closed by the proxy. Status 0: the proxy closed without answering."""
    reader, writer = await asyncio.open_connection("127.0.0.1", w.proxy.port)

    async def send() -> None:
        with contextlib.suppress(OSError):
            writer.write(head)
            for piece in pieces:
                await writer.drain()
                await asyncio.sleep(pause)
                writer.write(piece)
            await writer.drain()

    sender = asyncio.create_task(send())
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))  # primes the parser only
    conn.send(h11.EndOfMessage())
    status, headers = 0, {}
    try:
        async with asyncio.timeout(30):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        data = await reader.read(65536)
                    except ConnectionError:
                        data = b""
                    if not data and status == 0:
                        return 0, {}
                    conn.receive_data(data)
                elif isinstance(event, h11.Response):
                    status, headers = event.status_code, {n.decode(): v.decode() for n, v in event.headers}
                elif isinstance(event, h11.EndOfMessage):
                    break
            with contextlib.suppress(ConnectionError):
                assert await reader.read(65536) == b"", "the proxy kept the connection open"
    finally:
        sender.cancel()
        writer.close()
    return status, headers


async def test_a_request_head_dripped_in_slower_than_its_deadline_is_answered_408_and_closed(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None), request_head_timeout=0.3, client_timeout=10) as w:
        port = w.plain.port
        head = (f"GET http://plain.test:{port}/dripped HTTP/1.1\r\nHost: plain.test:{port}\r\n"
                f"Proxy-Authorization: {basic('usr_1')}\r\n").encode()
        status, headers = await drip(w, head, [f"X-Pad-{i}: a\r\n".encode() for i in range(100)] + [b"\r\n"])
        assert (status, headers.get("x-wakeful-refusal")) == (408, "request_timeout")
        assert w.decider.requests == [] and w.plain.received == []


async def test_a_request_body_dripped_in_slower_than_its_deadline_is_answered_408_and_never_sent(
        tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None), request_body_timeout=0.3, client_timeout=10) as w:
        port = w.plain.port
        head = (f"POST http://plain.test:{port}/upload HTTP/1.1\r\nHost: plain.test:{port}\r\n"
                f"Proxy-Authorization: {basic('usr_1')}\r\nContent-Length: 1000\r\n\r\n").encode()
        status, headers = await drip(w, head, [b"x" * 10] * 100)
        assert (status, headers.get("x-wakeful-refusal")) == (408, "request_timeout")
        assert w.decider.requests == [] and w.plain.received == []
        [record] = await w.decider.wait_records(1)
        assert (record.verdict, record.code, record.path) == ("refuse", "request_timeout", "/upload")


async def test_a_client_that_names_no_one_is_refused_before_any_of_its_body_is_read(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None), client_timeout=5) as w:
        port = w.plain.port
        head = (f"POST http://plain.test:{port}/upload HTTP/1.1\r\nHost: plain.test:{port}\r\n"
                f"Content-Length: {10 * 1024 * 1024}\r\n\r\n").encode()
        status, headers = await drip(w, head, [])  # not one byte of the body is sent
        assert (status, headers.get("x-wakeful-refusal")) == (403, "not_admitted")
        assert w.decider.requests == [] and w.plain.received == []


async def test_one_connection_over_the_cap_is_answered_503_and_closed_and_a_freed_slot_is_used_again(
        tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None), max_connections=2) as w:
        url = w.url("plain.test", "/", scheme="http")
        first, second = w.client(), w.client()
        for client in (first, second):  # each holds one kept-alive connection, accepted and counted
            assert (await client.get(url)).status_code == 200
        async with w.client() as third:
            response = await third.get(url)
            assert (response.status_code, refusal_code(response)) == (503, "too_many_connections")
            assert response.headers["connection"] == "close"
        assert len(w.plain.received) == 2
        await first.aclose()
        async with asyncio.timeout(10):
            while w.proxy.open_connections > 1:  # the proxy notices the close on its own time
                await asyncio.sleep(0.01)
        async with w.client() as fourth:
            assert (await fourth.get(url)).status_code == 200
        await second.aclose()


async def test_bodies_over_the_per_client_or_the_total_cap_are_answered_503_without_being_read(
        tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None), max_client_buffered_bytes=600, max_buffered_bytes=1000) as w:
        url = w.url("plain.test", "/upload", scheme="http")
        w.plain.hold = asyncio.Event()
        clients = {user: w.client(user=user) for user in ("usr_1", "usr_2", "usr_3")}
        try:
            held = [asyncio.create_task(clients["usr_1"].post(url, content=b"a" * 500))]
            async with asyncio.timeout(10):
                while len(w.plain.received) < 1:  # the first body is held by the proxy while the upstream waits
                    await asyncio.sleep(0.01)
            same_client = await clients["usr_1"].post(url, content=b"b" * 500)  # a second connection of usr_1
            assert (same_client.status_code, refusal_code(same_client)) == (503, "proxy_busy")
            held.append(asyncio.create_task(clients["usr_2"].post(url, content=b"c" * 400)))
            async with asyncio.timeout(10):
                while len(w.plain.received) < 2:
                    await asyncio.sleep(0.01)
            over_total = await clients["usr_3"].post(url, content=b"d" * 200)
            assert (over_total.status_code, refusal_code(over_total)) == (503, "proxy_busy")
            w.plain.hold.set()
            assert [(await task).status_code for task in held] == [200, 200]
            assert sorted(r.body[:1] for r in w.plain.received) == [b"a", b"c"]
            again = await clients["usr_3"].post(url, content=b"e" * 200)  # freed once answered
            assert again.status_code == 200
        finally:
            for client in clients.values():
                await client.aclose()
