"""Memory's repair: a correction traced back to its evidence and propagated.

- mem-correction-propagates: an advisory asks to re-confirm the flight of each of three bookings; each time the agent
  orders the cheapest flight that day (AB100, 07:10) and the user approves. From the three approvals the updater
  infers "prefers early flights" (a hypothesis, pending) and a Skill revision derived from it ("rebook onto the
  earliest flight", pending). The user corrects the hypothesis: "I don't prefer early flights; those times had no
  alternatives". The hypothesis is retired `corrected`, the user's words kept as their statement, the Skill revision
  invalidated and shown for review, and the three approvals disowned: after a fourth approval the updater proposes
  the hypothesis again from the approvals the history names, and the committer refuses it (`evidence_disowned`).
"""

from __future__ import annotations

from typing import Any

from wakeful.server.evals.agents import Turn, end
from wakeful.server.evals.memory_play import changes, correct, memories, mentioned, remember, runs_calling, show
from wakeful.server.evals.paired import POLICY
from wakeful.server.evals.scenario import Check, Scenario, check
from wakeful.server.evals.trip import ORDER, PNR, quiet, rebooking
from wakeful.server.evals.world import EvalWorld
from wakeful.server.harness.model import ModelReply, calls

__all__ = ["SCENARIOS"]

RECONFIRM = "Schedule update: please re-confirm the flight on your booking."
BOOKINGS = [PNR, "PNR124", "PNR125", "PNR126"]
"""PNR123 (seeded) and three more on AB100, the same day: each advisory re-orders one."""
CORRECTION = "I don't prefer early flights; those times had no alternatives."
EARLY = {"subject": "flight.departure", "value": "early", "topics": ["flight", "airline", "travel.advisory"]}
SKILL = {"form": "skill", "text": "When rebooking, choose the earliest flight of the day.",
         "subject": "rebooking.flight", "relation": "procedure", "value": "earliest of the day", "scope": "always",
         "topics": ["flight", "airline", "travel.advisory"]}


def inferring(turn: Turn) -> ModelReply:
    """An advisory: (re)order the cheapest flight that day. An order's outcome, once three approvals are in the
    history: infer the early-flight hypothesis from them, then a Skill revision derived from it."""
    if turn.after("remember"):
        stored = turn.result_of("remember")
        if turn.args_of("remember")["form"] == "hypothesis" and "memory_id" in stored:
            return remember(**SKILL, derived_from=[stored["memory_id"]],
                            evidence=turn.args_of("remember")["evidence"])
        return quiet("learnt what these approvals suggest; it waits for the user")
    advised = [e["pnr"] for e in turn.events("airline") if e.get("type") == "travel.advisory"]
    step = rebooking(turn, pnr=advised[0] if advised else PNR)
    if step is not None:
        return step
    if turn.after(ORDER):
        return quiet("asked the user to approve the order")
    if turn.called:
        return end()
    if advised:
        return calls(("airline__get_booking", {"pnr": advised[0]}))
    approvals = mentioned(turn, "apr")
    if turn.events("dispatch") and len(approvals) >= 3:
        return remember(form="hypothesis", text="The user seems to prefer early flights: they approved the 07:10 "
                        f"flight {len(approvals)} times.", relation="prefers", scope="always", confidence=0.6,
                        evidence=[{"type": "approval", "id": a} for a in approvals[:8]], **EARLY)
    return quiet("nothing the user needs to hear")


def _approve_an_order(w: EvalWorld, task_id: str, done: set[str]) -> str:
    """Send the next booking's advisory, approve the order it leads to, and wait for its ticket."""
    w.sim("airline", "POST", "/_sim/advisory", {"pnr": BOOKINGS[len(done)], "text": RECONFIRM})
    w.deliver("airline")
    action = w.until("a new order waiting for approval", lambda: next(
        (a for a in w.status(task_id)["actions"] if a["tool"] == ORDER and a["action_id"] not in done
         and a["verdict"] == "needs_approval"), None))
    w.decide(action["action_id"])
    w.until("its ticket", lambda: len(w.effects("airline", "ticket")) > len(done))
    done.add(action["action_id"])
    return str(action["action_id"])


def _pending(w: EvalWorld, form: str) -> dict[str, Any] | None:
    return next((r for r in memories(w, form=form, state="pending")), None)


def correction_propagates(w: EvalWorld) -> list[Check]:
    day = w.sim("airline", "GET", f"/v1/bookings/{PNR}")["date"]
    for pnr in BOOKINGS[1:]:
        w.sim("airline", "POST", "/_sim/bookings", {"pnr": pnr, "flight": "AB100", "date": day})
    trip = w.delegate("Keep my team's bookings on the cheapest flight of their day; each change needs my approval",
                      keys=BOOKINGS)
    w.until("the delegation's run", lambda: runs_calling(w, trip, "stay_quiet"))
    done: set[str] = set()
    for _ in range(3):
        _approve_an_order(w, trip, done)
    hypothesis = w.until("the inferred hypothesis", lambda: _pending(w, "hypothesis"))
    skill = w.until("the Skill revision derived from it", lambda: _pending(w, "skill"))
    inferred_from = show(w, hypothesis["memory_id"])
    corrected = correct(w, hypothesis["memory_id"], CORRECTION, CORRECTION)
    _approve_an_order(w, trip, done)
    refused = w.until("the same inference, proposed again", lambda: [
        c for c in changes(w, trip) if c["change"] == "refused"])
    after = {r["memory_id"]: r for r in memories(w)}
    statement = after.get(str(corrected.get("statement_id")), next(
        (r for r in after.values() if r["form"] == "statement" and r["text"] == CORRECTION), {}))
    skill_now = show(w, skill["memory_id"])["record"]
    hypothesis_now = show(w, hypothesis["memory_id"])["record"]
    early = [r for r in after.values() if r["subject"] == EARLY["subject"] and r["state"] != "retired"
             and r["form"] != "statement"]
    return [
        check("inferred from the three approvals, pending the user",
              len([e for e in inferred_from["evidence"] if e["type"] == "approval"]) == 3
              and (hypothesis["state"], hypothesis["speaker"]) == ("pending", "agent")
              and skill["memory_id"] in inferred_from["derived"],
              {"evidence": inferred_from["evidence"], "derived": inferred_from["derived"]}),
        check("the correction retired the hypothesis and kept the user's words as their statement",
              (hypothesis_now["state"], hypothesis_now["retire_reason"]) == ("retired", "corrected")
              and (statement.get("form"), statement.get("speaker"), statement.get("text"))
              == ("statement", "user", CORRECTION), {"hypothesis": hypothesis_now, "statement": statement}),
        check("the Skill revision derived from it was invalidated and shown for review",
              (skill_now["state"], skill_now["retire_reason"], skill_now["review"]) == ("retired", "invalidated", True)
              and skill["memory_id"] in ((corrected.get("reach") or {}).get("invalidated") or []),
              {"skill": skill_now, "reach": corrected.get("reach")}),
        check("the same approvals could not produce it again",
              [c.get("code") for c in refused] == ["evidence_disowned"] and early == [],
              {"refused": refused, "early": early}),
    ]


SCENARIOS = [
    Scenario(name="mem-correction-propagates", family="memory: repair", sims=("airline",), policy=POLICY,
             playbook=inferring, play=correction_propagates,
             summary="\"prefers early flights\", inferred from three approvals, is corrected by the user: retired, "
                     "the Skill revision derived from it invalidated for review, and the same approvals refused as "
                     "evidence when proposed again"),
]
