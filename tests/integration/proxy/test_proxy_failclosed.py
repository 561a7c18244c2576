"""Fail closed: without a well-formed allow in time, nothing is resolved and nothing is dialled."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from proxy_world import TOKEN, World, allow_tool, refusal_code, refuse_all, world

from wakeful.proxy.channel import DECIDE, HELLO, VERDICT, WELCOME, frame, read_frame
from wakeful.proxy.contract import Allow, DecisionRequest, RefusalCode, Verdict

pytestmark = pytest.mark.anyio



def nothing_went_out(w: World) -> None:
    assert w.dialled == 0
    assert w.resolve.looked_up == []
    assert all(u.received == [] for u in (w.merchant, w.other, w.plain))


@pytest.mark.parametrize("code", [RefusalCode.NOT_ADMITTED, RefusalCode.CONTENT_MISMATCH, RefusalCode.HOST_NOT_ALLOWED])
async def test_the_deciders_refusal_code_reaches_the_client_and_nothing_is_dialled(
        tmp_path: Path, code: RefusalCode) -> None:
    async with world(tmp_path, refuse_all(code)) as w, w.client() as client:
        response = await client.get(w.url("merchant.test", "/v1/x"))
        assert response.status_code == 403 and refusal_code(response) == code
        assert response.json()["error"]["message"]
        nothing_went_out(w)
        [record] = await w.decider.wait_records(1)
        assert (record.verdict, record.code, record.upstream_status) == ("refuse", code, None)


async def test_a_decider_that_is_not_running_is_decider_unavailable(tmp_path: Path) -> None:
    async with world(tmp_path, start_decider=False) as w, w.client() as client:
        for url in (w.url("merchant.test", "/"), w.url("plain.test", "/", scheme="http")):
            response = await client.get(url)
            assert response.status_code == 502 and refusal_code(response) == "decider_unavailable"
        nothing_went_out(w)


async def test_a_decider_too_slow_to_answer_is_decider_unavailable(tmp_path: Path) -> None:
    never = asyncio.Event()

    async def decide(req: DecisionRequest) -> Verdict:
        await never.wait()
        raise AssertionError("unreachable")

    async with world(tmp_path, decide, decider_timeout=0.3) as w, w.client() as client:
        response = await client.get(w.url("merchant.test", "/"))
        assert response.status_code == 502 and refusal_code(response) == "decider_unavailable"
        assert len(w.decider.requests) == 1
        nothing_went_out(w)


async def test_a_decider_that_fails_is_decider_unavailable(tmp_path: Path) -> None:
    async def decide(req: DecisionRequest) -> Verdict:
        raise RuntimeError("the ledger is locked")

    async with world(tmp_path, decide) as w, w.client() as client:
        response = await client.get(w.url("merchant.test", "/"))
        assert response.status_code == 502 and refusal_code(response) == "decider_unavailable"
        nothing_went_out(w)


async def test_an_answer_that_is_not_a_verdict_is_malformed_verdict(tmp_path: Path) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            kind, body = await read_frame(reader)
            assert kind == HELLO and json.loads(body)["token"] == TOKEN
            writer.write(frame(WELCOME, b'{"v":1}'))
            while True:
                kind, body = await read_frame(reader)
                if kind == DECIDE:
                    rid = json.loads(body)["request_id"]
                    writer.write(frame(VERDICT, json.dumps({"v": 1, "request_id": rid, "verdict": "allow",
                                                            "credential": "merchant_api"}).encode()))
        except (asyncio.IncompleteReadError, OSError):
            pass
        finally:
            writer.close()

    async with world(tmp_path, start_decider=False) as w:
        w.socket_path.parent.mkdir(mode=0o700, exist_ok=True)
        fake = await asyncio.start_unix_server(garbage, path=str(w.socket_path))
        async with fake, w.client() as client:
            response = await client.get(w.url("merchant.test", "/"))
        assert response.status_code == 502 and refusal_code(response) == "malformed_verdict"
        nothing_went_out(w)


async def test_an_allow_that_does_not_fit_the_kind_of_request_is_malformed_verdict(tmp_path: Path) -> None:
    async def decide(req: DecisionRequest) -> Verdict:  # a connector-style allow for tool-computer traffic
        return Allow(credential="merchant_api", rule="r", attempt_id="att_1", action_id="act_1")

    async with world(tmp_path, decide) as w, w.client() as client:
        response = await client.get(w.url("merchant.test", "/"))
        assert response.status_code == 502 and refusal_code(response) == "malformed_verdict"
        nothing_went_out(w)


async def test_a_proxy_with_the_wrong_channel_token_is_refused_by_the_decider(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool("merchant_api"), proxy_token="not-the-token") as w, w.client() as client:
        response = await client.get(w.url("merchant.test", "/"))
        assert response.status_code == 502 and refusal_code(response) == "decider_unavailable"
        assert w.decider.requests == []
        nothing_went_out(w)


async def test_a_name_resolving_to_a_private_address_not_allowed_is_refused_before_dialling(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None)) as w, w.client() as client:
        response = await client.get(w.url("evil.test", "/"))  # evil.test → 127.0.0.1, not in allowed_private
        assert response.status_code == 403 and refusal_code(response) == "address_not_allowed"
        assert w.resolve.looked_up == ["evil.test"]  # resolved only after the allow, and then not dialled
        assert w.dialled == 0


async def test_an_ip_literal_that_is_loopback_is_refused_without_an_exception_for_it(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None)) as w, w.client() as client:
        response = await client.get(f"http://127.0.0.1:{w.plain.port}/")
        assert response.status_code == 403 and refusal_code(response) == "address_not_allowed"
        assert w.dialled == 0


async def test_after_the_decider_comes_back_requests_are_decided_again(tmp_path: Path) -> None:
    async with world(tmp_path, allow_tool(None), start_decider=False) as w, w.client() as client:
        assert (await client.get(w.url("merchant.test", "/"))).status_code == 502
        assert w.decider_server is not None
        await w.decider_server.start()
        # The refusal's audit record makes the proxy reconnect on its own; once it is acknowledged, the channel is up.
        assert await w.proxy.decider.flush(5)
        assert [r.code for r in w.decider.requests_recorded] == ["decider_unavailable"]
        assert (await client.get(w.url("merchant.test", "/"))).status_code == 200
