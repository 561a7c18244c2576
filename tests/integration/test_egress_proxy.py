"""The whole egress path: the server's grants and decider, the real `wakeful proxy` process, HTTPS simulators with
their own CA. Assertions read what the simulators received and applied, and the proxy's audit in the database."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from sqlalchemy import Engine, select

from tests.integration.test_cli import run
from tests.support.acting import CANCEL_VERIFIED, Received, recorder
from tests.support.egress import EgressStack, egress_stack
from tests.support.polling import wait_until
from tests.support.serve import WAKEFUL, ServeProcess, free_port
from tests.support.tlsca import make_test_ca
from wakeful.proxy.clock import FakeClock
from wakeful.proxy.contract import DecisionRequest
from wakeful.proxy.rewrite import ATTEMPT_HEADER
from wakeful.server.acting.actions import load_action
from wakeful.server.core import control
from wakeful.server.egress import grants as egress
from wakeful.server.errors import WakefulError
from wakeful.server.settings import EXAMPLE_POLICIES
from wakeful.server.sims import create_merchant, serve
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, attempts, egress_grants


@pytest.fixture
def stack(engine: Engine, clock: FakeClock, owner: str, tmp_path: Path) -> Iterator[EgressStack]:
    with egress_stack(engine, clock, owner, tmp_path) as stack:
        yield stack


def _bearer(stack: EgressStack) -> str:
    return f"Bearer {stack.secret}"


def _cancel_admitted(stack: EgressStack) -> tuple[str, str]:
    w = stack.world
    task = w.task(completion=CANCEL_VERIFIED)
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    assert w.approve(action) == "admitted"
    return task.task_id, action


def test_a_cancellation_goes_out_with_the_credential_added_by_the_proxy_and_nothing_else(stack: EgressStack) -> None:
    w = stack.world
    _, action = _cancel_admitted(stack)
    assert w.dispatcher.drain() == 1
    w.dispatcher.verify_due()
    assert [e["kind"] for e in w.merchant.effects] == ["cancel_renewal"]
    got = w.received["merchant"]
    assert [(r.method, r.path) for r in got] == [
        ("GET", "/v1/subscriptions"), ("POST", "/v1/subscriptions/sub_1/cancel_renewal"),
        ("GET", "/v1/subscriptions/sub_1")]
    for request in got:
        headers = {k.lower(): v for k, v in request.headers}
        assert headers["authorization"] == _bearer(stack)  # injected upstream, never held by the server
        assert ATTEMPT_HEADER.lower() not in headers  # the grant token stops at the proxy
    rows = stack.audit(3)
    assert [(r["verdict"], r["method"], r["host"], r["credential"], r["upstream_status"]) for r in reversed(rows)] == [
        ("allow", "GET", "merchant.test", "merchant_api", 200), ("allow", "POST", "merchant.test", "merchant_api", 200),
        ("allow", "GET", "merchant.test", "merchant_api", 200)]
    assert rows[1]["action_id"] == action and all(r["user_id"] == w.owner for r in rows)


@pytest.mark.parametrize(("kind", "state"), [(ControlKind.PAUSE, "paused"), (ControlKind.REVOKE, "revoked")])
def test_a_write_paused_or_revoked_while_it_travels_to_the_proxy_is_refused_there(
        stack: EgressStack, kind: ControlKind, state: str) -> None:
    w = stack.world
    task_id, _ = _cancel_admitted(stack)

    def change_of_mind(req: DecisionRequest) -> None:
        if req.method == "POST":
            with write(w.engine) as conn:
                control.set_task_state(conn, user_id=w.owner, task_id=task_id, kind=kind, actor="user:test",
                                       reason="not now", now=w.clock.now())
    stack.before_decide.append(change_of_mind)
    w.dispatcher.drain()
    assert w.merchant.effects == []
    assert [r.method for r in w.received["merchant"]] == ["GET"]  # the POST never reached the merchant
    refused = stack.audit(2)[0]
    assert (refused["verdict"], refused["code"], refused["upstream_status"]) == ("refuse", "not_admitted", None)
    assert f"the task is {state}" in str(refused["rule"])
    with read(w.engine) as conn:
        (attempt,) = conn.execute(select(attempts)).all()
    # Refused before anything was dialled: known not to have happened, so nothing is left to reconcile.
    assert attempt.outcome == "blocked" and "refused by the egress proxy (not_admitted)" in attempt.detail


def test_a_write_is_refused_at_the_proxy_after_stop(stack: EgressStack) -> None:
    w = stack.world
    _cancel_admitted(stack)

    def stop(req: DecisionRequest) -> None:
        with write(w.engine) as conn:
            control.set_stop(conn, stopped=True, user_id=None, actor="cli", reason="panic", now=w.clock.now())
    stack.before_decide.append(stop)
    w.dispatcher.drain()
    assert w.merchant.effects == [] and stack.audit(2)[0]["code"] == "not_admitted"


def test_a_granted_token_cannot_carry_another_path_or_body_or_host(stack: EgressStack) -> None:
    w = stack.world
    task = w.task()
    asked: list[DecisionRequest] = []
    stack.before_decide.append(asked.append)
    w.call(task, "merchant__list_subscriptions")
    before = len(w.received["merchant"])
    (first,) = asked
    token = {ATTEMPT_HEADER: first.attempt_token or ""}
    granted = f"https://{first.host}:{first.port}{first.path}"
    with stack.client() as client:
        other_path = client.get(f"{granted}/sub_1", headers=token)
        other_body = client.request("GET", granted, content=b"{}", headers=token)
        other_host = client.get(f"https://airline.test:{first.port}{first.path}", headers=token)
        no_token = client.get(granted)
    for response, code, part in [(other_path, "content_mismatch", "path"), (other_body, "content_mismatch", "body"),
                                 (other_host, "content_mismatch", "host"),
                                 (no_token, "not_admitted", "Proxy-Authorization")]:
        assert response.status_code == 403 and response.headers["x-wakeful-refusal"] == code, response.text
        assert part in response.json()["error"]["message"], response.text
        assert stack.secret not in response.text
    assert len(w.received["merchant"]) == before and w.received["airline"] == []


def test_a_used_token_carries_nothing_more_not_even_the_same_request(stack: EgressStack) -> None:
    w = stack.world
    asked: list[DecisionRequest] = []
    stack.before_decide.append(asked.append)
    w.call(w.task(), "merchant__list_subscriptions")
    before = len(w.received["merchant"])
    (first,) = asked
    url = f"https://{first.host}:{first.port}{first.path}" + (f"?{first.query}" if first.query else "")
    with stack.client() as client:
        replay = client.get(url, headers={ATTEMPT_HEADER: first.attempt_token or ""})
    assert replay.status_code == 403 and replay.headers["x-wakeful-refusal"] == "not_admitted", replay.text
    assert "used once" in replay.text
    assert len(w.received["merchant"]) == before, "the merchant saw the listing once"


def test_a_write_whose_grant_expired_before_the_proxy_asked_is_refused_and_never_reaches_the_merchant(
        stack: EgressStack) -> None:
    w = stack.world
    tokens: list[str] = []
    stack.before_decide.append(lambda req: tokens.append(req.attempt_token or ""))
    _cancel_admitted(stack)

    def late(req: DecisionRequest) -> None:
        if req.method == "POST":  # the write took longer than its grant lives to reach the proxy
            w.clock.advance(stack.settings.egress_grant_ttl + timedelta(seconds=1))
    stack.before_decide.append(late)
    w.dispatcher.drain()
    assert w.merchant.effects == []
    assert [r.method for r in w.received["merchant"]] == ["GET"]  # the read before; the POST never arrived
    refused = stack.audit(2)[0]
    assert (refused["verdict"], refused["code"], refused["method"], refused["upstream_status"]) == (
        "refuse", "not_admitted", "POST", None)
    assert "expired at" in str(refused["rule"])
    with read(w.engine) as conn:
        (attempt,) = conn.execute(select(attempts)).all()
    assert attempt.outcome == "blocked" and "refused by the egress proxy (not_admitted)" in attempt.detail
    with stack.client() as client:  # the read's token, long expired, does not carry the read again either
        again = client.get(f"https://merchant.test:{_port(stack, 'merchant')}/v1/subscriptions",
                           headers={ATTEMPT_HEADER: tokens[0]})
    assert (again.status_code, again.headers["x-wakeful-refusal"]) == (403, "not_admitted")
    assert "expired" in again.json()["error"]["message"]
    assert [r.method for r in w.received["merchant"]] == ["GET"]


def test_an_action_awaiting_approval_has_no_grant_and_nothing_of_it_gets_through_the_proxy(
        stack: EgressStack) -> None:
    w = stack.world
    task = w.task()
    tokens: list[str] = []
    stack.before_decide.append(lambda req: tokens.append(req.attempt_token or ""))
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    proposed = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])
    assert (proposed["status"], proposed["code"]) == ("needs_approval", "approval_required")
    action_id = proposed["action_id"]
    assert w.dispatcher.drain() == 0
    with read(w.engine) as conn:
        request = load_action(conn, action_id).content["request"]
        assert conn.execute(select(egress_grants).where(egress_grants.c.action_id == action_id)).all() == []
        assert conn.execute(select(attempts).where(attempts.c.action_id == action_id)).all() == []
    # Whoever learnt the request's exact bytes still cannot send it: no grant names it, and the read's does not.
    url, body, headers = request["url"], request["body"].encode(), request["headers"]
    with stack.client() as client:
        bare = client.post(url, content=body, headers=headers)
        borrowed = client.post(url, content=body, headers={**headers, ATTEMPT_HEADER: tokens[0]})
    assert (bare.status_code, bare.headers["x-wakeful-refusal"]) == (403, "not_admitted")
    assert (borrowed.status_code, borrowed.headers["x-wakeful-refusal"]) == (403, "content_mismatch")
    assert w.merchant.effects == [] and [r.method for r in w.received["merchant"]] == ["GET"]
    # Approved, the very same request goes out once: what held it back was the missing approval.
    assert w.approve(action_id) == "admitted"
    assert w.dispatcher.drain() == 1
    assert [e["kind"] for e in w.merchant.effects] == ["cancel_renewal"]
    assert [(r.method, r.path) for r in w.received["merchant"]][-1] == ("POST", urlsplit(url).path)


def test_when_the_decider_is_gone_nothing_goes_out(stack: EgressStack) -> None:
    w = stack.world
    task = w.task()
    stack.stop_decider()
    with pytest.raises(WakefulError) as failed:
        w.call(task, "merchant__list_subscriptions")
    assert failed.value.code == "decider_unavailable"  # the proxy's own word, not the 502 it answered with
    assert w.received["merchant"] == []


EGRESS = """\
[[allow]]
name = "merchant web"
host = "merchant.test"
ports = [{merchant}]
methods = ["GET"]
credential = "merchant_api"

[[allow]]
name = "airline with the merchant's key"
host = "airline.test"
ports = [{airline}]
methods = ["GET"]
credential = "merchant_api"

[[allow]]
name = "intranet"
host = "intranet.test"
methods = ["GET"]
"""


@pytest.fixture
def tool_stack(engine: Engine, clock: FakeClock, owner: str, tmp_path: Path) -> Iterator[EgressStack]:
    policies = tmp_path / "policies"
    (policies / "connectors").mkdir(parents=True)
    for file in (EXAMPLE_POLICIES / "connectors").glob("*.toml"):
        (policies / "connectors" / file.name).write_text(file.read_text())
    with egress_stack(engine, clock, owner, tmp_path, policies=policies) as stack:
        ports = {name: _port(stack, name) for name in ("merchant", "airline")}
        (policies / "egress.toml").write_text(EGRESS.format(**ports))  # the decider picks up the edit
        yield stack


def _port(stack: EgressStack, sim: str) -> int:
    return int(stack.world.tools.registry.connectors[sim].base_url.rsplit(":", 1)[1])


def _tool_computer(stack: EgressStack) -> httpx.Client:
    """A client as a tool computer is: its proxy credential on every CONNECT and plain request."""
    w = stack.world
    with write(w.engine) as conn:
        _, token = egress.issue_client_token(conn, user_id=w.owner, label="vm", now=w.clock.now())
    return httpx.Client(proxy=stack.proxy_url.replace("://", f"://{w.owner}:{token}@"),
                        verify=ssl.create_default_context(cafile=stack.deployment_ca), timeout=10.0)


def test_tool_computer_traffic_follows_the_allowlist_and_credentials_stay_on_their_host(
        tool_stack: EgressStack) -> None:
    stack, w = tool_stack, tool_stack.world
    sims = {name: _port(stack, name) for name in ("merchant", "airline")}
    with _tool_computer(stack) as client:
        ok = client.get(f"https://merchant.test:{sims['merchant']}/v1/subscriptions",
                        headers={"Authorization": "Bearer the-agent-made-this-up", "x-api-key": "also-mine"})
        to_b = client.get(f"https://airline.test:{sims['airline']}/v1/flights")
        plain = client.get(f"http://merchant.test:{sims['merchant']}/v1/subscriptions")
        private = client.get("https://intranet.test/")
        unlisted = client.get(f"https://hotel.test:{sims['merchant']}/")
        trace = client.request("TRACE", f"https://merchant.test:{sims['merchant']}/")
    assert ok.status_code == 200, ok.text
    (seen,) = w.received["merchant"]
    headers = [(k.lower(), v) for k, v in seen.headers]
    assert ("authorization", _bearer(stack)) in headers and "x-api-key" not in dict(headers)
    assert [v for k, v in headers if k == "authorization"] == [_bearer(stack)]  # one, ours; the agent's is gone
    assert (to_b.status_code, to_b.headers.get("x-wakeful-refusal")) == (403, "host_not_allowed")
    assert w.received["airline"] == []  # a credential for merchant.test is never sent to airline.test
    assert plain.headers.get("x-wakeful-refusal") == "plaintext_credential"
    assert private.headers.get("x-wakeful-refusal") == "address_not_allowed"
    assert unlisted.headers.get("x-wakeful-refusal") == "host_not_allowed"
    assert trace.headers.get("x-wakeful-refusal") == "method_not_allowed"
    assert len(w.received["merchant"]) == 1 and w.received["hotel"] == []


def _allow_also(stack: EgressStack, rule: str) -> None:
    """One more [[allow]] rule in the running stack's egress.toml: the decider reads it at the next request."""
    path = stack.settings.policies / "egress.toml"
    path.write_text(path.read_text() + "\n[[allow]]\n" + rule)


def test_a_name_the_system_resolver_maps_to_loopback_is_refused_and_never_dialled(tool_stack: EgressStack) -> None:
    stack, w = tool_stack, tool_stack.world
    # Not in the static map, so the proxy asks the system resolver (/etc/hosts: 127.0.0.1), and not allowed private.
    assert "localhost" not in stack.settings.egress_resolve and "localhost" not in stack.settings.egress_allow_private
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        _allow_also(stack, f'name = "this machine"\nhost = "localhost"\nports = [{port}]\n')
        with _tool_computer(stack) as client:
            response = client.get(f"https://localhost:{port}/admin")
        assert (response.status_code, response.headers.get("x-wakeful-refusal")) == (403, "address_not_allowed")
        assert "localhost resolves to" in response.json()["error"]["message"]
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection was ever made to the address it resolved to
    assert [(r.host, r.port, r.path) for r in stack.asked] == [("localhost", port, "/admin")]  # allowed, then refused
    (row,) = stack.audit(1)
    assert (row["verdict"], row["code"], row["host"], row["upstream_status"]) == (
        "refuse", "address_not_allowed", "localhost", None)
    assert w.received["merchant"] == []


def test_a_credential_placeholder_is_filled_only_on_its_own_host_over_https(tool_stack: EgressStack) -> None:
    stack, w = tool_stack, tool_stack.world
    ports = {name: _port(stack, name) for name in ("merchant", "airline", "hotel")}
    _allow_also(stack, f'name = "hotel, no credential"\nhost = "hotel.test"\nports = [{ports["hotel"]}]\n')
    asks = {"Authorization": "key={{credential:merchant_api}};v=2"}  # its declared header (the default)
    with _tool_computer(stack) as client:
        own = client.get(f"https://merchant.test:{ports['merchant']}/v1/subscriptions", headers=asks)
        misplaced = client.get(f"https://merchant.test:{ports['merchant']}/v1/subscriptions",
                               headers={"User-Agent": "{{credential:merchant_api}}"})
        no_credential = client.get(f"https://hotel.test:{ports['hotel']}/v1/quotes/q_1", headers=asks)
        bound_elsewhere = client.get(f"https://airline.test:{ports['airline']}/v1/flights", headers=asks)
        plaintext = client.get(f"http://merchant.test:{ports['merchant']}/v1/subscriptions", headers=asks)
    assert own.status_code == 200, own.text
    (seen,) = w.received["merchant"]
    headers = {k.lower(): v for k, v in seen.headers}
    assert headers["authorization"] == f"key={stack.secret};v=2"  # in place of the placeholder, nowhere else
    for refused, code in [(no_credential, "credential_unavailable"), (bound_elsewhere, "host_not_allowed"),
                          (plaintext, "plaintext_credential"), (misplaced, "misplaced_credential")]:
        assert (refused.status_code, refused.headers.get("x-wakeful-refusal")) == (403, code), refused.text
        assert stack.secret not in refused.text
    assert w.received["hotel"] == [] and w.received["airline"] == []
    assert len(w.received["merchant"]) == 1


def _holding(needle: bytes, data_dir: Path, texts: Mapping[str, bytes]) -> list[str]:
    """Every file under `data_dir` (database, WAL, logs, exports) and every named text that holds `needle`."""
    found = [str(path) for path in sorted(data_dir.rglob("*")) if path.is_file() and needle in path.read_bytes()]
    return found + [name for name, text in texts.items() if needle in text]


def _assert_nowhere(secret: str, data_dir: Path, texts: Mapping[str, bytes]) -> None:
    needle = secret.encode()
    planted = data_dir / "planted-copy.bin"  # first, the search must find a copy where one is
    planted.write_bytes(b"\x00log line: " + needle + b"\n")
    try:
        found = _holding(needle, data_dir, {**texts, "planted text": b"{" + needle + b"}"})
        assert str(planted) in found and "planted text" in found, "the search cannot find the secret at all"
    finally:
        planted.unlink()
    leaks = _holding(needle, data_dir, texts)
    assert leaks == [], f"the secret leaked into {leaks}"


def test_the_canary_secret_is_nowhere_but_in_the_headers_the_upstream_received(
        tool_stack: EgressStack, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # everything the server side logs, in this process
    stack, w = tool_stack, tool_stack.world
    texts: dict[str, bytes] = {}
    task = w.task(completion=CANCEL_VERIFIED)
    listed = w.call(task, "merchant__list_subscriptions")
    proposed = w.call(task, "merchant__cancel_renewal", subscription=listed["objects"][0]["id"])
    texts |= {"read tool result": json.dumps(listed).encode(), "write tool result": json.dumps(proposed).encode()}
    assert w.approve(proposed["action_id"]) == "admitted"
    w.dispatcher.drain()
    w.dispatcher.verify_due()
    w.dispatcher.complete_due()
    port = _port(stack, "merchant")
    with _tool_computer(stack) as client:
        for url in (f"https://merchant.test:{port}/v1/subscriptions", f"https://airline.test:{port}/",
                    f"http://merchant.test:{port}/"):
            response = client.get(url, headers={"Authorization": "{{credential:merchant_api}}"})
            texts[f"response from {url}"] = response.content + str(response.headers).encode()
    rows = stack.audit(6)
    assert len(w.merchant.effects) == 1 and any(r["verdict"] == "refuse" for r in rows)
    assert any(stack.secret in v for r in w.received["merchant"] for _, v in r.headers)  # the one place it is
    texts["audit rows"] = repr(rows).encode()
    texts["server log"] = caplog.text.encode()
    assert caplog.records, "the server side logged nothing: searching its log proved nothing"
    assert stack.proxy_log.read_bytes(), "the proxy wrote no log at all: searching it proved nothing"
    _assert_nowhere(stack.secret, tmp_path, texts)


async def _as_the_agent(mcp_url: str, token: str, task_id: str) -> tuple[str, dict[str, bytes]]:
    """The agent's part over MCP (streamable HTTP on `wakeful serve`): read, propose; every result as it came."""
    results: dict[str, bytes] = {}
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http, \
            Client(streamable_http_client(mcp_url, http_client=http)) as client:
        listed = await client.call_tool("merchant__list_subscriptions", {"task_id": task_id})
        (sub,) = listed.structured_content["objects"]
        proposed = await client.call_tool("merchant__cancel_renewal", {"task_id": task_id, "subscription": sub["id"]})
        status = await client.call_tool("task_status", {"task_id": task_id})
        approvals = await client.read_resource("wakeful://approvals")
    for name, result in (("list", listed), ("propose", proposed), ("status", status)):
        assert not result.is_error, result.content
        results[f"MCP {name}"] = json.dumps(result.model_dump(mode="json")).encode()
    results["MCP approvals"] = json.dumps(approvals.model_dump(mode="json")).encode()
    assert proposed.structured_content["status"] == "needs_approval"
    return str(proposed.structured_content["action_id"]), results


def test_under_wakeful_serve_the_canary_secret_is_only_in_the_headers_the_merchant_received(tmp_path: Path) -> None:
    """The whole deployment as an operator runs it: the secret stored with `wakeful secret set`, `wakeful serve`
    with its proxy child, the agent over MCP, the user over HTTP and the CLI. The secret must show up in what the
    merchant received and nowhere else: not a file of the data dir, the server's log, an answer, an export."""
    ca = make_test_ca(tmp_path, ["merchant.test", "airline.test"])
    received: list[Received] = []
    app, merchant = create_merchant()
    with serve(recorder(app, received), tls=str(ca.leaf_file)) as url:
        port = int(url.rsplit(":", 1)[1])
        policies = tmp_path / "policies"
        shutil.copytree(EXAMPLE_POLICIES / "connectors", policies / "connectors")
        (policies / "egress.toml").write_text(
            f'[[allow]]\nname = "merchant"\nhost = "merchant.test"\nports = [{port}]\ncredential = "merchant_api"\n')
        secret = f"wkcanary{secrets.token_hex(12)}"
        stored = subprocess.run([str(WAKEFUL), "secret", "set", "merchant_api", "--host", "merchant.test"],
                                input=secret.encode(), capture_output=True, timeout=60, check=True,
                                env={**{k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")},
                                     "WAKEFUL_DATA_DIR": str(tmp_path)})
        texts: dict[str, bytes] = {"wakeful secret set": stored.stdout + stored.stderr}
        proxy_port = free_port()
        env = {"WAKEFUL_DATA_DIR": str(tmp_path), "WAKEFUL_PROXY": "true", "WAKEFUL_PROXY_PORT": str(proxy_port),
               "WAKEFUL_POLICIES_DIR": str(policies), "WAKEFUL_COMPUTERS": "false",
               "WAKEFUL_CONNECTOR_URLS__MERCHANT": f"https://merchant.test:{port}",
               "WAKEFUL_EGRESS_UPSTREAM_CA": str(ca.ca_file), "WAKEFUL_EGRESS_ALLOW_PRIVATE": '["merchant.test"]',
               "WAKEFUL_EGRESS_RESOLVE": '{"merchant.test": ["127.0.0.1"]}', "WAKEFUL_RECONCILE_INTERVAL": "0.2"}
        with ServeProcess(env, log_path=tmp_path / "serve.log") as server:
            token = run(tmp_path, "token").stdout.strip()
            auth = {"Authorization": f"Bearer {token}"}
            with httpx.Client(base_url=server.url, headers=auth, timeout=30.0) as api:
                def answer(response: httpx.Response) -> httpx.Response:
                    texts[f"answer {len(texts)}: {response.request.method} {response.request.url.path}"] = (
                        response.content + str(response.headers).encode())
                    return response
                task_id = answer(api.post("/v1/tasks", json={"title": "cancel it", "completion": CANCEL_VERIFIED})
                                 ).json()["task_id"]
                action_id, results = anyio.run(_as_the_agent, f"{server.url}/mcp", token, task_id)
                texts |= results
                answer(api.get(f"/v1/actions/{action_id}"))
                assert answer(api.post(f"/v1/actions/{action_id}/approve")).json()["verdict"] == "admitted"
                wait_until(lambda: api.get(f"/v1/tasks/{task_id}").json()["facts"]["goal_verified"], 30,
                           "the cancellation sent through the proxy and verified")
                # A tool computer too: its credential injected on the bound host, refused elsewhere.
                credential = run(tmp_path, "egress", "client", "vm").stdout.strip()
                deployment_ca = tmp_path / "deployment-ca.pem"
                run(tmp_path, "proxy", "ca", "-o", str(deployment_ca))
                asks = {"Authorization": "{{credential:merchant_api}}"}
                with httpx.Client(proxy=f"http://{credential}@127.0.0.1:{proxy_port}", timeout=10.0,
                                  verify=ssl.create_default_context(cafile=deployment_ca)) as vm:
                    tool_computer = [vm.get(f"https://merchant.test:{port}/v1/subscriptions", headers=asks),
                                     vm.get(f"https://airline.test:{port}/", headers=asks),
                                     vm.get(f"http://merchant.test:{port}/v1/subscriptions", headers=asks)]
                assert [(r.status_code, r.headers.get("x-wakeful-refusal")) for r in tool_computer] == [
                    (200, None), (403, "host_not_allowed"), (403, "plaintext_credential")]
                for response in tool_computer:
                    texts[f"tool computer: {response.url}"] = response.content + str(response.headers).encode()
                wait_until(lambda: len(api.get("/v1/egress").json()["requests"]) >= 6, 10, "the audit rows")
                for path in ("/v1/egress", "/v1/messages", f"/v1/tasks/{task_id}", f"/v1/tasks/{task_id}/ledger",
                             f"/v1/actions/{action_id}", "/v1/control"):
                    assert answer(api.get(path)).status_code == 200, path
            for args in (("ledger", "export", "-o", str(tmp_path / "ledger.jsonl")), ("ledger", task_id),
                         ("egress", "log", "--json"), ("egress", "log"), ("secret", "list"), ("status",)):
                done = run(tmp_path, *args)
                texts[f"wakeful {' '.join(args)}"] = (done.stdout + done.stderr).encode()
            _, killed = server.terminate()
        assert not killed, server.log()
    assert [e["kind"] for e in merchant.effects] == ["cancel_renewal"]
    assert [r.method for r in received].count("POST") == 1
    # Every request the merchant got carried it once, where it belongs (the one place it is): the connector's in
    # Authorization, the tool computer's in place of its placeholder.
    carried = sorted(tuple((k.lower(), v) for k, v in r.headers if secret in v) for r in received)
    assert carried == [(("authorization", f"Bearer {secret}"),)] * (len(received) - 1) + [(("authorization", secret),)]
    assert (tmp_path / "ledger.jsonl").read_text().count(action_id) > 0
    assert "egress proxy listening" in server.log()  # its log is the server's and the proxy's, both searched
    _assert_nowhere(secret, tmp_path, texts)
