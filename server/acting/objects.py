"""Server-issued object IDs: the only way a write tool can name a thing in the outside world.

A read mints an opaque ID per returned object, bound to the user, the task and its version, the object's kind,
the external reference, the read that returned it and an expiry. A write resolves IDs back to references only
when every binding holds; anything else — an ID from an email, another user's, an older task version's, a
made-up string, the wrong kind, an expired one — is `unknown_object`, and the refusal is recorded.

A helper task's reads (`core.helper_tasks`) mint IDs bound to that helper as well: the main run cannot act with
them (nor a helper with the main run's). What a helper found is information; before acting on it, the main run
reads the authoritative data again and acts on the IDs that read returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, select

from wakeful.server.errors import Refused
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import objects, refusals

__all__ = ["IssuedObject", "UnknownObject", "mint", "record_refusal", "resolve"]


class UnknownObject(Refused):
    def __init__(self, object_id: str, why: str) -> None:
        super().__init__("unknown_object", f"{object_id!r} is not an object this task was given ({why}); "
                         "use an ID returned by a read tool in this task", object_id=object_id)
        self.why = why


@dataclass(frozen=True, kw_only=True)
class IssuedObject:
    id: str
    kind: str
    connector: str
    ref: str
    operation: str
    snapshot: dict[str, Any]
    expires_at: datetime


def mint(conn: Connection, *, user_id: str, task_id: str, task_version: int, kind: str, connector: str, ref: str,
         operation: str, snapshot: dict[str, Any], now: datetime, ttl: timedelta,
         helper_id: str | None = None) -> str:
    object_id = new_id("obj")
    conn.execute(objects.insert().values(
        id=object_id, user_id=user_id, task_id=task_id, task_version=task_version, kind=kind, connector=connector,
        ref=ref, operation=operation, snapshot=json.dumps(snapshot, sort_keys=True), created_at=now,
        expires_at=now + ttl, helper_id=helper_id,
    ))
    return object_id


def resolve(conn: Connection, object_id: object, *, user_id: str, task_id: str, task_version: int, kind: str,
            now: datetime, helper_id: str | None = None) -> IssuedObject:
    """The object behind `object_id`, or `UnknownObject` unless it was issued for exactly this user, task
    version, kind and run (the main one, or the helper `helper_id`) and has not expired. The reason is kept for the
    record, never shown as a hint to find others."""
    if not isinstance(object_id, str):
        raise UnknownObject(repr(object_id), "not a string")
    row = conn.execute(select(objects).where(objects.c.id == object_id)).first()
    why = (
        "never issued" if row is None or row.user_id != user_id
        else "issued for another task" if row.task_id != task_id
        else "issued for an older task version" if row.task_version != task_version
        else _other_run(row.helper_id) if row.helper_id != helper_id
        else f"it is a {row.kind}, not a {kind}" if row.kind != kind
        else "expired" if row.expires_at <= now
        else None
    )
    if why is not None or row is None:
        raise UnknownObject(object_id, why or "never issued")
    return IssuedObject(id=row.id, kind=row.kind, connector=row.connector, ref=row.ref, operation=row.operation,
                        snapshot=json.loads(row.snapshot), expires_at=row.expires_at)


def _other_run(helper_id: str | None) -> str:
    if helper_id is None:
        return "issued to the main run, not to this helper"
    return "issued to a helper run: read it again yourself before acting on it"


def record_refusal(conn: Connection, *, user_id: str, task_id: str | None, run_id: str | None, tool: str, code: str,
                   detail: str, now: datetime) -> None:
    conn.execute(refusals.insert().values(id=new_id("ref"), user_id=user_id, task_id=task_id, run_id=run_id,
                                          tool=tool, code=code, detail=detail, created_at=now))
