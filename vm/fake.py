"""In-memory fakes of `Hypervisor` and `Disks`, with the real adapters' semantics, for unit tests above them.

The fake hypervisor keeps each domain's disk chain as a list of paths and touches the overlay files it creates, so
code that checks files (destroy removes everything) sees what it would see with libvirt.
"""

from __future__ import annotations

import ipaddress
import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path

from wakeful.vm.errors import (
    HypervisorUnavailable,
    IllegalTransition,
    ImageMissing,
    NetworkUnusable,
    SnapshotNotFound,
    VmError,
    VmNotFound,
)
from wakeful.vm.hypervisor import BridgePlace, DomainSpec, DomainState, NetworkInfo, SnapshotInfo

__all__ = ["FakeDisks", "FakeHypervisor"]


@dataclass
class _Domain:
    spec: DomainSpec
    state: DomainState = DomainState.SHUT_OFF
    saved: bool = False
    boots: int = 0
    restores: int = 0
    """Restores from a saved file (`restore_from`)."""
    layers: list[Path] = field(default_factory=list)  # bottom (the VM's overlay) to top
    snapshots: list[SnapshotInfo] = field(default_factory=list)


class FakeHypervisor:
    def __init__(self, *, resident_bytes_per_mib: int = 1024 * 1024) -> None:
        self.domains: dict[str, _Domain] = {}
        self.calls: list[tuple[str, str]] = []
        self._failures: dict[str, VmError] = {}
        self._per_mib = resident_bytes_per_mib
        self._lock = threading.RLock()
        self.networks: dict[str, ipaddress.IPv4Interface] = {}
        self.network_macs: dict[str, str] = {}
        """Isolated networks by name: the host's address on each (add one to use it)."""
        self.reservations: dict[str, dict[str, str]] = {}
        """DHCP reservations per network: MAC → address."""
        self.leases: dict[str, dict[str, str]] = {}
        """DHCP leases per network: address → MAC. A guest on a network takes one at each cold boot when it has a
        reservation here; a lease outlives its reservation, as dnsmasq's do (expiry is not modelled)."""
        self.down = False
        """True: every call fails with `HypervisorUnavailable`, like a host whose libvirtd is gone."""
        self.host_free_mib: int | None = None
        """What `free_mib` reports (None: nothing, like a driver that does not say)."""

    def fail_next(self, operation: str, error: VmError) -> None:
        """Make the next call of `operation` (a method name) raise `error` without doing anything."""
        self._failures[operation] = error

    def _enter(self, operation: str, name: str) -> _Domain | None:
        self.calls.append((operation, name))
        if self.down:
            raise HypervisorUnavailable(f"libvirt does not answer ({operation} {name})", vm=name)
        if (error := self._failures.pop(operation, None)) is not None:
            raise error
        return self.domains.get(name)

    def _get(self, operation: str, name: str) -> _Domain:
        dom = self._enter(operation, name)
        if dom is None:
            raise VmNotFound(f"there is no VM named {name}", vm=name)
        return dom

    def define(self, spec: DomainSpec) -> None:
        with self._lock:
            dom = self._enter("define", spec.name)
            for what, path in (("kernel", spec.kernel), ("initrd", spec.initrd), ("disk", spec.disk),
                               ("seed disk", spec.seed)):
                if path is not None and not path.exists():
                    raise ImageMissing(f"the {what} {path} does not exist", vm=spec.name)
            if dom is not None and dom.state is not DomainState.SHUT_OFF:
                raise IllegalTransition(f"{spec.name} is running; stop it before redefining it", vm=spec.name)
            if dom is None:
                self.domains[spec.name] = _Domain(spec=spec, layers=[spec.disk])
            else:
                dom.spec = spec

    def names(self) -> list[str]:
        self._enter("names", "*")
        return sorted(self.domains)

    def start(self, name: str) -> None:
        with self._lock:
            dom = self._get("start", name)
            if dom.saved:
                raise IllegalTransition(f"{name} has a saved state: restore it, or discard the state", vm=name)
            if dom.state is not DomainState.SHUT_OFF:
                raise IllegalTransition(f"{name} is already running", vm=name)
            self._attachable(dom.spec)
            dom.state, dom.boots = DomainState.RUNNING, dom.boots + 1
            bridge = dom.spec.bridge
            if bridge is not None and self.reservations.get(bridge.network, {}).get(bridge.mac) == bridge.address:
                self.leases.setdefault(bridge.network, {})[bridge.address] = bridge.mac  # its DHCP client at boot

    def _attachable(self, spec: DomainSpec) -> None:
        """As libvirt: a domain on a network this host lacks does not start."""
        if spec.bridge is not None and spec.bridge.network not in self.networks:
            raise NetworkUnusable(f"cannot start {spec.name}: there is no libvirt network named {spec.bridge.network}",
                                  vm=spec.name)

    def restore(self, name: str) -> None:
        with self._lock:
            dom = self._get("restore", name)
            if not dom.saved:
                raise IllegalTransition(f"{name} has no saved state to restore", vm=name)
            self._attachable(dom.spec)
            dom.state, dom.saved = DomainState.RUNNING, False

    def suspend_to_disk(self, name: str) -> None:
        with self._lock:
            dom = self._get("suspend_to_disk", name)
            if dom.state not in (DomainState.RUNNING, DomainState.PAUSED):
                raise IllegalTransition(f"cannot suspend {name}: it is not running", vm=name)
            dom.state, dom.saved = DomainState.SHUT_OFF, True

    def discard_saved_state(self, name: str) -> None:
        with self._lock:
            self._get("discard_saved_state", name).saved = False

    def save_to(self, name: str, path: Path) -> None:
        """Like `LibvirtHypervisor.save_to`: the file holds the domain's definition (pickled: a fake's own file)."""
        with self._lock:
            dom = self._get("save_to", name)
            if dom.state not in (DomainState.RUNNING, DomainState.PAUSED):
                raise IllegalTransition(f"cannot save {name}: it is not running", vm=name)
            path.write_bytes(b"fake saved state\n" + pickle.dumps(dom.spec))
            dom.state = DomainState.SHUT_OFF

    def restore_from(self, path: Path) -> str:
        with self._lock:
            self._enter("restore_from", path.name)
            spec: DomainSpec = pickle.loads(path.read_bytes().split(b"\n", 1)[1])  # the fake's own file
            dom = self.domains.get(spec.name)
            if dom is not None and dom.state is not DomainState.SHUT_OFF:
                raise IllegalTransition(f"{spec.name} is running here: it cannot be restored here too", vm=spec.name)
            self._attachable(spec)
            if dom is None:
                dom = self.domains[spec.name] = _Domain(spec=spec, layers=[spec.disk])
            dom.spec, dom.state, dom.saved = spec, DomainState.RUNNING, False
            dom.restores += 1
            return spec.name

    def allocated_mib(self) -> int:
        with self._lock:
            self._enter("allocated_mib", "*")
            return sum(d.spec.memory_mib for d in self.domains.values() if d.state is not DomainState.SHUT_OFF)

    def free_mib(self) -> int | None:
        with self._lock:
            self._enter("free_mib", "*")
            return self.host_free_mib

    def pause(self, name: str) -> None:
        with self._lock:
            dom = self._get("pause", name)
            if dom.state is not DomainState.RUNNING:
                raise IllegalTransition(f"cannot pause {name}: it is not running", vm=name)
            dom.state = DomainState.PAUSED

    def resume(self, name: str) -> None:
        with self._lock:
            dom = self._get("resume", name)
            if dom.state is not DomainState.PAUSED:
                raise IllegalTransition(f"cannot resume {name}: it is not paused", vm=name)
            dom.state = DomainState.RUNNING

    def destroy(self, name: str) -> None:
        with self._lock:
            self._get("destroy", name).state = DomainState.SHUT_OFF

    def undefine(self, name: str) -> None:
        with self._lock:
            self._get("undefine", name)
            del self.domains[name]

    def state(self, name: str) -> DomainState:
        with self._lock:
            return self._get("state", name).state

    def has_saved_state(self, name: str) -> bool:
        with self._lock:
            return self._get("has_saved_state", name).saved

    def memory_bytes(self, name: str) -> int:
        with self._lock:
            dom = self._get("memory_bytes", name)
            return dom.spec.memory_mib * self._per_mib if dom.state is not DomainState.SHUT_OFF else 0

    def boots(self, name: str) -> int:
        """How many cold boots the domain had (a restore is not a boot)."""
        return self.domains[name].boots

    def top_layer(self, name: str) -> Path:
        return self.domains[name].layers[-1]

    def snapshots(self, name: str) -> list[SnapshotInfo]:
        with self._lock:
            return list(self._get("snapshots", name).snapshots)

    def snapshot_create(self, name: str, snapshot: str, overlay: Path) -> SnapshotInfo:
        with self._lock:
            dom = self._get("snapshot_create", name)
            if dom.saved:
                raise IllegalTransition(f"{name} is suspended: restore it before taking a snapshot", vm=name)
            if overlay.exists() or any(s.name == snapshot for s in dom.snapshots):
                raise IllegalTransition(f"{name} already has a snapshot named {snapshot}", vm=name)
            info = SnapshotInfo(name=snapshot, frozen=dom.layers[-1], overlay=overlay)
            overlay.write_text(f"fake qcow2 backing={info.frozen}\n")
            dom.layers.append(overlay)
            dom.snapshots.append(info)
            return info

    def snapshot_revert(self, name: str, snapshot: str) -> None:
        with self._lock:
            dom = self._get("snapshot_revert", name)
            index = next((i for i, s in enumerate(dom.snapshots) if s.name == snapshot), None)
            if index is None:
                raise SnapshotNotFound(f"{name} has no snapshot named {snapshot}", vm=name)
            target = dom.snapshots[index]
            dom.state, dom.saved = DomainState.SHUT_OFF, False
            keep = dom.layers.index(target.frozen) + 1
            for layer in dom.layers[keep:]:
                layer.unlink(missing_ok=True)
            target.overlay.write_text(f"fake qcow2 backing={target.frozen}\n")
            dom.layers = [*dom.layers[:keep], target.overlay]
            dom.snapshots = dom.snapshots[: index + 1]

    def snapshot_delete(self, name: str, snapshot: str) -> None:
        """Like libvirt 9.0: the snapshot's overlay is merged into the layer below and its file removed."""
        with self._lock:
            dom = self._get("snapshot_delete", name)
            if dom.saved:
                raise IllegalTransition(f"{name} is suspended: restore it before deleting a snapshot", vm=name)
            index = next((i for i, s in enumerate(dom.snapshots) if s.name == snapshot), None)
            if index is None:
                raise SnapshotNotFound(f"{name} has no snapshot named {snapshot}", vm=name)
            target = dom.snapshots.pop(index)
            dom.layers.remove(target.overlay)
            target.overlay.unlink(missing_ok=True)
            if index < len(dom.snapshots):  # the next snapshot froze the merged layer
                later = dom.snapshots[index]
                dom.snapshots[index] = SnapshotInfo(name=later.name, frozen=target.frozen, overlay=later.overlay)

    def network(self, name: str) -> NetworkInfo:
        with self._lock:
            self._enter("network", name)
            if name not in self.networks:
                raise NetworkUnusable(f"there is no libvirt network named {name}")
            return NetworkInfo(name=name, host=self.networks[name],
                               reserved=frozenset(self.reservations.get(name, {}).values()),
                               leased=frozenset(self.leases.get(name, {})),
                               bridge_mac=self.network_macs.get(name))

    def reserve_address(self, place: BridgePlace, host_name: str) -> None:
        with self._lock:
            self._enter("reserve_address", host_name)
            reserved = self.reservations.setdefault(place.network, {})
            if place.mac in reserved or place.address in reserved.values():
                raise NetworkUnusable(f"{place.address} or {place.mac} is already reserved on {place.network}")
            reserved[place.mac] = place.address

    def release_address(self, place: BridgePlace) -> None:
        with self._lock:
            self._enter("release_address", place.mac)
            self.reservations.get(place.network, {}).pop(place.mac, None)


class FakeDisks:
    """qcow2 stand-ins: small text files naming their backing file and virtual size."""

    def __init__(self, *, base_size: int = 2 * 1024**3) -> None:
        self.base_size = base_size

    def create_overlay(self, path: Path, *, backing: Path, size_bytes: int | None = None) -> None:
        if not backing.is_file():
            raise ImageMissing(f"the base image {backing} does not exist: build it with `wakeful image build`")
        size = size_bytes if size_bytes is not None else self.virtual_size(backing)
        path.write_text(f"fake qcow2 backing={backing} size={size}\n")

    def _fields(self, path: Path) -> dict[str, str]:
        text = path.read_text(errors="replace") if path.is_file() else ""
        if not text.startswith("fake qcow2"):
            return {}
        return dict(word.split("=", 1) for word in text.split() if "=" in word)

    def virtual_size(self, path: Path) -> int:
        fields = self._fields(path)
        if "size" in fields:
            return int(fields["size"])
        return self.virtual_size(Path(fields["backing"])) if "backing" in fields else self.base_size

    def backing_chain(self, path: Path) -> list[Path]:
        chain = [path]
        while "backing" in (fields := self._fields(chain[-1])):
            chain.append(Path(fields["backing"]))
        return chain
