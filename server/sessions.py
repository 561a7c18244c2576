"""Sessions: one run at a time, enforced by a lease and a monotonically increasing fencing token.

A claim is one guarded `UPDATE` that only succeeds when the lease is free or expired, and bumps the token. Every
commit a run makes first calls `fence`, which only succeeds while the run's token is still the session's latest;
a worker that was taken over raises `StaleToken` and its transaction is rolled back, changing nothing.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Connection, and_, delete, func, or_, select, update

from server.db import upsert
from server.errors import StaleToken
from server.ids import new_id
from server.tables import sessions, todos

__all__ = ["claim", "claimable", "create_session", "fence", "lock", "release", "settle_todo", "wake"]


def create_session(conn: Connection, *, user_id: str, now: datetime) -> str:
    session_id = new_id("ses")
    conn.execute(sessions.insert().values(id=session_id, user_id=user_id, fencing_token=0, created_at=now))
    return session_id


def lock(conn: Connection, session_id: str) -> None:
    """Take the session's row lock (PostgreSQL); on SQLite the write transaction already holds the database."""
    conn.execute(select(sessions.c.id).where(sessions.c.id == session_id).with_for_update())


def wake(conn: Connection, *, session_id: str, user_id: str, due_at: datetime) -> None:
    """Record that the session has work: create its todo, or bump its version so a running run leaves it."""
    stmt = upsert(conn, todos).values(session_id=session_id, user_id=user_id, version=1, due_at=due_at)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[todos.c.session_id],
            set_={"version": todos.c.version + 1, "due_at": func.min(todos.c.due_at, stmt.excluded.due_at)}
            if conn.dialect.name == "sqlite"
            else {"version": todos.c.version + 1, "due_at": func.least(todos.c.due_at, stmt.excluded.due_at)},
        )
    )


def claimable(conn: Connection, *, now: datetime, limit: int = 10) -> list[tuple[str, str]]:
    """(session_id, user_id) of sessions with due work and no live lease, oldest first."""
    rows = conn.execute(
        select(todos.c.session_id, todos.c.user_id)
        .join(sessions, sessions.c.id == todos.c.session_id)
        .where(todos.c.due_at <= now)
        .where(or_(sessions.c.lease_expires_at.is_(None), sessions.c.lease_expires_at <= now))
        .order_by(todos.c.due_at)
        .limit(limit)
    )
    return [(r.session_id, r.user_id) for r in rows]


def claim(conn: Connection, *, session_id: str, worker: str, now: datetime, lease: timedelta) -> int | None:
    """Take the session if its lease is free; returns the new fencing token, or None if someone holds it."""
    token = conn.execute(
        update(sessions)
        .where(sessions.c.id == session_id)
        .where(or_(sessions.c.lease_expires_at.is_(None), sessions.c.lease_expires_at <= now))
        .values(fencing_token=sessions.c.fencing_token + 1, lease_owner=worker, lease_expires_at=now + lease)
        .returning(sessions.c.fencing_token)
    ).scalar_one_or_none()
    return None if token is None else int(token)


def fence(conn: Connection, *, session_id: str, token: int, lease_until: datetime | None = None) -> None:
    """Fail loudly unless `token` is still the session's latest; optionally extend the lease."""
    stmt = update(sessions).where(and_(sessions.c.id == session_id, sessions.c.fencing_token == token))
    stmt = stmt.values(lease_expires_at=lease_until) if lease_until else stmt.values(fencing_token=token)
    if conn.execute(stmt).rowcount != 1:
        raise StaleToken(session_id, token)


def release(conn: Connection, *, session_id: str, token: int) -> None:
    result = conn.execute(
        update(sessions)
        .where(and_(sessions.c.id == session_id, sessions.c.fencing_token == token))
        .values(lease_owner=None, lease_expires_at=None)
    )
    if result.rowcount != 1:
        raise StaleToken(session_id, token)


def settle_todo(conn: Connection, *, session_id: str, seen_version: int | None, retry_at: datetime | None) -> None:
    """After a run: drop the todo if nothing new arrived since it was read, else leave it due for the next run.

    `retry_at` postpones the todo instead (the run failed and its events stay pending)."""
    if retry_at is not None:
        conn.execute(update(todos).where(todos.c.session_id == session_id).values(due_at=retry_at))
        return
    if seen_version is not None:
        conn.execute(delete(todos).where(and_(todos.c.session_id == session_id, todos.c.version == seen_version)))


def todo_version(conn: Connection, session_id: str) -> int | None:
    return conn.execute(select(todos.c.version).where(todos.c.session_id == session_id)).scalar_one_or_none()
