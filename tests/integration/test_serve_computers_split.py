"""`wakeful serve` with tool computers on runs `wakeful api` and `wakeful worker` apart, and every computer path works:
the agent's MCP tools in the API, an act the user approved run by the worker's dispatcher on the API's computer, the
worker's sweeper reaping it idle (the next observe finds the epoch moved by the restore), and an API child killed
and restarted by serve serves the computers again to the same worker. On the vm layer's fakes (`computer_fakes`):
the real-VM story is tests/system/test_serve_computer.py."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.support.polling import wait_until
from tests.support.serve import WAKEFUL, ServeProcess

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

IDLE_AFTER = 3
"""Seconds idle before the sweeper reaps a computer: long enough that an observe and the act after it stay together."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def agent(url: str, token: str) -> AsyncIterator[Client]:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(120)) as http, \
            Client(streamable_http_client(f"{url}/mcp", http_client=http), read_timeout_seconds=120) as client:
        yield client


async def call(client: Client, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, args)
    assert not result.is_error, f"{tool}: {result.content}"
    body: dict[str, Any] = json.loads(result.content[0].text)  # type: ignore[union-attr]
    return body


def ref(seen: dict[str, Any], name: str) -> str:
    return next(line.split("]")[0][1:] for line in seen["text"].splitlines() if f'"{name}"' in line)


def pid(data_dir: Path, name: str) -> int | None:
    try:
        return int((data_dir / "run" / f"{name}.pid").read_text())
    except (FileNotFoundError, ValueError):
        return None


def attempts(url: str, token: str, task_id: str) -> list[str]:
    ledger = httpx.get(f"{url}/v1/tasks/{task_id}/ledger", headers={"Authorization": f"Bearer {token}"}).json()
    return [e.get("outcome") for e in ledger["entries"] if e["type"] == "attempt"]


async def test_serve_runs_api_and_worker_apart_with_computers_on_and_every_computer_path_works(
        tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}
    token = subprocess.run([str(WAKEFUL), "token", "--data-dir", str(tmp_path)], env=env, capture_output=True,
                           text=True, check=True, timeout=120).stdout.strip()
    with ServeProcess({"WAKEFUL_DATA_DIR": str(tmp_path), "WAKEFUL_COMPUTERS": "true",
                       "WAKEFUL_COMPUTER_FAKES": "true", "WAKEFUL_COMPUTER_IDLE_AFTER": str(IDLE_AFTER),
                       "WAKEFUL_SWEEP_INTERVAL": "0.5"}, log_path=tmp_path / "serve.log") as server:
        api, worker = wait_until(lambda: (pid(tmp_path, "api"), pid(tmp_path, "worker")) if all(
            (pid(tmp_path, "api"), pid(tmp_path, "worker"))) else None, 60, "the api and worker children")
        assert api != worker
        sock = tmp_path / "run" / "computers.sock"
        wait_until(sock.exists, 60, "the api to serve the computers")
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600

        async with agent(server.url, token) as client:
            task_id = (await call(client, "create_responsibility", {"title": "pay on the tool computer"}))["task_id"]
            seen = await call(client, "computer__observe", {"task_id": task_id})
            held = await call(client, "computer__act", {"task_id": task_id,
                                                        "act": {"kind": "click", "ref": ref(seen, "Pay 19.99 EUR")}})
        assert '"Checkout"' in seen["text"] and held["status"] == "needs_approval"
        decided = httpx.post(f"{server.url}/v1/actions/{held['action_id']}/approve",
                             headers={"Authorization": f"Bearer {token}"})
        assert decided.json()["verdict"] == "admitted", decided.text
        # The worker's dispatcher runs it, on the API's computer:
        wait_until(lambda: attempts(server.url, token, task_id) == ["accepted"], 120, "the approved act to run")

        # Idle, the worker's sweeper reaps it through the API; the next observe restores it (the epoch moves).
        wait_until(lambda: "suspended idle tool computers" in server.log(), 120, "the sweeper to reap the computer")
        async with agent(server.url, token) as client:
            paid = await call(client, "computer__observe", {"task_id": task_id})
        assert '"Paid"' in paid["text"] and paid["epoch"] > seen["epoch"]

        # The API dies; serve starts it again, and the worker finds the computers there.
        os.kill(api, signal.SIGKILL)
        wait_until(lambda: pid(tmp_path, "api") not in (None, api), 120, "serve to restart the api")
        wait_until(lambda: server_answers(server.url), 120, "the restarted api to answer")
        async with agent(server.url, token) as client:
            again = await call(client, "computer__observe", {"task_id": task_id})
            held = await call(client, "computer__act", {"task_id": task_id,
                                                        "act": {"kind": "click", "ref": ref(again, "Pay 19.99 EUR")}})
        httpx.post(f"{server.url}/v1/actions/{held['action_id']}/approve", headers={"Authorization": f"Bearer {token}"})
        wait_until(lambda: attempts(server.url, token, task_id) == ["accepted", "accepted"], 120,
                   "the worker to reach the restarted api's computers")
        assert pid(tmp_path, "worker") == worker  # the same worker all along
    assert "Traceback" not in server.log()


def server_answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False
