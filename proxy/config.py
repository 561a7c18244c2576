"""What the proxy server is told at start: where to listen, how to reach the decider, what to trust."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from wakeful.proxy.hosts import normalize_host
from wakeful.proxy.vault import KeyRing, Vault

__all__ = ["ProxyConfig"]


def _hosts(hosts: frozenset[str]) -> frozenset[str]:
    return frozenset(normalize_host(h) for h in hosts)


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    decider_socket: Path
    """The decider's unix socket (see `proxy.channel`)."""
    decider_token: str | Callable[[], str] = field(repr=False)
    """The shared secret the proxy says hello with on the decider channel, or what says the current one at each
    connect (the decider may be restarted with a new one: see `channel.DeciderClient`)."""
    ca_dir: Path
    """Holds `ca.pem` and `ca.key.enc`; the CA is created there on first start (see `proxy.tls`)."""
    keys: KeyRing = field(repr=False)
    """The vault's key ring; the CA's private key is sealed under its current key."""
    vault: Vault
    """Where the credentials named by allows are decrypted from."""
    listen_host: str = "127.0.0.1"
    """The address the proxy listens on."""
    listen_port: int = 0
    """0 picks a free port; `ProxyServer.port` reports the one bound."""
    address_listen: tuple[str, int] | None = None
    """A second listener for tool computers on an isolated network: a connection there is known by its source
    address alone, looked up in `address_book` (port 0 picks a free one; `ProxyServer.address_port` reports it)."""
    address_book: Path | None = None
    """The file the VM manager writes naming who holds each address on that network (see `proxy.addressbook`)."""
    relay_socket: Path | None = None
    """A unix socket (0600, in a 0700 directory: the wakeful user's alone) for tool computers on that network on
    other hosts, relayed by the api's SSH tunnel: each connection begins with a PROXY line naming the computer's
    address (`proxy.proxyline`) and is then known by it alone, as on the address listener. Needs `address_book`."""
    decider_timeout: float = 2.0
    """Seconds to wait for a verdict before refusing with `decider_unavailable`."""
    upstream_cafile: Path | None = None
    """The CA bundle upstream servers are verified against; None means the system's trust store."""
    resolve: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Static answers `{normalised host: [ip, …]}` consulted before DNS, at request time, only after an allow."""
    allowed_private: frozenset[str] = frozenset()
    """The only hosts that may resolve to private, loopback or reserved addresses."""
    no_intercept: frozenset[str] = frozenset()
    """Hosts that pin certificates or need mutual TLS: CONNECT is decided once (method CONNECT, path "") and
    tunnelled raw, so no credential can be injected for them."""
    max_body_bytes: int = 10 * 1024 * 1024
    """A larger request body is answered 413 and never decided."""
    client_timeout: float = 60.0
    """Seconds a client connection may sit idle between requests, and the bound on each read from it (the whole
    head and body have their own deadlines below); also its TLS handshake inside a CONNECT tunnel (a tool computer's
    Chromium under TCG takes up to ~10 s for one, certificate checks included) and the ClientHello of a tunnel that
    is not intercepted."""
    request_head_timeout: float = 30.0
    """Seconds from a request's first byte until its whole head (request line and headers) is in: a head dripped in
    slowly is answered 408 `request_timeout` and the connection closed, however short each pause is."""
    request_body_timeout: float = 120.0
    """Seconds from the end of a request's head until its whole body is in; else 408 `request_timeout`."""
    max_connections: int = 256
    """Client connections open at once, on both listeners together; one more is answered 503
    `too_many_connections` and closed before anything is read from it."""
    max_buffered_bytes: int = 64 * 1024 * 1024
    """Request-body bytes held by the proxy at once, over every client; a body that would pass it is answered 503
    `proxy_busy` (a declared length is checked before any of it is read)."""
    max_client_buffered_bytes: int = 24 * 1024 * 1024
    """Request-body bytes held at once for one client (a tool computer's user, or all connector calls together);
    a body that would pass it is answered 503 `proxy_busy`."""
    handshake_timeout: float = 10.0
    """Seconds for the TLS handshake with the upstream."""
    connect_timeout: float = 10.0
    """Seconds to open a connection to the upstream (per address tried)."""
    upstream_timeout: float = 60.0
    """Seconds to wait for the upstream's response headers, and between its body chunks; 504 when exceeded."""
    pool_idle_seconds: float = 15.0
    """How long an idle upstream keep-alive connection is kept for reuse."""
    pool_max_idle: int = 32
    """Idle upstream connections kept per (address, port, scheme, TLS host)."""
    leaf_cache_size: int = 1024
    """Hosts whose leaf certificate and TLS context are kept ready."""
    malformed_rows_burst: int = 20
    """Connections that send no readable HTTP/1.1 request (400 `malformed_request`) recorded one row each before
    `malformed_rows_every` applies; past it the rest are counted (see `malformed_summary_every`)."""
    malformed_rows_every: float = 10.0
    """Seconds per further `malformed_request` row written one by one, once the burst is spent."""
    malformed_summary_every: float = 60.0
    """Seconds after the first `malformed_request` connection that got no row of its own until one row counts it
    and every other one since: a flood writes about one row per `malformed_rows_every` and one per this, not one
    per connection."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_private", _hosts(self.allowed_private))
        object.__setattr__(self, "no_intercept", _hosts(self.no_intercept))
        if self.max_body_bytes < 0 or self.decider_timeout <= 0:
            raise ValueError("max_body_bytes must be ≥ 0 and decider_timeout > 0")
        if min(self.request_head_timeout, self.request_body_timeout, self.client_timeout) <= 0:
            raise ValueError("client_timeout, request_head_timeout and request_body_timeout must be > 0")
        if self.max_connections < 1 or min(self.max_buffered_bytes, self.max_client_buffered_bytes) < 0:
            raise ValueError("max_connections must be ≥ 1 and the buffered-byte caps ≥ 0")
        if self.malformed_rows_burst < 0 or min(self.malformed_rows_every, self.malformed_summary_every) <= 0:
            raise ValueError("malformed_rows_burst must be ≥ 0, malformed_rows_every and malformed_summary_every > 0")
        if (self.address_listen is None) != (self.address_book is None):
            raise ValueError("address_listen and address_book go together: one is set without the other")
        if self.relay_socket is not None and self.address_book is None:
            raise ValueError("relay_socket needs address_book: a relayed connection is known by its address alone")
