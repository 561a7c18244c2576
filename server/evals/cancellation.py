"""The subscription cancellation and its three failure timelines (openclaw-one-run-to-long-lived-work, "Three
failure timelines are more useful than one success flow diagram").

1. `cancel-lost-response`: the merchant commits, the response is lost; reconciled by a read, verified, never resent.
2. `cancel-user-changes-mind`: the user pauses and then closes the task (they kept the subscription themselves)
   while the cancellation waits on them; the approval clicked earlier on another screen and a merchant event that
   wakes the session arrive afterwards: nothing is cancelled.
3. `cancel-late-events-after-complete`: verified complete; then an error event from the old attempt, the merchant's
   late webhook and its redelivery arrive through the public endpoint, and the old approval is clicked again: the
   task stays complete and nothing is cancelled twice.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from wakeful.server.evals.agents import Turn, end
from wakeful.server.evals.scenario import Check, Scenario, check
from wakeful.server.evals.world import EvalWorld
from wakeful.server.harness.model import ModelReply, calls

__all__ = ["SCENARIOS", "TITLE", "cancelling"]

TITLE = "Stop my Pro subscription at the merchant from renewing, but keep this month's benefits"
COMPLETION = [{"effect": "merchant__cancel_renewal",
               "verify": {"read": "merchant__get_subscription", "with": {"subscription": "subscription"},
                          "done_when": {"at": "renewal", "equals": "off"}}}]
CANCEL = "merchant__cancel_renewal"


def cancelling(turn: Turn) -> ModelReply:
    """List the subscriptions, propose cancelling the first one's renewal, then let the records do the rest."""
    if turn.woken_by_delegation:
        return calls(("merchant__list_subscriptions", {}))
    if turn.after("merchant__list_subscriptions"):
        first = turn.result_of("merchant__list_subscriptions")["objects"][0]
        return calls((CANCEL, {"subscription": first["id"], "reason": "keep this month's benefits"}))
    if not turn.called:
        return calls(("stay_quiet", {"reason": "nothing the user needs to hear"}))
    return end()


def _attempts(ledger: list[dict[str, Any]], action_id: str) -> list[dict[str, Any]]:
    return [e for e in ledger if e["type"] == "attempt" and e["action_id"] == action_id]


def _verified(w: EvalWorld, task_id: str) -> dict[str, Any]:
    return w.until("the goal verified", lambda: (s := w.status(task_id))["facts"]["goal_verified"] and s)


def _approved_and_verified(w: EvalWorld) -> tuple[str, str]:
    """Delegate, approve the proposed cancellation over HTTP, wait for the verification: (task, action)."""
    task_id = w.delegate(TITLE, COMPLETION)
    action_id = w.action_of(task_id, CANCEL, "needs_approval")["action_id"]
    w.decide(action_id)
    _verified(w, task_id)
    return task_id, action_id


def _one_cancellation(w: EvalWorld) -> Check:
    effects = w.effects("merchant", "cancel_renewal")
    return check("the merchant applied exactly one cancellation", len(effects) == 1, effects)


def lost_response(w: EvalWorld) -> list[Check]:
    # Dedupe off: a resend under the same key would cancel again, so only a read may follow the lost response.
    w.faults("merchant", dedupe=False, commit_then_timeout=1, stall_seconds=3.0)
    task_id, action_id = _approved_and_verified(w)
    ledger = w.ledger(task_id)
    reconciled = [e for e in ledger if e["type"] == "evidence" and e["source"] == "reconcile"]
    subscription = w.sim("merchant", "GET", "/v1/subscriptions/sub_1")
    return [
        _one_cancellation(w),
        check("one attempt, its outcome unknown until a read found it", len(_attempts(ledger, action_id)) == 1
              and any(e["verdict"] == "accepted" for e in reconciled), {"attempts": _attempts(ledger, action_id),
                                                                         "reconcile_evidence": reconciled}),
        check("the goal was verified by a fresh read", w.status(task_id)["facts"]["goal_verified"] is not None,
              w.status(task_id)["facts"]),
        check("the merchant says the renewal is off", subscription["renewal"] == "off", subscription),
    ]


def user_changes_mind(w: EvalWorld) -> list[Check]:
    task_id = w.delegate(TITLE, COMPLETION)
    action_id = w.action_of(task_id, CANCEL, "needs_approval")["action_id"]
    paused = w.control(task_id, "pause", "the merchant asks for a CAPTCHA: I will look myself")
    closed = w.control(task_id, "close", "I kept the subscription")
    late_approval = w.decide(action_id)  # clicked on the other screen before the change of mind
    # The old run's world moves on: a merchant event wakes the session; whatever the agent makes of it, admission
    # reads the closed task.
    w.sims["merchant"].webhooks.queue({"type": "subscription.updated", "subscription": "sub_1"})
    woke = w.flush("merchant")
    handled = w.handled(woke)
    ledger = w.ledger(task_id)
    effects = w.effects("merchant", "cancel_renewal")
    return [
        check("pause and close were recorded", (paused.get("state"), closed.get("state")) == ("paused", "closed"),
              {"pause": paused, "close": closed}),
        check("the approval after the close released nothing", late_approval.get("verdict") != "admitted",
              late_approval),
        check("the merchant's event was taken and handled", [e["status"] for e in handled] == ["processed"],
              {"sent": woke, "events": handled}),
        check("the merchant applied no cancellation", effects == [], effects),
        check("no attempt was ever made", _attempts(ledger, action_id) == [], _attempts(ledger, action_id)),
    ]


def late_events_after_complete(w: EvalWorld) -> list[Check]:
    w.faults("merchant", late_webhook=True, commit_then_timeout=1, stall_seconds=3.0)
    task_id, action_id = _approved_and_verified(w)
    before = w.status(task_id)
    merchant = w.sims["merchant"]
    merchant.webhooks.queue({"type": "subscription.cancel_failed", "subscription": "sub_1",
                             "error": "timeout", "detail": "the old request's error, arriving late"})
    late = w.flush("merchant")
    w.handled(late)
    merchant.webhooks.redeliver(late[0]["delivery_id"])
    again = w.flush("merchant")
    second_click = w.decide(action_id)
    w.jump(timedelta(minutes=10))  # ten minutes on: whatever the late events set going has come due
    after = w.status(task_id)
    ledger = w.ledger(task_id)
    return [
        check("the late webhook and the late error were taken through /v1/hooks",
              len(late) == 2 and all(200 <= r.get("status_code", 0) < 300 for r in late), late),
        check("the redelivery was recognised as a duplicate", [r.get("answer", {}).get("duplicate") for r in again]
              == [True], again),
        check("approving the done action again changed nothing", second_click.get("verdict") != "admitted",
              second_click),
        _one_cancellation(w),
        check("one attempt only", len(_attempts(ledger, action_id)) == 1, _attempts(ledger, action_id)),
        check("the task is still verified complete", after["state"] == before["state"]
              and after["facts"]["goal_verified"] == before["facts"]["goal_verified"],
              {"before": before["state"], "after": after["state"], "facts": after["facts"]}),
    ]


SCENARIOS = [
    Scenario(name="cancel-lost-response", family="cancellation", playbook=cancelling, play=lost_response,
             summary="the merchant commits and the response is lost: reconciled by a read, verified, one "
                     "cancellation in the merchant's records (dedupe off, so a resend would show)"),
    Scenario(name="cancel-user-changes-mind", family="cancellation", playbook=cancelling, play=user_changes_mind,
             summary="the user pauses then closes while the cancellation waits on them; a late approval and a "
                     "merchant event afterwards: no cancellation, no attempt"),
    Scenario(name="cancel-late-events-after-complete", family="cancellation", playbook=cancelling,
             play=late_events_after_complete,
             summary="verified complete, then a late error, the merchant's late webhook and its redelivery through "
                     "/v1/hooks and a second approval click: still complete, one cancellation"),
]
