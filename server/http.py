"""The HTTP API: webhook inbox, control endpoints, the message feed. Errors map to JSON in one function.

    POST /v1/hooks/{source}        a signed webhook delivery (no token: the signature authenticates it)
    POST /v1/control/stop|start    STOP / START for the caller                       (bearer token)
    POST /v1/tasks                 create a task                                     (bearer token)
    POST /v1/tasks/{id}/pause|resume|close                                           (bearer token)
    GET  /v1/tasks/{id}, /v1/events/{id}, /v1/messages                               (bearer token)
    POST /v1/noop                  does nothing: the baseline the benchmarks compare ingest against
    GET  /healthz
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy import and_, select

from server import control, sessions, users
from server.db import read, write
from server.errors import BadRequest, NotFound, PayloadTooLarge, Unauthorized, WakefulError
from server.inbox import Delivery
from server.runtime import Runtime
from server.signatures import SignatureError, verify_signature
from server.tables import ControlKind, events, outbox, tasks

__all__ = ["create_app", "error_response"]


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


def current_user(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    """The bearer token's user; every record a request touches is filtered by it."""
    scheme, _, token = (authorization or "").partition(" ")
    with read(request.app.state.runtime.engine) as conn:
        return users.authenticate(conn, token if scheme.lower() == "bearer" else None)


User = Annotated[str, Depends(current_user)]


class TaskIn(BaseModel):
    title: str = Field(min_length=1, max_length=2000)


class ControlIn(BaseModel):
    reason: str = Field(default="", max_length=2000)


def create_app(runtime: Runtime, *, manage_runtime: bool = True) -> FastAPI:
    settings, engine, clock = runtime.settings, runtime.engine, runtime.clock

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if manage_runtime:
            runtime.start()
        try:
            yield
        finally:
            if manage_runtime:
                await asyncio.to_thread(runtime.stop)

    app = FastAPI(title="wakeful", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime

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

    @app.post("/v1/control/stop")
    def stop(user: User, body: ControlIn | None = None) -> dict[str, Any]:
        with write(engine) as conn:
            record = control.set_stop(conn, stopped=True, user_id=user, actor=f"user:{user}",
                                      reason=body.reason if body else "", now=clock.now())
        return {"stopped": True, "record_id": record}

    @app.post("/v1/control/start")
    def start(user: User, body: ControlIn | None = None) -> dict[str, Any]:
        with write(engine) as conn:
            record = control.set_stop(conn, stopped=False, user_id=user, actor=f"user:{user}",
                                      reason=body.reason if body else "", now=clock.now())
        runtime.signals.work.set()
        runtime.signals.dispatch.set()
        return {"stopped": False, "record_id": record}

    @app.get("/v1/control")
    def control_state(user: User) -> dict[str, Any]:
        with read(engine) as conn:
            state = control.stop_state(conn)
        return {"stopped": state.blocks(user), "global_stop": state.everything}

    @app.post("/v1/tasks", status_code=201)
    def create_task(user: User, body: TaskIn) -> dict[str, Any]:
        now = clock.now()
        with write(engine) as conn:
            session_id = sessions.create_session(conn, user_id=user, now=now)
            task_id = control.create_task(conn, user_id=user, session_id=session_id, title=body.title, now=now)
        return {"task_id": task_id, "session_id": session_id}

    def _transition(user: str, task_id: str, kind: ControlKind, body: ControlIn | None) -> dict[str, Any]:
        with write(engine) as conn:
            state = control.set_task_state(conn, user_id=user, task_id=task_id, kind=kind, actor=f"user:{user}",
                                           reason=body.reason if body else "", now=clock.now())
        runtime.signals.work.set()
        return {"task_id": task_id, "state": state.value}

    @app.post("/v1/tasks/{task_id}/pause")
    def pause(user: User, task_id: str, body: ControlIn | None = None) -> dict[str, Any]:
        return _transition(user, task_id, ControlKind.PAUSE, body)

    @app.post("/v1/tasks/{task_id}/resume")
    def resume(user: User, task_id: str, body: ControlIn | None = None) -> dict[str, Any]:
        return _transition(user, task_id, ControlKind.RESUME, body)

    @app.post("/v1/tasks/{task_id}/close")
    def close(user: User, task_id: str, body: ControlIn | None = None) -> dict[str, Any]:
        return _transition(user, task_id, ControlKind.CLOSE, body)

    @app.get("/v1/tasks/{task_id}")
    def get_task(user: User, task_id: str) -> dict[str, Any]:
        with read(engine) as conn:
            row = conn.execute(select(tasks).where(and_(tasks.c.id == task_id, tasks.c.user_id == user))).first()
        if row is None:
            raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
        return {"task_id": row.id, "session_id": row.session_id, "title": row.title, "state": row.state}

    @app.get("/v1/events/{event_id}")
    def get_event(user: User, event_id: str) -> dict[str, Any]:
        with read(engine) as conn:
            row = conn.execute(select(events).where(and_(events.c.id == event_id, events.c.user_id == user))).first()
        if row is None:
            raise NotFound("unknown_event", f"no event {event_id} for this user", event_id=event_id)
        return {"event_id": row.id, "source": row.source, "source_id": row.source_id, "session_id": row.session_id,
                "status": row.status, "attempts": row.attempts, "run_id": row.run_id,
                "received_at": row.received_at.isoformat()}

    @app.get("/v1/messages")
    def messages(user: User, limit: int = 100) -> dict[str, Any]:
        with read(engine) as conn:
            rows = conn.execute(select(outbox).where(outbox.c.user_id == user)
                                .order_by(outbox.c.created_at.desc()).limit(min(limit, 1000))).all()
        return {"messages": [{"id": r.id, "state": r.state, "created_at": r.created_at.isoformat(),
                              "body": json.loads(r.body)} for r in rows]}

    return app
