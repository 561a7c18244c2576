"""The server name a TLS ClientHello asks for, read from the client's first bytes without any I/O (sans-IO).

Used on tunnels the proxy does not intercept (`egress_no_intercept`): before relaying anything, the proxy reads the
ClientHello and checks its server name against the CONNECT target, so that `CONNECT pinned.test:443` cannot carry
a handshake for another name to that address (domain fronting). Feed `client_hello_sni` everything received so
far: it answers `NEED_MORE`, or a `ClientHello` with the name (None when the client sent none), or raises
`MalformedHello` for anything that is not a well-formed TLS ClientHello (RFC 8446 §4.1.2, RFC 6066 §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_HELLO_BYTES", "NEED_MORE", "ClientHello", "MalformedHello", "client_hello_sni"]

MAX_HELLO_BYTES: Final = 64 * 1024
"""A ClientHello larger than this is refused (a post-quantum key share makes one ~1.8 KB; the limit is generous)."""

_HANDSHAKE: Final = 22
_CLIENT_HELLO: Final = 1
_SERVER_NAME: Final = 0
_HOST_NAME: Final = 0
_MAX_RECORD: Final = 2**14


class MalformedHello(ValueError):
    """The bytes are not a well-formed TLS ClientHello: the tunnel is closed, nothing relayed."""


class _NeedMore:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_MORE"


NEED_MORE: Final = _NeedMore()
"""Not enough bytes yet to read the whole ClientHello."""


@dataclass(frozen=True, slots=True)
class ClientHello:
    sni: str | None
    """The host_name of the server_name extension, as sent (ASCII); None without the extension."""


class _Reader:
    """Bounds-checked reads over one handshake message: running past its end is malformed, never an IndexError."""

    __slots__ = ("data", "pos", "end")

    def __init__(self, data: bytes, pos: int = 0, end: int | None = None) -> None:
        self.data, self.pos, self.end = data, pos, len(data) if end is None else end

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise MalformedHello("a field runs past the end of its enclosing structure")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def vector(self, length_bytes: int) -> _Reader:
        size = self.uint(length_bytes)
        start = self.pos
        self.take(size)
        return _Reader(self.data, start, start + size)

    @property
    def left(self) -> int:
        return self.end - self.pos


def _handshake_bytes(data: bytes) -> bytes | _NeedMore:
    """The ClientHello handshake message, reassembled from as many records as it spans."""
    message = bytearray()
    pos = 0
    while True:
        if len(data) - pos < 5:
            return NEED_MORE
        content_type, major, length = data[pos], data[pos + 1], int.from_bytes(data[pos + 3:pos + 5], "big")
        if content_type != _HANDSHAKE:
            raise MalformedHello("the client's first record is not a handshake")
        if major != 3:
            raise MalformedHello("not a TLS record")
        if not 0 < length <= _MAX_RECORD:
            raise MalformedHello("a handshake record of an impossible length")
        if len(data) - pos - 5 < length:
            return NEED_MORE
        message += data[pos + 5:pos + 5 + length]
        pos += 5 + length
        if len(message) >= 4:
            if message[0] != _CLIENT_HELLO:
                raise MalformedHello("the client's first handshake message is not a ClientHello")
            size = int.from_bytes(message[1:4], "big")
            if size + 4 > MAX_HELLO_BYTES:
                raise MalformedHello("the ClientHello is too large")
            if len(message) >= size + 4:
                return bytes(message[4:size + 4])
        if pos > MAX_HELLO_BYTES:
            raise MalformedHello("the ClientHello is too large")


def _server_name(extension: _Reader) -> str:
    names = extension.vector(2)
    if extension.left:
        raise MalformedHello("bytes after the server_name list")
    found: str | None = None
    while names.left:
        kind = names.uint(1)
        name = names.vector(2)
        raw = name.take(name.left)
        if kind != _HOST_NAME:
            continue  # no other name type is defined; ignored as RFC 6066 asks
        if found is not None:
            raise MalformedHello("more than one host_name in server_name")
        if not raw or not all(0x21 <= b <= 0x7E for b in raw):
            raise MalformedHello("a host_name that is not printable ASCII")
        found = raw.decode("ascii")
    if found is None:
        raise MalformedHello("a server_name extension without a host_name")
    return found


def client_hello_sni(data: bytes) -> ClientHello | _NeedMore:
    """Read the ClientHello at the start of `data`. Raises `MalformedHello`; bytes after the ClientHello are the
    caller's (they are relayed with it)."""
    body = _handshake_bytes(data)
    if isinstance(body, _NeedMore):
        return body
    hello = _Reader(body)
    hello.take(2 + 32)  # legacy_version, random
    session = hello.vector(1)
    if session.left > 32:
        raise MalformedHello("a session id longer than 32 bytes")
    suites = hello.vector(2)
    if suites.left < 2 or suites.left % 2:
        raise MalformedHello("cipher suites of an impossible length")
    if hello.vector(1).left < 1:
        raise MalformedHello("no compression method")
    if not hello.left:
        return ClientHello(sni=None)  # no extensions at all (TLS 1.2 and older may omit them)
    extensions = hello.vector(2)
    if hello.left:
        raise MalformedHello("bytes after the extensions")
    seen: set[int] = set()
    sni: str | None = None
    while extensions.left:
        kind = extensions.uint(2)
        data_of = extensions.vector(2)
        if kind in seen:
            raise MalformedHello("an extension sent twice")
        seen.add(kind)
        if kind == _SERVER_NAME:
            sni = _server_name(data_of)
    return ClientHello(sni=sni)
