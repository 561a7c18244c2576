"""A `VmManager` over a `HostFleet` of fake hosts, with fake disks and every port free (tests/unit/vm)."""

from __future__ import annotations

from pathlib import Path

from wakeful.proxy.clock import FakeClock
from wakeful.vm.fake import FakeDisks
from wakeful.vm.hosts import HostFleet
from wakeful.vm.lifecycle import VmManager, VmSettings
from wakeful.vm.lifecycle_rules import VmSize

__all__ = ["manager_on"]


def manager_on(fleet: HostFleet, shared: Path, images: Path, **more: object) -> VmManager:
    settings = VmSettings(data_dir=shared, base_image=images / "base.qcow2", kernel=images / "vmlinux",
                          initrd=images / "initrd.img", size=VmSize(memory_mib=1024, vcpus=1, disk_gib=4),
                          port_range=(21000, 21099), proxy_port=3129, domain_prefix="wkt-", **more)  # type: ignore[arg-type]
    return VmManager(settings, fleet, clock=FakeClock(), disks=FakeDisks(), port_free=lambda port: True)
