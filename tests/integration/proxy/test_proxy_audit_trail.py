"""One audit record per request, with the facts that matter and none of the secrets: a canary secret, a client
token, an attempt token and a query value go through the proxy and are then looked for everywhere."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from proxy_world import CLIENT_TOKEN, SECRET, world

from wakeful.proxy.audit import encode_record
from wakeful.proxy.contract import Allow, DecisionRequest, RefusalCode, Verdict, refuse

pytestmark = pytest.mark.anyio
ATTEMPT = "att_tok_canary_91c3"
QUERY_SECRET = "card_4111_canary"



async def decide(req: DecisionRequest) -> Verdict:
    if req.attempt_token is not None:
        return Allow(credential="merchant_api", rule="action act_9", attempt_id="att_9", action_id="act_9")
    if req.path.startswith("/refused"):
        return refuse(RefusalCode.HOST_NOT_ALLOWED, "no rule for this path")
    return Allow(credential="merchant_api" if req.host == "merchant.test" else None, rule="shop rule",
                 attempt_id=None, action_id=None)


async def test_each_request_leaves_one_record_with_its_facts_and_no_secret_anywhere(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    bodies: list[bytes] = []
    async with world(tmp_path, decide) as w:
        async with w.client() as client:
            responses = [
                await client.post(w.url("merchant.test", f"/v1/pay?pan={QUERY_SECRET}"), content=b"12345",
                                  headers={"Authorization": f"Bearer {SECRET}-client-copy"}),
                await client.get(w.url("merchant.test", f"/refused?pan={QUERY_SECRET}")),
                await client.get(w.url("merchant.test", f"/v1/status?pan={QUERY_SECRET}", scheme="http")),
                await client.request("TRACE", w.url("merchant.test", "/")),
            ]
            bodies.extend(response.content for response in responses)
        async with w.client(user=None) as connector:
            response = await connector.get(w.url("merchant.test", "/v1/order"),
                                           headers={"X-Wakeful-Attempt": ATTEMPT})
            bodies.append(response.content)
        records = await w.decider.wait_records(5)
        assert w.merchant.received[0].header("authorization") == [f"Bearer {SECRET}"]
        vault_file = w.vault.path.read_bytes()

    by_path = {r.path: r for r in records}
    assert len(records) == 5 and len({r.request_id for r in records}) == 5
    paid = by_path["/v1/pay"]
    assert (paid.user_id, paid.client, paid.method, paid.scheme, paid.host, paid.verdict, paid.code, paid.rule,
            paid.credential, paid.bytes_up, paid.upstream_status) == (
        "usr_1", "tool_computer", "POST", "https", "merchant.test", "allow", None, "shop rule", "merchant_api", 5,
        200)
    assert paid.bytes_down == len(b"hello from upstream") and paid.latency_ms > 0
    assert (by_path["/refused"].verdict, by_path["/refused"].code, by_path["/refused"].rule) == (
        "refuse", "host_not_allowed", "no rule for this path")
    assert (by_path["/v1/status"].scheme, by_path["/v1/status"].code) == ("http", "plaintext_credential")
    assert (by_path["/"].method, by_path["/"].code) == ("TRACE", "method_not_allowed")
    order = by_path["/v1/order"]
    assert (order.client, order.user_id, order.attempt_id, order.action_id) == ("connector", None, "att_9", "act_9")

    # Only the proxy's own loggers: the test's HTTP client logs the URLs it was asked to fetch, queries included.
    ours = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records if r.name.startswith("wakeful"))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "POST https://merchant.test" in ours and "/v1/pay" in ours  # the proxy did log these requests
    haystacks = {"audit": b"".join(encode_record(r) for r in records), "logs": ours.encode(),
                 "responses": b"".join(bodies), "vault": vault_file}
    for needle in (SECRET, CLIENT_TOKEN, ATTEMPT, QUERY_SECRET):
        for where, hay in haystacks.items():
            assert needle.encode() not in hay, f"{needle} found in {where}"


async def test_a_secret_that_cannot_go_into_a_header_is_refused_without_being_quoted_anywhere(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    spaced = "sk_trailing_space_canary "  # a valid vault value that HTTP cannot carry at the end of a header
    async with world(tmp_path, decide) as w:
        w.vault.set("merchant_api", spaced.encode(), "merchant.test", "Authorization", "Bearer {secret}")
        async with w.client() as client:
            response = await client.get(w.url("merchant.test", "/v1/x"))
        assert response.status_code == 403 and response.headers["x-wakeful-refusal"] == "header_mismatch"
        assert w.dialled == 0
        [record] = await w.decider.wait_records(1)
    assert spaced.strip().encode() not in response.content + encode_record(record)
    assert spaced.strip() not in caplog.text
