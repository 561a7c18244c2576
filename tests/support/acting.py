"""A world to act in: the merchant, airline and hotel simulators on loopback, the real connector declarations
pointed at them, and the tool layer and dispatcher over a real SQLite file."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from starlette.types import ASGIApp, Receive, Scope, Send

from wakeful.proxy.clock import FakeClock
from wakeful.server.acting import approvals
from wakeful.server.acting.connectors import load_connectors
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control, sessions
from wakeful.server.core.worker import Binding
from wakeful.server.egress.dispatch import ActionDispatcher
from wakeful.server.egress.outbound import ConnectorHTTP
from wakeful.server.settings import EXAMPLE_POLICIES
from wakeful.server.sims import Airline, Hotel, Merchant, SimClock, create_airline, create_hotel, create_merchant, serve
from wakeful.server.store.db import write
from wakeful.server.tools.layer import ToolLayer

CANCEL_VERIFIED = [{"effect": "merchant__cancel_renewal",
                    "verify": {"read": "merchant__get_subscription", "with": {"subscription": "subscription"},
                               "done_when": {"at": "renewal", "equals": "off"}}}]


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: list[tuple[str, str]]


def recorder(app: ASGIApp, into: list[Received]) -> ASGIApp:
    """`app`, noting each request to the simulated service (not its `/_sim` controls) before it handles it."""
    async def recording(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope["path"].startswith("/_sim/"):
            into.append(Received(method=scope["method"], path=scope["path"],
                                 headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]))
        await app(scope, receive, send)
    return recording


@dataclass
class World:
    engine: Engine
    clock: FakeClock
    owner: str
    merchant: Merchant
    airline: Airline
    hotel: Hotel
    tools: ToolLayer
    dispatcher: ActionDispatcher
    policy: Policy
    received: dict[str, list[Received]]
    """Per simulator, every request as it arrived (headers included): where an injected credential shows up."""

    def task(self, title: str = "cancel my subscription but keep this month",
             completion: list[dict[str, Any]] | None = None, constraints: dict[str, Any] | None = None) -> Binding:
        with write(self.engine) as conn:
            session_id = sessions.create_session(conn, user_id=self.owner, now=self.clock.now())
            task_id = control.create_task(conn, user_id=self.owner, session_id=session_id, title=title,
                                          now=self.clock.now(), completion=completion or [],
                                          constraints=constraints)
        return Binding(user_id=self.owner, task_id=task_id, session_id=session_id)

    def call(self, binding: Binding, tool: str, **args: Any) -> dict[str, Any]:
        return self.tools.call(binding, tool, args)

    def approve(self, action_id: str) -> str:
        """The user approves on the control channel; returns the re-admission verdict's code."""
        with write(self.engine) as conn:
            decided = approvals.decide(conn, user_id=self.owner, action_id=action_id, approve=True,
                                       actor="user:test", policy=self.policy, now=self.clock.now())
        return decided.verdict.code


@contextmanager
def world(engine: Engine, clock: FakeClock, owner: str, *, policy: Policy | None = None,
          client_timeout: float = 2.0, http: ConnectorHTTP | None = None, tls: Path | None = None) -> Iterator[World]:
    """With `tls` (a PEM with a certificate for `<name>.test` and its key), the simulators serve HTTPS and the
    connectors address them as `https://<name>.test:<port>`: resolving those names is the egress proxy's job."""
    received: dict[str, list[Received]] = {}
    sim_clock = SimClock()
    clock.set(sim_clock.now())  # one notion of "now" for quote expiry on both sides
    merchant_app, merchant = create_merchant(clock=sim_clock)
    airline_app, airline = create_airline(clock=sim_clock)
    hotel_app, hotel = create_hotel(clock=sim_clock)
    policy = policy or Policy(reconcile_window=timedelta(minutes=30))
    with ExitStack() as stack:
        apps = {"merchant": merchant_app, "airline": airline_app, "hotel": hotel_app}
        urls = {name: stack.enter_context(serve(recorder(app, received.setdefault(name, [])),
                                                tls=str(tls) if tls else None))
                for name, app in apps.items()}
        if tls is not None:
            urls = {name: url.replace("127.0.0.1", f"{name}.test") for name, url in urls.items()}
        registry = load_connectors(EXAMPLE_POLICIES / "connectors", base_urls=urls)
        http = http or ConnectorHTTP(timeout=client_timeout)
        tools = ToolLayer(engine, clock, registry=registry, policy=policy, http=http)
        dispatcher = ActionDispatcher(engine, clock, policy=policy, http=http, resend_after=timedelta(seconds=10))
        stack.callback(tools.close)
        stack.callback(dispatcher.close)
        yield World(engine=engine, clock=clock, owner=owner, merchant=merchant, airline=airline, hotel=hotel,
                    tools=tools, dispatcher=dispatcher, policy=policy, received=received)
