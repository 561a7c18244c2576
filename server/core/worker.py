"""The worker: claim a session, hand its pending events to the run handler, commit the outcome under the token.

One wake, end to end:
    look                which sessions have work due, whose users are not stopped or over budget (a read)
    claim (lease + new fencing token; poison events failed; attempts counted)   ── one transaction
    handler(ctx)        effects are buffered; ctx.step() checks the token, STOP, preemption and budgets (a read)
                        and renews the lease once a tenth of it has run down
    commit              release(token) first (it fences), then outbox rows, waits, timers, the holds of the user's
                        messages it read and did not confirm as pauses (`core.holds`), events → processed,
                        run → ended                                               ── one transaction
A run that is interrupted (STOP, pause, the user's message) or fails commits none of its effects: its events stay
pending for the next run, and a hold stays. A run that exhausts its budget commits what it did and tells the user.
A session's pending events go to its one next run: deliveries that arrived together are one run (the inbox makes an
outside delivery due a short window after it arrived, so those that follow it join it). A run takes at most
`run_max_events` outside deliveries, the oldest first, and every preempting one (the user's messages, control); what
it leaves is its session's next run, due behind the work other sessions already had due.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, Insert, and_, bindparam, false, select, true, union_all, update

from wakeful.proxy.clock import Clock
from wakeful.server.core import agenda, control, faults, helper_tasks, holds, outbox, sessions, timers, waits
from wakeful.server.core.authority import of_source
from wakeful.server.core.schedule import Misfire, Recurrence
from wakeful.server.core.speaking import Level, Urgency
from wakeful.server.errors import Refused, StaleToken
from wakeful.server.observe import metrics
from wakeful.server.settings import Settings
from wakeful.server.store import users
from wakeful.server.store.db import read, upsert, write, write_lock_time
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import Authority, EventStatus, OnTimeout, RunOutcome, events, runs, usage_daily
from wakeful.server.store.tables import decisions as decisions_table
from wakeful.server.store.tables import sessions as sessions_table

__all__ = ["Binding", "EventView", "IdlePoll", "InboxRate", "RunContext", "RunHandler", "RunInterrupted", "Tools",
           "Worker", "rest_after_run"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EventView:
    """What a run sees of an event. `payload` is data from `source` at `trust`, never an instruction."""

    id: str
    source: str
    source_id: str
    kind: str
    trust: str
    corr_key: str | None
    payload: Any
    received_at: datetime


class IdlePoll:
    """Fallback polling that slows down while nothing is found (doubling up to `ceiling`) and is woken at once by
    in-process work; finding work resets it."""

    def __init__(self, floor: float, ceiling: float) -> None:
        self._floor, self._ceiling = floor, max(floor, ceiling)
        self._delay = floor

    def wait(self, wakeup: threading.Event, at_most: float | None = None) -> None:
        delay = self._delay if at_most is None else min(self._delay, at_most)
        if wakeup.wait(delay):
            self.reset()
        else:
            self._delay = min(self._delay * 2, self._ceiling)
        wakeup.clear()

    def reset(self) -> None:
        self._delay = self._floor


class InboxRate:
    """Deliveries per second the inbox committed, measured over windows of at least `window` seconds: a shorter one
    would make a quiet inbox look busy whenever two deliveries happen to land within one short run."""

    def __init__(self, received: Callable[[], int], *, window: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._received = received
        self._window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._mark = (received(), clock())
        self._rate = 0.0

    def __call__(self) -> float:
        with self._lock:
            count, now = self._received(), self._clock()
            if now - self._mark[1] >= self._window:
                self._rate = (count - self._mark[0]) / (now - self._mark[1])
                self._mark = (count, now)
            return self._rate


def rest_after_run(cost: float, *, share: float) -> float:
    """How long runs rest after one that cost `cost` seconds while the inbox was busy, so that they take at most
    `share` of the time."""
    return cost * (1 - share) / share


class RunShare:
    """Runs give way to acknowledgements: while the inbox is busy, the runs of all workers together take at most
    `share` of the time, and the backlog drains at full speed once deliveries stop. Never zero, so runs never starve.

    A run's cost is what it takes from the acknowledgements: the CPU its thread spent (one interpreter lock) or the
    time it held the database's write lock (its commits and their fsyncs; not its wait for another process's commit,
    which took nothing from that process), whichever is longer. Not wall time: a run waiting on a model or a
    provider takes nothing from them and owes no rest. In `wakeful worker` on SQLite, apart from `wakeful api`
    (`cpu_counts=False`), the run's CPU is not the API's interpreter lock: only the write lock counts. On PostgreSQL
    the write-lock time is 0 and the CPU counts wherever the run is."""

    def __init__(self, inbox_rate: Callable[[], float], *, share: float, busy_rate: float,
                 clock: Callable[[], float] = time.monotonic, cpu_counts: bool = True) -> None:
        """`inbox_rate`: deliveries per second the inbox is committing; above `busy_rate`, runs give way."""
        self._inbox_rate = inbox_rate
        self._share = share
        self._busy_rate = busy_rate
        self._clock = clock
        self._cpu_counts = cpu_counts
        self._lock = threading.Lock()
        self._free_at = 0.0  # no run starts before this (clock seconds)

    def rest(self) -> float:
        """Seconds before the next run may start; 0: now."""
        with self._lock:
            return max(0.0, self._free_at - self._clock())

    def cost(self, *, cpu: float, locked: float) -> float:
        """What a run that spent `cpu` seconds of its thread and held the write lock `locked` seconds took from the
        acknowledgements."""
        return max(cpu, locked) if self._cpu_counts else locked

    def spent(self, cost: float) -> None:
        """A run just ended, having cost `cost` seconds."""
        if self._inbox_rate() <= self._busy_rate:
            return
        with self._lock:
            self._free_at = max(self._free_at, self._clock()) + rest_after_run(cost, share=self._share)


class RunInterrupted(Exception):
    def __init__(self, outcome: RunOutcome, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason


class RunHandler(Protocol):
    def __call__(self, ctx: RunContext) -> None: ...


Effect = Callable[[Connection, datetime], None]


@dataclass(frozen=True, kw_only=True)
class Binding:
    """Who is calling: the user and task always; a worker run adds its run, session and fencing token."""

    user_id: str
    task_id: str
    run_id: str | None = None
    session_id: str | None = None
    token: int | None = None
    decision_id: str | None = None


class Tools(Protocol):
    """What a run calls its tools through; the tool layer (`server.tools`) implements it, the core never imports it."""

    def call(self, binding: Binding, tool: str, args: Mapping[str, Any]) -> dict[str, Any]: ...


@dataclass
class RunContext:
    """The handler's view of one run. Effects are buffered and committed atomically under the fencing token."""

    run_id: str
    session_id: str
    user_id: str
    token: int
    events: tuple[EventView, ...]
    todo_version: int | None
    left_pending: bool
    """The run took its `run_max_events` and more may wait: its session is due again, behind those due before."""
    lease_until: datetime
    _worker: Worker
    _started: float
    steps: int = 0
    effects: list[Effect] = field(default_factory=list)
    ended_by: str | None = None
    prior: dict[int, tuple[str, Any]] = field(default_factory=dict)
    """Decisions of the run this one resumes (it died mid-way), by step: replayed, never asked again."""
    decisions: int = 0
    followups: int = 0
    planned: agenda.Planned = field(default_factory=agenda.Planned)
    """The timers and waits this run set, not committed yet: counted against the task's caps."""
    helpers: int = 0

    @property
    def engine(self) -> Engine:
        """The database, for reading what the run needs (writes go through `persist`, which fences)."""
        return self._worker.engine

    def now(self) -> datetime:
        return self._worker.clock.now()

    def propose(self, ask: Callable[[], Any]) -> tuple[str, Any]:
        """The next decision: the stored one when resuming a run that made it, else `ask()`'s answer (the model's
        proposal), persisted under this run and step before anything acts on it. Returns (decision ID, proposal)."""
        step = self.decisions
        self.decisions += 1
        if step in self.prior:
            return self.prior[step]
        proposal = ask()
        decision_id = new_id("dec")
        self.persist(lambda conn: conn.execute(decisions_table.insert().values(
            id=decision_id, run_id=self.run_id, session_id=self.session_id, step=step,
            proposal=json.dumps(proposal, sort_keys=True, default=str), created_at=self.now())))
        return decision_id, proposal

    def persist(self, write_rows: Callable[[Connection], Any]) -> None:
        """Commit rows now, in a transaction that first checks this run still holds the session."""
        with write(self._worker.engine) as conn:
            sessions.fence(conn, session_id=self.session_id, token=self.token)
            write_rows(conn)

    def call_tool(self, *, task_id: str, tool: str, args: dict[str, Any], decision_id: str | None = None) -> Any:
        """Run one tool through the tool layer and admission, under this run's fencing token."""
        if self._worker.tools is None:
            raise RuntimeError("this worker has no tool layer (no connectors are declared)")
        binding = Binding(user_id=self.user_id, task_id=task_id, run_id=self.run_id, session_id=self.session_id,
                          token=self.token, decision_id=decision_id)
        return self._worker.tools.call(binding, tool, args)

    def step(self) -> None:
        """Call before each step: refuses to go on under STOP, preemption or an exhausted budget; renews the lease."""
        self._worker.check_step(self)
        self.steps += 1

    def send_to_user(self, text: str, *, level: Level = Level.NOTIFY, urgency: Urgency | None = None,
                     **extra: Any) -> None:
        """A message through the outbox, at commit; the speaking gate may hold it for the next summary."""
        def effect(conn: Connection, now: datetime) -> None:
            outbox.enqueue(conn, user_id=self.user_id, session_id=self.session_id, run_id=self.run_id, now=now,
                           body={"text": text, **extra}, level=level, urgency=urgency)

        self.effects.append(effect)
        self.ended_by = "message"

    def silence(self, reason: str) -> None:
        """Nothing to send: an explicit, logged outcome with a one-line reason."""
        log.info("run %s: nothing to send: %s", self.run_id, reason)
        if self.ended_by != "message":  # a run that sent a message ended in that message
            self.ended_by = f"silence: {reason}"

    def wait_for(self, match_key: str, *, kind: str = "reply", deadline: datetime | None = None,
                 task_id: str | None = None, source: str | None = None) -> None:
        """Wait for a webhook delivery carrying `match_key`: from the source named `source`, or any webhook source.
        A run's wait is never one the user's channel or the system answers (`server.core.authority`)."""
        holder = of_source(source) if source is not None else Authority.ANY_SOURCE

        def effect(conn: Connection, now: datetime) -> None:
            waits.register(conn, user_id=self.user_id, session_id=self.session_id, match_key=match_key, kind=kind,
                           authority=holder, deadline=deadline, now=now, task_id=task_id)

        self.effects.append(effect)
        self.ended_by = self.ended_by or f"wait: {match_key}"

    def _admit(self, admit: Callable[[Connection, agenda.Limits], object]) -> agenda.Limits:
        """Check a timer or a wait against the task's caps now, counting what this run set already, so that a
        refusal is heard at once (the commit checks it again, in the transaction that writes it)."""
        limits = agenda.Limits.of(self._worker.settings)
        with read(self._worker.engine) as conn:
            admit(conn, limits)
        return limits

    def follow_up(self, *, task_id: str, at: datetime, note: str) -> None:
        settings = self._worker.settings

        def admit(conn: Connection, limits: agenda.Limits) -> None:
            timers.check_followup(conn, user_id=self.user_id, task_id=task_id,
                                  cap=settings.followup_cap - self.followups)
            agenda.admit_timer(conn, user_id=self.user_id, task_id=task_id, limits=limits, now=self.now(),
                               recurrence=None, planned=self.planned)

        limits = self._admit(admit)
        self.followups += 1
        self.planned = replace(self.planned, timers=self.planned.timers + 1)

        def effect(conn: Connection, now: datetime) -> None:
            agenda.add_followup(conn, user_id=self.user_id, task_id=task_id, due_at=at, note=note, now=now,
                                limits=limits)

        self.effects.append(effect)

    def confirm_pause(self, *, task_id: str, reason: str) -> None:
        """The user's message that holds the task means "stop": the hold becomes a pause, committed now (a narrowing;
        the user resumes it). Refused (`not_held`) unless the task is held."""
        self.persist(lambda conn: holds.confirm_pause(
            conn, user_id=self.user_id, task_id=task_id, run_id=self.run_id, reason=reason,
            actor=f"agent:{self.user_id} in {self.run_id}", now=self.now()))
    def start_helper(self, *, task_id: str, task_version: int, goal: str, constraints: list[str],
                     output_form: str) -> str:
        """A read-only sub-task with a run of its own (`core.helper_tasks`), admitted now (STOP, the task's state,
        the cap, counting this run's own) and started when this run commits. Returns the helper's ID."""
        settings = self._worker.settings
        with read(self._worker.engine) as conn:
            if control.stop_state(conn).blocks(self.user_id):
                raise Refused("stopped", "a STOP is in force: no helper starts until the user lifts it")
            helper_tasks.check_start(conn, user_id=self.user_id, task_id=task_id,
                                     cap=settings.helper_cap - self.helpers)
        self.helpers += 1
        helper_id = new_id("hlp")

        def effect(conn: Connection, now: datetime) -> None:
            helper_tasks.start(conn, helper_id=helper_id, user_id=self.user_id, task_id=task_id,
                               task_version=task_version, parent_session_id=self.session_id, goal=goal,
                               constraints=constraints, output_form=output_form, cap=settings.helper_cap,
                               max_steps=settings.helper_max_steps, deadline=now + settings.helper_max_time, now=now)

        self.effects.append(effect)
        return helper_id

    def schedule(self, *, task_id: str, note: str, every: timedelta | None = None, cron: str | None = None,
                 misfire: Misfire = Misfire.SKIP) -> datetime:
        """A recurring check; a cron is read in the user's time zone. Returns its first slot."""
        with read(self._worker.engine) as conn:
            tz = users.zone(conn, self.user_id).key if cron is not None else None
        recurrence = Recurrence(interval=every, cron=cron, tz=tz)
        limits = self._admit(lambda conn, limits: agenda.admit_timer(
            conn, user_id=self.user_id, task_id=task_id, limits=limits, now=self.now(), recurrence=recurrence,
            planned=self.planned))
        self.planned = replace(self.planned, timers=self.planned.timers + 1,
                               wakes_per_day=self.planned.wakes_per_day
                               + agenda.wakes_per_day(recurrence, now=self.now()))

        def effect(conn: Connection, now: datetime) -> None:
            agenda.add_check(conn, user_id=self.user_id, task_id=task_id, note=note, now=now, limits=limits,
                             every=every, cron=cron, misfire=misfire)

        self.effects.append(effect)
        return recurrence.next_after(self.now(), anchor=self.now())

    def wait_for_reply(self, key: str, *, task_id: str, deadline: datetime, on_timeout: OnTimeout, note: str,
                       source: str | None = None) -> None:
        """Wait, for the task, for a delivery carrying `key` until `deadline` (`server.core.agenda`)."""
        agenda.check_deadline(deadline, now=self.now())
        limits = self._admit(lambda conn, limits: agenda.admit_wait(
            conn, user_id=self.user_id, task_id=task_id, limits=limits, planned=self.planned))
        self.planned = replace(self.planned, waits=self.planned.waits + 1)

        def effect(conn: Connection, now: datetime) -> None:
            agenda.add_wait(conn, user_id=self.user_id, task_id=task_id, key=key, deadline=deadline,
                            on_timeout=on_timeout, note=note, now=now, limits=limits, source=source,
                            replying_to=[e.id for e in self.events])

        self.effects.append(effect)
        self.ended_by = self.ended_by or f"wait: {key}"

    def cancel_timer(self, *, task_id: str, item_id: str) -> None:
        """End one of the task's own timers or reply waits when the run commits."""
        with read(self._worker.engine) as conn:
            agenda.check_open(conn, user_id=self.user_id, task_id=task_id, item_id=item_id)

        def effect(conn: Connection, now: datetime) -> None:
            agenda.cancel(conn, user_id=self.user_id, task_id=task_id, item_id=item_id,
                          reason=f"cancelled by the agent in run {self.run_id}", now=now)

        self.effects.append(effect)


class Worker:
    def __init__(self, engine: Engine, settings: Settings, clock: Clock, handler: RunHandler, *,
                 name: str | None = None, on_commit: Callable[[], None] = lambda: None,
                 tools: Tools | None = None, share: RunShare | None = None) -> None:
        """`share`: shared by the workers of one process, so that their runs give way to the inbox together."""
        self.tools = tools
        self._share = share
        self.engine = engine
        self.settings = settings
        self.clock = clock
        self.handler = handler
        self.name = name or new_id("wkr")
        self._on_commit = on_commit

    # -- the loop ------------------------------------------------------------------------------------------------

    def run_forever(self, stop: threading.Event, wakeup: threading.Event) -> None:
        idle = IdlePoll(self.settings.poll_interval, self.settings.idle_poll_max)
        while not stop.is_set():
            rest = self._share.rest() if self._share is not None else 0.0
            if rest and stop.wait(rest):
                return
            cpu, locked = time.thread_time(), write_lock_time()  # this thread's, not wall time
            try:
                worked = self.run_once()
            except Exception:
                log.exception("worker %s: unexpected error", self.name)
                worked = False
            if not worked:
                idle.wait(wakeup, at_most=self._until_next_due())
                continue
            idle.reset()
            if self._share is not None:
                self._share.spent(self._share.cost(cpu=time.thread_time() - cpu, locked=write_lock_time() - locked))

    def _until_next_due(self) -> float | None:
        """Seconds until a session's work falls due (a delivery's coalescing window ends); None: nothing is coming."""
        now = self.clock.now()
        with read(self.engine) as conn:
            due = sessions.next_due(conn, now=now)
        return None if due is None else (due - now).total_seconds()

    def run_once(self) -> bool:
        """Claim one session with due work and run it. Returns False when there was nothing to do."""
        ctx = self._claim()
        if ctx is None:
            return False
        faults.crash_point("after_claim")
        outcome, reason = RunOutcome.COMPLETED, None
        try:
            self.handler(ctx)
        except RunInterrupted as stop:
            outcome, reason = stop.outcome, stop.reason
        except Exception as exc:
            log.exception("run %s failed", ctx.run_id)
            outcome, reason = RunOutcome.FAILED, f"{type(exc).__name__}: {exc}"
        faults.crash_point("before_run_commit")
        try:
            self._commit(ctx, outcome, reason)
        except StaleToken:
            log.error("run %s lost session %s to a newer worker; its commit was refused", ctx.run_id, ctx.session_id)
            return True
        if outcome is RunOutcome.COMPLETED or outcome is RunOutcome.BUDGET_EXHAUSTED:
            faults.crash_point("after_outbox_write")
        self._on_commit()
        metrics.run_ended(outcome.value)
        return True

    # -- claim -----------------------------------------------------------------------------------------------------

    def _claim(self) -> RunContext | None:
        now = self.clock.now()
        with read(self.engine) as conn:  # look before taking the write lock: most polls find nothing
            due = sessions.claimable(conn, now=now, limit=20)
            if not due:
                return None
            stop = control.stop_state(conn)
            may_run = {user_id: not stop.blocks(user_id) and not self._over_daily_budget(conn, user_id, now)
                       for user_id in {user_id for _, user_id in due}}
        candidates = [(session_id, user_id) for session_id, user_id in due if may_run[user_id]]
        # A STOP or a step counted since that look is heard at the run's first step, as one written just after.
        users_of = dict(candidates)
        with write(self.engine) as conn:
            while users_of:
                # On PostgreSQL, workers that looked at the same candidates each take another (SKIP LOCKED).
                claimed = sessions.claim_first(conn, candidates=list(users_of), worker=self.name, now=now,
                                               lease=self.settings.lease)
                if claimed is None:  # all taken, or their work done or postponed, since the look
                    return None
                session_id, token = claimed
                user_id = users_of.pop(session_id)
                fail_poison_events(conn, session_id=session_id, cap=self.settings.event_max_attempts, now=now)
                cap = self.settings.run_max_events
                pending = sorted(conn.execute(_TAKE_PENDING, {"session": session_id, "cap": cap}),  # attempts counted
                                 key=lambda e: (e.received_at, e.id))
                if not pending:
                    sessions.settle_todo(conn, session_id=session_id,
                                         seen_version=sessions.todo_version(conn, session_id), retry_at=None)
                    sessions.release(conn, session_id=session_id, token=token)
                    continue
                run_id = new_id("run")
                conn.execute(_START_RUN, {"id": run_id, "session_id": session_id, "user_id": user_id,
                                          "fencing_token": token, "worker": self.name,
                                          "outcome": RunOutcome.RUNNING.value, "steps": 0, "started_at": now})
                views = tuple(
                    EventView(id=e.id, source=e.source, source_id=e.source_id, kind=e.kind, trust=e.trust,
                              corr_key=e.corr_key, payload=json.loads(e.payload), received_at=e.received_at)
                    for e in pending
                )
                metrics.run_started(now, views)
                return RunContext(run_id=run_id, session_id=session_id, user_id=user_id, token=token, events=views,
                                  todo_version=sessions.todo_version(conn, session_id),
                                  left_pending=sum(not e.preempt for e in pending) >= cap,
                                  lease_until=now + self.settings.lease, _worker=self, _started=time.monotonic(),
                                  prior=_resumable_decisions(conn, session_id, run_id))
        return None

    def _over_daily_budget(self, conn: Connection, user_id: str, now: datetime) -> bool:
        return _steps_today(conn, user_id, now) >= self.settings.daily_max_steps

    # -- during the run --------------------------------------------------------------------------------------------

    def check_step(self, ctx: RunContext) -> None:
        if ctx.steps >= self.settings.run_max_steps:
            raise RunInterrupted(RunOutcome.BUDGET_EXHAUSTED, f"step budget of {self.settings.run_max_steps} used")
        if time.monotonic() - ctx._started > self.settings.run_max_seconds:
            raise RunInterrupted(RunOutcome.BUDGET_EXHAUSTED,
                                 f"wall-clock budget of {self.settings.run_max_seconds:.0f} s used")
        now = self.clock.now()
        lease = self.settings.lease
        if now + lease - ctx.lease_until > lease / 10:  # a tenth of the lease has run down: renew it
            with write(self.engine) as conn:
                sessions.fence(conn, session_id=ctx.session_id, token=ctx.token, lease_until=now + lease)
            ctx.lease_until = now + lease
        with read(self.engine) as conn:  # the rest only looks: no write lock, no fsync
            sessions.holds(conn, session_id=ctx.session_id, token=ctx.token)
            if control.stop_state(conn).blocks(ctx.user_id):
                raise RunInterrupted(RunOutcome.INTERRUPTED, "STOP is in force")
            if conn.execute(_PREEMPTING, {"session_id": ctx.session_id, "handed": [e.id for e in ctx.events]}).first():
                raise RunInterrupted(RunOutcome.INTERRUPTED, "the user paused, closed or wrote about the task")
            if _steps_today(conn, ctx.user_id, now) + ctx.steps >= self.settings.daily_max_steps:
                raise RunInterrupted(RunOutcome.BUDGET_EXHAUSTED,
                                     f"daily budget of {self.settings.daily_max_steps} steps used")

    # -- commit ----------------------------------------------------------------------------------------------------

    def _commit(self, ctx: RunContext, outcome: RunOutcome, reason: str | None) -> None:
        now = self.clock.now()
        keep = outcome in (RunOutcome.COMPLETED, RunOutcome.BUDGET_EXHAUSTED)
        with write(self.engine) as conn:
            # Releasing fences (only the latest token can) and takes effect only if this transaction commits.
            sessions.release(conn, session_id=ctx.session_id, token=ctx.token)
            ids = [e.id for e in ctx.events]
            if keep:
                for effect in ctx.effects:
                    effect(conn, now)
                if outcome is RunOutcome.COMPLETED:
                    holds.release_read(conn, event_ids=ids, run_id=ctx.run_id, now=now)
                if outcome is RunOutcome.BUDGET_EXHAUSTED:
                    outbox.enqueue(conn, user_id=ctx.user_id, session_id=ctx.session_id, run_id=ctx.run_id, now=now,
                                   body={"text": f"I stopped working on this for now: {reason}. What I did so far "
                                         "is saved.", "kind": "budget_exhausted"})
                conn.execute(_PROCESSED, {"ids": ids, "status": EventStatus.PROCESSED.value, "run_id": ctx.run_id,
                                          "settled_at": now})
                sessions.settle_todo(conn, session_id=ctx.session_id, seen_version=ctx.todo_version,
                                     retry_at=now if ctx.left_pending else None)
            elif outcome is RunOutcome.INTERRUPTED:
                # Not the events' fault: give the attempt back; the todo stays due for after START / resume.
                conn.execute(_GIVE_ATTEMPT_BACK, {"ids": ids})
            else:
                attempts = max((e.attempts for e in conn.execute(select(events.c.attempts)
                                                                  .where(events.c.id.in_(ids)))), default=1)
                sessions.settle_todo(conn, session_id=ctx.session_id, seen_version=None,
                                     retry_at=now + timedelta(seconds=min(300, 2 ** attempts)))
            if ctx.steps:
                conn.execute(_count_steps(conn),
                             {"user_id": ctx.user_id, "day": now.date().isoformat(), "steps": ctx.steps})
            ended = conn.execute(_END_RUN, {"run": ctx.run_id, "outcome": outcome.value, "ended_at": now,
                                            "steps": ctx.steps,
                                            "reason": reason or ctx.ended_by or "silence: the handler sent nothing"})
            if ended.rowcount != 1:  # the sweeper already wrote this run off (its lease lapsed): commit nothing
                raise StaleToken(ctx.session_id, ctx.token)


# The statements of every run, built once (see `sessions`): a run executes them holding the write lock. An `UPDATE`
# without `values()` sets the columns its parameters name.
# A run takes the user's messages and control (`preempt`) all, and the oldest `cap` of the rest: the cap bounds how
# long its claim and its commit hold the write lock, whatever burst waits (the inbox's acknowledgements queue behind
# that lock). Taking every preempting event keeps a run from being interrupted by one it was not handed.
_PENDING = and_(events.c.session_id == bindparam("session"), events.c.status == EventStatus.PENDING.value)
# One list of IDs, both parts read from the (session, status, preempt, received_at) index, then each row by its key:
# a condition on the rows themselves would be tested on every pending event of the session, all of a burst's
# thousands (and on PostgreSQL two lists OR'd were a scan of the whole table).
_OLDEST = (select(events.c.id).where(_PENDING, events.c.preempt == false())
           .order_by(events.c.received_at, events.c.id).limit(bindparam("cap")).subquery())
_TAKE_PENDING = (update(events)
                 .where(events.c.id.in_(union_all(select(events.c.id).where(_PENDING, events.c.preempt == true()),
                                                  select(_OLDEST.c.id))))
                 .values(attempts=events.c.attempts + 1)
                 .returning(*events.c))
_GIVE_ATTEMPT_BACK = (update(events).where(events.c.id.in_(bindparam("ids", expanding=True)))
                      .values(attempts=events.c.attempts - 1))
_START_RUN = runs.insert()
_PREEMPTING = (select(events.c.id)
               .where(and_(events.c.session_id == bindparam("session_id"), events.c.preempt == true(),
                           events.c.status == EventStatus.PENDING.value,
                           events.c.id.not_in(bindparam("handed", expanding=True))))
               .limit(1))
_STEPS_TODAY = select(usage_daily.c.steps).where(and_(usage_daily.c.user_id == bindparam("user_id"),
                                                      usage_daily.c.day == bindparam("day")))
_PROCESSED = update(events).where(and_(events.c.id.in_(bindparam("ids", expanding=True)),
                                       events.c.status == EventStatus.PENDING.value))
_END_RUN = update(runs).where(and_(runs.c.id == bindparam("run"), runs.c.outcome == RunOutcome.RUNNING.value))


_COUNT_STEPS: dict[str, Insert] = {}  # by dialect


def _count_steps(conn: Connection) -> Insert:
    stmt = _COUNT_STEPS.get(conn.dialect.name)
    if stmt is None:
        upserting = upsert(conn, usage_daily)
        stmt = _COUNT_STEPS[conn.dialect.name] = upserting.on_conflict_do_update(
            index_elements=[usage_daily.c.user_id, usage_daily.c.day],
            set_={"steps": usage_daily.c.steps + upserting.excluded.steps})
    return stmt


def _steps_today(conn: Connection, user_id: str, now: datetime) -> int:
    steps = conn.execute(_STEPS_TODAY, {"user_id": user_id, "day": now.date().isoformat()}).scalar()
    return int(steps or 0)


def _resumable_decisions(conn: Connection, session_id: str, run_id: str) -> dict[int, tuple[str, Any]]:
    """When the session's previous run died mid-way, its decisions, to be replayed by the run that picks up."""
    previous = conn.execute(_PREVIOUS_RUN, {"session_id": session_id, "run_id": run_id}).first()
    if previous is None or previous.outcome not in (RunOutcome.ABANDONED.value, RunOutcome.RUNNING.value):
        return {}
    rows = conn.execute(select(decisions_table).where(decisions_table.c.run_id == previous.id))
    return {r.step: (r.id, json.loads(r.proposal)) for r in rows}


_PREVIOUS_RUN = (select(runs.c.id, runs.c.outcome)
                 .where(and_(runs.c.session_id == bindparam("session_id"), runs.c.id != bindparam("run_id")))
                 .order_by(runs.c.started_at.desc(), runs.c.id.desc())
                 .limit(1))


def fail_poison_events(conn: Connection, *, session_id: str | None, cap: int, now: datetime) -> int:
    """Events picked up `cap` times without success are failed, and the user is told (liveness)."""
    if session_id is not None:
        found = conn.execute(_POISON_IN_SESSION, {"cap": cap, "session_id": session_id})
    else:  # a session a live run holds is left to that run's claim-time check: it may be handling these now
        found = conn.execute(_POISON_UNHELD, {"cap": cap, "now": now})
    failed = 0
    for e in found.all():
        moved = conn.execute(update(events).where(and_(events.c.id == e.id,
                                                       events.c.status == EventStatus.PENDING.value))
                             .values(status=EventStatus.FAILED.value, settled_at=now)).rowcount
        if moved == 1:
            failed += 1
            outbox.enqueue(conn, user_id=e.user_id, session_id=e.session_id, now=now, message_id=f"fail_{e.id}",
                           body={"kind": "event_failed", "event_id": e.id,
                                 "text": f"I could not process the {e.source} event {e.source_id} after {cap} "
                                         "attempts and have set it aside. Nothing from it was acted on."})
    return failed


_POISON = select(events.c.id, events.c.user_id, events.c.session_id, events.c.source, events.c.source_id).where(
    and_(events.c.status == EventStatus.PENDING.value, events.c.attempts >= bindparam("cap")))
_POISON_IN_SESSION = _POISON.where(events.c.session_id == bindparam("session_id"))
_POISON_UNHELD = _POISON.where(events.c.session_id.not_in(
    select(sessions_table.c.id).where(sessions_table.c.lease_expires_at > bindparam("now"))))
_ANY_POISON_UNHELD = _POISON_UNHELD.limit(1)


def any_poison_unheld(conn: Connection, *, cap: int, now: datetime) -> bool:
    """Whether `fail_poison_events(session_id=None)` would find anything."""
    return conn.execute(_ANY_POISON_UNHELD, {"cap": cap, "now": now}).first() is not None
