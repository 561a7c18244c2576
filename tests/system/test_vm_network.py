"""The isolated network of infra/README.md on the real libvirtd: defined exactly as the doc shows, and a tool
computer's domain on it accepted by the real QEMU driver with its anti-spoofing filter named for the binding made
before it runs. Neither is started here; test_vm_network_restore.py starts both (a network of its own, nothing
leaves the host) and proves spoofing is blocked across restores.
"""

from __future__ import annotations

import re
import subprocess
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from wakeful.vm.domain_xml import ANTI_SPOOFING, FilterBinding, filter_binding_of, tap_name
from wakeful.vm.errors import NetworkUnusable
from wakeful.vm.hypervisor import Accel, BridgePlace, DomainSpec, Forwards
from wakeful.vm.libvirt_adapter import LibvirtHypervisor

pytestmark = pytest.mark.vm

ROOT = Path(__file__).resolve().parents[2]
URI = "qemu:///system"


def virsh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["virsh", "-c", URI, *args], capture_output=True, text=True, timeout=60, check=False)


def documented_network() -> str:
    """The network XML infra/README.md tells a production host to define (its only ```xml block)."""
    (block,) = re.findall(r"```xml\n(.*?)```", (ROOT / "infra" / "README.md").read_text(), re.DOTALL)
    return block


def spec_on(place: BridgePlace, tmp_path: Path) -> DomainSpec:
    """A domain on the network `place` names, its files placeholders: defined, never booted."""
    for name in ("vmlinux", "initrd.img", "disk.qcow2", "seed.img"):
        (tmp_path / name).write_bytes(b"x")
    return DomainSpec(name=f"wkt-{uuid.uuid4().hex[:8]}", accel=Accel.TCG, memory_mib=512, vcpus=1,
                      kernel=tmp_path / "vmlinux", initrd=tmp_path / "initrd.img", cmdline="root=/dev/vda",
                      disk=tmp_path / "disk.qcow2", seed=tmp_path / "seed.img", serial_log=tmp_path / "serial.log",
                      forwards=Forwards(ssh=None), bridge=place)


@pytest.fixture
def network(libvirtd: None, tmp_path: Path) -> Iterator[str]:
    """The documented network, renamed for this test (bridge name too), defined but never started."""
    tag = uuid.uuid4().hex[:6]
    name = f"wkt-net-{tag}"
    xml = documented_network().replace("<name>wakeful</name>", f"<name>{name}</name>").replace(
        'name="wkbr0"', f'name="wkt{tag}"')
    (tmp_path / "net.xml").write_text(xml)
    defined = virsh("net-define", str(tmp_path / "net.xml"))
    assert defined.returncode == 0, defined.stderr
    yield name
    virsh("net-undefine", name)


def test_the_documented_network_defines_isolated_and_is_refused_until_started(network: str) -> None:
    root = ET.fromstring(virsh("net-dumpxml", "--inactive", network).stdout)
    assert root.find("forward") is None, "isolated: no route beyond the host"
    assert root.find("ip/dhcp/range") is None, "no dynamic range: only reserved VMs get an address"
    with pytest.raises(NetworkUnusable, match=f"not active: virsh net-start {network}"):
        LibvirtHypervisor(URI).network(network)


def test_the_real_qemu_driver_takes_a_tool_computer_on_it_with_its_anti_spoofing_binding(
        network: str, tmp_path: Path) -> None:
    filters = virsh("nwfilter-list").stdout
    assert re.search(rf"\s{ANTI_SPOOFING}\s*$", filters, re.MULTILINE), (
        "libvirt's stock filters are missing: apt-get install libvirt-daemon-config-nwfilter, restart libvirtd")
    place = BridgePlace(network=network, mac="52:54:00:12:34:56", address="10.77.0.2")
    spec = spec_on(place, tmp_path)
    hv = LibvirtHypervisor(URI)
    hv.define(spec)
    try:
        root = ET.fromstring(virsh("dumpxml", "--inactive", spec.name).stdout)
        (nic,) = root.findall("devices/interface")
        assert nic.get("type") == "network" and nic.find("source").get("network") == network  # type: ignore[union-attr]
        assert nic.find("mac").get("address") == place.mac  # type: ignore[union-attr]
        assert nic.find("target").get("dev") == tap_name(spec.name)  # type: ignore[union-attr]
        assert nic.find("filterref") is None, "the filter is a binding made at each start, not rebuilt by libvirt"
        assert filter_binding_of(ET.tostring(root, encoding="unicode")) == FilterBinding(
            portdev=tap_name(spec.name), mac=place.mac, address=place.address, filter=ANTI_SPOOFING), (
            "the real driver keeps the binding wakeful makes before the VM runs (see test_vm_network_restore.py)")
        assert "hostfwd" not in ET.tostring(root, encoding="unicode"), "no host port is forwarded"
    finally:
        hv.undefine(spec.name)


@pytest.mark.parametrize("how", ["missing", "not started"])
def test_a_domain_on_a_network_this_host_lacks_or_has_not_started_does_not_start_and_says_it_is_unusable(
        how: str, network: str, tmp_path: Path) -> None:
    """What lets a fleet pass over such a host for the next one (`HostFleet`): libvirt refuses before QEMU runs."""
    name = f"wkt-gone-{uuid.uuid4().hex[:6]}" if how == "missing" else network  # `network` is defined, not started
    spec = spec_on(BridgePlace(network=name, mac="52:54:00:12:34:57", address="10.77.0.3"), tmp_path)
    hv = LibvirtHypervisor(URI)
    hv.define(spec)
    try:
        with pytest.raises(NetworkUnusable, match=f"no network with matching name '{name}'" if how == "missing"
                           else f"network '{name}' is not active"):
            hv.start(spec.name)
        assert virsh("domstate", spec.name).stdout.strip() == "shut off"
    finally:
        hv.undefine(spec.name)
