"""The HTTP/1.1 client of `wakeful mcp` (`server.faces.bridge`): kept-alive connections to the one server it was
given, each request written in one piece, each response's body read as it arrives.

Why not httpx: in the bridge an `httpx2` request cost ~2.4 ms of CPU against ~0.4 ms here on the same (loaded)
machine (`bench/mcp_roundtrip.py` and its notes), and it sent a request's head and body as two TCP segments, which the
server then parsed in two passes. The bridge needs little of HTTP: `POST`, `GET` and `DELETE` to a single origin, a
body framed by `Content-Length`, `chunked` or the connection's end, and a bearer header on every request.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

__all__ = ["HttpClient", "Response", "TransportError"]

LINE_LIMIT: Final = 1 << 20
"""Bytes a status or header line (or a chunk-size line) may take before the answer is taken as broken."""
IDLE_KEPT: Final = 8
"""Idle connections kept for reuse; more are closed when they come back."""


class TransportError(Exception):
    """The server could not be reached, or what it sent was not an HTTP answer; the text says which."""


@dataclass(eq=False)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        self.writer.close()

    @property
    def stale(self) -> bool:
        return self.reader.at_eof() or self.writer.is_closing()


class Response:
    """A response's status and headers (names in lower case), and its body to be read once."""

    def __init__(self, status: int, headers: dict[str, str], conn: _Connection, read_timeout: float, *,
                 no_body: bool) -> None:
        self.status = status
        self.headers = headers
        self._conn = conn
        self._timeout = read_timeout
        self._done = no_body
        self.keep = headers.get("connection", "").lower() != "close"

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as the server sends it."""
        reader, framing = self._conn.reader, self.headers.get("transfer-encoding", "").lower()
        try:
            if self._done:
                return
            if "chunked" in framing:
                while size := await self._chunk_size():
                    yield await self._exactly(size)
                    await self._exactly(2)
                while (await self._line()).strip():  # trailers, then the blank line that ends them
                    pass
            elif (length := self.headers.get("content-length")) is not None:
                left = int(length)
                while left > 0:
                    async with asyncio.timeout(self._timeout):
                        piece = await reader.read(min(left, 1 << 16))
                    if not piece:
                        raise TransportError("the server closed the connection in the middle of an answer")
                    left -= len(piece)
                    yield piece
            else:  # the body ends with the connection
                self.keep = False
                while True:
                    async with asyncio.timeout(self._timeout):
                        piece = await reader.read(1 << 16)
                    if not piece:
                        break
                    yield piece
            self._done = True
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError) as exc:
            raise TransportError(_why(exc)) from None

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    @property
    def reusable(self) -> bool:
        return self._done and self.keep

    async def _line(self) -> bytes:
        async with asyncio.timeout(self._timeout):
            return await self._conn.reader.readuntil(b"\n")

    async def _exactly(self, size: int) -> bytes:
        async with asyncio.timeout(self._timeout):
            return await self._conn.reader.readexactly(size)

    async def _chunk_size(self) -> int:
        return int((await self._line()).split(b";", 1)[0].strip(), 16)


class HttpClient:
    """Requests to one URL's origin, with `headers` on each, over kept-alive connections."""

    def __init__(self, url: str, headers: dict[str, str], *, connect_timeout: float = 30.0,
                 read_timeout: float = 300.0) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        default_port = self.port == (443 if parts.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._base = {"host": host if default_port else f"{host}:{self.port}", **headers}
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._idle: list[_Connection] = []

    @asynccontextmanager
    async def request(self, method: str, headers: dict[str, str], body: bytes = b"", *,
                      within: float | None = None) -> AsyncIterator[Response]:
        """Send a request; the response's body is left to read. `within` replaces both timeouts (seconds). A
        kept-alive connection the server had already closed is replaced once (nothing of the answer had come, so the
        request was not taken)."""
        fields = {**self._base, **headers}
        if body or method in ("POST", "PUT"):
            fields["content-length"] = str(len(body))
        head = f"{method} {self.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
        message = head.encode("latin-1") + body
        read_timeout = within if within is not None else self._read_timeout
        for attempt in range(2):
            conn, reused = await self._take(within)
            try:
                conn.writer.write(message)
                await conn.writer.drain()
                async with asyncio.timeout(read_timeout):
                    status_line = await conn.reader.readuntil(b"\n")
                    response_headers = await _headers(conn.reader)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError) as exc:
                conn.close()
                if reused and attempt == 0 and isinstance(exc, (OSError, asyncio.IncompleteReadError)):
                    continue
                raise TransportError(_why(exc)) from None
            except BaseException:  # cancelled half way: the connection is in an unknown state
                conn.close()
                raise
            break
        try:
            status = int(status_line.split(None, 2)[1])
        except (IndexError, ValueError):
            conn.close()
            raise TransportError(f"the server's answer is not HTTP: {status_line[:80]!r}") from None
        response = Response(status, response_headers, conn, read_timeout,
                            no_body=method == "HEAD" or status in (204, 304) or 100 <= status < 200)
        try:
            yield response
        finally:
            if response.reusable and len(self._idle) < IDLE_KEPT:
                self._idle.append(conn)
            else:
                conn.close()

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def _take(self, within: float | None) -> tuple[_Connection, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.stale:
                return conn, True
            conn.close()
        try:
            async with asyncio.timeout(within if within is not None else self._connect_timeout):
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self._tls, limit=LINE_LIMIT,
                    server_hostname=self.host if self._tls else None)
        except (OSError, TimeoutError) as exc:
            raise TransportError(_why(exc)) from None
        return _Connection(reader, writer), False


async def _headers(reader: asyncio.StreamReader) -> dict[str, str]:
    headers: dict[str, str] = {}
    while (line := await reader.readuntil(b"\n")) not in (b"\r\n", b"\n"):
        name, colon, value = line.decode("latin-1").partition(":")
        if not colon:
            raise ValueError(f"a header line without a colon: {line[:80]!r}")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return headers


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the server closed the connection"
    return str(exc) or type(exc).__name__
