"""The tool-computer tools as the tool layer runs them: observe (a read) and act (an action through admission).

An act is checked against the latest observation before it becomes an action (a stale ref never reaches the
ledger as something to do), recorded immutably with the element's role and name as observed, admitted or held for
approval like any effect, and — when admitted now — executed at once by the dispatcher (attempt first).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from sqlalchemy import Connection, Engine, and_, select

from wakeful.proxy.clock import Clock
from wakeful.server.acting import objects
from wakeful.server.acting.actions import create_action
from wakeful.server.acting.policy import Policy
from wakeful.server.acting.verdicts import admit_and_record, verdict_status
from wakeful.server.computers.pool import ACT_TOOL, OBSERVE_TOOL, Computers, act_json, act_of, act_risk
from wakeful.server.computers.pool import observe as observe_computer
from wakeful.server.egress.dispatch import add_evidence
from wakeful.server.errors import Refused, WakefulError
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import Outcome, VerdictKind, actions, attempts
from wakeful.server.tools.specs import ActOn, Observe, RequestHandoff

if TYPE_CHECKING:
    from wakeful.server.core.worker import Binding

__all__ = ["ComputerToolLayer"]

Fence = Callable[[Connection, "Binding"], Any]


class ComputerToolLayer:
    def __init__(self, engine: Engine, clock: Clock, *, computers: Computers, policy: Policy, fence: Fence,
                 dispatch_now: Callable[[str], None], notify: Callable[[Binding, str], None]) -> None:
        self._engine = engine
        self._clock = clock
        self._computers = computers
        self._policy = policy
        self._fence = fence
        self._dispatch_now = dispatch_now
        self._notify = notify

    def call(self, binding: Binding, tool: str, args: BaseModel) -> dict[str, Any]:
        """Run a tool-computer tool with its arguments validated by its spec (`server.tools.specs`)."""
        if isinstance(args, Observe):
            return self._observe(binding, args)
        if isinstance(args, ActOn):
            return self._act(binding, args)
        if isinstance(args, RequestHandoff):
            return self._handoff(binding, args)
        raise WakefulError("unknown_tool", f"there is no tool named {tool!r}")

    def _observe(self, binding: Binding, args: Observe) -> dict[str, Any]:
        with write(self._engine) as conn:
            self._fence(conn, binding)
        seen = observe_computer(self._computers, binding.user_id, args.surface)
        o = seen.observation
        with write(self._engine) as conn:
            add_evidence(conn, action=None, task_id=binding.task_id, attempt_id=None, source="read",
                         verdict=Outcome.ACCEPTED, now=self._clock.now(),
                         observed={"tool": OBSERVE_TOOL, "observation": o.number, "epoch": o.epoch,
                                   "surface": str(o.surface), "url": o.view.url, "title": seen.title,
                                   "elements": len(seen.elements)})
        return {"observation": o.number, "epoch": o.epoch, "text": seen.text(),
                "screenshot_png_base64": base64.b64encode(seen.screenshot).decode("ascii")}

    def _act(self, binding: Binding, args: ActOn) -> dict[str, Any]:
        from wakeful.vm.observe import Refused as ActRefused

        act = act_of(args.act)
        with write(self._engine) as conn:
            self._fence(conn, binding)  # whose task, and may it act, before the tool computer is even asked
        checked = self._computers.computer(binding.user_id).check(act)
        if isinstance(checked, ActRefused):
            with write(self._engine) as conn:
                objects.record_refusal(conn, user_id=binding.user_id, task_id=binding.task_id, run_id=binding.run_id,
                                       tool=ACT_TOOL, code=checked.code, detail=checked.message, now=self._clock.now())
            raise Refused(checked.code, checked.message)
        locator = checked.locator
        role, name = (locator.role, locator.name) if locator is not None else (None, None)
        now = self._clock.now()
        with write(self._engine) as conn:
            task = self._fence(conn, binding)
            if binding.decision_id is not None:
                existing = conn.execute(select(actions.c.id).where(and_(
                    actions.c.decision_id == binding.decision_id, actions.c.user_id == binding.user_id,
                    actions.c.task_id == binding.task_id))).scalar_one_or_none()
                if existing is not None:  # a replayed decision: the act was recorded already, never twice
                    return self._result(existing)
            described = " ".join(p for p in (act_json(act)["kind"], role, repr(name) if name else None) if p)
            content = {"tool": ACT_TOOL, "description": f"tool computer: {described}", "act": act_json(act),
                       "observation": checked.observation, "epoch": checked.epoch,
                       "element": {"role": role, "name": name}, "task_version": task.current_version}
            action = create_action(conn, user_id=binding.user_id, task_id=task.id, task_version=task.current_version,
                                   run_id=binding.run_id, tool=ACT_TOOL, content=content, risk=act_risk(act, name),
                                   amount_cents=None, currency=None, now=now, decision_id=binding.decision_id)
            verdict = admit_and_record(conn, action, policy=self._policy, now=now, session_id=task.session_id)
        if verdict.kind is VerdictKind.ADMITTED:
            self._dispatch_now(action.id)
        return self._result(action.id)

    def _result(self, action_id: str) -> dict[str, Any]:
        with read(self._engine) as conn:
            attempt = conn.execute(select(attempts.c.outcome, attempts.c.detail).where(
                attempts.c.action_id == action_id).order_by(attempts.c.seq.desc()).limit(1)).first()
        if attempt is None or attempt.outcome is None:
            with read(self._engine) as conn:
                return verdict_status(conn, action_id)
        return {"action_id": action_id, "status": "done", "outcome": attempt.outcome, "detail": attempt.detail,
                "next": "observe again before the next act"}

    def _handoff(self, binding: Binding, args: RequestHandoff) -> dict[str, Any]:
        reason, minutes = args.reason, args.minutes
        with write(self._engine) as conn:
            self._fence(conn, binding)
        from wakeful.vm.errors import VmError

        try:
            with self._computers.activity(binding.user_id, "handoff"):
                grant = self._computers.computer(binding.user_id).request_handoff(reason, timedelta(minutes=minutes))
        except VmError as exc:
            raise WakefulError(exc.code, exc.message) from None
        self._notify(binding, grant.token)
        return {"lease_id": grant.lease.lease_id, "until": grant.lease.expires_at.isoformat(),
                "next": "the user has the screen; your acts are refused until they return it. Then observe again."}
