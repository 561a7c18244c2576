"""The single writer and the run loop, on a real SQLite file with a fake clock."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, event, select

from tests.support.records import event_rows, messages, run_rows
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import control, holds, inbox, sessions
from wakeful.server.core.worker import InboxRate, RunContext, RunShare, Worker, rest_after_run
from wakeful.server.errors import StaleToken
from wakeful.server.harness.handlers import EchoHandler, ScriptedHandler
from wakeful.server.observe import metrics
from wakeful.server.runtime import Role, Runtime, run_costs_cpu
from wakeful.server.store.db import read, write, write_lock_time
from wakeful.server.store.tables import ControlKind, EventStatus, RunOutcome, tasks


def deliver(engine: Engine, clock: FakeClock, owner: str, source_id: str, key: str | None = "thread-1") -> str:
    with write(engine) as conn:
        return inbox.record(conn, inbox.Delivery(user_id=owner, source="hook", source_id=source_id,
                                                 payload={"n": source_id}, corr_key=key), now=clock.now()).event_id


def tasks_keyed(engine: Engine, clock: FakeClock, owner: str, *keys: str) -> None:
    """A task per key, each bound to its key: deliveries carrying them go to sessions of their own."""
    with write(engine) as conn:
        for key in keys:
            session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
            control.create_task(conn, user_id=owner, session_id=session_id, title=key, now=clock.now(),
                                task_keys=[key])


def inbox_session(engine: Engine, event_id: str) -> str:
    (event,) = [e for e in event_rows(engine) if e.id == event_id]
    return str(event.session_id)


def test_stale_worker_commit_after_takeover_is_rejected_and_changes_nothing(runtime: Runtime, engine: Engine,
                                                                             clock: FakeClock, owner: str) -> None:
    deliver(engine, clock, owner, "d1")
    slow = Worker(engine, runtime.settings, clock, EchoHandler(), name="slow")
    ctx = slow._claim()
    assert ctx is not None
    ctx.send_to_user("from the slow worker")
    clock.advance(runtime.settings.lease + timedelta(seconds=1))  # its lease runs out
    fast = Worker(engine, runtime.settings, clock, EchoHandler(), name="fast")
    assert fast.run_once()
    with pytest.raises(StaleToken):
        slow._commit(ctx, RunOutcome.COMPLETED, None)
    texts = [m["text"] for m in messages(engine)]
    assert texts == ["Received 1 event(s): hook:d1"]
    (event,) = event_rows(engine)
    assert event.status == EventStatus.PROCESSED and event.run_id != ctx.run_id


def test_a_run_that_keeps_stepping_keeps_its_session(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                    owner: str) -> None:
    deliver(engine, clock, owner, "d1")
    worker = Worker(engine, runtime.settings, clock, EchoHandler())
    ctx = worker._claim()
    assert ctx is not None
    lease = runtime.settings.lease
    for _ in range(3):  # 1.8 leases in all, a step every 0.6
        clock.advance(lease * 0.6)
        ctx.step()
        assert not Worker(engine, runtime.settings, clock, EchoHandler())._claim()  # nobody else can take it
    runtime.sweep_once()
    ctx.send_to_user("still here")
    worker._commit(ctx, RunOutcome.COMPLETED, None)
    assert [m["text"] for m in messages(engine)] == ["still here"]
    assert [r.outcome for r in run_rows(engine)] == [RunOutcome.COMPLETED]


def test_a_step_takes_the_write_lock_only_to_renew_the_lease(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                             owner: str) -> None:
    deliver(engine, clock, owner, "d1")
    ctx = Worker(engine, runtime.settings, clock, EchoHandler())._claim()
    assert ctx is not None
    before = write_lock_time()
    ctx.step()
    clock.advance(runtime.settings.lease / 20)
    ctx.step()
    assert write_lock_time() == before  # two steps within a tenth of the lease: only looked
    clock.advance(runtime.settings.lease / 10)
    ctx.step()
    assert write_lock_time() > before  # then it renewed


@pytest.mark.parametrize("renewing", [False, True])
def test_a_step_after_a_takeover_fails_loudly(runtime: Runtime, engine: Engine, clock: FakeClock, owner: str,
                                              renewing: bool) -> None:
    deliver(engine, clock, owner, "d1")
    ctx = Worker(engine, runtime.settings, clock, EchoHandler(), name="slow")._claim()
    assert ctx is not None
    ahead = FakeClock(clock.now() + runtime.settings.lease + timedelta(seconds=1))  # another host, its clock ahead
    taken = Worker(engine, runtime.settings, ahead, EchoHandler(), name="fast")._claim()
    assert taken is not None and taken.token > ctx.token
    # By its own clock, the slow worker's lease has run down by a twentieth (the step only looks), or by a half.
    clock.advance(runtime.settings.lease / (2 if renewing else 20))
    with pytest.raises(StaleToken):
        ctx.step()


def test_a_session_is_claimed_only_while_it_has_work_due(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                         owner: str) -> None:
    # A worker claims from a list it read before taking the write lock: the claim itself re-checks the todo.
    session_id = inbox_session(engine, deliver(engine, clock, owner, "d1"))

    def claim() -> int | None:
        with write(engine) as conn:
            return sessions.claim(conn, session_id=session_id, worker="w", now=clock.now(),
                                  lease=runtime.settings.lease)

    with write(engine) as conn:  # as a failed run leaves it: retry in a minute
        sessions.settle_todo(conn, session_id=session_id, seen_version=None,
                             retry_at=clock.now() + timedelta(minutes=1))
    assert claim() is None
    clock.advance(timedelta(minutes=1))
    token = claim()
    assert token is not None
    with write(engine) as conn:  # its work done
        sessions.settle_todo(conn, session_id=session_id, seen_version=sessions.todo_version(conn, session_id),
                             retry_at=None)
        sessions.release(conn, session_id=session_id, token=token)
    assert claim() is None


def test_two_workers_never_hold_one_session_at_once(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                     owner: str) -> None:
    deliver(engine, clock, owner, "d1")
    first = Worker(engine, runtime.settings, clock, EchoHandler())._claim()
    second = Worker(engine, runtime.settings, clock, EchoHandler())._claim()
    assert first is not None and second is None


def test_events_arriving_during_a_run_are_held_and_handed_to_the_next_run_together(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    deliver(engine, clock, owner, "d1")
    worker = Worker(engine, runtime.settings, clock, EchoHandler())
    ctx = worker._claim()
    assert ctx is not None and [e.source_id for e in ctx.events] == ["d1"]
    deliver(engine, clock, owner, "d2")
    deliver(engine, clock, owner, "d3")
    EchoHandler()(ctx)
    worker._commit(ctx, RunOutcome.COMPLETED, None)
    assert worker.run_once()
    assert not worker.run_once()  # nothing left
    assert [m["source_ids"] for m in messages(engine)] == [["hook:d1"], ["hook:d2", "hook:d3"]]


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
def test_a_burst_is_taken_a_capped_run_at_a_time_oldest_first_without_starving_other_sessions(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    settings = runtime.settings.model_copy(update={"run_max_events": 3})
    for i in range(7):  # the burst: one triage session, seven deliveries
        deliver(engine, clock, owner, f"d{i}", key=None)
        clock.advance(timedelta(milliseconds=1))
    tasks_keyed(engine, clock, owner, "thread-b")  # another session's work, due after the burst's
    with read(engine) as conn:
        task_id = conn.execute(select(tasks.c.id)).scalar_one()
    deliver(engine, clock, owner, "b", key="thread-b")
    with write(engine) as conn:  # the user writes about the task four times: more preempting events than the cap
        for text in ("one", "two", "three", "four"):
            holds.say(conn, user_id=owner, task_id=task_id, text=text, actor="user", now=clock.now())
    clock.advance(timedelta(milliseconds=1))
    worker = Worker(engine, settings, clock, EchoHandler())
    while worker.run_once():
        clock.advance(timedelta(milliseconds=1))
    runs = [m["source_ids"] for m in messages(engine)]
    chat = [e.source + ":" + e.source_id for e in event_rows(engine) if e.source == holds.CHAT_SOURCE]
    # The oldest three; then the session due before the burst's rest, with every message (past the cap).
    assert runs == [["hook:d0", "hook:d1", "hook:d2"],
                    [f"delegation:{task_id}", "hook:b", *chat],
                    ["hook:d3", "hook:d4", "hook:d5"], ["hook:d6"]]
    assert {e.status for e in event_rows(engine)} == {EventStatus.PROCESSED}


def test_different_sessions_are_claimed_independently(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                       owner: str) -> None:
    tasks_keyed(engine, clock, owner, "thread-a", "thread-b")
    deliver(engine, clock, owner, "a", key="thread-a")
    deliver(engine, clock, owner, "b", key="thread-b")
    one = Worker(engine, runtime.settings, clock, EchoHandler())._claim()
    two = Worker(engine, runtime.settings, clock, EchoHandler())._claim()
    assert one is not None and two is not None and one.session_id != two.session_id


def test_pausing_a_task_stops_the_active_run_at_its_next_step_and_commits_nothing(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    with write(engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        task_id = control.create_task(conn, user_id=owner, session_id=session_id, title="t", now=clock.now())
        inbox.record(conn, inbox.Delivery(user_id=owner, source="hook", source_id="d1", payload={},
                                          session_id=session_id), now=clock.now())

    def pause_mid_run(ctx: RunContext) -> None:
        ctx.step()
        ctx.send_to_user("half done")
        with write(engine) as conn:
            control.set_task_state(conn, user_id=owner, task_id=task_id, kind=ControlKind.PAUSE, actor="user",
                                   reason="wait", now=clock.now())
        ctx.step()  # refuses: the pause was persisted first
        ctx.send_to_user("never sent")

    worker = Worker(engine, runtime.settings, clock, ScriptedHandler([pause_mid_run]))
    assert worker.run_once()
    (run,) = run_rows(engine)
    assert run.outcome == RunOutcome.INTERRUPTED
    assert messages(engine) == []
    hook_event = next(e for e in event_rows(engine) if e.source == "hook")
    assert hook_event.status == EventStatus.PENDING and hook_event.attempts == 0


def test_stop_blocks_claims_until_start(runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    with write(engine) as conn:
        control.set_stop(conn, stopped=True, user_id=None, actor="cli", reason="test", now=clock.now())
    deliver(engine, clock, owner, "d1")
    worker = Worker(engine, runtime.settings, clock, EchoHandler())
    assert not worker.run_once()
    with write(engine) as conn:
        control.set_stop(conn, stopped=False, user_id=None, actor="cli", reason="", now=clock.now())
    assert worker.run_once()
    assert [e.status for e in event_rows(engine)] == [EventStatus.PROCESSED]


def test_stop_mid_run_interrupts_at_the_next_step(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                   owner: str) -> None:
    deliver(engine, clock, owner, "d1")

    def stopped_mid_run(ctx: RunContext) -> None:
        ctx.step()
        with write(engine) as conn:
            control.set_stop(conn, stopped=True, user_id=owner, actor="user", reason="stop", now=clock.now())
        ctx.step()

    Worker(engine, runtime.settings, clock, ScriptedHandler([stopped_mid_run])).run_once()
    assert [r.outcome for r in run_rows(engine)] == [RunOutcome.INTERRUPTED]
    assert [e.status for e in event_rows(engine)] == [EventStatus.PENDING]


def test_poison_event_is_failed_after_the_attempt_cap_and_the_user_is_told(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    deliver(engine, clock, owner, "poison")

    def explode(ctx: RunContext) -> None:
        raise RuntimeError("cannot parse this")

    worker = Worker(engine, runtime.settings, clock, ScriptedHandler([explode] * 100))
    for _ in range(runtime.settings.event_max_attempts + 1):
        clock.advance(timedelta(minutes=10))  # past the retry backoff
        worker.run_once()
    (event,) = event_rows(engine)
    assert event.status == EventStatus.FAILED
    assert event.attempts == runtime.settings.event_max_attempts
    failures = [m for m in messages(engine) if m.get("kind") == "event_failed"]
    assert [m["event_id"] for m in failures] == [event.id]
    outcomes = [r.outcome for r in run_rows(engine)]
    assert outcomes == [RunOutcome.FAILED] * runtime.settings.event_max_attempts


def test_run_that_exhausts_its_step_budget_saves_its_work_and_tells_the_user(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    runtime.settings.run_max_steps = 3
    deliver(engine, clock, owner, "d1")

    def loop_forever(ctx: RunContext) -> None:
        ctx.send_to_user("progress so far")
        while True:
            ctx.step()

    Worker(engine, runtime.settings, clock, ScriptedHandler([loop_forever])).run_once()
    (run,) = run_rows(engine)
    assert run.outcome == RunOutcome.BUDGET_EXHAUSTED and run.steps == 3
    assert [m.get("kind") for m in messages(engine)] == [None, "budget_exhausted"]
    assert [e.status for e in event_rows(engine)] == [EventStatus.PROCESSED]


def test_daily_budget_defers_new_runs_to_the_next_day_without_losing_events(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    runtime.settings.daily_max_steps = 1
    worker = Worker(engine, runtime.settings, clock, EchoHandler())
    deliver(engine, clock, owner, "d1", key="a")
    assert worker.run_once()  # uses the day's only step
    deliver(engine, clock, owner, "d2", key="b")
    assert not worker.run_once()
    assert [e.status for e in event_rows(engine)] == [EventStatus.PROCESSED, EventStatus.PENDING]
    clock.advance(timedelta(days=1))
    assert worker.run_once()
    assert [e.status for e in event_rows(engine)] == [EventStatus.PROCESSED, EventStatus.PROCESSED]


def runs_counted(engine: Engine, outcome: RunOutcome) -> float:
    """`wakeful_runs_total{outcome=…}` in what `GET /metrics` would answer now."""
    for family in text_string_to_metric_families(metrics.exposition(engine).decode()):
        for sample in family.samples:
            if sample.name == "wakeful_runs_total" and sample.labels.get("outcome") == outcome.value:
                return sample.value
    return 0.0


def test_abandoned_run_is_swept_and_its_events_are_taken_over(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                              owner: str) -> None:
    deliver(engine, clock, owner, "d1")
    counted = runs_counted(engine, RunOutcome.ABANDONED)
    dead = Worker(engine, runtime.settings, clock, EchoHandler())._claim()  # then the process "dies"
    assert dead is not None
    clock.advance(runtime.settings.lease + timedelta(seconds=1))
    runtime.sweep_once()
    assert [r.outcome for r in run_rows(engine)] == [RunOutcome.ABANDONED]
    assert runs_counted(engine, RunOutcome.ABANDONED) == counted + 1  # wakeful_runs_total counts it too
    assert Worker(engine, runtime.settings, clock, EchoHandler()).run_once()
    assert [e.status for e in event_rows(engine)] == [EventStatus.PROCESSED]
    assert len(messages(engine)) == 1


def test_the_sweeper_never_fails_an_event_a_live_run_is_handling(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                                 owner: str) -> None:
    # Regression: the last allowed attempt was failed by the sweeper mid-run, and the run still replied to it.
    runtime.settings.event_max_attempts = 1
    deliver(engine, clock, owner, "d1")
    worker = Worker(engine, runtime.settings, clock, EchoHandler())
    ctx = worker._claim()
    assert ctx is not None
    runtime.sweep_once()
    EchoHandler()(ctx)
    worker._commit(ctx, RunOutcome.COMPLETED, None)
    assert [e.status for e in event_rows(engine)] == [EventStatus.PROCESSED]
    assert [m.get("kind") for m in messages(engine)] == [None]


def test_a_run_written_off_by_the_sweeper_commits_nothing(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                          owner: str) -> None:
    # Regression: a run whose lease lapsed was marked abandoned, then committed anyway under its still-latest token.
    deliver(engine, clock, owner, "d1")
    worker = Worker(engine, runtime.settings, clock, EchoHandler())
    ctx = worker._claim()
    assert ctx is not None
    EchoHandler()(ctx)
    clock.advance(runtime.settings.lease + timedelta(seconds=1))
    runtime.sweep_once()
    with pytest.raises(StaleToken):
        worker._commit(ctx, RunOutcome.COMPLETED, None)
    assert messages(engine) == [] and [e.status for e in event_rows(engine)] == [EventStatus.PENDING]
    assert worker.run_once() and len(messages(engine)) == 1


class _RecordingStop(threading.Event):
    """A stop event that notes how long the worker asked to rest, and never makes it actually wait."""

    def __init__(self) -> None:
        super().__init__()
        self.rests: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.rests.append(timeout)
        return self.is_set()


def _run_twice(worker_runs: list[RunContext], stop: _RecordingStop) -> Callable[[RunContext], None]:
    def handler(ctx: RunContext) -> None:
        worker_runs.append(ctx)
        EchoHandler()(ctx)
        if len(worker_runs) == 2:
            stop.set()
    return handler


def _share(rate: float, runtime: Runtime) -> RunShare:
    return RunShare(lambda: rate, share=runtime.settings.ingest_run_share, busy_rate=runtime.settings.ingest_busy_rate)


def test_a_worker_rests_after_a_run_during_which_the_inbox_acknowledged_deliveries(
        runtime: Runtime, engine: Engine, clock: FakeClock, owner: str) -> None:
    tasks_keyed(engine, clock, owner, "a", "b")
    deliver(engine, clock, owner, "d1", key="a")
    deliver(engine, clock, owner, "d2", key="b")
    stop, runs = _RecordingStop(), []
    busy = runtime.settings.ingest_busy_rate + 1  # deliveries per second: above the line
    worker = Worker(engine, runtime.settings, clock, _run_twice(runs, stop), share=_share(busy, runtime))
    worker.run_forever(stop, threading.Event())
    assert len(runs) == 2
    assert len(stop.rests) == 1 and stop.rests[0] is not None and stop.rests[0] > 0  # before the second run


def test_a_worker_does_not_rest_while_the_inbox_is_not_busy(runtime: Runtime, engine: Engine, clock: FakeClock,
                                                        owner: str) -> None:
    tasks_keyed(engine, clock, owner, "a", "b")
    deliver(engine, clock, owner, "d1", key="a")
    deliver(engine, clock, owner, "d2", key="b")
    stop, runs = _RecordingStop(), []
    steady = runtime.settings.ingest_busy_rate / 2  # a stream the workers keep up with: runs go at full speed
    worker = Worker(engine, runtime.settings, clock, _run_twice(runs, stop), share=_share(steady, runtime))
    worker.run_forever(stop, threading.Event())
    assert len(runs) == 2 and stop.rests == []


def test_runs_under_ingest_take_at_most_their_share_of_the_time_all_workers_together() -> None:
    assert rest_after_run(0.004, share=0.1) == pytest.approx(0.036)  # 4 ms of run, 36 ms of rest: 10 %
    assert rest_after_run(0.004, share=1.0) == 0.0
    now, rate = [10.0], [1000.0]
    share = RunShare(lambda: rate[0], share=0.1, busy_rate=200, clock=lambda: now[0])
    assert share.rest() == 0.0
    share.spent(0.004)  # one worker's run
    share.spent(0.002)  # another's, ending meanwhile: the rests add up, they do not overlap
    assert share.rest() == pytest.approx(0.054)
    now[0] += 0.05
    assert share.rest() == pytest.approx(0.004)
    now[0] += 1.0
    rate[0] = 100.0  # the burst is over: runs cost nothing more
    share.spent(0.004)
    assert share.rest() == 0.0


def test_a_run_costs_the_write_lock_time_its_own_thread_held(engine: Engine) -> None:
    def hold() -> None:
        before = write_lock_time()
        with write(engine) as conn:
            entered = time.monotonic()
            conn.exec_driver_sql("SELECT 1")
            inside = time.monotonic() - entered
        held.append((write_lock_time() - before, inside))

    held: list[tuple[float, float]] = []
    mine = write_lock_time()
    other = threading.Thread(target=hold)
    other.start()
    other.join()
    assert held and held[0][0] >= held[0][1] > 0  # at least the whole time spent inside the transaction
    assert write_lock_time() == mine  # the other thread's, not this one's


def test_a_run_does_not_count_the_time_it_waited_for_another_process_writing_as_write_lock_time(
        engine: Engine) -> None:
    """`wakeful worker` beside `wakeful api`: waiting for the API's commit takes nothing from the acknowledgements
    (the API never waits for the worker's lock), so it is no cost the runs must rest for."""
    path = engine.url.database
    assert path is not None
    other = sqlite3.connect(path, isolation_level=None)  # the API process, writing
    other.execute("BEGIN IMMEDIATE")
    asking = threading.Event()

    @event.listens_for(engine, "checkout")  # just before the BEGIN that waits for `other`
    def _asking(*_args: object) -> None:
        asking.set()

    held: list[tuple[float, float]] = []

    def run() -> None:
        before = write_lock_time()
        with write(engine) as conn:
            conn.exec_driver_sql("SELECT 1")
        held.append((write_lock_time() - before, time.monotonic()))

    worker = threading.Thread(target=run)
    worker.start()
    assert asking.wait(timeout=30)
    released = time.monotonic()
    other.execute("COMMIT")  # only now can the worker's transaction begin
    worker.join(timeout=60)
    other.close()
    event.remove(engine, "checkout", _asking)
    assert held
    seconds, done = held[0]
    assert 0 < seconds <= done - released


def test_the_inbox_rate_is_measured_over_windows_long_enough_not_to_see_a_pair_as_a_burst() -> None:
    received, now = [0], [100.0]
    rate = InboxRate(lambda: received[0], window=0.25, clock=lambda: now[0])
    received[0], now[0] = 2, 100.01  # two deliveries within one 10 ms run: 200/s if measured there
    assert rate() == 0.0
    received[0], now[0] = 25, 100.25  # 25 in a quarter of a second
    assert rate() == pytest.approx(100.0)
    received[0], now[0] = 525, 100.75
    assert rate() == pytest.approx(1000.0)
    now[0] = 101.75  # a second with nothing: the burst is over
    assert rate() == 0.0


def test_a_run_costs_its_cpu_or_its_write_lock_time_and_apart_from_the_api_only_the_write_lock() -> None:
    """In one process a run's CPU is taken from the acknowledgements (one interpreter lock); in `wakeful worker`,
    apart from `wakeful api`, only the database's write lock is shared, so a run there rests for that alone."""
    together = RunShare(lambda: 1000.0, share=0.1, busy_rate=200)
    apart = RunShare(lambda: 1000.0, share=0.1, busy_rate=200, cpu_counts=False)
    assert together.cost(cpu=0.004, locked=0.001) == 0.004
    assert together.cost(cpu=0.001, locked=0.003) == 0.003
    assert apart.cost(cpu=0.004, locked=0.001) == 0.001


def test_a_worker_apart_counts_only_the_write_lock_on_sqlite_and_its_cpu_on_postgresql() -> None:
    """On PostgreSQL a run holds no one write lock (its time reads 0): counting that alone, runs never gave way."""
    assert not run_costs_cpu(Role.WORKER, "sqlite")
    assert run_costs_cpu(Role.WORKER, "postgresql")
    assert run_costs_cpu(Role.ALL, "sqlite") and run_costs_cpu(Role.ALL, "postgresql")

