"""Tool computers on several hosts: the VM manager over a `HostFleet` of two fake hypervisors, saved state in a
shared directory. A suspended computer resumes on another host when its own is full or gone, as the same VM."""

from __future__ import annotations

import ipaddress
import json
import threading
from pathlib import Path

import pytest

from tests.support.fleet import manager_on
from wakeful.vm.errors import HostsBusy, HypervisorUnavailable, NetworkUnusable, NoHostAvailable
from wakeful.vm.fake import FakeHypervisor
from wakeful.vm.hosts import MARKS_FILE, Host, HostFleet, read_marks, write_mark
from wakeful.vm.hypervisor import DomainState, ProxyCredential
from wakeful.vm.lifecycle import VmManager
from wakeful.vm.lifecycle_rules import VmState
from wakeful.vm.placement import HostMark, HostSpec

CREDENTIAL = ProxyCredential(user_id="alice", token="s3cret-token")


def fleet_of(shared: Path, a: FakeHypervisor, b: FakeHypervisor, *, a_mib: int = 4096, b_mib: int = 2048,
             max_restores: int = 2, busy_wait: float = 0.0) -> HostFleet:
    return HostFleet([Host(spec=HostSpec(name="a", uri="fake://a", memory_mib=a_mib, max_restores=max_restores),
                           hypervisor=a),
                      Host(spec=HostSpec(name="b", uri="fake://b", memory_mib=b_mib, max_restores=max_restores),
                           hypervisor=b)], shared, busy_wait=busy_wait)


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    return tmp_path / "shared"


@pytest.fixture
def fleet(shared: Path, a: FakeHypervisor, b: FakeHypervisor) -> HostFleet:
    return fleet_of(shared, a, b)


@pytest.fixture
def manager(fleet: HostFleet, shared: Path, images: Path) -> VmManager:
    return manager_on(fleet, shared, images)


def suspended_on_a(manager: VmManager, fleet: HostFleet, a: FakeHypervisor) -> str:
    vm = manager.provision("alice", proxy_credential=CREDENTIAL)
    manager.ensure_running("alice")
    assert fleet.home(vm.name) == "a" and a.state(vm.name) is DomainState.RUNNING
    manager.suspend("alice")
    return vm.name


def test_a_new_computer_is_defined_on_every_host_and_runs_on_the_one_with_most_free_memory(
        manager: VmManager, fleet: HostFleet, a: FakeHypervisor, b: FakeHypervisor) -> None:
    vm = manager.provision("alice", proxy_credential=CREDENTIAL)
    assert vm.name in a.names() and vm.name in b.names()
    manager.ensure_running("alice")
    assert fleet.home(vm.name) == "a"
    assert a.state(vm.name) is DomainState.RUNNING and b.state(vm.name) is DomainState.SHUT_OFF



def test_a_new_computer_is_not_homed_on_a_host_marked_full_though_it_has_the_most_free_memory(
        manager: VmManager, fleet: HostFleet, a: FakeHypervisor, b: FakeHypervisor) -> None:
    fleet.mark("a", HostMark.FULL)
    vm = manager.provision("alice", proxy_credential=CREDENTIAL)
    assert vm.name in a.names() and fleet.home(vm.name) == "b"
    manager.ensure_running("alice")
    assert b.state(vm.name) is DomainState.RUNNING and a.state(vm.name) is DomainState.SHUT_OFF

def test_a_suspended_computer_is_saved_to_the_shared_directory_not_to_its_host(
        manager: VmManager, fleet: HostFleet, a: FakeHypervisor, shared: Path) -> None:
    name = suspended_on_a(manager, fleet, a)
    assert manager.get("alice").state is VmState.SUSPENDED
    assert fleet.saved_path(name).parent == (shared / "saved").resolve() and fleet.saved_path(name).exists()
    assert not a.domains[name].saved  # no managed-save state that only host a could restore


def test_a_suspended_computer_resumes_on_its_own_host_while_it_has_room(
        manager: VmManager, fleet: HostFleet, a: FakeHypervisor, b: FakeHypervisor) -> None:
    name = suspended_on_a(manager, fleet, a)
    manager.ensure_running("alice")
    assert fleet.home(name) == "a" and a.domains[name].restores == 1 and b.state(name) is DomainState.SHUT_OFF
    assert not fleet.saved_path(name).exists()


@pytest.mark.parametrize("how", ["marked full", "marked gone", "not answering", "out of memory"])
def test_a_suspended_computer_resumes_on_another_host_as_the_same_vm(
        how: str, manager: VmManager, fleet: HostFleet, a: FakeHypervisor, b: FakeHypervisor) -> None:
    name = suspended_on_a(manager, fleet, a)
    before = manager.get("alice")
    if how == "marked full":
        fleet.mark("a", HostMark.FULL)
    elif how == "marked gone":
        fleet.mark("a", HostMark.GONE)
    elif how == "not answering":
        a.down = True
    else:
        a.host_free_mib = 512

    after = manager.ensure_running("alice")

    assert fleet.home(name) == "b" and b.state(name) is DomainState.RUNNING and b.domains[name].restores == 1
    assert b.boots(name) == 0  # restored with its memory, not booted
    assert after == before.__class__(**{**vars(before), "state": VmState.RUNNING})  # disk, keys, ports, credential
    assert b.domains[name].spec.proxy_credential == CREDENTIAL and b.domains[name].spec.disk == before.disk
    assert b.domains[name].spec.seed == before.seed  # the seed disk carries the SSH host key the channel pins


def test_a_mark_written_beside_a_running_fleet_holds_from_its_next_placement_and_across_a_restart(
        manager: VmManager, fleet: HostFleet, shared: Path, images: Path, a: FakeHypervisor,
        b: FakeHypervisor) -> None:
    name = suspended_on_a(manager, fleet, a)
    write_mark(shared, "a", HostMark.FULL)  # what `wakeful hosts mark a full` does, from another process
    manager.ensure_running("alice")
    assert fleet.home(name) == "b"
    manager.suspend("alice")
    again = fleet_of(shared, a, b)  # the server restarted: the settings still say up, the marks file says full
    assert [h.mark for h in again.hosts()] == [HostMark.FULL, HostMark.UP]
    write_mark(shared, "a", HostMark.UP)
    write_mark(shared, "b", HostMark.FULL)
    manager_on(again, shared, images).ensure_running("alice")
    assert again.home(name) == "a"  # a has the most room, b takes nothing new
    assert read_marks(shared) == {"a": HostMark.UP, "b": HostMark.FULL}


def test_a_marks_file_edited_wrongly_leaves_the_marks_as_they_were(
        fleet: HostFleet, shared: Path) -> None:
    write_mark(shared, "b", HostMark.GONE)
    assert [h.mark for h in fleet.hosts()] == [HostMark.UP, HostMark.GONE]
    (shared / MARKS_FILE).write_text('{"version": 1, "marks": {"b": "sideways"}}')
    assert [h.mark for h in fleet.hosts()] == [HostMark.UP, HostMark.GONE]


def test_a_running_computer_stays_on_its_host_when_that_host_is_marked_full(
        manager: VmManager, fleet: HostFleet, a: FakeHypervisor, b: FakeHypervisor) -> None:
    vm = manager.provision("alice")
    manager.ensure_running("alice")
    fleet.mark("a", HostMark.FULL)
    with manager.activity("alice", "act"):
        pass
    assert a.state(vm.name) is DomainState.RUNNING and b.state(vm.name) is DomainState.SHUT_OFF
    assert fleet.home(vm.name) == "a"


def test_a_computer_whose_host_is_gone_while_it_ran_boots_cold_elsewhere_from_its_disk(
        manager: VmManager, fleet: HostFleet, a: FakeHypervisor, b: FakeHypervisor) -> None:
    vm = manager.provision("alice")
    manager.ensure_running("alice")
    a.down = True
    manager.ensure_running("alice")  # its memory was on a: lost; the disk overlay is on shared storage
    assert fleet.home(vm.name) == "b" and b.boots(vm.name) == 1


def test_its_address_book_entry_and_reservation_follow_a_computer_to_another_host(
        fleet: HostFleet, shared: Path, images: Path, a: FakeHypervisor, b: FakeHypervisor, tmp_path: Path) -> None:
    for hv in (a, b):
        hv.networks["wakeful"] = ipaddress.IPv4Interface("10.77.0.1/24")
    book = tmp_path / "proxy" / "address-book.json"
    manager = manager_on(fleet, shared, images, network="wakeful", address_book=book)
    vm = manager.provision("alice", proxy_credential=CREDENTIAL)
    assert vm.bridge is not None
    manager.ensure_running("alice")
    manager.suspend("alice")
    entry = json.loads(book.read_text())["addresses"]
    fleet.mark("a", HostMark.FULL)
    manager.ensure_running("alice")
    assert fleet.home(vm.name) == "b"
    assert json.loads(book.read_text())["addresses"] == entry == {
        vm.bridge.address: {"user_id": "alice", "token": "s3cret-token"}}
    assert b.reservations["wakeful"] == {vm.bridge.mac: vm.bridge.address}
    assert b.domains[vm.name].spec.bridge == vm.bridge


def test_a_new_computer_gets_no_address_any_host_reserves_or_still_leases(
        fleet: HostFleet, shared: Path, images: Path, a: FakeHypervisor, b: FakeHypervisor) -> None:
    for hv in (a, b):
        hv.networks["wakeful"] = ipaddress.IPv4Interface("10.77.0.1/24")
    b.reservations["wakeful"] = {"52:54:00:99:99:99": "10.77.0.2"}  # someone else's, on b only
    manager = manager_on(fleet, shared, images, network="wakeful")
    fleet.mark("a", HostMark.FULL)
    alice = manager.provision("alice")
    manager.ensure_running("alice")  # boots on b: b's DHCP server leases alice her address
    assert fleet.home(alice.name) == "b" and alice.bridge is not None and alice.bridge.address == "10.77.0.3"
    manager.destroy("alice")  # her reservations go; b's lease stays until it expires
    assert b.leases["wakeful"] == {"10.77.0.3": alice.bridge.mac} and "wakeful" not in a.leases
    fleet.mark("a", HostMark.UP)
    bob = manager.provision("bob")
    assert bob.bridge is not None and bob.bridge.address == "10.77.0.4", "b's DHCP would not give bob .2 or .3"
    assert fleet.network("wakeful").reserved == {"10.77.0.2", "10.77.0.4"}


def test_a_computer_made_while_a_host_did_not_answer_gets_its_reservation_there_when_it_resumes_there(
        shared: Path, images: Path, a: FakeHypervisor, b: FakeHypervisor) -> None:
    # Without it the guest keeps its address on b until its DHCP client renews: b's server, which has no reservation
    # for it and no range, refuses the renewal and the guest drops the address the proxy knows it by.
    for hv in (a, b):
        hv.networks["wakeful"] = ipaddress.IPv4Interface("10.77.0.1/24")
    b.down = True
    manager = manager_on(fleet_of(shared, a, b), shared, images, network="wakeful")
    vm = manager.provision("alice", proxy_credential=CREDENTIAL)
    manager.ensure_running("alice")
    manager.suspend("alice")
    assert vm.bridge is not None and "wakeful" not in b.reservations
    b.down = False
    fleet = fleet_of(shared, a, b)  # the server restarted meanwhile: what the fleet knows comes from the shared dir
    again = manager_on(fleet, shared, images, network="wakeful")
    fleet.mark("a", HostMark.FULL)
    again.ensure_running("alice")
    assert fleet.home(vm.name) == "b"
    assert b.reservations["wakeful"] == {vm.bridge.mac: vm.bridge.address}
    again.suspend("alice")
    fleet.mark("a", HostMark.UP)
    again.ensure_running("alice")  # back home, where it has its reservation: nothing added
    assert a.reservations["wakeful"] == {vm.bridge.mac: vm.bridge.address}


@pytest.mark.parametrize("how", ["restores", "boots"])
def test_a_computer_passes_over_a_host_that_lacks_its_network_and_is_told_why_when_none_is_left(
        how: str, shared: Path, images: Path, a: FakeHypervisor, b: FakeHypervisor) -> None:
    c = FakeHypervisor()
    for hv in (a, b, c):
        hv.networks["wakeful"] = ipaddress.IPv4Interface("10.77.0.1/24")
    fleet = HostFleet([Host(spec=HostSpec(name=n, uri=f"fake://{n}", memory_mib=mib), hypervisor=hv)
                       for n, mib, hv in (("a", 4096, a), ("b", 8192, b), ("c", 2048, c))], shared)
    manager = manager_on(fleet, shared, images, network="wakeful")
    vm = manager.provision("alice", proxy_credential=CREDENTIAL)
    manager.ensure_running("alice")
    assert fleet.home(vm.name) == "b"  # the most free memory
    manager.suspend("alice") if how == "restores" else manager.stop("alice")
    del b.networks["wakeful"]  # b's network was removed (or never made again after a rebuild)
    fleet.mark("a", HostMark.FULL)

    manager.ensure_running("alice")  # b has the most room still, but not the network: c is next

    assert fleet.home(vm.name) == "c" and c.state(vm.name) is DomainState.RUNNING
    assert (c.domains[vm.name].restores, c.boots(vm.name)) == ((1, 0) if how == "restores" else (0, 1))
    assert b.state(vm.name) is DomainState.SHUT_OFF
    manager.suspend("alice") if how == "restores" else manager.stop("alice")
    fleet.mark("c", HostMark.FULL)
    with pytest.raises(NoHostAvailable, match="b: there is no libvirt network named wakeful"):
        manager.ensure_running("alice")
    assert b.state(vm.name) is DomainState.SHUT_OFF


def test_a_network_that_differs_between_hosts_is_unusable_and_names_both(
        fleet: HostFleet, a: FakeHypervisor, b: FakeHypervisor) -> None:
    for hv in (a, b):
        hv.networks["wakeful"] = ipaddress.IPv4Interface("10.77.0.1/24")
        hv.network_macs["wakeful"] = "52:54:00:ab:cd:01"
    assert fleet.network("wakeful").bridge_mac == "52:54:00:ab:cd:01"
    b.network_macs["wakeful"] = "52:54:00:ab:cd:02"  # defined on b from its own XML: libvirt chose another MAC
    with pytest.raises(NetworkUnusable, match=r"differs between hosts a .* and b .*52:54:00:ab:cd:02.*same XML"):
        fleet.network("wakeful")
    b.network_macs["wakeful"] = "52:54:00:ab:cd:01"
    b.networks["wakeful"] = ipaddress.IPv4Interface("10.77.1.1/24")
    with pytest.raises(NetworkUnusable, match="10.77.1.1/24"):
        fleet.network("wakeful")
    b.down = True  # a host that does not answer is not compared
    assert fleet.network("wakeful").host == ipaddress.IPv4Interface("10.77.0.1/24")


def test_no_host_with_room_is_a_clear_refusal(manager: VmManager, fleet: HostFleet, a: FakeHypervisor) -> None:
    suspended_on_a(manager, fleet, a)
    fleet.mark("a", HostMark.GONE)
    fleet.mark("b", HostMark.FULL)
    with pytest.raises(NoHostAvailable) as caught:
        manager.ensure_running("alice")
    assert "a: marked gone; b: marked full" in caught.value.message
    assert manager.get("alice").state is VmState.SUSPENDED  # still resumable once a host has room


class SlowRestores(FakeHypervisor):
    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def restore_from(self, path: Path) -> str:
        self.entered.set()
        assert self.release.wait(10)
        return super().restore_from(path)


def test_restores_past_a_hosts_cap_go_to_another_host_or_wait(shared: Path, images: Path) -> None:
    a, b = SlowRestores(), FakeHypervisor()
    fleet = fleet_of(shared, a, b, a_mib=8192, b_mib=2048, max_restores=1)
    manager = manager_on(fleet, shared, images)
    names = {}
    for user in ("u1", "u2", "u3"):
        names[user] = manager.provision(user).name
        manager.ensure_running(user)
        manager.suspend(user)
    assert {fleet.home(n) for n in names.values()} == {"a"}
    a.release.clear()
    first = threading.Thread(target=manager.ensure_running, args=("u1",))
    first.start()
    try:
        assert a.entered.wait(10)
        manager.ensure_running("u2")  # a has room but one restore in flight already: b takes it
        assert fleet.home(names["u2"]) == "b"
        b.host_free_mib = 0  # now only a has room, and it is at its cap
        with pytest.raises(HostsBusy):
            manager.ensure_running("u3")
    finally:
        a.release.set()
        first.join(10)
    assert fleet.home(names["u1"]) == "a" and a.state(names["u1"]) is DomainState.RUNNING
    manager.ensure_running("u3")  # the cap is free again
    assert fleet.home(names["u3"]) == "a"


def test_homes_survive_a_restart_of_the_server(shared: Path, images: Path, a: FakeHypervisor,
                                               b: FakeHypervisor) -> None:
    fleet = fleet_of(shared, a, b)
    manager = manager_on(fleet, shared, images)
    name = suspended_on_a(manager, fleet, a)
    fleet.mark("a", HostMark.FULL)
    manager.ensure_running("alice")
    manager.suspend("alice")

    again = fleet_of(shared, a, b)
    reloaded = manager_on(again, shared, images)
    assert again.home(name) == "b" and reloaded.get("alice").state is VmState.SUSPENDED
    reloaded.ensure_running("alice")
    assert again.home(name) == "b" and b.domains[name].restores == 2


def test_destroying_a_computer_removes_it_from_every_host_and_the_shared_directory(
        manager: VmManager, fleet: HostFleet, a: FakeHypervisor, b: FakeHypervisor) -> None:
    name = suspended_on_a(manager, fleet, a)
    manager.destroy("alice")
    assert name not in a.names() and name not in b.names()
    assert not fleet.saved_path(name).exists() and fleet.home(name) is None


def test_a_shared_directory_that_cannot_be_used_is_refused_naming_it(tmp_path: Path, a: FakeHypervisor,
                                                                     b: FakeHypervisor) -> None:
    not_a_dir = tmp_path / "nfs"
    not_a_dir.write_text("not mounted")
    with pytest.raises(HypervisorUnavailable, match=f"the shared directory {not_a_dir} is not usable"):
        fleet_of(not_a_dir, a, b)


def test_a_host_that_fails_the_restore_itself_is_passed_over_for_the_next(
        manager: VmManager, fleet: HostFleet, a: FakeHypervisor, b: FakeHypervisor) -> None:
    name = suspended_on_a(manager, fleet, a)
    a.fail_next("restore_from", HypervisorUnavailable("libvirtd went away mid-restore"))
    manager.ensure_running("alice")
    assert fleet.home(name) == "b" and b.state(name) is DomainState.RUNNING
