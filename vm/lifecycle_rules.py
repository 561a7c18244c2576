"""The tool-computer lifecycle as data: states, the one transition table, idle rules, limits, port choice.

Pure functions of their arguments and `now`; `vm.lifecycle.VmManager` is the shell that does the I/O.

    provisioned ──start──▶ running ──suspend──▶ suspended ──restore──▶ running
         ▲                    │                     │
         └──────stop──────────┴─────────────────────┘      (stop: hard stop, or a snapshot revert)
    provisioned / running / suspended ──destroy──▶ destroyed
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from wakeful.vm.errors import IllegalTransition, LimitExceeded, NetworkUnusable

__all__ = [
    "TRANSITIONS",
    "Activity",
    "ActivityKind",
    "Limits",
    "Op",
    "VmSize",
    "VmState",
    "check_limits",
    "is_idle",
    "next_state",
    "pick_address",
    "pick_ports",
    "reap_candidates",
]


class VmState(StrEnum):
    PROVISIONED = "provisioned"
    RUNNING = "running"
    SUSPENDED = "suspended"
    DESTROYED = "destroyed"


class Op(StrEnum):
    START = "start"
    SUSPEND = "suspend"
    RESTORE = "restore"
    STOP = "stop"
    DESTROY = "destroy"


TRANSITIONS: dict[Op, tuple[frozenset[VmState], VmState]] = {
    Op.START: (frozenset({VmState.PROVISIONED}), VmState.RUNNING),
    Op.SUSPEND: (frozenset({VmState.RUNNING}), VmState.SUSPENDED),
    Op.RESTORE: (frozenset({VmState.SUSPENDED}), VmState.RUNNING),
    Op.STOP: (frozenset({VmState.RUNNING, VmState.SUSPENDED}), VmState.PROVISIONED),
    Op.DESTROY: (frozenset({VmState.PROVISIONED, VmState.RUNNING, VmState.SUSPENDED}), VmState.DESTROYED),
}


def next_state(state: VmState, op: Op, *, vm: str | None = None) -> VmState:
    sources, target = TRANSITIONS[op]
    if state not in sources:
        allowed = ", ".join(sorted(sources))
        raise IllegalTransition(f"cannot {op} a VM that is {state} (only from: {allowed})", vm=vm)
    return target


class ActivityKind(StrEnum):
    OBSERVE = "observe"
    ACT = "act"
    HANDOFF = "handoff"
    LIVE_VIEW = "live_view"


@dataclass(frozen=True, kw_only=True)
class Activity:
    in_flight: int = 0
    """Activities (observe, act, handoff, live view) that started and have not ended."""
    last_ended: datetime | None = None
    """When the last activity ended (or the VM last came up, if nothing ran since)."""

    def begin(self) -> Activity:
        return Activity(in_flight=self.in_flight + 1, last_ended=self.last_ended)

    def end(self, now: datetime) -> Activity:
        return Activity(in_flight=max(0, self.in_flight - 1), last_ended=now)


def is_idle(activity: Activity, now: datetime, idle_after: timedelta) -> bool:
    """Idle only when nothing is in flight and the last activity ended more than `idle_after` ago."""
    if activity.in_flight > 0:
        return False
    return activity.last_ended is None or now - activity.last_ended > idle_after


def reap_candidates(vms: dict[str, tuple[VmState, Activity]], now: datetime, idle_after: timedelta) -> list[str]:
    """Running VMs the reaper should suspend, in a stable order."""
    return sorted(name for name, (state, activity) in vms.items()
                  if state is VmState.RUNNING and is_idle(activity, now, idle_after))


@dataclass(frozen=True, kw_only=True)
class VmSize:
    memory_mib: int
    vcpus: int
    disk_gib: int
    """Virtual size of the user's overlay disk (what the guest can fill), not its current size on the host."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_memory_mib: int = 4096
    max_vcpus: int = 2
    max_disk_gib: int = 32


def check_limits(size: VmSize, limits: Limits, *, vm: str | None = None) -> None:
    problems = []
    if not 128 <= size.memory_mib <= limits.max_memory_mib:
        problems.append(f"RAM {size.memory_mib} MiB (allowed 128–{limits.max_memory_mib} MiB)")
    if not 1 <= size.vcpus <= limits.max_vcpus:
        problems.append(f"{size.vcpus} vCPUs (allowed 1–{limits.max_vcpus})")
    if not 1 <= size.disk_gib <= limits.max_disk_gib:
        problems.append(f"disk {size.disk_gib} GiB (allowed 1–{limits.max_disk_gib} GiB)")
    if problems:
        raise LimitExceeded("over the per-user limit: " + "; ".join(problems), vm=vm)


def pick_ports(count: int, *, used: Collection[int], port_range: tuple[int, int],
               is_free: Callable[[int], bool]) -> list[int]:
    """The lowest `count` ports in the inclusive range that no VM holds and nothing else listens on."""
    low, high = port_range
    chosen: list[int] = []
    for port in range(low, high + 1):
        if port not in used and is_free(port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise LimitExceeded(f"no {count} free 127.0.0.1 ports left in {low}–{high}; widen the port range")


def pick_address(host: ipaddress.IPv4Interface, *, taken: Collection[str]) -> str:
    """The lowest address of the host's network that is neither the host's own, nor its network or broadcast
    address, nor `taken` (reserved or leased on the network, or held by a VM)."""
    for candidate in host.network.hosts():
        if candidate != host.ip and str(candidate) not in taken:
            return str(candidate)
    raise NetworkUnusable(f"no free address left on {host.network}; use a larger network for tool computers")
