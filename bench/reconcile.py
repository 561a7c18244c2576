"""Reads per minute to a provider during a long unknown: the reconciler's pace while a lookup answers 302.

The merchant simulator on loopback answers the cancellation with 503 (the outcome is unknown, nothing applied) and
every reconcile lookup with a 302 to its sign-in page, so the outcome stays unknown for the whole reconcile window.
Reads are counted where they arrive: at the simulator.

1. The first minute, in real time: a started `Runtime` (its own loops and threads, the system clock) from the
   moment the outcome is recorded unknown. This is where a reconciler that wakes itself after every look shows.
2. The whole reconcile window (the default 30 minutes), in simulated time: the same runtime's reconciler rounds,
   driven once per simulated second on a fake clock (woken far more often than its loop would be), so the figure is
   the pacing's, not the loop's.

Baseline: what `reconcile_interval` promises, one read per interval (12 a minute at the default 5 s).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from _common import ROOT, Row, Table, bench_args, print_and_save, reproduce
from starlette.types import ASGIApp, Receive, Scope, Send

from wakeful.proxy.clock import Clock, FakeClock, SystemClock
from wakeful.server.acting import approvals
from wakeful.server.core import control, sessions
from wakeful.server.core.worker import Binding
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.sims import SimClock, create_merchant, serve
from wakeful.server.store import users
from wakeful.server.store.db import write

LOOKUP = "/v1/cancellations"


@dataclass
class Lookups:
    """Reconcile lookups the simulator received, with the monotonic time of each."""

    at: list[float]

    def counting(self, app: ASGIApp) -> ASGIApp:
        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["path"] == LOOKUP:
                self.at.append(time.monotonic())
            await app(scope, receive, send)
        return counted


def unknown_cancellation(runtime: Runtime) -> None:
    """A task, a read, a cancellation the user approves: the dispatcher sends it and the merchant answers 503."""
    now = runtime.clock.now
    with write(runtime.engine) as conn:
        owner = users.user_id_by_name(conn, "owner")
        session_id = sessions.create_session(conn, user_id=owner, now=now())
        task_id = control.create_task(conn, user_id=owner, session_id=session_id, title="stop it renewing", now=now())
    binding = Binding(user_id=owner, task_id=task_id)
    (sub,) = runtime.tools.call(binding, "merchant__list_subscriptions", {})["objects"]
    action_id = runtime.tools.call(binding, "merchant__cancel_renewal", {"subscription": sub["id"]})["action_id"]
    with write(runtime.engine) as conn:
        approvals.decide(conn, user_id=owner, action_id=action_id, approve=True, actor="user:bench",
                         policy=runtime.policy, now=now())
    runtime.signals.wake_all()


def with_runtime(tmp: Path, clock: Clock, body: Callable[[Runtime, Lookups], None], *, start: bool) -> Lookups:
    """The merchant (lookups counted) and a prepared runtime over a fresh SQLite file; started when `start`."""
    app, merchant = create_merchant(clock=SimClock())
    merchant.faults.update({"fail_before_commit": 1, "lookups_redirect": True})
    lookups = Lookups(at=[])
    with serve(lookups.counting(app)) as url:
        settings = Settings(data_dir=tmp, policies_dir=ROOT / "policies", connector_urls={"merchant": url},
                            proxy=False, computers=False, sources={})
        runtime = Runtime(settings, handler=EchoHandler(), clock=clock)
        runtime.prepare()
        if start:
            runtime.start()
        try:
            body(runtime, lookups)
        finally:
            if start:
                runtime.stop()
            else:
                runtime.messages.close()
                runtime.egress.close()
    return lookups


def real_time(seconds: float) -> float:
    """Lookups per minute over the first `seconds` of the unknown, with the runtime's own loops running."""
    def run(runtime: Runtime, lookups: Lookups) -> None:
        unknown_cancellation(runtime)
        deadline = time.monotonic() + 30
        while not lookups.at and time.monotonic() < deadline:
            time.sleep(0.01)  # a poll tick inside a bounded loop: until the first lookup arrives
        threading.Event().wait(seconds)  # the measured window itself

    with tempfile.TemporaryDirectory(prefix="wakeful-bench-") as tmp:
        lookups = with_runtime(Path(tmp), SystemClock(), run, start=True)
    if not lookups.at:
        return float("nan")
    window = [t for t in lookups.at if t <= lookups.at[0] + seconds]
    return len(window) * 60 / seconds


def simulated(window: timedelta) -> tuple[float, float]:
    """Lookups per minute over the whole `window` and over its last ten minutes, the reconciler driven once per
    simulated second."""
    clock = FakeClock()
    marks: list[int] = []

    def run(runtime: Runtime, lookups: Lookups) -> None:
        unknown_cancellation(runtime)
        runtime.actions.drain()
        for _ in range(int(window.total_seconds())):
            clock.advance(timedelta(seconds=1))
            runtime.reconcile_once()
            marks.append(len(lookups.at))

    with tempfile.TemporaryDirectory(prefix="wakeful-bench-") as tmp:
        with_runtime(Path(tmp), clock, run, start=False)
    minutes = window.total_seconds() / 60
    last = marks[-1] - marks[-601] if len(marks) > 600 else marks[-1]
    return marks[-1] / minutes, last / 10


def run(quick: bool) -> list[Table]:
    settings = Settings(sources={})
    promised = 60 / settings.reconcile_interval
    seconds = 20.0 if quick else 60.0
    first = real_time(seconds)
    whole, last = simulated(timedelta(minutes=30))
    return [Table(
        title="Reconciliation pace: reads per minute to a provider whose lookup answers 302 (an unknown outcome)",
        rows=[Row(f"first {seconds:.0f} s, real loops and clock", f"{first:,.1f}/min", f"{promised:.1f}/min"),
              Row("30-minute reconcile window, simulated", f"{whole:,.1f}/min", f"{promised:.1f}/min"),
              Row("its last 10 minutes", f"{last:,.1f}/min", f"{promised:.1f}/min")],
        reproduce=reproduce("reconcile.py", quick),
        notes=[f"baseline: one read per reconcile_interval ({settings.reconcile_interval:g} s), what the setting "
               "promises; the simulated rows wake the reconciler every simulated second"])]


if __name__ == "__main__":
    args = bench_args(__doc__ or "")
    print_and_save(run(args.quick), "reconcile.txt")
