"""Waits: a registered condition with a unique identity, a match key and a deadline.

    pending ──► satisfied | timed_out | cancelled        (terminal states are final)

`resolve` is the one guarded transition (`UPDATE … WHERE id = :id AND state = 'pending'`): it raises
`wait_terminal` when the wait had already ended, and changes nothing then. `cancel`, `settle` and `expire_due` go
through the same guarded UPDATE; the inbox satisfies a wait with its own (it sits below this module).

Every wait records the authority that may satisfy it (`server.core.authority`): the user's control channel for an
approval, the system for a reconciliation, one named webhook source or any webhook source for what a run waits for.
An event whose correlation key equals a pending wait's match key, sent by an authority the wait accepts, satisfies it
and wakes its session (see `server.core.inbox`); one matching only a terminal wait is recorded as late and wakes
nothing; one from any other sender does neither, as if the wait were not there. Registration locks the session first
and looks for an answer that arrived before the wait existed from a sender the wait accepts, so an early answer is
not lost.

A reply wait the agent set (`server.core.agenda`) says what its deadline does (`on_timeout`): `follow_up` wakes the
session with a timeout event saying what was awaited (as every other wait's deadline does), `tell_user` queues one
plain message to the user through the outbox and wakes nothing, `close` only ends it. While its task is paused it
does not time out; it does on resume, if its deadline has passed.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, Row, ScalarSelect, and_, func, or_, select, update

from wakeful.server.core import inbox, outbox, sessions
from wakeful.server.core.authority import may_satisfy
from wakeful.server.errors import Conflict
from wakeful.server.store import users
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import (
    Authority,
    EventKind,
    EventStatus,
    OnTimeout,
    TaskState,
    WaitState,
    events,
    tasks,
    waits,
)

__all__ = ["TERMINAL", "cancel", "expire_due", "next_deadline", "register", "resolve", "settle"]

TERMINAL = frozenset({WaitState.SATISFIED, WaitState.TIMED_OUT, WaitState.CANCELLED})

_EXPIRING = and_(waits.c.state == WaitState.PENDING.value,
                 or_(waits.c.on_timeout.is_(None),
                     waits.c.task_id.not_in(select(tasks.c.id).where(tasks.c.state == TaskState.PAUSED.value))))
"""The waits whose deadline the scheduler acts on: pending ones, but for a paused task's reply waits (they time out
on resume, which wakes the scheduler)."""


def register(conn: Connection, *, user_id: str, session_id: str, match_key: str, kind: str, authority: str,
             deadline: datetime | None, now: datetime, task_id: str | None = None,
             on_timeout: OnTimeout | None = None, note: str | None = None,
             replying_to: Collection[str] | None = None) -> str:
    """A pending wait for `match_key` that only a delivery from `authority` may satisfy (`server.core.authority`);
    `on_timeout` and `note`: a reply wait the agent set (None: its deadline wakes the session).

    A delivery that carried the key before the wait existed answers it at once, except for a reply wait
    (`replying_to` given): what the agent already read (an earlier mail of the thread, the acknowledgement it is
    waiting on, the events `replying_to` names) is not the reply; only a delivery no run has taken yet is."""
    sessions.lock(conn, session_id)
    taken = conn.execute(
        select(waits.c.id).where(and_(waits.c.user_id == user_id, waits.c.match_key == match_key))
    ).first()
    if taken is not None:
        raise Conflict("wait_key_taken", f"a wait with match key {match_key!r} already exists; keys are single-use",
                       match_key=match_key)
    wait_id = new_id("wait")
    early = _early_answer(conn, user_id=user_id, match_key=match_key, authority=authority, replying_to=replying_to)
    conn.execute(
        waits.insert().values(
            id=wait_id, user_id=user_id, session_id=session_id, task_id=task_id, match_key=match_key,
            authority=authority, kind=kind, state=(WaitState.SATISFIED if early else WaitState.PENDING).value,
            deadline=deadline, created_at=now, resolved_at=now if early else None,
            resolved_event_id=early.id if early else None, on_timeout=on_timeout.value if on_timeout else None,
            note=note,
        )
    )
    if early is not None:
        # The answer beat its wait: bring it to this session if no run has taken it yet, and wake the session.
        if early.session_id != session_id:
            conn.execute(update(events).where(and_(events.c.id == early.id,
                                                   events.c.status == EventStatus.PENDING.value))
                         .values(session_id=session_id))
        sessions.wake(conn, session_id=session_id, user_id=user_id, due_at=now)
    return wait_id


def _early_answer(conn: Connection, *, user_id: str, match_key: str, authority: str,
                  replying_to: Collection[str] | None) -> Row[Any, Any, Any] | None:
    """The first event that carried `match_key` before its wait existed, from a sender the wait accepts (for a reply
    wait: one no run has taken, and not one it replies to); or None."""
    senders = conn.execute(select(events.c.authority).distinct()
                           .where(and_(events.c.user_id == user_id, events.c.corr_key == match_key))).scalars()
    accepted = [sender for sender in senders if may_satisfy(authority, sender)]
    if not accepted:
        return None
    which = [events.c.user_id == user_id, events.c.corr_key == match_key, events.c.authority.in_(accepted)]
    if replying_to is not None:
        which += [events.c.status == EventStatus.PENDING.value, events.c.id.not_in(list(replying_to))]
    return conn.execute(select(events.c.id, events.c.session_id, events.c.status).where(and_(*which))
                        .order_by(events.c.received_at).limit(1)).first()


def _end_pending(conn: Connection, *which: ColumnElement[bool], to: WaitState, now: datetime) -> int:
    """The guarded UPDATE every transition is: only a pending wait moves, and only to a terminal state."""
    if to not in TERMINAL:
        raise ValueError(f"a wait only ever moves to a terminal state, not {to}")
    return conn.execute(update(waits).where(and_(*which, waits.c.state == WaitState.PENDING.value))
                        .values(state=to.value, resolved_at=now)).rowcount


def resolve(conn: Connection, *, wait_id: str, to: WaitState, now: datetime) -> None:
    """pending → `to`; raises `wait_terminal` (and changes nothing) if the wait had already ended."""
    if _end_pending(conn, waits.c.id == wait_id, to=to, now=now) != 1:
        raise Conflict("wait_terminal", f"wait {wait_id} is not pending: a wait that ended stays ended",
                       wait_id=wait_id)


def cancel(conn: Connection, *, wait_id: str, now: datetime) -> None:
    """pending → cancelled; raises `wait_terminal` if the wait had already ended."""
    resolve(conn, wait_id=wait_id, to=WaitState.CANCELLED, now=now)


def settle(conn: Connection, *, user_id: str, match_key: str, now: datetime) -> bool:
    """Mark the pending wait with this key satisfied (the answer came by another way); False if none was pending."""
    return _end_pending(conn, waits.c.user_id == user_id, waits.c.match_key == match_key,
                        to=WaitState.SATISFIED, now=now) == 1


def next_deadline() -> ScalarSelect[datetime]:
    """The first deadline `expire_due` would act on (NULL: none), as a subquery for the scheduler."""
    return select(func.min(waits.c.deadline)).where(_EXPIRING).scalar_subquery()


def expire_due(conn: Connection, *, now: datetime, limit: int = 500) -> int:
    """Time out pending waits past their deadline, each as its `on_timeout` says (none: a timeout event wakes the
    wait's session). A reply wait of a paused task is held until the task resumes."""
    due = conn.execute(
        select(waits.c.id, waits.c.user_id, waits.c.session_id, waits.c.task_id, waits.c.match_key,
               waits.c.deadline, waits.c.on_timeout, waits.c.note)
        .where(and_(_EXPIRING, waits.c.deadline <= now))
        .limit(limit)
        .with_for_update(of=waits, skip_locked=True)  # PostgreSQL: waits another scheduler is expiring are its own
    ).all()
    for w in due:
        if _end_pending(conn, waits.c.id == w.id, to=WaitState.TIMED_OUT, now=now) == 1:
            _timed_out(conn, w, now=now)
    return len(due)


def _timed_out(conn: Connection, w: Any, *, now: datetime) -> None:
    if w.on_timeout == OnTimeout.CLOSE.value:
        return
    if w.on_timeout == OnTimeout.TELL_USER.value:
        when = users.in_words(w.deadline, users.zone(conn, w.user_id))
        outbox.enqueue(conn, user_id=w.user_id, session_id=w.session_id, now=now, message_id=f"wto_{w.id}",
                       once=True, body={"kind": "wait_timed_out", "task_id": w.task_id, "wait_id": w.id,
                                        "text": f"No reply came by {when}: I was waiting for "
                                                f"{w.note or 'a reply carrying ' + w.match_key}."})
        return
    inbox.record(conn, inbox.Delivery(
        user_id=w.user_id, source="wait", source_id=f"{w.id}:timed_out", kind=EventKind.WAIT_TIMEOUT,
        trust="system", authority=Authority.SYSTEM, session_id=w.session_id,
        payload={"wait_id": w.id, "match_key": w.match_key,
                 **({"awaited": w.note, "deadline": w.deadline.isoformat()} if w.on_timeout else {})},
    ), now=now)
