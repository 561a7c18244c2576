"""Attaching a delivery from triage to a task: information, never authority.

The agent, woken in the triage session, may decide a delivery belongs to one of the user's open tasks. `attach`
records who attached it and why (`event_attachments`, append-only) and gives the task a new event in its session: the
original payload, source and trust, kind and key, labelled as attached. It is recorded as the agent's (authority
`agent`) and goes straight to the task's session, so it satisfies no wait and approves nothing; it only wakes the
task with something to read. An event of another user, one not in the caller's triage session, or a task that is
not open is refused with a stable code.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Connection, and_, select

from wakeful.server.core import inbox, triage
from wakeful.server.core.keys import OPEN
from wakeful.server.errors import Conflict, NotFound
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import Authority, EventKind, event_attachments, events, tasks

__all__ = ["ATTACHED_SOURCE", "attach"]

ATTACHED_SOURCE: Final = "attached"
"""The source of an attached copy; the original's source is in its payload."""


def attach(conn: Connection, *, user_id: str, event_id: str, task_id: str, actor: str, reason: str,
           now: datetime) -> dict[str, Any]:
    """Give the task the triage event as information, in the caller's transaction. Attaching the same event to the
    same task again answers the first attachment."""
    event = conn.execute(select(events).where(and_(events.c.id == event_id, events.c.user_id == user_id))).first()
    if event is None:
        raise NotFound("unknown_event", f"no event {event_id} for this user", event_id=event_id)
    if not triage.is_triage(conn, event.session_id):
        raise Conflict("event_not_in_triage", f"event {event_id} is not in your triage session: only a delivery that "
                                              "found no task can be attached", event_id=event_id)
    task = conn.execute(select(tasks.c.session_id, tasks.c.state).where(and_(
        tasks.c.id == task_id, tasks.c.user_id == user_id))).first()
    if task is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    if task.state not in OPEN:
        raise Conflict("task_not_open", f"task {task_id} is {task.state}: nothing is attached to it",
                       task_id=task_id, state=task.state)
    earlier = conn.execute(select(event_attachments).where(and_(
        event_attachments.c.event_id == event_id, event_attachments.c.task_id == task_id))).first()
    if earlier is not None:
        return _answer(earlier.id, earlier.attached_event_id, task_id, duplicate=True)
    attachment_id = new_id("att")
    recorded = inbox.record(conn, inbox.Delivery(
        user_id=user_id, source=ATTACHED_SOURCE, source_id=attachment_id, kind=EventKind(event.kind),
        trust=event.trust, authority=Authority.AGENT, session_id=task.session_id,
        payload={"attached": {"event_id": event.id, "source": event.source, "source_id": event.source_id,
                              "corr_key": event.corr_key, "trust": event.trust, "by": actor, "reason": reason},
                 "payload": json.loads(event.payload)}), now=now)
    conn.execute(event_attachments.insert().values(
        id=attachment_id, user_id=user_id, event_id=event_id, task_id=task_id, attached_event_id=recorded.event_id,
        actor=actor, reason=reason, created_at=now))
    return _answer(attachment_id, recorded.event_id, task_id, duplicate=False)


def _answer(attachment_id: str, attached_event_id: str, task_id: str, *, duplicate: bool) -> dict[str, Any]:
    return {"attachment_id": attachment_id, "attached_event_id": attached_event_id, "task_id": task_id,
            "duplicate": duplicate}
