"""A hotel: price quotes that expire after 15 sim-minutes, and bookings of a quote (idempotent).

    app, sim = create_hotel()
    quote = client.post("/v1/quotes", json={"hotel": "hotel-lisboa", "nights": 2}).json()
    sim.clock.advance(timedelta(minutes=16))     # booking the quote now is a 409 quote_expired, and applies nothing

Service API:
    POST /v1/quotes {"hotel", "nights"}   201 {quote_id, hotel, nights, price_cents, currency, expires_at}
    GET  /v1/quotes/{id}                  the quote + {"expired": bool} | 404 {"error": "not_found"}
    POST /v1/bookings {"quote_id"}        Idempotency-Key required -> 201 {booking_id, quote_id, hotel, nights,
                                          price_cents, currency}, effect {"kind": "booking", "target": quote_id};
                                          404 {"error": "not_found"}; 409 {"error": "quote_expired"} (no effect).
                                          Every accepted booking is another booking, even of the same quote.
    GET  /v1/bookings?idempotency_key=K   {"bookings": [{booking_id, quote_id, ..., idempotency_key, created_at}]}
Sim-only:
    POST /_sim/rates {"hotel", "nightly_cents"}   the price of later quotes for that hotel (`sim.rates` in-process);
                                                  hotels not in `sim.rates` cost DEFAULT_NIGHTLY_CENTS a night
    POST /_sim/guest_note {"hotel", "note"}       what the hotel notes about its guest ("Guest prefers a high
                                                  floor."): each later booking there queues one signed
                                                  {"type": "booking.confirmed", "quote_id", "booking_id", "hotel",
                                                  "note"} webhook (a hotel without a note sends none)

Knobs: dedupe, fail_before_commit, stall_seconds (see _base), and
    commit_then_timeout  int  the next N bookings commit, then hold the response back `stall_seconds`
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from wakeful.server.sims._base import Faults, Reply, Sim, SimClock, error, iso, sim_app

__all__ = ["DEFAULT_NIGHTLY_CENTS", "QUOTE_TTL", "Hotel", "HotelFaults", "create_hotel"]

DEFAULT_NIGHTLY_CENTS = 12000
QUOTE_TTL = timedelta(minutes=15)


@dataclass
class HotelFaults(Faults):
    commit_then_timeout: int = 0


class QuoteRequest(BaseModel):
    hotel: str
    nights: int = Field(ge=1)


class BookingRequest(BaseModel):
    quote_id: str


class Hotel(Sim):
    def __init__(self, clock: SimClock | None = None) -> None:
        super().__init__("hotel", HotelFaults(), clock)
        self.faults: HotelFaults
        self.rates: dict[str, int] = {}
        self.guest_notes: dict[str, str] = {}
        self._quotes: dict[str, dict[str, Any]] = {}
        self._bookings: list[dict[str, Any]] = []

    def quote(self, hotel: str, nights: int) -> dict[str, Any]:
        with self.lock:
            quote: dict[str, Any] = {
                "quote_id": f"q_{len(self._quotes) + 1}", "hotel": hotel, "nights": nights,
                "price_cents": self.rates.get(hotel, DEFAULT_NIGHTLY_CENTS) * nights, "currency": "EUR",
                "expires_at": self.clock.now() + QUOTE_TTL,
            }
            self._quotes[quote["quote_id"]] = quote
            return _public(quote)

    def get_quote(self, quote_id: str) -> dict[str, Any] | None:
        with self.lock:
            quote = self._quotes.get(quote_id)
            return {**_public(quote), "expired": self._expired(quote)} if quote else None

    def _expired(self, quote: dict[str, Any]) -> bool:
        expires_at: datetime = quote["expires_at"]
        return self.clock.now() >= expires_at

    def bookings(self, idempotency_key: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(b) for b in self._bookings if idempotency_key in (None, b["idempotency_key"])]

    def book(self, quote_id: str, key: str) -> Reply:
        with self.lock:
            quote = self._quotes.get(quote_id)
            if quote is None:
                return Reply(404, {"error": "not_found"})
            if self._expired(quote):
                return Reply(409, {"error": "quote_expired"})
            booking_id = f"bk_{len(self._bookings) + 1}"
            body = {"booking_id": booking_id, "quote_id": quote_id, "hotel": quote["hotel"], "nights": quote["nights"],
                    "price_cents": quote["price_cents"], "currency": quote["currency"]}
            self._bookings.append({**body, "idempotency_key": key, "created_at": iso(self.clock.now())})
            self.record("booking", quote_id, key, booking_id=booking_id, price_cents=quote["price_cents"])
            note = self.guest_notes.get(quote["hotel"])
            if note is not None:
                self.webhooks.queue({"type": "booking.confirmed", "quote_id": quote_id, "booking_id": booking_id,
                                     "hotel": quote["hotel"], "note": note})
            return Reply(201, body, applied=True)


def _public(quote: dict[str, Any]) -> dict[str, Any]:
    return {**quote, "expires_at": iso(quote["expires_at"])}


def create_hotel(*, clock: SimClock | None = None) -> tuple[FastAPI, Hotel]:
    """A hotel app and its sim; no quotes yet (ask for one with POST /v1/quotes or `sim.quote(hotel, nights)`)."""
    sim = Hotel(clock)
    app = sim_app(sim, "hotel simulator")

    @app.post("/v1/quotes", status_code=201)
    def create_quote(body: QuoteRequest) -> dict[str, Any]:
        return sim.quote(body.hotel, body.nights)

    @app.get("/v1/quotes/{quote_id}", response_model=None)
    def get_quote(quote_id: str) -> dict[str, Any] | JSONResponse:
        return sim.get_quote(quote_id) or error(404, "not_found")

    @app.post("/v1/bookings")
    async def book(body: BookingRequest, request: Request) -> JSONResponse:
        return await sim.effect_request(request, body.model_dump(), lambda key: sim.book(body.quote_id, key),
                                        stall_knob="commit_then_timeout")

    @app.get("/v1/bookings")
    def bookings(idempotency_key: str | None = None) -> dict[str, Any]:
        return {"bookings": sim.bookings(idempotency_key)}

    @app.post("/_sim/rates")
    def set_rate(hotel: Annotated[str, Body()], nightly_cents: Annotated[int, Body(ge=0)]) -> dict[str, Any]:
        with sim.lock:
            sim.rates[hotel] = nightly_cents
        return {"hotel": hotel, "nightly_cents": nightly_cents}

    @app.post("/_sim/guest_note")
    def guest_note(hotel: Annotated[str, Body()], note: Annotated[str, Body(max_length=500)]) -> dict[str, Any]:
        with sim.lock:
            sim.guest_notes[hotel] = note
        return {"hotel": hotel, "note": note}

    return app, sim
