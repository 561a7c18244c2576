"""Reads about an action the provider has not settled: when the next one is due, and what to tell the user when
the reads stop.

An action whose outcome is unknown is read with its `reconcile` request; one the provider accepted, whose task asks
for a fresh read, with its `verify` request (see `dispatch`). Every read, answered or not, is an evidence row of that
source, so the rows are the whole schedule: how many reads, when the last one was, and with `pacing` when the next
is due. Past the deadline (the reconcile wait's, or `verify_window` after the acceptance) the reads stop and the user
gets one message built from the same rows: what is still open, how many reads since when, the provider's last
answer, and what they can do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import Connection, and_, func, select

from wakeful.server.acting.actions import Action
from wakeful.server.acting.connectors import values_at
from wakeful.server.core import outbox
from wakeful.server.egress.pacing import Pacing
from wakeful.server.store.tables import Outcome, attempts, evidence, tasks

__all__ = ["Answer", "Look", "accepted_at", "observed", "schedule", "tell_unknown", "tell_unverified"]


@dataclass(frozen=True, kw_only=True)
class Answer:
    """What one read got back: a readable 2xx body, another status, or no answer at all (`error`)."""

    status_code: int | None
    body: Any
    error: str | None

    @property
    def readable(self) -> bool:
        return self.error is None and self.status_code is not None and 200 <= self.status_code < 300


def observed(spec: Mapping[str, Any], answer: Answer, **verdict: bool) -> dict[str, Any]:
    """What a read saw, as its evidence row keeps it: the query, the status code, the body, the error if any."""
    seen = {"query": spec["request"], "status_code": answer.status_code, "body": answer.body, **verdict}
    return seen if answer.error is None else {**seen, "error": answer.error}


@dataclass(frozen=True, kw_only=True)
class Look:
    action_id: str
    due_at: datetime
    """When the next read is due, or the deadline if that comes first."""


@dataclass(frozen=True, kw_only=True)
class _Reads:
    """The reads of one source about one action, from its evidence rows."""

    count: int
    last_at: datetime | None
    last: Mapping[str, Any] | None
    """What the last read observed: the query, the status code, the body, the error if there was no answer."""


def schedule(conn: Connection, *, source: str, since: Mapping[str, datetime], pacing: Pacing,
             deadlines: Mapping[str, datetime] | None = None) -> list[Look]:
    """When each action in `since` (action ID → when its reads began) is next due for a read of `source`, earliest
    first."""
    if not since:
        return []
    done = {row.action_id: (row.reads, row.last_at) for row in conn.execute(
        select(evidence.c.action_id, func.count().label("reads"), func.max(evidence.c.checked_at).label("last_at"))
        .where(and_(evidence.c.source == source, evidence.c.action_id.in_(list(since))))
        .group_by(evidence.c.action_id))}
    looks = []
    for action_id, began in since.items():
        count, last_at = done.get(action_id, (0, None))
        due_at = pacing.due_at(action_id, since=began, reads=count, last=last_at)
        if deadlines is not None:
            due_at = min(due_at, deadlines[action_id])
        looks.append(Look(action_id=action_id, due_at=due_at))
    return sorted(looks, key=lambda look: look.due_at)


def accepted_at(conn: Connection, ids: Sequence[str]) -> dict[str, datetime]:
    """When each of these actions was first known accepted: by the remote's answer, or by reconciliation."""
    by_answer = select(attempts.c.action_id, func.min(attempts.c.outcome_at)).where(and_(
        attempts.c.action_id.in_(ids), attempts.c.outcome == Outcome.ACCEPTED.value)).group_by(attempts.c.action_id)
    by_reconcile = select(evidence.c.action_id, func.min(evidence.c.checked_at)).where(and_(
        evidence.c.action_id.in_(ids), evidence.c.source == "reconcile",
        evidence.c.verdict == Outcome.ACCEPTED.value)).group_by(evidence.c.action_id)
    first: dict[str, datetime] = {}
    for action_id, at in [*conn.execute(by_answer), *conn.execute(by_reconcile)]:
        first[action_id] = min(at, first.get(action_id, at))
    return first


def tell_unknown(conn: Connection, action: Action, *, session_id: str | None, now: datetime) -> None:
    """The one message past the reconcile window (`unk_<action>`): the outcome is still unknown."""
    sent = conn.execute(select(attempts.c.created_at, attempts.c.detail).where(
        attempts.c.action_id == action.id).order_by(attempts.c.seq)).all()
    text = _unknown_text(action, sent_at=sent[0].created_at, detail=sent[0].detail or "none recorded",
                         sends=len(sent), reads=_reads(conn, action_id=action.id, source="reconcile"))
    _tell(conn, f"unk_{action.id}", action=action, session_id=session_id, now=now,
          body={"kind": "outcome_unknown", "action_id": action.id, "text": text})


def tell_unverified(conn: Connection, action: Action, *, accepted_at: datetime, now: datetime) -> None:
    """The one message past the verify window (`unv_<action>`): accepted, and the provider's records still do not
    show it done."""
    session_id = conn.execute(select(tasks.c.session_id).where(tasks.c.id == action.task_id)).scalar_one()
    text = _unverified_text(action, accepted_at=accepted_at, reads=_reads(conn, action_id=action.id, source="verify"))
    _tell(conn, f"unv_{action.id}", action=action, session_id=session_id, now=now,
          body={"kind": "effect_unverified", "action_id": action.id, "task_id": action.task_id, "text": text})


def _tell(conn: Connection, message_id: str, *, action: Action, session_id: str | None, body: dict[str, Any],
          now: datetime) -> None:
    """A message to the user under a fixed ID: however many rounds (or servers) get here, it is sent once."""
    outbox.enqueue(conn, user_id=action.user_id, session_id=session_id, body=body, now=now, message_id=message_id,
                   once=True)


def _reads(conn: Connection, *, action_id: str, source: str) -> _Reads:
    rows = conn.execute(select(evidence.c.observed, evidence.c.checked_at).where(and_(
        evidence.c.action_id == action_id, evidence.c.source == source))
        .order_by(evidence.c.checked_at, evidence.c.id)).all()
    if not rows:
        return _Reads(count=0, last_at=None, last=None)
    return _Reads(count=len(rows), last_at=rows[-1].checked_at, last=json.loads(rows[-1].observed))


def _unknown_text(action: Action, *, sent_at: datetime, detail: str, sends: int, reads: _Reads) -> str:
    parts = [f"I still cannot confirm whether {_what(action)} took effect: I sent it at {_when(sent_at)} and got no "
             f"definite answer ({detail})."]
    parts.append("I have not sent it again." if sends <= 1 else
                 f"I sent it {sends - 1} more time(s) with the same idempotency key after the provider showed no "
                 "trace of it; none of those was confirmed either.")
    parts.append(_tried(reads, "asked the provider", done_when=_done_when(action, "reconcile")) if reads.count else
                 "I have no read that could ask the provider about it.")
    key = action.content.get("idempotency_key")
    parts.append("I have stopped asking; it stays recorded as unknown, not as failed. What you can do: check with the "
                 f"provider yourself{f' (the request carried the idempotency key {key})' if key else ''}; "
                 f"`wakeful ledger {action.task_id}` shows every request and answer; if it did not happen and you "
                 "still want it, tell me and I will prepare it again.")
    return " ".join(parts)


def _unverified_text(action: Action, *, accepted_at: datetime, reads: _Reads) -> str:
    parts = [f"The provider accepted {_what(action)} at {_when(accepted_at)}, but its own records still do not show "
             "it done."]
    if reads.count:
        parts.append(_tried(reads, "read it", done_when=_done_when(action, "verify")))
    parts.append("I have stopped checking, so no receipt will come for it; the action stays recorded as accepted, "
                 f"not verified, and the task stays open. What you can do: check with the provider yourself; "
                 f"`wakeful ledger {action.task_id}` shows every read; when you are satisfied, close the task with "
                 f"`wakeful close {action.task_id}`.")
    return " ".join(parts)


def _tried(reads: _Reads, verb: str, *, done_when: Mapping[str, Any] | None) -> str:
    assert reads.last is not None and reads.last_at is not None
    query = reads.last.get("query") or {}
    path = urlsplit(str(query.get("url", ""))).path
    return (f"Since then I {verb} {reads.count} times ({query.get('method', 'GET')} {path}), the last at "
            f"{_when(reads.last_at)}; the last answer: {_answer(reads.last, done_when)}.")


def _answer(seen: Mapping[str, Any], done_when: Mapping[str, Any] | None) -> str:
    """A read's answer in a few words: no answer, an HTTP status, or what the awaited field said."""
    status, body, error = seen.get("status_code"), seen.get("body"), seen.get("error")
    if error:
        return f"HTTP {status}, {error}" if status is not None else f"no answer ({error})"
    if status is None or not 200 <= int(status) < 300 or body is None:
        return f"HTTP {status}, nothing I can read"
    at = (done_when or {}).get("at") or ""
    shown = [json.dumps(v) for v in values_at(body, at) if v is not None] if at else []
    if shown:
        return f"HTTP {status}, {at} = {', '.join(shown)}"
    return f"HTTP {status}, no trace of it"


def _done_when(action: Action, spec: str) -> Mapping[str, Any] | None:
    declared = action.content.get(spec) or {}
    done_when = declared.get("done_when")
    return done_when if isinstance(done_when, Mapping) else None


def _what(action: Action) -> str:
    refs = action.content.get("refs") or {}
    named = "; ".join([*(f"{name} {ref}" for name, ref in sorted(refs.items())), f"action {action.id}"])
    return f"{action.tool} ({named})"


def _when(moment: datetime) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"
