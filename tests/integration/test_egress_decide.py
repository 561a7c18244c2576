"""The policy's side of the egress proxy, against real SQLite and the merchant simulator on loopback.

A `DecidingTransport` stands in for the proxy in-process: it builds the `DecisionRequest` the proxy would send, asks
the decider, and forwards to the simulator only on an allow. Whatever happens in between (a pause, a STOP, a
tampered body) is done by the test at that moment; the simulator's own records say whether anything was applied.
The real proxy process is exercised in test_egress_proxy.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select

from tests.support.acting import World, world
from wakeful.proxy.clock import FakeClock
from wakeful.proxy.contract import Allow, DecisionRequest, Refuse, Verdict
from wakeful.proxy.hosts import default_port, normalize_host
from wakeful.proxy.rewrite import ATTEMPT_HEADER
from wakeful.server.core import control
from wakeful.server.egress import grants as egress
from wakeful.server.egress.dispatch import ActionDispatcher
from wakeful.server.egress.outbound import ConnectorHTTP
from wakeful.server.egress.proxyctl import DeciderService
from wakeful.server.errors import BadRequest, WakefulError
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, Outcome, attempts, egress_grant_uses, egress_grants

Hook = Callable[[DecisionRequest], object]
"""Runs between the request leaving the server and the decision; a `DecisionRequest` it returns replaces it."""


class DecidingTransport(httpx.BaseTransport):
    """Asks the decider exactly what the proxy would ask; forwards only an allowed request, without the token."""

    def __init__(self, service: DeciderService) -> None:
        self.service = service
        self.verdicts: list[Verdict] = []
        self.hook: Hook | None = None
        self._upstream = httpx.HTTPTransport()
        self._seq = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        self._seq += 1
        url = request.url
        path, _, query = url.raw_path.decode("ascii").partition("?")
        asked = DecisionRequest(
            request_id=f"req-{self._seq}", user_id=None, attempt_token=request.headers.get(ATTEMPT_HEADER),
            client_token=None, method=request.method, scheme=url.scheme,  # type: ignore[arg-type]
            host=normalize_host(url.host), port=url.port or default_port(url.scheme), path=path, query=query,
            body_sha256=hashlib.sha256(body).hexdigest(), resolved_ips=(), client="connector")
        if self.hook is not None:
            changed = self.hook(asked)
            asked = changed if isinstance(changed, DecisionRequest) else asked
        verdict = self.service.decide_now(asked)
        self.verdicts.append(verdict)
        if isinstance(verdict, Refuse):
            return httpx.Response(403, json={"error": {"code": verdict.code.value, "message": verdict.reason}},
                                  request=request)
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != ATTEMPT_HEADER.lower()]
        return self._upstream.handle_request(httpx.Request(request.method, url, headers=headers, content=body,
                                                           extensions=request.extensions))


@pytest.fixture
def gate(engine: Engine, clock: FakeClock, settings: Settings) -> DecidingTransport:
    return DecidingTransport(DeciderService(engine, clock, settings))


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str, gate: DecidingTransport) -> Iterator[World]:
    http = ConnectorHTTP(timeout=2.0, proxy_url="http://proxy.invalid", transport=gate,
                         grant_ttl=timedelta(seconds=60))
    with world(engine, clock, owner, http=http) as w:
        yield w


def _admitted_cancel(w: World) -> tuple[str, str]:
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    assert w.approve(action) == "admitted"
    return task.task_id, action


def _outcomes(w: World) -> list[str | None]:
    with read(w.engine) as conn:
        return list(conn.execute(select(attempts.c.outcome)).scalars())


def test_a_granted_read_and_an_admitted_write_are_allowed_with_the_connectors_credential(
        w: World, gate: DecidingTransport) -> None:
    _admitted_cancel(w)
    assert w.dispatcher.drain() == 1
    read_allow, write_allow = gate.verdicts
    assert isinstance(read_allow, Allow) and isinstance(write_allow, Allow)
    assert read_allow.credential == write_allow.credential == "merchant_api"
    assert read_allow.action_id is None and read_allow.rule == "read merchant__list_subscriptions"
    assert write_allow.action_id is not None and write_allow.rule.startswith("write merchant__cancel_renewal")
    assert [e["kind"] for e in w.merchant.effects] == ["cancel_renewal"]
    with read(w.engine) as conn:
        purposes = sorted(conn.execute(select(egress_grants.c.purpose)).scalars())
    assert purposes == ["read", "write"]


def _refused_write(w: World, gate: DecidingTransport, meddle: Hook, *, later: timedelta = timedelta(0)) -> Refuse:
    """An admitted cancellation, drained `later` after its approval, with `meddle` run while it is on its way."""
    _admitted_cancel(w)
    w.clock.advance(later)
    gate.hook = meddle
    w.dispatcher.drain()
    verdict = gate.verdicts[-1]
    assert isinstance(verdict, Refuse)
    assert w.merchant.effects == []  # the merchant's own record: nothing was applied
    assert _outcomes(w) == [Outcome.BLOCKED.value]  # refused before it left: definitely not applied
    return verdict


def _set_task_state(w: World, kind: ControlKind) -> Hook:
    def hook(req: DecisionRequest) -> None:
        with write(w.engine) as conn:
            task_id = conn.execute(select(egress_grants.c.task_id).where(
                egress_grants.c.purpose == "write")).scalar_one()
            control.set_task_state(conn, user_id=w.owner, task_id=task_id, kind=kind, actor="user:test",
                                   reason="changed my mind", now=w.clock.now())
    return hook


@pytest.mark.parametrize(("kind", "state"), [(ControlKind.PAUSE, "paused"), (ControlKind.REVOKE, "revoked")])
def test_a_write_is_refused_when_the_task_is_paused_or_revoked_while_it_is_on_its_way(
        w: World, gate: DecidingTransport, kind: ControlKind, state: str) -> None:
    refused = _refused_write(w, gate, _set_task_state(w, kind))
    assert refused.code == "not_admitted" and f"the task is {state}" in refused.reason


def test_a_write_is_refused_after_stop(w: World, gate: DecidingTransport) -> None:
    def stop(req: DecisionRequest) -> None:
        with write(w.engine) as conn:
            control.set_stop(conn, stopped=True, user_id=None, actor="cli", reason="test", now=w.clock.now())
    refused = _refused_write(w, gate, stop)
    assert refused.code == "not_admitted" and "STOP" in refused.reason


def test_a_grant_that_expired_on_the_way_is_refused(w: World, gate: DecidingTransport) -> None:
    refused = _refused_write(w, gate, lambda req: w.clock.advance(timedelta(seconds=61)))
    assert refused.code == "not_admitted" and "expired" in refused.reason


def test_a_write_is_refused_when_the_user_steered_the_task_while_it_was_on_its_way(
        w: World, gate: DecidingTransport) -> None:
    def steer(req: DecisionRequest) -> None:
        with write(w.engine) as conn:
            task_id = conn.execute(select(egress_grants.c.task_id).where(
                egress_grants.c.purpose == "write")).scalar_one()
            control.steer(conn, user_id=w.owner, task_id=task_id, goal="actually, keep it", actor="user:test",
                          now=w.clock.now())
    refused = _refused_write(w, gate, steer)
    assert refused.code == "not_admitted" and "the task moved to version 2" in refused.reason


def test_a_write_whose_attempt_a_restarted_dispatcher_already_settled_is_refused_when_it_arrives_late(
        w: World, gate: DecidingTransport) -> None:
    _admitted_cancel(w)

    def restarted_dispatcher_recovers(req: DecisionRequest) -> None:
        # Another dispatcher (the server restarted) finds the attempt open and settles it as unknown, to be
        # reconciled; the old request reaches the proxy only afterwards.
        second = ActionDispatcher(w.engine, w.clock, policy=w.policy, http=ConnectorHTTP(timeout=2.0))
        try:
            assert second.drain() == 1
        finally:
            second.close()
    gate.hook = restarted_dispatcher_recovers
    w.dispatcher.drain()
    refused = gate.verdicts[-1]
    assert isinstance(refused, Refuse) and refused.code == "not_admitted"
    assert "already has an outcome (unknown)" in refused.reason
    assert w.merchant.effects == []  # the late request was never applied
    with read(w.engine) as conn:
        (attempt,) = conn.execute(select(attempts)).all()
    assert attempt.outcome == Outcome.UNKNOWN.value and "may or may not have left" in attempt.detail  # reconciled


def test_a_write_is_refused_when_its_object_expires_while_it_is_on_its_way(w: World, gate: DecidingTransport) -> None:
    # Sent 30 s before the subscription object's lifetime ends (still valid when the dispatcher checked it), it
    # reaches the decider 45 s later: the grant (60 s) still holds, the object no longer does.
    later = w.policy.object_ttl - timedelta(seconds=30)
    refused = _refused_write(w, gate, lambda req: w.clock.advance(timedelta(seconds=45)), later=later)
    assert refused.code == "not_admitted" and "subscription: obj_" in refused.reason and "expired at" in refused.reason


def test_a_booking_is_refused_when_its_quote_expires_while_it_is_on_its_way(w: World, gate: DecidingTransport) -> None:
    task = w.task(title="book the hotel")
    (quote,) = w.call(task, "hotel__quote_stay", hotel="Grand", nights=2)["objects"]
    action = w.call(task, "hotel__book_quote", quote_id=quote["id"])["action_id"]
    w.clock.advance(timedelta(minutes=14, seconds=30))  # the quote lives 15 minutes: approved and sent in time
    w.hotel.clock.advance(timedelta(minutes=14, seconds=30))
    assert w.approve(action) == "admitted"
    gate.hook = lambda req: w.clock.advance(timedelta(seconds=45))  # ...and decided after it expired
    w.dispatcher.drain()
    refused = gate.verdicts[-1]
    assert isinstance(refused, Refuse) and refused.code == "not_admitted"
    assert refused.reason.startswith("quote_id: the quote expired at")
    assert w.hotel.effects == []  # the hotel's own record: nothing was booked
    assert _outcomes(w) == [Outcome.BLOCKED.value]


@pytest.mark.parametrize(("part", "change"), [
    ("path", {"path": "/v1/subscriptions/sub_2/cancel_renewal"}),
    ("body", {"body_sha256": hashlib.sha256(b'{"reason":"other"}').hexdigest()}),
    ("method", {"method": "DELETE"}),
    ("host", {"host": "other.test"}),
    ("query", {"query": "all=true"}),
])
def test_a_request_that_differs_from_its_grant_is_refused_as_content_mismatch(
        w: World, gate: DecidingTransport, part: str, change: dict[str, str]) -> None:
    def tamper(req: DecisionRequest) -> DecisionRequest:
        return DecisionRequest(**{**req.__dict__, **change})
    refused = _refused_write(w, gate, tamper)
    assert refused.code == "content_mismatch" and f"request's {part} differs" in refused.reason


def test_a_forged_attempt_token_is_not_admitted(w: World, gate: DecidingTransport) -> None:
    refused = _refused_write(w, gate, lambda req: DecisionRequest(**{**req.__dict__, "attempt_token": "forged"}))
    assert refused.code == "not_admitted" and "no request was granted" in refused.reason


def test_a_connector_request_without_a_token_is_not_admitted(gate: DecidingTransport) -> None:
    req = DecisionRequest(request_id="r1", user_id=None, attempt_token=None, client_token=None, method="GET",
                          scheme="https", host="merchant.test", port=443, path="/v1/subscriptions", query="",
                          body_sha256=hashlib.sha256(b"").hexdigest(), resolved_ips=(), client="connector")
    verdict = gate.service.decide_now(req)
    assert isinstance(verdict, Refuse) and verdict.code == "not_admitted"


def test_the_same_token_cannot_carry_another_request(w: World, gate: DecidingTransport) -> None:
    task = w.task()
    w.call(task, "merchant__list_subscriptions")
    seen: list[DecisionRequest] = []
    gate.hook = seen.append
    w.call(task, "merchant__list_subscriptions")
    replay = DecisionRequest(**{**seen[0].__dict__, "path": "/v1/subscriptions/sub_1", "request_id": "again"})
    verdict = gate.service.decide_now(replay)
    assert isinstance(verdict, Refuse) and verdict.code == "content_mismatch"


def test_a_write_token_lets_one_request_through_even_while_its_attempt_is_still_open(
        w: World, gate: DecidingTransport) -> None:
    def replayed_first(req: DecisionRequest) -> None:
        if req.method == "POST":  # the same bytes under the same token reach the decider first
            replays.append(gate.service.decide_now(DecisionRequest(**{**req.__dict__, "request_id": "replay"})))
    replays: list[Verdict] = []
    refused = _refused_write(w, gate, replayed_first)
    assert [type(v) for v in replays] == [Allow], "the first of the two was allowed (and would have been sent)"
    assert refused.code == "not_admitted" and "used once" in refused.reason
    with read(w.engine) as conn:
        used = conn.execute(select(egress_grant_uses.c.request_id).join(egress_grants).where(
            egress_grants.c.purpose == "write")).scalars().all()
    assert used == ["replay"], "one use, recorded by the schema"


def test_a_read_token_is_used_up_by_its_request(w: World, gate: DecidingTransport) -> None:
    seen: list[DecisionRequest] = []
    gate.hook = seen.append
    w.call(w.task(), "merchant__list_subscriptions")
    assert isinstance(gate.verdicts[-1], Allow)
    again = gate.service.decide_now(DecisionRequest(**{**seen[0].__dict__, "request_id": "again"}))
    assert isinstance(again, Refuse) and again.code == "not_admitted" and "used once" in again.reason


def test_reconciliation_still_goes_out_while_the_task_is_paused(w: World, gate: DecidingTransport) -> None:
    task_id, action = _admitted_cancel(w)
    w.merchant.faults.commit_then_timeout = 1  # applied, but the answer comes too late: outcome unknown
    w.dispatcher.drain()
    assert _outcomes(w) == [Outcome.UNKNOWN.value]
    with write(w.engine) as conn:
        control.set_task_state(conn, user_id=w.owner, task_id=task_id, kind=ControlKind.PAUSE, actor="user:test",
                               reason="hold on", now=w.clock.now())
    w.dispatcher.reconcile(action)
    assert isinstance(gate.verdicts[-1], Allow) and gate.verdicts[-1].rule.startswith("reconcile ")
    assert len(w.merchant.effects) == 1


# -- tool computers -------------------------------------------------------------------------------------------------

EGRESS_TOML = """\
[[allow]]
name = "shop"
host = "shop.example.com"
methods = ["GET", "POST"]
credential = "shop_session"

[[allow]]
name = "docs for alice only"
host = "*.docs.example.com"
users = ["alice"]
"""


def _tc(user_id: str, token: str | None, host: str, method: str = "GET", path: str = "/") -> DecisionRequest:
    return DecisionRequest(request_id="r", user_id=user_id, attempt_token=None, client_token=token, method=method,
                           scheme="https", host=host, port=443, path=path, query="",
                           body_sha256=hashlib.sha256(b"").hexdigest(), resolved_ips=(), client="tool_computer")


@pytest.fixture
def rules_service(engine: Engine, clock: FakeClock, settings: Settings) -> DeciderService:
    settings.policies.mkdir(parents=True, exist_ok=True)
    (settings.policies / "egress.toml").write_text(EGRESS_TOML)
    return DeciderService(engine, clock, settings)


def test_tool_computer_traffic_is_allowed_only_by_a_rule_and_only_with_a_valid_proxy_credential(
        engine: Engine, clock: FakeClock, owner: str, rules_service: DeciderService) -> None:
    with write(engine) as conn:
        client_id, token = egress.issue_client_token(conn, user_id=owner, label="vm", now=clock.now())
    allowed = rules_service.decide_now(_tc(owner, token, "shop.example.com", "POST", "/cart"))
    assert isinstance(allowed, Allow) and allowed.credential == "shop_session"
    assert allowed.rule == "shop, for tool computer vm"  # the audit row says which tool computer
    for refused, code in [
        (_tc(owner, token, "evil.example.net"), "host_not_allowed"),
        (_tc(owner, token, "shop.example.com", "DELETE"), "host_not_allowed"),
        (_tc(owner, token, "a.docs.example.com"), "host_not_allowed"),  # that rule is alice's, not the owner's
        (_tc(owner, "not-the-token", "shop.example.com"), "not_admitted"),
        (_tc("usr_someone_else", token, "shop.example.com"), "not_admitted"),
        (_tc(owner, None, "shop.example.com"), "not_admitted"),
    ]:
        verdict = rules_service.decide_now(refused)
        assert isinstance(verdict, Refuse) and verdict.code == code, refused
    with write(engine) as conn:
        egress.revoke_client(conn, client_id, now=clock.now())
    revoked = rules_service.decide_now(_tc(owner, token, "shop.example.com"))
    assert isinstance(revoked, Refuse) and revoked.code == "not_admitted"


def test_an_egress_policy_with_a_typo_names_the_line_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "egress.toml"
    path.write_text('[[allow]]\nname = "x"\nhost = "a.example.com"\n\n[[allow]]\nname = "y"\nhots = "b.example"\n')
    with pytest.raises(BadRequest) as bad:
        egress.load_egress_rules(path)
    assert bad.value.code == "invalid_egress_policy"
    assert "line 5" in bad.value.message and "allow.1.hots" in bad.value.message
    path.write_text('[[allow]]\nname = "x"\nhost = "*.example.com"\ncredential = "c"\n')
    with pytest.raises(WakefulError, match="names its host exactly"):
        egress.load_egress_rules(path)


def test_an_edit_that_breaks_the_egress_policy_allows_nothing_until_fixed(
        engine: Engine, clock: FakeClock, owner: str, rules_service: DeciderService, settings: Settings) -> None:
    with write(engine) as conn:
        _, token = egress.issue_client_token(conn, user_id=owner, label="vm", now=clock.now())
    assert isinstance(rules_service.decide_now(_tc(owner, token, "shop.example.com")), Allow)
    path = settings.policies / "egress.toml"
    path.write_text(EGRESS_TOML + "\n[[allow]]\nname = 'broken'\n")
    stat = path.stat()
    import os
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a distinct mtime, however fast
    verdict = rules_service.decide_now(_tc(owner, token, "shop.example.com"))
    assert isinstance(verdict, Refuse) and verdict.code == "host_not_allowed"
