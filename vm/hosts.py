"""Tool computers on several KVM hosts: `HostFleet`, one `Hypervisor` over many libvirt connections.

    fleet = HostFleet([Host(spec=HostSpec(name="a", uri=..., memory_mib=16384), hypervisor=LibvirtHypervisor(...)),
                       Host(spec=HostSpec(name="b", ...), hypervisor=...)], shared=Path("/srv/wakeful-shared"))
    VmManager(VmSettings(data_dir=shared, ...), fleet)   # the manager does not know there are several hosts

What it does that one host does not:

* a domain is defined on every reachable host (defining costs no memory), and runs on one, its *home*;
  a running computer is never moved;
* a suspend saves memory to `<shared>/saved/<domain>.save` — a directory every host sees (NFS in production) —
  instead of libvirt's per-host managed save, so any host can restore it; `has_saved_state` is that file;
* start and restore ask `vm.placement.place` for the host: the home while it has room and is not marked full or
  gone, else the host with most free memory; at most `max_restores` arrivals in flight per host (more wait up to
  `busy_wait`, then `HostsBusy`);
* a restore elsewhere takes the definition from the saved image itself: the same UUID, disk overlay, seed disk
  (SSH host key), forwards and proxy credential — the VM's identity follows it, because all of it lives in the
  shared directory and the image, never on a host;
* a host other than the api's own is reached over SSH (`Host.link`, a `vm.host_tunnel.HostTunnel`): the guest
  channel's socket is a channel through it (`open_to`), and a host whose link cannot be made counts as gone (the
  tunnel keeps itself up between uses, and closes itself when the host stops answering);
* a host that does not answer counts as gone: a computer that was running there is lost to its last saved state
  (or boots cold from its disk); one saved from it resumes elsewhere;
* on an isolated network a computer's DHCP reservation is made on every host that answers, and again on a host it
  arrives on that lacks it (one that did not answer as the computer was made); a new computer's address is one no
  host reserves or still leases.

Homes, each domain's memory and its place on a network persist in `<shared>/placement.json`. Snapshots and reverts
act on the home only. An operator's marks (`wakeful hosts mark`, `write_mark`) persist in `<shared>/marks.json`,
which the fleet reads again whenever it changed, before each placement: they override each host's `mark` setting.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, TypeVar

from wakeful.vm.errors import (
    HostsBusy,
    HypervisorUnavailable,
    IllegalTransition,
    NetworkUnusable,
    VmError,
    VmNotFound,
)
from wakeful.vm.hypervisor import BridgePlace, DomainSpec, DomainState, Hypervisor, NetworkInfo, SnapshotInfo
from wakeful.vm.placement import HostLoad, HostMark, HostSpec, place

__all__ = ["MARKS_FILE", "Host", "HostFleet", "HostHypervisor", "HostLink", "read_marks", "write_mark"]

log = logging.getLogger("wakeful.vm")

T = TypeVar("T")

MARKS_FILE = "marks.json"
"""In the shared directory: the operator's marks, by host name (`write_mark`)."""


def read_marks(shared: Path) -> dict[str, HostMark]:
    """The marks written by `write_mark` in `shared`, by host name (none if nobody marked a host yet)."""
    try:
        data = json.loads((shared / MARKS_FILE).read_text())
    except FileNotFoundError:
        return {}
    return {host: HostMark(mark) for host, mark in data["marks"].items()}


def write_mark(shared: Path, host: str, mark: HostMark) -> None:
    """Mark a host in `shared`'s marks file, which every fleet on that directory reads before its next placement
    (`wakeful hosts mark`): it overrides the host's `mark` setting until marked again."""
    _write_json(shared / MARKS_FILE, {"version": 1, "marks": dict(sorted((read_marks(shared) | {host: mark}).items()))})


def _write_json(path: Path, data: object) -> None:
    """Replace `path` with `data` as JSON, durably: a reader sees the old file or the new one, never half of one."""
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    with staging.open("w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    staging.replace(path)


class HostHypervisor(Hypervisor, Protocol):
    """What the fleet needs of each host beyond `Hypervisor` (`LibvirtHypervisor` and `FakeHypervisor` have it)."""

    def save_to(self, name: str, path: Path) -> None:
        """Save memory to `path` and end the QEMU process, leaving no per-host saved state."""
        ...

    def restore_from(self, path: Path) -> str:
        """Define the domain saved in `path` from the image's own definition and start it; its name."""
        ...

    def allocated_mib(self) -> int:
        """Memory of all domains running on the host."""
        ...

    def free_mib(self) -> int | None:
        """Free memory the host reports, if it does."""
        ...


class HostLink(Protocol):
    """How the api reaches a host's loopback (`vm.host_tunnel.HostTunnel`; a fake in unit tests)."""

    def ensure(self) -> None:
        """Make the link unless it is up; raises a `VmError` (`host_unreachable`…) when it cannot."""
        ...

    def open(self, address: tuple[str, int], *, timeout: float | None = None) -> object:
        """A socket-like channel to `address` on the host's side."""
        ...


@dataclass(frozen=True, kw_only=True)
class Host:
    spec: HostSpec
    hypervisor: HostHypervisor
    link: HostLink | None = None
    """None for the api's own host: its loopback is ours."""


@dataclass(frozen=True, kw_only=True)
class _Placement:
    host: str
    memory_mib: int
    bridge: BridgePlace | None = None
    """Its place on an isolated network: reserved again on a host it arrives on that lacks the reservation."""


class HostFleet:
    """`Hypervisor` over several hosts with saved state on shared storage (see the module docstring)."""

    def __init__(self, hosts: Sequence[Host], shared: Path, *, busy_wait: float = 120.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not hosts:
            raise ValueError("a fleet needs at least one host")
        if len({h.spec.name for h in hosts}) != len(hosts):
            raise ValueError("host names must be unique")
        self._hosts = {h.spec.name: h for h in hosts}
        self._set_marks = {h.spec.name: h.spec.mark for h in hosts}  # as the settings say
        self._marks = dict(self._set_marks)
        self._marks_file = shared.resolve() / MARKS_FILE
        self._marks_read: tuple[int, int, int] | None = None  # the marks file's (inode, mtime, size) when last read
        self._saved_dir = shared.resolve() / "saved"
        try:
            self._saved_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise HypervisorUnavailable(f"the shared directory {shared} is not usable ({exc.strerror}): mount it "
                                        "at that path on this machine and every tool-computer host") from None
        self._placements_file = shared.resolve() / "placement.json"
        self._busy_wait = busy_wait
        self._monotonic = monotonic
        self._specs: dict[str, DomainSpec] = {}
        self._arriving: Counter[str] = Counter()
        self._arriving_mib: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._placements: dict[str, _Placement] = {}
        if self._placements_file.exists():
            data = json.loads(self._placements_file.read_text())
            self._placements = {name: _Placement(host=p["host"], memory_mib=p["memory_mib"],
                                                 bridge=BridgePlace(**p["bridge"]) if p.get("bridge") else None)
                                for name, p in data["placements"].items()}
        self._read_marks()

    # ------------------------------------------------------------------------------------------ the fleet itself

    def hosts(self) -> list[HostSpec]:
        self._read_marks()
        return [replace(h.spec, mark=self._marks[name]) for name, h in self._hosts.items()]

    def mark(self, host: str, mark: HostMark) -> None:
        """Mark a host up, full (takes nothing new) or gone (treated as unreachable), in the marks file."""
        if host not in self._hosts:
            raise VmNotFound(f"there is no tool-computer host named {host}")
        write_mark(self._marks_file.parent, host, mark)
        self._read_marks(again=True)

    def _read_marks(self, *, again: bool = False) -> None:
        """The settings' marks, overridden by the marks file's when it changed since it was last read (each write
        replaces the file: a new inode), or `again`."""
        try:
            st = self._marks_file.stat()
            changed: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            changed = None
        if changed == self._marks_read and not again:
            return
        try:
            written: dict[str, HostMark] | None = read_marks(self._marks_file.parent)
        except (OSError, ValueError, KeyError) as exc:  # edited by hand, wrongly: placement goes on as it was
            log.warning("the marks in %s cannot be read (%s): the hosts keep the marks they had", self._marks_file, exc)
            written = None
        with self._cond:
            if written is not None:
                self._marks = self._set_marks | {h: m for h, m in written.items() if h in self._hosts}
            self._marks_read = changed
            self._cond.notify_all()  # an arrival waiting for room may find it on a host marked up

    def home(self, name: str) -> str | None:
        """The host the domain runs on, or last ran on."""
        with self._cond:
            placement = self._placements.get(name)
        return placement.host if placement else None

    def saved_path(self, name: str) -> Path:
        return self._saved_dir / f"{name}.save"

    def loads(self) -> list[HostLoad]:
        """Each host as it is now (asks every host; one that does not answer is unreachable)."""
        self._read_marks()
        loads = []
        for name, host in self._hosts.items():
            reachable, allocated, free = True, 0, None
            if self._marks[name] is not HostMark.GONE:
                try:
                    allocated, free = host.hypervisor.allocated_mib(), host.hypervisor.free_mib()
                except HypervisorUnavailable:
                    reachable = False
                if reachable and not self._linked(name):
                    reachable = False
            with self._cond:
                arriving, arriving_mib = self._arriving[name], self._arriving_mib[name]
            loads.append(HostLoad(name=name, capacity_mib=host.spec.memory_mib, allocated_mib=allocated + arriving_mib,
                                  free_mib=None if free is None else free - arriving_mib, arriving=arriving,
                                  max_arriving=host.spec.max_restores, mark=self._marks[name], reachable=reachable))
        return loads

    def _linked(self, name: str) -> bool:
        """Whether the api reaches the host's loopback (always on its own host)."""
        link = self._hosts[name].link
        if link is None:
            return True
        try:
            link.ensure()
        except VmError as exc:
            log.warning("tool-computer host %s is unreachable (%s): %s", name, exc.code, exc.message)
            return False
        return True

    def open_to(self, name: str, address: tuple[str, int], *, timeout: float | None = None) -> object | None:
        """A channel to `address` on the loopback of the host the domain runs on, or None when that is the api's
        own host (connect directly). Raises `host_unreachable` (or the link's own code) when it cannot be reached."""
        home = self.home(name)
        if home is None:
            raise VmNotFound(f"there is no VM named {name} on any host", vm=name)
        link = self._hosts[home].link
        return None if link is None else link.open(address, timeout=timeout)

    def _save_placements(self) -> None:
        _write_json(self._placements_file, {"version": 1, "placements": {
            n: {"host": p.host, "memory_mib": p.memory_mib, **({"bridge": vars(p.bridge)} if p.bridge else {})}
            for n, p in sorted(self._placements.items())}})

    def _set_home(self, name: str, host: str, memory_mib: int, bridge: BridgePlace | None = None) -> None:
        """Record the domain's home (and its memory; its place on a network when given, else the one recorded)."""
        with self._cond:
            known = self._placements.get(name)
            self._placements[name] = _Placement(host=host, memory_mib=memory_mib,
                                                bridge=bridge or (known.bridge if known else None))
            self._save_placements()

    def _reserved_on(self, name: str, host: str) -> None:
        """Before the domain runs on `host`, other than its last: its DHCP reservation there, when that host did not
        answer as it was made. Its guest keeps its address without one until its DHCP client renews the lease; the
        host's server, with no reservation and no range, then refuses, and the guest drops the address the egress
        proxy knows it by."""
        with self._cond:
            placement = self._placements.get(name)
        place = placement.bridge if placement is not None else None
        if place is None:
            return
        hv = self._hosts[host].hypervisor
        if place.address not in hv.network(place.network).reserved:
            log.info("reserving %s (%s) on %s for %s, which it lacked", place.address, place.mac, host, name)
            hv.reserve_address(place, host_name=name)

    @contextmanager
    def _arrival(self, name: str, *, failed: Mapping[str, str]) -> Iterator[str]:
        """Choose a host for the domain to start or restore on, and count it arriving there for the block. `failed`:
        why this very arrival failed on hosts it tried (they are not chosen again)."""
        with self._cond:
            placement = self._placements.get(name)
        if placement is None:
            raise VmNotFound(f"there is no VM named {name} on any host", vm=name)
        deadline = self._monotonic() + self._busy_wait
        while True:
            measured = self.loads()
            with self._cond:
                loads = [replace(h, arriving=self._arriving[h.name], failed=failed.get(h.name, "")) for h in measured]
                try:
                    host = place(loads, placement.memory_mib, home=placement.host)
                except HostsBusy:
                    remaining = deadline - self._monotonic()
                    if remaining <= 0:
                        raise
                    self._cond.wait(min(remaining, 1.0))
                    continue
                self._arriving[host] += 1
                self._arriving_mib[host] += placement.memory_mib
                break
        try:
            yield host
        finally:
            with self._cond:
                self._arriving[host] -= 1
                self._arriving_mib[host] -= placement.memory_mib
                self._cond.notify_all()

    def _on_home(self, name: str) -> HostHypervisor:
        home = self.home(name)
        if home is None:
            raise VmNotFound(f"there is no VM named {name} on any host", vm=name)
        return self._hosts[home].hypervisor

    def _each_reachable(self, call: Callable[[HostHypervisor], T]) -> list[T]:
        """`call` on every host not marked gone; hosts that do not answer are skipped."""
        return list(self._by_reachable_host(call).values())

    def _by_reachable_host(self, call: Callable[[HostHypervisor], T]) -> dict[str, T]:
        """`call`'s result by host name, as `_each_reachable`."""
        results = {}
        for name, host in self._hosts.items():
            if self._marks[name] is HostMark.GONE:
                continue
            try:
                results[name] = call(host.hypervisor)
            except HypervisorUnavailable as exc:
                log.warning("tool-computer host %s does not answer: %s", name, exc.message)
        return results

    # ------------------------------------------------------------------------------------------ Hypervisor

    def define(self, spec: DomainSpec) -> None:
        self._specs[spec.name] = spec
        defined: list[str] = []
        for name, host in self._hosts.items():
            if self._marks[name] is HostMark.GONE:
                continue
            try:
                host.hypervisor.define(spec)
                defined.append(name)
            except HypervisorUnavailable as exc:
                log.warning("tool-computer host %s does not answer: %s", name, exc.message)
        if not defined:
            raise HypervisorUnavailable(f"no tool-computer host answers to define {spec.name}", vm=spec.name)
        home = self.home(spec.name)
        if home is None or home not in defined:
            # A host that could take it now (not marked full, with room) before one that could not, as `place` ranks.
            loads = [h for h in self.loads() if h.name in defined]
            home = min(loads, key=lambda h: (h.why_not(spec.memory_mib) is not None, -h.room_mib, h.name)).name
        self._set_home(spec.name, home, spec.memory_mib, spec.bridge)

    def names(self) -> list[str]:
        return sorted({n for names in self._each_reachable(lambda hv: hv.names()) for n in names})

    def start(self, name: str) -> None:
        if self.has_saved_state(name):
            raise IllegalTransition(f"{name} has a saved state: restore it, or discard the state to boot cold", vm=name)

        def boot(hv: HostHypervisor, host: str) -> None:
            if name not in hv.names():
                spec = self._specs.get(name)
                if spec is None:
                    raise VmNotFound(f"{name} is not defined on {host}", vm=name)
                hv.define(spec)
            hv.start(name)
        self._arrive(name, boot)

    def restore(self, name: str) -> None:
        saved = self.saved_path(name)
        if not saved.exists():
            raise IllegalTransition(f"{name} has no saved state to restore", vm=name)
        self._arrive(name, lambda hv, _host: hv.restore_from(saved))
        saved.unlink()

    def _arrive(self, name: str, run: Callable[[HostHypervisor, str], object]) -> None:
        """Start or restore the domain (`run`) on the host placement chooses, which becomes its home. A host where
        that fails for the host's sake (it stopped answering since it was measured, or it lacks the computer's
        network) is left for the next; once none is left, `NoHostAvailable` says what each one lacked."""
        failed: dict[str, str] = {}
        previous = self.home(name)
        while True:
            with self._arrival(name, failed=failed) as host:
                try:
                    if host != previous:
                        self._reserved_on(name, host)
                    run(self._hosts[host].hypervisor, host)
                except (HypervisorUnavailable, NetworkUnusable) as exc:
                    log.warning("could not start or restore %s on %s: %s", name, host, exc.message)
                    failed[host] = exc.message
                    continue
                self._set_home(name, host, self._memory(name))
                if previous != host:
                    log.info("tool computer %s runs on %s (it was on %s)", name, host, previous)
                return

    def _memory(self, name: str) -> int:
        with self._cond:
            return self._placements[name].memory_mib

    def suspend_to_disk(self, name: str) -> None:
        saved = self.saved_path(name)
        partial = saved.with_name(saved.name + ".partial")  # a restore never sees half a file
        partial.unlink(missing_ok=True)
        self._on_home(name).save_to(name, partial)
        partial.replace(saved)

    def discard_saved_state(self, name: str) -> None:
        self.saved_path(name).unlink(missing_ok=True)

    def pause(self, name: str) -> None:
        self._on_home(name).pause(name)

    def resume(self, name: str) -> None:
        self._on_home(name).resume(name)

    def destroy(self, name: str) -> None:
        self._on_home(name).destroy(name)

    def undefine(self, name: str) -> None:
        def drop(hv: HostHypervisor) -> None:
            try:
                hv.undefine(name)
            except VmNotFound:
                pass

        if not self._each_reachable(drop) and self.home(name) is not None:
            raise HypervisorUnavailable(f"no tool-computer host answers to remove {name}", vm=name)
        self.discard_saved_state(name)
        with self._cond:
            self._placements.pop(name, None)
            self._save_placements()
        self._specs.pop(name, None)

    def state(self, name: str) -> DomainState:
        """The domain's state on its home; shut off when the home does not answer (its memory is lost there)."""
        hv = self._on_home(name)
        try:
            return hv.state(name)
        except HypervisorUnavailable:
            return DomainState.SHUT_OFF

    def has_saved_state(self, name: str) -> bool:
        if self.home(name) is None:
            raise VmNotFound(f"there is no VM named {name} on any host", vm=name)
        return self.saved_path(name).exists()

    def memory_bytes(self, name: str) -> int:
        return self._on_home(name).memory_bytes(name)

    def snapshot_create(self, name: str, snapshot: str, overlay: Path) -> SnapshotInfo:
        return self._on_home(name).snapshot_create(name, snapshot, overlay)

    def snapshot_revert(self, name: str, snapshot: str) -> None:
        self._on_home(name).snapshot_revert(name, snapshot)

    def snapshot_delete(self, name: str, snapshot: str) -> None:
        self._on_home(name).snapshot_delete(name, snapshot)

    def snapshots(self, name: str) -> list[SnapshotInfo]:
        return self._on_home(name).snapshots(name)

    def network(self, name: str) -> NetworkInfo:
        """The network as the first reachable host has it, with the addresses reserved or leased on any of them (a
        computer may resume on any host, and its DHCP client asks that host's server for its address). Every host
        needs it under that name with the same host address and bridge MAC: a computer that resumes on another host
        still looks for the egress proxy at that address, and its ARP cache still holds the MAC it last saw there."""
        networks = list(self._by_reachable_host(lambda hv: hv.network(name)).items())
        if not networks:
            raise HypervisorUnavailable("no tool-computer host answers")
        (first, network), others = networks[0], networks[1:]
        for host, other in others:
            if (other.host, other.bridge_mac) != (network.host, network.bridge_mac):
                raise NetworkUnusable(
                    f"the network {name} differs between hosts {first} (host address {network.host}, bridge MAC "
                    f"{network.bridge_mac}) and {host} ({other.host}, {other.bridge_mac}): define it on every host "
                    f"from the same XML, its <ip> and <mac address=...> included (virsh net-dumpxml {name} on "
                    f"{first})")
        return replace(network, reserved=frozenset().union(*(n.reserved for _, n in networks)),
                       leased=frozenset().union(*(n.leased for _, n in networks)))

    def reserve_address(self, place: BridgePlace, host_name: str) -> None:
        """On every reachable host, so the VM keeps its address wherever it resumes."""
        self._each_reachable(lambda hv: hv.reserve_address(place, host_name))

    def release_address(self, place: BridgePlace) -> None:
        self._each_reachable(lambda hv: hv.release_address(place))
