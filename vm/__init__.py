"""Tool computers: per-user VMs on libvirt (hypervisor adapter, guest channel, browser, handoff).

The front door of the hypervisor layer; the libvirt adapter (`vm.libvirt_adapter.LibvirtHypervisor`) and the fake
(`vm.fake.FakeHypervisor`) are imported from their modules so that importing `vm` never loads libvirt.
"""

from wakeful.vm.errors import (
    HypervisorUnavailable,
    IllegalTransition,
    ImageMissing,
    LimitExceeded,
    SnapshotNotFound,
    VmDead,
    VmError,
    VmNotFound,
)
from wakeful.vm.hypervisor import Accel, DomainSpec, DomainState, Forwards, Hypervisor, ProxyCredential, SnapshotInfo
from wakeful.vm.lifecycle import AfterRestore, AfterRestoreHook, VmInfo, VmManager, VmSettings
from wakeful.vm.lifecycle_rules import ActivityKind, Limits, VmSize, VmState

__all__ = [
    "Accel",
    "ActivityKind",
    "AfterRestore",
    "AfterRestoreHook",
    "DomainSpec",
    "DomainState",
    "Forwards",
    "Hypervisor",
    "HypervisorUnavailable",
    "IllegalTransition",
    "ImageMissing",
    "LimitExceeded",
    "Limits",
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
