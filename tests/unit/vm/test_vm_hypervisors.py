"""One contract, two implementations: the in-memory fake and the libvirt adapter on the `test:///default` driver.

The test driver has only internal snapshots, so disk snapshots are covered by the fake here and by the system
tests on real libvirt.
"""

from __future__ import annotations

import ipaddress
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import libvirt  # noqa: TID251 - the tests define the networks the adapter only reads (an infra step)
import pytest

from tests.support.polling import wait_until
from wakeful.vm.domain_xml import FilterBinding, filter_binding_of, tap_name
from wakeful.vm.errors import IllegalTransition, ImageMissing, NetworkUnusable, SnapshotNotFound, VmNotFound
from wakeful.vm.fake import FakeHypervisor
from wakeful.vm.hypervisor import Accel, BridgePlace, DomainSpec, DomainState, Forwards, Hypervisor
from wakeful.vm.libvirt_adapter import LibvirtHypervisor


@pytest.fixture(params=["fake", "test:///default"])
def hv(request: pytest.FixtureRequest) -> Iterator[Hypervisor]:
    if request.param == "fake":
        yield FakeHypervisor()
        return
    adapter = LibvirtHypervisor("test:///default")
    before = set(adapter.names())
    yield adapter
    for name in set(adapter.names()) - before:
        adapter.undefine(name)


@pytest.fixture
def spec(tmp_path: Path) -> DomainSpec:
    for name in ("vmlinux", "initrd", "disk.qcow2", "seed.img"):
        (tmp_path / name).write_bytes(b"x")
    return DomainSpec(name=f"wkt-{uuid.uuid4().hex[:8]}", accel=Accel.TCG, memory_mib=512, vcpus=1,
                      kernel=tmp_path / "vmlinux", initrd=tmp_path / "initrd", cmdline="root=/dev/vda",
                      disk=tmp_path / "disk.qcow2", seed=tmp_path / "seed.img", serial_log=tmp_path / "serial.log",
                      forwards=Forwards(ssh=20000, proxy=3129))


def test_a_defined_domain_is_shut_off_with_nothing_saved_and_no_memory(hv: Hypervisor, spec: DomainSpec) -> None:
    hv.define(spec)
    assert spec.name in hv.names()
    assert hv.state(spec.name) is DomainState.SHUT_OFF
    assert not hv.has_saved_state(spec.name)
    assert hv.memory_bytes(spec.name) == 0


def test_managed_save_frees_memory_and_restore_brings_it_back(hv: Hypervisor, spec: DomainSpec) -> None:
    hv.define(spec)
    hv.start(spec.name)
    assert hv.state(spec.name) is DomainState.RUNNING and hv.memory_bytes(spec.name) > 0
    hv.suspend_to_disk(spec.name)
    assert hv.state(spec.name) is DomainState.SHUT_OFF and hv.has_saved_state(spec.name)
    assert hv.memory_bytes(spec.name) == 0
    hv.restore(spec.name)
    assert hv.state(spec.name) is DomainState.RUNNING and not hv.has_saved_state(spec.name)


def test_a_restore_holds_a_second_name_of_the_saved_file_until_it_returned_and_then_drops_it(
        spec: DomainSpec, tmp_path: Path) -> None:
    # libvirt unlinks the managed-save file before its start call returns; with a second name that unlink frees
    # nothing, and the file goes when the second name is dropped, after the restore. (The test driver keeps no file:
    # one stands in for it here, and it outlives the restore since only libvirt's own unlink would remove it.)
    saves = tmp_path / "save"
    saves.mkdir()
    hv = LibvirtHypervisor("test:///default", save_dir=saves)
    hv.define(spec)
    try:
        hv.start(spec.name)
        hv.suspend_to_disk(spec.name)
        saved = saves / f"{spec.name}.save"
        saved.write_bytes(b"memory")
        (saves / f".{spec.name}.save.restored").write_bytes(b"left by a crash")
        seen: list[int] = []
        create = libvirt.virDomain.createWithFlags

        def create_and_count(dom: libvirt.virDomain, flags: int = 0) -> int:
            seen.append(saved.stat().st_nlink)
            return create(dom, flags)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(libvirt.virDomain, "createWithFlags", create_and_count)
            hv.restore(spec.name)
        assert seen == [2], "libvirt started from a file with a second name"
        assert hv.state(spec.name) is DomainState.RUNNING
        wait_until(lambda: not (saves / f".{spec.name}.save.restored").exists(), 10, "the second name to go")
        assert saved.read_bytes() == b"memory" and saved.stat().st_nlink == 1
    finally:
        hv.undefine(spec.name)


def test_start_never_silently_replaces_a_saved_state(hv: Hypervisor, spec: DomainSpec) -> None:
    hv.define(spec)
    hv.start(spec.name)
    hv.suspend_to_disk(spec.name)
    with pytest.raises(IllegalTransition, match="saved state"):
        hv.start(spec.name)
    hv.discard_saved_state(spec.name)
    hv.start(spec.name)
    assert hv.state(spec.name) is DomainState.RUNNING


def test_restore_without_a_saved_state_is_refused(hv: Hypervisor, spec: DomainSpec) -> None:
    hv.define(spec)
    with pytest.raises(IllegalTransition, match="no saved state"):
        hv.restore(spec.name)


def test_pause_holds_memory_and_resume_continues(hv: Hypervisor, spec: DomainSpec) -> None:
    hv.define(spec)
    hv.start(spec.name)
    hv.pause(spec.name)
    assert hv.state(spec.name) is DomainState.PAUSED and hv.memory_bytes(spec.name) > 0
    hv.resume(spec.name)
    assert hv.state(spec.name) is DomainState.RUNNING


def test_destroy_is_a_no_op_when_stopped_and_undefine_forgets_everything(hv: Hypervisor, spec: DomainSpec) -> None:
    hv.define(spec)
    hv.destroy(spec.name)
    hv.start(spec.name)
    hv.suspend_to_disk(spec.name)
    hv.undefine(spec.name)
    assert spec.name not in hv.names()
    with pytest.raises(VmNotFound) as caught:
        hv.state(spec.name)
    assert caught.value.code == "vm_not_found"


def test_a_running_domain_cannot_be_redefined(hv: Hypervisor, spec: DomainSpec) -> None:
    hv.define(spec)
    hv.start(spec.name)
    with pytest.raises(IllegalTransition):
        hv.define(spec)


def test_a_missing_kernel_is_image_missing(hv: Hypervisor, spec: DomainSpec) -> None:
    spec.kernel.unlink()
    with pytest.raises(ImageMissing) as caught:
        hv.define(spec)
    assert caught.value.code == "image_missing" and str(spec.kernel) in caught.value.message


def test_unknown_snapshot_is_snapshot_not_found(hv: Hypervisor, spec: DomainSpec) -> None:
    hv.define(spec)
    with pytest.raises(SnapshotNotFound):
        hv.snapshot_revert(spec.name, "nope")
    assert hv.snapshots(spec.name) == []


def test_the_libvirt_adapter_names_the_remedy_when_libvirt_is_unreachable() -> None:
    from wakeful.vm.errors import HypervisorUnavailable

    with pytest.raises(HypervisorUnavailable, match="scripts/libvirtd") as caught:
        LibvirtHypervisor("qemu+unix:///system?socket=/nonexistent/sock").names()
    assert caught.value.code == "hypervisor_unavailable"


# ---------------------------------------------------------------------------------------------- fake snapshots

def test_fake_snapshots_stack_overlays_and_revert_drops_the_layers_above(spec: DomainSpec) -> None:
    hv = FakeHypervisor()
    hv.define(spec)
    hv.start(spec.name)
    s1 = hv.snapshot_create(spec.name, "s1", spec.disk.with_name("s1.qcow2"))
    s2 = hv.snapshot_create(spec.name, "s2", spec.disk.with_name("s2.qcow2"))
    assert (s1.frozen, s2.frozen) == (spec.disk, s1.overlay)
    assert hv.top_layer(spec.name) == s2.overlay
    hv.snapshot_revert(spec.name, "s1")
    assert hv.state(spec.name) is DomainState.SHUT_OFF
    assert [s.name for s in hv.snapshots(spec.name)] == ["s1"]
    assert hv.top_layer(spec.name) == s1.overlay and s1.overlay.exists() and not s2.overlay.exists()


def test_fake_snapshot_delete_merges_and_keeps_later_snapshots_consistent(spec: DomainSpec) -> None:
    hv = FakeHypervisor()
    hv.define(spec)
    s1 = hv.snapshot_create(spec.name, "s1", spec.disk.with_name("s1.qcow2"))
    hv.snapshot_create(spec.name, "s2", spec.disk.with_name("s2.qcow2"))
    hv.snapshot_delete(spec.name, "s1")
    assert not s1.overlay.exists()
    (only,) = hv.snapshots(spec.name)
    assert only.name == "s2" and only.frozen == spec.disk


def test_fake_refuses_snapshots_of_a_suspended_domain(spec: DomainSpec) -> None:
    hv = FakeHypervisor()
    hv.define(spec)
    hv.start(spec.name)
    hv.suspend_to_disk(spec.name)
    with pytest.raises(IllegalTransition, match="restore it"):
        hv.snapshot_create(spec.name, "s1", spec.disk.with_name("s1.qcow2"))


def test_fake_failures_can_be_injected_once(spec: DomainSpec) -> None:
    from wakeful.vm.errors import VmDead

    hv = FakeHypervisor()
    hv.define(spec)
    hv.fail_next("start", VmDead("qemu died"))
    with pytest.raises(VmDead):
        hv.start(spec.name)
    assert hv.state(spec.name) is DomainState.SHUT_OFF
    hv.start(spec.name)
    assert hv.boots(spec.name) == 1


# -- the isolated network for production hosts ---------------------------------------------------------------------

ISOLATED_XML = """<network><name>{name}</name><bridge name="{bridge}" stp="off"/><mac address="52:54:00:AB:CD:01"/>
  <ip address="10.77.0.1" netmask="255.255.255.0"><dhcp/></ip></network>"""


@pytest.fixture
def isolated(hv: Hypervisor) -> Iterator[str]:
    """An isolated network (no <forward>) named for this test, defined and started; removed afterwards."""
    name = f"wkt-net-{uuid.uuid4().hex[:6]}"
    if isinstance(hv, FakeHypervisor):
        hv.networks[name] = ipaddress.IPv4Interface("10.77.0.1/24")
        hv.network_macs[name] = "52:54:00:ab:cd:01"
        yield name
        return
    assert isinstance(hv, LibvirtHypervisor)
    conn = libvirt.open(hv.uri)
    net = conn.networkDefineXML(ISOLATED_XML.format(name=name, bridge=f"wkt{uuid.uuid4().hex[:6]}"))
    net.create()
    yield name
    net.destroy()
    net.undefine()


def test_an_isolated_network_reports_the_hosts_address_and_its_reservations(hv: Hypervisor, isolated: str) -> None:
    info = hv.network(isolated)
    assert info.host == ipaddress.IPv4Interface("10.77.0.1/24") and info.reserved == frozenset()
    assert info.bridge_mac == "52:54:00:ab:cd:01"
    a = BridgePlace(network=isolated, mac="52:54:00:00:00:0a", address="10.77.0.10")
    b = BridgePlace(network=isolated, mac="52:54:00:00:00:0b", address="10.77.0.11")
    hv.reserve_address(a, host_name="wkt-a")
    hv.reserve_address(b, host_name="wkt-b")
    assert hv.network(isolated).reserved == {"10.77.0.10", "10.77.0.11"}
    hv.release_address(a)
    hv.release_address(a)  # releasing again is a no-op
    assert hv.network(isolated).reserved == {"10.77.0.11"}


def test_a_missing_network_is_unusable_and_says_so(hv: Hypervisor) -> None:
    with pytest.raises(NetworkUnusable, match="no network named wkt-nowhere|no libvirt network named wkt-nowhere"):
        hv.network("wkt-nowhere")


def test_a_nat_network_is_refused_for_tool_computers() -> None:
    adapter = LibvirtHypervisor("test:///default")  # its `default` network is libvirt's NAT, as on a stock host
    with pytest.raises(NetworkUnusable, match="forwards traffic.*nat.*isolated") as err:
        adapter.network("default")
    assert err.value.code == "network_unusable"


def test_an_inactive_network_is_refused_until_started() -> None:
    adapter = LibvirtHypervisor("test:///default")
    name = f"wkt-net-{uuid.uuid4().hex[:6]}"
    conn = libvirt.open(adapter.uri)
    net = conn.networkDefineXML(ISOLATED_XML.format(name=name, bridge=f"wkt{uuid.uuid4().hex[:6]}"))
    try:
        with pytest.raises(NetworkUnusable, match=f"not active: virsh net-start {name}"):
            adapter.network(name)
    finally:
        net.undefine()


def test_a_domain_on_the_isolated_network_defines_with_its_filtered_interface(
        hv: Hypervisor, isolated: str, spec: DomainSpec) -> None:
    place = BridgePlace(network=isolated, mac="52:54:00:00:00:0c", address="10.77.0.12")
    hv.define(replace(spec, forwards=Forwards(ssh=None), bridge=place))
    assert spec.name in hv.names()
    if isinstance(hv, LibvirtHypervisor):  # what libvirt itself kept of the definition
        root = ET.fromstring(libvirt.open(hv.uri).lookupByName(spec.name).XMLDesc(0))
        nic = root.find("devices/interface[@type='network']")
        assert nic is not None and nic.find("source").get("network") == isolated  # type: ignore[union-attr]
        assert nic.find("mac").get("address") == place.mac  # type: ignore[union-attr]
        assert nic.find("target").get("dev") == tap_name(spec.name), "the tap the binding is keyed on"  # type: ignore[union-attr]
        assert nic.find("filterref") is None, "no filter libvirt would build again at every start"
        assert filter_binding_of(ET.tostring(root, encoding="unicode")) == FilterBinding(
            portdev=tap_name(spec.name), mac=place.mac, address=place.address, filter="clean-traffic")
