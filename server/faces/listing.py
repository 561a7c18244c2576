"""The paged reads of the console and the API: pages of the user's records, newest first by a stable cursor
(`faces.pages`), each a bounded query so a user with 10,000 tasks or a run with 20,000 entries costs one page, never
the whole history.

A page is `Page(rows, next)`: `next` is the cursor of the page after it (None on the last), which names the last
row's sort key, so rows added meanwhile never shift or repeat a page.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Select, and_, exists, func, or_, select
from sqlalchemy.sql.elements import ColumnElement

from wakeful.server.acting.verdicts import approval_key
from wakeful.server.errors import BadRequest
from wakeful.server.faces.pages import decode_cursor, encode_cursor
from wakeful.server.store.tables import (
    WaitState,
    actions,
    decisions,
    events,
    outbox,
    run_contexts,
    runs,
    tasks,
    timers,
    tool_results,
    verdicts,
    waits,
)

__all__ = ["PAGE", "Page", "events_page", "outbox_page", "pending_approvals", "run_history", "runs_page",
           "tasks_page", "timers_page"]

PAGE = 50
"""Rows per console page."""


@dataclass(frozen=True, kw_only=True)
class Page:
    rows: list[dict[str, Any]]
    next: str | None


def _row(r: Any) -> dict[str, Any]:
    return dict(r._mapping)


def _newest_first(conn: Connection, query: Select[Any], at: Any, key: Any, cursor: str | None, limit: int, *,
                  equal: Mapping[Any, str | None] | None = None, shape: Callable[[Any], dict[str, Any]] = _row) -> Page:
    """`query` newest first by (`at`, `key`), starting after `cursor`; of the columns in `equal`, each given a
    value (not None or empty) must hold it."""
    for column, value in (equal or {}).items():
        if value:
            query = query.where(column == value)
    after = decode_cursor(cursor, parts=2)
    if after is not None:
        try:
            when = datetime.fromisoformat(after[0])
        except ValueError:
            when = None
        if when is None or when.tzinfo is None:  # the server writes its times with their zone
            raise BadRequest("bad_cursor", "the cursor is not one this server gave out")
        query = query.where(or_(at < when, and_(at == when, key < after[1])))
    rows = list(conn.execute(query.order_by(at.desc(), key.desc()).limit(limit + 1)))
    page = rows[:limit]
    last = page[-1]._mapping if page else None
    return Page(rows=[shape(r) for r in page],
                next=encode_cursor([last[at.name].isoformat(), last[key.name]]) if last and len(rows) > limit
                else None)


def _latest_verdict_is_pending() -> ColumnElement[bool]:
    later = verdicts.alias("later")
    return and_(verdicts.c.verdict == "needs_approval", ~exists().where(and_(
        later.c.action_id == verdicts.c.action_id,
        or_(later.c.created_at > verdicts.c.created_at,
            and_(later.c.created_at == verdicts.c.created_at, later.c.id > verdicts.c.id)))))


def pending_approvals(conn: Connection, *, user_id: str, limit: int = PAGE,
                      task_id: str | None = None) -> list[dict[str, Any]]:
    """Actions whose latest verdict asks for the user's approval, oldest first (the longest waiting on top). Found
    from the open approval waits (a handful), not from every verdict the user ever had."""
    prefix = len(approval_key(""))
    query = (select(actions.c.id, actions.c.tool, actions.c.task_id, actions.c.amount_cents, actions.c.currency,
                    actions.c.created_at, tasks.c.title, verdicts.c.code)
             .select_from(waits)
             .join(actions, actions.c.id == func.substr(waits.c.match_key, prefix + 1))
             .join(verdicts, verdicts.c.action_id == actions.c.id).join(tasks, tasks.c.id == actions.c.task_id)
             .where(and_(waits.c.user_id == user_id, waits.c.kind == "approval",
                         waits.c.state == WaitState.PENDING.value, actions.c.user_id == user_id,
                         _latest_verdict_is_pending()))
             .order_by(actions.c.created_at, actions.c.id).limit(limit))
    if task_id is not None:
        query = query.where(actions.c.task_id == task_id)
    return [dict(r._mapping) for r in conn.execute(query)]


def tasks_page(conn: Connection, *, user_id: str, cursor: str | None, state: str | None,
               limit: int = PAGE) -> Page:
    query = select(tasks.c.id, tasks.c.title, tasks.c.state, tasks.c.current_version, tasks.c.created_at).where(
        tasks.c.user_id == user_id)
    return _newest_first(conn, query, tasks.c.created_at, tasks.c.id, cursor, limit, equal={tasks.c.state: state})


def events_page(conn: Connection, *, user_id: str, cursor: str | None, source: str | None, status: str | None,
                limit: int = PAGE) -> Page:
    query = select(events.c.id, events.c.source, events.c.source_id, events.c.kind, events.c.trust, events.c.status,
                   events.c.run_id, events.c.received_at).where(events.c.user_id == user_id)
    return _newest_first(conn, query, events.c.received_at, events.c.id, cursor, limit,
                         equal={events.c.source: source, events.c.status: status})


def runs_page(conn: Connection, *, user_id: str, cursor: str | None, outcome: str | None,
              limit: int = PAGE) -> Page:
    query = select(runs.c.id, runs.c.session_id, runs.c.outcome, runs.c.steps, runs.c.reason, runs.c.started_at,
                   runs.c.ended_at).where(runs.c.user_id == user_id)
    return _newest_first(conn, query, runs.c.started_at, runs.c.id, cursor, limit, equal={runs.c.outcome: outcome})


def timers_page(conn: Connection, *, user_id: str, cursor: str | None, state: str | None,
                limit: int = PAGE) -> Page:
    query = select(timers.c.id, timers.c.task_id, timers.c.kind, timers.c.state, timers.c.due_at, timers.c.note,
                   timers.c.fire_count, timers.c.created_at).where(timers.c.user_id == user_id)
    return _newest_first(conn, query, timers.c.created_at, timers.c.id, cursor, limit, equal={timers.c.state: state})


def outbox_page(conn: Connection, *, user_id: str, cursor: str | None, state: str | None,
                limit: int = PAGE) -> Page:
    query = select(outbox.c.id, outbox.c.kind, outbox.c.state, outbox.c.attempts, outbox.c.last_error,
                   outbox.c.body, outbox.c.created_at, outbox.c.sent_at).where(outbox.c.user_id == user_id)

    def shape(r: Any) -> dict[str, Any]:
        row = dict(r._mapping)
        body = json.loads(row.pop("body"))
        row["summary"] = str(body.get("text") or body.get("kind") or "")[:200] if isinstance(body, dict) else ""
        return row

    return _newest_first(conn, query, outbox.c.created_at, outbox.c.id, cursor, limit, equal={outbox.c.state: state},
                         shape=shape)


def run_history(conn: Connection, *, user_id: str, run_id: str, cursor: str | None,
                limit: int = PAGE) -> tuple[dict[str, Any] | None, Page]:
    """A run and one page of its history in step order: each step's proposal and the tool results it got.
    (None, empty) when the run is not this user's."""
    run = conn.execute(select(runs).where(and_(runs.c.id == run_id, runs.c.user_id == user_id))).first()
    if run is None:
        return None, Page(rows=[], next=None)
    after = decode_cursor(cursor, parts=1)
    if after is not None and not after[0].isdigit():
        raise BadRequest("bad_cursor", "the cursor is not one this server gave out")
    start = int(after[0]) if after is not None else -1
    steps = list(conn.execute(select(decisions.c.step, decisions.c.proposal, decisions.c.created_at)
                              .where(and_(decisions.c.run_id == run_id, decisions.c.step > start))
                              .order_by(decisions.c.step).limit(limit + 1)))
    shown = steps[:limit]
    results: dict[int, list[dict[str, Any]]] = {}
    if shown:
        for r in conn.execute(select(tool_results.c.step, tool_results.c.tool, tool_results.c.result)
                              .where(and_(tool_results.c.run_id == run_id,
                                          tool_results.c.step.between(shown[0].step, shown[-1].step)))
                              .order_by(tool_results.c.step, tool_results.c.id)):
            results.setdefault(r.step, []).append({"tool": r.tool, "result": r.result[:500]})
    rows = [{"step": s.step, "at": s.created_at, "proposal": s.proposal[:1000], "results": results.get(s.step, [])}
            for s in shown]
    # only a model's run keeps the context `wakeful replay` re-runs it from (the echo handler's does not)
    replayable = conn.execute(select(run_contexts.c.run_id).where(run_contexts.c.run_id == run_id)).first() is not None
    return {**run._mapping, "replayable": replayable}, Page(
        rows=rows, next=encode_cursor([str(shown[-1].step)]) if len(steps) > limit else None)
