"""The tool computer shell with in-memory fakes: nothing runs unless check_act accepted it, epochs move on what the
shell sees, restores reconnect and time every step, and the control lease shuts the agent out."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from datetime import timedelta

import pytest

from tests.support.polling import wait_until
from wakeful.proxy.clock import FakeClock
from wakeful.vm.browser import BrowserDisconnected, BrowserTimeout, ElementGone, PageCapture
from wakeful.vm.fake_browser import FakeBrowser
from wakeful.vm.fake_guest import FakeChannel, FakeDesktop
from wakeful.vm.guest import ClockSync, NotConnected
from wakeful.vm.observe import (
    Accepted,
    BumpReason,
    Click,
    DesktopClick,
    DesktopType,
    Element,
    Fill,
    FrameSize,
    Navigate,
    Phase,
    Press,
    Refused,
    Scroll,
    Select,
    Surface,
    SwitchTab,
)
from wakeful.vm.toolcomputer import ActResult, ObserveResult, ToolComputer

FORM = [Element(node=1, role="heading", name="Checkout", level=1), Element(node=2, role="textbox", name="Name"),
        Element(node=3, role="combobox", name="City", value="Choose"), Element(node=4, role="button", name="Pay")]


def _ticks() -> Callable[[], float]:
    counter = itertools.count()
    return lambda: float(next(counter))


class World:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.channel = FakeChannel()
        self.browser = FakeBrowser()
        self.desktop = FakeDesktop()
        self.tc = ToolComputer(vm_id="vm1", channel=self.channel, clock=clock, browser=self.browser,
                               desktop=self.desktop, timer=_ticks())
        self.tc.connect()
        self.browser.show("https://shop.test/checkout", FORM, title="Checkout")

    def observe(self, surface: Surface = Surface.BROWSER) -> ObserveResult:
        return self.tc.observe(surface)


@pytest.fixture
def world(clock: FakeClock) -> World:
    return World(clock)


def done(result: ActResult | Refused) -> ActResult:
    assert isinstance(result, ActResult), result
    return result


def refused(result: ActResult | Refused) -> str:
    assert isinstance(result, Refused), result
    return result.code


def test_connect_tunnels_cdp_through_the_guest_channel(world: World) -> None:
    assert world.browser.cdp_url == f"http://127.0.0.1:{world.channel.forwards[('127.0.0.1', 9222)]}"


def test_fill_and_click_by_ref_run_on_the_right_elements_and_report_for_the_ledger(world: World) -> None:
    seen = world.observe()
    filled = done(world.tc.act(Fill(ref=seen.ref_for("textbox", "Name"), text="Ada")))
    assert filled == ActResult(kind="fill", outcome="done", observation=1, epoch=1, ref=seen.ref_for("textbox", "Name"),
                               role="textbox", name="Name", may_have_changed_page=True)
    seen = world.observe()
    world.browser.on_click[4] = lambda b: b.show("https://shop.test/paid", [])
    clicked = done(world.tc.act(Click(ref=seen.ref_for("button", "Pay"))))
    assert (clicked.kind, clicked.role, clicked.name, clicked.navigated) == ("click", "button", "Pay", True)
    assert world.browser.acts == [("fill", 2, "Ada"), ("click", 4)]


def test_the_second_act_on_one_observation_needs_a_new_observation_and_runs_nothing(world: World) -> None:
    seen = world.observe()
    done(world.tc.act(Fill(ref=seen.ref_for("textbox", "Name"), text="Ada")))
    assert refused(world.tc.act(Click(ref=seen.ref_for("button", "Pay")))) == "observation_required"
    assert world.browser.acts == [("fill", 2, "Ada")]


def test_a_navigation_seen_before_the_act_refuses_it_and_starts_a_new_epoch(world: World) -> None:
    seen = world.observe()
    world.browser.show("https://shop.test/elsewhere", FORM)  # a redirect the agent has not seen
    decision = world.tc.act(Click(ref=seen.ref_for("button", "Pay")))
    assert refused(decision) == "stale_observation"
    assert isinstance(decision, Refused) and decision.bump is BumpReason.NAVIGATION
    assert world.browser.acts == []
    assert world.tc.state.epoch == 2
    fresh = world.observe()
    assert fresh.observation.epoch == 2 and fresh.bumped is None
    done(world.tc.act(Click(ref=fresh.ref_for("button", "Pay"))))


def test_an_observation_that_finds_a_new_page_starts_a_new_epoch(world: World) -> None:
    world.observe()
    world.browser.show("https://shop.test/next", FORM)
    again = world.observe()
    assert (again.bumped, again.observation.epoch) == (BumpReason.NAVIGATION, 2)


def test_a_tab_switch_by_someone_else_refuses_acts_on_the_old_tab(world: World) -> None:
    seen = world.observe()
    world.browser.new_tab("https://other.test")
    world.browser.acts.clear()
    decision = world.tc.act(Fill(ref=seen.ref_for("textbox", "Name"), text="x"))
    assert isinstance(decision, Refused) and decision.bump is BumpReason.FOCUS_CHANGE
    assert world.browser.acts == []


def test_switching_tabs_is_an_act_that_starts_a_new_epoch(world: World) -> None:
    world.browser.new_tab("https://other.test")
    world.browser.select_tab("T1")
    seen = world.observe()
    assert [t.tab_id for t in seen.tabs] == ["T1", "T2"]
    done(world.tc.act(SwitchTab(tab_id="T2", observation=seen.observation.number)))
    assert world.browser.current == "T2"
    assert (world.tc.state.epoch, world.tc.state.last_bump) == (2, BumpReason.FOCUS_CHANGE)


def test_scroll_leaves_the_observation_usable(world: World) -> None:
    seen = world.observe()
    scrolled = done(world.tc.act(Scroll(dy=300, observation=seen.observation.number)))
    assert scrolled.may_have_changed_page is False
    done(world.tc.act(Click(ref=seen.ref_for("button", "Pay"))))


def test_an_element_that_is_gone_fails_the_act_and_still_consumes_the_observation(world: World) -> None:
    seen = world.observe()
    world.browser.pages["T1"].elements = FORM[:3]  # the button vanished, the URL did not change
    failed = done(world.tc.act(Click(ref=seen.ref_for("button", "Pay"))))
    assert (failed.outcome, failed.code) == ("failed", ElementGone.code)
    assert refused(world.tc.act(Select(ref=seen.ref_for("combobox", "City"), option="Paris"))) == \
        "observation_required"


def test_a_timeout_half_way_leaves_the_outcome_unknown(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = world.observe()

    def slow(node: int) -> None:
        raise BrowserTimeout("the browser did not answer within 30 s")
    monkeypatch.setattr(world.browser, "click", slow)
    result = done(world.tc.act(Click(ref=seen.ref_for("button", "Pay"))))
    assert (result.outcome, result.code) == ("unknown", "browser_timeout")


def test_observe_reestablishes_dropped_connections(world: World) -> None:
    world.channel.drop()
    world.browser.drop()
    seen = world.observe()
    assert world.channel.connects == 2 and world.browser.connects == 2
    assert seen.elements


def test_a_lost_browser_connection_refuses_the_act_without_running_it(world: World) -> None:
    seen = world.observe()
    world.browser.drop()
    assert refused(world.tc.act(Click(ref=seen.ref_for("button", "Pay")))) == "observation_required"
    assert world.browser.acts == []


# ------------------------------------------------------------------------------------------ desktop


def test_desktop_acts_use_coordinates_of_the_latest_desktop_observation(world: World) -> None:
    seen = world.observe(Surface.DESKTOP)
    n = seen.observation.number
    assert seen.observation.frame == FrameSize(width=1024, height=768) and seen.title == "Chromium"
    assert refused(world.tc.act(DesktopClick(x=2000, y=10, observation=n))) == "outside_frame"
    done(world.tc.act(DesktopClick(x=100, y=200, observation=n)))
    assert refused(world.tc.act(DesktopType(text="hi", observation=n))) == "observation_required"
    assert world.desktop.acts == [("click", "100", "200", "1")]


def test_a_focus_change_in_the_guest_refuses_the_desktop_act_with_nothing_typed(world: World) -> None:
    seen = world.observe(Surface.DESKTOP)
    world.desktop.window = "999"  # a dialog took the focus after the screenshot
    decision = world.tc.act(DesktopType(text="secret", observation=seen.observation.number))
    assert isinstance(decision, Refused)
    assert (decision.code, decision.bump) == ("stale_observation", BumpReason.FOCUS_CHANGE)
    assert world.desktop.acts == []
    assert world.tc.state.epoch == 2


# ------------------------------------------------------------------------------------------ restore


def test_after_restore_reconnects_resyncs_bumps_and_times_every_step(world: World) -> None:
    before = world.observe()
    world.channel.drop()
    report = world.tc.after_restore(observe=True)
    assert world.channel.clock_syncs == 1 and world.browser.connects == 2
    assert report.epoch == 2 and report.clock_sync.before == timedelta(seconds=-3)
    t = report.timings
    assert None not in (t.cdp_reconnect, t.first_observation)
    assert min(t.ssh_reconnect, t.clock, t.cdp_reconnect or 0, t.first_observation or 0) > 0
    assert report.observation is not None and report.observation.observation.epoch == 2
    assert refused(world.tc.act(Click(ref=before.ref_for("button", "Pay")))) == "stale_observation"
    done(world.tc.act(Click(ref=report.observation.ref_for("button", "Pay"))))


def test_after_restore_attaches_cdp_once_more_when_the_first_attach_failed_before_ssh_was_back(world: World) -> None:
    world.observe()
    world.channel.drop()
    world.browser.drop()  # under user-mode networking DevTools went with the transport
    world.browser.refuse_connects = 1
    report = world.tc.after_restore(observe=True)
    assert world.browser.connects == 3 and world.browser.connected
    assert report.observation is not None and report.observation.observation.epoch == 2


def test_after_restore_raises_when_the_second_cdp_attach_fails_too(world: World) -> None:
    world.channel.drop()
    world.browser.drop()
    world.browser.refuse_connects = 2
    with pytest.raises(BrowserDisconnected):
        world.tc.after_restore(observe=True)
    assert world.browser.connects == 3


def test_after_restore_retries_until_the_guest_answers(world: World) -> None:
    world.channel.drop()
    world.channel.unreachable = 3
    report = world.tc.after_restore()
    assert report.observation is None and report.timings.first_observation is None
    assert world.channel.connected


def test_after_restore_keeps_connections_that_survived_the_restore_and_still_bumps_the_epoch(world: World) -> None:
    # On an isolated network the TCP connection lives in the host kernel and the guest's saved memory.
    before = world.observe()
    report = world.tc.after_restore(observe=True)
    assert world.channel.probes == 1 and world.channel.connects == 1 and world.browser.connects == 1
    assert report.timings.kept and report.timings.ssh_reconnect == 0 and report.timings.cdp_reconnect == 0
    assert world.channel.clock_syncs == 1, "the guest clock is behind after any restore"
    assert report.observation is not None and report.observation.observation.epoch == 2
    assert refused(world.tc.act(Click(ref=before.ref_for("button", "Pay")))) == "stale_observation"
    done(world.tc.act(Click(ref=report.observation.ref_for("button", "Pay"))))


def test_after_restore_reconnects_both_when_the_kept_transport_no_longer_answers(world: World) -> None:
    world.channel.silent = True
    report = world.tc.after_restore(observe=True)
    assert world.channel.connects == 2 and world.browser.connects == 2
    assert not report.timings.kept and report.observation is not None


def test_after_restore_takes_the_first_observation_on_the_kept_connection_while_the_probe_is_out(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe is a guest round trip; the observation through the kept DevTools connection proves as much, so it
    # does not wait for the probe. Here the probe answers only once the page was captured.
    captured = threading.Event()
    capture = world.browser.capture

    def capture_then_tell(*, screenshot: bool = True) -> PageCapture:
        page = capture(screenshot=screenshot)
        captured.set()
        return page

    def alive_once_captured(*, timeout: float = 2.0) -> bool:
        world.channel.probes += 1
        return captured.wait(10)

    monkeypatch.setattr(world.browser, "capture", capture_then_tell)
    monkeypatch.setattr(world.channel, "alive", alive_once_captured)
    report = world.tc.after_restore(observe=True)
    assert report.timings.kept and world.channel.probes == 1
    assert world.channel.connects == 1 and world.browser.connects == 1 and world.channel.clock_syncs == 1
    assert report.observation is not None and report.observation.observation.epoch == 2


def test_after_restore_observes_again_through_a_new_connection_when_the_probe_finds_the_transport_dead(
        world: World) -> None:
    # The observation taken on the old connection meanwhile is not the one reported: that connection went with the
    # transport, and the refs are issued from one taken after the attach.
    world.channel.silent = True
    report = world.tc.after_restore(observe=True)
    assert not report.timings.kept and world.browser.connects == 2
    assert report.observation is not None and world.tc.state.latest is not None
    assert report.observation.observation.number == world.tc.state.latest.number
    done(world.tc.act(Click(ref=report.observation.ref_for("button", "Pay"))))


def test_after_restore_without_observing_leaves_the_clock_resync_to_run_beside_the_next_observation(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the server does: the hook reconnects, and the agent's own observe follows. The resync (a guest command)
    # runs beside that observation, not before it; here it can only finish once the page was captured.
    captured = threading.Event()
    capture, resync = world.browser.capture, world.channel.resync_clock

    def capture_then_tell(*, screenshot: bool = True) -> PageCapture:
        page = capture(screenshot=screenshot)
        captured.set()
        return page

    def resync_once_captured() -> ClockSync:
        if not captured.wait(10):
            raise NotConnected("fake guest: the clock resync was not beside the observation")
        return resync()

    monkeypatch.setattr(world.browser, "capture", capture_then_tell)
    monkeypatch.setattr(world.channel, "resync_clock", resync_once_captured)
    report = world.tc.after_restore()
    assert report.clock_sync is None and report.timings.clock is None and report.epoch == 2
    seen = world.observe()
    assert world.channel.clock_syncs == 1 and world.tc.clock_sync is not None
    assert world.tc.clock_sync.before == timedelta(seconds=-3)
    assert seen.observation.epoch == 2
    done(world.tc.act(Click(ref=seen.ref_for("button", "Pay"))))
    world.observe()
    assert world.channel.clock_syncs == 1, "one resync per restore"


def test_a_clock_resync_that_failed_beside_the_observation_fails_it_and_the_next_observation_tries_again(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    resync = world.channel.resync_clock
    failures = [NotConnected("fake guest: the connection dropped while setting the clock")]

    def flaky() -> ClockSync:
        if failures:
            raise failures.pop()
        return resync()

    monkeypatch.setattr(world.channel, "resync_clock", flaky)
    world.tc.after_restore()
    with pytest.raises(NotConnected):
        world.observe()
    seen = world.observe()
    assert world.channel.clock_syncs == 1 and world.tc.clock_sync is not None
    assert world.tc.wait_for_clock() is world.tc.clock_sync and world.channel.clock_syncs == 1
    done(world.tc.act(Click(ref=seen.ref_for("button", "Pay"))))


def test_an_observation_has_the_clock_keeper_started_in_the_background_for_the_next_restore(world: World) -> None:
    # The keeper makes the resync beside the first observation after a restore a line each way, not a new shell.
    world.observe()
    wait_until(lambda: world.channel.keepers >= 1, 10, "the clock keeper to be asked for")
    world.tc.after_restore()
    world.observe()
    assert world.channel.clock_syncs == 1
    wait_until(lambda: world.channel.keepers >= 2, 10, "the keeper to be asked for again (a no-op while it runs)")


def test_a_clock_keeper_that_cannot_start_fails_nothing(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = threading.Event()

    def fail() -> None:
        asked.set()
        raise NotConnected("fake guest: the connection dropped")

    monkeypatch.setattr(world.channel, "keep_clock", fail)
    seen = world.observe()
    assert asked.wait(10)
    done(world.tc.act(Click(ref=seen.ref_for("button", "Pay"))))
    world.observe()


def test_wait_for_clock_sets_the_clock_a_restore_left_behind_without_observing(world: World) -> None:
    assert world.tc.wait_for_clock() is None, "no restore, nothing to set"
    world.tc.after_restore()
    sync = world.tc.wait_for_clock()
    assert sync is not None and sync.before == timedelta(seconds=-3) and world.channel.clock_syncs == 1


def test_after_restore_attaches_cdp_again_when_only_ssh_survived(world: World) -> None:
    world.browser.drop()
    report = world.tc.after_restore(observe=True)
    assert world.channel.connects == 1 and world.browser.connects == 2
    assert report.timings.kept and report.observation is not None


# ------------------------------------------------------------------------------------------ handoff


def test_while_the_human_holds_control_the_agent_can_look_but_not_act(world: World) -> None:
    seen = world.observe()
    grant = world.tc.request_handoff("captcha", timedelta(minutes=10))
    assert world.tc.state.phase is Phase.HUMAN
    assert refused(world.tc.act(Click(ref=seen.ref_for("button", "Pay")))) == "human_in_control"
    during = world.observe()
    assert refused(world.tc.act(Press(key="Enter", observation=during.observation.number))) == "human_in_control"
    assert isinstance(world.tc.redeem_handoff(grant.token), Accepted)
    assert refused(world.tc.redeem_handoff(grant.token)) == "token_used"  # type: ignore[arg-type]
    assert world.browser.acts == []

    epoch = world.tc.return_control(grant.lease.lease_id)
    assert epoch == 2
    assert refused(world.tc.act(Click(ref=during.ref_for("button", "Pay")))) == "stale_observation"
    fresh = world.observe()
    done(world.tc.act(Click(ref=fresh.ref_for("button", "Pay"))))


def test_an_expired_lease_hands_control_back_with_a_new_epoch(world: World, clock: FakeClock) -> None:
    seen = world.observe()
    world.tc.request_handoff("login", timedelta(minutes=5))
    clock.advance(timedelta(minutes=5))
    assert world.tc.lease is None
    assert world.tc.state.last_bump is BumpReason.HANDOFF_EXPIRED
    assert refused(world.tc.act(Click(ref=seen.ref_for("button", "Pay")))) == "stale_observation"
    assert world.tc.return_control() == 2  # returning after expiry changes nothing


def test_navigate_needs_the_latest_observation_number(world: World) -> None:
    seen = world.observe()
    assert refused(world.tc.act(Navigate(url="https://x.test", observation=seen.observation.number - 1))) == \
        "stale_observation"
    went = done(world.tc.act(Navigate(url="https://x.test", observation=seen.observation.number)))
    assert went.navigated and world.browser.acts == [("navigate", "https://x.test")]


def test_the_observation_text_shows_refs_roles_names_and_states(world: World) -> None:
    seen = world.observe()
    text = seen.text()
    assert text.splitlines()[0].startswith("observation 1 (epoch 1) · browser · 1280×720 · https://shop.test/checkout")
    assert f'[{seen.ref_for("combobox", "City")}] combobox "City" value="Choose"' in text
    assert f'[{seen.ref_for("heading", "Checkout")}] heading "Checkout" level=1' in text
    assert "node" not in text and "=2" not in text  # node ids never reach the agent


def test_check_names_the_element_for_admission_without_running_or_consuming(world: World) -> None:
    seen = world.observe()
    decision = world.tc.check(Click(ref=seen.ref_for("button", "Pay")))
    assert isinstance(decision, Accepted) and decision.locator is not None
    assert (decision.locator.role, decision.locator.name) == ("button", "Pay")
    assert world.browser.acts == [] and world.tc.state.phase is Phase.OBSERVED
    done(world.tc.act(Click(ref=seen.ref_for("button", "Pay"))))


def test_a_restore_through_the_side_door_observes_and_resyncs_while_ssh_is_still_being_made_again(
        world: World) -> None:
    # User-mode networking with the clock keeper at its side door: SSH is made again off the path.
    before = world.observe()
    world.channel.side_door = True
    ssh_back = threading.Event()
    world.channel.reconnects.append(ssh_back)
    report = world.tc.after_restore(observe=True)
    assert not world.channel.connected, "the first observation did not wait for SSH"
    t = report.timings
    assert t.side_door and t.ssh_reconnect == 0 and t.probe == 0 and world.channel.probes == 0
    assert report.clock_sync is not None and world.channel.clock_syncs == 1 and t.clock is not None
    assert report.observation is not None and report.observation.observation.epoch == 2
    assert world.browser.connects == 2, "DevTools attached again (through the side door)"
    world.observe()  # a browser observation needs no SSH either
    assert refused(world.tc.act(Click(ref=before.ref_for("button", "Pay")))) == "stale_observation"
    ssh_back.set()
    assert world.tc.wait_for_ssh() is not None and world.channel.connected


def test_after_a_restore_through_the_side_door_a_desktop_observation_waits_for_ssh(world: World) -> None:
    world.channel.side_door = True
    ssh_back = threading.Event()
    world.channel.reconnects.append(ssh_back)
    world.tc.after_restore()
    threading.Timer(0.0, ssh_back.set).start()  # SSH comes back while the desktop observation waits for it
    seen = world.observe(Surface.DESKTOP)
    assert world.channel.connected and world.channel.connects == 2
    assert seen.observation.surface is Surface.DESKTOP
