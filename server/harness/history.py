"""What one wake sees of its delegation, read from the records as they stood when its run started.

Every section is read as of the run's start: a record counts when it was stamped before it (the user's task, versions
and control records: at it too) and is not the run's own, so replaying a run derives the same bytes. No model writes
any of it; every section is bounded:

    snapshot   the task version at the delegation's last compaction point: the version current when the session's
               run number 0, COMPACT_EVERY, 2 × COMPACT_EVERY … started (stable between them, so it caches)
    current    the task version now, when it differs from the snapshot (tail notes override the snapshot)
    changes    one ledger line per record since the session's previous run started (the newest CHANGES_CAP)
    earlier    what is older, as a count per kind of record with the newest IDs (pointers the model can ask about)
    sent       the messages already sent to the user, with when (the newest SENT_CAP)
    waits, timers, approvals   what is open, with deadlines, next due times and expiries (OPEN_CAP each)

Timers keep no history (a firing moves `due_at`): replaying an old run after one of its timers fired shows the
timer's later due time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, or_, select

from wakeful.server.acting.ledger import describe, entries
from wakeful.server.acting.verdicts import approval_key
from wakeful.server.core.control import state_after
from wakeful.server.errors import NotFound
from wakeful.server.store.tables import TaskState, TimerState, actions, runs, task_versions, timers, tool_results, waits

__all__ = ["CHANGES_CAP", "COMPACT_EVERY", "OPEN_CAP", "POINTERS", "SENT_CAP", "Moment", "as_of", "record"]

COMPACT_EVERY = 16  # runs between compaction points: the snapshot is refreshed at each
CHANGES_CAP = 30
LINE_CAP = 300
POINTERS = 5  # record IDs named per kind of earlier record
SENT_CAP = 10
TEXT_CAP = 500
OPEN_CAP = 10
_APPROVAL = approval_key("")  # every approval wait's match key: the prefix, then the action's ID
_USERS = frozenset({"task", "task_version", "control"})  # written on the user's channel only, never by a run
_EVERY_WAKE = frozenset({"event", "run", "tool_result"})
_OWN_SECTION = frozenset({"message", "dispatch_intent", "decision"})  # messages have theirs; decisions: tool_result


@dataclass(frozen=True, kw_only=True)
class Moment:
    """The run a context is assembled for: its task, session, ID, context time and the events handed to it."""

    user_id: str
    task_id: str
    session_id: str
    run_id: str
    now: datetime
    handed: frozenset[str]


def as_of(conn: Connection, moment: Moment) -> dict[str, Any]:
    """The tail's sections for `moment` (with `snapshot`, which the context renders as its own block)."""
    earlier_runs = conn.execute(select(runs.c.id, runs.c.started_at).where(and_(
        runs.c.session_id == moment.session_id, runs.c.id < moment.run_id)).order_by(runs.c.id)).all()
    versions = conn.execute(select(task_versions).where(and_(
        task_versions.c.task_id == moment.task_id, task_versions.c.created_at <= moment.now))
        .order_by(task_versions.c.version)).all()
    compacted = len(earlier_runs) - len(earlier_runs) % COMPACT_EVERY
    snapshot_at = earlier_runs[compacted].started_at if compacted < len(earlier_runs) else moment.now
    snapshot = next((v for v in reversed(versions) if v.created_at <= snapshot_at), versions[0])
    seen = _visible(conn, moment)
    since = earlier_runs[-1].started_at if earlier_runs else None
    history = [e for e in seen if e["type"] not in _OWN_SECTION]
    older = [e for e in history if since is not None and _at(e) < since]
    changed = [e for e in history if since is None or _at(e) >= since]
    sent = [e for e in seen if e["type"] == "message"]
    title = next(e["title"] for e in seen if e["type"] == "task")
    return {
        "task": {"task_id": moment.task_id, "title": title, "state": _state(seen), "version": versions[-1].version,
                 "snapshot_version": snapshot.version},
        "snapshot": {"task_id": moment.task_id, "title": title, **_version(snapshot)},
        "current": _version(versions[-1]) if versions[-1] is not snapshot else None,
        "changes": [_line(e) for e in changed[-CHANGES_CAP:]],
        "earlier": _digest(older + changed[:-CHANGES_CAP]),
        "sent": [_message(e) for e in sent[-SENT_CAP:]],
        "sent_total": len(sent),
        **_open(conn, moment),
    }


def record(conn: Connection, *, user_id: str, task_id: str, session_id: str, record_id: str) -> dict[str, Any]:
    """One record of the task's history, whole, by ID: what a pointer in the context stands for."""
    found = [e for e in _history(conn, user_id=user_id, task_id=task_id, session_id=session_id)
             if e.get("id") == record_id]
    if not found:
        raise NotFound("unknown_record", f"no record {record_id} in this task's history", record_id=record_id)
    return found[0]


def _history(conn: Connection, *, user_id: str, task_id: str, session_id: str) -> list[dict[str, Any]]:
    """The task's ledger and the tool results of its session's runs, each an entry with `at`, `type` and `id`."""
    results = conn.execute(select(tool_results).join(runs, runs.c.id == tool_results.c.run_id)
                           .where(runs.c.session_id == session_id)).all()
    return entries(conn, task_id=task_id, user_id=user_id) + [
        {"at": r.created_at.isoformat(), "type": "tool_result", "id": r.id, "run_id": r.run_id, "tool": r.tool,
         "args": json.loads(r.args), "result": json.loads(r.result)} for r in results]


def _visible(conn: Connection, moment: Moment) -> list[dict[str, Any]]:
    """The task's ledger and the session's tool results stamped before the context time (the user's own records: at
    it too), without this run's own records or the events handed to it (those are the new events). A record a run
    writes is stamped at or after the run's start, so the run never sees its own; a replay sees what the run saw."""
    own_actions = set(conn.execute(select(actions.c.id).where(actions.c.run_id == moment.run_id)).scalars())
    found = _history(conn, user_id=moment.user_id, task_id=moment.task_id, session_id=moment.session_id)
    return sorted((e for e in found
                   if (_at(e) < moment.now or (_at(e) == moment.now and e["type"] in _USERS))
                   and e.get("run_id") != moment.run_id
                   and e["id"] != moment.run_id and e.get("action_id") not in own_actions
                   and e["id"] not in moment.handed),
                  key=lambda e: (_at(e), e["type"], e["id"]))


def _at(entry: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(entry["at"])


def _version(row: Any) -> dict[str, Any]:
    return {"version": row.version, "goal": row.goal, "constraints": json.loads(row.constraints),
            "completion": json.loads(row.completion), "created_by": row.created_by,
            "created_at": row.created_at.isoformat()}


def _state(seen: list[dict[str, Any]]) -> str:
    """The task's state at the context time: where the user's last pause, resume, close … left it."""
    moves = [state_after(e["kind"]) for e in seen if e["type"] == "control"]
    return str(next((s for s in reversed(moves) if s is not None), TaskState.ACTIVE).value)


def _line(entry: dict[str, Any]) -> str:
    if entry["type"] == "tool_result":
        result = entry["result"]
        said = (result.get("error") or {}).get("code") or result.get("status") or "ok"
        line = f"{entry['at']}  {'tool_result':<15} {entry['id']} {entry['tool']} → {said}"
    else:
        line = f"{describe(entry)} [{entry['id']}]"
    return line if len(line) <= LINE_CAP else line[:LINE_CAP - 1] + "…"


def _digest(older: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind of record: how many, and the newest IDs (the model reads any of them with `read_record`). The kinds
    every wake adds to come last, so the digest's start stays as the last wake's."""
    kinds: dict[str, list[str]] = {}
    for e in older:
        kinds.setdefault(e["type"], []).append(e["id"])
    return [{"type": kind, "count": len(ids), "latest": ids[-POINTERS:]}
            for kind, ids in sorted(kinds.items(), key=lambda k: (k[0] in _EVERY_WAKE, k[0]))]


def _message(entry: dict[str, Any]) -> dict[str, Any]:
    body = entry["body"]
    if body.get("kind") == "approval_request":
        card = body["card"]
        text = f"approval request for {card['action_id']}: " + "; ".join(card["lines"])
    else:
        text = str(body.get("text") or body.get("kind"))
    return {"id": entry["id"], "at": entry["at"], "text": text[:TEXT_CAP]}


def _open(conn: Connection, moment: Moment) -> dict[str, Any]:
    """Waits and pending approvals open at the context time, and the task's active timers."""
    approval = waits.c.match_key == _APPROVAL + actions.c.id
    opened = conn.execute(select(waits, actions.c.tool, actions.c.content).outerjoin(actions, approval)
                          .where(and_(or_(waits.c.session_id == moment.session_id, waits.c.task_id == moment.task_id),
                                      waits.c.created_at < moment.now,
                                      or_(waits.c.resolved_at.is_(None), waits.c.resolved_at >= moment.now)))
                          .order_by(waits.c.deadline, waits.c.id)).all()
    due = conn.execute(select(timers).where(and_(timers.c.task_id == moment.task_id,
                                                 timers.c.state == TimerState.ACTIVE.value,
                                                 timers.c.created_at < moment.now))
                       .order_by(timers.c.due_at, timers.c.id).limit(OPEN_CAP)).all()
    return {
        "waits": [{"wait_id": w.id, "kind": w.kind, "key": w.match_key, "authority": w.authority,
                   "deadline": _iso(w.deadline)} for w in opened if w.kind != "approval"][:OPEN_CAP],
        "approvals": [{"action_id": w.match_key.removeprefix(_APPROVAL), "tool": w.tool,
                       "what": str(json.loads(w.content or "{}").get("description") or w.tool)[:TEXT_CAP],
                       "expires_at": _iso(w.deadline)} for w in opened if w.kind == "approval"][:OPEN_CAP],
        "timers": [{"timer_id": t.id, "kind": t.kind, "next_due": _iso(t.due_at), "note": t.note[:TEXT_CAP],
                    "every_seconds": t.interval_seconds, "cron": t.cron} for t in due],
    }


def _iso(at: datetime | None) -> str | None:
    return at.isoformat() if at else None
