"""The clock keeper's side door against a real sshd on loopback: what a restore under user-mode networking leaves.

The "guest" is this host: the keeper listens on 127.0.0.1 and a free port (never beyond the loopback), which is then
both where it listens and where the host reaches it (a VM's host forward stands between the two). The keeper only
records the time it is given. SSH logins are counted from sshd's own log, not from calls of our code.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.hits import Hits
from tests.support.polling import wait_until
from tests.support.serve import free_port
from tests.support.sshd import Sshd
from tests.support.threaded import serving_on_thread
from wakeful.vm.keeper import SideDoor, SideDoorClosed, clock_keeper, open_side_door
from wakeful.vm.ssh_channel import GuestChannel


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    with Sshd(tmp_path / "sshd", log_level="INFO") as server:
        yield server


@pytest.fixture
def http_server() -> Iterator[Hits]:
    with serving_on_thread(Hits()) as server:
        yield server


def _door() -> SideDoor:
    port = free_port()
    return SideDoor(listen=("127.0.0.1", port), host=("127.0.0.1", port))


def _channel(sshd: Sshd, tmp_path: Path, door: SideDoor | None, **kwargs: object) -> GuestChannel:
    keeper = clock_keeper(f"open({str(tmp_path / 'clock')!r}, 'a').write(str(t) + '\\n')",
                          pidfile=str(tmp_path / "keeper.pid"))
    options: dict[str, object] = {"port": sshd.port, "user": "root", "client_key_path": sshd.client_key,
                                  "pinned_host_key": sshd.host_public_key, "set_clock": "exit 9", "keeper": keeper,
                                  "side_door": door, **kwargs}
    return GuestChannel(**options)  # type: ignore[arg-type]


def _opened(chan: GuestChannel) -> None:
    chan.connect()
    chan.keep_clock()
    wait_until(lambda: chan.side_door_open, 60, "the clock keeper to listen at its side door")


def _talk(door: SideDoor, data: bytes) -> bytes:
    """Everything the side door says to a connection that sends `data`, until it hangs up."""
    with socket.create_connection(door.host, timeout=10) as conn:
        conn.sendall(data)
        out = bytearray()
        try:
            while chunk := conn.recv(4096):
                out += chunk
        except ConnectionResetError:  # hung up on with some of it unread
            pass
        return bytes(out)


def test_connect_through_the_side_door_splices_a_port_on_the_guests_loopback(
        sshd: Sshd, tmp_path: Path, http_server: Hits) -> None:
    door = _door()
    with _channel(sshd, tmp_path, door) as chan:
        _opened(chan)
        token = chan._keeper_token  # white-box: in memory only, as it must be
        with socket.create_connection(door.host, timeout=10) as conn:
            conn.sendall(f"token {token}\nconnect {http_server.server_address[1]}\n".encode())
            lines = conn.makefile("rb")
            assert lines.readline().split()[0] == b"ready"
            assert lines.readline() == b"ok\n"
            conn.sendall(b"GET /spliced HTTP/1.0\r\n\r\n")
            assert lines.read().endswith(b"seen /spliced")
    assert http_server.paths == ["/spliced"]


def test_the_side_door_hangs_up_on_anything_but_its_token_and_relays_nothing_to_a_bad_target(
        sshd: Sshd, tmp_path: Path, http_server: Hits) -> None:
    door = _door()
    port = http_server.server_address[1]
    with _channel(sshd, tmp_path, door) as chan:
        _opened(chan)
        token = chan._keeper_token
        assert _talk(door, f"connect {port}\n".encode()) == b""  # no token
        assert _talk(door, f"token {'0' * len(token)}\nconnect {port}\n".encode()) == b""  # the wrong one
        assert _talk(door, f"token {token} {'x' * 200}\nconnect {port}\n".encode()) == b""  # over-long
        assert _talk(door, b"token " + b"x" * 100_000) == b""  # no end of line: not read to the end either
        for target in (f"10.0.2.2:{port}", f"127.0.0.1 {port}", "x", "0", "70000", f"-{port}", f"{port} {port}"):
            answer = _talk(door, f"token {token}\nconnect {target}\nGET / HTTP/1.0\r\n\r\n".encode()).split(b"\n")
            assert answer[0].split()[0] == b"ready" and answer[1].startswith(b"error"), target
            assert answer[2:] == [b""], f"{target}: hung up after the error"
        answer = _talk(door, f"token {token}\nhello\nset 1\n".encode()).split(b"\n")  # an unknown line: hung up
        assert answer[0].split()[0] == b"ready" and answer[1:] == [b""]
        assert chan.resync_clock().kept  # still there for its own channel
    assert http_server.paths == []


def test_with_ssh_gone_the_clock_and_a_forwards_new_connections_go_through_the_side_door_without_a_login(
        sshd: Sshd, tmp_path: Path, http_server: Hits) -> None:
    # A restore under user-mode networking: the SSH connection died with the old QEMU process, and sshd would take
    # seconds of the guest's vCPU for a new one. The clock (whose shell setter fails here) and DevTools must not wait.
    door = _door()
    with _channel(sshd, tmp_path, door) as chan:
        _opened(chan)
        local = chan.forward("127.0.0.1", http_server.server_address[1])
        assert httpx.get(f"http://127.0.0.1:{local}/over-ssh", timeout=10).text == "seen /over-ssh"
        logins = sshd.logins()
        assert logins == 1
        chan.drop()
        assert not chan.connected and chan.side_door_open
        sync = chan.resync_clock()
        assert sync.applied and sync.kept
        assert httpx.get(f"http://127.0.0.1:{local}/through-the-side-door", timeout=10).text == \
            "seen /through-the-side-door"
        assert chan.keeping and not chan.connected
        assert sshd.logins() == logins, "no new SSH connection"
        chan.reconnect(timeout=30)
        assert chan.resync_clock().kept  # the same keeper, still through the side door
        assert sshd.logins() == logins + 1
    assert len((tmp_path / "clock").read_text().split()) == 2


def test_a_side_door_answering_for_another_boot_is_not_used(sshd: Sshd, tmp_path: Path, http_server: Hits) -> None:
    # The host remembers the keeper's boot; a guest that booted since has no keeper of ours behind the door.
    door = _door()
    shell_clock = tmp_path / "shell-clock"
    with _channel(sshd, tmp_path, door, set_clock=f'echo "$t" > {shell_clock}', forward_wait=1.0) as chan:
        _opened(chan)
        local = chan.forward("127.0.0.1", http_server.server_address[1])
        keeper = chan._keeper  # white-box: as if it had said another boot id than the one now behind the door
        assert keeper is not None
        keeper.boot_id = chan._door_boot = "0" * 36
        chan.drop()
        with pytest.raises(httpx.TransportError):  # the forward does not take the door; it waits for SSH, in vain
            httpx.get(f"http://127.0.0.1:{local}/other-boot", timeout=10)
        assert not chan.side_door_open
        chan.reconnect(timeout=30)
        sync = chan.resync_clock()
        assert sync.applied and not sync.kept, "a shell set the clock, not the keeper behind the door"
    assert shell_clock.read_text().strip() and not (tmp_path / "clock").exists()
    assert http_server.paths == []


def test_a_new_keeper_takes_the_side_door_from_the_one_it_replaces(sshd: Sshd, tmp_path: Path) -> None:
    # A server restarted: its new channel (a new token, in memory only) starts a new keeper, which ends the old one
    # through the pid file and listens on the same fixed port once the old one let go of it.
    door = _door()
    with _channel(sshd, tmp_path, door) as old:
        _opened(old)
        with _channel(sshd, tmp_path, door) as new:
            _opened(new)
            assert new.keeper_port == door.listen[1]
            assert new.resync_clock().kept
            wait_until(lambda: not old.keeping, 30, "the old keeper to end")


@pytest.mark.parametrize(("answer", "gone"), [
    (None, False),  # slow (a loaded host right after a restore): tried again next time
    (b"", True),  # slirp hangs up when nothing listens in the guest: no keeper there
    (b"ready 00000000-0000-0000-0000-000000000000 9444 10.0.2.15\n", True),  # another boot
])
def test_only_a_side_door_without_our_keeper_behind_it_counts_as_gone(answer: bytes | None, gone: bool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, ThreadPoolExecutor(1) as pool:
        door = SideDoor(listen=("10.0.2.15", 9444), host=("127.0.0.1", server.getsockname()[1]))
        opened = pool.submit(open_side_door, door, "t" * 32, boot_id="our-boot", timeout=2.0)
        conn, _ = server.accept()
        with conn:
            assert conn.recv(4096).startswith(b"token ")  # it spoke first, then waits for the answer
            if answer is not None:
                conn.sendall(answer)
                conn.shutdown(socket.SHUT_WR)
            with pytest.raises(SideDoorClosed) as closed:
                opened.result(timeout=30)
        assert closed.value.gone is gone
