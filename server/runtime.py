"""The runtime: the inbox committer (the API's half) and the workers, scheduler, dispatcher, reconciler and sweeper
(the worker's half), in one process (`Role.ALL`: what tests and embedding programs build) or split between the
`wakeful api` and `wakeful worker` processes that `wakeful serve` supervises.

Loops sleep on a `threading.Event` and are woken the moment a commit gives them work (a delivery wakes the workers,
a run's commit the dispatcher and the scheduler); an API process relays each wake-up to the worker process
(`server.core.wakeups`). The scheduler also sleeps no longer than until the first timer or wait deadline it would act
on. Polling every `poll_interval` is only the fallback. Everything they need is in the
database, so a restart resumes from it alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING

from sqlalchemy import Engine, select

from wakeful.proxy.clock import Clock, SystemClock
from wakeful.server.acting.connectors import Registry, load_connectors
from wakeful.server.acting.policy import load_policy
from wakeful.server.computers.handoff import LiveViews
from wakeful.server.computers.pool import Computers, LazyVmComputers
from wakeful.server.computers.remote import ActionLocks, ComputerServer, RemoteComputers, computers_socket
from wakeful.server.core import control, faults, outbox, speaking, timers, waits
from wakeful.server.core.inbox import GroupCommitter
from wakeful.server.core.outbox import MessageDelivery, OutboxDrain
from wakeful.server.core.speaking import Level
from wakeful.server.core.sweeper import sweep
from wakeful.server.core.wakeups import Signals, WakeListener, WakeSender, listener_for, sender_for
from wakeful.server.core.worker import Binding, IdlePoll, InboxRate, RunHandler, RunShare, Worker
from wakeful.server.egress.dispatch import ActionDispatcher
from wakeful.server.egress.grants import issue_client_token
from wakeful.server.egress.outbound import ConnectorHTTP
from wakeful.server.egress.pacing import Pacing
from wakeful.server.harness.handlers import EchoHandler, NoModelHandler
from wakeful.server.memory import expire_task
from wakeful.server.settings import Settings, missing_vm_packages
from wakeful.server.store import users
from wakeful.server.store.db import make_engine, migrate, read, write
from wakeful.server.store.tables import tasks as tasks_table
from wakeful.server.tools.layer import ToolLayer

if TYPE_CHECKING:
    from wakeful.server.audit.signing import LedgerKey
    from wakeful.vm.hypervisor import ProxyCredential

__all__ = ["Role", "Runtime", "Signals", "load_registry", "make_handler", "prepare"]

log = logging.getLogger(__name__)

control.on_task_end(expire_task)  # a task's task-scoped memory expires with it (control never imports memory)


class Role(StrEnum):
    """Which half of the runtime a process runs."""

    ALL = "all"
    """Both, in one process: the inbox and the loops wake each other in memory (tests, `demo`, evals)."""
    API = "api"
    """The inbox only (`wakeful api`): its wake-ups go to the worker process."""
    WORKER = "worker"
    """The loops only (`wakeful worker`): woken by the API process's messages, and by its own commits."""


def prepare(engine: Engine, now: datetime) -> str | None:
    """Migrate, and create the owner on first start: returns its token, to be shown once (None after that)."""
    migrate(engine)
    with write(engine) as conn:
        _, token = users.ensure_user(conn, name=users.OWNER, now=now, admin=True)
    return token


def load_registry(settings: Settings) -> Registry:
    """The declared connectors (none when the policies folder has no `connectors/`)."""
    directory = settings.policies / "connectors"
    if not directory.is_dir():
        log.warning("no connectors: %s does not exist (copy the repository's policies/ there, or set policies_dir); "
                    "the agent has no connector tools", directory)
        return Registry(connectors={})
    registry = load_connectors(directory, base_urls=settings.connector_urls)
    log.info("connectors from %s: %s", directory, ", ".join(sorted(registry.connectors)) or "none")
    return registry


def make_handler(settings: Settings, registry: Registry) -> RunHandler:
    """The model harness when a model is configured, else the quiet no-model handler (and a log line saying so)."""
    if settings.anthropic_api_key is None and settings.echo_without_model:
        return EchoHandler()
    if settings.anthropic_api_key is None:
        log.warning("no model configured (WAKEFUL_ANTHROPIC_API_KEY or ANTHROPIC_API_KEY): runs record and settle "
                    "their events in silence, and each user is told once")
        return NoModelHandler()
    from wakeful.server.harness.model_anthropic import AnthropicModel
    from wakeful.server.harness.wake import Harness

    model = AnthropicModel(api_key=settings.anthropic_api_key.get_secret_value(), model=settings.model)
    return Harness(model, registry=registry, instructions=settings.instructions_file
                   or settings.data_dir / "instructions.md", max_tokens_per_run=settings.run_max_tokens,
                   computers=settings.computers)


def _alone(action_id: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()  # one process: the dispatcher's own lock suffices


def run_costs_cpu(role: Role, dialect: str) -> bool:
    """Whether a run's CPU counts in what it takes from the acknowledgements (`RunShare`). Beside the API in one
    process it does (one interpreter lock). In `wakeful worker` on SQLite only the write lock is shared. On PostgreSQL
    there is no one write lock (its time reads 0, so a run would never give way): the run's CPU stands for the
    database work it makes the server do beside the acks'."""
    return role is not Role.WORKER or dialect != "sqlite"


class Runtime:
    def __init__(self, settings: Settings, *, handler: RunHandler, clock: Clock | None = None,
                 engine: Engine | None = None, registry: Registry | None = None,
                 computers: Computers | None = None, role: Role = Role.ALL) -> None:
        faults.configure(settings.crash_at)
        self.settings = settings
        self.role = role
        self.clock = clock or SystemClock()
        self.engine = engine or make_engine(settings.db_url)
        self._ledger_key: LedgerKey | None = None  # loaded (or created) by the first seal
        self._sender: WakeSender | None = None
        self._listener: WakeListener | None = None
        self._received_elsewhere = 0  # deliveries the API process's inbox committed, as its last wake-up said
        if role is Role.API:
            self._sender = sender_for(self.engine, settings.data_dir, lambda: self.committer.received)
            self.signals = Signals.relayed(self._sender.send)
        else:
            self.signals = Signals()
        if role is Role.WORKER:
            self._listener = listener_for(self.engine, settings.data_dir)
        self.committer = GroupCommitter(self.engine, self.clock, on_commit=self.signals.work.set,
                                        coalesce=timedelta(seconds=settings.coalesce_seconds))
        self.policy = load_policy(settings.policies / "policy.toml")
        self.registry = registry or load_registry(settings)
        self.egress = ConnectorHTTP.from_settings(settings)
        self.tools = ToolLayer(self.engine, self.clock, registry=self.registry, policy=self.policy,
                               http=self.egress)
        share = RunShare(InboxRate(lambda: self.committer.received + self._received_elsewhere),
                         share=settings.ingest_run_share,
                         busy_rate=settings.ingest_busy_rate,
                         cpu_counts=run_costs_cpu(role, self.engine.dialect.name))
        self.workers = [
            Worker(self.engine, settings, self.clock, handler, on_commit=self._after_run, tools=self.tools,
                   share=share)
            for _ in range(settings.workers if role is not Role.API else 0)
        ]
        self.messages = MessageDelivery(self.engine, self.clock, notify_url=settings.notify_url,
                                        max_attempts=settings.dispatch_max_attempts,
                                        backoff=settings.dispatch_backoff, base_url=settings.base_url)
        if computers is None and settings.computers:
            computers = self._own_computers() if role is not Role.WORKER else RemoteComputers(
                computers_socket(settings.data_dir))
        self.computers = computers
        # The live views are the API's (the worker serves no page); so are the computers themselves under the split:
        # the worker reaches them through `server.computers.remote`, and one offered handoff is offered there.
        self.live = LiveViews(computers, self.clock) if computers is not None and role is not Role.WORKER else None
        self._computer_server: ComputerServer | None = None
        if role is Role.API and computers is not None and self.live is not None:
            self._computer_server = ComputerServer(computers, computers_socket(settings.data_dir),
                                                   on_handoff=self.live.offer)
        self.actions = ActionDispatcher(self.engine, self.clock, policy=self.policy,
                                        on_event=self.signals.outcome_recorded, http=self.egress,
                                        resend_after=settings.resend_after, computers=computers,
                                        one_at_a_time=ActionLocks(settings.data_dir / "run").held
                                        if computers is not None and role is not Role.ALL else _alone,
                                        pacing=Pacing(first=timedelta(seconds=settings.reconcile_interval),
                                                      cap=settings.reconcile_backoff_max))
        self.outbox = OutboxDrain(self.engine, self.clock, [self.messages, self.actions], hold=settings.lease)
        if computers is not None:
            self.tools.attach_computers(computers, dispatch_now=self._dispatch_now, notify=self._send_live_view)
        self.source_users: dict[str, str] = {}
        self._threads: list[threading.Thread] = []

    def _own_computers(self) -> Computers:
        """The tool computers this process holds (and decides the VMs of)."""
        if self.settings.computer_fakes:
            from wakeful.server.computers.fakes import FakeVmComputers

            return FakeVmComputers(self.clock, self.settings.computer_idle_after)
        if missing := missing_vm_packages():
            log.warning("tool computers are on (computers = true) but the VM packages are missing (%s): the "
                        "agent's computer tools will answer tool_computer_unavailable (./scripts/install "
                        "--computers, or computers = false)", ", ".join(missing))
        return LazyVmComputers(self.settings, self.clock, self._computer_credential)

    def _computer_credential(self, user_id: str) -> ProxyCredential:
        """A tool computer's own proxy credential: its traffic is matched against the user's egress allowlist."""
        from wakeful.vm.hypervisor import ProxyCredential  # importing the VM layer waits for the first computer

        with write(self.engine) as conn:
            _, token = issue_client_token(conn, user_id=user_id, label="tool computer", now=self.clock.now())
        return ProxyCredential(user_id=user_id, token=token)

    def prepare(self) -> str | None:
        """Migrate, create the owner on first start (returns its token, to be shown once), bind sources to users."""
        token = prepare(self.engine, self.clock.now())
        with read(self.engine) as conn:
            for name, source in self.settings.sources.items():
                self.source_users[name] = users.user_id_by_name(conn, source.user)
        return token

    def _dispatch_now(self, action_id: str) -> None:
        """An act on the tool computer that admission let through runs now, within the agent's tool call."""
        self.actions.dispatch(f"dsp_{action_id}", action_id)

    def _send_live_view(self, binding: Binding, token: str) -> None:
        """The user's one-time link to take the screen (served by `wakeful serve`)."""
        link = f"{self.settings.base_url}/v1/live/{token}"
        if self.live is not None:  # else the computers' owner (the API) offered it as it granted it
            self.live.offer(binding.user_id, token)
        with write(self.engine) as conn:
            session_id = conn.execute(select(tasks_table.c.session_id).where(
                tasks_table.c.id == binding.task_id)).scalar_one()
            outbox.enqueue(conn, user_id=binding.user_id, session_id=session_id, run_id=binding.run_id,
                           level=Level.ASK, now=self.clock.now(),
                           body={"kind": "handoff", "task_id": binding.task_id, "link": link,
                                 "text": "Your tool computer needs you: open the link to take the screen, and press "
                                         "'Return control' when done."})
        self.signals.dispatch.set()

    def _after_run(self) -> None:
        # A run's commit may hold outbox rows, and timers or waits due before the scheduler's next look.
        self.signals.dispatch.set()
        self.signals.timers.set()

    def _woken(self, loop: str, received: int) -> None:
        """A wake-up from the API process."""
        self._received_elsewhere = max(self._received_elsewhere, received)
        self.signals.woken(loop)

    def start(self) -> None:
        if self._computer_server is not None:
            self._computer_server.start()  # before anything answers: a second owner stops here (computers_running)
        if self.role is not Role.WORKER:
            self.committer.start()
        if self.role is Role.API:
            return
        if self._listener is not None:
            self._listener.start(self._woken)
        loops: list[tuple[str, Callable[[], None]]] = [
            *((f"worker-{i}", lambda w=w: w.run_forever(self.signals.stop, self.signals.work))
              for i, w in enumerate(self.workers)),
            ("scheduler", self._scheduler_loop),
            ("dispatcher", self._dispatcher_loop),
            ("reconciler", self._reconciler_loop),
            ("sweeper", self._sweeper_loop),
        ]
        for name, target in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self.signals.stop.set()
        if self._listener is not None:
            self._listener.stop()
        for event in self.signals.all():
            threading.Event.set(event)  # this process's loops only: a stopping API wakes no worker
        for thread in self._threads:
            thread.join(timeout=30)
        if self.role is not Role.WORKER:
            self.committer.stop()
        if self._computer_server is not None:
            self._computer_server.stop()
        if self._sender is not None:
            self._sender.close()
        self.messages.close()
        self.egress.close()

    # -- loops -----------------------------------------------------------------------------------------------------

    def _guarded(self, name: str, body: Callable[[], float]) -> float:
        try:
            return body()
        except Exception:
            log.exception("%s: unexpected error; retrying after the poll interval", name)
            return self.settings.poll_interval

    def _scheduler_loop(self) -> None:
        idle = IdlePoll(self.settings.poll_interval, self.settings.idle_poll_max)
        while not self.signals.stop.is_set():
            until_next = self._guarded("scheduler", self.scheduler_tick)
            idle.wait(self.signals.timers, at_most=until_next)

    def scheduler_tick(self) -> float:
        """Fire due timers and expire due waits; returns how long to sleep: until the next timer or wait deadline
        falls due, the idle ceiling when none is coming."""
        next_due, moved = self._next_due(), 0
        if next_due is not None and next_due <= self.clock.now():
            with write(self.engine) as conn:
                now = self.clock.now()  # read under the lock: an event's received_at is when it was written
                stop = control.stop_state(conn)
                fired = 0 if stop.everything else timers.fire_due(conn, now=now, blocked=stop.blocks)
                expired = waits.expire_due(conn, now=now)
            if fired or expired:
                self.signals.work.set()
            if expired:
                self.signals.reconcile.set()  # a reconcile wait that ran out is told to the user by the reconciler
            moved = fired + expired
            next_due = self._next_due()
        if next_due is None:
            return self.settings.idle_poll_max
        until = (next_due - self.clock.now()).total_seconds()
        if until > 0 or moved:
            return max(0.0, until)  # still due after a tick that moved some: more than one batch was due
        # Due, and this tick moved none of it: held under STOP (or, on PostgreSQL, another scheduler's to fire).
        return self.settings.poll_interval

    def _next_due(self) -> datetime | None:
        """When the scheduler next has work: the first timer or wait deadline it would act on (one query)."""
        with read(self.engine) as conn:
            due = conn.execute(select(timers.next_due(), waits.next_deadline())).one()
        return min((at for at in due if at is not None), default=None)

    def _dispatcher_loop(self) -> None:
        idle = IdlePoll(self.settings.poll_interval, self.settings.idle_poll_max)
        while not self.signals.stop.is_set():
            attempted = self._guarded("dispatcher", lambda: float(self.release_held() + self.outbox.drain()))
            if attempted:
                idle.reset()
            else:
                idle.wait(self.signals.dispatch)

    def release_held(self) -> int:
        """Queue the summary of each user's held messages whose hold has ended (`core.speaking`)."""
        with read(self.engine) as conn:  # most rounds find nothing: look before taking the write lock
            if not speaking.any_held_due(conn, now=self.clock.now()):
                return 0
        with write(self.engine) as conn:
            return speaking.release_due(conn, now=self.clock.now())

    def _reconciler_loop(self) -> None:
        # It sleeps until the next read about an unsettled action is due (each action keeps its own pace), or until
        # an outcome recorded in this process wakes it; nothing waiting is the usual case: six idle polls then.
        idle = IdlePoll(self.settings.reconcile_interval, 6 * self.settings.idle_poll_max)
        while not self.signals.stop.is_set():
            until_next = self._guarded("reconciler", self.reconcile_once)
            idle.wait(self.signals.reconcile, at_most=until_next)

    def reconcile_once(self) -> float:
        """Read the provider about the unknown outcomes and unverified effects that are due, send receipts for
        completed tasks; returns the seconds until the next read is due (the idle ceiling when none waits)."""
        looked = self.actions.reconcile_due() + self.actions.verify_due()
        if looked:
            self.signals.dispatch.set()  # reconciliation may have queued a resend or a receipt
        following = self.actions.next_look()
        if following is None:
            return 6 * self.settings.idle_poll_max
        # Never less than a poll: a read that failed before it left (and so left no evidence) is not retried hot.
        return max(self.settings.poll_interval, (following - self.clock.now()).total_seconds())

    def seal_ledger(self) -> int:
        """Chain the history rows written since the last seal and sign a checkpoint (`server.audit.seal`)."""
        from wakeful.server.audit.seal import seal  # here: every `wakeful` command imports this module
        from wakeful.server.audit.signing import load_or_create_key

        if self._ledger_key is None:
            self._ledger_key = load_or_create_key(self.settings.ledger_key_path)
        return seal(self.engine, self._ledger_key, now=self.clock.now())

    def _sweeper_loop(self) -> None:
        while not self.signals.stop.wait(self.settings.sweep_interval):
            self._guarded("sweeper", self.sweep_once)

    def sweep_once(self) -> float:
        report = sweep(self.engine, now=self.clock.now(), event_max_attempts=self.settings.event_max_attempts)
        if report.rescheduled or report.abandoned_runs:
            self.signals.work.set()
        if report.failed_events:
            self.signals.dispatch.set()
        if self.computers is not None:
            suspended = self.computers.reap()  # idle tool computers go to disk: their RAM is freed
            if suspended:
                log.info("suspended idle tool computers of %s", ", ".join(suspended))
        self.seal_ledger()
        return 0.0
