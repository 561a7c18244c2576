"""Shared pieces of the external-service simulators: clock, effect records, idempotency, fault knobs, webhooks, serve.

A simulator is a `Sim` (state, records, knobs) plus a FastAPI app built by `sim_app(sim)`, which mounts these
test-only endpoints next to the simulated service's own `/v1/...` API:

    GET  /_sim/records               {"effects": [{"seq", "kind", "target", "idempotency_key", "at", ...}]}
    GET  /_sim/faults                the knobs, e.g. {"dedupe": true, "fail_before_commit": 0, ...}
    POST /_sim/faults                set some knobs: {"fail_before_commit": 2}; unknown knob or wrong type -> 400
    GET  /_sim/clock                 {"now": iso}
    POST /_sim/clock/advance         {"seconds": n} -> {"now": iso}
    POST /_sim/webhook               {"url", "secret"}: where signed webhooks go
    GET  /_sim/webhooks              {"pending": [...], "delivered": [...]}
    POST /_sim/webhooks/flush        send every pending webhook now -> {"delivered": [{delivery_id, url, status_code,
                                     answer (the receiver's JSON)} | {..., error}], "pending": n};
                                     with {"delay_seconds": d}: send them from a background thread after d s -> 202

The same state is there in-process: `sim.effects`, `sim.faults`, `sim.clock`, `sim.webhooks`.

The effect list is the simulator's own record of what it applied: safety tests assert on it, because counting our
tool calls cannot tell a retry from a duplicate effect.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, get_type_hints

import anyio
import httpx
import uvicorn
from fastapi import APIRouter, Body, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp

__all__ = [
    "Faults",
    "Reply",
    "Sim",
    "SimClock",
    "WebhookOutbox",
    "error",
    "serve",
    "sim_app",
]

IDEMPOTENCY_HEADER = "Idempotency-Key"
SIGNATURE_HEADER = "X-Wakeful-Signature"
TIMESTAMP_HEADER = "X-Wakeful-Timestamp"
DELIVERY_HEADER = "X-Wakeful-Delivery"


def error(status: int, code: str, **extra: Any) -> JSONResponse:
    """The simulators' error shape: `{"error": code, ...}`."""
    return JSONResponse({"error": code, **extra}, status_code=status)


def iso(moment: datetime) -> str:
    return moment.isoformat()


class SimClock:
    """Simulated time: tz-aware UTC, starts at the real now, moves only when told to. Several sims may share one.

    `running=True` makes it tick with real time as well (and still jump when told): the clock an evaluation shares
    between the simulators and the runtime, whose loops need time to pass between the jumps.
    """

    def __init__(self, start: datetime | None = None, *, running: bool = False) -> None:
        start = start or datetime.now(UTC)
        if start.tzinfo is None:
            raise ValueError("SimClock needs a tz-aware start")
        self._now = start.astimezone(UTC)
        self._since = time.monotonic() if running else None
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._read()

    def advance(self, delta: timedelta) -> datetime:
        if delta < timedelta(0):
            raise ValueError("the simulated clock never goes back")
        with self._lock:
            self._now += delta
            return self._read()

    def _read(self) -> datetime:
        if self._since is None:
            return self._now
        return self._now + timedelta(seconds=time.monotonic() - self._since)


@dataclass
class Faults:
    """Knobs every simulator has. Counters (`int`) are consumed one per request they affect."""

    dedupe: bool = True
    """Honour `Idempotency-Key`: a repeat gets the stored response and applies nothing. Off: a repeat applies again."""
    fail_before_commit: int = 0
    """The next N effect requests get 503 and apply nothing."""
    stall_seconds: float = 5.0
    """How long a commit-then-timeout response is held back (ends early if the client disconnects)."""

    def update(self, changes: dict[str, Any]) -> None:
        """Set knobs by name; rejects unknown names and wrong types (a typo must not silently disable a fault)."""
        hints = get_type_hints(type(self))
        for name, value in changes.items():
            if name not in hints:
                raise ValueError(f"unknown knob: {name}")
            if not _fits(hints[name], value):
                raise ValueError(f"knob {name} wants a {hints[name].__name__} (numbers >= 0), got {value!r}")
        for name, value in changes.items():
            setattr(self, name, value)


def _fits(kind: type, value: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    allowed = (int,) if kind is int else (int, float)
    return isinstance(value, allowed) and value >= 0


@dataclass(frozen=True)
class Reply:
    """What an effect handler decided: the response, and whether it applied an effect (only then is it stored)."""

    status: int
    body: dict[str, Any]
    applied: bool = False


@dataclass
class _Stored:
    fingerprint: str
    reply: Reply


def _signed(secret: bytes, body: bytes, delivery_id: str, now: datetime) -> dict[str, str]:
    """The generic scheme's headers for one send, stamped `now` (a signature is good for minutes, so each send signs
    afresh: a redelivery an hour later still verifies)."""
    timestamp = str(int(now.timestamp()))
    payload = f"{timestamp}\n{delivery_id}\n".encode() + body
    return {TIMESTAMP_HEADER: timestamp, DELIVERY_HEADER: delivery_id,
            SIGNATURE_HEADER: "v1=" + hmac.new(secret, payload, hashlib.sha256).hexdigest()}


class WebhookOutbox:
    """Signed outbound webhooks: queued by the sim, sent on `flush()` (deterministic) or `flush_later(delay)`.

    Each webhook gets its delivery id when queued; a failed send stays pending and is retried with the same id on
    the next flush, as real providers redeliver. Each send is signed by wakeful's generic scheme (docs/webhooks.md)
    at the wall-clock time it is sent (a provider's own clock, not the simulated one; `signing_clock` replaces it
    where the receiver shares the simulated clock): `X-Wakeful-Timestamp`, `X-Wakeful-Delivery`, and
    `X-Wakeful-Signature: v1=<hex hmac(secret, "<timestamp>\\n<delivery id>\\n<body>")>`.
    """

    def __init__(self) -> None:
        self.url: str | None = None
        self.secret: bytes | None = None
        self.pending: list[dict[str, Any]] = []
        """Queued webhooks not yet accepted by the receiver: {"delivery_id", "payload"}."""
        self.delivered: list[dict[str, Any]] = []
        """Webhooks the receiver accepted (2xx): {"delivery_id", "payload", "url", "status_code"}."""
        self.transport: httpx.BaseTransport | None = None
        """Where flushes go; None means real HTTP. A test may set an `httpx.MockTransport` to stay in-process."""
        self.signing_clock: SimClock | None = None
        """Whose time stamps the signatures; None is the wall clock."""
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one flush at a time, so a webhook is never sent twice by racing flushes

    def configure(self, url: str, secret: str | bytes) -> None:
        with self._lock:
            self.url = url
            self.secret = secret.encode() if isinstance(secret, str) else secret

    def queue(self, payload: dict[str, Any]) -> str:
        delivery_id = f"dlv_{uuid.uuid4().hex}"
        with self._lock:
            self.pending.append({"delivery_id": delivery_id, "payload": payload})
        return delivery_id

    def flush(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """POST every pending webhook in order; returns one result per attempt: {delivery_id, url, status_code and
        answer (the receiver's JSON, or the start of its text) | error}.
        A webhook the receiver did not accept with a 2xx stays pending (same delivery id next time)."""
        with self._flushing:
            return self._flush(timeout)

    def _flush(self, timeout: float) -> list[dict[str, Any]]:
        with self._lock:
            if self.url is None or self.secret is None:
                raise RuntimeError("no webhook target configured: POST /_sim/webhook {url, secret} first")
            url, secret, batch = self.url, self.secret, list(self.pending)
        results = []
        with httpx.Client(timeout=timeout, trust_env=False, transport=self.transport) as client:
            for item in batch:
                body = json.dumps(item["payload"], separators=(",", ":")).encode()
                now = self.signing_clock.now() if self.signing_clock else datetime.now(UTC)
                headers = {"Content-Type": "application/json", **_signed(secret, body, item["delivery_id"], now)}
                result: dict[str, Any] = {"delivery_id": item["delivery_id"], "url": url}
                try:
                    response = client.post(url, content=body, headers=headers)
                    result["status_code"], result["answer"] = response.status_code, _json_or_text(response)
                except httpx.HTTPError as exc:
                    result["error"] = repr(exc)
                results.append(result)
                if 200 <= result.get("status_code", 0) < 300:
                    with self._lock:
                        self.pending.remove(item)
                        self.delivered.append({**item, **result})
        return results

    def redeliver(self, delivery_id: str) -> None:
        """Queue a delivered webhook again under its own delivery id, as a provider retrying it would."""
        with self._lock:
            item = next(d for d in self.delivered if d["delivery_id"] == delivery_id)
            self.pending.append({"delivery_id": delivery_id, "payload": item["payload"]})

    def flush_later(self, delay_seconds: float) -> threading.Timer:
        """A late webhook: flush from a daemon thread after `delay_seconds` real seconds."""
        timer = threading.Timer(delay_seconds, self.flush)
        timer.daemon = True
        timer.start()
        return timer

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"pending": list(self.pending), "delivered": list(self.delivered)}


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:500]


class Sim:
    """State shared by every simulator: clock, append-only effects, idempotency store, knobs and webhook outbox.

    All state changes happen under `self.lock`; handlers do their check-apply-store without awaiting, so two
    concurrent requests with one key can never both apply.
    """

    def __init__(self, name: str, faults: Faults, clock: SimClock | None = None) -> None:
        self.name = name
        self.faults = faults
        self.clock = clock or SimClock()
        self.webhooks = WebhookOutbox()
        self.lock = threading.RLock()
        self._effects: list[dict[str, Any]] = []
        self._stored: dict[str, _Stored] = {}

    @property
    def effects(self) -> list[dict[str, Any]]:
        """A copy of every effect applied so far, oldest first."""
        with self.lock:
            return [dict(effect) for effect in self._effects]

    def effects_of(self, kind: str, target: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.effects if e["kind"] == kind and (target is None or e["target"] == target)]

    def record(self, kind: str, target: str, idempotency_key: str | None, **details: Any) -> dict[str, Any]:
        with self.lock:
            effect = {"seq": len(self._effects) + 1, "kind": kind, "target": target,
                      "idempotency_key": idempotency_key, "at": iso(self.clock.now()), **details}
            self._effects.append(effect)
            return dict(effect)

    def take(self, knob: str) -> bool:
        """Consume one unit of a counter knob; True if it was armed."""
        with self.lock:
            left = getattr(self.faults, knob)
            if left > 0:
                setattr(self.faults, knob, left - 1)
                return True
            return False

    async def effect_request(self, request: Request, payload: Any, apply: Callable[[str], Reply], *,
                             stall_knob: str | None = None) -> JSONResponse:
        """Run one effect request the way an idempotent API does.

        Order: missing key -> 400; `fail_before_commit` -> 503 (nothing applied); a stored key (with `dedupe`) ->
        the stored response, or 422 `idempotency_key_reused` if the request differs; otherwise `apply(key)`, and
        if it applied an effect its reply is stored. Then, if `stall_knob` is armed, the response is held back
        for `stall_seconds` — the effect is already committed and visible to reconciliation.
        """
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if not key:
            return error(400, "idempotency_key_required")
        if self.take("fail_before_commit"):
            return error(503, "unavailable")
        fingerprint = json.dumps([request.method, request.url.path, payload], sort_keys=True, default=str)
        stall = False
        with self.lock:
            stored = self._stored.get(key) if self.faults.dedupe else None
            if stored is not None:
                if stored.fingerprint != fingerprint:
                    return error(422, "idempotency_key_reused")
                reply = stored.reply
            else:
                reply = apply(key)
                if reply.applied:
                    self._stored[key] = _Stored(fingerprint, reply)
                    stall = stall_knob is not None and self.take(stall_knob)
        if stall:
            await self._stall(request)
        return JSONResponse(reply.body, status_code=reply.status)

    async def _stall(self, request: Request) -> None:
        with anyio.move_on_after(self.faults.stall_seconds):
            while (await request.receive())["type"] != "http.disconnect":
                pass  # a leftover body chunk; the next receive blocks until the client goes away


def sim_app(sim: Sim, title: str) -> FastAPI:
    """A FastAPI app with the `/_sim/...` endpoints for `sim`; the caller adds the service's own routes."""
    app = FastAPI(title=title)
    app.state.sim = sim
    router = APIRouter(prefix="/_sim")

    @router.get("/records")
    def records(kind: str | None = None) -> dict[str, Any]:
        return {"effects": [e for e in sim.effects if kind is None or e["kind"] == kind]}

    @router.get("/faults")
    def get_faults() -> dict[str, Any]:
        with sim.lock:
            return dataclasses.asdict(sim.faults)

    @router.post("/faults", response_model=None)
    def set_faults(changes: Annotated[dict[str, Any], Body()]) -> dict[str, Any] | JSONResponse:
        with sim.lock:
            try:
                sim.faults.update(changes)
            except ValueError as exc:
                return error(400, "bad_knob", detail=str(exc))
            return dataclasses.asdict(sim.faults)

    @router.get("/clock")
    def clock() -> dict[str, str]:
        return {"now": iso(sim.clock.now())}

    @router.post("/clock/advance")
    def advance(seconds: Annotated[float, Body(embed=True, ge=0)]) -> dict[str, str]:
        return {"now": iso(sim.clock.advance(timedelta(seconds=seconds)))}

    @router.post("/webhook")
    def configure_webhook(url: Annotated[str, Body()], secret: Annotated[str, Body()]) -> dict[str, str]:
        sim.webhooks.configure(url, secret)
        return {"url": url}

    @router.get("/webhooks")
    def webhooks() -> dict[str, Any]:
        return sim.webhooks.snapshot()

    @router.post("/webhooks/flush", response_model=None)
    def flush(delay_seconds: Annotated[float | None, Body(embed=True, ge=0)] = None) -> dict[str, Any] | JSONResponse:
        # A sync endpoint: FastAPI runs it in a worker thread, so a slow receiver never blocks the sim's loop.
        if sim.webhooks.url is None:
            return error(409, "webhook_not_configured")
        if delay_seconds is not None:
            sim.webhooks.flush_later(delay_seconds)
            return JSONResponse({"scheduled": len(sim.webhooks.pending)}, status_code=202)
        results = sim.webhooks.flush()
        return {"delivered": results, "pending": len(sim.webhooks.pending)}

    app.include_router(router)
    return app


@contextmanager
def serve(app: ASGIApp, *, ready_timeout: float = 10.0, stop_timeout: float = 10.0,
          tls: str | None = None, port: int = 0) -> Iterator[str]:
    """Run `app` with uvicorn on 127.0.0.1 (`port`, or a free one) in a background thread; yield its base URL.

    Returns once the server answers HTTP; on exit asks it to stop and joins the thread (bounded). In-flight
    requests get `timeout_graceful_shutdown` seconds before uvicorn cancels them. With `tls` (a PEM file holding
    the certificate and its key) it serves HTTPS.
    """
    config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", lifespan="off", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=1, ssl_certfile=tls)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="sim-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + ready_timeout
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the simulator server exited before it started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the simulator server did not start within {ready_timeout} s")
            time.sleep(0.01)  # a poll tick inside a bounded loop
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        while True:
            try:  # any HTTP answer will do; this only checks that it listens
                httpx.get(f"{url}/_sim/ping", timeout=1.0, trust_env=False, verify=False)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the simulator at {url} did not answer within {ready_timeout} s") from None
                time.sleep(0.01)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=stop_timeout)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout=stop_timeout)
        if thread.is_alive():
            raise RuntimeError("the simulator server did not stop")  # a leaked server must fail loudly
