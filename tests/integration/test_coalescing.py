"""Deliveries that arrive together are one run (issue 16: the D9 typhoon warning and two cancellations, one run, one
rebooking): webhooks over real HTTP into the real inbox, runs driven one at a time on a fake clock."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from tests.support.records import event_rows, run_rows
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import inbox
from wakeful.server.core.signatures import sign
from wakeful.server.core.worker import Worker
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.sims import serve
from wakeful.server.store.db import write
from wakeful.server.store.tables import EventKind, EventStatus, RunOutcome

BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
WINDOW = timedelta(seconds=2)


@dataclass
class Inbox:
    runtime: Runtime
    url: str
    secret: bytes
    clock: FakeClock

    def hook(self, delivery_id: str, payload: dict[str, Any]) -> str:
        """A signed delivery from the third-party source `hook`; returns its event's ID."""
        body = json.dumps(payload).encode()
        headers = sign("generic", secret=self.secret, body=body, now=self.clock.now().timestamp(),
                       delivery_id=delivery_id)
        answer = httpx.post(f"{self.url}/v1/hooks/hook", content=body, headers=headers, timeout=10)
        assert answer.status_code == 200, answer.text
        return str(answer.json()["event_id"])

    def run_once(self) -> bool:
        return self.runtime.workers[0].run_once()


@pytest.fixture
def live(engine: Engine, clock: FakeClock, owner: str, settings: Settings) -> Iterator[Inbox]:
    windowed = settings.model_copy(update={"coalesce_seconds": WINDOW.total_seconds()})
    runtime = Runtime(windowed, handler=EchoHandler(), clock=clock, engine=engine)
    runtime.prepare()
    runtime.committer.start()  # the inbox's writer; the test runs the worker itself, one run at a time
    try:
        with serve(create_app(runtime, manage_runtime=False)) as url:
            yield Inbox(runtime=runtime, url=url, clock=clock,
                        secret=windowed.sources["hook"].secret.get_secret_value().encode())
    finally:
        runtime.committer.stop()


@BOTH
def test_a_warning_and_two_cancellations_within_the_window_are_one_run_with_all_three(live: Inbox,
                                                                                      clock: FakeClock) -> None:
    sent = [live.hook("typhoon-d9", {"session_key": "PNR-HK1", "kind": "typhoon_warning"})]
    clock.advance(timedelta(milliseconds=700))
    sent.append(live.hook("cancel-cx101", {"session_key": "PNR-HK1", "kind": "cancelled", "flight": "CX101"}))
    clock.advance(timedelta(milliseconds=700))
    sent.append(live.hook("cancel-cx105", {"session_key": "PNR-HK1", "kind": "cancelled", "flight": "CX105"}))
    assert not live.run_once()  # the window since the first delivery has not run out: nobody has started yet
    clock.advance(WINDOW)
    assert live.run_once()
    assert not live.run_once()
    (run,) = run_rows(live.runtime.engine)
    events = event_rows(live.runtime.engine)
    assert sorted(e.id for e in events) == sorted(sent)
    assert {(e.status, e.run_id) for e in events} == {(EventStatus.PROCESSED, run.id)}
    assert run.outcome == RunOutcome.COMPLETED


def test_a_delivery_after_the_window_is_a_run_of_its_own(live: Inbox, clock: FakeClock) -> None:
    live.hook("first", {"session_key": "PNR-HK1"})
    clock.advance(WINDOW)
    assert live.run_once()
    live.hook("later", {"session_key": "PNR-HK1"})
    assert not live.run_once()
    clock.advance(WINDOW)
    assert live.run_once()
    assert [r.outcome for r in run_rows(live.runtime.engine)] == [RunOutcome.COMPLETED] * 2


def test_a_delivery_without_a_key_starts_at_once_since_nothing_could_join_it(live: Inbox) -> None:
    live.hook("alone", {"kind": "newsletter"})
    assert live.run_once()


def deliver(engine: Engine, clock: FakeClock, owner: str, delivery: inbox.Delivery) -> str:
    with write(engine) as conn:
        return inbox.record(conn, delivery, now=clock.now(), coalesce=WINDOW).session_id


def test_a_timer_joins_the_waiting_deliveries_and_the_users_word_starts_them_at_once(
        engine: Engine, clock: FakeClock, owner: str, settings: Settings) -> None:
    session = deliver(engine, clock, owner, inbox.Delivery(user_id=owner, source="hook", source_id="warning",
                                                           payload={}, corr_key="PNR-HK1"))
    worker = Worker(engine, settings, clock, EchoHandler())
    deliver(engine, clock, owner, inbox.Delivery(user_id=owner, source="timer", source_id="check-1", payload={},
                                                 kind=EventKind.TIMER, trust="system", authority="system",
                                                 session_id=session))
    assert not worker.run_once()  # the timer queued behind the window, it did not cut it short
    deliver(engine, clock, owner, inbox.Delivery(user_id=owner, source="control", source_id="ctl-1", payload={},
                                                 kind=EventKind.CONTROL, trust="user", authority="user",
                                                 session_id=session))
    assert worker.run_once()
    (run,) = run_rows(engine)
    assert {(e.source, e.run_id) for e in event_rows(engine)} == {("hook", run.id), ("timer", run.id),
                                                                   ("control", run.id)}


def test_events_pending_for_a_session_all_go_to_its_next_run(engine: Engine, clock: FakeClock, owner: str,
                                                             settings: Settings) -> None:
    """What the worker did before any window: every pending event of the session is handed to one run."""
    for source_id in ("a", "b", "c"):
        with write(engine) as conn:
            inbox.record(conn, inbox.Delivery(user_id=owner, source="hook", source_id=source_id, payload={},
                                              corr_key="thread-1"), now=clock.now())
    assert Worker(engine, settings, clock, EchoHandler()).run_once()
    (run,) = run_rows(engine)
    assert {e.run_id for e in event_rows(engine)} == {run.id}
