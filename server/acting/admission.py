"""Admission: the pure function that decides whether an action may be dispatched, and says why.

Checks run in a fixed order and every one is reported, so the recorded verdict explains itself:

    STOP → revoked → paused → held → closed → current task version → objects valid   (`leave.leave_check`, the rule
    → per-action ceiling → task total → daily cap → risk tier and approval      the dispatcher and egress ask too)

Limits are checked against the facts at admission time (which may be long after the proposal: an approval
re-admits the action with fresh facts). The caller gathers the facts and records the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from wakeful.server.acting.leave import Check, Leave, LeaveFacts, leave_check
from wakeful.server.store.tables import ApprovalDecision, Risk, TaskState, VerdictKind

__all__ = ["ApprovalFacts", "Budgets", "Check", "Facts", "Verdict", "admit"]


@dataclass(frozen=True, kw_only=True)
class Budgets:
    per_action_cents: int | None = None
    task_total_cents: int | None = None
    daily_cents: int | None = None


@dataclass(frozen=True, kw_only=True)
class ApprovalFacts:
    id: str
    decision: ApprovalDecision
    approver: str
    content_hash: str
    task_version: int
    valid_until: datetime
    amount_ceiling_cents: int | None
    used: bool


@dataclass(frozen=True, kw_only=True)
class Facts:
    now: datetime
    stopped: bool
    task_state: TaskState
    current_version: int
    action_version: int
    content_hash: str
    risk: Risk
    auto_rule: str | None          # the policy rule that approves this action, when the tier is auto
    amount_cents: int | None
    objects_problem: tuple[str, str] | None  # (code, detail): unknown_object / quote_expired; None when all valid
    budgets: Budgets
    spent_task_cents: int          # admitted, not blocked, in this task
    spent_today_cents: int         # admitted, not blocked, for this user today
    approval: ApprovalFacts | None

    @property
    def leave(self) -> LeaveFacts:
        """The facts `leave_check` decides on: an action that may not leave now is not admitted either."""
        return LeaveFacts(stopped=self.stopped, task_state=self.task_state, current_version=self.current_version,
                          action_version=self.action_version, objects_problem=self.objects_problem)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    kind: VerdictKind
    code: str
    checks: tuple[Check, ...]
    approver: str | None = None
    approval_id: str | None = None

    @property
    def reason(self) -> str:
        failed = [c for c in self.checks if not c.ok]
        return failed[0].detail if failed else self.checks[-1].detail


def _approval_problem(f: Facts) -> str | None:
    a = f.approval
    if a is None:
        return "no approval yet"
    if a.content_hash != f.content_hash:
        return "the approval was for different content"
    if a.task_version != f.current_version:
        return "the approval was for an earlier task version"
    if a.used:
        return "the approval was already used"
    if a.valid_until <= f.now:
        return f"the approval expired at {a.valid_until.isoformat()}"
    if a.amount_ceiling_cents is not None and (f.amount_cents or 0) > a.amount_ceiling_cents:
        return f"the amount exceeds the approved ceiling of {a.amount_ceiling_cents} cents"
    return None


def admit(f: Facts) -> Verdict:
    checks: list[Check] = []

    def gate(name: str, ok: bool, detail: str) -> bool:
        checks.append(Check(name=name, ok=ok, detail=detail))
        return ok

    def refused(code: str) -> Verdict:
        return Verdict(kind=VerdictKind.REFUSED, code=code, checks=tuple(checks))

    leaving = leave_check(f.leave)
    checks.extend(leaving.checks)
    if leaving.kind is not Leave.GO:  # held or void alike: nothing is admitted that may not leave now
        return refused(leaving.code)
    amount = f.amount_cents or 0
    b = f.budgets
    steps: list[tuple[str, str, bool, str]] = [
        ("per_action_ceiling", "budget_exceeded",
         b.per_action_cents is None or amount <= b.per_action_cents,
         f"{amount} cents against a per-action ceiling of {b.per_action_cents}"),
        ("task_total", "budget_exhausted",
         b.task_total_cents is None or f.spent_task_cents + amount <= b.task_total_cents,
         f"{f.spent_task_cents} + {amount} cents against the task total of {b.task_total_cents}"),
        ("daily_cap", "budget_exhausted",
         b.daily_cents is None or f.spent_today_cents + amount <= b.daily_cents,
         f"{f.spent_today_cents} + {amount} cents against the daily cap of {b.daily_cents}"),
    ]
    for name, code, ok, detail in steps:
        if not gate(name, ok, detail):
            return refused(code)
    if f.risk is Risk.DENY:
        gate("risk", False, "policy denies this operation")
        return refused("denied_by_policy")
    if f.risk is Risk.AUTO:
        gate("risk", True, f"auto-approved by policy rule {f.auto_rule or 'declared tier'}")
        return Verdict(kind=VerdictKind.ADMITTED, code="admitted", checks=tuple(checks),
                       approver=f"policy:{f.auto_rule or 'tier'}")
    if f.approval is not None and f.approval.decision is ApprovalDecision.DENIED and \
            f.approval.content_hash == f.content_hash:
        gate("approval", False, f"denied by {f.approval.approver}")
        return refused("denied")
    problem = _approval_problem(f)
    if problem is not None:
        gate("approval", False, problem)
        return Verdict(kind=VerdictKind.NEEDS_APPROVAL, code="approval_required", checks=tuple(checks))
    assert f.approval is not None
    gate("approval", True, f"approved by {f.approval.approver}")
    return Verdict(kind=VerdictKind.ADMITTED, code="admitted", checks=tuple(checks), approver=f.approval.approver,
                   approval_id=f.approval.id)
