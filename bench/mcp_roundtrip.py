"""MCP tool-call round trip for a read-only tool (`task_status`), over stdio and streamable HTTP, p50/p99,
beside a bare `MCPServer` echo tool on the same transport in the same run — so wakeful's own overhead shows.

The client is the real `mcp` SDK client. stdio launches `wakeful mcp` (and `bench/_echo_mcp.py stdio`);
HTTP talks to `/mcp` on a running `wakeful serve` with a bearer token (and to the echo server under uvicorn).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx2
from _common import WAKEFUL, Row, Table, bench_args, fmt_ms, free_port, percentile, print_and_save, reproduce, serve
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

HERE = Path(__file__).resolve().parent


async def timed(client_factory: Callable[[], AbstractAsyncContextManager[Client]], n: int,
                setup: Callable[[Client], Awaitable[tuple[str, dict[str, Any]]]]) -> list[float]:
    async with client_factory() as client:
        tool, args = await setup(client)
        for _ in range(5):  # warm up outside the measurement
            await client.call_tool(tool, args)
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            result = await client.call_tool(tool, args)
            samples.append(time.perf_counter() - start)
            if result.is_error:
                raise RuntimeError(f"{tool} failed: {result.content}")
        return samples


async def wakeful_task(client: Client) -> tuple[str, dict[str, Any]]:
    created = await client.call_tool("create_responsibility", {"title": "benchmark"})
    return "task_status", {"task_id": created.structured_content["task_id"]}


async def echo_call(client: Client) -> tuple[str, dict[str, Any]]:
    return "echo", {"text": "hello"}


def clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}, **extra}


def stdio_figures(n: int) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        ours = StdioServerParameters(command=str(WAKEFUL), args=["mcp"], env=clean_env(WAKEFUL_DATA_DIR=tmp))
        echo = StdioServerParameters(command=sys.executable, args=[str(HERE / "_echo_mcp.py"), "stdio"],
                                     env=clean_env())
        return (asyncio.run(timed(lambda: Client(ours), n, wakeful_task)),
                asyncio.run(timed(lambda: Client(echo), n, echo_call)))


def http_figures(n: int) -> tuple[list[float], list[float]]:
    with serve() as server:
        token = subprocess.run([str(WAKEFUL), "token"], env=clean_env(WAKEFUL_DATA_DIR=str(server.data_dir)),
                               capture_output=True, text=True, check=True).stdout.strip()

        def ours() -> AbstractAsyncContextManager[Client]:
            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"})
            return Client(streamable_http_client(f"{server.url}/mcp", http_client=http))

        wakeful_samples = asyncio.run(timed(ours, n, wakeful_task))
    port = free_port()
    echo_proc = subprocess.Popen([sys.executable, str(HERE / "_echo_mcp.py"), "http", str(port)], env=clean_env(),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx2.get(f"http://127.0.0.1:{port}/mcp", timeout=1.0)
                break
            except httpx2.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the echo MCP server did not start") from None
                time.sleep(0.05)
        echo_samples = asyncio.run(timed(lambda: Client(f"http://127.0.0.1:{port}/mcp"), n, echo_call))
    finally:
        echo_proc.terminate()
        echo_proc.wait(timeout=10)
    return wakeful_samples, echo_samples


def run(quick: bool) -> list[Table]:
    n = 60 if quick else 400
    rows = []
    for transport, figures in (("stdio", stdio_figures), ("streamable HTTP", http_figures)):
        ours, echo = figures(n)
        rows += [Row(f"{transport}: task_status round trip p{p}", fmt_ms(percentile(ours, p)),
                     fmt_ms(percentile(echo, p)) + " (echo)") for p in (50, 99)]
    return [Table(title=f"MCP tool-call round trip, {n} calls each (baseline: a bare MCPServer echo tool)",
                  rows=rows, reproduce=reproduce("mcp_roundtrip.py", quick),
                  notes=["task_status reads a task's records from SQLite; echo does no work at all"])]


if __name__ == "__main__":
    args = bench_args(__doc__ or "")
    print_and_save(run(args.quick), "mcp_roundtrip.txt")
