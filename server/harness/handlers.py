"""Run handlers that need no model: the demo's echo and the scripted handler tests drive.

The model harness (a later capability) is another `RunHandler`; the worker does not know the difference.
"""

from __future__ import annotations

from collections.abc import Callable

from wakeful.server.core.worker import RunContext

__all__ = ["EchoHandler", "ScriptedHandler"]


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
