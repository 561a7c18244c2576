"""Admission is a pure function: each check in its order, each refusal with its code."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wakeful.server.acting.admission import ApprovalFacts, Budgets, Facts, admit
from wakeful.server.store.tables import ApprovalDecision, Risk, TaskState, VerdictKind

NOW = datetime(2026, 3, 1, 12, tzinfo=UTC)
APPROVAL = ApprovalFacts(id="apr_1", decision=ApprovalDecision.APPROVED, approver="user:usr_1", content_hash="h",
                         task_version=1, valid_until=NOW + timedelta(hours=1), amount_ceiling_cents=None, used=False)
BASE = Facts(now=NOW, stopped=False, task_state=TaskState.ACTIVE, current_version=1, action_version=1,
             content_hash="h", risk=Risk.ASK, auto_rule=None, amount_cents=1000, objects_problem=None,
             budgets=Budgets(per_action_cents=5000, task_total_cents=8000, daily_cents=9000), spent_task_cents=0,
             spent_today_cents=0, approval=APPROVAL)


def verdict(**changes: object) -> tuple[VerdictKind, str]:
    v = admit(dataclasses.replace(BASE, **changes))  # type: ignore[arg-type]
    return v.kind, v.code


def test_an_approved_action_within_every_limit_is_admitted_with_its_approver() -> None:
    v = admit(BASE)
    assert (v.kind, v.approver, v.approval_id) == (VerdictKind.ADMITTED, "user:usr_1", "apr_1")
    assert [c.name for c in v.checks] == ["stop", "revoked", "paused", "held", "closed", "task_version", "objects",
                                          "per_action_ceiling", "task_total", "daily_cap", "approval"]


@pytest.mark.parametrize(("changes", "code"), [
    ({"stopped": True}, "stopped"),
    ({"task_state": TaskState.REVOKED}, "revoked"),
    ({"task_state": TaskState.PAUSED}, "paused"),
    ({"task_state": TaskState.HELD}, "held"),
    ({"task_state": TaskState.CLOSED}, "task_closed"),
    ({"current_version": 2}, "task_version_changed"),
    ({"objects_problem": ("unknown_object", "never issued")}, "unknown_object"),
    ({"objects_problem": ("quote_expired", "the quote expired")}, "quote_expired"),
    ({"amount_cents": 6000}, "budget_exceeded"),
    ({"spent_task_cents": 7500}, "budget_exhausted"),
    ({"spent_today_cents": 8500}, "budget_exhausted"),
    ({"risk": Risk.DENY}, "denied_by_policy"),
    ({"approval": dataclasses.replace(APPROVAL, decision=ApprovalDecision.DENIED)}, "denied"),
])
def test_each_failed_check_refuses_with_its_code(changes: dict[str, object], code: str) -> None:
    assert verdict(**changes) == (VerdictKind.REFUSED, code)


@pytest.mark.parametrize("approval", [
    None,
    dataclasses.replace(APPROVAL, content_hash="other"),
    dataclasses.replace(APPROVAL, task_version=0),
    dataclasses.replace(APPROVAL, used=True),
    dataclasses.replace(APPROVAL, valid_until=NOW),
    dataclasses.replace(APPROVAL, amount_ceiling_cents=999),
])
def test_a_missing_or_void_approval_means_approval_is_required(approval: ApprovalFacts | None) -> None:
    assert verdict(approval=approval) == (VerdictKind.NEEDS_APPROVAL, "approval_required")


def test_an_auto_tier_is_admitted_with_the_policy_rule_as_approver() -> None:
    v = admit(dataclasses.replace(BASE, risk=Risk.AUTO, auto_rule="small-orders", approval=None))
    assert (v.kind, v.approver) == (VerdictKind.ADMITTED, "policy:small-orders")


def test_stop_is_checked_before_anything_else() -> None:
    v = admit(dataclasses.replace(BASE, stopped=True, task_state=TaskState.REVOKED, current_version=9))
    assert v.code == "stopped" and len(v.checks) == 1


@given(stopped=st.booleans(), state=st.sampled_from(list(TaskState)), version=st.integers(1, 3),
       amount=st.integers(0, 10_000), spent=st.integers(0, 10_000), risk=st.sampled_from(list(Risk)),
       approved=st.booleans())
def test_nothing_is_admitted_unless_every_check_passed(stopped: bool, state: TaskState, version: int, amount: int,
                                                       spent: int, risk: Risk, approved: bool) -> None:
    v = admit(dataclasses.replace(BASE, stopped=stopped, task_state=state, current_version=version,
                                  amount_cents=amount, spent_task_cents=spent, risk=risk,
                                  approval=APPROVAL if approved else None))
    if v.kind is VerdictKind.ADMITTED:
        assert all(c.ok for c in v.checks)
        assert not stopped and state is TaskState.ACTIVE and version == 1 and risk is not Risk.DENY
        assert amount <= 5000 and spent + amount <= 8000
        assert risk is Risk.AUTO or approved
    else:
        assert not v.checks[-1].ok
