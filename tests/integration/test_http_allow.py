"""A wrong method's 405 names every method its path takes, in `Allow` and in the message (docs/http-api.md), for
every path the app serves, where several routes share the path (`GET` and `POST /v1/tasks`) too. Real requests to a
server on loopback."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from starlette.routing import BaseRoute

from tests.support.serve import serving
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import write
from wakeful.server.store.users import ensure_user

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


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, list[BaseRoute]]]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("allow"), proxy=False, computers=True, sources={})
    runtime = Runtime(settings, handler=EchoHandler())
    runtime.prepare()
    with write(runtime.engine) as conn:
        _, token = ensure_user(conn, name="someone", now=runtime.clock.now())
    assert token is not None
    app = create_app(runtime, manage_runtime=False)
    try:
        with serving(app) as url:
            yield url, token, list(_fastapi(app).routes)
    finally:
        runtime.engine.dispose()


def test_a_wrong_method_on_any_path_is_405_naming_every_method_its_routes_take(
        served: tuple[str, str, list[BaseRoute]]) -> None:
    url, token, routes = served
    cases = _wrong_methods(routes)
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
def test_the_reported_paths_name_both_their_methods(served: tuple[str, str, list[BaseRoute]], method: str,
                                                    path: str, allow: str) -> None:
    url, token, _ = served
    response = httpx.request(method, url + path, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert (response.status_code, response.headers["allow"]) == (405, allow)
    assert response.json()["error"]["message"] == f"this path does not take that method; it takes {allow}"

