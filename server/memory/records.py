"""The user's hand on memory and its read models: list and show records, confirm or reject what is pending, edit,
correct (trace the evidence, disown it, propagate), forget, clear a review flag, and expire a closed task's records.
Every change is a guarded transition (`UPDATE … WHERE state IN (…)`, raising when no row moved) and a
`memory_changes` row; content is never rewritten (a change is a new version; the schema refuses the rest).

    list_records   a page of the user's records (the latest version of each), filtered
    show           one record: every version of its lineage, evidence, what was derived from it, uses, changes
    confirm        pending → a new active version (a hypothesis becomes a preference), by the user
    reject         pending → retired `rejected`
    edit           a new active version by the user
    correct        trace, disown the evidence, retire `corrected`, write the user's correction, propagate
    forget         retire `forgotten`, propagate
    mark_reviewed  clear the review flag
    expire_task    a closed or revoked task's task-scoped records retire `expired`
    propagate      invalidate what was derived from a record; name the runs and open tasks that recalled it
    trace          the evidence refs that produced a record, through its lineage and what it was derived from
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Connection, and_, or_, select, update

from wakeful.server.errors import BadRequest, Conflict, NotFound, Refused, WakefulError
from wakeful.server.memory.committer import change, retire_contradicted, same_key, write_version
from wakeful.server.memory.model import Actor, ActorKind, Proposal, Reach, Stored
from wakeful.server.memory.rules import Facts, Refusal, check, storable
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import (
    MemoryForm,
    MemoryScope,
    MemoryState,
    Speaker,
    TaskState,
    memories,
    memory_changes,
    memory_disowned,
    memory_links,
    memory_topics,
    memory_uses,
    runs,
    tasks,
)
from wakeful.server.store.users import name_of

__all__ = ["LIVE", "confirm", "correct", "edit", "expire_task", "forget", "list_records", "mark_reviewed",
           "propagate", "reject", "show", "trace"]

LIVE: Final = (MemoryState.ACTIVE.value, MemoryState.PENDING.value)
"""States a record is changed from: a retired version is history."""

_MAX_REASON: Final = 1000
_MAX_PAGE: Final = 200


def _user(user_id: str) -> Actor:
    return Actor(kind=ActorKind.USER, name=user_id)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _record(row: Any, topics: Iterable[str] = ()) -> dict[str, Any]:
    return {"id": row.id, "lineage_id": row.lineage_id, "version": row.version, "supersedes": row.supersedes,
            "form": row.form, "state": row.state, "subject": row.subject, "relation": row.relation,
            "value": row.value, "text": row.text, "scope": row.scope, "scope_ref": row.scope_ref,
            "speaker": row.speaker, "speaker_name": row.speaker_name, "confidence": row.confidence,
            "review": bool(row.review), "run_id": row.run_id, "task_id": row.task_id,
            "confirmed_by": row.confirmed_by, "confirmed_at": _iso(row.confirmed_at),
            "valid_from": _iso(row.valid_from), "valid_until": _iso(row.valid_until),
            "recorded_at": _iso(row.recorded_at), "retired_at": _iso(row.retired_at),
            "retire_reason": row.retire_reason, "retired_by": row.retired_by, "topics": sorted(topics)}


def _topics(conn: Connection, ids: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {i: [] for i in ids}
    if ids:
        for r in conn.execute(select(memory_topics.c.memory_id, memory_topics.c.topic)
                              .where(memory_topics.c.memory_id.in_(ids))):
            out[r.memory_id].append(r.topic)
    return out


def _version(conn: Connection, user_id: str, memory_id: str) -> Any:
    row = conn.execute(select(memories).where(and_(memories.c.id == memory_id, memories.c.user_id == user_id))).first()
    if row is None:
        raise NotFound("unknown_memory", f"no memory {str(memory_id)[:40]} of yours", memory_id=str(memory_id)[:40])
    return row


def _live(conn: Connection, user_id: str, memory_id: str, states: tuple[str, ...] = LIVE) -> Any:
    """The lineage's version in one of `states` (the one a change applies to), by any version's id."""
    row = _version(conn, user_id, memory_id)
    live = conn.execute(select(memories).where(and_(memories.c.lineage_id == row.lineage_id,
                                                    memories.c.state.in_(states)))
                        .order_by(memories.c.version.desc())).first()
    if live is None:
        latest = conn.execute(select(memories.c.state).where(memories.c.lineage_id == row.lineage_id)
                              .order_by(memories.c.version.desc())).scalar()
        raise Conflict("invalid_transition", f"memory {memory_id} is {latest}: only a record in state "
                                             f"{' or '.join(states)} can change so", memory_id=memory_id,
                       state=latest)
    return live


def _retire(conn: Connection, memory_id: str, *, sources: tuple[str, ...], reason: str, by: str, now: datetime,
            review: bool = False) -> None:
    moved = conn.execute(update(memories).where(and_(memories.c.id == memory_id, memories.c.state.in_(sources)))
                         .values(state=MemoryState.RETIRED.value, retired_at=now, retire_reason=reason,
                                 retired_by=by, review=review)).rowcount
    if moved != 1:
        raise Conflict("invalid_transition", f"memory {memory_id} changed meanwhile: it is no longer "
                                             f"{' or '.join(sources)}", memory_id=memory_id)


def _error(refusal: Refusal) -> WakefulError:
    return (BadRequest if refusal.malformed else Refused)(refusal.code, refusal.message)


def _reason(reason: str) -> str:
    if not isinstance(reason, str) or not reason.strip() or len(reason) > _MAX_REASON or not storable(reason):
        raise BadRequest("invalid_memory", f"a reason of 1 to {_MAX_REASON} characters is needed")
    return reason.strip()


def _links(conn: Connection, memory_ids: Iterable[str]) -> list[tuple[str, str]]:
    ids = list(memory_ids)
    rows = conn.execute(select(memory_links.c.ref_type, memory_links.c.ref_id)
                        .where(memory_links.c.memory_id.in_(ids)).order_by(memory_links.c.ref_type,
                                                                            memory_links.c.ref_id)).all()
    return list(dict.fromkeys((r.ref_type, r.ref_id) for r in rows))


def _lineage_ids(conn: Connection, lineage_id: str) -> list[str]:
    return list(conn.execute(select(memories.c.id).where(memories.c.lineage_id == lineage_id)
                             .order_by(memories.c.version)).scalars())


def _new_version(conn: Connection, user_id: str, live: Any, *, proposal: Proposal, kind: str, now: datetime,
                 detail: dict[str, Any] | None = None) -> Stored:
    """A new active version of `live` by the user (confirm, edit): the rules judge it as the user's word, a rival
    on its subject and relation is retired `contradicted`, the old version `superseded`."""
    actor = Actor(kind=ActorKind.USER, task_id=live.task_id, run_id=live.run_id, name=user_id)
    name = name_of(conn, user_id)
    lineage = set(_lineage_ids(conn, live.lineage_id))
    rivals = tuple(e for e in same_key(conn, user_id, proposal.subject, proposal.relation) if e.id not in lineage)
    verdict = check(proposal, actor, Facts(user_name=name, same_key=rivals))
    if isinstance(verdict, Refusal):
        raise _error(verdict)
    if live.speaker != Speaker.USER.value and kind == "confirmed":
        # who said it stays who said it (the agent, a named third party): the user confirmed it
        verdict = replace(verdict, speaker=Speaker(live.speaker), speaker_name=live.speaker_name)
    _retire(conn, live.id, sources=LIVE, reason="superseded", by="user", now=now)
    retire_contradicted(conn, ids=verdict.retire, by="user", review=False, now=now)
    change_id = new_id("mch")
    memory_id = write_version(conn, user_id=user_id, verdict=verdict, proposal=proposal, actor=actor, now=now,
                              lineage_id=live.lineage_id, version=live.version + 1, supersedes=live.id,
                              confirmed_by=change_id, task_id=live.task_id, run_id=live.run_id,
                              links=_links(conn, [live.id]))
    change(conn, user_id=user_id, memory_id=memory_id, kind=kind, actor=actor, now=now, change_id=change_id,
           detail={"supersedes": live.id, "retired": list(verdict.retire), **(detail or {})}, task_id=live.task_id)
    return Stored(memory_id=memory_id, lineage_id=live.lineage_id, version=live.version + 1,
                  state=MemoryState.ACTIVE.value, form=verdict.form.value, change_id=change_id,
                  retired=verdict.retire)


def _as_proposal(live: Any, **changes: Any) -> Proposal:
    base: dict[str, Any] = {"form": live.form, "text": live.text, "subject": live.subject,
                            "relation": live.relation, "value": live.value, "scope": live.scope,
                            "scope_ref": live.scope_ref, "valid_from": live.valid_from,
                            "valid_until": live.valid_until, "confidence": live.confidence,
                            "speaker_name": live.speaker_name if live.speaker == "third_party" else None}
    base.update({k: v for k, v in changes.items() if v is not None})
    try:
        return Proposal.model_validate(base)
    except ValueError as exc:
        raise BadRequest("invalid_memory", str(exc).splitlines()[0]) from None


def confirm(conn: Connection, user_id: str, memory_id: str, now: datetime) -> Stored:
    """The user confirms a pending record: a new active version (a hypothesis becomes a preference), confirmed by
    this change; the pending version retires `superseded`."""
    live = _live(conn, user_id, memory_id, (MemoryState.PENDING.value,))
    form = MemoryForm.PREFERENCE if live.form == MemoryForm.HYPOTHESIS.value else None
    proposal = _as_proposal(live, form=form)
    if form is not None:
        proposal = proposal.model_copy(update={"confidence": None})
    return _new_version(conn, user_id, live, proposal=proposal, kind="confirmed", now=now,
                        detail={"from_form": live.form})


def reject(conn: Connection, user_id: str, memory_id: str, now: datetime, *, reason: str = "") -> Stored:
    """The user rejects a pending record: retired `rejected`."""
    live = _live(conn, user_id, memory_id, (MemoryState.PENDING.value,))
    _retire(conn, live.id, sources=(MemoryState.PENDING.value,), reason="rejected", by="user", now=now)
    change_id = change(conn, user_id=user_id, memory_id=live.id, kind="rejected", actor=_user(user_id), now=now,
                       detail={"reason": str(reason)[:_MAX_REASON]}, task_id=live.task_id)
    return Stored(memory_id=live.id, lineage_id=live.lineage_id, version=live.version,
                  state=MemoryState.RETIRED.value, form=live.form, change_id=change_id)


def edit(conn: Connection, user_id: str, memory_id: str, *, now: datetime, text: str | None = None,
         value: str | None = None, valid_until: datetime | None = None, scope: str | None = None,
         scope_ref: str | None = None) -> Stored:
    """The user edits a record: a new active version in their words (a pending one is confirmed by it)."""
    if all(v is None for v in (text, value, valid_until, scope, scope_ref)):
        raise BadRequest("invalid_memory", "an edit changes at least one of text, value, valid_until, scope")
    live = _live(conn, user_id, memory_id)
    if scope is not None and scope != live.scope and scope_ref is None:
        scope_ref = None if scope in (MemoryScope.ALWAYS.value,) else live.scope_ref
    changes: dict[str, Any] = {"text": text, "value": value, "valid_until": valid_until, "scope": scope,
                               "scope_ref": scope_ref}
    if live.form == MemoryForm.HYPOTHESIS.value:
        changes.update(form=MemoryForm.PREFERENCE)
    proposal = _as_proposal(live, **changes)
    if scope == MemoryScope.ALWAYS.value:
        proposal = proposal.model_copy(update={"scope_ref": None})
    edited = sorted(k for k, v in changes.items() if v is not None and k != "form")
    return _new_version(conn, user_id, live, proposal=proposal, kind="edited", now=now, detail={"edited": edited})


def trace(conn: Connection, memory_id: str) -> list[dict[str, str]]:
    """`[{"type", "id"}]`: the evidence (not memory refs) of the record's lineage and, transitively, of the records
    it was derived from; deduplicated, in a stable order. Empty for an unknown id."""
    row = conn.execute(select(memories.c.lineage_id).where(memories.c.id == memory_id)).first()
    if row is None:
        return []
    seen: set[str] = set()
    todo = [row.lineage_id]
    found: dict[tuple[str, str], None] = {}
    while todo:
        lineage = todo.pop()
        if lineage in seen:
            continue
        seen.add(lineage)
        for ref_type, ref_id in _links(conn, _lineage_ids(conn, lineage)):
            if ref_type == "memory":
                parent = conn.execute(select(memories.c.lineage_id).where(memories.c.id == ref_id)).scalar()
                if parent is not None:
                    todo.append(parent)
            else:
                found[(ref_type, ref_id)] = None
    return [{"type": t, "id": i} for t, i in sorted(found)]


def propagate(conn: Connection, memory_id: str, now: datetime) -> Reach:
    """Retire `invalidated` (review set) every live record derived from `memory_id`'s lineage, transitively; name
    the runs that recalled any version of it and the open tasks of those runs' sessions (their next wake is told;
    nothing already said is rewritten)."""
    row = conn.execute(select(memories.c.lineage_id, memories.c.user_id).where(memories.c.id == memory_id)).first()
    if row is None:
        return Reach(at=now)
    versions = _lineage_ids(conn, row.lineage_id)
    invalidated: list[str] = []
    frontier, seen = list(versions), set(versions)
    while frontier:
        children = conn.execute(select(memories.c.id, memories.c.lineage_id, memories.c.state)
                                .join(memory_links, memory_links.c.memory_id == memories.c.id)
                                .where(and_(memory_links.c.ref_type == "memory",
                                            memory_links.c.ref_id.in_(frontier)))
                                .order_by(memories.c.id)).all()
        frontier = []
        for child in children:
            for version in _lineage_ids(conn, child.lineage_id):
                if version not in seen:
                    seen.add(version)
                    frontier.append(version)
            if child.state in LIVE and child.id not in invalidated:
                _retire(conn, child.id, sources=LIVE, reason="invalidated", by="system", now=now, review=True)
                change(conn, user_id=row.user_id, memory_id=child.id, kind="invalidated", actor="system", now=now,
                       detail={"derived_from": memory_id})
                invalidated.append(child.id)
    recalled = conn.execute(select(memory_uses.c.run_id, runs.c.session_id)
                            .join(runs, runs.c.id == memory_uses.c.run_id)
                            .where(memory_uses.c.memory_id.in_(versions)).order_by(memory_uses.c.run_id)).all()
    sessions = {r.session_id for r in recalled}
    open_tasks = conn.execute(select(tasks.c.id).where(and_(
        tasks.c.session_id.in_(sessions), tasks.c.state.in_([TaskState.ACTIVE.value, TaskState.PAUSED.value])))
        .order_by(tasks.c.id)).scalars().all() if sessions else []
    return Reach(invalidated=tuple(invalidated), runs=tuple(dict.fromkeys(r.run_id for r in recalled)),
                 tasks=tuple(open_tasks), at=now)


def correct(conn: Connection, user_id: str, memory_id: str, *, reason: str, now: datetime,
            text: str | None = None) -> Stored:
    """The repair: the evidence that produced the record is disowned (it never again supports an inference), the
    record retires `corrected`, the user's correction (`text`) is written as their statement, and what was derived
    from it is invalidated (`propagate`)."""
    why = _reason(reason)
    live = _live(conn, user_id, memory_id)
    refs = trace(conn, live.id)
    known = {(r.ref_type, r.ref_id) for r in conn.execute(
        select(memory_disowned.c.ref_type, memory_disowned.c.ref_id).where(memory_disowned.c.user_id == user_id))}
    for ref in refs:
        if (ref["type"], ref["id"]) not in known:
            conn.execute(memory_disowned.insert().values(user_id=user_id, ref_type=ref["type"], ref_id=ref["id"],
                                                         memory_id=live.id, reason=why, created_at=now))
    _retire(conn, live.id, sources=LIVE, reason="corrected", by="user", now=now)
    reach = propagate(conn, live.id, now)
    statement = None
    if text is not None:
        actor = Actor(kind=ActorKind.USER, name=user_id, task_id=live.task_id)
        proposal = _as_proposal(live, form=MemoryForm.STATEMENT, text=text, relation="said",
                                value=text[:200].strip() or "-", scope=MemoryScope.ALWAYS.value, confidence=None)
        proposal = proposal.model_copy(update={"scope_ref": None, "confidence": None, "valid_until": None,
                                               "valid_from": None})
        name = name_of(conn, user_id)
        verdict = check(proposal, actor, Facts(user_name=name))
        if isinstance(verdict, Refusal):
            raise _error(verdict)
        statement = write_version(conn, user_id=user_id, verdict=verdict, proposal=proposal, actor=actor, now=now,
                                  task_id=live.task_id, run_id=None, links=[("memory", live.id)],
                                  confirmed_by=None)
        change(conn, user_id=user_id, memory_id=statement, kind="committed", actor=actor, now=now,
               detail={"correction_of": live.id}, task_id=live.task_id)
    change_id = change(conn, user_id=user_id, memory_id=live.id, kind="corrected", actor=_user(user_id), now=now,
                       detail={"reason": why, "disowned": refs, "statement": statement, "reach": reach.to_json()},
                       task_id=live.task_id)
    return Stored(memory_id=live.id, lineage_id=live.lineage_id, version=live.version,
                  state=MemoryState.RETIRED.value, form=live.form, change_id=change_id, reach=reach)


def forget(conn: Connection, user_id: str, memory_id: str, *, reason: str, now: datetime) -> Stored:
    """The user deletes a record: it retires `forgotten` (kept, with why) and what was derived from it is
    invalidated (`propagate`)."""
    why = _reason(reason)
    live = _live(conn, user_id, memory_id)
    _retire(conn, live.id, sources=LIVE, reason="forgotten", by="user", now=now)
    reach = propagate(conn, live.id, now)
    change_id = change(conn, user_id=user_id, memory_id=live.id, kind="forgotten", actor=_user(user_id), now=now,
                       detail={"reason": why, "reach": reach.to_json()}, task_id=live.task_id)
    return Stored(memory_id=live.id, lineage_id=live.lineage_id, version=live.version,
                  state=MemoryState.RETIRED.value, form=live.form, change_id=change_id, reach=reach)


def mark_reviewed(conn: Connection, user_id: str, memory_id: str, now: datetime) -> Stored:
    """The user saw a retirement they did not make: the review flag clears."""
    row = _version(conn, user_id, memory_id)
    moved = conn.execute(update(memories).where(and_(memories.c.id == row.id, memories.c.review.is_(True)))
                         .values(review=False)).rowcount
    if moved != 1:
        raise Conflict("invalid_transition", f"memory {memory_id} is not flagged for review", memory_id=memory_id)
    change_id = change(conn, user_id=user_id, memory_id=row.id, kind="reviewed", actor=_user(user_id), now=now,
                       task_id=row.task_id)
    return Stored(memory_id=row.id, lineage_id=row.lineage_id, version=row.version, state=row.state, form=row.form,
                  change_id=change_id)


def expire_task(conn: Connection, task_id: str, now: datetime) -> list[str]:
    """Retire the task's task-scoped active and pending records `expired` (its close or revoke path); returns their
    ids. Wider records are untouched: a narrower one only overrode them while it held."""
    rows = conn.execute(select(memories.c.id, memories.c.user_id).where(and_(
        memories.c.scope == MemoryScope.TASK.value, memories.c.scope_ref == task_id, memories.c.state.in_(LIVE)))
        .order_by(memories.c.id)).all()
    for r in rows:
        _retire(conn, r.id, sources=LIVE, reason="expired", by="system", now=now)
        change(conn, user_id=r.user_id, memory_id=r.id, kind="expired", actor="system", now=now, task_id=task_id)
    return [r.id for r in rows]


def list_records(conn: Connection, user_id: str, *, form: str | None = None, state: str | None = None,
                 review: bool | None = None, task_id: str | None = None, limit: int = 50,
                 after: str | None = None) -> dict[str, Any]:
    """`{"records": [...], "next": id | None}`: the latest version of each of the user's records, in the order
    they were recorded, after the version id `after` (`next` is the cursor of the following page)."""
    if form is not None and form not in {f.value for f in MemoryForm}:
        raise BadRequest("invalid_memory", f"no form {str(form)[:40]!r}")
    if state is not None and state not in {s.value for s in MemoryState}:
        raise BadRequest("invalid_memory", f"no state {str(state)[:40]!r}")
    if not 1 <= limit <= _MAX_PAGE:
        raise BadRequest("invalid_memory", f"limit is 1 to {_MAX_PAGE}")
    newer = memories.alias("newer")
    latest = ~select(newer.c.id).where(and_(newer.c.lineage_id == memories.c.lineage_id,
                                            newer.c.version > memories.c.version)).exists()
    query = select(memories).where(and_(memories.c.user_id == user_id, latest))
    if form is not None:
        query = query.where(memories.c.form == form)
    if state is not None:
        query = query.where(memories.c.state == state)
    if review is not None:
        query = query.where(memories.c.review.is_(review))
    if task_id is not None:
        query = query.where(or_(memories.c.task_id == task_id, and_(memories.c.scope == MemoryScope.TASK.value,
                                                                    memories.c.scope_ref == task_id)))
    if after is not None:
        query = query.where(memories.c.id > after)
    rows = conn.execute(query.order_by(memories.c.id).limit(limit + 1)).all()
    page = rows[:limit]
    topics = _topics(conn, [r.id for r in page])
    return {"records": [_record(r, topics[r.id]) for r in page],
            "next": page[-1].id if len(rows) > limit else None}


def show(conn: Connection, user_id: str, memory_id: str) -> dict[str, Any]:
    """One record (any version's id): `record` (its latest version), `versions`, `evidence` (refs, with the version
    that names them), `derived` (records made from it), `recalled_by` (runs), `changes`. `unknown_memory` (404) for
    an id that is not the user's."""
    row = _version(conn, user_id, memory_id)
    versions = conn.execute(select(memories).where(memories.c.lineage_id == row.lineage_id)
                            .order_by(memories.c.version)).all()
    ids = [v.id for v in versions]
    topics = _topics(conn, ids)
    links = conn.execute(select(memory_links).where(memory_links.c.memory_id.in_(ids))
                         .order_by(memory_links.c.memory_id, memory_links.c.ref_type, memory_links.c.ref_id)).all()
    derived = conn.execute(select(memories.c.id, memories.c.form, memories.c.state, memories.c.text)
                           .join(memory_links, memory_links.c.memory_id == memories.c.id)
                           .where(and_(memory_links.c.ref_type == "memory", memory_links.c.ref_id.in_(ids)))
                           .order_by(memories.c.id)).all()
    uses = conn.execute(select(memory_uses.c.run_id, memory_uses.c.memory_id)
                        .where(memory_uses.c.memory_id.in_(ids)).order_by(memory_uses.c.run_id)).all()
    changes = conn.execute(select(memory_changes).where(memory_changes.c.memory_id.in_(ids))
                           .order_by(memory_changes.c.at, memory_changes.c.id)).all()
    return {"record": _record(versions[-1], topics[versions[-1].id]),
            "versions": [_record(v, topics[v.id]) for v in versions],
            "evidence": [{"type": ln.ref_type, "id": ln.ref_id, "memory_id": ln.memory_id} for ln in links],
            "derived": [{"id": d.id, "form": d.form, "state": d.state, "text": d.text} for d in derived],
            "recalled_by": [{"run_id": u.run_id, "memory_id": u.memory_id} for u in uses],
            "changes": [{"id": c.id, "memory_id": c.memory_id, "change": c.change, "actor": c.actor,
                         "run_id": c.run_id, "task_id": c.task_id, "code": c.code, "detail": json.loads(c.detail),
                         "at": _iso(c.at)} for c in changes]}


