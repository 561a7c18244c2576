"""The bridge's wire, without I/O: which headers a client message is POSTed with, what the bridge learns from the
server's answers, and the server-sent events it cuts a response stream into; and its HTTP client against a loopback
server that counts connections."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from wakeful.server.faces.bridge import SseDecoder, Wire, http_failure
from wakeful.server.faces.bridge_http import HttpClient, TransportError

MODERN = "2026-07-28"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _modern(method: str, **params: object) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": 7, "method": method,
            "params": {**params, "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}}}


def test_a_2026_request_carries_its_own_version_method_and_name_as_headers() -> None:
    headers = Wire().headers(_modern("tools/call", name="task_status", arguments={}))
    assert headers["mcp-protocol-version"] == MODERN
    assert headers["mcp-method"] == "tools/call" and headers["mcp-name"] == "task_status"
    assert "mcp-session-id" not in headers


def test_the_handshake_era_learns_the_session_and_the_version_initialize_settled_on() -> None:
    wire = Wire()
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18"}}
    assert "mcp-protocol-version" not in wire.headers(initialize)
    wire.answered(initialize, "session-1")
    wire.learn({"jsonrpc": "2.0", "id": 1, "result": {"protocolVersion": "2025-06-18"}})
    later = wire.headers({"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert later["mcp-session-id"] == "session-1" and later["mcp-protocol-version"] == "2025-06-18"
    assert not wire.modern


def test_a_discover_probes_version_does_not_leak_onto_the_handshake_that_follows_it() -> None:
    wire = Wire()
    wire.headers(_modern("server/discover"))
    assert "mcp-protocol-version" not in wire.headers({"jsonrpc": "2.0", "id": 2, "method": "initialize"})


def test_server_sent_events_are_cut_at_blank_lines_wherever_the_chunks_break() -> None:
    stream = (b"event: message\r\nid: 1\r\ndata: \r\n\r\n"  # a priming event: no data, nothing to forward
              b'event: message\r\ndata: {"a":1}\r\n\r\n'
              b'data: {"b":\r\ndata: 2}\r\n\r\n'  # data split over two lines is joined with a newline
              b"event: ping\r\ndata: x\r\n\r\n"  # not a message
              b': a comment\r\ndata: {"c":3}\n\n')
    decoder = SseDecoder()
    got = [data for i in range(0, len(stream), 5) for data in decoder.feed(stream[i:i + 5])]
    assert got == ['{"a":1}', '{"b":\n2}', '{"c":3}']


def test_an_http_failure_without_a_json_rpc_error_becomes_one_the_client_can_act_on() -> None:
    assert http_failure("u", 404, b"", in_session=False)[0] == -32601  # method not found: the client falls back
    assert http_failure("u", 404, b"", in_session=True) == (-32600, "Session terminated")
    code, words = http_failure("http://x/mcp", 401, b"{}", in_session=True)
    assert code == -32603 and "refused the credential (401)" in words
    assert "answered 502: bad gateway" in http_failure("http://x/mcp", 502, b"bad gateway", in_session=True)[1]


# -- the HTTP client ---------------------------------------------------------------------------------------------------


@asynccontextmanager
async def _server(answer: bytes, *, close_after: int | None = None) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback HTTP/1.1 server answering every request with `answer`; yields its URL and a list that counts, per
    connection, the requests it served. With `close_after`, it closes each connection after that many."""
    served: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(0)
        mine = len(served) - 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
                served[mine] += 1
                if close_after is not None and served[mine] >= close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}/mcp", served


EVENT = b"event: message\r\ndata: {}\r\n\r\n"
SSE_ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
              + b"%x\r\n" % len(EVENT) + EVENT + b"\r\n0\r\n\r\n")
JSON_ANSWER = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


@pytest.mark.anyio
@pytest.mark.parametrize("answer", [SSE_ANSWER, JSON_ANSWER], ids=["an SSE stream", "a JSON body"])
async def test_many_requests_share_one_kept_alive_connection(answer: bytes) -> None:
    async with _server(answer) as (url, served):
        http = HttpClient(url, {"authorization": "Bearer x"})
        bodies = []
        for _ in range(5):
            async with http.request("POST", {}, b"{}") as response:
                bodies.append(await response.read())
        await http.aclose()
    assert served == [5]
    assert len(set(bodies)) == 1 and bodies[0] in (b'{"ok":true}', EVENT)


@pytest.mark.anyio
async def test_a_connection_the_server_closed_while_idle_is_replaced_without_failing_the_request() -> None:
    async with _server(JSON_ANSWER, close_after=1) as (url, served):
        http = HttpClient(url, {})
        for _ in range(3):
            async with http.request("POST", {}, b"{}") as response:
                assert json.loads(await response.read()) == {"ok": True}
        await http.aclose()
    assert served == [1, 1, 1]


@pytest.mark.anyio
async def test_a_server_that_is_not_there_is_a_transport_error_that_says_so() -> None:
    async with _server(JSON_ANSWER) as (url, _):
        pass  # closed: nothing listens there any more
    with pytest.raises(TransportError):
        async with HttpClient(url, {}).request("POST", {}, b"{}"):
            pass
