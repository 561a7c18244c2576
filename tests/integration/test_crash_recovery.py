"""Persist on receive and exactly once, proven against a real `wakeful serve` that dies at protocol points.

For each crash point the server runs armed with `WAKEFUL_CRASH_AT=<point>:<p>` and calls `os._exit(77)` there.
A webhook provider delivers batches in parallel and retries every delivery until it gets a 2xx, as real providers
do; whenever the server died, it is restarted (still armed) and the provider keeps going. A trial counts only if the
server really died at the point during it. After the trials the server runs once unarmed until nothing is pending,
then shuts down on SIGTERM, and the pass bar is checked on the database and on the receiving sink's own records:

    zero acknowledged deliveries lost, each recorded exactly once, under the event ID its acknowledgement named;
    every event processed (named by exactly one reply the sink applied) or failed (exactly one failure notice,
    and no reply naming it); every outbox message sent and applied exactly once by the sink.

Replay a failure with `WAKEFUL_FAULT_SEED=<seed>` (printed with each summary). The seed fixes the deliveries,
session keys, provider retries and crash probabilities; where the server's own dice land is up to the server.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.polling import wait_until
from tests.support.postgres import postgres_database
from tests.support.serve import ServeProcess, ServerExited
from tests.support.sink import Sink
from wakeful.server.core.faults import EXIT_CODE, POINTS
from wakeful.server.core.signatures import sign
from wakeful.server.store.db import make_engine

# The campaigns are bounded by their own deadlines; the project-wide 300 s per test is too tight for a campaign on
# a loaded machine (each restart is ~1.5 CPU-seconds of imports), so they get a wider net.
pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

SECRET = "crash-test-secret"
SEED = int(os.environ.get("WAKEFUL_FAULT_SEED") or random.SystemRandom().randrange(1 << 32))

TRIALS_PER_POINT = 20  # counted trials: each saw at least one real crash at the point
# A trial without a crash is cheap (under a second), but the search must end. On a loaded machine a run takes more
# of a trial's deliveries at once, so fewer runs pass the run points: once only 18 of 150 trials crashed at
# before_run_commit on PostgreSQL (12%; 20 are wanted). At that rate 400 trials fall short less than once in 10,000.
MAX_TRIALS_PER_POINT = 400
MAX_STARTS_IN_A_ROW = 40  # starts in a row that die before answering /healthz, before we call it a hang
CRASH_PROBABILITY = (0.1, 0.3)  # drawn per server start
DELIVERY_DEADLINE = 60.0  # seconds one server may take to acknowledge a delivery (restarts extend it)
MAX_SERVERS_PER_DELIVERY = 40  # servers that come up and die without acknowledging one delivery: then it hangs
SETTLE_TIMEOUT = 30.0  # seconds for an armed server to finish a trial's work (or die trying)
DRAIN_TIMEOUT = 60.0  # seconds for the final, unarmed server to finish everything
# A keyed delivery's run waits this long for others to join it (2 s by default), and every trial waited it out
# before it could settle. A batch is posted in parallel, so deliveries still join within the shorter window.
COALESCE_SECONDS = "0.2"
# SIGTERM: uvicorn (>= 0.29) shuts down gracefully, then re-raises the signal, so a clean stop reads as -SIGTERM.
CLEAN_EXIT = (0, -signal.SIGTERM)


def server_env(data_dir: Path, notify_url: str, crash_at: str | None = None,
               database_url: str | None = None) -> dict[str, str]:
    # No model key (ServeProcess drops the caller's WAKEFUL_* variables), and the tests' echo: one reply per run
    # naming every event the run handled in `source_ids` (without it a run ends in silence, with nothing to count).
    env = {
        "WAKEFUL_DATA_DIR": str(data_dir),
        "WAKEFUL_ECHO_WITHOUT_MODEL": "true",
        "WAKEFUL_SOURCES__HOOK__KIND": "generic",
        "WAKEFUL_SOURCES__HOOK__SECRET": SECRET,
        "WAKEFUL_NOTIFY_URL": notify_url,
        "WAKEFUL_LEASE": "1",  # seconds: a dead worker's session is free again by the time the restart is done
        "WAKEFUL_SWEEP_INTERVAL": "0.3",
        "WAKEFUL_POLL_INTERVAL": "0.2",
        "WAKEFUL_IDLE_POLL_MAX": "1",  # recovery waits on lease expiry, which only polling notices
        "WAKEFUL_DISPATCH_BACKOFF": "0.1",
        # Low enough that a run of crashes after claiming really fails events, so the explicit-failure path
        # (one notice, no reply) is exercised under crashes as well as the happy path.
        "WAKEFUL_EVENT_MAX_ATTEMPTS": "4",
    }
    if crash_at:
        env["WAKEFUL_CRASH_AT"] = crash_at
    if database_url:
        env["WAKEFUL_DATABASE_URL"] = database_url
    return env


# -- the database, read directly --------------------------------------------------------------------------------


class Records:
    """Read-only queries on the server's SQLite file (or its PostgreSQL database), each on a fresh connection so no
    snapshot is held."""

    def __init__(self, data_dir: Path, database_url: str | None = None) -> None:
        self.path = data_dir / "wakeful.db"
        self._engine = make_engine(database_url) if database_url else None

    def rows(self, sql: str, *args: Any) -> list[Any]:
        if self._engine is not None:
            with self._engine.connect() as pg:
                return [row._mapping for row in pg.exec_driver_sql(sql.replace("?", "%s"), args)]
        if not self.path.exists():
            return []
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
        try:
            conn.row_factory = sqlite3.Row
            return conn.execute(sql, args).fetchall()
        finally:
            conn.close()

    def unfinished(self) -> dict[str, int]:
        """What still has to happen: pending events, pending outbox rows, runs not yet ended."""
        (row,) = self.rows(
            "SELECT (SELECT count(*) FROM events WHERE status = 'pending') AS events,"
            " (SELECT count(*) FROM outbox WHERE state = 'pending') AS outbox,"
            " (SELECT count(*) FROM runs WHERE outcome = 'running') AS runs")
        return dict(row)

    def quiet(self) -> bool:
        return (self._engine is not None or self.path.exists()) and not any(self.unfinished().values())


# -- the server's life: start, die, restart ---------------------------------------------------------------------


@dataclass
class Supervisor:
    """Owns the one live `wakeful serve`; restarts it, still armed, whenever it died at the crash point.

    Never two at once: a new process is started only after the previous one has exited.
    """

    point: str
    data_dir: Path
    notify_url: str
    rng: random.Random
    database_url: str | None = None
    armed: bool = True
    crashes: int = 0
    starts: int = 0
    generation: int = 0
    server: ServeProcess | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        """Start until one answers /healthz; deaths during recovery at startup are crashes too."""
        for _ in range(MAX_STARTS_IN_A_ROW):
            self.starts += 1
            crash_at = f"{self.point}:{self.rng.uniform(*CRASH_PROBABILITY):.2f}" if self.armed else None
            env = server_env(self.data_dir, self.notify_url, crash_at, self.database_url)
            server = ServeProcess({**env, "WAKEFUL_COALESCE_SECONDS": COALESCE_SECONDS},
                                  log_path=self.data_dir / f"serve-{self.starts:03d}.log")
            self.server = server
            try:
                server.start()
            except ServerExited as died:
                self._record_death(died.returncode, died.log)
                continue
            self.generation += 1
            return
        raise AssertionError(f"{MAX_STARTS_IN_A_ROW} starts in a row died before answering /healthz")

    def current(self) -> tuple[int, ServeProcess]:
        with self._lock:
            assert self.server is not None
            return self.generation, self.server

    def recover(self, generation: int) -> None:
        """The server of `generation` has exited: record how, and start the next (once, whoever asks first)."""
        with self._lock:
            if generation != self.generation:
                return  # another sender already restarted it
            assert self.server is not None
            code = self.server.wait_exit(10.0)
            assert code is not None, "recover() called while the server is still running"
            self._record_death(code, self.server.log())
            self.start()

    def _record_death(self, code: int, log: str) -> None:
        # Only the armed point may kill the server: any other exit is a crash of its own, and a failure.
        assert self.armed and code == EXIT_CODE, f"wakeful serve exited with {code}, not {EXIT_CODE}:\n{log}"
        assert f"crash point {self.point} reached" in log, f"exit {EXIT_CODE} without the crash point log:\n{log}"
        self.crashes += 1

    def stop_armed(self) -> None:
        """SIGTERM the armed server (it may still die at the point while shutting down), and disarm."""
        with self._lock:
            assert self.server is not None
            code, killed = self.server.terminate()
            if code not in CLEAN_EXIT or killed:
                self._record_death(code, self.server.log())
            self.armed = False

    def stop(self) -> None:
        if self.server is not None:
            self.server.kill()


# -- the webhook provider ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    id: str
    body: bytes


@dataclass(frozen=True)
class Ack:
    event_id: str
    duplicate: bool


def make_delivery(delivery_id: str, session_key: str | None, rng: random.Random) -> Delivery:
    payload: dict[str, Any] = {"n": rng.randrange(1 << 30), "text": f"delivery {delivery_id}"}
    if session_key is not None:
        payload["session_key"] = session_key
    return Delivery(delivery_id, json.dumps(payload).encode())


def post(client: httpx.Client, url: str, delivery: Delivery) -> httpx.Response:
    headers = {"Content-Type": "application/json",
               **sign("generic", secret=SECRET.encode(), body=delivery.body, now=time.time(), delivery_id=delivery.id)}
    return client.post(f"{url}/v1/hooks/hook", content=delivery.body, headers=headers)


def deliver(client: httpx.Client, supervisor: Supervisor, delivery: Delivery) -> Ack:
    """POST until a 2xx, as a provider does; a server that died is restarted, and the provider just retries.

    The deadline is per server: each one that comes up has DELIVERY_DEADLINE to acknowledge. A restart is a
    Python start (15-20 s on a loaded machine), and a delivery may see several servers die at the point before one
    answers it; counting them all against one deadline failed the campaigns on load, not on the server."""
    deadline = time.monotonic() + DELIVERY_DEADLINE
    backoff = 0.02
    first = last = supervisor.current()[0]
    while time.monotonic() < deadline:
        generation, server = supervisor.current()
        if generation != last:
            last, deadline = generation, time.monotonic() + DELIVERY_DEADLINE
            assert generation - first <= MAX_SERVERS_PER_DELIVERY, (
                f"delivery {delivery.id} not acknowledged by {MAX_SERVERS_PER_DELIVERY} servers in a row")
        try:
            response = post(client, server.url, delivery)
        except httpx.TransportError:
            response = None
        if response is not None and response.is_success:
            body = response.json()
            return Ack(body["event_id"], body["duplicate"])
        if response is not None and response.status_code < 500:
            raise AssertionError(f"delivery {delivery.id} refused: {response.status_code} {response.text}")
        # The provider's backoff doubles as the wait for a dying process to be reaped.
        if server.wait_exit(backoff) is not None:
            supervisor.recover(generation)
        backoff = min(backoff * 2, 0.5)
    raise AssertionError(f"delivery {delivery.id} not acknowledged within {DELIVERY_DEADLINE:.0f} s by a live server")


# -- one crash point, end to end --------------------------------------------------------------------------------


@dataclass
class Campaign:
    """Everything one crash point's trials sent and were told."""

    point: str
    rng: random.Random
    sent: dict[str, Delivery] = field(default_factory=dict)
    acks: dict[str, Ack] = field(default_factory=dict)
    resent: list[tuple[str, Ack]] = field(default_factory=list)  # (delivery id, ack of the provider's re-send)
    session_keys: list[str] = field(default_factory=list)

    def batch(self, trial: int) -> tuple[list[Delivery], list[Delivery]]:
        """A handful of new deliveries (some sharing a session), and maybe a re-send of an acknowledged one."""
        rng = self.rng
        keys = [f"{self.point}-t{trial}-s{k}" for k in range(rng.randint(1, 2))]
        old_keys = rng.sample(self.session_keys, min(len(self.session_keys), 1))
        self.session_keys.extend(keys)
        fresh = []
        for i in range(rng.randint(1, 6)):
            key = rng.choice([None, *keys, *keys, *old_keys])
            delivery = make_delivery(f"{self.point}-t{trial}-d{i}-{rng.randrange(1 << 32):08x}", key, rng)
            self.sent[delivery.id] = delivery
            fresh.append(delivery)
        repeats = [self.sent[rng.choice(sorted(self.acks))]] if self.acks and rng.random() < 0.4 else []
        return fresh, repeats


def run_trial(campaign: Campaign, trial: int, supervisor: Supervisor, records: Records,
              client: httpx.Client, pool: ThreadPoolExecutor) -> None:
    fresh, repeats = campaign.batch(trial)
    everything = fresh + repeats
    # Providers deliver in parallel: one crash can take several unacknowledged deliveries down with it.
    for delivery, ack in zip(everything, pool.map(lambda d: deliver(client, supervisor, d), everything),
                             strict=True):
        if delivery in repeats:
            campaign.resent.append((delivery.id, ack))
        else:
            campaign.acks.setdefault(delivery.id, ack)
    settle(supervisor, records)


def wait_with_state(predicate: Callable[[], bool], records: Records, timeout: float, what: str) -> None:
    """`wait_until`, with what was still unfinished at the deadline in the message."""
    try:
        wait_until(predicate, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still unfinished: {records.unfinished()}") from None


def settle(supervisor: Supervisor, records: Records) -> None:
    """End the trial when its work is done or the server died; a dead server is restarted, still armed.

    The restarted server's recovery (expired leases, unsent messages) overlaps the next trial, as it would in
    production; whatever is left at the end is finished by the unarmed drain before anything is asserted.
    """
    generation, server = supervisor.current()
    wait_with_state(lambda: server.returncode is not None or records.quiet(), records, SETTLE_TIMEOUT,
                    "the armed server to finish the trial or die")
    if server.returncode is not None:
        supervisor.recover(generation)


def drain_unarmed(supervisor: Supervisor, records: Records) -> None:
    """Replace the armed server by an unarmed one, let it finish everything, and stop it with SIGTERM."""
    supervisor.stop_armed()
    supervisor.start()
    wait_with_state(records.quiet, records, DRAIN_TIMEOUT,
                    "the unarmed server to leave no event, message or run unfinished")
    _, server = supervisor.current()
    code, killed = server.terminate()
    assert not killed and code in CLEAN_EXIT, f"SIGTERM: exit {code}, killed={killed}; log:\n{server.log()}"
    assert "Traceback" not in server.log(), f"the unarmed server logged a traceback:\n{server.log()}"


class Aborted(Exception):
    """Another test failed and the module is being torn down: stop this campaign early."""


@dataclass(frozen=True)
class Outcome:
    campaign: Campaign
    records: Records
    sink: Sink
    trials: int
    counted: int
    crashes: int
    starts: int
    seconds: float

    def summary(self) -> str:
        statuses = Counter(row["status"] for row in self.records.rows("SELECT status FROM events"))
        _, _, duplicates = self.sink.snapshot()
        return (f"[faults] {self.campaign.point}: {self.counted} trials counted of {self.trials}, {self.crashes} "
                f"crashes, {self.starts} starts, {len(self.campaign.acks)} deliveries acknowledged "
                f"({len(self.campaign.resent)} re-sent), events {dict(statuses)}, {len(self.sink.applied)} messages "
                f"applied, {sum(duplicates.values())} duplicate deliveries suppressed by the sink, "
                f"{self.seconds:.0f} s, seed {SEED}")


def run_campaign(point: str, data_dir: Path, abort: threading.Event, database_url: str | None = None,
                 wanted: int = TRIALS_PER_POINT) -> Outcome:
    # Two streams, so the deliveries replay the same whatever the server's own dice did to the restarts.
    campaign = Campaign(point, random.Random(f"{SEED}:{point}:deliveries"))
    records = Records(data_dir, database_url)
    trials = counted = 0
    began = time.monotonic()
    with Sink() as sink:
        supervisor = Supervisor(point, data_dir, sink.url, random.Random(f"{SEED}:{point}:probabilities"),
                                database_url)
        try:
            with httpx.Client(timeout=10.0) as client, ThreadPoolExecutor(max_workers=8) as pool:
                supervisor.start()
                while counted < wanted:
                    if abort.is_set():
                        raise Aborted(point)
                    trials += 1
                    assert trials <= MAX_TRIALS_PER_POINT, f"only {counted} trials crashed at {point} in {trials - 1}"
                    crashes_before = supervisor.crashes
                    run_trial(campaign, trials, supervisor, records, client, pool)
                    counted += supervisor.crashes > crashes_before
                drain_unarmed(supervisor, records)
        finally:
            supervisor.stop()
    return Outcome(campaign, records, sink, trials, counted, supervisor.crashes, supervisor.starts,
                   time.monotonic() - began)


# -- the pass bar -----------------------------------------------------------------------------------------------


def assert_no_acknowledged_delivery_lost(records: Records, campaign: Campaign) -> None:
    rows = records.rows("SELECT id, source, source_id FROM events")
    by_delivery: dict[str, list[str]] = {}
    for row in rows:
        assert row["source"] == "hook" and row["source_id"] in campaign.sent, f"an event nobody sent: {dict(row)}"
        by_delivery.setdefault(row["source_id"], []).append(row["id"])
    for delivery_id, ack in campaign.acks.items():
        assert by_delivery.get(delivery_id) == [ack.event_id], (
            f"acknowledged delivery {delivery_id} (event {ack.event_id}) is recorded as {by_delivery.get(delivery_id)}")
    for delivery_id, ack in campaign.resent:
        assert ack == Ack(campaign.acks[delivery_id].event_id, duplicate=True), (
            f"the provider's re-send of {delivery_id} was answered {ack}, not the original event as a duplicate")


def assert_every_event_settled_exactly_once(records: Records, sink: Sink) -> None:
    applied, _, _ = sink.snapshot()
    replies = Counter(source_id for message in applied.values() if message["body"].get("kind") != "event_failed"
                      for source_id in message["body"].get("source_ids", []))
    notices = Counter(message["body"]["event_id"] for message in applied.values()
                      if message["body"].get("kind") == "event_failed")
    events = records.rows("SELECT id, source, source_id, status FROM events")
    for event in events:
        named = f"{event['source']}:{event['source_id']}"
        if event["status"] == "processed":
            assert replies[named] == 1, f"processed event {event['id']} ({named}) named by {replies[named]} replies"
        else:
            assert event["status"] == "failed", f"event {event['id']} ended {event['status']!r}"
            assert notices[event["id"]] == 1 and f"fail_{event['id']}" in applied, (
                f"failed event {event['id']} has {notices[event['id']]} failure notices")
            # The notice tells the user "nothing from it was acted on": no reply may name it.
            assert replies[named] == 0, f"failed event {event['id']} ({named}) was also replied to"
    known = {f"{e['source']}:{e['source_id']}" for e in events}
    assert set(replies) <= known, f"replies name events that do not exist: {set(replies) - known}"


def assert_every_message_applied_exactly_once(records: Records, sink: Sink) -> None:
    applied, applications, _ = sink.snapshot()
    outbox = records.rows("SELECT id, state, body FROM outbox")
    unsent = [(row["id"], row["state"]) for row in outbox if row["state"] != "sent"]
    assert not unsent, f"outbox rows not sent: {unsent}"
    assert set(applied) == {row["id"] for row in outbox}, (
        f"sink and outbox disagree: only in sink {set(applied) - {r['id'] for r in outbox}}, "
        f"only in outbox {({r['id'] for r in outbox}) - set(applied)}")
    assert all(count == 1 for count in applications.values()), f"applied more than once: {applications}"
    for row in outbox:
        message = applied[row["id"]]
        assert message["id"] == row["id"] and message["body"] == json.loads(row["body"]), (
            f"the sink applied {message} for outbox row {dict(row)}")


# -- the tests --------------------------------------------------------------------------------------------------


PARALLEL_CAMPAIGNS = 2  # one per core: a campaign is mostly one server process starting at a time
# The points a webhook passes on its way to a delivered reply. The action points (`after_attempt_persisted`,
# `after_send`) need a run that dispatches an action, which the tests' echo handler never does.
WEBHOOK_POINTS = ("after_event_commit", "after_claim", "before_run_commit", "after_outbox_write", "after_dispatch")
# On PostgreSQL, every point again (its claims differ from SQLite's: `FOR UPDATE SKIP LOCKED`, the outbox's hold),
# as many trials as on SQLite. Measured with `-n 0 --durations=0` at load 4-7: the two campaigns of old (10 trials, a
# 2 s coalescing window per trial) took 145 + 256 s; with the 0.2 s window, the five at 12 trials took 71-90 s each
# (396 s, ~6.6 s a counted trial), so five at 20 add ~2.2 min of module wall (two at a time) over the old two.
# `test_workers_pg` has worker processes die at random while deliveries keep coming.
PG_POINTS = WEBHOOK_POINTS
PG_TRIALS_PER_POINT = TRIALS_PER_POINT


@pytest.fixture(scope="module")
def campaigns(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Outcome]]]:
    """The selected points' campaigns, started together two at a time; each test waits for its own and judges it."""
    selected = [item.name for item in request.session.items]
    points = [p for p in WEBHOOK_POINTS if any(name.startswith(f"test_crash_{p}_") for name in selected)]
    on_pg = [p for p in PG_POINTS if any(name.startswith(f"test_pg_crash_{p}_") for name in selected)]
    server = request.getfixturevalue("postgres_server") if on_pg else ""
    abort = threading.Event()
    with ThreadPoolExecutor(max_workers=PARALLEL_CAMPAIGNS, thread_name_prefix="campaign") as pool:
        futures = {point: pool.submit(run_campaign, point, tmp_path_factory.mktemp(point), abort)
                   for point in points}
        futures |= {f"{point}@postgresql": pool.submit(run_campaign, point, tmp_path_factory.mktemp(point), abort,
                                                       postgres_database(server), PG_TRIALS_PER_POINT)
                    for point in on_pg}
        try:
            yield futures
        finally:
            abort.set()  # a campaign still running after a failure stops at its next trial and kills its server
            for future in futures.values():
                future.cancel()


def test_every_point_on_the_webhook_path_is_a_crash_point_the_server_knows() -> None:
    assert set(WEBHOOK_POINTS) <= set(POINTS)
    tests = [name for name in globals() if name.startswith(("test_crash_", "test_pg_crash_"))]
    for prefix in ("test_crash_", "test_pg_crash_"):
        missing = [p for p in WEBHOOK_POINTS if not any(t.startswith(f"{prefix}{p}_") for t in tests)]
        assert missing == [], f"points on the webhook path without a {prefix}<point>_… test: {missing}"


def judge(campaigns: dict[str, Future[Outcome]], point: str, wanted: int = TRIALS_PER_POINT) -> Outcome:
    outcome = campaigns[point].result()
    print(f"\n{outcome.summary()}")
    assert outcome.counted >= wanted and outcome.crashes >= wanted
    assert_no_acknowledged_delivery_lost(outcome.records, outcome.campaign)
    assert_every_event_settled_exactly_once(outcome.records, outcome.sink)
    assert_every_message_applied_exactly_once(outcome.records, outcome.sink)
    return outcome


def test_crash_after_event_commit_loses_no_acknowledged_event(campaigns: dict[str, Future[Outcome]]) -> None:
    judge(campaigns, "after_event_commit")


def test_crash_after_claim_leaves_every_event_processed_or_failed_once(campaigns: dict[str, Future[Outcome]]) -> None:
    judge(campaigns, "after_claim")


def test_crash_before_run_commit_replies_to_every_event_exactly_once(campaigns: dict[str, Future[Outcome]]) -> None:
    judge(campaigns, "before_run_commit")


def test_crash_after_outbox_write_still_delivers_every_committed_message(
        campaigns: dict[str, Future[Outcome]]) -> None:
    judge(campaigns, "after_outbox_write")


def test_crash_after_dispatch_redelivers_and_the_receiver_applies_each_message_once(
        campaigns: dict[str, Future[Outcome]]) -> None:
    assert_one_redelivery_per_crash(judge(campaigns, "after_dispatch"))


def test_pg_crash_after_event_commit_loses_no_acknowledged_event(campaigns: dict[str, Future[Outcome]]) -> None:
    judge(campaigns, "after_event_commit@postgresql", PG_TRIALS_PER_POINT)


def test_pg_crash_after_claim_leaves_every_event_processed_or_failed_once(
        campaigns: dict[str, Future[Outcome]]) -> None:
    judge(campaigns, "after_claim@postgresql", PG_TRIALS_PER_POINT)


def test_pg_crash_before_run_commit_replies_to_every_event_exactly_once(
        campaigns: dict[str, Future[Outcome]]) -> None:
    judge(campaigns, "before_run_commit@postgresql", PG_TRIALS_PER_POINT)


def test_pg_crash_after_outbox_write_still_delivers_every_committed_message(
        campaigns: dict[str, Future[Outcome]]) -> None:
    judge(campaigns, "after_outbox_write@postgresql", PG_TRIALS_PER_POINT)


def test_pg_crash_after_dispatch_redelivers_once_the_hold_lapses_and_the_receiver_applies_each_message_once(
        campaigns: dict[str, Future[Outcome]]) -> None:
    assert_one_redelivery_per_crash(judge(campaigns, "after_dispatch@postgresql", PG_TRIALS_PER_POINT))


def assert_one_redelivery_per_crash(outcome: Outcome) -> None:
    _, _, duplicates = outcome.sink.snapshot()
    # Each crash left exactly one message accepted but not marked sent, and a later start sent it again.
    assert duplicates, "no crash after dispatch ever re-delivered a message"
    assert sum(duplicates.values()) == outcome.crashes, (
        f"{outcome.crashes} crashes after dispatch but {sum(duplicates.values())} re-deliveries: {duplicates}")


# -- no crash points: duplicates and a receiver outage ---------------------------------------------------------


@dataclass(frozen=True)
class Plain:
    server: ServeProcess
    sink: Sink
    records: Records


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plain]:
    data_dir = tmp_path_factory.mktemp("plain")
    with Sink() as sink, ServeProcess(server_env(data_dir, sink.url), log_path=data_dir / "serve.log") as server:
        yield Plain(server, sink, Records(data_dir))


def _post_once(plain: Plain, delivery: Delivery) -> httpx.Response:
    with httpx.Client(timeout=30.0) as client:
        return post(client, plain.server.url, delivery)


def test_the_same_delivery_posted_twice_is_recorded_once(plain: Plain) -> None:
    delivery = make_delivery(f"twice-{random.randrange(1 << 32):08x}", "twice", random.Random(SEED))
    first, second = _post_once(plain, delivery), _post_once(plain, delivery)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert first.json()["duplicate"] is False and second.json()["duplicate"] is True
    assert first.json()["event_id"] == second.json()["event_id"]
    rows = plain.records.rows("SELECT id FROM events WHERE source_id = ?", delivery.id)
    assert [row["id"] for row in rows] == [first.json()["event_id"]]


def test_fifty_concurrent_identical_deliveries_are_recorded_once(plain: Plain) -> None:
    delivery = make_delivery(f"fifty-{random.randrange(1 << 32):08x}", None, random.Random(SEED))
    start = threading.Barrier(50)

    def send(_: int) -> httpx.Response:
        start.wait(timeout=30)  # release all fifty at once, so they race into the same commit batches
        return _post_once(plain, delivery)

    with ThreadPoolExecutor(max_workers=50) as pool:
        responses = list(pool.map(send, range(50)))
    assert [r.status_code for r in responses] == [200] * 50, [r.text for r in responses if r.status_code != 200]
    event_ids = {r.json()["event_id"] for r in responses}
    assert len(event_ids) == 1
    assert sum(not r.json()["duplicate"] for r in responses) == 1
    rows = plain.records.rows("SELECT id FROM events WHERE source_id = ?", delivery.id)
    assert [row["id"] for row in rows] == list(event_ids)


def test_a_receiver_outage_is_retried_and_the_message_applied_once(plain: Plain) -> None:
    wait_until(plain.records.quiet, DRAIN_TIMEOUT, "earlier tests' messages to be delivered")
    rejected_before = plain.sink.rejected
    plain.sink.fail_next(3)
    delivery = make_delivery(f"outage-{random.randrange(1 << 32):08x}", None, random.Random(SEED))
    response = _post_once(plain, delivery)
    assert response.status_code == 200, response.text

    def sent_reply() -> sqlite3.Row | None:
        rows = plain.records.rows("SELECT id, state, attempts, body FROM outbox WHERE state = 'sent'")
        return next((r for r in rows if f"hook:{delivery.id}" in json.loads(r["body"]).get("source_ids", [])), None)

    message = wait_until(sent_reply, DRAIN_TIMEOUT, f"the reply to {delivery.id} to be sent")
    applied, applications, duplicates = plain.sink.snapshot()
    assert plain.sink.rejected - rejected_before == 3
    assert message["attempts"] == 4, "three 503s, then the delivery that was applied"
    assert applications[message["id"]] == 1 and message["id"] not in duplicates
    assert applied[message["id"]]["body"] == json.loads(message["body"])
