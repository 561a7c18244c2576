"""MCP tool-call round trip for a read-only tool (`task_status`), over stdio and streamable HTTP, p50/p99,
beside a bare `MCPServer` echo tool on the same transport in the same run — so wakeful's own overhead shows.

The client is the real `mcp` SDK client. stdio launches `wakeful mcp`, the bridge to a running `wakeful serve`'s
`/mcp` (beside `bench/_echo_mcp.py stdio`, and the same bridge in front of the echo server over HTTP, which shows the
bridge's own cost); HTTP talks to `/mcp` with a bearer token (and to the echo server under uvicorn).

Beside the milliseconds, each process's CPU time per call (from /proc, Linux only): on a shared machine the wall
clock moves with the load, while the CPU a call costs each hop moves far less — it is where the time goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
from _common import (
    WAKEFUL,
    Row,
    Table,
    bench_args,
    fmt_ms,
    fmt_ratio,
    free_port,
    percentile,
    print_and_save,
    reproduce,
    serve,
    verdict,
)
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

HERE = Path(__file__).resolve().parent


Factory = Callable[[], AbstractAsyncContextManager[Client]]
Setup = Callable[[Client], Awaitable[tuple[str, dict[str, Any]]]]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (NaN where /proc cannot say)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children() -> dict[int, str]:
    """This process's child processes: their command lines by PID."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


@dataclass(frozen=True, kw_only=True)
class Measured:
    samples: dict[str, list[float]]
    """Each series' round trips, in seconds."""
    cpu: dict[str, float]
    """CPU seconds each process used during the measured rounds, by the name `watch` gave it."""


async def interleaved(series: dict[str, tuple[Factory, Setup]], n: int,
                      watch: Callable[[], dict[str, int]] = dict) -> Measured:
    """Every series' client open at once, one call of each in turn, n rounds: on a shared machine whose load comes
    and goes, each series meets the same load, so their ratios mean something even when the milliseconds move.
    `watch` names the processes whose CPU time is taken over the rounds (asked once every client is open)."""
    async with contextlib.AsyncExitStack() as stack:
        calls = {}
        for name, (factory, setup) in series.items():
            client = await stack.enter_async_context(factory())
            tool, args = await setup(client)
            for _ in range(5):  # warm up outside the measurement
                await client.call_tool(tool, args)
            calls[name] = (client, tool, args)
        samples: dict[str, list[float]] = {name: [] for name in series}
        pids = watch()
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        for _ in range(n):
            for name, (client, tool, args) in calls.items():
                start = time.perf_counter()
                result = await client.call_tool(tool, args)
                samples[name].append(time.perf_counter() - start)
                if result.is_error:
                    raise RuntimeError(f"{tool} failed: {result.content}")
        return Measured(samples=samples, cpu={name: cpu_seconds(pid) - before[name] for name, pid in pids.items()})


async def wakeful_task(client: Client) -> tuple[str, dict[str, Any]]:
    created = await client.call_tool("create_responsibility", {"title": "benchmark"})
    return "task_status", {"task_id": created.structured_content["task_id"]}


async def echo_call(client: Client) -> tuple[str, dict[str, Any]]:
    return "echo", {"text": "hello"}


def clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}, **extra}


def http_client(url: str, token: str) -> Factory:
    def client() -> AbstractAsyncContextManager[Client]:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"})
        return Client(streamable_http_client(url, http_client=http))

    return client


def bridged(url: str, token: str) -> Factory:
    """A client that starts `wakeful mcp` (the stdio bridge) to `url`, as Claude Code does."""
    params = StdioServerParameters(command=str(WAKEFUL), args=["mcp", "--url", url],
                                   env=clean_env(WAKEFUL_AGENT_TOKEN=token))
    return lambda: Client(params)


@contextlib.contextmanager
def echo_http() -> Iterator[tuple[str, int]]:
    """The bare echo server over streamable HTTP; yields its endpoint and PID."""
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
        yield f"http://127.0.0.1:{port}/mcp", echo_proc.pid
    finally:
        echo_proc.terminate()
        echo_proc.wait(timeout=10)


def figures(n: int) -> Measured:
    """Every series against one server and one echo server, interleaved."""
    echo_stdio = StdioServerParameters(command=sys.executable, args=[str(HERE / "_echo_mcp.py"), "stdio"],
                                       env=clean_env())
    with serve() as server, echo_http() as (echo_url, echo_pid):
        token = subprocess.run([str(WAKEFUL), "token"], env=clean_env(WAKEFUL_DATA_DIR=str(server.data_dir)),
                               capture_output=True, text=True, check=True).stdout.strip()

        def watch() -> dict[str, int]:
            found = {"wakeful serve": server.proc.pid, "echo server (HTTP)": echo_pid}
            for pid, command in children().items():
                if " mcp --url " in command:
                    found["bridge to echo" if echo_url in command else "bridge to wakeful"] = pid
                elif command.endswith("_echo_mcp.py stdio "):
                    found["echo server (stdio)"] = pid
            return found

        return asyncio.run(interleaved({
            "stdio task_status": (bridged(server.url, token), wakeful_task),
            "stdio echo": (lambda: Client(echo_stdio), echo_call),
            "stdio echo bridged": (bridged(echo_url, "unused"), echo_call),
            "http task_status": (http_client(f"{server.url}/mcp", token), wakeful_task),
            "http echo": (lambda: Client(echo_url), echo_call),
        }, n, watch))


CALLS_PER_PROCESS = {"wakeful serve": ("stdio task_status", "http task_status"),
                     "bridge to wakeful": ("stdio task_status",), "bridge to echo": ("stdio echo bridged",),
                     "echo server (HTTP)": ("stdio echo bridged", "http echo"), "echo server (stdio)": ("stdio echo",)}
"""Which series' calls each watched process served (its CPU is divided by their count)."""


def run(quick: bool) -> list[Table]:
    n = 60 if quick else 400
    load = os.getloadavg()[0]
    measured = figures(n)
    got = measured.samples
    rows = []
    for transport, ours, baselines in (
            ("stdio (through the bridge)", "stdio task_status", ("stdio echo", "stdio echo bridged")),
            ("streamable HTTP", "http task_status", ("http echo",))):
        for p in (50, 99):
            mine = percentile(got[ours], p)
            for baseline in baselines:
                theirs = percentile(got[baseline], p)
                label = "echo" if baseline.endswith("echo") else "echo through the bridge"
                rows.append(Row(f"{transport}: task_status p{p} vs {label}", fmt_ms(mine),
                                f"{fmt_ms(theirs)} ({fmt_ratio(mine / theirs)})",
                                "≤ 2x" if p == 50 else "-", verdict(mine <= 2 * theirs) if p == 50 else "-"))
    every = [Row(f"{name} p50 / p99", fmt_ms(percentile(values, 50)), fmt_ms(percentile(values, 99)))
             for name, values in got.items()]
    every += [Row(f"CPU per call: {name}", fmt_ms(seconds / (n * len(CALLS_PER_PROCESS[name]))), "-")
              for name, seconds in sorted(measured.cpu.items())]
    return [Table(title=f"MCP tool-call round trip, {n} calls each (baseline: a bare MCPServer echo tool)",
                  rows=rows, reproduce=reproduce("mcp_roundtrip.py", quick),
                  notes=["task_status reads a task's records from SQLite; echo does no work at all",
                         "stdio is `wakeful mcp`, the bridge to the server's /mcp; its baselines are the echo server "
                         "over plain stdio and the same echo server over HTTP through the same bridge",
                         "the five series are interleaved call by call, so each meets the same machine load",
                         f"load average when it started: {load:.2f} on {os.cpu_count()} CPUs"]),
            Table(title="Every series, and where the time goes (CPU time each process spent per call it served)",
                  rows=every, reproduce=reproduce("mcp_roundtrip.py", quick),
                  notes=["the client's own CPU (the SDK's) is in every series and in no row here",
                         "the HTTP echo server answers both `stdio echo bridged` and `http echo`; wakeful serve "
                         "answers both task_status series"])]


if __name__ == "__main__":
    args = bench_args(__doc__ or "")
    print_and_save(run(args.quick), "mcp_roundtrip.txt")
