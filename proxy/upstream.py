"""HTTP/1.1 over asyncio streams: h11 for clients, llhttp (`httptools`) for upstream responses; name resolution
after an allow; the upstream keep-alive pool."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Final, Literal

import h11
import httptools

from wakeful.proxy.contract import REFUSAL_HEADER
from wakeful.proxy.hosts import is_ip
from wakeful.proxy.rewrite import HOP_BY_HOP

__all__ = ["DeadlinePassed", "Framing", "H11Stream", "PoolKey", "ResponseHead", "Upstream", "UpstreamPool", "resolve",
           "response_headers", "serialize_request"]

_READ: Final = 65536
_MAX_HEAD: Final = 64 * 1024

PoolKey = tuple[str, int, str, str]
"""(ip, port, scheme, TLS server name): a connection is only ever reused for the same destination and name."""


class DeadlinePassed(TimeoutError):
    """A client did not send its whole request head or body in time (not merely: it went quiet)."""


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
        self.answered = False
        """The response went out as bytes written past h11 (see `write_raw`): h11's own state no longer tells."""
        self.head_start = bytearray()
        """The first bytes of the request head being read, up to its first line's end (or 64 KiB): h11 drops a head
        it refuses, and the audit still names that request's method and target (`wire.read_request_line`)."""

    async def next_event(self, idle: float, *, deadline: float | None = None) -> h11.Event:
        """The next event other than NEED_DATA, each read within `idle` seconds and all of them before `deadline`
        (the loop's clock). Raises `DeadlinePassed`, `TimeoutError`, `h11.RemoteProtocolError`, `OSError`."""
        loop = asyncio.get_running_loop()
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]  # PAUSED only follows a complete message
            await self._receive(idle if deadline is None else min(idle, deadline - loop.time()), deadline)

    async def next_head(self, idle: float, whole: float) -> h11.Event:
        """The next request head: waiting for its first byte takes up to `idle` (a kept-alive connection between
        requests); from that byte on, the whole head must be in within `whole` seconds, however short each pause.
        Raises `DeadlinePassed` once any of the head arrived and it is late, else as `next_event`."""
        loop = asyncio.get_running_loop()
        buffered = self.conn.trailing_data[0]
        deadline = loop.time() + whole if buffered else None
        self.head_start.clear()
        self._keep_head_start(buffered)
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            if deadline is None:
                self._keep_head_start(await self._receive(idle, None))
                deadline = loop.time() + whole
            else:
                self._keep_head_start(await self._receive(min(idle, deadline - loop.time()), deadline))

    def _keep_head_start(self, data: bytes) -> None:
        if b"\n" not in self.head_start and len(self.head_start) < _MAX_HEAD:
            self.head_start += data[:_MAX_HEAD - len(self.head_start)]

    async def _receive(self, wait: float, deadline: float | None) -> bytes:
        if wait <= 0:
            raise DeadlinePassed()
        try:
            async with asyncio.timeout(wait):
                data = await self.reader.read(_READ)
        except TimeoutError:
            if deadline is not None:
                raise DeadlinePassed() from None
            raise
        self.received += len(data)
        self.conn.receive_data(data)
        return data

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

    def write_raw(self, data: bytes) -> None:
        """Write response bytes without h11: the caller frames them. After this, only `start_next_cycle` or a
        close; `answer_error` no longer answers."""
        self.answered = True
        self.writer.write(data)

    def reusable(self) -> bool:
        return self.conn.their_state is h11.DONE and (self.answered or self.conn.our_state is h11.DONE)

    def start_next_cycle(self) -> None:
        """Ready for the client's next request: h11's own cycle, or a fresh parser fed what it had buffered."""
        if not self.answered:
            self.conn.start_next_cycle()
            return
        data, closed = self.conn.trailing_data
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        self.answered = False
        if data:
            self.conn.receive_data(data)
        if closed:
            self.conn.receive_data(b"")

    def close(self) -> None:
        self.writer.close()


# The refusal header is the proxy's own word that nothing was sent; an upstream must not be able to say it.
_ALWAYS_DROPPED: Final = frozenset({h.encode("ascii") for h in HOP_BY_HOP} | {REFUSAL_HEADER.lower().encode("ascii")})


def response_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers without hop-by-hop ones (and those its `Connection` names)."""
    nominated = {token.strip().lower() for name, value in headers if name.lower() == b"connection"
                 for token in value.split(b",")} - {b"content-length"}
    drop = _ALWAYS_DROPPED | nominated
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


class ResponseHead:
    """The status line and headers of one upstream response, and how its body is framed."""

    __slots__ = ("status", "reason", "headers", "framing")

    def __init__(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], framing: Framing) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.framing = framing


Framing = Literal["none", "length", "chunked", "close"]
"""How an upstream response body ends: not at all (HEAD, 1xx, 204, 304), after Content-Length bytes, at the last
chunk, or when the upstream closes."""

_FIELD_NAME: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE: Final = re.compile(rb"(?:[\x21-\x7e\x80-\xff](?:[ \t\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?")
_TARGET: Final = re.compile(rb"[\x21-\x7e]+")
_REASON: Final = re.compile(rb"[ \t\x21-\x7e\x80-\xff]*")


def serialize_request(method: bytes, target: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
    """An HTTP/1.1 request's bytes. Raises `ValueError` (without quoting anything: values can hold secrets) for
    a method, target, header name or value that cannot be written as it is: the same grammar h11 enforces."""
    if not _FIELD_NAME.fullmatch(method) or not _TARGET.fullmatch(target):
        raise ValueError("the request line cannot be written as it is")
    parts = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        if not _FIELD_NAME.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise ValueError("a header cannot be written as it is")
        parts += (name, b": ", value, b"\r\n")
    parts += (b"\r\n", body)
    return b"".join(parts)


class _Parsed:
    """httptools' callbacks for one upstream connection: what llhttp has parsed and not yet been taken."""

    __slots__ = ("parser", "status", "reason", "headers", "head_done", "keep_alive", "body", "complete", "extra")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.reason = bytearray()
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.keep_alive = False
        """llhttp's word, read once the head is parsed: it forgets it when the message completes."""
        self.body: list[bytes] = []
        self.complete = False
        self.extra = False
        """Bytes after the response: the upstream is not speaking HTTP the way we asked, never reused."""

    def on_message_begin(self) -> None:
        if not self.complete:
            return
        if self.status >= 200:
            self.extra = True
            return
        # The final response after a 1xx one (a 100 Continue: the body was already sent, so it is skipped).
        self.status, self.reason, self.headers = 0, bytearray(), []
        self.head_done = self.complete = False

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # trailers after a chunked body are dropped, as hop-by-hop
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.head_done = True
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class Upstream:
    """One connection to an upstream: requests written as bytes, responses parsed by llhttp (`httptools`)."""

    def __init__(self, key: PoolKey, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.key = key
        self.reader = reader
        self.writer = writer
        self.reused = False
        self.idle_since = 0.0
        self.received = 0
        """Bytes received so far: whether a failed reused connection had answered anything."""
        self._parsed = _Parsed()
        self._framing: Framing | None = None
        self._done = False
        self._unproductive = 0
        """Bytes read in a row that held no body: chunk sizes, extensions and trailers are bounded like a head."""

    async def request(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def _feed(self, wait: float) -> bool:
        """Read and parse once; False at EOF. Raises `TimeoutError`, `OSError`, `httptools.HttpParserError`."""
        async with asyncio.timeout(wait):
            data = await self.reader.read(_READ)
        if not data:
            return False
        self.received += len(data)
        try:
            self._parsed.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # an unasked-for 101 included
            raise ValueError(f"the upstream's answer is not well-formed HTTP/1.1: {type(exc).__name__}") from None
        return True

    async def response_head(self, wait: float, *, head_request: bool) -> ResponseHead:
        """The next final response's head (1xx are skipped: the body is already sent). Raises `TimeoutError`,
        `OSError` (`ConnectionResetError` for a close before or a 101 in place of an answer), `ValueError`
        (`httptools.HttpParserError` included) for an answer that is not well-formed."""
        parsed = self._parsed
        start = self.received
        while not (parsed.head_done and parsed.status >= 200):
            if parsed.status == 101:
                raise ConnectionResetError("the upstream switched protocols unasked")
            # llhttp buffers a header line it has not finished: the bytes read, not those parsed, are bounded.
            if self.received - start > _MAX_HEAD:
                raise ValueError("the upstream's response head is too large")
            if not await self._feed(wait):
                raise ConnectionResetError("the upstream closed before answering")
        status = parsed.status
        if len(parsed.reason) + sum(len(n) + len(v) for n, v in parsed.headers) > _MAX_HEAD:
            raise ValueError("the upstream's response head is too large")
        reason = bytes(parsed.reason)
        if not _REASON.fullmatch(reason):
            reason = b""
        te: bytes | None = None
        length = False
        for name, value in parsed.headers:
            if not _FIELD_NAME.fullmatch(name) or not _FIELD_VALUE.fullmatch(value.strip(b" \t")):
                raise ValueError("an upstream response header cannot be forwarded as it is")
            lowered = name.lower()
            if lowered == b"transfer-encoding":
                te = value if te is None else te + b"," + value
            elif lowered == b"content-length":
                length = True
        framing: Framing
        if head_request or status in (204, 304):
            framing = "none"
        elif te is not None:
            framing = "chunked" if te.rsplit(b",", 1)[-1].strip().lower() == b"chunked" else "close"
        elif length:
            framing = "length"
        else:
            framing = "close"
        if framing == "none" and not parsed.complete:
            # llhttp does not know this answered a HEAD: it expects the body its Content-Length announces.
            if head_request and not parsed.body:
                parsed.complete = True
            else:
                raise ValueError("a response that has no body carried one")
        self._framing = framing
        return ResponseHead(status, reason, [(n, v.strip(b" \t")) for n, v in parsed.headers], framing)

    def take_body(self) -> list[bytes]:
        """The body bytes parsed and not yet taken."""
        chunks, self._parsed.body = self._parsed.body, []
        return chunks

    @property
    def complete(self) -> bool:
        return self._parsed.complete

    async def read_more(self, wait: float) -> None:
        """Read once more of the body. Raises `TimeoutError`, `OSError` (`ConnectionResetError` for a close
        before the body's end), `ValueError` (`httptools.HttpParserError` included)."""
        before = self.received
        if not await self._feed(wait):
            if self._framing != "close":
                raise ConnectionResetError("the upstream closed mid-response")
            self._parsed.complete = True
            self._done = True  # close-delimited: the close was the body's end
        elif self._parsed.body:
            self._unproductive = 0
        else:
            self._unproductive += self.received - before
            if self._unproductive > _MAX_HEAD:
                raise ValueError("the upstream sends framing without a body")

    def reusable(self) -> bool:
        parsed = self._parsed
        return (parsed.complete and not parsed.extra and not self._done and self._framing != "close"
                and parsed.keep_alive)

    def start_next_cycle(self) -> None:
        self._parsed = _Parsed()
        self._framing = None
        self._unproductive = 0

    def alive(self) -> bool:
        return not (self.writer.is_closing() or self.reader.at_eof())

    def close(self) -> None:
        self.writer.close()


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
        upstream.start_next_cycle()
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
