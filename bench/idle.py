"""Idle cost with 10,000 active delegations: CPU and RSS of `wakeful serve` doing nothing, beside an empty database.

Each delegation is a session, an active task, a daily cron schedule ("0 9 * * *") and a pending reply wait (deadline
in 30 days), written with the server's own functions in a few large transactions. Creating a task also records its
delegation event, so the server first runs one run per delegation; the window starts once it has caught up (no
pending event, no running run) and settled. Both servers run at the same time (idle, they barely compete) and are
sampled from /proc every second over the window.
Targets (issue): idle CPU <= 1 % of one core, RSS <= 200 MB.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from _common import Row, Serve, Table, bench_args, print_and_save, reproduce, start_servers, verdict
from sqlalchemy import Connection

from wakeful.server.core import control, sessions, timers, waits
from wakeful.server.store import users
from wakeful.server.store.db import make_engine, migrate, write
from wakeful.server.store.tables import Authority

TARGET_CPU = 1.0  # percent of one core
TARGET_RSS = 200 * 1024 * 1024
CHUNK = 1000  # delegations per transaction
# 10,000 one-step delegation runs in one UTC day exceed the default per-user budget (5,000 steps), which would leave
# half the delegation events pending until tomorrow; both servers get the same raised budget.
SERVE_ENV = {"WAKEFUL_DAILY_MAX_STEPS": "1000000"}
SETTLE = 2.0  # the last runs' outbox deliveries are over by then; later sweeps are idle work
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Plan:
    delegations: int
    window: float


FULL = Plan(delegations=10_000, window=60.0)
QUICK = Plan(delegations=200, window=10.0)


def populate(data_dir: Path, n: int) -> float:
    """Write n delegations into a fresh database; returns the seconds it took."""
    engine = make_engine(f"sqlite:///{data_dir / 'wakeful.db'}")
    migrate(engine)
    start = time.perf_counter()
    now = datetime.now(UTC)
    with write(engine) as conn:
        owner, _ = users.ensure_user(conn, name="owner", now=now)
    for first in range(0, n, CHUNK):
        with write(engine) as conn:
            for i in range(first, min(n, first + CHUNK)):
                _delegation(conn, owner, i, now)
    engine.dispose()
    return time.perf_counter() - start


def _delegation(conn: Connection, owner: str, i: int, now: datetime) -> None:
    session_id = sessions.create_session(conn, user_id=owner, now=now)
    task_id = control.create_task(conn, user_id=owner, session_id=session_id, title=f"delegation {i}", now=now)
    timers.create_schedule(conn, user_id=owner, task_id=task_id, now=now, note="daily check", cron="0 9 * * *",
                           min_interval=timedelta(minutes=1))
    waits.register(conn, user_id=owner, session_id=session_id, match_key=f"reply-{i}", kind="reply",
                   authority=Authority.ANY_SOURCE, deadline=now + timedelta(days=30), now=now, task_id=task_id)


# -- sampling /proc -------------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all threads), from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces; skip past it
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5), counted from 1


def status_field(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise KeyError(name)


def children(pid: int) -> list[int]:
    """The process's child processes (`wakeful serve` runs its egress proxy as one)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


@dataclass
class Samples:
    cpu: list[float] = field(default_factory=list)  # cumulative CPU seconds
    rss: list[int] = field(default_factory=list)  # bytes
    threads: int = 0
    child_cpu: list[float] = field(default_factory=list)  # the same, summed over its child processes
    child_rss: list[int] = field(default_factory=list)

    def take(self, pid: int) -> None:
        self.cpu.append(cpu_seconds(pid))
        self.rss.append(status_field(pid, "VmRSS") * 1024)
        self.threads = status_field(pid, "Threads")
        kids = children(pid)
        self.child_cpu.append(sum(cpu_seconds(c) for c in kids))
        self.child_rss.append(sum(status_field(c, "VmRSS") * 1024 for c in kids))

    def cpu_percent(self, window: float) -> float:
        return (self.cpu[-1] - self.cpu[0]) / window * 100

    def child_cpu_percent(self, window: float) -> float:
        return (self.child_cpu[-1] - self.child_cpu[0]) / window * 100


def sample(servers: list[Serve], window: float) -> list[Samples]:
    """Sample every server once a second over the window."""
    samples = [Samples() for _ in servers]
    start = time.monotonic()
    for tick in range(int(window) + 1):
        time.sleep(max(0.0, start + tick - time.monotonic()))
        for server, s in zip(servers, samples, strict=True):
            s.take(server.pid)
    return samples


# -- the benchmark --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    populate: float  # seconds to write the delegations
    catch_up: float | None  # seconds the server took to run every delegation's first run; None: it did not finish


def measure(plan: Plan) -> tuple[Samples, Samples, Prepared]:
    with tempfile.TemporaryDirectory(prefix="wakeful-bench-idle-") as full_dir, \
            tempfile.TemporaryDirectory(prefix="wakeful-bench-idle-empty-") as empty_dir:
        populate_seconds = populate(Path(full_dir), plan.delegations)
        servers = start_servers([Path(full_dir), Path(empty_dir)], env=SERVE_ENV)
        try:
            catch_up = servers[0].wait_drained(timeout=900)
            time.sleep(SETTLE)
            loaded, empty = sample(servers, plan.window)
        finally:
            for server in servers:
                server.stop()
    return loaded, empty, Prepared(populate=populate_seconds, catch_up=catch_up)


def _mb(n: float) -> str:
    return f"{n / 1024 / 1024:.1f} MB"


def run(quick: bool = False) -> list[Table]:
    plan = QUICK if quick else FULL
    loaded, empty, prepared = measure(plan)
    cpu = loaded.cpu_percent(plan.window)
    rss = max(loaded.rss)
    rows = [
        Row(f"idle CPU over {plan.window:.0f} s (% of one core)", f"{cpu:.2f} %",
            f"{empty.cpu_percent(plan.window):.2f} %", f"<= {TARGET_CPU:.0f} %", verdict(cpu <= TARGET_CPU)),
        Row("RSS, max over the window", _mb(rss), _mb(max(empty.rss)), f"<= {_mb(TARGET_RSS)}",
            verdict(rss <= TARGET_RSS)),
        Row("CPU seconds used in the window", f"{loaded.cpu[-1] - loaded.cpu[0]:.2f} s",
            f"{empty.cpu[-1] - empty.cpu[0]:.2f} s"),
        Row("threads", str(loaded.threads), str(empty.threads)),
        Row("its egress proxy process: idle CPU", f"{loaded.child_cpu_percent(plan.window):.2f} %",
            f"{empty.child_cpu_percent(plan.window):.2f} %"),
        Row("its egress proxy process: RSS, max", _mb(max(loaded.child_rss)), _mb(max(empty.child_rss))),
    ]
    notes = [f"{plan.delegations:,} delegations (session + active task + daily cron schedule + pending wait); "
             "baseline: the same server on an empty database, sampled at the same time; both with "
             "WAKEFUL_DAILY_MAX_STEPS=1000000 so that the bulk-created delegations' first runs fit in one day",
             f"writing them through the server's functions took {prepared.populate:.1f} s "
             f"({prepared.populate / plan.delegations * 1000:.2f} ms per delegation); "
             + (f"the server then ran their first runs in {prepared.catch_up:.0f} s "
                f"({plan.delegations / max(prepared.catch_up, 1e-9):.0f} runs/s) before the window"
                if prepared.catch_up is not None else
                "WARNING: the server had NOT caught up with the delegation events within 900 s: the window "
                "measures that backlog, not idling")]
    if quick:
        notes.append(f"quick run: {plan.delegations:,} delegations, not the target's 10,000")
    return [Table(title=f"idle: {plan.delegations:,} active delegations, {plan.window:.0f} s idle window",
                  rows=rows, reproduce=reproduce("idle.py", quick), notes=notes)]


if __name__ == "__main__":
    args = bench_args(__doc__.splitlines()[0])
    print_and_save(run(args.quick), "idle.txt")
