"""Sessions: one run at a time, enforced by a lease and a monotonically increasing fencing token.

A claim is one guarded `UPDATE` that only succeeds when the lease is free or expired and work is due, and bumps the
token. Every commit a run makes first calls `fence` (or `release`, which checks the same), which only succeeds while
the run's token is still the session's latest; a worker that was taken over raises `StaleToken` and its transaction
is rolled back, changing nothing.

The statements every run makes are built once, with bound parameters: building and caching a statement per call
cost SQLAlchemy several times what executing it does, and a run executes them while holding the write lock. (In an
`UPDATE`, a parameter may not be named after a column of its table: SQLAlchemy keeps those names for `SET`.)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import Connection, Insert, and_, bindparam, delete, exists, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from wakeful.server.errors import StaleToken
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import sessions, todos

__all__ = ["claim", "claim_first", "claimable", "create_session", "fence", "holds", "lock", "next_due", "release",
           "settle_todo", "todo_version", "wake"]


def create_session(conn: Connection, *, user_id: str, now: datetime) -> str:
    session_id = new_id("ses")
    conn.execute(sessions.insert().values(id=session_id, user_id=user_id, fencing_token=0, created_at=now))
    return session_id


def lock(conn: Connection, session_id: str) -> None:
    """Take the session's row lock (PostgreSQL); on SQLite the write transaction already holds the database."""
    conn.execute(select(sessions.c.id).where(sessions.c.id == session_id).with_for_update())


def wake(conn: Connection, *, session_id: str, user_id: str, due_at: datetime, hasten: bool = True) -> None:
    """Record that the session has work: create its todo, or bump its version so a running run leaves it.

    A todo falls due at the earliest `due_at` it was given; one given with `hasten=False` (a timer) joins the work
    already there at its time, and is due at `due_at` only when there was none."""
    conn.execute(_wake(conn.dialect.name, hasten),
                 {"session_id": session_id, "user_id": user_id, "version": 1, "due_at": due_at})


@functools.cache
def _wake(dialect: str, hasten: bool) -> Insert:
    """`wake`'s statement, built once per dialect: on the inbox's hot path (every batch), building it cost more than
    executing it."""
    stmt = (postgresql.insert(todos) if dialect == "postgresql" else sqlite.insert(todos))
    earliest = func.least if dialect == "postgresql" else func.min
    return stmt.on_conflict_do_update(
        index_elements=[todos.c.session_id],
        set_={"version": todos.c.version + 1,
              "due_at": earliest(todos.c.due_at, stmt.excluded.due_at) if hasten else todos.c.due_at},
    )


_LEASE_FREE = or_(sessions.c.lease_expires_at.is_(None), sessions.c.lease_expires_at <= bindparam("now"))
_THIS_TOKEN = and_(sessions.c.id == bindparam("session_id"), sessions.c.fencing_token == bindparam("token"))

_CLAIMABLE = (select(todos.c.session_id, todos.c.user_id)
              .join(sessions, sessions.c.id == todos.c.session_id)
              .where(todos.c.due_at <= bindparam("now"))
              .where(_LEASE_FREE)
              .order_by(todos.c.due_at)
              .limit(bindparam("limit")))


_NEXT_DUE = select(func.min(todos.c.due_at)).where(todos.c.due_at > bindparam("now"))


def next_due(conn: Connection, *, now: datetime) -> datetime | None:
    """When the next todo not yet due falls due (None: none is waiting to)."""
    due: datetime | None = conn.execute(_NEXT_DUE, {"now": now}).scalar()
    return due


def claimable(conn: Connection, *, now: datetime, limit: int = 10) -> list[tuple[str, str]]:
    """(session_id, user_id) of sessions with due work and no live lease, oldest first."""
    return [(r.session_id, r.user_id) for r in conn.execute(_CLAIMABLE, {"now": now, "limit": limit})]


_CLAIM = (update(sessions)
          .where(sessions.c.id == bindparam("session_id"))
          .where(_LEASE_FREE)
          .where(exists().where(and_(todos.c.session_id == sessions.c.id, todos.c.due_at <= bindparam("now"))))
          .values(fencing_token=sessions.c.fencing_token + 1, lease_owner=bindparam("worker"),
                  lease_expires_at=bindparam("until"))
          .returning(sessions.c.fencing_token))


def claim(conn: Connection, *, session_id: str, worker: str, now: datetime, lease: timedelta) -> int | None:
    """Take the session if its lease is free and it has work due; returns the new fencing token, or None."""
    token = conn.execute(_CLAIM, {"session_id": session_id, "now": now, "worker": worker,
                                  "until": now + lease}).scalar_one_or_none()
    return None if token is None else int(token)


_PICK = (select(sessions.c.id)
         .join(todos, todos.c.session_id == sessions.c.id)
         .where(sessions.c.id.in_(bindparam("candidates", expanding=True)))
         .where(todos.c.due_at <= bindparam("now"))
         .where(_LEASE_FREE)
         .order_by(todos.c.due_at)
         .limit(1)
         .with_for_update(of=sessions, skip_locked=True)
         .cte("picked").prefix_with("MATERIALIZED"))  # once: as `IN (subquery)` it could run per row (see outbox)
_CLAIM_FIRST = (update(sessions)
                .where(sessions.c.id == _PICK.c.id)
                .where(_LEASE_FREE)
                .values(fencing_token=sessions.c.fencing_token + 1, lease_owner=bindparam("worker"),
                        lease_expires_at=bindparam("until"))
                .returning(sessions.c.id, sessions.c.fencing_token))


def claim_first(conn: Connection, *, candidates: Sequence[str], worker: str, now: datetime,
                lease: timedelta) -> tuple[str, int] | None:
    """Take the first of `candidates` (given oldest first, as `claimable` lists them) whose lease is free and whose
    work is due; returns it and its new fencing token, or None when none could be taken.

    On PostgreSQL, one statement that skips the rows other transactions hold (`FOR UPDATE SKIP LOCKED`): workers
    that looked at the same candidates each take a different one, at once, instead of queueing on the first and
    finding it taken. The row stays locked until the caller's transaction ends. On SQLite (one writer at a time),
    `claim` on each candidate in turn."""
    if not candidates:
        return None
    if conn.dialect.name == "postgresql":
        row = conn.execute(_CLAIM_FIRST, {"candidates": list(candidates), "now": now, "worker": worker,
                                          "until": now + lease}).first()
        return None if row is None else (str(row.id), int(row.fencing_token))
    for session_id in candidates:
        token = claim(conn, session_id=session_id, worker=worker, now=now, lease=lease)
        if token is not None:
            return session_id, token
    return None


_FENCE = update(sessions).where(_THIS_TOKEN).values(fencing_token=sessions.c.fencing_token)
_RENEW = update(sessions).where(_THIS_TOKEN).values(lease_expires_at=bindparam("until"))


def fence(conn: Connection, *, session_id: str, token: int, lease_until: datetime | None = None) -> None:
    """Fail loudly unless `token` is still the session's latest; optionally extend the lease.

    A write (of the token onto itself), so that on PostgreSQL the row stays locked until the transaction ends."""
    if lease_until is None:
        result = conn.execute(_FENCE, {"session_id": session_id, "token": token})
    else:
        result = conn.execute(_RENEW, {"session_id": session_id, "token": token, "until": lease_until})
    if result.rowcount != 1:
        raise StaleToken(session_id, token)


_TOKEN = select(sessions.c.fencing_token).where(sessions.c.id == bindparam("session_id"))


def holds(conn: Connection, *, session_id: str, token: int) -> None:
    """Like `fence`, for a read: fail loudly unless `token` is still the session's latest (as of this snapshot)."""
    if conn.execute(_TOKEN, {"session_id": session_id}).scalar_one_or_none() != token:
        raise StaleToken(session_id, token)


_RELEASE = update(sessions).where(_THIS_TOKEN).values(lease_owner=None, lease_expires_at=None)


def release(conn: Connection, *, session_id: str, token: int) -> None:
    """End the lease of the run holding `token`; fails loudly (as `fence` does) for any other."""
    if conn.execute(_RELEASE, {"session_id": session_id, "token": token}).rowcount != 1:
        raise StaleToken(session_id, token)


_POSTPONE = update(todos).where(todos.c.session_id == bindparam("session")).values(due_at=bindparam("retry_at"))
_SETTLE = delete(todos).where(and_(todos.c.session_id == bindparam("session"),
                                   todos.c.version == bindparam("seen_version")))


def settle_todo(conn: Connection, *, session_id: str, seen_version: int | None, retry_at: datetime | None) -> None:
    """After a run: drop the todo if nothing new arrived since it was read, else leave it due for the next run.

    `retry_at` postpones the todo instead (the run failed and its events stay pending)."""
    if retry_at is not None:
        conn.execute(_POSTPONE, {"session": session_id, "retry_at": retry_at})
    elif seen_version is not None:
        conn.execute(_SETTLE, {"session": session_id, "seen_version": seen_version})


_TODO_VERSION = select(todos.c.version).where(todos.c.session_id == bindparam("session_id"))


def todo_version(conn: Connection, session_id: str) -> int | None:
    return conn.execute(_TODO_VERSION, {"session_id": session_id}).scalar_one_or_none()
