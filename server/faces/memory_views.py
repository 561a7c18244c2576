"""Memory as the user's faces show it: the HTTP routes (`server.faces.memory_routes`) and the CLI
(`server.faces.cli_memory`) call these, each in the caller's transaction, and answer what they return. They put the
user's hand (`server.memory`) into the answer shapes `server.faces.schemas` declares (`MemoryRecord`, `MemoryPage`,
`MemoryDetail`, `MemoryChanged`), so both faces say the same thing, and they fill in what the user's own writes
mean: spoken by the user (by name), active, confirmed by the change that wrote it.

    page / detail                      read
    add                                the user writes an instruction, a preference or a fact
    confirm / reject / edit / correct / forget / reviewed   the user's hand on a record
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from wakeful.server import memory
from wakeful.server.errors import BadRequest, WakefulError
from wakeful.server.memory.committer import try_propose
from wakeful.server.store.tables import MemoryScope
from wakeful.server.store.users import name_of

__all__ = ["USER_FORMS", "add", "confirm", "correct", "detail", "edit", "forget", "page", "record", "reject",
           "reviewed"]

USER_FORMS = ("instruction", "preference", "fact")
"""What the user writes by hand; the other forms are what the agent learns (and the user confirms or rejects)."""

RECORD_FIELDS = ("memory_id", "lineage_id", "version", "supersedes", "form", "state", "subject", "relation", "value",
                 "text", "scope", "scope_ref", "speaker", "speaker_name", "confidence", "review", "run_id", "task_id",
                 "confirmed_by", "confirmed_at", "valid_from", "valid_until", "recorded_at", "retired_at",
                 "retire_reason", "retired_by", "topics")


def record(row: Mapping[str, Any]) -> dict[str, Any]:
    """One version as `MemoryRecord`, from the read model (`memory.list_records`, `memory.show`), which already gives
    its times in ISO form, `review` as a bool and `topics` sorted: only the ID's name differs."""
    return {"memory_id": row["id"], **{k: row[k] for k in RECORD_FIELDS[1:]}}


def page(conn: Connection, user_id: str, *, form: str | None, state: str | None, review: bool | None,
         task_id: str | None, after: str | None, limit: int) -> dict[str, Any]:
    listed = memory.list_records(conn, user_id, form=form, state=state, review=review, task_id=task_id, limit=limit,
                                 after=after)
    return {"records": [record(r) for r in listed["records"]], "next": listed.get("next")}


def detail(conn: Connection, user_id: str, memory_id: str) -> dict[str, Any]:
    shown = memory.show(conn, user_id, memory_id)
    return {"record": record(shown["record"]), "versions": [record(v) for v in shown["versions"]],
            "evidence": [{"type": t, "id": i} for t, i in dict.fromkeys((e["type"], e["id"])
                                                                        for e in shown["evidence"])],
            "derived": list(dict.fromkeys(d["id"] for d in shown["derived"])),
            "recalled_by": list(dict.fromkeys(r["run_id"] for r in shown["recalled_by"])),
            "changes": [_change(c) for c in shown["changes"]]}


def _change(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"change_id": row["id"], **{k: row.get(k) for k in ("memory_id", "change", "actor", "run_id", "task_id",
                                                                "code", "detail", "at")}}


def _changed(stored: memory.Stored) -> dict[str, Any]:
    return stored.to_json()


def add(conn: Connection, user_id: str, body: Mapping[str, Any], *, now: datetime) -> dict[str, Any] | WakefulError:
    """The user's own record: an instruction, a preference or a fact (for `always` unless a scope is given),
    through the committer like every other. A refusal is recorded and returned, not raised: the caller commits, so
    that its record stays, then raises it."""
    if body.get("form") not in USER_FORMS:
        raise BadRequest("invalid_memory", f"you write an instruction, a preference or a fact; {body.get('form')!r} "
                                           "is what the agent learns (confirm or reject those)")
    proposal = memory.parse_proposal({k: v for k, v in body.items() if v is not None})
    task_id = proposal.scope_ref if proposal.scope == MemoryScope.TASK else None  # its changes are in its ledger
    actor = memory.Actor(kind=memory.ActorKind.USER, name=name_of(conn, user_id), task_id=task_id)
    stored = try_propose(conn, user_id=user_id, actor=actor, proposal=proposal, now=now)
    return stored if isinstance(stored, WakefulError) else _changed(stored)


def confirm(conn: Connection, user_id: str, memory_id: str, *, now: datetime) -> dict[str, Any]:
    return _changed(memory.confirm(conn, user_id, memory_id, now))


def reject(conn: Connection, user_id: str, memory_id: str, *, now: datetime) -> dict[str, Any]:
    return _changed(memory.reject(conn, user_id, memory_id, now))


def edit(conn: Connection, user_id: str, memory_id: str, changes: Mapping[str, Any], *,
         now: datetime) -> dict[str, Any]:
    if not changes:
        raise BadRequest("invalid_memory", "an edit changes something: text, value, scope, scope_ref or valid_until")
    return _changed(memory.edit(conn, user_id, memory_id, now=now, **changes))


def correct(conn: Connection, user_id: str, memory_id: str, *, reason: str, text: str | None,
            now: datetime) -> dict[str, Any]:
    return _changed(memory.correct(conn, user_id, memory_id, reason=reason, text=text, now=now))


def forget(conn: Connection, user_id: str, memory_id: str, *, reason: str, now: datetime) -> dict[str, Any]:
    return _changed(memory.forget(conn, user_id, memory_id, reason=reason, now=now))


def reviewed(conn: Connection, user_id: str, memory_id: str, *, now: datetime) -> dict[str, Any]:
    return _changed(memory.mark_reviewed(conn, user_id, memory_id, now))
