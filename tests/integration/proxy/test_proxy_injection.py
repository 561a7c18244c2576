"""Through the real proxy to real HTTPS upstreams: the credential goes in only after an allow, only to its host."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from proxy_world import CLIENT_TOKEN, SECRET, allow_tool, refusal_code, world

from wakeful.proxy.contract import Allow, DecisionRequest, Verdict

pytestmark = pytest.mark.anyio



CLIENT_CREDENTIALS = {"authorization": "Bearer client-own", "x-API-key": "client-key", "COOKIE": "session=client",
                      "X-Auth-Token": "client-token"}


async def test_the_credential_is_injected_after_an_allow_and_every_client_credential_is_stripped(
        tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w, w.client() as client:
        response = await client.post(w.url("merchant.test", "/v1/orders?expand=1"), content=b'{"qty":2}',
                                     headers=CLIENT_CREDENTIALS)
        assert response.status_code == 200 and response.text == "hello from upstream"
        [got] = w.merchant.received
        assert got.header("authorization") == [f"Bearer {SECRET}"]
        for name in ("x-api-key", "cookie", "x-auth-token", "proxy-authorization", "x-wakeful-attempt"):
            assert got.header(name) == [], name
        assert got.method == "POST" and got.target == "/v1/orders?expand=1" and got.body == b'{"qty":2}'
        [asked] = w.decider.requests
        assert (asked.user_id, asked.client_token, asked.client) == ("usr_1", CLIENT_TOKEN, "tool_computer")
        assert (asked.method, asked.scheme, asked.host, asked.port) == ("POST", "https", "merchant.test",
                                                                        w.merchant.port)
        assert (asked.path, asked.query) == ("/v1/orders", "expand=1")
        assert asked.body_sha256 == hashlib.sha256(b'{"qty":2}').hexdigest()
        assert asked.resolved_ips == () and asked.attempt_token is None


async def test_an_allow_without_a_credential_forwards_the_request_without_the_clients_credentials(
        tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None)) as w, w.client() as client:
        assert (await client.get(w.url("merchant.test", "/"), headers=CLIENT_CREDENTIALS)).status_code == 200
        [got] = w.merchant.received
        assert got.header("authorization") == [] and got.header("x-api-key") == []
        assert got.header("cookie") == ["session=client"]  # no credential is bound here, so the cookie is theirs


async def test_a_connector_call_shows_its_attempt_to_the_decider_and_never_to_the_upstream(tmp_path: Path) -> None:
    async def decide(req: DecisionRequest) -> Verdict:
        return Allow(credential="merchant_api", rule="action act_1", attempt_id="att_1", action_id="act_1")

    async with world(tmp_path, decide) as w, w.client(user=None) as client:
        response = await client.get(w.url("merchant.test", "/v1/x"), headers={"X-Wakeful-Attempt": "att_tok_1"})
        assert response.status_code == 200
        [asked] = w.decider.requests
        assert (asked.client, asked.attempt_token, asked.user_id, asked.client_token) == (
            "connector", "att_tok_1", None, None)
        assert w.merchant.received[0].header("x-wakeful-attempt") == []
        [record] = await w.decider.wait_records(1)
        assert (record.client, record.attempt_id, record.action_id, record.rule) == (
            "connector", "att_1", "act_1", "action act_1")


async def test_a_credential_bound_to_one_host_is_never_sent_to_another(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w, w.client() as client:
        response = await client.get(w.url("other.test", "/steal"))
        assert response.status_code == 403 and refusal_code(response) == "host_not_allowed"
        assert w.other.connections == 0 and w.other.received == []
        [record] = await w.decider.wait_records(1)
        assert (record.verdict, record.code, record.credential) == ("refuse", "host_not_allowed", None)


async def test_a_credential_missing_from_the_vault_is_credential_unavailable(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("ghost")) as w, w.client() as client:
        response = await client.get(w.url("merchant.test", "/"))
        assert response.status_code == 403 and refusal_code(response) == "credential_unavailable"
        assert w.dialled == 0


async def test_a_redirect_to_another_host_goes_back_to_the_client_and_is_not_followed(tmp_path: Path) -> None:
    async def decide(req: DecisionRequest) -> Verdict:
        credential = "merchant_api" if req.host == "merchant.test" else None
        return Allow(credential=credential, rule=f"rule for {req.host}", attempt_id=None, action_id=None)

    async with world(tmp_path, decide) as w:
        target = w.url("other.test", "/landing")
        w.merchant.reply = lambda r: (302, [("location", target)], b"")
        async with w.client() as client:
            response = await client.get(w.url("merchant.test", "/go"))
            assert response.status_code == 302 and response.headers["location"] == target
            assert w.other.connections == 0
            assert [r.host for r in w.decider.requests] == ["merchant.test"]
        async with w.client(follow_redirects=True) as client:  # a client that follows asks again, for the new host
            assert (await client.get(w.url("merchant.test", "/go"))).status_code == 200
        [landed] = w.other.received
        assert landed.header("authorization") == []
        assert [r.host for r in w.decider.requests] == ["merchant.test", "merchant.test", "other.test"]


async def test_several_requests_in_one_tunnel_are_each_decided_and_share_one_upstream_connection(
        tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w, w.client() as client:
        for n in range(4):
            assert (await client.get(w.url("merchant.test", f"/item/{n}"))).status_code == 200
        assert [r.path for r in w.decider.requests] == ["/item/0", "/item/1", "/item/2", "/item/3"]
        assert len({r.request_id for r in w.decider.requests}) == 4
        assert [r.target for r in w.merchant.received] == ["/item/0", "/item/1", "/item/2", "/item/3"]
        assert w.merchant.connections == 1
        assert all(r.header("authorization") == [f"Bearer {SECRET}"] for r in w.merchant.received)


async def test_an_upstream_answer_streams_back_whole_with_its_status_and_headers(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, several reads
    async with world(tmp_path, allow_tool(None)) as w:
        w.merchant.reply = lambda r: (201, [("x-upstream", "yes"), ("connection", "keep-alive, x-hop"),
                                            ("x-hop", "drop me")], payload)
        async with w.client() as client:
            response = await client.get(w.url("merchant.test", "/big"))
        assert response.status_code == 201 and response.content == payload
        assert response.headers["x-upstream"] == "yes" and "x-hop" not in response.headers
        [record] = await w.decider.wait_records(1)
        assert (record.bytes_down, record.upstream_status) == (len(payload), 201)


async def test_plain_http_is_forwarded_when_allowed_without_a_credential(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None)) as w, w.client() as client:
        response = await client.get(w.url("plain.test", "/p?q=1", scheme="http"), headers={"Authorization": "x"})
        assert response.status_code == 200
        [got] = w.plain.received
        assert got.target == "/p?q=1" and got.header("authorization") == []
        assert got.header("proxy-authorization") == []
        assert w.decider.requests[0].scheme == "http" and w.decider.requests[0].client_token == CLIENT_TOKEN


async def test_plain_http_with_a_credential_is_refused_and_nothing_is_dialled(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w, w.client() as client:
        response = await client.get(w.url("merchant.test", "/", scheme="http"))
        assert response.status_code == 403 and refusal_code(response) == "plaintext_credential"
        assert w.dialled == 0


async def test_an_upstream_that_drops_idle_connections_costs_a_new_connection_not_a_failed_request(
        tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api")) as w, w.client() as client:
        w.merchant.hang_up = True
        for method in ("GET", "POST", "GET"):
            assert (await client.request(method, w.url("merchant.test", "/again"), content=b"")).status_code == 200
        assert [r.method for r in w.merchant.received] == ["GET", "POST", "GET"]
        assert w.merchant.connections == 3


async def test_a_head_request_gets_headers_and_no_body_and_the_tunnel_carries_on(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None)) as w, w.client() as client:
        head = await client.head(w.url("merchant.test", "/h"))
        assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == "19"
        assert (await client.get(w.url("merchant.test", "/g"))).text == "hello from upstream"
        assert [r.method for r in w.merchant.received] == ["HEAD", "GET"]


async def test_an_upstream_cannot_pass_itself_off_as_a_proxy_refusal(tmp_path: Path) -> None:
    # The dispatcher reads X-Wakeful-Refusal as "nothing was sent": an upstream that applied the request must not
    # be able to make it look unsent.
    async with world(tmp_path, allow_tool("merchant_api")) as w, w.client() as client:
        w.merchant.reply = lambda r: (409, [("x-wakeful-refusal", "not_admitted"), ("X-Other", "kept")], b"no")
        response = await client.get(w.url("merchant.test", "/v1/orders"))
        assert response.status_code == 409 and "x-wakeful-refusal" not in response.headers
        assert response.headers["x-other"] == "kept" and len(w.merchant.received) == 1
