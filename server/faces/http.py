"""The HTTP app: the webhook inbox here, the user's control channel in `server.routes`. Errors map to JSON in
exactly one function.

    POST /v1/hooks/{source}        a signed webhook delivery (no token: the signature authenticates it)
    POST /v1/wake                  another local process wrote work: the loops look now (carries nothing)
    POST /v1/noop                  does nothing: the baseline the benchmarks compare ingest against
    /mcp                           the MCP server over streamable HTTP (bearer token)
    GET  /healthz
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from email.utils import formatdate
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from mcp.server.auth.settings import AuthSettings
from pydantic import AnyHttpUrl
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.server import HANDLED_SIGNALS

from wakeful.server.computers.handoff import NOVNC_DIR
from wakeful.server.core.inbox import Delivery
from wakeful.server.core.signatures import SignatureError, verify_signature
from wakeful.server.egress.proxyctl import serve_egress
from wakeful.server.errors import BadRequest, MethodNotAllowed, NotFound, PayloadTooLarge, Unauthorized, WakefulError
from wakeful.server.faces.liveview import live_router
from wakeful.server.faces.mcpserver import TokenVerifier, WakefulMCP
from wakeful.server.faces.routes import router
from wakeful.server.runtime import Runtime

__all__ = ["QuietServer", "WebhookInbox", "create_app", "error_response"]

log = logging.getLogger(__name__)


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


def error_response(exc: WakefulError) -> JSONResponse:
    """The one place a refusal becomes an HTTP response: status from the error class, body with a stable code."""
    return JSONResponse(exc.to_json(), status_code=exc.http_status)


def _locate(locator: str, headers: Mapping[str, str], body: Any) -> str | None:
    where, _, path = locator.partition(":")
    if where == "header":
        value = headers.get(path)
        return value or None
    node = body
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if node is None or isinstance(node, dict | list):
        return None
    return str(node)


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        source = self._source(scope)
        if source is None:
            await self.app(scope, receive, send)
            return
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed("method_not_allowed", "webhook deliveries are POSTed")
            answer = await self.receive(source, Headers(scope=scope), receive)
        except _Disconnected:
            return  # nobody to answer; nothing was recorded
        except WakefulError as exc:
            await self._refuse(exc, scope, receive, send)
            return
        except Exception:
            log.exception("webhook delivery to source %r failed", source)
            await self._refuse(WakefulError("internal_error", "the delivery could not be recorded; send it again"),
                               scope, receive, send)
            return
        body = json.dumps(answer, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

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

    @staticmethod
    async def _body(receive: Receive, limit: int) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge("payload_too_large", f"bodies over {limit} bytes are refused")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def receive(self, source: str, headers: Headers, receive: Receive) -> dict[str, Any]:
        """Verify, parse and persist one delivery; answers (the JSON to send) once it is durable."""
        runtime = self.runtime
        settings, clock = runtime.settings, runtime.clock
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise PayloadTooLarge("payload_too_large", f"bodies over {settings.max_body_bytes} bytes are refused")
        config = settings.sources.get(source)
        if config is None:
            raise NotFound("unknown_source", f"no webhook source named {source!r} is configured", source=source)
        body = await self._body(receive, settings.max_body_bytes)
        try:
            verify_signature(config.kind, secret=config.secret.get_secret_value().encode(), body=body,
                             headers=headers, now=clock.now().timestamp(),
                             tolerance_seconds=config.tolerance_seconds)
        except SignatureError as exc:
            raise Unauthorized(exc.code, str(exc), source=source) from None
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise BadRequest("malformed_body", "the body is not valid JSON") from None
        if not isinstance(payload, dict):
            raise BadRequest("malformed_body", "the body must be a JSON object")
        if config.kind == "slack" and payload.get("type") == "url_verification":
            return {"challenge": payload.get("challenge")}
        delivery_id = _locate(config.delivery_locator(), headers, payload)
        if delivery_id is None:
            raise BadRequest("missing_delivery_id", f"no delivery ID at {config.delivery_locator()!r}")
        delivery = Delivery(
            user_id=runtime.source_users[source], source=source, source_id=delivery_id, payload=payload,
            trust=config.trust, corr_key=_locate(config.session_locator(), headers, payload),
        )
        recorded = await runtime.committer.persist(delivery)
        return {"event_id": recorded.event_id, "duplicate": recorded.duplicate, "status": recorded.status.value}


class _Disconnected(Exception):
    """The client went away before its whole body arrived."""


def create_app(runtime: Runtime, *, manage_runtime: bool = True) -> ASGIApp:
    """The HTTP app: FastAPI behind the webhook inbox, which answers its own path first."""
    settings, clock = runtime.settings, runtime.clock

    mcp = WakefulMCP(engine=runtime.engine, clock=clock, settings=settings, tools=runtime.tools, local_user=None,
                     on_write=runtime.signals.wake_all)
    base = f"http://{settings.host}:{settings.port}"
    mcp_app = mcp.server.streamable_http_app(
        streamable_http_path="/mcp", host=settings.host, token_verifier=TokenVerifier(runtime.engine),
        auth=AuthSettings(issuer_url=AnyHttpUrl(base), resource_server_url=AnyHttpUrl(f"{base}/mcp"),
                          validate_token_resource=False))  # wakeful tokens are per user, not per resource

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if manage_runtime and settings.proxy:
                # The proxy is up before the first connector call can be made.
                await stack.enter_async_context(serve_egress(runtime.engine, clock, settings))
            if manage_runtime:
                runtime.start()
            try:
                async with mcp.server.session_manager.run():
                    yield
            finally:
                if manage_runtime:
                    await asyncio.to_thread(runtime.stop)

    app = FastAPI(title="wakeful", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    if runtime.live is not None:
        app.include_router(live_router(runtime.live))
        if NOVNC_DIR.is_dir():
            app.mount("/novnc", StaticFiles(directory=NOVNC_DIR), name="novnc")

    @app.exception_handler(WakefulError)
    async def _wakeful_error(_request: Request, exc: WakefulError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(BadRequest("malformed_body", "the request body does not match the schema",
                                         details=json.loads(json.dumps(exc.errors(), default=str))))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/wake", status_code=204)
    async def wake() -> Response:
        """Another process on this machine (the CLI, `wakeful mcp`) wrote work: look now instead of at the next
        idle poll. It only shortens a wait; it carries nothing and changes nothing."""
        runtime.signals.wake_all()
        return Response(status_code=204)

    @app.post("/v1/noop")
    async def noop() -> dict[str, bool]:
        return {"ok": True}

    app.include_router(router)
    app.mount("/", mcp_app)  # last: `/mcp`, streamable HTTP, bearer token required
    return WebhookInbox(app, runtime=runtime)
