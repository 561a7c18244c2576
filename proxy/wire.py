"""Pure readings of what a client puts on the request line and in the proxy's own headers, and the refusal answer.

No I/O: the proxy server calls these with text it already parsed with h11. Every function raises `HeaderRejected`
(code `header_mismatch`) for anything it cannot read without guessing.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import traceback
from dataclasses import dataclass
from typing import Final

from wakeful.proxy.contract import RefusalCode
from wakeful.proxy.hosts import default_port, parse_authority
from wakeful.proxy.rewrite import ATTEMPT_HEADER, HeaderRejected

__all__ = [
    "ANONYMOUS",
    "describe",
    "REQUEST_TOO_LARGE",
    "UPSTREAM_FAILED",
    "UPSTREAM_TIMEOUT",
    "Identity",
    "IdentityChanged",
    "RequestLine",
    "Target",
    "attempt_token",
    "error_body",
    "head_problem",
    "parse_connect_target",
    "parse_proxy_authorization",
    "parse_target",
    "read_request_line",
    "refusal_response",
    "refusal_status",
    "settle_identity",
]

_ABSOLUTE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)([^#]*)")
_LIMIT: Final = 256
_ATTEMPT: Final = ATTEMPT_HEADER.lower()


@dataclass(frozen=True, kw_only=True)
class Identity:
    """Who a tool-computer client says it is, from `Proxy-Authorization: Basic base64(user_id:token)`."""

    user_id: str | None
    token: str | None

    def __repr__(self) -> str:  # the token is a credential: never printed
        return f"Identity(user_id={self.user_id!r})"


ANONYMOUS: Final = Identity(user_id=None, token=None)


def _printable(text: str) -> bool:
    return 0 < len(text) <= _LIMIT and text.isprintable()


def parse_proxy_authorization(values: list[str]) -> Identity:
    """The identity in the Proxy-Authorization header values (none: anonymous; more than one: rejected)."""
    if not values:
        return ANONYMOUS
    if len(values) > 1:
        raise HeaderRejected("more than one Proxy-Authorization header")
    scheme, _, param = values[0].strip().partition(" ")
    if scheme.lower() != "basic":
        raise HeaderRejected("Proxy-Authorization must use the Basic scheme")
    try:
        decoded = base64.b64decode(param.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        raise HeaderRejected("Proxy-Authorization is not base64 of user_id:token") from None
    user_id, colon, token = decoded.partition(":")
    if not colon or not _printable(user_id) or not _printable(token):
        raise HeaderRejected("Proxy-Authorization must carry a printable user_id:token")
    return Identity(user_id=user_id, token=token)


class IdentityChanged(HeaderRejected):
    """A request on a plain-HTTP connection that presents another identity than the connection's first request."""

    def __init__(self) -> None:
        super().__init__("this connection already speaks for another Proxy-Authorization identity; "
                         "open a new connection for another one")


def settle_identity(settled: Identity | None, presented: Identity) -> Identity:
    """The identity one request on a plain-HTTP client connection acts under.

    The connection's first request settles it (`settled` is None then): whatever it presents, anonymous included.
    A later request without Proxy-Authorization acts under the settled identity; one presenting the same acts
    under it too; one presenting another (or any, on a connection settled as anonymous) raises `IdentityChanged`.
    A guest's forward inserts the credential after the first request line of each connection only: this is what
    lets its later keep-alive requests speak for it, and nothing else."""
    if settled is None or presented == settled:
        return presented
    if presented == ANONYMOUS:
        return settled
    raise IdentityChanged()


def attempt_token(headers: list[tuple[str, str]]) -> str | None:
    """The `X-Wakeful-Attempt` value (any casing), None without one; two of them are rejected."""
    values = [value.strip() for name, value in headers if name.lower() == _ATTEMPT]
    if len(values) > 1:
        raise HeaderRejected(f"more than one {ATTEMPT_HEADER} header")
    if values and not _printable(values[0]):
        raise HeaderRejected(f"the {ATTEMPT_HEADER} header must be printable")
    return values[0] if values else None


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where a request goes: normalised host, port, path without the query, and the query without its `?`."""

    host: str | None
    """None for origin-form (`/path`): the tunnel's CONNECT target names the host."""
    port: int | None
    path: str
    query: str


def parse_target(target: str, *, in_tunnel: bool) -> Target:
    """The request target: absolute-form `http://…` outside a tunnel, origin-form `/…` inside one.

    Outside a tunnel HTTPS goes through CONNECT, so an absolute `https://` target is rejected, as is userinfo.
    """
    if not target.isascii() or not target.isprintable() or "#" in target:
        raise HeaderRejected("the request target holds characters a URL does not")
    if in_tunnel:
        if not target.startswith("/"):
            raise HeaderRejected("inside a tunnel the request target must be a path")
        path, _, query = target.partition("?")
        return Target(host=None, port=None, path=path, query=query)
    match = _ABSOLUTE.fullmatch(target)
    if match is None:
        raise HeaderRejected("a proxied request needs an absolute http:// target")
    scheme, authority, rest = match.groups()
    if scheme.lower() != "http":
        raise HeaderRejected(f"{scheme}:// is not forwarded as a plain request; HTTPS goes through CONNECT")
    if "@" in authority:
        raise HeaderRejected("userinfo in the request target is never forwarded")
    try:
        host, port = parse_authority(authority)
    except ValueError:
        raise HeaderRejected("the request target names no valid host") from None
    path, _, query = rest.partition("?")
    return Target(host=host, port=port or default_port("http"), path=path or "/", query=query)


def parse_connect_target(target: str) -> tuple[str, int]:
    """`host:port` of a CONNECT request, the port required."""
    try:
        host, port = parse_authority(target)
    except ValueError:
        raise HeaderRejected("the CONNECT target is not host:port") from None
    if port is None:
        raise HeaderRejected("the CONNECT target needs a port")
    return host, port


@dataclass(frozen=True, kw_only=True)
class RequestLine:
    """The first line of a request head, read without h11: what the audit can still say of a head h11 refused."""

    method: str
    target: str
    http1: bool
    """HTTP/1.0 or HTTP/1.1, the only versions the proxy speaks."""


_REQUEST_LINE: Final = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])\r?")


def read_request_line(head: bytes) -> RequestLine | None:
    """The request line at the start of `head`, or None when its first line is not one (or has not ended)."""
    line, newline, _ = head.partition(b"\n")
    match = _REQUEST_LINE.fullmatch(line) if newline else None
    if match is None:
        return None
    method, target, major, minor = (part.decode("ascii") for part in match.groups())
    return RequestLine(method=method, target=target, http1=major == "1" and minor in ("0", "1"))


_HEAD_PROBLEMS: Final = (
    ("conflicting Content-Length", "the request has conflicting Content-Length headers"),
    ("Found multiple Host", "the request has more than one Host header"),
    ("Missing mandatory Host", "an HTTP/1.1 request needs a Host header"),
    ("Only Transfer-Encoding: chunked", "the request's Transfer-Encoding is not chunked alone"),
    ("illegal header line", "a header line is not `name: value` (it holds a CR, NUL or other control character, or "
                            "a bad name)"),
    ("Receive buffer too long", "the request head is longer than 64 KiB"),
)


def head_problem(message: str) -> str:
    """What is wrong with a request head h11 refused, from h11's message, in words that never quote the head: h11's
    own message can hold a header line, and so a credential."""
    for prefix, problem in _HEAD_PROBLEMS:
        if message.startswith(prefix):
            return problem
    return "the request head is not well-formed HTTP/1.1"


UPSTREAM_TIMEOUT: Final = "upstream_timeout"
UPSTREAM_FAILED: Final = "upstream_failed"
"""Codes of the proxy's own errors, beside the `RefusalCode`s: the request was allowed and the upstream failed."""
REQUEST_TOO_LARGE: Final = RefusalCode.REQUEST_TOO_LARGE

_STATUS: Final[dict[str, int]] = {
    RefusalCode.DECIDER_UNAVAILABLE: 502, RefusalCode.MALFORMED_VERDICT: 502,
    UPSTREAM_TIMEOUT: 504, UPSTREAM_FAILED: 502, REQUEST_TOO_LARGE: 413,
    RefusalCode.REQUEST_TIMEOUT: 408, RefusalCode.TOO_MANY_CONNECTIONS: 503, RefusalCode.PROXY_BUSY: 503,
    RefusalCode.MALFORMED_REQUEST: 400, RefusalCode.TARGET_TOO_LONG: 414,
}


def refusal_status(code: str) -> int:
    """The HTTP status of a refusal or proxy error: 403 unless the policy component or the upstream failed."""
    return _STATUS.get(code, 403)


def error_body(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}, separators=(",", ":")).encode("utf-8")


_REASON_PHRASES: Final = {400: b"Bad Request", 403: b"Forbidden", 408: b"Request Timeout", 413: b"Content Too Large",
                          414: b"URI Too Long", 502: b"Bad Gateway", 503: b"Service Unavailable",
                          504: b"Gateway Timeout"}


def refusal_response(code: str, message: str) -> bytes:
    """A whole refusal response that closes the connection, for when there is no request h11 could answer (a
    connection over the cap, a head that never completed)."""
    status = refusal_status(code)
    body = error_body(code, message)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nx-wakeful-refusal: %s\r\n"
            b"connection: close\r\n\r\n" % (status, _REASON_PHRASES.get(status, b""), len(body),
                                               code.encode("ascii")) + body)


def describe(exc: BaseException) -> str:
    """An exception's type and where it was raised, without its message: messages can quote header values."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}{where}"
