"""Simulators of external services (merchant, airline, hotel, mail and calendar) with fault knobs and their own
records.

They ship with the package because `wakeful demo`, the evaluations and the tests all run against them; they import
nothing of the server (only `faces`, for the demo, imports them), so they stay a stand-in for the outside world.

Each `create_*()` returns `(app, sim)`: run the FastAPI `app` in-process (TestClient) or on loopback with
`serve(app)`, and assert on `sim.effects` (or `GET /_sim/records`) — what the service actually applied.
"""

from wakeful.server.sims._base import Faults, Reply, Sim, SimClock, WebhookOutbox, serve
from wakeful.server.sims.airline import Airline, AirlineFaults, create_airline
from wakeful.server.sims.hotel import Hotel, HotelFaults, create_hotel
from wakeful.server.sims.mail import Mail, MailFaults, create_mail
from wakeful.server.sims.merchant import Merchant, MerchantFaults, create_merchant

__all__ = [
    "Airline", "AirlineFaults", "Faults", "Hotel", "HotelFaults", "Mail", "MailFaults", "Merchant", "MerchantFaults",
    "Reply", "Sim", "SimClock", "WebhookOutbox", "create_airline", "create_hotel", "create_mail", "create_merchant",
    "serve",
]
