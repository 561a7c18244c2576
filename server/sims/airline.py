"""An airline: bookings, alternative flights, ticketing/rebooking orders (idempotent), flight cancellations.

    app, sim = create_airline()
    sim.webhooks.configure(url, secret)
    sim.cancel_flight("AB100")          # PNR123 is now cancelled; a signed flight.cancelled webhook is queued
    sim.webhooks.flush()

Service API:
    GET  /v1/bookings/{pnr}          {pnr, flight, date, from, to, status: "confirmed"|"cancelled",
                                      ticket: null | {"number"}, seat: null | "window"|"aisle"|"middle"}
                                     | 404 {"error": "not_found"}
    GET  /v1/flights?from=&to=&date= {"flights": [{flight, from, to, date, departs_at, arrives_at,
                                      status: "scheduled", price_cents, currency}]}
                                     the route's flights that day, cheapest first; cancelled flights left out
    POST /v1/orders                  Idempotency-Key required; {"pnr", "flight", "seat"?}: (re)book the PNR onto the
                                     flight (same date) and issue a new ticket, with the seat asked for (window, aisle
                                     or middle; none: the airline's choice, null) -> 201 {order_id, pnr, flight, seat,
                                     ticket: {"number"}}, effect {"kind": "ticket", "target": pnr, "seat"}; 404
                                     {"error": "not_found"} (pnr) or {"error": "unknown_flight"}; 409
                                     {"error": "flight_cancelled"}. Every accepted order issues another ticket.
    GET  /v1/orders?idempotency_key=K {"orders": [{order_id, pnr, flight, ticket, idempotency_key, created_at}]}
Sim-only:
    POST /_sim/cancel_flight {"flight", "notices"?} -> {"flight", "pnrs": [...]}: confirmed bookings on it become
                                     cancelled; `notices` (1) signed {"type": "flight.cancelled", "pnr", "flight",
                                     "notice"} webhooks queued each (airlines repeat a cancellation notice)
    POST /_sim/bookings {"pnr", "flight", "date"} -> {"pnr"}: another confirmed, ticketed booking (404
                                     {"error": "unknown_flight"})
    POST /_sim/advisory {"pnr", "text"} -> {"pnr"}: one signed {"type": "travel.advisory", "pnr", "text"} webhook
                                     queued (a typhoon warning for the booking's trip); 404 {"error": "not_found"}

Knobs: dedupe, fail_before_commit, stall_seconds (see _base), and
    ticketing_timeout  int  the next N orders commit (ticket issued), then hold the response back `stall_seconds`
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from datetime import date as Date
from typing import Annotated, Any, Literal

from fastapi import Body, FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from wakeful.server.sims._base import Faults, Reply, Sim, SimClock, error, iso, sim_app

__all__ = ["FLIGHTS", "Airline", "AirlineFaults", "create_airline"]


@dataclass(frozen=True)
class Flight:
    number: str
    origin: str
    destination: str
    departs: time
    minutes: int
    price_cents: int


FLIGHTS: dict[str, Flight] = {f.number: f for f in [
    Flight("AB100", "AMS", "LIS", time(7, 10), 185, 12900),
    Flight("AB102", "AMS", "LIS", time(13, 40), 185, 14900),
    Flight("CD310", "AMS", "LIS", time(18, 25), 190, 17900),
    Flight("AB101", "LIS", "AMS", time(9, 30), 170, 12900),
    Flight("AB103", "LIS", "AMS", time(16, 5), 170, 13900),
]}


@dataclass
class AirlineFaults(Faults):
    ticketing_timeout: int = 0


Seat = Literal["window", "aisle", "middle"]


class OrderRequest(BaseModel):
    pnr: str
    flight: str
    seat: Seat | None = None
    """The seat the traveller asked for; None leaves it to the airline (recorded as null)."""


class Airline(Sim):
    def __init__(self, clock: SimClock | None = None) -> None:
        super().__init__("airline", AirlineFaults(), clock)
        self.faults: AirlineFaults
        self.cancelled_flights: set[str] = set()
        self._orders: list[dict[str, Any]] = []
        self._tickets = 0
        self._bookings: dict[str, dict[str, Any]] = {}
        self.add_booking("PNR123", "AB100", (self.clock.now() + timedelta(days=7)).date())

    def add_booking(self, pnr: str, flight: str, day: Date, *, ticketed: bool = True) -> None:
        with self.lock:
            self._bookings[pnr] = {"pnr": pnr, "flight": flight, "date": day.isoformat(),
                                   "from": FLIGHTS[flight].origin, "to": FLIGHTS[flight].destination,
                                   "status": "confirmed", "ticket": self._issue_ticket() if ticketed else None,
                                   "seat": None}

    def _issue_ticket(self) -> dict[str, str]:
        self._tickets += 1
        return {"number": f"074-{self._tickets:010d}"}

    def booking(self, pnr: str) -> dict[str, Any] | None:
        with self.lock:
            booking = self._bookings.get(pnr)
            return {**booking, "ticket": booking["ticket"] and dict(booking["ticket"])} if booking else None

    def flights(self, origin: str, destination: str, day: Date) -> list[dict[str, Any]]:
        with self.lock:
            on_route = [f for f in FLIGHTS.values() if (f.origin, f.destination) == (origin, destination)
                        and f.number not in self.cancelled_flights]
        return [_offer(f, day) for f in sorted(on_route, key=lambda f: f.price_cents)]

    def orders(self, idempotency_key: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(o) for o in self._orders if idempotency_key in (None, o["idempotency_key"])]

    def cancel_flight(self, flight: str, *, notices: int = 1) -> list[str]:
        """The airline cancels `flight`: its confirmed bookings become cancelled and `notices` webhooks are queued
        for each."""
        with self.lock:
            self.cancelled_flights.add(flight)
            pnrs = [b["pnr"] for b in self._bookings.values() if b["flight"] == flight and b["status"] == "confirmed"]
            for pnr in pnrs:
                self._bookings[pnr]["status"] = "cancelled"
                for notice in range(1, notices + 1):
                    self.webhooks.queue({"type": "flight.cancelled", "pnr": pnr, "flight": flight, "notice": notice})
            return pnrs

    def advise(self, pnr: str, text: str) -> bool:
        """A travel advisory for a booking's trip (a typhoon warning): one webhook; False for an unknown booking."""
        with self.lock:
            if pnr not in self._bookings:
                return False
            self.webhooks.queue({"type": "travel.advisory", "pnr": pnr, "text": text})
            return True

    def order(self, pnr: str, flight: str, key: str, seat: str | None = None) -> Reply:
        with self.lock:
            booking = self._bookings.get(pnr)
            if booking is None:
                return Reply(404, {"error": "not_found"})
            if flight not in FLIGHTS:
                return Reply(404, {"error": "unknown_flight"})
            if flight in self.cancelled_flights:
                return Reply(409, {"error": "flight_cancelled"})
            order_id, ticket = f"ord_{len(self._orders) + 1}", self._issue_ticket()
            booking.update(flight=flight, status="confirmed", ticket=ticket, seat=seat,
                           **{"from": FLIGHTS[flight].origin, "to": FLIGHTS[flight].destination})
            body = {"order_id": order_id, "pnr": pnr, "flight": flight, "seat": seat, "ticket": dict(ticket)}
            self._orders.append({**body, "idempotency_key": key, "created_at": iso(self.clock.now())})
            self.record("ticket", pnr, key, order_id=order_id, flight=flight, seat=seat,
                        ticket_number=ticket["number"])
            return Reply(201, body, applied=True)


def _offer(flight: Flight, day: Date) -> dict[str, Any]:
    departs = datetime.combine(day, flight.departs, UTC)
    return {"flight": flight.number, "from": flight.origin, "to": flight.destination, "date": day.isoformat(),
            "departs_at": iso(departs), "arrives_at": iso(departs + timedelta(minutes=flight.minutes)),
            "status": "scheduled", "price_cents": flight.price_cents, "currency": "EUR"}


def create_airline(*, clock: SimClock | None = None) -> tuple[FastAPI, Airline]:
    """An airline app and its sim, seeded with booking PNR123 on AB100 (AMS->LIS), 7 days after sim now, ticketed.
    More bookings: `sim.add_booking(pnr, flight, date, ticketed=...)`."""
    sim = Airline(clock)
    app = sim_app(sim, "airline simulator")

    @app.get("/v1/bookings/{pnr}", response_model=None)
    def get_booking(pnr: str) -> dict[str, Any] | JSONResponse:
        return sim.booking(pnr) or error(404, "not_found")

    @app.get("/v1/flights")
    def flights(origin: Annotated[str, Query(alias="from")], destination: Annotated[str, Query(alias="to")],
                date: Date) -> dict[str, Any]:
        return {"flights": sim.flights(origin, destination, date)}

    @app.post("/v1/orders")
    async def order(body: OrderRequest, request: Request) -> JSONResponse:
        return await sim.effect_request(request, body.model_dump(),
                                        lambda key: sim.order(body.pnr, body.flight, key, body.seat),
                                        stall_knob="ticketing_timeout")

    @app.get("/v1/orders")
    def orders(idempotency_key: str | None = None) -> dict[str, Any]:
        return {"orders": sim.orders(idempotency_key)}

    @app.post("/_sim/cancel_flight")
    def cancel_flight(flight: Annotated[str, Body()], notices: Annotated[int, Body(ge=1, le=10)] = 1) -> dict[str, Any]:
        return {"flight": flight, "pnrs": sim.cancel_flight(flight, notices=notices)}

    @app.post("/_sim/bookings", response_model=None)
    def add_booking(pnr: Annotated[str, Body(max_length=8)], flight: Annotated[str, Body()],
                    date: Annotated[Date, Body()]) -> dict[str, Any] | JSONResponse:
        if flight not in FLIGHTS:
            return error(404, "unknown_flight")
        sim.add_booking(pnr, flight, date)
        return {"pnr": pnr}

    @app.post("/_sim/advisory", response_model=None)
    def advisory(pnr: Annotated[str, Body()],
                 text: Annotated[str, Body(max_length=2000)]) -> dict[str, Any] | JSONResponse:
        return {"pnr": pnr} if sim.advise(pnr, text) else error(404, "not_found")

    return app, sim
