"""Open-loop HTTP load generator: a constant offered rate, latency measured from each request's intended send time.

Run as its own process (`open_loop` below starts it) so the client never shares the server's GIL or core time
slices with the code under test. Request i is *intended* at `t0 + i / rate`; it waits in a queue until one of the
keep-alive connections is free, and its latency runs from the intended time to the last byte of the response.
A slow server therefore shows up as queueing in the latency instead of silently lowering the offered rate
(no coordinated omission). The generator's own lag (dispatch time - intended time) is reported so a generator
that cannot keep up is visible rather than blamed on the server.

Raw HTTP/1.1 over asyncio streams (uvloop when available): an HTTP client library costs more CPU per request than
the server's no-op endpoint, which would make the baseline measure the client.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

__all__ = ["LoadResult", "LoadSpec", "open_loop"]


@dataclass(frozen=True)
class LoadSpec:
    host: str
    port: int
    path: str
    body: str
    headers: dict[str, str]
    rate: float
    duration: float
    warmup: float = 1.0
    connections: int = 64
    per_request: list[dict[str, str]] = field(default_factory=list)
    """Headers for request i alone (a webhook's own delivery ID and signature), one per request; none: all alike."""
    drain_timeout: float = 15.0

    @property
    def total(self) -> int:
        """How many requests the phase sends, warm-up included."""
        return int((self.warmup + self.duration) * self.rate)


@dataclass
class LoadResult:
    offered: float
    sent: int = 0  # measured requests (after warm-up) that were dispatched
    ok: int = 0  # 2xx
    failed: int = 0  # non-2xx or connection errors
    unfinished: int = 0  # no answer within the drain timeout
    achieved: float = 0.0  # measured 2xx responses per second of the measuring window
    latencies: list[float] = field(default_factory=list)  # seconds, from intended send time
    lag: list[float] = field(default_factory=list)  # seconds the generator dispatched late


def _request_bytes(spec: LoadSpec, own: dict[str, str]) -> bytes:
    body = spec.body.encode()
    headers = {"Host": f"{spec.host}:{spec.port}", "Content-Type": "application/json",
               "Content-Length": str(len(body)), **spec.headers, **own}
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"POST {spec.path} HTTP/1.1\r\n{head}\r\n".encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status


class _Run:
    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
        self.result = LoadResult(offered=spec.rate)
        self.t_measure = 0.0
        self.t_end = 0.0
        self.last_done = 0.0
        if spec.per_request and len(spec.per_request) != spec.total:
            raise ValueError(f"{len(spec.per_request)} per-request headers for {spec.total} requests")
        # Built before the clock starts, so the generator's per-request cost is a list lookup.
        self.requests = [_request_bytes(spec, own) for own in spec.per_request]
        self.fixed = _request_bytes(spec, {})

    async def connection(self) -> None:
        reader, writer = await asyncio.open_connection(self.spec.host, self.spec.port)
        try:
            while (item := await self.queue.get()) is not None:
                await self._one(reader, writer, *item)
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int, intended: float) -> None:
        writer.write(self.requests[i] if self.requests else self.fixed)
        try:
            status = await _read_response(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            status = 0
        done = time.perf_counter()
        if intended >= self.t_measure:  # warm-up (connections, caches, first batches) is not what we measure
            if 200 <= status < 300:
                self.result.ok += 1
                self.result.latencies.append(done - intended)
                self.last_done = max(self.last_done, done)
            else:
                self.result.failed += 1
        if status == 0:
            raise ConnectionError("the server closed the connection")  # this connection is done; others go on

    async def schedule(self, t0: float) -> None:
        """Enqueue request i at t0 + i/rate; a late wake-up enqueues every request that became due meanwhile."""
        spec, i = self.spec, 0
        total = spec.total
        while i < total:
            now = time.perf_counter()
            while i < total and t0 + i / spec.rate <= now:
                intended = t0 + i / spec.rate
                if intended >= self.t_measure:
                    self.result.sent += 1
                    self.result.lag.append(now - intended)
                self.queue.put_nowait((i, intended))
                i += 1
            if i < total:
                await asyncio.sleep(max(0.0, t0 + i / spec.rate - time.perf_counter()))

    async def run(self) -> LoadResult:
        spec = self.spec
        workers = [asyncio.create_task(self.connection()) for _ in range(spec.connections)]
        await asyncio.sleep(0.2)  # let the connections open before the clock starts
        t0 = time.perf_counter()
        self.t_measure = t0 + spec.warmup
        self.t_end = self.t_measure + spec.duration
        await self.schedule(t0)
        for _ in workers:
            self.queue.put_nowait(None)
        done, pending = await asyncio.wait(workers, timeout=spec.drain_timeout)
        for task in pending:
            task.cancel()
        self.result.unfinished = self.result.sent - self.result.ok - self.result.failed
        window = max(self.t_end, self.last_done) - self.t_measure
        self.result.achieved = self.result.ok / window if window > 0 else 0.0
        return self.result


def open_loop(spec: LoadSpec) -> LoadResult:
    """Run one open-loop phase in a child process and return its result."""
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(asdict(spec)), capture_output=True,
                          text=True, check=False, timeout=spec.warmup + spec.duration + spec.drain_timeout + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return LoadResult(**json.loads(proc.stdout))


def _main() -> None:
    spec = LoadSpec(**json.loads(sys.stdin.read()))
    gc.disable()  # a collection pause would show up as dispatch lag; the process is short-lived
    try:
        import uvloop  # a faster event loop keeps the generator's own lag well under the server's latency
    except ImportError:
        result = asyncio.run(_Run(spec).run())
    else:
        result = uvloop.run(_Run(spec).run())
    json.dump(asdict(result), sys.stdout)


if __name__ == "__main__":
    _main()
