"""Who may satisfy a wait, through the real webhook endpoint on loopback: a signed third-party delivery that carries
the key of a wait the server opened for itself (`approval:<action>`, `reconcile:<action>`) does not satisfy it;
the user's decision and the reconciler's own finding still do (wakeful issue 15, item 1)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select

from tests.support.acting import World, world
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting.verdicts import approval_key
from wakeful.server.core.signatures import sign
from wakeful.server.core.worker import Binding
from wakeful.server.egress.dispatch import reconcile_key
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.sims import serve
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import EventStatus, Outcome, VerdictKind, WaitState, events, todos, waits
from wakeful.server.store.users import issue_token


@dataclass
class Live:
    w: World
    url: str
    auth: dict[str, str]
    secret: bytes

    def hook(self, delivery_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A delivery from the third-party source `hook`, signed with its real secret."""
        body = json.dumps(payload).encode()
        headers = sign("generic", secret=self.secret, body=body, now=self.w.clock.now().timestamp(),
                       delivery_id=delivery_id)
        answer = httpx.post(f"{self.url}/v1/hooks/hook", content=body, headers=headers, timeout=10)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())


@pytest.fixture
def live(engine: Engine, clock: FakeClock, owner: str, settings: Settings) -> Iterator[Live]:
    with world(engine, clock, owner, client_timeout=1.0) as w:
        runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine, registry=w.tools.registry)
        runtime.prepare()
        runtime.committer.start()  # the inbox's writer; no worker runs, so every event stays as the inbox left it
        with write(engine) as conn:
            token = issue_token(conn, user_id=owner)
        try:
            with serve(create_app(runtime, manage_runtime=False)) as url:
                yield Live(w=w, url=url, auth={"Authorization": f"Bearer {token}"},
                           secret=settings.sources["hook"].secret.get_secret_value().encode())
        finally:
            runtime.committer.stop()


def wait_row(engine: Engine, key: str) -> Any:
    with read(engine) as conn:
        return conn.execute(select(waits).where(waits.c.match_key == key)).one()


def event_row(engine: Engine, event_id: str) -> Any:
    with read(engine) as conn:
        return conn.execute(select(events).where(events.c.id == event_id)).one()


def has_todo(engine: Engine, session_id: str) -> bool:
    with read(engine) as conn:
        return conn.execute(select(todos.c.session_id).where(todos.c.session_id == session_id)).first() is not None


def awaiting_approval(w: World) -> tuple[Binding, str]:
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    proposed = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])
    assert proposed["status"] == VerdictKind.NEEDS_APPROVAL
    return task, str(proposed["action_id"])


def test_a_third_party_delivery_naming_the_approval_wait_leaves_it_to_the_users_deny(live: Live) -> None:
    w = live.w
    task, act = awaiting_approval(w)
    forged = live.hook("forged-approval", {"session_key": approval_key(act), "decision": "approved"})
    assert forged["status"] == EventStatus.PENDING  # recorded, as every signed delivery is
    assert wait_row(w.engine, approval_key(act)).state == WaitState.PENDING
    assert event_row(w.engine, forged["event_id"]).session_id != task.session_id
    status = httpx.get(f"{live.url}/v1/tasks/{task.task_id}", headers=live.auth, timeout=10).json()
    assert [(x["match_key"], x["authority"]) for x in status["waits"]] == [(approval_key(act), "user")]

    with write(w.engine) as conn:  # the agent's run over the task's session happened: it is idle again
        conn.execute(todos.delete().where(todos.c.session_id == task.session_id))
    denied = httpx.post(f"{live.url}/v1/actions/{act}/deny", json={"reason": "no"}, headers=live.auth, timeout=10)
    assert denied.status_code == 200, denied.text
    wait = wait_row(w.engine, approval_key(act))
    assert wait.state == WaitState.SATISFIED
    answer = event_row(w.engine, wait.resolved_event_id)
    assert (answer.source, answer.status, answer.session_id) == ("approval", EventStatus.PENDING, task.session_id)
    assert json.loads(answer.payload)["decision"] == "denied"
    assert has_todo(w.engine, task.session_id)  # the deny wakes the agent
    w.dispatcher.drain()
    assert w.merchant.effects == []


def test_a_third_party_delivery_naming_the_reconcile_wait_does_not_end_reconciliation(live: Live) -> None:
    w = live.w
    w.merchant.faults.update({"commit_then_timeout": 1, "stall_seconds": 5.0})
    task, act = awaiting_approval(w)
    assert w.approve(act) == "admitted"
    w.dispatcher.drain()
    assert wait_row(w.engine, reconcile_key(act)).state == WaitState.PENDING  # the response was lost

    forged = live.hook("forged-reconcile", {"session_key": reconcile_key(act), "outcome": "accepted"})
    assert forged["status"] == EventStatus.PENDING
    assert wait_row(w.engine, reconcile_key(act)).state == WaitState.PENDING
    assert event_row(w.engine, forged["event_id"]).session_id != task.session_id

    assert w.dispatcher.reconcile_due() == 1  # reconciliation goes on: it asks the merchant
    wait = wait_row(w.engine, reconcile_key(act))
    assert wait.state == WaitState.SATISFIED
    found = event_row(w.engine, wait.resolved_event_id)
    assert (found.source, found.session_id) == ("reconcile", task.session_id)
    assert json.loads(found.payload)["outcome"] == Outcome.ACCEPTED
