"""HTTP/1.1 over asyncio streams with h11, name resolution after an allow, and the upstream keep-alive pool."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Final

import h11

from proxy.hosts import is_ip
from proxy.rewrite import HOP_BY_HOP

__all__ = ["H11Stream", "PoolKey", "Upstream", "UpstreamPool", "resolve", "response_headers"]

_READ: Final = 65536
_MAX_HEAD: Final = 64 * 1024

PoolKey = tuple[str, int, str, str]
"""(ip, port, scheme, TLS server name): a connection is only ever reused for the same destination and name."""


class H11Stream:
    """One h11 connection over a stream pair: the proxy's client side (SERVER role) or an upstream (CLIENT role)."""

    def __init__(self, role: type[h11.CLIENT] | type[h11.SERVER], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.conn = h11.Connection(role, max_incomplete_event_size=_MAX_HEAD)
        self.reader = reader
        self.writer = writer
        self.received = 0
        """Bytes received so far: whether a failed reused connection had answered anything."""
        self._out: list[bytes] = []

    async def next_event(self, idle: float) -> h11.Event:
        """The next event other than NEED_DATA; raises `TimeoutError`, `h11.RemoteProtocolError`, `OSError`."""
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]  # PAUSED only follows a complete message
            async with asyncio.timeout(idle):
                data = await self.reader.read(_READ)
            self.received += len(data)
            self.conn.receive_data(data)

    def send(self, event: h11.Event) -> None:
        """Queue an event's bytes; `flush` writes everything queued at once (one TLS record, one syscall)."""
        data = self.conn.send(event)
        if data:
            self._out.append(data)

    def flush(self) -> None:
        if self._out:
            self.writer.write(b"".join(self._out))
            self._out.clear()

    async def drain(self) -> None:
        self.flush()
        await self.writer.drain()

    def reusable(self) -> bool:
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    def close(self) -> None:
        self.writer.close()


def response_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers without hop-by-hop ones (and those its `Connection` names)."""
    nominated = {token.strip().lower() for name, value in headers if name.lower() == b"connection"
                 for token in value.split(b",")} - {b"content-length"}
    # X-Wakeful-Refusal is the proxy's own word that nothing was sent; an upstream must not be able to say it.
    drop = {h.encode("ascii") for h in HOP_BY_HOP} | nominated | {b"x-wakeful-refusal"}
    return [(name, value) for name, value in headers if name.lower() not in drop]


async def resolve(host: str, port: int, static: Mapping[str, Sequence[str]]) -> list[str]:
    """The addresses to dial for `host`: itself if an IP literal, else the static map, else DNS. Call only after
    an allow. Raises `OSError` when the name does not resolve."""
    if is_ip(host):
        return [host]
    answer = static.get(host)
    if answer is not None:
        return list(answer)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Upstream(H11Stream):
    def __init__(self, key: PoolKey, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(h11.CLIENT, reader, writer)
        self.key = key
        self.reused = False
        self.idle_since = 0.0

    def alive(self) -> bool:
        return not (self.writer.is_closing() or self.reader.at_eof())


class UpstreamPool:
    """Idle keep-alive connections to upstreams, so that keep-alive HTTPS pays for one handshake, not one each."""

    def __init__(self, tls: ssl.SSLContext, *, connect_timeout: float, handshake_timeout: float,
                 max_idle: int = 32, idle_seconds: float = 15.0) -> None:
        self._tls = tls
        self._connect_timeout = connect_timeout
        self._handshake_timeout = handshake_timeout
        self._max_idle = max_idle
        self._idle_seconds = idle_seconds
        self._idle: dict[PoolKey, list[Upstream]] = {}

    def take(self, ips: Sequence[str], port: int, scheme: str, host: str) -> Upstream | None:
        """An idle connection to one of `ips` for this name, if one is still open."""
        now = time.monotonic()
        for ip in ips:
            idle = self._idle.get((ip, port, scheme, host))
            while idle:
                upstream = idle.pop()
                if upstream.alive() and now - upstream.idle_since < self._idle_seconds:
                    upstream.reused = True
                    return upstream
                upstream.close()
        return None

    async def dial(self, ips: Sequence[str], port: int, scheme: str, host: str) -> Upstream:
        """A new connection to the first of `ips` that answers; TLS verified against `host`, never re-resolved.

        Raises `TimeoutError` when every address timed out, else the last `OSError` (`ssl.SSLError` included)."""
        error: OSError = OSError(f"no address to dial for {host}")
        for ip in ips:
            try:
                async with asyncio.timeout(self._connect_timeout + (self._handshake_timeout if scheme == "https"
                                                                    else 0)):
                    if scheme == "https":
                        reader, writer = await asyncio.open_connection(
                            ip, port, ssl=self._tls, server_hostname=host,
                            ssl_handshake_timeout=self._handshake_timeout)
                    else:
                        reader, writer = await asyncio.open_connection(ip, port)
            except OSError as exc:  # TimeoutError and ssl.SSLError included
                error = exc
                continue
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return Upstream((ip, port, scheme, host), reader, writer)
        raise error

    def give(self, upstream: Upstream) -> None:
        """Return a connection whose exchange completed cleanly; anything else is closed."""
        if not upstream.reusable() or not upstream.alive():
            upstream.close()
            return
        upstream.conn.start_next_cycle()
        upstream.idle_since = time.monotonic()
        idle = self._idle.setdefault(upstream.key, [])
        idle.append(upstream)
        if len(idle) > self._max_idle:
            idle.pop(0).close()

    def close(self) -> None:
        for idle in self._idle.values():
            for upstream in idle:
                upstream.close()
        self._idle.clear()
