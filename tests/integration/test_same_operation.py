"""The same operation twice is one action (wakeful issue 15, item 4): within a task version, a write whose
operation matches an action that is pending, admitted, unknown or done answers with that action, never a second
one and never a second approval card. Against the merchant simulator on loopback; effects are read from its own
records."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select

from tests.support.acting import World, world
from tests.support.records import messages
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting import approvals
from wakeful.server.core import control
from wakeful.server.core.worker import Binding
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import VerdictKind, actions

CANCEL_PATH = "/v1/subscriptions/sub_1/cancel_renewal"


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner) as w:
        yield w


def cards(w: World) -> list[str]:
    """The action ID of every approval card sent to the user, in order."""
    return [m["card"]["action_id"] for m in messages(w.engine) if m.get("kind") == "approval_request"]


def action_ids(w: World) -> list[str]:
    with read(w.engine) as conn:
        return list(conn.execute(select(actions.c.id).order_by(actions.c.created_at, actions.c.id)).scalars())


def cancel_requests(w: World) -> int:
    """How many cancellation requests reached the merchant (its refusals included)."""
    return sum(1 for r in w.received["merchant"] if (r.method, r.path) == ("POST", CANCEL_PATH))


def subscription(w: World, task: Binding) -> str:
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    return str(sub["id"])


def test_the_same_cancellation_proposed_twice_is_one_action_one_card_and_one_request(w: World) -> None:
    task = w.task()
    sub = subscription(w, task)
    first = w.call(task, "merchant__cancel_renewal", subscription=sub, reason="keep this month")
    again = w.call(task, "merchant__cancel_renewal", subscription=sub, reason="keep this month")
    assert action_ids(w) == [first["action_id"]] and cards(w) == [first["action_id"]]
    assert "same_operation" not in first
    assert (again["action_id"], again["status"], again["state"], again["same_operation"]) == (
        first["action_id"], VerdictKind.NEEDS_APPROVAL, "pending", True)
    assert first["action_id"] in again["reason"]

    assert w.approve(first["action_id"]) == "admitted"
    assert w.call(task, "merchant__cancel_renewal", subscription=sub, reason="keep this month")["state"] == "admitted"
    assert w.dispatcher.drain() == 1
    assert cancel_requests(w) == 1 and len(w.merchant.effects_of("cancel_renewal", "sub_1")) == 1
    done = w.call(task, "merchant__cancel_renewal", subscription=sub, reason="keep this month")
    assert (done["action_id"], done["state"], done["same_operation"]) == (first["action_id"], "done", True)
    assert w.dispatcher.drain() == 0 and cancel_requests(w) == 1
    assert action_ids(w) == [first["action_id"]] and cards(w) == [first["action_id"]]


def test_a_second_read_of_the_same_subscription_names_the_same_operation(w: World) -> None:
    task = w.task()
    one, two = subscription(w, task), subscription(w, task)
    assert one != two  # two server-issued IDs for one external subscription
    first = w.call(task, "merchant__cancel_renewal", subscription=one)
    again = w.call(task, "merchant__cancel_renewal", subscription=two)
    assert action_ids(w) == [first["action_id"]]
    assert (again["action_id"], again["same_operation"]) == (first["action_id"], True)
    assert cards(w) == [first["action_id"]]


def test_different_arguments_are_a_different_operation(w: World) -> None:
    task = w.task()
    sub = subscription(w, task)
    first = w.call(task, "merchant__cancel_renewal", subscription=sub, reason="keep this month")
    other = w.call(task, "merchant__cancel_renewal", subscription=sub, reason="it is too expensive")
    assert other["action_id"] != first["action_id"] and "same_operation" not in other
    assert cards(w) == [first["action_id"], other["action_id"]]


def test_after_the_user_steers_the_same_operation_is_a_new_action_of_the_new_version(w: World) -> None:
    task = w.task()
    first = w.call(task, "merchant__cancel_renewal", subscription=subscription(w, task))
    with write(w.engine) as conn:
        control.steer(conn, user_id=w.owner, task_id=task.task_id, goal="cancel it, but say why", actor="user:test",
                      now=w.clock.now())
    fresh = w.call(task, "merchant__cancel_renewal", subscription=subscription(w, task))
    assert fresh["action_id"] != first["action_id"] and "same_operation" not in fresh
    assert cards(w) == [first["action_id"], fresh["action_id"]]
    assert w.approve(fresh["action_id"]) == "admitted" and w.dispatcher.drain() == 1
    assert cancel_requests(w) == 1


def test_a_denied_action_does_not_stand_for_a_fresh_proposal(w: World) -> None:
    task = w.task()
    sub = subscription(w, task)
    first = w.call(task, "merchant__cancel_renewal", subscription=sub)
    with write(w.engine) as conn:
        approvals.decide(conn, user_id=w.owner, action_id=first["action_id"], approve=False, actor="user:test",
                         policy=w.policy, now=w.clock.now())
    fresh = w.call(task, "merchant__cancel_renewal", subscription=sub)
    assert fresh["action_id"] != first["action_id"] and fresh["status"] == VerdictKind.NEEDS_APPROVAL
    assert "same_operation" not in fresh and cards(w) == [first["action_id"], fresh["action_id"]]


def test_a_cancellation_whose_outcome_is_unknown_still_stands_for_the_same_operation(w: World) -> None:
    task = w.task()
    sub = subscription(w, task)
    first = w.call(task, "merchant__cancel_renewal", subscription=sub)
    w.merchant.faults.fail_before_commit = 1  # a 503: it may or may not have been applied, for all we know
    assert w.approve(first["action_id"]) == "admitted" and w.dispatcher.drain() == 1
    again = w.call(task, "merchant__cancel_renewal", subscription=sub)
    assert action_ids(w) == [first["action_id"]]
    assert (again["action_id"], again["state"], again["same_operation"]) == (first["action_id"], "unknown", True)
    assert action_ids(w) == [first["action_id"]] and cancel_requests(w) == 1


def test_a_booking_the_hotel_refused_does_not_stand_for_a_fresh_proposal(w: World) -> None:
    task = w.task(title="book the hotel")
    (quote,) = w.call(task, "hotel__quote_stay", hotel="Grand", nights=2)["objects"]
    first = w.call(task, "hotel__book_quote", quote_id=quote["id"])
    assert w.approve(first["action_id"]) == "admitted"
    w.hotel.clock.advance(timedelta(minutes=16))  # the hotel refuses the expired quote (409): nothing was booked
    assert w.dispatcher.drain() == 1 and w.hotel.effects == []
    fresh = w.call(task, "hotel__book_quote", quote_id=quote["id"])
    assert fresh["action_id"] != first["action_id"] and "same_operation" not in fresh


def propose_at_once(w: World, task: Binding, sub: str, callers: int) -> list[dict[str, Any]]:
    """`callers` threads propose the same cancellation, released together by a barrier."""
    barrier = threading.Barrier(callers, timeout=10)
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def propose() -> None:
        try:
            barrier.wait()
            results.append(w.call(task, "merchant__cancel_renewal", subscription=sub))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=propose) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return results


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
def test_concurrent_identical_proposals_make_one_action_and_one_card(w: World) -> None:
    for _ in range(10):
        task = w.task()
        sub = subscription(w, task)
        before = set(action_ids(w))
        results = propose_at_once(w, task, sub, callers=3)
        made = set(action_ids(w)) - before
        assert len(made) == 1 and {r["action_id"] for r in results} == made
        assert sorted(r.get("same_operation", False) for r in results) == [False, True, True]
    assert len(cards(w)) == 10 == len(set(cards(w)))
