"""The SSH tunnel to another tool-computer host, against real sshds on loopback: the "host" is one sshd, a "guest"
behind it another. The host key is pinned; the guest channel speaks SSH through a direct-tcpip channel of the
tunnel; the host's 127.0.0.1:<proxy port> comes back to the egress proxy here (a stand-in listening on 127.0.0.2,
since both ends share this machine's loopback); an unreachable host is `host_unreachable`.

On an isolated network the host's sshd listens on the network's host address instead (127.0.0.5 here; GatewayPorts
clientspecified), and each guest connection comes to the egress proxy's relay socket here headed by a PROXY line
naming the guest's own address, which the sshd reports as the connection's originator (127.0.0.3 here)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.docs import fenced, section
from tests.support.polling import wait_until
from tests.support.serve import free_port
from tests.support.sshd import Sshd, keygen
from wakeful.vm.errors import HostUnreachable
from wakeful.vm.fake import FakeHypervisor
from wakeful.vm.guest import AuthFailed, GuestUnreachable, HostKeyMismatch
from wakeful.vm.host_tunnel import ForwardRefused, HostSsh, HostTunnel, NetworkForward
from wakeful.vm.hosts import Host, HostFleet
from wakeful.vm.placement import HostSpec
from wakeful.vm.ssh_channel import GuestChannel


def _record_and_answer(server: socket.socket, seen: list[bytes], who: bytes) -> None:
    """Answer each connection on `server` with what it read up to the client's half-close, recorded in `seen`."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            seen.append(data)
            conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + who + b" saw " + data)


class FakeProxy:
    """Answers each connection with what it read up to the client's half-close, and records it."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.2", free_port()))
        self.port = int(self.server.getsockname()[1])
        self.seen: list[bytes] = []
        self.thread = threading.Thread(target=_record_and_answer, args=(self.server, self.seen, b"proxy"),
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()


class FakeRelay:
    """The egress proxy's relay socket: records what each connection sent up to its half-close, and answers."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="wkr-"))  # a unix socket path must stay short
        self.path = self.dir / "relay.sock"
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(self.path))
        self.server.listen()
        self.seen: list[bytes] = []
        threading.Thread(target=_record_and_answer, args=(self.server, self.seen, b"relay"), daemon=True).start()

    def with_payload(self) -> list[bytes]:
        """What connections carrying more than their PROXY line sent (the tunnel's own bind check carries none)."""
        return [data for data in self.seen if not data.endswith(b"\r\n") or data.count(b"\r\n") > 1]

    def close(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self.path.unlink(missing_ok=True)
        self.dir.rmdir()


NETWORK_HOST, GUEST = "127.0.0.5", "127.0.0.3"


@pytest.fixture
def relay() -> Iterator[FakeRelay]:
    fake = FakeRelay()
    yield fake
    fake.close()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Sshd]:
    with Sshd(tmp_path / "host", forwarding="yes") as server:
        yield server


@pytest.fixture
def proxy() -> Iterator[FakeProxy]:
    fake = FakeProxy()
    yield fake
    fake.close()


def tunnel_to(host: Sshd, **kwargs: object) -> HostTunnel:
    options: dict[str, object] = {"host_key": host.host_public_key, "client_key": host.client_key}
    ssh_options = {k: kwargs.pop(k) for k in list(kwargs) if k in {"host_key", "client_key", "proxy_command"}}
    ssh = HostSsh.parse(f"root@127.0.0.1:{host.port}", **{**options, **ssh_options})  # type: ignore[arg-type]
    return HostTunnel(name="b", ssh=ssh, timeout=5.0, **kwargs)  # type: ignore[arg-type]


def test_the_guest_channel_speaks_ssh_through_the_tunnel_with_the_guests_key_still_pinned(
        host: Sshd, tmp_path: Path) -> None:
    with Sshd(tmp_path / "guest") as guest:
        tunnel = tunnel_to(host)
        try:
            channel = GuestChannel(port=guest.port, user="root", client_key_path=guest.client_key,
                                   pinned_host_key=guest.host_public_key,
                                   sock=lambda: tunnel.open(("127.0.0.1", guest.port)))
            with channel:
                channel.connect()
                assert channel.run(["echo", "through b"], timeout=10).stdout == b"through b\n"
                guest.restart()  # the guest's transport dies (a restore); the tunnel stays
                channel.reconnect(timeout=20)
                assert channel.run("echo again", timeout=10).stdout == b"again\n"
            impostor = GuestChannel(port=guest.port, user="root", client_key_path=guest.client_key,
                                    pinned_host_key=keygen(tmp_path / "other-guest"),
                                    sock=lambda: tunnel.open(("127.0.0.1", guest.port)))
            with impostor, pytest.raises(HostKeyMismatch):
                impostor.connect()
        finally:
            tunnel.close()


def test_a_guest_connection_to_the_hosts_proxy_port_reaches_the_egress_proxy_here(
        host: Sshd, proxy: FakeProxy) -> None:
    tunnel = tunnel_to(host, proxy=("127.0.0.2", proxy.port))
    try:
        tunnel.ensure()
        for n in (1, 2):  # one connection per request, as slirp's connector makes them
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as conn:  # the host's loopback
                conn.sendall(b"GET http://example.test/ HTTP/1.1\r\nProxy-Authorization: Basic dTp0\r\n\r\n")
                conn.shutdown(socket.SHUT_WR)
                answer = b""
                while chunk := conn.recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.0 200 OK") and b"Proxy-Authorization: Basic dTp0" in answer
            assert len(proxy.seen) == n
        host.restart()  # the host's sshd restarts: the forward dies with the session, and comes back with the next
        wait_until(lambda: not tunnel.connected(), 10, "the tunnel to notice the restart")
        tunnel.ensure()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as conn:
            conn.sendall(b"again")
            conn.shutdown(socket.SHUT_WR)
            assert conn.recv(65536).startswith(b"HTTP/1.0 200 OK")
    finally:
        tunnel.close()


def forward_answers(port: int) -> bool:
    """Whether a connection to the host's 127.0.0.1:`port` (the remote forward) comes back to the fake proxy."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"ping")
            conn.shutdown(socket.SHUT_WR)
            return conn.recv(65536).startswith(b"HTTP/1.0 200 OK")
    except OSError:
        return False


def test_the_keeper_brings_the_proxy_forward_back_after_the_hosts_sshd_session_dies_with_nothing_else_using_it(
        host: Sshd, proxy: FakeProxy, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wakeful.vm")
    tunnel = tunnel_to(host, proxy=("127.0.0.2", proxy.port), keepalive=0.2)
    try:
        tunnel.ensure()
        assert forward_answers(proxy.port)
        for pid in host.sessions():  # the connection's sshd dies; the listener stays, as when sshd is restarted
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not forward_answers(proxy.port), 10, "the forward to die with the session")
        wait_until(lambda: forward_answers(proxy.port), 20, "the keeper to bring the forward back")
        assert tunnel.connected()
        messages = [r.getMessage() for r in caplog.records if "tunnel" in r.getMessage()]
        assert len([m for m in messages if "dropped" in m]) == 1, messages  # once per drop, not per attempt
        assert len([m for m in messages if "is back" in m]) == 1, messages
    finally:
        tunnel.close()


def test_the_keeper_notices_the_drop_behind_a_proxy_command_too(host: Sshd, proxy: FakeProxy) -> None:
    # paramiko's ProxyCommand never reads an end of stream as the connection ending: only a write that fails shows it
    tunnel = tunnel_to(host, proxy=("127.0.0.2", proxy.port), proxy_command="/bin/busybox nc %h %p", keepalive=0.2)
    try:
        tunnel.ensure()
        assert forward_answers(proxy.port)
        for pid in host.sessions():
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not forward_answers(proxy.port), 10, "the forward to die with the session")
        wait_until(lambda: forward_answers(proxy.port), 20, "the keeper to bring the forward back")
    finally:
        tunnel.close()


def test_the_keeper_keeps_trying_with_a_backoff_until_the_host_comes_back(host: Sshd, proxy: FakeProxy) -> None:
    tunnel = tunnel_to(host, proxy=("127.0.0.2", proxy.port), keepalive=0.2)
    try:
        tunnel.ensure()
        host.stop()
        wait_until(lambda: not tunnel.connected(), 10, "the tunnel to notice the stop")
        with pytest.raises(HostUnreachable):
            tunnel.ensure()
        host.start()
        wait_until(lambda: forward_answers(proxy.port), 30, "the keeper to reconnect once the host is back")
    finally:
        tunnel.close()


def test_a_host_that_stops_answering_is_marked_unreachable_by_the_keeper_and_placement_counts_it_gone(
        host: Sshd, proxy: FakeProxy, tmp_path: Path) -> None:
    tunnel = tunnel_to(host, proxy=("127.0.0.2", proxy.port), keepalive=0.2)
    fleet = HostFleet([Host(spec=HostSpec(name="a", uri="fake://a", memory_mib=2048), hypervisor=FakeHypervisor()),
                       Host(spec=HostSpec(name="b", uri="fake://b", memory_mib=2048), hypervisor=FakeHypervisor(),
                            link=tunnel)], tmp_path / "shared")
    assert host.pid is not None
    stopped: list[int] = []
    try:
        assert [(h.name, h.reachable) for h in fleet.loads()] == [("a", True), ("b", True)]
        assert forward_answers(proxy.port)
        for pid in [host.pid, *host.sessions()]:  # the peer (and its listener) freeze: TCP stays up, nothing answers
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        wait_until(lambda: not tunnel.connected(), 30, "the keeper to notice that the host does not answer")
        with pytest.raises(HostUnreachable) as caught:
            tunnel.ensure()
        assert caught.value.code == "host_unreachable"
        assert [(h.name, h.reachable) for h in fleet.loads()] == [("a", True), ("b", False)]
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        tunnel.close()


def test_closing_the_tunnel_stops_its_keeper(host: Sshd) -> None:
    tunnel = tunnel_to(host, keepalive=0.2)
    tunnel.ensure()
    assert any(t.name == "host-b-keeper" for t in threading.enumerate())
    tunnel.close()
    wait_until(lambda: not any(t.name == "host-b-keeper" for t in threading.enumerate()), 10,
               "the keeper thread to end")
    assert not tunnel.connected()


def test_a_host_presenting_another_key_is_refused(host: Sshd, tmp_path: Path) -> None:
    tunnel = tunnel_to(host, host_key=keygen(tmp_path / "not-the-host"))
    with pytest.raises(HostKeyMismatch) as caught:
        tunnel.ensure()
    assert caught.value.code == "host_key_mismatch" and not tunnel.connected()


def test_a_client_key_the_host_does_not_know_is_refused(host: Sshd, tmp_path: Path) -> None:
    keygen(tmp_path / "stranger")
    with pytest.raises(AuthFailed):
        tunnel_to(host, client_key=tmp_path / "stranger").ensure()


def test_a_host_nothing_answers_at_is_unreachable(host: Sshd) -> None:
    host.stop()
    with pytest.raises(HostUnreachable) as caught:
        tunnel_to(host).ensure()
    assert caught.value.code == "host_unreachable" and "127.0.0.1" in caught.value.message


def test_after_a_failure_the_host_is_tried_again_only_after_retry_after(host: Sshd) -> None:
    now = [100.0]
    host.stop()
    tunnel = tunnel_to(host, retry_after=5.0, monotonic=lambda: now[0])
    try:
        with pytest.raises(HostUnreachable):
            tunnel.ensure()
        host.start()
        now[0] += 4.0
        with pytest.raises(HostUnreachable):  # the same answer, without another attempt
            tunnel.ensure()
        now[0] += 1.0
        tunnel.ensure()
        assert tunnel.connected()
    finally:
        tunnel.close()


def test_a_proxy_command_that_cannot_reach_the_host_is_unreachable(host: Sshd) -> None:
    with pytest.raises(HostUnreachable):
        tunnel_to(host, proxy_command="/bin/false").ensure()


def test_the_host_is_reached_through_a_proxy_command(host: Sshd) -> None:
    tunnel = tunnel_to(host, proxy_command="/bin/busybox nc %h %p")
    try:
        tunnel.ensure()
        assert tunnel.connected()
    finally:
        tunnel.close()


def test_a_guest_port_nothing_listens_on_is_guest_unreachable_and_the_tunnel_stays(host: Sshd) -> None:
    tunnel = tunnel_to(host)
    try:
        with pytest.raises(GuestUnreachable):
            tunnel.open(("127.0.0.1", free_port()))
        assert tunnel.connected()
    finally:
        tunnel.close()


def test_a_proxy_port_the_host_will_not_forward_is_a_clear_error(tmp_path: Path, proxy: FakeProxy) -> None:
    with Sshd(tmp_path / "strict") as strict:  # AllowTcpForwarding local: no remote forwards
        with pytest.raises(HostUnreachable, match="AllowTcpForwarding"):
            tunnel_to(strict, proxy=("127.0.0.2", proxy.port)).ensure()


def documented_sshd_config() -> dict[str, str]:
    """The sshd settings infra/README.md tells a host on an isolated network to set for the server's user."""
    notes = (Path(__file__).resolve().parents[2] / "infra" / "README.md").read_text()
    block = fenced(section(notes, "### Hosts reached over SSH"), "text")
    return dict(line.split() for line in block.splitlines() if line.startswith("    "))


def from_guest(port: int, data: bytes, *, source: str = GUEST) -> bytes:
    """A guest on the host's network connecting to the proxy's address there, from its own address."""
    with socket.socket() as conn:
        conn.settimeout(10)
        conn.bind((source, 0))
        conn.connect((NETWORK_HOST, port))
        conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer


def test_on_an_isolated_network_a_guest_connection_reaches_the_relay_socket_headed_by_the_guests_address(
        tmp_path: Path, relay: FakeRelay) -> None:
    port = free_port()
    documented = documented_sshd_config()
    assert documented == {"AllowTcpForwarding": "yes", "GatewayPorts": "clientspecified"}
    with Sshd(tmp_path / "netted", forwarding=documented["AllowTcpForwarding"],
              gateway_ports=documented["GatewayPorts"]) as host:
        tunnel = tunnel_to(host, network=NetworkForward(listen=(NETWORK_HOST, port), relay_socket=relay.path))
        try:
            tunnel.ensure()
            request = b"GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\n\r\n"
            answer = from_guest(port, request)
            [seen] = relay.with_payload()
            head, rest = seen.split(b"\r\n", 1)
            fields = head.decode().split(" ")
            assert fields[:4] == ["PROXY", "TCP4", GUEST, NETWORK_HOST] and fields[5] == str(port)
            assert rest == request and answer == b"HTTP/1.0 200 OK\r\n\r\nrelay saw " + seen
            assert not forward_answers(port), "the forward is on the network's address only, not the host's loopback"
            assert b"PROXY TCP4 127.0.0.4 " in from_guest(port, b"x", source="127.0.0.4").split(b"saw ", 1)[1]
        finally:
            tunnel.close()


def test_a_host_whose_sshd_puts_the_forward_on_its_loopback_instead_is_told_to_set_gatewayports(
        tmp_path: Path, relay: FakeRelay) -> None:
    # GatewayPorts no (the default): OpenSSH grants the forward but binds it to the loopback, silently.
    port = free_port()
    with Sshd(tmp_path / "default", forwarding="yes") as host:
        tunnel = tunnel_to(host, network=NetworkForward(listen=(NETWORK_HOST, port), relay_socket=relay.path))
        with pytest.raises(ForwardRefused, match="GatewayPorts clientspecified") as caught:
            tunnel.ensure()
        assert caught.value.code == "host_forward_refused" and not tunnel.connected()


def test_a_host_whose_sshd_puts_the_forward_on_every_address_is_told_to_set_gatewayports_clientspecified(
        tmp_path: Path, relay: FakeRelay) -> None:
    port = free_port()
    with Sshd(tmp_path / "wide", forwarding="yes", gateway_ports="yes") as host:
        tunnel = tunnel_to(host, network=NetworkForward(listen=(NETWORK_HOST, port), relay_socket=relay.path))
        with pytest.raises(ForwardRefused, match="clientspecified"):
            tunnel.ensure()
        assert not tunnel.connected()


def test_a_host_that_refuses_remote_forwards_on_its_network_is_a_clear_error(
        tmp_path: Path, relay: FakeRelay) -> None:
    with Sshd(tmp_path / "strict", gateway_ports="clientspecified") as strict:  # AllowTcpForwarding local
        tunnel = tunnel_to(strict, network=NetworkForward(listen=(NETWORK_HOST, free_port()), relay_socket=relay.path))
        with pytest.raises(ForwardRefused, match="AllowTcpForwarding"):
            tunnel.ensure()


def test_a_tunnel_takes_the_loopback_forward_or_the_network_one_not_both(host: Sshd, relay: FakeRelay) -> None:
    with pytest.raises(ValueError, match="not both"):
        tunnel_to(host, proxy=("127.0.0.2", 3128), network=NetworkForward(listen=(NETWORK_HOST, 3128),
                                                                          relay_socket=relay.path))


def test_the_keeper_brings_the_network_forward_back_after_the_hosts_sshd_session_dies(
        tmp_path: Path, relay: FakeRelay) -> None:
    port = free_port()

    def relayed() -> bool:
        try:
            return from_guest(port, b"ping").endswith(b"ping")
        except OSError:
            return False

    with Sshd(tmp_path / "netted", forwarding="yes", gateway_ports="clientspecified") as host:
        tunnel = tunnel_to(host, network=NetworkForward(listen=(NETWORK_HOST, port), relay_socket=relay.path),
                           keepalive=0.2)
        try:
            tunnel.ensure()
            assert relayed()
            for pid in host.sessions():
                os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not relayed(), 10, "the forward to die with the session")
            wait_until(relayed, 20, "the keeper to bring the network forward back, checked again")
        finally:
            tunnel.close()
