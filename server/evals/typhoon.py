"""The trip's typhoon night (D9) and its end (D12).

- hk-d9-typhoon-night: quiet hours 23:00-07:30 in Asia/Hong_Kong. At 02:10 a typhoon advisory and two cancellation
  notices for the trip's PNR arrive within the coalescing window: one run. The agent reads the booking (the
  cancellation verified on the airline's records, not taken from the notice), rebooks within the user's policy once
  (one new ticket), and proposes the hotel extension and moving the meeting, both of which wait for the user's
  approval and are not executed. The user gets nothing before 07:30 and one summary at 07:30.
- hk-d12-closure: the trip's completion condition is verified against the airline's records (the four facts, the
  evidence); the agent asks before closing, the user closes the task over HTTP; its keys are released (a later
  delivery carrying one goes to triage, not to the closed trip) and its daily check ends with it. The run that asks
  distils the rebooking through `remember`: a Skill revision (how a typhoon night's rebooking goes) and a
  preference candidate (the cheapest flight that day will do), both pending the user, and still pending after the
  closure.
"""

from __future__ import annotations

import json
from datetime import time, timedelta
from typing import Any

from wakeful.server.evals.agents import Turn, end
from wakeful.server.evals.memory_play import mentioned
from wakeful.server.evals.paired import BOOK
from wakeful.server.evals.scenario import Check, check
from wakeful.server.evals.trip import CENTRAL, CLIENT, ORDER, PNR, REPLY, THREAD, ZONE, quiet, rebooking
from wakeful.server.evals.waiting import mail
from wakeful.server.evals.world import EvalWorld
from wakeful.server.harness.model import ModelReply, calls

__all__ = ["COMPLETION", "closing", "d12_closure", "d9_typhoon_night", "night"]

CANCELLED = "AB100"
"""The trip's flight (PNR123's), cancelled by the typhoon."""
ALERTS = frozenset({"flight.cancelled", "travel.advisory"})
ADVISORY = "Typhoon signal No. 8 expected from 03:00: flights from Hong Kong may be cancelled."
MEETING = "Confirmed: Thursday 10:00 at our Central office."
MOVE = "The typhoon cancelled my flight: could we move Thursday's meeting to Friday 10:00?"
REBOOKED = ("Typhoon overnight: the airline cancelled your flight (its booking says so). I rebooked you on the next "
            "flight that day, within your travel policy. Extending the hotel by 2 nights and moving Thursday's "
            "meeting wait for your approval.")
QUIET_HOURS = {"start": "23:00", "end": "07:30"}
NIGHT_AT, BEFORE_MORNING, MORNING_AT = time(2, 10), time(7, 29), time(7, 30)


def night(turn: Turn) -> ModelReply:
    """On a cancellation or an advisory: read the booking; if it is cancelled, rebook the cheapest flight that day,
    then propose extending the hotel and moving the meeting, and tell the user what was done."""
    if turn.after("airline__get_booking") and not turn.after("airline__search_flights"):
        if turn.result_of("airline__get_booking")["objects"][0]["status"] != "cancelled":
            return quiet("the booking stands: nothing to do")
    step = rebooking(turn) or _proposals(turn)
    if step is not None:
        return step
    if turn.called:
        return end()
    alerts = [e for e in turn.events("airline") if e.get("type") in ALERTS]
    if alerts:
        return calls(("airline__get_booking", {"pnr": alerts[0]["pnr"]}))
    return quiet("nothing the user needs to hear")


def _proposals(turn: Turn) -> ModelReply | None:
    """After the rebooking: quote and propose the hotel's extension, read the thread and propose moving the
    meeting, then tell the user."""
    if turn.after(ORDER):
        return calls(("hotel__quote_stay", {"hotel": CENTRAL, "nights": 2}))
    if turn.after("hotel__quote_stay"):
        return calls((BOOK, {"quote_id": turn.result_of("hotel__quote_stay")["objects"][0]["id"]}))
    if turn.after(BOOK):
        return calls(("mail__read_thread", {"thread_id": THREAD}))
    if turn.after("mail__read_thread"):
        return calls((REPLY, {"thread": turn.result_of("mail__read_thread")["objects"][0]["id"], "body": MOVE}))
    if turn.after(REPLY):
        return calls(("send_to_user", {"text": REBOOKED, "level": "act"}))
    return None


def _calls_of(ledger: list[dict[str, Any]], run_id: str) -> list[str]:
    """The tools a run's model proposed, in order (its decisions in the ledger)."""
    steps = sorted((e for e in ledger if e["type"] == "decision" and e["run_id"] == run_id), key=lambda e: e["step"])
    return [c["name"] for e in steps for c in e["proposal"]["tool_calls"]]


def _feed_position(w: EvalWorld) -> int:
    return max((m["seq"] for m in w.messages()), default=0)


def d9_typhoon_night(w: EvalWorld) -> list[Check]:
    w.prefer(timezone=ZONE.key, quiet_hours=QUIET_HOURS)
    w.sim("hotel", "POST", "/_sim/rates", {"hotel": CENTRAL, "nightly_cents": 25000})
    task_id = w.delegate("Hong Kong trip, D9: keep my flight, my stay in Central and Thursday's meeting working "
                         "through the typhoon", keys=[PNR, THREAD])
    mail(w, CLIENT, "Meeting in Central", MEETING, THREAD)
    w.jump_to(NIGHT_AT, ZONE)
    seen = _feed_position(w)
    w.sim("airline", "POST", "/_sim/advisory", {"pnr": PNR, "text": ADVISORY})
    w.sim("airline", "POST", "/_sim/cancel_flight", {"flight": CANCELLED, "notices": 2})
    arrived = w.deliver("airline")
    w.until("the rebooking's ticket", lambda: w.effects("airline", "ticket"))
    held = [w.action_of(task_id, tool, "needs_approval") for tool in (BOOK, REPLY)]
    w.jump_to(BEFORE_MORNING, ZONE)
    overnight = w.messages(seen)
    w.jump_to(MORNING_AT, ZONE)
    w.until("the morning summary", lambda: w.messages(seen))
    w.jump(timedelta(minutes=30))  # time for any second message to show
    morning, ledger = w.messages(seen), w.ledger(task_id)
    runs = {e["run_id"] for e in arrived}
    run = next(iter(runs))
    called = _calls_of(ledger, str(run))
    tickets = w.effects("airline", "ticket")
    booked = w.sim("airline", "GET", f"/v1/bookings/{PNR}")
    order = w.action_of(task_id, ORDER)["action_id"]
    verdicts = [e["verdict"] for e in ledger if e["type"] == "verdict" and e["action_id"] == order]
    return [
        check("the advisory and both cancellation notices were one run", len(arrived) == 3 and len(runs) == 1
              and run is not None, arrived),
        check("the cancellation was verified by reading the booking before rebooking", ORDER in called
              and "airline__get_booking" in called[:called.index(ORDER)], called),
        check("rebooked once within the policy: one new ticket, on a flight that still flies",
              verdicts[:1] == ["admitted"] and len(tickets) == 1 and tickets[0]["flight"] != CANCELLED
              and booked["status"] == "confirmed", {"verdicts": verdicts, "tickets": tickets, "booking": booked}),
        check("the hotel extension and the meeting wait for the user's approval, not executed",
              [a["verdict"] for a in held] == ["needs_approval"] * 2 and w.effects("hotel", "booking") == []
              and w.effects("mail", "send") == [], {"held": held, "hotel": w.effects("hotel", "booking"),
                                                      "mail": w.effects("mail", "send")}),
        check("nothing reached the user before 07:30", overnight == [], overnight),
        check("one summary at 07:30 carrying the night's news", len(morning) == 1
              and morning[0]["body"].get("kind") == "summary" and REBOOKED in morning[0]["body"]["text"],
              morning),
    ]


# -- D12 -------------------------------------------------------------------------------------------------------------

COMPLETION = [{"effect": ORDER, "verify": {"read": "airline__read_booking", "with": {"pnr": "pnr"},
                                           "done_when": {"at": "status", "equals": "confirmed"}}}]
"""Done when the airline accepted the ticketing order and its booking, read afresh, is confirmed."""
ASK_CLOSE = "Everything for the trip is done: your flight is ticketed and the airline confirms it. Shall I close it?"
DISTILLED_TOPICS = ["flight.cancelled", "travel.advisory", "airline", "flight", "rebooking"]
SKILL = {"form": "skill", "subject": "rebooking.typhoon", "relation": "procedure", "scope": "always",
         "value": "verify on the booking; rebook the cheapest flight that day within policy; hold the rest; summarize",
         "text": "When a typhoon cancels a flight: read the booking to verify the cancellation, rebook the cheapest "
                 "flight that day within the travel policy, leave the hotel extension and moving meetings for the "
                 "user's approval, and send one summary when quiet hours end."}
CANDIDATE = {"form": "preference", "subject": "flight.rebooking", "relation": "prefers", "scope": "always",
             "value": "cheapest that day", "confidence": 0.5,
             "text": "When a flight is cancelled, the user is content with the cheapest flight that day within policy."}


def closing(turn: Turn) -> ModelReply:
    """Keep a daily check and ticket the flight; once the booking reads confirmed and ticketed, ask the user whether
    to close the trip (once)."""
    if "<triage>" in turn.tail:
        return quiet("a delivery for no open task: leaving it")
    if turn.woken_by_delegation:
        return calls(("keep_checking", {"note": "the trip's bookings, until the trip is closed", "cron": "0 9 * * *"}),
                     ("airline__get_booking", {"pnr": PNR}))
    if turn.after("send_to_user") and ASK_CLOSE in json.dumps(turn.args_of("send_to_user")):
        return _distil(turn)
    if turn.after("remember"):
        return quiet("asked the user; what the trip taught waits for them")
    if turn.after("list_timers"):
        booked = (turn.result_of("airline__get_booking").get("objects") or [{}])[0]
        if booked.get("status") == "confirmed" and booked.get("ticket") and ASK_CLOSE not in turn.tail:
            return calls(("send_to_user", {"text": ASK_CLOSE, "level": "ask"}))
        return quiet("not done yet, or already asked")
    step = rebooking(turn)
    if step is not None:
        return step
    if turn.after(ORDER):
        return quiet("ordered: the airline's records will verify it")
    if turn.called:
        return end()
    if ASK_CLOSE in turn.tail:
        return quiet("waiting for the user to close the trip")
    return calls(("airline__get_booking", {"pnr": PNR}), ("list_timers", {}))


def _distil(turn: Turn) -> ModelReply:
    """The closure run's updater: the trip's rebooking (its order, by the action IDs the history names) distilled
    into a Skill revision and a preference candidate, both for the user to confirm."""
    evidence = [{"type": "action", "id": a} for a in mentioned(turn, "act")[:4]]
    return calls(("remember", {**SKILL, "evidence": evidence, "topics": DISTILLED_TOPICS}),
                 ("remember", {**CANDIDATE, "evidence": evidence, "topics": DISTILLED_TOPICS}))


def _distilled(w: EvalWorld, task_id: str) -> list[dict[str, Any]]:
    return [r for r in w.get("/v1/memory?limit=100")["records"] if r["task_id"] == task_id]


def _asked(w: EvalWorld) -> list[dict[str, Any]]:
    return [m for m in w.messages() if ASK_CLOSE in json.dumps(m["body"])]


def d12_closure(w: EvalWorld) -> list[Check]:
    w.prefer(timezone=ZONE.key)
    task_id = w.delegate("Hong Kong trip, D12: ticket my flight and close the trip once everything is done",
                         COMPLETION, keys=[PNR, THREAD])
    verified = w.until("the goal verified", lambda: (s := w.status(task_id))["facts"]["goal_verified"] and s)
    w.until("the agent's question", lambda: _asked(w))
    checking = w.status(task_id)["timers"]
    distilled = w.until("the closure run's distillation", lambda: d if len(d := _distilled(w, task_id)) >= 2
                        else None)
    w.control(task_id, "close", "all done, thanks")
    asked = _asked(w)
    status, ledger = w.status(task_id), w.ledger(task_id)
    w.sim("airline", "POST", "/_sim/advisory", {"pnr": PNR, "text": "Your next trip: nothing to report."})
    [later] = w.deliver("airline")
    tickets, booked = w.effects("airline", "ticket"), w.sim("airline", "GET", f"/v1/bookings/{PNR}")
    evidence = {e["source"]: e["verdict"] for e in ledger if e["type"] == "evidence"}
    closed = [e for e in ledger if e["type"] == "control" and e["kind"] == "close"]
    order = w.action_of(task_id, ORDER)["action_id"]
    after_close = {r["memory_id"]: r for r in _distilled(w, task_id)}
    refs = {r["memory_id"]: w.get(f"/v1/memory/{r['memory_id']}")["evidence"] for r in distilled}
    return [
        check("the completion condition was verified by a fresh read of the airline's booking",
              verified["facts"]["goal_verified"] is not None
              and (evidence.get("verify"), evidence.get("completion")) == ("accepted", "accepted")
              and len(tickets) == 1 and booked["status"] == "confirmed"
              and booked["ticket"]["number"] == tickets[0]["ticket_number"],
              {"facts": verified["facts"], "evidence": evidence, "tickets": tickets, "booking": booked}),
        check("the agent asked; the user closed the trip", len(asked) == 1 and status["state"] == "closed"
              and [e["actor"].split(":")[0] for e in closed] == ["user"], {"asked": asked, "closed": closed}),
        check("the trip's keys were released", {k["key"] for k in status["keys"]} == {PNR, THREAD}
              and all(k["released_at"] for k in status["keys"]), status["keys"]),
        check("its daily check ended with it", len(checking) == 1 and status["timers"] == [] and status["waits"] == []
              and [e["state"] for e in ledger if e["type"] == "timer_ended"] == ["cancelled"],
              {"before": checking, "after": status["timers"], "ended": [e for e in ledger
                                                                       if e["type"] == "timer_ended"]}),
        check("a later delivery carrying a released key no longer reaches the trip",
              later["session_id"] != verified["session_id"], later),
        check("the closure run distilled the rebooking: a Skill revision and a preference candidate, both pending",
              sorted((r["form"], r["state"], r["speaker"]) for r in distilled)
              == [("hypothesis", "pending", "agent"), ("skill", "pending", "agent")]
              and all({"type": "action", "id": order} in found for found in refs.values()),
              {"records": distilled, "evidence": refs, "order": order}),
        check("both still await the user after the closure", sorted(
            r["state"] for r in after_close.values() if r["memory_id"] in refs) == ["pending", "pending"],
              list(after_close.values())),
    ]
