"""`wakeful mcp`: a stdio ⇄ streamable-HTTP bridge to a running server's `/mcp`.

The process an MCP client starts (Claude Code's `claude mcp add wakeful -- wakeful mcp --url …`) holds no database,
no settings and no user credential: only the server's URL and the credential it was given (a file or the
environment). It relays every JSON-RPC message as it is — requests, responses, notifications, both ways — between
the client on stdin/stdout and the server's streamable HTTP endpoint: a client line is POSTed as its body, and what
the server answers (a JSON body, or the `data:` of each SSE event, or an event on the session's GET stream) is written
back as one line. Tools, resources and their errors are the server's: nothing is re-implemented here, and what a tool
creates (a handoff's live-view link, a timer) lives in the server, not in this process.

Why raw lines and not the `mcp` SDK's two transports: they parsed and re-serialised every message with pydantic on
each side, read stdin and wrote stdout through a worker thread per line, and closed each response's SSE stream
before its end, so every call opened a new TCP connection. The profile (bench/mcp_roundtrip.py) put the bridge at
~5 ms of CPU per call, more than the tool itself. Here a message is parsed once with `json`, the HTTP connection is
kept alive, and stdin/stdout are event-loop pipes.

Per message, the bridge only adds what the HTTP wire carries outside the body (`Wire`): the session's
`Mcp-Session-Id`, a 2026-era request's routing headers (`MCP-Protocol-Version`, `Mcp-Method`, `Mcp-Name`, copied
from the request itself), and in the handshake era the protocol version the server answered `initialize` with. An
HTTP failure becomes a JSON-RPC error on the request it answered, so the client's call ends instead of hanging.
Before it reads a byte of stdin it asks the server once (`server/discover`): an unreachable server or a refused
credential ends it at once with a plain message and exit 2, instead of an MCP client that cannot tell why its tools
are missing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from mcp.shared.inbound import (
    MCP_METHOD_HEADER,
    MCP_NAME_HEADER,
    MCP_PROTOCOL_VERSION_HEADER,
    NAME_BEARING_METHODS,
    encode_header_value,
)
from mcp_types import CONNECTION_CLOSED, INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, PROTOCOL_VERSION_META_KEY
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from wakeful.server.errors import WakefulError
from wakeful.server.faces.bridge_http import HttpClient, Response, TransportError
from wakeful.server.faces.stdio_lines import StdioLines

__all__ = ["SseDecoder", "Wire", "endpoint", "error_line", "preflight", "run_bridge"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT: Final = 10.0
"""Seconds the start-up check waits for the server before saying it is unreachable."""

SESSION_HEADER: Final = "mcp-session-id"
GET_STREAM_ATTEMPTS: Final = 2
"""Times in a row the server-to-client GET stream may fail to open before the bridge stops asking (the SDK's own)."""


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


# -- the wire, sans I/O -----------------------------------------------------------------------------------------------


@dataclass
class Wire:
    """What the HTTP wire carries besides a message's body, learnt from the messages that went by."""

    session_id: str | None = None
    """The server's `Mcp-Session-Id`, from its answer to `initialize` (the handshake era)."""
    version: str | None = None
    """The protocol version every message carries: the last 2026-era request's own, or what `initialize` settled."""
    _initialize_ids: set[Any] = field(default_factory=set)

    @property
    def modern(self) -> bool:
        return self.version in MODERN_PROTOCOL_VERSIONS

    def headers(self, message: dict[str, Any]) -> dict[str, str]:
        """The headers to POST a message of the client's with."""
        method = message.get("method")
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        meta = params.get("_meta")
        version = meta.get(PROTOCOL_VERSION_META_KEY) if isinstance(meta, dict) else None
        headers = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
        if self.session_id is not None:
            headers[SESSION_HEADER] = self.session_id
        if "id" in message and isinstance(method, str):
            if isinstance(version, str) and version in MODERN_PROTOCOL_VERSIONS:
                self.version = version
                headers[MCP_METHOD_HEADER] = method
                name_key = NAME_BEARING_METHODS.get(method)
                if name_key is not None and isinstance(name := params.get(name_key), str):
                    headers[MCP_NAME_HEADER] = encode_header_value(name)
            elif method == "initialize":
                self.version = None  # the handshake settles it; a discover probe's version must not leak onto it
                self._initialize_ids.add(message["id"])
        if self.version is not None:
            headers[MCP_PROTOCOL_VERSION_HEADER] = self.version
        return headers

    def answered(self, request: dict[str, Any], session_id: str | None) -> None:
        """The server answered a request with HTTP success; an `initialize` answer names the session."""
        if request.get("method") == "initialize" and session_id:
            self.session_id = session_id

    def learn(self, message: Any) -> None:
        """Learn from a message of the server's: the version an `initialize` settled on."""
        if not isinstance(message, dict) or "id" not in message or message["id"] not in self._initialize_ids:
            return
        self._initialize_ids.discard(message["id"])
        result = message.get("result")
        if isinstance(result, dict) and isinstance(version := result.get("protocolVersion"), str):
            self.version = version


class SseDecoder:
    """Server-sent events, fed bytes as they arrive: the `data` of each complete `message` event (a priming event,
    with no data, is skipped)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        out = []
        for raw in lines:
            line = raw.removesuffix(b"\r").decode("utf-8", "replace")
            if not line:
                if (data := "\n".join(self._data)) and self._event in ("", "message"):
                    out.append(data)
                self._event, self._data = "", []
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                self._data.append(value)
            elif name == "event":
                self._event = value
        return out


def error_line(request_id: Any, code: int, message: str) -> bytes:
    """A JSON-RPC error answering the client's request, as the line written to it."""
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}).encode()


def http_failure(url: str, status: int, body: bytes, *, in_session: bool) -> tuple[int, str]:
    """The JSON-RPC error code and words for an HTTP status that carried no JSON-RPC error of its own."""
    said = body.decode("utf-8", "replace").strip()[:200]
    if status == 404 and not in_session:
        return METHOD_NOT_FOUND, "Not Found"  # a server without this method (the client falls back on it)
    if status == 404:
        return INVALID_REQUEST, "Session terminated"
    if status == 401:
        return INTERNAL_ERROR, (f"the server at {url} refused the credential (401): it was revoked or re-issued; "
                                "restart `wakeful mcp` with a current one")
    return INTERNAL_ERROR, f"the server at {url} answered {status}: {said or 'no reason given'}"


def _one_line(text: str | bytes) -> tuple[bytes, Any] | None:
    """A server message as one line for the client, with its parsed value; None when it is not JSON."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    line = text.encode() if isinstance(text, str) else text
    line = line.strip()
    if b"\n" in line or b"\r" in line:
        line = json.dumps(value).encode()
    return line, value


# -- the shell: stdin, stdout and HTTP --------------------------------------------------------------------------------


def _client(url: str, token: str) -> HttpClient:
    # The SDK transport's defaults: 30 s to connect, 300 s to wait for a read (a response stream may stay open).
    return HttpClient(url, {"authorization": f"Bearer {token}"}, connect_timeout=30.0, read_timeout=300.0)


async def preflight(url: str, token: str) -> None:
    """Ask the server once who it is, with the credential: refused with a plain reason when that cannot work."""
    version = MODERN_PROTOCOL_VERSIONS[-1]
    body = {"jsonrpc": "2.0", "id": 0, "method": "server/discover",
            "params": {"_meta": {PROTOCOL_VERSION_META_KEY: version, "io.modelcontextprotocol/clientCapabilities": {},
                                 "io.modelcontextprotocol/clientInfo": {"name": "wakeful-mcp", "version": "1"}}}}
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               MCP_PROTOCOL_VERSION_HEADER: version, MCP_METHOD_HEADER: "server/discover"}
    http = _client(url, token)
    try:
        async with http.request("POST", headers, json.dumps(body).encode(), within=PROBE_TIMEOUT) as response:
            said = (await response.read()).decode("utf-8", "replace")[:200]
    except TransportError as exc:
        raise WakefulError("server_unreachable", f"no wakeful server answers at {url} ({exc}): is `wakeful serve` "
                                                 "running, and is --url right?") from None
    finally:
        await http.aclose()
    if response.status == 401:
        raise WakefulError("bad_token", f"the server at {url} refused the credential (401): it is not one it "
                                         "issued, or it was revoked or re-issued")
    if response.status == 403:
        raise WakefulError("forbidden", f"the server at {url} refused this credential (403): {said}")
    if response.status == 404:
        raise WakefulError("not_an_mcp_endpoint", f"nothing answers MCP at {url} (404): give the server's URL, "
                                                   "e.g. http://127.0.0.1:8787")
    if response.status >= 500:
        raise WakefulError("server_error", f"the server at {url} failed ({response.status}); see its log")


async def run_bridge(url: str, token: str) -> None:
    """Relay MCP messages between this process's stdin/stdout and the server until stdin closes."""
    await preflight(url, token)
    http = _client(url, token)
    try:
        async with StdioLines.open() as stdio:
            await _Relay(url, http, stdio).run()
    finally:
        await http.aclose()


@dataclass(eq=False)
class _Relay:
    url: str
    http: HttpClient
    stdio: StdioLines
    wire: Wire = field(default_factory=Wire)
    _posts: dict[Any, tuple[asyncio.Task[None], bool]] = field(default_factory=dict)
    """Each request's POST in flight, and whether it went out in the 2026 era (where cancelling is closing it)."""
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def run(self) -> None:
        try:
            async for line in self.stdio.lines():
                await self._up(line)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.wire.session_id is not None:  # the client is done: so is its session
                try:
                    async with self.http.request("DELETE", self.wire.headers({}), within=PROBE_TIMEOUT):
                        pass
                except TransportError as exc:
                    log.debug("wakeful mcp: ending the session failed: %s", exc)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _up(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):  # said, then dropped, as the SDK's stdio transport did
            log.warning("wakeful mcp: dropped a line from the client that is not a JSON-RPC message: %.200r", line)
            return
        if message.get("method") == "notifications/cancelled" and self._cancelled(message):
            return
        headers = self.wire.headers(message)
        if "id" in message and "method" in message:  # a request: answered on its own POST, in its own time
            request_id = message["id"]
            task = self._spawn(self._request(line, message, headers))
            self._posts[request_id] = (task, self.wire.modern)
            task.add_done_callback(lambda done: self._settled(request_id, done))
        else:  # a notification or an answer to the server: sent in order, before the next line
            await self._send(line, message, headers)
            if message.get("method") == "notifications/initialized" and self.wire.session_id is not None:
                self._spawn(self._listen())

    def _settled(self, request_id: Any, task: asyncio.Task[None]) -> None:
        if self._posts.get(request_id, (None, False))[0] is task:  # not a later request that reused the id
            del self._posts[request_id]

    def _cancelled(self, message: dict[str, Any]) -> bool:
        """In the 2026 era, cancelling a request is closing its POST: True when that is done instead of sending."""
        params = message.get("params")
        request_id = params.get("requestId") if isinstance(params, dict) else None
        post = self._posts.get(request_id)
        if post is not None:
            task, modern = post
            if modern:
                task.cancel()
            return modern
        return self.wire.modern

    async def _request(self, line: bytes, message: dict[str, Any], headers: dict[str, str]) -> None:
        request_id = message["id"]
        try:
            async with self.http.request("POST", headers, line) as response:
                if response.status == 202:
                    self.stdio.write(error_line(request_id, INVALID_REQUEST,
                                                "the server answered a request with 202 Accepted"))
                elif response.status >= 300:
                    self.stdio.write(await self._failure(request_id, response))
                else:
                    self.wire.answered(message, response.headers.get(SESSION_HEADER))
                    if not await self._forward(response, request_id):
                        self.stdio.write(error_line(request_id, CONNECTION_CLOSED,
                                                    "the server closed the response before answering"))
        except TransportError as exc:
            self.stdio.write(error_line(request_id, CONNECTION_CLOSED, f"the server at {self.url} did not answer "
                                                                       f"({exc}): is `wakeful serve` still running?"))

    async def _failure(self, request_id: Any, response: Response) -> bytes:
        body = await response.read()
        parsed = _one_line(body) if response.headers.get("content-type", "").startswith("application/json") else None
        got = parsed[1] if parsed is not None else None
        error = got.get("error") if isinstance(got, dict) else None
        if isinstance(got, dict) and "jsonrpc" in got and isinstance(error, dict) and type(error.get("code")) is int:
            # The server's own JSON-RPC error (its id may be null: it failed before reading it); ours is the id.
            return json.dumps({"jsonrpc": "2.0", "id": request_id, "error": error}).encode()
        if isinstance(error, dict) and isinstance(error.get("message"), str):  # wakeful's own refusal: its words
            body = f"{error.get('code')}: {error['message']}".encode()
        if 300 <= response.status < 400:
            where = response.headers.get("location", "elsewhere")
            return error_line(request_id, INVALID_REQUEST, f"the server at {self.url} redirects to {where}: "
                                                           "give `wakeful mcp --url` that address instead")
        code, words = http_failure(self.url, response.status, body, in_session=self.wire.session_id is not None)
        return error_line(request_id, code, words)

    async def _forward(self, response: Response, request_id: Any) -> bool:
        """Write what a response carries to the client, to the end of it (so its connection is kept); True when it
        held the answer to `request_id`."""
        answered = False
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            decoder = SseDecoder()
            async for chunk in response.chunks():
                for data in decoder.feed(chunk):
                    answered = self._down(data, request_id) or answered
        else:
            answered = self._down(await response.read(), request_id)
        return answered

    def _down(self, text: str | bytes, request_id: Any = None) -> bool:
        """One message of the server's to the client; True when it answers `request_id`."""
        got = _one_line(text)
        if got is None:
            log.warning("wakeful mcp: dropped a message from the server that is not JSON: %.200r", text)
            return False
        line, message = got
        self.wire.learn(message)
        self.stdio.write(line)
        return (request_id is not None and isinstance(message, dict) and message.get("id") == request_id
                and "method" not in message)

    async def _send(self, line: bytes, message: dict[str, Any], headers: dict[str, str]) -> None:
        what = message.get("method", "response")
        try:
            async with self.http.request("POST", headers, line) as response:
                said = await response.read()
        except TransportError as exc:
            log.warning("wakeful mcp: the server did not take a %s: %s", what, exc)
            return
        if response.status >= 300:
            log.warning("wakeful mcp: the server refused a %s (%d): %.200r", what, response.status, said)

    async def _listen(self) -> None:
        """The session's GET stream: what the server says unasked (notifications, its own requests) to the client."""
        failures = 0
        while failures < GET_STREAM_ATTEMPTS:
            try:
                headers = {**self.wire.headers({}), "accept": "text/event-stream"}
                async with self.http.request("GET", headers) as response:
                    if response.status != 200:
                        log.debug("wakeful mcp: no GET stream (%d)", response.status)
                        return
                    failures = 0
                    await self._forward(response, None)
            except TransportError as exc:
                log.debug("wakeful mcp: the GET stream broke: %s", exc)
            failures += 1
            await asyncio.sleep(1.0)  # the SDK's reconnection delay: not a busy loop against a server that is down
