"""Docs stay true to the code."""

from __future__ import annotations

import hashlib
import hmac
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.routing import APIWebSocketRoute
from fastapi.staticfiles import StaticFiles
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute

from tests.support.docs import section
from wakeful.server.computers.handoff import NOVNC_DIR
from wakeful.server.core.signatures import sign, verify_signature
from wakeful.server.faces.gate import ControlGate
from wakeful.server.faces.http import ExactPath, WebhookInbox, create_app
from wakeful.server.faces.schemas import CODES
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_every_setting_is_documented_with_its_environment_variable() -> None:
    text = (DOCS / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert f"`{name}`" in text and f"`WAKEFUL_{name.upper()}" in text, name


def test_durations_in_the_environment_may_be_plain_seconds_or_iso(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAKEFUL_RESEND_AFTER", "2")
    monkeypatch.setenv("WAKEFUL_LEASE", "PT3S")
    monkeypatch.setenv("WAKEFUL_DISPATCH_BACKOFF", "0.5")
    settings = Settings()
    assert (settings.resend_after, settings.lease, settings.dispatch_backoff) == (
        timedelta(seconds=2), timedelta(seconds=3), timedelta(seconds=0.5))


ROUTE_ENTRY = re.compile(r"`(?:(GET|POST|PUT|PATCH|DELETE|WS) )?(/[^`\s?]*)(?:\?[^`]*)?`")


def _documented_routes() -> set[tuple[str, str]]:
    """(method, path) from the first column of the route table in docs/http-api.md; `*` for every method."""
    text = (DOCS / "http-api.md").read_text()
    table = section(text, "## Routes")
    found = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            found |= {(method or "*", _shape(path)) for method, path in ROUTE_ENTRY.findall(line.split(" | ")[0])}
    return found


def _shape(path: str) -> str:
    """Parameter names differ between the doc (`{id}`) and the code (`{task_id}`); their places do not."""
    return re.sub(r"\{[^}]*\}", "{}", path)


def _served_routes(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str]]:
    for route in routes:
        if hasattr(route, "original_router"):  # FastAPI keeps an included router whole, with its prefix
            yield from _served_routes(route.original_router.routes, prefix + route.include_context.prefix)
        elif isinstance(route, Mount) and isinstance(route.app, StaticFiles):
            yield "GET", _shape(prefix + route.path + "/{path}")
        elif isinstance(route, WebSocketRoute | APIWebSocketRoute):
            yield "WS", _shape(prefix + route.path)
        elif isinstance(route, Route):
            for method in sorted((route.methods or {"*"}) - {"HEAD", "OPTIONS"}):
                yield method, _shape(prefix + route.path)
        else:
            raise AssertionError(f"a kind of route this test does not know how to list: {route!r}")


def test_the_http_api_doc_lists_every_route_the_app_serves_and_no_other(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, proxy=False, computers=True, sources={})  # live-view routes included
    inbox = create_app(Runtime(settings, handler=EchoHandler()), manage_runtime=False)
    assert isinstance(inbox, WebhookInbox) and isinstance(inbox.app, ExactPath)  # `/mcp` first, then the rest
    assert isinstance(inbox.app.app, ControlGate)
    served = set(_served_routes(inbox.app.app.app.router.routes)) | {("POST", _shape(inbox.PREFIX + "{source}"))}
    if not NOVNC_DIR.is_dir():  # the noVNC files are served only where noVNC is installed
        served.add(("GET", _shape("/novnc/{path}")))
    documented = _documented_routes()
    assert not served - documented, f"served but not in docs/http-api.md: {sorted(served - documented)}"
    assert not documented - served, f"in docs/http-api.md but not served: {sorted(documented - served)}"


def test_every_error_code_of_the_openapi_document_is_in_the_http_api_doc_under_its_status() -> None:
    table = section((DOCS / "http-api.md").read_text(), "## Errors")
    rows = {int(status): text for status, text in re.findall(r"^\| (\d{3}) \| (.*)$", table, re.M)}
    missing = [f"{code} ({status})" for code, status in CODES.items() if f"`{code}`" not in rows.get(status, "")]
    assert not missing, f"not in docs/http-api.md's error table under their status: {missing}"


USER_DOCS = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), ROOT / "infra" / "README.md",
             ROOT / "policies" / "README.md", ROOT / "images" / "README.md"]
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_in_the_docs_leads_to_a_file_inside_the_repository(doc: Path) -> None:
    """The docs are read in a clone or from the package's README: a link that leaves the repository (a sibling
    folder, a web page) is one a reader cannot follow or that can change under them."""
    for target in MARKDOWN_LINK.findall(doc.read_text()):
        assert not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I), f"{doc.name}: {target} leaves the repository"
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name}: {target} points outside the repository"
        assert path.exists(), f"{doc.name}: {target} does not exist"


def test_the_worked_example_of_the_generic_scheme_is_what_the_server_signs_and_accepts() -> None:
    text = (DOCS / "webhooks.md").read_text().split("Worked example:", 1)[1]
    secret = re.match(r" secret `([^`]+)`", text)
    signed_bytes, headers_block = re.findall(r"```text\n(.*?)\n```", text, re.S)[:2]
    assert secret
    headers = dict(line.split(": ", 1) for line in headers_block.splitlines())
    timestamp, delivery, body = signed_bytes.split("\n")
    assert headers["X-Wakeful-Signature"] == "v1=" + hmac.new(secret.group(1).encode(), signed_bytes.encode(),
                                                              hashlib.sha256).hexdigest()
    assert sign("generic", secret=secret.group(1).encode(), body=body.encode(), now=int(timestamp),
                delivery_id=delivery) == headers
    verify_signature("generic", secret=secret.group(1).encode(), body=body.encode(), headers=headers,
                     now=int(timestamp) + 300)


def test_the_acceleration_probe_command_in_the_infra_notes_runs(tmp_path: Path) -> None:
    shown = re.search(r"`python -m (wakeful\.vm\.accel) --kernel <vmlinux>`", (ROOT / "infra" / "README.md")
                      .read_text())
    assert shown, "infra/README.md no longer shows the probe command"
    kernel = tmp_path / "vmlinux"
    kernel.write_bytes(b"not a kernel: --force skips the boot")
    result = subprocess.run([sys.executable, "-m", shown.group(1), "--kernel", str(kernel), "--force", "tcg",
                             "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "tcg (forced by setting)"
