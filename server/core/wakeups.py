"""Wake-ups: what tells a loop it has work now, in one process and between processes.

`Signals` are the loops' in-process events (the worker's own commits wake its own loops through them, as they
always did). When the HTTP API and the worker run in separate processes (`wakeful api`, `wakeful worker`), the
API's signals are *relayed*: setting one also sends a wake-up message to the worker process, whose listener sets
the same event there. The channel:

    SQLite       a Unix datagram socket, `<data_dir>/run/wake.sock` (0600), which the one worker binds
    PostgreSQL   `NOTIFY wakeful_wake`, which every worker process LISTENs to on a connection of its own

A message is `<loop> <received>`: the loop to wake (`work`, `dispatch`, `timers`, `reconcile`) and how many
deliveries the sender's inbox has committed since it started (the worker measures the inbox's rate from it, to give
way to acknowledgements while it is busy). Best effort by design: a message that finds no worker, or a full
socket buffer, costs at most the worker's idle poll, which stays the fallback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Engine

from wakeful.server.errors import Conflict
from wakeful.server.store.rundir import bind_private, hold_lock

__all__ = ["CHANNEL", "LOOPS", "DatagramListener", "DatagramSender", "NotifyListener", "NotifySender", "Signals",
           "WakeListener", "WakeSender", "listener_for", "sender_for", "wake_socket"]

log = logging.getLogger(__name__)

LOOPS = ("work", "dispatch", "timers", "reconcile")
CHANNEL = "wakeful_wake"
"""The PostgreSQL notification channel."""
_STOP = "stop"


class _Relayed(threading.Event):
    """An event that, when set, also tells another process (`relay(name)`)."""

    def __init__(self, name: str, relay: Callable[[str], None]) -> None:
        super().__init__()
        self._name, self._relay = name, relay

    def set(self) -> None:
        super().set()
        self._relay(self._name)


@dataclass
class Signals:
    """The loops' wake-up events. `Signals()` wakes loops of this process only; `Signals.relayed(send)` also sends
    each wake-up to the worker process (the API's side of a split deployment)."""

    work: threading.Event = field(default_factory=threading.Event)
    dispatch: threading.Event = field(default_factory=threading.Event)
    timers: threading.Event = field(default_factory=threading.Event)
    reconcile: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def relayed(cls, send: Callable[[str], None]) -> Signals:
        return cls(**{name: _Relayed(name, send) for name in LOOPS})

    def all(self) -> tuple[threading.Event, ...]:
        return (self.work, self.dispatch, self.timers, self.reconcile)

    def wake_all(self) -> None:
        """The one way a write wakes the loops: HTTP routes, MCP tools and `POST /v1/wake` (which the CLI's
        `nudge` calls) all end here, so work written by any of them starts now, not at the next idle poll."""
        for event in self.all():
            event.set()

    def outcome_recorded(self) -> None:
        """An action's outcome was recorded: the run should hear of it, reconciliation may have work."""
        self.work.set()
        self.reconcile.set()

    def woken(self, loop: str) -> None:
        """A wake-up message from another process: set the named loop's event (unknown names are ignored)."""
        if loop in LOOPS:
            threading.Event.set(getattr(self, loop))  # never relayed back


class WakeSender(Protocol):
    def send(self, loop: str) -> None: ...

    def close(self) -> None: ...


class WakeListener(Protocol):
    def start(self, on_wake: Callable[[str, int], None]) -> None:
        """Call `on_wake(loop, received)` for every message, on a thread of its own, until `stop`."""

    def stop(self) -> None: ...


def wake_socket(data_dir: Path) -> Path:
    return data_dir / "run" / "wake.sock"


def _parse(text: str) -> tuple[str, int] | None:
    loop, _, count = text.partition(" ")
    try:
        return loop, int(count or 0)
    except ValueError:
        return None


class DatagramSender:
    """Sends wake-ups to the worker's socket without ever waiting: no worker, or a full buffer, drops the message."""

    def __init__(self, path: Path, received: Callable[[], int]) -> None:
        self._path = str(path)
        self._received = received
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def send(self, loop: str) -> None:
        with contextlib.suppress(OSError):  # ENOENT, ECONNREFUSED (no worker yet), EAGAIN (it has plenty to read)
            self._sock.sendto(f"{loop} {self._received()}".encode(), self._path)

    def close(self) -> None:
        self._sock.close()


class DatagramListener:
    """Binds `<data_dir>/run/wake.sock` (owner-only) and wakes the loops it is told to.

    One worker process per SQLite database: SQLite has one writer at a time anyway, and a second process's runs
    would only queue for its lock. The listener holds `<data_dir>/run/worker.lock` (`flock`, released by the kernel
    when the process ends, however it ends); a second one is refused with `worker_running`."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._lock_fd: int | None = None

    def start(self, on_wake: Callable[[str, int], None]) -> None:
        self._lock_fd = hold_lock(self._path.parent / "worker.lock", lambda holder: Conflict(
            "worker_running", f"another wakeful worker (pid {holder}) runs on this SQLite database (one at a time: "
                              "SQLite has one writer); stop it first, or give it more threads with --workers"))
        sock = self._sock = bind_private(self._path, socket.SOCK_DGRAM)  # one left by a worker that died goes
        self._thread = threading.Thread(target=self._listen, args=(sock, on_wake), name="wake-listener", daemon=True)
        self._thread.start()

    def _listen(self, sock: socket.socket, on_wake: Callable[[str, int], None]) -> None:
        while True:
            try:
                messages = [sock.recv(128)]
                with contextlib.suppress(BlockingIOError):  # everything already queued: one wake-up per loop
                    while True:
                        messages.append(sock.recv(128, socket.MSG_DONTWAIT))
            except OSError:
                return
            woken: dict[str, int] = {}
            for raw in messages:
                parsed = _parse(raw.decode(errors="replace"))
                if parsed is None:
                    continue
                loop, received = parsed
                if loop == _STOP and self._stopping:
                    return
                woken[loop] = max(received, woken.get(loop, 0))
            for loop, received in woken.items():
                on_wake(loop, received)

    def stop(self) -> None:
        if self._sock is None:
            return
        self._stopping = True
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as poke, contextlib.suppress(OSError):
            poke.sendto(f"{_STOP} 0".encode(), str(self._path))
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()
        self._sock = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _raw_connection(engine: Engine) -> Any:
    """A psycopg connection of its own, out of the engine's pool, in autocommit."""
    pooled = engine.raw_connection()
    conn = pooled.driver_connection  # before `detach`, which forgets it
    pooled.detach()
    assert conn is not None
    conn.autocommit = True
    return conn


class NotifySender:
    """`NOTIFY wakeful_wake` on a connection of its own, from a thread of its own: the caller (the event loop, the
    inbox's committer) never waits for the round trip, and wake-ups that pile up meanwhile go as one each."""

    def __init__(self, engine: Engine, received: Callable[[], int]) -> None:
        self._engine = engine
        self._received = received
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="wake-notify", daemon=True)
        self._thread.start()

    def send(self, loop: str) -> None:
        with self._lock:
            self._pending.add(loop)
        self._wake.set()

    def _run(self) -> None:
        conn: Any = None
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                loops, self._pending = self._pending, set()
            if self._closed:
                break
            try:
                if conn is None:
                    conn = _raw_connection(self._engine)
                for loop in sorted(loops):
                    conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{loop} {self._received()}"))
            except Exception as exc:  # best effort: the worker's poll finds the work anyway
                log.warning("could not notify the workers (%s); they find the work at their next poll", exc)
                with contextlib.suppress(Exception):
                    conn.close()
                conn = None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)


class NotifyListener:
    """`LISTEN wakeful_wake` on a connection of its own; reconnects (after `retry` seconds) when it is lost."""

    def __init__(self, engine: Engine, *, retry: float = 1.0) -> None:
        self._engine = engine
        self._retry = retry
        self._token = f"{_STOP}:{os.getpid()}:{id(self)}"  # ends this listener only: every worker hears a NOTIFY
        self._stopped = threading.Event()
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_wake: Callable[[str, int], None]) -> None:
        self._thread = threading.Thread(target=self._run, args=(on_wake,), name="wake-listener", daemon=True)
        self._thread.start()
        self._listening.wait(timeout=10)

    def _run(self, on_wake: Callable[[str, int], None]) -> None:
        while not self._stopped.is_set():
            conn: Any = None
            try:
                conn = _raw_connection(self._engine)
                conn.execute(f"LISTEN {CHANNEL}")
                self._listening.set()
                on_wake("work", 0)  # anything sent while we were not listening: look once
                for note in conn.notifies():
                    if note.payload == self._token:
                        return
                    parsed = _parse(note.payload)
                    if parsed is not None:
                        on_wake(*parsed)
            except Exception as exc:
                if self._stopped.is_set():
                    return
                log.warning("lost the wake-up channel (%s); listening again in %g s", exc, self._retry)
                self._stopped.wait(self._retry)
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is None:
            return
        with contextlib.suppress(Exception):
            conn = _raw_connection(self._engine)
            try:
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, self._token))
            finally:
                conn.close()
        self._thread.join(timeout=5)


def sender_for(engine: Engine, data_dir: Path, received: Callable[[], int]) -> WakeSender:
    if engine.dialect.name == "postgresql":
        return NotifySender(engine, received)
    return DatagramSender(wake_socket(data_dir), received)


def listener_for(engine: Engine, data_dir: Path) -> WakeListener:
    if engine.dialect.name == "postgresql":
        return NotifyListener(engine)
    return DatagramListener(wake_socket(data_dir))
