"""Unknown ≠ not happened, proven against a real `wakeful serve` killed in the middle of dispatching an action.

Two crash points in `server/dispatch.py` (armed with `WAKEFUL_CRASH_AT=<point>:1`, the process calls `os._exit(77)`):

    after_attempt_persisted   the attempt (request, idempotency key) is committed; the request never left
    after_send                the merchant applied the cancellation and answered; the outcome is not recorded

Each trial cancels a fresh subscription at the merchant simulator (in this process, on loopback): the test process
creates the task and the `cancel_renewal` action through the real tool layer on the server's own database, the
user approves it over the server's HTTP control API, the armed server dies at the point, and an unarmed server
recovers. Every armed-server test runs twice: on the data directory's SQLite file and on a PostgreSQL database.
The pass bar, read from the merchant's own records and the server's database:

    exactly one `cancel_renewal` effect for that subscription, and no more after further reconcile rounds;
    the attempt that was open at the crash is recorded `unknown` (it is reconciled, never silently retried);
    a later attempt exists only when reconciliation said "not found", and it reuses the same idempotency key.

Replay with `WAKEFUL_FAULT_SEED=<seed>` (printed with each summary): it fixes which subscriptions are cancelled and
the reason sent with them.

The kill-before-send trials wait `resend_after` (set to 2 s for the server under test) after the first attempt was
persisted. The regression tests at the end pin bugs once found on the recovery path; those that need no process to
die run in-process on the simulators, with a fake clock.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, and_, select

from tests.support.acting import World, world
from tests.support.dispatch_world import CANCEL_VERIFIED, DispatchWorld, Proposed, dispatch_world, holds_for
from tests.support.polling import wait_until
from tests.support.postgres import postgres_database
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting import ledger
from wakeful.server.core import control
from wakeful.server.core.faults import POINTS
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, attempts, evidence

pytestmark = pytest.mark.faults

SEED = int(os.environ.get("WAKEFUL_FAULT_SEED") or random.SystemRandom().randrange(1 << 32))

TRIALS = {"after_attempt_persisted": 5, "after_send": 5}
# On PostgreSQL each point's path is the same one (the crash is certain, p = 1) and a trial is two server starts:
# fewer of them keep the file's time bounded (figures in the commit that set them).
PG_TRIALS = {"after_attempt_persisted": 3, "after_send": 3}
DEDUPE_OFF_TRIALS = 2
RECONCILE_INTERVAL = 0.2
RESEND_AFTER = timedelta(seconds=10)  # the in-process world's dispatcher (tests/support/acting.py)
SERVE_RESEND_AFTER = timedelta(seconds=2)  # WAKEFUL_RESEND_AFTER for the server under test (dispatch_world.py)
SETTLE_TIMEOUT = 40.0  # the kill-before-send path needs RESEND_AFTER from the first attempt, plus a restart
RECEIPT_TIMEOUT = 15.0
QUIET_ROUNDS = 6  # reconcile intervals watched after settling: nothing more may happen
OPEN_DETAIL = "the dispatcher stopped after persisting the attempt"


@dataclass
class Trial:
    point: str
    proposed: Proposed
    approve_reply_lost: bool
    seconds_down_to_settled: float = 0.0  # from the death to settled (the restart included)
    seconds_up_to_settled: float = 0.0  # from the unarmed server answering /healthz to settled
    settled_by: str = ""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    reconcile_misses: int = 0  # reconcile rounds that did not find the effect


# -- one trial ----------------------------------------------------------------------------------------------------


def crash_and_recover(w: DispatchWorld, point: str, subscription: str, rng: random.Random) -> Trial:
    """The server is running armed at `point`. Approve a fresh cancellation, see the process die there, restart it
    unarmed and wait until the action is settled; the server is left running unarmed."""
    proposed = w.propose_cancel(subscription, reason=rng.choice([None, "keep this month"]),
                                completion=CANCEL_VERIFIED)
    reply = w.approve(proposed.action_id)
    w.wait_crash(point)
    died = time.monotonic()
    trial = Trial(point, proposed, approve_reply_lost=reply is None)

    # The moment of death, as the records show it.
    (open_attempt,) = w.attempts(proposed.action_id)
    assert open_attempt["outcome"] is None, f"the attempt open at the crash already has an outcome: {open_attempt}"
    assert open_attempt["request"]["idempotency_key"] == proposed.idempotency_key
    effects = w.merchant.effects_of("cancel_renewal", subscription)
    if point == "after_attempt_persisted":
        assert effects == [], f"the request left before the crash point that precedes the send: {effects}"
    else:
        assert [e["idempotency_key"] for e in effects] == [proposed.idempotency_key], (
            f"after_send: the merchant should hold exactly the one effect the dead process caused: {effects}")

    server = w.start()
    up = time.monotonic()
    trial.settled_by = str(wait_until(
        lambda: w.settled(proposed.action_id), SETTLE_TIMEOUT,
        f"{proposed.action_id} ({point}, {subscription}) to be settled after the restart; log:\n{server.log()}"))
    now = time.monotonic()
    trial.seconds_down_to_settled, trial.seconds_up_to_settled = now - died, now - up
    trial.attempts = w.attempts(proposed.action_id)
    trial.reconcile_misses = sum(e["verdict"] != "accepted" for e in w.evidence(proposed.action_id, "reconcile"))
    return trial


def assert_exactly_one_effect(w: DispatchWorld, trial: Trial, *, resend_expected: bool) -> None:
    p = trial.proposed
    first, *later = trial.attempts
    # The attempt open at the crash: unknown, never silently retried or assumed failed.
    assert first["outcome"] == "unknown" and first["detail"].startswith(OPEN_DETAIL), first
    assert first["status_code"] is None and first["outcome_at"] is not None
    if resend_expected:
        # Reconciliation said "not found", RESEND_AFTER passed: the same request, with the same key, went once more.
        (resend,) = later
        assert resend["seq"] == 2 and resend["outcome"] == "accepted" and resend["status_code"] == 200, resend
        assert resend["request"] == first["request"], "the resend must be the same request"
        assert resend["request"]["headers"]["Idempotency-Key"] == p.idempotency_key
        assert resend["created_at"] - first["created_at"] >= SERVE_RESEND_AFTER, (first["created_at"],
                                                                            resend["created_at"])
        assert trial.reconcile_misses >= 1, "a resend without reconciliation having looked first"
    else:
        assert later == [], f"resent although the effect had happened: {later}"
        assert trial.settled_by == "reconcile" and trial.reconcile_misses == 0, (trial.settled_by,
                                                                                  trial.reconcile_misses)
    effects = w.merchant.effects_of("cancel_renewal", p.subscription)
    assert [e["idempotency_key"] for e in effects] == [p.idempotency_key], (
        f"{p.subscription}: {len(effects)} cancel_renewal effects, exactly one was expected: {effects}")
    assert (w.merchant.subscription(p.subscription) or {}).get("renewal") == "off"
    wait = w.reconcile_wait(p.action_id)
    assert wait is not None and wait["state"] == "satisfied", wait
    intents = w.dispatch_intents(p.action_id)
    assert [i["state"] for i in intents] == ["sent"] * (1 + resend_expected), intents


def assert_nothing_more_happens(w: DispatchWorld, trial: Trial, total_effects: int) -> None:
    """Further reconcile rounds: no new attempt, no pending intent, no new effect anywhere at the merchant."""
    action_id = trial.proposed.action_id
    seen = len(trial.attempts)

    def violation() -> object:
        attempts = w.attempts(action_id)
        if len(attempts) != seen:
            return f"a new attempt: {attempts[seen:]}"
        pending = [i["id"] for i in w.dispatch_intents(action_id) if i["state"] == "pending"]
        if pending:
            return f"a pending dispatch intent: {pending}"
        effects = w.merchant.effects_of("cancel_renewal")
        return f"a new merchant effect: {effects[total_effects:]}" if len(effects) != total_effects else None

    holds_for(violation, QUIET_ROUNDS * RECONCILE_INTERVAL, f"{action_id} to stay settled")


def assert_user_told_the_truth(w: DispatchWorld, trial: Trial) -> None:
    """Verified by a fresh read, the task gets its receipt; no "cannot confirm" message is ever sent."""
    p = trial.proposed

    def receipt() -> dict[str, Any] | None:
        return next((m for m in w.messages(p.session_id) if m.get("kind") == "receipt"), None)

    message = wait_until(receipt, RECEIPT_TIMEOUT, f"the receipt for {p.task_id}")
    assert message is not None
    assert [proof["action_id"] for proof in message["proof"]] == [p.action_id], message
    kinds = [m.get("kind") for m in w.messages(p.session_id)]
    assert "outcome_unknown" not in kinds and "action_voided" not in kinds, kinds


# -- a campaign per crash point -----------------------------------------------------------------------------------


def recovery_path(entries: list[dict[str, Any]], action_id: str) -> str:
    """The action's dispatch history from `wakeful ledger export`, repeated steps folded: `a → b ×n → c`."""
    steps: list[str] = []
    for e in entries:
        if e.get("action_id") != action_id and not str(e.get("id", "")).startswith(f"dsp_{action_id}"):
            continue
        step = {"attempt": lambda e: f"attempt#{e['seq']}",
                "outcome": lambda e: f"outcome {e['outcome']}",
                "evidence": lambda e: f"{e['source']} {e['verdict']}",
                "dispatch_intent": lambda e: f"intent {e['id'].removeprefix('dsp_' + action_id) or '(approval)'}",
                }.get(e["type"], lambda e: "")(e)
        if step:
            steps.append(step)
    folded: list[tuple[str, int]] = []
    for step in steps:
        if folded and folded[-1][0] == step:
            folded[-1] = (step, folded[-1][1] + 1)
        else:
            folded.append((step, 1))
    return " → ".join(s if n == 1 else f"{s} ×{n}" for s, n in folded)


def run_campaign(point: str, w: DispatchWorld, trials: int, rng: random.Random,
                 check: Callable[[Trial], None]) -> list[Trial]:
    free = sorted(f"sub_{i}" for i in range(trials))
    rng.shuffle(free)
    done: list[Trial] = []
    w.start(crash_at=f"{point}:1")
    for _ in range(trials):
        trial = crash_and_recover(w, point, free.pop(), rng)
        check(trial)
        assert_nothing_more_happens(w, trial, total_effects=len(done) + 1)
        assert_user_told_the_truth(w, trial)
        done.append(trial)
        log = w.stop()
        assert "Traceback" not in log, f"the recovering server logged a traceback:\n{log}"
        if len(done) < trials:
            w.start(crash_at=f"{point}:1")
    # Everything, once more: one effect per trial, each under its action's key.
    effects = w.merchant.effects_of("cancel_renewal")
    assert sorted(e["idempotency_key"] for e in effects) == sorted(t.proposed.idempotency_key for t in done)
    return done


def summarise(label: str, w: DispatchWorld, trials: list[Trial]) -> None:
    entries = w.ledger_export()
    for t in trials:  # the ledger the operator sees agrees with the tables
        kinds = [e["type"] for e in entries if e.get("action_id") == t.proposed.action_id]
        assert kinds.count("attempt") == len(t.attempts), kinds
    down = [t.seconds_down_to_settled for t in trials]
    up = [t.seconds_up_to_settled for t in trials]
    print(f"\n[dispatch-faults] {label}: {len(trials)} trials, {len(trials)} crashes, {w.starts} server starts, "
          f"time to settle after the death {min(down):.1f}/{statistics.median(down):.1f}/{max(down):.1f} s "
          f"(min/median/max; after the restart answered: median {statistics.median(up):.1f} s), "
          f"resends {sum(len(t.attempts) - 1 for t in trials)}, reconcile misses before settling "
          f"{[t.reconcile_misses for t in trials]}, settled by {sorted({t.settled_by for t in trials})}, "
          f"approve replies lost to the crash {sum(t.approve_reply_lost for t in trials)}, "
          f"merchant effects {len(w.merchant.effects_of('cancel_renewal'))}, seed {SEED}")
    print(f"[dispatch-faults] {label}: recovery path of {trials[-1].proposed.action_id} from `wakeful ledger "
          f"export`: {recovery_path(entries, trials[-1].proposed.action_id)}")


def trials_at(w: DispatchWorld, point: str) -> int:
    return (TRIALS if w.database_url is None else PG_TRIALS)[point]


@pytest.fixture(params=["sqlite", "postgresql"])
def dw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DispatchWorld]:
    """The armed server's world, on the data directory's SQLite file or on a PostgreSQL database of its own."""
    database_url = (postgres_database(request.getfixturevalue("postgres_server"))
                    if request.param == "postgresql" else None)
    with dispatch_world(tmp_path, subscriptions=max(TRIALS.values()) + DEDUPE_OFF_TRIALS,
                        reconcile_interval=RECONCILE_INTERVAL, database_url=database_url) as w:
        yield w


def test_a_crash_before_the_send_is_reconciled_then_resent_once_with_the_same_key(dw: DispatchWorld) -> None:
    point = "after_attempt_persisted"
    assert point in POINTS
    rng = random.Random(f"{SEED}:{point}")
    trials = run_campaign(point, dw, trials_at(dw, point), rng,
                          lambda t: assert_exactly_one_effect(dw, t, resend_expected=True))
    summarise(point, dw, trials)


def test_a_crash_after_the_send_is_reconciled_and_never_resent(dw: DispatchWorld) -> None:
    point = "after_send"
    assert point in POINTS
    rng = random.Random(f"{SEED}:{point}")
    trials = run_campaign(point, dw, trials_at(dw, point), rng,
                          lambda t: assert_exactly_one_effect(dw, t, resend_expected=False))
    summarise(point, dw, trials)


def test_a_crash_after_the_send_is_one_effect_even_when_the_merchant_does_not_deduplicate(
        dw: DispatchWorld) -> None:
    """Without the merchant's idempotency store a resend would be a second cancellation: only reconciliation,
    finding the first one by its key, keeps it at one."""
    point = "after_send"
    rng = random.Random(f"{SEED}:{point}:dedupe-off")
    reply = httpx.post(f"{dw.merchant_url}/_sim/faults", json={"dedupe": False}, timeout=10.0)
    assert reply.status_code == 200 and reply.json()["dedupe"] is False, reply.text
    trials = run_campaign(point, dw, DEDUPE_OFF_TRIALS, rng,
                          lambda t: assert_exactly_one_effect(dw, t, resend_expected=False))
    summarise(f"{point}, merchant dedupe off", dw, trials)


# -- the resend path when the resend cannot go at once ------------------------------------------------------------


@pytest.fixture
def world_in_process(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner) as w:
        yield w


def test_a_held_resend_does_not_break_the_reconciler(world_in_process: World) -> None:
    w = world_in_process
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action_id = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    w.approve(action_id)
    # The state a crash at after_attempt_persisted leaves behind: an attempt that never left, its outcome unknown.
    # (In-process, a 503 that applied nothing gives the same records without killing the test process.)
    w.merchant.faults.update({"fail_before_commit": 1})
    assert w.dispatcher.drain() == 1
    assert w.merchant.effects == []
    with write(w.engine) as conn:
        control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.PAUSE,
                               actor="user:test", reason="hold everything", now=w.clock.now())
    w.clock.advance(RESEND_AFTER + timedelta(seconds=1))
    assert w.dispatcher.reconcile_due() == 1  # not found: the resend is enqueued …
    assert w.dispatcher.drain() == 0  # … and held, because the task is paused
    w.clock.advance(timedelta(seconds=5))  # the second read is due at most the first delay (5 s) after the first
    assert w.dispatcher.reconcile_due() == 1  # the next round must not fail
    assert w.merchant.effects == []


def test_a_refused_resend_is_not_sent_again_and_again(world_in_process: World) -> None:
    w = world_in_process
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action_id = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    w.approve(action_id)
    # The outcome is unknown (as after a crash after the send), and nothing of ours was applied …
    w.merchant.faults.update({"fail_before_commit": 1})
    assert w.dispatcher.drain() == 1
    # … while the user stopped the renewal themselves on the merchant's site: our request can only be refused now.
    assert w.merchant.cancel_renewal("sub_1", "the-users-own-click", None).status == 200
    for _ in range(3):
        w.clock.advance(RESEND_AFTER + timedelta(seconds=1))
        w.dispatcher.reconcile_due()
        w.dispatcher.drain()
    with read(w.engine) as conn:
        outcomes = [r.outcome for r in conn.execute(select(attempts).where(attempts.c.action_id == action_id)
                                                   .order_by(attempts.c.seq))]
    assert outcomes[:2] == ["unknown", "blocked"], outcomes  # the one resend reconciliation allowed, refused: 409
    assert len(outcomes) == 2, f"the refused request was sent again: {outcomes}"


@pytest.mark.parametrize("change", ["revoke", "steer"])
def test_a_task_changed_while_the_server_was_down_after_the_send_is_still_reconciled(dw: DispatchWorld,
                                                                                     change: str) -> None:
    dw.start(crash_at="after_send:1")
    p = dw.propose_cancel("sub_0")
    dw.approve(p.action_id)
    dw.wait_crash("after_send")
    assert len(dw.merchant.effects_of("cancel_renewal", "sub_0")) == 1
    with write(dw.engine) as conn:  # the user, through the CLI, while the server is down
        if change == "revoke":
            control.set_task_state(conn, user_id=dw.owner, task_id=p.task_id, kind=ControlKind.REVOKE,
                                   actor="cli:owner", reason="never mind", now=dw.clock.now())
        else:
            control.steer(conn, user_id=dw.owner, task_id=p.task_id, goal="keep it after all", actor="cli:owner",
                          now=dw.clock.now())
    server = dw.start()
    wait_until(lambda: all(i["state"] != "pending" for i in dw.dispatch_intents(p.action_id)), 15.0,
               f"the restarted server to take up the dispatch intent of {p.action_id}; log:\n{server.log()}")
    (attempt,) = dw.attempts(p.action_id)
    told = [m["text"] for m in dw.messages(p.session_id) if m.get("kind") == "action_voided"]
    assert attempt["outcome"] is not None and not told, (
        f"the request was sent and applied, yet the attempt is {attempt['outcome']!r} and the user was told {told}")
    wait_until(lambda: dw.accepted(p.action_id) == "reconcile", SETTLE_TIMEOUT, "reconciliation to find the effect")


def test_revoking_a_task_does_not_abandon_the_reconciliation_of_a_sent_request(engine: Engine, clock: FakeClock,
                                                                               owner: str) -> None:
    with world(engine, clock, owner, client_timeout=0.3) as w:
        # The merchant applies the cancellation and the reply is lost: the same records as a crash after the send.
        w.merchant.faults.update({"commit_then_timeout": 1, "stall_seconds": 2.0})
        task = w.task()
        (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
        action_id = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
        w.approve(action_id)
        assert w.dispatcher.drain() == 1
        assert len(w.merchant.effects) == 1
        with write(w.engine) as conn:  # revoked before the first reconcile round: "effects already sent stand"
            control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.REVOKE,
                                   actor="user:test", reason="never mind", now=w.clock.now())
        # A read that times out on a loaded machine is recorded as unanswered and leaves the wait for the next read,
        # which is what the reconciler does in service; a few reads make the test independent of the load.
        found: list[str] = []
        for _ in range(5):
            assert w.dispatcher.reconcile_due() == 1, "the sent request's unknown outcome is no longer reconciled"
            with read(w.engine) as conn:
                found = list(conn.execute(select(evidence.c.verdict).where(and_(
                    evidence.c.action_id == action_id, evidence.c.source == "reconcile"))
                    .order_by(evidence.c.checked_at)).scalars())
            if "accepted" in found:
                break
            w.clock.advance(timedelta(minutes=1))  # reads are paced: the next one is due within the minute
        assert found[-1:] == ["accepted"] and set(found[:-1]) <= {"unknown"}, found


def test_the_ledger_shows_the_resend_intent_reconciliation_created(world_in_process: World) -> None:
    w = world_in_process
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    action_id = w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]
    w.approve(action_id)
    w.merchant.faults.update({"fail_before_commit": 1})  # unknown, and nothing applied: as a kill before the send
    w.dispatcher.drain()
    w.clock.advance(RESEND_AFTER + timedelta(seconds=1))
    w.dispatcher.reconcile_due()
    w.dispatcher.drain()
    assert len(w.merchant.effects) == 1
    with read(w.engine) as conn:
        entries = ledger.entries(conn, task_id=task.task_id, user_id=w.owner)
    intents = [e["id"] for e in entries if e["type"] == "dispatch_intent"]
    assert intents == [f"dsp_{action_id}", f"dsp_{action_id}_2"], intents
