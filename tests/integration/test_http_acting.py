"""The control channel over HTTP on a real action: card, approve, status, ledger, steer — and only for its owner."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select

from tests.support.acting import CANCEL_VERIFIED, World, world
from tests.support.docs import DOCS, fenced, section
from wakeful.proxy.clock import FakeClock
from wakeful.server.core.worker import Binding
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import task_keys, task_versions
from wakeful.server.store.users import ensure_user, issue_token


@pytest.fixture
def setup(engine: Engine, clock: FakeClock, owner: str, settings: Settings) -> Iterator[tuple[World, TestClient, dict]]:
    with world(engine, clock, owner) as w:
        runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine, registry=w.tools.registry)
        runtime.prepare()
        with write(engine) as conn:
            token = issue_token(conn, user_id=owner)
        with TestClient(create_app(runtime, manage_runtime=False)) as client:
            yield w, client, {"Authorization": f"Bearer {token}"}


def test_approving_over_http_after_reading_the_card_sends_it_once(setup: tuple[World, TestClient, dict]) -> None:
    w, client, auth = setup
    created = client.post("/v1/tasks", json={"title": "cancel it", "completion": CANCEL_VERIFIED}, headers=auth)
    assert created.status_code == 201, created.text
    task = Binding(user_id=w.owner, task_id=created.json()["task_id"])
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action_id = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    card = client.get(f"/v1/actions/{action_id}", headers=auth).json()["card"]
    assert card["action_id"] == action_id and "amount: 19.99 EUR" in card["lines"]
    decided = client.post(f"/v1/actions/{action_id}/approve", json={"reason": "yes"}, headers=auth).json()
    assert (decided["verdict"], decided["code"]) == ("admitted", "admitted")
    w.dispatcher.drain()
    w.dispatcher.verify_due()
    assert len(w.merchant.effects) == 1
    status = client.get(f"/v1/tasks/{task.task_id}", headers=auth).json()
    assert status["actions"][0]["outcome"] == "accepted" and status["facts"]["goal_verified"]
    kinds = {e["type"] for e in client.get(f"/v1/tasks/{task.task_id}/ledger", headers=auth).json()["entries"]}
    assert {"action", "verdict", "approval", "attempt", "evidence"} <= kinds


def test_steering_over_http_voids_the_pending_approval(setup: tuple[World, TestClient, dict]) -> None:
    w, client, auth = setup
    task_id = client.post("/v1/tasks", json={"title": "cancel it"}, headers=auth).json()["task_id"]
    task = Binding(user_id=w.owner, task_id=task_id)
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action_id = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    assert client.post(f"/v1/tasks/{task_id}/steer", json={"goal": "keep it"}, headers=auth).json()["version"] == 2
    decided = client.post(f"/v1/actions/{action_id}/approve", headers=auth).json()
    assert decided["code"] == "task_version_changed"
    w.dispatcher.drain()
    assert w.merchant.effects == []


def test_another_user_cannot_see_or_approve_the_action(setup: tuple[World, TestClient, dict]) -> None:
    w, client, auth = setup
    task_id = client.post("/v1/tasks", json={"title": "cancel it"}, headers=auth).json()["task_id"]
    task = Binding(user_id=w.owner, task_id=task_id)
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action_id = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    with write(w.engine) as conn:
        _, other = ensure_user(conn, name="mallory", now=w.clock.now())
    foreign = {"Authorization": f"Bearer {other}"}
    for response in (client.get(f"/v1/actions/{action_id}", headers=foreign),
                     client.post(f"/v1/actions/{action_id}/approve", headers=foreign),
                     client.get(f"/v1/tasks/{task_id}/ledger", headers=foreign)):
        assert response.status_code == 404
    assert client.post("/v1/tasks", json={"title": "x", "completion": [{"effect": "nope__x"}]},
                       headers=auth).json()["error"]["code"] == "unknown_tool"


def test_the_delegation_body_in_the_docs_is_accepted_as_written_and_its_ceiling_is_the_tasks(
        setup: tuple[World, TestClient, dict]) -> None:
    w, client, auth = setup
    body = json.loads(fenced(section((DOCS / "http-api.md").read_text(), "### A delegation's body"), "json"))
    assert body["completion"] == CANCEL_VERIFIED  # the example merchant's own tools, as the tests use them
    created = client.post("/v1/tasks", json=body, headers=auth)
    assert created.status_code == 201, created.text
    task_id = created.json()["task_id"]
    with read(w.engine) as conn:
        version = conn.execute(select(task_versions.c.constraints).where(task_versions.c.task_id == task_id)).one()
        keys = conn.execute(select(task_keys.c.key).where(task_keys.c.task_id == task_id)).scalars().all()
    assert json.loads(version.constraints) == {"max_amount_cents": 5000} and keys == ["SUB-1042"]


def test_the_task_list_pages_a_users_own_delegations_newest_first_and_filters_by_state(
        setup: tuple[World, TestClient, dict]) -> None:
    w, client, auth = setup
    made = []
    for title in ("first", "second", "third"):
        made.append(client.post("/v1/tasks", json={"title": title}, headers=auth).json()["task_id"])
        w.clock.advance(timedelta(seconds=1))
    assert client.post(f"/v1/tasks/{made[0]}/pause", headers=auth).status_code == 200
    first = client.get("/v1/tasks?limit=2", headers=auth).json()
    assert [(t["task_id"], t["title"]) for t in first["tasks"]] == [(made[2], "third"), (made[1], "second")]
    rest = client.get(f"/v1/tasks?limit=2&cursor={first['next']}", headers=auth).json()
    assert [(t["task_id"], t["state"], t["version"]) for t in rest["tasks"]] == [(made[0], "paused", 1)]
    assert rest["next"] is None
    assert [t["task_id"] for t in client.get("/v1/tasks?state=paused", headers=auth).json()["tasks"]] == [made[0]]
    assert client.get("/v1/tasks?state=gone", headers=auth).json()["error"]["code"] == "invalid_parameter"
    assert client.get("/v1/tasks?cursor=WyJ4Il0", headers=auth).json()["error"]["code"] == "bad_cursor"
    with write(w.engine) as conn:
        _, other = ensure_user(conn, name="mallory", now=w.clock.now())
    assert client.get("/v1/tasks", headers={"Authorization": f"Bearer {other}"}).json() == {"tasks": [], "next": None}
