"""Every error the HTTP server answers has the documented shape, `{"error": {"code", "message", ...}}`, with a
stable code: unknown paths, wrong methods, bodies that are not JSON or not the schema, missing or bad tokens — in
the API, in the live view and in the MCP server's plain-HTTP answers. Real requests to a server on loopback."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import iter_route_contexts
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute

from tests.support.serve import serving
from wakeful.server.computers.handoff import NOVNC_DIR
from wakeful.server.errors import Conflict
from wakeful.server.faces.http import create_app, error_response
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import write
from wakeful.server.store.users import ensure_user

DOC = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text()

METHODS = ("DELETE", "GET", "PATCH", "POST", "PUT")


def _fastapi(app: Any) -> FastAPI:
    """The FastAPI app inside the ASGI wrappers `create_app` puts in front of it."""
    while not isinstance(app, FastAPI):
        app = app.app
    return app


def _concrete(path: str) -> str:
    """A path a route's template matches: each `{name}` or `{name:convertor}` filled in."""
    return re.sub(r"\{[^}:]+(:int|:float)?(:[^}]+)?\}", lambda m: "1" if m.group(1) else "x", path)


def _wrong_methods(routes: list[BaseRoute]) -> list[tuple[str, str, list[str]]]:
    """(path, a method no route of it takes, the methods of every route whose template matches the path), for each
    path a route with methods serves (not a mount's, nor `/mcp`'s, which takes any). FastAPI keeps an included router
    as one route: `iter_route_contexts` is its own walk of the routes inside."""
    routed = [r for r in iter_route_contexts(routes) if r.methods]
    cases = []
    for path in dict.fromkeys(_concrete(str(r.path)) for r in routed):
        taken = sorted({m for r in routed if r.path_regex.match(path) for m in r.methods or ()})
        cases.append((path, next(m for m in METHODS if m not in taken), taken))
    return cases


class Server:
    def __init__(self, url: str, token: str, routes: list[BaseRoute]) -> None:
        self.url, self.token, self.routes = url, token, routes

    def request(self, method: str, path: str, *, token: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = kwargs.pop("headers", {}) | ({"Authorization": f"Bearer {token}"} if token else {})
        return httpx.request(method, self.url + path, headers=headers, timeout=10, **kwargs)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("errors"), proxy=False, computers=True, sources={})
    runtime = Runtime(settings, handler=EchoHandler())
    runtime.prepare()
    with write(runtime.engine) as conn:
        _, token = ensure_user(conn, name="someone", now=runtime.clock.now())
    assert token is not None
    app = create_app(runtime, manage_runtime=False)  # the loops are not needed to answer errors
    try:
        with serving(app) as url:
            yield Server(url, token, list(_fastapi(app).routes))
    finally:
        runtime.engine.dispose()


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The documented shape, or the assertion says what came instead."""
    assert response.headers["content-type"] == "application/json", (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["code"], str) and error["code"] and isinstance(error["message"], str), body
    assert "detail" not in body
    return dict(error)


CASES = [
    # (what, method, path, authenticated, extra request arguments, status, code)
    ("an unknown path", "GET", "/nowhere", False, {}, 404, "not_found"),
    ("an unknown path under the API", "GET", "/v1/nothing/here", True, {}, 404, "not_found"),
    ("an unknown path that only resembles MCP's", "POST", "/mcp/extra", True, {}, 404, "not_found"),
    ("the wrong method on a route", "DELETE", "/v1/control", True, {}, 405, "method_not_allowed"),
    ("the wrong method on the inbox", "GET", "/v1/hooks/github", False, {}, 405, "method_not_allowed"),
    ("OAuth resource metadata, which MCP does not advertise", "GET", "/.well-known/oauth-protected-resource/mcp",
     False, {}, 404, "not_found"),
    ("a body that is not JSON", "POST", "/v1/tasks", True,
     {"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "malformed_body"),
    ("a body that is not the schema", "POST", "/v1/tasks", True, {"json": {"title": "", "colour": 1}}, 400,
     "malformed_body"),
    ("a negative ceiling", "POST", "/v1/tasks", True, {"json": {"title": "x", "constraints": {"max_amount_cents": -5}}},
     400, "malformed_body"),
    ("a ceiling too large to compare", "POST", "/v1/tasks", True,
     {"json": {"title": "x", "constraints": {"max_amount_cents": 1e308}}}, 400, "malformed_body"),
    ("an infinite ceiling in a steer", "POST", "/v1/tasks/task_x/steer", True,
     {"content": b'{"goal": "g", "constraints": {"max_amount_cents": Infinity}}',
      "headers": {"content-type": "application/json"}}, 400, "malformed_body"),
    ("a query parameter of the wrong type", "GET", "/v1/egress?limit=many", True, {}, 400, "invalid_parameter"),
    ("no token", "POST", "/v1/tasks", False, {"json": {"title": "x"}}, 401, "missing_token"),
    ("a token nobody was issued", "GET", "/v1/control", "wk_forged", {}, 401, "bad_token"),
    ("no token, over MCP", "POST", "/mcp", False, {"json": {}}, 401, "missing_token"),
    ("a token nobody was issued, over MCP", "POST", "/mcp", "wk_forged", {"json": {}}, 401, "bad_token"),
    ("a foreign Host header, over MCP", "POST", "/mcp", True,
     {"json": {}, "headers": {"host": "evil.example"}}, 421, "misdirected_request"),
    ("a foreign Origin, over MCP", "POST", "/mcp", True,
     {"json": {}, "headers": {"origin": "http://evil.example"}}, 403, "forbidden"),
    ("a live-view link nobody offered", "GET", "/v1/live/not-a-token", False, {}, 410, "gone"),
    ("a live-view link whose token starts like the view-link route", "GET", "/v1/live/viewfinder", False, {}, 410,
     "gone"),
    ("a live-view session that does not exist", "GET", "/v1/live/s/not-a-session", False, {}, 410, "gone"),
    ("a webhook source that is not configured", "POST", "/v1/hooks/nobody", False, {"content": b"{}"}, 404,
     "unknown_source"),
]


@pytest.mark.parametrize(("what", "method", "path", "auth", "extra", "status", "code"), CASES,
                         ids=[c[0] for c in CASES])
def test_each_error_answers_the_documented_shape_with_a_stable_code(
        server: Server, what: str, method: str, path: str, auth: bool | str, extra: dict[str, Any], status: int,
        code: str) -> None:
    token = auth if isinstance(auth, str) else (server.token if auth else None)
    response = server.request(method, path, token=token, **extra)
    assert response.status_code == status, (what, response.text)
    assert error_of(response)["code"] == code, what
    assert f"`{code}`" in DOC, f"docs/http-api.md does not name the code {code}"


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded"])
def test_a_json_body_sent_without_saying_it_is_json_is_told_to_say_so(server: Server,
                                                                      content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}  # curl -d sends the second
    response = server.request("POST", "/v1/tasks", token=server.token, content=b'{"title": "x"}', headers=headers)
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "malformed_body"
    assert "send it with `Content-Type: application/json`" in error["message"]
    assert (content_type or "no Content-Type") in error["message"]


def test_a_wrong_method_says_which_methods_the_path_takes(server: Server) -> None:
    response = server.request("DELETE", "/v1/control", token=server.token)
    assert response.headers["allow"] == "GET"
    assert "GET" in error_of(response)["message"]


def test_a_schema_invalid_body_names_each_field_that_is_wrong(server: Server) -> None:
    error = error_of(server.request("POST", "/v1/tasks", token=server.token, json={"title": "", "colour": 1}))
    assert {tuple(p["loc"]) for p in error["details"]} == {("body", "title"), ("body", "colour")}


def test_mcp_s_401_is_a_plain_bearer_challenge_pointing_to_no_oauth_server(server: Server) -> None:
    """Regression: the 401 named resource metadata whose authorization server answered 404 to every MCP client that
    followed it (Claude Code went on to `/.well-known/oauth-authorization-server`, then `POST /register`)."""
    missing = server.request("POST", "/mcp", json={})
    forged = server.request("POST", "/mcp", token="wk_forged", json={})
    assert missing.headers["www-authenticate"] == 'Bearer realm="wakeful"'
    assert forged.headers["www-authenticate"] == 'Bearer realm="wakeful", error="invalid_token"'
    for path in ("/.well-known/oauth-protected-resource/mcp", "/.well-known/oauth-protected-resource",
                 "/.well-known/oauth-authorization-server"):
        assert server.request("GET", path).status_code == 404, path


def test_mcp_s_own_protocol_errors_stay_json_rpc_for_its_clients(server: Server) -> None:
    """The MCP transport answers a broken message with a JSON-RPC error object, which clients parse: that is the
    protocol's shape, not an HTTP error, and passes untouched."""
    response = server.request("POST", "/mcp", token=server.token, content=b"{not json",
                              headers={"content-type": "application/json",
                                       "accept": "application/json, text/event-stream"})
    assert response.status_code == 400
    assert response.json()["jsonrpc"] == "2.0" and "error" in response.json()


@pytest.mark.skipif(not NOVNC_DIR.is_dir(), reason="noVNC is not installed (scripts/install installs it)")
def test_a_file_the_live_view_does_not_have_is_a_json_404(server: Server) -> None:
    response = server.request("GET", "/novnc/no-such-file.js")
    assert response.status_code == 404 and error_of(response)["code"] == "not_found"


def test_the_one_mapping_function_hides_the_inside_of_an_unexpected_failure() -> None:
    response = error_response(RuntimeError("secret path /etc/wakeful and a stack"))
    body = json.loads(bytes(response.body))
    assert response.status_code == 500 and body == {"error": {
        "code": "internal_error", "message": "the server failed to answer; the error is in its log"}}


def test_the_one_mapping_function_keeps_our_codes_and_fields() -> None:
    response = error_response(Conflict("invalid_transition", "the task is closed", task_id="task_1"))
    assert response.status_code == 409 and json.loads(bytes(response.body)) == {"error": {
        "code": "invalid_transition", "message": "the task is closed", "task_id": "task_1"}}


def test_the_one_mapping_function_codes_framework_errors_by_their_status() -> None:
    assert json.loads(bytes(error_response(HTTPException(410, "link used")).body))["error"] == {
        "code": "gone", "message": "link used"}
    invalid = RequestValidationError([{"type": "int_parsing", "loc": ("path", "n"), "msg": "not an int"}])
    assert json.loads(bytes(error_response(invalid).body))["error"]["code"] == "invalid_parameter"


def _raw_head(server: Server, head: str) -> bytes:
    """Send a request head only (no body follows) and read what the server answers to it."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)  # a server waiting for the promised body would time this out
            if not chunk:
                break
            answer += chunk
        return answer


def test_a_control_request_without_a_token_is_refused_before_its_body_is_read(server: Server) -> None:
    answer = _raw_head(server, "POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               "Content-Length: 52428800\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 401")


def test_a_control_body_over_the_limit_is_refused_from_its_declared_length(server: Server) -> None:
    answer = _raw_head(server, f"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
                               "Content-Type: application/json\r\nContent-Length: 8388608\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413")


def test_eight_megabytes_of_constraints_are_a_413_and_a_deep_body_a_400(server: Server) -> None:
    huge = server.request("POST", "/v1/tasks", token=server.token,
                          json={"title": "t", "constraints": {"pad": "x" * (8 << 20)}})
    assert (huge.status_code, error_of(huge)["code"]) == (413, "payload_too_large")
    deep = server.request("POST", "/v1/tasks", token=server.token, content=b'{"title": "t", "constraints": ' +
                          b'{"a":' * 200 + b"1" + b"}" * 200 + b"}", headers={"Content-Type": "application/json"})
    assert (deep.status_code, error_of(deep)["code"]) == (400, "json_too_deep")
    fine = server.request("POST", "/v1/tasks", token=server.token, json={"title": "t", "constraints": {"a": 1}})
    assert fine.status_code == 201, fine.text


def test_a_wrong_method_on_any_path_is_405_naming_every_method_its_routes_take(server: Server) -> None:
    """In `Allow` and in the message (docs/http-api.md), where several routes share the path (`GET` and `POST
    /v1/tasks`) too."""
    url, token = server.url, server.token
    cases = _wrong_methods(server.routes)
    assert {"/v1/tasks", "/v1/preferences", "/v1/memory"} <= {path for path, _, _ in cases}
    wrong = []
    for path, method, taken in cases:
        response = httpx.request(method, url + path, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        allow = ", ".join(taken)
        error = response.json()["error"] if response.status_code == 405 else {}
        if (response.status_code, response.headers.get("allow"), error.get("code")) != (405, allow,
                                                                                        "method_not_allowed") \
                or not error["message"].endswith(f"it takes {allow}"):
            wrong.append((method, path, response.status_code, response.headers.get("allow"), allow,
                          response.text[:200]))
    assert not wrong, wrong


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("DELETE", "/v1/tasks", "GET, POST"),
    ("DELETE", "/v1/preferences", "GET, PUT"),
    ("DELETE", "/v1/memory", "GET, POST"),
])
def test_the_reported_paths_name_both_their_methods(server: Server, method: str, path: str, allow: str) -> None:
    url, token = server.url, server.token
    response = httpx.request(method, url + path, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert (response.status_code, response.headers["allow"]) == (405, allow)
    assert response.json()["error"]["message"] == f"this path does not take that method; it takes {allow}"

