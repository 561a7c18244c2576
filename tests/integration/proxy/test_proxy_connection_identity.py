"""A plain-HTTP client connection speaks for the identity its first request names.

A guest's browser cannot send Proxy-Authorization by itself; the guest's forward inserts it after the first request
line of each connection only. So later keep-alive requests without one act under the first request's identity, a
request naming another identity is refused (`header_mismatch`) and its connection closed, and the decider still
checks the credential on every request.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import h11
import pytest
from proxy_world import CLIENT_TOKEN, World, world

from wakeful.proxy.contract import Allow, DecisionRequest, RefusalCode, Verdict, refuse

pytestmark = pytest.mark.anyio



def basic(user: str, token: str) -> bytes:
    return b"Proxy-Authorization: Basic " + base64.b64encode(f"{user}:{token}".encode()) + b"\r\n"


OWNER = basic("usr_1", CLIENT_TOKEN)
SOMEONE_ELSE = basic("usr_2", "tok_someone_else")


async def checks_the_token(req: DecisionRequest) -> Verdict:
    """The real decider's shape: a tool computer is admitted only with a known credential, on every request."""
    if req.user_id != "usr_1" or req.client_token != CLIENT_TOKEN:
        return refuse(RefusalCode.NOT_ADMITTED, "this tool computer's proxy credential is unknown or revoked")
    return Allow(credential=None, rule="plain rule", attempt_id=None, action_id=None)


class KeepAlive:
    """One client connection to the proxy carrying plain-HTTP requests one after another, as a browser does."""

    def __init__(self, w: World) -> None:
        self.w = w
        self.conn = h11.Connection(h11.CLIENT)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> KeepAlive:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.w.proxy.port)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.writer is not None
        self.writer.close()

    async def get(self, path: str, auth: bytes = b"") -> tuple[int, dict[str, str]]:
        """Send one GET (hand-written, so that exactly `auth` is sent) and read its response."""
        assert self.reader is not None and self.writer is not None
        authority = f"plain.test:{self.w.plain.port}".encode()
        self.writer.write(b"GET http://" + authority + path.encode() + b" HTTP/1.1\r\nHost: " + authority + b"\r\n"
                          + auth + b"\r\n")
        if self.conn.our_state is h11.DONE:
            self.conn.start_next_cycle()
        self.conn.send(h11.Request(method="GET", target=path, headers=[("host", "x")]))  # keeps the parser in step
        self.conn.send(h11.EndOfMessage())
        status, headers = 0, {}
        async with asyncio.timeout(10):
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    self.conn.receive_data(await self.reader.read(65536))
                elif isinstance(event, h11.Response):
                    status, headers = event.status_code, {n.decode(): v.decode() for n, v in event.headers}
                elif isinstance(event, h11.EndOfMessage):
                    return status, headers
                elif not isinstance(event, h11.Data):
                    raise AssertionError(f"unexpected {event!r}")

    async def closed_by_proxy(self) -> bool:
        assert self.reader is not None
        async with asyncio.timeout(10):
            return await self.reader.read(1) == b""


async def test_later_keep_alive_requests_without_proxy_authorization_act_under_the_first_requests_identity(
        tmp_path: Path) -> None:
    async with world(tmp_path, checks_the_token) as w, KeepAlive(w) as c:
        assert (await c.get("/one", OWNER))[0] == 200
        assert (await c.get("/two"))[0] == 200
        assert (await c.get("/three", OWNER))[0] == 200  # naming the same identity again is fine
        assert [r.target for r in w.plain.received] == ["/one", "/two", "/three"]
        assert all(not r.header("proxy-authorization") for r in w.plain.received)  # never forwarded
        # The decider was asked for every request, each time with the credential to check.
        assert [(r.path, r.user_id, r.client_token) for r in w.decider.requests] == [
            ("/one", "usr_1", CLIENT_TOKEN), ("/two", "usr_1", CLIENT_TOKEN), ("/three", "usr_1", CLIENT_TOKEN)]
        records = await w.decider.wait_records(3)
        assert [(r.path, r.user_id, r.verdict) for r in records] == [
            ("/one", "usr_1", "allow"), ("/two", "usr_1", "allow"), ("/three", "usr_1", "allow")]


async def test_an_inherited_identity_is_still_checked_by_the_decider_on_every_request(tmp_path: Path) -> None:
    async with world(tmp_path, checks_the_token) as w, KeepAlive(w) as c:
        assert (await c.get("/before", OWNER))[0] == 200
        w.decider.decide = lambda req: _revoked()  # the credential is revoked between two keep-alive requests
        status, headers = await c.get("/after")
        assert status == 403 and headers["x-wakeful-refusal"] == "not_admitted"
        assert [r.target for r in w.plain.received] == ["/before"]


async def _revoked() -> Verdict:
    return refuse(RefusalCode.NOT_ADMITTED, "this tool computer's proxy credential is unknown or revoked")


async def test_a_request_naming_another_identity_on_the_same_connection_is_refused_and_the_connection_closed(
        tmp_path: Path) -> None:
    async with world(tmp_path, checks_the_token) as w, KeepAlive(w) as c:
        assert (await c.get("/mine", OWNER))[0] == 200
        status, headers = await c.get("/theirs", SOMEONE_ELSE)
        assert status == 403 and headers["x-wakeful-refusal"] == RefusalCode.HEADER_MISMATCH
        assert headers.get("connection") == "close" and await c.closed_by_proxy()
        assert [r.path for r in w.decider.requests] == ["/mine"]  # refused before anyone was asked
        assert [r.target for r in w.plain.received] == ["/mine"]
        records = await w.decider.wait_records(2)
        refused = next(r for r in records if r.path == "/theirs")
        assert (refused.verdict, refused.code, refused.user_id) == ("refuse", RefusalCode.HEADER_MISMATCH, "usr_1")


async def test_a_connection_that_began_without_an_identity_cannot_take_one_on_later(tmp_path: Path) -> None:
    async with world(tmp_path, checks_the_token) as w, KeepAlive(w) as c:
        status, headers = await c.get("/anonymous")
        assert status == 403 and headers["x-wakeful-refusal"] == "not_admitted"
        status, headers = await c.get("/late", OWNER)
        assert status == 403 and headers["x-wakeful-refusal"] == RefusalCode.HEADER_MISMATCH
        assert await c.closed_by_proxy()
        assert w.plain.received == []


async def test_requests_with_no_identity_at_all_are_not_admitted(tmp_path: Path) -> None:
    async with world(tmp_path, checks_the_token) as w, KeepAlive(w) as c:
        for path in ("/first", "/second"):
            status, headers = await c.get(path)
            assert status == 403 and headers["x-wakeful-refusal"] == "not_admitted"
        assert [(r.path, r.user_id, r.client_token) for r in w.decider.requests] == [
            ("/first", None, None), ("/second", None, None)]
        assert w.plain.received == [] and w.dialled == 0


async def test_a_connect_after_a_plain_request_keeps_the_connections_identity(tmp_path: Path) -> None:
    async with world(tmp_path, checks_the_token) as w, KeepAlive(w) as c:
        assert (await c.get("/plain", OWNER))[0] == 200
        assert c.writer is not None and c.reader is not None
        target = f"merchant.test:{w.merchant.port}".encode()
        c.writer.write(b"CONNECT " + target + b" HTTP/1.1\r\nHost: " + target + b"\r\n" + SOMEONE_ELSE + b"\r\n")
        async with asyncio.timeout(10):
            head = await c.reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 403") and b"x-wakeful-refusal: header_mismatch" in head.lower()
        assert w.merchant.connections == 0
