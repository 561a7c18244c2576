"""Tool computers across processes: one process holds them, the others reach them over a local socket.

A tool computer's state (the SSH channel, the browser's CDP session, the observation epoch and its refs, the human's
control lease) lives in the memory of one process, and only that process may decide a VM's state (restore, suspend):
two deciders could restore one VM twice. Under `wakeful serve` that owner is the API child (the MCP tools and the live
view are user-facing and stay local); the worker (runs, the dispatcher, the sweeper's reaping) reaches them through
`RemoteComputers`, which implements the `Computers` seam of `pool` over `<data_dir>/run/computers.sock`:

    ComputerServer     the owner's side: binds the socket (0600, in the 0700 run dir), answers only its own uid
                       (SO_PEERCRED), holds `<data_dir>/run/computers.lock` so no second owner starts
    RemoteComputers    the other side: `computer(user)` is a `RemoteComputer` whose every call is one request

One request per connection: a 4-byte big-endian length, then a JSON object `{"op": …, "user": …, …}`; the answer is
framed the same way, `{"ok": value}` or `{"error": {"code", "message"}}`. Values are the vm layer's own dataclasses
(`ObserveResult`, `ActResult`, `Accepted`, `Refused`, `LeaseGrant`, `HandoffLease`) as JSON; acts are `act_json`'s.
Errors cross as the same codes (`VmError`s and `WakefulError`s alike arrive as `WakefulError(code, message)`).
`activity` is the one request that keeps its connection: the owner holds the activity (the reaper leaves the VM
alone) until the client closes it, or dies and the kernel closes it.

An owner that does not answer is `computers_unreachable`. Nothing was done when the request could not be sent; an
act whose answer was lost on the way back (the API restarted mid-act) is an `ActResult` with outcome `unknown`, so
the dispatcher reconciles it by observing, never by repeating it. No secret crosses: the proxy credential stays
with the owner, and a handoff's one-time token is offered to the owner's live views where it is minted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from pydantic import BaseModel, ConfigDict, create_model

from wakeful.server.computers.pool import Computers, act_from_args, act_json
from wakeful.server.errors import Conflict, WakefulError
from wakeful.server.store.rundir import bind_private, hold_lock

if TYPE_CHECKING:
    from wakeful.vm.observe import Accepted, Act, HandoffLease, LeaseGrant, Refused, Surface
    from wakeful.vm.toolcomputer import ActResult, ObserveResult

__all__ = ["MAX_MESSAGE", "ActionLocks", "ComputerServer", "RemoteComputer", "RemoteComputers", "computers_socket"]

log = logging.getLogger(__name__)

MAX_MESSAGE: Final = 1 << 20
"""The largest request the owner reads (answers carry screenshots and may be larger: `_MAX_ANSWER`)."""
_MAX_ANSWER: Final = 64 << 20
_HEADER: Final = struct.Struct(">I")
_CALL_TIMEOUT: Final = 1800.0
"""Seconds a call may take: a first observe cold-boots the guest (minutes under TCG)."""
_READ_TIMEOUT: Final = 30.0
"""Seconds the owner waits for a request (and for its answer to be taken) before it drops the connection."""
_ACTIVITY_KINDS: Final = frozenset({"observe", "act", "handoff", "live_view"})


def computers_socket(data_dir: Path) -> Path:
    return data_dir / "run" / "computers.sock"


class ActionLocks:
    """One action dispatched by one process at a time, across the processes of one host: the API runs an act it
    admitted within the agent's tool call while the worker's dispatcher may find the same intent due. Without this,
    the second would take the first's attempt, persisted and still running, for one a dead dispatcher left, and
    settle it as unknown. `flock` on one of `STRIPES` files in `run/actions/` (a fresh descriptor per hold, so
    threads of one process exclude each other too; two actions on one stripe only wait for each other)."""

    STRIPES: Final = 64

    def __init__(self, run_dir: Path) -> None:
        self._dir = run_dir / "actions"

    @contextlib.contextmanager
    def held(self, action_id: str) -> Iterator[None]:
        self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        stripe = int(hashlib.sha256(action_id.encode()).hexdigest()[:8], 16) % self.STRIPES
        fd = os.open(self._dir / f"{stripe}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


# -- the wire ----------------------------------------------------------------------------------------------------------


class _BadMessage(Exception):
    """A request the owner cannot read; answered `bad_message`."""


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, limit: int) -> dict[str, Any] | None:
    """The next message, None at end of stream; `_BadMessage` when it is too long or not a JSON object."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > limit:
        raise _BadMessage(f"a message of {length} bytes (at most {limit})")
    data = _recv_exact(sock, length)
    if data is None:
        raise _BadMessage("the message ended early")
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _BadMessage(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise _BadMessage("not a JSON object")
    return message


@cache
def _wire(kind: Any) -> type[BaseModel]:
    """A model carrying one vm value as JSON (bytes, a screenshot, as base64)."""
    config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")
    return create_model("Wire", __config__=config, value=(kind, ...))


def _types() -> dict[str, Any]:
    from wakeful.vm.observe import Accepted, HandoffLease, LeaseGrant, Refused
    from wakeful.vm.toolcomputer import ActResult, ObserveResult

    return {"observe": ObserveResult, "check": Accepted | Refused, "act": ActResult | Refused,
            "request_handoff": LeaseGrant, "redeem_handoff": Accepted | Refused, "return_control": int,
            "lease": HandoffLease | None, "vnc_port": int, "reap": list[str]}


def _encode(op: str, value: Any) -> Any:
    return json.loads(_wire(_types()[op])(value=value).model_dump_json())["value"]


def _decode(op: str, raw: Any) -> Any:
    wire: Any = _wire(_types()[op]).model_validate_json(json.dumps({"value": raw}))
    return wire.value


def _text(message: dict[str, Any], name: str, limit: int = 10_000) -> str:
    value = message.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise _BadMessage(f"{name!r} must be a non-empty string of at most {limit} characters")
    return value


def _number(message: dict[str, Any], name: str) -> int:
    value = message.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1_000_000:
        raise _BadMessage(f"{name!r} must be a whole number from 0 to 1000000")
    return value


# -- the owner's side --------------------------------------------------------------------------------------------------


class ComputerServer:
    """Serves `computers` on `path` to processes of this uid. `on_handoff(user, token)` is told each handoff token a
    remote caller was granted (the owner's live views must know it: the link leads to the owner)."""

    def __init__(self, computers: Computers, path: Path, *,
                 on_handoff: Callable[[str, str], None] = lambda user, token: None) -> None:
        self._computers = computers
        self._path = path
        self._on_handoff = on_handoff
        self._sock: socket.socket | None = None
        self._lock_fd: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._lock_fd = hold_lock(self._path.with_name("computers.lock"), lambda holder: Conflict(
            "computers_running", f"another process (pid {holder}) holds the tool computers of this data directory; "
                                 "one owner at a time decides a VM's state"))
        sock = bind_private(self._path, socket.SOCK_STREAM)  # one left by an owner that died goes
        sock.listen(64)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, args=(sock,), name="computers-server", daemon=True)
        self._thread.start()
        log.info("tool computers served to the worker on %s", self._path)

    def stop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._serve, args=(conn,), name="computers-call", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                uid = _peer_uid(conn)
                if uid != os.getuid():
                    log.warning("refused a connection to %s from uid %d (only uid %d may use it)", self._path, uid,
                                os.getuid())
                    _send(conn, {"error": {"code": "peer_refused", "message": "only the owner's uid may use this "
                                                                              "socket"}})
                    return
                conn.settimeout(_READ_TIMEOUT)  # a request comes at once; the call it asks for may take minutes
                message = _recv(conn, MAX_MESSAGE)
                if message is None:
                    return
                op = message.get("op")
                if not isinstance(op, str):
                    raise _BadMessage("'op' must be a string")
                if op == "activity":
                    self._hold_activity(conn, message)
                    return
                _send(conn, {"ok": self._call(op, message)})
            except _BadMessage as exc:
                log.warning("a malformed request on %s: %s", self._path, exc)
                with contextlib.suppress(OSError):
                    _send(conn, {"error": {"code": "bad_message", "message": str(exc)}})
            except OSError as exc:
                log.info("a caller of %s went away: %s", self._path, exc)
            except Exception as exc:
                code, text = _error_of(exc)
                if code == "internal_error":
                    log.exception("a call on %s failed", self._path)
                with contextlib.suppress(OSError):
                    _send(conn, {"error": {"code": code, "message": text}})

    def _hold_activity(self, conn: socket.socket, message: dict[str, Any]) -> None:
        user, kind = _text(message, "user", 200), _text(message, "kind", 20)
        if kind not in _ACTIVITY_KINDS:
            raise _BadMessage(f"no activity kind {kind!r}")
        with self._computers.activity(user, kind):
            _send(conn, {"ok": None})
            conn.settimeout(None)
            with contextlib.suppress(OSError):
                conn.recv(1)  # until the caller closes (or dies): the activity lasts as long as its block

    def _call(self, op: str, message: dict[str, Any]) -> Any:
        if op == "reap":
            return _encode(op, self._computers.reap())
        if op not in _types():
            raise _BadMessage(f"no operation {op!r}")
        user = _text(message, "user", 200)
        tc = self._computers.computer(user)
        value: Any
        if op == "observe":
            from wakeful.vm.observe import Surface

            surface = _text(message, "surface", 20)
            if surface not in set(Surface):
                raise _BadMessage(f"no surface {surface!r}")
            value = tc.observe(Surface(surface))
        elif op in ("check", "act"):
            act = act_from_args(message.get("act"))
            value = tc.check(act) if op == "check" else tc.act(act)
        elif op == "request_handoff":
            value = tc.request_handoff(_text(message, "reason"), timedelta(seconds=_number(message, "seconds")))
            self._on_handoff(user, value.token)
        elif op == "redeem_handoff":
            value = tc.redeem_handoff(_text(message, "token", 200))
        elif op == "return_control":
            lease_id = message.get("lease_id")
            value = tc.return_control(None if lease_id is None else _text(message, "lease_id", 200))
        elif op == "lease":
            value = tc.lease
        else:
            value = tc.vnc_port(_number(message, "guest_port"))
        return _encode(op, value)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _error_of(exc: Exception) -> tuple[str, str]:
    """The code and words a failed call crosses with."""
    from wakeful.vm.errors import VmError

    if isinstance(exc, WakefulError):
        return exc.code, exc.message
    if isinstance(exc, VmError):
        return exc.code, exc.message
    return "internal_error", "the tool computers' process failed on this call; its log says why"


# -- the other side ----------------------------------------------------------------------------------------------------


class _Lost(Exception):
    """The request was sent but its answer never came."""


class RemoteComputers:
    """The `Computers` of the process at `path` (the owner's `ComputerServer`)."""

    def __init__(self, path: Path, *, timeout: float = _CALL_TIMEOUT) -> None:
        self.path = path
        self._timeout = timeout

    def _unreachable(self, why: object) -> WakefulError:
        return WakefulError("computers_unreachable", f"the tool computers' process (the API) does not answer on "
                                                     f"{self.path} ({why}); `wakeful serve` restarts it, or start "
                                                     "`wakeful api` beside this worker")

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout)
        try:
            sock.connect(str(self.path))
        except OSError as exc:
            sock.close()
            raise self._unreachable(exc.strerror or exc) from None
        return sock

    def _answer(self, sock: socket.socket) -> Any:
        try:
            answer = _recv(sock, _MAX_ANSWER)
        except (OSError, _BadMessage) as exc:
            raise _Lost(exc) from None
        if answer is None:
            raise _Lost("the connection closed before the answer")
        if "error" in answer:
            error = answer["error"]
            raise WakefulError(str(error.get("code", "internal_error")), str(error.get("message", "")))
        return answer.get("ok")

    def call(self, op: str, **fields: Any) -> Any:
        """One request; its answer decoded. `computers_unreachable` when it could not be made or answered."""
        with self._connect() as sock:
            try:
                _send(sock, {"op": op, **fields})
            except OSError as exc:
                raise self._unreachable(exc.strerror or exc) from None
            try:
                raw = self._answer(sock)
            except _Lost as exc:
                raise self._unreachable(exc) from None
        return _decode(op, raw)

    def act(self, user_id: str, act: Act) -> ActResult | Refused:
        from wakeful.vm.toolcomputer import ActResult

        with self._connect() as sock:
            try:
                _send(sock, {"op": "act", "user": user_id, "act": act_json(act)})
            except OSError as exc:
                raise self._unreachable(exc.strerror or exc) from None  # never sent: nothing was done
            try:
                raw = self._answer(sock)
            except _Lost as exc:  # sent, and no answer: it may have run
                return ActResult(kind=act.kind, outcome="unknown", observation=getattr(act, "observation", None) or 0,
                                 epoch=0, code="computers_unreachable",
                                 detail=f"the tool computers' process stopped answering during the act ({exc}); it "
                                        "may or may not have run: observe before anything else")
        result: ActResult | Refused = _decode("act", raw)
        return result

    def computer(self, user_id: str) -> RemoteComputer:
        return RemoteComputer(self, user_id)

    @contextlib.contextmanager
    def activity(self, user_id: str, kind: str) -> Iterator[None]:
        sock = self._connect()
        try:
            try:
                _send(sock, {"op": "activity", "user": user_id, "kind": kind})
                sock.settimeout(self._timeout)
                self._answer(sock)
            except (OSError, _Lost) as exc:
                raise self._unreachable(exc) from None
            yield
        finally:
            sock.close()  # the owner's activity ends with the connection

    def reap(self) -> list[str]:
        try:
            reaped: list[str] = self.call("reap")
        except WakefulError as exc:
            if exc.code != "computers_unreachable":
                raise
            log.warning("idle tool computers not reaped this time: %s", exc.message)
            return []
        return reaped


class RemoteComputer:
    """One user's tool computer in the owner process (`Computer`): each call is one request."""

    def __init__(self, remote: RemoteComputers, user_id: str) -> None:
        self._remote = remote
        self.user_id = user_id

    def observe(self, surface: Surface) -> ObserveResult:
        result: ObserveResult = self._remote.call("observe", user=self.user_id, surface=str(surface))
        return result

    def check(self, act: Act) -> Accepted | Refused:
        result: Accepted | Refused = self._remote.call("check", user=self.user_id, act=act_json(act))
        return result

    def act(self, act: Act) -> ActResult | Refused:
        return self._remote.act(self.user_id, act)

    def request_handoff(self, reason: str, ttl: timedelta) -> LeaseGrant:
        grant: LeaseGrant = self._remote.call("request_handoff", user=self.user_id, reason=reason,
                                              seconds=int(ttl.total_seconds()))
        return grant

    def redeem_handoff(self, token: str) -> Accepted | Refused:
        result: Accepted | Refused = self._remote.call("redeem_handoff", user=self.user_id, token=token)
        return result

    def return_control(self, lease_id: str | None = None) -> int:
        epoch: int = self._remote.call("return_control", user=self.user_id, lease_id=lease_id)
        return epoch

    @property
    def lease(self) -> HandoffLease | None:
        lease: HandoffLease | None = self._remote.call("lease", user=self.user_id)
        return lease

    def vnc_port(self, guest_port: int = 5900) -> int:
        port: int = self._remote.call("vnc_port", user=self.user_id, guest_port=guest_port)
        return port

