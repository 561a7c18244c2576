"""Acting: admission + dispatch-intent commit latency, and event → admitted dispatch end to end.

1. Commit latency: one write tool call for an auto-approved action (`hotel__book_quote` under a policy rule) — the
   arguments checked, objects resolved, the immutable action written, admission run and its verdict recorded, the
   dispatch intent queued, all in one fsynced SQLite transaction. Baseline: one fsynced single-row commit in the
   same database, the floor any durable write pays here.
2. End to end: a webhook event enters the inbox of a running runtime; the harness (a scripted model that asks for
   a quote, then books it) proposes the write; it is admitted by policy and dispatched to the hotel simulator on
   loopback. Measured from the event's commit to the attempt row the dispatcher persists before sending.
   Baseline: the same runtime's event → run start.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from _common import ROOT, Row, Table, bench_args, fmt_ms, percentile, print_and_save, reproduce
from sqlalchemy import select, text

from wakeful.proxy.clock import SystemClock
from wakeful.server.acting.connectors import load_connectors
from wakeful.server.acting.policy import AutoRule, Policy
from wakeful.server.core import control, sessions
from wakeful.server.core.worker import Binding
from wakeful.server.harness.model import ModelReply, ModelRequest, ScriptedModel, calls, quiet
from wakeful.server.harness.wake import Harness
from wakeful.server.runtime import Runtime, load_registry
from wakeful.server.settings import Settings
from wakeful.server.sims import create_hotel, serve
from wakeful.server.store import users
from wakeful.server.store.db import make_engine, migrate, read, write
from wakeful.server.store.tables import actions, attempts, events, runs, tasks
from wakeful.server.tools.layer import ToolLayer

POLICY = Policy(rules=(AutoRule(name="hotel-auto", tool="hotel__book_quote", max_amount_cents=10**9),))


def commit_latency(n: int) -> tuple[list[float], list[float]]:
    hotel_app, _ = create_hotel()
    with tempfile.TemporaryDirectory() as tmp, serve(hotel_app) as url:
        engine = make_engine(f"sqlite:///{tmp}/wakeful.db")
        migrate(engine)
        clock = SystemClock()
        registry = load_connectors(ROOT / "policies" / "connectors", base_urls={"hotel": url})
        tools = ToolLayer(engine, clock, registry=registry, policy=POLICY)
        with write(engine) as conn:
            owner, _ = users.ensure_user(conn, name="owner", now=clock.now())
            session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
            task_id = control.create_task(conn, user_id=owner, session_id=session_id, title="bench", now=clock.now())
        binding = Binding(user_id=owner, task_id=task_id)
        quotes = [tools.call(binding, "hotel__quote_stay", {"hotel": "Bench", "nights": 1})["objects"][0]["id"]
                  for _ in range(n + 5)]
        ours = []
        for i, quote in enumerate(quotes):
            start = time.perf_counter()
            result = tools.call(binding, "hotel__book_quote", {"quote_id": quote})
            if i >= 5:
                ours.append(time.perf_counter() - start)
            assert result["status"] == "admitted", result
        with engine.connect() as conn:
            conn.exec_driver_sql("CREATE TABLE bench_floor (id INTEGER PRIMARY KEY, v TEXT)")
            conn.commit()
        floor = []
        for i in range(n):
            start = time.perf_counter()
            with write(engine) as conn:
                conn.execute(text("INSERT INTO bench_floor (v) VALUES (:v)"), {"v": str(i)})
            floor.append(time.perf_counter() - start)
        tools.close()
        engine.dispose()
        return ours, floor


class HotelAgent(ScriptedModel):
    """Asked on a delegation: quote, then book the quote, then stay quiet; any other wake: stay quiet."""

    def __init__(self) -> None:
        super().__init__(script=[])

    def complete(self, request: ModelRequest) -> ModelReply:
        last = request.messages[-1]["content"]
        if isinstance(last, str):
            return calls(("hotel__quote_stay", {"hotel": "Bench", "nights": 1})) if "delegation" in last else \
                quiet("nothing to do")
        result = json.loads(last[0]["content"])
        if "objects" in result:
            return calls(("hotel__book_quote", {"quote_id": result["objects"][0]["id"]}))
        return quiet("booked")


def end_to_end(n: int) -> tuple[list[float], list[float]]:
    hotel_app, _ = create_hotel()
    with tempfile.TemporaryDirectory() as tmp, serve(hotel_app) as url:
        policies = Path(tmp) / "policies"
        (policies / "connectors").mkdir(parents=True)
        for f in (ROOT / "policies" / "connectors").glob("*.toml"):
            (policies / "connectors" / f.name).write_text(f.read_text())
        (policies / "policy.toml").write_text(
            '[[rules]]\nname = "hotel-auto"\ntool = "hotel__book_quote"\nmax_amount_cents = 1000000000\n')
        settings = Settings(data_dir=Path(tmp), policies_dir=policies, connector_urls={"hotel": url},
                            poll_interval=0.5, sources={})
        registry = load_registry(settings)
        harness = Harness(HotelAgent(), registry=registry, instructions=None, max_tokens_per_run=10**9)
        runtime = Runtime(settings, handler=harness, registry=registry)
        runtime.prepare()
        runtime.start()
        try:
            with write(runtime.engine) as conn:
                owner = users.user_id_by_name(conn, "owner")
            for i in range(n):
                with write(runtime.engine) as conn:
                    session_id = sessions.create_session(conn, user_id=owner, now=runtime.clock.now())
                    control.create_task(conn, user_id=owner, session_id=session_id, title=f"stay {i}",
                                        now=runtime.clock.now())
                runtime.signals.work.set()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    with read(runtime.engine) as conn:
                        if len(conn.execute(select(attempts.c.id)).all()) > i:
                            break
                    time.sleep(0.005)  # polling the database inside a bounded loop
            with read(runtime.engine) as conn:
                first_event = {r.session_id: r.received_at for r in conn.execute(
                    select(events.c.session_id, events.c.received_at).where(events.c.source == "delegation"))}
                run_start = {r.session_id: r.started_at for r in conn.execute(  # each session's first run
                    select(runs.c.session_id, runs.c.started_at).order_by(runs.c.started_at.desc()))}
                sent = conn.execute(select(tasks.c.session_id, attempts.c.created_at)
                                    .join(actions, actions.c.id == attempts.c.action_id)
                                    .join(tasks, tasks.c.id == actions.c.task_id)).all()
        finally:
            runtime.stop()
        dispatch = [(created - first_event[s]).total_seconds() for s, created in sent]
        wake = [(run_start[s] - first_event[s]).total_seconds() for s in first_event if s in run_start]
        return dispatch, wake


def run(quick: bool) -> list[Table]:
    n = 30 if quick else 200
    ours, floor = commit_latency(n)
    dispatch, wake = end_to_end(10 if quick else 40)
    return [Table(
        title="Acting: admission + dispatch intent commit, and event → admitted dispatch (auto-approved)",
        rows=[Row("write tool call → admitted + intent committed p50", fmt_ms(percentile(ours, 50)),
                  fmt_ms(percentile(floor, 50)) + " (1-row fsync)"),
              Row("write tool call → admitted + intent committed p99", fmt_ms(percentile(ours, 99)),
                  fmt_ms(percentile(floor, 99)) + " (1-row fsync)"),
              Row("event → attempt persisted p50 (end to end)", fmt_ms(percentile(dispatch, 50)),
                  fmt_ms(percentile(wake, 50)) + " (event → run)"),
              Row("event → attempt persisted p99 (end to end)", fmt_ms(percentile(dispatch, 99)),
                  fmt_ms(percentile(wake, 99)) + " (event → run)")],
        reproduce=reproduce("admission.py", quick),
        notes=["end to end includes two model steps (scripted), a quote read from the hotel simulator over "
               "loopback, admission, the intent, and the dispatcher's attempt row"])]


if __name__ == "__main__":
    args = bench_args(__doc__ or "")
    print_and_save(run(args.quick), "admission.txt")
