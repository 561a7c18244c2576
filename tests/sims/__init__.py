"""Test-only simulators of external services (merchant, airline, hotel) with fault knobs and their own records.

Each `create_*()` returns `(app, sim)`: run the FastAPI `app` in-process (TestClient) or on loopback with
`serve(app)`, and assert on `sim.effects` (or `GET /_sim/records`) — what the service actually applied.
"""

from tests.sims._base import Faults, Reply, Sim, SimClock, WebhookOutbox, serve
from tests.sims.airline import Airline, AirlineFaults, create_airline
from tests.sims.hotel import Hotel, HotelFaults, create_hotel
from tests.sims.merchant import Merchant, MerchantFaults, create_merchant

__all__ = [
    "Airline", "AirlineFaults", "Faults", "Hotel", "HotelFaults", "Merchant", "MerchantFaults", "Reply", "Sim",
    "SimClock", "WebhookOutbox", "create_airline", "create_hotel", "create_merchant", "serve",
]
