"""The inbox: persist on receive.

`record` writes one event and its session todo in the caller's transaction, routing it to a session and dropping
duplicates by `(source, source_id)`. A delivery goes, in this order, to: the session its sender named (internal
sources: timers, control); the session of a wait its correlation key names and its sender may satisfy; the session of
the user's open task its key is bound to (`core.keys`); else the user's triage session (`core.triage`). Who sent a
delivery is its `authority` (`server.core.authority`): a key names a wait only for a sender that wait accepts, and a
task's key leads a delivery to the task's session without giving it any authority there.
`GroupCommitter` is how the HTTP handler uses it: deliveries from many requests are written in one transaction and
one fsync, and each request is acknowledged only after that commit returned. A delivery whose transaction fails is
retried alone, so one bad delivery never fails its neighbours.

When a delivery's run falls due (`due_at`): several outside deliveries that arrive together are one run, so a
webhook with a correlation key makes its session's todo due `coalesce` after it arrived and those that follow within
that window join it (the earliest due time stands); one without a key starts a session nothing else can join, and is
due at once. The user's messages and control are due at once, and pull a window in; a timer joins the work already
there at its time (it never hastens it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, select, update

from wakeful.proxy.clock import Clock
from wakeful.server.core import faults, keys, sessions, triage
from wakeful.server.core.authority import of_source, satisfiable_by
from wakeful.server.store.db import (
    Busy,
    OpenWrite,
    begin_unless_busy,
    bound,
    checkpoint,
    connect_nowait,
    insert_many,
    sqlite_driver,
    write,
)
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import SOURCE_PREFIX, EventKind, EventStatus, WaitState, events, waits

__all__ = ["Delivery", "GroupCommitter", "Recorded", "due_at", "record", "record_many"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """An input to persist. `session_id` is set by internal sources (timers, control) that know their session.

    `authority` is who sent it: `user` or `system` only where server code says so; by default, and always for a
    webhook delivery, the source named by `source` (`server.core.authority`). `trust` says how far its content may be
    believed, and never lets it satisfy a wait."""

    user_id: str
    source: str
    source_id: str
    payload: Any
    kind: EventKind = EventKind.WEBHOOK
    trust: str = "third_party"
    corr_key: str | None = None
    session_id: str | None = None
    preempt: bool = False
    authority: str = ""

    def __post_init__(self) -> None:
        if not self.authority:
            object.__setattr__(self, "authority", of_source(self.source))


@dataclass(frozen=True, kw_only=True)
class Recorded:
    event_id: str
    session_id: str
    duplicate: bool
    status: EventStatus


_NOW = timedelta(0)


def due_at(delivery: Delivery, *, now: datetime, coalesce: timedelta) -> tuple[datetime, bool]:
    """(when the delivery's run falls due, whether that may hasten work already due later): an outside delivery that
    others may join (it names a key or a session) after the coalescing window, a timer at once but never ahead of work
    already waiting, anything else at once."""
    joinable = delivery.corr_key is not None or delivery.session_id is not None
    if delivery.authority.startswith(SOURCE_PREFIX) and joinable:
        return now + coalesce, True
    return now, delivery.kind not in (EventKind.TIMER, EventKind.WAIT_TIMEOUT)


def record(conn: Connection, delivery: Delivery, *, now: datetime, coalesce: timedelta = _NOW) -> Recorded:
    """Persist one delivery in the caller's transaction. Idempotent by `(source, source_id)`. `coalesce`: the window
    an outside delivery waits for others to join its run."""
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
            authority=delivery.authority,
            preempt=delivery.preempt,
            payload=_payload(delivery.payload),
            status=status.value,
            attempts=0,
            received_at=now,
        )
    )
    if status is EventStatus.PENDING:
        due, hasten = due_at(delivery, now=now, coalesce=coalesce)
        sessions.wake(conn, session_id=session_id, user_id=delivery.user_id, due_at=due, hasten=hasten)
    return Recorded(event_id=event_id, session_id=session_id, duplicate=False, status=status)


def record_many(conn: Connection, deliveries: list[Delivery], *, now: datetime,
                coalesce: timedelta = _NOW) -> list[Recorded]:
    """`record` for a batch, in the caller's transaction, with the same results in the same order.

    The common case — a delivery with no correlation key, which goes to its user's triage session — is written with
    one multi-row insert instead of statement by statement; the rest go through `record`."""
    first: dict[tuple[str, str], int] = {}
    for i, d in enumerate(deliveries):
        first.setdefault((d.source, d.source_id), i)
    known: dict[tuple[str, str], Recorded] = {}
    for source in {d.source for d in deliveries}:
        for source_id, event_id, session_id, status in _known(conn, source,
                                                               [d.source_id for d in deliveries if d.source == source]):
            known[(source, source_id)] = Recorded(event_id=event_id, session_id=session_id, duplicate=True,
                                                  status=EventStatus(status))
    fresh: dict[int, Recorded] = {}
    simple_rows: list[tuple[Delivery, str, str]] = []
    triaged: dict[str, str] = {}  # user: triage session
    for key, i in first.items():
        d = deliveries[i]
        if key in known:
            continue
        if d.corr_key is None and d.session_id is None:
            if d.user_id not in triaged:
                triaged[d.user_id] = triage.session_of(conn, user_id=d.user_id, now=now)
            simple_rows.append((d, new_id("ev"), triaged[d.user_id]))
            fresh[i] = Recorded(event_id=simple_rows[-1][1], session_id=simple_rows[-1][2], duplicate=False,
                                status=EventStatus.PENDING)
        else:
            fresh[i] = record(conn, d, now=now, coalesce=coalesce)
    if simple_rows:  # a delivery without a key is due at once (`due_at`)
        _insert_triaged(conn, simple_rows, now=now)
        for user_id, session_id in triaged.items():
            sessions.wake(conn, session_id=session_id, user_id=user_id, due_at=now)
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


_KNOWN = select(events.c.source_id, events.c.id, events.c.session_id, events.c.status).where(
    events.c.source == bindparam("source"), events.c.source_id.in_(bindparam("ids", expanding=True)))


def _known(conn: Connection, source: str, source_ids: list[str]) -> Sequence[tuple[str, str, str, str]]:
    """(source_id, event id, session id, status) of the deliveries among `source_ids` already recorded.

    Once per batch on the inbox's hot path, where building the query and passing it through SQLAlchemy's execution
    cost a fifth of the committer's time: the statement is built once, and on SQLite the query goes to the driver
    (the rows are plain tuples either way)."""
    if conn.dialect.name != "sqlite":
        return [tuple(row) for row in conn.execute(_KNOWN, {"source": source, "ids": source_ids})]
    driver = sqlite_driver(conn)
    marks = ", ".join("?" * len(source_ids))  # the values go as parameters
    rows: list[tuple[str, str, str, str]] = driver.execute(
        f"SELECT source_id, id, session_id, status FROM events WHERE source = ? AND source_id IN ({marks})",
        (source, *source_ids)).fetchall()
    return rows


def _insert_triaged(conn: Connection, rows: list[tuple[Delivery, str, str]], *, now: datetime) -> None:
    """Each (delivery, event ID, triage session ID) as an event: one insert.

    The inbox's hot path: values go to the driver as they are (`insert_many`), so the shared ones are converted
    once per batch."""
    at = bound(conn, events.c.received_at, now)
    preempt = {flag: bound(conn, events.c.preempt, flag) for flag in (False, True)}
    pending = EventStatus.PENDING.value
    insert_many(conn, events, ("id", "user_id", "source", "source_id", "session_id", "corr_key", "kind", "trust",
                               "authority", "preempt", "payload", "status", "attempts", "received_at"),
                [(eid, d.user_id, d.source, d.source_id, sid, None, d.kind.value, d.trust, d.authority,
                  preempt[d.preempt], _payload(d.payload), pending, 0, at) for d, eid, sid in rows])


def _payload(payload: Any) -> str:
    return _PAYLOAD(payload)


_PAYLOAD = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode
"""Built once: `json.dumps` with any option builds an encoder per call (once per delivery here)."""


def _route(conn: Connection, d: Delivery, *, event_id: str, now: datetime) -> tuple[str, EventStatus]:
    if d.session_id is not None:
        return d.session_id, EventStatus.PENDING
    if d.corr_key is None:
        return triage.session_of(conn, user_id=d.user_id, now=now), EventStatus.PENDING
    # A wait this sender may not satisfy is not there for it: the delivery goes on as if no wait had matched.
    wait = conn.execute(
        select(waits.c.id, waits.c.session_id, waits.c.state).where(
            waits.c.user_id == d.user_id, waits.c.match_key == d.corr_key,
            waits.c.authority.in_(satisfiable_by(d.authority)),
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
    # A task's key leads to its session whoever the sender is: as information, never as an answer to a wait.
    task_session = keys.session_of(conn, user_id=d.user_id, key=d.corr_key)
    session_id = task_session or triage.session_of(conn, user_id=d.user_id, now=now)
    sessions.lock(conn, session_id)
    return session_id, EventStatus.PENDING


class GroupCommitter:
    """Commits deliveries in batches: one transaction and one fsync for many requests, each caller awaiting its own
    answer, given once the batch is durable.

    On SQLite the event loop writes the batches itself: every delivery that arrived in one turn of the loop is
    written at the end of that turn, and only the commit (the fsync) goes to a syncing thread, which answers the
    batch's callers once it returned; meanwhile the loop keeps accepting and answering, and the deliveries that arrive
    wait for the lock (joined by later ones) to make the next batch. Writing through a writer thread instead, every
    return from SQLite (several per batch) waited for the interpreter lock while the loop held it: the same SQL
    reached 3,900 deliveries/s at saturation that way, 5,300/s on the loop (`bench/ingest.py`, no runs); the commit
    is one return. The loop never waits for the write lock: while another thread holds it (or a batch syncs), the
    turn's deliveries wait until its release calls the loop back, and threads asking for the lock meanwhile let the
    loop go first; while another process holds it, the loop looks again every few ms. On PostgreSQL, where a commit
    is a network round trip, batches go to a writer thread; so does a batch that failed on the loop, to be retried
    delivery by delivery. A batch's answers go back to each event loop in ONE callback, and `received` counts
    committed deliveries, so that runs can tell when they are competing with the inbox (`server.worker`).

    The loop's commits never checkpoint SQLite's write-ahead log. SQLite would, in the committing thread, once the
    log holds 1,000 pages, and the next batch would wait for it: tens of ms about every second at 1,000 deliveries/s.
    A thread of its own does it instead, at most every `checkpoint_every` seconds after a commit (`db.checkpoint`:
    the loop waits only for what was written while the bulk was copied)."""

    BUSY_RETRY = 0.001
    """Seconds before the loop looks again at a database another process is writing to (a run's transaction in
    `wakeful worker`; asyncio's epoll wait rounds up to whole milliseconds). Every acknowledgement that met a run's
    transaction waited for the next look: at 2 ms the ack p99 at 1,000 deliveries/s was 8.3 ms, at 1 ms 6.9 ms (three
    runs each of `bench/ingest.py --tail`'s load, quiet machine, only this constant changed)."""
    HERE_RETRY = 0.05
    """Seconds before the loop looks again at a write lock a thread of this process holds (its release calls back
    first)."""

    def __init__(self, engine: Engine, clock: Clock, *, on_commit: Callable[[], None] = lambda: None,
                 max_batch: int = 512, coalesce: timedelta = _NOW, checkpoint_every: float = 0.5) -> None:
        """`coalesce`: how long an outside delivery waits for others to join its run (`due_at`)."""
        self._engine = engine
        self._coalesce = coalesce
        self._clock = clock
        self._on_commit = on_commit
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="inbox-committer", daemon=True)
        self._on_loop = engine.dialect.name == "sqlite"
        self._turns: dict[asyncio.AbstractEventLoop, list[_Pending]] = {}  # not yet committed, per loop
        self._loop_conn: Connection | None = None  # the loops' own connection, opened on first use
        self._syncer = _OneThread("inbox-sync")  # commits the loops' batches
        self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inbox-checkpoint")
        self._checkpoint_every = checkpoint_every
        self._checkpointed_at = time.monotonic()
        self._checkpointing: Future[None] | None = None
        self.batches = 0
        self.received = 0

    def start(self) -> None:
        self._thread.start()

    async def persist(self, delivery: Delivery) -> Recorded:
        """Record the delivery; returns once it is durable (or raises what its transaction raised)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Recorded] = loop.create_future()
        pending = _Pending(delivery=delivery, loop=loop, future=future)
        if not self._on_loop:
            self._queue.put(pending)
            return await future
        waiting = self._turns.get(loop)
        if waiting is None:
            waiting = self._turns[loop] = []
            loop.call_soon(self._commit_turn, loop)  # after the requests this turn of the loop is running
        waiting.append(pending)
        return await future

    def stop(self) -> None:
        self._syncer.shutdown()  # the batches syncing now are answered (or queued for the writer)
        self._checkpointer.shutdown(wait=True)
        self._queue.put(None)
        self._thread.join(timeout=30)
        if self._loop_conn is not None:
            self._loop_conn.close()

    def _commit_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: write what waits, unless the write lock is taken (then when it is released), and hand the
        commit to the syncing thread, which answers once it is durable."""
        waiting = self._turns.get(loop)
        if not waiting:  # a wake-up for deliveries already committed
            return
        batch = waiting[:self._max_batch]
        try:
            if self._loop_conn is None:
                self._loop_conn = connect_nowait(self._engine)
                sqlite_driver(self._loop_conn).execute("PRAGMA wal_autocheckpoint = 0")  # see `_checkpoint_soon`
            now = self._clock.now()
            opened = begin_unless_busy(self._loop_conn, loop,
                                       lambda: loop.call_soon_threadsafe(self._commit_turn, loop))
            if isinstance(opened, Busy):
                # A thread's release (a batch's sync, a run's commit) calls back, and the later look is only a
                # backstop (a thread that waited past its patience drops the loop's request); another process's
                # release does not call back: look again soon.
                loop.call_later(self.BUSY_RETRY if opened is Busy.ELSEWHERE else self.HERE_RETRY,
                                self._commit_turn, loop)
                return
            try:
                results = record_many(opened.conn, [p.delivery for p in batch], now=now, coalesce=self._coalesce)
            except BaseException:
                opened.rollback()
                raise
        except Exception:  # the writer thread retries them one by one, and refuses only a delivery that fails alone
            log.exception("inbox batch of %d failed on the event loop; the writer retries it", len(batch))
            for pending in batch:
                self._queue.put(pending)
        else:
            # The loop keeps accepting and answering while the disk syncs; the deliveries that arrive meanwhile wait
            # for the lock (the sync's end calls the loop back) and make the next batch.
            opened.hand_off()
            try:
                self._syncer.submit(partial(self._sync, opened, batch, results))
            except RuntimeError:  # stopping: the syncing thread is gone, the loop syncs this last batch itself
                self._sync(opened, batch, results)
        del waiting[:len(batch)]
        if waiting:
            loop.call_soon(self._commit_turn, loop)
        else:
            del self._turns[loop]

    def _sync(self, opened: OpenWrite, batch: list[_Pending], results: list[Recorded]) -> None:
        """On the syncing thread: commit a batch the loop wrote; answer its callers once it is durable."""
        try:
            opened.commit()
        except Exception:  # rolled back: the writer thread retries them one by one
            log.exception("inbox batch of %d failed to commit; the writer retries it", len(batch))
            for pending in batch:
                self._queue.put(pending)
            return
        self._committed(len(batch))
        self._settle(batch, results)
        self._checkpoint_soon()

    def _checkpoint_soon(self) -> None:
        """After a commit of the loop: a checkpoint on its own thread, unless one runs or ran lately."""
        if time.monotonic() - self._checkpointed_at < self._checkpoint_every:
            return
        if self._checkpointing is not None and not self._checkpointing.done():
            return
        self._checkpointed_at = time.monotonic()
        with contextlib.suppress(RuntimeError):  # stopping: the last connection to close checkpoints
            self._checkpointing = self._checkpointer.submit(self._checkpoint)

    def _checkpoint(self) -> None:
        try:
            checkpoint(self._engine)
        except Exception:  # the log grows until the next one (and the other connections checkpoint as they commit)
            log.exception("checkpointing the write-ahead log failed")

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
        self._settle(batch, answers)

    @staticmethod
    def _settle(batch: list[_Pending], answers: Sequence[Recorded | BaseException]) -> None:
        """Each answer to its caller's event loop: one callback per loop."""
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
            results = record_many(conn, deliveries, now=now, coalesce=self._coalesce)
        self._committed(len(deliveries))
        return results

    def _committed(self, count: int) -> None:
        faults.crash_point("after_event_commit")  # durable, not yet acknowledged
        self.batches += 1
        self.received += count
        self._on_commit()


class _OneThread:
    """Runs calls in turn on one thread of its own, started on first use: the inbox's syncing thread. (A
    ThreadPoolExecutor did the same with a future, a work item and an idle-semaphore check per call: ~15% of
    `_commit_turn` in a thread-time profile of the loop at batches of two.) After `shutdown`, `submit` raises
    RuntimeError, as the executor's did."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, call: Callable[[], None]) -> None:
        with self._guard:
            if self._closed:
                raise RuntimeError(f"{self._name} is shut down")
            if self._thread is None:
                # A daemon: were the process to end without `stop`, a batch not yet synced was not acknowledged either.
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._calls.put(call)

    def shutdown(self) -> None:
        """Returns once every call submitted before has returned."""
        with self._guard:
            self._closed = True
            thread, self._thread = self._thread, None
            self._calls.put(None)
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call()
            except Exception:  # the thread goes on with the next batch
                log.exception("%s: a call failed", self._name)


@dataclass(frozen=True, kw_only=True)
class _Pending:
    delivery: Delivery
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Recorded]


def _answer(settled: Sequence[tuple[asyncio.Future[Recorded], Recorded | BaseException]]) -> None:
    for future, answer in settled:
        if future.done():  # the request was cancelled (its client went away); the delivery is recorded anyway
            continue
        if isinstance(answer, BaseException):
            future.set_exception(answer)
        else:
            future.set_result(answer)
