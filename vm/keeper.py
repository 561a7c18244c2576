"""The guest's clock keeper and its side door: how the host reaches the guest without SSH right after a restore.

The keeper is one Python process in the guest, started once over SSH (`vm.ssh_channel.GuestChannel.keep_clock`) and
kept: a resync through it is one line each way, with no new session, shell or `date` to start. After a restore under
TCG those cost the guest's vCPUs a second or more (its translated code went with the old QEMU process), right when
the first observation needs it.

Under user-mode networking the SSH connection dies at every save (it lives in the old QEMU process's slirp), and a new
one costs the guest's sshd a fork, a re-exec, a key exchange and an authentication: 2-3 s under TCG. The keeper then
listens on the guest's slirp address (`SideDoor`), which only a host forward of QEMU's reaches (`restrict=on`: nothing
else gets in), on a fixed port, and the host reaches it through that forward on its own 127.0.0.1 — the side door.
Through it, with the token the keeper was started with, a connection sets the clock as through SSH, or asks
`connect PORT` to be spliced to a port on the guest's loopback (DevTools): the first observation after a restore needs
no SSH at all, and the new SSH connection is made after it.
"""

from __future__ import annotations

import contextlib
import select
import shlex
import socket
import time
from dataclasses import dataclass

__all__ = ["CLOCK_KEEPER", "KEEPER_GUEST_PORT", "SideDoor", "SideDoorClosed", "SocketLine", "clock_keeper",
           "open_side_door"]

KEEPER_GUEST_PORT = 9444
"""The guest port the keeper listens on under user-mode networking (the domain's `keeper` host forward leads there)."""

# It reads `token TOKEN [ADDRESS PORT]` on its first line (where to listen; 127.0.0.1 and a free port without them),
# listens there (a keeper it replaces may still hold the port for a moment: retried, bounded, else a free loopback
# port), answers `ready BOOT_ID PORT ADDRESS`, then for each `set NANOS` (or `read`) line `BEFORE AFTER` (the guest
# clock in nanoseconds just before and after setting it) or `error TEXT`. A connection to its port must send the token
# first (at most 128 characters on that line; anything else is hung up on); it may then ask `connect PORT` and, once
# the keeper answered `ok`, send nothing else: the bytes are spliced both ways to 127.0.0.1:PORT in the guest until
# either side closes (`error TEXT`, then a hang-up, if that port does not answer). Any other line is hung up on. `bye`
# ends it; so does a new keeper (through the pid file), or ten minutes with neither its session nor a connection open.
_KEEPER_SOURCE = """\
import hmac, os, select, signal, socket, sys, threading, time
tag = "wakeful-clock-keeper"
pidfile = {pidfile!r}
try:
    old = int(open(pidfile).read())
    if old != os.getpid() and tag.encode() in open("/proc/%d/cmdline" % old, "rb").read():
        os.kill(old, signal.SIGTERM)
except (OSError, ValueError):
    pass
try:
    with open(pidfile, "w") as f:
        f.write(str(os.getpid()))
except OSError:
    pass
first = sys.stdin.readline(256).split()
token = (first[1] if len(first) >= 2 else "").encode()
where = (first[2], int(first[3])) if len(first) >= 4 and first[3].isdigit() else ("127.0.0.1", 0)
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
for attempt in range(50):
    try:
        server.bind(where)
        break
    except OSError:
        time.sleep(0.1)
else:
    server.bind(("127.0.0.1", 0))
server.listen(4)
server.settimeout(600)
boot = open("/proc/sys/kernel/random/boot_id").read().strip()
here = server.getsockname()
ready = "ready %s %d %s\\n" % (boot, here[1], here[0])
def splice(conn, words):
    try:
        if len(words) != 2 or not words[1].isdigit() or not 0 < int(words[1]) < 65536:
            raise ValueError("connect takes one port")
        target = socket.create_connection(("127.0.0.1", int(words[1])), timeout=10)
    except (OSError, ValueError) as exc:
        conn.sendall(("error %s\\n" % str(exc).replace("\\n", " ")).encode())
        return
    with target:
        target.settimeout(None)
        conn.sendall(b"ok\\n")
        while True:
            for s in select.select([conn, target], [], [])[0]:
                data = s.recv(65536)
                if not data:
                    return
                (target if s is conn else conn).sendall(data)
def serve(lines, write, conn=None):
    write(ready)
    for line in lines:
        words = line.split()
        if words[:1] == ["bye"]:
            os._exit(0)
        if words[:1] == ["connect"] and conn is not None:
            return splice(conn, words)
        if words[:1] not in (["set"], ["read"]):
            return
        before = time.time_ns()
        try:
            if words[:1] == ["set"]:
                t = int(words[1])
                {setter}
            out = "%d %d" % (before, time.time_ns())
        except SystemExit:
            os._exit(0)
        except Exception as exc:
            out = "error %s" % str(exc).replace("\\n", " ")
        write(out + "\\n")
def session():
    try:
        serve(sys.stdin, lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    except (OSError, ValueError):
        pass
def connection(conn):
    with conn:
        try:
            lines = conn.makefile("r", encoding="ascii", errors="replace")
            words = lines.readline(128).split()  # a token line is short: nothing longer is read
            if token and words[:1] == ["token"] and len(words) == 2 and hmac.compare_digest(words[1].encode(), token):
                serve(lines, lambda text: conn.sendall(text.encode()), conn)
        except (OSError, ValueError, TypeError):
            pass
served = [threading.Thread(target=session, daemon=True)]
served[0].start()
while True:
    try:
        conn, _ = server.accept()
    except socket.timeout:
        served = [t for t in served if t.is_alive()]
        if not served:
            os._exit(0)
        continue
    served.append(threading.Thread(target=connection, args=(conn,), daemon=True))
    served[-1].start()
"""


def clock_keeper(setter: str = "time.clock_settime_ns(time.CLOCK_REALTIME, t)",
                 pidfile: str = "/run/wakeful/clock-keeper.pid") -> str:
    """The guest command that runs the clock keeper; `setter` is the Python statement that sets the clock to `t`
    (nanoseconds since the epoch), `pidfile` where it finds the keeper it replaces: tests on a host replace both."""
    source = _KEEPER_SOURCE.format(setter=setter, pidfile=pidfile)
    return "exec python3 -c " + shlex.quote(source)


CLOCK_KEEPER = clock_keeper()
"""The default clock keeper: sets the guest clock with clock_settime (the guest image has python3)."""


@dataclass(frozen=True, kw_only=True)
class SideDoor:
    """Where the clock keeper listens in the guest, and where the host reaches that without SSH."""

    listen: tuple[str, int]
    """The guest address and port the keeper listens on: the slirp address (`vm.domain_xml.GUEST_ADDRESS`) and
    `KEEPER_GUEST_PORT` for a VM (a loopback address and a free port in tests on a host)."""
    host: tuple[str, int]
    """Where the host connects to reach it: 127.0.0.1 and the VM's `keeper` host forward."""


class SideDoorClosed(Exception):
    """The side door did not lead to our keeper this time: the caller uses SSH. It never leaves the guest channel."""

    def __init__(self, message: str, *, gone: bool = False) -> None:
        super().__init__(message)
        self.gone = gone
        """Our keeper is not behind it (nothing listens there in the guest, another boot, something else answers):
        not worth trying again. False when it may only have been slow, or the VM not running, or the port it was to
        connect to not answering."""


class SocketLine:
    """A TCP connection to the keeper with the few methods of a paramiko channel the guest channel's line reading
    uses (`recv_ready`, `eof_received`, `closed`), so a keeper reached through the side door is read like one
    reached through SSH."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.eof_received = False
        self.closed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def recv_ready(self) -> bool:
        """Something to read now; an end of file found here is noted (`eof_received`), not reported as data."""
        if self.closed or self.eof_received:
            return False
        try:
            if not select.select([self._sock], [], [], 0)[0]:
                return False
            if self._sock.recv(1, socket.MSG_PEEK):
                return True
        except OSError:
            pass
        self.eof_received = True
        return False

    def recv(self, size: int) -> bytes:
        data = self._sock.recv(size)
        if not data:
            self.eof_received = True
        return data

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.close()


def open_side_door(door: SideDoor, token: str, *, boot_id: str, connect: int | None = None,
                   timeout: float) -> tuple[socket.socket, bytes]:
    """A connection to the keeper through the side door, past its token and its `ready` line (which must carry
    `boot_id`: a guest that booted again has no keeper of ours), and with `connect`, spliced to that port on the
    guest's loopback once the keeper said `ok`. Returns the socket (blocking, no timeout) and what came after the
    lines (a server that speaks first). Raises `SideDoorClosed`."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection(door.host, timeout=timeout)
    except OSError as exc:
        raise SideDoorClosed(f"nothing answers at {door.host}: {exc}") from None
    try:
        request = f"token {token}\n" + (f"connect {connect}\n" if connect is not None else "")
        sock.sendall(request.encode())  # both lines at once: one round trip
        pending = bytearray()
        ready = _read_line(sock, pending, deadline, first=True).split()
        if ready[:2] != [b"ready", boot_id.encode()]:
            raise SideDoorClosed(f"the side door answered {b' '.join(ready[:2])[:100]!r}, not our keeper of this boot",
                                 gone=True)
        if connect is not None:
            answer = _read_line(sock, pending, deadline)
            if answer != b"ok":
                raise SideDoorClosed(f"the keeper could not connect to guest port {connect}: {answer[:200]!r}")
        sock.settimeout(None)
        return sock, bytes(pending)
    except (OSError, SideDoorClosed) as exc:
        sock.close()
        if isinstance(exc, SideDoorClosed):
            raise
        raise SideDoorClosed(f"the side door closed: {exc}") from None


def _read_line(sock: socket.socket, pending: bytearray, deadline: float, *, first: bool = False) -> bytes:
    """The next line (at most 512 bytes) from `sock`, keeping what came after it in `pending`. A hang-up before the
    `first` line means nothing of ours listens behind the door (slirp closes when the guest refuses)."""
    while b"\n" not in pending:
        if len(pending) > 512:
            raise SideDoorClosed("the side door sent no end of line", gone=True)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SideDoorClosed("no answer through the side door in time")
        sock.settimeout(remaining)
        data = sock.recv(4096)
        if not data:
            raise SideDoorClosed("the side door hung up", gone=first)
        pending += data
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return line.strip()
