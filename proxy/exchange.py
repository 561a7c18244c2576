"""One request through the proxy: read it, check it, ask the decider, and only then resolve, inject and forward.

Order, for every request: head (whole within a deadline) → path and query not too long → path made canonical → a
client that names no one refused before its body → body read (bounded in size, time and bytes held) → no
placeholder in query or body → Host/SNI/CONNECT agreement → method → decider → verdict fits → resolve → addresses
checked → placeholders only in the declared header → client credentials stripped → credential injected → dial the
checked address → forward → stream the answer back → one audit record. Nothing is resolved or dialled before an
allow.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

import h11

from wakeful.proxy.audit import METHOD_WIDTH, RULE_WIDTH, USER_WIDTH, EgressRecord, clip, fit_path
from wakeful.proxy.channel import DeciderClient
from wakeful.proxy.config import ProxyConfig
from wakeful.proxy.contract import (
    MAX_TARGET_PART,
    REFUSAL_HEADER,
    Allow,
    Client,
    ContractError,
    DecisionRequest,
    ProxyRefusal,
    RefusalCode,
    Refuse,
)
from wakeful.proxy.credential import Credential
from wakeful.proxy.decide import agree, check_addresses, check_method, check_verdict
from wakeful.proxy.limits import BodyBudget, Held
from wakeful.proxy.paths import AmbiguousPath, normalize_path
from wakeful.proxy.rewrite import (
    HeaderRejected,
    check_placeholders,
    header_key,
    inject,
    refuse_misplaced,
    strip_credentials,
)
from wakeful.proxy.upstream import (
    DeadlinePassed,
    H11Stream,
    ResponseHead,
    Upstream,
    UpstreamPool,
    resolve,
    response_headers,
    serialize_request,
)
from wakeful.proxy.vault import Vault, VaultError
from wakeful.proxy.wire import (
    REQUEST_TOO_LARGE,
    UPSTREAM_FAILED,
    UPSTREAM_TIMEOUT,
    Identity,
    IdentityChanged,
    RequestLine,
    attempt_token,
    error_body,
    parse_connect_target,
    parse_proxy_authorization,
    parse_target,
    refusal_status,
    settle_identity,
)

__all__ = ["ClientConnection", "Credentials", "Exchange", "ProxyFailure", "Shared", "Tunnel", "answer_error",
           "authorize", "handle_request", "head_exchange", "request_line"]

log = logging.getLogger("wakeful.proxy")

EMPTY_SHA256: Final = hashlib.sha256(b"").hexdigest()
_IDEMPOTENT: Final = frozenset({"GET", "HEAD", "OPTIONS"})
_DROP_UPSTREAM: Final = frozenset({"content-length", "expect", "host"})
_CLOSING: Final = frozenset({RefusalCode.REQUEST_TIMEOUT, RefusalCode.PROXY_BUSY})
"""Refusals after which the connection is closed: what the client was still sending is not read."""


class ProxyFailure(Exception):
    """The proxy could not do what was allowed (upstream down or slow) or would not read the request (too big)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Credentials:
    """Decrypted credentials, kept while the vault file is unchanged: `wakeful secret set|rm` replaces the file
    (a new inode), which drops everything cached here. Saves a read, a parse and a decryption per request."""

    def __init__(self, vault: Vault) -> None:
        self._vault = vault
        self._stamp: tuple[int, int, int] | None = None
        self._cache: dict[str, Credential] = {}

    def get(self, name: str) -> Credential:
        """Raises `VaultError` (`CredentialNotFound`, `DecryptFailed`, `VaultFileError`)."""
        try:
            st = os.stat(self._vault.path)
            stamp: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp != self._stamp or stamp is None:
            self._cache.clear()
            self._stamp = stamp
        credential = self._cache.get(name)
        if credential is None:
            credential = self._cache[name] = self._vault.get(name)
        return credential


@dataclass(frozen=True, kw_only=True)
class Shared:
    """What every connection of one proxy server uses."""

    config: ProxyConfig
    decider: DeciderClient
    pool: UpstreamPool
    credentials: Credentials
    budget: BodyBudget
    """Request-body bytes held at once, per client and in total (see `proxy.limits`)."""


@dataclass(frozen=True, kw_only=True)
class Tunnel:
    """An intercepted CONNECT: every request inside it must name this host, port and TLS server name."""

    host: str
    port: int
    sni: str | None
    identity: Identity


class ClientConnection:
    """A client connection outside a tunnel. Its identity is settled by its first request (see `settle_identity`):
    later keep-alive requests without Proxy-Authorization act under it. On the address listener it is settled
    before any request, by the client's source address."""

    __slots__ = ("identity",)

    def __init__(self, identity: Identity | None = None) -> None:
        self.identity: Identity | None = identity


def _utcnow() -> datetime:
    return datetime.now(UTC)


def new_request_id() -> str:
    return "egr_" + os.urandom(12).hex()


class Exchange:
    """The audit facts of one request, filled in as it goes, written once at the end."""

    def __init__(self, *, method: str, scheme: str, host: str | None, port: int | None) -> None:
        self.request_id = new_request_id()
        self.at = _utcnow()
        self.started = time.perf_counter()
        self.method = method
        self.scheme = scheme
        self.host = host
        self.port = port
        self.path = ""
        self.user_id: str | None = None
        self.client: Client = "tool_computer"
        self.attempt_id: str | None = None
        self.action_id: str | None = None
        self.verdict: str = "refuse"
        self.code: RefusalCode | None = None
        self.rule = "not decided"
        self.credential: str | None = None
        self.bytes_up = 0
        self.bytes_down = 0
        self.upstream_status: int | None = None

    def allowed(self, allow: Allow) -> None:
        self.verdict, self.rule = "allow", allow.rule
        self.attempt_id, self.action_id = allow.attempt_id, allow.action_id

    def accepted(self, rule: str) -> None:
        """What needed no decision went ahead (an intercepted CONNECT: each request inside is decided)."""
        self.verdict, self.rule = "allow", rule

    def refused(self, code: RefusalCode | None, reason: str) -> None:
        self.verdict, self.code, self.rule, self.credential = "refuse", code, reason, None

    def record(self, decider: DeciderClient) -> None:
        """Queue the one record of this request, fitted to what the audit stores (a destination the proxy could not
        read is recorded as none: host "" and port 0)."""
        host, port = (self.host, self.port) if self.host is not None and self.port is not None else ("", 0)
        try:
            record = EgressRecord(
                request_id=self.request_id, at=self.at,
                user_id=None if self.user_id is None else clip(self.user_id, USER_WIDTH), client=self.client,
                attempt_id=self.attempt_id, action_id=self.action_id, method=clip(self.method, METHOD_WIDTH),
                scheme="https" if self.scheme == "https" else "http", host=host, port=port, path=fit_path(self.path),
                verdict="allow" if self.verdict == "allow" else "refuse", code=self.code,
                rule=clip(self.rule, RULE_WIDTH), credential=self.credential, bytes_up=self.bytes_up,
                bytes_down=self.bytes_down, upstream_status=self.upstream_status,
                latency_ms=(time.perf_counter() - self.started) * 1000.0)
        except ContractError as exc:
            log.warning("egress record %s could not be written: %s", self.request_id, exc)
            return
        if log.isEnabledFor(logging.DEBUG):  # path only: a query can carry secrets
            log.debug("%s %s://%s:%d%s → %s %s (%s), upstream %s", record.method, record.scheme, record.host,
                      record.port, record.path, record.verdict, record.code or "", record.rule,
                      record.upstream_status)
        decider.audit(record)


def request_line(request: h11.Request) -> RequestLine:
    """The request line of a head h11 read."""
    return RequestLine(method=request.method.decode("ascii"), target=request.target.decode("latin-1"),
                       http1=request.http_version in (b"1.0", b"1.1"))


def head_exchange(line: RequestLine | None, connection: Tunnel | ClientConnection) -> Exchange:
    """The audit facts of a request refused before `handle_request` read it: its method and whatever of its
    destination and path its request line names (nothing guessed; none without one), and whom the connection
    speaks for so far."""
    inside = connection if isinstance(connection, Tunnel) else None
    method = line.method if line is not None else ""
    ex = Exchange(method=method, scheme="https" if inside or method == "CONNECT" else "http",
                  host=inside.host if inside else None, port=inside.port if inside else None)
    identity = inside.identity if inside else connection.identity
    if identity is not None:
        ex.user_id = identity.user_id
    if line is not None:
        try:
            _name_target(ex, line.target, inside=inside is not None)
        except ProxyRefusal:
            pass  # a target that does not parse names nothing
    return ex


def _name_target(ex: Exchange, target: str, *, inside: bool) -> None:
    if ex.method == "CONNECT":
        if not inside:
            ex.host, ex.port = parse_connect_target(target)
        return
    parsed = parse_target(target, in_tunnel=inside)
    if not inside:
        ex.host, ex.port = parsed.host, parsed.port
    ex.path = parsed.path


_REFUSAL: Final = REFUSAL_HEADER.lower().encode("ascii")


async def answer_error(client: H11Stream, code: str, message: str, *, close: bool) -> bool:
    """Send a refusal or error response if the client still expects one; whether the connection can go on."""
    if client.answered or client.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return False
    body = error_body(code, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii")),
               (_REFUSAL, code.encode("ascii"))]
    if close:
        headers.append((b"connection", b"close"))
    try:
        client.send(h11.Response(status_code=refusal_status(code), headers=headers))
        client.send(h11.Data(data=body))
        client.send(h11.EndOfMessage())
        await client.drain()
    except (h11.LocalProtocolError, OSError):
        return False
    return not close


async def authorize(shared: Shared, req: DecisionRequest, ex: Exchange) -> tuple[Allow, list[str]]:
    """The decider's allow for `req` and the checked addresses to dial. Raises `ProxyRefusal` or `ProxyFailure`."""
    verdict = check_verdict(req, await shared.decider.decide(req))
    if isinstance(verdict, Refuse):
        raise ProxyRefusal(verdict.code, verdict.reason)
    ex.allowed(verdict)
    try:
        ips = await resolve(req.host, req.port, shared.config.resolve)
    except OSError:
        raise ProxyFailure(UPSTREAM_FAILED, f"{req.host} does not resolve") from None
    refusal = check_addresses(req.host, ips, allowed_private=shared.config.allowed_private)
    if refusal is not None:
        raise ProxyRefusal(refusal.code, refusal.reason)
    return verdict, ips


def _announced(request: h11.Request) -> int | None:
    """The body length a request declares: Content-Length, None for chunked, 0 for no body (h11 checked both)."""
    for name, value in request.headers:
        if name == b"content-length":
            return int(value)
        if name == b"transfer-encoding":
            return None
    return 0


async def _read_body(client: H11Stream, request: h11.Request, config: ProxyConfig, held: Held) -> bytes:
    """The whole body, within `request_body_timeout` and the caps: `max_body_bytes` for this request (413), and
    the bytes held for this client and in total (503 `proxy_busy`); a declared length is checked before reading."""
    limit = config.max_body_bytes
    announced = _announced(request)
    if announced is not None:
        if announced > limit:
            raise ProxyFailure(REQUEST_TOO_LARGE, f"the request body exceeds {limit} bytes")
        held.take(announced)
    if client.conn.they_are_waiting_for_100_continue:
        client.send(h11.InformationalResponse(status_code=100, headers=[]))
        client.flush()
    deadline = asyncio.get_running_loop().time() + config.request_body_timeout
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            event = await client.next_event(config.client_timeout, deadline=deadline)
        except DeadlinePassed:
            raise ProxyRefusal(RefusalCode.REQUEST_TIMEOUT, f"the request body did not arrive whole within "
                               f"{config.request_body_timeout:g} s") from None
        if isinstance(event, h11.Data):
            size += len(event.data)
            if size > limit:
                raise ProxyFailure(REQUEST_TOO_LARGE, f"the request body exceeds {limit} bytes")
            if announced is None:
                held.take(len(event.data))
            chunks.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        else:
            raise ConnectionResetError("the client went away while sending its body")


async def handle_request(shared: Shared, client: H11Stream, request: h11.Request,
                         tunnel: Tunnel | ClientConnection) -> bool:
    """Answer one request read from `client`; whether the client connection can carry another one."""
    inside = tunnel if isinstance(tunnel, Tunnel) else None
    ex = Exchange(method=request.method.decode("ascii"), scheme="https" if inside else "http",
                  host=inside.host if inside else None, port=inside.port if inside else None)
    held = Held(shared.budget, "")
    try:
        return await _handle(shared, client, request, tunnel, ex, held)
    except ProxyRefusal as refusal:
        ex.refused(refusal.code, refusal.reason)
        # A connection that changed identity is not trusted with another request; one whose body was not read
        # whole cannot carry another.
        close = (isinstance(refusal, IdentityChanged) or refusal.code in _CLOSING
                 or client.conn.their_state is not h11.DONE)
        return await answer_error(client, refusal.code, refusal.reason, close=close)
    except ProxyFailure as failure:
        if failure.code == REQUEST_TOO_LARGE:
            ex.refused(RefusalCode.REQUEST_TOO_LARGE, failure.message)
        return await answer_error(client, failure.code, failure.message, close=failure.code == REQUEST_TOO_LARGE)
    except h11.RemoteProtocolError:
        ex.refused(RefusalCode.HEADER_MISMATCH, "the request body is not well-formed HTTP/1.1")
        return await answer_error(client, RefusalCode.HEADER_MISMATCH, ex.rule, close=True)
    except OSError:  # TimeoutError included: the client stalled or left before its request was complete
        ex.refused(None, "the client did not send its whole request")
        return False
    finally:
        held.release()
        ex.record(shared.decider)


async def _handle(shared: Shared, client: H11Stream, request: h11.Request, connection: Tunnel | ClientConnection,
                  ex: Exchange, held: Held) -> bool:
    config = shared.config
    tunnel = connection if isinstance(connection, Tunnel) else None
    scheme = "https" if tunnel else "http"
    headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers.raw_items()]
    target = parse_target(request.target.decode("latin-1"), in_tunnel=tunnel is not None)
    host, port = (tunnel.host, tunnel.port) if tunnel else (target.host, target.port)
    ex.host, ex.port, ex.path = host, port, target.path
    if max(len(target.path), len(target.query)) > MAX_TARGET_PART:
        raise ProxyRefusal(RefusalCode.TARGET_TOO_LONG)
    try:
        path = normalize_path(target.path).wire  # what the decider judges is what the upstream gets
    except AmbiguousPath as exc:
        raise ProxyRefusal(RefusalCode.AMBIGUOUS_PATH, str(exc)) from None
    ex.path = path
    lowered = [name.lower() for name, _ in headers]
    if "content-length" in lowered and "transfer-encoding" in lowered:
        raise HeaderRejected("both Content-Length and Transfer-Encoding: the body's length is ambiguous")
    if tunnel is not None:
        identity = tunnel.identity
    else:
        assert isinstance(connection, ClientConnection)
        if connection.identity is not None:
            ex.user_id = connection.identity.user_id
        identity = connection.identity = settle_identity(connection.identity, parse_proxy_authorization(
            [value for name, value in headers if name.lower() == "proxy-authorization"]))
    token = attempt_token(headers)
    ex.user_id, ex.client = identity.user_id, "connector" if token is not None else "tool_computer"
    if identity.token is None and token is None and _announced(request) != 0:
        # Nobody can be allowed without naming themselves: refused before a byte of the body is read or held.
        raise ProxyRefusal(RefusalCode.NOT_ADMITTED, "a tool computer authenticates to the proxy "
                           "(Proxy-Authorization) before it sends a body")
    held.client = f"user:{identity.user_id}" if token is None else "connector"
    body = await _read_body(client, request, config, held)
    refuse_misplaced(target.query, body)
    hosts = [value for name, value in headers if name.lower() == "host"]
    if len(hosts) > 1:
        raise HeaderRejected("more than one Host header")
    assert host is not None and port is not None  # parse_target names both outside a tunnel
    if not agree((host, port), tunnel.sni if tunnel else None, hosts[0] if hosts else None, port, scheme=scheme):
        raise ProxyRefusal(RefusalCode.HEADER_MISMATCH)
    refusal = check_method(ex.method)
    if refusal is not None:
        raise ProxyRefusal(refusal.code, refusal.reason)
    try:
        req = DecisionRequest(
            request_id=ex.request_id, user_id=identity.user_id, attempt_token=token, client_token=identity.token,
            method=ex.method, scheme="https" if tunnel else "http", host=host, port=port, path=path,
            query=target.query, body_sha256=hashlib.sha256(body).hexdigest(), resolved_ips=(), client=ex.client)
    except ContractError as exc:
        raise HeaderRejected(str(exc)) from None
    allow, ips = await authorize(shared, req, ex)
    credential: Credential | None = None
    if allow.credential is not None:
        try:
            credential = shared.credentials.get(allow.credential)
        except VaultError:
            raise ProxyRefusal(RefusalCode.CREDENTIAL_UNAVAILABLE) from None
    keep = check_placeholders(headers, credential)  # before stripping: a stripped header's placeholder is refused
    forward = strip_credentials(headers, bound_host=credential is not None, keep=keep)
    if credential is not None:
        forward = inject(forward, credential, scheme=req.scheme, host=host)
        ex.credential = credential.name
    out = [(b"host", hosts[0].encode("latin-1") if hosts else _authority(host, port, req.scheme))]
    out += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in forward
            if header_key(name) not in _DROP_UPSTREAM]
    if body or request.method in (b"POST", b"PUT", b"PATCH"):
        out.append((b"content-length", str(len(body)).encode("ascii")))
    target_bytes = (path + (f"?{target.query}" if target.query else "")).encode("latin-1")
    try:
        upstream_request = serialize_request(request.method, target_bytes, out, body)
    except ValueError:
        # Never quote the value: it may be the injected secret.
        raise HeaderRejected("a header value cannot be forwarded as it is (e.g. leading or trailing spaces)") from None
    keep_alive = request.http_version == b"1.1" and not any(
        name == b"connection" and b"close" in (t.strip().lower() for t in value.split(b","))
        for name, value in request.headers)
    return await _forward(shared, client, upstream_request, request.method, len(body), ips, port, req.scheme,
                          host, ex, keep_alive=keep_alive, chunked_ok=request.http_version == b"1.1")


def _authority(host: str, port: int, scheme: str) -> bytes:
    name = f"[{host}]" if ":" in host else host
    return (name if port == (443 if scheme == "https" else 80) else f"{name}:{port}").encode("ascii")


async def _exchange(upstream: Upstream, request: bytes, method: bytes, wait: float) -> ResponseHead:
    await upstream.request(request)
    return await upstream.response_head(wait, head_request=method == b"HEAD")


def _head(head: ResponseHead, *, keep_alive: bool, chunked: bool) -> bytes:
    parts = [b"HTTP/1.1 %d " % head.status, head.reason, b"\r\n"]
    for name, value in response_headers(head.headers):
        parts += (name, b": ", value, b"\r\n")
    if chunked:
        parts.append(b"transfer-encoding: chunked\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


async def _forward(shared: Shared, client: H11Stream, request: bytes, method: bytes, bytes_up: int, ips: list[str],
                   port: int, scheme: str, host: str, ex: Exchange, *, keep_alive: bool, chunked_ok: bool) -> bool:
    """Send `request` upstream (on a pooled connection if one is idle) and stream the answer back to `client`,
    re-framed for it: Content-Length kept, chunked or close-delimited bodies chunked again for an HTTP/1.1 client
    (close-delimited for HTTP/1.0). Whether the client connection can carry another request."""
    config, pool = shared.config, shared.pool
    upstream = pool.take(ips, port, scheme, host)
    head: ResponseHead | None = None
    try:
        if upstream is not None:
            try:
                head = await _exchange(upstream, request, method, config.upstream_timeout)
            except (OSError, ValueError):
                upstream.close()
                # A kept-alive connection the upstream had already closed: nothing reached it, so an idempotent
                # request may go again on a fresh one. Anything else might have had an effect: never re-sent.
                if upstream.received or method.decode("ascii") not in _IDEMPOTENT:
                    raise
                upstream = None
        if upstream is None:
            upstream = await pool.dial(ips, port, scheme, host)
            head = await _exchange(upstream, request, method, config.upstream_timeout)
    except TimeoutError:
        if upstream is not None:
            upstream.close()
        raise ProxyFailure(UPSTREAM_TIMEOUT, f"{host} did not answer in time") from None
    except (OSError, ValueError) as exc:  # ssl.SSLError and httptools.HttpParserError included
        if upstream is not None:
            upstream.close()
        log.debug("upstream %s:%d failed: %s", host, port, type(exc).__name__)
        raise ProxyFailure(UPSTREAM_FAILED, f"{host} could not be reached or answered badly") from None
    assert head is not None
    ex.bytes_up, ex.upstream_status = bytes_up, head.status
    unknown_length = head.framing in ("chunked", "close")
    chunked = unknown_length and chunked_ok
    keep_alive = keep_alive and not (unknown_length and not chunked)
    out = [_head(head, keep_alive=keep_alive, chunked=chunked)]
    try:
        while True:
            for data in upstream.take_body():
                ex.bytes_down += len(data)
                out.append(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            if upstream.complete:
                break
            # Whatever is already parsed goes out before waiting: usually headers and body in one write.
            client.write_raw(b"".join(out))
            out.clear()
            await client.writer.drain()
            await upstream.read_more(config.upstream_timeout)
        if chunked:
            out.append(b"0\r\n\r\n")
        client.write_raw(b"".join(out))
        await client.writer.drain()
    except (OSError, ValueError) as exc:
        # Headers already went out: the only honest signal left is to cut the client connection.
        log.debug("response from %s:%d cut short: %s", host, port, type(exc).__name__)
        upstream.close()
        return False
    pool.give(upstream)
    return keep_alive
