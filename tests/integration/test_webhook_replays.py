"""Replayed and stale webhook deliveries, against a real server on loopback with a real SQLite file and the fake clock.

The generic scheme signs a timestamp and the delivery ID with the body, so a delivery replayed under a new ID no
longer verifies and an old one is refused; GitHub signs only the body, so a GitHub delivery is the same delivery
however its unsigned `X-GitHub-Delivery` header is changed. Signatures are computed here with hmac, by the recipe in
docs/webhooks.md, never by the module under test.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.support.polling import wait_until
from tests.support.records import event_rows
from wakeful.proxy.clock import FakeClock
from wakeful.server.core.signatures import sign
from wakeful.server.faces.http import QuietServer, create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.sims import create_airline

SECRET = "replay-secret"
BODY = b'{"session_key": "thread-1", "text": "hello"}'
GITHUB_BODY = json.dumps({"action": "opened", "issue": {"number": 7}}).encode()


def app_settings(data_dir: Path) -> Settings:
    sources = {kind: {"kind": kind, "secret": SECRET} for kind in ("generic", "github", "stripe", "slack")}
    sources["strict"] = {"kind": "generic", "secret": SECRET, "tolerance_seconds": 30}
    return Settings(data_dir=data_dir, proxy=False, poll_interval=0.05, sweep_interval=3600, sources=sources)


@dataclass
class Server:
    url: str
    runtime: Runtime

    def post(self, source: str, body: bytes, headers: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/hooks/{source}", content=body, timeout=10,
                          headers={"content-type": "application/json", **headers})

    def source_ids(self) -> list[str]:
        return [e.source_id for e in event_rows(self.runtime.engine)]


@contextmanager
def serving(settings: Settings, clock: FakeClock) -> Iterator[Server]:
    runtime = Runtime(settings, handler=EchoHandler(), clock=clock)
    runtime.prepare()
    uv = QuietServer(uvicorn.Config(create_app(runtime), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: uv.started, 30, "the server to start")
        yield Server(f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}", runtime)
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        runtime.engine.dispose()


@pytest.fixture
def server(tmp_path: Path, clock: FakeClock) -> Iterator[Server]:
    with serving(app_settings(tmp_path), clock) as server:
        yield server


def hexmac(payload: bytes) -> str:
    return hmac.new(SECRET.encode(), payload, hashlib.sha256).hexdigest()


def generic(body: bytes, delivery: str, timestamp: str) -> dict[str, str]:
    """The documented recipe: `v1=` + hex HMAC-SHA256 of `<timestamp>\\n<delivery ID>\\n<body>`."""
    signature = hexmac(f"{timestamp}\n{delivery}\n".encode() + body)
    return {"X-Wakeful-Timestamp": timestamp, "X-Wakeful-Delivery": delivery, "X-Wakeful-Signature": f"v1={signature}"}


def now(clock: FakeClock, skew: int = 0) -> str:
    return str(int(clock.now().timestamp()) + skew)


def code(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


# --- replays under a new delivery ID -------------------------------------------------------------------------------


def test_a_generic_delivery_replayed_under_a_new_delivery_id_is_refused_and_records_nothing(
        server: Server, clock: FakeClock) -> None:
    headers = generic(BODY, "d-1", now(clock))
    first = server.post("generic", BODY, headers)
    assert first.status_code == 200, first.text
    for replayed in ("d-2", "D-1", "d-1.2"):
        assert code(server.post("generic", BODY, headers | {"X-Wakeful-Delivery": replayed})) == (
            401, "signature_mismatch"), replayed
    again = server.post("generic", BODY, headers)  # the same signed delivery again, inside the tolerance
    assert again.json() == {**first.json(), "duplicate": True, "status": again.json()["status"]}
    assert server.source_ids() == ["d-1"]


def test_a_github_delivery_replayed_under_a_new_delivery_header_is_the_same_event(server: Server) -> None:
    signature = {"X-Hub-Signature-256": "sha256=" + hexmac(GITHUB_BODY)}
    answers = [server.post("github", GITHUB_BODY, signature | {"X-GitHub-Delivery": d}).json()
               for d in ("g-1", "g-2", "g-3")]
    answers.append(server.post("github", GITHUB_BODY, signature).json())  # and with no delivery header at all
    assert [a.get("duplicate") for a in answers] == [False, True, True, True], answers
    assert len({a["event_id"] for a in answers}) == 1
    assert len(server.source_ids()) == 1


def test_a_github_replay_is_still_the_same_event_after_a_restart(tmp_path: Path, clock: FakeClock) -> None:
    signature = {"X-Hub-Signature-256": "sha256=" + hexmac(GITHUB_BODY)}
    with serving(app_settings(tmp_path), clock) as first:
        original = first.post("github", GITHUB_BODY, signature | {"X-GitHub-Delivery": "g-1"}).json()
    clock.advance(timedelta(days=30))
    with serving(app_settings(tmp_path), clock) as second:
        replay = second.post("github", GITHUB_BODY, signature | {"X-GitHub-Delivery": "g-2"}).json()
        assert replay == {**original, "duplicate": True, "status": replay["status"]}
        assert len(second.source_ids()) == 1


def test_a_github_delivery_with_another_body_is_another_event(server: Server) -> None:
    other = json.dumps({"action": "closed", "issue": {"number": 7}}).encode()
    for body in (GITHUB_BODY, other):
        answer = server.post("github", body, {"X-Hub-Signature-256": "sha256=" + hexmac(body),
                                              "X-GitHub-Delivery": "g-1"})
        assert answer.json()["duplicate"] is False
    assert len(set(server.source_ids())) == 2


# --- the timestamp and its tolerance -------------------------------------------------------------------------------


def timestamped(source: str, clock: FakeClock, skew: int) -> tuple[bytes, dict[str, str]]:
    if source in ("generic", "strict"):
        return BODY, generic(BODY, "d-1", now(clock, skew))
    body = json.dumps({"id": "evt_1", "event_id": "evt_1", "type": "event"}).encode()
    return body, sign(source, secret=SECRET.encode(), body=body, now=clock.now().timestamp() + skew)  # type: ignore[arg-type]


@pytest.mark.parametrize("source", ["generic", "stripe", "slack"])
@pytest.mark.parametrize("skew", [-301, 301], ids=["older", "ahead"])
def test_a_timestamp_beyond_the_five_minute_tolerance_is_refused_as_expired(
        server: Server, clock: FakeClock, source: str, skew: int) -> None:
    body, headers = timestamped(source, clock, skew)
    assert code(server.post(source, body, headers)) == (401, "signature_expired")
    assert server.source_ids() == []


@pytest.mark.parametrize("source", ["generic", "stripe", "slack"])
@pytest.mark.parametrize("skew", [-300, 300], ids=["older", "ahead"])
def test_a_timestamp_at_the_edge_of_the_tolerance_is_accepted(
        server: Server, clock: FakeClock, source: str, skew: int) -> None:
    body, headers = timestamped(source, clock, skew)
    assert server.post(source, body, headers).status_code == 200


def test_a_generic_delivery_replayed_after_the_tolerance_is_refused(server: Server, clock: FakeClock) -> None:
    headers = generic(BODY, "d-1", now(clock))
    assert server.post("generic", BODY, headers).status_code == 200
    clock.advance(timedelta(minutes=5, seconds=1))
    assert code(server.post("generic", BODY, headers)) == (401, "signature_expired")


def test_a_sources_own_tolerance_is_honoured(server: Server, clock: FakeClock) -> None:
    assert server.post("strict", BODY, generic(BODY, "d-1", now(clock, -30))).status_code == 200
    assert code(server.post("strict", BODY, generic(BODY, "d-2", now(clock, -31)))) == (401, "signature_expired")
    assert server.source_ids() == ["d-1"]


def test_a_generic_delivery_without_a_timestamp_is_refused_with_a_stable_code(server: Server, clock: FakeClock) -> None:
    headers = generic(BODY, "d-1", now(clock))
    del headers["X-Wakeful-Timestamp"]
    response = server.post("generic", BODY, headers)
    assert code(response) == (401, "signature_missing")
    assert "X-Wakeful-Timestamp" in response.json()["error"]["message"]
    assert server.source_ids() == []


def test_a_body_only_signature_of_the_retired_scheme_is_refused(server: Server, clock: FakeClock) -> None:
    headers = {"X-Wakeful-Timestamp": now(clock), "X-Wakeful-Delivery": "d-1",
               "X-Wakeful-Signature": "sha256=" + hexmac(BODY)}
    assert code(server.post("generic", BODY, headers)) == (401, "signature_malformed")
    assert server.source_ids() == []


# --- hostile values: a 4xx with a stable code, never a 500 ---------------------------------------------------------


@pytest.mark.parametrize(("timestamp", "expected"), [
    ("9" * 15, "signature_expired"),  # a number, signed, but in the year 31 million
    ("9" * 40, "signature_malformed"),
    ("-1", "signature_malformed"),
    ("0", "signature_expired"),
    ("soon", "signature_malformed"),
    ("1e9", "signature_malformed"),
    ("1700000000.5", "signature_malformed"),
    ("0x65", "signature_malformed"),
    ("\u0661\u0667\u0660\u0660", "signature_malformed"),  # Arabic-Indic digits: int() would take them
], ids=["huge", "too long", "negative", "zero", "a word", "exponent", "fraction", "hex", "non-ascii digits"])
def test_an_absurd_timestamp_is_a_401_with_a_stable_code(server: Server, clock: FakeClock, timestamp: str,
                                                         expected: str) -> None:
    signature = "v1=" + hexmac(f"{timestamp}\nd-1\n".encode() + BODY)
    headers = {"X-Wakeful-Timestamp": timestamp.encode(), "X-Wakeful-Delivery": "d-1", "X-Wakeful-Signature": signature}
    assert code(server.post("generic", BODY, headers)) == (401, expected)
    assert server.source_ids() == []


@pytest.mark.parametrize("delivery", ["x" * 201, "thread 1", "caf\u00e9"],
                         ids=["201 characters", "a space", "non-ascii"])
def test_an_absurd_delivery_id_is_a_401_with_a_stable_code(server: Server, clock: FakeClock, delivery: str) -> None:
    timestamp = now(clock)
    signature = "v1=" + hexmac(f"{timestamp}\n".encode() + delivery.encode("latin-1") + b"\n" + BODY)
    headers = {"X-Wakeful-Timestamp": timestamp, "X-Wakeful-Delivery": delivery.encode("latin-1"),
               "X-Wakeful-Signature": signature}
    assert code(server.post("generic", BODY, headers)) == (401, "signature_malformed")
    assert server.source_ids() == []


# --- the simulators sign the way the inbox checks ------------------------------------------------------------------


def test_a_simulators_webhook_is_recorded_under_its_delivery_id(tmp_path: Path) -> None:
    # The simulator signs with its own wall clock, as a provider would: the server's clock is set to it.
    with serving(app_settings(tmp_path), FakeClock(datetime.now(UTC))) as server:
        _, airline = create_airline()
        airline.webhooks.configure(f"{server.url}/v1/hooks/generic", SECRET)
        airline.cancel_flight("AB100")
        [result] = airline.webhooks.flush()
        assert result["status_code"] == 200, result
        assert server.source_ids() == [result["delivery_id"]]
