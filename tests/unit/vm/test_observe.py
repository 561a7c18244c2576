"""Observe, then act: the epoch, ref and control-lease rules of vm.observe, exhaustively and by property."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.vm.errors import IllegalTransition
from wakeful.vm.observe import (
    TRANSITIONS,
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
    Element,
    Fill,
    FrameSize,
    Navigate,
    NewTab,
    Phase,
    Press,
    Refused,
    Scroll,
    Select,
    Step,
    Surface,
    SwitchTab,
    View,
    act_consumes,
    bump_epoch,
    check_act,
    grant_lease,
    new_ref,
    record_act,
    record_observation,
    redeem_token,
    return_control,
    settle,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
FRAME = FrameSize(width=1280, height=720)
PAGE = View(surface=Surface.BROWSER, frame=FRAME, tab_id="T1", url="https://shop.test/cart")
SCREEN = View(surface=Surface.DESKTOP, frame=FrameSize(width=1024, height=768), window="77")
ELEMENTS = (Element(node=10, role="textbox", name="Name"), Element(node=11, role="button", name="Pay"),
            Element(node=12, role="combobox", name="City"), Element(node=13, role="heading", name="Cart", level=1))


def _mint() -> object:
    counter = itertools.count(1)
    return lambda: f"r{next(counter):04d}"


def observed(state: ComputerState | None = None, view: View = PAGE,
             tabs: tuple[str, ...] = ("T1", "T2")) -> tuple[ComputerState, dict[str, str]]:
    """A state whose latest observation shows ELEMENTS; returns it with name → ref."""
    state = state or ComputerState(vm_id="vm1")
    elements = ELEMENTS if view.surface is Surface.BROWSER else ()
    state, obs = record_observation(state, Capture(view=view, tabs=tabs, elements=elements))
    return state, {loc.name: ref for ref, loc in obs.refs.items()}


def latest_number(state: ComputerState) -> int:
    assert state.latest is not None
    return state.latest.number


def refused(decision: Accepted | Refused) -> str:
    assert isinstance(decision, Refused), decision
    return decision.code


# ------------------------------------------------------------------------------------------ refs


def test_refs_are_random_strings_not_node_ids_and_differ_between_observations() -> None:
    state, first = observed()
    _, second = observed(state)
    assert all(ref.startswith("r") and len(ref) == 13 for ref in first.values())
    assert not {str(e.node) for e in ELEMENTS} & set(first.values())
    assert not set(first.values()) & set(second.values())


def test_a_ref_collision_within_one_observation_is_minted_again() -> None:
    values = iter(["rA", "rA", "rB", "rB", "rC", "rD", "rE"])
    _, obs = record_observation(ComputerState(vm_id="vm1"), Capture(view=PAGE, elements=ELEMENTS),
                                mint=lambda: next(values))
    assert sorted(obs.refs) == ["rA", "rB", "rC", "rD"]


def test_observation_numbers_keep_increasing_across_epochs() -> None:
    state, _ = observed()
    state, _ = observed(state)
    state = bump_epoch(state, BumpReason.RESTORE)
    state, _ = observed(state)
    assert (latest_number(state), state.epoch) == (3, 2)


def test_a_ref_from_the_latest_observation_is_accepted_with_its_element() -> None:
    state, refs = observed()
    decision = check_act(state, Click(ref=refs["Pay"]), now=NOW, view=PAGE)
    assert decision == Accepted(observation=1, epoch=1, locator=state.latest.refs[refs["Pay"]])  # type: ignore[union-attr]
    assert decision.locator is not None and (decision.locator.node, decision.locator.role) == (11, "button")


def test_an_unknown_ref_is_stale() -> None:
    state, _ = observed()
    assert refused(check_act(state, Click(ref="r-made-up"), now=NOW)) == "stale_observation"


def test_a_ref_from_an_older_observation_is_stale() -> None:
    state, old = observed()
    state, _ = observed(state)
    assert refused(check_act(state, Click(ref=old["Pay"]), now=NOW)) == "stale_observation"


@pytest.mark.parametrize("reason", list(BumpReason))
def test_every_epoch_bump_makes_every_ref_stale(reason: BumpReason) -> None:
    state, refs = observed()
    state = bump_epoch(state, reason)
    assert state.phase is Phase.UNOBSERVED and state.last_bump is reason
    assert refused(check_act(state, Click(ref=refs["Pay"]), now=NOW)) == "stale_observation"
    assert refused(check_act(state, Navigate(url="https://x.test", observation=1), now=NOW)) == "stale_observation"


def test_before_any_observation_every_act_is_refused() -> None:
    state = ComputerState(vm_id="vm1")
    assert refused(check_act(state, Click(ref="r1"), now=NOW)) == "stale_observation"
    assert refused(check_act(state, Press(key="Enter"), now=NOW)) == "observation_required"
    assert refused(check_act(state, DesktopClick(x=1, y=1, observation=0), now=NOW)) == "stale_observation"


# ------------------------------------------------------------------------------------------ consumption


CHANGING: list[Act] = [Fill(ref="Name", text="Ada"), Click(ref="Pay"), Press(key="Enter", ref="Name"),
                       Select(ref="City", option="Paris")]


@pytest.mark.parametrize("make", CHANGING, ids=lambda a: type(a).__name__)
def test_an_act_that_may_change_the_page_consumes_the_observation(make: Act) -> None:
    state, refs = observed()
    act = type(make)(**{**make.__dict__, "ref": refs[make.ref]})  # type: ignore[attr-defined]
    assert isinstance(check_act(state, act, now=NOW, view=PAGE), Accepted)
    state = record_act(state, act)
    assert state.phase is Phase.UNOBSERVED and state.epoch == 1
    assert refused(check_act(state, act, now=NOW, view=PAGE)) == "observation_required"
    assert refused(check_act(state, Click(ref=refs["Name"]), now=NOW, view=PAGE)) == "observation_required"
    state, fresh = observed(state)
    assert isinstance(check_act(state, Click(ref=fresh["Pay"]), now=NOW, view=PAGE), Accepted)


def test_scroll_keeps_the_observation_because_refs_name_elements_not_pixels() -> None:
    state, refs = observed()
    for act in (Scroll(ref=refs["Cart"]), Scroll(dy=400, observation=1)):
        assert isinstance(check_act(state, act, now=NOW, view=PAGE), Accepted)
        state = record_act(state, act)
        assert state.phase is Phase.OBSERVED
    assert isinstance(check_act(state, Click(ref=refs["Pay"]), now=NOW, view=PAGE), Accepted)


def test_only_scroll_does_not_consume() -> None:
    acts: list[Act] = [Click(ref="r"), Fill(ref="r", text=""), Press(key="a"), Select(ref="r", option="o"),
                       Navigate(url="u", observation=1), NewTab(observation=1), SwitchTab(tab_id="T", observation=1),
                       CloseTab(tab_id="T", observation=1), DesktopClick(x=0, y=0, observation=1),
                       DesktopType(text="t", observation=1), DesktopKey(keys="Return", observation=1)]
    assert all(act_consumes(a) for a in acts)
    assert not act_consumes(Scroll(dy=1, observation=1))


@pytest.mark.parametrize(("act", "reason"), [
    (Navigate(url="https://x.test", observation=1), BumpReason.NAVIGATION),
    (NewTab(observation=1), BumpReason.FOCUS_CHANGE),
    (SwitchTab(tab_id="T2", observation=1), BumpReason.FOCUS_CHANGE),
    (CloseTab(tab_id="T2", observation=1), BumpReason.FOCUS_CHANGE),
])
def test_navigation_and_tab_acts_bump_the_epoch_as_they_are_recorded(act: Act, reason: BumpReason) -> None:
    state, _ = observed()
    assert isinstance(check_act(state, act, now=NOW, view=PAGE), Accepted)
    state = record_act(state, act)
    assert (state.epoch, state.last_bump, state.latest) == (2, reason, None)


def test_a_ref_less_act_must_name_the_latest_observation() -> None:
    state, _ = observed()
    state, _ = observed(state)
    assert refused(check_act(state, Press(key="Enter"), now=NOW)) == "observation_required"
    assert refused(check_act(state, Press(key="Enter", observation=1), now=NOW)) == "stale_observation"
    assert refused(check_act(state, Press(key="Enter", observation=3), now=NOW)) == "stale_observation"
    assert isinstance(check_act(state, Press(key="Enter", observation=2), now=NOW, view=PAGE), Accepted)


# ------------------------------------------------------------------------------------------ view changes


@pytest.mark.parametrize(("now_showing", "reason"), [
    (View(surface=Surface.BROWSER, frame=FRAME, tab_id="T2", url=PAGE.url), BumpReason.FOCUS_CHANGE),
    (View(surface=Surface.BROWSER, frame=FRAME, tab_id="T1", url="https://shop.test/paid"), BumpReason.NAVIGATION),
    (View(surface=Surface.BROWSER, frame=FrameSize(width=800, height=600), tab_id="T1", url=PAGE.url),
     BumpReason.RESIZE),
])
def test_a_changed_tab_page_or_frame_refuses_with_the_bump_to_record(now_showing: View, reason: BumpReason) -> None:
    state, refs = observed()
    decision = check_act(state, Click(ref=refs["Pay"]), now=NOW, view=now_showing)
    assert isinstance(decision, Refused)
    assert (decision.code, decision.bump) == ("stale_observation", reason)


def test_a_browser_act_needs_a_browser_observation_and_a_desktop_act_a_desktop_one() -> None:
    state, refs = observed()
    assert refused(check_act(state, DesktopType(text="x", observation=1), now=NOW)) == "observation_required"
    state, _ = observed(state, view=SCREEN)
    assert refused(check_act(state, Click(ref=refs["Pay"]), now=NOW)) == "stale_observation"
    assert refused(check_act(state, Press(key="Enter", observation=2), now=NOW)) == "observation_required"
    assert isinstance(check_act(state, DesktopType(text="x", observation=2), now=NOW), Accepted)


@pytest.mark.parametrize(("x", "y", "inside"), [(0, 0, True), (1023, 767, True), (1024, 0, False),
                                                 (0, 768, False), (-1, 5, False), (500, -3, False)])
def test_desktop_coordinates_must_lie_within_the_observed_screen(x: int, y: int, inside: bool) -> None:
    state, _ = observed(view=SCREEN)
    decision = check_act(state, DesktopClick(x=x, y=y, observation=1), now=NOW)
    assert isinstance(decision, Accepted) is inside
    if not inside:
        assert refused(decision) == "outside_frame"


def test_fill_and_select_must_fit_the_element() -> None:
    state, refs = observed()
    assert refused(check_act(state, Fill(ref=refs["Pay"], text="x"), now=NOW, view=PAGE)) == "wrong_target"
    assert refused(check_act(state, Select(ref=refs["Name"], option="x"), now=NOW, view=PAGE)) == "wrong_target"
    assert isinstance(check_act(state, Select(ref=refs["City"], option="Paris"), now=NOW, view=PAGE), Accepted)


def test_tab_acts_name_only_tabs_the_observation_listed() -> None:
    state, _ = observed(tabs=("T1",))
    assert refused(check_act(state, SwitchTab(tab_id="T9", observation=1), now=NOW, view=PAGE)) == "unknown_tab"
    assert refused(check_act(state, CloseTab(tab_id="T9", observation=1), now=NOW, view=PAGE)) == "unknown_tab"


# ------------------------------------------------------------------------------------------ control lease


def granted(state: ComputerState, ttl: timedelta = timedelta(minutes=10)) -> tuple[ComputerState, str]:
    state, grant = grant_lease(state, now=NOW, ttl=ttl, reason="captcha", lease_id="L1", token="tok-secret")
    return state, grant.token


def test_while_the_human_holds_control_every_act_is_refused() -> None:
    state, refs = observed()
    state, _ = granted(state)
    assert state.phase is Phase.HUMAN
    for act in (Click(ref=refs["Pay"]), Scroll(dy=1, observation=1), DesktopClick(x=1, y=1, observation=1),
                Press(key="Enter"), Click(ref="made-up")):
        assert refused(check_act(state, act, now=NOW + timedelta(minutes=9))) == "human_in_control"


def test_returning_control_bumps_the_epoch_and_requires_a_new_observation() -> None:
    state, refs = observed()
    state, _ = granted(state)
    state = return_control(state, lease_id="L1")
    assert (state.phase, state.epoch, state.lease, state.last_bump) == (Phase.UNOBSERVED, 2, None,
                                                                         BumpReason.HANDOFF_RETURN)
    assert refused(check_act(state, Click(ref=refs["Pay"]), now=NOW)) == "stale_observation"


def test_an_observation_taken_during_the_handoff_does_not_survive_the_return() -> None:
    state, _ = observed()
    state, _ = granted(state)
    state, during = observed(state)
    assert state.phase is Phase.HUMAN
    assert refused(check_act(state, Click(ref=during["Pay"]), now=NOW)) == "human_in_control"
    state = return_control(state)
    assert refused(check_act(state, Click(ref=during["Pay"]), now=NOW)) == "stale_observation"


def test_an_expired_lease_returns_control_with_a_new_epoch() -> None:
    state, refs = observed()
    state, _ = granted(state, ttl=timedelta(minutes=5))
    assert settle(state, now=NOW + timedelta(minutes=4)) == state
    late = NOW + timedelta(minutes=5)
    decision = check_act(state, Click(ref=refs["Pay"]), now=late)
    assert isinstance(decision, Refused) and decision.bump is BumpReason.HANDOFF_EXPIRED
    state = settle(state, now=late)
    assert (state.phase, state.epoch, state.lease, state.last_bump) == (Phase.UNOBSERVED, 2, None,
                                                                         BumpReason.HANDOFF_EXPIRED)


def test_the_token_opens_the_live_view_once_and_only_while_the_lease_is_valid() -> None:
    state, token = granted(ComputerState(vm_id="vm1"), ttl=timedelta(minutes=5))
    assert token not in repr(state)  # only its digest is kept
    state, first = redeem_token(state, "wrong", now=NOW)
    assert refused(first) == "invalid_token"
    state, second = redeem_token(state, token, now=NOW)
    assert isinstance(second, Accepted)
    _, third = redeem_token(state, token, now=NOW)
    assert refused(third) == "token_used"
    fresh, _ = granted(ComputerState(vm_id="vm1"), ttl=timedelta(minutes=5))
    _, late = redeem_token(fresh, token, now=NOW + timedelta(minutes=5))
    assert refused(late) == "lease_expired"


def test_a_second_lease_cannot_be_granted_while_one_is_held() -> None:
    state, _ = granted(ComputerState(vm_id="vm1"))
    with pytest.raises(IllegalTransition):
        granted(state)


def test_control_can_only_be_returned_under_the_lease_that_is_held() -> None:
    with pytest.raises(IllegalTransition):
        return_control(ComputerState(vm_id="vm1"))
    state, _ = granted(ComputerState(vm_id="vm1"))
    with pytest.raises(IllegalTransition):
        return_control(state, lease_id="someone-else")


def test_a_restore_during_the_handoff_keeps_the_human_in_control() -> None:
    state, _ = granted(ComputerState(vm_id="vm1"))
    state = bump_epoch(state, BumpReason.RESTORE)
    assert (state.phase, state.epoch) == (Phase.HUMAN, 2)
    assert refused(check_act(state, Press(key="a", observation=0), now=NOW)) == "human_in_control"


def test_a_lease_needs_a_positive_time_to_live() -> None:
    with pytest.raises(ValueError, match="positive"):
        grant_lease(ComputerState(vm_id="vm1"), now=NOW, ttl=timedelta(0), reason="r", lease_id="L", token="t")


# ------------------------------------------------------------------------------------------ the table


def test_every_step_missing_from_the_table_is_an_illegal_transition() -> None:
    for phase, step in itertools.product(Phase, Step):
        if (phase, step) in TRANSITIONS:
            continue
        state = ComputerState(vm_id="vm1", phase=phase)
        with pytest.raises(IllegalTransition):
            if step is Step.ACT_CONSUMING:
                record_act(state, Click(ref="r"))
            elif step is Step.ACT_KEEPING:
                record_act(state, Scroll(dy=1, observation=1))
            elif step is Step.GRANT:
                granted(state)
            elif step is Step.RETURN:
                return_control(state)
            else:
                raise AssertionError(f"{step} is allowed from every phase, so it cannot be missing")


def test_new_ref_is_unguessable_enough() -> None:
    refs = {new_ref() for _ in range(2000)}
    assert len(refs) == 2000


# ------------------------------------------------------------------------------------------ the property

OPS = st.lists(st.one_of(
    st.just(("observe", 0)),
    st.just(("observe_desktop", 0)),
    st.tuples(st.just("bump"), st.sampled_from(list(BumpReason))),
    st.tuples(st.just("click"), st.integers(0, 12)),       # a ref from the k-th observation ever issued
    st.tuples(st.just("scroll"), st.integers(0, 12)),
    st.tuples(st.just("press"), st.integers(0, 12)),       # a ref-less act naming observation k
    st.just(("grant", 0)),
    st.just(("return", 0)),
), max_size=40)


@settings(max_examples=400, deadline=None)
@given(OPS)
def test_an_act_is_accepted_only_against_the_latest_unconsumed_observation_of_the_current_epoch(
        ops: list[tuple[str, object]]) -> None:
    state = ComputerState(vm_id="vm1")
    issued: list[tuple[int, int, dict[str, str]]] = []  # (epoch, number, name → ref) of every observation
    usable: int | None = None  # the model: the number of the observation acts may use, if any
    for op, arg in ops:
        if op in ("observe", "observe_desktop"):
            view = PAGE if op == "observe" else SCREEN
            state, refs = observed(state, view=view)
            issued.append((state.epoch, latest_number(state), refs))
            usable = latest_number(state) if state.lease is None and op == "observe" else None
        elif op == "bump":
            state = bump_epoch(state, arg)  # type: ignore[arg-type]
            usable = None
        elif op == "grant":
            if state.lease is None:
                state, _ = granted(state)
                usable = None
        elif op == "return":
            if state.lease is not None:
                state = return_control(state)
        elif issued:
            epoch, number, refs = issued[int(arg) % len(issued)]  # type: ignore[call-overload]
            act: Act
            if op == "click":
                act = Click(ref=refs.get("Pay", "r-none"))
            elif op == "scroll":
                act = Scroll(ref=refs.get("Cart", "r-none"))
            else:
                act = Press(key="Enter", observation=number)
            decision = check_act(state, act, now=NOW, view=PAGE)
            expected = state.lease is None and usable == number and epoch == state.epoch
            assert isinstance(decision, Accepted) is expected, (op, number, usable, decision)
            if state.lease is not None:
                assert refused(decision) == "human_in_control"
            if isinstance(decision, Accepted):
                state = record_act(state, act)
                if act_consumes(act):
                    usable = None
