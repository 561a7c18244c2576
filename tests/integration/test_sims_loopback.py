"""The merchant simulator on a real loopback port, called over TCP, with its webhooks sent to a real receiver.

The assertions read the simulator's own records (`GET /_sim/records`): a client timeout says nothing about whether
the merchant applied the cancellation; the merchant's records do.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.support.polling import wait_until
from wakeful.server.core.signatures import SignatureError, verify_signature
from wakeful.server.sims import Merchant, create_merchant, serve

SECRET = "whsec_loopback"
CANCEL = "/v1/subscriptions/sub_1/cancel_renewal"


def verifies(body: bytes, headers: dict[str, str]) -> bool:
    """Whether wakeful's inbox would take this delivery's signature (the generic scheme, stamped now)."""
    try:
        verify_signature("generic", secret=SECRET.encode(), body=body, headers=headers, now=time.time())
    except SignatureError:
        return False
    return True


class Receiver:
    """A tiny webhook receiver (stdlib http.server on 127.0.0.1:0) that keeps each delivery and whether it verified."""

    def __init__(self) -> None:
        self.deliveries: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="receiver", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hooks"

    def received(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.deliveries)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # the name http.server dispatches to
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                verified = verifies(body, dict(self.headers))
                with receiver._lock:
                    receiver.deliveries.append({"verified": verified, "payload": json.loads(body),
                                                "delivery_id": self.headers.get("X-Wakeful-Delivery")})
                self.send_response(204 if verified else 401)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
                pass

        return Handler

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def merchant() -> Iterator[tuple[httpx.Client, Merchant]]:
    app, sim = create_merchant()
    with serve(app) as url, httpx.Client(base_url=url, timeout=5.0, trust_env=False) as client:
        yield client, sim


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as receiver:
        yield receiver


def records(client: httpx.Client) -> list[dict[str, Any]]:
    effects: list[dict[str, Any]] = client.get("/_sim/records").json()["effects"]
    return effects


def test_serve_answers_on_a_loopback_port_and_stops_on_exit() -> None:
    app, _ = create_merchant()
    with serve(app) as url:
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        assert httpx.get(f"{url}/v1/subscriptions/sub_1", trust_env=False).json()["renewal"] == "on"

    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/subscriptions/sub_1", timeout=1.0, trust_env=False)


def test_a_cancellation_over_tcp_is_recorded_once_and_found_by_its_key(merchant: tuple[httpx.Client, Merchant]) -> None:
    client, sim = merchant

    for _ in range(2):
        response = client.post(CANCEL, headers={"Idempotency-Key": "k1"}, json={"reason": "moving"})
        assert response.status_code == 200 and response.json()["renewal"] == "off"

    assert [(e["kind"], e["target"], e["idempotency_key"]) for e in records(client)] == [("cancel_renewal", "sub_1",
                                                                                           "k1")]
    assert records(client) == sim.effects
    [found] = client.get("/v1/cancellations", params={"idempotency_key": "k1"}).json()["cancellations"]
    assert found["cancellation_id"] == response.json()["cancellation_id"]


def test_a_client_timeout_after_commit_leaves_exactly_one_effect_that_reconciliation_finds(
        merchant: tuple[httpx.Client, Merchant]) -> None:
    client, _ = merchant
    client.post("/_sim/faults", json={"commit_then_timeout": 1, "stall_seconds": 5})

    with pytest.raises(httpx.ReadTimeout):
        client.post(CANCEL, headers={"Idempotency-Key": "k1"}, json={"reason": "moving"}, timeout=0.3)

    [effect] = records(client)
    assert (effect["kind"], effect["idempotency_key"]) == ("cancel_renewal", "k1")
    [found] = client.get("/v1/cancellations", params={"idempotency_key": "k1"}).json()["cancellations"]
    assert found["cancellation_id"] == effect["cancellation_id"]
    assert client.get("/v1/subscriptions/sub_1").json()["renewal"] == "off"
    retry = client.post(CANCEL, headers={"Idempotency-Key": "k1"}, json={"reason": "moving"})
    assert (retry.status_code, retry.json()["cancellation_id"]) == (200, effect["cancellation_id"])
    assert len(records(client)) == 1


def test_a_late_webhook_is_delivered_signed_to_a_real_receiver_when_flushed(
        merchant: tuple[httpx.Client, Merchant], receiver: Receiver) -> None:
    client, _ = merchant
    client.post("/_sim/webhook", json={"url": receiver.url, "secret": SECRET})
    client.post("/_sim/faults", json={"late_webhook": True})
    cancel = client.post(CANCEL, headers={"Idempotency-Key": "k1"}).json()
    assert len(client.get("/_sim/webhooks").json()["pending"]) == 1
    assert receiver.received() == []

    [result] = client.post("/_sim/webhooks/flush").json()["delivered"]

    [delivery] = receiver.received()
    assert delivery["verified"] and result["status_code"] == 204
    assert delivery["delivery_id"] == result["delivery_id"]
    assert delivery["payload"] == {"type": "subscription.renewal_cancelled", "subscription": "sub_1",
                                   "cancellation_id": cancel["cancellation_id"]}
    assert client.get("/_sim/webhooks").json()["pending"] == []


def test_a_webhook_flushed_with_a_delay_arrives_later_from_a_background_thread(
        merchant: tuple[httpx.Client, Merchant], receiver: Receiver) -> None:
    client, sim = merchant
    sim.webhooks.configure(receiver.url, SECRET)
    sim.faults.late_webhook = True
    client.post(CANCEL, headers={"Idempotency-Key": "k1"})

    response = client.post("/_sim/webhooks/flush", json={"delay_seconds": 0.2})

    assert (response.status_code, response.json()) == (202, {"scheduled": 1})
    [delivery] = wait_until(receiver.received, 5.0, "the delayed webhook to arrive")
    assert delivery["verified"] and delivery["payload"]["type"] == "subscription.renewal_cancelled"
