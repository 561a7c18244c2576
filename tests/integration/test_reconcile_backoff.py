"""An unknown outcome or an unverified effect is read again on a backoff, never in a hot loop, and past its deadline
the user is told once, plainly, what was tried (issue 15, items 9 and 10).

The runtime is prepared, not started: the test drives its reconciler one round at a time on a fake clock, and wakes
it far more often than its loop ever would. Reads are counted from the merchant's own request records (what reached
the simulator), never from our code's calls; messages are read through `GET /v1/messages`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from tests.support.acting import CANCEL_VERIFIED, World, world
from wakeful.proxy.clock import FakeClock
from wakeful.server.core.worker import Binding
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import write
from wakeful.server.store.users import issue_token

RECONCILE_WINDOW = timedelta(minutes=15)
VERIFY_WINDOW = timedelta(hours=1)


@dataclass
class Setup:
    w: World
    runtime: Runtime
    client: TestClient
    auth: dict[str, str]

    def reads(self, path: str) -> int:
        """Requests for `path` the merchant received (its own record, not our count of calls)."""
        return sum(1 for r in self.w.received["merchant"] if (r.method, r.path) == ("GET", path))

    def rounds(self, *, lasting: timedelta, step: timedelta) -> None:
        """Let `lasting` pass in steps, running the scheduler and the reconciler once per step."""
        end = self.w.clock.now() + lasting
        while self.w.clock.now() < end:
            self.w.clock.advance(step)
            self.runtime.scheduler_tick()
            self.runtime.reconcile_once()

    def messages(self, kind: str) -> list[dict[str, Any]]:
        self.runtime.outbox.drain()
        feed = self.client.get("/v1/messages", headers=self.auth)
        assert feed.status_code == 200, feed.text
        return [m for m in feed.json()["messages"] if m["body"].get("kind") == kind]

    def status(self, task: Binding) -> dict[str, Any]:
        answer = self.client.get(f"/v1/tasks/{task.task_id}", headers=self.auth)
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body


@pytest.fixture
def setup(engine: Engine, clock: FakeClock, owner: str, settings: Settings, tmp_path: Path) -> Iterator[Setup]:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "policy.toml").write_text(f"reconcile_window = {int(RECONCILE_WINDOW.total_seconds())}\n"
                                          f"verify_window = {int(VERIFY_WINDOW.total_seconds())}\n")
    paced = settings.model_copy(update={"reconcile_interval": 5.0, "reconcile_backoff_max": timedelta(minutes=2)})
    with world(engine, clock, owner) as w:
        runtime = Runtime(paced, handler=EchoHandler(), clock=clock, engine=engine, registry=w.tools.registry)
        runtime.prepare()
        with write(engine) as conn:
            token = issue_token(conn, user_id=owner)
        with TestClient(create_app(runtime, manage_runtime=False)) as client:
            yield Setup(w=w, runtime=runtime, client=client, auth={"Authorization": f"Bearer {token}"})


def cancel_sub_1(s: Setup, task: Binding) -> str:
    (sub,) = s.w.call(task, "merchant__list_subscriptions")["objects"]
    action_id = str(s.w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"])
    assert s.w.approve(action_id) == "admitted"
    assert s.runtime.actions.drain() == 1
    return action_id


def test_a_lookup_the_merchant_redirects_is_read_on_a_backoff_and_never_wakes_its_own_loop(setup: Setup) -> None:
    s = setup
    s.w.merchant.faults.update({"fail_before_commit": 1, "lookups_redirect": True})  # 503: unknown; lookups: 302
    task = s.w.task()
    cancel_sub_1(s, task)
    assert s.w.merchant.effects == []

    s.runtime.signals.reconcile.clear()
    sleep = s.runtime.reconcile_once()
    assert s.reads("/v1/cancellations") == 1
    assert not s.runtime.signals.reconcile.is_set(), "a read that changed nothing woke the reconciler again at once"
    assert 3.75 <= sleep <= 5.0, f"the reconciler would sleep {sleep} s, not until the next read is due"

    # Ten minutes, the reconciler woken every second. Gaps: 5 s doubling to the 2-minute cap, each less up to a
    # quarter of jitter: reads at most at 0, 3.75, 11.25, 26.25, 56.25, 116.25, then every 90 s or more (11 in
    # 10 minutes), at least at 0, 5, 15, 35, 75, 155, then every 120 s or less (9), plus a second per gap at most.
    s.rounds(lasting=timedelta(minutes=10), step=timedelta(seconds=1))
    assert 9 <= s.reads("/v1/cancellations") <= 11, s.reads("/v1/cancellations")
    assert s.w.merchant.effects == []  # a 302 is no answer: nothing is sent again on it


def test_past_the_reconcile_window_the_user_is_told_once_what_was_tried_and_the_outcome_stays_unknown(
        setup: Setup) -> None:
    s = setup
    s.w.merchant.faults.update({"fail_before_commit": 1, "lookups_redirect": True})
    task = s.w.task()
    action_id = cancel_sub_1(s, task)
    s.rounds(lasting=RECONCILE_WINDOW + timedelta(minutes=1), step=timedelta(seconds=10))
    reads = s.reads("/v1/cancellations")
    s.rounds(lasting=timedelta(minutes=30), step=timedelta(minutes=1))
    assert s.reads("/v1/cancellations") == reads, "the provider was still read after the reconcile window"

    (told,) = s.messages("outcome_unknown")
    text = told["body"]["text"]
    assert told["state"] == "sent" and told["body"]["action_id"] == action_id
    assert f"asked the provider {reads} times" in text, text
    assert "HTTP 302" in text and "wakeful ledger" in text, text
    status = s.status(task)
    assert status["state"] == "active" and [a["outcome"] for a in status["actions"]] == ["unknown"]


def test_an_effect_the_provider_keeps_processing_is_escalated_once_at_the_verify_deadline(setup: Setup) -> None:
    s = setup
    s.w.merchant.faults.update({"processing_seconds": 10 * 86400.0})  # accepted with 202; "processing" for days
    task = s.w.task(completion=CANCEL_VERIFIED)
    action_id = cancel_sub_1(s, task)
    s.rounds(lasting=VERIFY_WINDOW + timedelta(minutes=1), step=timedelta(seconds=10))
    reads = s.reads("/v1/subscriptions/sub_1")
    # 5 s doubling to the 2-minute cap over an hour: 6 reads in the first 155 s, then one every 90 to 120 s.
    assert 30 <= reads <= 45, reads
    s.rounds(lasting=timedelta(hours=2), step=timedelta(minutes=2))
    assert s.reads("/v1/subscriptions/sub_1") == reads, "the provider was still read after the verify deadline"

    (told,) = s.messages("effect_unverified")
    text = told["body"]["text"]
    assert told["state"] == "sent" and told["body"]["action_id"] == action_id
    assert f"read it {reads} times" in text and 'renewal = "processing"' in text, text
    assert f"wakeful close {task.task_id}" in text, text
    assert s.messages("receipt") == []
    status = s.status(task)
    assert [a["outcome"] for a in status["actions"]] == ["accepted"]  # accepted, not verified, not failed
    assert status["state"] == "active" and status["facts"]["goal_verified"] is None
