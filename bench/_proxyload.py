"""The two ends of the proxy benchmark, each run as its own process by bench/proxy.py.

    python bench/_proxyload.py upstream HTTP_PORT HTTPS_PORT LEAF_PEM      # answers "ok" to anything, keep-alive
    python bench/_proxyload.py client SPEC_JSON                           # prints JSON results
    python bench/_proxyload.py decider SOCKET TOKEN_FILE CREDENTIAL        # allows everything, stores nothing

Both speak HTTP/1.1 over raw asyncio streams with the least parsing that is still correct for these fixed
exchanges, so neither end is the bottleneck the numbers end up describing.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import time
from pathlib import Path
from typing import Any

EXCHANGE_TIMEOUT = 10.0
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


# -- upstream -----------------------------------------------------------------------------------------------------


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if length:
                await reader.readexactly(length)
            writer.write(RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def upstream(http_port: int, https_port: int, leaf: str) -> None:
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(leaf)
    plain = await asyncio.start_server(_answer, "127.0.0.1", http_port)
    secure = await asyncio.start_server(_answer, "127.0.0.1", https_port, ssl=tls)
    async with plain, secure:
        await asyncio.gather(plain.serve_forever(), secure.serve_forever())


# -- client -------------------------------------------------------------------------------------------------------


class Target:
    """Where one kind of request goes: directly, or through a proxy (plain absolute-form, or a CONNECT tunnel)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.scheme: str = spec["scheme"]
        self.host: str = spec["host"]            # the name the upstream is addressed by
        self.port: int = spec["port"]
        self.proxy: int | None = spec.get("proxy")
        self.auth: str | None = spec.get("proxy_auth")
        self.tls: ssl.SSLContext | None = None
        if self.scheme == "https":
            self.tls = ssl.create_default_context(cafile=spec["cafile"])
        authority = f"{self.host}:{self.port}"
        auth = f"Proxy-Authorization: {self.auth}\r\n" if self.auth else ""
        if self.proxy and self.scheme == "http":
            self.request = f"GET http://{authority}/bench HTTP/1.1\r\nHost: {authority}\r\n{auth}\r\n".encode()
        else:
            self.request = f"GET /bench HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
        self.connect = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{auth}\r\n".encode()

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.proxy is None:
            return await asyncio.open_connection("127.0.0.1", self.port, ssl=self.tls,
                                                 server_hostname=self.host if self.tls else None)
        reader, writer = await asyncio.open_connection("127.0.0.1", self.proxy)
        if self.scheme == "https":
            writer.write(self.connect)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"CONNECT refused: {head[:200]!r}")
            await writer.start_tls(self.tls, server_hostname=self.host)  # type: ignore[arg-type]
        return reader, writer

    async def exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.wait_for(self._exchange(reader, writer), EXCHANGE_TIMEOUT)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"not 200: {head[:300]!r}")
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await reader.readexactly(length)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:  # a TLS peer may never answer our close_notify: do not wait for it
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (ConnectionError, ssl.SSLError, TimeoutError):
        pass


async def latency(target: Target, n: int, fresh: bool) -> list[float]:
    """One request at a time; seconds per request (a fresh connection's set-up is part of its request)."""
    samples: list[float] = []
    reader, writer = await target.open()
    await target.exchange(reader, writer)  # warm: the first connection pays for lazy set-up everywhere
    if fresh:
        await _close(writer)
    for _ in range(n):
        start = time.perf_counter()
        if fresh:
            reader, writer = await target.open()
        await target.exchange(reader, writer)
        if fresh:
            await _close(writer)
        samples.append(time.perf_counter() - start)
    if not fresh:
        await _close(writer)
    return samples


async def throughput(target: Target, connections: int, seconds: float, fresh: bool) -> dict[str, float]:
    done = errors = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        reader = writer = None
        while time.perf_counter() < deadline:
            try:
                if writer is None:
                    reader, writer = await target.open()
                assert reader is not None
                await target.exchange(reader, writer)
                done += 1
                if fresh:
                    await _close(writer)
                    writer = None
            except (OSError, RuntimeError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError):
                errors += 1
                writer = None
        if writer is not None:
            await _close(writer)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(connections)))
    return {"rate": done / (time.perf_counter() - start), "errors": errors}


async def client(spec: dict[str, Any]) -> dict[str, Any]:
    target = Target(spec["target"])
    if spec["kind"] == "latency":
        return {"samples": await latency(target, spec["n"], spec["fresh"])}
    return await throughput(target, spec["connections"], spec["seconds"], spec["fresh"])


# -- a decider that asks nothing ----------------------------------------------------------------------------------


async def trivial_decider(socket_path: str, token: str, credential: str) -> None:
    """wakeful's own decider channel (`proxy.channel.DeciderServer`) answering every request inline with an allow
    (the credential for HTTPS) and acknowledging audit records without storing them: what the proxy costs when the
    policy component costs nothing."""
    from wakeful.proxy.channel import DeciderServer
    from wakeful.proxy.contract import Allow, DecisionRequest, Verdict

    def allow(req: DecisionRequest) -> Verdict:
        return Allow(credential=credential if req.scheme == "https" else None, rule="always", attempt_id=None,
                     action_id=None)

    async def decide(req: DecisionRequest) -> Verdict:
        return allow(req)

    async def record(records: list[Any]) -> None:
        return None

    async with DeciderServer(socket_path, token, decide, record, decide_now=allow):
        await asyncio.Event().wait()


if __name__ == "__main__":
    if sys.argv[1] == "decider":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `proxy`
        asyncio.run(trivial_decider(sys.argv[2], Path(sys.argv[3]).read_text().strip(), sys.argv[4]))
    elif sys.argv[1] == "upstream":
        asyncio.run(upstream(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
    else:
        print(json.dumps(asyncio.run(client(json.loads(sys.argv[2])))))
