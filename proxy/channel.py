"""The local authenticated channel between the proxy and the policy decider: both ends.

Unix domain socket, in a directory of mode 0700, the socket itself 0600. Every message is a frame:

    4-byte big-endian unsigned N (1 ≤ N ≤ MAX_MESSAGE_BYTES + 1), then N bytes: 1 byte kind, N-1 bytes body

    H  client → server  {"v":1,"token":"…"}      hello; first frame, within 2 s, or the server closes
    W  server → client  {"v":1}                   welcome; never sent for a wrong token (the server closes instead)
    D  client → server  contract.encode_request   a decision request
    V  server → client  contract.encode_verdict   its verdict (answers may come back in any order)
    A  client → server  audit.encode_record       one egress record
    K  server → client  {"v":1,"request_id":"…"}  the record is durably stored

Anything else (an oversized frame, an unknown kind, a body that does not parse) closes the connection.
`DeciderClient` (the proxy's end) never raises into the proxy and never allows on error. It asks for its token at
every connect: the decider may have been restarted with a new one (`wakeful api` writes one at each start).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from wakeful.proxy.audit import EgressRecord, encode_record, parse_record
from wakeful.proxy.contract import (
    MAX_MESSAGE_BYTES,
    Allow,
    ContractError,
    DecisionRequest,
    RefusalCode,
    Refuse,
    Verdict,
    encode_request,
    encode_verdict,
    parse_request,
    parse_verdict,
    refuse,
)
from wakeful.proxy.wire import describe

__all__ = ["ChannelError", "DeciderClient", "DeciderServer", "Decide", "DecideNow", "Record",
           "private_unix_server"]

log = logging.getLogger("wakeful.proxy.channel")


async def private_unix_server(path: Path, serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                                          Awaitable[None]], *, what: str,
                              refused: Callable[[str], Exception]) -> asyncio.Server:
    """A unix listener at `path` that only this user can reach: its directory 0700 (made so if missing; if it is
    open to others, raises `refused(message naming what)`), the socket 0600. A socket file left there by a process
    that was killed is replaced (asyncio does it)."""
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if parent.stat().st_mode & 0o077:
        raise refused(f"{what}'s directory {parent} is open to others: chmod 700 it")
    server = await asyncio.start_unix_server(serve, path=str(path))
    os.chmod(path, 0o600)
    return server

HELLO: Final = b"H"
WELCOME: Final = b"W"
DECIDE: Final = b"D"
VERDICT: Final = b"V"
AUDIT: Final = b"A"
ACK: Final = b"K"
MAX_FRAME: Final = MAX_MESSAGE_BYTES + 1
HELLO_TIMEOUT: Final = 2.0
AUDIT_DELAY: Final = 0.02  # audit frames ride along with the next decision request, or go out after this long
RECORD_GATHER: Final = 0.02  # the decider gathers records this long before storing them: one transaction for many
_RECORD_BATCH: Final = 500

Decide = Callable[[DecisionRequest], Awaitable[Verdict]]
DecideNow = Callable[[DecisionRequest], Verdict | None]
Record = Callable[[list[EgressRecord]], Awaitable[None]]
Token = Callable[[], str]
"""The decider's current token, asked for at each connect (it may read a file: keep it to a few microseconds)."""


class ChannelError(Exception):
    """A frame or handshake that breaks the protocol; the connection it came on is closed."""


def frame(kind: bytes, body: bytes) -> bytes:
    size = 1 + len(body)
    if size > MAX_FRAME:
        raise ChannelError(f"a {kind!r} frame of {size} bytes exceeds {MAX_FRAME}")
    return size.to_bytes(4, "big") + kind + body


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(kind, body). Raises `ChannelError` for a bad length, `asyncio.IncompleteReadError` at end of stream."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    if not 1 <= size <= MAX_FRAME:
        raise ChannelError(f"frame length {size} is out of range")
    data = await reader.readexactly(size)
    return data[:1], data[1:]


def _json_object(body: bytes, keys: frozenset[str]) -> dict[str, object]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        raise ChannelError("a frame body is not JSON") from None
    if not isinstance(obj, dict) or set(obj) != keys or obj.get("v") != 1 or type(obj["v"]) is not int:
        raise ChannelError(f"a frame body must be an object of exactly {sorted(keys)}, version 1")
    return obj


def _ack(request_id: str) -> bytes:
    return json.dumps({"v": 1, "request_id": request_id}, separators=(",", ":")).encode("ascii")


_ACK_KEYS = frozenset({"v", "request_id"})
_HELLO_KEYS = frozenset({"v", "token"})


# --- the proxy's end -----------------------------------------------------------------------------------------------


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.pending: dict[str, asyncio.Future[Verdict]] = {}
        self.reading: asyncio.Task[None] | None = None

    def send(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)


class DeciderClient:
    """One persistent, pipelined connection to the decider; reconnects on demand, one connect at a time.

    `decide` answers `Refuse(decider_unavailable)` when no well-formed verdict arrives within `timeout` seconds or
    the connection is lost, and `Refuse(malformed_verdict)` for an answer that is not understood. `audit` queues a
    record until the decider acknowledges it; unacknowledged records are re-sent after a reconnect (the decider
    deduplicates by request_id) and the oldest are dropped past `audit_capacity`, counted in `audit_dropped`.

    `token` is the secret itself, or a `Token` that says the current one at each connect. After the decider refuses
    a hello, the client tries again by itself (backing off) as soon as `token` says another one, so a decider
    restarted with a new token is reached again without waiting for a request; the refused one is tried again only
    for a request.
    """

    def __init__(self, path: Path | str, token: str | Token, *, timeout: float = 2.0, backoff: float = 0.05,
                 max_backoff: float = 1.0, audit_capacity: int = 100_000) -> None:
        self.path = str(path)
        self.timeout = timeout
        self._token: Token = token if callable(token) else (lambda: token)
        self._refused: str | None = None  # the token the decider last refused, until it welcomes one
        self._backoff_min = backoff
        self._backoff_max = max_backoff
        self._backoff = backoff
        self._capacity = audit_capacity
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._not_before = 0.0  # monotonic time before which no new connect is tried
        self._unacked: OrderedDict[str, bytes] = OrderedDict()
        self._outbox: list[bytes] = []  # audit frames not written yet, each also kept in _unacked
        self._outbox_timer: asyncio.TimerHandle | None = None
        self._drained = asyncio.Event()
        self._drained.set()
        self._closed = False
        self._down_logged = False
        self.audit_dropped = 0

    def __repr__(self) -> str:  # never the token
        return f"DeciderClient({self.path!r}, connected={self._conn is not None})"

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def audit_pending(self) -> int:
        """Records sent or queued that the decider has not acknowledged yet."""
        return len(self._unacked)

    async def decide(self, req: DecisionRequest) -> Verdict:
        """The decider's verdict on `req`, or a refusal. Never raises (except on cancellation)."""
        try:
            return await self._decide(req)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the proxy must get a verdict whatever went wrong here
            log.error("the decider channel failed on request %s: %s", req.request_id, describe(exc))
            return refuse(RefusalCode.DECIDER_UNAVAILABLE)

    async def _decide(self, req: DecisionRequest) -> Verdict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        conn = self._conn or await self._connected(deadline)
        if conn is None:
            return refuse(RefusalCode.DECIDER_UNAVAILABLE)
        if req.request_id in conn.pending:
            return refuse(RefusalCode.DECIDER_UNAVAILABLE, "a request with this id is already waiting for a verdict")
        future: asyncio.Future[Verdict] = loop.create_future()
        conn.pending[req.request_id] = future
        timer = loop.call_at(deadline, _expire, future, self.timeout)
        try:
            conn.send(self._take_outbox() + frame(DECIDE, encode_request(req)))
            return await future
        finally:
            timer.cancel()
            conn.pending.pop(req.request_id, None)

    def audit(self, record: EgressRecord) -> None:
        """Queue one record for the decider; returns at once."""
        if self._closed:
            self.audit_dropped += 1
            log.warning("egress audit record %s dropped: the decider channel is closed", record.request_id)
            return
        body = encode_record(record)
        self._unacked[record.request_id] = body
        self._drained.clear()
        if len(self._unacked) > self._capacity:
            self._unacked.popitem(last=False)
            self.audit_dropped += 1
            if self.audit_dropped == 1 or self.audit_dropped % 1000 == 0:
                log.warning("%d egress audit records dropped so far: the decider has not acknowledged %d records",
                            self.audit_dropped, self._capacity)
        if self._conn is not None:
            self._outbox.append(frame(AUDIT, body))
            if self._outbox_timer is None:
                self._outbox_timer = asyncio.get_running_loop().call_later(AUDIT_DELAY, self._send_outbox)
        else:
            self._kick()

    def _take_outbox(self) -> bytes:
        if self._outbox_timer is not None:
            self._outbox_timer.cancel()
            self._outbox_timer = None
        data = b"".join(self._outbox)
        self._outbox.clear()
        return data

    def _send_outbox(self) -> None:
        data = self._take_outbox()
        if data and self._conn is not None:
            self._conn.send(data)

    async def flush(self, within: float) -> bool:
        """Wait up to `within` seconds until every queued audit record is acknowledged; whether it was."""
        if self._unacked:
            self._send_outbox()
            self._kick()
        try:
            await asyncio.wait_for(self._drained.wait(), within)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        self._closed = True
        self._take_outbox()
        if self._retry is not None:
            self._retry.cancel()
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connecting
        conn = self._conn
        if conn is not None:
            self._lost(conn, refuse(RefusalCode.DECIDER_UNAVAILABLE, "the proxy is shutting down"))
            if conn.reading is not None:
                conn.reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await conn.reading
        if self._unacked:
            log.warning("%d egress audit records were not acknowledged before shutdown", len(self._unacked))

    # connection management

    async def _connected(self, deadline: float) -> _Connection | None:
        if self._closed:
            return None
        loop = asyncio.get_running_loop()
        if self._connecting is None:
            if time.monotonic() < self._not_before:
                return None  # backing off after a failed connect: refuse now rather than queue behind it
            self._connecting = asyncio.create_task(self._connect())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._connecting), max(0.0, deadline - loop.time()))
        return self._conn

    def _wanted(self) -> bool:
        # Audit records need a connection even when no request comes to open one; so does a refused hello, to find
        # the decider's new token before the next request does.
        return bool(self._unacked) or self._refused is not None

    def _kick(self) -> None:
        if self._closed or self._conn is not None or self._connecting is not None or self._retry is not None:
            return
        delay = self._not_before - time.monotonic()
        loop = asyncio.get_running_loop()
        if delay > 0:
            self._retry = loop.call_later(delay, self._retry_now)
        else:
            self._connecting = loop.create_task(self._connect(unasked=True))

    def _retry_now(self) -> None:
        self._retry = None
        if self._wanted():
            self._kick()

    async def _connect(self, *, unasked: bool = False) -> None:
        """One try. `unasked` (no request waits on it): a token the decider refused is not tried again."""
        try:
            token = self._token()
            if unasked and token == self._refused and not self._unacked:
                raise _StillRefused
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), HELLO_TIMEOUT)
            try:
                writer.write(frame(HELLO, json.dumps({"v": 1, "token": token}).encode("utf-8")))
                try:
                    kind, body = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT)
                except asyncio.IncompleteReadError:  # closed without a welcome: this token is not its own
                    self._refused = token
                    raise _Refused from None
                if kind != WELCOME:
                    raise ChannelError("the decider did not welcome us")
                _json_object(body, frozenset({"v"}))
            except BaseException:
                writer.close()
                raise
        except _StillRefused:
            self._retry_later()
            return
        except (OSError, ChannelError, TimeoutError, asyncio.IncompleteReadError, _Refused) as exc:
            self._retry_later()
            if not self._down_logged:
                if isinstance(exc, _Refused):
                    log.warning("the decider at %s refused our hello (a token from an earlier run of it?): refusing "
                                "requests until it answers; its token is read again at each try", self.path)
                else:
                    log.warning("cannot reach the decider at %s (%s): refusing requests until it answers",
                                self.path, type(exc).__name__)
                self._down_logged = True
            return
        finally:
            self._connecting = None
        conn = _Connection(reader, writer)
        self._conn = conn
        self._refused = None
        self._backoff = self._backoff_min
        if self._down_logged:
            log.info("the decider at %s answers again", self.path)
            self._down_logged = False
        conn.reading = asyncio.create_task(self._read(conn))
        for body in list(self._unacked.values()):
            conn.send(frame(AUDIT, body))

    def _retry_later(self) -> None:
        self._not_before = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._backoff_max)
        if self._wanted() and not self._closed:
            # Called from inside `_connect`, whose task slot is being cleared: schedule instead of recursing.
            asyncio.get_running_loop().call_soon(self._kick)

    async def _read(self, conn: _Connection) -> None:
        lost = refuse(RefusalCode.DECIDER_UNAVAILABLE, "the connection to the policy component was lost")
        try:
            while True:
                kind, body = await read_frame(conn.reader)
                if kind == VERDICT:
                    self._on_verdict(conn, body)
                elif kind == ACK:
                    self._on_ack(body)
                else:
                    raise ChannelError(f"unexpected frame kind {kind!r} from the decider")
        except ChannelError as exc:
            log.warning("closing the decider channel: %s", exc)
            lost = refuse(RefusalCode.MALFORMED_VERDICT)
        except (asyncio.IncompleteReadError, OSError):
            pass
        finally:
            self._lost(conn, lost)

    def _on_verdict(self, conn: _Connection, body: bytes) -> None:
        try:
            request_id = json.loads(body).get("request_id")
        except (ValueError, AttributeError, RecursionError):
            request_id = None
        if not isinstance(request_id, str):
            raise ChannelError("a verdict that names no request")
        future = conn.pending.get(request_id)
        if future is None:
            log.debug("a verdict for %s arrived after its request gave up", request_id)
            return
        if not future.done():
            future.set_result(parse_verdict(body, request_id=request_id))

    def _on_ack(self, body: bytes) -> None:
        request_id = _json_object(body, _ACK_KEYS)["request_id"]
        if not isinstance(request_id, str):
            raise ChannelError("an ack that names no record")
        self._unacked.pop(request_id, None)
        if not self._unacked:
            self._drained.set()

    def _lost(self, conn: _Connection, verdict: Refuse) -> None:
        if self._conn is conn:
            self._conn = None
            self._take_outbox()  # still in _unacked: all of it is re-sent after the reconnect
        conn.writer.close()
        for future in conn.pending.values():
            if not future.done():
                future.set_result(verdict)
        conn.pending.clear()
        if self._unacked and not self._closed:
            self._not_before = max(self._not_before, time.monotonic() + self._backoff)
            self._kick()


class _Refused(Exception):
    """The decider closed the connection after our hello without welcoming us: it holds another token."""


class _StillRefused(Exception):
    """An unasked retry found the token the decider refused last: nothing to try yet."""


def _expire(future: asyncio.Future[Verdict], timeout: float) -> None:
    if not future.done():
        future.set_result(refuse(RefusalCode.DECIDER_UNAVAILABLE,
                                 f"the policy component did not answer within {timeout:g} s; nothing was sent"))


# --- the decider's end ---------------------------------------------------------------------------------------------


class _Peer:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.tasks: set[asyncio.Task[None]] = set()
        self.records: list[EgressRecord] = []
        self.recording: asyncio.Task[None] | None = None

    def send(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)


class DeciderServer:
    """The decider's end: authenticates the proxy, answers decision requests concurrently, stores audit records.

    `decide` answers one request; an exception in it answers `Refuse(decider_unavailable)`. `decide_now`, when
    given, is tried first, on the event loop, as each request is read: it answers at once or returns None to leave
    the request to `decide` (it must not wait on anything). `record` stores a batch of records durably; each is
    acknowledged after it returns; records are gathered for `record_gather` seconds into one batch. Records already
    stored by this server are acked without being stored twice, but a record may still reach `record` again after a
    restart: store idempotently, keyed by request_id. If `record` raises, the connection is closed and the proxy
    re-sends.
    """

    def __init__(self, path: Path | str, token: str, decide: Decide, record: Record, *,
                 decide_now: DecideNow | None = None, hello_timeout: float = HELLO_TIMEOUT,
                 remember: int = 100_000, record_gather: float = RECORD_GATHER) -> None:
        if not token:
            raise ValueError("the decider channel needs a non-empty token")
        self.path = Path(path)
        self._token = token.encode("utf-8")
        self._decide = decide
        self._decide_now = decide_now
        self._record = record
        self._record_gather = record_gather
        self._hello_timeout = hello_timeout
        self._remember = remember
        self._stored: OrderedDict[str, None] = OrderedDict()
        self._server: asyncio.Server | None = None
        self._peers: set[_Peer] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._refused_last = False

    @property
    def hello_refused(self) -> bool:
        """The last hello heard here was refused and no proxy welcomed here is connected: a proxy is likely
        knocking with a token that is not this decider's, and reaches no decision until it reads the right one."""
        return self._refused_last and not self._peers

    def __repr__(self) -> str:
        return f"DeciderServer({str(self.path)!r})"

    async def start(self) -> None:
        self._server = await private_unix_server(self.path, self._serve, what="the decider socket",
                                                 refused=ChannelError)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for peer in list(self._peers):
            peer.writer.close()
            for task in (*peer.tasks, *([peer.recording] if peer.recording else [])):
                task.cancel()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def __aenter__(self) -> DeciderServer:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        peer = _Peer(writer)
        try:
            if not await self._welcome(reader, peer):
                return
            self._peers.add(peer)
            while True:
                kind, body = await read_frame(reader)
                if kind == DECIDE:
                    req = parse_request(body)
                    if not self._answer_now(peer, req):
                        answer = asyncio.create_task(self._answer(peer, req))
                        peer.tasks.add(answer)
                        answer.add_done_callback(peer.tasks.discard)
                elif kind == AUDIT:
                    peer.records.append(parse_record(body))
                    if peer.recording is None:
                        peer.recording = asyncio.create_task(self._store(peer))
                else:
                    raise ChannelError(f"unexpected frame kind {kind!r} from the proxy")
        except (ChannelError, ContractError) as exc:
            log.warning("closing a proxy connection that broke the protocol: %s", exc)
        except (asyncio.IncompleteReadError, OSError):
            pass
        except asyncio.CancelledError:
            pass  # close() cut this connection; asyncio would log a cancelled connection task as an error
        finally:
            self._peers.discard(peer)
            writer.close()
            for answer in list(peer.tasks):
                answer.cancel()  # the proxy has already refused whatever was pending on this connection
            if task is not None:
                self._handlers.discard(task)

    async def _welcome(self, reader: asyncio.StreamReader, peer: _Peer) -> bool:
        try:
            kind, body = await asyncio.wait_for(read_frame(reader), self._hello_timeout)
            token = _json_object(body, _HELLO_KEYS)["token"] if kind == HELLO else None
        except (TimeoutError, ChannelError, asyncio.IncompleteReadError, OSError):
            token = None
        if not isinstance(token, str) or not hmac.compare_digest(token.encode("utf-8"), self._token):
            log.warning("refused a connection on the decider channel: no valid hello")
            self._refused_last = True
            return False
        self._refused_last = False
        peer.send(frame(WELCOME, b'{"v":1}'))
        return True

    def _answer_now(self, peer: _Peer, req: DecisionRequest) -> bool:
        if self._decide_now is None:
            return False
        try:
            verdict = self._decide_now(req)
            if verdict is None:
                return False
            if not isinstance(verdict, Allow | Refuse):
                raise TypeError(f"decide_now returned a {type(verdict).__name__}, not a verdict")
        except Exception as exc:  # its message is not logged: it may quote the request's client token
            log.error("the decider failed on request %s; refusing it: %s", req.request_id, describe(exc))
            verdict = refuse(RefusalCode.DECIDER_UNAVAILABLE)
        peer.send(frame(VERDICT, encode_verdict(verdict, request_id=req.request_id)))
        return True

    async def _answer(self, peer: _Peer, req: DecisionRequest) -> None:
        try:
            verdict = await self._decide(req)
            if not isinstance(verdict, Allow | Refuse):
                raise TypeError(f"decide returned a {type(verdict).__name__}, not a verdict")
        except Exception as exc:  # its message is not logged: it may quote the request's client token
            log.error("the decider failed on request %s; refusing it: %s", req.request_id, describe(exc))
            verdict = refuse(RefusalCode.DECIDER_UNAVAILABLE)
        peer.send(frame(VERDICT, encode_verdict(verdict, request_id=req.request_id)))

    async def _store(self, peer: _Peer) -> None:
        try:
            while peer.records:
                if len(peer.records) < _RECORD_BATCH and self._record_gather > 0:
                    await asyncio.sleep(self._record_gather)  # more arrive meanwhile: one transaction for them all
                batch, peer.records = peer.records[:_RECORD_BATCH], peer.records[_RECORD_BATCH:]
                fresh = list({r.request_id: r for r in batch if r.request_id not in self._stored}.values())
                if fresh:
                    try:
                        await self._record(fresh)
                    except Exception:
                        log.exception("storing %d egress records failed; the proxy will send them again",
                                      len(fresh))
                        peer.writer.close()
                        return
                    for r in fresh:
                        self._stored[r.request_id] = None
                    while len(self._stored) > self._remember:
                        self._stored.popitem(last=False)
                peer.send(b"".join(frame(ACK, _ack(r.request_id)) for r in batch))  # one write for the batch
        finally:
            peer.recording = None
