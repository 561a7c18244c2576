"""Requests that could mean two things are refused before the decider is asked: ambiguous framing, two Hosts,
names that disagree, TRACE, bodies past the limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from proxy_world import World, allow_tool, world

pytestmark = pytest.mark.anyio



def refused(w: World, answer: tuple[int, dict[str, str], bytes], code: str, status: int = 403) -> None:
    got_status, headers, body = answer
    assert got_status == status and headers.get("x-wakeful-refusal") == code
    assert json.loads(body)["error"]["code"] == code
    assert w.decider.requests == [] and w.dialled == 0 and w.resolve.looked_up == []


def host(w: World, name: str = "merchant.test") -> bytes:
    return f"{name}:{w.port_of(name)}".encode()


async def test_two_host_headers_are_refused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer = await w.raw(b"GET / HTTP/1.1\r\nHost: " + host(w) + b"\r\nHost: " + host(w, "other.test")
                             + b"\r\n\r\n")
        refused(w, answer, "header_mismatch")


async def test_content_length_with_transfer_encoding_is_refused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer = await w.raw(b"POST / HTTP/1.1\r\nHost: " + host(w) + b"\r\nContent-Length: 4\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
        refused(w, answer, "header_mismatch")


async def test_a_host_header_naming_another_host_than_the_tunnel_is_refused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer = await w.raw(b"GET / HTTP/1.1\r\nHost: " + host(w, "other.test") + b"\r\n\r\n")
        refused(w, answer, "header_mismatch")
        [record] = await w.decider.wait_records(1)
        assert (record.host, record.verdict, record.code) == ("merchant.test", "refuse", "header_mismatch")


async def test_a_host_header_with_another_port_than_the_tunnel_is_refused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer = await w.raw(b"GET / HTTP/1.1\r\nHost: merchant.test:1\r\n\r\n")
        refused(w, answer, "header_mismatch")


async def test_a_tls_name_other_than_the_connect_target_is_refused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer = await w.raw(b"GET / HTTP/1.1\r\nHost: " + host(w) + b"\r\n\r\n", sni="other.test")
        refused(w, answer, "header_mismatch")


async def test_an_absolute_url_whose_host_header_disagrees_is_refused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None)) as w:
        answer = await w.raw(b"GET http://" + host(w, "plain.test") + b"/ HTTP/1.1\r\nHost: " + host(w, "other.test")
                             + b"\r\n\r\n", connect=None)
        refused(w, answer, "header_mismatch")


@pytest.mark.parametrize("target", [b"/relative", b"https://merchant.test/", b"http://user:pw@plain.test/", b"*"])
async def test_a_plain_request_must_name_an_http_url_without_userinfo(tmp_path: Path, target: bytes) -> None:
    async with world(tmp_path, allow_tool(None)) as w:
        answer = await w.raw(b"OPTIONS " + target + b" HTTP/1.1\r\nHost: plain.test\r\n\r\n", connect=None)
        refused(w, answer, "header_mismatch")


@pytest.mark.parametrize("method", [b"TRACE", b"TRACK"])
async def test_trace_is_never_forwarded(tmp_path: Path, method: bytes) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer = await w.raw(method + b" / HTTP/1.1\r\nHost: " + host(w) + b"\r\n\r\n")
        refused(w, answer, "method_not_allowed")


async def test_two_attempt_headers_are_refused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer = await w.raw(b"GET / HTTP/1.1\r\nHost: " + host(w) + b"\r\nX-Wakeful-Attempt: a\r\n"
                             b"x-wakeful-attempt: b\r\n\r\n")
        refused(w, answer, "header_mismatch")


async def test_a_body_past_the_limit_is_refused_unread(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api"), max_body_bytes=1000) as w:
        answer = await w.raw(b"POST / HTTP/1.1\r\nHost: " + host(w) + b"\r\nContent-Length: 5000\r\n\r\n"
                             + b"x" * 5000)
        refused(w, answer, "request_too_large", status=413)


async def test_a_chunked_body_past_the_limit_is_refused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api"), max_body_bytes=1000) as w:
        chunk = b"x" * 800
        answer = await w.raw(b"POST / HTTP/1.1\r\nHost: " + host(w) + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + (b"320\r\n" + chunk + b"\r\n") * 2 + b"0\r\n\r\n")
        refused(w, answer, "request_too_large", status=413)


async def test_garbage_instead_of_http_is_refused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w:
        answer = await w.raw(b"GET / HTTP/1.1\r\nHost: " + host(w) + b"\r\nBad Header: x\r\n\r\n")
        refused(w, answer, "header_mismatch")


async def test_a_malformed_proxy_authorization_is_refused(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None)) as w:
        answer = await w.raw(b"GET http://" + host(w, "plain.test") + b"/ HTTP/1.1\r\nHost: " + host(w, "plain.test")
                             + b"\r\nProxy-Authorization: Basic not-base64!\r\n\r\n", connect=None)
        refused(w, answer, "header_mismatch")
