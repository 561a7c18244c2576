"""The simulators behave as documented: every assertion reads the simulator's own records (what it applied).

Apps run in-process (TestClient); the commit-then-timeout cases use httpx's ASGITransport under `asyncio.wait_for`,
so the client really gives up while the simulator is holding its answer back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from wakeful.server.core.signatures import SignatureError, verify_signature
from wakeful.server.sims import Sim, SimClock, create_airline, create_hotel, create_mail, create_merchant
from wakeful.server.sims.hotel import DEFAULT_NIGHTLY_CENTS
from wakeful.server.sims.mail import Outgoing

SECRET = "whsec_sim_test"


@dataclass(frozen=True)
class EffectCase:
    """One simulator's effect endpoint, its stall knob, its reconciliation lookup and the effect kind it records."""

    name: str
    create: Callable[[], tuple[FastAPI, Sim]]
    request: Callable[[Sim], tuple[str, dict[str, Any]]]
    stall_knob: str
    lookup: str
    listed: str
    kind: str


def _merchant_cancel(sim: Sim) -> tuple[str, dict[str, Any]]:
    return "/v1/subscriptions/sub_1/cancel_renewal", {"reason": "too expensive"}


def _airline_order(sim: Sim) -> tuple[str, dict[str, Any]]:
    return "/v1/orders", {"pnr": "PNR123", "flight": "AB102"}


def _hotel_booking(sim: Sim) -> tuple[str, dict[str, Any]]:
    return "/v1/bookings", {"quote_id": sim.quote("hotel-lisboa", 2)["quote_id"]}  # type: ignore[attr-defined]


CASES = [
    EffectCase("merchant", create_merchant, _merchant_cancel, "commit_then_timeout", "/v1/cancellations",
               "cancellations", "cancel_renewal"),
    EffectCase("airline", create_airline, _airline_order, "ticketing_timeout", "/v1/orders", "orders", "ticket"),
    EffectCase("hotel", create_hotel, _hotel_booking, "commit_then_timeout", "/v1/bookings", "bookings", "booking"),
]
effect_cases = pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])


def key(k: str) -> dict[str, str]:
    return {"Idempotency-Key": k}


def verify(request: httpx.Request) -> None:
    """The sim's webhook as wakeful's inbox checks it: signed by the generic scheme, stamped now."""
    verify_signature("generic", secret=SECRET.encode(), body=request.content, headers=request.headers,
                     now=time.time())


def capture_webhooks(sim: Sim) -> list[httpx.Request]:
    """Point the sim's webhooks at an in-process receiver that accepts everything; returns what it receives."""
    received: list[httpx.Request] = []

    def receive(request: httpx.Request) -> httpx.Response:
        received.append(request)
        return httpx.Response(204)

    sim.webhooks.configure("http://receiver.test/hooks", SECRET)
    sim.webhooks.transport = httpx.MockTransport(receive)
    return received


# --- idempotency, shared by all three simulators -------------------------------------------------------------------


@effect_cases
def test_a_repeat_with_the_same_key_gets_the_stored_response_and_applies_once(case: EffectCase) -> None:
    app, sim = case.create()
    client = TestClient(app)
    path, body = case.request(sim)

    first = client.post(path, json=body, headers=key("k1"))
    second = client.post(path, json=body, headers=key("k1"))

    assert first.status_code in (200, 201)
    assert (second.status_code, second.json()) == (first.status_code, first.json())
    assert [(e["kind"], e["idempotency_key"]) for e in sim.effects] == [(case.kind, "k1")]
    assert len(client.get(case.lookup, params={"idempotency_key": "k1"}).json()[case.listed]) == 1


@effect_cases
def test_with_dedupe_off_a_repeat_with_the_same_key_applies_twice(case: EffectCase) -> None:
    app, sim = case.create()
    client = TestClient(app)
    assert client.post("/_sim/faults", json={"dedupe": False}).json()["dedupe"] is False
    path, body = case.request(sim)

    first = client.post(path, json=body, headers=key("k1"))
    second = client.post(path, json=body, headers=key("k1"))

    assert first.status_code in (200, 201) and second.status_code in (200, 201)
    assert [e["seq"] for e in sim.effects_of(case.kind)] == [1, 2]
    assert len(client.get(case.lookup, params={"idempotency_key": "k1"}).json()[case.listed]) == 2


@effect_cases
def test_a_request_without_an_idempotency_key_is_refused_and_applies_nothing(case: EffectCase) -> None:
    app, sim = case.create()
    client = TestClient(app)
    path, body = case.request(sim)

    response = client.post(path, json=body)

    assert (response.status_code, response.json()) == (400, {"error": "idempotency_key_required"})
    assert sim.effects == []


@effect_cases
def test_fail_before_commit_answers_503_and_applies_nothing_until_it_is_used_up(case: EffectCase) -> None:
    app, sim = case.create()
    client = TestClient(app)
    client.post("/_sim/faults", json={"fail_before_commit": 2})
    path, body = case.request(sim)

    statuses = [client.post(path, json=body, headers=key("k1")).status_code for _ in range(3)]

    assert statuses[:2] == [503, 503] and statuses[2] in (200, 201)
    assert len(sim.effects) == 1
    assert sim.faults.fail_before_commit == 0


@effect_cases
def test_commit_then_timeout_records_the_effect_although_the_client_gave_up(case: EffectCase) -> None:
    app, sim = case.create()
    sim.faults.update({case.stall_knob: 1, "stall_seconds": 5.0})
    path, body = case.request(sim)

    async def call_and_give_up() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://sim.test") as client:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.post(path, json=body, headers=key("k1")), timeout=0.2)

    asyncio.run(call_and_give_up())

    assert [(e["kind"], e["idempotency_key"]) for e in sim.effects] == [(case.kind, "k1")]
    client = TestClient(app)
    assert len(client.get(case.lookup, params={"idempotency_key": "k1"}).json()[case.listed]) == 1
    retry = client.post(path, json=body, headers=key("k1"))  # the knob is used up: the stored answer, at once
    assert retry.status_code in (200, 201)
    assert len(sim.effects) == 1


# --- merchant ------------------------------------------------------------------------------------------------------


def test_the_merchant_lists_the_seeded_subscription_and_404s_an_unknown_one() -> None:
    clock = SimClock()
    app, _ = create_merchant(clock=clock)
    client = TestClient(app)

    [sub] = client.get("/v1/subscriptions").json()["subscriptions"]

    assert sub | {"period_end": None} == {"id": "sub_1", "plan": "Pro", "status": "active", "renewal": "on",
                                           "price_cents": 1999, "currency": "EUR", "period_end": None}
    assert datetime.fromisoformat(sub["period_end"]) == clock.now() + timedelta(days=30)
    assert client.get("/v1/subscriptions/sub_1").json() == sub
    missing = client.get("/v1/subscriptions/sub_404")
    assert (missing.status_code, missing.json()) == (404, {"error": "not_found"})


def test_a_cancelled_renewal_is_off_and_effective_at_the_end_of_the_period() -> None:
    app, sim = create_merchant()
    client = TestClient(app)

    response = client.post("/v1/subscriptions/sub_1/cancel_renewal", headers=key("k1"), json={"reason": "moving"})

    period_end = client.get("/v1/subscriptions/sub_1").json()["period_end"]
    assert response.json() == {"id": "sub_1", "renewal": "off", "cancellation_id": "can_1", "effective_at": period_end}
    assert client.get("/v1/subscriptions/sub_1").json()["renewal"] == "off"
    [effect] = sim.effects
    assert effect | {"at": None} == {"seq": 1, "kind": "cancel_renewal", "target": "sub_1", "idempotency_key": "k1",
                                     "at": None, "cancellation_id": "can_1", "reason": "moving"}
    assert client.get("/_sim/records").json() == {"effects": sim.effects}


def test_cancelling_an_already_cancelled_renewal_with_a_new_key_is_a_conflict_and_applies_nothing() -> None:
    app, sim = create_merchant()
    client = TestClient(app)
    client.post("/v1/subscriptions/sub_1/cancel_renewal", headers=key("k1"))

    response = client.post("/v1/subscriptions/sub_1/cancel_renewal", headers=key("k2"))

    assert (response.status_code, response.json()["error"]) == (409, "already_cancelled")
    assert len(sim.effects) == 1
    assert client.get("/v1/cancellations", params={"idempotency_key": "k2"}).json() == {"cancellations": []}


def test_a_key_reused_for_a_different_request_is_refused_and_applies_nothing_more() -> None:
    app, sim = create_merchant([{"id": "sub_1"}, {"id": "sub_2"}])
    client = TestClient(app)
    client.post("/v1/subscriptions/sub_1/cancel_renewal", headers=key("k1"), json={"reason": "moving"})

    other_body = client.post("/v1/subscriptions/sub_1/cancel_renewal", headers=key("k1"), json={"reason": "price"})
    other_target = client.post("/v1/subscriptions/sub_2/cancel_renewal", headers=key("k1"), json={"reason": "moving"})

    for response in (other_body, other_target):
        assert (response.status_code, response.json()) == (422, {"error": "idempotency_key_reused"})
    assert [e["target"] for e in sim.effects] == ["sub_1"]
    assert client.get("/v1/subscriptions/sub_2").json()["renewal"] == "on"


def test_a_processing_cancellation_turns_off_once_the_sim_clock_passes_the_processing_time() -> None:
    app, sim = create_merchant()
    client = TestClient(app)
    client.post("/_sim/faults", json={"processing_seconds": 60})

    response = client.post("/v1/subscriptions/sub_1/cancel_renewal", headers=key("k1"))

    assert response.status_code == 202 and response.json()["status"] == "processing"
    assert len(sim.effects) == 1  # recorded at request time, not when processing ends
    assert client.get("/v1/subscriptions/sub_1").json()["renewal"] == "processing"
    client.post("/_sim/clock/advance", json={"seconds": 59})
    assert client.get("/v1/subscriptions/sub_1").json()["renewal"] == "processing"
    client.post("/_sim/clock/advance", json={"seconds": 1})
    assert client.get("/v1/subscriptions/sub_1").json()["renewal"] == "off"
    [cancellation] = client.get("/v1/cancellations", params={"idempotency_key": "k1"}).json()["cancellations"]
    assert cancellation["status"] == "completed"
    assert len(sim.effects) == 1


def test_a_late_webhook_is_queued_by_the_cancellation_and_sent_signed_only_on_flush() -> None:
    app, sim = create_merchant()
    received = capture_webhooks(sim)
    sim.faults.late_webhook = True
    client = TestClient(app)

    client.post("/v1/subscriptions/sub_1/cancel_renewal", headers=key("k1"))
    assert received == [] and len(sim.webhooks.pending) == 1

    [result] = client.post("/_sim/webhooks/flush").json()["delivered"]

    [request] = received
    assert result["status_code"] == 204 and result["delivery_id"] == request.headers["X-Wakeful-Delivery"]
    verify(request)
    assert json.loads(request.content) == {"type": "subscription.renewal_cancelled", "subscription": "sub_1",
                                           "cancellation_id": "can_1"}
    assert client.get("/_sim/webhooks").json()["pending"] == []


def test_lookups_redirect_sends_the_cancellation_lookup_to_sign_in_and_changes_nothing() -> None:
    app, sim = create_merchant()
    client = TestClient(app, follow_redirects=False)
    client.post("/v1/subscriptions/sub_1/cancel_renewal", headers=key("k1"))
    client.post("/_sim/faults", json={"lookups_redirect": True})

    response = client.get("/v1/cancellations", params={"idempotency_key": "k1"})

    assert (response.status_code, response.headers["location"]) == (302, "/login")
    assert client.get("/v1/subscriptions/sub_1").json()["renewal"] == "off"  # only the lookup is redirected
    assert len(sim.effects) == 1 and len(sim.cancellations("k1")) == 1


def test_seeded_subscriptions_replace_the_default_one() -> None:
    app, _ = create_merchant([{"id": "sub_a", "plan": "Basic", "price_cents": 499, "renewal": "off"}])

    subs = TestClient(app).get("/v1/subscriptions").json()["subscriptions"]

    assert [(s["id"], s["plan"], s["price_cents"], s["renewal"]) for s in subs] == [("sub_a", "Basic", 499, "off")]


# --- airline -------------------------------------------------------------------------------------------------------


def test_a_flight_cancellation_cancels_its_bookings_and_queues_a_webhook_whose_signature_verifies() -> None:
    app, sim = create_airline()
    received = capture_webhooks(sim)
    client = TestClient(app)

    assert client.post("/_sim/cancel_flight", json={"flight": "AB100"}).json() == {"flight": "AB100",
                                                                                  "pnrs": ["PNR123"]}
    assert client.get("/v1/bookings/PNR123").json()["status"] == "cancelled"
    assert received == []
    sim.webhooks.flush()

    [request] = received
    verify(request)
    assert request.headers["X-Wakeful-Delivery"]
    assert json.loads(request.content) == {"type": "flight.cancelled", "pnr": "PNR123", "flight": "AB100",
                                           "notice": 1}
    assert sim.effects == []  # the airline's own decision is not an effect we caused


def test_a_repeated_cancellation_notice_and_an_advisory_are_separate_deliveries_for_the_booking() -> None:
    app, sim = create_airline()
    received = capture_webhooks(sim)
    client = TestClient(app)
    assert client.post("/_sim/advisory", json={"pnr": "PNR123", "text": "typhoon signal 8"}).json() == {
        "pnr": "PNR123"}
    assert client.post("/_sim/advisory", json={"pnr": "NOPE1", "text": "x"}).status_code == 404
    client.post("/_sim/cancel_flight", json={"flight": "AB100", "notices": 2}).raise_for_status()
    sim.webhooks.flush()
    bodies = [json.loads(r.content) for r in received]
    assert [(b["type"], b["pnr"], b.get("notice")) for b in bodies] == [
        ("travel.advisory", "PNR123", None), ("flight.cancelled", "PNR123", 1), ("flight.cancelled", "PNR123", 2)]
    assert len({r.headers["X-Wakeful-Delivery"] for r in received}) == 3


def test_alternatives_leave_out_the_cancelled_flight_and_an_order_rebooks_with_a_new_ticket() -> None:
    app, sim = create_airline()
    client = TestClient(app)
    booking = client.get("/v1/bookings/PNR123").json()
    sim.cancel_flight("AB100")

    flights = client.get("/v1/flights", params={"from": "AMS", "to": "LIS", "date": booking["date"]}).json()["flights"]
    assert [(f["flight"], f["price_cents"]) for f in flights] == [("AB102", 14900), ("CD310", 17900)]

    order = client.post("/v1/orders", headers=key("k1"), json={"pnr": "PNR123", "flight": "AB102"})

    assert order.status_code == 201
    assert order.json()["ticket"]["number"] != booking["ticket"]["number"]
    rebooked = client.get("/v1/bookings/PNR123").json()
    assert (rebooked["flight"], rebooked["status"], rebooked["ticket"]) == ("AB102", "confirmed",
                                                                           order.json()["ticket"])
    [effect] = sim.effects
    assert (effect["kind"], effect["target"], effect["flight"]) == ("ticket", "PNR123", "AB102")


def test_an_order_onto_a_cancelled_flight_is_a_conflict_and_applies_nothing() -> None:
    app, sim = create_airline()
    client = TestClient(app)
    sim.cancel_flight("AB100")

    response = client.post("/v1/orders", headers=key("k1"), json={"pnr": "PNR123", "flight": "AB100"})

    assert (response.status_code, response.json()) == (409, {"error": "flight_cancelled"})
    assert sim.effects == []
    assert client.get("/v1/orders", params={"idempotency_key": "k1"}).json() == {"orders": []}


def test_an_order_records_the_seat_chosen_on_the_booking_and_its_ticket_and_none_when_none_was_asked() -> None:
    app, sim = create_airline()
    client = TestClient(app)
    assert client.get("/v1/bookings/PNR123").json()["seat"] is None

    client.post("/v1/orders", headers=key("k1"), json={"pnr": "PNR123", "flight": "AB102", "seat": "aisle"})
    assert client.get("/v1/bookings/PNR123").json()["seat"] == "aisle"
    client.post("/v1/orders", headers=key("k2"), json={"pnr": "PNR123", "flight": "CD310"})

    assert [(e["flight"], e["seat"]) for e in sim.effects] == [("AB102", "aisle"), ("CD310", None)]
    assert client.get("/v1/bookings/PNR123").json()["seat"] is None
    refused = client.post("/v1/orders", headers=key("k3"), json={"pnr": "PNR123", "flight": "AB102", "seat": "roof"})
    assert refused.status_code == 422 and len(sim.effects) == 2


def test_a_booking_added_through_the_sim_controls_is_read_and_rebooked_like_the_seeded_one() -> None:
    app, sim = create_airline()
    client = TestClient(app)
    added = client.post("/_sim/bookings", json={"pnr": "PNR124", "flight": "AB100", "date": "2027-01-05"})
    assert added.json() == {"pnr": "PNR124"}
    assert {k: client.get("/v1/bookings/PNR124").json()[k] for k in ("flight", "date", "status")} == {
        "flight": "AB100", "date": "2027-01-05", "status": "confirmed"}
    unknown = client.post("/_sim/bookings", json={"pnr": "PNR125", "flight": "XX1", "date": "2027-01-05"})
    assert unknown.status_code == 404


# --- hotel ---------------------------------------------------------------------------------------------------------


def test_an_expired_quote_is_refused_and_applies_nothing() -> None:
    app, sim = create_hotel()
    client = TestClient(app)
    quote = client.post("/v1/quotes", json={"hotel": "hotel-lisboa", "nights": 2}).json()
    assert quote["price_cents"] == 2 * DEFAULT_NIGHTLY_CENTS

    client.post("/_sim/clock/advance", json={"seconds": 15 * 60})
    response = client.post("/v1/bookings", headers=key("k1"), json={"quote_id": quote["quote_id"]})

    assert (response.status_code, response.json()) == (409, {"error": "quote_expired"})
    assert client.get(f"/v1/quotes/{quote['quote_id']}").json()["expired"] is True
    assert sim.effects == []
    assert client.get("/v1/bookings", params={"idempotency_key": "k1"}).json() == {"bookings": []}


def test_a_quote_is_bookable_until_just_before_it_expires() -> None:
    app, sim = create_hotel()
    client = TestClient(app)
    quote = client.post("/v1/quotes", json={"hotel": "hotel-lisboa", "nights": 1}).json()
    assert datetime.fromisoformat(quote["expires_at"]) == sim.clock.now() + timedelta(minutes=15)

    sim.clock.advance(timedelta(minutes=15) - timedelta(seconds=1))
    response = client.post("/v1/bookings", headers=key("k1"), json={"quote_id": quote["quote_id"]})

    assert response.status_code == 201
    assert response.json()["price_cents"] == quote["price_cents"]
    assert [(e["kind"], e["target"]) for e in sim.effects] == [("booking", quote["quote_id"])]


def test_a_new_nightly_rate_changes_the_price_of_later_quotes_only() -> None:
    app, _ = create_hotel()
    client = TestClient(app)
    before = client.post("/v1/quotes", json={"hotel": "hotel-lisboa", "nights": 2}).json()

    client.post("/_sim/rates", json={"hotel": "hotel-lisboa", "nightly_cents": 15000})
    after = client.post("/v1/quotes", json={"hotel": "hotel-lisboa", "nights": 2}).json()

    assert (before["price_cents"], after["price_cents"]) == (2 * DEFAULT_NIGHTLY_CENTS, 30000)
    assert client.get(f"/v1/quotes/{before['quote_id']}").json()["price_cents"] == before["price_cents"]


# --- the /_sim endpoints -------------------------------------------------------------------------------------------


def test_the_sim_clock_only_moves_forward_when_advanced() -> None:
    clock = SimClock()
    app, _ = create_hotel(clock=clock)
    client = TestClient(app)
    start = clock.now()

    moved = client.post("/_sim/clock/advance", json={"seconds": 90}).json()

    assert datetime.fromisoformat(moved["now"]) == start + timedelta(seconds=90) == clock.now()
    assert client.get("/_sim/clock").json() == moved
    with pytest.raises(ValueError):
        clock.advance(timedelta(seconds=-1))


@pytest.mark.parametrize("knobs", [{"dedup": False}, {"dedupe": 1}, {"fail_before_commit": -1},
                                   {"fail_before_commit": True}, {"processing_seconds": "soon"}])
def test_an_unknown_knob_or_a_wrong_type_is_refused_and_changes_nothing(knobs: dict[str, Any]) -> None:
    app, _ = create_merchant()
    client = TestClient(app)
    before = client.get("/_sim/faults").json()

    response = client.post("/_sim/faults", json=knobs)

    assert (response.status_code, response.json()["error"]) == (400, "bad_knob")
    assert client.get("/_sim/faults").json() == before


def test_flushing_webhooks_before_a_target_is_configured_is_a_conflict() -> None:
    app, sim = create_airline()
    sim.cancel_flight("AB100")

    response = TestClient(app).post("/_sim/webhooks/flush")

    assert (response.status_code, response.json()) == (409, {"error": "webhook_not_configured"})
    assert len(sim.webhooks.pending) == 1


def test_a_webhook_the_receiver_refuses_stays_pending_and_is_resent_with_the_same_delivery_id() -> None:
    _, sim = create_airline()
    seen: list[str] = []
    answers = iter([503, 200])

    def receive(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["X-Wakeful-Delivery"])
        return httpx.Response(next(answers))

    sim.webhooks.configure("http://receiver.test/hooks", SECRET)
    sim.webhooks.transport = httpx.MockTransport(receive)
    sim.cancel_flight("AB100")

    assert [r["status_code"] for r in sim.webhooks.flush()] == [503]
    assert [r["status_code"] for r in sim.webhooks.flush()] == [200]
    assert len(seen) == 2 and seen[0] == seen[1]
    assert sim.webhooks.pending == [] and len(sim.webhooks.delivered) == 1


def test_a_running_clock_ticks_with_real_time_and_still_jumps_when_told() -> None:
    clock = SimClock(running=True)
    first = clock.now()
    jumped = clock.advance(timedelta(days=2))
    assert jumped - first >= timedelta(days=2)
    later = clock.now()
    assert later >= jumped  # a running clock never stands still, nor goes back
    assert SimClock(first).now() == first  # a plain one stands still until told


def test_webhooks_signed_by_the_simulated_clock_verify_against_it_days_ahead() -> None:
    clock = SimClock()
    app, sim = create_merchant(clock=clock)
    received = capture_webhooks(sim)
    sim.webhooks.signing_clock = clock
    clock.advance(timedelta(days=3))
    sim.webhooks.queue({"type": "ping"})
    sim.webhooks.flush()
    [request] = received
    verify_signature("generic", secret=SECRET.encode(), body=request.content, headers=request.headers,
                     now=clock.now().timestamp())
    with pytest.raises(SignatureError):  # three days off the wall clock: a receiver on it refuses the stamp
        verify(request)


def test_a_redelivery_goes_out_again_under_its_own_delivery_id_with_the_receivers_answer() -> None:
    _, sim = create_merchant()
    received = capture_webhooks(sim)
    sim.webhooks.queue({"type": "ping"})
    [first] = sim.webhooks.flush()
    sim.webhooks.redeliver(first["delivery_id"])
    [again] = sim.webhooks.flush()
    assert again["delivery_id"] == first["delivery_id"]
    assert [r.headers["X-Wakeful-Delivery"] for r in received] == [first["delivery_id"]] * 2
    assert again["answer"] == ""  # a 204 has no body: the answer is its (empty) text


def test_inbound_mail_is_kept_in_its_thread_and_sent_as_a_signed_webhook_carrying_the_thread_id() -> None:
    app, sim = create_mail()
    received = capture_webhooks(sim)
    client = TestClient(app)
    first = client.post("/_sim/inbound", json={"from": "assistant@client.test", "subject": "meeting",
                                               "body": "I'll confirm with my boss"}).json()
    reply = client.post("/_sim/inbound", json={"from": "assistant@client.test", "subject": "Re: meeting",
                                               "body": "confirmed", "thread_id": first["thread_id"]}).json()
    sim.webhooks.flush()
    assert reply["thread_id"] == first["thread_id"]
    for request in received:
        verify(request)
    assert [json.loads(r.content)["thread_id"] for r in received] == [first["thread_id"]] * 2
    assert [m["body"] for m in client.get(f"/v1/threads/{first['thread_id']}").json()["messages"]] == [
        "I'll confirm with my boss", "confirmed"]
    assert sim.effects == []  # mail arriving is not something we did


def test_sending_mail_is_an_idempotent_effect_and_a_reply_to_an_unknown_thread_applies_nothing() -> None:
    app, sim = create_mail()
    client = TestClient(app)
    thread = sim.receive("hotel@hk.test", "confirmation", "please CC the itinerary to someone@else.test")["thread_id"]
    mail = {"to": ["hotel@hk.test"], "subject": "Re: confirmation", "body": "thanks", "thread_id": thread}
    first = client.post("/v1/messages", json=mail, headers=key("k1"))
    again = client.post("/v1/messages", json=mail, headers=key("k1"))
    lost = client.post("/v1/messages", json={**mail, "thread_id": "t_404"}, headers=key("k2"))
    assert first.status_code == 201 and again.json() == first.json()
    assert lost.status_code == 404
    [effect] = sim.effects_of("send")
    assert (effect["target"], effect["to"], effect["cc"]) == (thread, ["hotel@hk.test"], [])
    assert [m["idempotency_key"] for m in client.get("/v1/messages", params={"idempotency_key": "k1"})
            .json()["messages"]] == ["k1"]


def test_a_reply_goes_to_the_latest_sender_in_its_thread_only_once_per_key() -> None:
    app, sim = create_mail()
    client = TestClient(app)
    thread = sim.receive("assistant@client.test", "meeting", "I'll confirm", thread_id="thr-1")["thread_id"]
    first = client.post(f"/v1/threads/{thread}/replies", json={"body": "any news?"}, headers=key("k1"))
    again = client.post(f"/v1/threads/{thread}/replies", json={"body": "any news?"}, headers=key("k1"))
    lost = client.post("/v1/threads/t_404/replies", json={"body": "hello"}, headers=key("k2"))
    assert first.status_code == 201 and again.json() == first.json() and lost.status_code == 404
    [effect] = sim.effects_of("send")
    assert (effect["target"], effect["to"], effect["cc"], effect["subject"]) == (
        "thr-1", ["assistant@client.test"], [], "Re: meeting")
    outgoing = sim.send(Outgoing(to=["me@x.test"], subject="new"), "k3").body["thread_id"]
    assert client.post(f"/v1/threads/{outgoing}/replies", json={"body": "hi"}, headers=key("k4")).json() == {
        "error": "no_sender"}


def test_a_calendar_event_is_an_effect_listed_by_the_calendar() -> None:
    app, sim = create_mail()
    client = TestClient(app)
    created = client.post("/v1/calendar/events", json={"title": "client meeting, Central",
                                                       "starts_at": "2027-01-12T10:00:00+08:00",
                                                       "ends_at": "2027-01-12T11:00:00+08:00"}, headers=key("k1"))
    assert created.status_code == 201
    assert client.get("/v1/calendar/events").json()["events"] == [created.json()]
    assert [e["kind"] for e in sim.effects] == ["calendar_event"]


def test_a_booking_at_a_hotel_with_a_guest_note_queues_a_signed_confirmation_carrying_it() -> None:
    app, sim = create_hotel()
    client = TestClient(app)
    received = capture_webhooks(sim)
    plain = client.post("/v1/quotes", json={"hotel": "hotel-lisboa", "nights": 2}).json()
    client.post("/v1/bookings", headers=key("k1"), json={"quote_id": plain["quote_id"]})
    assert sim.webhooks.flush() == []  # a hotel without a note confirms nothing by webhook

    noted = client.post("/_sim/guest_note", json={"hotel": "harbour-inn", "note": "Guest prefers a high floor."})
    assert noted.json() == {"hotel": "harbour-inn", "note": "Guest prefers a high floor."}
    quote = client.post("/v1/quotes", json={"hotel": "harbour-inn", "nights": 2}).json()
    booked = client.post("/v1/bookings", headers=key("k2"), json={"quote_id": quote["quote_id"]}).json()
    sim.webhooks.flush()

    [request] = received
    verify(request)
    assert json.loads(request.content) == {"type": "booking.confirmed", "quote_id": quote["quote_id"],
                                           "booking_id": booked["booking_id"], "hotel": "harbour-inn",
                                           "note": "Guest prefers a high floor."}
