"""The sweeper: the safety net that makes every acknowledged event eventually processed or explicitly failed.

Each pass, in one write transaction: runs whose lease expired are marked abandoned (their worker died) and the lease is
freed; poison events past the attempt cap are failed and the user told; a pending event without a todo gets one;
a todo whose session has nothing pending is dropped.

It also clears what expired and is no longer of use: console sessions past their expiry (the console already
treats them as signed out; the row only kept a CSRF token alive), and approval links `LINK_KEPT` past theirs. A link
is kept that long after it expired (used or not) so that a late click is told why it no longer opens
(`link_expired`, `link_used`) rather than `unknown_link`; after that it refuses all the same, and one row per approval
request would otherwise pile up for as long as the deployment lives. Neither is history: the approval itself, its
use and the action stay in the ledger.

The event checks look through every pending event or todo (a millisecond per thousand here), and there is almost
never anything to find: they look on a snapshot first, and search again under the write lock only when that found
something, so that a backlog of events does not hold the inbox's commits up for as long as it takes to read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine, and_, delete, exists, or_, select, update

from wakeful.server.core import sessions
from wakeful.server.core.worker import any_poison_unheld, fail_poison_events
from wakeful.server.observe import metrics
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import EventStatus, RunOutcome, approval_links, console_sessions, events, runs, todos
from wakeful.server.store.tables import sessions as sessions_table

__all__ = ["LINK_KEPT", "SweepReport", "sweep"]

LINK_KEPT = timedelta(days=7)
"""How long an approval link is kept after it expired, so that opening it late still says why it refuses."""


@dataclass(frozen=True, kw_only=True)
class SweepReport:
    abandoned_runs: int
    failed_events: int
    rescheduled: int
    dropped_todos: int
    expired_sessions: int = 0
    expired_links: int = 0


def sweep(engine: Engine, *, now: datetime, event_max_attempts: int) -> SweepReport:
    orphaned = and_(events.c.status == EventStatus.PENDING.value,
                    ~exists().where(todos.c.session_id == events.c.session_id))
    idle = and_(todos.c.due_at <= now, ~exists().where(and_(events.c.session_id == todos.c.session_id,
                                                              events.c.status == EventStatus.PENDING.value)))
    with read(engine) as conn:
        found_poison = any_poison_unheld(conn, cap=event_max_attempts, now=now)
        found_orphans = conn.execute(select(events.c.id).where(orphaned).limit(1)).first()
        found_idle = conn.execute(select(todos.c.session_id).where(idle).limit(1)).first()
    expired = and_(sessions_table.c.lease_expires_at.is_not(None), sessions_table.c.lease_expires_at <= now)
    dead_runs = select(runs.c.id).join(sessions_table, sessions_table.c.id == runs.c.session_id).where(
        and_(runs.c.outcome == RunOutcome.RUNNING.value,
             or_(expired, sessions_table.c.fencing_token > runs.c.fencing_token,
                 sessions_table.c.lease_owner.is_(None)))
    )
    with write(engine) as conn:
        abandoned = conn.execute(
            update(runs).where(and_(runs.c.id.in_(dead_runs.scalar_subquery()),
                                    runs.c.outcome == RunOutcome.RUNNING.value))
            .values(outcome=RunOutcome.ABANDONED.value, ended_at=now, reason="the worker's lease expired")
        ).rowcount
        conn.execute(update(sessions_table).where(expired).values(lease_owner=None, lease_expires_at=None))
        failed = fail_poison_events(conn, session_id=None, cap=event_max_attempts, now=now) if found_poison else 0
        orphans = [] if found_orphans is None else conn.execute(
            select(events.c.session_id, events.c.user_id).distinct().where(orphaned)).all()
        for o in orphans:
            sessions.wake(conn, session_id=o.session_id, user_id=o.user_id, due_at=now)
        dropped = 0 if found_idle is None else conn.execute(delete(todos).where(idle)).rowcount
        # Both by their `expires_at` index: a pass that finds nothing reads nothing.
        signed_out = conn.execute(delete(console_sessions).where(console_sessions.c.expires_at <= now)).rowcount
        stale_links = conn.execute(delete(approval_links)
                                   .where(approval_links.c.expires_at <= now - LINK_KEPT)).rowcount
    metrics.run_ended(RunOutcome.ABANDONED.value, count=abandoned)
    return SweepReport(abandoned_runs=abandoned, failed_events=failed, rescheduled=len(orphans), dropped_todos=dropped,
                       expired_sessions=signed_out, expired_links=stale_links)
