"""The HTTP API fuzzed against its own OpenAPI document (schemathesis): every operation the document lists but MCP's
(whose protocol is its own, fuzzed by test_mcp_fuzz.py), with a user's token, on a real server on loopback over a
real database (SQLite, and PostgreSQL, which refuses other text) that holds a task, an action waiting for approval,
a steer the agent proposed, an event, messages, egress records and a live view the generated requests can reach.

Every answer must have a documented status, content type and shape; none may be a server error; a route that asks
for a token must refuse a request without one; a request the document calls invalid must be refused. Requests are
generated valid and invalid; in about half, the parameters are swapped for the IDs of those records and webhook
deliveries are signed, so the fuzzer gets past "no such task" and "bad signature" to the code behind them. The
examples are derandomized (hypothesis's fixed seed) and bounded: a run is the same run every time, about a minute.

(schemathesis's own pytest integration, `schemathesis.pytest.from_fixture`, reads a pytest internal that pytest 9.2
removed; each operation's strategy is driven with hypothesis here instead.)"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core import NotSet
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import Engine

from tests.support.acting import world
from tests.support.serve import serving
from wakeful.proxy.audit import EgressRecord
from wakeful.proxy.clock import FakeClock
from wakeful.server import memory
from wakeful.server.core import outbox, steers
from wakeful.server.core.signatures import sign
from wakeful.server.egress.grants import store_audit
from wakeful.server.faces.http import create_app
from wakeful.server.faces.liveview import COOKIE
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import write
from wakeful.server.store.users import issue_token

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          ignored_auth, negative_data_rejection]
EXAMPLES = 100
"""Per operation (two dozen of them; schemathesis leaves out the document's own route): about a minute on two cores."""
HOOK = "/v1/hooks/{source}"
FRAMING = {"content-length", "transfer-encoding", "host", "connection", "expect", "upgrade"}
"""Headers that frame the HTTP message: the HTTP server's (uvicorn's) to parse, in plain text when they are wrong,
before the API sees a request. The fuzzer's invented extra headers sometimes name one."""


@dataclass(frozen=True)
class Served:
    url: str
    auth: dict[str, str]
    known: dict[str, str]
    """A real record's ID (or a live view's binder) per parameter name."""
    secret: bytes
    clock: FakeClock


BACKENDS = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)


@pytest.fixture
def served(settings: Settings, engine: Engine, clock: FakeClock, owner: str) -> Iterator[Served]:
    with world(engine, clock, owner) as w, ExitStack() as stack:
        runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine, registry=w.tools.registry)
        runtime.prepare()
        task = w.task()
        (subscription,) = w.call(task, "merchant__list_subscriptions")["objects"]
        action_id = w.call(task, "merchant__cancel_renewal", subscription=subscription["id"])["action_id"]
        with write(engine) as conn:
            token = issue_token(conn, user_id=owner)
            proposed = steers.steer(conn, user_id=owner, task_id=task.task_id, goal="another goal", constraints={},
                                    completion=[], actor=f"agent:{owner}", now=clock.now())
            assert proposed.steer_id is not None  # another goal widens the task: only proposed
            for text in ("first", "second"):
                outbox.enqueue(conn, user_id=owner, body={"text": text}, now=clock.now(), session_id=task.session_id)
            store_audit(conn, [_egress_record(owner, clock, n) for n in range(2)], now=clock.now())
            remembered = memory.propose(conn, user_id=owner, actor=memory.Actor(
                kind=memory.ActorKind.AGENT, task_id=task.task_id, name="fuzz"), now=clock.now(),
                proposal=memory.parse_proposal({"form": "fact", "text": "the user lives in Hong Kong",
                                                "scope": "always", "subject": "home", "relation": "is",
                                                "value": "hong kong"}))
        secret = settings.sources["hook"].secret.get_secret_value().encode()
        assert runtime.live is not None
        link, _ = runtime.live.offer_view(owner, timedelta(minutes=15))  # left for the fuzzer to redeem
        redeemed = runtime.live.redeem(runtime.live.offer_view(owner, timedelta(minutes=15))[0])
        assert redeemed is not None
        session, binder = redeemed
        runtime.committer.start()  # the inbox's (on PostgreSQL it commits on a thread); no other loop runs
        stack.callback(runtime.committer.stop)
        with serving(create_app(runtime, manage_runtime=False)) as url:
            body = json.dumps({"session_key": "fuzz"}).encode()
            delivered = httpx.post(f"{url}/v1/hooks/hook", content=body, headers={
                **sign("generic", secret=secret, body=body, now=clock.now().timestamp(), delivery_id="d-1"),
                "Content-Type": "application/json"})
            assert delivered.status_code == 200, delivered.text
            yield Served(url=url, auth={"Authorization": f"Bearer {token}"}, secret=secret, clock=clock, known={
                "task_id": task.task_id, "action_id": action_id, "event_id": delivered.json()["event_id"],
                "source": "hook", "token": link, "session": session, COOKIE: binder,
                "steer_id": proposed.steer_id, "memory_id": remembered.memory_id})


def _egress_record(user_id: str, clock: FakeClock, n: int) -> EgressRecord:
    return EgressRecord(
        request_id=f"req-{n}", at=clock.now() - timedelta(seconds=n), user_id=user_id, client="tool_computer",
        attempt_id=None, action_id=None, method="GET", scheme="https", host="example.org", port=443, path="/",
        verdict="refuse" if n else "allow", code=None, rule="fuzz", credential=None, bytes_up=0, bytes_down=0,
        upstream_status=None, latency_ms=1.0)


@pytest.fixture
def api(served: Served) -> schemathesis.BaseSchema:
    loaded = schemathesis.openapi.from_url(f"{served.url}/openapi.json", headers=served.auth)
    return loaded.exclude(path_regex=r"^/mcp$")  # MCP's own protocol: its own tests (test_mcp*.py) fuzz it


@BACKENDS
def test_every_answer_is_documented_and_none_is_a_server_error(api: schemathesis.BaseSchema, served: Served) -> None:
    failures = {}
    for result in api.get_all_operations():
        operation = result.ok()
        try:
            _fuzz(operation, served)
        except (FailureGroup, AssertionError) as failure:  # each operation's is reported, then the next is fuzzed
            failures[operation.label] = str(failure)
    assert not failures, "\n\n".join(f"{label}:\n{failure}" for label, failure in failures.items())


def _fuzz(operation: APIOperation, served: Served) -> None:
    """Positive and negative requests to one operation, from a fixed seed (hypothesis derandomized)."""
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(case=cases, real=st.booleans())
    def one(case: schemathesis.Case, real: bool) -> None:
        extra: dict[str, Any] = {}
        if case.headers:
            case.headers = {name: value for name, value in case.headers.items() if name.lower() not in FRAMING}
        if real:
            case.path_parameters = _known(case.path_parameters, served)
            case.cookies = _known(case.cookies, served)
        if real and case.operation.path == HOOK and not isinstance(case.body, NotSet):
            extra = _signed(case.body, served)
        headers = {**served.auth, **extra.pop("headers", {})}
        case.call_and_validate(base_url=served.url, headers=headers, checks=CHECKS, **extra)

    one()


def _known(values: dict[str, Any] | None, served: Served) -> dict[str, Any] | None:
    return values and {name: served.known.get(name, value) for name, value in values.items()}


BODIES = {  # a body each route takes, with a slot (@) for one JSON value
    "/v1/control/stop": b'{"reason": @}', "/v1/control/start": b'{"reason": @}', "/v1/tasks": b'{"title": @}',
    "/v1/control/everything/stop": b'{"reason": @}', "/v1/control/everything/start": b'{"reason": @}',
    "/v1/tasks/{task_id}/steer": b'{"goal": @}', "/v1/tasks/{task_id}/{operation}": b'{"reason": @}',
    "/v1/tasks/{task_id}/messages": b'{"text": @}',
    "/v1/actions/{action_id}/{decision}": b'{"reason": @}', "/v1/live/view": b'{"minutes": @}',
    "/v1/preferences": b'{"timezone": @}', HOOK: b'{"session_key": @}',
    "/v1/memory": b'{"form": "fact", "text": @, "subject": "home", "relation": "is", "value": "x"}',
    "/v1/memory/{memory_id}/edit": b'{"text": @}', "/v1/memory/{memory_id}/correct": b'{"reason": @}',
    "/v1/memory/{memory_id}/forget": b'{"reason": @}',
}
ABSURD = {  # a value for the slot, and the code it is refused with
    b'"\\ud800"': "malformed_body", b'"\\u0000"': "malformed_body", b"1e400": "number_out_of_range",
    b"NaN": "malformed_body", b'"\xff"': "malformed_body", b"1" * 100: "number_too_long",
    b"[" * 70 + b"]" * 70: "json_too_deep", b'{"k": 1, "k": 2}': "duplicate_key",
}


@BACKENDS
def test_absurd_bodies_are_refused_with_a_documented_code_on_every_route_that_takes_one(
        api: schemathesis.BaseSchema, served: Served) -> None:
    """Half a surrogate pair, NUL, a number past a double, NaN, bytes that are not UTF-8, a 100-digit number, 70 levels
    of nesting, a key twice: in a body that is otherwise right, on every route the document says takes a body (the
    webhook's deliveries signed), each is a documented 400 with its code, never a 500 or an acceptance."""
    taking = [op for op in (r.ok() for r in api.get_all_operations()) if op.body]
    assert {op.path for op in taking} == set(BODIES), "a route takes a body this test has no example of"
    for operation in taking:
        for value, code in ABSURD.items():
            raw = BODIES[operation.path].replace(b"@", value)
            if operation.path == HOOK and code == "malformed_body" and b"\\u" in value:
                code = "invalid_session_key"  # a payload keeps such text, escaped; the key read from it cannot
            signed = _signed(raw, served) if operation.path == HOOK else {"data": raw, "headers": {}}
            case = operation.Case(path_parameters={name: served.known.get(name, "pause" if name == "operation" else
                                                                          "deny") for name in _names(operation.path)})
            response = case.call_and_validate(base_url=served.url, checks=CHECKS, data=signed["data"], headers={
                **served.auth, "Content-Type": "application/json", **signed["headers"]})
            refused = (response.status_code, response.json().get("error", {}).get("code"))
            assert refused == (400, code), (operation.label, value, response.text)


@BACKENDS
def test_nul_in_a_path_parameter_is_a_documented_refusal_on_every_route_that_takes_one(
        api: schemathesis.BaseSchema, served: Served) -> None:
    """No ID holds NUL, and PostgreSQL cannot even be asked about one: where a route looks it up, it is a 400."""
    for operation in (r.ok() for r in api.get_all_operations()):
        for name in _names(operation.path):
            parameters = {other: served.known.get(other, "x") for other in _names(operation.path)} | {name: "a\x00b"}
            response = operation.Case(path_parameters=parameters).call_and_validate(
                base_url=served.url, headers=served.auth, checks=CHECKS)
            assert 400 <= response.status_code < 500, (operation.label, name)


def _names(path: str) -> list[str]:
    return re.findall(r"\{(\w+)\}", path)


def _signed(body: Any, served: Served) -> dict[str, Any]:
    """The delivery as its source would sign it: the raw bytes and the headers that go with them."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return {"data": raw, "headers": {
        **sign("generic", secret=served.secret, body=raw, now=served.clock.now().timestamp(), delivery_id="fuzz"),
        "Content-Type": "application/json"}}


def test_the_openapi_document_is_served_only_to_a_user(served: Served) -> None:
    assert httpx.get(f"{served.url}/openapi.json").status_code == 401
    document = httpx.get(f"{served.url}/openapi.json", headers=served.auth).json()
    assert HOOK in document["paths"] and "/v1/tasks" in document["paths"]
