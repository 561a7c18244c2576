"""Tool computers: per-user VMs on libvirt (hypervisor adapter, guest channel, browser, handoff, guest image).

The front door of the hypervisor layer. Each outside library has one adapter module, imported from its module and
never from here: `vm.libvirt_adapter.LibvirtHypervisor` (libvirt), `vm.ssh_channel.GuestChannel` (paramiko),
`vm.cdp_browser.CdpBrowser` (Playwright). Their interfaces (`vm.hypervisor`, `vm.guest`, `vm.browser`) and the
fakes (`vm.fake`, `vm.fake_guest`, `vm.fake_browser`) import none of those libraries, so importing `vm` or a fake
loads none (`tests/unit/vm/test_vm_imports.py`). The image build is the package `vm.image`. Several KVM hosts:
`vm.hosts.HostFleet`, a `Hypervisor` over many libvirt connections, placing by the rules of `vm.placement`.
May import: `wakeful.vm` and `wakeful.proxy` (the clock, `proxy.clock`); never `wakeful.server`.
"""

from wakeful.vm.errors import (
    HostsBusy,
    HypervisorUnavailable,
    IllegalTransition,
    ImageMissing,
    LimitExceeded,
    NoHostAvailable,
    SnapshotNotFound,
    VmDead,
    VmError,
    VmNotFound,
)
from wakeful.vm.hosts import Host, HostFleet
from wakeful.vm.hypervisor import Accel, DomainSpec, DomainState, Forwards, Hypervisor, ProxyCredential, SnapshotInfo
from wakeful.vm.lifecycle import AfterRestore, AfterRestoreHook, VmInfo, VmManager, VmSettings
from wakeful.vm.lifecycle_rules import ActivityKind, Limits, VmSize, VmState
from wakeful.vm.placement import HostMark, HostSpec

__all__ = [
    "Accel",
    "ActivityKind",
    "AfterRestore",
    "AfterRestoreHook",
    "DomainSpec",
    "DomainState",
    "Forwards",
    "Host",
    "HostFleet",
    "HostMark",
    "HostSpec",
    "HostsBusy",
    "Hypervisor",
    "HypervisorUnavailable",
    "IllegalTransition",
    "ImageMissing",
    "LimitExceeded",
    "Limits",
    "NoHostAvailable",
    "ProxyCredential",
    "SnapshotInfo",
    "SnapshotNotFound",
    "VmDead",
    "VmError",
    "VmInfo",
    "VmManager",
    "VmNotFound",
    "VmSettings",
    "VmSize",
    "VmState",
]
