"""What the Hong Kong trip's days share: the traveller's time zone, policy and keys, and the airline's steps of a
(re)booking that the scripted agent takes on several days.

The trip's deliveries find it by its keys: the booking's PNR (the airline's webhooks) and the mail thread with the
client's assistant (the mail simulator's), bound when the user delegates.
"""

from __future__ import annotations

from typing import Any
from zoneinfo import ZoneInfo

from wakeful.server.evals.agents import Turn
from wakeful.server.evals.paired import POLICY
from wakeful.server.harness.model import ModelReply, calls

__all__ = ["CENTRAL", "CLIENT", "ORDER", "PNR", "REPLY", "THREAD", "TRIP_POLICY", "ZONE", "quiet", "rebooking",
           "sent_mail"]

ZONE = ZoneInfo("Asia/Hong_Kong")
"""Where the traveller is: checks run and quiet hours are read in this zone (`PUT /v1/preferences`)."""
PNR = "PNR123"
"""The trip's booking at the airline (the simulator seeds it: AB100, a week ahead)."""
THREAD = "thr-hk-meeting"
"""The mail thread with the client's assistant about the meeting in Central."""
CLIENT = "assistant@client.example"
ORDER = "airline__order_flight"
REPLY = "mail__reply"
TRIP_POLICY = POLICY.replace("]\n", f', {{ name = "trip-flights", tool = "{ORDER}", max_amount_cents = 20000 }} ]\n')
"""The trip's policy: stays up to 300 EUR and flights up to 200 EUR go ahead without asking."""
CENTRAL = "central-plaza"
"""The hotel near the client's new meeting place: over the policy."""


def quiet(reason: str) -> ModelReply:
    """End the wake without a message, saying why (the run's reason in the ledger)."""
    return calls(("stay_quiet", {"reason": reason}))


def rebooking(turn: Turn, pnr: str = PNR) -> ModelReply | None:
    """After reading the booking: search that day's flights on its route beside a fresh read of booking `pnr`; after
    the search: order the cheapest for it. None when the last step was neither."""
    if turn.after("airline__search_flights"):
        cheapest = turn.result_of("airline__search_flights")["objects"][0]
        booked = turn.result_of("airline__get_booking")["objects"][0]
        return calls((ORDER, {"pnr": booked["id"], "flight": cheapest["id"]}))
    if turn.after("airline__get_booking"):
        booked = turn.result_of("airline__get_booking")["objects"][0]
        return calls(("airline__search_flights", {"from": booked["from"], "to": booked["to"], "date": booked["date"]}),
                     ("airline__get_booking", {"pnr": pnr}))
    return None


def sent_mail(effects: list[dict[str, Any]], address: str) -> list[dict[str, Any]]:
    """Of the mail simulator's `send` effects, those that went to `address`, as a recipient or in copy."""
    return [e for e in effects if address in [*e["to"], *e["cc"]]]
