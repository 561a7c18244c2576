"""The user's "don't book yet" racing an approval from another device: the pause wins whenever it committed first.

One world (the simulators on loopback, one SQLite file) per test, so a thousand interleavings stay fast. Each trial
proposes a hotel booking (a new action, with its own idempotency key) that awaits approval, then runs approve /
pause / dispatcher drain in an order drawn from a seeded `random.Random` (the seed is printed; set WAKEFUL_RACE_SEED
to replay one), and ends with the user resuming or closing the task. A task is reused by the next trial until a
trial closes it, so pause/resume cycles pile up on one task too; each trial books a quote of its own (booking one
quote again in the same task version would be the same operation, so the same action). Bookings are told apart in
the hotel's own records by their idempotency key.

The invariant: once a pause has committed, nothing more leaves for that task until it is resumed — no attempt row,
no effect at the hotel — and the hotel never holds more than one booking per action.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, and_, select

from tests.support.acting import World, world
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting import approvals
from wakeful.server.acting.actions import Action, load_action
from wakeful.server.core import control
from wakeful.server.core.worker import Binding
from wakeful.server.egress.dispatch import ActionDispatcher
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import (
    ControlKind,
    OutboxKind,
    OutboxState,
    TaskState,
    VerdictKind,
    attempts,
    outbox,
    verdicts,
)
from wakeful.server.store.tables import control as control_table

TRIALS = int(os.environ.get("WAKEFUL_RACE_TRIALS", "1000"))
THREADED_TRIALS = 250
TICK = timedelta(milliseconds=1)


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner) as w:
        yield w


def seeded(name: str) -> tuple[int, random.Random]:
    seed = int(os.environ.get("WAKEFUL_RACE_SEED") or random.SystemRandom().randrange(2**32))
    print(f"{name}: seed={seed} (replay with WAKEFUL_RACE_SEED={seed})")
    return seed, random.Random(seed)


@dataclass(frozen=True)
class Desk:
    """A task, reused until a trial closes it."""

    task: Binding


def open_desk(w: World, title: str) -> Desk:
    return Desk(task=w.task(title=title))


def propose_booking(w: World, desk: Desk) -> tuple[str, str]:
    """(action ID, its idempotency key) of a new booking of a fresh quote, awaiting the user's approval."""
    (quote,) = w.call(desk.task, "hotel__quote_stay", hotel="Grand", nights=2)["objects"]
    proposed = w.call(desk.task, "hotel__book_quote", quote_id=quote["id"])
    assert proposed["status"] == VerdictKind.NEEDS_APPROVAL
    with read(w.engine) as conn:
        key = load_action(conn, proposed["action_id"]).content["idempotency_key"]
    return proposed["action_id"], key


def bookings(w: World, key: str) -> int:
    """How many bookings the hotel itself applied under this action's idempotency key."""
    return sum(1 for e in w.hotel.effects if e["idempotency_key"] == key)


def attempt_rows(w: World, action_id: str) -> list[Any]:
    with read(w.engine) as conn:
        return conn.execute(select(attempts).where(attempts.c.action_id == action_id).order_by(attempts.c.seq)).all()


def pending_dispatches(w: World) -> int:
    with read(w.engine) as conn:
        return len(conn.execute(select(outbox.c.id).where(and_(outbox.c.kind == OutboxKind.DISPATCH.value,
                                                               outbox.c.state == OutboxState.PENDING.value))).all())


# -- 1000 sequential interleavings --------------------------------------------------------------------------------


@dataclass
class Model:
    """What must happen, by the rules: approval is admitted only while active; a drain sends only while active."""

    state: TaskState = TaskState.ACTIVE
    admitted: bool = False
    sent: bool = False
    approve_code: str | None = None

    def apply(self, op: str) -> None:
        if op == "approve":
            self.admitted = self.state is TaskState.ACTIVE
            self.approve_code = "admitted" if self.admitted else "paused"
        elif op == "drain":
            self.sent = self.sent or (self.admitted and self.state is TaskState.ACTIVE)
        else:
            self.state = {"pause": TaskState.PAUSED, "resume": TaskState.ACTIVE, "close": TaskState.CLOSED}[op]


def test_dont_book_yet_racing_an_approval_over_a_thousand_random_interleavings(w: World) -> None:
    seed, rng = seeded("sequential")
    sequence: list[str] = []  # the global order in which things committed, across every trial

    def check(ok: bool, trial: int, what: str) -> None:
        assert ok, f"seed={seed} trial={trial}: {what}\n" + "\n".join(sequence[-12:])

    desk: Desk | None = None
    booked_total = 0
    for trial in range(TRIALS):
        desk = desk or open_desk(w, f"book the hotel, from trial {trial}")
        task = desk.task
        act, key = propose_booking(w, desk)
        ops = ["approve", "pause", "drain"]
        rng.shuffle(ops)
        if rng.random() < 0.5:
            ops.insert(rng.randrange(len(ops) + 1), "drain")
        ops += [rng.choice(["resume", "close"]), "drain"]
        model = Model()
        frozen: tuple[int, int, int] | None = None  # (attempts, its bookings, all bookings) when the pause committed
        for op in ops:
            w.clock.advance(TICK)
            if op == "approve":
                with write(w.engine) as conn:
                    code = approvals.decide(conn, user_id=w.owner, action_id=act, approve=True, actor="user:phone",
                                            policy=w.policy, now=w.clock.now()).verdict.code
                result: Any = code
            elif op == "drain":
                result = w.dispatcher.drain()
            else:
                kind = {"pause": ControlKind.PAUSE, "resume": ControlKind.RESUME, "close": ControlKind.CLOSE}[op]
                with write(w.engine) as conn:
                    result = control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=kind,
                                                    actor="user:laptop", reason="don't book yet", now=w.clock.now())
            model.apply(op)
            if op == "drain" or op == "pause":  # only a drain sends anything, so it is counted around those
                sent, booked, everything = len(attempt_rows(w, act)), bookings(w, key), len(w.hotel.effects)
                check(sent <= 1 and booked <= 1, trial, "more than one attempt or booking for one action")
                frozen = (sent, booked, everything) if op == "pause" else frozen
                if frozen is not None:
                    check((sent, booked, everything) == frozen, trial, "something left after the pause committed")
                sequence.append(f"trial {trial}: {op} -> {result} (attempts={sent}, bookings={booked})")
            else:
                sequence.append(f"trial {trial}: {op} -> {result}")
            if op == "resume":
                frozen = None
            if op == "approve":
                check(result == model.approve_code, trial, f"approve answered {result}, expected "
                                                           f"{model.approve_code}")
        expected = int(model.sent)
        booked_total += expected
        check(bookings(w, key) == expected, trial, f"expected {expected} booking(s)")
        check([a.outcome for a in attempt_rows(w, act)] == ["accepted"] * expected, trial, "attempts")
        check(len(w.hotel.effects) == booked_total, trial, "a booking nobody accounted for")
        desk = None if model.state is TaskState.CLOSED else desk
    assert pending_dispatches(w) == 0  # every trial ended resumed-and-drained or closed-and-voided
    keys = [e["idempotency_key"] for e in w.hotel.effects]
    assert len(keys) == len(set(keys)) == booked_total  # at most one booking per action, ever


# -- a few hundred truly concurrent races ------------------------------------------------------------------------


@dataclass
class Ledger:
    """Commit order, taken while holding SQLite's write lock (every write transaction is BEGIN IMMEDIATE, so the
    bodies of two write transactions never overlap): a counter read inside a transaction orders its commit."""

    counter: Iterator[int] = field(default_factory=itertools.count)
    prepares: list[tuple[int, str, str | None]] = field(default_factory=list)  # (order, action, attempt or None)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> int:
        with self.lock:
            return next(self.counter)


class OrderedDispatcher(ActionDispatcher):
    """The real dispatcher; its re-check-and-persist step also notes its place in the commit order and stamps the
    attempt with a time taken under the write lock, so the attempt's created_at orders it against control rows."""

    def __init__(self, *args: Any, ledger: Ledger, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ledger = ledger

    def _prepare(self, conn: Connection, intent_id: str, action: Action,
                 now: datetime) -> str | tuple[str, dict[str, str]]:
        order = self.ledger.take()
        prepared = super()._prepare(conn, intent_id, action, self._clock.advance(TICK))
        self.ledger.prepares.append((order, action.id, None if isinstance(prepared, str) else prepared[0]))
        return prepared


def race(w: World, dispatcher: OrderedDispatcher, task: Binding, act: str, delays: dict[str, float]) -> dict[str, Any]:
    """Approve (phone) and pause (laptop) at once, while the dispatcher drains in a loop until the pause is in."""
    ledger = dispatcher.ledger
    barrier = threading.Barrier(3)
    paused = threading.Event()
    seen: dict[str, Any] = {}
    errors: list[BaseException] = []

    def approve() -> None:
        barrier.wait(timeout=10)
        time.sleep(delays["approve"])  # random jitter that varies the interleaving; no result waits on it
        with write(w.engine) as conn:
            order, now = ledger.take(), w.clock.advance(TICK)
            code = approvals.decide(conn, user_id=w.owner, action_id=act, approve=True, actor="user:phone",
                                    policy=w.policy, now=now).verdict.code
        seen["approve"] = (order, code)

    def pause() -> None:
        try:
            barrier.wait(timeout=10)
            time.sleep(delays["pause"])  # random jitter that varies the interleaving; no result waits on it
            with write(w.engine) as conn:
                order, now = ledger.take(), w.clock.advance(TICK)
                control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.PAUSE,
                                       actor="user:laptop", reason="don't book yet", now=now)
            seen["pause"] = order
        finally:
            paused.set()

    def drain() -> None:
        barrier.wait(timeout=10)
        drained = 0
        while not paused.is_set():  # bounded: the pause thread always sets it
            drained += dispatcher.drain()
        seen["drained"] = drained + dispatcher.drain()

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # handed to the main thread
                errors.append(exc)
                barrier.abort()
        return run

    threads = [threading.Thread(target=guarded(fn), name=f"race-{fn.__name__}") for fn in (approve, pause, drain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return seen


def test_dont_book_yet_and_an_approval_from_two_devices_at_once_never_release_a_paused_booking(w: World) -> None:
    seed, rng = seeded("threaded")
    dispatcher = OrderedDispatcher(w.engine, w.clock, policy=w.policy, timeout=2.0, ledger=Ledger(),
                                   resend_after=timedelta(seconds=10))
    outcomes: dict[str, int] = {"approve first": 0, "pause first": 0, "sent before the pause": 0,
                                "held by the pause": 0}
    desk: Desk | None = None
    booked_total = 0
    try:
        for trial in range(THREADED_TRIALS):
            desk = desk or open_desk(w, f"book the hotel, from race {trial}")
            task = desk.task
            act, key = propose_booking(w, desk)
            since = w.clock.now()
            delays = {op: rng.choice([0.0, 0.0, 0.0005, 0.001, 0.002]) for op in ("approve", "pause")}
            seen = race(w, dispatcher, task, act, delays)
            (approve_order, code), pause_order = seen["approve"], seen["pause"]
            prepared = [(o, a) for o, act_id, a in dispatcher.ledger.prepares if act_id == act]
            why = f"seed={seed} trial={trial} delays={delays} approve={seen['approve']} pause={pause_order} " \
                  f"prepares={prepared}"

            # The records' own order agrees with the commit order we observed.
            with read(w.engine) as conn:
                rows = conn.execute(select(control_table.c.kind, control_table.c.created_at).where(and_(
                    control_table.c.task_id == task.task_id, control_table.c.created_at > since))
                    .order_by(control_table.c.created_at)).all()
                verdict_rows = conn.execute(select(verdicts.c.verdict, verdicts.c.code).where(
                    verdicts.c.action_id == act).order_by(verdicts.c.created_at)).all()
            stamped = {r.kind: r.created_at for r in rows}
            assert [r.kind for r in rows] == (["approve", "pause"] if approve_order < pause_order
                                              else ["pause", "approve"]), why
            assert code == ("admitted" if approve_order < pause_order else "paused"), why
            assert [tuple(v) for v in verdict_rows][-1] == (
                (VerdictKind.ADMITTED, "admitted") if approve_order < pause_order
                else (VerdictKind.REFUSED, "paused")), why

            # The invariant: an attempt exists only if it was persisted after the approval and before the pause,
            # by the DB's own timestamps; otherwise nothing was sent.
            sent = attempt_rows(w, act)
            assert len(sent) <= 1 and bookings(w, key) == len(sent), why
            assert len(w.hotel.effects) == booked_total + len(sent), why
            for attempt in sent:
                assert stamped["approve"] < attempt.created_at < stamped["pause"], why
                assert any(a == attempt.id and approve_order < o < pause_order for o, a in prepared), why
            for order, attempt_id in prepared:
                if order > pause_order:
                    assert attempt_id is None, why  # the pause had committed: nothing was released
            outcomes["approve first" if approve_order < pause_order else "pause first"] += 1
            outcomes["sent before the pause"] += len(sent)
            outcomes["held by the pause"] += sum(1 for order, _ in prepared if order > pause_order)

            # The task is paused now: however often the dispatcher runs, nothing more leaves.
            w.clock.advance(TICK)
            dispatcher.drain()
            assert len(attempt_rows(w, act)) == len(sent) and len(w.hotel.effects) == booked_total + len(sent), why

            # Then the user decides: resume releases exactly an admitted, unsent booking; close voids it.
            kind = rng.choice([ControlKind.RESUME, ControlKind.CLOSE])
            w.clock.advance(TICK)
            with write(w.engine) as conn:
                control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=kind, actor="user:laptop",
                                       reason="decided", now=w.clock.now())
            w.clock.advance(TICK)
            dispatcher.drain()
            expected = 1 if sent or (kind is ControlKind.RESUME and approve_order < pause_order) else 0
            assert bookings(w, key) == expected, f"{why} then {kind.value}"
            assert len(attempt_rows(w, act)) == expected, f"{why} then {kind.value}"
            booked_total += expected
            assert len(w.hotel.effects) == booked_total, f"{why} then {kind.value}"
            desk = None if kind is ControlKind.CLOSE else desk
    finally:
        dispatcher.close()
    print(f"threaded: {outcomes}")
    assert pending_dispatches(w) == 0
    keys = [e["idempotency_key"] for e in w.hotel.effects]
    assert len(keys) == len(set(keys)) == booked_total
