"""Run handlers that need no model: the one `wakeful serve` runs without a model key, and those tests drive.

    NoModelHandler   without a model the agent is quiet: events and timers are recorded and settled, each run ends
                     in silence ("no model configured"), and the user is told once, ever, how to configure one
    EchoHandler      one reply per run naming its events: a handler that speaks, for tests and benches of the
                     worker and the outbox
    ScriptedHandler  a list of step functions, one per run, then the echo

The model harness (`harness.wake.Harness`) is another `RunHandler`; the worker does not know the difference.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from functools import partial

from sqlalchemy import Connection

from wakeful.server.core import outbox
from wakeful.server.core.worker import RunContext

__all__ = ["NO_MODEL", "EchoHandler", "NoModelHandler", "ScriptedHandler"]

NO_MODEL = "no model configured"
NO_MODEL_TEXT = ("No model is configured, so I only record what arrives and act on nothing. Set "
                 "WAKEFUL_ANTHROPIC_API_KEY (or ANTHROPIC_API_KEY), or anthropic_api_key in the settings file, and "
                 "restart `wakeful serve`; what was recorded meanwhile stays in the ledger.")


class NoModelHandler:
    """The agent starts quiet: no reply per event, one notice per user (its fixed ID keeps it one across restarts)."""

    def __call__(self, ctx: RunContext) -> None:
        ctx.step()
        ctx.effects.append(partial(_tell_once, ctx.user_id))
        ctx.silence(NO_MODEL)


def _tell_once(user_id: str, conn: Connection, now: datetime) -> None:
    outbox.enqueue(conn, user_id=user_id, message_id=f"nomodel_{user_id}", once=True, now=now,
                   body={"kind": "no_model", "text": NO_MODEL_TEXT})


class EchoHandler:
    """One reply per run, naming every event the run was handed (three quick events, one reply)."""

    def __call__(self, ctx: RunContext) -> None:
        ctx.step()
        if all(e.kind == "control" and e.source != "delegation" for e in ctx.events):
            ctx.silence("only control events: nothing to tell the user")
            return
        listed = ", ".join(f"{e.source}:{e.source_id}" for e in ctx.events)
        ctx.send_to_user(f"Received {len(ctx.events)} event(s): {listed}",
                         event_ids=[e.id for e in ctx.events],
                         source_ids=[f"{e.source}:{e.source_id}" for e in ctx.events])


class ScriptedHandler:
    """Replays a list of step functions, one per run, then falls back to `EchoHandler`."""

    def __init__(self, script: list[Callable[[RunContext], None]]) -> None:
        self._script = list(script)
        self.seen: list[RunContext] = []

    def __call__(self, ctx: RunContext) -> None:
        self.seen.append(ctx)
        if self._script:
            self._script.pop(0)(ctx)
        else:
            EchoHandler()(ctx)
