"""The hypervisor interface: what the VM manager needs from libvirt, and nothing more.

One real adapter (`vm.libvirt_adapter.LibvirtHypervisor`) and one in-memory fake (`vm.fake.FakeHypervisor`) implement
it. Domains are addressed by name. Semantics every implementation keeps:

* `start` boots cold and refuses when a saved state exists (a restore is never silently replaced by a boot);
  `restore` starts from the saved state and refuses when there is none.
* `suspend_to_disk` is libvirt's managed save: memory goes to a file, the QEMU process exits, RAM is freed.
* Disk snapshots are external overlays: the current top layer is frozen and a new overlay file is stacked on it.
  Reverting discards every layer above the snapshot and stops the domain (its memory no longer matches the disk).
"""

from __future__ import annotations

import base64
import ipaddress
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

__all__ = ["Accel", "BridgePlace", "DomainSpec", "DomainState", "Forwards", "Hypervisor", "NetworkInfo",
           "ProxyCredential", "SnapshotInfo"]


class Accel(StrEnum):
    KVM = "kvm"
    TCG = "tcg"


class DomainState(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    SHUT_OFF = "shut_off"  # includes "saved": check `has_saved_state`
    CRASHED = "crashed"
    OTHER = "other"


@dataclass(frozen=True, kw_only=True)
class Forwards:
    """Host ports on 127.0.0.1 and where they lead (user-mode networking). Nothing else of the VM is reachable
    from the host. A VM on an isolated network (`BridgePlace`) has none: the host reaches it at its address."""

    ssh: int | None
    """Host port forwarded to guest port 22."""
    cdp: int | None = None
    """Only in VMs provisioned before the side door: a host port forwarded to guest port 9222, which leads nowhere
    (Chromium's DevTools listen on the guest's loopback only; they are reached through SSH or the side door). Kept
    so the port stays taken while such a VM's saved domain binds it at its next restore."""
    keeper: int | None = None
    """Host port forwarded to the clock keeper's side door (`vm.keeper`) on the guest's slirp address, if any (VMs
    provisioned before it have none and reach the keeper over SSH only)."""
    vnc: int | None = None
    """Only in VMs provisioned before it was dropped: a host port forwarded to guest port 5900, which leads nowhere
    (x11vnc listens on the guest's loopback only; a live view reaches it through SSH). Kept, as `cdp`, so the port
    stays taken while such a VM's saved domain binds it at its next restore."""
    proxy: int | None = None
    """Host port of the egress proxy; the guest reaches it at 10.0.2.100:3128 and nowhere else."""

    def host_ports(self) -> tuple[int, ...]:
        return tuple(p for p in (self.ssh, self.cdp, self.keeper, self.vnc) if p is not None)


@dataclass(frozen=True, kw_only=True)
class NetworkInfo:
    """An isolated libvirt network as tool computers see it."""

    name: str
    host: ipaddress.IPv4Interface
    """The host's own address on the network, with its prefix: the egress proxy listens there."""
    reserved: frozenset[str] = frozenset()
    """Addresses already given to some machine by a DHCP reservation."""
    leased: frozenset[str] = frozenset()
    """Addresses the network's DHCP server holds a lease on. A lease outlives its reservation: dnsmasq gives that
    address to no other MAC until the lease expires (an hour by default), whatever the reservations say."""
    bridge_mac: str | None = None
    """The MAC address of the host's side of the network (lower case); None when the definition names none. A
    suspended guest keeps the one it last saw in its ARP cache, so hosts it moves between must have the same."""


@dataclass(frozen=True, kw_only=True)
class BridgePlace:
    """A VM's fixed place on an isolated libvirt network: its MAC, and the address a DHCP reservation gives it.
    libvirt's `clean-traffic` filter with this address and MAC holds on the VM's tap (a binding made before the VM
    runs, see `vm.libvirt_adapter`), so the VM cannot send from another one: the egress proxy knows the VM by it."""

    network: str
    mac: str
    address: str


@dataclass(frozen=True, kw_only=True)
class ProxyCredential:
    """Who a tool computer is to the egress proxy (`server.egress.issue_client_token`).

    It never enters the guest: the host's per-connection relay (see `vm.domain_xml.proxy_connector`) inserts
    `Proxy-Authorization: Basic base64(user_id:token)` after the first request line of each guest connection, and
    the proxy takes that first request's identity for the whole connection. It lives in the domain definition (the
    QEMU command line) and the VM's 0600 record on the host."""

    user_id: str
    token: str = field(repr=False)

    def __post_init__(self) -> None:
        if not self.user_id or ":" in self.user_id or not self.token:
            raise ValueError("a proxy credential is a non-empty user ID without ':' and a non-empty token")
        if any(not c.isprintable() for c in self.user_id + self.token):
            raise ValueError("a proxy credential must be printable")

    def basic(self) -> str:
        """The Basic credential: base64 of `user_id:token` (only [A-Za-z0-9+/=], safe on any command line)."""
        return base64.b64encode(f"{self.user_id}:{self.token}".encode()).decode("ascii")


@dataclass(frozen=True, kw_only=True)
class DomainSpec:
    """Everything needed to define one tool-computer domain."""

    name: str
    """Domain name, unique on the host."""
    accel: Accel
    """KVM where a real boot probe succeeded (see `vm.accel`), TCG otherwise."""
    memory_mib: int
    vcpus: int
    kernel: Path
    """Direct kernel boot: a bzImage, or an uncompressed PVH vmlinux (boots ~3 s faster under TCG)."""
    initrd: Path | None
    cmdline: str
    """Kernel command line; `console=ttyS0` and `init_on_free=1` are added when missing."""
    disk: Path
    """The VM's qcow2 overlay on the shared read-only base (the active top layer)."""
    seed: Path | None
    """Read-only ext4 image labelled WKSEED with per-VM keys (see `vm.seed`)."""
    serial_log: Path
    forwards: Forwards
    cpu_model: str = "Westmere"
    """A named model (never host-passthrough) so a saved state restores on any host that offers it."""
    tb_cache_mib: int = 512
    """TCG translation cache (ignored under KVM); see `VmSettings.tb_cache_mib`."""
    machine: str = "q35"
    proxy_command: tuple[str, ...] = ("/bin/busybox", "nc")
    """Run by QEMU per guest connection to the proxy, with `127.0.0.1 PORT` appended: a stdio-to-TCP bridge."""
    proxy_credential: ProxyCredential | None = None
    """When set, each guest connection to the proxy gets this identity inserted by the host (see `ProxyCredential`)."""
    bridge: BridgePlace | None = None
    """Join this isolated libvirt network instead of user-mode networking (then `forwards` is unused)."""


@dataclass(frozen=True, kw_only=True)
class SnapshotInfo:
    name: str
    frozen: Path
    """The layer frozen when the snapshot was taken; reverting stacks a fresh overlay on it."""
    overlay: Path
    """The overlay created by the snapshot (the top layer until the next snapshot)."""


class Hypervisor(Protocol):
    def define(self, spec: DomainSpec) -> None:
        """Define (or redefine, when shut off) the domain. Raises `ImageMissing` if a file it needs is absent."""
        ...

    def names(self) -> list[str]:
        """Names of all defined domains."""
        ...

    def start(self, name: str) -> None:
        """Cold boot. Refuses (`IllegalTransition`) when a saved state exists."""
        ...

    def restore(self, name: str) -> None:
        """Start from the managed-save state, in place. Refuses (`IllegalTransition`) when there is none."""
        ...

    def suspend_to_disk(self, name: str) -> None:
        """Managed save: write memory to disk and end the QEMU process. The domain must be running or paused."""
        ...

    def discard_saved_state(self, name: str) -> None:
        """Remove the managed-save state, if any (the next start is a cold boot)."""
        ...

    def pause(self, name: str) -> None:
        """Stop the vCPUs; RAM stays held."""
        ...

    def resume(self, name: str) -> None:
        ...

    def destroy(self, name: str) -> None:
        """Hard stop (pull the plug). A no-op when the domain is not running."""
        ...

    def undefine(self, name: str) -> None:
        """Remove the definition with its managed-save state and snapshot metadata. Stops the domain first."""
        ...

    def state(self, name: str) -> DomainState:
        ...

    def has_saved_state(self, name: str) -> bool:
        ...

    def memory_bytes(self, name: str) -> int:
        """Resident bytes of the domain's QEMU process; 0 when it has none (shut off or saved)."""
        ...

    def snapshot_create(self, name: str, snapshot: str, overlay: Path) -> SnapshotInfo:
        """Freeze the current top disk layer and continue on a new overlay file `overlay`. Running or shut off."""
        ...

    def snapshot_revert(self, name: str, snapshot: str) -> None:
        """Discard every layer above the snapshot's frozen layer and stop the domain (its saved state goes too)."""
        ...

    def snapshot_delete(self, name: str, snapshot: str) -> None:
        """Forget a snapshot; its layers stay in the chain (they hold data later layers need)."""
        ...

    def snapshots(self, name: str) -> list[SnapshotInfo]:
        """Snapshots, oldest first."""
        ...

    def network(self, name: str) -> NetworkInfo:
        """The isolated network `name`. Raises `NetworkUnusable` when it is not defined, not active, forwards
        anywhere (a `<forward>` element: NAT, routed, bridged to the LAN) or has no IPv4 address."""
        ...

    def reserve_address(self, place: BridgePlace, host_name: str) -> None:
        """Add the DHCP reservation (MAC → address) to the running network and its persistent definition."""
        ...

    def release_address(self, place: BridgePlace) -> None:
        """Remove the reservation; a no-op when it is not there."""
        ...
