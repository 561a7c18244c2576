"""A tool computer on a host the api reaches only over SSH, for real on this one machine.

Host "b" is a second libvirtd in a network namespace of its own (second_libvirtd.py, `own_network=True`): its
loopback is not ours, so a guest's forwards there are out of the api's reach but through SSH. An sshd runs inside
b on b's 127.0.0.1, and the api reaches it only through a proxy command (`nsenter --net=… busybox nc 127.0.0.1
PORT`), as it would through a bastion: no address outside 127.0.0.0/8 is used anywhere.

The tiny guest runs on a (the system libvirtd), is suspended to the shared directory, a is marked full, and it
resumes on b. The api then observes it through the tunnel (`HostFleet.open_to`, what the guest channel's socket is):
the counter the guest serves on its port 22 has the same pid and boot id, further on. A request the guest makes to
the egress proxy (10.0.2.100:3128) leaves b through the proxy connector, carrying the VM's credential, and reaches
the proxy on a through the tunnel's remote forward. Then b's sshd stops: b counts as gone, and the computer, saved
on b, resumes on a. Timings are printed (-s), never asserted. What only separate hosts would show: latency and
bandwidth of the link, NFS under the shared directory, a host whose network (not its sshd) fails.

Then the production setting, `computer_network`, with b reached over SSH: an isolated network of the test's own
exists only in b's namespace (10.79.N.0/24), a second sshd there has `GatewayPorts clientspecified`, and the
server's own wiring builds the rest from the settings (`hypervisor_for`, `network_settings`, the default link) with
the real `wakeful proxy` and decider (`shop_lab`). A computer on b takes its reserved address by DHCP; the api
reaches its port 22 at that address through the tunnel; its request to the proxy's address on b's network comes
through the tunnel to the proxy's relay socket, headed by the address b's sshd saw, and the proxy asks the decider
with that computer's identity from the address book. A request from b's own address on that network, which is in no
book, is anonymous and refused. Saved and restored on b, the computer is known by its address again.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

import pytest
from conftest import URI
from second_libvirtd import SecondLibvirtd, isolated_network_in, start_second_libvirtd
from shop_lab import ShopEgress, shop_egress
from tiny_guest import TinyGuest
from vm_lab import Count, Recorder, Serial

from tests.support.polling import wait_until
from tests.support.sshd import Sshd
from wakeful.proxy.clock import FakeClock
from wakeful.server.computers.pool import default_link, hypervisor_for, network_settings
from wakeful.server.settings import ComputerHost
from wakeful.vm.accel import AccelChoice
from wakeful.vm.errors import VmError
from wakeful.vm.host_tunnel import HostSsh, HostTunnel
from wakeful.vm.hosts import Host, HostFleet, HostLink
from wakeful.vm.hypervisor import DomainState, ProxyCredential
from wakeful.vm.libvirt_adapter import LibvirtHypervisor
from wakeful.vm.lifecycle import VmManager, VmSettings
from wakeful.vm.lifecycle_rules import VmSize
from wakeful.vm.placement import HostMark, HostSpec

pytestmark = pytest.mark.vm

USER = "remote-bob"
CREDENTIAL = ProxyCredential(user_id="usr_remote_bob", token="tok-remote-bob-3")
PREFIX = f"wkr{os.getpid() % 10000}-"


@dataclass
class Remote:
    fleet: HostFleet
    manager: VmManager
    a: LibvirtHypervisor
    b: LibvirtHypervisor
    daemon_b: SecondLibvirtd
    sshd_b: Sshd
    tunnel: HostTunnel


@pytest.fixture(scope="module")
def remote(libvirtd: None, tiny_guest: TinyGuest, accel: AccelChoice, proxy: Recorder,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("a second libvirtd in its own namespaces needs root, unshare and nsenter")
    daemon_b = start_second_libvirtd(tmp_path_factory.mktemp("libvirtd-b-net"), own_network=True)
    sshd_b = Sshd(tmp_path_factory.mktemp("sshd-b"), forwarding="yes", netns=daemon_b.netns)
    try:
        sshd_b.start()
    except BaseException:
        daemon_b.stop()
        raise
    ssh = HostSsh.parse(f"root@127.0.0.1:{sshd_b.port}", host_key=sshd_b.host_public_key,
                        client_key=sshd_b.client_key,
                        proxy_command=f"nsenter --net={daemon_b.netns} /bin/busybox nc %h %p")
    tunnel = HostTunnel(name="b", ssh=ssh, proxy=("127.0.0.1", proxy.port))
    a, b = LibvirtHypervisor(URI), LibvirtHypervisor(daemon_b.uri)
    shared = tmp_path_factory.mktemp("shared-remote")
    fleet = HostFleet([Host(spec=HostSpec(name="a", uri=URI, memory_mib=200_000), hypervisor=a),
                       Host(spec=HostSpec(name="b", uri=daemon_b.uri, memory_mib=100_000), hypervisor=b,
                            link=tunnel)], shared)
    settings = VmSettings(
        data_dir=shared, base_image=tiny_guest.base, kernel=tiny_guest.kernel, initrd=tiny_guest.initrd,
        cmdline="panic=-1", accel=accel.accel, size=VmSize(memory_mib=256, vcpus=1, disk_gib=1),
        port_range=(27000, 27999), proxy_port=proxy.port, idle_after=timedelta(minutes=5), domain_prefix=PREFIX)
    manager = VmManager(settings, fleet, clock=FakeClock())
    yield Remote(fleet=fleet, manager=manager, a=a, b=b, daemon_b=daemon_b, sshd_b=sshd_b, tunnel=tunnel)
    for vm in manager.vms():
        if vm.name.startswith(PREFIX):
            for hv in (a, b):
                try:
                    hv.destroy(vm.name)
                except VmError:
                    pass
                try:
                    hv.undefine(vm.name)
                except VmError:
                    pass
    tunnel.close()
    sshd_b.stop()
    daemon_b.stop()


class _Sock(Protocol):
    def sendall(self, data: bytes) -> None: ...
    def recv(self, size: int) -> bytes: ...
    def close(self) -> None: ...


def http_get(sock: object, path: str) -> str:
    """One HTTP/1.0 request over a socket-like object (a tunnel's channel), the whole answer as text."""
    assert sock is not None, "a computer on b is reached through the tunnel"
    chan = cast(_Sock, sock)
    chan.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
    answer = b""
    while chunk := chan.recv(65536):
        answer += chunk
    chan.close()
    return answer.decode(errors="replace")


def counter_through_tunnel(remote: Remote, name: str, port: int) -> Count:
    text = http_get(remote.fleet.open_to(name, ("127.0.0.1", port), timeout=30), "/counter")
    fields = dict(part.split("=", 1) for part in text.rsplit("WK-COUNTER", 1)[1].split())
    return Count(int(fields["n"]), int(fields["pid"]), fields["boot"])


def refused_here(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except OSError:
        return True


def test_the_api_reaches_b_only_through_the_proxy_command(remote: Remote) -> None:
    assert refused_here(remote.sshd_b.port)  # b's sshd is on b's loopback, not ours
    remote.tunnel.ensure()
    assert remote.tunnel.connected()
    assert [(h.name, h.reachable) for h in remote.fleet.loads()] == [("a", True), ("b", True)]


def test_a_computer_resumed_on_b_is_observed_through_the_tunnel_and_reaches_the_proxy_on_a(
        remote: Remote, proxy: Recorder) -> None:
    manager, fleet = remote.manager, remote.fleet
    vm = manager.provision(USER, proxy_credential=CREDENTIAL)
    assert vm.forwards.ssh is not None
    serial = Serial(vm.serial_log)
    manager.ensure_running(USER)
    assert fleet.home(vm.name) == "a"
    booted = serial.next_count(timeout=180)
    assert fleet.open_to(vm.name, ("127.0.0.1", vm.forwards.ssh)) is None  # on a: the channel connects directly
    manager.suspend(USER)
    last = serial.last_count()

    fleet.mark("a", HostMark.FULL)
    started = time.perf_counter()
    manager.ensure_running(USER)
    restored = time.perf_counter() - started
    assert fleet.home(vm.name) == "b" and remote.b.state(vm.name) is DomainState.RUNNING

    assert refused_here(vm.forwards.ssh)  # the guest's forward is on b's loopback now
    started = time.perf_counter()
    seen = wait_until(lambda: _after(counter_through_tunnel(remote, vm.name, vm.forwards.ssh), last), 60,
                      "the counter through the tunnel to go on")
    observed = time.perf_counter() - started
    assert (seen.pid, seen.boot) == (booted.pid, booted.boot)  # the same process, the same boot: its memory came

    asked = len(proxy.paths)
    started = time.perf_counter()
    answer = http_get(fleet.open_to(vm.name, ("127.0.0.1", vm.forwards.ssh), timeout=30), "/cgi-bin/proxy?from-b")
    proxied = time.perf_counter() - started
    assert "hello-from-proxy" in answer, answer
    assert proxy.paths[asked:] == ["/from-b"]
    _, headers = proxy.heads[asked]
    assert ("Proxy-Authorization", f"Basic {CREDENTIAL.basic()}") in headers  # the relay kept its identity
    print(f"\nrestore on b {restored:.2f} s; first counter through the tunnel {observed:.2f} s; a guest request "
          f"to the proxy on a and back {proxied:.2f} s")


def test_when_bs_sshd_stops_b_counts_as_gone_and_the_computer_resumes_on_a(remote: Remote) -> None:
    manager, fleet = remote.manager, remote.fleet
    vm = manager.get(USER)
    assert fleet.home(vm.name) == "b", "runs after the test that moves the computer to b"
    serial = Serial(vm.serial_log)
    manager.suspend(USER)  # b's libvirt still answers: the memory goes to the shared directory
    last = serial.last_count()
    remote.sshd_b.stop()
    wait_until(lambda: not remote.tunnel.connected(), 30, "the tunnel to b to drop")
    assert [(h.name, h.reachable) for h in fleet.loads()] == [("a", True), ("b", False)]

    fleet.mark("a", HostMark.UP)
    manager.ensure_running(USER)
    assert fleet.home(vm.name) == "a" and remote.a.state(vm.name) is DomainState.RUNNING
    after = serial.next_count(timeout=60)
    assert (after.pid, after.boot) == (last.pid, last.boot) and after.n > last.n
    manager.destroy(USER)


def _after(count: Count, last: Count) -> Count | None:
    return count if count.n > last.n else None


NET_USER = "netbob"
NET_PREFIX = f"wkn{os.getpid() % 10000}-"


@dataclass
class Netted:
    fleet: HostFleet
    manager: VmManager
    shop: ShopEgress
    network: str
    host: str
    """The network's host address on b (and `proxy_bridge_listen`'s)."""
    netns: str


@pytest.fixture(scope="module")
def netted(remote: Remote, tiny_guest: TinyGuest, accel: AccelChoice,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Netted]:
    daemon_b = remote.daemon_b
    with isolated_network_in(daemon_b, "wkn-") as (network, host), \
            Sshd(tmp_path_factory.mktemp("sshd-b-netted"), forwarding="yes", gateway_ports="clientspecified",
                 netns=daemon_b.netns) as sshd:
        b = {"name": "b", "uri": daemon_b.uri, "memory_mib": 100_000, "ssh": f"root@127.0.0.1:{sshd.port}",
             "ssh_host_key": sshd.host_public_key, "ssh_key": str(sshd.client_key),
             "ssh_proxy_command": f"nsenter --net={daemon_b.netns} /bin/busybox nc %h %p"}
        with shop_egress(tmp_path_factory.mktemp("egress-netted"), user=NET_USER, network=(network, host),
                         computer_hosts=[b], computer_shared_dir=tmp_path_factory.mktemp("shared-netted")) as shop:
            settings = shop.settings
            assert settings.proxy_relay_socket is not None
            wait_until(settings.proxy_relay_socket.exists, 30, "wakeful proxy to listen on its relay socket")
            tunnels: list[HostTunnel] = []

            def link(host: ComputerHost) -> HostLink:
                tunnel = default_link(settings)(host)  # what the server makes: kept here to be closed
                assert isinstance(tunnel, HostTunnel)
                tunnels.append(tunnel)
                return tunnel

            fleet = hypervisor_for(settings, LibvirtHypervisor, link)
            assert isinstance(fleet, HostFleet) and settings.computer_shared_dir is not None
            manager = VmManager(VmSettings(
                data_dir=settings.computer_shared_dir, base_image=tiny_guest.base, kernel=tiny_guest.kernel,
                initrd=tiny_guest.initrd, cmdline="panic=-1", accel=accel.accel,
                size=VmSize(memory_mib=256, vcpus=1, disk_gib=1), proxy_port=settings.proxy_port,
                domain_prefix=NET_PREFIX, **network_settings(settings, fleet)), fleet, clock=FakeClock())
            try:
                yield Netted(fleet=fleet, manager=manager, shop=shop, network=network, host=host,
                             netns=daemon_b.netns)
            finally:
                for vm in manager.vms():
                    try:
                        manager.destroy(vm.user)
                    except VmError:
                        pass
                for tunnel in tunnels:
                    tunnel.close()


def test_on_bs_isolated_network_a_computer_reaches_the_egress_proxy_known_by_its_address_alone(
        netted: Netted) -> None:
    manager, fleet, shop = netted.manager, netted.fleet, netted.shop
    started = time.perf_counter()
    vm = manager.provision(NET_USER, proxy_credential=shop.credential)
    assert vm.bridge is not None and vm.forwards.ssh is None and vm.bridge.network == netted.network
    serial = Serial(vm.serial_log)
    manager.ensure_running(NET_USER)
    assert fleet.home(vm.name) == "b"
    serial.next_count(timeout=180)
    booted = time.perf_counter() - started
    book = json.loads(shop.settings.address_book.read_text())["addresses"]
    assert book == {vm.bridge.address: {"user_id": shop.credential.user_id, "token": shop.credential.token}}

    # The guest's port 22 at its address on b's network: only b reaches it, through the tunnel.
    started = time.perf_counter()
    answer = http_get(fleet.open_to(vm.name, vm.ssh_endpoint, timeout=30), f"/cgi-bin/proxy?{shop.shop.url}")
    proxied = time.perf_counter() - started
    assert "<title>Shop</title>" in answer, answer
    assert [(r.user_id, r.client_token, r.host, r.path) for r in shop.asked] == [
        (shop.credential.user_id, shop.credential.token, "shop.test", "/")], "known by its address alone"
    assert [r.proxy_auth for r in shop.shop.requests] == [None]

    # b itself, from its own address on the network: in no book, so anonymous, and refused.
    asked = f"printf 'GET {shop.shop.url}from-b HTTP/1.0\\r\\n\\r\\n' | /bin/busybox nc -w 10 {netted.host} 3128"
    refused = subprocess.run(["nsenter", f"--net={netted.netns}", "/bin/busybox", "sh", "-c", asked],
                             capture_output=True, text=True, timeout=60).stdout
    assert refused.startswith("HTTP/1.1 403") and "not_admitted" in refused, refused
    assert [(r.user_id, r.client_token, r.path) for r in shop.asked[1:]] == [(None, None, "/from-b")]
    assert shop.shop.count("GET", "/from-b") == 0

    # Saved and restored on b: the same address, the same identity, through a tunnel that stayed up.
    last = serial.last_count()
    manager.suspend(NET_USER)
    manager.ensure_running(NET_USER)
    assert fleet.home(vm.name) == "b"
    after = serial.next_count(timeout=60)
    assert (after.pid, after.boot) == (last.pid, last.boot) and after.n > last.n
    answer = http_get(fleet.open_to(vm.name, vm.ssh_endpoint, timeout=30), f"/cgi-bin/proxy?{shop.shop.url}again")
    assert [(r.user_id, r.path) for r in shop.asked[2:]] == [(shop.credential.user_id, "/again")], answer
    manager.destroy(NET_USER)
    print(f"\non b's isolated network: provision and cold boot {booted:.2f} s; a guest request through the tunnel "
          f"to the proxy's relay socket and back {proxied:.2f} s")
