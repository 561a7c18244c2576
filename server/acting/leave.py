"""May this leave now? The one pure rule, asked by admission, by the dispatcher and by the egress decider.

Checks run in a fixed order; the first that fails decides, and says what it means for the request:

    STOP → revoked → paused → held → closed → the attempt has no outcome yet → current task version → objects valid

    hold  STOP, pause, the hold of the user's message: nothing leaves now; the same request may leave once it is
          lifted
    void  revoked, closed, a settled attempt, a moved task version, a stale object: it never leaves
    go    every check passed

A reconcile or verify read (`settling`) only asks what already happened: it goes through every hold and void,
because an unknown outcome must still be settled. Facts a caller does not have are None and their check is not
run: a read tool has no action (no version or object checks), only the egress decider has an attempt.
Each caller gathers the facts and acts on the verdict: admission refuses, the dispatcher holds or voids the
intent, the egress decider refuses the request (`not_admitted`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from wakeful.server.store.tables import TaskState

__all__ = ["Check", "Leave", "LeaveFacts", "LeaveVerdict", "leave_check"]


class Leave(StrEnum):
    GO = "go"
    HOLD = "hold"
    VOID = "void"


@dataclass(frozen=True, kw_only=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, kw_only=True)
class LeaveFacts:
    stopped: bool
    """A STOP is in force for this user or for the whole deployment."""
    task_state: TaskState
    current_version: int
    """The task's version now."""
    action_version: int | None = None
    """The task version the action was made for; None for a request that carries no action (a read tool)."""
    objects_problem: tuple[str, str] | None = None
    """(code, detail) of the first stale object (unknown_object, quote_expired); None when all are valid."""
    attempt: tuple[str, str | None] | None = None
    """(attempt ID, its recorded outcome or None) when the request is one attempt of an action; None otherwise."""
    settling: bool = False
    """A reconcile or verify read: it only reads what already happened."""


@dataclass(frozen=True, kw_only=True)
class LeaveVerdict:
    kind: Leave
    code: str
    """Stable: `ok`, or the failed check's code (stopped, revoked, paused, held, task_closed, attempt_settled,
    task_version_changed, unknown_object, quote_expired)."""
    checks: tuple[Check, ...]
    """Every check run, in order; the last one failed unless the verdict is GO."""

    @property
    def detail(self) -> str:
        return self.checks[-1].detail if self.checks else "a reconcile or verify read goes through every hold"


_GO_SETTLING = LeaveVerdict(kind=Leave.GO, code="ok", checks=())


def leave_check(f: LeaveFacts) -> LeaveVerdict:
    if f.settling:
        return _GO_SETTLING
    state = f.task_state.value
    steps: list[tuple[str, str, Leave, bool, str]] = [
        ("stop", "stopped", Leave.HOLD, not f.stopped,
         "STOP is in force; nothing new goes out until the user lifts it" if f.stopped else "no STOP"),
        ("revoked", "revoked", Leave.VOID, f.task_state is not TaskState.REVOKED, f"the task is {state}"),
        ("paused", "paused", Leave.HOLD, f.task_state is not TaskState.PAUSED, f"the task is {state}"),
        ("held", "held", Leave.HOLD, f.task_state is not TaskState.HELD,
         "the user wrote about the task: nothing new goes out until a run has read the message"
         if f.task_state is TaskState.HELD else f"the task is {state}"),
        ("closed", "task_closed", Leave.VOID, f.task_state is not TaskState.CLOSED, f"the task is {state}"),
    ]
    if f.attempt is not None:
        attempt_id, outcome = f.attempt
        steps.append(("attempt", "attempt_settled", Leave.VOID, outcome is None,
                      f"attempt {attempt_id} has no outcome yet" if outcome is None else
                      f"attempt {attempt_id} already has an outcome ({outcome}); it is not sent again"))
    if f.action_version is not None:
        steps.append(("task_version", "task_version_changed", Leave.VOID, f.action_version == f.current_version,
                      f"the action is for task version {f.action_version}" +
                      ("" if f.action_version == f.current_version else
                       f", but the task moved to version {f.current_version}")))
        steps.append(("objects", f.objects_problem[0] if f.objects_problem else "", Leave.VOID,
                      f.objects_problem is None, f.objects_problem[1] if f.objects_problem else "all objects valid"))
    checks: list[Check] = []
    for name, code, kind, ok, detail in steps:
        checks.append(Check(name=name, ok=ok, detail=detail))
        if not ok:
            return LeaveVerdict(kind=kind, code=code, checks=tuple(checks))
    return LeaveVerdict(kind=Leave.GO, code="ok", checks=tuple(checks))
