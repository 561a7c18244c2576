"""A tool computer on the real guest image, on an isolated libvirt network of its own (started for this module and
removed after it; nothing on it leaves the host), behind the real egress proxy listening on the network's host address.

Saved and restored, the VM keeps its TCP connections: they live in the host's kernel and in the guest's saved memory,
not in the QEMU process. So the restore keeps the SSH transport and the DevTools connection through it (nothing is
reconnected), still resyncs the clock and still needs a fresh observation before any act. Timings are printed
(run with `-n 0 -s`), never asserted.

Across restores the guest cannot send from another address or MAC, nor claim another address in ARP: libvirt's
clean-traffic filter, a binding made once per VM while it is paused (see vm/libvirt_adapter.py), still holds on the
tap libvirt creates again at each restore; and a binding lost (as after a host reboot) is made again by the next
restore before the guest runs.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from computer_lab import URI, ComputerLab, isolated_network, tool_computer
from shop_lab import ShopEgress, shop_egress

from tests.support.polling import wait_until
from wakeful.vm.accel import choose_accel
from wakeful.vm.domain_xml import tap_name
from wakeful.vm.observe import Fill, Navigate, Refused
from wakeful.vm.toolcomputer import ActResult

if TYPE_CHECKING:
    from tests.system.conftest import GuestImageBuild

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]  # one cold boot under TCG: minutes

USER = "netshopper"


def _virsh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["virsh", "-c", URI, *args], capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def world(libvirtd: None, guest_image_build: GuestImageBuild, guest_image: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ComputerLab, ShopEgress]]:
    accel = choose_accel(guest_image / "vmlinux", data_dir=guest_image.parent.parent, timeout=10.0)
    with isolated_network("wkt-") as net, \
            shop_egress(tmp_path_factory.mktemp("egress"), user=USER, deployment=guest_image_build.data_dir,
                        network=(net.name, net.host)) as shop, \
            tool_computer(guest_image, tmp_path_factory.mktemp("vms"), user=USER, accel=accel,
                          proxy_port=shop.settings.proxy_port, credential=shop.credential, network=net,
                          address_book=shop.settings.address_book, port_range=(24300, 24499)) as lab:
        lab.boot()
        yield lab, shop


def test_a_restore_on_an_isolated_network_keeps_ssh_and_cdp_and_still_asks_for_a_fresh_observation(
        world: tuple[ComputerLab, ShopEgress]) -> None:
    lab, shop = world
    tc = lab.computer
    first = tc.observe()
    tc.act(Navigate(url=shop.shop.url, observation=first.observation.number))
    deadline = time.monotonic() + 300
    while (before := tc.observe()).title != "Shop" and time.monotonic() < deadline:
        pass
    assert before.title == "Shop", "the guest reached the shop through the proxy on the network's host address"
    assert shop.asked and all(r.user_id == shop.credential.user_id for r in shop.asked), (
        "the proxy knew the VM by its address")
    boot_id = lab.channel.run("cat /proc/sys/kernel/random/boot_id", timeout=60).stdout
    wait_until(lambda: lab.channel.keeping, 300, "the clock keeper an observation started to be ready")

    lab.manager.suspend(USER)
    t = time.perf_counter()
    lab.manager.ensure_running(USER)
    total = time.perf_counter() - t

    report = lab.restores[-1]
    timings = report.timings
    assert timings.kept, "the SSH transport outlived the save and restore"
    assert timings.ssh_reconnect == 0 and timings.cdp_reconnect == 0, "nothing was reconnected"
    assert report.clock_sync.applied, "the guest clock is set again after any restore"
    assert report.clock_sync.kept, "through the clock keeper that outlived the restore with SSH: no shell started"
    assert report.observation is not None and report.observation.title == "Shop"
    assert report.epoch > before.observation.epoch
    assert lab.channel.run("cat /proc/sys/kernel/random/boot_id", timeout=60).stdout == boot_id, "not rebooted"

    stale = tc.act(Fill(ref=before.ref_for("textbox", "Name"), text="Ada"))
    assert isinstance(stale, Refused) and stale.code == "stale_observation"
    filled = tc.act(Fill(ref=report.observation.ref_for("textbox", "Name"), text="Ada"))
    assert isinstance(filled, ActResult) and filled.outcome == "done", filled
    print(f"\nrestore to first observation {total:.2f} s: probe {timings.probe:.2f} s (kept), clock "
          f"{timings.clock:.2f} s, first observation {timings.first_observation or 0:.2f} s")


def test_restored_as_the_server_does_it_the_clock_is_set_beside_the_agents_first_observation(
        world: tuple[ComputerLab, ShopEgress]) -> None:
    # The server's hook only reconnects (here: keeps) and bumps the epoch; the agent's observe comes next, and the
    # clock resync runs beside it: that observe returns with the guest clock set again.
    lab, _ = world
    tc = lab.computer
    before = tc.observe()
    lab.observe_on_restore = False
    try:
        lab.manager.suspend(USER)
        t = time.perf_counter()
        lab.manager.ensure_running(USER)
        hook = time.perf_counter() - t
        report = lab.restores[-1]
        assert report.timings.kept and report.observation is None and report.clock_sync is None
        assert report.epoch > before.observation.epoch
        seen = tc.observe()
        total = time.perf_counter() - t
    finally:
        lab.observe_on_restore = True
    assert seen.observation.epoch == report.epoch and seen.title == "Shop"
    assert tc.clock_sync is not None and tc.clock_sync.applied, "observe waited for the resync beside it"
    assert abs(tc.clock_sync.after.total_seconds()) < 5, "the guest clock is the host's again"
    assert tc.clock_sync.kept, "through the clock keeper"
    filled = tc.act(Fill(ref=seen.ref_for("textbox", "Name"), text="Grace"))
    assert isinstance(filled, ActResult) and filled.outcome == "done", filled
    print(f"\nas the server does it: restore to first observation {total:.2f} s (the hook {hook:.2f} s, probe "
          f"{report.timings.probe:.2f} s; then observe with the clock beside it)")


PROBE = r"""
import socket, struct, subprocess, sys
host, port, real, spoof, real_mac, spoof_mac, host_mac = sys.argv[1:8]
mac = lambda m: bytes.fromhex(m.replace(":", ""))
ip4 = socket.inet_aton
def checksum(b):
    s = sum(struct.unpack("!10H", b))
    s = (s >> 16) + (s & 0xFFFF)
    return ~(s + (s >> 16)) & 0xFFFF
def udp_frame(src_mac, src, payload):
    udp = struct.pack("!HHHH", 40000, int(port), 8 + len(payload), 0) + payload
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0x4000, 64, 17, 0, ip4(src), ip4(host))
    hdr = hdr[:10] + struct.pack("!H", checksum(hdr)) + hdr[12:]
    return mac(host_mac) + mac(src_mac) + b"\x08\x00" + hdr + udp
def arp_request(src_mac, claimed):
    arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, mac(src_mac), ip4(claimed), b"\0" * 6, ip4(host))
    return b"\xff" * 6 + mac(src_mac) + b"\x08\x06" + arp
def send_from(src, payload):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((src, 0))
    s.sendto(payload, (host, int(port)))
raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
raw.bind(("eth0", 0))
send_from(real, b"socket-from-own-address")
raw.send(udp_frame(real_mac, real, b"raw-from-own-mac"))
subprocess.run(["ip", "addr", "add", spoof + "/32", "dev", "eth0"], check=True)
try:
    send_from(spoof, b"ip-spoofed")
finally:
    subprocess.run(["ip", "addr", "del", spoof + "/32", "dev", "eth0"], check=True)
raw.send(udp_frame(spoof_mac, real, b"mac-spoofed"))
raw.send(arp_request(real_mac, spoof))
print("sent")
"""
"""Run in the guest as root: UDP to the host from the VM's own address and MAC (through a socket, and as a raw
frame), then from another address (a socket bound to it), from another MAC (a raw frame), and an ARP request that
claims another address."""


def _probe(lab: ComputerLab, spoof: str) -> tuple[set[bytes], bool]:
    """What the host received of the probe on the network's host address (UDP payloads), and whether it learned a
    neighbour at `spoof` from the spoofed ARP request."""
    place = lab.vm.bridge
    assert place is not None
    root = ET.fromstring(_virsh("net-dumpxml", place.network).stdout)
    bridge, host = root.find("bridge").get("name", ""), root.find("ip").get("address", "")  # type: ignore[union-attr]
    host_mac = Path(f"/sys/class/net/{bridge}/address").read_text().strip()
    subprocess.run(["ip", "neigh", "flush", "to", spoof, "dev", bridge], check=False)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind((host, 0))
        sink.settimeout(3.0)
        args = [host, str(sink.getsockname()[1]), place.address, spoof, place.mac, "52:54:00:de:ad:01", host_mac]
        sent = lab.channel.run(["python3", "-c", PROBE, *args], timeout=120)
        assert sent.stdout.strip() == b"sent", sent
        got: set[bytes] = set()
        with contextlib.suppress(TimeoutError):
            while True:
                got.add(sink.recv(2048))
    learned = "lladdr" in subprocess.run(["ip", "neigh", "show", "to", spoof, "dev", bridge],
                                         capture_output=True, text=True, check=True).stdout
    return got, learned


def _binding(lab: ComputerLab) -> str:
    return _virsh("nwfilter-binding-dumpxml", tap_name(lab.vm.name)).stdout


def test_across_restores_the_guest_cannot_send_from_another_address_or_mac_and_a_lost_filter_is_made_again(
        world: tuple[ComputerLab, ShopEgress]) -> None:
    lab, _ = world
    place = lab.vm.bridge
    assert place is not None
    subnet = place.address.rsplit(".", 1)[0]
    lab.manager.suspend(USER)
    lab.manager.ensure_running(USER)
    assert "clean-traffic" in _binding(lab), "the binding made at the cold boot outlived the save and restore"
    own = {b"socket-from-own-address", b"raw-from-own-mac"}
    assert _probe(lab, f"{subnet}.201") == (own, False), "restored: only the VM's own address and MAC get through"

    # As after a host reboot: no binding. The probe sees spoofing then (so it would see it were the filter missing).
    assert _virsh("nwfilter-binding-delete", tap_name(lab.vm.name)).returncode == 0
    got, learned = _probe(lab, f"{subnet}.202")
    assert got == own | {b"ip-spoofed", b"mac-spoofed"} and learned, "without the filter, spoofing gets through"

    lab.manager.suspend(USER)
    lab.manager.ensure_running(USER)
    assert "clean-traffic" in _binding(lab) and place.address in _binding(lab), "the restore made the binding again"
    assert _probe(lab, f"{subnet}.203") == (own, False), "and it filters before anything else"
