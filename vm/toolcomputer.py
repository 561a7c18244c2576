"""The tool computer shell for one VM: joins the guest channel, browser and desktop under the rules of vm.observe.

    tc = ToolComputer(vm_id="u1", channel=channel, browser=CdpBrowser(), desktop=XDesktop(channel), clock=clock)
    tc.connect()                                   # SSH, the forward to the guest's CDP port, CDP
    seen = tc.observe()                            # screenshot + snapshot; refs bound to this observation
    tc.act(Fill(ref=seen.ref_for("textbox", "Name"), text="Ada"))   # → ActResult, or Refused: nothing ran
    ... the VM is restored ...
    tc.after_restore()                             # bump the epoch, keep or reconnect SSH ‖ CDP; the clock is
    tc.observe()                                   #   resynced beside this first observation, which waits for it
    tc.before_suspend()                            # the guest drops its page cache: less to save and restore

`act` always asks `check_act` first and records the act (consuming the observation) before anything executes, so
a failure half-way still needs a new observation. Before a browser act it reads the current view (tab, URL,
viewport) and refuses with `stale_observation` if the page moved on since the observation. Desktop acts carry the
observed focused window into the guest, where the same shell command checks it before any input.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import timedelta

from wakeful.proxy.clock import Clock
from wakeful.vm.browser import (
    Browser,
    BrowserDisconnected,
    BrowserError,
    BrowserTimeout,
    Effect,
    ElementGone,
    ElementObscured,
    NavigationFailed,
    NoSuchOption,
    NoSuchTab,
    NotEditable,
    Tab,
)
from wakeful.vm.computer_results import (
    ActResult,
    ConnectTimings,
    ObserveResult,
    RefElement,
    RestoreReport,
    RestoreTimings,
)
from wakeful.vm.desktop import BadKeys, Desktop, FocusChanged
from wakeful.vm.errors import VmError
from wakeful.vm.guest import Channel, ClockSync, NotConnected
from wakeful.vm.observe import (
    Accepted,
    Act,
    BumpReason,
    Capture,
    Click,
    CloseTab,
    ComputerState,
    DesktopClick,
    DesktopKey,
    DesktopType,
    Fill,
    HandoffLease,
    LeaseGrant,
    Locator,
    Navigate,
    NewTab,
    Press,
    Refused,
    Scroll,
    Select,
    Surface,
    SwitchTab,
    act_may_change_page,
    bump_epoch,
    check_act,
    grant_lease,
    new_ref,
    record_act,
    record_observation,
    redeem_token,
    return_control,
    settle,
    view_change,
)

__all__ = ["SHED_CACHE", "ActResult", "ConnectTimings", "ObserveResult", "RefElement", "RestoreReport",
           "RestoreTimings", "ToolComputer"]

SHED_CACHE = "sync; echo 1 > /proc/sys/vm/drop_caches"
"""The guest command `before_suspend` runs: write dirty pages out, then drop the clean page cache."""
# Errors raised before the act touched the page: nothing happened. Anything else (a timeout, a dropped connection)
# leaves the outcome unknown, to be reconciled by observing, never by repeating the act.
_NOTHING_DONE: tuple[type[VmError], ...] = (ElementGone, ElementObscured, NotEditable, NoSuchOption, NoSuchTab,
                                            NavigationFailed, BadKeys)


@dataclass(frozen=True, kw_only=True)
class _SshSide:
    """What the SSH side of `after_restore` found and how long each step took (seconds)."""

    probe: float
    kept: bool
    reconnect: float
    moved: bool
    """The local port of the CDP forward changed with the reconnect."""
    clock: float | None = None
    sync: ClockSync | None = None
    """None when the clock was left for later."""


class ToolComputer:
    def __init__(self, *, vm_id: str, channel: Channel, clock: Clock, browser: Browser | None = None,
                 desktop: Desktop | None = None, cdp: tuple[str, int] = ("127.0.0.1", 9222),
                 mint_ref: Callable[[], str] = new_ref, new_id: Callable[[], str] = lambda: secrets.token_hex(8),
                 new_token: Callable[[], str] = lambda: secrets.token_urlsafe(32),
                 timer: Callable[[], float] = time.perf_counter, reconnect_timeout: float = 60.0,
                 probe_timeout: float = 2.0) -> None:
        """`probe_timeout`: how long, after a restore, the old SSH transport gets to answer before it is given up
        and made again."""
        self.vm_id = vm_id
        self._channel = channel
        self._browser = browser
        self._desktop = desktop
        self._clock = clock
        self._cdp = cdp
        self._mint = mint_ref
        self._new_id = new_id
        self._new_token = new_token
        self._timer = timer
        self._reconnect_timeout = reconnect_timeout
        self._probe_timeout = probe_timeout
        self._state = ComputerState(vm_id=vm_id)
        self._lock = threading.RLock()
        self._clock_due = False
        """A restore happened and the guest clock has not been set since."""
        self._clock_job: Future[ClockSync] | None = None
        self._clock_sync: ClockSync | None = None
        self._clock_seconds: float | None = None
        """How long the latest resync took, from its start in the background."""
        self._background = ThreadPoolExecutor(1, thread_name_prefix=f"clock-{vm_id}")
        self._reconnect_job: Future[float] | None = None
        """SSH made again off the path after a restore through the side door: what needs SSH waits for it."""
        self._ssh_deferred = False
        """A restore through the side door left SSH to be made again after the first observation."""
        self._ssh_lock = threading.Lock()
        self._reconnector = ThreadPoolExecutor(1, thread_name_prefix=f"ssh-{vm_id}")

    @property
    def state(self) -> ComputerState:
        return self._state

    @property
    def clock_sync(self) -> ClockSync | None:
        """The latest resync of the guest clock (after a restore), once it is done."""
        return self._clock_sync

    @property
    def lease(self) -> HandoffLease | None:
        with self._lock:
            self._state = settle(self._state, now=self._clock.now())
            return self._state.lease

    # ---------------------------------------------------------------------------------------- connection

    def connect(self, *, wait: float = 0.0) -> ConnectTimings:
        """SSH, then the CDP forward and the browser connection. With `wait`, a guest that is still booting gets
        that many seconds in all: SSH is retried until it answers, then DevTools until Chromium is up."""
        with self._lock:
            start = self._timer()
            if wait > 0:
                self._channel.reconnect(timeout=wait)
            else:
                self._channel.connect()
            ssh = self._timer() - start
            if self._browser is None:
                return ConnectTimings(ssh=ssh, cdp=None)
            while True:
                try:
                    self._browser.connect(self._cdp_url())
                    return ConnectTimings(ssh=ssh, cdp=self._timer() - start)
                except BrowserError:
                    if self._timer() - start >= wait:
                        raise
                time.sleep(1.0)  # Chromium is still starting: its DevTools port answers within the wait or never

    def _cdp_url(self) -> str:
        return f"http://127.0.0.1:{self._channel.forward(*self._cdp)}"

    def _ensure_connected(self, *, ssh: bool = True) -> None:
        """SSH (waiting for a reconnect running off the path, or making one), then the browser. Without `ssh` (a
        browser observation) and with the keeper's side door open, SSH is left to come back on its own: the browser's
        connections reach the guest through the side door meanwhile."""
        if ssh or not self._channel.side_door_open:
            self._await_reconnect()
            if not self._channel.connected:
                self._channel.reconnect(timeout=self._reconnect_timeout)
        if self._browser is not None and not self._browser.connected:
            self._browser.connect(self._cdp_url())

    def _reconnect_aside(self) -> Future[float] | None:
        """Start the SSH reconnect a restore through the side door deferred, unless it runs; the one running, if any.
        Deferred until the first observation is taken: sshd's fork, re-exec, key exchange and authentication take the
        guest's vCPUs for seconds under TCG, which the observation would otherwise share."""
        with self._ssh_lock:
            if self._ssh_deferred:
                self._ssh_deferred = False
                if self._reconnect_job is None or self._reconnect_job.done():
                    self._reconnect_job = self._reconnector.submit(self._timed_reconnect)
            return self._reconnect_job

    def _await_reconnect(self) -> None:
        """Wait for the SSH reconnect running off the path, if any; a failed one is made again by whoever needs it."""
        self._reconnect_aside()
        job, self._reconnect_job = self._reconnect_job, None
        if job is not None:
            with contextlib.suppress(VmError):
                job.result()

    def wait_for_ssh(self) -> float | None:
        """Wait for the SSH reconnect that a restore through the side door left running beside it, and say how long
        it took (seconds from its start); raises what it raised. None if none was left running."""
        with self._lock:
            self._reconnect_aside()
            job, self._reconnect_job = self._reconnect_job, None
            return job.result() if job is not None else None

    def close(self) -> None:
        with self._lock:
            self._background.shutdown(wait=False, cancel_futures=True)
            self._reconnector.shutdown(wait=False, cancel_futures=True)
            if self._browser is not None:
                self._browser.close()
            self._channel.close()

    # ---------------------------------------------------------------------------------------- observe

    def observe(self, surface: Surface = Surface.BROWSER) -> ObserveResult:
        """A fresh observation of the browser tab or the desktop, re-establishing the connections if needed. After a
        restore it also waits for the guest clock's resync, which runs beside it; if that failed, so does this
        observation, and the next one resyncs again."""
        with self._lock:
            self._state = settle(self._state, now=self._clock.now())
            self._ensure_connected(ssh=surface is not Surface.BROWSER)
            self._start_clock_sync()
            seen = self._observe(surface)
            self._reconnect_aside()
            self._finish_clock_sync()
            self._background.submit(self._keep_clock)
            return seen

    def wait_for_clock(self) -> ClockSync | None:
        """Set the guest clock now if a restore left it behind, waiting for a resync already running beside an
        observation; raises what the resync raised. The latest resync, or None if there was no restore."""
        with self._lock:
            self._finish_clock_sync()
            return self._clock_sync

    def _keep_clock(self) -> None:
        """Start the guest's clock keeper unless it runs (a no-op then), so that the resync after the next restore is
        a line each way rather than a new shell beside the first observation. In the background, after an
        observation: its start costs the guest's vCPU a moment, never while the agent waits for a restore."""
        with contextlib.suppress(VmError):  # the transport went away meanwhile: the next observation asks again
            self._channel.keep_clock()

    def _start_clock_sync(self) -> None:
        """After a restore, set the guest clock in the background (one guest command) unless that already runs."""
        if self._clock_due and self._clock_job is None:
            self._clock_job = self._background.submit(self._resync)

    def _resync(self) -> ClockSync:
        """Resync the guest clock (through the keeper, or a shell over SSH); if that needs SSH and SSH is being made
        again off the path, once it is back."""
        start = self._timer()
        try:
            sync = self._channel.resync_clock()
        except NotConnected:
            job = self._reconnect_aside()
            if job is None:
                raise
            job.result()
            sync = self._channel.resync_clock()
        self._clock_seconds = self._timer() - start
        return sync

    def _finish_clock_sync(self) -> None:
        """Wait for the resync `_start_clock_sync` started (resync_clock bounds it); raise what it raised."""
        self._start_clock_sync()
        job, self._clock_job = self._clock_job, None
        if job is None:
            return
        self._clock_sync = job.result()
        self._clock_due = False

    def _observe(self, surface: Surface) -> ObserveResult:
        tabs: tuple[Tab, ...] = ()
        truncated = False
        if surface is Surface.BROWSER:
            page = self._need_browser().capture()
            capture, png, truncated, tabs = page.capture(), page.screenshot, page.truncated, page.tabs
        else:
            shot = self._need_desktop().capture()
            capture, png = Capture(view=shot.view, title=shot.title), shot.screenshot
        bumped = None
        latest = self._state.latest
        if latest is not None and (bumped := view_change(latest, capture.view)) is not None:
            self._state = bump_epoch(self._state, bumped)
        self._state, observation = record_observation(self._state, capture, mint=self._mint)
        by_node = {e.node: e for e in capture.elements}
        elements = tuple(RefElement(ref=ref, role=loc.role, name=loc.name, value=by_node[loc.node].value,
                                    states=by_node[loc.node].states, level=by_node[loc.node].level)
                         for ref, loc in observation.refs.items())
        return ObserveResult(observation=observation, title=capture.title, elements=elements, tabs=tabs,
                             screenshot=png, truncated=truncated, bumped=bumped)

    def _need_browser(self) -> Browser:
        if self._browser is None:
            raise BrowserDisconnected("this tool computer has no browser", vm=self.vm_id)
        return self._browser

    def _need_desktop(self) -> Desktop:
        if self._desktop is None:
            raise VmError("this tool computer has no desktop", vm=self.vm_id)
        return self._desktop

    # ---------------------------------------------------------------------------------------- act

    def check(self, act: Act) -> Accepted | Refused:
        """What `act` would be checked against, without running or consuming anything: admission uses the
        accepted element's role and name (a button named "Pay" needs approval) before the act is dispatched."""
        with self._lock:
            now = self._clock.now()
            self._state = settle(self._state, now=now)
            return check_act(self._state, act, now=now)

    def act(self, act: Act) -> ActResult | Refused:
        """Check, record, then run one act. A `Refused` means nothing was executed."""
        with self._lock:
            now = self._clock.now()
            self._state = settle(self._state, now=now)
            decision = check_act(self._state, act, now=now)
            if isinstance(decision, Accepted) and not isinstance(act, DesktopClick | DesktopType | DesktopKey):
                try:  # what the browser shows right now, against what was observed
                    view = self._need_browser().view()
                except BrowserDisconnected:
                    return Refused(code="observation_required",
                                   message="The connection to the browser was lost. Observe again before acting.")
                decision = check_act(self._state, act, now=now, view=view)
            elif isinstance(decision, Accepted):
                self._await_reconnect()  # a desktop act runs a guest command: SSH must be back
            if isinstance(decision, Refused):
                if decision.bump is not None:
                    self._state = bump_epoch(self._state, decision.bump)
                return decision
            self._finish_clock_sync()  # a no-op once an observation of this epoch waited for it
            self._state = record_act(self._state, act)  # consumed before it runs
            return self._run(act, decision)

    def _run(self, act: Act, accepted: Accepted) -> ActResult | Refused:
        locator = accepted.locator
        base = ActResult(kind=act.kind, outcome="done", observation=accepted.observation, epoch=accepted.epoch,
                         ref=getattr(act, "ref", None), role=locator.role if locator else None,
                         name=locator.name if locator else None, may_have_changed_page=act_may_change_page(act))
        try:
            effect = self._execute(act, locator)
        except FocusChanged:
            self._state = bump_epoch(self._state, BumpReason.FOCUS_CHANGE)
            return Refused(code="stale_observation", bump=BumpReason.FOCUS_CHANGE,
                           message="Another window took the focus since the observation; nothing was done. "
                                   "Observe again.")
        except _NOTHING_DONE as exc:
            return replace(base, outcome="failed", code=exc.code, detail=exc.message)
        except (BrowserError, VmError) as exc:  # timeouts, dropped connections: it may or may not have happened
            code = exc.code if not isinstance(exc, BrowserTimeout) else "browser_timeout"
            return replace(base, outcome="unknown", code=code, detail=exc.message)
        return replace(base, navigated=effect.navigated, detail=effect.detail)

    def _execute(self, act: Act, locator: Locator | None) -> Effect:
        node = locator.node if locator is not None else None
        window = self._state_window()
        match act:
            case Click():
                return self._need_browser().click(_node(node))
            case Fill(text=text):
                return self._need_browser().fill(_node(node), text)
            case Press(key=key):
                return self._need_browser().press(key, node)
            case Select(option=option):
                return self._need_browser().select_option(_node(node), option)
            case Scroll(dx=dx, dy=dy):
                return self._need_browser().scroll(node, dx=dx, dy=dy)
            case Navigate(url=url):
                return self._need_browser().navigate(url)
            case NewTab(url=url):
                return Effect(detail=self._need_browser().new_tab(url))
            case SwitchTab(tab_id=tab_id):
                self._need_browser().select_tab(tab_id)
                return Effect(detail=tab_id)
            case CloseTab(tab_id=tab_id):
                self._need_browser().close_tab(tab_id)
                return Effect(detail=tab_id)
            case DesktopClick(x=x, y=y, button=button):
                self._need_desktop().click(x, y, expect_window=window, button=button)
            case DesktopType(text=text):
                self._need_desktop().type_text(text, expect_window=window)
            case DesktopKey(keys=keys):
                self._need_desktop().key(keys, expect_window=window)
        return Effect()

    def _state_window(self) -> str | None:
        latest = self._state.latest
        return latest.view.window if latest is not None else None

    # ---------------------------------------------------------------------------------------- restore

    def after_restore(self, *, observe: bool = False, surface: Surface = Surface.BROWSER) -> RestoreReport:
        """The VM was restored (a new QEMU process): bump the epoch, keep the SSH transport if it outlived the restore
        (on an isolated network it does; under user-mode networking it died with the old process) or else reconnect
        SSH ‖ CDP in parallel (a CDP connection made through the forward waits for the new SSH transport), resync
        the guest clock, and optionally take the first fresh observation. Every step is timed.

        Two threads, from the moment the domain runs: the SSH side probes the transport (one round trip) and
        reconnects it if it died; the CDP side takes the browser observation at once on a DevTools connection that
        is still open (it rides on the SSH transport, so an observation that comes back proves that transport alive
        as well as the probe does), or attaches again first. If the probe finds the transport dead, a connection
        used meanwhile went with it: CDP is attached again and the observation taken once more; likewise after a
        CDP attach or an observation that failed before SSH was back.

        The clock resync (one guest command, a second or more under TCG) never runs before the first observation
        but beside it: on the SSH side after the probe when this call observes, else in the background from the
        moment this call returns, and the next `observe` waits for it (the server's hook does not observe: the
        agent's own first observation follows). The observation's times are the host's (the epoch, the lease); the
        guest's clock may still be behind while it is taken, which only a page showing the guest's time would see."""
        with self._lock:
            start = self._timer()
            self._state = bump_epoch(self._state, BumpReason.RESTORE)
            self._clock_due, self._clock_job = True, None  # a resync from before the restore no longer counts
            if self._channel.side_door_open:
                return self._restore_through_side_door(start, observe, surface)
            early = observe and surface is Surface.BROWSER
            speculate = self._browser is not None and self._browser.connected
            with ThreadPoolExecutor(2, thread_name_prefix=f"restore-{self.vm_id}") as pool:
                ssh = pool.submit(self._timed_ssh, early)
                cdp = pool.submit(self._timed_cdp, early, speculate) if self._browser is not None else None
                ssh_side = ssh.result()
                cdp_seconds: float | None = None
                first: ObserveResult | None = None
                first_seconds: float | None = None
                # The CDP forward moved, or the connection used on the CDP side went with a dead transport.
                attach_again = ssh_side.moved or (speculate and not ssh_side.kept)
                if cdp is not None:
                    try:
                        cdp_seconds, first, first_seconds = cdp.result()
                    except BrowserError:
                        # The forward gave up waiting for SSH (a loaded host, a slow restore), or a kept connection
                        # turned out dead; SSH is back now.
                        attach_again = True
            clock_seconds = ssh_side.clock
            if ssh_side.sync is not None:
                self._clock_sync, self._clock_due = ssh_side.sync, False
            if attach_again and self._browser is not None:
                t = self._timer()
                self._browser.connect(self._cdp_url())
                cdp_seconds = (cdp_seconds or 0.0) + self._timer() - t
                first = None
            self._start_clock_sync()
            if observe and first is None:
                t = self._timer()
                first = self._observe(surface)
                first_seconds = self._timer() - t
                if self._clock_job is not None:
                    t = self._timer()
                    self._finish_clock_sync()
                    clock_seconds = (first_seconds or 0.0) + self._timer() - t  # started beside the observation
            timings = RestoreTimings(ssh_reconnect=ssh_side.reconnect, clock=clock_seconds, cdp_reconnect=cdp_seconds,
                                     first_observation=first_seconds, total=self._timer() - start,
                                     probe=ssh_side.probe, kept=ssh_side.kept)
            return RestoreReport(timings=timings, clock_sync=self._clock_sync if not self._clock_due else None,
                                 epoch=self._state.epoch, observation=first)

    def _restore_through_side_door(self, start: float, observe: bool, surface: Surface) -> RestoreReport:
        """`after_restore` under user-mode networking with the keeper's side door open: the SSH transport died with
        the old QEMU process, and a new one costs the guest's sshd seconds of its one vCPU under TCG. It is made again
        in the background once the first observation is taken (by this call or the next `observe`); the clock resync
        (a line each way to the keeper) and the CDP attach go through the side door at once, then the first
        observation. Whatever needs SSH before that starts the reconnect and waits for it. A side door that turns out
        shut leaves both to SSH: the forward waits for it, the resync too."""
        self._channel.drop()
        with self._ssh_lock:
            self._ssh_deferred = True
        self._clock_seconds = None
        self._start_clock_sync()
        cdp_seconds: float | None = None
        if self._browser is not None:
            t = self._timer()
            try:
                self._browser.connect(self._cdp_url())
            except BrowserError:  # the side door was shut after all: the forward gave up waiting for SSH
                self._ensure_connected()
            cdp_seconds = self._timer() - t
        first: ObserveResult | None = None
        first_seconds = clock_seconds = None
        if observe:
            if surface is not Surface.BROWSER:
                self._ensure_connected()
            t = self._timer()
            first = self._observe(surface)
            first_seconds = self._timer() - t
            self._reconnect_aside()
            self._finish_clock_sync()
            clock_seconds = self._clock_seconds
        timings = RestoreTimings(ssh_reconnect=0.0, clock=clock_seconds, cdp_reconnect=cdp_seconds,
                                 first_observation=first_seconds, total=self._timer() - start, side_door=True)
        return RestoreReport(timings=timings, clock_sync=self._clock_sync if not self._clock_due else None,
                             epoch=self._state.epoch, observation=first)

    def _timed_reconnect(self) -> float:
        t = self._timer()
        self._channel.reconnect(timeout=self._reconnect_timeout)
        return self._timer() - t

    def before_suspend(self) -> None:
        """The VM is about to be suspended: the guest drops its clean page cache (file pages no process maps). Freed
        pages are zeroed (`init_on_free=1`) and a zero page costs next to nothing to save and restore, so the saved
        state, and the restore that reads it back, shrink by the cache's size (a fifth of the state here). Raises
        what the guest command raised; a VM not connected is left as it is."""
        with self._lock:
            self._await_reconnect()
            if self._channel.connected:
                self._channel.run(SHED_CACHE, timeout=self._reconnect_timeout).check("dropping the guest's page cache")

    def _timed_ssh(self, resync: bool) -> _SshSide:
        """Probe the transport, make it again if it died, then (if asked) resync the clock."""
        t0 = self._timer()
        kept = self._channel.alive(timeout=self._probe_timeout)
        t1 = self._timer()
        moved = False
        if not kept:
            self._channel.drop()  # dead even if it has not noticed: forwards wait for the new one
            report = self._channel.reconnect(timeout=self._reconnect_timeout)
            moved = self._cdp in report.moved
        t2 = self._timer()
        if not resync:
            return _SshSide(probe=t1 - t0, kept=kept, reconnect=t2 - t1 if not kept else 0.0, moved=moved)
        sync = self._channel.resync_clock()
        return _SshSide(probe=t1 - t0, kept=kept, reconnect=t2 - t1 if not kept else 0.0, moved=moved,
                        clock=self._timer() - t2, sync=sync)

    def _timed_cdp(self, observe: bool, connected: bool) -> tuple[float, ObserveResult | None, float | None]:
        """Attach CDP again unless the connection is still open (the forward's port survives the restore; a
        connection through a dead transport does not), then, if asked, take the first browser observation (the
        caller holds the lock and waits for this thread)."""
        assert self._browser is not None
        t0 = self._timer()
        if not connected:
            self._browser.connect(self._cdp_url())
        t1 = self._timer()
        if not observe:
            return (t1 - t0 if not connected else 0.0), None, None
        first = self._observe(Surface.BROWSER)
        return (t1 - t0 if not connected else 0.0), first, self._timer() - t1

    # ---------------------------------------------------------------------------------------- handoff

    def request_handoff(self, reason: str, ttl: timedelta) -> LeaseGrant:
        """Give the human control until `ttl` from now; the grant's one-time token goes into their link."""
        with self._lock:
            now = self._clock.now()
            self._state = settle(self._state, now=now)
            self._state, grant = grant_lease(self._state, now=now, ttl=ttl, reason=reason,
                                             lease_id=self._new_id(), token=self._new_token())
            return grant

    def redeem_handoff(self, token: str) -> Accepted | Refused:
        with self._lock:
            now = self._clock.now()
            self._state = settle(self._state, now=now)
            self._state, decision = redeem_token(self._state, token, now=now)
            return decision

    def vnc_port(self, guest_port: int = 5900) -> int:
        """A local port (127.0.0.1) forwarded over SSH to x11vnc on the guest's loopback: what a live view bridges."""
        with self._lock:
            self._ensure_connected()
            return self._channel.forward("127.0.0.1", guest_port)

    def return_control(self, lease_id: str | None = None) -> int:
        """The human hands the screen back; returns the new epoch (the agent must observe again)."""
        with self._lock:
            self._state = settle(self._state, now=self._clock.now())
            if self._state.lease is None:
                return self._state.epoch  # it already expired: control is back, the epoch already moved
            self._state = return_control(self._state, lease_id=lease_id)
            return self._state.epoch


def _node(node: int | None) -> int:
    assert node is not None, "ref acts always resolve to a node"
    return node

