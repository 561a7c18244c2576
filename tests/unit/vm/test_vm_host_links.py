"""Hosts reached over SSH (`Host.link`): the fleet opens the guest channel's socket through the link of the host a
computer runs on, and a host whose link cannot be made counts as gone for placement, like one whose libvirt does
not answer. The links here are fakes; tests/integration/test_vm_host_tunnel.py drives the real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fleet import manager_on
from wakeful.vm.errors import HostUnreachable, NoHostAvailable, VmError, VmNotFound
from wakeful.vm.fake import FakeHypervisor
from wakeful.vm.guest import HostKeyMismatch
from wakeful.vm.hosts import Host, HostFleet
from wakeful.vm.lifecycle import VmManager
from wakeful.vm.placement import HostMark, HostSpec


class FakeLink:
    """Opens 'channels' that are just the address asked for; `failure` makes every call raise it."""

    def __init__(self) -> None:
        self.failure: VmError | None = None
        self.opened: list[tuple[str, int]] = []

    def ensure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def open(self, address: tuple[str, int], *, timeout: float | None = None) -> object:
        self.ensure()
        self.opened.append(address)
        return ("channel", address)


@pytest.fixture
def link() -> FakeLink:
    return FakeLink()


@pytest.fixture
def fleet(tmp_path: Path, a: FakeHypervisor, b: FakeHypervisor, link: FakeLink) -> HostFleet:
    # b has more room: a new computer goes there, through its link
    return HostFleet([Host(spec=HostSpec(name="a", uri="qemu:///system", memory_mib=2048), hypervisor=a),
                      Host(spec=HostSpec(name="b", uri="fake://b", memory_mib=8192), hypervisor=b, link=link)],
                     tmp_path / "shared", busy_wait=0.0)


@pytest.fixture
def manager(fleet: HostFleet, tmp_path: Path, images: Path) -> VmManager:
    return manager_on(fleet, tmp_path / "shared", images)


def test_the_guest_socket_of_a_computer_on_a_linked_host_goes_through_that_hosts_link(
        manager: VmManager, fleet: HostFleet, link: FakeLink) -> None:
    vm = manager.provision("alice")
    manager.ensure_running("alice")
    assert fleet.home(vm.name) == "b"
    assert fleet.open_to(vm.name, vm.ssh_endpoint) == ("channel", vm.ssh_endpoint)
    assert link.opened == [vm.ssh_endpoint]


def test_on_the_apis_own_host_there_is_no_link_and_the_channel_connects_directly(
        manager: VmManager, fleet: HostFleet, link: FakeLink) -> None:
    fleet.mark("b", HostMark.FULL)
    vm = manager.provision("alice")
    manager.ensure_running("alice")
    assert fleet.home(vm.name) == "a"
    assert fleet.open_to(vm.name, vm.ssh_endpoint) is None and link.opened == []


@pytest.mark.parametrize("failure", [HostUnreachable("cannot reach host b"), HostKeyMismatch("another key")])
def test_a_host_whose_link_fails_counts_as_gone_for_placement(
        manager: VmManager, fleet: HostFleet, link: FakeLink, failure: VmError) -> None:
    link.failure = failure
    vm = manager.provision("alice")
    manager.ensure_running("alice")
    assert fleet.home(vm.name) == "a"
    assert [(h.name, h.reachable) for h in fleet.loads()] == [("a", True), ("b", False)]


def test_when_no_host_is_left_the_error_says_so(manager: VmManager, fleet: HostFleet, link: FakeLink) -> None:
    link.failure = HostUnreachable("cannot reach host b")
    fleet.mark("a", HostMark.FULL)
    manager.provision("alice")
    with pytest.raises(NoHostAvailable):
        manager.ensure_running("alice")


def test_a_link_that_drops_after_placement_fails_the_guest_socket_with_host_unreachable(
        manager: VmManager, fleet: HostFleet, link: FakeLink) -> None:
    vm = manager.provision("alice")
    manager.ensure_running("alice")
    link.failure = HostUnreachable("the SSH connection to host b dropped")
    with pytest.raises(HostUnreachable) as caught:
        fleet.open_to(vm.name, vm.ssh_endpoint)
    assert caught.value.code == "host_unreachable"


def test_asking_for_the_socket_of_an_unknown_computer_is_not_found(fleet: HostFleet) -> None:
    with pytest.raises(VmNotFound):
        fleet.open_to("wkt-nobody", ("127.0.0.1", 21000))
