"""The audit ledger: a task's whole history in order, from the records alone.

Events (each delivery its keys or an attachment brought, with its source, key and trust), the task's keys (bound by
whom and why, and when released), attachments from triage, runs, decisions, task versions, steers the agent proposed
and the user's answer, control decisions, actions with their content hashes, admission verdicts with reasons,
approvals with their approver, attempts with outcomes, evidence from responses and reconciliation, refusals, messages
to the user, the timers and waits set for the task (each in plain words, `said`) with when and how each ended, and
every change to memory made in the task (`memory`: a record committed, a proposal refused with its code, a record
confirmed, edited, corrected, forgotten, expired or invalidated, and by whom). Enough to answer "why did this
effect happen, and on whose authority".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Connection, and_, or_, select

from wakeful.server.core import agenda, keys
from wakeful.server.core.holds import current_hold
from wakeful.server.errors import NotFound
from wakeful.server.store import users
from wakeful.server.store.tables import (
    actions,
    approvals,
    attempts,
    control,
    decisions,
    event_attachments,
    events,
    evidence,
    memory_changes,
    outbox,
    refusals,
    runs,
    steer_proposals,
    task_keys,
    task_versions,
    tasks,
    timers,
    verdicts,
    waits,
)

__all__ = ["EntryType", "describe", "entries", "four_facts", "task_status"]

EntryType = Literal["task", "task_version", "control", "steer_proposal", "steer_decision", "event", "run", "decision",
                    "action", "verdict", "approval", "attempt", "outcome", "evidence", "refusal", "message",
                    "dispatch_intent", "timer", "timer_ended", "wait", "wait_ended", "task_key", "task_key_release",
                    "attachment", "memory"]
"""Every kind of ledger entry (the HTTP API documents them: a kind missing here fails the type check where it is
written)."""

_JSON = {"content", "payload", "reasons", "observed", "request", "proposal", "constraints", "completion", "body",
         "widens"}


def _row(kind: EntryType, at: datetime, row: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    data: dict[str, Any] = {"at": at.isoformat(), "type": kind}
    for key, value in row._mapping.items():
        if key in skip or value is None:
            continue
        if isinstance(value, datetime):
            value = value.isoformat()
        elif key in _JSON and isinstance(value, str):
            value = json.loads(value)
        data[key] = value
    return data


def entries(conn: Connection, *, task_id: str, user_id: str) -> list[dict[str, Any]]:
    task = conn.execute(select(tasks).where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id))).first()
    if task is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    return sorted(_collect(conn, task), key=lambda e: (e["at"], e["type"], e.get("id", "")))


def _collect(conn: Connection, task: Any) -> Iterator[dict[str, Any]]:
    yield _row("task", task.created_at, task)
    for r in conn.execute(select(task_versions).where(task_versions.c.task_id == task.id)):
        yield _row("task_version", r.created_at, r)
    for r in conn.execute(select(control).where(control.c.task_id == task.id)):
        yield _row("control", r.created_at, r)
    for r in conn.execute(select(steer_proposals).where(steer_proposals.c.task_id == task.id)):
        yield _row("steer_proposal", r.created_at, r, skip=("decided_by", "decided_at"))
        if r.decided_at is not None:
            yield {"at": r.decided_at.isoformat(), "type": "steer_decision", "id": r.id, "state": r.state,
                   "decided_by": r.decided_by, "base_version": r.base_version}
    for r in conn.execute(select(task_keys).where(task_keys.c.task_id == task.id)):
        yield _row("task_key", r.bound_at, r, skip=("released_at",))
        if r.released_at is not None:
            yield {"at": r.released_at.isoformat(), "type": "task_key_release", "id": r.id, "key": r.key}
    for r in conn.execute(select(event_attachments).where(event_attachments.c.task_id == task.id)):
        yield _row("attachment", r.created_at, r)
    for r in conn.execute(select(events).where(events.c.session_id == task.session_id)):
        yield _row("event", r.received_at, r)
    run_ids = []
    for r in conn.execute(select(runs).where(runs.c.session_id == task.session_id)):
        run_ids.append(r.id)
        yield _row("run", r.started_at, r)
    for r in conn.execute(select(decisions).where(decisions.c.run_id.in_(run_ids))):
        yield _row("decision", r.created_at, r)
    action_ids = []
    for r in conn.execute(select(actions).where(actions.c.task_id == task.id)):
        action_ids.append(r.id)
        yield _row("action", r.created_at, r)
    for r in conn.execute(select(verdicts).where(verdicts.c.action_id.in_(action_ids))):
        yield _row("verdict", r.created_at, r)
    for r in conn.execute(select(approvals).where(approvals.c.action_id.in_(action_ids))):
        yield _row("approval", r.created_at, r)
    for r in conn.execute(select(attempts).where(attempts.c.action_id.in_(action_ids))):
        yield _row("attempt", r.created_at, r)
        if r.outcome_at is not None:
            yield {"at": r.outcome_at.isoformat(), "type": "outcome", "id": r.id, "action_id": r.action_id,
                   "outcome": r.outcome, "status_code": r.status_code, "external_ref": r.external_ref,
                   "detail": r.detail}
    for r in conn.execute(select(evidence).where(evidence.c.task_id == task.id)):
        yield _row("evidence", r.checked_at, r)
    for r in conn.execute(select(refusals).where(refusals.c.task_id == task.id)):
        yield _row("refusal", r.created_at, r)
    yield from _agenda(conn, task)
    for r in conn.execute(select(memory_changes).where(and_(memory_changes.c.task_id == task.id,
                                                            memory_changes.c.user_id == task.user_id))):
        yield {**_row("memory", r.at, r, skip=("detail",)), "detail": json.loads(r.detail)}
    intents = [outbox.c.id.like(f"dsp_{a}%") for a in action_ids]  # the first intent and any resends
    for r in conn.execute(select(outbox).where(or_(outbox.c.session_id == task.session_id, *intents))):
        yield _row("message" if r.kind == "user_message" else "dispatch_intent", r.created_at, r)


def _agenda(conn: Connection, task: Any) -> Iterator[dict[str, Any]]:
    """The task's timers and waits: when each was set (in plain words) and when and how it ended."""
    zone = users.zone(conn, task.user_id)
    for r in conn.execute(select(timers).where(timers.c.task_id == task.id)):
        yield {**_row("timer", r.created_at, r, skip=("ended_at", "end_reason")),
               "said": agenda.said_of_timer(r, zone)}
        if r.ended_at is not None:
            yield {"at": r.ended_at.isoformat(), "type": "timer_ended", "id": r.id, "state": r.state,
                   "end_reason": r.end_reason}
    for r in conn.execute(select(waits).where(waits.c.task_id == task.id)):
        said = agenda.said_of_wait(r, zone)
        yield {**_row("wait", r.created_at, r, skip=("resolved_at", "resolved_event_id")),
               **({"said": said} if said else {})}
        if r.resolved_at is not None:
            yield {"at": r.resolved_at.isoformat(), "type": "wait_ended", "id": r.id, "state": r.state,
                   **({"event_id": r.resolved_event_id} if r.resolved_event_id else {})}


def four_facts(conn: Connection, *, task_id: str) -> dict[str, str | None]:
    """The four separate facts of a task, each with its own time (None: not yet)."""
    task = conn.execute(select(tasks).where(tasks.c.id == task_id)).one()
    ended = conn.execute(select(runs.c.ended_at).where(and_(runs.c.session_id == task.session_id,
                                                            runs.c.ended_at.is_not(None)))
                         .order_by(runs.c.ended_at.desc()).limit(1)).scalar()
    verified = conn.execute(select(evidence.c.checked_at).where(and_(
        evidence.c.task_id == task_id, evidence.c.source == "completion", evidence.c.verdict == "accepted"))
        .order_by(evidence.c.checked_at).limit(1)).scalar()
    receipt = conn.execute(select(outbox.c.sent_at).where(and_(
        outbox.c.id.like(f"rcpt_{task_id}%"), outbox.c.state == "sent")).limit(1)).scalar()
    return {
        "request_received": task.created_at.isoformat(),
        "run_ended": ended.isoformat() if ended else None,
        "goal_verified": verified.isoformat() if verified else None,
        "receipt_delivered": receipt.isoformat() if receipt else None,
    }


def describe(entry: dict[str, Any]) -> str:
    """One line per entry, for people reading the ledger in a terminal."""
    kind = entry["type"]
    formats: dict[str, Callable[[dict[str, Any]], str]] = {
        "task": lambda e: f"{e['id']} {e['title']!r}",
        "task_version": lambda e: f"v{e['version']}: {e['goal']} (by {e['created_by']})",
        "control": lambda e: f"{e['kind']} by {e['actor']} {e.get('reason', '')}".rstrip()
                             + (f" [message {e['event_id']}]" if "event_id" in e else ""),
        "steer_proposal": lambda e: f"{e['id']} by {e['proposed_by']} against v{e['base_version']}: "
                                    + "; ".join(e["widens"])[:200],
        "steer_decision": lambda e: f"{e['id']} {e['state']} by {e['decided_by']}"
                                    + (f" → v{e['base_version'] + 1}" if e["state"] == "confirmed" else ""),
        "event": lambda e: f"{e['source']}:{e['source_id']} [{e['status']}] trust={e['trust']}",
        "run": lambda e: f"{e['id']} token={e['fencing_token']} → {e['outcome']} ({e.get('reason', '')})",
        "decision": lambda e: f"run {e['run_id']} step {e['step']}: {json.dumps(e['proposal'])[:100]}",
        "action": lambda e: f"{e['id']} {e['tool']} sha256={e['content_hash'][:16]}… risk={e['risk']}"
                            + (f" amount={e['amount_cents']} {e.get('currency', '')}" if "amount_cents" in e else ""),
        "verdict": lambda e: f"{e['action_id']}: {e['verdict']} ({e['code']})"
                             + (f" approver={e['approver']}" if "approver" in e else ""),
        "approval": lambda e: f"{e['action_id']}: {e['decision']} by {e['approver']} for sha256="
                              f"{e['content_hash'][:16]}… until {e['valid_until']}",
        "attempt": lambda e: f"{e['id']} #{e['seq']} of {e['action_id']} persisted before sending",
        "outcome": lambda e: f"{e['id']}: {e['outcome']} {e.get('status_code', '')} {e.get('detail', '')}",
        "evidence": lambda e: f"{e['source']} → {e['verdict']}"
                              + (f" for {e['action_id']}" if "action_id" in e else ""),
        "refusal": lambda e: f"{e['tool']}: {e['code']}: {e['detail']}",
        "message": lambda e: f"to user [{e['state']}]: {str(e['body'].get('text') or e['body'].get('kind'))[:100]}",
        "dispatch_intent": lambda e: f"{e['id']} [{e['state']}]",
        "timer": lambda e: f"{e['id']} {e['said']}",
        "timer_ended": lambda e: f"{e['id']} {e['state']} ({e.get('end_reason', '')})",
        "wait": lambda e: f"{e['id']} {e.get('said') or e['kind'] + ' for ' + e['match_key']}",
        "wait_ended": lambda e: f"{e['id']} {e['state']}",
        "task_key": lambda e: f"{e['key']!r} bound by {e['bound_by']}: {e.get('reason', '')}".rstrip(": "),
        "task_key_release": lambda e: f"{e['key']!r} released",
        "attachment": lambda e: f"{e['event_id']} attached as {e['attached_event_id']} by {e['actor']}: {e['reason']}",
        "memory": lambda e: f"{e['change']} {e.get('memory_id') or '(nothing stored)'} by {e['actor']}"
                            + (f" ({e['code']})" if "code" in e else ""),
    }
    detail = formats.get(kind)
    return f"{entry['at']}  {kind:<15} {detail(entry) if detail else ''}"


def task_status(conn: Connection, *, user_id: str, task_id: str) -> dict[str, Any]:
    """A task's state from its records: the four facts, open timers and pending waits (each in plain words),
    actions with verdicts and outcomes, the agent's proposed steers, and the hold of the user's message while there
    is one."""
    row = conn.execute(select(tasks).where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id))).first()
    if row is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    action_rows = []
    for a in conn.execute(select(actions).where(actions.c.task_id == task_id).order_by(actions.c.created_at)):
        verdict = conn.execute(select(verdicts.c.verdict, verdicts.c.code).where(verdicts.c.action_id == a.id)
                               .order_by(verdicts.c.created_at.desc(), verdicts.c.id.desc()).limit(1)).first()
        outcome = conn.execute(select(attempts.c.outcome).where(attempts.c.action_id == a.id)
                               .order_by(attempts.c.seq.desc()).limit(1)).scalar()
        action_rows.append({"action_id": a.id, "tool": a.tool, "version": a.task_version,
                            "content_hash": a.content_hash, "verdict": verdict.verdict if verdict else None,
                            "code": verdict.code if verdict else None, "outcome": outcome})
    return {"task_id": row.id, "session_id": row.session_id, "title": row.title, "state": row.state,
            "version": row.current_version, "facts": four_facts(conn, task_id=task_id),
            **agenda.listing(conn, user_id=user_id, task_id=task_id),
            "actions": action_rows, "proposed_steers": _proposed_steers(conn, task_id), "hold": _hold(conn, task_id),
            "keys": keys.of_task(conn, task_id)}


def _hold(conn: Connection, task_id: str) -> dict[str, Any] | None:
    held = current_hold(conn, task_id=task_id)
    return None if held is None else {"hold_id": held.hold_id, "event_id": held.event_id, "held_by": held.held_by,
                                      "since": held.since.isoformat()}


def _proposed_steers(conn: Connection, task_id: str) -> list[dict[str, Any]]:
    """The agent's steers that asked for more than the task had, each with its state (awaiting_user until the user
    answers)."""
    rows = conn.execute(select(steer_proposals).where(steer_proposals.c.task_id == task_id)
                        .order_by(steer_proposals.c.created_at, steer_proposals.c.id)).all()
    return [{"steer_id": r.id, "state": r.state, "against_version": r.base_version, "widens": json.loads(r.widens)}
            for r in rows]
