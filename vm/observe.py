"""Observe, then act — the pure rules (no I/O): observation epochs, server-issued refs and the control lease.

A tool computer is always in one of three phases, and every change goes through `TRANSITIONS`:

    phase        step            → phase       what else changes
    unobserved   observe         → observed    a new latest observation
    observed     observe         → observed    it replaces the latest one
    human        observe         → human       recorded, but acts stay refused until control returns
    observed     act (changing)  → unobserved  the observation is consumed
    observed     act (scroll)    → observed    refs stay bound to the same elements
    any          bump            → unobserved  epoch + 1 (restore, navigation, focus change, resize)
                                   (human stays human)
    unobserved,  grant lease     → human       the human holds control
    observed
    human        return          → unobserved  epoch + 1 (explicit return or expiry)

An act is accepted only against the latest observation of the current epoch, for the same tab and frame
size (`check_act`). Refs are random strings minted here, never element ids, so they cannot be guessed or
carried from one observation to the next. Scroll is the one act that does not consume the observation:
refs name elements (not pixels), and scrolling does not change which element a ref names.

Every refusal is a `Refused` with a stable code:

    stale_observation     the ref or observation number is not the latest of the current epoch,
                          or the tab, page or frame changed since it was taken
    observation_required  there is no usable observation: none yet in this epoch, or the latest was consumed
                          by an act that may have changed the screen, or it was of the other surface
    human_in_control      the human holds the control lease
    outside_frame         desktop coordinates outside the observed screen
    wrong_target          the act does not fit the element (fill on a button, select on a link)
    unknown_tab           a tab act names a tab the observation did not list
    invalid_token, lease_expired, token_used    the human's one-time live-view token (`redeem_token`)

Observation epochs move on restore, handoff return or expiry, navigation, focus change (tab switch, another
window) and resize; the shell (vm.toolcomputer) notices the last three by comparing what it sees with the latest
observation (`view_change`). A step missing from `TRANSITIONS` raises `vm.errors.IllegalTransition`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum
from types import MappingProxyType
from typing import Any, ClassVar, Final, get_args

from wakeful.vm.errors import IllegalTransition

__all__ = [
    "ACT_KINDS",
    "TRANSITIONS",
    "Accepted",
    "Act",
    "BumpReason",
    "Capture",
    "Click",
    "CloseTab",
    "ComputerState",
    "DesktopClick",
    "DesktopKey",
    "DesktopType",
    "Element",
    "Fill",
    "FrameSize",
    "HandoffLease",
    "LeaseGrant",
    "Locator",
    "Navigate",
    "NewTab",
    "Observation",
    "Phase",
    "Press",
    "Refused",
    "Scroll",
    "Select",
    "Step",
    "Surface",
    "SwitchTab",
    "View",
    "act_consumes",
    "act_may_change_page",
    "bump_epoch",
    "check_act",
    "grant_lease",
    "new_ref",
    "record_act",
    "record_observation",
    "redeem_token",
    "return_control",
    "settle",
    "view_change",
]


# ---------------------------------------------------------------------------------------------------- values


class Surface(StrEnum):
    BROWSER = "browser"
    DESKTOP = "desktop"


class BumpReason(StrEnum):
    RESTORE = "restore"
    HANDOFF_RETURN = "handoff_return"
    HANDOFF_EXPIRED = "handoff_expired"
    NAVIGATION = "navigation"
    FOCUS_CHANGE = "focus_change"
    RESIZE = "resize"


@dataclass(frozen=True, kw_only=True)
class FrameSize:
    width: int
    height: int

    def contains(self, x: int, y: int) -> bool:
        return 0 <= x < self.width and 0 <= y < self.height


@dataclass(frozen=True, kw_only=True)
class Element:
    """One interesting node of an accessibility snapshot, as the browser reported it (before refs are issued)."""

    node: int
    """Chromium's backendDOMNodeId: stable for the life of the DOM node, never shown to the agent."""
    role: str
    name: str
    value: str | None = None
    states: tuple[str, ...] = ()
    """Flags that are set: focused, disabled, checked, expanded, selected, required, readonly ..."""
    level: int | None = None
    """Heading level, where there is one."""


@dataclass(frozen=True, kw_only=True)
class View:
    """What the screen shows right now, cheaply read: compared with the latest observation before each act."""

    surface: Surface
    frame: FrameSize
    tab_id: str | None = None
    url: str | None = None
    window: str | None = None
    """The focused desktop window's id (desktop surface)."""


@dataclass(frozen=True, kw_only=True)
class Capture:
    """What an observation saw, before refs are issued."""

    view: View
    title: str = ""
    tabs: tuple[str, ...] = ()
    elements: tuple[Element, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Locator:
    node: int
    role: str
    name: str


@dataclass(frozen=True, kw_only=True)
class Observation:
    vm_id: str
    epoch: int
    number: int
    """Monotonically increasing per tool computer, across epochs."""
    view: View
    refs: Mapping[str, Locator] = field(default_factory=dict)
    tabs: tuple[str, ...] = ()

    @property
    def surface(self) -> Surface:
        return self.view.surface

    @property
    def tab_id(self) -> str | None:
        return self.view.tab_id

    @property
    def frame(self) -> FrameSize:
        return self.view.frame


# ---------------------------------------------------------------------------------------------------- acts


@dataclass(frozen=True, kw_only=True)
class Click:
    kind: ClassVar[str] = "click"
    ref: str


@dataclass(frozen=True, kw_only=True)
class Fill:
    kind: ClassVar[str] = "fill"
    ref: str
    text: str


@dataclass(frozen=True, kw_only=True)
class Press:
    kind: ClassVar[str] = "press"
    key: str
    """A key or chord in Playwright's notation: Enter, Tab, Control+a, ArrowDown."""
    ref: str | None = None
    """Focus this element first; without it, `observation` names the observation acted on."""
    observation: int | None = None


@dataclass(frozen=True, kw_only=True)
class Select:
    kind: ClassVar[str] = "select"
    ref: str
    option: str
    """The option's label or value."""


@dataclass(frozen=True, kw_only=True)
class Scroll:
    kind: ClassVar[str] = "scroll"
    ref: str | None = None
    """Scroll this element into view; without it, scroll the page by (dx, dy) CSS pixels."""
    dx: int = 0
    dy: int = 0
    observation: int | None = None


@dataclass(frozen=True, kw_only=True)
class Navigate:
    kind: ClassVar[str] = "navigate"
    url: str
    observation: int


@dataclass(frozen=True, kw_only=True)
class NewTab:
    kind: ClassVar[str] = "new_tab"
    observation: int
    url: str | None = None


@dataclass(frozen=True, kw_only=True)
class SwitchTab:
    kind: ClassVar[str] = "switch_tab"
    tab_id: str
    observation: int


@dataclass(frozen=True, kw_only=True)
class CloseTab:
    kind: ClassVar[str] = "close_tab"
    tab_id: str
    observation: int


@dataclass(frozen=True, kw_only=True)
class DesktopClick:
    kind: ClassVar[str] = "desktop_click"
    x: int
    y: int
    observation: int
    button: int = 1


@dataclass(frozen=True, kw_only=True)
class DesktopType:
    kind: ClassVar[str] = "desktop_type"
    text: str
    observation: int


@dataclass(frozen=True, kw_only=True)
class DesktopKey:
    kind: ClassVar[str] = "desktop_key"
    keys: str
    """xdotool key names joined by '+', e.g. ctrl+l, Return, alt+Tab."""
    observation: int


Act = (Click | Fill | Press | Select | Scroll | Navigate | NewTab | SwitchTab | CloseTab
       | DesktopClick | DesktopType | DesktopKey)

ACT_KINDS: Final[Mapping[str, type[Act]]] = MappingProxyType({cls.kind: cls for cls in get_args(Act)})
"""The act vocabulary, by kind (`click`, `fill`, …): each act class above declares its own `kind`, and this is the
one list the server's tool schema, its argument parsing and the ledger's act records are derived from."""

_DESKTOP_ACTS = (DesktopClick, DesktopType, DesktopKey)
_TAB_ACTS = (NewTab, SwitchTab, CloseTab)
_FILLABLE = frozenset({"textbox", "searchbox", "combobox", "spinbutton"})
_SELECTABLE = frozenset({"combobox", "listbox"})


def act_consumes(act: Act) -> bool:
    """Whether the observation is used up by this act: everything but scroll may change the screen."""
    return not isinstance(act, Scroll)


def act_may_change_page(act: Act) -> bool:
    """Reported in act results for the ledger (same rule as consumption)."""
    return act_consumes(act)


def _act_bump(act: Act) -> BumpReason | None:
    """Acts that change what the agent is looking at by design bump the epoch right away."""
    if isinstance(act, _TAB_ACTS):
        return BumpReason.FOCUS_CHANGE
    if isinstance(act, Navigate):
        return BumpReason.NAVIGATION
    return None


# ---------------------------------------------------------------------------------------------------- lease


@dataclass(frozen=True, kw_only=True)
class HandoffLease:
    lease_id: str
    reason: str
    granted_at: datetime
    expires_at: datetime
    token_digest: str
    """SHA-256 of the one-time token: the token itself is handed out once, in the `LeaseGrant`."""
    token_used: bool = False

    def expired(self, now: datetime) -> bool:
        return now >= self.expires_at


@dataclass(frozen=True, kw_only=True)
class LeaseGrant:
    lease: HandoffLease
    token: str
    """The one-time token for the human's live-view link. Not stored anywhere else."""


# ---------------------------------------------------------------------------------------------------- state


class Phase(StrEnum):
    UNOBSERVED = "unobserved"
    OBSERVED = "observed"
    HUMAN = "human"


class Step(StrEnum):
    OBSERVE = "observe"
    ACT_CONSUMING = "act_consuming"
    ACT_KEEPING = "act_keeping"
    BUMP = "bump"
    GRANT = "grant"
    RETURN = "return"


P, S = Phase, Step
TRANSITIONS: Mapping[tuple[Phase, Step], Phase] = {
    (P.UNOBSERVED, S.OBSERVE): P.OBSERVED,
    (P.OBSERVED, S.OBSERVE): P.OBSERVED,
    (P.HUMAN, S.OBSERVE): P.HUMAN,
    (P.OBSERVED, S.ACT_CONSUMING): P.UNOBSERVED,
    (P.OBSERVED, S.ACT_KEEPING): P.OBSERVED,
    (P.UNOBSERVED, S.BUMP): P.UNOBSERVED,
    (P.OBSERVED, S.BUMP): P.UNOBSERVED,
    (P.HUMAN, S.BUMP): P.HUMAN,
    (P.UNOBSERVED, S.GRANT): P.HUMAN,
    (P.OBSERVED, S.GRANT): P.HUMAN,
    (P.HUMAN, S.RETURN): P.UNOBSERVED,
}
del P, S


@dataclass(frozen=True, kw_only=True)
class ComputerState:
    vm_id: str
    phase: Phase = Phase.UNOBSERVED
    epoch: int = 1
    last_number: int = 0
    latest: Observation | None = None
    """The latest observation of the current epoch; kept after it is consumed so a reused ref reads
    `observation_required` rather than `stale_observation`. Cleared by every epoch bump."""
    lease: HandoffLease | None = None
    last_bump: BumpReason | None = None


def _step(state: ComputerState, step: Step, **changes: Any) -> ComputerState:
    target = TRANSITIONS.get((state.phase, step))
    if target is None:
        raise IllegalTransition(f"{step} is not allowed while the tool computer is {state.phase}", vm=state.vm_id)
    return replace(state, phase=target, **changes)


@dataclass(frozen=True, kw_only=True)
class Accepted:
    observation: int
    epoch: int
    locator: Locator | None = None
    """The element a ref act names; None for acts without a ref."""


@dataclass(frozen=True, kw_only=True)
class Refused:
    code: str
    message: str
    bump: BumpReason | None = None
    """When the refusal came from seeing that the screen changed: the epoch bump the shell must record."""


def new_ref() -> str:
    """An unguessable ref: 48 random bits, short enough for a model to copy."""
    return "r" + secrets.token_hex(6)


def record_observation(state: ComputerState, capture: Capture, *,
                       mint: Callable[[], str] = new_ref) -> tuple[ComputerState, Observation]:
    """Issue a new observation for what was captured: fresh refs, the next number, the current epoch."""
    refs: dict[str, Locator] = {}
    for element in capture.elements:
        ref = mint()
        while ref in refs:  # a collision within one observation would make two elements share a ref
            ref = mint()
        refs[ref] = Locator(node=element.node, role=element.role, name=element.name)
    observation = Observation(vm_id=state.vm_id, epoch=state.epoch, number=state.last_number + 1,
                              view=capture.view, refs=refs, tabs=capture.tabs)
    return _step(state, Step.OBSERVE, last_number=observation.number, latest=observation), observation


def view_change(observation: Observation, view: View) -> BumpReason | None:
    """Why the screen no longer matches `observation`, or None if it still does."""
    if view.surface != observation.surface:
        return None  # a view of the other surface says nothing about this observation
    if view.tab_id != observation.tab_id or view.window != observation.view.window:
        return BumpReason.FOCUS_CHANGE
    if view.url != observation.view.url:
        return BumpReason.NAVIGATION
    if view.frame != observation.frame:
        return BumpReason.RESIZE
    return None


_STALE = ("This ref or observation is not from the latest observation of the current screen. "
          "Observe again and act on what that observation shows.")
_REQUIRED = "The screen may have changed since the last observation. Observe again before acting."


def check_act(state: ComputerState, act: Act, *, now: datetime, view: View | None = None) -> Accepted | Refused:
    """Whether `act` may run now. Nothing may execute unless this returns Accepted.

    `view` is what the screen shows right now (when the shell can read it cheaply): a different tab, page or
    frame size than the observation's refuses the act and carries the epoch bump to record.
    """
    if state.lease is not None:
        if not state.lease.expired(now):
            return Refused(code="human_in_control",
                           message="The user holds control of this screen. Wait for them to hand it back.")
        return Refused(code="stale_observation", message=_STALE, bump=BumpReason.HANDOFF_EXPIRED)
    latest = state.latest
    ref = getattr(act, "ref", None)
    if ref is not None:
        if latest is None or ref not in latest.refs:
            return Refused(code="stale_observation", message=_STALE)
        locator: Locator | None = latest.refs[ref]
        number = latest.number
    else:
        number_or_none: int | None = getattr(act, "observation", None)
        if number_or_none is None:
            return Refused(code="observation_required",
                           message="This act needs a ref or the number of the observation it is based on.")
        number = number_or_none
        if latest is None or number != latest.number:
            return Refused(code="stale_observation", message=_STALE)
        locator = None
    if state.phase is not Phase.OBSERVED:
        return Refused(code="observation_required", message=_REQUIRED)
    surface = Surface.DESKTOP if isinstance(act, _DESKTOP_ACTS) else Surface.BROWSER
    if latest.surface != surface:
        return Refused(code="observation_required",
                       message=f"This is a {surface} act; take a {surface} observation first.")
    if view is not None and (bump := view_change(latest, view)) is not None:
        return Refused(code="stale_observation", message=f"The screen changed ({bump}). " + _STALE, bump=bump)
    if (refusal := _fits(act, latest, locator)) is not None:
        return refusal
    return Accepted(observation=number, epoch=state.epoch, locator=locator)


def _fits(act: Act, observation: Observation, locator: Locator | None) -> Refused | None:
    if isinstance(act, DesktopClick) and not observation.frame.contains(act.x, act.y):
        frame = observation.frame
        return Refused(code="outside_frame",
                       message=f"({act.x}, {act.y}) is outside the observed {frame.width}×{frame.height} screen.")
    if isinstance(act, Fill) and locator is not None and locator.role not in _FILLABLE:
        return Refused(code="wrong_target", message=f"A {locator.role} cannot be filled; fill a text field.")
    if isinstance(act, Select) and locator is not None and locator.role not in _SELECTABLE:
        return Refused(code="wrong_target",
                       message=f"A {locator.role} has no options; select on a drop-down or list box.")
    if isinstance(act, SwitchTab | CloseTab) and act.tab_id not in observation.tabs:
        return Refused(code="unknown_tab", message=f"Tab {act.tab_id} was not in the observation's tab list.")
    return None


def record_act(state: ComputerState, act: Act) -> ComputerState:
    """After an accepted act (before it runs, so a failure half-way still counts): consume, and bump if the
    act changes what is shown by design (navigate, tab acts)."""
    state = _step(state, Step.ACT_CONSUMING if act_consumes(act) else Step.ACT_KEEPING)
    bump = _act_bump(act)
    return bump_epoch(state, bump) if bump is not None else state


def bump_epoch(state: ComputerState, reason: BumpReason) -> ComputerState:
    """Restore, navigation, focus change, resize: every ref and observation issued so far is stale."""
    return _step(state, Step.BUMP, epoch=state.epoch + 1, latest=None, last_bump=reason)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def grant_lease(state: ComputerState, *, now: datetime, ttl: timedelta, reason: str,
                lease_id: str, token: str) -> tuple[ComputerState, LeaseGrant]:
    """Hand control to the human until `now + ttl`. IDs and the token are injected (random in the shell)."""
    if ttl <= timedelta(0):
        raise ValueError("a control lease needs a positive time to live")
    lease = HandoffLease(lease_id=lease_id, reason=reason, granted_at=now, expires_at=now + ttl,
                         token_digest=_digest(token))
    return _step(state, Step.GRANT, lease=lease), LeaseGrant(lease=lease, token=token)


def redeem_token(state: ComputerState, token: str, *, now: datetime) -> tuple[ComputerState, Accepted | Refused]:
    """The human's link presents the one-time token: it opens the live view once, while the lease is valid."""
    lease = state.lease
    if lease is None or not hmac.compare_digest(lease.token_digest, _digest(token)):
        return state, Refused(code="invalid_token", message="This link is not valid for this screen.")
    if lease.expired(now):
        return state, Refused(code="lease_expired", message="This link has expired.")
    if lease.token_used:
        return state, Refused(code="token_used", message="This link was already used; ask for a new one.")
    latest = state.latest.number if state.latest is not None else 0
    return replace(state, lease=replace(lease, token_used=True)), Accepted(observation=latest, epoch=state.epoch)


def return_control(state: ComputerState, *, lease_id: str | None = None,
                   reason: BumpReason = BumpReason.HANDOFF_RETURN) -> ComputerState:
    """The human hands the screen back (or the lease ran out): new epoch, the agent must re-observe."""
    if state.lease is None or (lease_id is not None and state.lease.lease_id != lease_id):
        raise IllegalTransition("control can only be returned under the lease that is held", vm=state.vm_id)
    return _step(state, Step.RETURN, lease=None, epoch=state.epoch + 1, latest=None, last_bump=reason)


def settle(state: ComputerState, *, now: datetime) -> ComputerState:
    """Apply what time alone changes: an expired lease returns control."""
    if state.lease is not None and state.lease.expired(now):
        return return_control(state, reason=BumpReason.HANDOFF_EXPIRED)
    return state
