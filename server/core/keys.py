"""Task keys: the correlation keys that lead a delivery to its task.

A key (a PNR, an order number, a mail thread ID) belongs to one open task of one user: the user binds it when
delegating, the agent while the task is open, each bind recorded with who, when and why. A delivery carrying it
wakes that task's session (`core.inbox`); the key gives the delivery no authority (a wait is satisfied only by the
senders `core.authority` allows). Closing or revoking the task releases its keys: from then on they route like an
unknown key (to triage), and reopening the task does not bind them again — the user or the agent binds them anew,
since meanwhile another task may hold them. Another user's identical key is another key.

    check         a key's shape, refused with `invalid_task_key`
    bind          bind keys to an open task; one another open task of the user holds is `task_key_taken` (409)
    release       release every key of a task (its close or revoke path)
    session_of    the session of the open task a key is bound to, if any
    of_task       a task's bindings, released ones included, for its status and ledger
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Connection, and_, bindparam, select, update
from sqlalchemy.exc import IntegrityError

from wakeful.server.errors import BadRequest, Conflict, NotFound
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import TaskState, task_keys, tasks

__all__ = ["KEY_PATTERN", "MAX_KEYS", "OPEN", "bind", "check", "of_task", "release", "session_of"]

KEY_PATTERN: Final = r"^[^\s\x00-\x1f\x7f\ud800-\udfff]{1,200}$"
"""1 to 200 characters, none of them a space, a control character or half a surrogate pair: what a webhook's
correlation key can be compared with on every database."""

MAX_KEYS: Final = 20
"""Keys one request may bind."""

OPEN: Final = frozenset({TaskState.ACTIVE.value, TaskState.PAUSED.value})
"""The states in which a task holds its keys."""

_KEY = re.compile(KEY_PATTERN)


def check(key: Any) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise BadRequest("invalid_task_key", f"{str(key)[:80]!r} is not a key: 1 to 200 characters, no spaces or "
                                             "control characters", key=str(key)[:80])
    return key


def bind(conn: Connection, *, user_id: str, task_id: str, keys: Iterable[str], actor: str, reason: str,
         now: datetime) -> list[str]:
    """Bind `keys` to the user's open task, in the caller's transaction; a key the task holds already is kept as it
    is. Returns the keys newly bound."""
    wanted = list(dict.fromkeys(check(k) for k in keys))
    if len(wanted) > MAX_KEYS:
        raise BadRequest("invalid_task_key", f"at most {MAX_KEYS} keys at once", count=len(wanted))
    state = conn.execute(select(tasks.c.state).where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id))
                         .with_for_update()).scalar()
    if state is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    if state not in OPEN:
        raise Conflict("task_not_open", f"task {task_id} is {state}: keys are bound only to an open task",
                       task_id=task_id, state=state)
    bound = []
    for key in wanted:
        holder = conn.execute(select(task_keys.c.task_id).where(and_(
            task_keys.c.user_id == user_id, task_keys.c.key == key, task_keys.c.released_at.is_(None)))).scalar()
        if holder == task_id:
            continue
        if holder is not None:
            raise Conflict("task_key_taken", f"the key {key!r} is bound to your open task {holder}", key=key,
                           task_id=holder)
        try:  # another transaction may be binding it right now: the schema's unique index decides
            with conn.begin_nested():
                conn.execute(task_keys.insert().values(id=new_id("key"), user_id=user_id, task_id=task_id, key=key,
                                                       bound_by=actor, reason=reason, bound_at=now))
        except IntegrityError:
            raise Conflict("task_key_taken", f"the key {key!r} was just bound to another open task of yours",
                           key=key) from None
        bound.append(key)
    return bound


def release(conn: Connection, *, task_id: str, now: datetime) -> None:
    conn.execute(update(task_keys).where(and_(task_keys.c.task_id == task_id, task_keys.c.released_at.is_(None)))
                 .values(released_at=now))


def session_of(conn: Connection, *, user_id: str, key: str) -> str | None:
    """The session of the user's open task bound to `key` (a released key leads nowhere)."""
    found: str | None = conn.execute(
        select(tasks.c.session_id).join(task_keys, task_keys.c.task_id == tasks.c.id)
        .where(and_(task_keys.c.user_id == user_id, task_keys.c.key == key, task_keys.c.released_at.is_(None)))
    ).scalar()
    return found


_OF_TASK = (select(task_keys).where(task_keys.c.task_id == bindparam("task_id"))
            .order_by(task_keys.c.bound_at, task_keys.c.id))


def of_task(conn: Connection, task_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(_OF_TASK, {"task_id": task_id}).all()
    return [{"key": r.key, "bound_by": r.bound_by, "reason": r.reason, "bound_at": r.bound_at.isoformat(),
             "released_at": r.released_at.isoformat() if r.released_at else None} for r in rows]
