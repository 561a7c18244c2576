"""The committer: the one door through which a proposed record is stored. It reads the facts a proposal is judged
on (its evidence resolved, the records on its subject and relation, the user's disowned evidence), asks the pure
rules (`rules.check`), and writes the version, its topics and links and a `memory_changes` row — `committed`, or
`refused` with its code and the proposal — in the caller's transaction.

    propose      commit a proposal for a user, or record its refusal and raise it
    try_propose  the same, returning the refusal (recorded, not raised) so the caller can commit its record
    facts        the snapshot `rules.check` judges a proposal on
    change       write one `memory_changes` row (for `records` too)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, select, update

from wakeful.server.errors import BadRequest, Refused, WakefulError
from wakeful.server.memory.model import Actor, ActorKind, Proposal, Stored
from wakeful.server.memory.rules import Existing, Facts, Refusal, Resolved, Verdict, check
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import (
    MemoryForm,
    MemoryScope,
    MemoryState,
    Speaker,
    actions,
    approvals,
    decisions,
    events,
    memories,
    memory_changes,
    memory_disowned,
    memory_links,
    memory_topics,
    outbox,
    runs,
    steer_proposals,
    tasks,
)
from wakeful.server.store.users import name_of

__all__ = ["change", "facts", "propose", "retire_contradicted", "try_propose", "write_version"]


def change(conn: Connection, *, user_id: str, memory_id: str | None, kind: str, actor: Actor | str, now: datetime,
           code: str | None = None, detail: dict[str, Any] | None = None, task_id: str | None = None,
           change_id: str | None = None) -> str:
    """One `memory_changes` row; returns its id."""
    change_id = change_id or new_id("mch")
    who = actor if isinstance(actor, str) else actor.kind.value
    run_id = None if isinstance(actor, str) else actor.run_id
    if task_id is None and not isinstance(actor, str):
        task_id = actor.task_id
    conn.execute(memory_changes.insert().values(
        id=change_id, user_id=user_id, memory_id=memory_id, change=kind, actor=who, run_id=run_id, task_id=task_id,
        code=code, detail=json.dumps(detail or {}, sort_keys=True, default=str), at=now))
    return change_id


def _resolve(conn: Connection, user_id: str, t: str, i: str) -> Resolved:
    """One ref as this user's: `found` false when absent or another user's (the same answer either way)."""
    if t == "event":
        ev = conn.execute(select(events.c.kind, events.c.authority, tasks.c.id.label("task_id"))
                          .select_from(events.outerjoin(tasks, tasks.c.session_id == events.c.session_id))
                          .where(and_(events.c.id == i, events.c.user_id == user_id))).first()
        if ev is None:
            return Resolved(type=t, id=i, found=False)
        return Resolved(type=t, id=i, found=True, kind=ev.kind, authority=ev.authority, task_id=ev.task_id)
    found: Any
    if t == "decision":
        found = conn.execute(select(decisions.c.id).join(runs, runs.c.id == decisions.c.run_id)
                             .where(and_(decisions.c.id == i, runs.c.user_id == user_id))).scalar()
    elif t == "approval":
        found = conn.execute(select(approvals.c.task_id).join(actions, actions.c.id == approvals.c.action_id)
                             .where(and_(approvals.c.id == i, actions.c.user_id == user_id))).scalar()
    else:
        table, col = {"action": (actions, actions.c.user_id), "steer": (steer_proposals, steer_proposals.c.user_id),
                      "message": (outbox, outbox.c.user_id), "run": (runs, runs.c.user_id),
                      "memory": (memories, memories.c.user_id)}[t]
        found = conn.execute(select(table.c.id).where(and_(table.c.id == i, col == user_id))).scalar()
    return Resolved(type=t, id=i, found=found is not None)


def _existing(row: Any) -> Existing:
    return Existing(id=row.id, form=MemoryForm(row.form), state=MemoryState(row.state), scope=MemoryScope(row.scope),
                    scope_ref=row.scope_ref, value=row.value, speaker=Speaker(row.speaker),
                    confirmed_by=row.confirmed_by)


def same_key(conn: Connection, user_id: str, subject: str, relation: str) -> tuple[Existing, ...]:
    rows = conn.execute(select(memories).where(and_(
        memories.c.user_id == user_id, memories.c.subject == subject, memories.c.relation == relation,
        memories.c.state.in_([MemoryState.ACTIVE.value, MemoryState.PENDING.value]))).order_by(memories.c.id)).all()
    return tuple(_existing(r) for r in rows)


def facts(conn: Connection, *, user_id: str, actor: Actor, proposal: Proposal) -> Facts:
    """What the rules judge `proposal` on, read in the caller's transaction."""
    name = name_of(conn, user_id)
    evidence = tuple(_resolve(conn, user_id, ref.type, ref.id) for ref in proposal.evidence)
    disowned = frozenset((r.ref_type, r.ref_id) for r in conn.execute(
        select(memory_disowned.c.ref_type, memory_disowned.c.ref_id).where(memory_disowned.c.user_id == user_id)))
    derived_found = all(_resolve(conn, user_id, "memory", m).found for m in proposal.derived_from)
    owned = True
    if actor.task_id is not None:  # the task an agent acts for is one of this user's (the faces check it too)
        owned = conn.execute(select(tasks.c.id).where(and_(tasks.c.id == actor.task_id,
                                                           tasks.c.user_id == user_id))).scalar() is not None
    if owned and actor.kind == ActorKind.USER and proposal.scope_ref is not None:
        if proposal.scope == MemoryScope.TASK:
            owned = conn.execute(select(tasks.c.id).where(and_(tasks.c.id == proposal.scope_ref,
                                                               tasks.c.user_id == user_id))).scalar() is not None
        elif proposal.scope == MemoryScope.RUN:
            owned = _resolve(conn, user_id, "run", proposal.scope_ref).found
    return Facts(user_name=name, evidence=evidence, disowned=disowned, derived_found=derived_found,
                 scope_ref_owned=owned,
                 same_key=same_key(conn, user_id, proposal.subject, proposal.relation))


def retire_contradicted(conn: Connection, *, ids: Sequence[str], by: str, review: bool, now: datetime) -> None:
    for old in ids:
        moved = conn.execute(update(memories).where(and_(
            memories.c.id == old, memories.c.state == MemoryState.ACTIVE.value)).values(
            state=MemoryState.RETIRED.value, retired_at=now, retire_reason="contradicted", retired_by=by,
            review=review)).rowcount
        if moved != 1:
            raise WakefulError("invalid_transition", f"memory {old} changed while it was being contradicted")


def write_version(conn: Connection, *, user_id: str, verdict: Verdict, proposal: Proposal, actor: Actor,
                  now: datetime, lineage_id: str | None = None, version: int = 1, supersedes: str | None = None,
                  confirmed_by: str | None = None, task_id: str | None = None, run_id: str | None = None,
                  links: Sequence[tuple[str, str]] | None = None) -> str:
    """Insert one version with its topics and links; returns its id."""
    memory_id = new_id("mem")
    conn.execute(memories.insert().values(
        id=memory_id, user_id=user_id, lineage_id=lineage_id or memory_id, version=version, supersedes=supersedes,
        form=verdict.form.value, state=verdict.state.value, subject=proposal.subject, relation=proposal.relation,
        value=proposal.value, text=proposal.text, scope=verdict.scope.value, scope_ref=verdict.scope_ref,
        speaker=verdict.speaker.value, speaker_name=verdict.speaker_name, confidence=verdict.confidence,
        review=False, run_id=run_id if run_id is not None else actor.run_id,
        task_id=task_id if task_id is not None else actor.task_id, confirmed_by=confirmed_by,
        confirmed_at=now if confirmed_by else None, valid_from=proposal.valid_from or now,
        valid_until=proposal.valid_until, recorded_at=now))
    for topic in verdict.topics:
        conn.execute(memory_topics.insert().values(memory_id=memory_id, topic=topic, user_id=user_id))
    if links is None:
        links = [(r.type, r.id) for r in proposal.evidence] + [("memory", m) for m in proposal.derived_from]
    for ref_type, ref_id in dict.fromkeys(links):
        conn.execute(memory_links.insert().values(memory_id=memory_id, ref_type=ref_type, ref_id=ref_id,
                                                  user_id=user_id))
    return memory_id


def try_propose(conn: Connection, *, user_id: str, actor: Actor, proposal: Proposal,
                now: datetime) -> Stored | WakefulError:
    """`propose`, but a refusal is returned (after it was recorded) rather than raised: the caller commits its
    transaction, so that the refusal's record stays, and then raises it."""
    verdict = check(proposal, actor, facts(conn, user_id=user_id, actor=actor, proposal=proposal))
    if isinstance(verdict, Refusal):
        change(conn, user_id=user_id, memory_id=None, kind="refused", actor=actor, now=now, code=verdict.code,
               detail={"proposal": proposal.model_dump(mode="json"), "reason": verdict.message})
        error = BadRequest if verdict.malformed else Refused
        return error(verdict.code, verdict.message)
    retire_contradicted(conn, ids=verdict.retire, by=actor.kind.value, review=verdict.review, now=now)
    change_id = new_id("mch")
    # the user's own word confirms itself (content is written once: confirmed_by names the change to come)
    confirmed_by = change_id if actor.kind == ActorKind.USER and verdict.state == MemoryState.ACTIVE else None
    memory_id = write_version(conn, user_id=user_id, verdict=verdict, proposal=proposal, actor=actor, now=now,
                              confirmed_by=confirmed_by)
    change(conn, user_id=user_id, memory_id=memory_id, kind="committed", actor=actor, now=now, change_id=change_id,
           detail={"form": verdict.form.value, "state": verdict.state.value, "proposed_form": proposal.form.value,
                   "retired": list(verdict.retire)})
    return Stored(memory_id=memory_id, lineage_id=memory_id, version=1, state=verdict.state.value,
                  form=verdict.form.value, change_id=change_id, retired=verdict.retire)


def propose(conn: Connection, *, user_id: str, actor: Actor, proposal: Proposal, now: datetime) -> Stored:
    """Commit `proposal` for `user_id` as `actor`: the version (pending or active, as the rules say), its topics,
    links and change. A refusal is recorded (`memory_changes`, memory_id NULL) and raised: `BadRequest` for a
    malformed proposal (`invalid_memory`, `invalid_scope`), `Refused` otherwise (`unknown_evidence`,
    `evidence_disowned`, `third_party_source`, `third_party_directive`, `user_only`, `user_owned`,
    `needs_user_words`, `needs_evidence`, `contradicts_confirmed`). The refusal's record is in the caller's
    transaction: raised through it, it is rolled back with everything else (use `try_propose` to keep it)."""
    out = try_propose(conn, user_id=user_id, actor=actor, proposal=proposal, now=now)
    if isinstance(out, WakefulError):
        raise out
    return out
