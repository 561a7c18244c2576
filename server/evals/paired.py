"""Paired cases: two scenarios that differ in one thing, each judged by the records.

- act vs ask: a hotel booking within the user's auto-approval rule goes ahead with no question; the same booking
  over the rule waits for the user, and nothing is booked until they approve.
- a late approval vs a fresh one: an approval that comes after its wait expired (the card is a day old) releases
  nothing; a fresh approval on a pending wait is acted on once and wakes the session with the outcome.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from wakeful.server.evals.agents import Playbook, Turn, end
from wakeful.server.evals.cancellation import CANCEL, COMPLETION, TITLE, cancelling
from wakeful.server.evals.scenario import Check, Scenario, check
from wakeful.server.evals.world import EvalWorld
from wakeful.server.harness.model import ModelReply, calls

__all__ = ["BOOK", "POLICY", "SCENARIOS", "booking"]

BOOK = "hotel__book_quote"
POLICY = f'rules = [ {{ name = "small-stays", tool = "{BOOK}", max_amount_cents = 30000 }} ]\n'
"""Stays up to 300.00 EUR are booked without asking."""


def booking(hotel: str, nights: int) -> Playbook:
    """Ask the hotel for a quote and propose booking it; after a resume (the quote may be stale), quote again."""
    def playbook(turn: Turn) -> ModelReply:
        if turn.woken_by_delegation or (not turn.called and '"control": "resume"' in turn.tail):
            return calls(("hotel__quote_stay", {"hotel": hotel, "nights": nights}))
        if turn.after("hotel__quote_stay"):
            quote = turn.result_of("hotel__quote_stay")["objects"][0]
            return calls((BOOK, {"quote_id": quote["id"]}))
        if not turn.called:
            return calls(("stay_quiet", {"reason": "nothing the user needs to hear"}))
        return end()
    return playbook


def _verdicts(ledger: list[dict[str, Any]], action_id: str) -> list[str]:
    return [f"{e['verdict']}:{e['code']}" for e in ledger if e["type"] == "verdict" and e["action_id"] == action_id]


def _stay(w: EvalWorld, hotel: str, nightly_cents: int) -> str:
    w.sim("hotel", "POST", "/_sim/rates", {"hotel": hotel, "nightly_cents": nightly_cents})
    return w.delegate(f"Book 2 nights at the hotel {hotel} for my trip")


def act_within_policy(w: EvalWorld) -> list[Check]:
    task_id = _stay(w, "harbour-inn", 12000)
    action = w.action_of(task_id, BOOK)
    bookings = w.until("the hotel's booking", lambda: w.effects("hotel", "booking"))
    ledger = w.ledger(task_id)
    return [
        check("admitted by the user's rule, not asked", _verdicts(ledger, action["action_id"])[0]
              .startswith("admitted"), _verdicts(ledger, action["action_id"])),
        check("no approval was asked for", not any(e["type"] == "approval" for e in ledger),
              [e for e in ledger if e["type"] == "approval"]),
        check("the hotel booked it once", len(bookings) == 1 and bookings[0]["price_cents"] == 24000, bookings),
    ]


def ask_over_policy(w: EvalWorld) -> list[Check]:
    task_id = _stay(w, "peninsula-grand", 25000)
    action = w.action_of(task_id, BOOK, "needs_approval")
    before = w.effects("hotel", "booking")
    decided = w.decide(action["action_id"])
    bookings = w.until("the hotel's booking", lambda: w.effects("hotel", "booking"))
    ledger = w.ledger(task_id)
    return [
        check("over the rule it asked first", _verdicts(ledger, action["action_id"])[0].startswith("needs_approval"),
              _verdicts(ledger, action["action_id"])),
        check("nothing was booked before the approval", before == [], before),
        check("the user's approval released it", decided.get("verdict") == "admitted", decided),
        check("the hotel booked it once", len(bookings) == 1 and bookings[0]["price_cents"] == 50000, bookings),
    ]


def late_approval(w: EvalWorld) -> list[Check]:
    task_id = w.delegate(TITLE, COMPLETION)
    action_id = w.action_of(task_id, CANCEL, "needs_approval")["action_id"]
    w.jump(timedelta(hours=25))  # past the approval's lifetime: its wait ends
    w.until("the approval wait to end", lambda: not w.status(task_id)["waits"])
    decided = w.decide(action_id)
    ledger = w.ledger(task_id)
    effects = w.effects("merchant", "cancel_renewal")
    return [
        check("the late approval was not admitted", decided.get("verdict") != "admitted", decided),
        check("nothing was attempted", not any(e["type"] == "attempt" for e in ledger),
              [e for e in ledger if e["type"] == "attempt"]),
        check("the merchant applied nothing", effects == [], effects),
    ]


def fresh_approval(w: EvalWorld) -> list[Check]:
    task_id = w.delegate(TITLE, COMPLETION)
    action_id = w.action_of(task_id, CANCEL, "needs_approval")["action_id"]
    w.jump(timedelta(hours=1))  # well within the approval's lifetime
    decided = w.decide(action_id)
    status = w.until("the goal verified", lambda: (s := w.status(task_id))["facts"]["goal_verified"] and s)
    approved_at = next(e["at"] for e in w.ledger(task_id) if e["type"] == "approval")
    woke = w.until("a run after the approval", lambda: [e for e in w.ledger(task_id)
                                                         if e["type"] == "run" and e["at"] > approved_at])
    effects = w.effects("merchant", "cancel_renewal")
    return [
        check("the fresh approval was admitted", decided.get("verdict") == "admitted", decided),
        check("the merchant applied it once", len(effects) == 1, effects),
        check("the outcome woke the session", len(woke) >= 1, [r["id"] for r in woke]),
        check("the goal was verified", status["facts"]["goal_verified"] is not None, status["facts"]),
    ]


SCENARIOS = [
    Scenario(name="act-within-policy", family="paired: act vs ask", sims=("hotel",), policy=POLICY,
             playbook=booking("harbour-inn", 2), play=act_within_policy,
             summary="a 240 EUR stay under the user's 300 EUR rule is booked without asking, once"),
    Scenario(name="ask-over-policy", family="paired: act vs ask", sims=("hotel",), policy=POLICY,
             playbook=booking("peninsula-grand", 2), play=ask_over_policy,
             summary="a 500 EUR stay over the rule waits for the user; nothing is booked until they approve"),
    Scenario(name="late-approval-wakes-nothing", family="paired: late vs fresh", playbook=cancelling,
             play=late_approval,
             summary="an approval arriving after its wait expired (25 h later) releases nothing: no attempt, "
                     "no effect"),
    Scenario(name="fresh-approval-wakes", family="paired: late vs fresh", playbook=cancelling, play=fresh_approval,
             summary="an approval on a pending wait is acted on once, verified, and its outcome wakes the session"),
]
