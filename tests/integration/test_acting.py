"""Acting safely, end to end against simulators on loopback: assertions read the simulators' own records."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import Engine, select

from tests.support.acting import CANCEL_VERIFIED, World, world
from tests.support.records import messages
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting import ledger
from wakeful.server.acting.objects import UnknownObject
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control
from wakeful.server.errors import Conflict, Refused
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, Outcome, attempts, refusals


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner) as w:
        yield w


def approve(w: World, action_id: str) -> str:
    return w.approve(action_id)


def outcomes(w: World) -> list[str | None]:
    with read(w.engine) as conn:
        return [r.outcome for r in conn.execute(select(attempts).order_by(attempts.c.created_at, attempts.c.seq))]


def test_a_cancellation_waits_for_approval_then_is_sent_exactly_once(w: World) -> None:
    task = w.task(completion=CANCEL_VERIFIED)
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    assert sub["kind"] == "subscription" and sub["id"].startswith("obj_") and sub["renewal"] == "on"
    proposed = w.call(task, "merchant__cancel_renewal", subscription=sub["id"], reason="keep this month")
    assert (proposed["status"], proposed["code"]) == ("needs_approval", "approval_required")
    assert w.dispatcher.drain() == 0 and w.merchant.effects == []  # nothing leaves before the approval
    (card,) = [m for m in messages(w.engine) if m.get("kind") == "approval_request"]
    assert card["card"]["action_id"] == proposed["action_id"] and "amount: 19.99 EUR" in card["card"]["lines"]
    assert approve(w, proposed["action_id"]) == "admitted"
    assert w.dispatcher.drain() == 1
    assert [e["kind"] for e in w.merchant.effects] == ["cancel_renewal"]
    assert w.merchant.subscription("sub_1")["renewal"] == "off"
    assert outcomes(w) == [Outcome.ACCEPTED]
    assert w.dispatcher.drain() == 0 and len(w.merchant.effects) == 1


def test_an_approval_is_single_use(w: World) -> None:
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    approve(w, action)
    with pytest.raises(Conflict) as second:
        approve(w, action)
    assert second.value.code == "not_awaiting_approval"


@pytest.mark.parametrize("forged", ["sub_1", "obj_00000000000000000000000000", "", "../sub_1"])
def test_a_forged_object_id_from_an_email_is_refused_and_recorded(w: World, forged: str) -> None:
    task = w.task()
    with pytest.raises(UnknownObject) as refused:
        w.call(task, "merchant__cancel_renewal", subscription=forged)
    assert refused.value.code == "unknown_object"
    with read(w.engine) as conn:
        assert conn.execute(select(refusals.c.code)).scalars().all() == ["unknown_object"]
    assert w.merchant.effects == []


def test_an_object_from_another_task_is_unknown_here(w: World) -> None:
    first, second = w.task(), w.task()
    (sub,) = w.call(first, "merchant__list_subscriptions")["objects"]
    with pytest.raises(UnknownObject) as refused:
        w.call(second, "merchant__cancel_renewal", subscription=sub["id"])
    assert refused.value.code == "unknown_object"
    with read(w.engine) as conn:
        recorded = conn.execute(select(refusals.c.code, refusals.c.task_id)).all()
    assert [(r.code, r.task_id) for r in recorded] == [("unknown_object", second.task_id)]
    assert w.merchant.effects == []


def test_an_approval_from_before_the_user_steered_the_task_is_void(w: World) -> None:
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    with write(w.engine) as conn:
        control.steer(conn, user_id=w.owner, task_id=task.task_id, goal="actually, keep it", actor="user:test",
                      now=w.clock.now())
    assert approve(w, action) == "task_version_changed"
    assert w.dispatcher.drain() == 0 and w.merchant.effects == []


def test_revoking_while_the_dispatch_is_queued_sends_nothing(w: World) -> None:
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    approve(w, action)
    with write(w.engine) as conn:
        control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.REVOKE,
                               actor="user:test", reason="changed my mind", now=w.clock.now())
    w.dispatcher.drain()
    assert w.merchant.effects == [] and outcomes(w) == []
    assert any(m.get("kind") == "action_voided" for m in messages(w.engine))


def test_a_pause_holds_the_dispatch_and_resume_releases_it(w: World) -> None:
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    approve(w, w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"])
    for kind in (ControlKind.PAUSE,):
        with write(w.engine) as conn:
            control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=kind, actor="user:test",
                                   reason="", now=w.clock.now())
    assert w.dispatcher.drain() == 0 and w.merchant.effects == []
    with write(w.engine) as conn:
        control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.RESUME,
                               actor="user:test", reason="", now=w.clock.now())
    assert w.dispatcher.drain() == 1 and len(w.merchant.effects) == 1


def test_tools_refuse_to_act_for_a_paused_task(w: World) -> None:
    task = w.task()
    with write(w.engine) as conn:
        control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.PAUSE,
                               actor="user:test", reason="", now=w.clock.now())
    with pytest.raises(Refused) as refused:
        w.call(task, "merchant__list_subscriptions")
    assert refused.value.code == "paused"


def test_a_lost_response_is_reconciled_and_never_sent_twice(engine: Engine, clock: FakeClock, owner: str) -> None:
    with world(engine, clock, owner, client_timeout=0.3) as w:
        w.merchant.faults.update({"commit_then_timeout": 1, "stall_seconds": 2.0})
        task = w.task()
        (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
        approve(w, w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"])
        w.dispatcher.drain()
        assert outcomes(w) == [Outcome.UNKNOWN]
        assert len(w.merchant.effects) == 1  # the merchant did it; we do not know yet
        assert w.dispatcher.drain() == 0  # never a blind retry
        assert w.dispatcher.reconcile_due() == 1
        assert len(w.merchant.effects) == 1 and outcomes(w) == [Outcome.UNKNOWN]  # history is not rewritten
        assert w.dispatcher.reconcile_due() == 0  # the reconcile wait was satisfied by the evidence


def test_an_approval_after_the_quote_expired_is_refused(engine: Engine, clock: FakeClock, owner: str) -> None:
    with world(engine, clock, owner, policy=Policy()) as w:
        task = w.task(title="book the hotel")
        (quote,) = w.call(task, "hotel__quote_stay", hotel="Grand", nights=2)["objects"]
        action = w.call(task, "hotel__book_quote", quote_id=quote["id"])["action_id"]
        w.hotel.clock.advance(timedelta(minutes=16))
        w.clock.advance(timedelta(minutes=16))
        assert approve(w, action) == "quote_expired"
        assert w.dispatcher.drain() == 0 and w.hotel.effects == []




def test_completion_is_judged_on_a_fresh_read_and_the_receipt_is_sent_once(w: World) -> None:
    task = w.task(completion=CANCEL_VERIFIED)
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    approve(w, w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"])
    with read(w.engine) as conn:
        assert ledger.four_facts(conn, task_id=task.task_id)["goal_verified"] is None
    w.dispatcher.drain()
    assert w.dispatcher.verify_due() == 1
    assert w.dispatcher.verify_due() == 0 and w.dispatcher.complete_due() == 0  # once
    receipts = [m for m in messages(w.engine) if m.get("kind") == "receipt"]
    assert len(receipts) == 1 and receipts[0]["proof"][0]["verified"] is True
    assert "Verified against the provider's own records" in receipts[0]["text"]
    with read(w.engine) as conn:
        facts = ledger.four_facts(conn, task_id=task.task_id)
    assert facts["goal_verified"] is not None and facts["receipt_delivered"] is None  # not dispatched yet


def test_a_receipt_for_an_effect_no_read_verifies_does_not_say_verified(w: World) -> None:
    task = w.task(completion=[{"effect": "merchant__cancel_renewal"}])  # no verify read declared
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    approve(w, w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"])
    w.dispatcher.drain()
    w.dispatcher.complete_due()
    (receipt,) = [m for m in messages(w.engine) if m.get("kind") == "receipt"]
    assert receipt["proof"][0]["verified"] is False
    assert "Verified" not in receipt["text"] and "not verified by a fresh read" in receipt["text"]


def test_an_accepted_effect_that_the_fresh_read_does_not_show_is_not_complete(w: World) -> None:
    w.merchant.faults.update({"processing_seconds": 3600.0})
    task = w.task(completion=CANCEL_VERIFIED)
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    approve(w, w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"])
    w.dispatcher.drain()
    w.dispatcher.verify_due()
    assert not [m for m in messages(w.engine) if m.get("kind") == "receipt"]
    w.merchant.clock.advance(timedelta(hours=2))
    w.clock.advance(timedelta(minutes=1))  # reads are paced: the next one is due well within the minute
    w.dispatcher.verify_due()
    assert [m["kind"] for m in messages(w.engine) if m.get("kind") == "receipt"] == ["receipt"]


@pytest.mark.parametrize("answer, code", [
    (httpx.Response(403, headers={"X-Wakeful-Refusal": "credential_unavailable"},
                    json={"error": {"code": "credential_unavailable", "message": "no credential named merchant"}}),
     "credential_unavailable"),
    (httpx.Response(403, json={"error": "forbidden"}), "remote_error"),  # the remote's 403 stays the remote's
], ids=["the proxy refused", "the remote refused"])
def test_a_read_the_proxy_refused_tells_the_agent_the_proxys_own_code_and_reason(
        engine: Engine, clock: FakeClock, owner: str, answer: httpx.Response, code: str) -> None:
    from wakeful.proxy.contract import REFUSAL_HEADER
    from wakeful.server.egress.outbound import ConnectorHTTP
    from wakeful.server.errors import WakefulError

    assert REFUSAL_HEADER == "X-Wakeful-Refusal"
    http = ConnectorHTTP(timeout=5, transport=httpx.MockTransport(lambda request: answer))
    with world(engine, clock, owner, http=http) as w:
        task = w.task(title="cancel")
        with pytest.raises(WakefulError) as refused:
            w.call(task, "merchant__list_subscriptions")
    assert refused.value.code == code
    if code == "credential_unavailable":
        assert "no credential named merchant" in refused.value.message
