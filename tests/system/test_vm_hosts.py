"""Tool computers on two hosts, for real: the system libvirtd ("a") and a second libvirtd started by the test
("b", see second_libvirtd.py), the tiny guest, saved state in a shared directory.

A computer runs on a, is suspended (its memory saved to the shared directory), a is marked full, and it resumes on
b with its memory (the guest's counter goes on, same boot) and its identity (disk overlay, seed disk with the SSH
host key, forwards, proxy credential). Then b's daemon is killed for real, and the computer, suspended there
before, resumes on a. Timings are printed (-s), never asserted. Both daemons run on this one machine: see
second_libvirtd.py for what only separate hosts would show.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import URI
from second_libvirtd import SecondLibvirtd, start_second_libvirtd
from tiny_guest import TinyGuest
from vm_lab import Recorder, Serial

from wakeful.proxy.clock import FakeClock
from wakeful.vm.accel import AccelChoice
from wakeful.vm.errors import VmError
from wakeful.vm.hosts import Host, HostFleet
from wakeful.vm.hypervisor import DomainState, ProxyCredential
from wakeful.vm.libvirt_adapter import LibvirtHypervisor
from wakeful.vm.lifecycle import VmInfo, VmManager, VmSettings
from wakeful.vm.lifecycle_rules import VmSize, VmState
from wakeful.vm.placement import HostMark, HostSpec

pytestmark = pytest.mark.vm

USER = "hosts-alice"
CREDENTIAL = ProxyCredential(user_id="usr_hosts_alice", token="tok-hosts-alice-7")


@dataclass
class TwoHosts:
    fleet: HostFleet
    manager: VmManager
    a: LibvirtHypervisor
    b: LibvirtHypervisor
    daemon_b: SecondLibvirtd
    shared: Path


@pytest.fixture(scope="module")
def two_hosts(libvirtd: None, tiny_guest: TinyGuest, accel: AccelChoice, proxy: Recorder,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a second libvirtd in its own mount namespace needs root and unshare")
    daemon_b = start_second_libvirtd(tmp_path_factory.mktemp("libvirtd-b"))
    a, b = LibvirtHypervisor(URI), LibvirtHypervisor(daemon_b.uri)
    shared = tmp_path_factory.mktemp("shared")
    fleet = HostFleet([Host(spec=HostSpec(name="a", uri=URI, memory_mib=200_000, max_restores=2), hypervisor=a),
                       Host(spec=HostSpec(name="b", uri=daemon_b.uri, memory_mib=100_000, max_restores=2),
                            hypervisor=b)], shared)
    settings = VmSettings(
        data_dir=shared, base_image=tiny_guest.base, kernel=tiny_guest.kernel, initrd=tiny_guest.initrd,
        cmdline="panic=-1", accel=accel.accel, size=VmSize(memory_mib=256, vcpus=1, disk_gib=1),
        port_range=(26000, 26999), proxy_port=proxy.port, idle_after=timedelta(minutes=5), domain_prefix="wkh-")
    manager = VmManager(settings, fleet, clock=FakeClock())
    yield TwoHosts(fleet=fleet, manager=manager, a=a, b=b, daemon_b=daemon_b, shared=shared)
    for vm in manager.vms():
        if vm.name.startswith("wkh-"):
            for hv in (a, b):
                try:
                    hv.undefine(vm.name)
                except VmError:  # b may be gone already: its state directory goes with it
                    pass
    daemon_b.stop()


def identity(vm: VmInfo) -> tuple[object, ...]:
    return (vm.name, vm.disk, vm.seed, vm.forwards, vm.keys, vm.proxy_credential,
            json.loads((vm.directory / "vm.json").read_text()))


def test_a_suspended_computer_resumes_on_host_b_when_host_a_is_marked_full(two_hosts: TwoHosts) -> None:
    manager, fleet = two_hosts.manager, two_hosts.fleet
    vm = manager.provision(USER, proxy_credential=CREDENTIAL)
    assert vm.name in two_hosts.a.names() and vm.name in two_hosts.b.names()  # defined on both
    serial = Serial(vm.serial_log)
    manager.ensure_running(USER)
    assert fleet.home(vm.name) == "a" and two_hosts.a.state(vm.name) is DomainState.RUNNING
    booted = serial.next_count(timeout=180)
    before = identity(manager.get(USER))

    started = time.perf_counter()
    manager.suspend(USER)
    saved = time.perf_counter() - started
    assert fleet.saved_path(vm.name).is_file() and not two_hosts.a.has_saved_state(vm.name)
    last = serial.last_count()

    started = time.perf_counter()
    manager.ensure_running(USER)  # the baseline: back on its own host, which has room
    restored_home = time.perf_counter() - started
    assert fleet.home(vm.name) == "a"
    assert serial.next_count(timeout=60).n > last.n
    manager.suspend(USER)
    last = serial.last_count()

    fleet.mark("a", HostMark.FULL)
    started = time.perf_counter()
    manager.ensure_running(USER)
    restored = time.perf_counter() - started

    assert fleet.home(vm.name) == "b"
    assert two_hosts.b.state(vm.name) is DomainState.RUNNING
    assert two_hosts.a.state(vm.name) is DomainState.SHUT_OFF
    after = serial.next_count(timeout=60)
    assert after.boot == booted.boot and after.pid == booted.pid and after.n > last.n  # its memory came along
    assert identity(manager.get(USER)) == before
    assert manager.get(USER).state is VmState.RUNNING
    xml = _virsh_xml(two_hosts.daemon_b.uri, vm.name)
    assert CREDENTIAL.basic() in xml and str(vm.disk) in xml and str(vm.seed) in xml  # the identity b runs with
    print(f"\nsave to shared storage {saved:.2f} s; restore on its own host {restored_home:.2f} s, on the other "
          f"host {restored:.2f} s")


def test_a_computer_saved_on_host_b_resumes_on_host_a_when_b_is_gone(two_hosts: TwoHosts) -> None:
    manager, fleet = two_hosts.manager, two_hosts.fleet
    vm = manager.get(USER)
    assert fleet.home(vm.name) == "b", "runs after the test that moves the computer to b"
    serial = Serial(vm.serial_log)
    before = identity(vm)
    manager.suspend(USER)
    last = serial.last_count()
    fleet.mark("a", HostMark.UP)
    two_hosts.daemon_b.stop()  # b's libvirtd is gone for real (the computer's QEMU ended with the save)
    assert not two_hosts.daemon_b.answers()

    started = time.perf_counter()
    manager.ensure_running(USER)
    restored = time.perf_counter() - started

    assert fleet.home(vm.name) == "a" and two_hosts.a.state(vm.name) is DomainState.RUNNING
    after = serial.next_count(timeout=60)
    assert after.pid == last.pid and after.boot == last.boot and after.n > last.n
    assert identity(manager.get(USER)) == before
    assert CREDENTIAL.basic() in _virsh_xml(URI, vm.name)
    manager.destroy(USER)
    assert vm.name not in two_hosts.a.names() and not fleet.saved_path(vm.name).exists()
    print(f"\nrestore on host a after b was gone {restored:.2f} s")


def _virsh_xml(uri: str, name: str) -> str:
    return subprocess.run(["virsh", "-c", uri, "dumpxml", name], capture_output=True, text=True, check=True,
                          timeout=60).stdout
