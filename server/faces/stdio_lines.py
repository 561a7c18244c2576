"""Newline-delimited messages on this process's stdin and stdout, read and written on the event loop.

What `wakeful mcp` (`server.faces.bridge`) speaks to the MCP client that started it. A pipe, socket or terminal is
read and written by the event loop itself, with no thread per line; anything else (a regular file, `/dev/null`,
which the loop cannot wait on) is read in a worker thread and written directly. While open, fd 1 points at stderr so
a stray print misses the wire, as the `mcp` SDK's stdio transport does; it is restored on exit.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Final

__all__ = ["StdioLines"]

CHUNK: Final = 1 << 16
FLUSH_TIMEOUT: Final = 10.0
"""Seconds the last lines may take to reach the client at exit before the bridge gives up on a reader gone deaf."""


def _pollable(fd: int) -> bool:
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or (stat.S_ISCHR(mode) and os.isatty(fd))


class _Closed(asyncio.Protocol):
    def __init__(self) -> None:
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class StdioLines:
    """Lines in from stdin, lines out to stdout (each write one whole line, so concurrent writers never interleave)."""

    def __init__(self, read: Callable[[], Awaitable[bytes]], write: Callable[[bytes], None]) -> None:
        self._read = read
        self._write = write

    @classmethod
    @asynccontextmanager
    async def open(cls) -> AsyncIterator[StdioLines]:
        loop = asyncio.get_running_loop()
        saved, wire = os.dup(1), os.dup(1)
        os.dup2(2, 1)
        closers: list[Callable[[], Awaitable[None]]] = []
        try:
            if _pollable(0):
                reader = asyncio.StreamReader(limit=CHUNK, loop=loop)
                transport_in, _ = await loop.connect_read_pipe(
                    lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(0, "rb", closefd=False))

                async def close_in() -> None:
                    transport_in.close()

                closers.append(close_in)
                read: Callable[[], Awaitable[bytes]] = lambda: reader.read(CHUNK)  # noqa: E731
            else:
                read = lambda: loop.run_in_executor(None, os.read, 0, CHUNK)  # noqa: E731
            if _pollable(wire):
                transport_out, protocol = await loop.connect_write_pipe(_Closed, os.fdopen(wire, "wb"))

                async def close_out() -> None:
                    transport_out.close()  # after what is buffered went out
                    await asyncio.wait_for(protocol.closed, FLUSH_TIMEOUT)

                closers.append(close_out)
                write: Callable[[bytes], None] = transport_out.write
            else:
                closers.append(lambda: asyncio.to_thread(os.close, wire))
                write = lambda data: _write_all(wire, data)  # noqa: E731
            yield cls(read, write)
        finally:
            for close in closers:
                try:
                    await close()
                except (OSError, TimeoutError):
                    pass
            os.dup2(saved, 1)
            os.close(saved)

    async def lines(self) -> AsyncIterator[bytes]:
        """Each non-blank line of stdin, without its newline, until stdin closes."""
        pending: list[bytes] = []
        while chunk := await self._read():
            if b"\n" not in chunk:
                pending.append(chunk)
                continue
            first, *rest = chunk.split(b"\n")
            lines = [b"".join([*pending, first]), *rest[:-1]]
            pending = [rest[-1]] if rest[-1] else []
            for line in lines:
                if line.strip():
                    yield line
        if (last := b"".join(pending)).strip():
            yield last

    def write(self, line: bytes) -> None:
        """One line to stdout (the newline is added here)."""
        self._write(line + b"\n")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
