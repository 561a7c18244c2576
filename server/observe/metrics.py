"""Prometheus metrics: what the server counts, where the counts are kept, and the exposition `GET /metrics` serves.

Counters and histograms are observed where things happen, one call at each point: the webhook inbox (`delivery`),
the worker (`run_started`, `run_ended`), the egress decider (`egress_recorded`), the tool-computer pool
(`computers`, `restoring`). Gauges of stored state (pending events, open waits, active timers, the outbox's depth)
are counted from the database at each scrape (`StoredState`), so every API process answers the same for them.

Across processes: `wakeful serve` calls `share_across_processes` before anything is observed, so every process
it starts keeps its observations in files under `<data_dir>/run/metrics` (prometheus_client's multiprocess mode,
the directory in `PROMETHEUS_MULTIPROC_DIR`, inherited by children) and the API's `/metrics` sums them all; the
directory is emptied when serve starts. A process that never called it (an embedding program, the tests) keeps
them in its own memory, and serves those.

No label carries a user's ID or name: `source` is a webhook source the deployment configured (anything else is
`unknown`), the others are fixed states, outcomes and stable codes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    values,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from sqlalchemy import Engine, func, select

from wakeful.server.store.db import read
from wakeful.server.store.tables import EventStatus, OutboxState, TimerState, WaitState, events, outbox, timers, waits

__all__ = ["CONTENT_TYPE", "StoredState", "computers", "delivery", "egress_recorded", "exposition", "restoring",
           "run_ended", "run_started", "share_across_processes"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
ENV = "PROMETHEUS_MULTIPROC_DIR"

_ACK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_WAKE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
_RESTORE_BUCKETS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


@dataclass(frozen=True, kw_only=True)
class _Metrics:
    deliveries: Counter
    ack: Histogram
    event_to_run: Histogram
    timer_to_run: Histogram
    runs: Counter
    egress: Counter
    computers: Gauge
    restore: Histogram
    by_delivery: dict[tuple[str, str], Counter] = field(default_factory=dict)
    """`deliveries`' children by (source, result), as `delivery` looked them up."""

    def all(self) -> tuple[Counter | Gauge | Histogram, ...]:
        return (self.deliveries, self.ack, self.event_to_run, self.timer_to_run, self.runs, self.egress,
                self.computers, self.restore)


def _build() -> _Metrics:
    # Not in prometheus_client's global registry: `exposition` reads them (or their files) itself, so two apps in
    # one process (the tests) never register a name twice. No `_created` series: multiprocess mode has none either.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    return _Metrics(
        deliveries=Counter("wakeful_deliveries", "Webhook deliveries answered, by source and result: recorded, "
                           "duplicate, or the refusal's code.", ["source", "result"], registry=None),
        ack=Histogram("wakeful_ack_seconds", "From a webhook delivery's arrival to its answer (recorded or "
                      "refused).", registry=None, buckets=_ACK_BUCKETS),
        event_to_run=Histogram("wakeful_event_to_run_start_seconds", "From an event's arrival to the start of the "
                               "run that takes it (timers excepted).", registry=None, buckets=_WAKE_BUCKETS),
        timer_to_run=Histogram("wakeful_timer_due_to_run_start_seconds", "From a timer's due time to the start of "
                               "the run that takes its event.", registry=None, buckets=_WAKE_BUCKETS),
        runs=Counter("wakeful_runs", "Runs ended, by outcome.", ["outcome"], registry=None),
        egress=Counter("wakeful_egress_verdicts", "Requests the egress proxy decided, by client kind, verdict and "
                       "refusal code.", ["client", "verdict", "code"], registry=None),
        computers=Gauge("wakeful_computers", "Tool computers known to the process that runs them, by state.",
                        ["state"], registry=None, multiprocess_mode="livesum"),
        restore=Histogram("wakeful_computer_restore_seconds", "From asking for a suspended tool computer to it "
                          "running again (libvirt restore and the reconnect after it).", registry=None,
                          buckets=_RESTORE_BUCKETS),
    )


_lock = threading.Lock()
_metrics: _Metrics | None = None
_computer_states: set[str] = set()


def _m() -> _Metrics:
    global _metrics
    if _metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = _build()
    return _metrics


def share_across_processes(directory: Path, *, clean: bool) -> None:
    """Keep this process's observations, and those of every process it starts, in files under `directory`, which
    any of them sums at `/metrics`. `clean`: empty it first (the one process that starts all the others, at its
    start; counts of processes from before are gone). Call it before anything is observed."""
    global _metrics
    directory.mkdir(parents=True, exist_ok=True)
    if clean:
        for stale in directory.glob("*.db"):
            stale.unlink(missing_ok=True)
    os.environ[ENV] = str(directory)
    with _lock:
        # prometheus_client chose where values live when it was imported, before the environment named a directory
        values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
        _metrics = None


def _shared_directory() -> Path | None:
    named = os.environ.get(ENV)
    return Path(named) if named else None


# -- observations: one call at each point -----------------------------------------------------------------------


def delivery(source: str, result: str, seconds: float) -> None:
    """A webhook delivery was answered after `seconds`: `result` is recorded, duplicate, or the refusal's code."""
    metrics = _m()
    # The labelled counter, kept per (source, result) beside the metrics it belongs to: `labels` checks and locks
    # on every call, once per delivery. (Refusal codes and configured sources are few, so the dict stays small.)
    counter = metrics.by_delivery.get((source, result))
    if counter is None:
        counter = metrics.by_delivery[(source, result)] = metrics.deliveries.labels(source, result)
    counter.inc()
    metrics.ack.observe(seconds)


class EventLike(Protocol):
    @property
    def source(self) -> str: ...
    @property
    def received_at(self) -> datetime: ...
    @property
    def payload(self) -> Any: ...


def run_started(now: datetime, taken: Iterable[EventLike]) -> None:
    """A run started at `now` with these events: how long each waited (a timer's, since it was due)."""
    metrics = _m()
    for event in taken:
        slot = event.payload.get("slot") if event.source == "timer" and isinstance(event.payload, dict) else None
        if isinstance(slot, str):
            metrics.timer_to_run.observe(max(0.0, (now - _aware(datetime.fromisoformat(slot))).total_seconds()))
        else:
            metrics.event_to_run.observe(max(0.0, (now - _aware(event.received_at)).total_seconds()))


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def run_ended(outcome: str, *, count: int = 1) -> None:
    """`count` runs ended so: a worker's run as it commits, or the runs the sweeper wrote off (their worker died)."""
    if count:
        _m().runs.labels(outcome).inc(count)


class RecordLike(Protocol):
    @property
    def client(self) -> str: ...
    @property
    def verdict(self) -> str: ...
    @property
    def code(self) -> str | None: ...


def egress_recorded(records: Iterable[RecordLike]) -> None:
    """The egress proxy's audit records of decided requests (`code` is empty for an allow)."""
    counter = _m().egress
    for record in records:
        counter.labels(str(record.client), str(record.verdict), str(record.code or "")).inc()


def computers(states: Iterable[str]) -> None:
    """The states of every tool computer the calling process runs (a state no longer seen counts 0)."""
    counted: dict[str, int] = {}
    for state in states:
        counted[state] = counted.get(state, 0) + 1
    gauge = _m().computers
    with _lock:
        _computer_states.update(counted)
        for state in _computer_states:
            gauge.labels(state).set(counted.get(state, 0))


@contextlib.contextmanager
def restoring(suspended: bool) -> Iterator[None]:
    """Around bringing a tool computer up: timed when it was `suspended` (a restore) and came up."""
    started = time.monotonic()
    yield
    if suspended:
        _m().restore.observe(time.monotonic() - started)


# -- the exposition -------------------------------------------------------------------------------------------------


class _Observed(Collector):
    """This process's own observations, when they are not shared through files."""

    def collect(self) -> Iterator[Metric]:
        for metric in _m().all():
            yield from metric.collect()


class StoredState(Collector):
    """Gauges counted from the database at each scrape: the same in every process that reads it."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        with read(self._engine) as conn:
            pending_events = conn.execute(select(func.count()).select_from(events)
                                          .where(events.c.status == EventStatus.PENDING.value)).scalar_one()
            open_waits = conn.execute(select(func.count()).select_from(waits)
                                      .where(waits.c.state == WaitState.PENDING.value)).scalar_one()
            active_timers = conn.execute(select(func.count()).select_from(timers)
                                         .where(timers.c.state == TimerState.ACTIVE.value)).scalar_one()
            queued: dict[str, int] = dict(conn.execute(select(outbox.c.state, func.count()).where(outbox.c.state.in_(
                [OutboxState.PENDING.value, OutboxState.HELD.value])).group_by(outbox.c.state)).all())
        yield GaugeMetricFamily("wakeful_events_pending", "Events recorded and not yet taken by a run (the backlog).",
                                value=pending_events)
        yield GaugeMetricFamily("wakeful_waits_pending", "Waits open (approval, reply, reconcile, handoff, deadline).",
                                value=open_waits)
        yield GaugeMetricFamily("wakeful_timers_active", "Follow-ups and recurring checks still to fire.",
                                value=active_timers)
        depth = GaugeMetricFamily("wakeful_outbox_depth", "Messages to users not sent yet: pending (to send now) "
                                  "and held (quiet hours, the attention budget).", labels=["state"])
        for state in (OutboxState.PENDING, OutboxState.HELD):
            depth.add_metric([state.value], queued.get(state.value, 0))
        yield depth


def exposition(engine: Engine) -> bytes:
    """The text `GET /metrics` answers: every process's observations (or this one's) and the stored state."""
    registry = CollectorRegistry(auto_describe=False)
    directory = _shared_directory()
    if directory is not None:
        _forget_dead_processes(directory)
        MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    else:
        registry.register(_Observed())
    registry.register(StoredState(engine))
    return generate_latest(registry)


def _forget_dead_processes(directory: Path) -> None:
    """A tool-computer gauge of a process that died (a restarted worker) no longer counts."""
    for path in directory.glob("gauge_live*_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
        except PermissionError:
            pass
