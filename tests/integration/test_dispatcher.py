"""The one outbox drain and the message delivery it hands messages to: idempotency keys, retries with backoff, the
failure cap, STOP, claims."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, true

from tests.support.records import messages
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import control, outbox
from wakeful.server.core.outbox import MessageDelivery, OutboxDrain
from wakeful.server.store.db import write
from wakeful.server.store.tables import OutboxKind


class Receiver:
    """A receiver that honours Idempotency-Key and can be told to fail."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.applied: dict[str, dict[str, object]] = {}
        self.requests = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if self.failures:
            self.failures -= 1
            return httpx.Response(503)
        self.applied.setdefault(request.headers["Idempotency-Key"], json.loads(request.content))
        return httpx.Response(200)


def dispatcher(engine: Engine, clock: FakeClock, receiver: Receiver | None, max_attempts: int = 3) -> OutboxDrain:
    """The drain with the message delivery registered, as the runtime has it (without the action dispatcher)."""
    return OutboxDrain(engine, clock, [MessageDelivery(
        engine, clock, notify_url="http://receiver.test/messages" if receiver else None, max_attempts=max_attempts,
        backoff=timedelta(seconds=1), transport=httpx.MockTransport(receiver) if receiver else None)])


def enqueue(engine: Engine, clock: FakeClock, owner: str, text: str = "hello") -> str:
    with write(engine) as conn:
        return outbox.enqueue(conn, user_id=owner, body={"text": text}, now=clock.now())


def test_a_message_is_delivered_once_with_its_id_as_the_idempotency_key(engine: Engine, clock: FakeClock,
                                                                        owner: str) -> None:
    receiver = Receiver()
    message_id = enqueue(engine, clock, owner)
    d = dispatcher(engine, clock, receiver)
    assert d.drain() == 1
    assert d.drain() == 0
    assert receiver.applied[message_id]["body"] == {"text": "hello", "level": "notify"}
    assert receiver.applied[message_id]["seq"] == 1  # the receiver can order what it gets as the feed does
    assert [m["state"] for m in messages(engine)] == ["sent"]


def test_a_failed_delivery_backs_off_and_is_retried(engine: Engine, clock: FakeClock, owner: str) -> None:
    receiver = Receiver(failures=2)
    message_id = enqueue(engine, clock, owner)
    d = dispatcher(engine, clock, receiver, max_attempts=5)
    d.drain()
    assert d.drain() == 0  # not due again before the backoff
    clock.advance(timedelta(seconds=1))
    d.drain()
    clock.advance(timedelta(seconds=2))  # the backoff doubled
    d.drain()
    assert list(receiver.applied) == [message_id]
    assert receiver.requests == 3 and [m["state"] for m in messages(engine)] == ["sent"]


def test_a_delivery_that_keeps_failing_is_marked_failed_at_the_cap(engine: Engine, clock: FakeClock,
                                                                   owner: str) -> None:
    receiver = Receiver(failures=100)
    enqueue(engine, clock, owner)
    d = dispatcher(engine, clock, receiver, max_attempts=3)
    for _ in range(6):
        d.drain()
        clock.advance(timedelta(minutes=1))
    assert receiver.requests == 3 and receiver.applied == {}
    assert [m["state"] for m in messages(engine)] == ["failed"]


def test_stop_holds_every_delivery_until_start(engine: Engine, clock: FakeClock, owner: str) -> None:
    receiver = Receiver()
    enqueue(engine, clock, owner)
    with write(engine) as conn:
        control.set_stop(conn, stopped=True, user_id=None, actor="cli", reason="", now=clock.now())
    d = dispatcher(engine, clock, receiver)
    assert d.drain() == 0 and receiver.requests == 0
    with write(engine) as conn:
        control.set_stop(conn, stopped=False, user_id=None, actor="cli", reason="", now=clock.now())
    assert d.drain() == 1 and len(receiver.applied) == 1


def test_without_a_notify_url_messages_go_to_the_local_feed(engine: Engine, clock: FakeClock, owner: str) -> None:
    enqueue(engine, clock, owner)
    assert dispatcher(engine, clock, None).drain() == 1
    assert [m["state"] for m in messages(engine)] == ["sent"]


def test_the_message_dispatcher_never_touches_an_action_dispatch_intent(engine: Engine, clock: FakeClock,
                                                                        owner: str) -> None:
    # Regression: the message dispatcher once "delivered" dispatch intents to the feed, so actions were never sent.
    with write(engine) as conn:
        outbox.enqueue(conn, user_id=owner, body={"action_id": "act_x"}, now=clock.now(), kind=OutboxKind.DISPATCH)
    assert dispatcher(engine, clock, None).drain() == 0
    assert [m["state"] for m in messages(engine)] == ["pending"]


class Recording:
    """A handler for dispatch intents that only notes what it was handed."""

    kind = OutboxKind.DISPATCH

    def __init__(self) -> None:
        self.handed: list[tuple[str, int]] = []

    def ready(self) -> Any:
        return true()

    def handle(self, rows: Sequence[Any]) -> int:
        self.handed.extend((row.id, row.attempts) for row in rows)
        return len(rows)


def test_the_drain_hands_each_kind_to_its_own_handler_and_counts_the_handover(engine: Engine, clock: FakeClock,
                                                                              owner: str) -> None:
    enqueue(engine, clock, owner)
    with write(engine) as conn:
        intent = outbox.enqueue(conn, user_id=owner, body={"action_id": "act_x"}, now=clock.now(),
                                kind=OutboxKind.DISPATCH)
    intents = Recording()
    drain = dispatcher(engine, clock, None)
    drain.register(intents)
    assert drain.drain() == 2
    assert intents.handed == [(intent, 1)]  # the claim counted the handover before the handler saw the row
    assert drain.drain() == 1  # the recording handler settles nothing: the intent stays due and is claimed again
    assert intents.handed[-1] == (intent, 2)


def test_a_row_claimed_by_another_drain_since_it_was_read_is_not_handed_over(engine: Engine, clock: FakeClock,
                                                                              owner: str) -> None:
    with write(engine) as conn:
        intent = outbox.enqueue(conn, user_id=owner, body={"action_id": "act_x"}, now=clock.now(),
                                kind=OutboxKind.DISPATCH)
    drain, other = OutboxDrain(engine, clock), OutboxDrain(engine, clock, [Recording()])
    seen = drain.due(OutboxKind.DISPATCH)
    assert [row.id for row in seen] == [intent]
    assert other.drain() == 1  # another drain claims it between this one's read and its claim
    assert drain.take(seen) == []
    assert [row.id for row in drain.take(drain.due(OutboxKind.DISPATCH))] == [intent]  # a fresh read claims it


def test_stop_holds_every_kind_in_the_outbox(engine: Engine, clock: FakeClock, owner: str) -> None:
    enqueue(engine, clock, owner)
    with write(engine) as conn:
        outbox.enqueue(conn, user_id=owner, body={"action_id": "act_x"}, now=clock.now(), kind=OutboxKind.DISPATCH)
        control.set_stop(conn, stopped=True, user_id=owner, actor="user:test", reason="hold", now=clock.now())
    intents = Recording()
    drain = dispatcher(engine, clock, None)
    drain.register(intents)
    assert drain.drain() == 0 and intents.handed == []
    with write(engine) as conn:
        control.set_stop(conn, stopped=False, user_id=owner, actor="user:test", reason="go",
                         now=clock.advance(timedelta(seconds=1)))
    assert drain.drain() == 2


def test_a_second_handler_for_one_kind_is_refused(engine: Engine, clock: FakeClock) -> None:
    drain = OutboxDrain(engine, clock, [Recording()])
    with pytest.raises(ValueError, match="already has a handler"):
        drain.register(Recording())
