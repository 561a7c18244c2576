"""Through the real proxy: a credential placeholder is filled only in its credential's declared header; anywhere
else (another header, the query, the body) the request is refused and nothing is sent."""

from __future__ import annotations

from pathlib import Path

import pytest
from proxy_world import SECRET, allow_tool, refusal_code, world

pytestmark = pytest.mark.anyio

ASK = "{{credential:merchant_api}}"


async def test_a_placeholder_in_an_undeclared_header_is_refused_and_the_secret_never_leaves(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w, w.client() as client:
        for name in ("User-Agent", "Referer", "X-Echo-Me"):
            response = await client.get(w.url("merchant.test", "/echo"), headers={name: ASK})
            assert (response.status_code, refusal_code(response)) == (403, "misplaced_credential"), name
            assert SECRET not in response.text
        assert w.merchant.received == []
        records = await w.decider.wait_records(3)
        assert {(r.verdict, r.code, r.credential) for r in records} == {("refuse", "misplaced_credential", None)}


@pytest.mark.parametrize(("path", "body"), [
    (f"/echo?key={ASK}", b""), ("/echo?key=%7B%7Bcredential:merchant_api%7D%7D", b""),
    ("/echo", f'{{"key": "{ASK}"}}'.encode()), ("/echo", b"key=%7B%7Bcredential%3Amerchant_api%7D%7D"),
])
async def test_a_placeholder_in_the_query_or_the_body_is_refused_not_forwarded_as_written(
        tmp_path: Path, path: str, body: bytes) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w, w.client() as client:
        response = await client.post(w.url("merchant.test", path), content=body)
        assert (response.status_code, refusal_code(response)) == (403, "misplaced_credential")
        assert w.merchant.received == [] and w.decider.requests == []


async def test_a_placeholder_in_the_declared_header_is_filled_there_and_nowhere_else(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_key")) as w, w.client() as client:
        w.vault.set("merchant_key", SECRET.encode(), "merchant.test", "X-Merchant-Key", "{secret}")
        response = await client.get(w.url("merchant.test", "/v1"),
                                    headers={"X-Merchant-Key": "key={{credential:merchant_key}};v=2"})
        assert response.status_code == 200
        [got] = w.merchant.received
        assert got.header("x-merchant-key") == [f"key={SECRET};v=2"]
        assert [value for name, value in got.headers if SECRET in value] == [f"key={SECRET};v=2"]


async def test_a_placeholder_in_the_declared_authorization_header_replaces_the_template(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w, w.client() as client:
        response = await client.get(w.url("merchant.test", "/v1"), headers={"Authorization": f"Token {ASK}"})
        assert response.status_code == 200
        [got] = w.merchant.received
        assert got.header("authorization") == [f"Token {SECRET}"]
