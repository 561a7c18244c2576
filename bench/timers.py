"""Timer firing delay: `events.received_at - slot` for follow-ups and interval schedules due in the near future.

In-process, because follow-ups are created by run handlers and the HTTP API does not expose them: a real
`Runtime` (EchoHandler, its own SQLite file, default settings) runs its scheduler, workers and dispatcher while the
timers are written with the server's own functions. Every firing is an inbox event that starts a run, so the
scheduler works under the load its own firings create.
Baseline: a plain thread in the same process sleeping with `threading.Event.wait` until each follow-up's due time
(what the OS and the GIL allow a sleeper here). Target (issue): fires within 1 s of due.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from _common import Row, Table, bench_args, fmt_ms, percentile, print_and_save, reproduce, verdict
from sqlalchemy import text

from wakeful.server.core import control, sessions, timers
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store import users
from wakeful.server.store.db import read, write

TARGET = 1.0


@dataclass(frozen=True)
class Plan:
    tasks: int
    followups: int
    first: float  # seconds from now to the first follow-up
    span: float  # follow-ups are spread evenly over this many seconds
    schedules: int
    every: timedelta

    @property
    def window(self) -> float:
        return self.first + self.span


FULL = Plan(tasks=40, followups=400, first=1.0, span=20.0, schedules=20, every=timedelta(seconds=2))
QUICK = Plan(tasks=10, followups=60, first=1.0, span=2.0, schedules=5, every=timedelta(seconds=1))


def create_timers(runtime: Runtime, plan: Plan) -> list[datetime]:
    """Tasks, follow-ups and schedules in one transaction; returns the follow-ups' due times."""
    now = runtime.clock.now()
    dues = [now + timedelta(seconds=plan.first + plan.span * i / max(1, plan.followups - 1))
            for i in range(plan.followups)]
    with write(runtime.engine) as conn:
        owner = users.user_id_by_name(conn, "owner")
        task_ids = []
        for i in range(plan.tasks):
            session_id = sessions.create_session(conn, user_id=owner, now=now)
            task_ids.append(control.create_task(conn, user_id=owner, session_id=session_id, title=f"timers {i}",
                                                now=now))
        for i, due in enumerate(dues):  # the default cap (20 per user) would refuse a benchmark's worth
            timers.create_followup(conn, user_id=owner, task_id=task_ids[i % plan.tasks], due_at=due,
                                   note=f"follow-up {i}", now=now, cap=plan.followups + 1)
        for i in range(plan.schedules):  # below the 1-minute minimum, to get many firings in a short window
            timers.create_schedule(conn, user_id=owner, task_id=task_ids[i % plan.tasks], now=now,
                                   note=f"schedule {i}", every=plan.every, min_interval=plan.every)
    runtime.signals.timers.set()  # the scheduler re-plans for the new earliest due time
    return dues


def sleeper_baseline(dues: list[datetime], out: list[float]) -> None:
    """How late a plain `Event.wait` until each due time wakes, in the same process at the same time."""
    never = threading.Event()
    for due in dues:
        never.wait(max(0.0, due.timestamp() - time.time()))
        out.append(time.time() - due.timestamp())


def delays(runtime: Runtime) -> tuple[list[float], list[float], list[float]]:
    """(follow-up delays, schedule delays, due -> run start) in seconds, from the timer events in the database."""
    with read(runtime.engine) as conn:
        rows = conn.execute(text("SELECT e.received_at, e.payload, r.started_at FROM events e "
                                 "LEFT JOIN runs r ON r.id = e.run_id WHERE e.source = 'timer'")).all()
    followups, schedules, to_run = [], [], []
    for received, payload, started in rows:
        body = json.loads(payload)
        slot = datetime.fromisoformat(body["slot"]).timestamp()
        received_ts = datetime.fromisoformat(received).replace(tzinfo=UTC).timestamp()
        (followups if body["kind"] == "followup" else schedules).append(received_ts - slot)
        if started is not None:
            to_run.append(datetime.fromisoformat(started).replace(tzinfo=UTC).timestamp() - slot)
    return followups, schedules, to_run


def measure(plan: Plan) -> tuple[list[float], list[float], list[float], list[float]]:
    with tempfile.TemporaryDirectory(prefix="wakeful-bench-timers-") as tmp:
        runtime = Runtime(Settings(data_dir=Path(tmp), sources={}), handler=EchoHandler())
        runtime.prepare()
        runtime.start()
        try:
            dues = create_timers(runtime, plan)
            baseline: list[float] = []
            sleeper = threading.Thread(target=sleeper_baseline, args=(dues, baseline), daemon=True)
            sleeper.start()
            sleeper.join(timeout=plan.window + 30)
            time.sleep(2.0)  # the last firings' runs commit their event's run_id
        finally:
            runtime.stop()
        followups, schedules, to_run = delays(runtime)
        runtime.engine.dispose()
    return followups, schedules, to_run, baseline


def _rows(followups: list[float], schedules: list[float], to_run: list[float], baseline: list[float]) -> list[Row]:
    both = followups + schedules
    rows = []
    for label, p in (("p50", 50), ("p99", 99), ("max", 100)):
        value = percentile(both, p)
        rows.append(Row(f"timer firing delay {label} (received_at - slot)", fmt_ms(value),
                        fmt_ms(percentile(baseline, p)), "<= 1000 ms", verdict(value <= TARGET)))
    rows += [
        Row("  follow-ups only p99", fmt_ms(percentile(followups, 99)), fmt_ms(percentile(baseline, 99))),
        Row("  schedules only p99", fmt_ms(percentile(schedules, 99)), fmt_ms(percentile(baseline, 99))),
        Row("slot -> run started_at p50", fmt_ms(percentile(to_run, 50)), fmt_ms(percentile(baseline, 50))),
        Row("slot -> run started_at p99", fmt_ms(percentile(to_run, 99)), fmt_ms(percentile(baseline, 99))),
    ]
    return rows


def run(quick: bool = False) -> list[Table]:
    plan = QUICK if quick else FULL
    followups, schedules, to_run, baseline = measure(plan)
    notes = [f"{len(followups)} of {plan.followups} follow-ups fired (due over {plan.window:.0f} s), "
             f"{len(schedules)} firings of {plan.schedules} schedules every {plan.every.total_seconds():.0f} s (until "
             "the runtime stopped); baseline: Event.wait until each follow-up's due time in a thread of the same "
             "process",
             "received_at is the scheduler tick's clock reading, taken before it waits for the write lock; "
             "slot -> run start includes that wait and the worker's claim"]
    return [Table(title=f"timers: firing delay, in-process Runtime, {plan.tasks} tasks",
                  rows=_rows(followups, schedules, to_run, baseline), reproduce=reproduce("timers.py", quick),
                  notes=notes)]


if __name__ == "__main__":
    args = bench_args(__doc__.splitlines()[0])
    print_and_save(run(args.quick), "timers.txt")
