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
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from mcp.server.auth.settings import AuthSettings
from pydantic import AnyHttpUrl

from server.errors import BadRequest, NotFound, PayloadTooLarge, Unauthorized, WakefulError
from server.inbox import Delivery
from server.liveview import NOVNC_DIR, live_router
from server.mcpserver import TokenVerifier, WakefulMCP
from server.proxyctl import serve_egress
from server.routes import router
from server.runtime import Runtime
from server.signatures import SignatureError, verify_signature

__all__ = ["QuietServer", "create_app", "error_response"]


class QuietServer(uvicorn.Server):
    """uvicorn wakes ten times a second to refresh its Date header and look for a shutdown request; once a second
    does both, and those wake-ups were most of an idle server's CPU."""

    async def main_loop(self) -> None:
        ticks = 0
        while not await self.on_tick(ticks * 10):  # on_tick refreshes the header when its counter is a multiple of 10
            ticks = (ticks + 1) % 86_400
            await asyncio.sleep(1.0)


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


def create_app(runtime: Runtime, *, manage_runtime: bool = True) -> FastAPI:
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

    @app.post("/v1/hooks/{source}")
    async def hook(source: str, request: Request) -> JSONResponse:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise PayloadTooLarge("payload_too_large", f"bodies over {settings.max_body_bytes} bytes are refused")
        config = settings.sources.get(source)
        if config is None:
            raise NotFound("unknown_source", f"no webhook source named {source!r} is configured", source=source)
        body = await request.body()
        if len(body) > settings.max_body_bytes:
            raise PayloadTooLarge("payload_too_large", f"bodies over {settings.max_body_bytes} bytes are refused")
        try:
            verify_signature(config.kind, secret=config.secret.get_secret_value().encode(), body=body,
                             headers=request.headers, now=clock.now().timestamp(),
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
            return JSONResponse({"challenge": payload.get("challenge")})
        delivery_id = _locate(config.delivery_locator(), request.headers, payload)
        if delivery_id is None:
            raise BadRequest("missing_delivery_id", f"no delivery ID at {config.delivery_locator()!r}")
        delivery = Delivery(
            user_id=runtime.source_users[source], source=source, source_id=delivery_id, payload=payload,
            trust=config.trust, corr_key=_locate(config.session_locator(), request.headers, payload),
        )
        recorded = await asyncio.wrap_future(runtime.committer.submit(delivery))
        return JSONResponse({"event_id": recorded.event_id, "duplicate": recorded.duplicate,
                             "status": recorded.status.value})

    app.include_router(router)
    app.mount("/", mcp_app)  # last: `/mcp`, streamable HTTP, bearer token required
    return app
