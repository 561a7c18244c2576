"""What the agent may write to a delegation, and the user's answer when it asks for more (principle 9).

    delegate          the agent records a delegation: refused under STOP, and with a `max_…` limit above the
                      user's own ceiling for it
    steer             the agent steers a task: refused under STOP and on a task that is not active; a steer that
                      narrows or keeps the task version takes effect at once, one that widens it (`core.widening`)
                      is only proposed, and the user is asked through the outbox with a card saying what widens
    confirm, reject   the user's answer, from the control channel only (HTTP, the CLI)

The agent's records carry its actor and trust `agent`; a confirmed steer becomes a version written by the user who
confirmed it. A proposal moves awaiting_user → confirmed | rejected | superseded, each move one guarded UPDATE; any
newer task version supersedes it (`control.steer`), so a confirmation applies to the version it was proposed for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

from sqlalchemy import Connection, and_, select, update

from wakeful.server.core import control, outbox, sessions
from wakeful.server.core.speaking import Level
from wakeful.server.core.widening import Delegation, over_ceilings, widenings
from wakeful.server.errors import Conflict, NotFound, Refused
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import SteerState, TaskState, steer_proposals, task_versions, tasks

__all__ = ["AGENT_TRUST", "Decided", "Steered", "confirm", "delegate", "reject", "steer"]

AGENT_TRUST: Final = "agent"
"""The trust of what the agent wrote: its own word, never the user's."""


@dataclass(frozen=True, kw_only=True)
class Steered:
    """What became of an agent's steer: applied as `version`, or awaiting the user as `steer_id`."""

    task_id: str
    version: int
    state: Literal["applied", "awaiting_user"]
    steer_id: str | None = None
    widens: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Decided:
    """The user's answer to a proposed steer, and the task's version after it."""

    steer_id: str
    task_id: str
    state: SteerState
    version: int


def _refuse_if_stopped(conn: Connection, user_id: str) -> None:
    if control.stop_state(conn).blocks(user_id):
        raise Refused("stopped", "a STOP is in force: nothing the agent asks changes a task until the user lifts it")


def delegate(conn: Connection, *, user_id: str, title: str, goal: str | None, constraints: Mapping[str, Any],
             completion: Sequence[Mapping[str, Any]], ceilings: Mapping[str, int | None], actor: str,
             now: datetime, task_keys: Sequence[str] = ()) -> str:
    """A delegation the agent records, with the keys it names (`core.keys`); it acts under the user's policy like
    any other. Returns the task's ID."""
    _refuse_if_stopped(conn, user_id)
    over = over_ceilings(constraints, ceilings)
    if over:
        raise Refused("exceeds_user_limit", "; ".join(over) + ": only the user can delegate past their own policy",
                      limits=list(over))
    session_id = sessions.create_session(conn, user_id=user_id, now=now)
    return control.create_task(conn, user_id=user_id, session_id=session_id, title=title, goal=goal,
                               constraints=constraints, completion=completion, now=now, actor=actor,
                               trust=AGENT_TRUST, task_keys=task_keys)


def steer(conn: Connection, *, user_id: str, task_id: str, goal: str, constraints: Mapping[str, Any],
          completion: Sequence[Mapping[str, Any]], actor: str, now: datetime) -> Steered:
    """The agent's steer: applied when it narrows or keeps the task version, else proposed to the user."""
    task = conn.execute(select(tasks).where(and_(tasks.c.id == task_id, tasks.c.user_id == user_id))
                        .with_for_update()).first()
    if task is None:
        raise NotFound("unknown_task", f"no task {task_id} for this user", task_id=task_id)
    _refuse_if_stopped(conn, user_id)
    if task.state != TaskState.ACTIVE.value:
        raise Refused(task.state, f"the task is {task.state}: only the user's own control reaches it now")
    current = conn.execute(select(task_versions).where(and_(task_versions.c.task_id == task_id,
                                                            task_versions.c.version == task.current_version))).one()
    widens = widenings(
        Delegation.of(goal=current.goal, constraints=json.loads(current.constraints),
                      completion=json.loads(current.completion)),
        Delegation.of(goal=goal, constraints=constraints, completion=completion))
    if not widens:
        version = control.steer(conn, user_id=user_id, task_id=task_id, goal=goal, constraints=constraints,
                                completion=completion, actor=actor, now=now, trust=AGENT_TRUST)
        return Steered(task_id=task_id, version=version, state="applied")
    steer_id = new_id("stp")
    conn.execute(steer_proposals.insert().values(
        id=steer_id, user_id=user_id, task_id=task_id, base_version=task.current_version, goal=goal,
        constraints=json.dumps(dict(constraints), sort_keys=True), completion=json.dumps(list(completion)),
        widens=json.dumps(list(widens)), proposed_by=actor, state=SteerState.AWAITING_USER.value, created_at=now))
    outbox.enqueue(conn, user_id=user_id, session_id=task.session_id, now=now, message_id=f"card_{steer_id}",
                   level=Level.ASK, body={"kind": "steer_request", "card": _card(steer_id, task, widens)})
    return Steered(task_id=task_id, version=task.current_version, state="awaiting_user", steer_id=steer_id,
                   widens=widens)


def _card(steer_id: str, task: Any, widens: Sequence[str]) -> dict[str, Any]:
    """What the user reads before confirming: what the agent asks for beyond the current version."""
    return {"steer_id": steer_id, "task_id": task.id, "title": task.title, "version": task.current_version,
            "summary": "The agent asks to widen this task. Nothing changes unless you confirm.",
            "lines": list(widens), "confirm_with": f"wakeful confirm {steer_id}",
            "reject_with": f"wakeful reject {steer_id}"}


def _decide(conn: Connection, *, user_id: str, steer_id: str, task_id: str | None, target: SteerState,
            actor: str, now: datetime) -> Any:
    """Move a proposal awaiting the user to `target`; returns its row."""
    query = select(steer_proposals).where(and_(steer_proposals.c.id == steer_id, steer_proposals.c.user_id == user_id))
    row = conn.execute(query if task_id is None else query.where(steer_proposals.c.task_id == task_id)).first()
    if row is None:
        raise NotFound("unknown_steer", f"no proposed steer {steer_id} for this user", steer_id=steer_id)
    moved = conn.execute(update(steer_proposals).where(and_(
        steer_proposals.c.id == steer_id, steer_proposals.c.state == SteerState.AWAITING_USER.value))
        .values(state=target.value, decided_by=actor, decided_at=now)).rowcount
    if moved != 1:
        hint = ": the task was steered to a newer version after it was proposed" \
            if row.state == SteerState.SUPERSEDED.value else ""
        raise Conflict("not_awaiting_user", f"steer {steer_id} is {row.state}{hint}", steer_id=steer_id,
                       state=row.state)
    return row


def confirm(conn: Connection, *, user_id: str, steer_id: str, actor: str, now: datetime,
            task_id: str | None = None) -> Decided:
    """The user confirms a proposed steer: it becomes the task's next version, written by the user."""
    row = _decide(conn, user_id=user_id, steer_id=steer_id, task_id=task_id, target=SteerState.CONFIRMED,
                  actor=actor, now=now)
    version = control.steer(conn, user_id=user_id, task_id=row.task_id, goal=row.goal,
                            constraints=json.loads(row.constraints), completion=json.loads(row.completion),
                            actor=actor, now=now)
    return Decided(steer_id=steer_id, task_id=row.task_id, state=SteerState.CONFIRMED, version=version)


def reject(conn: Connection, *, user_id: str, steer_id: str, actor: str, now: datetime,
           task_id: str | None = None) -> Decided:
    """The user rejects a proposed steer: the task stays at the version it was proposed against (still the current
    one: a newer version would have superseded the proposal)."""
    row = _decide(conn, user_id=user_id, steer_id=steer_id, task_id=task_id, target=SteerState.REJECTED,
                  actor=actor, now=now)
    return Decided(steer_id=steer_id, task_id=row.task_id, state=SteerState.REJECTED, version=row.base_version)
