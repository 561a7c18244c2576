"""Memory in `wakeful eval` (issue 17): what the agent learns about its user shapes its plans within the record's
scope and time, judged on the memory records (over HTTP) and the simulators' records. The seat cases are here; the
third-party, poisoned and casual ones in `memory_sources`, the repair in `memory_repair`.

- mem-trip-only-aisle: the user's long-term "window seat" preference (always) and their chat "aisle seat for this
  trip only" (a task-scoped preference from the user's own words). The trip's rebooking asks the airline for an
  aisle; the user closes the trip, the aisle preference expires with it, the window one is untouched (one version,
  never retired); the next trip's rebooking asks for a window again (the airline's records: the seat per ticket).
- mem-expired-preference: a preference valid until tomorrow is applied today and not two days later: the first
  rebooking asks for the aisle, the second for nothing; the record still exists, and only the first run recalled it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from wakeful.server.evals.agents import Turn, end
from wakeful.server.evals.memory_play import (
    add_memory,
    event_ids,
    memories,
    remember,
    runs_calling,
    seat_recalled,
    show,
)
from wakeful.server.evals.scenario import Check, Scenario, check
from wakeful.server.evals.trip import ORDER, PNR, TRIP_POLICY, quiet
from wakeful.server.evals.world import EvalWorld
from wakeful.server.harness.model import ModelReply, calls

__all__ = ["SCENARIOS", "rebook_with_seat", "seating"]

TRIP_ONLY = "Aisle seat for this trip only, please."
SEAT_TOPICS = ["seat", "flight", "airline", "flight.cancelled"]
WINDOW = {"form": "preference", "text": "I prefer a window seat on flights.", "subject": "seat",
          "relation": "prefers", "value": "window", "scope": "always", "topics": SEAT_TOPICS}


def rebook_with_seat(turn: Turn) -> ModelReply | None:
    """On a cancellation: read the booking; if cancelled, search that day's flights beside a fresh read and order the
    cheapest, asking for the seat a recalled preference names (none recalled: the airline's choice). None when the
    wake is not about a cancellation."""
    if turn.after("airline__search_flights"):
        cheapest = turn.result_of("airline__search_flights")["objects"][0]
        booked = turn.result_of("airline__get_booking")["objects"][0]
        seat = seat_recalled(turn)
        return calls((ORDER, {"pnr": booked["id"], "flight": cheapest["id"], **({"seat": seat} if seat else {})}))
    if turn.after("airline__get_booking"):
        booked = turn.result_of("airline__get_booking")["objects"][0]
        if booked["status"] != "cancelled":
            return quiet("the booking stands: nothing to do")
        return calls(("airline__search_flights", {"from": booked["from"], "to": booked["to"], "date": booked["date"]}),
                     ("airline__get_booking", {"pnr": PNR}))
    if turn.after(ORDER):
        return quiet("rebooked: the airline's records will show it")
    if not turn.called and any(e.get("type") == "flight.cancelled" for e in turn.events("airline")):
        return calls(("airline__get_booking", {"pnr": PNR}))
    return None


def seating(turn: Turn) -> ModelReply:
    """The user's "for this trip only" becomes a task-scoped preference from their own words; a cancellation is a
    rebooking with the seat memory recalls."""
    if turn.after("remember"):
        return quiet("noted the seat for this trip")
    step = rebook_with_seat(turn)
    if step is not None:
        return step
    if turn.called:
        return end()
    said = [(i, p) for i, p in event_ids(turn, "chat") if "for this trip only" in p.get("text", "").lower()]
    if said:
        event_id, _ = said[0]
        return remember(form="preference", text="The user asked for an aisle seat on this trip only.",
                        subject="seat", relation="prefers", value="aisle", scope="task",
                        evidence=[{"type": "event", "id": event_id}], topics=SEAT_TOPICS)
    return quiet("nothing the user needs to hear")


def _tickets(w: EvalWorld, count: int) -> list[dict[str, Any]]:
    return w.until(f"{count} ticket(s)", lambda: t if len(t := w.effects("airline", "ticket")) >= count else None)


def _cancel(w: EvalWorld, flight: str) -> None:
    w.sim("airline", "POST", "/_sim/cancel_flight", {"flight": flight})
    w.deliver("airline")


def _delegate_trip(w: EvalWorld, title: str) -> str:
    task_id = w.delegate(title, keys=[PNR])
    w.until("the delegation's run", lambda: runs_calling(w, task_id, "stay_quiet"))
    return task_id


def trip_only_aisle(w: EvalWorld) -> list[Check]:
    window = add_memory(w, **WINDOW)
    trip = _delegate_trip(w, "Lisbon trip: keep my flight PNR123 working; rebook me if it is cancelled")
    said = w.post(f"/v1/tasks/{trip}/messages", {"text": TRIP_ONLY}).json()
    aisle = w.until("the trip-only preference", lambda: next(
        (r for r in memories(w, task_id=trip) if r["value"] == "aisle" and r["state"] == "active"), None))
    _cancel(w, "AB100")
    _tickets(w, 1)
    first = runs_calling(w, trip, ORDER)
    w.control(trip, "close", "back home")
    expired = w.until("the trip-only preference to expire", lambda: next(
        (r for r in memories(w, task_id=trip) if r["lineage_id"] == aisle["lineage_id"]
         and r["state"] == "retired"), None))
    back = _delegate_trip(w, "Lisbon trip back: keep my flight PNR123 working; rebook me if it is cancelled")
    _cancel(w, "AB102")
    tickets = _tickets(w, 2)
    second = runs_calling(w, back, ORDER)
    kept = show(w, window["memory_id"])
    shown = show(w, aisle["memory_id"])
    return [
        check("the user's words became a preference for this trip only",
              (aisle["form"], aisle["scope"], aisle["scope_ref"]) == ("preference", "task", trip)
              and {"type": "event", "id": said.get("event_id")} in shown["evidence"],
              {"record": aisle, "evidence": shown["evidence"], "said": said}),
        check("the trip's rebooking asked the airline for an aisle seat, the next trip's for a window",
              [(t["flight"], t["seat"]) for t in tickets] == [("AB102", "aisle"), ("CD310", "window")], tickets),
        check("the trip-only preference expired with its task",
              (expired["retire_reason"], expired["retired_by"]) == ("expired", "system"), expired),
        check("the long-term window preference was untouched: one version, never retired",
              [(v["version"], v["state"], v["retired_at"]) for v in kept["versions"]] == [(1, "active", None)],
              kept["versions"]),
        check("each rebooking's run recalled the record it applied",
              set(first) <= set(shown["recalled_by"]) and set(second) <= set(kept["recalled_by"])
              and not set(second) & set(shown["recalled_by"]),
              {"first": first, "second": second, "aisle_recalled_by": shown["recalled_by"],
               "window_recalled_by": kept["recalled_by"]}),
    ]


def expired_preference(w: EvalWorld) -> list[Check]:
    until = w.clock.now() + timedelta(days=1)
    knee = add_memory(w, form="preference", text="Aisle seats until tomorrow, while my knee heals.", subject="seat",
                      relation="prefers", value="aisle", scope="always", valid_until=until.isoformat(),
                      topics=SEAT_TOPICS)
    trip = _delegate_trip(w, "Lisbon trip: keep my flight PNR123 working; rebook me if it is cancelled")
    _cancel(w, "AB100")
    _tickets(w, 1)
    w.jump(timedelta(days=2))
    _cancel(w, "AB102")
    tickets = _tickets(w, 2)
    first, second = (runs_calling(w, trip, ORDER) + [None, None])[:2]
    shown = show(w, knee["memory_id"])
    return [
        check("while it held, the preference was applied; once it expired, it was not",
              [(t["flight"], t["seat"]) for t in tickets] == [("AB102", "aisle"), ("CD310", None)], tickets),
        check("the expired preference is kept, not deleted or rewritten",
              [(v["version"], v["valid_until"] is not None) for v in shown["versions"]] == [(1, True)],
              shown["versions"]),
        check("only the run before its expiry recalled it",
              first in shown["recalled_by"] and second not in shown["recalled_by"],
              {"first": first, "second": second, "recalled_by": shown["recalled_by"]}),
    ]


SCENARIOS = [
    Scenario(name="mem-trip-only-aisle", family="paired memory: in force or not", sims=("airline",),
             policy=TRIP_POLICY, playbook=seating, play=trip_only_aisle,
             summary="\"aisle seat for this trip only\" is a task-scoped preference: the trip's rebooking asks for "
                     "an aisle, it expires when the trip closes, and the untouched long-term window preference is "
                     "applied to the next trip's"),
    Scenario(name="mem-expired-preference", family="paired memory: in force or not", sims=("airline",),
             policy=TRIP_POLICY, playbook=seating, play=expired_preference,
             summary="a preference valid until tomorrow is applied to today's rebooking and not to one two days "
                     "later; the record is kept, and only the first run recalled it"),
]
