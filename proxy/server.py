"""The asyncio forward proxy: plain HTTP in absolute form, and HTTPS through CONNECT, intercepted or tunnelled raw.

`serve_proxy(config)` starts it and returns a `ProxyServer`; `run(config)` serves until SIGTERM or SIGINT. What
happens to each request is in `proxy.exchange`. With `address_listen` it listens twice: on the loopback listener a
client names itself with Proxy-Authorization; on the address listener its source address names it (`AddressBook`).
With `relay_socket` too, tool computers on other hosts' isolated networks come relayed by the api's SSH tunnel on a
unix socket, each connection headed by a PROXY line (`proxy.proxyline`) naming the address it came from: from there
on it is served exactly as a connection on the address listener from that address.

Every request read leaves one audit record, one refused while its head was still being read included, and so does
every CONNECT: its own record once its tunnel is open (or refused), beside those of the requests inside it. A
connection that sends nothing leaves none; one that sends no readable request is recorded as `proxy.malformed` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
from collections.abc import Callable

import h11

from wakeful.proxy.addressbook import AddressBook
from wakeful.proxy.channel import DeciderClient, private_unix_server
from wakeful.proxy.config import ProxyConfig
from wakeful.proxy.contract import ContractError, DecisionRequest, ProxyRefusal, RefusalCode
from wakeful.proxy.exchange import (
    EMPTY_SHA256,
    ClientConnection,
    Credentials,
    Exchange,
    ProxyFailure,
    Shared,
    Tunnel,
    answer_error,
    authorize,
    handle_request,
    head_exchange,
    request_line,
)
from wakeful.proxy.hosts import normalize_host
from wakeful.proxy.limits import BodyBudget
from wakeful.proxy.malformed import MalformedRows
from wakeful.proxy.proxyline import MAX_LINE, MalformedProxyLine, parse_proxy_line
from wakeful.proxy.rewrite import HeaderRejected
from wakeful.proxy.sni import NEED_MORE, ClientHello, MalformedHello, client_hello_sni
from wakeful.proxy.tls import LeafCertificates, load_or_create_ca, sni_of
from wakeful.proxy.upstream import DeadlinePassed, H11Stream, UpstreamPool
from wakeful.proxy.wire import (
    ANONYMOUS,
    Identity,
    attempt_token,
    describe,
    head_problem,
    parse_connect_target,
    parse_proxy_authorization,
    read_request_line,
    refusal_response,
    settle_identity,
)

__all__ = ["ProxyServer", "event_loop_factory", "run", "serve_proxy"]

log = logging.getLogger("wakeful.proxy")

_AUDIT_FLUSH_SECONDS = 2.0
_LINGER_SECONDS = 1.0
_LINGER_BYTES = 64 * 1024
_IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)  # Linux's value; Python names it from 3.12 on


class ProxyServer:
    """A running proxy. `port` is the port it listens on (and `address_port` the address listener's, 0 without one);
    `close()` stops it and flushes the audit."""

    def __init__(self, config: ProxyConfig, shared: Shared, leaves: LeafCertificates) -> None:
        self.config = config
        self.decider = shared.decider
        self._shared = shared
        self._leaves = leaves
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[None]] = set()
        self.host = config.listen_host
        self.port = 0
        self.address_host = config.address_listen[0] if config.address_listen else None
        self.address_port = 0
        self.relay_socket = config.relay_socket
        self._book = AddressBook(config.address_book) if config.address_book is not None else None
        self._malformed = MalformedRows(config, shared.decider)

    @property
    def open_connections(self) -> int:
        """Client connections open now, on both listeners (at most `max_connections`)."""
        return len(self._connections)

    def __repr__(self) -> str:
        by_address = f", by address on {self.address_host}:{self.address_port}" if self.address_host else ""
        return f"ProxyServer({self.host}:{self.port}{by_address})"

    async def _start(self) -> None:
        loopback = await asyncio.start_server(self._serve, self.config.listen_host, self.config.listen_port)
        self._servers.append(loopback)
        self.port = loopback.sockets[0].getsockname()[1]
        if self.config.address_listen is not None:
            try:
                by_address = await asyncio.start_server(self._serve_by_address,
                                                        sock=_freebind_listener(*self.config.address_listen))
            except OSError:  # do not leave the loopback one open
                loopback.close()
                raise
            self._servers.append(by_address)
            self.address_port = by_address.sockets[0].getsockname()[1]
        if self.relay_socket is not None:
            try:
                self._servers.append(await private_unix_server(self.relay_socket, self._serve_relayed,
                                                                what="the relay socket", refused=OSError))
            except OSError:
                for server in self._servers:
                    server.close()
                raise

    async def close(self, *, audit_grace: float = _AUDIT_FLUSH_SECONDS) -> None:
        """Stop listening, cut open connections, then wait up to `audit_grace` seconds for the audit to drain."""
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._servers = []
        if self.relay_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                self.relay_socket.unlink()
        self._shared.pool.close()
        self._malformed.close()
        if not await self.decider.flush(audit_grace):
            log.warning("%d egress audit records were not acknowledged at shutdown", self.decider.audit_pending)
        await self.decider.close()

    async def __aenter__(self) -> ProxyServer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The loopback listener: the connection's first request names its identity."""
        await self._accept(reader, writer, by_address=False)

    async def _serve_by_address(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The address listener: the connection's source address names its identity before any request, so a
        request presenting another (or any, from an address not in the book) is refused as an identity change."""
        await self._accept(reader, writer, by_address=True)

    async def _serve_relayed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The relay socket: the PROXY line the api's host tunnel wrote names the source address, which names the
        identity as on the address listener."""
        await self._accept(reader, writer, by_address=True, relayed=True)

    def _identity_of(self, address: str | None) -> Identity:
        if self._book is None or address is None:
            return ANONYMOUS
        return self._book.identity(address)

    async def _relayed_source(self, reader: asyncio.StreamReader) -> str | None:
        """The source address the connection's PROXY line names; None (logged) when it does not begin with one
        strict line within `request_head_timeout`. Read a byte at a time so that nothing past the line is taken from
        the stream, and never more than `MAX_LINE` bytes."""
        line = bytearray()
        try:
            async with asyncio.timeout(self.config.request_head_timeout):
                while not line.endswith(b"\n") and len(line) <= MAX_LINE:
                    line += await reader.readexactly(1)
            return parse_proxy_line(bytes(line)).source
        except MalformedProxyLine as exc:
            log.warning("a relayed connection on %s did not begin with a PROXY line (%s); closed, nothing relayed",
                        self.relay_socket, exc)
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            log.warning("a relayed connection on %s ended or stalled before its PROXY line was whole; closed",
                        self.relay_socket)
        return None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, by_address: bool,
                      relayed: bool = False) -> None:
        if len(self._connections) >= self.config.max_connections:
            # Answered before anything is read, so a flood of idle connections costs one short write each.
            await _refuse_raw(reader, writer, RefusalCode.TOO_MANY_CONNECTIONS,
                              f"the proxy holds {self.config.max_connections} client connections; retry later")
            return
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if relayed:
                source = await self._relayed_source(reader)
                if source is None:
                    return
            else:
                peer = writer.get_extra_info("peername")
                source = str(peer[0]) if isinstance(peer, tuple) and peer else None
            connection = ClientConnection(self._identity_of(source) if by_address else None)
            await self._requests(H11Stream(h11.SERVER, reader, writer), connection)
        except asyncio.CancelledError:
            pass  # close() cut this connection; asyncio would log a cancelled connection task as an error
        except Exception as exc:
            log.error("a client connection failed: %s", describe(exc))
        finally:
            writer.close()
            if task is not None:
                self._connections.discard(task)

    async def _requests(self, client: H11Stream, connection: Tunnel | ClientConnection) -> None:
        timeout = self.config.client_timeout
        while True:
            try:
                event = await client.next_head(timeout, self.config.request_head_timeout)
            except DeadlinePassed:
                if not client.answered:
                    await self._head_late(client, connection)
                return
            except h11.RemoteProtocolError as exc:
                await self._head_refused(client, connection, head_problem(str(exc)))
                return
            except OSError:  # TimeoutError included: an idle or stalled client
                return
            if not isinstance(event, h11.Request):
                return
            if event.http_version not in (b"1.0", b"1.1"):
                await self._refuse(client, head_exchange(request_line(event), connection),
                                   RefusalCode.MALFORMED_REQUEST, f"HTTP/{event.http_version.decode('ascii')} is "
                                   "not spoken here (HTTP/2 with prior knowledge, h2c, included): send HTTP/1.1, and "
                                   "HTTPS through CONNECT")
                return
            if event.method == b"CONNECT":
                if isinstance(connection, ClientConnection):
                    await self._connect(client, event, connection)
                else:
                    await self._refuse(client, head_exchange(request_line(event), connection),
                                       RefusalCode.HEADER_MISMATCH, "CONNECT inside a tunnel")
                return
            if not await handle_request(self._shared, client, event, connection) or not client.reusable():
                return
            client.start_next_cycle()

    async def _refuse(self, client: H11Stream, ex: Exchange, code: RefusalCode, reason: str) -> None:
        """Answer a refusal, close, and record it (`malformed_request` as `MalformedRows` bounds it)."""
        ex.refused(code, reason)
        await answer_error(client, code, reason, close=True)
        if code is RefusalCode.MALFORMED_REQUEST:
            self._malformed.record(ex)
        else:
            ex.record(self.decider)

    async def _head_refused(self, client: H11Stream, connection: Tunnel | ClientConnection, problem: str) -> None:
        """A head h11 would not read: `header_mismatch` if it began with an HTTP/1.x request line, the client's
        departure if it left before the head ended, else `malformed_request`. The head itself is never quoted."""
        line = read_request_line(bytes(client.head_start))
        ex = head_exchange(line, connection)
        if line is None or not line.http1:
            await self._refuse(client, ex, RefusalCode.MALFORMED_REQUEST,
                               "the client sent bytes that are not an HTTP/1.1 request line")
        elif client.conn.trailing_data[1]:
            ex.refused(None, "the client closed before its request head was complete")
            ex.record(self.decider)
        else:
            await self._refuse(client, ex, RefusalCode.HEADER_MISMATCH, problem)

    async def _head_late(self, client: H11Stream, connection: Tunnel | ClientConnection) -> None:
        ex = head_exchange(read_request_line(bytes(client.head_start)), connection)
        ex.refused(RefusalCode.REQUEST_TIMEOUT, f"the request head did not arrive whole within "
                                                f"{self.config.request_head_timeout:g} s")
        ex.record(self.decider)
        await _refuse_raw(client.reader, client.writer, RefusalCode.REQUEST_TIMEOUT, ex.rule)

    async def _connect(self, client: H11Stream, request: h11.Request, connection: ClientConnection) -> None:
        ex = head_exchange(request_line(request), connection)
        try:
            host, port, identity, token = await self._read_connect(client, request, connection, ex)
        except ProxyRefusal as refusal:
            await self._refuse(client, ex, refusal.code, refusal.reason)
            return
        except (OSError, h11.RemoteProtocolError):
            ex.refused(None, "the client left before its CONNECT request was complete")
            ex.record(self.decider)
            return
        if host in self.config.no_intercept:
            await self._raw_tunnel(client, ex, host, port, identity, token)
        else:
            await self._intercept(client, ex, host, port, identity)

    async def _read_connect(self, client: H11Stream, request: h11.Request, connection: ClientConnection,
                            ex: Exchange) -> tuple[str, int, Identity, str | None]:
        """The CONNECT's target, identity and attempt token, each also put on `ex` as soon as it is read. Raises
        `ProxyRefusal`, `OSError`, `h11.RemoteProtocolError`."""
        headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers.raw_items()]
        presented = parse_proxy_authorization([value for name, value in headers
                                               if name.lower() == "proxy-authorization"])
        ex.user_id = presented.user_id or ex.user_id
        host, port = parse_connect_target(request.target.decode("latin-1"))
        identity = settle_identity(connection.identity, presented)
        token = attempt_token(headers)
        ex.user_id = identity.user_id
        ex.client = "connector" if token is not None else "tool_computer"
        event = await client.next_event(self.config.client_timeout)
        if not isinstance(event, h11.EndOfMessage):
            raise HeaderRejected("a CONNECT request carries no body")
        return host, port, identity, token

    async def _intercept(self, client: H11Stream, ex: Exchange, host: str, port: int, identity: Identity) -> None:
        """An intercepted tunnel: its own record once its TLS session with the client is up (or failed), then each
        request inside it read, decided and recorded on its own. The CONNECT itself is not decided: nothing leaves
        on it."""
        # The server's connector calls open their tunnels naming no one; each request inside names its grant.
        ex.client = "tool_computer" if identity.token is not None else "connector"
        client.send(h11.Response(status_code=200, headers=[], reason=b"Connection established"))
        try:
            await client.drain()
        except OSError:
            ex.refused(None, "the client left before its tunnel was open")
            ex.record(self.decider)
            return
        if client.conn.trailing_data[0]:
            ex.refused(RefusalCode.HEADER_MISMATCH, f"the client spoke before its tunnel to {host} was open; closed")
            ex.record(self.decider)
            return
        try:
            context = self._leaves.context_for(host)
            await client.writer.start_tls(context, ssl_handshake_timeout=self.config.client_timeout)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.info("a client's TLS handshake for %s failed: %s", host, describe(exc))
            ex.refused(None, f"the client's TLS handshake for {host} failed ({type(exc).__name__}): a client that "
                             "does not trust the deployment CA, or that does not speak TLS in its tunnel")
            ex.record(self.decider)
            return
        sni = sni_of(client.writer.get_extra_info("ssl_object"))
        ex.accepted(f"intercepted: TLS server name {sni or '(none)'}; each request inside is decided and recorded "
                    "on its own")
        ex.record(self.decider)
        tunnel = Tunnel(host=host, port=port, sni=sni, identity=identity)
        await self._requests(H11Stream(h11.SERVER, client.reader, client.writer), tunnel)

    async def _raw_tunnel(self, client: H11Stream, ex: Exchange, host: str, port: int, identity: Identity,
                          token: str | None) -> None:
        """A host that is not intercepted: decided once as a CONNECT, then bytes both ways, nothing injected. Its
        record, written when the tunnel closes, says whether the ClientHello named the CONNECT target."""
        try:
            try:
                req = DecisionRequest(
                    request_id=ex.request_id, user_id=identity.user_id, attempt_token=token,
                    client_token=identity.token, method="CONNECT", scheme="https", host=host, port=port, path="",
                    query="", body_sha256=EMPTY_SHA256, resolved_ips=(), client=ex.client)
            except ContractError as exc:
                raise HeaderRejected(str(exc)) from None
            _, ips = await authorize(self._shared, req, ex)
            upstream_reader, upstream_writer = await self._dial_raw(ips, port, host)
        except ProxyRefusal as refusal:
            ex.refused(refusal.code, refusal.reason)
            await answer_error(client, refusal.code, refusal.reason, close=True)
            ex.record(self.decider)
            return
        except ProxyFailure as failure:
            await answer_error(client, failure.code, failure.message, close=True)
            ex.record(self.decider)
            return
        try:
            client.send(h11.Response(status_code=200, headers=[], reason=b"Connection established"))
            client.flush()
            # Nothing is relayed before the ClientHello names the CONNECT target: else `CONNECT pinned.test`
            # could carry a handshake for any other name to that address (fronting).
            try:
                hello, first = await self._client_hello(client.reader, client.conn.trailing_data[0])
                named = normalize_host(hello.sni) if hello.sni is not None else None
            except (MalformedHello, ValueError, OSError) as exc:  # TimeoutError included
                ex.refused(RefusalCode.HEADER_MISMATCH, f"no well-formed TLS ClientHello for {host} arrived in time "
                           f"({type(exc).__name__}); nothing was relayed")
                return
            if named != host:
                ex.refused(RefusalCode.HEADER_MISMATCH, f"the TLS server name ({'none' if named is None else named})"
                           f" is not the CONNECT target {host}; nothing was relayed")
                return
            ex.rule = f"{ex.rule}; TLS server name {named} matches the CONNECT target"
            upstream_writer.write(first)
            ex.bytes_up += len(first)
            up, down = await asyncio.gather(_pipe(client.reader, upstream_writer),
                                            _pipe(upstream_reader, client.writer))
            ex.bytes_up += up
            ex.bytes_down = down
        finally:
            upstream_writer.close()
            ex.record(self.decider)

    async def _client_hello(self, reader: asyncio.StreamReader, buffered: bytes) -> tuple[ClientHello, bytes]:
        """The client's ClientHello and every byte read so far, within `client_timeout` for the whole of it.
        Raises `MalformedHello`, `TimeoutError`, `ConnectionResetError` (the client left first)."""
        data = bytearray(buffered)
        async with asyncio.timeout(self.config.client_timeout):
            while (hello := client_hello_sni(bytes(data))) is NEED_MORE:
                chunk = await reader.read(65536)
                if not chunk:
                    raise ConnectionResetError("the client closed before its ClientHello")
                data += chunk
        assert isinstance(hello, ClientHello)
        return hello, bytes(data)

    async def _dial_raw(self, ips: list[str], port: int, host: str) -> tuple[asyncio.StreamReader,
                                                                             asyncio.StreamWriter]:
        for ip in ips:
            with contextlib.suppress(OSError):
                async with asyncio.timeout(self.config.connect_timeout):
                    return await asyncio.open_connection(ip, port)
        raise ProxyFailure("upstream_failed", f"{host} could not be reached")


def _freebind_listener(host: str, port: int) -> socket.socket:
    """A listening socket on an address the host may not have yet (`IP_FREEBIND`): the isolated network's bridge
    can come up after the proxy starts, and the proxy must not depend on that order. Connections arrive once it is
    up."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IP, _IP_FREEBIND, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def _refuse_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, code: RefusalCode,
                      message: str) -> None:
    """Answer a refusal without a request to answer, then close: half-close and read (bounded) what the client
    still sends, so the close does not reset the connection before the client has read the answer."""
    try:
        writer.write(refusal_response(code, message))
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        drained = 0
        async with asyncio.timeout(_LINGER_SECONDS):
            while drained < _LINGER_BYTES and (data := await reader.read(65536)):
                drained += len(data)
    except (OSError, RuntimeError):  # TimeoutError included; RuntimeError: a transport already closing
        pass
    finally:
        writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    total = 0
    try:
        while data := await reader.read(65536):
            total += len(data)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()
    return total


def _upstream_tls(config: ProxyConfig) -> ssl.SSLContext:
    cafile = str(config.upstream_cafile) if config.upstream_cafile is not None else None
    context = ssl.create_default_context(cafile=cafile)
    context.set_alpn_protocols(["http/1.1"])
    return context


async def serve_proxy(config: ProxyConfig) -> ProxyServer:
    """Start the proxy: load (or create) the CA, open the decider channel lazily, listen. Report `.port`."""
    ca = load_or_create_ca(config.ca_dir, config.keys)
    leaves = LeafCertificates(ca, cache_size=config.leaf_cache_size)
    decider = DeciderClient(config.decider_socket, config.decider_token, timeout=config.decider_timeout)
    pool = UpstreamPool(_upstream_tls(config), connect_timeout=config.connect_timeout,
                        handshake_timeout=config.handshake_timeout, max_idle=config.pool_max_idle,
                        idle_seconds=config.pool_idle_seconds)
    shared = Shared(config=config, decider=decider, pool=pool, credentials=Credentials(config.vault),
                    budget=BodyBudget(total=config.max_buffered_bytes, per_client=config.max_client_buffered_bytes))
    server = ProxyServer(config, shared, leaves)
    await server._start()
    return server


def run(config: ProxyConfig, *, ready: Callable[[ProxyServer], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then close cleanly. `ready` is called once the port is bound."""

    async def main() -> None:
        server = await serve_proxy(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("wakeful proxy listening on %s:%d", server.host, server.port)
        if server.address_host is not None:
            log.info("wakeful proxy listening for tool computers by address on %s:%d", server.address_host,
                     server.address_port)
        if server.relay_socket is not None:
            log.info("wakeful proxy taking tool computers on other hosts relayed on %s", server.relay_socket)
        if ready is not None:
            ready(server)
        try:
            await stop.wait()
        finally:
            await server.close()
            log.info("wakeful proxy stopped")

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(main())


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed, else asyncio's own (None).

    uvloop does the per-request transport and TLS work in C instead of asyncio's Python `sslproto`: the proxy spends
    most of its time there. Nothing else changes; the proxy runs the same on either loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
