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
(10.79.N.0/24) is defined from one XML, bridge MAC included, on a (in this machine's namespace, as
test_vm_network_restore.py does) and in b's namespace; a second sshd in b's has `GatewayPorts clientspecified`, and
the server's own wiring builds the rest from the settings (`hypervisor_for`, `network_settings`, the default link)
with the real `wakeful proxy` and decider (`shop_lab`). A computer on b takes its reserved address by DHCP; the api
reaches its port 22 at that address through the tunnel; its request to the proxy's address on b's network comes
through the tunnel to the proxy's relay socket, headed by the address b's sshd saw, and the proxy asks the decider
with that computer's identity from the address book. A request from b's own address on that network, which is in no
book, is anonymous and refused. Saved and restored on b, the computer is known by its address again. Another
computer boots on a, where the proxy knows it by its address on the bridge listener, moves to b (a full) and back
(b gone), and is known by the same address, with the same identity, on each; b's DHCP server offers it its reserved
address (not one b still leases to the computer before it: dnsmasq keeps a lease past its VM).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

import pytest
from conftest import URI
from second_libvirtd import SecondLibvirtd, shared_network, start_second_libvirtd
from shop_lab import ShopEgress, shop_egress
from tiny_guest import TinyGuest
from vm_lab import Count, Recorder, Serial

from tests.support.polling import wait_until
from tests.support.sshd import Sshd
from wakeful.proxy.clock import FakeClock
from wakeful.server.computers.pool import default_link, hypervisor_for, network_settings
from wakeful.server.settings import ComputerHost
from wakeful.vm.accel import AccelChoice
from wakeful.vm.domain_xml import tap_name
from wakeful.vm.errors import VmError
from wakeful.vm.host_tunnel import HostSsh, HostTunnel
from wakeful.vm.hosts import Host, HostFleet, HostLink
from wakeful.vm.hypervisor import DomainState, ProxyCredential
from wakeful.vm.libvirt_adapter import LibvirtHypervisor
from wakeful.vm.lifecycle import VmInfo, VmManager, VmSettings
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


def refused_here(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
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
    """The network's host address, on a and on b (and `proxy_bridge_listen`'s)."""
    uri_b: str
    netns: str


@pytest.fixture(scope="module")
def netted(remote: Remote, tiny_guest: TinyGuest, accel: AccelChoice,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Netted]:
    daemon_b = remote.daemon_b
    with shared_network(daemon_b, "wkn-", uri=URI) as (network, host), \
            Sshd(tmp_path_factory.mktemp("sshd-b-netted"), forwarding="yes", gateway_ports="clientspecified",
                 netns=daemon_b.netns) as sshd:
        a = {"name": "a", "uri": URI, "memory_mib": 100_000}
        b = {"name": "b", "uri": daemon_b.uri, "memory_mib": 100_000, "ssh": f"root@127.0.0.1:{sshd.port}",
             "ssh_host_key": sshd.host_public_key, "ssh_key": str(sshd.client_key),
             "ssh_proxy_command": f"nsenter --net={daemon_b.netns} /bin/busybox nc %h %p"}
        with shop_egress(tmp_path_factory.mktemp("egress-netted"), user=NET_USER, network=(network, host),
                         computer_hosts=[a, b], computer_shared_dir=tmp_path_factory.mktemp("shared-netted")) as shop:
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
                yield Netted(fleet=fleet, manager=manager, shop=shop, network=network, host=host, uri_b=daemon_b.uri,
                             netns=daemon_b.netns)
            finally:
                for mark in ("a", "b"):  # what a test marked gone still holds its domains and reservations
                    fleet.mark(mark, HostMark.UP)
                for vm in manager.vms():
                    try:
                        manager.destroy(vm.user)
                    except VmError:
                        pass
                for tunnel in tunnels:
                    tunnel.close()


def guest_get(fleet: HostFleet, vm: VmInfo, path: str) -> str:
    """GET `path` from the guest's port 22 at its address: through the tunnel on b, directly on a (the api's host,
    whose namespace has the network's bridge)."""
    channel = fleet.open_to(vm.name, vm.ssh_endpoint, timeout=30)
    return http_get(channel or socket.create_connection(vm.ssh_endpoint, timeout=30), path)


def anonymous_from_b(netted: Netted, path: str) -> str:
    """A request to the proxy's address on b's network from b's own address there, which is in no address book."""
    asked = f"printf 'GET {netted.shop.shop.url}{path} HTTP/1.0\\r\\n\\r\\n' | /bin/busybox nc -w 10 {netted.host} 3128"
    return subprocess.run(["nsenter", f"--net={netted.netns}", "/bin/busybox", "sh", "-c", asked],
                          capture_output=True, text=True, timeout=60).stdout


def reservations(uri: str, network: str) -> dict[str, str]:
    """The DHCP reservations (MAC → address) of the network on the libvirt at `uri`."""
    dumped = subprocess.run(["virsh", "-c", uri, "net-dumpxml", network], capture_output=True, text=True, timeout=60,
                            check=True).stdout
    return {h.get("mac", ""): h.get("ip", "") for h in ET.fromstring(dumped).iterfind("ip/dhcp/host")}


def leases(uri: str, network: str) -> dict[str, str]:
    """The network's DHCP leases (address → MAC) on the libvirt at `uri`."""
    listed = subprocess.run(["virsh", "-c", uri, "net-dhcp-leases", network], capture_output=True, text=True,
                            timeout=60, check=True).stdout
    return {address: mac for mac, address in re.findall(r"([0-9a-f:]{17})\s+ipv4\s+([0-9.]+)/", listed)}


def binding(uri: str, vm: VmInfo) -> str:
    """The anti-spoofing filter binding on the VM's tap on the libvirt at `uri` ("" when there is none)."""
    return subprocess.run(["virsh", "-c", uri, "nwfilter-binding-dumpxml", tap_name(vm.name)], capture_output=True,
                          text=True, timeout=60).stdout


def test_on_bs_isolated_network_a_computer_reaches_the_egress_proxy_known_by_its_address_alone(
        netted: Netted) -> None:
    manager, fleet, shop = netted.manager, netted.fleet, netted.shop
    fleet.mark("a", HostMark.FULL)  # the computer boots on b
    fleet.mark("b", HostMark.UP)
    asked_before = len(shop.asked)
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
    answer = guest_get(fleet, vm, f"/cgi-bin/proxy?{shop.shop.url}")
    proxied = time.perf_counter() - started
    assert "<title>Shop</title>" in answer, answer
    assert [(r.user_id, r.client_token, r.host, r.path) for r in shop.asked[asked_before:]] == [
        (shop.credential.user_id, shop.credential.token, "shop.test", "/")], "known by its address alone"
    assert shop.shop.requests[-1].proxy_auth is None

    # b itself, from its own address on the network: in no book, so anonymous, and refused.
    refused = anonymous_from_b(netted, "from-b")
    assert refused.startswith("HTTP/1.1 403") and "not_admitted" in refused, refused
    assert [(r.user_id, r.client_token, r.path) for r in shop.asked[asked_before + 1:]] == [(None, None, "/from-b")]
    assert shop.shop.count("GET", "/from-b") == 0

    # Saved and restored on b: the same address, the same identity, through a tunnel that stayed up.
    last = serial.last_count()
    manager.suspend(NET_USER)
    manager.ensure_running(NET_USER)
    assert fleet.home(vm.name) == "b"
    after = serial.next_count(timeout=60)
    assert (after.pid, after.boot) == (last.pid, last.boot) and after.n > last.n
    answer = guest_get(fleet, vm, f"/cgi-bin/proxy?{shop.shop.url}again")
    assert [(r.user_id, r.path) for r in shop.asked[asked_before + 2:]] == [(shop.credential.user_id, "/again")], answer
    manager.destroy(NET_USER)
    print(f"\non b's isolated network: provision and cold boot {booted:.2f} s; a guest request through the tunnel "
          f"to the proxy's relay socket and back {proxied:.2f} s")


MOVER = "netmover"


def moved(netted: Netted, vm: VmInfo, serial: Serial, booted: Count, *, marks: dict[str, HostMark], to: str) -> float:
    """Suspend the computer to the shared directory, mark the hosts, resume it: on `to`, the process that `booted`
    counted going on in the same boot. The seconds the resume took."""
    last = serial.last_count()
    netted.manager.suspend(vm.user)
    assert netted.fleet.saved_path(vm.name).exists()
    for host, mark in marks.items():
        netted.fleet.mark(host, mark)
    started = time.perf_counter()
    netted.manager.ensure_running(vm.user)
    took = time.perf_counter() - started
    assert netted.fleet.home(vm.name) == to
    after = serial.next_count(timeout=60)
    assert (after.pid, after.boot) == (booted.pid, booted.boot) and after.n > last.n, "the same process, same boot"
    return took


def test_a_computer_on_the_isolated_network_moves_from_the_apis_host_to_b_and_back_known_by_its_address(
        netted: Netted) -> None:
    manager, fleet, shop = netted.manager, netted.fleet, netted.shop
    user_id, token = shop.credential.user_id, shop.credential.token
    fleet.mark("a", HostMark.UP)
    fleet.mark("b", HostMark.FULL)  # the computer boots on a, the api's own host
    vm = manager.provision(MOVER, proxy_credential=shop.credential)
    place = vm.bridge
    assert place is not None and place.network == netted.network
    assert reservations(URI, netted.network)[place.mac] == place.address
    assert reservations(netted.uri_b, netted.network)[place.mac] == place.address, "reserved on b too"
    book = json.loads(shop.settings.address_book.read_text())["addresses"]
    assert book[place.address] == {"user_id": user_id, "token": token}
    assert leases(netted.uri_b, netted.network).get(place.address, place.mac) == place.mac, (
        "not an address b's DHCP server still leases to another computer (the last one on b left its lease there)")
    # As when b's network is defined again from an XML without its reservations: the move must make it again.
    entry = f"<host mac='{place.mac}'/>"  # infra/README's command
    subprocess.run(["virsh", "-c", netted.uri_b, "net-update", netted.network, "delete", "ip-dhcp-host", entry,
                    "--live", "--config"], check=True, capture_output=True, timeout=60)
    assert place.mac not in reservations(netted.uri_b, netted.network)
    serial = Serial(vm.serial_log)
    manager.ensure_running(MOVER)
    assert fleet.home(vm.name) == "a"
    booted = serial.next_count(timeout=180)

    # On a: the guest's address is on the bridge in this namespace, the proxy listens on the bridge's address.
    assert fleet.open_to(vm.name, vm.ssh_endpoint) is None
    assert f"WK-LEASE {place.address}" in guest_get(fleet, vm, "/cgi-bin/lease")
    asked = len(shop.asked)
    answer = guest_get(fleet, vm, f"/cgi-bin/proxy?{shop.shop.url}on-a")
    assert "<title>Not found</title>" in answer, answer
    assert [(r.user_id, r.client_token, r.path) for r in shop.asked[asked:]] == [(user_id, token, "/on-a")]

    # Saved to the shared directory, a full: it resumes on b, the same process, the same address.
    to_b = moved(netted, vm, serial, booted, marks={"a": HostMark.FULL, "b": HostMark.UP}, to="b")
    assert refused_here(22, place.address), "its address on a's bridge answers no more"
    assert reservations(netted.uri_b, netted.network)[place.mac] == place.address, "reserved on b again"
    assert f"WK-LEASE {place.address}" in guest_get(fleet, vm, "/cgi-bin/lease"), "b's DHCP knows it"
    assert "clean-traffic" in binding(netted.uri_b, vm) and place.address in binding(netted.uri_b, vm)
    assert place.address in binding(URI, vm), "a keeps its binding, inert without the tap, for a return"
    assert json.loads(shop.settings.address_book.read_text())["addresses"] == book
    asked = len(shop.asked)
    started = time.perf_counter()
    answer = guest_get(fleet, vm, f"/cgi-bin/proxy?{shop.shop.url}on-b")
    relayed = time.perf_counter() - started
    assert "<title>Not found</title>" in answer and shop.shop.count("GET", "/on-b") == 1, answer
    assert [(r.user_id, r.client_token, r.path) for r in shop.asked[asked:]] == [(user_id, token, "/on-b")], (
        "through the tunnel and the relay socket, known by the same address")
    refused = anonymous_from_b(netted, "not-in-the-book")
    assert refused.startswith("HTTP/1.1 403") and "not_admitted" in refused, refused
    assert [(r.user_id, r.path) for r in shop.asked[asked + 1:]] == [(None, "/not-in-the-book")]

    # Saved on b, b gone: back on a, known by its address again through the bridge listener.
    to_a = moved(netted, vm, serial, booted, marks={"b": HostMark.GONE, "a": HostMark.UP}, to="a")
    asked = len(shop.asked)
    answer = guest_get(fleet, vm, f"/cgi-bin/proxy?{shop.shop.url}back-on-a")
    assert "<title>Not found</title>" in answer, answer
    assert [(r.user_id, r.client_token, r.path) for r in shop.asked[asked:]] == [(user_id, token, "/back-on-a")]
    assert "clean-traffic" in binding(URI, vm) and place.address in binding(URI, vm), "filtered on a again"
    assert shop.shop.count("GET", "/not-in-the-book") == 0
    assert [r.proxy_auth for r in shop.shop.requests] == [None] * len(shop.shop.requests)
    fleet.mark("b", HostMark.UP)
    manager.destroy(MOVER)
    print(f"\non the isolated network: a → b restore {to_b:.2f} s, a guest request through the tunnel and relay "
          f"{relayed:.2f} s; b → a restore {to_a:.2f} s")
