"""The VM manager over the fake hypervisor and fake disks, with a fake clock: provisioning, the lifecycle,
activities and the idle reaper, snapshots, destroy, reload."""

from __future__ import annotations

import ipaddress
import json
import stat
import threading
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from tests.support.debugfs import debugfs
from wakeful.proxy.clock import FakeClock
from wakeful.vm.errors import IllegalTransition, ImageMissing, LimitExceeded, NetworkUnusable, VmDead, VmNotFound
from wakeful.vm.fake import FakeDisks, FakeHypervisor
from wakeful.vm.hypervisor import DomainState, ProxyCredential
from wakeful.vm.lifecycle import AfterRestore, VmInfo, VmManager, VmSettings
from wakeful.vm.lifecycle_rules import Limits, VmSize, VmState

IDLE = timedelta(minutes=10)


@pytest.fixture
def settings(tmp_path: Path, images: Path) -> VmSettings:  # `images`: the fake image files of conftest.py
    return VmSettings(data_dir=tmp_path / "data", base_image=images / "base.qcow2", kernel=images / "vmlinux",
                      initrd=images / "initrd.img", size=VmSize(memory_mib=1024, vcpus=1, disk_gib=4),
                      limits=Limits(max_memory_mib=2048, max_vcpus=2, max_disk_gib=8), port_range=(21000, 21099),
                      proxy_port=3129, idle_after=IDLE, domain_prefix="wkt-")


@pytest.fixture
def hv() -> FakeHypervisor:
    return FakeHypervisor()


@pytest.fixture
def events() -> list[AfterRestore]:
    return []


@pytest.fixture
def manager(settings: VmSettings, hv: FakeHypervisor, clock: FakeClock, events: list[AfterRestore]) -> VmManager:
    m = VmManager(settings, hv, clock=clock, disks=FakeDisks(), port_free=lambda port: True)
    m.add_after_restore_hook(events.append)
    return m


def test_provision_builds_overlay_keys_seed_and_a_defined_domain(manager: VmManager, hv: FakeHypervisor) -> None:
    vm = manager.provision("alice@example.com")
    assert vm.state is VmState.PROVISIONED
    assert vm.name.startswith("wkt-alice-example-com-") and vm.name in hv.names()
    assert stat.S_IMODE(vm.directory.stat().st_mode) == 0o700
    assert f"backing={manager.settings.base_image}" in vm.disk.read_text()
    assert f"size={4 * 1024**3}" in vm.disk.read_text()
    assert vm.seed.is_file() and vm.keys.host_public.startswith("ssh-ed25519 ")
    spec = hv.domains[vm.name].spec
    assert (spec.disk, spec.seed, spec.memory_mib, spec.forwards) == (vm.disk, vm.seed, 1024, vm.forwards)
    assert hv.domains[vm.name].state is DomainState.SHUT_OFF


def test_each_vm_gets_its_own_loopback_ports(manager: VmManager) -> None:
    a, b = manager.provision("a"), manager.provision("b")
    assert a.forwards.host_ports() == (21000, 21001)  # SSH, the side door: nothing leads to x11vnc or DevTools
    assert b.forwards.host_ports() == (21002, 21003)
    assert a.forwards.proxy == b.forwards.proxy == 3129


def test_a_vm_on_user_mode_networking_has_a_side_door_to_its_clock_keeper(manager: VmManager) -> None:
    vm = manager.provision("a")
    assert vm.forwards.keeper == 21001 and vm.forwards.cdp is None and vm.forwards.vnc is None
    assert vm.side_door is not None
    assert vm.side_door.host == ("127.0.0.1", 21001) and vm.side_door.listen == ("10.0.2.15", 9444)


def test_a_vm_recorded_before_the_side_door_loads_without_one_and_keeps_its_old_port_taken(
        settings: VmSettings, manager: VmManager, hv: FakeHypervisor, clock: FakeClock) -> None:
    vm = manager.provision("a")
    meta = json.loads((vm.directory / "vm.json").read_text())
    meta["forwards"] = {"ssh": 21000, "cdp": 21001, "vnc": 21002, "proxy": 3129}  # as written before it
    (vm.directory / "vm.json").write_text(json.dumps(meta))
    again = VmManager(settings, hv, clock=clock, disks=FakeDisks(), port_free=lambda port: True)
    old = again.get("a")
    assert old.forwards.keeper is None and old.side_door is None and old.forwards.cdp == 21001
    assert old.forwards.vnc == 21002
    assert again.provision("b").forwards.host_ports() == (21003, 21004)


def test_ports_in_use_on_the_host_are_skipped(settings: VmSettings, hv: FakeHypervisor, clock: FakeClock) -> None:
    m = VmManager(settings, hv, clock=clock, disks=FakeDisks(), port_free=lambda port: port % 2 == 1)
    assert m.provision("a").forwards.host_ports() == (21001, 21003)


def test_provision_over_the_limit_is_refused_before_anything_is_created(manager: VmManager,
                                                                         hv: FakeHypervisor) -> None:
    with pytest.raises(LimitExceeded, match="RAM 4096 MiB"):
        manager.provision("alice", VmSize(memory_mib=4096, vcpus=1, disk_gib=4))
    assert hv.names() == [] and manager.vms() == []
    assert not (manager.settings.data_dir / "vms").exists() or not any((manager.settings.data_dir / "vms").iterdir())


def test_a_disk_smaller_than_the_base_image_is_refused(manager: VmManager) -> None:
    (manager.settings.base_image).write_text(f"fake qcow2 size={6 * 1024**3}\n")
    with pytest.raises(LimitExceeded, match="base image is 6.0 GiB"):
        manager.provision("alice")


def test_a_missing_base_image_says_how_to_build_it(manager: VmManager) -> None:
    manager.settings.base_image.unlink()
    with pytest.raises(ImageMissing, match="wakeful image build"):
        manager.provision("alice")


def test_a_user_has_one_vm(manager: VmManager) -> None:
    manager.provision("alice")
    with pytest.raises(IllegalTransition, match="already has"):
        manager.provision("alice")


def test_a_failed_define_leaves_nothing_behind(manager: VmManager, hv: FakeHypervisor) -> None:
    hv.fail_next("define", VmDead("libvirt said no"))
    with pytest.raises(VmDead):
        manager.provision("alice")
    assert manager.vms() == [] and hv.names() == []
    assert list((manager.settings.data_dir / "vms").iterdir()) == []
    manager.provision("alice")  # and the ports and name are free again


def test_the_lifecycle_runs_provisioned_running_suspended_running_destroyed(
        manager: VmManager, hv: FakeHypervisor, events: list[AfterRestore]) -> None:
    vm = manager.provision("alice")
    assert manager.ensure_running("alice").state is VmState.RUNNING
    assert hv.memory_bytes(vm.name) > 0
    assert manager.suspend("alice").state is VmState.SUSPENDED
    assert manager.memory_bytes("alice") == 0 and hv.has_saved_state(vm.name)
    assert manager.ensure_running("alice").state is VmState.RUNNING
    assert hv.boots(vm.name) == 1, "restored in place, not booted again"
    assert [(e.vm.name, e.cold_boot) for e in events] == [(vm.name, True), (vm.name, False)]
    manager.destroy("alice")
    assert hv.names() == [] and not vm.directory.exists()
    with pytest.raises(VmNotFound):
        manager.get("alice")


def test_illegal_steps_are_refused(manager: VmManager) -> None:
    manager.provision("alice")
    with pytest.raises(IllegalTransition):
        manager.suspend("alice")
    manager.ensure_running("alice")
    with pytest.raises(IllegalTransition):
        manager.start("alice")
    manager.suspend("alice")
    with pytest.raises(IllegalTransition):
        manager.suspend("alice")


def test_ensure_running_on_a_running_vm_runs_no_hooks(manager: VmManager, events: list[AfterRestore]) -> None:
    manager.provision("alice")
    manager.ensure_running("alice")
    manager.ensure_running("alice")
    assert len(events) == 1


def test_a_vm_that_died_is_booted_again_on_demand(manager: VmManager, hv: FakeHypervisor,
                                                  events: list[AfterRestore]) -> None:
    vm = manager.provision("alice")
    manager.ensure_running("alice")
    hv.destroy(vm.name)  # QEMU died behind our back
    assert manager.ensure_running("alice").state is VmState.RUNNING
    assert [e.cold_boot for e in events] == [True, True]


def test_a_failed_restore_leaves_the_vm_suspended(manager: VmManager, hv: FakeHypervisor) -> None:
    manager.provision("alice")
    manager.ensure_running("alice")
    manager.suspend("alice")
    hv.fail_next("restore", VmDead("save image unreadable"))
    with pytest.raises(VmDead):
        manager.ensure_running("alice")
    assert manager.get("alice").state is VmState.SUSPENDED


def test_an_activity_restores_a_suspended_vm_first(manager: VmManager, events: list[AfterRestore]) -> None:
    manager.provision("alice")
    with manager.activity("alice", "observe") as vm:
        assert vm.state is VmState.RUNNING
    manager.suspend("alice")
    with manager.activity("alice", "act"):
        assert events[-1].cold_boot is False


def test_an_unknown_activity_kind_is_refused(manager: VmManager) -> None:
    manager.provision("alice")
    with pytest.raises(ValueError), manager.activity("alice", "sleep"):
        pass
    assert manager.get("alice").state is VmState.PROVISIONED


def test_the_reaper_suspends_only_after_the_last_activity_ended_idle_after_ago(
        manager: VmManager, clock: FakeClock) -> None:
    manager.provision("alice")
    with manager.activity("alice", "live_view"):
        clock.advance(timedelta(hours=5))
        assert manager.reap() == []  # a five-hour live view is not idle
    clock.advance(IDLE)
    assert manager.reap() == []
    clock.advance(timedelta(seconds=1))
    assert manager.reap() == ["alice"]
    assert manager.get("alice").state is VmState.SUSPENDED
    assert manager.reap() == []


def test_a_freshly_restored_vm_is_not_reaped_at_once(manager: VmManager, clock: FakeClock) -> None:
    manager.provision("alice")
    manager.ensure_running("alice")
    clock.advance(IDLE * 3)
    assert manager.reap() == ["alice"]
    manager.ensure_running("alice")
    assert manager.reap() == []


def test_the_reaper_leaves_a_vm_alone_while_another_thread_holds_it(manager: VmManager, clock: FakeClock) -> None:
    manager.provision("alice")
    manager.ensure_running("alice")
    clock.advance(IDLE * 2)
    entered, release = threading.Event(), threading.Event()
    record_lock = manager._record("alice").lock  # the lock an activity holds while it restores the VM
    holder = threading.Thread(target=lambda: (record_lock.acquire(), entered.set(), release.wait(5),
                                              record_lock.release()))
    holder.start()
    assert entered.wait(5)
    try:
        assert manager.reap() == []
    finally:
        release.set()
        holder.join(5)
    assert manager.reap() == ["alice"]


def test_several_activities_overlap_and_the_last_one_to_end_counts(manager: VmManager, clock: FakeClock) -> None:
    manager.provision("alice")
    with manager.activity("alice", "handoff"):
        with manager.activity("alice", "observe"):
            pass
        clock.advance(IDLE * 2)
        assert manager.reap() == []
    clock.advance(IDLE / 2)
    assert manager.reap() == []


def test_a_hook_failure_reaches_the_caller_and_the_vm_stays_running(manager: VmManager) -> None:
    def broken(_: AfterRestore) -> None:
        raise VmDead("ssh did not come back")

    manager.add_after_restore_hook(broken)
    manager.provision("alice")
    with pytest.raises(VmDead, match="ssh"):
        manager.ensure_running("alice")
    assert manager.get("alice").state is VmState.RUNNING


def test_before_suspend_hooks_run_on_the_running_vm_and_one_that_fails_does_not_stop_the_suspend(
        manager: VmManager, hv: FakeHypervisor) -> None:
    seen: list[DomainState] = []

    def shed(vm: VmInfo) -> None:
        seen.append(hv.state(vm.name))

    def broken(_: VmInfo) -> None:
        raise VmDead("the guest did not answer")

    manager.add_before_suspend_hook(broken)
    manager.add_before_suspend_hook(shed)
    manager.provision("alice")
    manager.ensure_running("alice")
    assert manager.suspend("alice").state is VmState.SUSPENDED
    assert seen == [DomainState.RUNNING]
    with pytest.raises(IllegalTransition):
        manager.suspend("alice")  # nothing to suspend: the hooks are not asked either
    assert seen == [DomainState.RUNNING]


def test_snapshot_revert_rolls_back_the_disk_and_the_next_start_is_a_cold_boot(
        manager: VmManager, hv: FakeHypervisor, events: list[AfterRestore]) -> None:
    vm = manager.provision("alice")
    manager.ensure_running("alice")
    snap = manager.snapshot("alice", "before-pay")
    assert snap.frozen == vm.disk and snap.overlay.parent == vm.directory / "snapshots"
    manager.snapshot("alice", "after-pay")
    assert manager.revert("alice", "before-pay").state is VmState.PROVISIONED
    assert [s.name for s in manager.snapshots("alice")] == ["before-pay"]
    assert hv.top_layer(vm.name) == snap.overlay
    manager.ensure_running("alice")
    assert events[-1].cold_boot is True and hv.boots(vm.name) == 2
    manager.delete_snapshot("alice", "before-pay")
    assert manager.snapshots("alice") == [] and not snap.overlay.exists()


def test_no_snapshot_of_a_suspended_vm_and_labels_are_plain(manager: VmManager) -> None:
    manager.provision("alice")
    manager.ensure_running("alice")
    with pytest.raises(Exception, match="label"):
        manager.snapshot("alice", "../../etc")
    manager.suspend("alice")
    with pytest.raises(IllegalTransition, match="suspended"):
        manager.snapshot("alice", "s1")


def test_stop_discards_the_saved_state(manager: VmManager, hv: FakeHypervisor) -> None:
    vm = manager.provision("alice")
    manager.ensure_running("alice")
    manager.suspend("alice")
    assert manager.stop("alice").state is VmState.PROVISIONED
    assert not hv.has_saved_state(vm.name)


def test_a_new_manager_finds_the_vms_and_their_state_from_the_hypervisor(
        settings: VmSettings, manager: VmManager, hv: FakeHypervisor, clock: FakeClock) -> None:
    a = manager.provision("a")
    manager.provision("b")
    manager.ensure_running("a")
    manager.provision("c")
    manager.ensure_running("c")
    manager.suspend("c")
    again = VmManager(settings, hv, clock=clock, disks=FakeDisks(), port_free=lambda port: True)
    states = {vm.user: vm.state for vm in again.vms()}
    assert states == {"a": VmState.RUNNING, "b": VmState.PROVISIONED, "c": VmState.SUSPENDED}
    assert again.get("a").forwards == a.forwards and again.get("a").keys == a.keys
    assert json.loads((a.directory / "vm.json").read_text())["user"] == "a"
    assert again.provision("d").forwards.ssh == 21006, "ports held by known VMs stay taken"


def test_a_proxy_credential_reaches_the_domain_and_survives_a_new_manager_in_a_private_record(
        settings: VmSettings, manager: VmManager, hv: FakeHypervisor, clock: FakeClock) -> None:
    credential = ProxyCredential(user_id="usr_1", token="tok-secret")
    vm = manager.provision("alice", proxy_credential=credential)
    assert hv.domains[vm.name].spec.proxy_credential == credential
    record = vm.directory / "vm.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    again = VmManager(settings, hv, clock=clock, disks=FakeDisks(), port_free=lambda port: True)
    assert again.get("alice").proxy_credential == credential
    assert "tok-secret" not in repr(again.get("alice")), "the token is not printed with the VM"
    assert manager.provision("bob").proxy_credential is None


def test_one_vm_failing_to_suspend_does_not_spare_the_others(manager: VmManager, hv: FakeHypervisor,
                                                             clock: FakeClock) -> None:
    for user in ("a", "b"):
        manager.provision(user)
        manager.ensure_running(user)
    clock.advance(IDLE * 2)
    hv.fail_next("suspend_to_disk", VmDead("disk full"))
    with pytest.raises(VmDead, match="disk full"):
        manager.reap()
    assert {vm.user: vm.state for vm in manager.vms()} == {"a": VmState.RUNNING, "b": VmState.SUSPENDED}
    assert manager.reap() == ["a"]


# -- on an isolated network ----------------------------------------------------------------------------------------

@pytest.fixture
def on_network(settings: VmSettings, hv: FakeHypervisor, clock: FakeClock, tmp_path: Path) -> VmManager:
    hv.networks["wakeful"] = ipaddress.IPv4Interface("10.77.0.1/29")  # room for 5 guests
    hv.reservations["wakeful"] = {"52:54:00:99:99:99": "10.77.0.2"}  # someone else's reservation
    return VmManager(replace(settings, network="wakeful", network_proxy_port=3128,
                             address_book=tmp_path / "proxy" / "address-book.json"),
                     hv, clock=clock, disks=FakeDisks(), port_free=lambda port: True)


def _book(manager: VmManager) -> dict[str, dict[str, str]]:
    assert manager.settings.address_book is not None
    data = json.loads(manager.settings.address_book.read_text())
    assert data["version"] == 1
    return data["addresses"]


def test_on_a_network_each_vm_gets_a_reserved_address_and_no_host_port(on_network: VmManager,
                                                                        hv: FakeHypervisor) -> None:
    alice = on_network.provision("alice", proxy_credential=ProxyCredential(user_id="u_alice", token="tok-a"))
    bob = on_network.provision("bob", proxy_credential=ProxyCredential(user_id="u_bob", token="tok-b"))
    assert alice.bridge is not None and bob.bridge is not None
    assert (alice.bridge.address, bob.bridge.address) == ("10.77.0.3", "10.77.0.4"), "not the host's, not taken"
    assert alice.bridge.mac != bob.bridge.mac and alice.bridge.mac.startswith("52:54:00:")
    assert hv.reservations["wakeful"][alice.bridge.mac] == "10.77.0.3"
    assert alice.forwards.host_ports() == () and alice.ssh_endpoint == ("10.77.0.3", 22)
    assert hv.domains[alice.name].spec.bridge == alice.bridge
    seed = debugfs(alice.seed, "cat /proxy")
    assert seed == "http://10.77.0.1:3128\n", "the guest looks for the proxy at the network's host address"


def test_the_address_book_tells_the_proxy_who_each_address_is(on_network: VmManager) -> None:
    alice = on_network.provision("alice", proxy_credential=ProxyCredential(user_id="u_alice", token="tok-a"))
    on_network.provision("anon")  # no credential: the proxy cannot speak for it, so it is not in the book
    assert _book(on_network) == {"10.77.0.3": {"user_id": "u_alice", "token": "tok-a"}}
    book = on_network.settings.address_book
    assert book is not None and stat.S_IMODE(book.stat().st_mode) == 0o600
    on_network.destroy("alice")
    assert _book(on_network) == {}
    assert alice.bridge is not None and alice.bridge.mac not in on_network._hv.reservations["wakeful"]  # type: ignore[attr-defined]


def test_a_reload_keeps_each_vms_place_and_rewrites_the_book(on_network: VmManager, hv: FakeHypervisor,
                                                             clock: FakeClock) -> None:
    alice = on_network.provision("alice", proxy_credential=ProxyCredential(user_id="u_alice", token="tok-a"))
    assert on_network.settings.address_book is not None
    on_network.settings.address_book.unlink()
    again = VmManager(on_network.settings, hv, clock=clock, disks=FakeDisks(), port_free=lambda port: True)
    assert again.get("alice").bridge == alice.bridge
    assert _book(again) == {"10.77.0.3": {"user_id": "u_alice", "token": "tok-a"}}
    assert again.provision("bob").bridge.address == "10.77.0.4"  # type: ignore[union-attr]


def test_a_full_network_refuses_the_next_vm_and_leaves_nothing_behind(on_network: VmManager,
                                                                       hv: FakeHypervisor) -> None:
    for user in ("a", "b", "c", "d"):  # .3 to .6: the /29 has .1 (host) to .6, .2 is reserved by someone else
        on_network.provision(user)
    with pytest.raises(NetworkUnusable, match="no free address left on 10.77.0.0/29") as err:
        on_network.provision("e")
    assert err.value.code == "network_unusable"
    assert len(hv.reservations["wakeful"]) == 5 and len(hv.domains) == 4
    assert sorted(p.name for p in (on_network.settings.data_dir / "vms").iterdir()) == sorted(
        vm.name for vm in on_network.vms())


def test_a_missing_network_refuses_provisioning(settings: VmSettings, hv: FakeHypervisor, clock: FakeClock) -> None:
    manager = VmManager(replace(settings, network="nowhere"), hv, clock=clock, disks=FakeDisks())
    with pytest.raises(NetworkUnusable, match="nowhere"):
        manager.provision("alice")
    assert manager.vms() == [] and hv.domains == {}


def test_a_failed_definition_gives_the_reserved_address_back(on_network: VmManager, hv: FakeHypervisor) -> None:
    hv.fail_next("define", VmDead("libvirt said no"))
    with pytest.raises(VmDead):
        on_network.provision("alice")
    assert hv.reservations["wakeful"] == {"52:54:00:99:99:99": "10.77.0.2"}
    assert on_network.provision("alice").bridge.address == "10.77.0.3"  # type: ignore[union-attr]


def test_an_address_whose_dhcp_lease_outlived_its_vm_is_not_given_to_the_next(on_network: VmManager,
                                                                            hv: FakeHypervisor) -> None:
    # dnsmasq keeps a destroyed VM's lease (an hour by default) and gives its address to no other MAC meanwhile: a
    # new VM reserved that address would get none from DHCP when it boots.
    alice = on_network.provision("alice")
    on_network.ensure_running("alice")
    on_network.destroy("alice")
    assert alice.bridge is not None and hv.leases["wakeful"] == {alice.bridge.address: alice.bridge.mac}
    bob = on_network.provision("bob")
    assert bob.bridge is not None and bob.bridge.address == "10.77.0.4", "not alice's, still leased"
