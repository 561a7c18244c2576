"""The guest channel's adapter: SSH to a tool computer with paramiko (the only module that imports it).

It implements `vm.guest.Channel`; the errors it raises are declared there.

    channel = GuestChannel(port=10122, user="root", client_key_path=key, pinned_host_key=pinned)
    channel.connect()
    channel.run(["uname", "-r"], timeout=10).stdout
    cdp_port = channel.forward("127.0.0.1", 9222)     # a local 127.0.0.1 listener tunnelled to the guest
    ... restore the VM (a new QEMU process: the old transport is dead) ...
    channel.reconnect()                               # the same local ports keep working
    channel.resync_clock()

On another KVM host the guest's forward is on that host's loopback: `sock` is then a factory the channel calls on
every (re)connect for the socket to speak SSH over (a `vm.host_tunnel.HostTunnel` channel); None means a plain TCP
connection to `host:port`.

The host key is pinned when the VM is provisioned; the channel accepts exactly that key and refuses anything
else with `host_key_mismatch` — never trust-on-first-use. Local forward listeners belong to the channel, not to
one SSH transport: they stay bound across `reconnect()`, and a connection accepted while the transport is down
waits (bounded) for the next one, so a CDP reconnect can start while SSH is still reconnecting.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import secrets
import select
import shlex
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import paramiko  # noqa: TID251 - the one module that talks SSH

from wakeful.vm.guest import (
    AuthFailed,
    BadKey,
    ChannelClosed,
    ClockSync,
    CommandFailed,
    GuestError,
    GuestTimeout,
    GuestUnreachable,
    HostKeyMismatch,
    NotConnected,
    OutputTooLarge,
    ReconnectReport,
    RunResult,
)
from wakeful.vm.keeper import CLOCK_KEEPER, SideDoor, SideDoorClosed, SocketLine, clock_keeper, open_side_door

__all__ = ["CLOCK_KEEPER", "SET_CLOCK", "GuestChannel", "clock_keeper", "parse_public_key", "pump"]

_CHUNK = 65536


class _TransportErrorsAtDebug(logging.Filter):
    """paramiko logs, at ERROR and with tracebacks, what is routine here: a guest that resets the connection or
    sends no banner while it boots or restores (retried until it answers), a forward to a port nothing listens on
    yet (DevTools while Chromium starts). Each failure also reaches the caller, which reports it with a stable code,
    so paramiko's own lines go down to DEBUG rather than fill an operator's log with errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


logging.getLogger("paramiko.transport").addFilter(_TransportErrorsAtDebug())


def pump(conn: socket.socket, chan: paramiko.Channel | socket.socket, *, half_close: bool = False) -> None:
    """Copy both ways between a socket and a channel until `conn` ends, or `chan` ends. With `half_close`, the
    channel ending is passed on to `conn` as a half-close instead (its side has said all it will: a request sent)
    and `conn`'s answer still goes back, until `conn` ends. Errors are the caller's; it closes both."""
    reading: list[socket.socket | paramiko.Channel] = [conn, chan]
    while True:
        ready, _, _ = select.select(reading, [], [])
        if conn in ready:
            data = conn.recv(_CHUNK)
            if not data:
                return
            chan.sendall(data)
        if chan in ready:
            data = chan.recv(_CHUNK)
            if data:
                conn.sendall(data)
            elif not half_close:
                return
            else:
                reading.remove(chan)
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_WR)


def parse_public_key(line: str) -> paramiko.PKey:
    """An OpenSSH public key line (`ssh-ed25519 AAAA… comment`) as a paramiko key; `bad_pinned_key` if it is not."""
    parts = line.split()
    if len(parts) < 2:
        raise BadKey("the pinned host key is not an OpenSSH public key line")
    try:
        return paramiko.PKey.from_type_string(parts[0], base64.b64decode(parts[1], validate=True))
    except (binascii.Error, ValueError, paramiko.SSHException) as exc:
        raise BadKey(f"the pinned host key cannot be read: {exc}") from None


class _PinnedOnly(paramiko.RejectPolicy):  # type: ignore[misc]  # paramiko is untyped
    """Reached when the server offers a key of a type we did not pin: refuse, with our stable code."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise HostKeyMismatch(f"{hostname} offered a {key.get_name()} host key, not the one pinned for this VM")


@dataclass(eq=False)
class _Forward:
    remote: tuple[str, int]
    listener: socket.socket
    port: int
    thread: threading.Thread | None = None


@dataclass(eq=False)
class _Keeper:
    """The clock keeper's connection: its session on one transport, or a connection through the side door."""

    chan: paramiko.Channel | SocketLine
    transport: paramiko.Transport | None
    """None when `chan` goes through the side door."""
    pending: bytearray
    boot_id: str | None = None
    """From its first line; None until it has started."""
    port: int | None = None
    """Where it listens in the guest (its first line): how a later transport, or the side door, reaches it."""
    address: str = "127.0.0.1"
    """The guest address it listens on (its first line)."""


@dataclass(eq=False)
class _Pipe:
    conn: socket.socket
    chan: paramiko.Channel | socket.socket | None = None


def _local_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


SET_CLOCK = 'date -u -s "@$t"'
"""The guest shell command that sets the clock to `$t` (epoch seconds with nine decimals)."""
# One guest shell reads the clock, waits for the host's time on stdin, sets it and reads it again: a single command
# (each one costs a fork and an exec of the shell, slow in a guest whose translated code a restore threw away), and
# the host sends its time only once the shell is up, so the clock lands close to it. bash's $EPOCHREALTIME reads
# the clock without another exec; `date` stands in under a shell without it. With stdin closed and nothing read,
# the shell exits 0 and the clock is left alone.
_CLOCK_SCRIPT = (
    'read -r b < /proc/sys/kernel/random/boot_id; echo "$b ${{EPOCHREALTIME:-$(date +%s.%N)}}"; '
    'read -r t || exit 0; {{ {setter}; }} >/dev/null || exit 3; echo "set ${{EPOCHREALTIME:-$(date +%s.%N)}}"')


_REATTACH_TIMEOUT = 5.0
"""How long a keeper from an earlier transport gets to answer through a forward before a shell sets the clock."""

_BYE_WAIT = 2.0
"""How long `close` waits for the clock keeper to hang up after `bye`."""

_CLOSE_ENOUGH_NS = 50_000_000
"""How far off the guest clock may land through the keeper before it is set once more (50 ms)."""

def _epoch_ns(text: bytes) -> int:
    """`1733162400.123456` (any number of decimals, either separator) as nanoseconds."""
    seconds, _, fraction = text.decode().replace(",", ".").partition(".")
    return int(seconds) * 10**9 + int((fraction + "000000000")[:9])


class GuestChannel:
    def __init__(self, *, host: str = "127.0.0.1", port: int, user: str, client_key_path: Path | str,
                 pinned_host_key: str, keepalive: float = 0.0, forward_wait: float = 20.0,
                 max_output: int = 64 * 1024 * 1024, wall_ns: Callable[[], int] = time.time_ns,
                 set_clock: str = SET_CLOCK, keeper: str | None = CLOCK_KEEPER,
                 sock: Callable[[], object | None] | None = None, side_door: SideDoor | None = None) -> None:
        """`keepalive`: seconds between SSH keepalives, 0 for none (the default). A VM on an isolated network keeps
        its TCP connection through a save and restore only if the host sends nothing while it is saved: an unanswered
        keepalive then sits in TCP's retransmission backoff, so the first message after the restore waits seconds
        behind it, and after ~15 minutes of retries the connection is torn down. Liveness is asked when it matters
        instead (`alive`, after a restore).
        `forward_wait`: how long a forwarded connection waits for a live transport (during a reconnect).
        `set_clock`: the guest shell command that sets its clock to `$t` (tests on a host replace it).
        `keeper`: the guest command `keep_clock` starts (see `clock_keeper`; tests on a host replace it), None for
        none: every resync then starts a shell.
        `sock`: called before each connection attempt for a socket-like object to use instead of connecting to
        `host:port` (None from it: connect directly); it raises `guest_unreachable` to be retried, anything else
        (`host_unreachable`) to fail the reconnect at once.
        `side_door`: where the clock keeper listens so that the host reaches it without SSH (user-mode networking: a
        host forward to the guest's slirp address; see `vm.keeper`). Once it said it is ready there, the clock is
        resynced through it, and forwarded connections to the guest's loopback go through it while SSH is down."""
        self.host, self.port, self.user = host, port, user
        self._pinned = parse_public_key(pinned_host_key)
        try:
            self._key = paramiko.PKey.from_path(Path(client_key_path))
        except (OSError, paramiko.SSHException, ValueError) as exc:
            raise BadKey(f"cannot read the client key {client_key_path}: {exc}") from None
        self._keepalive = keepalive
        self._forward_wait = forward_wait
        self._max_output = max_output
        self._wall_ns = wall_ns
        self._set_clock = set_clock
        self._keeper_command = keeper
        self._keeper: _Keeper | None = None
        self._keeper_token = secrets.token_hex(16)
        """What the keeper asks of a connection to its port: it started with it on its first line."""
        self._keeper_lock = threading.Lock()
        self._side_door = side_door
        self._door_boot: str | None = None
        """The boot id of the keeper that said it listens at the side door; None while none did."""
        self._sock = sock
        self._client: paramiko.SSHClient | None = None
        self._cond = threading.Condition()
        self._connect_lock = threading.Lock()
        self._closing = threading.Event()
        self._forwards: dict[tuple[str, int], _Forward] = {}
        self._pipes: set[_Pipe] = set()
        self._threads: set[threading.Thread] = set()

    # ------------------------------------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        transport = self._transport()
        return transport is not None and transport.is_active()

    def _transport(self) -> paramiko.Transport | None:
        client = self._client
        return client.get_transport() if client is not None else None

    def _open_client(self, timeout: float) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        name = self.host if self.port == 22 else f"[{self.host}]:{self.port}"
        client.get_host_keys().add(name, self._pinned.get_name(), self._pinned)
        client.set_missing_host_key_policy(_PinnedOnly())
        sock = self._sock() if self._sock is not None else None
        try:
            client.connect(self.host, self.port, username=self.user, pkey=self._key, timeout=timeout,
                           banner_timeout=timeout, auth_timeout=timeout, look_for_keys=False,
                           allow_agent=False, sock=sock)
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyMismatch(f"{self.host}:{self.port} presented host key {exc.key.fingerprint}, "
                                  f"not the one pinned for this VM ({self._pinned.fingerprint})") from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise AuthFailed(f"the guest refused this VM's client key: {exc}") from None
        except GuestError:
            client.close()
            raise
        except (OSError, EOFError, paramiko.SSHException) as exc:
            client.close()
            raise GuestUnreachable(f"cannot reach sshd at {self.host}:{self.port}: {exc}") from None
        transport = client.get_transport()
        assert transport is not None
        if self._keepalive > 0:
            transport.set_keepalive(int(max(1, self._keepalive)))
        return client

    def connect(self, *, timeout: float = 10.0) -> None:
        """Connect once (no retries); raises GuestError."""
        self._reconnect(timeout=timeout, retry=False)

    def alive(self, *, timeout: float = 2.0) -> bool:
        """Whether the current transport still reaches the guest's sshd: one round trip (a session channel opened
        and closed again, which sshd answers without starting a process) within `timeout` seconds.

        After a restore under user-mode networking the transport died with the old QEMU process and this is False at
        once. On an isolated network the TCP connection lives in the host's kernel and in the guest's saved memory,
        so it outlives a save and restore: then this is True, and the transport (with every forwarded connection
        in it) can be kept instead of made again."""
        transport = self._transport()
        if transport is None or not transport.is_active():
            return False
        try:
            chan = transport.open_session(timeout=timeout)
        except (paramiko.SSHException, EOFError, OSError):
            return False
        chan.close()
        return True

    def drop(self) -> None:
        """Forget the current transport (known dead after a restore, even if it has not noticed yet): commands
        fail with `not_connected` and forwarded connections wait for the next `reconnect()`."""
        with self._cond:
            old, self._client = self._client, None
        if old is not None:
            old.close()
        keeper = self._keeper
        if keeper is not None and keeper.transport is None:
            keeper.chan.close()  # through the side door, which the old process held too: reached again when asked

    def reconnect(self, *, timeout: float = 30.0) -> ReconnectReport:
        """Drop the old transport (dead after a restore) and connect again, retrying until `timeout` while the
        guest is unreachable. Forwards keep their local ports; a listener that died is bound again."""
        attempts = self._reconnect(timeout=timeout, retry=True)
        moved: dict[tuple[str, int], int] = {}
        with self._cond:
            for remote, fwd in list(self._forwards.items()):
                if fwd.thread is None or not fwd.thread.is_alive():
                    old = fwd.port
                    fwd.listener.close()
                    self._forwards[remote] = self._listen(remote, prefer=old)
                    if self._forwards[remote].port != old:
                        moved[remote] = self._forwards[remote].port
            ports = {remote: fwd.port for remote, fwd in self._forwards.items()}
        return ReconnectReport(ports=ports, moved=moved, attempts=attempts)

    def _reconnect(self, *, timeout: float, retry: bool) -> int:
        if self._closing.is_set():
            raise ChannelClosed("this guest channel was closed")
        with self._connect_lock:
            with self._cond:
                old, self._client = self._client, None
            if old is not None:
                old.close()
            deadline = time.monotonic() + timeout
            attempts, delay = 0, 0.05
            while True:
                attempts += 1
                remaining = deadline - time.monotonic()
                try:
                    client = self._open_client(max(0.5, min(remaining, 10.0)))
                    break
                except GuestError as exc:
                    if not retry or not isinstance(exc, GuestUnreachable) or time.monotonic() + delay >= deadline:
                        raise
                # Back off before the next try; wakes at once if the channel is closed meanwhile.
                if self._closing.wait(delay):
                    raise ChannelClosed("this guest channel was closed")
                delay = min(delay * 2, 1.0)
            with self._cond:
                if self._closing.is_set():  # closed while we were connecting: do not leave a live transport
                    client.close()
                    raise ChannelClosed("this guest channel was closed")
                self._client = client
                self._cond.notify_all()
            return attempts

    @property
    def reconnecting(self) -> bool:
        """A (re)connect is under way (after a restore through the side door, off the path): commands wait for it."""
        return self._connect_lock.locked()

    def _live_transport(self, wait: float = 0.0) -> paramiko.Transport:
        with self._cond:
            self._cond.wait_for(lambda: self._closing.is_set() or self.connected, timeout=wait)
            transport = self._transport()
        if self._closing.is_set():
            raise ChannelClosed("this guest channel was closed")
        if transport is None or not transport.is_active():
            raise NotConnected("the SSH connection to the guest is down; reconnect first")
        return transport

    # ------------------------------------------------------------------------------------------ commands

    def run(self, cmd: str | Sequence[str], *, input: bytes | None = None, timeout: float) -> RunResult:
        """Run `cmd` (a shell string, or argv that is quoted here) and collect its output; `guest_timeout` after
        `timeout` seconds (the channel is closed; the guest process gets SIGHUP only if it reads or writes). While a
        reconnect is under way it waits for it, within the same `timeout`."""
        command = cmd if isinstance(cmd, str) else shlex.join(cmd)
        deadline = time.monotonic() + timeout
        transport = self._live_transport(wait=timeout if self.reconnecting else 0.0)
        try:
            chan = transport.open_session(timeout=timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise NotConnected(f"cannot open a session on the guest: {exc}") from None
        try:
            chan.exec_command(command)
            if input is not None:
                chan.sendall(input)
            chan.shutdown_write()
            return self._collect(chan, deadline, timeout, command)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise NotConnected(f"the SSH connection dropped while running a command: {exc}") from None
        finally:
            chan.close()

    def _collect(self, chan: paramiko.Channel, deadline: float, timeout: float, command: str) -> RunResult:
        out, err = bytearray(), bytearray()
        while True:
            while chan.recv_ready():
                out += chan.recv(_CHUNK)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(_CHUNK)
            if len(out) > self._max_output or len(err) > self._max_output:
                raise OutputTooLarge(f"the command wrote more than {self._max_output} bytes")
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                if chan.eof_received or chan.closed:
                    return RunResult(status=chan.recv_exit_status(), stdout=bytes(out), stderr=bytes(err))
            if chan.closed and not chan.exit_status_ready():
                raise NotConnected("the SSH channel closed before the command finished")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GuestTimeout(f"no result within {timeout:g} s: {command[:200]}")
            # Wakes on output or close; the cap re-checks the exit status, which does not wake the pipe.
            select.select([chan], [], [], min(remaining, 0.05))

    def keep_clock(self, *, timeout: float = 10.0) -> None:
        """Start the clock keeper unless it already runs: on the current transport, or from an earlier one and
        reached again through a forward to its port. Returns once the guest's sshd took the command; until the
        keeper has started and said so, resyncs still start a shell."""
        if self._keeper_command is None:
            return
        with self._keeper_lock:
            if self._keeper is not None and self._keeper_alive(self._keeper):
                return
            if self._reattach_keeper(min(timeout, _REATTACH_TIMEOUT)) is not None:
                return
            transport = self._live_transport()
            try:
                chan = transport.open_session(timeout=timeout)
                chan.exec_command(self._keeper_command)
                listen = "" if self._side_door is None else " {} {}".format(*self._side_door.listen)
                chan.sendall(f"token {self._keeper_token}{listen}\n".encode())
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise NotConnected(f"cannot start the clock keeper on the guest: {exc}") from None
            self._keeper = _Keeper(chan=chan, transport=transport, pending=bytearray())

    @property
    def keeper_port(self) -> int | None:
        """The guest loopback port the clock keeper listens on, once it said so (None before, or without one)."""
        keeper = self._keeper
        return keeper.port if keeper is not None else None

    @property
    def keeping(self) -> bool:
        """The clock keeper runs on the current transport and has said it is ready: resyncs go through it."""
        with self._keeper_lock:
            return self._ready_keeper() is not None

    @property
    def side_door_open(self) -> bool:
        """The clock keeper said it listens at the side door (and was not found gone since): a resync and the
        forwarded connections to the guest's loopback need no SSH transport. Reads its `ready` line if it waits
        (unless a resync holds the keeper meanwhile: never waits for one)."""
        if self._keeper_lock.acquire(blocking=False):
            try:
                self._ready_keeper()
            finally:
                self._keeper_lock.release()
        return self._side_door is not None and self._door_boot is not None

    def _keeper_alive(self, keeper: _Keeper) -> bool:
        if keeper.transport is None:
            keeper.chan.recv_ready()  # notes an end of file
            return not keeper.chan.closed and not keeper.chan.eof_received
        current = self._transport()
        return (current is not None and keeper.transport is current and current.is_active()
                and not keeper.chan.closed and not keeper.chan.eof_received)

    def _ready_keeper(self) -> _Keeper | None:
        """The clock keeper on the current transport once it has said it is ready (without waiting for it). A keeper
        that said where it listens and lost its channel (its transport died) is kept for `_reattach_keeper`."""
        keeper = self._keeper
        if keeper is None:
            return None
        if keeper.boot_id is None:
            # Read even from a channel whose transport died: its `ready` line may have come before the restore.
            while keeper.chan.recv_ready():
                keeper.pending += keeper.chan.recv(_CHUNK)
            if b"\n" in keeper.pending:
                line, _, rest = bytes(keeper.pending).partition(b"\n")
                keeper.pending = bytearray(rest)
                words = line.decode(errors="replace").split()
                if words[:1] == ["ready"] and len(words) >= 2:
                    keeper.boot_id = words[1]
                    keeper.port = int(words[2]) if len(words) >= 3 and words[2].isdigit() else None
                    keeper.address = words[3] if len(words) >= 4 else "127.0.0.1"
                    door = self._side_door
                    if door is not None and (keeper.address, keeper.port) == door.listen:
                        self._door_boot = keeper.boot_id
                else:
                    keeper.chan.close()  # not our keeper talking: leave it
        if keeper.boot_id is None or not self._keeper_alive(keeper):
            gone = keeper.chan.closed or keeper.chan.eof_received or keeper.transport is not self._transport()
            if gone and (keeper.boot_id is None or keeper.port is None):
                self._drop_keeper(keeper)
            return None
        return keeper

    def _reattach_keeper(self, timeout: float) -> _Keeper | None:
        """Reach a keeper that outlived its connection (a restore under user-mode networking): through the side door
        when it listens there, else through a forward to its port on the current transport: the token, then its
        `ready` line with the same boot id. None (and the keeper forgotten) if it is gone, or the guest booted again,
        or something else answers."""
        keeper = self._keeper
        if keeper is None or keeper.port is None or keeper.boot_id is None or self._keeper_alive(keeper):
            return None
        door = self._side_door
        if door is not None and (keeper.address, keeper.port) == door.listen:
            try:
                sock, rest = open_side_door(door, self._keeper_token, boot_id=keeper.boot_id, timeout=timeout)
            except SideDoorClosed as exc:
                if exc.gone:
                    self._drop_keeper(keeper)
                return None
            keeper.chan.close()
            keeper.chan, keeper.transport, keeper.pending = SocketLine(sock), None, bytearray(rest)
            self._door_boot = keeper.boot_id
            return keeper
        transport = self._transport()
        if transport is None or not transport.is_active():
            return None
        deadline = time.monotonic() + timeout
        chan: paramiko.Channel | None = None
        try:
            chan = transport.open_channel("direct-tcpip", (keeper.address, keeper.port), ("127.0.0.1", 0),
                                          timeout=timeout)
            chan.sendall(f"token {self._keeper_token}\n".encode())
            line, pending = self._line(chan, bytearray(), deadline, timeout)
        except (paramiko.SSHException, EOFError, OSError, GuestTimeout):
            line, pending = b"", bytearray()
        words = line.decode(errors="replace").split()
        if chan is None or words[:2] != ["ready", keeper.boot_id]:
            if chan is not None:
                chan.close()
            self._drop_keeper(keeper)
            return None
        keeper.chan.close()
        keeper.chan, keeper.transport, keeper.pending = chan, transport, pending
        return keeper

    def _drop_keeper(self, keeper: _Keeper) -> None:
        """Close a keeper that is gone, wedged or not ours: the next resync starts a shell, the next observation a
        new keeper; the side door is shut until that one says it listens there."""
        keeper.chan.close()
        self._keeper = None
        self._door_boot = None

    def resync_clock(self, *, timeout: float = 10.0) -> ClockSync:
        """Set the guest clock from the host's. Through the clock keeper when it runs on this transport
        (`keep_clock`): the host sends its time on one line, the keeper sets the clock and answers with it before and
        after. Otherwise in one guest command: the shell reports its boot id and clock, the host answers with its own
        time on stdin, the shell sets the clock and reports it again.

        Refuses to set it (`applied=False`) when the "guest" shares this machine's boot id: pointed at the host's own
        sshd (as in tests), `date -s` would step the host clock that every other process relies on."""
        with self._keeper_lock:
            keeper = self._ready_keeper() or self._reattach_keeper(min(timeout, _REATTACH_TIMEOUT))
            if keeper is not None:
                sync = self._resync_through(keeper, timeout)
                if sync is not None:
                    return sync
        return self._resync_in_shell(timeout)

    def _resync_through(self, keeper: _Keeper, timeout: float) -> ClockSync | None:
        """Through the clock keeper; None if it turned out gone (a shell does it then). The host's time goes on the
        line it sends, so the clock lands behind by however long the keeper took to wake up and read it: right after
        a restore under TCG, tenths of a second. When it landed that far off it is set once more, the keeper awake."""
        deadline = time.monotonic() + timeout
        here = keeper.boot_id == _local_boot_id() and self._keeper_command == CLOCK_KEEPER
        first = self._exchange(keeper, here, deadline, timeout)
        if first is None:
            return None
        t0, t1, before, after = first
        rtt = timedelta(microseconds=(t1 - t0) / 1000)
        if here:
            offset = timedelta(microseconds=(before - t0) / 1000)
            return ClockSync(before=offset, after=offset, round_trip=rtt, applied=False, kept=True)
        if abs(after - t1) > _CLOSE_ENOUGH_NS:
            again = self._exchange(keeper, here, deadline, timeout)
            if again is None:
                return None
            t1, after = again[1], again[3]
        return ClockSync(before=timedelta(microseconds=(before - t0) / 1000),
                         after=timedelta(microseconds=(after - t1) / 1000), round_trip=rtt, applied=True, kept=True)

    def _exchange(self, keeper: _Keeper, here: bool, deadline: float,
                  timeout: float) -> tuple[int, int, int, int] | None:
        """One line to the keeper and its answer: (host time sent, host time answered, guest clock before, guest
        clock after), in nanoseconds; None if the keeper is gone."""
        t0 = self._wall_ns()
        try:
            keeper.chan.sendall(b"read\n" if here else f"set {t0}\n".encode())
            line, keeper.pending = self._line(keeper.chan, keeper.pending, deadline, timeout)
        except (paramiko.SSHException, EOFError, OSError):
            line = b""
        except GuestTimeout:
            self._drop_keeper(keeper)  # wedged
            raise
        t1 = self._wall_ns()
        if not line:
            self._drop_keeper(keeper)
            return None
        if line.startswith(b"error"):
            raise CommandFailed(f"setting the guest clock failed: {line[6:200].decode(errors='replace')}", status=-1)
        try:
            before_text, after_text = line.split()
            return t0, t1, int(before_text), int(after_text)
        except ValueError:
            self._drop_keeper(keeper)
            raise CommandFailed(f"the guest clock keeper answered {line[:200]!r}", status=-1) from None

    def _resync_in_shell(self, timeout: float) -> ClockSync:
        deadline = time.monotonic() + timeout
        transport = self._live_transport()
        t0 = self._wall_ns()
        try:
            chan = transport.open_session(timeout=timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise NotConnected(f"cannot open a session on the guest: {exc}") from None
        try:
            chan.exec_command(_CLOCK_SCRIPT.format(setter=self._set_clock))
            first, pending = self._line(chan, bytearray(), deadline, timeout)
            t1 = self._wall_ns()
            try:
                boot_id, guest_text = first.split()
                before = _epoch_ns(guest_text) - t1
            except ValueError:
                raise CommandFailed(f"reading the guest clock gave {first[:200]!r}", status=-1) from None
            rtt = timedelta(microseconds=(t1 - t0) / 1000)
            if boot_id.decode() == _local_boot_id() and self._set_clock == SET_CLOCK:
                chan.shutdown_write()  # nothing to read: the shell leaves the clock alone
                offset = timedelta(microseconds=before / 1000)
                return ClockSync(before=offset, after=offset, round_trip=rtt, applied=False)
            now = self._wall_ns()
            chan.sendall(f"{now // 10**9}.{now % 10**9:09d}\n".encode())
            chan.shutdown_write()
            second, _ = self._line(chan, pending, deadline, timeout)
            t3 = self._wall_ns()
            if not second.startswith(b"set "):
                status = chan.recv_exit_status() if chan.exit_status_ready() else -1
                raise CommandFailed(f"setting the guest clock failed with status {status}", status=status)
            after = _epoch_ns(second.split()[1]) - t3
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise NotConnected(f"the SSH connection dropped while setting the clock: {exc}") from None
        finally:
            chan.close()
        return ClockSync(before=timedelta(microseconds=before / 1000), after=timedelta(microseconds=after / 1000),
                         round_trip=rtt, applied=True)

    def _line(self, chan: paramiko.Channel | SocketLine, pending: bytearray, deadline: float,
              timeout: float) -> tuple[bytes, bytearray]:
        """The next line on `chan`'s stdout (and what came after it), waiting until `deadline`."""
        while b"\n" not in pending:
            if chan.recv_ready():
                pending += chan.recv(_CHUNK)
                continue
            if chan.closed or chan.eof_received:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GuestTimeout(f"no answer from the guest clock within {timeout:g} s")
            select.select([chan], [], [], min(remaining, 0.05))
        line, _, rest = bytes(pending).partition(b"\n")
        return line.strip(), bytearray(rest)

    # ------------------------------------------------------------------------------------------ forwards

    def forward(self, remote_host: str, remote_port: int) -> int:
        """A local 127.0.0.1 port whose connections are tunnelled to (remote_host, remote_port) as the guest
        sees it. Idempotent: asking again for the same remote returns the same port."""
        if self._closing.is_set():
            raise ChannelClosed("this guest channel was closed")
        remote = (remote_host, remote_port)
        with self._cond:
            fwd = self._forwards.get(remote)
            if fwd is None:
                fwd = self._forwards[remote] = self._listen(remote)
            return fwd.port

    def _listen(self, remote: tuple[str, int], prefer: int = 0) -> _Forward:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", prefer))
        except OSError:
            listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        fwd = _Forward(remote=remote, listener=listener, port=int(listener.getsockname()[1]))
        fwd.thread = self._spawn(self._accept_loop, fwd, name=f"guest-forward-{remote[1]}")
        return fwd

    def _spawn(self, target: Callable[..., None], *args: object, name: str) -> threading.Thread:
        thread = threading.Thread(target=self._tracked, args=(target, *args), name=name, daemon=True)
        with self._cond:
            self._threads.add(thread)
        thread.start()
        return thread

    def _tracked(self, target: Callable[..., None], *args: object) -> None:
        try:
            target(*args)
        finally:
            with self._cond:
                self._threads.discard(threading.current_thread())

    def _accept_loop(self, fwd: _Forward) -> None:
        while not self._closing.is_set():
            try:
                conn, peer = fwd.listener.accept()
            except OSError:
                return  # the listener was shut down
            pipe = _Pipe(conn=conn)
            with self._cond:
                if self._closing.is_set():
                    conn.close()
                    return
                self._pipes.add(pipe)
            self._spawn(self._pump, pipe, fwd.remote, peer, name=f"guest-pipe-{fwd.remote[1]}")

    def _pump(self, pipe: _Pipe, remote: tuple[str, int], peer: tuple[str, int]) -> None:
        conn = pipe.conn
        try:
            door = self._side_door is not None and self._door_boot is not None and not self.connected
            pipe.chan = self._through_side_door(remote, conn)
            if pipe.chan is None:
                # Past a side door that turned out shut, wait only for a reconnect under way: with none, the client
                # sees the close at once and has SSH made again.
                wait = self._forward_wait if not door or self.reconnecting else 0.0
                transport = self._live_transport(wait=wait)
                pipe.chan = transport.open_channel("direct-tcpip", remote, peer, timeout=self._forward_wait)
            pump(conn, pipe.chan)
        except (GuestError, paramiko.SSHException, EOFError, OSError, ValueError):
            return  # the client sees its connection close; the next one tries again
        finally:
            if pipe.chan is not None:
                pipe.chan.close()
            conn.close()
            with self._cond:
                self._pipes.discard(pipe)

    def _through_side_door(self, remote: tuple[str, int], conn: socket.socket) -> socket.socket | None:
        """While SSH is down, a connection to the guest's loopback spliced by the keeper through the side door; None
        (SSH it is, once it is back) without a side door or a keeper of this boot there, or if it does not answer."""
        door, boot = self._side_door, self._door_boot
        if door is None or boot is None or remote[0] != "127.0.0.1" or self.connected:
            return None
        try:
            sock, early = open_side_door(door, self._keeper_token, boot_id=boot, connect=remote[1],
                                         timeout=self._forward_wait)
        except SideDoorClosed as exc:
            if exc.gone:
                self._door_boot = None  # not there after all: SSH for the next connections, until a resync finds it
            return None
        if early:
            conn.sendall(early)
        return sock

    # ------------------------------------------------------------------------------------------ shutdown

    def close(self, *, join_timeout: float = 5.0) -> None:
        """Stop every listener and tunnelled connection, end the clock keeper, close SSH, and wait (bounded) for the
        threads."""
        self._closing.set()
        keeper = self._keeper
        if keeper is not None and not keeper.chan.closed:
            # It outlives its session otherwise (made for restores). Waits (bounded) for it to hang up: sshd drops what
            # it has not yet passed on once the connection closes.
            with contextlib.suppress(paramiko.SSHException, EOFError, OSError):
                keeper.chan.sendall(b"bye\n")
                deadline = time.monotonic() + _BYE_WAIT
                while not (keeper.chan.eof_received or keeper.chan.closed) and time.monotonic() < deadline:
                    select.select([keeper.chan], [], [], 0.05)
                    while keeper.chan.recv_ready():
                        keeper.chan.recv(_CHUNK)
        with self._cond:
            forwards, pipes = list(self._forwards.values()), list(self._pipes)
            client, self._client = self._client, None
            self._cond.notify_all()
        for fwd in forwards:
            with contextlib.suppress(OSError):
                fwd.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        for pipe in pipes:
            with contextlib.suppress(OSError):
                pipe.conn.shutdown(socket.SHUT_RDWR)  # wakes the pump's select(); the pump closes it
            if pipe.chan is not None:
                pipe.chan.close()
        if client is not None:
            client.close()
        deadline = time.monotonic() + join_timeout
        with self._cond:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for fwd in forwards:
            fwd.listener.close()

    def forward_threads(self) -> int:
        """How many forwarding threads are alive (tests check that close() leaves none)."""
        with self._cond:
            return sum(1 for t in self._threads if t.is_alive())

    def __enter__(self) -> GuestChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
