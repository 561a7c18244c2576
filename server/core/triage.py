"""The triage session: where a user's deliveries go when they match no wait and no task key.

Each user has one, made by the first delivery that needs it. Two first deliveries at once (two requests, two
processes) make one: the session is claimed by inserting the user's row in `triage_sessions`, whose primary key is
the user; the loser of that insert (on PostgreSQL it waits for the winner's commit, on SQLite the write lock already
ordered them) drops the session it made and takes the winner's. A run in the triage session sees the user's open
tasks (`open_tasks`), and may attach a delivery to one of them as information (`core.attach`) or leave it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, bindparam, delete, select

from wakeful.server.core import sessions
from wakeful.server.core.keys import OPEN
from wakeful.server.store.db import upsert
from wakeful.server.store.tables import sessions as sessions_table
from wakeful.server.store.tables import task_versions, tasks, triage_sessions

__all__ = ["is_triage", "open_tasks", "session_of"]


def session_of(conn: Connection, *, user_id: str, now: datetime) -> str:
    """The user's triage session, made on first use, in the caller's transaction."""
    found = _recorded(conn, user_id)
    if found is not None:
        return found
    made = sessions.create_session(conn, user_id=user_id, now=now)
    claimed = conn.execute(upsert(conn, triage_sessions).values(user_id=user_id, session_id=made, created_at=now)
                           .on_conflict_do_nothing(index_elements=[triage_sessions.c.user_id])
                           .returning(triage_sessions.c.session_id)).first()
    if claimed is not None:
        return made
    conn.execute(delete(sessions_table).where(sessions_table.c.id == made))  # nothing refers to it yet
    winner = _recorded(conn, user_id)
    assert winner is not None, "the insert conflicted with a row it cannot see"
    return winner


def _recorded(conn: Connection, user_id: str) -> str | None:
    found: str | None = conn.execute(_RECORDED, {"user_id": user_id}).scalar()
    return found


_RECORDED = select(triage_sessions.c.session_id).where(triage_sessions.c.user_id == bindparam("user_id"))
"""Built once: on the inbox's hot path (every batch of keyless deliveries)."""


def is_triage(conn: Connection, session_id: str) -> bool:
    return conn.execute(select(triage_sessions.c.user_id)
                        .where(triage_sessions.c.session_id == session_id)).first() is not None


def open_tasks(conn: Connection, user_id: str) -> list[dict[str, Any]]:
    """The user's open tasks, oldest first: ID, title, and the goal and constraints of the current version."""
    rows = conn.execute(
        select(tasks.c.id, tasks.c.title, tasks.c.state, task_versions.c.goal, task_versions.c.constraints)
        .join(task_versions, and_(task_versions.c.task_id == tasks.c.id,
                                  task_versions.c.version == tasks.c.current_version))
        .where(and_(tasks.c.user_id == user_id, tasks.c.state.in_(OPEN)))
        .order_by(tasks.c.created_at, tasks.c.id)).all()
    return [{"task_id": r.id, "title": r.title, "state": r.state, "goal": r.goal,
             "constraints": json.loads(r.constraints)} for r in rows]
