"""Three `wakeful worker` processes on one PostgreSQL database, killed at random while deliveries keep coming
(issue 19): zero acknowledged deliveries lost, every event replied to (or failed) exactly once, every outbox message
applied exactly once by the receiver.

A throwaway PostgreSQL cluster (`tests.support.postgres`), one `wakeful api` and three `wakeful worker` processes
(each with its own scheduler, dispatcher, reconciler and sweeper), a webhook provider posting signed deliveries in
parallel and retrying until a 2xx, and a killer that SIGKILLs a random worker every 1–2 s and starts it again, for a
bounded number of kills. Once the load stops, the workers finish what is left; then the records are judged with the
crash harness's own pass bar (`test_crash_recovery`), on the database and on the sink's records. Every process is
signalled by its own PID only.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text

from tests.integration.test_crash_recovery import (
    SECRET,
    Ack,
    Delivery,
    assert_every_event_settled_exactly_once,
    assert_every_message_applied_exactly_once,
    make_delivery,
    server_env,
)
from tests.support.polling import wait_until
from tests.support.postgres import postgres_database
from tests.support.serve import WAKEFUL, free_port
from tests.support.sink import Sink
from wakeful.server.core.faults import EXIT_CODE
from wakeful.server.core.signatures import sign
from wakeful.server.store.db import make_engine, migrate, write
from wakeful.server.store.users import ensure_user

pytestmark = [pytest.mark.faults]

SEED = int(os.environ.get("WAKEFUL_FAULT_SEED") or random.SystemRandom().randrange(1 << 32))
WORKERS = 3
KILLS = 12
KILL_EVERY = (1.0, 2.0)  # seconds between kills, drawn each time: a deliberate random interval, not a wait
POSTERS = 4  # the provider's parallel connections
USERS = 6
"""A user's deliveries that match no task go to that user's one triage session: runs in parallel need users."""
ARMED = ",".join(f"{point}:0.02" for point in ("after_claim", "before_run_commit", "after_outbox_write",
                                                "after_dispatch"))
"""Besides the kills, the workers die now and then at the protocol points of a run (`server.core.faults`)."""
START_TIMEOUT = 60.0
DRAIN_TIMEOUT = 60.0


def _die_with_the_test() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan if the test dies


DB_PASSWORD = "never-in-a-log-5c1f"  # a stand-in: the trusting test cluster ignores it


class Child:
    """One `wakeful <command>` process, its output in `log_path`."""

    def __init__(self, command: str, env: Mapping[str, str], log_path: Path) -> None:
        self.command = command
        self.env = dict(env)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._offset = 0

    def start(self, ready: str | None) -> None:
        """Start it; with `ready`, wait for that in its log (this start's part)."""
        self.starts += 1
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([str(WAKEFUL), self.command], env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_the_test)
        if ready is not None:
            self.wait_ready(ready)

    def wait_ready(self, ready: str) -> None:
        proc = self.proc
        assert proc is not None

        def up() -> bool:
            assert proc.poll() is None, f"wakeful {self.command} exited with {proc.returncode}:\n{self.log()}"
            return ready in self.log()[self._offset:]

        wait_until(up, START_TIMEOUT, f"wakeful {self.command} to say {ready!r}")

    def running(self) -> bool:
        """Alive, and said it runs since its last start."""
        return self.proc is not None and self.proc.poll() is None and "wakeful worker running" in \
            self.log()[self._offset:]

    def kill(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # by its own PID
        self.proc.wait(timeout=30)

    def terminate(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Records:
    """The crash harness's read-only queries, on PostgreSQL."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def rows(self, sql: str, *args: Any) -> list[Mapping[str, Any]]:
        assert not args
        with self.engine.connect() as conn:
            return [row._mapping for row in conn.execute(text(sql))]

    def unfinished(self) -> dict[str, int]:
        (row,) = self.rows(
            "SELECT (SELECT count(*) FROM events WHERE status = 'pending') AS events,"
            " (SELECT count(*) FROM outbox WHERE state = 'pending') AS outbox,"
            " (SELECT count(*) FROM runs WHERE outcome = 'running') AS runs")
        return dict(row)

    def quiet(self) -> bool:
        return not any(self.unfinished().values())


def post(client: httpx.Client, url: str, source: str, delivery: Delivery) -> httpx.Response:
    headers = {"Content-Type": "application/json",
               **sign("generic", secret=SECRET.encode(), body=delivery.body, now=time.time(), delivery_id=delivery.id)}
    return client.post(f"{url}/v1/hooks/{source}", content=delivery.body, headers=headers)


def assert_no_acknowledged_delivery_lost(records: Records, sent: Mapping[str, tuple[str, Delivery]],
                                         acks: Mapping[str, Ack], resends: list[tuple[str, Ack]]) -> None:
    """The crash harness's first bar (`test_crash_recovery`), for deliveries from several sources."""
    by_delivery: dict[str, list[str]] = {}
    for row in records.rows("SELECT id, source, source_id FROM events"):
        assert row["source_id"] in sent and row["source"] == sent[row["source_id"]][0], f"unsent: {dict(row)}"
        by_delivery.setdefault(row["source_id"], []).append(row["id"])
    for delivery_id, ack in acks.items():
        assert by_delivery.get(delivery_id) == [ack.event_id], (
            f"acknowledged delivery {delivery_id} (event {ack.event_id}) is recorded as {by_delivery.get(delivery_id)}")
    for delivery_id, ack in resends:
        assert ack == Ack(acks[delivery_id].event_id, duplicate=True), f"re-send of {delivery_id} answered {ack}"


@dataclass
class Cluster:
    api: Child
    workers: list[Child]
    url: str
    records: Records


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, Sink]]:
    database_url = postgres_database(request.getfixturevalue("postgres_server"))
    # The cluster trusts loopback: the password is ignored there, and must show in no log.
    with_password = database_url.replace("://postgres@", f"://postgres:{DB_PASSWORD}@", 1)
    port = free_port()
    with Sink() as sink:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")},
               **server_env(tmp_path, sink.url), "WAKEFUL_DATABASE_URL": with_password, "WAKEFUL_HOST": "127.0.0.1",
               "WAKEFUL_PORT": str(port), "WAKEFUL_PROXY": "false", "WAKEFUL_COMPUTERS": "false",
               "WAKEFUL_WORKERS": "2"}
        for u in range(USERS):  # source h<u> delivers to user u<u>
            env |= {f"WAKEFUL_SOURCES__H{u}__KIND": "generic", f"WAKEFUL_SOURCES__H{u}__SECRET": SECRET,
                    f"WAKEFUL_SOURCES__H{u}__USER": f"u{u}"}
        api = Child("api", env, tmp_path / "api.log")
        workers = [Child("worker", {**env, "WAKEFUL_CRASH_AT": ARMED}, tmp_path / f"worker-{i}.log")
                   for i in range(WORKERS)]
        engine = make_engine(database_url)
        migrate(engine)  # the users the sources name exist before the api binds them
        with write(engine) as conn:
            for u in range(USERS):
                ensure_user(conn, name=f"u{u}", now=datetime.now(UTC))
        try:
            api.start("wakeful serving on")
            for worker in workers:
                worker.start("wakeful worker running")
            yield Cluster(api, workers, f"http://127.0.0.1:{port}", Records(engine)), sink
        finally:
            for child in [*workers, api]:
                if child.proc is not None and child.proc.poll() is None:
                    child.kill()
            engine.dispose()


def test_three_workers_killed_at_random_lose_no_event_and_apply_every_message_once(
        cluster: tuple[Cluster, Sink]) -> None:
    c, sink = cluster
    rng = random.Random(SEED)
    sent_by_id: dict[str, tuple[str, Delivery]] = {}  # delivery id: (source, delivery)
    acks: dict[str, Ack] = {}
    keys = [f"key-{k}" for k in range(12)]
    loading = threading.Event()
    loading.set()
    lock = threading.Lock()
    resends: list[tuple[str, Ack]] = []

    def provider(n: int) -> int:
        sent = 0
        with httpx.Client(timeout=30.0) as client:
            own = random.Random(f"{SEED}:provider:{n}")
            while loading.is_set():
                # Mostly a fresh session every few deliveries (many runs), now and then one of a few long-lived ones.
                key = own.choice([f"p{n}-k{sent // 3}", f"p{n}-k{sent // 3}", *own.sample(keys, 1), None])
                delivery = make_delivery(f"p{n}-{sent}-{own.randrange(1 << 32):08x}", key, own)
                source = f"h{own.randrange(USERS)}"
                deadline = time.monotonic() + 60
                while True:  # a provider retries until it gets a 2xx (the api is never killed here)
                    try:
                        response = post(client, c.url, source, delivery)
                    except httpx.TransportError:
                        response = None
                    if response is not None and response.is_success:
                        break
                    assert time.monotonic() < deadline, f"delivery {delivery.id} never acknowledged"
                    assert response is None or response.status_code >= 500, response.text
                ack = Ack(response.json()["event_id"], response.json()["duplicate"])
                with lock:
                    sent_by_id[delivery.id] = (source, delivery)
                    acks[delivery.id] = ack
                    if own.random() < 0.05:  # now and then the provider sends one again
                        again = post(client, c.url, source, delivery)
                        assert again.is_success, again.text
                        resends.append((delivery.id, Ack(again.json()["event_id"], again.json()["duplicate"])))
                sent += 1
        return sent

    began = time.monotonic()
    kills: Counter[int] = Counter()
    points: Counter[str] = Counter()

    def revive() -> None:
        """Start again each worker that died at an armed crash point."""
        for worker in c.workers:
            code = worker.proc.poll() if worker.proc is not None else None
            if code is not None:
                assert code == EXIT_CODE, f"a worker exited with {code}:\n{worker.log()[-3000:]}"
                points[worker.log().rsplit("crash point ", 1)[-1].split(" ", 1)[0]] += 1
                worker.start(None)

    with ThreadPoolExecutor(max_workers=POSTERS) as pool:
        posted = [pool.submit(provider, n) for n in range(POSTERS)]
        try:
            for _ in range(KILLS):
                time.sleep(rng.uniform(*KILL_EVERY))  # the kill interval itself: deliberate, random
                revive()
                running = [i for i, w in enumerate(c.workers) if w.running()]
                victim = rng.choice(running or list(range(WORKERS)))
                c.workers[victim].kill()
                kills[victim] += 1
                c.workers[victim].start(None)
        finally:
            loading.clear()
        total = sum(f.result() for f in posted)
    load_seconds = time.monotonic() - began
    revive()
    for worker in c.workers:  # unarmed now, they finish what is left
        # (One still starting ends by the signal itself; an armed one may reach a crash point while it stops.)
        code = worker.terminate()
        assert code in (0, -signal.SIGTERM, EXIT_CODE), f"exit {code}: {worker.log()[-3000:]}"
        worker.env.pop("WAKEFUL_CRASH_AT")
        worker.start("wakeful worker running")

    try:
        wait_until(c.records.quiet, DRAIN_TIMEOUT, "the workers to leave no event, message or run unfinished")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still unfinished: {c.records.unfinished()}") from None
    for child in [*c.workers, c.api]:  # uvicorn re-raises SIGTERM once it has stopped cleanly
        assert child.terminate() in (0, -signal.SIGTERM), f"{child.command}: {child.log()[-3000:]}"

    statuses = Counter(row["status"] for row in c.records.rows("SELECT status FROM events"))
    _, _, duplicates = sink.snapshot()
    runs = c.records.rows("SELECT count(*) AS n, count(DISTINCT worker) AS workers FROM runs")[0]
    outcomes = Counter(row["outcome"] for row in c.records.rows("SELECT outcome FROM runs"))
    print(f"\n[pg-workers] {total} deliveries acknowledged in {load_seconds:.0f} s ({len(resends)} re-sent), "
          f"{sum(kills.values())} kills {dict(kills)}, deaths at crash points {dict(points)}, "
          f"events {dict(statuses)}, {runs['n']} runs by {runs['workers']} worker threads {dict(outcomes)}, "
          f"{len(sink.applied)} messages applied, "
          f"{sum(duplicates.values())} re-deliveries suppressed by the sink, seed {SEED}")
    assert sum(kills.values()) == KILLS and total > 0
    assert_no_acknowledged_delivery_lost(c.records, sent_by_id, acks, resends)
    assert_every_event_settled_exactly_once(c.records, sink)  # type: ignore[arg-type]
    assert_every_message_applied_exactly_once(c.records, sink)  # type: ignore[arg-type]
    assert runs["workers"] > WORKERS, "the runs were not shared between the worker processes"
    for child in [c.api, *c.workers]:
        assert DB_PASSWORD not in child.log(), f"the {child.command} log shows the database password"
