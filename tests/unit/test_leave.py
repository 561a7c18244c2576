"""`leave_check` is the one rule for "may this leave now?": holds, voids and their codes, over random facts."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wakeful.server.acting.leave import Leave, LeaveFacts, leave_check
from wakeful.server.store.tables import TaskState

ACTION = LeaveFacts(stopped=False, task_state=TaskState.ACTIVE, current_version=2, action_version=2)

facts = st.builds(
    LeaveFacts,
    stopped=st.booleans(),
    task_state=st.sampled_from(list(TaskState)),
    current_version=st.integers(1, 3),
    action_version=st.none() | st.integers(1, 3),
    objects_problem=st.none() | st.sampled_from([("unknown_object", "offer: never issued"),
                                                 ("quote_expired", "offer: the quote expired")]),
    attempt=st.none() | st.tuples(st.just("att_1"), st.none() | st.sampled_from(["accepted", "blocked", "unknown"])),
    settling=st.booleans(),
)


def test_an_action_with_every_fact_in_order_goes() -> None:
    v = leave_check(ACTION)
    assert (v.kind, v.code) == (Leave.GO, "ok")
    assert [c.name for c in v.checks] == ["stop", "revoked", "paused", "held", "closed", "task_version", "objects"]


@pytest.mark.parametrize(("changes", "kind", "code"), [
    ({"stopped": True}, Leave.HOLD, "stopped"),
    ({"task_state": TaskState.PAUSED}, Leave.HOLD, "paused"),
    ({"task_state": TaskState.HELD}, Leave.HOLD, "held"),
    ({"task_state": TaskState.REVOKED}, Leave.VOID, "revoked"),
    ({"task_state": TaskState.CLOSED}, Leave.VOID, "task_closed"),
    ({"attempt": ("att_1", "unknown")}, Leave.VOID, "attempt_settled"),
    ({"current_version": 3}, Leave.VOID, "task_version_changed"),
    ({"objects_problem": ("quote_expired", "offer: the quote expired")}, Leave.VOID, "quote_expired"),
])
def test_each_failed_check_holds_or_voids_with_its_code(changes: dict[str, object], kind: Leave, code: str) -> None:
    v = leave_check(dataclasses.replace(ACTION, **changes))  # type: ignore[arg-type]
    assert (v.kind, v.code) == (kind, code)
    assert v.detail == v.checks[-1].detail and not v.checks[-1].ok


def test_a_stop_holds_before_a_revoke_would_void() -> None:
    v = leave_check(dataclasses.replace(ACTION, stopped=True, task_state=TaskState.REVOKED, current_version=9))
    assert (v.kind, v.code, len(v.checks)) == (Leave.HOLD, "stopped", 1)


def test_the_refusal_says_what_moved() -> None:
    assert "the task moved to version 3" in leave_check(dataclasses.replace(ACTION, current_version=3)).detail
    assert "already has an outcome (unknown)" in leave_check(dataclasses.replace(ACTION, attempt=("a", "unknown"))
                                                             ).detail
    assert leave_check(dataclasses.replace(ACTION, task_state=TaskState.PAUSED)).detail == "the task is paused"


def test_a_read_without_an_action_skips_the_action_checks() -> None:
    v = leave_check(LeaveFacts(stopped=False, task_state=TaskState.ACTIVE, current_version=1))
    assert v.kind is Leave.GO and [c.name for c in v.checks] == ["stop", "revoked", "paused", "held", "closed"]


@given(facts)
def test_stop_in_force_never_lets_anything_new_go(f: LeaveFacts) -> None:
    if f.stopped and not f.settling:
        assert leave_check(f).kind is Leave.HOLD


@given(facts)
def test_a_moved_task_version_never_goes(f: LeaveFacts) -> None:
    if f.action_version is not None and f.action_version != f.current_version and not f.settling:
        assert leave_check(f).kind is not Leave.GO


@given(facts)
def test_only_an_active_task_lets_anything_new_go(f: LeaveFacts) -> None:
    if leave_check(f).kind is Leave.GO and not f.settling:
        assert f.task_state is TaskState.ACTIVE and not f.stopped
        assert f.objects_problem is None or f.action_version is None
        assert f.attempt is None or f.attempt[1] is None


@given(facts)
def test_a_reconcile_or_verify_read_always_goes(f: LeaveFacts) -> None:
    assert (leave_check(f).kind is Leave.GO) >= f.settling


@given(facts)
def test_a_hold_is_only_ever_stop_pause_or_held_and_everything_else_that_fails_voids(f: LeaveFacts) -> None:
    v = leave_check(f)
    if v.kind is Leave.HOLD:
        assert v.code in ("stopped", "paused", "held") and (f.stopped or f.task_state in (TaskState.PAUSED,
                                                                                          TaskState.HELD))
    if v.kind is not Leave.GO:
        assert all(c.ok for c in v.checks[:-1]) and not v.checks[-1].ok
        assert v.code in ("stopped", "paused", "held", "revoked", "task_closed", "attempt_settled",
                          "task_version_changed", "unknown_object", "quote_expired")
