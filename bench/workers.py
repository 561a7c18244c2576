"""Ingest and run throughput with 1, 2 and 4 `wakeful worker` processes on PostgreSQL, beside SQLite's one worker.

Each configuration gets a fresh database and its own processes: one `wakeful api` and N `wakeful worker` (each with
its default two worker threads, its scheduler, dispatcher, reconciler and sweeper). A closed-loop provider posts
signed deliveries over `CONNECTIONS` keep-alive connections, spread over `USERS` users (one webhook source each: a
user's deliveries that match no task go to that user's one triage session, so runs can only run side by side for
different users), while the workers run them (the tests' echo handler: one reply per run, no model). Measured:

    ingest       deliveries acknowledged per second, while the workers run
    events run   events settled by a run per second, from the first delivery until none is left pending
    runs         runs per second over the same span (a run takes up to `run_max_events` pending events of its session)

PostgreSQL runs in a throwaway cluster on loopback (`initdb` / `pg_ctl` from Debian's `postgresql` package) with
fsync on, as SQLite runs with `synchronous=FULL`: both acknowledge only what is durable. The baseline column is
SQLite's single worker (`wakeful worker` refuses a second one on SQLite) in the same run; no target: the issue asks
for the table. All processes share this machine's cores with the provider, so more workers than cores mostly
measures contention: read the load average printed with the table.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
from _common import (
    SECRET,
    WAKEFUL,
    Row,
    Table,
    bench_args,
    fmt_rate,
    free_port,
    print_and_save,
    reproduce,
    signed_headers,
)
from sqlalchemy import text

from wakeful.server.store.db import make_engine, migrate, write
from wakeful.server.store.users import ensure_user

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))  # the tests' own cluster
from postgres import postgres_bin, postgres_cluster

USERS = 16
CONNECTIONS = 16
DELIVERIES = {True: 300, False: 2000}  # quick, full
WORKER_COUNTS = (1, 2, 4)
START_TIMEOUT = 90.0
DRAIN_TIMEOUT = 300.0
BODY = b'{"bench":"workers","note":"a delivery that matches no task: it goes to its user\'s triage session"}'


@dataclass(frozen=True)
class Figures:
    label: str
    ingest: float  # acks/s
    events: float  # events settled per second, first delivery to empty backlog
    runs: float  # runs per second, same span
    delivered: int
    seconds: float


def new_database(server: str) -> str:
    import psycopg

    name = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{server.replace('postgresql+psycopg', 'postgresql')}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{server}/{name}"


# -- one configuration ----------------------------------------------------------------------------------------------


def _env(data_dir: Path, port: int, database_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_") and k != "ANTHROPIC_API_KEY"}
    env |= {"WAKEFUL_DATA_DIR": str(data_dir), "WAKEFUL_HOST": "127.0.0.1", "WAKEFUL_PORT": str(port),
            "WAKEFUL_PROXY": "false", "WAKEFUL_COMPUTERS": "false", "WAKEFUL_ECHO_WITHOUT_MODEL": "true"}
    if database_url:
        env["WAKEFUL_DATABASE_URL"] = database_url
    for u in range(USERS):
        env |= {f"WAKEFUL_SOURCES__H{u}__KIND": "generic", f"WAKEFUL_SOURCES__H{u}__SECRET": SECRET,
                f"WAKEFUL_SOURCES__H{u}__USER": f"u{u}"}
    return env


def _start(command: str, env: dict[str, str], log: Path, ready: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen([str(WAKEFUL), command], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT
    while ready not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"wakeful {command} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)  # by its own PID
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


async def _provide(url: str, count: int) -> float:
    """Post `count` deliveries over CONNECTIONS connections, each retried until a 2xx; returns the seconds taken."""
    todo = iter(range(count))

    async def connection(client: httpx.AsyncClient) -> None:
        for i in todo:
            delivery_id = f"w-{i}-{uuid.uuid4().hex[:8]}"
            while True:
                response = await client.post(f"{url}/v1/hooks/h{i % USERS}", content=BODY,
                                             headers={"Content-Type": "application/json",
                                                      **signed_headers(BODY, delivery_id)})
                if response.is_success:
                    break

    began = time.monotonic()
    async with httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=CONNECTIONS)) as client:
        await asyncio.gather(*(connection(client) for _ in range(CONNECTIONS)))
    return time.monotonic() - began


def measure(label: str, workers: int, database_url: str | None, count: int) -> Figures:
    with tempfile.TemporaryDirectory(prefix="wakeful-bench-workers-") as tmp:
        data_dir = Path(tmp)
        url = database_url or f"sqlite:///{data_dir / 'wakeful.db'}"
        engine = make_engine(url)
        migrate(engine)
        with write(engine) as conn:  # the users the sources name exist before the api binds them
            for u in range(USERS):
                ensure_user(conn, name=f"u{u}", now=datetime.now(UTC))
        port = free_port()
        env = _env(data_dir, port, database_url)
        procs = [_start("api", env, data_dir / "api.log", "wakeful serving on")]
        try:
            procs += [_start("worker", env, data_dir / f"worker-{i}.log", "wakeful worker running")
                      for i in range(workers)]
            began = time.monotonic()
            ingest_seconds = asyncio.run(_provide(f"http://127.0.0.1:{port}", count))
            deadline = time.monotonic() + DRAIN_TIMEOUT
            while True:
                with engine.connect() as conn:
                    pending, runs = conn.execute(text(
                        "SELECT (SELECT count(*) FROM events WHERE status = 'pending') + (SELECT count(*) FROM runs "
                        "WHERE outcome = 'running'), (SELECT count(*) FROM runs)")).one()
                if pending == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            span = time.monotonic() - began
            settled = count - pending
        finally:
            for proc in reversed(procs):
                _stop(proc)
            engine.dispose()
    return Figures(label=label, ingest=count / ingest_seconds, events=settled / span if not pending else math.nan,
                   runs=runs / span, delivered=count, seconds=span)


def run(quick: bool = False) -> list[Table]:
    count = DELIVERIES[quick]
    where = postgres_bin()
    if where is None:
        raise SystemExit("PostgreSQL is not installed (scripts/install --all installs it)")
    baseline = measure("SQLite, 1 worker", 1, None, count)
    with postgres_cluster(durable=True, connections=200) as server:
        figures = [measure(f"PostgreSQL, {n} worker{'s' if n > 1 else ''}", n, new_database(server), count)
                   for n in WORKER_COUNTS]
    rows = [Row(f"{baseline.label}: ingest", fmt_rate(baseline.ingest), "(baseline)"),
            Row(f"{baseline.label}: events run", fmt_rate(baseline.events), "(baseline)"),
            Row(f"{baseline.label}: runs", f"{baseline.runs:,.1f}/s", "(baseline)")]
    for f in figures:
        rows += [Row(f"{f.label}: ingest", fmt_rate(f.ingest), fmt_rate(baseline.ingest)),
                 Row(f"{f.label}: events run", fmt_rate(f.events), fmt_rate(baseline.events)),
                 Row(f"{f.label}: runs", f"{f.runs:,.1f}/s", f"{baseline.runs:,.1f}/s")]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [Table(
        title=f"worker processes: {count} signed deliveries over {CONNECTIONS} connections to {USERS} users, "
              "runs alongside (echo handler)",
        rows=rows, reproduce=reproduce("workers.py", quick),
        notes=[f"baseline: SQLite (WAL, synchronous=FULL) with its one `wakeful worker`, same deliveries, same run; "
               f"PostgreSQL {where.parent.name} with fsync on",
               "events run and runs: from the first delivery until no event is pending and no run is running; a "
               "run takes up to `run_max_events` pending events of its session, so more runs per second means "
               "smaller runs, not more work (on SQLite runs give way to acknowledgements while the inbox is busy)",
               f"{os.cpu_count()} CPUs shared by the provider, the api, the workers and the database; "
               f"load average at the end {load}"])]


if __name__ == "__main__":
    args = bench_args(__doc__.splitlines()[0])
    print_and_save(run(args.quick), "workers.txt")
