"""Every request the proxy reads leaves exactly one audit row, the ones it refuses while still reading the head
included, and a connection that sends no request at all is recorded without letting a flood fill the disk.

Raw bytes on a socket, the server's own decider and audit store (SQLite), rows read back through the reader that
`GET /v1/egress` and `wakeful egress log` use.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
from pathlib import Path

import pytest
from proxy_world import World, audited, recorded_world
from sqlalchemy import Engine

from tests.integration.test_cli import run
from wakeful.proxy.clock import FakeClock
from wakeful.server.egress import grants as egress
from wakeful.server.settings import Settings
from wakeful.server.store.db import write
from wakeful.server.store.tables import egress_audit

pytestmark = pytest.mark.anyio

LONG_PATH = "/" + "a" * (9 * 1024)
LONG_REQUEST = b"GET http://{a}" + LONG_PATH.encode() + b" HTTP/1.1\r\nHost: {a}\r\n\r\n"
CANARY = "sk_live_refused_canary_5d1e"

# (what, request with {a} for plain.test's authority, status, code, (method, host, path) on the row)
REFUSALS = [
    ("conflicting Content-Length",
     b"POST http://{a}/x HTTP/1.1\r\nHost: {a}\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
     403, "header_mismatch", ("POST", "plain.test", "/x")),
    ("Content-Length with Transfer-Encoding",
     b"POST http://{a}/x HTTP/1.1\r\nHost: {a}\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     403, "header_mismatch", ("POST", "plain.test", "/x")),
    ("Transfer-Encoding chunked, identity",
     b"POST http://{a}/x HTTP/1.1\r\nHost: {a}\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
     403, "header_mismatch", ("POST", "plain.test", "/x")),
    ("two Host headers", b"GET http://{a}/x HTTP/1.1\r\nHost: {a}\r\nHost: other.test\r\n\r\n",
     403, "header_mismatch", ("GET", "plain.test", "/x")),
    ("CR in a header value", b"GET http://{a}/x HTTP/1.1\r\nHost: {a}\r\nX-Note: a\rb\r\n\r\n",
     403, "header_mismatch", ("GET", "plain.test", "/x")),
    ("NUL in a header value", b"GET http://{a}/x HTTP/1.1\r\nHost: {a}\r\nX-Note: a\x00b\r\n\r\n",
     403, "header_mismatch", ("GET", "plain.test", "/x")),
    ("CONNECT without a host", b"CONNECT :443 HTTP/1.1\r\nHost: :443\r\n\r\n",
     403, "header_mismatch", ("CONNECT", "", "")),
    ("CONNECT to port 99999", b"CONNECT plain.test:99999 HTTP/1.1\r\nHost: plain.test:99999\r\n\r\n",
     403, "header_mismatch", ("CONNECT", "", "")),
    ("CONNECT to an unclosed IPv6 literal", b"CONNECT [::1 HTTP/1.1\r\nHost: x\r\n\r\n",
     403, "header_mismatch", ("CONNECT", "", "")),
    ("h2c prior knowledge", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
     400, "malformed_request", ("PRI", "", "")),
    ("a 9 KiB path", LONG_REQUEST, 414, "target_too_long", ("GET", "plain.test", None)),
    ("bytes that are not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 hello\r\n\r\n",
     400, "malformed_request", ("", "", "")),
]


def request(w: World, template: bytes) -> bytes:
    return template.replace(b"{a}", f"plain.test:{w.plain.port}".encode())


@pytest.mark.parametrize(("what", "template", "status", "code", "facts"), REFUSALS, ids=[r[0] for r in REFUSALS])
async def test_each_refusal_while_reading_a_request_answers_with_its_code_and_leaves_exactly_one_row(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings, what: str, template: bytes,
        status: int, code: str, facts: tuple[str, str, str | None]) -> None:
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        got_status, headers, body = await w.raw(request(w, template), connect=None)
        assert (got_status, headers.get("x-wakeful-refusal"), json.loads(body)["error"]["code"]) == (
            status, code, code)
        [row] = await audited(w, engine)
        assert w.decider.requests == [] and w.dialled == 0
    method, host, path = facts
    assert (row["verdict"], row["code"], row["method"], row["host"]) == ("refuse", code, method, host)
    if path is not None:
        assert row["path"] == path
    assert row["rule"] and row["upstream_status"] is None


async def test_a_path_too_long_to_keep_is_recorded_cut_with_its_length_and_digest(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings) -> None:
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        await w.raw(request(w, LONG_REQUEST), connect=None)
        [row] = await audited(w, engine)
    digest = hashlib.sha256(LONG_PATH.encode()).hexdigest()
    assert row["path"].startswith("/aaaa") and len(row["path"]) <= 8192
    assert row["path"].endswith(f" [cut from {len(LONG_PATH)} chars, sha256:{digest}]")


async def test_header_values_of_refused_requests_are_not_in_the_audit(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings) -> None:
    secret_basic = base64.b64encode(f"usr_1:{CANARY}".encode()).decode()
    requests = [
        b"GET http://{a}/x HTTP/1.1\r\nHost: {a}\r\nAuthorization: Bearer " + CANARY.encode()
        + b"\r\nX-Note: a\x00b\r\n\r\n",
        b"GET http://{a}/x HTTP/1.1\r\nHost: {a}\r\nX-Api-Key: " + CANARY.encode() + b"\rmore\r\n\r\n",
        b"GET http://{a}/x HTTP/1.1\r\nHost: {a}\r\nProxy-Authorization: Basic " + secret_basic.encode()
        + b"\r\nHost: two.test\r\n\r\n",
        b"CONNECT :443 HTTP/1.1\r\nHost: x\r\nProxy-Authorization: Basic " + secret_basic.encode() + b"\r\n\r\n",
    ]
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        for template in requests:
            status, _, body = await w.raw(request(w, template), connect=None)
            assert status == 403 and CANARY.encode() not in body
        rows = await audited(w, engine)
    assert len(rows) == len(requests) and {r["code"] for r in rows} == {"header_mismatch"}
    assert CANARY not in json.dumps(rows) and secret_basic not in json.dumps(rows)


async def send_garbage(w: World) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", w.proxy.port)
    try:
        writer.write(b"\x00\x01garbage\r\n\r\n")
        head = await reader.readuntil(b"\r\n")
        return int(head.split()[1])
    finally:
        writer.close()


async def test_connections_that_send_no_request_are_recorded_one_by_one_up_to_a_bound_then_counted(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings) -> None:
    bound = {"malformed_rows_burst": 3, "malformed_rows_every": 3600.0, "malformed_summary_every": 0.2}
    async with recorded_world(tmp_path, engine, clock, settings, **bound) as w:
        for _ in range(3):  # connected and left without a byte: nothing was read, nothing to record
            _, writer = await asyncio.open_connection("127.0.0.1", w.proxy.port)
            writer.close()
        assert [await send_garbage(w) for _ in range(10)] == [400] * 10
        async with asyncio.timeout(10):
            while sum(counted(rows := await audited(w, engine))) < 7:
                await asyncio.sleep(0.05)  # the count is written once the summary interval has passed
    assert {(r["verdict"], r["code"], r["host"]) for r in rows} == {("refuse", "malformed_request", "")}
    one_by_one = [r for r in rows if "more connections" not in r["rule"]]
    assert len(one_by_one) == 3 and sum(counted(rows)) == 7


def counted(rows: list[dict[str, object]]) -> list[int]:
    """The connections the summary rows count, that have no row of their own."""
    return [int(m.group(1)) for r in rows if (m := re.match(r"(\d+) more connections", str(r["rule"])))]


async def test_a_long_path_no_rule_allows_is_refused_as_such_and_not_as_a_failed_decider(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings, owner: str) -> None:
    with write(engine) as conn:
        _, token = egress.issue_client_token(conn, user_id=owner, label="laptop", now=clock.now())
    path = "/track/" + "x" * 2000  # a browser's tracking link: within the limits, and no rule allows it
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        request = f"GET {path} HTTP/1.1\r\nHost: merchant.test:{w.merchant.port}\r\n\r\n".encode()
        status, headers, _ = await w.raw(request, auth=f"{owner}:{token}")
        assert (status, headers.get("x-wakeful-refusal")) == (403, "host_not_allowed")
        rows = await audited(w, engine)
    [refused] = [r for r in rows if r["method"] == "GET"]
    assert (refused["code"], refused["path"]) == ("host_not_allowed", path) and "laptop" in refused["rule"]


async def test_the_egress_log_shows_recorded_paths_as_they_are_markup_and_cut_marker_included(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings) -> None:
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        for template in (LONG_REQUEST, b"GET http://{a}/x[/]y[bold] HTTP/1.1\r\nHost: {a}\r\n\r\n"):
            await w.raw(request(w, template), connect=None)
        await audited(w, engine)
    table = (await asyncio.to_thread(run, tmp_path, "egress", "log")).stdout
    assert "/x[/]y[bold]" in table and f"[cut from {len(LONG_PATH)} chars," in table  # the long path's cell wraps


async def test_a_long_method_and_a_long_claimed_user_are_cut_to_the_columns_that_store_them(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings) -> None:
    # SQLite stores a string of any length; PostgreSQL refuses one longer than its column, and a batch of records
    # that cannot be stored is sent again and again.
    method, user = "X" * 30, "u" * 100
    basic = base64.b64encode(f"{user}:tok".encode()).decode()
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        await w.raw(request(w, method.encode() + b" http://{a}/x HTTP/1.1\r\nHost: {a}\r\nProxy-Authorization: Basic "
                            + basic.encode() + b"\r\n\r\n"), connect=None)
        [row] = await audited(w, engine)
    assert row["code"] == "not_admitted"
    for column, sent in (("method", method), ("user_id", user)):
        width = egress_audit.c[column].type.length
        assert len(row[column]) <= width and row[column][:width - 1] == sent[:width - 1], column
