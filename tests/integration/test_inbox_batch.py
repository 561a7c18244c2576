"""Group commit writes a batch as `record` would write it delivery by delivery: same rows, same answers."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, event, func, select
from sqlalchemy.exc import IntegrityError

from tests.support.templates import copy_template
from wakeful.proxy.clock import FakeClock
from wakeful.server.core.inbox import Delivery, GroupCommitter, Recorded, record, record_many
from wakeful.server.store.db import (
    bound,
    connect_nowait,
    insert_many,
    make_engine,
    migrate,
    read,
    write,
    write_unless_busy,
)
from wakeful.server.store.tables import events, sessions, todos
from wakeful.server.store.users import ensure_user

deliveries = st.lists(
    st.builds(lambda source, sid, key: (source, sid, key), st.sampled_from(["a", "b"]),
              st.sampled_from([f"d{i}" for i in range(6)]), st.sampled_from([None, None, "thread-1", "thread-2"])),
    min_size=1, max_size=12)


def fresh(path: Path, template: Path) -> tuple[Engine, str]:
    copy_template(template, path)
    engine = make_engine(f"sqlite:///{path}")
    migrate(engine)
    with write(engine) as conn:
        user, _ = ensure_user(conn, name="owner", now=FakeClock().now())
    return engine, user


def shape(engine: Engine) -> tuple[int, int, int, list[tuple[str, str, str]]]:
    with read(engine) as conn:
        counts = [conn.execute(select(func.count()).select_from(t)).scalar_one() for t in (events, sessions, todos)]
        rows = [tuple(r) for r in conn.execute(select(events.c.source, events.c.source_id, events.c.status)
                                               .order_by(events.c.source, events.c.source_id))]
    return counts[0], counts[1], counts[2], rows


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=deliveries, batch=deliveries)
def test_a_batch_is_recorded_exactly_as_one_by_one(tmp_path_factory: object, sqlite_template: Path, before: list,
                                                   batch: list) -> None:
    base = tmp_path_factory.mktemp("batch")  # type: ignore[attr-defined]
    clock = FakeClock()
    results = []
    for name, many in (("one.db", False), ("many.db", True)):
        engine, user = fresh(base / name, sqlite_template)
        with write(engine) as conn:
            for s, i, k in before:
                record(conn, Delivery(user_id=user, source=s, source_id=i, payload={}, corr_key=k), now=clock.now())
        batch_deliveries = [Delivery(user_id=user, source=s, source_id=i, payload={"x": 1}, corr_key=k)
                            for s, i, k in batch]
        with write(engine) as conn:
            answers = (record_many(conn, batch_deliveries, now=clock.now()) if many else
                       [record(conn, d, now=clock.now()) for d in batch_deliveries])
        results.append(([(a.duplicate, a.status) for a in answers], shape(engine)))
        engine.dispose()
    assert results[0] == results[1]


async def _persist_all(committer: GroupCommitter, batch: list[Delivery]) -> list[Recorded | BaseException]:
    return await asyncio.gather(*(committer.persist(d) for d in batch), return_exceptions=True)


def test_every_caller_of_a_group_commit_gets_its_own_answer(tmp_path: Path, sqlite_template: Path) -> None:
    engine, user = fresh(tmp_path / "inbox.db", sqlite_template)
    committer = GroupCommitter(engine, FakeClock())
    committer.start()
    try:
        batch = [Delivery(user_id=user, source="hook", source_id=f"d{i % 40}", payload={"i": i}) for i in range(60)]
        answers = asyncio.run(_persist_all(committer, batch))
    finally:
        committer.stop()
    assert all(isinstance(a, Recorded) for a in answers)
    recorded = [a for a in answers if isinstance(a, Recorded)]
    assert [a.duplicate for a in recorded] == [False] * 40 + [True] * 20
    assert [a.event_id for a in recorded[40:]] == [a.event_id for a in recorded[:20]]  # the original's ID
    assert shape(engine)[:3] == (40, 1, 1) and committer.received == 60  # keyless: all to the triage session


@pytest.mark.parametrize("broken", ["user", "authority"])
def test_a_delivery_that_cannot_be_written_fails_alone(tmp_path: Path, sqlite_template: Path, broken: str) -> None:
    """An unknown user fails the batch where it is routed (its triage session), an authority the table refuses
    only in the multi-row insert. Either way that delivery's transaction fails, and only its own."""
    engine, user = fresh(tmp_path / "inbox.db", sqlite_template)
    committer = GroupCommitter(engine, FakeClock())
    committer.start()
    bad = {"user": {"user_id": "usr_nobody"}, "authority": {"authority": "nobody in particular"}}[broken]
    try:
        batch = [Delivery(**{"user_id": user, "source": "hook", "source_id": f"d{i}", "payload": {},
                             **(bad if i == 3 else {})}) for i in range(8)]
        answers = asyncio.run(_persist_all(committer, batch))
    finally:
        committer.stop()
    assert isinstance(answers[3], IntegrityError)
    assert all(isinstance(a, Recorded) for i, a in enumerate(answers) if i != 3)
    assert [sid for _, sid, _ in shape(engine)[3]] == [f"d{i}" for i in range(8) if i != 3]


def test_insert_many_writes_more_rows_than_one_sqlite_statement_can_carry(
        tmp_path: Path, sqlite_template: Path) -> None:
    engine, user = fresh(tmp_path / "inbox.db", sqlite_template)
    at = FakeClock().now()
    with write(engine) as conn:
        rows = [(f"ses_{i:05d}", user, 0, bound(conn, sessions.c.created_at, at)) for i in range(9_000)]
        insert_many(conn, sessions, ("id", "user_id", "fencing_token", "created_at"), rows)  # 4 columns: 8,191 a go
    with read(engine) as conn:
        assert conn.execute(select(func.count()).select_from(sessions)).scalar_one() == 9_000
        assert conn.execute(select(sessions.c.created_at).limit(1)).scalar_one() == at


def test_the_event_loop_commits_without_waiting_for_another_process_holding_the_database(
        tmp_path: Path, sqlite_template: Path) -> None:
    engine, user = fresh(tmp_path / "inbox.db", sqlite_template)
    other = sqlite3.connect(tmp_path / "inbox.db", isolation_level=None)  # another process's write lock
    other.execute("BEGIN IMMEDIATE")
    committer = GroupCommitter(engine, FakeClock())
    committer.start()

    async def scenario() -> tuple[int, bool, Recorded]:
        task = asyncio.ensure_future(committer.persist(
            Delivery(user_id=user, source="hook", source_id="d1", payload={})))
        ticks = 0
        for _ in range(20):  # the loop keeps turning while the delivery waits for the lock
            await asyncio.sleep(0.005)
            ticks += 1
        done_while_held = task.done()
        other.execute("COMMIT")
        return ticks, done_while_held, await asyncio.wait_for(task, timeout=30)

    try:
        ticks, done_while_held, recorded = asyncio.run(scenario())
    finally:
        committer.stop()
        other.close()
    assert ticks == 20 and not done_while_held
    assert not recorded.duplicate and shape(engine)[:3] == (1, 1, 1)


def test_a_loop_waiting_for_the_write_lock_goes_before_threads_that_asked_after_it(
        tmp_path: Path, sqlite_template: Path) -> None:
    engine, _ = fresh(tmp_path / "inbox.db", sqlite_template)
    loop_conn = connect_nowait(engine)
    holding, release, freed = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def holder() -> None:
        with write(engine):
            holding.set()
            release.wait()

    def late_thread() -> None:
        with write(engine):
            order.append("thread")

    first = threading.Thread(target=holder)
    first.start()
    holding.wait()
    with write_unless_busy(loop_conn, "loop", freed.set) as conn:
        assert conn is None  # taken: the loop does not wait, it is called back
    second = threading.Thread(target=late_thread)
    second.start()  # asks for the lock after the loop did
    release.set()
    first.join()
    assert freed.wait(timeout=30)
    with write_unless_busy(loop_conn, "loop", freed.set) as conn:
        assert conn is not None
        order.append("loop")
    second.join(timeout=30)
    loop_conn.close()
    assert order == ["loop", "thread"]


def test_the_event_loop_keeps_turning_while_a_batch_syncs_and_answers_only_once_it_is_durable(
        tmp_path: Path, sqlite_template: Path) -> None:
    engine, user = fresh(tmp_path / "inbox.db", sqlite_template)
    syncing, synced = threading.Event(), threading.Event()
    loop_blocked: list[bool] = []

    @event.listens_for(engine, "commit")
    def _slow_disk(_conn: object) -> None:  # the commit (the fsync) waits until the loop has turned without it
        syncing.set()
        loop_blocked.append(not synced.wait(timeout=10))

    committer = GroupCommitter(engine, FakeClock())
    committer.start()

    async def scenario() -> tuple[bool, Recorded]:
        task = asyncio.ensure_future(committer.persist(
            Delivery(user_id=user, source="hook", source_id="d1", payload={})))
        while not syncing.is_set():  # the loop turns while the batch is written and its commit starts
            await asyncio.sleep(0.001)
        answered_before_durable = task.done()
        synced.set()  # only a loop that is not waiting on the commit itself gets here
        return answered_before_durable, await asyncio.wait_for(task, timeout=30)

    try:
        answered_before_durable, recorded = asyncio.run(scenario())
    finally:
        committer.stop()
    assert loop_blocked == [False] and not answered_before_durable
    assert not recorded.duplicate and shape(engine)[:3] == (1, 1, 1)


async def _persist_in_batches(committer: GroupCommitter, user: str, *, batches: int, size: int) -> None:
    for b in range(batches):  # all of one gather arrive in one turn of the loop: one batch, one commit
        await _persist_all(committer, [Delivery(user_id=user, source="hook", source_id=f"d{b}-{i}",
                                                payload={"note": "x" * 200}) for i in range(size)])


def _log_after_batches(path: Path, template: Path, *, checkpoint_every: float) -> int:
    """Bytes in the write-ahead log after 400 batches of 10 deliveries, before the last connection closes (and
    SQLite removes the log)."""
    engine, user = fresh(path, template)
    committer = GroupCommitter(engine, FakeClock(), checkpoint_every=checkpoint_every)
    committer.start()
    try:
        asyncio.run(_persist_in_batches(committer, user, batches=400, size=10))
        log_bytes = Path(f"{path}-wal").stat().st_size
    finally:
        committer.stop()
    assert shape(engine)[0] == 4000
    return log_bytes


def test_the_loops_commits_leave_the_log_to_the_checkpointing_thread(tmp_path: Path, sqlite_template: Path) -> None:
    """SQLite would checkpoint in the committing thread past 1,000 pages (4 MiB), and the next batch would wait for
    it; with no checkpoint due, the log grows past that instead."""
    assert _log_after_batches(tmp_path / "inbox.db", sqlite_template, checkpoint_every=3600.0) > 5 << 20


def test_the_checkpointing_thread_keeps_the_log_small_while_the_loop_writes(
        tmp_path: Path, sqlite_template: Path) -> None:
    assert _log_after_batches(tmp_path / "inbox.db", sqlite_template, checkpoint_every=0.0) < 2 << 20
