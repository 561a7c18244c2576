"""Through the real proxy: a stripped header in another spelling is stripped, and the path the allowlist judges is
the path the upstream gets, with no spelling that reads outside a rule's prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
from proxy_world import allow_tool, refusal_code, world

from wakeful.proxy.contract import DecisionRequest, Verdict
from wakeful.proxy.decide import AllowRule, decide_by_allowlist

pytestmark = pytest.mark.anyio

V1 = AllowRule(name="v1 only", host="merchant.test", ports=frozenset(range(1, 65536)), methods=frozenset({"GET"}),
               path_prefix="/v1")


async def by_allowlist(req: DecisionRequest) -> Verdict:
    return decide_by_allowlist(req, [V1])


async def test_credential_and_framing_headers_spelled_with_underscores_never_reach_the_upstream(
        tmp_path: Path) -> None:
    sneaky = {"X_Api_Key": "client-key", "x_auth_token": "client-token", "Transfer_Encoding": "chunked",
              "Proxy_Authorization": "Basic eDp5", "X_Wakeful_Attempt": "att_forged", "Content_Length": "99"}
    async with world(tmp_path, allow_tool("merchant_api")) as w, w.client() as client:
        response = await client.get(w.url("merchant.test", "/v1/x"), headers=sneaky)
        assert response.status_code == 200
        [got] = w.merchant.received
        canonical = {name.lower().replace("_", "-") for name, _ in got.headers}
        assert canonical.isdisjoint({name.lower().replace("_", "-") for name in sneaky}), got.headers


@pytest.mark.parametrize("path", ["/v1/%c0%ae%c0%ae/admin", "/v1/.%c0%ae/admin", "/v1/%252e%252e/admin",
                                  "/v1/..%2fadmin", "/v1/..;/admin", "/v1/%zz"])
async def test_a_path_that_can_be_read_two_ways_is_refused_before_the_decider_and_never_sent(
        tmp_path: Path, path: str) -> None:
    async with world(tmp_path, by_allowlist) as w, w.client() as client:
        response = await client.get(w.url("merchant.test", path))
        assert (response.status_code, refusal_code(response)) == (403, "ambiguous_path")
        assert w.merchant.received == [] and w.decider.requests == []


async def test_dot_segments_are_resolved_before_the_rule_and_the_upstream_gets_the_resolved_path(
        tmp_path: Path) -> None:
    async with world(tmp_path, by_allowlist) as w, w.client() as client:
        inside = await client.get(w.url("merchant.test", "/v1/a/%2e%2e/b?q=1"))
        outside = await client.get(w.url("merchant.test", "/v1/%2E%2E/admin"))
        assert inside.status_code == 200
        assert (outside.status_code, refusal_code(outside)) == (403, "host_not_allowed")
        assert [r.path for r in w.decider.requests] == ["/v1/b", "/admin"]
        assert [r.target for r in w.merchant.received] == ["/v1/b?q=1"]
