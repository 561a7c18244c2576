"""A subscription merchant: list subscriptions, cancel a renewal (idempotent), look cancellations up by key.

    app, sim = create_merchant()
    client.post("/v1/subscriptions/sub_1/cancel_renewal", headers={"Idempotency-Key": "k1"}, json={"reason": "..."})
    assert len(sim.effects_of("cancel_renewal", "sub_1")) == 1

Service API:
    GET  /v1/subscriptions                    {"subscriptions": [subscription]}
    GET  /v1/subscriptions/{id}               subscription | 404 {"error": "not_found"}
         subscription = {id, plan, status: "active", renewal: "on"|"off"|"processing", price_cents, currency,
                         period_end}
    POST /v1/subscriptions/{id}/cancel_renewal   Idempotency-Key required; optional body {"reason"}
         200 {id, renewal: "off", cancellation_id, effective_at}            effect {"kind": "cancel_renewal"}
         202 {status: "processing", id, renewal: "processing", cancellation_id, effective_at}  (processing_seconds)
         409 {"error": "already_cancelled", "renewal"}   renewal already off/processing and the key is new
    GET  /v1/cancellations?idempotency_key=K&subscription=S   {"cancellations": [{cancellation_id, subscription,
         idempotency_key, reason, status: "processing"|"completed", created_at, effective_at}]}

Knobs (`sim.faults`, `/_sim/faults`): dedupe, fail_before_commit, stall_seconds (see _base), and
    commit_then_timeout  int   the next N cancellations commit, then hold the response back `stall_seconds`
    processing_seconds   float >0: cancellations answer 202 and stay "processing" for that many sim-seconds
    late_webhook         bool  each cancellation queues a signed `subscription.renewal_cancelled` webhook
    lookups_redirect     bool  `GET /v1/cancellations` answers 302 to `/login` (a lookup the provider sends to sign-in)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse
from pydantic import BaseModel

from wakeful.server.sims._base import Faults, Reply, Sim, SimClock, error, iso, sim_app

__all__ = ["Merchant", "MerchantFaults", "create_merchant"]


@dataclass
class MerchantFaults(Faults):
    commit_then_timeout: int = 0
    processing_seconds: float = 0.0
    late_webhook: bool = False
    lookups_redirect: bool = False


class CancelRequest(BaseModel):
    reason: str | None = None


class Merchant(Sim):
    def __init__(self, subscriptions: Sequence[Mapping[str, Any]] | None, clock: SimClock | None = None) -> None:
        super().__init__("merchant", MerchantFaults(), clock)
        self.faults: MerchantFaults
        self._subscriptions: dict[str, dict[str, Any]] = {}
        self._cancellations: list[dict[str, Any]] = []
        for seed in subscriptions if subscriptions is not None else [{"id": "sub_1"}]:
            period_end = seed.get("period_end") or self.clock.now() + timedelta(days=30)
            self._subscriptions[seed["id"]] = {
                "id": seed["id"], "plan": seed.get("plan", "Pro"), "status": "active",
                "renewal": seed.get("renewal", "on"), "price_cents": seed.get("price_cents", 1999),
                "currency": seed.get("currency", "EUR"),
                "period_end": period_end if isinstance(period_end, datetime) else datetime.fromisoformat(period_end),
                "processing_until": None,
            }

    def _settle(self) -> None:
        """Finish the cancellations whose processing time has passed on the sim clock."""
        now = self.clock.now()
        for sub in self._subscriptions.values():
            if sub["renewal"] == "processing" and sub["processing_until"] <= now:
                sub["renewal"], sub["processing_until"] = "off", None
        for cancellation in self._cancellations:
            if self._subscriptions[cancellation["subscription"]]["renewal"] == "off":
                cancellation["status"] = "completed"

    def subscriptions(self) -> list[dict[str, Any]]:
        with self.lock:
            self._settle()
            return [_public(sub) for sub in self._subscriptions.values()]

    def subscription(self, sub_id: str) -> dict[str, Any] | None:
        with self.lock:
            self._settle()
            sub = self._subscriptions.get(sub_id)
            return _public(sub) if sub else None

    def cancellations(self, idempotency_key: str | None = None,
                      subscription: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            self._settle()
            return [dict(c) for c in self._cancellations
                    if idempotency_key in (None, c["idempotency_key"]) and subscription in (None, c["subscription"])]

    def cancel_renewal(self, sub_id: str, key: str, reason: str | None) -> Reply:
        with self.lock:
            self._settle()
            sub = self._subscriptions.get(sub_id)
            if sub is None:
                return Reply(404, {"error": "not_found"})
            seen_key = any(c["idempotency_key"] == key for c in self._cancellations)
            if sub["renewal"] != "on" and not seen_key:
                return Reply(409, {"error": "already_cancelled", "renewal": sub["renewal"]})
            now, processing = self.clock.now(), self.faults.processing_seconds
            cancellation_id = f"can_{len(self._cancellations) + 1}"
            effective_at = iso(sub["period_end"])
            if processing > 0:
                sub["renewal"], sub["processing_until"] = "processing", now + timedelta(seconds=processing)
            else:
                sub["renewal"] = "off"
            self._cancellations.append({
                "cancellation_id": cancellation_id, "subscription": sub_id, "idempotency_key": key, "reason": reason,
                "status": "processing" if processing > 0 else "completed", "created_at": iso(now),
                "effective_at": effective_at,
            })
            self.record("cancel_renewal", sub_id, key, cancellation_id=cancellation_id, reason=reason)
            if self.faults.late_webhook:
                self.webhooks.queue({"type": "subscription.renewal_cancelled", "subscription": sub_id,
                                     "cancellation_id": cancellation_id})
            body = {"id": sub_id, "renewal": sub["renewal"], "cancellation_id": cancellation_id,
                    "effective_at": effective_at}
            if processing > 0:
                return Reply(202, {"status": "processing", **body}, applied=True)
            return Reply(200, body, applied=True)


def _public(sub: dict[str, Any]) -> dict[str, Any]:
    view = {k: v for k, v in sub.items() if k != "processing_until"}
    view["period_end"] = iso(sub["period_end"])
    return view


def create_merchant(subscriptions: Sequence[Mapping[str, Any]] | None = None, *,
                    clock: SimClock | None = None) -> tuple[FastAPI, Merchant]:
    """A merchant app and its sim. Each seed needs an "id"; plan, price_cents, currency, renewal and period_end
    (datetime or ISO string) default to "Pro", 1999, "EUR", "on" and 30 days after sim now. None seeds `sub_1`."""
    sim = Merchant(subscriptions, clock)
    app = sim_app(sim, "merchant simulator")

    @app.get("/v1/subscriptions")
    def list_subscriptions() -> dict[str, Any]:
        return {"subscriptions": sim.subscriptions()}

    @app.get("/v1/subscriptions/{sub_id}", response_model=None)
    def get_subscription(sub_id: str) -> dict[str, Any] | JSONResponse:
        return sim.subscription(sub_id) or error(404, "not_found")

    @app.post("/v1/subscriptions/{sub_id}/cancel_renewal")
    async def cancel_renewal(sub_id: str, request: Request, body: CancelRequest | None = None) -> JSONResponse:
        reason = body.reason if body else None
        return await sim.effect_request(request, {"reason": reason},
                                        lambda key: sim.cancel_renewal(sub_id, key, reason),
                                        stall_knob="commit_then_timeout")

    @app.get("/v1/cancellations", response_model=None)
    def cancellations(idempotency_key: str | None = None,
                      subscription: str | None = None) -> dict[str, Any] | RedirectResponse:
        if sim.faults.lookups_redirect:
            return RedirectResponse("/login", status_code=302)
        return {"cancellations": sim.cancellations(idempotency_key, subscription)}

    return app, sim
