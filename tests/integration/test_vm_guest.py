"""The guest channel against a real sshd on loopback: pinned host keys, commands, forwards, reconnect."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.hits import Hits
from tests.support.polling import wait_until
from tests.support.sshd import Sshd, keygen
from tests.support.threaded import serving_on_thread
from wakeful.vm.guest import ClockSync, GuestError
from wakeful.vm.ssh_channel import GuestChannel, clock_keeper


class _Relay:
    """A TCP relay in front of sshd that can hold every byte, as a VM on an isolated network does while it is saved
    (the host's TCP connection stays open and nothing answers), and let them through again once it is restored."""

    def __init__(self, port: int) -> None:
        self._target = ("127.0.0.1", port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._flowing = threading.Event()
        self._flowing.set()
        self._done = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while not self._done.is_set():
                client, _ = self._server.accept()
                upstream = socket.create_connection(self._target, timeout=10)
                self._socks += [client, upstream]
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not self._done.is_set():
                if not self._flowing.wait(0.05):
                    continue
                ready, _, _ = select.select([src], [], [], 0.05)
                if ready and self._flowing.is_set():
                    data = src.recv(65536)
                    if not data:
                        return
                    dst.sendall(data)

    def __enter__(self) -> _Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        for sock in [self._server, *self._socks]:
            sock.close()


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    with Sshd(tmp_path / "sshd") as server:
        yield server


@pytest.fixture
def http_server() -> Iterator[Hits]:
    with serving_on_thread(Hits()) as server:
        yield server


def _channel(sshd: Sshd, **kwargs: object) -> GuestChannel:
    options: dict[str, object] = {"port": sshd.port, "user": "root", "client_key_path": sshd.client_key,
                                  "pinned_host_key": sshd.host_public_key, **kwargs}
    return GuestChannel(**options)  # type: ignore[arg-type]


@pytest.fixture
def channel(sshd: Sshd) -> Iterator[GuestChannel]:
    chan = _channel(sshd)
    chan.connect()
    yield chan
    chan.close()


def test_the_pinned_host_key_is_accepted_and_commands_run(channel: GuestChannel) -> None:
    result = channel.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10)
    assert (result.status, result.stdout, result.stderr) == (3, b"out\n", b"err\n")


def test_a_host_presenting_another_key_of_the_pinned_type_is_refused(sshd: Sshd, tmp_path: Path) -> None:
    other = keygen(tmp_path / "other_ed25519")
    with pytest.raises(GuestError) as refused:
        _channel(sshd, pinned_host_key=other).connect()
    assert refused.value.code == "host_key_mismatch"


def test_a_host_whose_key_type_was_not_pinned_is_refused(sshd: Sshd, tmp_path: Path) -> None:
    path = tmp_path / "other_ecdsa"
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(path)], check=True, timeout=30)
    with pytest.raises(GuestError) as refused:
        _channel(sshd, pinned_host_key=path.with_suffix(".pub").read_text()).connect()
    assert refused.value.code == "host_key_mismatch"


def test_a_client_key_the_guest_does_not_know_is_refused(sshd: Sshd, tmp_path: Path) -> None:
    keygen(tmp_path / "stranger")
    with pytest.raises(GuestError) as refused:
        _channel(sshd, client_key_path=tmp_path / "stranger").connect()
    assert refused.value.code == "auth_failed"


def test_nothing_listening_reads_as_unreachable(sshd: Sshd) -> None:
    sshd.stop()
    with pytest.raises(GuestError) as refused:
        _channel(sshd).connect(timeout=2)
    assert refused.value.code == "guest_unreachable"


def test_input_is_fed_to_the_command_and_binary_output_comes_back_whole(channel: GuestChannel) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
    assert channel.run("cat", input=payload, timeout=30).stdout == payload


def test_argv_is_quoted_so_shell_text_stays_text(channel: GuestChannel) -> None:
    hostile = "$(echo pwned); `id` 'quote\" \\ ;|&"
    assert channel.run(["printf", "%s", hostile], timeout=10).stdout.decode() == hostile


def test_a_command_that_outlives_its_timeout_raises(channel: GuestChannel) -> None:
    with pytest.raises(GuestError) as slow:
        channel.run(["sleep", "30"], timeout=0.5)
    assert slow.value.code == "guest_timeout"
    assert channel.run(["true"], timeout=10).status == 0  # the channel is still usable


def test_output_beyond_the_bound_is_refused(sshd: Sshd) -> None:
    with _channel(sshd, max_output=1000) as chan:
        chan.connect()
        with pytest.raises(GuestError) as big:
            chan.run(["head", "-c", "100000", "/dev/zero"], timeout=10)
    assert big.value.code == "output_too_large"


def test_a_forward_round_trips_to_a_loopback_server(channel: GuestChannel, http_server: Hits) -> None:
    port = channel.forward("127.0.0.1", http_server.server_address[1])
    assert channel.forward("127.0.0.1", http_server.server_address[1]) == port
    with httpx.Client(timeout=10) as client:
        bodies = [client.get(f"http://127.0.0.1:{port}/n/{i}").text for i in range(3)]
    assert bodies == [f"seen /n/{i}" for i in range(3)]
    assert http_server.paths == ["/n/0", "/n/1", "/n/2"]


def test_a_forward_to_a_port_nothing_listens_on_closes_quietly(channel: GuestChannel,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    port = channel.forward("127.0.0.1", closed)
    with caplog.at_level(logging.DEBUG, logger="paramiko.transport"), \
            socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        assert conn.recv(1) == b"", "the tunnelled connection is closed, as a refused one would be"
    refused = [r for r in caplog.records if "open FAILED" in r.getMessage()]
    assert refused and all(r.levelno == logging.DEBUG for r in refused), "paramiko said so, at DEBUG, not ERROR"


def test_a_guest_that_resets_ssh_while_it_boots_leaves_no_errors_in_the_log(
        sshd: Sshd, caplog: pytest.LogCaptureFixture) -> None:
    with socket.create_server(("127.0.0.1", 0)) as booting:  # accepts, says nothing, hangs up: sshd not up yet
        def hang_up() -> None:
            with contextlib.suppress(OSError):
                conn, _ = booting.accept()
                conn.recv(1)  # the client's banner arrives first; then the line goes dead
                conn.close()

        threading.Thread(target=hang_up, daemon=True).start()
        chan = _channel(sshd, port=booting.getsockname()[1])
        with caplog.at_level(logging.DEBUG, logger="paramiko.transport"), pytest.raises(GuestError):
            chan.connect(timeout=5)
        chan.close()
    said = [r for r in caplog.records if r.name == "paramiko.transport"]
    assert said and all(r.levelno < logging.WARNING for r in said), [(r.levelname, r.getMessage()) for r in said]


def test_close_stops_listeners_and_leaves_no_threads(sshd: Sshd, http_server: Hits) -> None:
    chan = _channel(sshd)
    chan.connect()
    port = chan.forward("127.0.0.1", http_server.server_address[1])
    idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # an open, idle tunnelled connection
    wait_until(lambda: chan.forward_threads() == 2, 10, "the tunnelled connection to be picked up")
    chan.close()
    assert chan.forward_threads() == 0
    assert idle.recv(1) == b""  # the idle client saw its connection end
    idle.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert not chan.connected


def test_reconnect_after_the_guest_sshd_restarts_keeps_the_forward_port(
        sshd: Sshd, channel: GuestChannel, http_server: Hits) -> None:
    port = channel.forward("127.0.0.1", http_server.server_address[1])
    sshd.restart()  # a restored VM: new process, the old transport is dead
    wait_until(lambda: not channel.connected, 15, "the client to notice its transport died")
    with pytest.raises(GuestError) as down:
        channel.run(["true"], timeout=5)
    assert down.value.code == "not_connected"

    report = channel.reconnect(timeout=15)
    assert report.ports == {("127.0.0.1", http_server.server_address[1]): port}
    assert report.moved == {}
    assert channel.run(["echo", "back"], timeout=10).stdout == b"back\n"
    assert httpx.get(f"http://127.0.0.1:{port}/after", timeout=10).text == "seen /after"


def test_a_connection_made_while_ssh_is_down_waits_for_the_reconnect(
        sshd: Sshd, channel: GuestChannel, http_server: Hits) -> None:
    port = channel.forward("127.0.0.1", http_server.server_address[1])
    sshd.stop()
    wait_until(lambda: not channel.connected, 15, "the client to notice its transport died")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: httpx.get(f"http://127.0.0.1:{port}/early", timeout=30).text)
        sshd.start()
        channel.reconnect(timeout=15)
        assert pending.result(timeout=30) == "seen /early"


def test_reconnect_retries_until_the_guest_answers(sshd: Sshd, channel: GuestChannel) -> None:
    sshd.stop()
    wait_until(lambda: not channel.connected, 15, "the client to notice its transport died")
    with ThreadPoolExecutor(1) as pool:
        reconnecting = pool.submit(channel.reconnect, timeout=30)
        wait_until(lambda: reconnecting.running(), 5, "the reconnect to start")
        sshd.start()
        report = reconnecting.result(timeout=40)
    assert report.attempts >= 1
    assert channel.connected


def test_clock_resync_sets_the_guest_clock_to_the_host_time(sshd: Sshd, tmp_path: Path) -> None:
    # On a host the real `date -s` would set this machine's clock: record the command's argument instead.
    # The setter runs in the same guest shell that read the clock, given the host's time as "$t" (seconds.nanos).
    target = tmp_path / "clock"
    chan = _channel(sshd, set_clock=f'echo "$t" > {target}')
    with chan:
        chan.connect()
        sync = chan.resync_clock()
        host_now = time.time_ns()
    seconds, _, nanos = target.read_text().strip().partition(".")
    assert len(nanos) == 9
    set_to = int(seconds) * 10**9 + int(nanos)
    assert abs(host_now - set_to) < 60 * 10**9  # it was set to the host's time, not something else
    assert abs(sync.before.total_seconds()) < 60 and abs(sync.after.total_seconds()) < 60
    assert sync.round_trip.total_seconds() >= 0
    assert sync.applied is True


def test_a_clock_that_cannot_be_set_is_reported_with_its_status(sshd: Sshd) -> None:
    with _channel(sshd, set_clock="exit 9") as chan:
        chan.connect()
        with pytest.raises(GuestError) as failed:
            chan.resync_clock()
    assert failed.value.code == "guest_command_failed"


def test_clock_resync_never_sets_the_clock_of_the_machine_it_runs_on(channel: GuestChannel) -> None:
    # The sshd here runs on this very host: the default `date -s` would step the host clock. It must be skipped.
    sync = channel.resync_clock()
    assert sync.applied is False
    assert sync.before == sync.after


def _resync_through_the_keeper(chan: GuestChannel) -> ClockSync:
    wait_until(lambda: chan.keeping, 60, "the clock keeper to start")
    return chan.resync_clock()


def test_the_clock_keeper_sets_the_clock_with_a_line_each_way_instead_of_a_shell(sshd: Sshd, tmp_path: Path) -> None:
    # The shell's setter fails here, so a resync that succeeds went through the keeper, which got the host's time
    # (nanoseconds) on its line. On a host the keeper records the time instead of setting the clock.
    target = tmp_path / "clock"
    chan = _channel(sshd, set_clock="exit 9", keeper=clock_keeper(f"open({str(target)!r}, 'w').write(str(t))"))
    with chan:
        chan.connect()
        assert not chan.keeping
        chan.keep_clock()
        sync = _resync_through_the_keeper(chan)
        chan.keep_clock()  # it runs: nothing new is started
        again = chan.resync_clock()
        host_now = time.time_ns()
    assert abs(host_now - int(target.read_text())) < 60 * 10**9
    assert sync.applied and again.applied and sync.kept and again.kept
    assert abs(sync.before.total_seconds()) < 60 and abs(sync.after.total_seconds()) < 60


def test_a_clock_the_keeper_left_off_is_set_once_more_and_no_more(sshd: Sshd, tmp_path: Path) -> None:
    # The host's clock here runs a second ahead of the "guest" (this machine), whose clock the keeper only records:
    # the first set leaves it a second off, so it is set once more (the keeper awake by then), and that is all.
    target = tmp_path / "clock"
    chan = _channel(sshd, wall_ns=lambda: time.time_ns() + 10**9,
                    keeper=clock_keeper(f"open({str(target)!r}, 'a').write(str(t) + '\\n')"))
    with chan:
        chan.connect()
        chan.keep_clock()
        sync = _resync_through_the_keeper(chan)
    assert len(target.read_text().split()) == 2
    assert sync.kept and sync.after.total_seconds() < -0.5


def test_a_clock_keeper_that_died_leaves_the_resync_to_a_shell(sshd: Sshd, tmp_path: Path) -> None:
    target = tmp_path / "clock"
    chan = _channel(sshd, set_clock=f'echo "$t" > {target}', keeper=clock_keeper("sys.exit(0)"))
    with chan:
        chan.connect()
        chan.keep_clock()
        sync = _resync_through_the_keeper(chan)  # the keeper exits on its line: the shell sets the clock
        assert not chan.keeping
    assert sync.applied and not sync.kept and target.read_text().strip()


def _answers(port: int, first_line: bytes) -> bytes:
    """What the keeper's port says to a connection that starts with `first_line` (b"" once it hangs up)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(first_line)
        conn.settimeout(10)
        try:
            return conn.recv(4096)
        except ConnectionResetError:  # hung up on with some of it unread
            return b""


def test_a_clock_keeper_that_outlived_its_connection_sets_the_clock_through_the_next_one(sshd: Sshd,
                                                                                         tmp_path: Path) -> None:
    # A restore under user-mode networking: the SSH connection dies with the old QEMU process, the keeper in the
    # guest does not. The next connection reaches it through a forward to its port: no shell (whose setter fails
    # here), no new keeper (which would start python3 again right after the restore).
    target = tmp_path / "clock"
    chan = _channel(sshd, set_clock="exit 9", keeper=clock_keeper(f"open({str(target)!r}, 'a').write(str(t) + '\\n')"))
    with chan:
        chan.connect()
        chan.keep_clock()
        _resync_through_the_keeper(chan)
        chan.drop()  # the old session ends: the keeper reads end-of-file on its stdin and carries on
        chan.reconnect(timeout=30)
        assert not chan.keeping
        sync = chan.resync_clock()
        assert sync.applied and sync.kept
        assert chan.keeping
        chan.keep_clock()  # it runs: nothing new is started
        assert chan.resync_clock().kept
    assert len(target.read_text().split()) == 3


def test_a_keeper_whose_ready_line_came_before_the_connection_died_is_reached_through_the_next_one(
        sshd: Sshd, tmp_path: Path) -> None:
    # Nothing asked the keeper whether it was ready before the restore: its line waited in the dead channel.
    target = tmp_path / "clock"
    chan = _channel(sshd, set_clock="exit 9", keeper=clock_keeper(f"open({str(target)!r}, 'a').write(str(t) + '\\n')"))
    with chan:
        chan.connect()
        chan.keep_clock()
        keeper = chan._keeper  # white-box: wait for its line to arrive without reading it
        assert keeper is not None
        wait_until(keeper.chan.recv_ready, 60, "the keeper's ready line")
        chan.drop()
        chan.reconnect(timeout=30)
        sync = chan.resync_clock()
        assert sync.applied and sync.kept
    assert len(target.read_text().split()) == 1


def test_the_clock_keepers_port_hangs_up_on_a_connection_without_its_token_and_closing_the_channel_ends_it(
        sshd: Sshd, tmp_path: Path) -> None:
    chan = _channel(sshd, keeper=clock_keeper(f"open({str(tmp_path / 'clock')!r}, 'w').write(str(t))"))
    with chan:
        chan.connect()
        chan.keep_clock()
        _resync_through_the_keeper(chan)
        port = chan.keeper_port
        assert port is not None
        assert _answers(port, b"token not-the-one\n") == b""
        assert _answers(port, b"set 0\n") == b""
        assert _answers(port, b"\n") == b""
        assert _answers(port, b"token " + b"x" * 100_000) == b""  # no end of line: not read to the end either
        assert chan.resync_clock().kept  # still there for its own channel

    def gone() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return True
        return False

    wait_until(gone, 30, "the keeper to end with the channel")


def test_the_clock_keeper_never_sets_the_clock_of_the_machine_it_runs_on(channel: GuestChannel) -> None:
    channel.keep_clock()
    sync = _resync_through_the_keeper(channel)
    assert sync.applied is False and sync.before == sync.after and sync.kept
    assert channel.keeping


def test_a_transport_that_outlives_a_silence_is_alive_again_with_its_forwards(sshd: Sshd, http_server: Hits) -> None:
    # A VM on an isolated network, saved and restored: the TCP connection was never closed, only silent.
    with _Relay(sshd.port) as relay, _channel(sshd, port=relay.port) as chan:
        chan.connect()
        port = chan.forward("127.0.0.1", http_server.server_address[1])
        assert chan.alive(timeout=10)
        relay.hold()
        assert not chan.alive(timeout=0.5), "a guest that does not answer is not alive"
        relay.release()
        assert chan.alive(timeout=10)
        assert chan.run(["echo", "same transport"], timeout=10).stdout == b"same transport\n"
        assert httpx.get(f"http://127.0.0.1:{port}/after", timeout=10).text == "seen /after"


def test_a_transport_whose_guest_process_is_gone_is_not_alive(sshd: Sshd, channel: GuestChannel) -> None:
    sshd.restart()  # a VM restored under user-mode networking: the old connection died with the old process
    assert not channel.alive(timeout=10)
    channel.drop()
    assert not channel.alive(timeout=10), "nothing to ask once dropped"


def test_a_command_waits_for_a_reconnect_under_way_instead_of_failing(sshd: Sshd) -> None:
    # After a restore through the keeper's side door, SSH is made again off the path: a command meanwhile waits for
    # it (within its own timeout) rather than failing with not_connected.
    with _Relay(sshd.port) as relay, _channel(sshd, port=relay.port) as chan:
        chan.connect()
        chan.drop()
        relay.hold()  # the new connection's banner waits in the relay
        with ThreadPoolExecutor(2) as pool:
            reconnect = pool.submit(chan.reconnect, timeout=60)
            wait_until(lambda: chan.reconnecting, 10, "the reconnect to start")
            command = pool.submit(chan.run, ["echo", "after the reconnect"], timeout=60)
            relay.release()
            assert command.result(timeout=60).stdout == b"after the reconnect\n"
            reconnect.result(timeout=60)
