"""The HTTP app: the webhook inbox here, the user's control channel in `server.routes`. Errors map to JSON in
exactly one function, `error_response`: every refusal, unknown path, wrong method, invalid body and unexpected
failure answers `{"error": {"code", "message", ...}}` with a stable code (docs/http-api.md).

    POST /v1/hooks/{source}        a signed webhook delivery (no token: the signature authenticates it)
    POST /v1/wake                  another local process wrote work: the loops look now (carries nothing)
    POST /v1/noop                  does nothing: the baseline the benchmarks compare ingest against
    /mcp                           the MCP server over streamable HTTP (an agent credential, or the user's token)
    GET  /openapi.json             the OpenAPI document of all of it (bearer token; `server.faces.openapi`)
    GET  /healthz, /readyz         alive; ready (database, proxy, libvirt answer; not draining) — no credential
    GET  /metrics                  Prometheus metrics, aggregate numbers only (`server.observe.metrics`)
    GET  /, /signin, /approvals, /tasks, …   the console: pages for people (`server.faces.console`)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from email.utils import formatdate
from functools import partial
from http import HTTPStatus
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import iter_route_contexts
from fastapi.staticfiles import StaticFiles
from sqlalchemy import Column, String
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.server import HANDLED_SIGNALS

from wakeful.server.computers.handoff import NOVNC_DIR
from wakeful.server.core.inbox import Delivery
from wakeful.server.core.signatures import SignatureError, Signed, verify_signature
from wakeful.server.egress.proxyctl import serve_egress
from wakeful.server.errors import BadRequest, MethodNotAllowed, NotFound, Unauthorized, Unavailable, WakefulError
from wakeful.server.faces import bodies
from wakeful.server.faces.auth import BearerGate, current_user, user_of
from wakeful.server.faces.console import console_routers
from wakeful.server.faces.gate import ControlGate
from wakeful.server.faces.liveview import live_router
from wakeful.server.faces.mcpserver import WakefulMCP, transport_security
from wakeful.server.faces.memory_routes import memory_router
from wakeful.server.faces.openapi import MCP, NOVNC, WEBHOOKS, openapi_document
from wakeful.server.faces.routes import router
from wakeful.server.faces.schemas import Done, Health, Ready, refusals
from wakeful.server.observe import logs, metrics
from wakeful.server.observe.health import Drain, readiness
from wakeful.server.runtime import Runtime
from wakeful.server.store.tables import events

__all__ = ["ExactPath", "QuietServer", "WebhookInbox", "create_app", "error_response"]

log = logging.getLogger(__name__)

_SURROGATE = re.compile("[\ud800-\udfff]")
"""Half of a UTF-16 pair, which JSON's `\\ud800` escapes can smuggle into a string: no database stores it."""


class QuietServer(uvicorn.Server):
    """uvicorn wakes ten times a second to refresh its Date header and look for a shutdown request. Here an idle
    server does not wake at all: a shutdown request wakes the loop itself, and the header is refreshed once a second
    only while connections are open, and at once when one opens after a quiet spell. (On these VMs every wake-up
    of an idle process costs a measurable slice of a core.)

    Also: the heap built at start-up (modules, the schema, the app) is frozen out of the garbage collector, whose
    full collections otherwise walked all of it and stalled requests for over 100 ms under load."""

    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None
    _stamped = 0.0

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.server_state.connections = _Connections(self._connection_opened)
        self._draining: asyncio.TimerHandle | None = None
        # uvicorn set its own handlers up in `config`; ours write its lines too (no access lines when it is off)
        logs.route_uvicorn_to_root(access_log=config.access_log)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first SIGTERM starts the drain (`server.observe.health`): `/readyz` answers 503 from now on, and the
        server stops listening `drain_seconds` later (at once when 0). Ctrl-C, or a second signal, stops it now."""
        app = self.config.app
        if isinstance(app, WebhookInbox) and not app.drain.draining:
            app.drain.begin()
            delay = app.runtime.settings.drain_seconds
            if sig == signal.SIGTERM and delay > 0 and self.started and self._loop is not None:
                log.info("SIGTERM: draining for %g s (/readyz answers 503), then stopping", delay)
                self._draining = self._loop.call_later(delay, super().handle_exit, sig, frame)
                return
        if self._draining is not None:
            self._draining.cancel()
        super().handle_exit(sig, frame)

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:  # set by uvicorn's signal handler, or by whoever embeds the server
        self._should_exit = value
        if value and self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def main_loop(self) -> None:
        gc.freeze()
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        if threading.current_thread() is threading.main_thread():
            # uvicorn's handlers are plain `signal.signal` ones, which run only when the main thread next runs Python:
            # a loop asleep with nothing to do would never get to them. The loop's own handlers wake it.
            for sig in HANDLED_SIGNALS:
                self._loop.add_signal_handler(sig, self.handle_exit, sig, None)
        while True:
            self._wake.clear()
            self._stamp()
            if await self.on_tick(1):  # not a multiple of 10: only the exit checks (the header is ours)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0 if self.server_state.connections else None)

    def _connection_opened(self) -> None:
        if time.monotonic() - self._stamped >= 1.0:
            self._stamp()  # before this connection's first response
        if self._wake is not None:
            self._wake.set()  # tick again while it is open

    def _stamp(self) -> None:
        """What uvicorn's own tick does once a second: the default headers with the current Date."""
        date = [(b"date", formatdate(time.time(), usegmt=True).encode())] if self.config.date_header else []
        self.server_state.default_headers = date + self.config.encoded_headers
        self._stamped = time.monotonic()


class _Connections(set[Any]):
    """uvicorn's set of open connections, telling the server when one opens."""

    def __init__(self, on_open: Callable[[], None]) -> None:
        super().__init__()
        self._on_open = on_open

    def add(self, connection: Any) -> None:
        super().add(connection)
        self._on_open()


def _json_type(content_type: str) -> bool:
    """Whether a Content-Type declares a JSON body, as FastAPI reads it (`application/json`, `application/…+json`)."""
    mime = content_type.partition(";")[0].strip().lower()
    return re.fullmatch(r"application/([\w.-]+\+)?json", mime) is not None


def error_response(exc: BaseException, *, content_type: str | None = None) -> JSONResponse:
    """The one place an error becomes an HTTP response: `{"error": {"code", "message", ...}}` with a stable code.

    Our own refusals carry their code and status; a request FastAPI could not validate is `malformed_body` (the
    body: not JSON, or not the schema) or `invalid_parameter` (path or query); an HTTP error raised by the
    framework or a mounted app (unknown path, wrong method, ...) is coded from its status phrase (`not_found`,
    `method_not_allowed`, `gone`, ...) and keeps its headers (`Allow`, `WWW-Authenticate`); anything else is a
    500 `internal_error` that says nothing about the inside. `content_type`: the request's, when known ("" for none):
    a body that did not declare JSON is told to (FastAPI read it as bytes, and would say they are not an object)."""
    headers: Mapping[str, str] | None = None
    if isinstance(exc, WakefulError):
        error, status = exc, exc.http_status
    elif isinstance(exc, RequestValidationError):
        problems = json.loads(json.dumps(exc.errors(), default=str))
        if not all(p.get("loc", ["body"])[0] == "body" for p in problems):
            error = BadRequest("invalid_parameter", "a path or query parameter is not valid", details=problems)
        elif content_type is not None and not _json_type(content_type):
            error = BadRequest("malformed_body", "the body is JSON: send it with `Content-Type: application/json` "
                                                 f"(this request said {(content_type or 'no Content-Type')[:100]})")
        elif any(p.get("type") == "json_invalid" for p in problems):
            error = BadRequest("malformed_body", "the body is not valid JSON", details=problems)
        else:
            error = BadRequest("malformed_body", "the request body does not match the schema", details=problems)
        status = error.http_status
    elif isinstance(exc, HTTPException):
        status, headers = exc.status_code, exc.headers
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        code = re.sub(r"[^a-z0-9]+", "_", phrase.lower()).strip("_")
        if exc.detail != phrase:  # someone said why
            message = str(exc.detail)
        elif status == 404:
            message = "nothing is served at this path (docs/http-api.md lists the routes)"
        elif status == 405:
            message = f"this path does not take that method; it takes {(headers or {}).get('Allow', 'others')}"
        else:
            message = phrase
        error = WakefulError(code, message)
    else:
        error, status = WakefulError("internal_error", "the server failed to answer; the error is in its log"), 500
    return JSONResponse(error.to_json(), status_code=status, headers=headers)


def _allowing(exc: HTTPException, routes: Sequence[BaseRoute], scope: Scope) -> HTTPException:
    """A wrong method's 405 with an `Allow` naming every method the path takes, sorted: Starlette's names only the
    methods of the first route matching the path (`DELETE /v1/tasks` said `POST`; `GET /v1/tasks` is another route)."""
    # FastAPI keeps an included router as one route: `iter_route_contexts` (its OpenAPI's walk) yields each inside it.
    methods = sorted({m for route in iter_route_contexts(routes) if route.matches(scope)[0] is not Match.NONE
                      for m in route.methods or ()})
    if not methods:  # a mounted app's own 405 (the static files'): it said what it takes, if anything
        return exc
    return HTTPException(405, detail=exc.detail, headers={**(exc.headers or {}), "Allow": ", ".join(methods)})


class ExactPath:
    """One exact path answered by `route` in front of `app` (FastAPI, whose routing matched every other route and
    router before reaching it, and whose middleware wrapped it: ~13% of an MCP call's server CPU in a profile of
    `bench/mcp_roundtrip.py`); every other request goes to `app`. What FastAPI's stack gave the route is kept here:
    an unexpected error before the answer started is logged and answered 500 through `error_response`."""

    def __init__(self, app: ASGIApp, *, path: str, route: ASGIApp) -> None:
        self.app = app
        self.path = path
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.route(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            log.exception("%s %s failed", scope["method"], self.path)
            await error_response(exc)(scope, receive, send)


class JsonErrors:
    """Around a mounted app that answers its own HTTP errors (the MCP server's host and origin checks, its router's
    404): an error answered as plain text or in another JSON shape is answered through
    `error_response` instead, keeping its status and its `Allow` / `WWW-Authenticate` headers. JSON-RPC error
    objects pass untouched (they are the MCP protocol's own answers, which clients parse), and so does every
    answer below 400 (streams included)."""

    KEPT_HEADERS = (b"allow", b"www-authenticate")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: list[Message] = []

        async def send_or_hold(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held.append(message)
            elif held and message["type"] == "http.response.body":
                held.append(message)
                if not message.get("more_body", False):
                    await self._answer(held, scope, receive, send)
            else:
                await send(message)

        await self.app(scope, receive, send_or_hold)

    async def _answer(self, held: list[Message], scope: Scope, receive: Receive, send: Send) -> None:
        start, body = held[0], b"".join(m.get("body", b"") for m in held[1:])
        try:
            parsed = json.loads(body) if body else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            parsed = None
        if isinstance(parsed, dict) and "jsonrpc" in parsed:
            for message in held:
                await send(message)
            return
        kept = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])
                if k.lower() in self.KEPT_HEADERS}
        said = parsed.get("error_description") if isinstance(parsed, dict) else body.decode(errors="replace")
        exc = HTTPException(start["status"], detail=said or None, headers=kept or None)
        await error_response(exc)(scope, receive, send)


def _headers(scope: Scope) -> dict[str, str]:
    """A request's headers by name (lower-cased, as ASGI gives them), decoded once: a repeated name keeps its first
    value, as starlette's `Headers.get` finds it."""
    headers: dict[str, str] = {}
    for name, value in scope["headers"]:
        headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return headers


_ANSWER = json.JSONEncoder(separators=(",", ":")).encode
"""Built once: `json.dumps` with any option builds an encoder per call."""


def _locate(locator: str, headers: Mapping[str, str], body: Any, *, column: Column[str], code: str) -> str | None:
    """The value at `locator` (the delivery ID, the correlation key), None where there is none; one that `column`
    cannot hold (too long, a NUL, a lone surrogate) is refused with `code`. `headers`: by lower-cased name."""
    where, _, path = locator.partition(":")
    if where == "header":
        return _storable(headers.get(path.lower()) or None, column, code, locator)
    node = body
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if node is None or isinstance(node, dict | list):
        return None
    return _storable(str(node), column, code, locator)


def _storable(value: str | None, column: Column[str], code: str, locator: str) -> str | None:
    """`value` if `column` can hold it on every database the server runs on, else refused with `code`."""
    limit = column.type.length if isinstance(column.type, String) else None
    if value is None:
        return None
    if (limit is None or len(value) <= limit) and "\x00" not in value and not _SURROGATE.search(value):
        return value
    raise BadRequest(code, f"the value at {locator!r} is not one the inbox can keep: at most {limit} characters of "
                           "Unicode text, without NUL", locator=locator)


def _delivery_id(locator: str | None, signed: Signed, body: Any) -> str | None:
    """The ID duplicates are dropped by: one only the sender could have set (in the signed body, or in a header the
    signature covers), else the digest of what the signature covers. So a delivery replayed with a new unsigned ID
    header (GitHub's `X-GitHub-Delivery`) is the same delivery again, and records nothing new."""
    if locator is not None and locator.startswith("body:"):
        return _locate(locator, {}, body, column=events.c.source_id, code="invalid_delivery_id")
    name = locator.partition(":")[2].lower() if locator is not None else ""
    given = _storable(signed.headers.get(name), events.c.source_id, "invalid_delivery_id", locator or "")
    return given or f"sha256:{signed.digest}"


class WebhookInbox:
    """`POST /v1/hooks/{source}`, answered in front of the whole app (every other request, and the lifespan, pass
    through to it).

    The inbox is the one endpoint whose latency is a contract (providers give up after seconds, and every request
    is acknowledged only once durable), so it takes the short way: outside FastAPI's stack (its error, telemetry and
    body-limit middleware, routing, endpoint machinery), reading the body and writing the answer as ASGI messages;
    that stack and Starlette's request and response objects were most of the event loop's time per delivery at
    saturation. It keeps what the stack gave: refusals go through `error_response`, the body limit is checked here,
    and an unexpected error is logged and answered 500 with a stable code."""

    PREFIX = "/v1/hooks/"

    def __init__(self, app: ASGIApp, *, runtime: Runtime) -> None:
        self.app = app
        self.runtime = runtime
        self.drain = Drain()
        """Set by the first SIGTERM (`QuietServer.handle_exit`); `/readyz` answers 503 from then on."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        source = self._source(scope)
        if source is None:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        result = await self._answer(source, scope, receive, send)
        # A source the deployment did not configure is named by whoever sent it: never a label of its own.
        metrics.delivery(source if source in self.runtime.settings.sources else "unknown", result,
                         time.perf_counter() - started)

    async def _answer(self, source: str, scope: Scope, receive: Receive, send: Send) -> str:
        """Answer one delivery; returns what became of it: recorded, duplicate, or the refusal's code."""
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed("method_not_allowed", "webhook deliveries are POSTed")
            answer = await self.receive(source, _headers(scope), receive)
        except bodies.Disconnected:
            return "disconnected"  # nobody to answer; nothing was recorded
        except WakefulError as exc:
            await self._refuse(exc, scope, receive, send)
            return exc.code
        except Exception:
            log.exception("webhook delivery to source %r failed", source)
            await self._refuse(WakefulError("internal_error", "the delivery could not be recorded; send it again"),
                               scope, receive, send)
            return "internal_error"
        body = _ANSWER(answer).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})
        if "challenge" in answer:
            return "challenge"
        return "duplicate" if answer["duplicate"] else "recorded"

    @staticmethod
    async def _refuse(exc: WakefulError, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(exc)
        if isinstance(exc, MethodNotAllowed):
            response.headers["Allow"] = "POST"
        await response(scope, receive, send)

    def _source(self, scope: Scope) -> str | None:
        """The source named by a webhook path (`/v1/hooks/{source}`); None for any other request."""
        if scope["type"] != "http" or not scope["path"].startswith(self.PREFIX):
            return None
        source: str = scope["path"][len(self.PREFIX):]
        return source if source and "/" not in source else None

    async def receive(self, source: str, headers: Mapping[str, str], receive: Receive) -> dict[str, Any]:
        """Verify, parse and persist one delivery; answers (the JSON to send) once it is durable. `headers`: by
        lower-cased name (`_headers`)."""
        runtime = self.runtime
        settings, clock = runtime.settings, runtime.clock
        bodies.refuse_declared(headers.get("content-length"), settings.max_body_bytes)
        config = settings.sources.get(source)
        if config is None:
            raise NotFound("unknown_source", f"no webhook source named {source!r} is configured", source=source)
        body = await bodies.read(receive, settings.max_body_bytes)
        try:
            signed = verify_signature(config.kind, secret=config.secret.get_secret_value().encode(), body=body,
                                      headers=headers, now=clock.now().timestamp(),
                                      tolerance_seconds=config.tolerance_seconds)
        except SignatureError as exc:
            raise Unauthorized(exc.code, str(exc), source=source) from None
        payload = bodies.loads(body)  # depth, number length and duplicate keys bounded before anything recurses
        if not isinstance(payload, dict):
            raise BadRequest("malformed_body", "the body must be a JSON object")
        if config.kind == "slack" and payload.get("type") == "url_verification":
            return {"challenge": payload.get("challenge")}
        delivery_id = _delivery_id(config.delivery_locator(), signed, payload)
        if delivery_id is None:
            raise BadRequest("missing_delivery_id", f"no delivery ID at {config.delivery_locator()!r}")
        delivery = Delivery(
            user_id=runtime.source_users[source], source=source, source_id=delivery_id, payload=payload,
            trust=config.trust, corr_key=_locate(config.session_locator(), headers, payload, column=events.c.corr_key,
                                                 code="invalid_session_key"),
        )
        recorded = await runtime.committer.persist(delivery)
        return {"event_id": recorded.event_id, "duplicate": recorded.duplicate, "status": recorded.status.value}


def create_app(runtime: Runtime, *, manage_runtime: bool = True, proxy_child: bool = True,
               await_proxy: bool = False) -> ASGIApp:
    """The HTTP app: FastAPI behind the webhook inbox, which answers its own path first. `proxy_child=False`: the
    decider answers the egress proxy, which someone else runs (`wakeful serve` beside `wakeful api`); with
    `await_proxy`, the app starts once that proxy listens."""
    settings, clock = runtime.settings, runtime.clock

    mcp = WakefulMCP(engine=runtime.engine, clock=clock, settings=settings, tools=runtime.tools, local_user=None,
                     on_write=runtime.signals.wake_all)
    # No SDK auth: its resource metadata would send clients to an OAuth server wakeful does not run. `BearerGate`
    # checks the token once per request, and the handlers read the user it found (`server.faces.auth`). A call is
    # answered as one JSON body, not an SSE stream: no handler sends what only a request's stream could carry (a
    # progress or log notification, a request of its own), and the stream's machinery was ~25% of a call's CPU.
    mcp_app = mcp.server.streamable_http_app(streamable_http_path="/mcp", json_response=True,
                                             transport_security=transport_security(settings))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if manage_runtime and settings.proxy:
                # The proxy is up before the first connector call can be made.
                _app.state.decider = await stack.enter_async_context(serve_egress(
                    runtime.engine, clock, settings, proxy_child=proxy_child, await_proxy=await_proxy))
            if manage_runtime:
                runtime.start()
            try:
                async with mcp.server.session_manager.run():
                    yield
            finally:
                if manage_runtime:
                    await asyncio.to_thread(runtime.stop)

    # FastAPI's own OpenAPI route is off: ours asks for a token, and its document is corrected to what the server
    # answers (`server.faces.openapi`).
    app = FastAPI(title="wakeful", description="The HTTP API of a wakeful server (docs/http-api.md says more).",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = runtime
    described: list[APIRouter] = [WEBHOOKS, MCP]  # routes answered outside FastAPI's routing
    if runtime.live is not None:
        app.include_router(live_router(runtime.live))
        if NOVNC_DIR.is_dir():
            app.mount("/novnc", StaticFiles(directory=NOVNC_DIR), name="novnc")
            described.append(NOVNC)

    async def _error(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            exc = _allowing(exc, app.router.routes, request.scope)
        return error_response(exc, content_type=request.headers.get("content-type", ""))

    for caught in (WakefulError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(caught, _error)


    @app.get("/healthz", response_model=Health)
    async def healthz() -> dict[str, str]:
        """Alive: the process answers (while it drains too). No credential; it says nothing else."""
        return {"status": "ok"}

    @app.get("/readyz", response_model=Ready, responses=refusals("not_ready"))
    async def readyz() -> dict[str, Any]:
        """Ready for traffic: the database, the egress proxy (`proxy`), libvirt (`computers`) answer, and the process
        is not draining after a SIGTERM. No credential; it names no user."""
        decider = getattr(app.state, "decider", None)  # the proxy answers, but is it let in?
        checks = await readiness(settings, runtime.engine, inbox.drain,
                                 proxy_refused=lambda: decider is not None and decider.hello_refused)
        said = {check.name: check.problem or "ok" for check in checks}
        failed = [f"{check.name}: {check.problem}" for check in checks if check.problem is not None]
        if failed:
            raise Unavailable("not_ready", "not ready: " + "; ".join(failed), checks=said)
        return {"status": "ready", "checks": said}

    @app.get("/metrics", response_class=Response, responses=refusals("not_found") | {
        200: {"description": "Prometheus text exposition", "content": {metrics.CONTENT_TYPE.split(";")[0]: {}}}})
    async def prometheus() -> Response:
        """Prometheus metrics: counts, latencies and depths, never a user's ID or name (`server.observe.metrics`).
        No credential: read it from the listen address, and keep it from the outside at the reverse proxy."""
        if not settings.metrics:
            raise NotFound("not_found", "metrics are off on this server (metrics = false)")
        body = await asyncio.to_thread(metrics.exposition, runtime.engine)
        return Response(body, media_type=metrics.CONTENT_TYPE)

    @app.get("/openapi.json", dependencies=[Depends(current_user)])
    def openapi() -> dict[str, Any]:
        """This document: every route, what it takes and every answer it gives. Only to a user: a closed default,
        though it says nothing the repository's docs do not."""
        return openapi_document(app, described)

    @app.post("/v1/wake", status_code=204)
    async def wake() -> Response:
        """Another process on this machine (the CLI) wrote work: look now instead of at the next
        idle poll. It only shortens a wait; it carries nothing and changes nothing."""
        runtime.signals.wake_all()
        return Response(status_code=204)

    @app.post("/v1/noop", response_model=Done)
    async def noop() -> dict[str, bool]:
        return {"ok": True}

    app.include_router(router)
    app.include_router(memory_router)
    for console in console_routers():  # the console's pages at `/` (`server.faces.console`)
        app.include_router(console)
    # The MCP app answers only its own path (`/mcp`, streamable HTTP with a bearer token): mounted under everything,
    # it would answer every unknown path, and every wrong method on a known one, with its own plain-text 404.
    mcp_errors_as_ours = BearerGate(JsonErrors(mcp_app), engine=runtime.engine, respond=error_response)
    for route in mcp_app.routes:
        assert isinstance(route, Route), route
        app.router.add_route(route.path, mcp_errors_as_ours, methods=route.methods)  # type: ignore[arg-type]
    gate = ControlGate(app, authenticate=partial(user_of, runtime.engine), respond=error_response)
    inbox = WebhookInbox(ExactPath(gate, path="/mcp", route=mcp_errors_as_ours), runtime=runtime)
    return inbox
