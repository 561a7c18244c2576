"""Several workers and dispatchers on one PostgreSQL database (issue 19): claims take `FOR UPDATE SKIP LOCKED`, so
two claimers never wait on each other nor take the same row, and the outbox drained by several dispatchers at once
sends every message once. On SQLite (one writer) the same calls keep today's guarded updates. The inbox's group
commit holds on PostgreSQL too (one commit for many deliveries, each caller its own answer).

Through the store functions and the real outbox drain, against a loopback receiver that honours `Idempotency-Key`
and records what it applied (`tests.support.sink`).
"""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

from tests.support.polling import wait_until
from tests.support.records import messages
from tests.support.sink import Sink
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import outbox, sessions
from wakeful.server.core.inbox import Delivery, GroupCommitter, Recorded
from wakeful.server.core.outbox import MessageDelivery, OutboxDrain
from wakeful.server.store.db import write

BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
PG = pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
LEASE = timedelta(seconds=30)


def _due_sessions(engine: Engine, owner: str, clock: FakeClock, n: int) -> list[str]:
    """`n` sessions with work due, the first due earliest."""
    made = []
    with write(engine) as conn:
        for i in range(n):
            session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
            sessions.wake(conn, session_id=session_id, user_id=owner, due_at=clock.now() - timedelta(seconds=n - i))
            made.append(session_id)
    return made


@BOTH
def test_a_claim_takes_the_earliest_due_candidate_and_not_one_already_leased(engine: Engine, clock: FakeClock,
                                                                            owner: str) -> None:
    first, second = _due_sessions(engine, owner, clock, 2)
    with write(engine) as conn:
        assert sessions.claim_first(conn, candidates=[first, second], worker="a", now=clock.now(),
                                    lease=LEASE) == (first, 1)
    with write(engine) as conn:
        assert sessions.claim_first(conn, candidates=[first, second], worker="b", now=clock.now(),
                                    lease=LEASE) == (second, 1)
    with write(engine) as conn:
        assert sessions.claim_first(conn, candidates=[first, second], worker="c", now=clock.now(),
                                    lease=LEASE) is None
    clock.advance(LEASE)  # both leases lapse: the next claim fences the first worker out
    with write(engine) as conn:
        assert sessions.claim_first(conn, candidates=[first], worker="c", now=clock.now(), lease=LEASE) == (first, 2)


@PG
def test_a_claim_skips_the_session_another_worker_is_claiming_instead_of_waiting_for_it(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    first, second = _due_sessions(engine, owner, clock, 2)
    with engine.connect() as a, a.begin():
        assert sessions.claim_first(a, candidates=[first, second], worker="a", now=clock.now(),
                                    lease=LEASE) == (first, 1)
        with engine.connect() as b, b.begin():
            b.execute(text("SET LOCAL lock_timeout = '2s'"))  # a claim that waited on `a` would fail here
            assert sessions.claim_first(b, candidates=[first, second], worker="b", now=clock.now(),
                                        lease=LEASE) == (second, 1)
            with engine.connect() as c, c.begin():
                c.execute(text("SET LOCAL lock_timeout = '2s'"))
                assert sessions.claim_first(c, candidates=[first, second], worker="c", now=clock.now(),
                                            lease=LEASE) is None


@PG
def test_a_drain_does_not_take_the_messages_another_drain_is_delivering(engine: Engine, clock: FakeClock,
                                                                       owner: str) -> None:
    with write(engine) as conn:
        ids = [outbox.enqueue(conn, user_id=owner, body={"text": f"m{i}"}, now=clock.advance(timedelta(seconds=1)))
               for i in range(4)]
    one, other = (OutboxDrain(engine, clock, hold=LEASE) for _ in range(2))
    taken = one.claim(outbox.OutboxKind.USER_MESSAGE, limit=3)
    assert [row.id for row in taken] == ids[:3]
    assert [row.id for row in other.claim(outbox.OutboxKind.USER_MESSAGE)] == ids[3:]
    assert other.claim(outbox.OutboxKind.USER_MESSAGE) == []
    clock.advance(LEASE)  # the first drain died before settling them: they come back, their handovers counted
    again = other.claim(outbox.OutboxKind.USER_MESSAGE)
    assert [(row.id, row.attempts) for row in again] == [(i, 2) for i in ids[:3]] + [(ids[3], 2)]


@PG
def test_four_dispatchers_draining_one_outbox_send_every_message_exactly_once(engine: Engine, clock: FakeClock,
                                                                              owner: str) -> None:
    count = 300
    with write(engine) as conn:
        for i in range(count):
            outbox.enqueue(conn, user_id=owner, body={"text": f"message {i}"}, now=clock.now())
    stop = threading.Event()
    with Sink() as sink:
        def dispatcher() -> None:
            delivery = MessageDelivery(engine, clock, notify_url=sink.url, max_attempts=5,
                                       backoff=timedelta(seconds=1))
            drain = OutboxDrain(engine, clock, [delivery], hold=LEASE)
            try:
                while not stop.is_set():
                    drain.drain(limit=7)
            finally:
                delivery.close()

        threads = [threading.Thread(target=dispatcher, name=f"dispatcher-{i}") for i in range(4)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: all(m["state"] == "sent" for m in messages(engine)), 60, "every message sent")
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
        applied, applications, repeats = sink.snapshot()
    assert len(applied) == count
    assert set(applications.values()) == {1}
    assert repeats == {}  # not one message was even sent twice


@PG
def test_group_commit_on_postgresql_writes_many_deliveries_per_commit_and_answers_each_caller(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    committer = GroupCommitter(engine, clock)

    def persist_all(batch: list[Delivery]) -> list[Recorded | BaseException]:
        async def together() -> list[Recorded | BaseException]:
            return await asyncio.gather(*(committer.persist(d) for d in batch), return_exceptions=True)
        return asyncio.run(together())

    committer.start()
    try:
        good = persist_all([Delivery(user_id=owner, source="hook", source_id=f"d{i % 50}", payload={"i": i})
                            for i in range(80)])
        batches = committer.batches
        # An unknown user breaks a foreign key: that delivery fails alone, the others of its batch are kept.
        mixed = persist_all([Delivery(user_id=owner if i != 3 else "usr_nobody", source="hook",
                                      source_id=f"e{i}", payload={}) for i in range(8)])
    finally:
        committer.stop()
    assert [a.duplicate for a in good if isinstance(a, Recorded)] == [False] * 50 + [True] * 30
    assert 80 == committer.received - 7 and batches < 80  # not one commit per delivery
    assert isinstance(mixed[3], IntegrityError)
    assert all(isinstance(a, Recorded) and not a.duplicate for i, a in enumerate(mixed) if i != 3)
