"""What a tool computer hands back: observations with their refs, act results, and the timings of a connect or a
restore (`vm.toolcomputer.ToolComputer` makes them; they are plain values, safe to log and to store)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from wakeful.vm.browser import Tab
from wakeful.vm.guest import ClockSync
from wakeful.vm.observe import BumpReason, Observation, Surface

__all__ = ["ActResult", "ConnectTimings", "ObserveResult", "Outcome", "RefElement", "RestoreReport", "RestoreTimings"]

Outcome = Literal["done", "failed", "unknown"]


@dataclass(frozen=True, kw_only=True)
class RefElement:
    ref: str
    role: str
    name: str
    value: str | None = None
    states: tuple[str, ...] = ()
    level: int | None = None

    def line(self) -> str:
        parts = [f"[{self.ref}] {self.role}", f'"{self.name}"' if self.name else ""]
        if self.level is not None:
            parts.append(f"level={self.level}")
        if self.value is not None:
            parts.append(f'value="{self.value}"')
        parts.extend(self.states)
        return " ".join(p for p in parts if p)


@dataclass(frozen=True, kw_only=True)
class ObserveResult:
    observation: Observation
    title: str
    elements: tuple[RefElement, ...]
    tabs: tuple[Tab, ...]
    screenshot: bytes = field(repr=False)
    truncated: bool = False
    bumped: BumpReason | None = None
    """This observation found the screen changed (navigation, focus, resize) and started a new epoch."""

    def ref_for(self, role: str, name: str) -> str:
        """The ref of the first element with this role and name (KeyError if none): for scripts and tests."""
        for e in self.elements:
            if e.role == role and e.name == name:
                return e.ref
        raise KeyError(f"no {role} named {name!r} in observation {self.observation.number}")

    def text(self) -> str:
        """The observation as the agent reads it."""
        o = self.observation
        frame = f"{o.frame.width}×{o.frame.height}"
        head = f"observation {o.number} (epoch {o.epoch}) · {o.surface} · {frame}"
        if o.surface is Surface.BROWSER:
            head += f" · {o.view.url} · {self.title!r} · tab {o.tab_id} of {len(self.tabs)}"
        else:
            head += f" · focused window {self.title!r}"
        lines = [head, *(e.line() for e in self.elements)]
        if self.truncated:
            lines.append("… more elements not shown; scroll or narrow the page")
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class ActResult:
    """What an accepted act did, small and typed for the ledger."""

    kind: str
    outcome: Outcome
    observation: int
    epoch: int
    ref: str | None = None
    role: str | None = None
    name: str | None = None
    may_have_changed_page: bool = True
    navigated: bool = False
    code: str | None = None
    """The error code when the outcome is not `done`."""
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class ConnectTimings:
    """Seconds from the start of `connect` until SSH answered, and until the browser was attached."""

    ssh: float
    cdp: float | None


@dataclass(frozen=True, kw_only=True)
class RestoreTimings:
    """Seconds per step of `after_restore`; SSH and CDP reconnect run in parallel, so total < their sum."""

    ssh_reconnect: float
    """0 when the connections were kept."""
    clock: float | None
    """None when the resync was left to run beside the next observation (`after_restore(observe=False)`)."""
    cdp_reconnect: float | None
    first_observation: float | None
    total: float
    probe: float = 0.0
    """The round trip that asked whether the SSH transport outlived the restore."""
    kept: bool = False
    """It did (an isolated network): SSH, and CDP through it, were kept rather than made again."""
    side_door: bool = False
    """Under user-mode networking with the guest's clock keeper listening at its side door: CDP and the clock went
    through it, and SSH is made again after the first observation, off the path (`ssh_reconnect` is 0 then, and
    `ToolComputer.wait_for_ssh` says how long it took)."""


@dataclass(frozen=True, kw_only=True)
class RestoreReport:
    timings: RestoreTimings
    clock_sync: ClockSync | None
    """None when the resync was left to run beside the next observation: `ToolComputer.clock_sync` has it then."""
    epoch: int
    observation: ObserveResult | None = None
