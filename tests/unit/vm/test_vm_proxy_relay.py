"""The identity relay the guest forward runs per connection (`vm.domain_xml.RELAY`), run here as slirp runs it:
the guest's end of a socketpair as stdin/stdout/stderr, in a session of its own, with a loopback upstream standing
in for the egress proxy. Needs the host's busybox (the same one QEMU runs)."""

from __future__ import annotations

import fcntl
import shlex
import socket
import struct
import subprocess
import termios
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.polling import wait_until
from wakeful.vm.domain_xml import proxy_connector
from wakeful.vm.hypervisor import ProxyCredential

pytestmark = pytest.mark.skipif(not Path("/bin/busybox").exists(), reason="the host has no /bin/busybox")

CREDENTIAL = ProxyCredential(user_id="usr_1", token="tok-abc")
AUTH = b"Proxy-Authorization: Basic " + CREDENTIAL.basic().encode() + b"\r\n"
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nX-Raw: \xff\x00\r\n\r\n\x00\xfe\r\nok"


@dataclass
class Upstream:
    """Accepts one connection, records every byte, answers `RESPONSE` once per request head, and closes when told."""

    port: int = 0
    received: bytearray = field(default_factory=bytearray)
    heads: int = 0
    close: threading.Event = field(default_factory=threading.Event)
    closed_by_peer: threading.Event = field(default_factory=threading.Event)


@contextmanager
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    server = socket.create_server(("127.0.0.1", 0))
    up.port = server.getsockname()[1]

    def run() -> None:
        conn, _ = server.accept()
        conn.settimeout(0.05)
        with conn:
            while not up.close.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    up.closed_by_peer.set()
                    return
                up.received += data
                while up.received.count(b"\r\n\r\n") > up.heads:
                    up.heads += 1
                    conn.sendall(RESPONSE)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield up
    finally:
        up.close.set()
        thread.join(5)
        server.close()


@contextmanager
def relay(port: int) -> Iterator[tuple[socket.socket, subprocess.Popen[bytes]]]:
    guest, host_end = socket.socketpair()
    argv = shlex.split(proxy_connector(port, ("/bin/busybox", "nc"), CREDENTIAL))
    proc = subprocess.Popen(argv, stdin=host_end, stdout=host_end, stderr=host_end, start_new_session=True)
    host_end.close()
    guest.settimeout(10)
    try:
        yield guest, proc
    finally:
        guest.close()
        if proc.poll() is None:
            proc.kill()  # our own child, by its handle
        proc.wait(5)


def read_until_close(sock: socket.socket) -> bytes:
    out = bytearray()
    while chunk := sock.recv(65536):
        out += chunk
    return bytes(out)


def read_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes in session `sid`, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it just went away
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def all_read(guest: socket.socket) -> bool:
    """Whether the relay has read every byte the guest sent: a Unix socket's output queue (SIOCOUTQ) holds what its
    peer has not read yet."""
    return struct.unpack("i", fcntl.ioctl(guest, termios.TIOCOUTQ, b"\0" * 4))[0] == 0


def wait_for(condition: threading.Event, what: str) -> None:
    assert condition.wait(10), what


def test_one_header_goes_in_after_the_request_line_and_everything_else_passes_unchanged_both_ways() -> None:
    request = b"GET http://shop.test/a?b=c HTTP/1.1\r\nHost: shop.test\r\nCookie: s=1\r\n\r\n"
    with upstream() as up, relay(up.port) as (guest, _proc):
        guest.sendall(request)
        assert read_exactly(guest, len(RESPONSE)) == RESPONSE, "the response reaches the guest byte for byte"
    first, rest = request.split(b"\r\n", 1)
    assert bytes(up.received) == first + b"\r\n" + AUTH + rest
    assert bytes(up.received).count(b"Proxy-Authorization") == 1


def test_a_request_line_that_arrives_in_pieces_keeps_its_carriage_return() -> None:
    with upstream() as up, relay(up.port) as (guest, _proc):
        for piece in (b"CONNECT shop.test:443 HT", b"TP/1.1\r", b"\nHost: shop.test:443\r\n\r\n"):
            guest.sendall(piece)
            wait_until(lambda: all_read(guest), 10, "the relay to read the piece before the next is sent")
        read_exactly(guest, len(RESPONSE))
    assert bytes(up.received) == b"CONNECT shop.test:443 HTTP/1.1\r\n" + AUTH + b"Host: shop.test:443\r\n\r\n"


def test_only_the_first_request_of_a_kept_alive_connection_carries_the_identity() -> None:
    with upstream() as up, relay(up.port) as (guest, _proc):
        guest.sendall(b"GET http://shop.test/1 HTTP/1.1\r\nHost: shop.test\r\n\r\n")
        read_exactly(guest, len(RESPONSE))
        guest.sendall(b"GET http://shop.test/2 HTTP/1.1\r\nHost: shop.test\r\n\r\n")
        read_exactly(guest, len(RESPONSE))
    assert bytes(up.received).count(b"Proxy-Authorization") == 1
    assert bytes(up.received).endswith(b"GET http://shop.test/2 HTTP/1.1\r\nHost: shop.test\r\n\r\n")


def test_when_the_proxy_closes_the_guest_sees_the_close_and_no_relay_process_is_left() -> None:
    with upstream() as up, relay(up.port) as (guest, proc):
        guest.sendall(b"GET http://shop.test/ HTTP/1.1\r\nHost: shop.test\r\n\r\n")
        read_exactly(guest, len(RESPONSE))
        up.close.set()
        assert read_until_close(guest) == b"", "the guest reads the close, nothing more"
        proc.wait(10)
        wait_until(lambda: session_members(proc.pid) == [], 10, "no relay process keeping the guest's socket open")


def test_when_the_guest_closes_the_proxy_sees_the_close() -> None:
    with upstream() as up, relay(up.port) as (guest, proc):
        guest.sendall(b"GET http://shop.test/ HTTP/1.1\r\nHost: shop.test\r\n\r\n")
        read_exactly(guest, len(RESPONSE))
        guest.shutdown(socket.SHUT_WR)
        wait_for(up.closed_by_peer, "the proxy side sees EOF once the guest closed")


def test_an_unreachable_proxy_closes_the_guest_connection_at_once() -> None:
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    with relay(port) as (guest, proc):
        assert read_until_close(guest) == b"", "no error text leaks to the guest; just the close"
        proc.wait(10)
