"""The HTTP API, through the real FastAPI app and its lifespan (runtime threads on a real SQLite file)."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from tests.support.polling import wait_until
from tests.support.records import event_rows, run_rows
from tests.support.templates import copy_template
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import control, outbox
from wakeful.server.core.signatures import SignatureKind, sign
from wakeful.server.faces.http import QuietServer, create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import make_engine, migrate, read, write
from wakeful.server.store.users import ensure_user

SECRET = "shh-its-a-secret"
KINDS: list[SignatureKind] = ["github", "stripe", "slack", "generic"]


@pytest.fixture
def app_settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path, max_body_bytes=4096, poll_interval=0.05, sweep_interval=3600,
                    sources={kind: {"kind": kind, "secret": SECRET} for kind in KINDS})


@pytest.fixture
def app_engine(app_settings: Settings, sqlite_template: Path) -> Iterator[Engine]:
    copy_template(sqlite_template, app_settings.db_url)
    engine = make_engine(app_settings.db_url)
    migrate(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def client(app_settings: Settings, app_engine: Engine, clock: FakeClock) -> Iterator[TestClient]:
    runtime = Runtime(app_settings, handler=EchoHandler(), clock=clock, engine=app_engine)
    runtime.prepare()
    with TestClient(create_app(runtime)) as client:
        yield client


@pytest.fixture
def token(app_engine: Engine, clock: FakeClock) -> str:
    with write(app_engine) as conn:
        _, new = ensure_user(conn, name="second", now=clock.now())
    assert new is not None
    return new


def signed(kind: SignatureKind, payload: dict[str, Any], clock: FakeClock, delivery: str = "d-1",
           secret: str = SECRET) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(payload).encode()
    headers = sign(kind, secret=secret.encode(), body=body, now=clock.now().timestamp(), delivery_id=delivery)
    return body, headers | {"content-type": "application/json"}


def payload_for(kind: SignatureKind, delivery: str) -> dict[str, Any]:
    # Stripe and Slack carry the delivery ID in the body.
    return {"id": delivery, "event_id": delivery, "type": "event", "issue": {"number": 7}}


@pytest.mark.parametrize("kind", KINDS)
def test_a_correctly_signed_delivery_is_stored_and_acknowledged(client: TestClient, app_engine: Engine,
                                                                clock: FakeClock, kind: SignatureKind) -> None:
    body, headers = signed(kind, payload_for(kind, "d-1"), clock)
    response = client.post(f"/v1/hooks/{kind}", content=body, headers=headers)
    assert response.status_code == 200, response.text
    (event,) = event_rows(app_engine)
    # GitHub signs no delivery ID (X-GitHub-Delivery is not signed): its deliveries are told apart by the signed body.
    source_id = "sha256:" + hashlib.sha256(body).hexdigest() if kind == "github" else "d-1"
    assert response.json()["event_id"] == event.id and event.source == kind and event.source_id == source_id


@pytest.mark.parametrize("kind", KINDS)
def test_a_delivery_signed_with_another_secret_is_refused_and_nothing_is_stored(
        client: TestClient, app_engine: Engine, clock: FakeClock, kind: SignatureKind) -> None:
    body, headers = signed(kind, payload_for(kind, "d-1"), clock, secret="wrong")
    response = client.post(f"/v1/hooks/{kind}", content=body, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "signature_mismatch"
    assert event_rows(app_engine) == []


def test_an_unsigned_delivery_is_refused(client: TestClient, app_engine: Engine) -> None:
    response = client.post("/v1/hooks/generic", content=b"{}", headers={"X-Wakeful-Delivery": "x"})
    assert (response.status_code, response.json()["error"]["code"]) == (401, "signature_missing")
    assert event_rows(app_engine) == []


def test_a_stale_stripe_timestamp_is_refused(client: TestClient, clock: FakeClock) -> None:
    body, headers = signed("stripe", payload_for("stripe", "evt_1"), clock)
    clock.advance(__import__("datetime").timedelta(minutes=6))
    response = client.post("/v1/hooks/stripe", content=body, headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (401, "signature_expired")


def test_the_same_delivery_twice_is_one_row_and_returns_the_original_id(client: TestClient, app_engine: Engine,
                                                                       clock: FakeClock) -> None:
    body, headers = signed("generic", {"x": 1}, clock)
    first = client.post("/v1/hooks/generic", content=body, headers=headers).json()
    second = client.post("/v1/hooks/generic", content=body, headers=headers).json()
    assert first["event_id"] == second["event_id"]
    assert (first["duplicate"], second["duplicate"]) == (False, True)
    assert len(event_rows(app_engine)) == 1


def test_fifty_concurrent_identical_deliveries_are_one_row(client: TestClient, app_engine: Engine,
                                                           clock: FakeClock) -> None:
    body, headers = signed("generic", {"x": 1}, clock, delivery="same")
    with ThreadPoolExecutor(max_workers=50) as pool:
        responses = list(pool.map(lambda _: client.post("/v1/hooks/generic", content=body, headers=headers),
                                  range(50)))
    assert {r.status_code for r in responses} == {200}
    assert len({r.json()["event_id"] for r in responses}) == 1
    assert len(event_rows(app_engine)) == 1


@pytest.mark.parametrize(("body", "code"), [
    (b"not json", "malformed_body"), (b"[1, 2]", "malformed_body"), (b'{"a": NaN}', "malformed_body"),
    (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", "json_too_deep"),
    (b'{"n": ' + b"9" * 4000 + b"}", "number_too_long"),
    (b'{"session_key": "mine", "session_key": "yours"}', "duplicate_key"),
], ids=["not json", "not an object", "NaN", "too deep", "a 4000-digit number", "a key twice"])
def test_a_malformed_body_is_a_400_with_a_stable_code(client: TestClient, app_engine: Engine, clock: FakeClock,
                                                      body: bytes, code: str) -> None:
    headers = sign("generic", secret=SECRET.encode(), body=body, now=clock.now().timestamp(), delivery_id="d")
    response = client.post("/v1/hooks/generic", content=body, headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (400, code)
    assert event_rows(app_engine) == []  # a signed but absurd body is refused whole, nothing recorded


def test_a_delivery_without_its_delivery_id_is_refused(client: TestClient, clock: FakeClock) -> None:
    body = b"{}"  # Stripe's delivery ID is the body's `id`
    headers = sign("stripe", secret=SECRET.encode(), body=body, now=clock.now().timestamp())
    response = client.post("/v1/hooks/stripe", content=body, headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (400, "missing_delivery_id")


def test_a_body_over_the_limit_is_a_413(client: TestClient, app_engine: Engine, clock: FakeClock) -> None:
    body, headers = signed("generic", {"pad": "x" * 5000}, clock)
    response = client.post("/v1/hooks/generic", content=body, headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (413, "payload_too_large")
    assert event_rows(app_engine) == []


def test_a_streamed_body_over_the_limit_is_a_413_without_a_declared_length(client: TestClient, app_engine: Engine,
                                                                           clock: FakeClock) -> None:
    body, headers = signed("generic", {"pad": "x" * 5000}, clock)
    response = client.post("/v1/hooks/generic", content=iter([body[:2000], body[2000:]]), headers=headers)
    assert "content-length" not in {k.lower() for k in response.request.headers}
    assert (response.status_code, response.json()["error"]["code"]) == (413, "payload_too_large")
    assert event_rows(app_engine) == []


def test_a_delivery_that_fails_unexpectedly_is_a_500_with_a_code(app_settings: Settings, app_engine: Engine,
                                                                 clock: FakeClock,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    runtime = Runtime(app_settings, handler=EchoHandler(), clock=clock, engine=app_engine)
    runtime.prepare()

    async def broken(_delivery: object) -> None:
        raise RuntimeError("the disk went away")

    runtime.committer.persist = broken  # type: ignore[method-assign,assignment]
    body, headers = signed("generic", {}, clock)
    with TestClient(create_app(runtime)) as client:
        response = client.post("/v1/hooks/generic", content=body, headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (500, "internal_error")
    assert "the disk went away" in caplog.text  # logged with its traceback, not sent to the provider
    assert "the disk went away" not in response.text


def test_an_unknown_source_is_a_404(client: TestClient, clock: FakeClock) -> None:
    body, headers = signed("generic", {}, clock)
    response = client.post("/v1/hooks/nope", content=body, headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (404, "unknown_source")


def test_a_webhook_path_answers_only_post(client: TestClient, app_engine: Engine) -> None:
    response = client.get("/v1/hooks/generic")
    assert (response.status_code, response.json()["error"]["code"]) == (405, "method_not_allowed")
    assert response.headers["allow"] == "POST" and event_rows(app_engine) == []


def test_slack_url_verification_is_answered_after_the_signature_check(client: TestClient, clock: FakeClock) -> None:
    body, headers = signed("slack", {"type": "url_verification", "challenge": "abc"}, clock)
    assert client.post("/v1/hooks/slack", content=body, headers=headers).json() == {"challenge": "abc"}


def test_control_endpoints_refuse_a_missing_or_wrong_token(client: TestClient) -> None:
    assert client.post("/v1/control/stop").json()["error"]["code"] == "missing_token"
    response = client.post("/v1/control/stop", headers={"Authorization": "Bearer wk_nope"})
    assert (response.status_code, response.json()["error"]["code"]) == (401, "bad_token")


def test_stop_and_start_through_the_api(client: TestClient, token: str) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    assert client.post("/v1/control/stop", json={"reason": "going away"}, headers=auth).json()["stopped"] is True
    assert client.get("/v1/control", headers=auth).json() == {"stopped": True, "global_stop": False}
    client.post("/v1/control/start", headers=auth)
    assert client.get("/v1/control", headers=auth).json()["stopped"] is False


def test_a_users_start_during_a_global_stop_answers_that_they_are_still_stopped(
        client: TestClient, app_engine: Engine, token: str, clock: FakeClock) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    with write(app_engine) as conn:
        control.set_stop(conn, stopped=True, user_id=None, actor="cli", reason="incident", now=clock.now())
    answer = client.post("/v1/control/start", headers=auth).json()
    assert answer["stopped"] is True and answer["global_stop"] is True and "wakeful start" in answer["note"]
    assert client.get("/v1/control", headers=auth).json() == {"stopped": True, "global_stop": True}
    with write(app_engine) as conn:
        control.set_stop(conn, stopped=False, user_id=None, actor="cli", reason="over", now=clock.now())
    answer = client.post("/v1/control/start", headers=auth).json()
    assert (answer["stopped"], answer["global_stop"], "note" in answer) == (False, False, False)


def test_steering_a_revoked_task_says_it_is_final_not_to_reopen_it(client: TestClient, token: str) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    task = client.post("/v1/tasks", json={"title": "t"}, headers=auth).json()["task_id"]
    assert client.post(f"/v1/tasks/{task}/revoke", headers=auth).status_code == 200
    steer = client.post(f"/v1/tasks/{task}/steer", json={"goal": "again"}, headers=auth)
    assert steer.status_code == 409 and "final" in steer.json()["error"]["message"]
    assert client.post(f"/v1/tasks/{task}/reopen", headers=auth).status_code == 409  # what it says is so


def test_one_users_token_never_reaches_another_users_task(client: TestClient, app_engine: Engine, token: str,
                                                          clock: FakeClock) -> None:
    with write(app_engine) as conn:
        _, other = ensure_user(conn, name="third", now=clock.now())
    task = client.post("/v1/tasks", json={"title": "mine"}, headers={"Authorization": f"Bearer {token}"}).json()
    foreign = {"Authorization": f"Bearer {other}"}
    for path in (f"/v1/tasks/{task['task_id']}", f"/v1/tasks/{task['task_id']}/pause"):
        response = client.request("GET" if path.count("/") == 3 else "POST", path, headers=foreign)
        assert (response.status_code, response.json()["error"]["code"]) == (404, "unknown_task")


def test_pausing_twice_is_a_409_with_the_current_state(client: TestClient, token: str) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    task = client.post("/v1/tasks", json={"title": "t"}, headers=auth).json()["task_id"]
    assert client.post(f"/v1/tasks/{task}/pause", headers=auth).json()["state"] == "paused"
    again = client.post(f"/v1/tasks/{task}/pause", headers=auth)
    assert again.status_code == 409 and again.json()["error"] | {"message": ""} == {
        "code": "invalid_transition", "message": "", "task_id": task, "state": "paused"}


def _workers_asleep() -> bool:
    """Every worker thread is inside its idle wait: it looked for work, found none, and sleeps until woken or until
    its poll. (Looked up in the threads' frames, so that the test knows a later task was not found by a look.)"""
    frames = sys._current_frames()
    workers = [t for t in threading.enumerate() if t.name.startswith("worker-")]
    for thread in workers:
        frame, names = frames.get(thread.ident or -1), set()
        while frame is not None:
            names.add(frame.f_code.co_qualname)
            frame = frame.f_back
        if "IdlePoll.wait" not in names:
            return False
    return bool(workers)


def test_a_task_posted_over_http_starts_its_run_without_waiting_for_the_idle_poll(tmp_path: Path, token: str,
                                                                                 app_engine: Engine) -> None:
    # A poll the test could never wait out: only a wake starts the run within the bounded wait below.
    settings = Settings(data_dir=tmp_path, poll_interval=3600, idle_poll_max=3600, sweep_interval=3600,
                        reconcile_interval=3600, workers=1)
    runtime = Runtime(settings, handler=EchoHandler(), engine=app_engine)
    runtime.prepare()
    with TestClient(create_app(runtime)) as client:
        wait_until(_workers_asleep, 10, "the worker to find nothing and fall asleep")
        answer = client.post("/v1/tasks", json={"title": "first run"}, headers={"Authorization": f"Bearer {token}"})
        session = answer.json()["session_id"]
        wait_until(lambda: any(r.session_id == session for r in run_rows(app_engine)), 20,
                   "the delegation's run to start (the idle poll would take an hour)")


def test_a_quiet_server_stamps_every_response_and_stops_at_once_when_idle() -> None:
    app = FastAPI()

    @app.get("/")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    server = QuietServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the server to start")
    port = server.servers[0].sockets[0].getsockname()[1]
    for _ in range(2):  # each on a fresh connection
        response = httpx.get(f"http://127.0.0.1:{port}/")
        assert response.status_code == 200 and parsedate_to_datetime(response.headers["date"])
    wait_until(lambda: not server.server_state.connections, 10, "the client's connections to close")
    server.should_exit = True  # asleep with no connection and nothing due: this alone must wake it
    thread.join(timeout=30)
    assert not thread.is_alive()


def _user_id(engine: Engine, name: str) -> str:
    from wakeful.server.store import users

    with read(engine) as conn:
        return users.user_id_by_name(conn, name)


def test_paging_through_the_messages_shows_each_once_newest_first(client: TestClient, app_engine: Engine,
                                                                 token: str, clock: FakeClock) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    user_id = _user_id(app_engine, "second")
    with write(app_engine) as conn:
        sent = [outbox.enqueue(conn, user_id=user_id, body={"text": f"m{i}"}, now=clock.now()) for i in range(7)]
    seen: list[str] = []
    cursor: str | None = None
    while True:
        page = client.get("/v1/messages", params={"limit": 3, **({"cursor": cursor} if cursor else {})},
                          headers=auth).json()
        seen += [m["id"] for m in page["messages"]]
        cursor = page["next"]
        if cursor is None:
            break
        with write(app_engine) as conn:  # a message sent between two pages never shifts the next page
            outbox.enqueue(conn, user_id=user_id, body={"text": "late"}, now=clock.now())
    assert seen == sorted(sent, reverse=True)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/egress"])
@pytest.mark.parametrize("limit", ["-1", "0", "1001", "-9223372036854775809", "99999999999999999999999"])
def test_a_list_limit_out_of_bounds_is_a_400_never_the_whole_table_or_a_500(client: TestClient, token: str,
                                                                            path: str, limit: str) -> None:
    response = client.get(path, params={"limit": limit}, headers={"Authorization": f"Bearer {token}"})
    assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_parameter")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/egress"])
@pytest.mark.parametrize("cursor", ["nope", "WyJhIiwiYiIsImMiXQ", "W10", "eyJhIjoxfQ", "x" * 600,
                                    "WyJcdWQ4MDAiXQ",  # ["\ud800"]: half a surrogate pair, which SQLite cannot encode
                                    "WyIyMDIwLTAxLTAxIiwieSJd"])  # ["2020-01-01","y"]: a time without its zone
def test_a_cursor_the_server_did_not_write_is_a_400(client: TestClient, token: str, path: str, cursor: str) -> None:
    response = client.get(path, params={"cursor": cursor}, headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] in {"bad_cursor", "invalid_parameter"}


def test_paging_through_the_egress_audit_keeps_rows_that_share_a_timestamp(client: TestClient, app_engine: Engine,
                                                                          token: str, clock: FakeClock) -> None:
    from wakeful.proxy.audit import EgressRecord
    from wakeful.proxy.contract import RefusalCode
    from wakeful.server.egress.grants import store_audit

    user_id = _user_id(app_engine, "second")
    at = clock.now()
    records = [EgressRecord(request_id=f"req-{i:02d}", at=at, user_id=user_id, client="connector", attempt_id=None,
                            action_id=None, method="GET", scheme="https", host="shop.test", port=443, path="/",
                            verdict="refuse", code=RefusalCode.NOT_ADMITTED, rule="r", credential=None, bytes_up=0,
                            bytes_down=0, upstream_status=None, latency_ms=1.0) for i in range(5)]
    with write(app_engine) as conn:
        store_audit(conn, records, now=at)
    seen: list[str] = []
    cursor: str | None = None
    while True:
        page = client.get("/v1/egress", params={"limit": 2, **({"cursor": cursor} if cursor else {})},
                          headers={"Authorization": f"Bearer {token}"}).json()
        seen += [r["request_id"] for r in page["requests"]]
        if (cursor := page["next"]) is None:
            break
    assert seen == [f"req-{i:02d}" for i in reversed(range(5))]
