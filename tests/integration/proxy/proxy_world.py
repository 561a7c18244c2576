"""A world for proxy integration tests: HTTPS upstreams with their own test CA, a real decider on a unix socket,
a vault with one credential, and the real proxy between them — all on 127.0.0.1 in one event loop."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import httpx
from sqlalchemy import Engine

from tests.support.tlsca import make_test_ca
from wakeful.proxy.audit import EgressRecord
from wakeful.proxy.channel import DeciderServer, Record
from wakeful.proxy.clock import FakeClock
from wakeful.proxy.config import ProxyConfig
from wakeful.proxy.contract import Allow, DecisionRequest, RefusalCode, Refuse, Verdict, refuse
from wakeful.proxy.server import ProxyServer, serve_proxy
from wakeful.proxy.tls import CA_CERT_FILE
from wakeful.proxy.vault import KeyRing, Vault, generate_key
from wakeful.server.egress import grants as egress
from wakeful.server.egress.proxyctl import DeciderService
from wakeful.server.settings import Settings
from wakeful.server.store.db import read

SECRET = "sk_live_canary_4f9a1e7c2b"
TOKEN = "decider-channel-token"
CLIENT_TOKEN = "tok_client_8b2d"
HOSTS = ("merchant.test", "other.test", "pinned.test", "evil.test", "plain.test")


# --- a test CA for the upstreams ---------------------------------------------------------------------------------

def upstream_tls(directory: Path, names: Iterable[str]) -> tuple[ssl.SSLContext, Path]:
    """A server context for the upstreams (one leaf for every name and 127.0.0.1) and the test CA's file."""
    ca = make_test_ca(directory, names)
    return ca.server_context(), ca.ca_file


# --- an upstream that records what it received --------------------------------------------------------------------

@dataclass
class Received:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n.lower() == name.lower()]


Reply = tuple[int, list[tuple[str, str]], bytes]


class Upstream:
    """An HTTP/1.1 server (TLS or plain) that records every request and counts connections."""

    def __init__(self, tls: ssl.SSLContext | None, reply: Callable[[Received], Reply] | None = None) -> None:
        self.tls = tls
        self.reply = reply or (lambda r: (200, [("content-type", "text/plain")], b"hello from upstream"))
        self.received: list[Received] = []
        self.connections = 0
        self.raw_bytes = bytearray()
        self.hang_up = False
        """When set, each connection is closed after one response, without saying so (an idle timeout)."""
        self.raw_reply: Callable[[Received], tuple[bytes, bool]] | None = None
        """When set, every request is answered with these bytes exactly, and the connection closed if asked."""
        self.hold: asyncio.Event | None = None
        """When set, every request is recorded and then answered only once this event is set."""
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.hold is not None:
            self.hold.set()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request: h11.Request | None = None
                body = bytearray()
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await reader.read(65536)
                        self.raw_bytes += data
                        conn.receive_data(data)
                        continue
                    if isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                assert request is not None
                received = Received(request.method.decode(), request.target.decode(),
                                    [(n.decode(), v.decode()) for n, v in request.headers.raw_items()], bytes(body))
                self.received.append(received)
                if self.hold is not None:
                    await self.hold.wait()
                if self.raw_reply is not None:
                    data, close = self.raw_reply(received)
                    writer.write(data)
                    await writer.drain()
                    if close:
                        return
                    trailing, _ = conn.trailing_data
                    conn = h11.Connection(h11.SERVER)
                    if trailing:  # b"" would mean the client closed
                        conn.receive_data(trailing)
                    continue
                status, headers, payload = self.reply(received)
                headers = [*headers, ("content-length", str(len(payload)))]
                writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
                if request.method != b"HEAD":
                    writer.write(conn.send(h11.Data(data=payload)) or b"")
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                if self.hang_up or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (OSError, h11.ProtocolError, ssl.SSLError):
            return
        finally:
            writer.close()


class RawUpstream:
    """A TLS server that only echoes a fixed line and records the raw bytes it decrypted (for raw tunnels)."""

    def __init__(self, tls: ssl.SSLContext) -> None:
        self.tls = tls
        self.connections = 0
        self.received = bytearray()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            data = await reader.readuntil(b"\r\n\r\n")
            self.received += data
            body = b"pinned ok"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()


# --- the decider ---------------------------------------------------------------------------------------------------

class RecordingMap(Mapping[str, Sequence[str]]):
    """The static resolve map, remembering every name looked up in it: proof that nothing resolved early."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self._answers = answers
        self.looked_up: list[str] = []

    def __getitem__(self, key: str) -> Sequence[str]:
        self.looked_up.append(key)
        return self._answers[key]

    def get(self, key: str, default: Any = None) -> Any:
        self.looked_up.append(key)
        return self._answers.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._answers)

    def __len__(self) -> int:
        return len(self._answers)


Decide = Callable[[DecisionRequest], Awaitable[Verdict]]


def allow_tool(credential: str | None = None, rule: str = "test rule") -> Decide:
    async def decide(req: DecisionRequest) -> Verdict:
        return Allow(credential=credential, rule=rule, attempt_id=None, action_id=None)
    return decide


def refuse_all(code: RefusalCode = RefusalCode.NOT_ADMITTED) -> Decide:
    async def decide(req: DecisionRequest) -> Verdict:
        return refuse(code)
    return decide


@dataclass
class Decider:
    """The scripted policy: `decide` is swappable; every request and every stored record is kept."""

    decide: Decide
    requests: list[DecisionRequest] = field(default_factory=list)
    records: list[EgressRecord] = field(default_factory=list)
    batches: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def on_decide(self, req: DecisionRequest) -> Verdict:
        self.requests.append(req)
        return await self.decide(req)

    async def on_record(self, records: list[EgressRecord]) -> None:
        async with self.changed:
            self.records.extend(records)
            self.batches += 1
            self.changed.notify_all()

    @property
    def requests_recorded(self) -> list[EgressRecord]:
        """The records of requests, without those of CONNECTs (every tunnel has one of its own)."""
        return [r for r in self.records if r.method != "CONNECT"]

    async def wait_records(self, count: int, within: float = 5.0, *, tunnels: bool = False) -> list[EgressRecord]:
        """Once there are `count`: the records of requests, or with `tunnels` of CONNECTs too."""
        def recorded() -> list[EgressRecord]:
            return list(self.records) if tunnels else self.requests_recorded
        async with asyncio.timeout(within), self.changed:
            await self.changed.wait_for(lambda: len(recorded()) >= count)
        return recorded()


# --- the world -----------------------------------------------------------------------------------------------------

@dataclass
class World:
    proxy: ProxyServer
    decider: Decider
    decider_server: DeciderServer | None
    merchant: Upstream
    other: Upstream
    pinned: RawUpstream
    plain: Upstream
    resolve: RecordingMap
    vault: Vault
    ca_file: Path
    socket_path: Path
    deployment_ca: Path

    def port_of(self, host: str) -> int:
        return {"merchant.test": self.merchant.port, "other.test": self.other.port, "evil.test": self.merchant.port,
                "pinned.test": self.pinned.port, "plain.test": self.plain.port}[host]

    def url(self, host: str, path: str = "/", *, scheme: str = "https") -> str:
        return f"{scheme}://{host}:{self.port_of(host)}{path}"

    async def raw(self, data: bytes, *, connect: str | None = "merchant.test", sni: str | None = None,
                  handshake_after: float = 0.0, auth: str = f"usr_1:{CLIENT_TOKEN}",
                  ) -> tuple[int, dict[str, str], bytes]:
        """Send hand-written bytes through the proxy (inside a CONNECT tunnel to `connect` presenting `auth`, the TLS
        name `sni`, whose handshake starts `handshake_after` seconds after the tunnel opened), and read one
        response."""
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection("127.0.0.1", self.proxy.port)
            try:
                if connect is not None:
                    basic = base64.b64encode(auth.encode()).decode()
                    target = f"{connect}:{self.port_of(connect)}"
                    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
                                 f"Proxy-Authorization: Basic {basic}\r\n\r\n".encode())
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200"), head
                    context = ssl.create_default_context(cafile=str(self.deployment_ca))
                    context.check_hostname = sni in (None, connect)
                    await asyncio.sleep(handshake_after)  # a slow client (a TCG guest's Chromium checking the leaf)
                    await writer.start_tls(context, server_hostname=sni or connect)
                writer.write(data)
                await writer.drain()
                conn = h11.Connection(h11.CLIENT)
                conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))  # primes the parser only
                conn.send(h11.EndOfMessage())
                status, headers, body = 0, {}, bytearray()
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await reader.read(65536))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                        headers = {n.decode(): v.decode() for n, v in event.headers}
                    elif isinstance(event, h11.Data):
                        body += event.data
                    else:
                        return status, headers, bytes(body)
            finally:
                writer.close()

    def client(self, *, user: str | None = "usr_1", token: str | None = CLIENT_TOKEN,
               **kwargs: Any) -> httpx.AsyncClient:
        auth = f"{user}:{token}@" if user is not None else ""
        verify = ssl.create_default_context(cafile=str(self.deployment_ca))
        return httpx.AsyncClient(proxy=f"http://{auth}127.0.0.1:{self.proxy.port}", verify=verify, trust_env=False,
                                 timeout=10, **kwargs)

    @property
    def dialled(self) -> int:
        return self.merchant.connections + self.other.connections + self.pinned.connections + self.plain.connections


def short_socket_dir() -> Path:
    # A unix socket path is limited to ~107 bytes; pytest's tmp_path can be longer than that.
    return Path(tempfile.mkdtemp(prefix="wkp-"))


@contextlib.asynccontextmanager
async def world(tmp_path: Path, decide: Decide | None = None, *, start_decider: bool = True,
                decider_token: str = TOKEN, proxy_token: str = TOKEN, record: Record | None = None,
                **config: Any) -> AsyncIterator[World]:
    """The world; `record` stores the proxy's audit records instead of the in-memory `Decider` (e.g. the server's
    `DeciderService.record`, into the database)."""
    tls, ca_file = upstream_tls(tmp_path, HOSTS)
    merchant, other, pinned, plain = Upstream(tls), Upstream(tls), RawUpstream(tls), Upstream(None)
    upstreams: tuple[Upstream | RawUpstream, ...] = (merchant, other, pinned, plain)
    for upstream in upstreams:
        await upstream.start()
    keys = KeyRing(current=generate_key())
    vault = Vault(tmp_path / "vault.json", keys)
    vault.set("merchant_api", SECRET.encode(), "merchant.test", "Authorization", "Bearer {secret}")
    resolve = RecordingMap({h: ["127.0.0.1"] for h in HOSTS})
    sock_dir = short_socket_dir()
    socket_path = sock_dir / "run" / "decider.sock"
    decider = Decider(decide or allow_tool())
    server = DeciderServer(socket_path, decider_token, decider.on_decide, record or decider.on_record)
    if start_decider:
        await server.start()
    settings: dict[str, Any] = {
        "decider_socket": socket_path, "decider_token": proxy_token, "ca_dir": tmp_path / "ca", "keys": keys,
        "vault": vault, "upstream_cafile": ca_file, "resolve": resolve,
        "allowed_private": frozenset({"merchant.test", "other.test", "pinned.test", "plain.test"}),
        "no_intercept": frozenset({"pinned.test"}), "decider_timeout": 2.0,
    }
    settings.update(config)
    proxy = await serve_proxy(ProxyConfig(**settings))
    try:
        yield World(proxy=proxy, decider=decider, decider_server=server, merchant=merchant, other=other,
                    pinned=pinned, plain=plain, resolve=resolve, vault=vault, ca_file=ca_file, socket_path=socket_path,
                    deployment_ca=tmp_path / "ca" / CA_CERT_FILE)
    finally:
        await proxy.close(audit_grace=0.2)
        await server.close()
        for upstream in upstreams:
            await upstream.close()
        with contextlib.suppress(OSError):
            socket_path.parent.rmdir()
            sock_dir.rmdir()


@contextlib.asynccontextmanager
async def recorded_world(tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings,
                         **config: Any) -> AsyncIterator[World]:
    """The world with the server's own decider in place of the scripted one: `DeciderService` over the database
    behind `engine` (tool computers' credentials, the egress allowlist in `settings.policies`, the audit rows)."""
    service = DeciderService(engine, clock, settings)
    (tmp_path / "world").mkdir()
    try:
        async with world(tmp_path / "world", service.decide, record=service.record, **config) as w:
            yield w
    finally:
        service.close()


def allow_rules(settings: Settings, w: World, *rules: tuple[str, str, str]) -> None:
    """Write the egress allowlist: one rule per (name, host, methods as TOML), on the host's port in this world."""
    settings.policies.mkdir(parents=True, exist_ok=True)
    (settings.policies / "egress.toml").write_text("".join(
        f'[[allow]]\nname = "{name}"\nhost = "{host}"\nports = [{w.port_of(host)}]\nmethods = {methods}\n'
        for name, host, methods in rules))


async def audited(w: World, engine: Engine) -> list[dict[str, Any]]:
    """Every audit row, newest first, through the reader `GET /v1/egress` and `wakeful egress log` use: read once
    every connection the proxy had is over and the decider has stored every record the proxy sent."""
    async with asyncio.timeout(10):
        while w.proxy.open_connections:  # the proxy notices a client's close on its own time
            await asyncio.sleep(0.01)
    assert await w.proxy.decider.flush(10), "the decider did not store every audit record"
    with read(engine) as conn:
        return list(egress.audit_rows(conn, user_id=None, limit=10_000))


def refusal_code(response: httpx.Response) -> str:
    assert response.headers["x-wakeful-refusal"] == response.json()["error"]["code"]
    return str(response.json()["error"]["code"])


__all__ = ["CLIENT_TOKEN", "SECRET", "TOKEN", "Decider", "Received", "RecordingMap", "Refuse", "World", "allow_rules",
           "allow_tool", "audited", "recorded_world", "refusal_code", "refuse_all", "world"]
