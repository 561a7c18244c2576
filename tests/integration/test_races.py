""""Don't book yet" racing an approval from another device: the pause wins whenever it committed first.

One world (the simulators on loopback, one SQLite file) per test and a fresh task per trial, so a thousand
interleavings stay fast. Each trial books a hotel quote that is awaiting approval, then runs approve / pause /
dispatcher drain in an order drawn from a seeded `random.Random` (the seed is printed; set WAKEFUL_RACE_SEED to
replay one), and checks the hotel's own records after every step.

The invariant: once a pause has committed, nothing more leaves for that task until it is resumed — no attempt row,
no effect at the hotel — and the hotel never holds more than one booking per action.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, and_, select

from server import approvals, control
from server.actions import Action, load_action
from server.clock import FakeClock
from server.db import read, write
from server.dispatch import ActionDispatcher
from server.tables import ControlKind, OutboxKind, OutboxState, TaskState, VerdictKind, attempts, outbox, verdicts
from server.tables import control as control_table
from server.tools import Binding
from tests.support.acting import World, world

TRIALS = 1000
THREADED_TRIALS = 300
TICK = timedelta(milliseconds=1)


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner) as w:
        yield w


def seeded(name: str) -> tuple[int, random.Random]:
    seed = int(os.environ.get("WAKEFUL_RACE_SEED") or random.SystemRandom().randrange(2**32))
    print(f"{name}: seed={seed} (replay with WAKEFUL_RACE_SEED={seed})")
    return seed, random.Random(seed)


def propose_booking(w: World, task: Binding) -> tuple[str, str]:
    """(action ID, the hotel's quote ID) of a booking awaiting the user's approval."""
    (quote,) = w.call(task, "hotel__quote_stay", hotel="Grand", nights=2)["objects"]
    proposed = w.call(task, "hotel__book_quote", quote_id=quote["id"])
    assert proposed["status"] == VerdictKind.NEEDS_APPROVAL
    with read(w.engine) as conn:
        ref = load_action(conn, proposed["action_id"]).content["refs"]["quote_id"]
    return proposed["action_id"], ref


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

    import time as _t
    _t0 = _t.perf_counter()
    for trial in range(TRIALS):
        if trial % 100 == 0:
            print("T", trial, round(_t.perf_counter() - _t0, 2))
        task = w.task(title=f"book the hotel, trial {trial}")
        act, quote = propose_booking(w, task)
        ops = ["approve", "pause", "drain"]
        rng.shuffle(ops)
        if rng.random() < 0.5:
            ops.insert(rng.randrange(len(ops) + 1), "drain")
        ops += [rng.choice(["resume", "close"]), "drain"]
        model = Model()
        frozen: tuple[int, int] | None = None  # (attempts, bookings) when the pause committed
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
            sent, booked = len(attempt_rows(w, act)), len(w.hotel.effects_of("booking", quote))
            sequence.append(f"trial {trial}: {op} -> {result} (attempts={sent}, bookings={booked})")
            check(sent <= 1 and booked <= 1, trial, "more than one attempt or booking for one action")
            if op == "pause":
                frozen = (sent, booked)
            elif op == "resume":
                frozen = None
            if frozen is not None:
                check((sent, booked) == frozen, trial, "something left after the pause committed")
            if op == "approve":
                check(result == model.approve_code, trial, f"approve answered {result}, expected "
                                                           f"{model.approve_code}")
        expected = int(model.sent)
        check(len(w.hotel.effects_of("booking", quote)) == expected, trial, f"expected {expected} booking(s)")
        check([a.outcome for a in attempt_rows(w, act)] == ["accepted"] * expected, trial, "attempts")
    assert pending_dispatches(w) == 0  # every trial ended resumed-and-drained or closed-and-voided
    assert len(w.hotel.effects) == len({e["target"] for e in w.hotel.effects})  # one booking per quote, ever


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

    def _prepare(self, conn: Connection, intent_id: str, action: Action, now: datetime) -> str | None:
        order = self.ledger.take()
        attempt = super()._prepare(conn, intent_id, action, self._clock.advance(TICK))
        self.ledger.prepares.append((order, action.id, attempt))
        return attempt


def test_dont_book_yet_and_an_approval_from_two_devices_at_once_never_release_a_paused_booking(w: World) -> None:
    seed, rng = seeded("threaded")
    ledger = Ledger()
    dispatcher = OrderedDispatcher(w.engine, w.clock, policy=w.policy, timeout=2.0, ledger=ledger,
                                   resend_after=timedelta(seconds=10))
    outcomes: dict[str, int] = {"approve first": 0, "pause first": 0, "sent before the pause": 0}
    try:
        for trial in range(THREADED_TRIALS):
            task = w.task(title=f"book the hotel, race {trial}")
            act, quote = propose_booking(w, task)
            racers = ["approve", "pause"] + (["drain"] if rng.random() < 0.75 else [])
            barrier = threading.Barrier(len(racers))
            seen: dict[str, Any] = {}
            errors: list[BaseException] = []

            def run(op: str, task: Binding = task, act: str = act, barrier: threading.Barrier = barrier,
                    seen: dict[str, Any] = seen, errors: list[BaseException] = errors) -> None:
                try:
                    barrier.wait(timeout=10)
                    if op == "drain":
                        seen["drain"] = dispatcher.drain()
                        return
                    with write(w.engine) as conn:
                        order, now = ledger.take(), w.clock.advance(TICK)
                        if op == "approve":
                            seen["approve"] = (order, approvals.decide(
                                conn, user_id=w.owner, action_id=act, approve=True, actor="user:phone",
                                policy=w.policy, now=now).verdict.code)
                        else:
                            control.set_task_state(conn, user_id=w.owner, task_id=task.task_id,
                                                   kind=ControlKind.PAUSE, actor="user:laptop",
                                                   reason="don't book yet", now=now)
                            seen["pause"] = order
                except BaseException as exc:  # re-raised on the main thread below
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(op,), name=f"race-{op}") for op in racers]
            rng.shuffle(threads)
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            assert not errors, f"seed={seed} trial={trial}: {errors!r}"
            (approve_order, code), pause_order = seen["approve"], seen["pause"]
            prepared = [(o, a) for o, act_id, a in ledger.prepares if act_id == act]
            why = f"seed={seed} trial={trial} racers={racers} approve={seen['approve']} pause={pause_order} " \
                  f"prepares={prepared}"

            # The records' own order agrees with the commit order we observed.
            with read(w.engine) as conn:
                rows = conn.execute(select(control_table.c.kind, control_table.c.created_at).where(
                    control_table.c.task_id == task.task_id).order_by(control_table.c.created_at)).all()
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
            booked = w.hotel.effects_of("booking", quote)
            assert len(sent) <= 1 and len(booked) == len(sent), why
            for attempt in sent:
                assert stamped["approve"] < attempt.created_at < stamped["pause"], why
                assert any(a == attempt.id and approve_order < o < pause_order for o, a in prepared), why
            for order, attempt_id in prepared:
                if order > pause_order:
                    assert attempt_id is None, why  # the pause had committed: nothing was released
            outcomes["approve first" if approve_order < pause_order else "pause first"] += 1
            outcomes["sent before the pause"] += len(sent)

            # The task is paused now: however often the dispatcher runs, nothing more leaves.
            w.clock.advance(TICK)
            dispatcher.drain()
            assert len(attempt_rows(w, act)) == len(sent) and len(w.hotel.effects_of("booking", quote)) == len(sent)

            # Then the user decides: resume releases exactly an admitted, unsent booking; close voids it.
            kind = rng.choice([ControlKind.RESUME, ControlKind.CLOSE])
            w.clock.advance(TICK)
            with write(w.engine) as conn:
                control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=kind, actor="user:laptop",
                                       reason="decided", now=w.clock.now())
            w.clock.advance(TICK)
            dispatcher.drain()
            expected = 1 if sent or (kind is ControlKind.RESUME and approve_order < pause_order) else 0
            assert len(w.hotel.effects_of("booking", quote)) == expected, f"{why} then {kind.value}"
            assert len(attempt_rows(w, act)) == expected, f"{why} then {kind.value}"
    finally:
        dispatcher.close()
    print(f"threaded: {outcomes}")
    assert pending_dispatches(w) == 0
    assert len(w.hotel.effects) == len({e["target"] for e in w.hotel.effects})
