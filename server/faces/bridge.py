"""`wakeful mcp`: a stdio ⇄ streamable-HTTP bridge to a running server's `/mcp`.

The process an MCP client starts (Claude Code's `claude mcp add wakeful -- wakeful mcp --url …`) holds no database,
no settings and no user credential: only the server's URL and the credential it was given (a file or the
environment). It forwards every JSON-RPC message as it is — requests, responses, notifications, both ways — between
the client on stdin/stdout and the server's streamable HTTP endpoint, through the `mcp` SDK's own two transports.
Tools, resources and their errors are the server's: nothing is re-implemented here, and what a tool creates (a
handoff's live-view link, a timer) lives in the server, not in this process.

Per message, the bridge only adds what the HTTP wire carries outside the body: a 2026-era request's routing headers
(`MCP-Protocol-Version`, `Mcp-Method`, `Mcp-Name`, copied from the request itself), and in the handshake era the
protocol version the server answered `initialize` with. Before it reads a byte of stdin it asks the server once
(`server/discover`): an unreachable server or a refused credential ends it at once with a plain message and exit 2,
instead of an MCP client that cannot tell why its tools are missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import httpx2
from mcp.client.streamable_http import streamable_http_client
from mcp.server.stdio import stdio_server
from mcp.shared._stream_protocols import ReadStream, WriteStream
from mcp.shared.inbound import (
    MCP_METHOD_HEADER,
    MCP_NAME_HEADER,
    MCP_PROTOCOL_VERSION_HEADER,
    NAME_BEARING_METHODS,
    encode_header_value,
)
from mcp.shared.message import ClientMessageMetadata, SessionMessage
from mcp_types import PROTOCOL_VERSION_META_KEY, JSONRPCRequest, JSONRPCResponse
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from wakeful.server.errors import WakefulError

__all__ = ["Headers", "endpoint", "preflight", "run_bridge"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT: Final = 10.0
"""Seconds the start-up check waits for the server before saying it is unreachable."""


def endpoint(url: str) -> str:
    """The MCP endpoint of a server URL: `http://127.0.0.1:8787` (or with a trailing `/`) means its `/mcp`; a URL
    with another path is taken as the endpoint itself."""
    url = url.strip()
    if not url.startswith(("http://", "https://")):
        raise WakefulError("bad_url", f"{url!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:8787)")
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    if not host:
        raise WakefulError("bad_url", f"{url!r} names no host")
    return f"{scheme}://{host}/mcp" if not slash or not path else url


@dataclass
class Headers:
    """What a message needs on the HTTP wire besides its body."""

    legacy_version: str | None = None
    """The protocol version the server answered `initialize` with (the handshake era), once it has."""
    _initialize_ids: set[Any] = field(default_factory=set)

    def up(self, message: SessionMessage) -> SessionMessage:
        """A message from the client, with the headers it needs."""
        rpc = message.message
        if not isinstance(rpc, JSONRPCRequest):
            return message
        params = rpc.params or {}
        meta = params.get("_meta") if isinstance(params, dict) else None
        version = meta.get(PROTOCOL_VERSION_META_KEY) if isinstance(meta, dict) else None
        headers: dict[str, str] = {}
        if isinstance(version, str) and version in MODERN_PROTOCOL_VERSIONS:
            headers = {MCP_PROTOCOL_VERSION_HEADER: version, MCP_METHOD_HEADER: rpc.method}
            name_key = NAME_BEARING_METHODS.get(rpc.method)
            if name_key is not None and isinstance(name := params.get(name_key), str):
                headers[MCP_NAME_HEADER] = encode_header_value(name)
        elif rpc.method == "initialize":
            self._initialize_ids.add(rpc.id)
        elif self.legacy_version is not None:
            headers = {MCP_PROTOCOL_VERSION_HEADER: self.legacy_version}
        if not headers:
            return message
        return SessionMessage(rpc, metadata=ClientMessageMetadata(headers=headers))

    def down(self, message: SessionMessage) -> None:
        """Learn from a message of the server's: the version an `initialize` settled on."""
        rpc = message.message
        if isinstance(rpc, JSONRPCResponse) and rpc.id in self._initialize_ids:
            self._initialize_ids.discard(rpc.id)
            version = rpc.result.get("protocolVersion")
            if isinstance(version, str):
                self.legacy_version = version


def _client(token: str) -> httpx2.AsyncClient:
    # The transports' own defaults: 30 s to connect or write, 300 s to read (a response stream may stay open).
    return httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                              timeout=httpx2.Timeout(30.0, read=300.0))


async def preflight(url: str, token: str) -> None:
    """Ask the server once who it is, with the credential: refused with a plain reason when that cannot work."""
    version = MODERN_PROTOCOL_VERSIONS[-1]
    body = {"jsonrpc": "2.0", "id": 0, "method": "server/discover",
            "params": {"_meta": {PROTOCOL_VERSION_META_KEY: version, "io.modelcontextprotocol/clientCapabilities": {},
                                 "io.modelcontextprotocol/clientInfo": {"name": "wakeful-mcp", "version": "1"}}}}
    headers = {"accept": "application/json, text/event-stream", MCP_PROTOCOL_VERSION_HEADER: version,
               MCP_METHOD_HEADER: "server/discover"}
    async with _client(token) as http:
        try:
            response = await http.post(url, json=body, headers=headers, timeout=PROBE_TIMEOUT)
        except httpx2.HTTPError as exc:
            why = str(exc) or type(exc).__name__
            raise WakefulError("server_unreachable", f"no wakeful server answers at {url} ({why}): is `wakeful serve` "
                                                     "running, and is --url right?") from None
    if response.status_code == 401:
        raise WakefulError("bad_token", f"the server at {url} refused the credential (401): it is not one it "
                                         "issued, or it was revoked or re-issued")
    if response.status_code == 403:
        raise WakefulError("forbidden", f"the server at {url} refused this credential (403): {response.text[:200]}")
    if response.status_code == 404:
        raise WakefulError("not_an_mcp_endpoint", f"nothing answers MCP at {url} (404): give the server's URL, "
                                                   "e.g. http://127.0.0.1:8787")
    if response.status_code >= 500:
        raise WakefulError("server_error", f"the server at {url} failed ({response.status_code}); see its log")


async def run_bridge(url: str, token: str) -> None:
    """Forward MCP messages between this process's stdin/stdout and the server until stdin closes."""
    await preflight(url, token)
    headers = Headers()
    async with _client(token) as http, \
            streamable_http_client(url, http_client=http) as (from_server, to_server), \
            stdio_server() as (from_client, to_client), \
            anyio.create_task_group() as tg:

        async def up() -> None:
            await _pump(from_client, to_server, headers.up, "client")
            tg.cancel_scope.cancel()  # the client closed stdin: it is done with us

        async def down() -> None:
            def learn(message: SessionMessage) -> SessionMessage:
                headers.down(message)
                return message

            await _pump(from_server, to_client, learn, "server")
            tg.cancel_scope.cancel()

        tg.start_soon(up)
        tg.start_soon(down)


async def _pump(source: ReadStream[SessionMessage | Exception], sink: WriteStream[SessionMessage],
                adapt: Callable[[SessionMessage], SessionMessage], side: str) -> None:
    async with sink:
        async for item in source:
            if isinstance(item, Exception):  # a line or an event that is not JSON-RPC: said, then dropped
                log.warning("wakeful mcp: dropped a message from the %s that is not JSON-RPC: %s", side, item)
                continue
            await sink.send(adapt(item))

