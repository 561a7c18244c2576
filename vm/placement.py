"""Where a tool computer runs among several hosts: the rules, as pure functions of each host's load.

    place(loads, need_mib, home=...)  → the host's name, or NoHostAvailable / HostsBusy

A computer goes back to its own host (`home`) while that host can take it; otherwise to the reachable host marked
`up` with the most free memory (its capacity less the memory of the domains running there, bounded by what the
host itself reports free) that is under its cap of arrivals (restores and cold boots) in flight. A running computer
is never moved: placement happens only when one is started or restored. `vm.hosts.HostFleet` is the shell that
measures the loads and acts on the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from wakeful.vm.errors import HostsBusy, NoHostAvailable

__all__ = ["HostLoad", "HostMark", "HostSpec", "place"]


class HostMark(StrEnum):
    """What the operator says about a host."""

    UP = "up"
    """Takes computers."""
    FULL = "full"
    """Takes no computer that is not running there already (draining for maintenance, or kept for others)."""
    GONE = "gone"
    """Treated as unreachable: nothing is placed there, and computers saved from it resume elsewhere."""


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """One KVM host of the registry (`computer_hosts` in the settings)."""

    name: str
    """A short name for logs and errors."""
    uri: str
    """Its libvirt connection, e.g. `qemu+ssh://root@kvm2/system`."""
    memory_mib: int
    """Memory tool computers may take there in all (the rest is the host's own)."""
    max_restores: int = 2
    """Restores and cold boots in flight there at once; more wait (they all contend for the same CPUs and disk)."""
    mark: HostMark = HostMark.UP


@dataclass(frozen=True, kw_only=True)
class HostLoad:
    """One host as measured just before a placement."""

    name: str
    capacity_mib: int
    allocated_mib: int
    """Memory of the domains running there now, and of those arriving."""
    free_mib: int | None
    """What the host itself reports free, when it reports it."""
    arriving: int
    """Restores and cold boots in flight there."""
    max_arriving: int
    mark: HostMark
    reachable: bool
    failed: str = ""
    """Why this computer's start or restore there failed moments ago ("" if it did not): that arrival tries the
    other hosts."""

    @property
    def room_mib(self) -> int:
        room = self.capacity_mib - self.allocated_mib
        return room if self.free_mib is None else min(room, self.free_mib)

    def why_not(self, need_mib: int) -> str | None:
        """Why this host cannot take `need_mib` now (None: it can, cap aside)."""
        if self.failed:
            return self.failed
        if not self.reachable or self.mark is HostMark.GONE:
            return "unreachable" if not self.reachable else "marked gone"
        if self.mark is HostMark.FULL:
            return "marked full"
        if self.room_mib < need_mib:
            return f"{max(self.room_mib, 0)} MiB free"
        return None


def place(loads: Sequence[HostLoad], need_mib: int, *, home: str | None) -> str:
    """The host a computer needing `need_mib` starts or restores on. `home` (where it ran last) wins while it can
    take it; else the most free memory, ties by name. Raises `HostsBusy` when the hosts with room are all at their
    cap of arrivals (wait and ask again), `NoHostAvailable` when none has room."""
    fits = [h for h in loads if h.why_not(need_mib) is None]
    if not fits:
        reasons = "; ".join(f"{h.name}: {h.why_not(need_mib)}" for h in sorted(loads, key=lambda h: h.name))
        raise NoHostAvailable(f"no tool-computer host can take {need_mib} MiB now ({reasons or 'no hosts'}): "
                              "free memory, mark a host up, or add one to computer_hosts")
    open_ = [h for h in fits if h.arriving < h.max_arriving]
    if not open_:
        raise HostsBusy(f"every host with room for {need_mib} MiB is at its cap of restores in flight "
                        f"({', '.join(sorted(h.name for h in fits))}); try again in a moment")
    for h in open_:
        if h.name == home:
            return h.name
    return min(open_, key=lambda h: (-h.room_mib, h.name)).name
