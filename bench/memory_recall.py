"""Memory recall at 10,000 records per user, beside the wake's other costs.

One user holds RECORDS memory record versions spread over forms (instructions, preferences, facts, statements,
episodes, sourced facts, pending hypotheses and skills), scopes (always, project, task over TASKS tasks, run), topics
(TOPICS words, two to four each), states (active, retired, pending) and validity (some past their valid_until); ten
other users hold OTHERS records each on the same topics. They are bulk-inserted into a real SQLite file (the committer's
per-record reads would only slow the set-up); the delegation, its keys and its events are made the ordinary way.
For one wake of the delegation (an airline push), measured in process with a fake clock:
    recall            `memory.recall` with the wake's focus (event kind and source, goal words, key prefixes)
    context           `harness.context.assemble` with recall, and with recall stubbed out (the baseline: the same
                      wake's context without memory)
    whole wake        a scripted wake (`Worker.run_once` with the harness; the model answers `stay_quiet` at once):
                      claim, context with recall, the decision, the tool call, the commit
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from _common import ROOT, Row, Table, bench_args, fmt_ms, percentile, print_and_save, reproduce
from sqlalchemy import Engine, func, insert, select

from wakeful.proxy.clock import FakeClock
from wakeful.server.acting.connectors import load_connectors
from wakeful.server.core import control, inbox, sessions
from wakeful.server.core.worker import EventView, Worker
from wakeful.server.harness import context as context_module
from wakeful.server.harness.context import assemble
from wakeful.server.harness.model import ScriptedModel, quiet
from wakeful.server.harness.wake import Harness
from wakeful.server.memory import Recall, recall
from wakeful.server.memory.recall import focus
from wakeful.server.settings import Settings
from wakeful.server.sims import SimClock, create_merchant, serve
from wakeful.server.store import users
from wakeful.server.store.db import make_engine, migrate, read, write
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import memories, memory_topics, memory_uses, runs

RECORDS = 10_000
OTHERS = 10
OTHER_RECORDS = 1_000
TASKS = 50
TOPICS = 200
GOAL = "Rebook the flight to Hong Kong if the typhoon cancels it; keep the hotel"
FORMS = [("preference", 30), ("fact", 10), ("statement", 10), ("episode", 20), ("sourced_fact", 15),
         ("hypothesis", 8), ("skill", 5), ("instruction", 2)]
SCOPES = [("always", 40), ("project", 20), ("task", 30), ("run", 10)]
NAMED = ["airline", "webhook", "flight", "hotel", "seat", "fare", "typhoon", "hong", "kong", "pnr", "rebook", "meal"]


def _pick(rng: random.Random, weighted: list[tuple[str, int]]) -> str:
    return rng.choices([w[0] for w in weighted], weights=[w[1] for w in weighted])[0]


Rows = list[dict[str, Any]]


def _records(rng: random.Random, user_id: str, n: int, *, now: datetime, tasks: list[str]) -> tuple[Rows, Rows]:
    vocabulary = NAMED + [f"topic{i}" for i in range(TOPICS - len(NAMED))]
    rows, topics = [], []
    for i in range(n):
        form, scope = _pick(rng, FORMS), _pick(rng, SCOPES)
        recorded = now - timedelta(days=rng.uniform(1, 400))
        retired = rng.random() < 0.15
        pending = form in ("hypothesis", "skill") and not retired
        memory_id = new_id("mem")
        subject = f"s{rng.randrange(600)}"
        rows.append({
            "id": memory_id, "user_id": user_id, "lineage_id": memory_id, "version": 1, "form": form,
            "state": "retired" if retired else "pending" if pending else "active", "subject": subject,
            "relation": "prefers", "value": f"v{i}", "text": f"record {i}: " + "words " * rng.randrange(5, 40),
            "scope": scope, "scope_ref": {"always": None, "project": f"p{rng.randrange(5)}",
                                          "task": rng.choice(tasks), "run": f"run_{rng.randrange(1000)}"}[scope],
            "speaker": "agent" if form in ("hypothesis", "skill", "episode") else
                       "third_party" if form == "sourced_fact" else "user",
            "speaker_name": "hotel" if form == "sourced_fact" else "owner", "review": False,
            "confirmed_by": None if form in ("hypothesis", "skill", "episode", "sourced_fact") else "mch_x",
            "valid_from": recorded, "recorded_at": recorded,
            "valid_until": now - timedelta(days=1) if rng.random() < 0.1 else None,
            "retired_at": recorded + timedelta(days=1) if retired else None,
            "retire_reason": "superseded" if retired else None, "retired_by": "user" if retired else None,
        })
        topics += [{"memory_id": memory_id, "topic": t, "user_id": user_id}
                   for t in dict.fromkeys([subject, *rng.sample(vocabulary, rng.randrange(1, 4))])]
    return rows, topics


@contextmanager
def world(tmp: Path) -> Iterator[dict[str, Any]]:
    merchant_app, _ = create_merchant(clock=SimClock())
    with serve(merchant_app) as url:
        engine = make_engine(f"sqlite:///{tmp}/wakeful.db")
        migrate(engine)
        clock = FakeClock()
        rng = random.Random(17)
        with write(engine) as conn:
            owner, _ = users.ensure_user(conn, name="owner", now=clock.now())
            session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
            task_id = control.create_task(conn, user_id=owner, session_id=session_id, title="Hong Kong trip",
                                          goal=GOAL, task_keys=["PNR123", "thr-hk-meeting"], now=clock.now())
            others = [users.ensure_user(conn, name=f"other{k}", now=clock.now())[0] for k in range(OTHERS)]
        clock.advance(timedelta(minutes=1))
        now = clock.now()
        with write(engine) as conn:
            for user_id, n in [(owner, RECORDS), *[(o, OTHER_RECORDS) for o in others]]:
                rows, topics = _records(rng, user_id, n, now=now,
                                        tasks=[task_id] + [f"task_{k}" for k in range(TASKS - 1)])
                conn.execute(insert(memories), rows)
                conn.execute(insert(memory_topics), topics)
        registry = load_connectors(ROOT / "policies" / "connectors", base_urls={"merchant": url})
        yield {"engine": engine, "clock": clock, "owner": owner, "session_id": session_id, "task_id": task_id,
               "registry": registry, "tmp": tmp}
        engine.dispose()


def _deliver(w: dict[str, Any], n: int) -> None:
    with write(w["engine"]) as conn:
        inbox.record(conn, inbox.Delivery(user_id=w["owner"], source="airline", source_id=f"push-{n}",
                                          payload={"status": "cancelled", "n": n}, session_id=w["session_id"]),
                     now=w["clock"].now())
    w["clock"].advance(timedelta(minutes=1))


def _timed(n: int, call: Callable[[], object]) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def measure(quick: bool) -> tuple[dict[str, list[float]], dict[str, int]]:
    n, wakes = (40, 8) if quick else (300, 40)
    with tempfile.TemporaryDirectory(prefix="wakeful-bench-") as tmp, world(Path(tmp)) as w:
        engine: Engine = w["engine"]
        harness = Harness(ScriptedModel([]), registry=w["registry"], instructions=None, max_tokens_per_run=10**9)
        worker = Worker(engine, Settings(data_dir=w["tmp"], sources={}, proxy=False), w["clock"], harness)
        times: dict[str, list[float]] = {"wake": []}
        for k in range(wakes):  # whole scripted wakes, each after one airline push
            _deliver(w, k)
            harness.model.script.append(quiet("nothing to tell"))  # type: ignore[attr-defined]
            start = time.perf_counter()
            assert worker.run_once()
            times["wake"].append(time.perf_counter() - start)
            w["clock"].advance(timedelta(minutes=5))
        with read(engine) as conn:
            run = conn.execute(select(runs).order_by(runs.c.id.desc()).limit(1)).one()
            recalled = conn.execute(select(func.count()).select_from(memory_uses)
                                    .where(memory_uses.c.run_id == run.id)).scalar_one()
        views = (EventView(id="ev_bench", source="airline", source_id="push-x", kind="webhook", trust="source",
                           corr_key=None, payload={"status": "cancelled"}, received_at=run.started_at),)

        def one_recall() -> Recall:
            with read(engine) as conn:
                topics = focus(conn, task_id=w["task_id"], goal=GOAL, sources=["airline"], now=run.started_at)
                return recall(conn, user_id=w["owner"], task_id=w["task_id"], run_id=run.id, event_kinds=["webhook"],
                              focus=topics, now=run.started_at)

        def one_context() -> None:
            with read(engine) as conn:
                assemble(conn, registry=w["registry"], instructions=None, user_id=w["owner"],
                         session_id=w["session_id"], run_id=run.id, events=views)

        times["recall"] = _timed(n, one_recall)
        times["context"] = _timed(n, one_context)
        with _without_memory():
            times["bare"] = _timed(n, one_context)
        found = one_recall()
        with read(engine) as conn:
            total = conn.execute(select(func.count()).select_from(memories)
                                 .where(memories.c.user_id == w["owner"])).scalar_one()
        counts = {"records": total, "recalled": len(found.records), "overridden": len(found.overrides),
                  "left_out": found.left_out, "uses": recalled, "n": n, "wakes": wakes}
    return times, counts


@contextmanager
def _without_memory() -> Iterator[None]:
    """The context module with recall stubbed out: the same wake's context, without memory."""
    saved = context_module.recall, context_module.focus
    context_module.recall = lambda *a, **k: Recall(records=())  # type: ignore[assignment]
    context_module.focus = lambda *a, **k: ()  # type: ignore[assignment]
    try:
        yield
    finally:
        context_module.recall, context_module.focus = saved


def run(quick: bool) -> list[Table]:
    times, counts = measure(quick)

    def p(name: str, q: float) -> str:
        return fmt_ms(percentile(times[name], q))

    share = statistics.median(times["recall"]) / statistics.median(times["wake"])
    rows = [
        Row("recall p50", p("recall", 50), f"context without memory {p('bare', 50)}"),
        Row("recall p99", p("recall", 99), f"context without memory {p('bare', 99)}"),
        Row("context with memory p50 / p99", f"{p('context', 50)} / {p('context', 99)}",
            f"without {p('bare', 50)} / {p('bare', 99)}"),
        Row("whole scripted wake p50 / p99", f"{p('wake', 50)} / {p('wake', 99)}", "-"),
        Row("recall's share of a wake (p50)", f"{share:.0%}", "-"),
        Row("records recalled / overridden / left out", f"{counts['recalled']} / {counts['overridden']} / "
            f"{counts['left_out']}", f"of {counts['records']:,} versions of the user"),
    ]
    notes = [f"one user with {counts['records']:,} record versions (15% retired, pending hypotheses and skills, 10% "
             f"past valid_until) and {OTHERS} other users with {OTHER_RECORDS:,} each, SQLite file, in process",
             f"{counts['n']} recalls and context assemblies, {counts['wakes']} whole wakes (each after one airline "
             f"push; scripted model answering stay_quiet); the last wake wrote {counts['uses']} memory_uses rows",
             "whole wake = Worker.run_once: claim, context (with recall), decision, tool call, commit",
             "load average at the end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
             + f" on {os.cpu_count()} CPUs (other processes move every figure)"]
    return [Table(title="memory recall at 10,000 records per user, beside the wake's other costs", rows=rows,
                  reproduce=reproduce("memory_recall.py", quick), notes=notes)]


if __name__ == "__main__":
    args = bench_args(__doc__.splitlines()[0])
    print_and_save(run(args.quick), "memory_recall.txt")
