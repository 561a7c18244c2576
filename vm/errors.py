"""The errors of the tool-computer layer, each with a stable code and a message a user can act on.

    VmError                      code
    ├── VmNotFound               vm_not_found            no such VM / domain
    ├── VmDead                   vm_dead                 the VM's process is gone or it cannot do what was asked now
    ├── IllegalTransition        illegal_transition      a lifecycle step not allowed from the current state
    ├── ImageMissing             image_missing           base image, kernel or initrd not on disk
    ├── HypervisorUnavailable    hypervisor_unavailable  libvirtd / QEMU / qemu-img not reachable or failing
    │   └── HostUnreachable      host_unreachable        a tool-computer host's SSH (the tunnel to its guests) fails
    ├── LimitExceeded            limit_exceeded          a per-user limit (RAM, vCPUs, disk, ports) would be exceeded
    ├── SnapshotNotFound         snapshot_not_found      no such disk snapshot
    ├── NetworkUnusable          network_unusable        the libvirt network for tool computers is missing,
    │                                                    inactive, not isolated or full
    ├── NoHostAvailable          no_host_available       no tool-computer host has room (or all are marked or gone)
    └── HostsBusy                hosts_busy              the hosts with room are all at their cap of restores in flight

Other `vm/` modules (guest channel, browser) subclass `VmError` with their own codes.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "HostUnreachable",
    "HostsBusy",
    "HypervisorUnavailable",
    "IllegalTransition",
    "ImageMissing",
    "LimitExceeded",
    "NetworkUnusable",
    "NoHostAvailable",
    "SnapshotNotFound",
    "VmDead",
    "VmError",
    "VmNotFound",
]


class VmError(Exception):
    """Base of the tree; `code` is stable and meant for machines, the message for people."""

    code: ClassVar[str] = "vm_error"

    def __init__(self, message: str, *, vm: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.vm = vm


class VmNotFound(VmError):
    code = "vm_not_found"


class VmDead(VmError):
    code = "vm_dead"


class IllegalTransition(VmError):
    code = "illegal_transition"


class ImageMissing(VmError):
    code = "image_missing"


class HypervisorUnavailable(VmError):
    code = "hypervisor_unavailable"


class HostUnreachable(HypervisorUnavailable):
    """A host is unreachable over SSH: as for libvirt not answering, the fleet treats it as gone."""

    code = "host_unreachable"


class LimitExceeded(VmError):
    code = "limit_exceeded"


class SnapshotNotFound(VmError):
    code = "snapshot_not_found"


class NetworkUnusable(VmError):
    code = "network_unusable"


class NoHostAvailable(VmError):
    code = "no_host_available"


class HostsBusy(VmError):
    code = "hosts_busy"
