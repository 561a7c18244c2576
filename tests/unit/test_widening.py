"""Whether a steer widens a delegation: only what provably narrows or keeps it may pass without the user."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wakeful.server.core.widening import Delegation, over_ceilings, widenings

CANCEL = [{"effect": "merchant__cancel_renewal"}]


def version(goal: str = "cancel it", completion: list[Any] | None = None, **constraints: Any) -> Delegation:
    return Delegation.of(goal=goal, constraints=constraints, completion=CANCEL if completion is None else completion)


BEFORE = version(max_amount_cents=5000, recipients=["me@example.com"])


@pytest.mark.parametrize("after", [
    BEFORE,
    version(max_amount_cents=2000, recipients=["me@example.com"]),
    version(max_amount_cents=5000, max_items=1, recipients=["me@example.com"]),
    version(max_amount_cents=0.5, recipients=["me@example.com"]),
], ids=["kept", "a_limit_lowered", "a_ceiling_added", "a_float_ceiling_below"])
def test_what_keeps_or_narrows_the_delegation_does_not_widen_it(after: Delegation) -> None:
    assert widenings(BEFORE, after) == ()


@pytest.mark.parametrize(("after", "said"), [
    (version(max_amount_cents=500000, recipients=["me@example.com"]), "raises max_amount_cents from 5000 to 500000"),
    (version(recipients=["me@example.com"]), "removes max_amount_cents (was 5000)"),
    (version(max_amount_cents=True, recipients=["me@example.com"]), "changes max_amount_cents from 5000 to true"),
    (version(max_amount_cents="5000", recipients=["me@example.com"]), 'changes max_amount_cents from 5000 to "5000"'),
    (version(max_amount_cents=5000, recipients=["me@example.com", "them@example.com"]),
     'changes recipients from ["me@example.com"] to ["me@example.com", "them@example.com"]'),
    (version(max_amount_cents=5000, recipients=[]), 'changes recipients from ["me@example.com"] to []'),
    (version(max_amount_cents=5000, recipients=["me@example.com"], scope="anything"), 'adds scope = "anything"'),
    (version(max_amount_cents=5000), 'removes recipients (was ["me@example.com"])'),
    (version("cancel it and book a flight", max_amount_cents=5000, recipients=["me@example.com"]),
     'changes the goal from "cancel it" to "cancel it and book a flight"'),
    (version(completion=[], max_amount_cents=5000, recipients=["me@example.com"]),
     'changes the completion conditions from [{"effect": "merchant__cancel_renewal"}] to []'),
    (version(completion=[*CANCEL, *CANCEL], max_amount_cents=5000, recipients=["me@example.com"]),
     "changes the completion conditions"),
])
def test_anything_not_provably_narrowing_widens_and_says_how(after: Delegation, said: str) -> None:
    assert any(said in w for w in widenings(BEFORE, after)), widenings(BEFORE, after)


def test_a_ceiling_that_was_not_a_number_is_not_narrowed_by_a_number() -> None:
    assert widenings(version(max_amount_cents="lots"), version(max_amount_cents=1)) == (
        'changes max_amount_cents from "lots" to 1',)


def test_a_long_value_is_shortened_on_the_card() -> None:
    (said,) = widenings(version(), version(note="x" * 5000))
    assert len(said) < 120 and said.endswith("…")


def test_a_stored_version_and_a_proposed_one_compare_as_json() -> None:
    stored = Delegation.of(goal="g", constraints={"max_items": 2}, completion=[{"effect": "e", "verify": None}])
    proposed = Delegation.of(goal="g", constraints={"max_items": 2.0}, completion=({"effect": "e", "verify": None},))
    assert widenings(stored, proposed) == ()


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                        max_size=3), max_leaves=8)
CONSTRAINTS = st.dictionaries(st.sampled_from(["max_amount_cents", "max_items", "recipients", "scope"]), JSON_VALUES)


@given(goal=st.text(max_size=20), constraints=CONSTRAINTS, completion=st.lists(JSON_VALUES, max_size=2))
def test_a_version_never_widens_itself(goal: str, constraints: dict[str, Any], completion: list[Any]) -> None:
    same = Delegation.of(goal=goal, constraints=constraints, completion=completion)
    assert widenings(same, same) == ()


@given(constraints=CONSTRAINTS, limits=st.dictionaries(st.sampled_from(["max_amount_cents", "max_items"]),
                                                        st.integers(0, 10**6)))
def test_going_back_is_widening_whenever_going_forward_narrowed_something(
        constraints: dict[str, Any], limits: dict[str, int]) -> None:
    before = Delegation.of(goal="g", constraints=constraints, completion=[])
    after = Delegation.of(goal="g", constraints={**constraints, **limits}, completion=[])
    if widenings(before, after) == () and after != before:
        assert widenings(after, before) != ()


def test_an_agent_delegation_is_held_to_the_users_own_ceilings() -> None:
    ceilings = {"max_amount_cents": 10000}
    assert over_ceilings({"max_amount_cents": 10000}, ceilings) == ()
    assert over_ceilings({}, ceilings) == ()
    assert over_ceilings({"max_amount_cents": 10001}, {"max_amount_cents": None}) == ()
    assert over_ceilings({"max_amount_cents": 10001}, ceilings) == (
        "max_amount_cents = 10001 is not within your limit of 10000",)
    assert over_ceilings({"max_amount_cents": "any"}, ceilings) != ()
