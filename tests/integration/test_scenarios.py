"""The issue's proof list, as scenarios against the simulators on loopback.

Every safety assertion reads what the simulator itself applied (`sim.effects`), never how often we called it:
counting calls cannot tell a reconciliation from a resend, nor a retry from a duplicate effect.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, and_, select, text
from sqlalchemy.exc import DBAPIError

from tests.support.acting import CANCEL_VERIFIED, World, world
from tests.support.polling import wait_until
from tests.support.records import messages
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting.actions import Action, load_action
from wakeful.server.acting.objects import UnknownObject
from wakeful.server.acting.policy import Policy
from wakeful.server.acting.verdicts import admit_and_record
from wakeful.server.core import control, inbox, sessions
from wakeful.server.core.worker import Binding
from wakeful.server.egress.dispatch import reconcile_key
from wakeful.server.errors import Conflict
from wakeful.server.store.db import read, write
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import (
    ApprovalDecision,
    ControlKind,
    EventStatus,
    OutboxKind,
    OutboxState,
    Outcome,
    VerdictKind,
    WaitState,
    actions,
    attempts,
    events,
    evidence,
    outbox,
    refusals,
    todos,
    verdicts,
    waits,
)
from wakeful.server.store.tables import approvals as approvals_table
from wakeful.server.store.users import ensure_user


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner) as w:
        yield w


# -- helpers: every one reads the records ----------------------------------------------------------------------


def approve(w: World, action_id: str) -> str:
    return w.approve(action_id)


def set_state(w: World, task: Binding, kind: ControlKind, reason: str = "") -> None:
    with write(w.engine) as conn:
        control.set_task_state(conn, user_id=task.user_id, task_id=task.task_id, kind=kind, actor="user:test",
                               reason=reason or kind.value, now=w.clock.now())


def attempt_rows(w: World, action_id: str) -> list[Any]:
    with read(w.engine) as conn:
        return conn.execute(select(attempts).where(attempts.c.action_id == action_id).order_by(attempts.c.seq)).all()


def evidence_rows(w: World, action_id: str | None = None, *, task_id: str | None = None,
                  source: str | None = None) -> list[Any]:
    query = select(evidence).order_by(evidence.c.checked_at, evidence.c.id)
    if action_id is not None:
        query = query.where(evidence.c.action_id == action_id)
    if task_id is not None:
        query = query.where(evidence.c.task_id == task_id)
    if source is not None:
        query = query.where(evidence.c.source == source)
    with read(w.engine) as conn:
        return conn.execute(query).all()


def latest_verdict(w: World, action_id: str) -> tuple[str, str]:
    with read(w.engine) as conn:
        row = conn.execute(select(verdicts.c.verdict, verdicts.c.code).where(verdicts.c.action_id == action_id)
                           .order_by(verdicts.c.created_at.desc(), verdicts.c.id.desc()).limit(1)).one()
    return row.verdict, row.code


def action(w: World, action_id: str) -> Action:
    with read(w.engine) as conn:
        return load_action(conn, action_id)


def wait_row(w: World, match_key: str) -> Any:
    with read(w.engine) as conn:
        return conn.execute(select(waits).where(waits.c.match_key == match_key)).one()


def pending_dispatches(w: World) -> list[Any]:
    with read(w.engine) as conn:
        return conn.execute(select(outbox).where(and_(outbox.c.kind == OutboxKind.DISPATCH.value,
                                                      outbox.c.state == OutboxState.PENDING.value))).all()


def rounds(w: World, n: int = 3, *, step: timedelta = timedelta(seconds=11)) -> None:
    """Let time pass (each step past the dispatcher's resend_after) and run every loop of the dispatcher."""
    for _ in range(n):
        w.clock.advance(step)
        w.dispatcher.drain()
        w.dispatcher.reconcile_due()
        w.dispatcher.verify_due()
        w.dispatcher.complete_due()
        w.dispatcher.drain()


def cancel_sub_1(w: World, task: Binding, **args: Any) -> str:
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    proposed = w.call(task, "merchant__cancel_renewal", subscription=sub["id"], **args)
    assert proposed["status"] == VerdictKind.NEEDS_APPROVAL
    return str(proposed["action_id"])


def book_a_quote(w: World, task: Binding, hotel: str = "Grand") -> tuple[str, str]:
    """(action ID, the hotel's quote ID) of a booking awaiting approval."""
    (quote,) = w.call(task, "hotel__quote_stay", hotel=hotel, nights=2)["objects"]
    proposed = w.call(task, "hotel__book_quote", quote_id=quote["id"])
    assert proposed["status"] == VerdictKind.NEEDS_APPROVAL
    return proposed["action_id"], action(w, proposed["action_id"]).content["refs"]["quote_id"]


# -- 1. the merchant cancelled, the receipt was lost ---------------------------------------------------------------


def test_a_lost_receipt_is_reconciled_and_even_without_merchant_dedupe_there_is_only_one_cancellation(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    with world(engine, clock, owner, client_timeout=1.0) as w:
        # Dedupe off: any second request with the key would apply a second cancellation, so only reconciliation
        # (a read) may follow the lost response.
        w.merchant.faults.update({"dedupe": False, "commit_then_timeout": 1, "stall_seconds": 5.0})
        task = w.task(completion=CANCEL_VERIFIED)
        act = cancel_sub_1(w, task, reason="keep this month")
        assert approve(w, act) == "admitted"
        assert w.dispatcher.drain() == 1
        (attempt,) = attempt_rows(w, act)
        assert attempt.outcome == Outcome.UNKNOWN and attempt.status_code is None
        assert len(w.merchant.effects_of("cancel_renewal", "sub_1")) == 1  # it happened; we do not know yet
        assert wait_row(w, reconcile_key(act)).state == WaitState.PENDING

        assert w.dispatcher.reconcile_due() == 1
        found = evidence_rows(w, act, source="reconcile")
        assert [(e.verdict, json.loads(e.observed)["found"]) for e in found] == [(Outcome.ACCEPTED, True)]
        assert wait_row(w, reconcile_key(act)).state == WaitState.SATISFIED

        rounds(w, 4)  # well past resend_after, with every loop run: still nothing is sent again
        assert len(w.merchant.effects) == 1
        assert [a.outcome for a in attempt_rows(w, act)] == [Outcome.UNKNOWN]  # history is not rewritten
        assert pending_dispatches(w) == []
        assert [m["kind"] for m in messages(w.engine) if m.get("kind") == "receipt"] == ["receipt"]
        assert w.merchant.subscription("sub_1")["renewal"] == "off"

        # Sanity of the probe: with dedupe off, the simulator really would have recorded a resend.
        request = json.loads(attempt.request)
        httpx.request(request["method"], request["url"], headers=request["headers"],
                      content=request["body"].encode() if request["body"] else None, timeout=5.0)
        assert len(w.merchant.effects_of("cancel_renewal", "sub_1")) == 2


# -- 2. the user revokes while an old execution is in flight -----------------------------------------------------


def test_revoking_while_a_request_is_on_the_wire_stops_every_later_step_and_claims_nothing_undone(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    with world(engine, clock, owner, client_timeout=2.5) as w:
        w.merchant.faults.update({"commit_then_timeout": 1, "stall_seconds": 5.0})
        task = w.task(title="cancel the subscription, then book the hotel")
        cancel = cancel_sub_1(w, task, reason="keep this month")
        booking, quote_ref = book_a_quote(w, task)
        assert approve(w, cancel) == "admitted"
        w.clock.advance(timedelta(seconds=1))  # the cancellation's intent is drained first
        assert approve(w, booking) == "admitted"
        w.clock.advance(timedelta(seconds=1))

        drained: list[int] = []
        drainer = threading.Thread(target=lambda: drained.append(w.dispatcher.drain()), name="drain")
        drainer.start()
        wait_until(lambda: w.merchant.effects, 10, "the cancellation to reach the merchant", interval=0.005)
        assert len(w.merchant.effects) == 1
        (in_flight,) = attempt_rows(w, cancel)
        assert in_flight.outcome is None  # persisted before the send, and the answer has not come back
        w.clock.advance(timedelta(seconds=1))
        set_state(w, task, ControlKind.REVOKE, "stop, I changed my mind")
        revoked_at = w.clock.now()
        drainer.join(timeout=15)
        assert not drainer.is_alive() and drained == [2]

        # Nothing was dispatched after the revocation committed: no second attempt, no new effect anywhere.
        (only,) = attempt_rows(w, cancel)
        assert only.id == in_flight.id and only.created_at < revoked_at and only.outcome == Outcome.UNKNOWN
        assert attempt_rows(w, booking) == []
        assert w.hotel.effects_of("booking", quote_ref) == [] and w.hotel.effects == []
        assert latest_verdict(w, booking) == (VerdictKind.REFUSED, "revoked")

        # The unknown outcome is still reconciled (a read), and it is never sent again, however long we wait.
        assert w.dispatcher.reconcile_due() == 1
        assert [e.verdict for e in evidence_rows(w, cancel, source="reconcile")] == [Outcome.ACCEPTED]
        rounds(w, 3)
        assert len(w.merchant.effects) == 1 and len(attempt_rows(w, cancel)) == 1 and w.hotel.effects == []

        # The user is told that the further step stopped; the effect that already left is not claimed undone.
        told = messages(w.engine)
        voided = [m for m in told if m.get("kind") == "action_voided"]
        assert [(m["action_id"], m["code"]) for m in voided] == [(booking, "revoked")]
        assert "Nothing was sent" in voided[0]["text"]
        to_user = [m for m in told if not m["id"].startswith("dsp_")]  # the outbox also holds dispatch intents
        assert [m["id"] for m in to_user if cancel in json.dumps(m)] == [f"card_{cancel}"]  # only its card


def test_revoking_after_a_response_was_lost_still_reconciles_the_unknown_outcome(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    with world(engine, clock, owner, client_timeout=1.0) as w:
        w.merchant.faults.update({"commit_then_timeout": 1, "stall_seconds": 5.0})
        task = w.task()
        act = cancel_sub_1(w, task)
        approve(w, act)
        w.dispatcher.drain()
        assert [a.outcome for a in attempt_rows(w, act)] == [Outcome.UNKNOWN]
        assert len(w.merchant.effects) == 1
        set_state(w, task, ControlKind.REVOKE, "never mind")
        # Revoking stops further steps; it cannot make "unknown" known: the request that left is still reconciled,
        # so the user can learn that the cancellation did happen.
        assert wait_row(w, reconcile_key(act)).state == WaitState.PENDING
        assert w.dispatcher.reconcile_due() == 1
        assert [e.verdict for e in evidence_rows(w, act, source="reconcile")] == [Outcome.ACCEPTED]
        assert wait_row(w, reconcile_key(act)).state == WaitState.SATISFIED
        rounds(w, 3)
        assert len(w.merchant.effects) == 1 and len(attempt_rows(w, act)) == 1 and pending_dispatches(w) == []


# -- 3. a duplicate request and a late error after verified completion --------------------------------------------


def test_after_a_verified_cancellation_a_replayed_decision_and_late_events_change_nothing(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    with world(engine, clock, owner, client_timeout=1.0) as w:
        w.merchant.faults.update({"commit_then_timeout": 1, "stall_seconds": 5.0, "late_webhook": True})
        plain = w.task(completion=CANCEL_VERIFIED)
        task = Binding(user_id=plain.user_id, task_id=plain.task_id, session_id=plain.session_id,
                       decision_id="dec_0123456789abcdefghjkmnpqrs")
        (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
        first = w.call(task, "merchant__cancel_renewal", subscription=sub["id"], reason="keep this month")
        act = first["action_id"]
        assert w.call(task, "merchant__cancel_renewal", subscription=sub["id"], reason="keep this month") == first
        assert approve(w, act) == "admitted"
        w.dispatcher.drain()
        assert w.dispatcher.reconcile_due() == 1 and w.dispatcher.verify_due() == 1
        receipts = [m for m in messages(w.engine) if m.get("kind") == "receipt"]
        assert len(receipts) == 1 and receipts[0]["proof"] == [{"effect": "merchant__cancel_renewal",
                                                                 "action_id": act, "verified": True}]
        (completion,) = evidence_rows(w, task_id=task.task_id, source="completion")
        satisfied = wait_row(w, reconcile_key(act))
        assert satisfied.state == WaitState.SATISFIED

        # (a) the same delivery of the tool call, replayed with its decision: the same action, nothing new
        replayed = w.call(task, "merchant__cancel_renewal", subscription=sub["id"], reason="keep this month")
        assert (replayed["action_id"], replayed["status"]) == (act, VerdictKind.ADMITTED)
        with read(w.engine) as conn:
            assert conn.execute(select(actions.c.id).where(actions.c.task_id == task.task_id)).scalars().all() == [act]
        with pytest.raises(Conflict) as again:
            approve(w, act)  # a second tap on the approval card
        assert again.value.code == "not_awaiting_approval"

        # (b) the merchant's late webhook and a late error event, both naming the satisfied reconcile wait: a wait
        # the server opened for itself, which no webhook may answer, so they reach neither it nor its session
        with read(w.engine) as conn:
            todo_before = conn.execute(select(todos.c.session_id, todos.c.version, todos.c.due_at)
                                       .where(todos.c.session_id == satisfied.session_id)).all()
        (late,) = w.merchant.webhooks.pending
        w.clock.advance(timedelta(minutes=5))
        with write(w.engine) as conn:
            recorded = [
                inbox.record(conn, inbox.Delivery(user_id=w.owner, source="merchant", source_id=late["delivery_id"],
                                                  payload=late["payload"], corr_key=reconcile_key(act)),
                             now=w.clock.now()),
                inbox.record(conn, inbox.Delivery(user_id=w.owner, source="merchant", source_id="evt_error_1",
                                                  payload={"type": "subscription.cancellation_failed",
                                                           "subscription": "sub_1", "error": "card_declined"},
                                                  corr_key=reconcile_key(act)), now=w.clock.now()),
                inbox.record(conn, inbox.Delivery(user_id=w.owner, source="merchant", source_id="evt_error_1",
                                                  payload={"type": "subscription.cancellation_failed"},
                                                  corr_key=reconcile_key(act)), now=w.clock.now()),
            ]
        assert [(r.status, r.duplicate) for r in recorded] == [
            (EventStatus.PENDING, False), (EventStatus.PENDING, False), (EventStatus.PENDING, True)]
        (merchants,) = {r.session_id for r in recorded}  # the key binds a session for the merchant's events
        assert merchants != satisfied.session_id
        with read(w.engine) as conn:
            assert conn.execute(select(todos.c.session_id, todos.c.version, todos.c.due_at)
                                .where(todos.c.session_id == satisfied.session_id)).all() == todo_before
            statuses = conn.execute(select(events.c.status, events.c.session_id)
                                    .where(events.c.corr_key == reconcile_key(act))
                                    .order_by(events.c.received_at)).all()
        assert statuses == [(EventStatus.PENDING, satisfied.session_id), (EventStatus.PENDING, merchants),
                            (EventStatus.PENDING, merchants)]  # reconcile's own, then the merchant's two
        after = wait_row(w, reconcile_key(act))
        assert (after.state, after.resolved_event_id, after.resolved_at) == (
            WaitState.SATISFIED, satisfied.resolved_event_id, satisfied.resolved_at)

        rounds(w, 3)
        assert [a.outcome for a in attempt_rows(w, act)] == [Outcome.UNKNOWN]  # no new attempt
        assert len(w.merchant.effects_of("cancel_renewal", "sub_1")) == 1 and len(w.merchant.effects) == 1
        assert evidence_rows(w, task_id=task.task_id, source="completion") == [completion]
        assert len([m for m in messages(w.engine) if m.get("kind") == "receipt"]) == 1
        assert w.merchant.subscription("sub_1")["renewal"] == "off"


# -- 4. the airline's ticketing timeout ---------------------------------------------------------------------------


def order_a_flight(w: World, task: Binding, flight: str = "AB102") -> str:
    (booking,) = w.call(task, "airline__get_booking", pnr="PNR123")["objects"]
    found = w.tools.call(task, "airline__search_flights", {"from": "AMS", "to": "LIS", "date": booking["date"]})
    (offer,) = [f for f in found["objects"] if f["flight"] == flight]
    proposed = w.call(task, "airline__order_flight", pnr=booking["id"], flight=offer["id"])
    assert proposed["status"] == VerdictKind.NEEDS_APPROVAL
    assert approve(w, proposed["action_id"]) == "admitted"
    return str(proposed["action_id"])


def test_a_ticketing_timeout_is_reconciled_by_idempotency_key_and_never_rebooks(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    with world(engine, clock, owner, client_timeout=1.0) as w:
        w.airline.faults.update({"ticketing_timeout": 1, "stall_seconds": 5.0})
        task = w.task(title="rebook me onto the afternoon flight")
        act = order_a_flight(w, task)
        key = action(w, act).content["idempotency_key"]
        w.dispatcher.drain()
        assert [a.outcome for a in attempt_rows(w, act)] == [Outcome.UNKNOWN]
        assert len(w.airline.effects_of("ticket", "PNR123")) == 1  # ticketed; the answer was lost

        assert w.dispatcher.reconcile_due() == 1
        (found,) = evidence_rows(w, act, source="reconcile")
        assert found.verdict == Outcome.ACCEPTED
        assert [o["idempotency_key"] for o in json.loads(found.observed)["body"]["orders"]] == [key]

        rounds(w, 5)
        (ticket,) = w.airline.effects_of("ticket", "PNR123")
        assert ticket["idempotency_key"] == key and ticket["flight"] == "AB102"
        assert len(w.airline.orders()) == 1 and len(w.airline.effects) == 1
        assert len(attempt_rows(w, act)) == 1 and pending_dispatches(w) == []
        assert w.airline.booking("PNR123")["flight"] == "AB102"


def test_an_order_the_airline_never_got_is_sent_again_with_the_same_key_after_reconciliation_finds_nothing(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    with world(engine, clock, owner) as w:
        w.airline.faults.update({"fail_before_commit": 1})
        task = w.task(title="rebook me onto the afternoon flight")
        act = order_a_flight(w, task)
        key = action(w, act).content["idempotency_key"]
        w.dispatcher.drain()
        (first,) = attempt_rows(w, act)
        assert (first.outcome, first.status_code) == (Outcome.UNKNOWN, 503)  # a 503 may or may not have applied
        assert w.airline.effects == []

        assert w.dispatcher.reconcile_due() == 1  # nothing there yet, and too early to send it again
        assert [e.verdict for e in evidence_rows(w, act, source="reconcile")] == [Outcome.UNKNOWN]
        assert w.dispatcher.drain() == 0 and len(attempt_rows(w, act)) == 1

        w.clock.advance(timedelta(seconds=11))  # past resend_after
        assert w.dispatcher.reconcile_due() == 1
        assert w.dispatcher.drain() == 1
        first, second = attempt_rows(w, act)
        assert second.outcome == Outcome.ACCEPTED and second.status_code == 201
        assert json.loads(second.request) == json.loads(first.request)  # the SAME request ...
        assert json.loads(second.request)["headers"]["Idempotency-Key"] == key  # ... with the SAME key
        (ticket,) = w.airline.effects_of("ticket", "PNR123")
        assert ticket["idempotency_key"] == key

        rounds(w, 4)
        assert len(w.airline.effects_of("ticket", "PNR123")) == 1 and len(w.airline.orders()) == 1
        assert len(attempt_rows(w, act)) == 2 and pending_dispatches(w) == []
        assert wait_row(w, reconcile_key(act)).state == WaitState.SATISFIED


@pytest.mark.parametrize("control_kind", ["pause", "steer"])
def test_reconciling_an_unknown_order_again_after_its_resend_was_held_or_voided_neither_crashes_nor_resends(
        engine: Engine, clock: FakeClock, owner: str, control_kind: str) -> None:
    """Regression (fixed in 432d4d0): the second reconcile pass re-enqueued dsp_<action>_<seq+1> and hit the outbox
    primary key, so reconcile_due raised IntegrityError for everyone until the reconcile window ran out."""
    with world(engine, clock, owner) as w:
        w.airline.faults.update({"fail_before_commit": 1})
        task = w.task(title="rebook me onto the afternoon flight")
        act = order_a_flight(w, task)
        key = action(w, act).content["idempotency_key"]
        w.dispatcher.drain()
        assert [a.outcome for a in attempt_rows(w, act)] == [Outcome.UNKNOWN]
        if control_kind == "pause":
            set_state(w, task, ControlKind.PAUSE, "wait, don't book yet")
        else:
            with write(w.engine) as conn:
                control.steer(conn, user_id=w.owner, task_id=task.task_id, goal="the evening flight instead",
                              actor="user:test", now=w.clock.now())
        w.clock.advance(timedelta(seconds=11))
        assert w.dispatcher.reconcile_due() == 1  # not found: the same request is queued again ...
        w.dispatcher.drain()  # ... and held (paused) or voided (the task moved on)
        assert len(attempt_rows(w, act)) == 1 and w.airline.effects == []
        assert wait_row(w, reconcile_key(act)).state == WaitState.PENDING
        for _ in range(3):  # the reconciler loop's next passes, each when the next read is due (reads are paced)
            w.clock.advance(timedelta(minutes=1))
            assert w.dispatcher.reconcile_due() == 1
            w.dispatcher.drain()
        assert w.airline.effects == [] and len(attempt_rows(w, act)) == 1  # nothing left while held / after void
        assert len(pending_dispatches(w)) == (1 if control_kind == "pause" else 0)  # one resend per attempt
        if control_kind == "pause":  # resuming releases that one resend: the same request, the same key
            set_state(w, task, ControlKind.RESUME, "go ahead")
            assert w.dispatcher.drain() == 1
            first, second = attempt_rows(w, act)
            assert json.loads(second.request) == json.loads(first.request) and second.outcome == Outcome.ACCEPTED
            (ticket,) = w.airline.effects_of("ticket", "PNR123")
            assert ticket["idempotency_key"] == key
            rounds(w, 2)
            assert len(w.airline.effects) == 1 and len(attempt_rows(w, act)) == 2
        else:
            voided = [m for m in messages(w.engine) if m.get("kind") == "action_voided"]
            assert [(m["action_id"], m["code"]) for m in voided] == [(act, "task_version_changed")]


def test_voiding_a_resend_never_tells_the_user_that_nothing_was_sent(engine: Engine, clock: FakeClock,
                                                                     owner: str) -> None:
    with world(engine, clock, owner) as w:
        w.airline.faults.update({"fail_before_commit": 1})
        task = w.task(title="rebook me onto the afternoon flight")
        act = order_a_flight(w, task)
        w.dispatcher.drain()  # the order left; the airline answered 503: it may or may not have been applied
        with write(w.engine) as conn:
            control.steer(conn, user_id=w.owner, task_id=task.task_id, goal="the evening flight instead",
                          actor="user:test", now=w.clock.now())
        w.clock.advance(timedelta(seconds=11))
        w.dispatcher.reconcile_due()
        w.dispatcher.drain()  # the resend is voided: the task moved on
        assert len(attempt_rows(w, act)) == 1 and wait_row(w, reconcile_key(act)).state == WaitState.PENDING
        (voided,) = [m for m in messages(w.engine) if m.get("kind") == "action_voided"]
        assert voided["action_id"] == act
        assert "Nothing was sent" not in voided["text"], voided["text"]  # one request did leave, outcome unknown


def test_an_order_whose_resend_was_voided_does_not_stop_another_tasks_reconciliation(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    """Regression (fixed in 432d4d0): the voided resend made every later reconcile pass raise before it reached
    the other task's unknown outcome, and the runtime's reconciler then skipped verify_due: no receipt, ever."""
    with world(engine, clock, owner, client_timeout=1.0) as w:
        w.airline.faults.update({"fail_before_commit": 1})
        broken = w.task(title="rebook me onto the afternoon flight")
        order_a_flight(w, broken)
        w.dispatcher.drain()
        with write(w.engine) as conn:
            control.steer(conn, user_id=w.owner, task_id=broken.task_id, goal="the evening flight instead",
                          actor="user:test", now=w.clock.now())
        w.clock.advance(timedelta(seconds=11))
        w.dispatcher.reconcile_due()
        w.dispatcher.drain()  # the order's resend is voided: the task moved on

        w.merchant.faults.update({"commit_then_timeout": 1, "stall_seconds": 5.0})
        bystander = w.task(completion=CANCEL_VERIFIED)
        cancel = cancel_sub_1(w, bystander)
        approve(w, cancel)
        w.dispatcher.drain()
        assert [a.outcome for a in attempt_rows(w, cancel)] == [Outcome.UNKNOWN]
        w.clock.advance(timedelta(seconds=11))
        for _ in range(3):  # the runtime's reconciler loop
            w.dispatcher.reconcile_due()
            w.dispatcher.verify_due()
        assert [e.verdict for e in evidence_rows(w, cancel, source="reconcile")] == [Outcome.ACCEPTED]
        assert [m["task_id"] for m in messages(w.engine) if m.get("kind") == "receipt"] == [bystander.task_id]


# -- 5 lives in test_races.py -- 6. an approval for content that changed ------------------------------------------


def test_an_approval_binds_to_one_action_and_its_content_hash(w: World) -> None:
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    a = w.call(task, "merchant__cancel_renewal", subscription=sub["id"], reason="keep this month")["action_id"]
    a2 = w.call(task, "merchant__cancel_renewal", subscription=sub["id"], reason="it is too expensive")["action_id"]
    A, A2 = action(w, a), action(w, a2)
    assert a != a2 and A.content_hash != A2.content_hash
    cards = {m["card"]["action_id"]: m["card"] for m in messages(w.engine) if m.get("kind") == "approval_request"}
    assert (cards[a]["content_hash"], cards[a2]["content_hash"]) == (A.content_hash, A2.content_hash)

    w.clock.advance(timedelta(seconds=1))
    assert approve(w, a2) == "admitted"
    assert latest_verdict(w, a) == (VerdictKind.NEEDS_APPROVAL, "approval_required")
    assert w.dispatcher.drain() == 1
    (effect,) = w.merchant.effects_of("cancel_renewal", "sub_1")
    assert (effect["reason"], effect["idempotency_key"]) == ("it is too expensive", A2.content["idempotency_key"])
    assert attempt_rows(w, a) == []
    with read(w.engine) as conn:
        rows = conn.execute(select(approvals_table.c.action_id, approvals_table.c.content_hash)).all()
    assert [tuple(r) for r in rows] == [(a2, A2.content_hash)]

    # An approval carrying A''s hash can never admit A (the other direction of the same binding): insert one for
    # A by hand, as if the approval of A' had been filed under A, and re-admit A.
    w.clock.advance(timedelta(seconds=1))
    with write(w.engine) as conn:
        conn.execute(approvals_table.insert().values(
            id=new_id("apr"), action_id=a, content_hash=A2.content_hash, task_id=task.task_id, task_version=1,
            decision=ApprovalDecision.APPROVED.value, approver="user:test", amount_ceiling_cents=None,
            valid_until=w.clock.now() + timedelta(hours=1), created_at=w.clock.now()))
        mixed = admit_and_record(conn, A, policy=w.policy, now=w.clock.now(), session_id=task.session_id)
    assert (mixed.kind, mixed.reason) == (VerdictKind.NEEDS_APPROVAL, "the approval was for different content")
    assert w.dispatcher.drain() == 0 and attempt_rows(w, a) == []

    # A's own approval admits A alone; the merchant refuses it (already cancelled), and A' is not sent again.
    w.clock.advance(timedelta(seconds=1))
    assert approve(w, a) == "admitted"
    assert w.dispatcher.drain() == 1
    assert [(r.outcome, r.status_code) for r in attempt_rows(w, a)] == [(Outcome.BLOCKED, 409)]
    assert len(attempt_rows(w, a2)) == 1 and len(w.merchant.effects) == 1


def test_stored_actions_and_approvals_cannot_be_changed_after_the_fact(w: World) -> None:
    task = w.task()
    a = cancel_sub_1(w, task, reason="keep this month")
    approve(w, a)
    tampered = json.dumps({**action(w, a).content, "args": {"reason": "and delete my account"}})
    for statement, params in [
        ("UPDATE actions SET content = :v WHERE id = :id", {"v": tampered, "id": a}),
        ("UPDATE actions SET content_hash = :v WHERE id = :id", {"v": "0" * 64, "id": a}),
        ("UPDATE actions SET tool = :v WHERE id = :id", {"v": "hotel__book_quote", "id": a}),
        ("DELETE FROM actions WHERE id = :id", {"id": a}),
        ("UPDATE approvals SET content_hash = :v WHERE action_id = :id", {"v": "0" * 64, "id": a}),
        ("UPDATE verdicts SET verdict = 'admitted' WHERE action_id = :id", {"id": a}),
        ("DELETE FROM approval_uses", {}),
    ]:
        with pytest.raises(DBAPIError, match="append-only"), write(w.engine) as conn:
            conn.execute(text(statement), params)
    assert action(w, a).content["args"]["reason"] == "keep this month"
    assert w.dispatcher.drain() == 1
    (effect,) = w.merchant.effects
    assert effect["reason"] == "keep this month"


# -- 7. an approval after (or just before) the quote expired -----------------------------------------------------


def test_a_quote_that_expires_between_approval_and_dispatch_is_recorded_as_blocked_and_books_nothing(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    with world(engine, clock, owner, policy=Policy()) as w:
        task = w.task(title="book the hotel")
        act, quote_ref = book_a_quote(w, task)
        assert approve(w, act) == "admitted"
        w.hotel.clock.advance(timedelta(minutes=16))
        w.clock.advance(timedelta(minutes=16))
        w.dispatcher.drain()
        assert w.hotel.effects == [] and w.hotel.effects_of("booking", quote_ref) == []
        sent = attempt_rows(w, act)
        assert sent or latest_verdict(w, act) == (VerdictKind.REFUSED, "quote_expired")
        for attempt in sent:  # if it was sent at all, its outcome is certain: refused, not unknown
            assert (attempt.outcome, attempt.status_code) == (Outcome.BLOCKED, 409)
            assert "quote_expired" in attempt.detail
        with read(w.engine) as conn:
            assert conn.execute(select(waits.c.id).where(waits.c.match_key == reconcile_key(act))).first() is None
        rounds(w, 2)
        assert w.hotel.effects == [] and len(attempt_rows(w, act)) <= 1


def test_the_dispatcher_does_not_send_a_quote_it_knows_has_expired(engine: Engine, clock: FakeClock,
                                                                    owner: str) -> None:
    with world(engine, clock, owner, policy=Policy()) as w:
        task = w.task(title="book the hotel")
        act, _ = book_a_quote(w, task)
        approve(w, act)
        w.hotel.clock.advance(timedelta(minutes=16))
        w.clock.advance(timedelta(minutes=16))
        w.dispatcher.drain()
        assert w.hotel.effects == []
        assert attempt_rows(w, act) == []
        assert latest_verdict(w, act) == (VerdictKind.REFUSED, "quote_expired")


# -- 8. forged object IDs ----------------------------------------------------------------------------------------


def other_users_task(w: World) -> Binding:
    with write(w.engine) as conn:
        other, _ = ensure_user(conn, name="someone-else", now=w.clock.now())
        session_id = sessions.create_session(conn, user_id=other, now=w.clock.now())
        task_id = control.create_task(conn, user_id=other, session_id=session_id, title="their own errand",
                                      now=w.clock.now())
    return Binding(user_id=other, task_id=task_id, session_id=session_id)


def refusal_rows(w: World) -> list[Any]:
    with read(w.engine) as conn:
        return conn.execute(select(refusals).order_by(refusals.c.created_at, refusals.c.id)).all()


def test_an_object_id_issued_to_another_user_is_unknown_here_and_reveals_nothing(w: World) -> None:
    theirs = other_users_task(w)
    (their_sub,) = w.call(theirs, "merchant__list_subscriptions")["objects"]
    mine = w.task()
    with pytest.raises(UnknownObject) as refused:
        w.call(mine, "merchant__cancel_renewal", subscription=their_sub["id"])
    assert refused.value.code == "unknown_object"
    assert refused.value.why == "never issued"  # the same words as a made-up ID: no oracle for other users' IDs
    with pytest.raises(UnknownObject) as made_up:
        w.call(mine, "merchant__cancel_renewal", subscription="obj_" + "0" * 26)
    assert made_up.value.why == refused.value.why
    assert [(r.user_id, r.task_id, r.code) for r in refusal_rows(w)] == [
        (w.owner, mine.task_id, "unknown_object"), (w.owner, mine.task_id, "unknown_object")]
    # The owner's own read works, and the other user's ID is still theirs alone.
    (my_sub,) = w.call(mine, "merchant__list_subscriptions")["objects"]
    assert my_sub["id"] != their_sub["id"]
    assert w.call(mine, "merchant__cancel_renewal", subscription=my_sub["id"])["status"] == VerdictKind.NEEDS_APPROVAL
    with read(w.engine) as conn:
        assert conn.execute(select(actions.c.user_id)).scalars().all() == [w.owner]
    assert w.dispatcher.drain() == 0 and w.merchant.effects == []


def test_an_object_id_from_before_the_user_steered_the_task_is_unknown_in_the_new_version(w: World) -> None:
    task = w.task()
    (old,) = w.call(task, "merchant__list_subscriptions")["objects"]
    with write(w.engine) as conn:
        assert control.steer(conn, user_id=w.owner, task_id=task.task_id, goal="cancel it, but only next month",
                             actor="user:test", now=w.clock.now()) == 2
    with pytest.raises(UnknownObject) as refused:
        w.call(task, "merchant__cancel_renewal", subscription=old["id"])
    assert (refused.value.code, refused.value.why) == ("unknown_object", "issued for an older task version")
    assert [(r.task_id, r.code) for r in refusal_rows(w)] == [(task.task_id, "unknown_object")]
    with read(w.engine) as conn:
        assert conn.execute(select(actions.c.id)).first() is None
    (fresh,) = w.call(task, "merchant__list_subscriptions")["objects"]
    proposed = w.call(task, "merchant__cancel_renewal", subscription=fresh["id"])
    assert proposed["status"] == VerdictKind.NEEDS_APPROVAL and action(w, proposed["action_id"]).task_version == 2
    assert w.merchant.effects == []


# -- a held dispatch must not starve anyone else's ---------------------------------------------------------------


def test_dispatches_held_by_a_pause_do_not_starve_another_tasks_dispatch(w: World) -> None:
    for n in range(50):
        paused = w.task(title=f"held {n}")
        held, _ = book_a_quote(w, paused, hotel=f"held-{n}")
        approve(w, held)
        set_state(w, paused, ControlKind.PAUSE, "don't book yet")
    w.clock.advance(timedelta(seconds=1))
    task = w.task(title="book the hotel")
    act, quote_ref = book_a_quote(w, task)
    assert approve(w, act) == "admitted"
    w.dispatcher.drain()
    assert len(w.hotel.effects_of("booking", quote_ref)) == 1
    assert len(pending_dispatches(w)) == 50  # the held ones stay held

