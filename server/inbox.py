"""The inbox: persist on receive.

`record` writes one event and its session todo in the caller's transaction, routing it to a session (a pending
wait's, a known correlation key's, or a new one) and dropping duplicates by `(source, source_id)`.
`GroupCommitter` is how the HTTP handler uses it: deliveries from many requests are written in one transaction and
one fsync, and each request is acknowledged only after that commit returned. A delivery whose transaction fails is
retried alone, so one bad delivery never fails its neighbours.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, select, update

from server import faults, sessions
from server.clock import Clock
from server.db import bound, insert_many, upsert, write
from server.ids import new_id
from server.tables import EventKind, EventStatus, WaitState, events, session_keys, todos, waits
from server.tables import sessions as sessions_table

__all__ = ["Delivery", "GroupCommitter", "Recorded", "record", "record_many"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """An input to persist. `session_id` is set by internal sources (timers, control) that know their session."""

    user_id: str
    source: str
    source_id: str
    payload: Any
    kind: EventKind = EventKind.WEBHOOK
    trust: str = "third_party"
    corr_key: str | None = None
    session_id: str | None = None
    preempt: bool = False


@dataclass(frozen=True, kw_only=True)
class Recorded:
    event_id: str
    session_id: str
    duplicate: bool
    status: EventStatus


def record(conn: Connection, delivery: Delivery, *, now: datetime) -> Recorded:
    """Persist one delivery in the caller's transaction. Idempotent by `(source, source_id)`."""
    existing = conn.execute(
        select(events.c.id, events.c.session_id, events.c.status).where(
            events.c.source == delivery.source, events.c.source_id == delivery.source_id
        )
    ).first()
    if existing is not None:
        return Recorded(event_id=existing.id, session_id=existing.session_id, duplicate=True,
                        status=EventStatus(existing.status))
    event_id = new_id("ev")
    session_id, status = _route(conn, delivery, event_id=event_id, now=now)
    conn.execute(
        events.insert().values(
            id=event_id,
            user_id=delivery.user_id,
            source=delivery.source,
            source_id=delivery.source_id,
            session_id=session_id,
            corr_key=delivery.corr_key,
            kind=delivery.kind.value,
            trust=delivery.trust,
            preempt=delivery.preempt,
            payload=_payload(delivery.payload),
            status=status.value,
            attempts=0,
            received_at=now,
        )
    )
    if status is EventStatus.PENDING:
        sessions.wake(conn, session_id=session_id, user_id=delivery.user_id, due_at=now)
    return Recorded(event_id=event_id, session_id=session_id, duplicate=False, status=status)


def record_many(conn: Connection, deliveries: list[Delivery], *, now: datetime) -> list[Recorded]:
    """`record` for a batch, in the caller's transaction, with the same results in the same order.

    The common case — a delivery with no correlation key, which starts a session of its own — is written with one
    multi-row insert per table instead of statement by statement; the rest go through `record`."""
    first: dict[tuple[str, str], int] = {}
    for i, d in enumerate(deliveries):
        first.setdefault((d.source, d.source_id), i)
    known: dict[tuple[str, str], Recorded] = {}
    for source in {d.source for d in deliveries}:
        ids = [d.source_id for d in deliveries if d.source == source]
        for row in conn.execute(select(events.c.source_id, events.c.id, events.c.session_id, events.c.status)
                                .where(events.c.source == source, events.c.source_id.in_(ids))):
            known[(source, row.source_id)] = Recorded(event_id=row.id, session_id=row.session_id, duplicate=True,
                                                      status=EventStatus(row.status))
    fresh: dict[int, Recorded] = {}
    simple_rows: list[tuple[Delivery, str, str]] = []
    for key, i in first.items():
        d = deliveries[i]
        if key in known:
            continue
        if d.corr_key is None and d.session_id is None:
            simple_rows.append((d, new_id("ev"), new_id("ses")))
            fresh[i] = Recorded(event_id=simple_rows[-1][1], session_id=simple_rows[-1][2], duplicate=False,
                                status=EventStatus.PENDING)
        else:
            fresh[i] = record(conn, d, now=now)
    if simple_rows:
        _insert_fresh_sessions(conn, simple_rows, now=now)
    results = []
    for i, d in enumerate(deliveries):
        key = (d.source, d.source_id)
        if key in known:
            results.append(known[key])
        elif first[key] == i:
            results.append(fresh[i])
        else:  # the same delivery twice in one batch: the second is a duplicate of the first
            original = fresh[first[key]]
            results.append(Recorded(event_id=original.event_id, session_id=original.session_id, duplicate=True,
                                    status=original.status))
    return results


def _insert_fresh_sessions(conn: Connection, rows: list[tuple[Delivery, str, str]], *, now: datetime) -> None:
    """Each (delivery, event id, session id) as a new session, its event and its todo: one insert per table.

    The inbox's hot path: values go to the driver as they are (`insert_many`), so the shared ones are converted
    once per batch."""
    at = bound(conn, events.c.received_at, now)
    preempt = {flag: bound(conn, events.c.preempt, flag) for flag in (False, True)}
    pending = EventStatus.PENDING.value
    insert_many(conn, sessions_table, ("id", "user_id", "fencing_token", "created_at"),
                [(sid, d.user_id, 0, at) for d, _, sid in rows])
    insert_many(conn, events, ("id", "user_id", "source", "source_id", "session_id", "corr_key", "kind", "trust",
                               "preempt", "payload", "status", "attempts", "received_at"),
                [(eid, d.user_id, d.source, d.source_id, sid, None, d.kind.value, d.trust, preempt[d.preempt],
                  _payload(d.payload), pending, 0, at) for d, eid, sid in rows])
    insert_many(conn, todos, ("session_id", "user_id", "version", "due_at"),  # a new session has no todo yet
                [(sid, d.user_id, 1, at) for d, _, sid in rows])


def _payload(payload: Any) -> str:
    return json.dumps(payload, separators=(",", ":"), sort_keys=True)


def _route(conn: Connection, d: Delivery, *, event_id: str, now: datetime) -> tuple[str, EventStatus]:
    if d.session_id is not None:
        return d.session_id, EventStatus.PENDING
    if d.corr_key is None:
        return sessions.create_session(conn, user_id=d.user_id, now=now), EventStatus.PENDING
    wait = conn.execute(
        select(waits.c.id, waits.c.session_id, waits.c.state).where(
            waits.c.user_id == d.user_id, waits.c.match_key == d.corr_key
        )
    ).first()
    if wait is not None:
        sessions.lock(conn, wait.session_id)
        moved = conn.execute(
            update(waits)
            .where(waits.c.id == wait.id, waits.c.state == WaitState.PENDING.value)
            .values(state=WaitState.SATISFIED.value, resolved_at=now, resolved_event_id=event_id)
        ).rowcount
        # A terminal wait is final: the late answer is kept as a record and wakes nothing.
        return wait.session_id, EventStatus.PENDING if moved == 1 else EventStatus.LATE
    known = conn.execute(
        select(session_keys.c.session_id).where(
            session_keys.c.user_id == d.user_id, session_keys.c.key == d.corr_key
        )
    ).scalar_one_or_none()
    if known is not None:
        sessions.lock(conn, known)
        return known, EventStatus.PENDING
    session_id = sessions.create_session(conn, user_id=d.user_id, now=now)
    conn.execute(
        upsert(conn, session_keys)
        .values(user_id=d.user_id, key=d.corr_key, session_id=session_id)
        .on_conflict_do_nothing()
    )
    return session_id, EventStatus.PENDING


class GroupCommitter:
    """One writer thread that commits batches of deliveries; each caller awaits its own, answered once durable.

    A batch's answers go back to each event loop in ONE callback (not one wake-up per request), and `received`
    counts committed deliveries, so that runs can tell when they are competing with the inbox (`server.worker`)."""

    def __init__(self, engine: Engine, clock: Clock, *, on_commit: Callable[[], None] = lambda: None,
                 max_batch: int = 512) -> None:
        self._engine = engine
        self._clock = clock
        self._on_commit = on_commit
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="inbox-committer", daemon=True)
        self.batches = 0
        self.received = 0

    def start(self) -> None:
        self._thread.start()

    async def persist(self, delivery: Delivery) -> Recorded:
        """Record the delivery; returns once it is durable (or raises what its transaction raised)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Recorded] = loop.create_future()
        self._queue.put(_Pending(delivery=delivery, loop=loop, future=future))
        return await future

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stopping = False
            while len(batch) < self._max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            self._commit(batch)
            if stopping:
                return

    def _commit(self, batch: list[_Pending]) -> None:
        answers: list[Recorded | BaseException]
        try:
            answers = list(self._write([p.delivery for p in batch]))
        except Exception:
            log.exception("inbox batch of %d failed; committing one by one", len(batch))
            answers = []
            for pending in batch:
                try:
                    (result,) = self._write([pending.delivery])
                except Exception as exc:  # this delivery alone is bad: refuse it, keep the others
                    answers.append(exc)
                else:
                    answers.append(result)
        else:
            faults.crash_point("after_event_commit")  # durable, not yet acknowledged
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Recorded], Recorded | BaseException]]] = {}
        for pending, answer in zip(batch, answers, strict=True):
            by_loop.setdefault(pending.loop, []).append((pending.future, answer))
        for loop, settled in by_loop.items():
            try:
                loop.call_soon_threadsafe(_answer, settled)
            except RuntimeError:  # that loop is closed: nobody is waiting for these answers any more
                pass

    def _write(self, deliveries: list[Delivery]) -> list[Recorded]:
        now = self._clock.now()
        with write(self._engine) as conn:
            results = record_many(conn, deliveries, now=now)
        self.batches += 1
        self.received += len(deliveries)
        self._on_commit()
        return results


@dataclass(frozen=True, kw_only=True)
class _Pending:
    delivery: Delivery
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Recorded]


def _answer(settled: list[tuple[asyncio.Future[Recorded], Recorded | BaseException]]) -> None:
    for future, answer in settled:
        if future.done():  # the request was cancelled (its client went away); the delivery is recorded anyway
            continue
        if isinstance(answer, BaseException):
            future.set_exception(answer)
        else:
            future.set_result(answer)
