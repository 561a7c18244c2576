"""The whole egress path: the server's grants and decider, the real `wakeful proxy` process, HTTPS simulators with
their own CA. Assertions read what the simulators received and applied, and the proxy's audit in the database."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select

from proxy.contract import DecisionRequest
from proxy.rewrite import ATTEMPT_HEADER
from server import control, egress
from server.clock import FakeClock
from server.db import read, write
from server.tables import ControlKind, attempts
from tests.support.acting import CANCEL_VERIFIED, POLICIES
from tests.support.egress import EgressStack, egress_stack


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
    tokens: list[str] = []
    stack.before_decide.append(lambda req: tokens.append(req.attempt_token or ""))
    w.call(task, "merchant__list_subscriptions")
    before = len(w.received["merchant"])
    with stack.client() as client:
        other_path = client.get("https://merchant.test/v1/subscriptions/sub_1",
                                headers={ATTEMPT_HEADER: tokens[0]})
        other_body = client.request("GET", "https://merchant.test/v1/subscriptions", content=b"{}",
                                    headers={ATTEMPT_HEADER: tokens[0]})
        other_host = client.get("https://airline.test/v1/subscriptions", headers={ATTEMPT_HEADER: tokens[0]})
        no_token = client.get("https://merchant.test/v1/subscriptions")
    for response, code in [(other_path, "content_mismatch"), (other_body, "content_mismatch"),
                           (other_host, "content_mismatch"), (no_token, "not_admitted")]:
        assert response.status_code == 403 and response.headers["x-wakeful-refusal"] == code, response.text
        assert stack.secret not in response.text
    assert len(w.received["merchant"]) == before and w.received["airline"] == []


def test_when_the_decider_is_gone_nothing_goes_out(stack: EgressStack) -> None:
    w = stack.world
    task = w.task()
    stack.stop_decider()
    with pytest.raises(Exception) as failed:
        w.call(task, "merchant__list_subscriptions")
    assert "502" in str(failed.value)
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
    for file in (POLICIES / "connectors").glob("*.toml"):
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


def test_the_canary_secret_is_nowhere_but_in_the_headers_the_upstream_received(
        tool_stack: EgressStack, tmp_path: Path) -> None:
    stack, w = tool_stack, tool_stack.world
    bodies: list[bytes] = []
    _, action = _cancel_admitted(stack)
    w.dispatcher.drain()
    w.dispatcher.verify_due()
    w.dispatcher.complete_due()
    port = _port(stack, "merchant")
    with _tool_computer(stack) as client:
        for url in (f"https://merchant.test:{port}/v1/subscriptions", f"https://airline.test:{port}/",
                    f"http://merchant.test:{port}/"):
            response = client.get(url)
            bodies.append(response.content + str(response.headers).encode())
    rows = stack.audit(6)
    assert len(w.merchant.effects) == 1 and any(r["verdict"] == "refuse" for r in rows)
    needle = stack.secret.encode()
    assert any(needle in v.encode() for r in w.received["merchant"] for _, v in r.headers)  # the one place it is
    leaks = [str(path) for path in tmp_path.rglob("*") if path.is_file() and needle in path.read_bytes()]
    leaks += [f"response {i}" for i, body in enumerate(bodies) if needle in body]
    leaks += ["audit"] if needle in repr(rows).encode() else []
    assert leaks == [], f"the secret leaked into {leaks}"
    assert stack.proxy_log.read_bytes(), "the proxy wrote no log at all: the search above proved nothing about it"
