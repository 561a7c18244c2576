"""The user's hand on memory and its read models: list and show records, confirm or reject what is pending, edit,
correct (trace the evidence, disown it, propagate), forget, clear a review flag, and expire a closed task's records.
Every change is a guarded transition (`UPDATE … WHERE state IN (…)`, raising when no row moved) and a
`memory_changes` row; content is never rewritten (a change is a new version; the schema refuses the rest).

    list_records   a page of the user's records (latest version of each lineage), filtered
    show           one record: every version of its lineage, evidence, what was derived from it, uses, changes
    confirm        pending → a new active version (a hypothesis becomes a preference), by the user
    reject         pending → retired `rejected`
    edit           a new version by the user
    correct        trace, disown the evidence, retire `corrected`, write the user's correction, propagate
    forget         retire `forgotten`, propagate
    mark_reviewed  clear the review flag
    expire_task    a closed or revoked task's task-scoped records retire `expired`
    propagate      invalidate what was derived from a record; name the runs and open tasks that recalled it
    trace          the evidence refs that produced a record, through its lineage and what it was derived from
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from wakeful.server.memory.model import Reach, Stored

__all__ = ["confirm", "correct", "edit", "expire_task", "forget", "list_records", "mark_reviewed", "propagate",
           "reject", "show", "trace"]


def list_records(conn: Connection, user_id: str, *, form: str | None = None, state: str | None = None,
                 review: bool | None = None, task_id: str | None = None, limit: int = 50,
                 after: str | None = None) -> dict[str, Any]:
    """`{"records": [...], "next": id | None}`: the user's records, newest first, after the id `after`."""
    raise NotImplementedError


def show(conn: Connection, user_id: str, memory_id: str) -> dict[str, Any]:
    """One record (any version's id): its versions, evidence, derived records, runs that recalled it, changes.
    `unknown_memory` (404) for an id that is not the user's."""
    raise NotImplementedError


def confirm(conn: Connection, user_id: str, memory_id: str, now: datetime) -> Stored:
    raise NotImplementedError


def reject(conn: Connection, user_id: str, memory_id: str, now: datetime, *, reason: str = "") -> Stored:
    raise NotImplementedError


def edit(conn: Connection, user_id: str, memory_id: str, *, now: datetime, text: str | None = None,
         value: str | None = None, valid_until: datetime | None = None, scope: str | None = None,
         scope_ref: str | None = None) -> Stored:
    raise NotImplementedError


def correct(conn: Connection, user_id: str, memory_id: str, *, reason: str, now: datetime,
            text: str | None = None) -> Stored:
    raise NotImplementedError


def forget(conn: Connection, user_id: str, memory_id: str, *, reason: str, now: datetime) -> Stored:
    raise NotImplementedError


def mark_reviewed(conn: Connection, user_id: str, memory_id: str, now: datetime) -> Stored:
    raise NotImplementedError


def expire_task(conn: Connection, task_id: str, now: datetime) -> list[str]:
    """Retire the task's task-scoped active and pending records `expired`; returns their ids."""
    raise NotImplementedError


def propagate(conn: Connection, memory_id: str, now: datetime) -> Reach:
    raise NotImplementedError


def trace(conn: Connection, memory_id: str) -> list[dict[str, str]]:
    """`[{"type", "id"}]`: the non-memory evidence of the record's lineage and (transitively) of what it was
    derived from, deduplicated, in a stable order."""
    raise NotImplementedError
