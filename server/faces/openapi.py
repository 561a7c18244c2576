"""The HTTP API's OpenAPI document (`GET /openapi.json`, to a user with a token): FastAPI's, made true to what the
server answers.

- Every error response is `ErrorEnvelope` as JSON, its `error.code` one of the codes the response lists
  (`x-error-codes`): those the route declared (`schemas.refusals`) and those every route of its kind answers — the
  token check where a token is asked for, the control gate's checks under its paths (the body's, and a path
  parameter's: NUL), and the `400` FastAPI's validation answers for a body or a query parameter (it would document
  its own `422`, which we never send; path, header and cookie parameters here are plain strings, which it never
  finds invalid).
- Routes answered outside FastAPI's routing are described by routers that are never mounted: the webhook inbox
  (answered in front of the app), the MCP transport and its metadata (a mounted app), the noVNC files.
  The live view's websocket is not in the document (OpenAPI has no way to say it).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response

from wakeful.server.faces.auth import bearer
from wakeful.server.faces.gate import guards
from wakeful.server.faces.schemas import CODES, ERROR_CODES_KEY, ErrorEnvelope, HookReceipt, SlackChallenge, refusals

__all__ = ["MCP", "NOVNC", "WEBHOOKS", "openapi_document"]

_REF = "#/components/schemas/{model}"
_TOKEN_CODES = ("missing_token", "bad_token")
_BODY_CODES = ("payload_too_large", "malformed_body", "json_too_deep", "number_too_long", "number_out_of_range",
               "duplicate_key")
"""What reading a body within bounds refuses (`server.faces.bodies`): the control gate's and the inbox's."""


def openapi_document(app: FastAPI, described: list[APIRouter]) -> dict[str, Any]:
    """The document for `app` and the routes `described` (built once, then kept)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, description=app.description,
                               routes=[*app.routes, *(route for router in described for route in router.routes)])
        for path, item in document["paths"].items():
            for operation in item.values():
                _document_errors(path, operation)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shape: we answer 400 in ours
            schemas.pop(unused, None)
        envelope = ErrorEnvelope.model_json_schema(ref_template=_REF)
        schemas |= envelope.pop("$defs")
        schemas["ErrorEnvelope"] = envelope
        app.openapi_schema = document
    return app.openapi_schema


def _document_errors(path: str, operation: dict[str, Any]) -> None:
    responses: dict[str, dict[str, Any]] = operation["responses"]
    answered: list[str] = []
    if responses.pop("422", None) is not None:
        answered += ["malformed_body"] if "requestBody" in operation else []
        answered += ["invalid_parameter"] if any(p["in"] == "query" for p in operation.get("parameters", [])) else []
    if operation.get("security"):
        answered += _TOKEN_CODES
        answered += [] if path == "/mcp" else ["user_credential_required"]  # only the agent's channel takes an agent's
    if guards(path):
        answered += _BODY_CODES
        answered += ["invalid_parameter"] if any(p["in"] == "path" for p in operation.get("parameters", [])) else []
    for code in answered:
        listed = responses.setdefault(str(CODES[code]), {}).setdefault(ERROR_CODES_KEY, [])
        if code not in listed:
            listed.append(code)
    for status, response in responses.items():
        codes = response.get(ERROR_CODES_KEY)
        if codes is None:
            continue
        response["description"] = f"{HTTPStatus(int(status)).phrase}: " + ", ".join(f"`{c}`" for c in codes)
        response["content"] = {"application/json": {"schema": {"allOf": [
            {"$ref": _REF.format(model="ErrorEnvelope")},
            {"properties": {"error": {"properties": {"code": {"enum": codes}}}}},
        ]}}}


WEBHOOKS = APIRouter(tags=["webhooks"])
"""The webhook inbox, answered in front of the app (`server.faces.http.WebhookInbox`): described, never mounted."""


@WEBHOOKS.post("/v1/hooks/{source}", response_model=HookReceipt | SlackChallenge,
               responses=refusals("missing_delivery_id", "invalid_delivery_id", "invalid_session_key",
                                  "signature_missing", "signature_malformed",
                                  "signature_mismatch", "signature_expired", "unknown_source", *_BODY_CODES))
def webhook_delivery(source: str, payload: Annotated[dict[str, Any], Body()]) -> None:
    """A delivery from the configured webhook source `source`, authenticated by its signature (no token): GitHub's
    `X-Hub-Signature-256`, Stripe's `Stripe-Signature`, Slack's `X-Slack-Signature` with
    `X-Slack-Request-Timestamp`, or the generic `X-Wakeful-Signature` over `X-Wakeful-Timestamp`,
    `X-Wakeful-Delivery` and the body (docs/webhooks.md). The answer comes once the delivery is durable; a delivery
    seen before (by a delivery ID its signature covers) answers `duplicate`."""


MCP = APIRouter(tags=["mcp"])
"""The MCP server over streamable HTTP (a mounted app with its own protocol): described, never mounted."""

_MCP_ANSWERS = refusals("forbidden", "misdirected_request") | {
    200: {"description": "the MCP transport's answer: JSON or an event stream"},
    202: {"description": "a notification or a response accepted"}}


@MCP.post("/mcp", operation_id="mcp_post", dependencies=[Depends(bearer)], response_class=Response,
          responses=_MCP_ANSWERS)
@MCP.get("/mcp", operation_id="mcp_get", dependencies=[Depends(bearer)], response_class=Response,
         responses=_MCP_ANSWERS)
@MCP.delete("/mcp", operation_id="mcp_delete", dependencies=[Depends(bearer)], response_class=Response,
            responses=_MCP_ANSWERS)
def mcp_transport() -> None:
    """The Model Context Protocol's streamable HTTP transport (the MCP specification describes its messages; a broken
    one is answered with a JSON-RPC error object, which MCP clients read). A request from a web page of another
    origin is `403 forbidden`, one whose `Host` is not this machine's loopback name `421 misdirected_request`. The token
goes in `Authorization: Bearer`; there is no OAuth, and a `401` points to none (`WWW-Authenticate: Bearer
realm="wakeful"`)."""


NOVNC = APIRouter(tags=["live view"])
"""The noVNC files the live view's page loads (served where noVNC is installed): described, never mounted."""


@NOVNC.get("/novnc/{path}", response_class=Response, responses=refusals("not_found") | {
    200: {"description": "the file", "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}}})
def novnc_file(path: str) -> None:
    """A file of noVNC (JavaScript, styles, images), for the live view's page."""
