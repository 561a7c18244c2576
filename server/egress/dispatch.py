"""The action dispatcher and the reconciler: where an admitted action meets the outside world.

Dispatch, per intent:
    lock the task; ask `leave_check` (STOP, pause, revocation, close, task version, objects) → held or voided
    persist the attempt (request, idempotency key)                                → committed BEFORE the send
    send; normalise the outcome to accepted | blocked | unknown; record it once, with evidence
    unknown → a reconcile wait; never a blind retry
An attempt found without an outcome (the process died between persisting and recording) is unknown by
definition: it is reconciled, not re-sent. Reconciliation queries the remote (by idempotency key or by reading the
object) and adds evidence rows; only when the remote says the effect did not happen and the operation carries an
idempotency key may the same request, with the same key, be sent again. Past the reconcile window the user is
told exactly what is and is not known. Accepted effects whose task asks for it are verified by a fresh read, up to
the verify window. Reads about one action are paced (`pacing`, scheduled from the evidence rows by `looks`): a read
that changed nothing never makes the next one come sooner, and never wakes the reconciler again.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import ColumnElement, Connection, Engine, String, and_, func, literal, or_, select, update

from wakeful.proxy.clock import Clock
from wakeful.proxy.contract import REFUSAL_HEADER, EgressRequest, RefusalCode
from wakeful.proxy.wire import REQUEST_TOO_LARGE
from wakeful.server.acting.actions import Action, content_hash, load_action
from wakeful.server.acting.connectors import DoneWhen, done_when_holds
from wakeful.server.acting.leave import Leave, leave_check
from wakeful.server.acting.policy import Policy
from wakeful.server.acting.verdicts import leave_facts, lock_task
from wakeful.server.computers.pool import ACT_TOOL, Computers, act_from_args
from wakeful.server.computers.pool import execute as execute_act
from wakeful.server.core import faults, inbox, outbox, waits
from wakeful.server.core.outbox import OutboxDrain
from wakeful.server.egress.looks import Answer, Look, accepted_at, observed, schedule, tell_unknown, tell_unverified
from wakeful.server.egress.outbound import ConnectorHTTP
from wakeful.server.egress.pacing import Pacing
from wakeful.server.errors import WakefulError
from wakeful.server.store.db import read, write
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import (
    Authority,
    EventKind,
    GrantPurpose,
    OutboxKind,
    OutboxState,
    Outcome,
    TaskState,
    VerdictKind,
    WaitState,
    attempts,
    evidence,
    task_versions,
    verdicts,
)
from wakeful.server.store.tables import actions as actions_table
from wakeful.server.store.tables import outbox as outbox_table
from wakeful.server.store.tables import tasks as tasks_table
from wakeful.server.store.tables import waits as waits_table
from wakeful.vm.observe import Refused as ActRefused

__all__ = ["ActionDispatcher", "add_evidence", "classify", "proxy_refusal", "reconcile_key"]

HELD, SETTLED = "held", "settled"
_PROXY_REFUSALS = frozenset(code.value for code in RefusalCode) | {REQUEST_TOO_LARGE}
"""What the egress proxy answers before dialling anything; not upstream_failed / upstream_timeout (it had dialled)."""

log = logging.getLogger(__name__)

_REF_FIELDS = ("id", "cancellation_id", "order_id", "booking_id", "reference")


def reconcile_key(action_id: str) -> str:
    return f"reconcile:{action_id}"


@dataclass(frozen=True, kw_only=True)
class Result:
    outcome: Outcome
    status_code: int | None
    external_ref: str | None
    detail: str
    body: Any = None


def proxy_refusal(response: httpx.Response) -> tuple[str, str] | None:
    """The egress proxy's own (code, reason) when it refused the request before dialling anything, else None (it
    strips its refusal header from upstream answers, so a remote cannot pose as the proxy)."""
    code = response.headers.get(REFUSAL_HEADER)
    if code not in _PROXY_REFUSALS:
        return None
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    return code, str(error.get("message", "")) if isinstance(error, dict) else ""


def classify(response: httpx.Response | None, error: Exception | None) -> Result:
    """Normalise what came back to exactly one of accepted, blocked, unknown."""
    if error is not None:
        if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout):
            return Result(outcome=Outcome.BLOCKED, status_code=None, external_ref=None,
                          detail=f"no connection was made ({type(error).__name__}); the request did not leave")
        return Result(outcome=Outcome.UNKNOWN, status_code=None, external_ref=None,
                      detail=f"{type(error).__name__} after the request was sent; it may have been applied")
    assert response is not None
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    status = response.status_code
    refused = proxy_refusal(response)
    if refused is not None:
        code, reason = refused
        return Result(outcome=Outcome.BLOCKED, status_code=status, external_ref=None, body=body,
                      detail=f"refused by the egress proxy ({code}): {reason}".strip())
    if 200 <= status < 300:
        ref = next((str(body[k]) for k in _REF_FIELDS if isinstance(body, dict) and body.get(k)), None)
        return Result(outcome=Outcome.ACCEPTED, status_code=status, external_ref=ref, body=body,
                      detail="processing" if status == 202 else "accepted")
    if 400 <= status < 500 and status not in (408, 429):
        return Result(outcome=Outcome.BLOCKED, status_code=status, external_ref=None, body=body,
                      detail=f"refused by the remote: HTTP {status} {json.dumps(body)[:200] if body else ''}".strip())
    return Result(outcome=Outcome.UNKNOWN, status_code=status, external_ref=None, body=body,
                  detail=f"HTTP {status}: the remote may or may not have applied it")


PACING = Pacing(first=timedelta(seconds=5), cap=timedelta(minutes=10))
"""The settings' defaults (`reconcile_interval`, `reconcile_backoff_max`)."""


class ActionDispatcher:
    def __init__(self, engine: Engine, clock: Clock, *, policy: Policy, timeout: float = 10.0,
                 resend_after: timedelta = timedelta(seconds=10), http: ConnectorHTTP | None = None,
                 computers: Computers | None = None, on_event: Any = lambda: None, pacing: Pacing = PACING,
                 one_at_a_time: Callable[[str], AbstractContextManager[None]] = lambda _: nullcontext()) -> None:
        """`one_at_a_time(action_id)`: held around each dispatch, for the dispatchers of other processes (the API
        runs the acts it admits at once while the worker's dispatcher drains; `server.computers.remote`)."""
        self._engine = engine
        self._one_at_a_time = one_at_a_time
        self._clock = clock
        self._policy = policy
        self._resend_after = resend_after
        self._pacing = pacing
        self._http = http or ConnectorHTTP(timeout=timeout)
        self._computers = computers
        self._on_event = on_event
        self._sending: dict[str, threading.Lock] = {}
        self._sending_lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    # -- dispatch ----------------------------------------------------------------------------------------------

    # The outbox handler for action intents (see `core.outbox.OutboxHandler`); the runtime registers it with the
    # one `OutboxDrain` beside the message delivery.
    kind = OutboxKind.DISPATCH

    def ready(self) -> ColumnElement[bool]:
        # Intents held by a pause or the hold of the user's message are left unclaimed (STOP the drain leaves out
        # itself), so they never crowd out the others.
        paused = select(tasks_table.c.session_id).where(
            tasks_table.c.state.in_([TaskState.PAUSED.value, TaskState.HELD.value]))
        return or_(outbox_table.c.session_id.is_(None), outbox_table.c.session_id.not_in(paused))

    def handle(self, rows: Sequence[Any]) -> int:
        done = 0
        for row in rows:
            try:
                done += self.dispatch(row.id, json.loads(row.body)["action_id"])
            except Exception:
                log.exception("dispatch of %s failed unexpectedly; it stays pending", row.id)
        return done

    def drain(self, limit: int = 50) -> int:
        """Dispatch the due intents alone, through the one outbox drain (the runtime drains every kind at once)."""
        return OutboxDrain(self._engine, self._clock, [self]).drain(limit)

    def dispatch(self, intent_id: str, action_id: str) -> int:
        """Returns 1 when the intent was settled (sent, voided or handed to reconciliation), 0 when held.

        One action is dispatched by one caller at a time in this process (the loop, or a tool call executing an
        act it just admitted): a second caller waits and then finds the intent settled."""
        with self._sending_lock:
            lock = self._sending.setdefault(action_id, threading.Lock())
        with lock, self._one_at_a_time(action_id):
            try:
                return self._dispatch(intent_id, action_id)
            finally:
                with self._sending_lock:
                    self._sending.pop(action_id, None)

    def _dispatch(self, intent_id: str, action_id: str) -> int:
        now = self._clock.now()
        with write(self._engine) as conn:
            pending = conn.execute(select(outbox_table.c.state).where(outbox_table.c.id == intent_id)).scalar()
            if pending != OutboxState.PENDING.value:
                return 1  # settled by another caller meanwhile
            action = load_action(conn, action_id)
            prepared = self._prepare(conn, intent_id, action, now)
        if isinstance(prepared, str):
            return 0 if prepared == HELD else 1
        attempt_id, grant = prepared
        faults.crash_point("after_attempt_persisted")
        if action.tool == ACT_TOOL:
            result = self._act(action)
        else:
            response, error = self._send(EgressRequest.from_json(action.content["request"]), grant)
            result = classify(response, error)
        faults.crash_point("after_send")
        self._record(attempt_id, action, result, intent_id=intent_id)
        return 1

    def _act(self, action: Action) -> Result:
        """Run a tool-computer act. The tool computer checks it against the latest observation first: a stale or
        refused act runs nothing (blocked); an act that failed before touching the page is blocked; one whose
        effect is unclear (a timeout, a lost connection) is unknown, to be settled by observing, never repeated."""
        if self._computers is None:
            return Result(outcome=Outcome.BLOCKED, status_code=None, external_ref=None,
                          detail="tool computers are not enabled on this server; nothing was done")
        act = act_from_args(action.content["act"])
        try:
            done = execute_act(self._computers, action.user_id, act)
        except WakefulError as exc:
            return Result(outcome=Outcome.BLOCKED, status_code=None, external_ref=None,
                          detail=f"{exc.code}: {exc.message}")
        if isinstance(done, ActRefused):  # refused by the tool computer: nothing ran
            return Result(outcome=Outcome.BLOCKED, status_code=None, external_ref=None,
                          detail=f"{done.code}: {done.message}")
        outcome = {"done": Outcome.ACCEPTED, "failed": Outcome.BLOCKED}.get(done.outcome, Outcome.UNKNOWN)
        detail = done.detail or done.outcome
        return Result(outcome=outcome, status_code=None, external_ref=None, detail=detail if not done.code else
                      f"{done.code}: {detail}", body={"navigated": done.navigated, "observation": done.observation,
                                                       "epoch": done.epoch})

    def _prepare(self, conn: Connection, intent_id: str, action: Action,
                 now: datetime) -> str | tuple[str, dict[str, str]]:
        """Re-check everything and persist the attempt with its egress grant. Returns the attempt's ID and the
        grant's headers, or HELD (nothing may be sent now; it will be once the hold lifts) or SETTLED (the intent
        needs no send: voided, recovered or done)."""
        task = lock_task(conn, action.task_id)
        if content_hash(action.content) != action.content_hash:
            self._void(conn, intent_id, action, "content_tampered", "the stored content no longer matches its hash",
                       now)
            return SETTLED
        previous = conn.execute(select(attempts).where(attempts.c.action_id == action.id)
                                .order_by(attempts.c.seq.desc())).all()
        open_attempt = next((a for a in previous if a.outcome is None), None)
        if open_attempt is not None:
            # The process died between persisting this attempt and recording its outcome: it may have left. This
            # comes before every hold or void: whatever the task's state now, that request must be reconciled.
            self._settle_attempt(conn, open_attempt.id, action, Result(
                outcome=Outcome.UNKNOWN, status_code=None, external_ref=None,
                detail="the dispatcher stopped after persisting the attempt; the request may or may not have left"),
                now=now, intent_id=intent_id, source="recovery")
            return SETTLED
        leaving = leave_check(leave_facts(conn, action, task=task, now=now))
        if leaving.kind is Leave.HOLD:
            # Released again by START / resume, never sent while held; due again at once (a PostgreSQL drain's
            # claim moved it out of the other drains' reach for a while: not for that long once the hold lifts).
            conn.execute(update(outbox_table).where(and_(outbox_table.c.id == intent_id,
                                                         outbox_table.c.state == OutboxState.PENDING.value))
                         .values(next_attempt_at=now))
            return HELD
        if leaving.kind is Leave.VOID:  # an expired quote is not sent either, even if it was approved in time
            self._void(conn, intent_id, action, leaving.code, leaving.detail, now)
            return SETTLED
        if any(a.outcome == Outcome.ACCEPTED.value for a in previous):
            self._finish_intent(conn, intent_id, now)
            return SETTLED
        attempt_id = new_id("att")
        if action.tool == ACT_TOOL:  # an act on the tool computer: no HTTP request, no egress grant
            conn.execute(attempts.insert().values(id=attempt_id, action_id=action.id, seq=len(previous) + 1,
                                                  request=json.dumps({"act": action.content["act"]}, sort_keys=True),
                                                  created_at=now))
            return attempt_id, {}
        request = EgressRequest.from_json(action.content["request"])
        # The attempt records the request in its one stored form; the idempotency key rides beside it (it is also
        # in the headers under the operation's own name) because attempts have always carried it there.
        recorded = {**request.to_json(), "idempotency_key": action.content.get("idempotency_key")}
        conn.execute(attempts.insert().values(id=attempt_id, action_id=action.id, seq=len(previous) + 1,
                                              request=json.dumps(recorded, sort_keys=True), created_at=now))
        grant = self._grant(conn, action, GrantPurpose.WRITE, request, now=now, attempt_id=attempt_id)
        return attempt_id, grant

    def _grant(self, conn: Connection, action: Action, purpose: GrantPurpose, request: EgressRequest, *,
               now: datetime, attempt_id: str | None = None) -> dict[str, str]:
        return self._http.grant(conn, purpose=purpose, user_id=action.user_id, task_id=action.task_id,
                                tool=action.tool, request=request, credential=action.content.get("credential"),
                                now=now, action_id=action.id, attempt_id=attempt_id)

    def _send(self, request: EgressRequest,
              grant: dict[str, str]) -> tuple[httpx.Response | None, Exception | None]:
        try:  # the idempotency key is among the request's headers; no credential is: the proxy adds it
            return self._http.send(request, grant), None
        except httpx.HTTPError as exc:
            return None, exc

    def _query(self, action: Action, purpose: GrantPurpose, stored: Mapping[str, Any]) -> httpx.Response:
        """A read that settles or checks an action (reconcile, verify), granted like any other egress."""
        request = EgressRequest.from_json(stored)
        with write(self._engine) as conn:
            grant = self._grant(conn, action, purpose, request, now=self._clock.now())
        return self._http.send(request, grant)

    def _record(self, attempt_id: str, action: Action, result: Result, *, intent_id: str) -> None:
        with write(self._engine) as conn:
            self._settle_attempt(conn, attempt_id, action, result, now=self._clock.now(), intent_id=intent_id)
        self._on_event()

    def _settle_attempt(self, conn: Connection, attempt_id: str, action: Action, result: Result, *,
                        now: datetime, intent_id: str, source: str = "response") -> None:
        written = conn.execute(update(attempts).where(and_(attempts.c.id == attempt_id, attempts.c.outcome.is_(None)))
                               .values(outcome=result.outcome.value, outcome_at=now, status_code=result.status_code,
                                       external_ref=result.external_ref, detail=result.detail)).rowcount
        if written != 1:
            return  # someone recorded it first; history is written once
        add_evidence(conn, action=action, attempt_id=attempt_id, source=source, verdict=result.outcome,
                     observed={"status_code": result.status_code, "detail": result.detail,
                               "external_ref": result.external_ref, "body": result.body}, now=now)
        self._finish_intent(conn, intent_id, now)
        task = lock_task(conn, action.task_id)
        if result.outcome is not Outcome.UNKNOWN:
            # A definite answer (to a resend, say) settles what reconciliation was asking.
            waits.settle(conn, user_id=action.user_id, match_key=reconcile_key(action.id), now=now)
        else:
            exists = conn.execute(select(waits_table.c.id).where(and_(
                waits_table.c.user_id == action.user_id,
                waits_table.c.match_key == reconcile_key(action.id)))).first()
            if exists is None:
                waits.register(conn, user_id=action.user_id, session_id=task.session_id,
                               match_key=reconcile_key(action.id), kind="reconcile", authority=Authority.SYSTEM,
                               task_id=action.task_id,
                               deadline=now + self._policy.reconcile_window, now=now)
        inbox.record(conn, inbox.Delivery(
            user_id=action.user_id, source="dispatch", source_id=attempt_id, kind=EventKind.WEBHOOK, trust="system",
            authority=Authority.SYSTEM, session_id=task.session_id,
            payload={"action_id": action.id, "tool": action.tool, "outcome": result.outcome.value,
                     "detail": result.detail, "external_ref": result.external_ref},
        ), now=now)

    def _finish_intent(self, conn: Connection, intent_id: str, now: datetime) -> None:
        conn.execute(update(outbox_table).where(and_(outbox_table.c.id == intent_id,
                                                     outbox_table.c.state == OutboxState.PENDING.value))
                     .values(state=OutboxState.SENT.value, sent_at=now))

    def _void(self, conn: Connection, intent_id: str, action: Action, code: str, detail: str, now: datetime) -> None:
        conn.execute(verdicts.insert().values(
            id=new_id("vrd"), action_id=action.id, verdict=VerdictKind.REFUSED.value, code=code,
            reasons=json.dumps([{"check": "dispatch_recheck", "ok": False, "detail": detail}]), created_at=now))
        conn.execute(update(outbox_table).where(and_(outbox_table.c.id == intent_id,
                                                     outbox_table.c.state == OutboxState.PENDING.value))
                     .values(state=OutboxState.FAILED.value, last_error=code))
        task = lock_task(conn, action.task_id)
        earlier = conn.execute(select(func.count()).select_from(attempts).where(attempts.c.action_id == action.id)
                               ).scalar_one()
        said = ("Nothing was sent for it." if not earlier else
                "An earlier request for it did leave; I am still checking with the provider whether it took effect.")
        outbox.enqueue(conn, user_id=action.user_id, session_id=task.session_id, now=now,
                       message_id=f"void_{action.id}_{earlier}",
                       body={"kind": "action_voided", "action_id": action.id, "code": code,
                             "text": f"I did not send {action.tool} again: {detail}. {said}" if earlier else
                                     f"I did not send {action.tool}: {detail}. {said}"})

    # -- reconcile ---------------------------------------------------------------------------------------------

    def reconcile_due(self, limit: int = 50) -> int:
        """Read the provider about every action whose outcome is still unknown and whose next read is due; returns
        how many were read. Then tell the user about those whose reconcile window ran out."""
        now = self._clock.now()
        with read(self._engine) as conn:
            due = [look.action_id for look in self._reconcile_looks(conn, now) if look.due_at <= now][:limit]
        for action_id in due:
            try:
                self.reconcile(action_id)
            except Exception:  # one action's trouble must not stop the others' reconciliation
                log.exception("reconciling %s failed; it is tried again next round", action_id)
        self._tell_timed_out()
        return len(due)

    def reconcile(self, action_id: str) -> Outcome:
        with read(self._engine) as conn:
            action = load_action(conn, action_id)
            last = conn.execute(select(attempts).where(attempts.c.action_id == action_id)
                                .order_by(attempts.c.seq.desc()).limit(1)).one()
        spec = action.content.get("reconcile")
        if spec is None:
            return Outcome.UNKNOWN
        answer = self._read(action, GrantPurpose.RECONCILE, spec)
        found = answer.readable and done_when_holds(DoneWhen.model_validate(spec["done_when"]), answer.body)
        now = self._clock.now()
        with write(self._engine) as conn:
            add_evidence(conn, action=action, attempt_id=last.id, source="reconcile",
                         verdict=Outcome.ACCEPTED if found else Outcome.UNKNOWN,
                         observed=observed(spec, answer, found=found), now=now)
            if found:
                inbox.record(conn, inbox.Delivery(
                    user_id=action.user_id, source="reconcile", source_id=f"{action.id}:found", trust="system",
                    authority=Authority.SYSTEM, corr_key=reconcile_key(action.id),
                    payload={"action_id": action.id, "outcome": Outcome.ACCEPTED.value,
                             "detail": "the remote shows the effect"},
                ), now=now)
            elif action.content.get("idempotency_key") and now - last.created_at >= self._resend_after and \
                    answer.readable:
                # The remote says it did not happen and deduplicates by key: the same request may go again.
                session_id = lock_task(conn, action.task_id).session_id
                outbox.enqueue(conn, user_id=action.user_id, kind=OutboxKind.DISPATCH, session_id=session_id, now=now,
                               body={"action_id": action.id}, message_id=f"dsp_{action.id}_{last.seq + 1}",
                               once=True)  # one resend per attempt, however often we look
        if found:
            self._on_event()  # only news wakes the loops: a read that changed nothing waits for its turn
        return Outcome.ACCEPTED if found else Outcome.UNKNOWN

    def next_look(self) -> datetime | None:
        """When the next read about an unsettled action is due (or a verify deadline falls); None: none waits."""
        now = self._clock.now()
        with read(self._engine) as conn:
            looks = self._reconcile_looks(conn, now) + self._verify_looks(conn)[0]
        return min((look.due_at for look in looks), default=None)

    def _reconcile_looks(self, conn: Connection, now: datetime) -> list[Look]:
        """The actions with a pending reconcile wait inside its window and a read to reconcile them with."""
        pending = conn.execute(select(waits_table.c.match_key, waits_table.c.created_at).where(and_(
            waits_table.c.kind == "reconcile", waits_table.c.state == WaitState.PENDING.value,
            or_(waits_table.c.deadline.is_(None), waits_table.c.deadline > now)))).all()
        since = {w.match_key.removeprefix("reconcile:"): w.created_at for w in pending}
        readable = {a: t for a, t in since.items() if load_action(conn, a).content.get("reconcile") is not None}
        return schedule(conn, source="reconcile", since=readable, pacing=self._pacing)

    def _read(self, action: Action, purpose: GrantPurpose, spec: Mapping[str, Any]) -> Answer:
        """One read that settles or checks an action; no answer is an answer too, recorded and paced like any."""
        try:
            response = self._query(action, purpose, spec["request"])
        except httpx.HTTPError as exc:
            log.info("a %s read for %s got no answer: %s", purpose.value, action.id, exc)
            return Answer(status_code=None, body=None, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
        if not response.is_success:
            return Answer(status_code=response.status_code, body=None, error=None)
        try:
            return Answer(status_code=response.status_code, body=response.json(), error=None)
        except ValueError:
            return Answer(status_code=response.status_code, body=None, error="the answer was not JSON")

    # -- verify and complete -------------------------------------------------------------------------------------

    def verify_due(self, limit: int = 50) -> int:
        """Re-read the world for accepted actions whose task version asks for it, each when its next read is due;
        past the verify window, tell the user once instead. Then check completion. Returns how many were read."""
        now = self._clock.now()
        with read(self._engine) as conn:
            looks, since = self._verify_looks(conn)
            due = [load_action(conn, look.action_id) for look in looks if look.due_at <= now]
        checked = 0
        for action in due:
            if since[action.id] + self._policy.verify_window <= now:  # past the window: the reads stop, once told
                with write(self._engine) as conn:
                    tell_unverified(conn, action, accepted_at=since[action.id], now=now)
            elif checked < limit:
                checked += 1
                self._verify(action)
        self.complete_due()
        return checked

    def _verify_looks(self, conn: Connection) -> tuple[list[Look], dict[str, datetime]]:
        """The accepted, unverified actions whose task asks for a fresh read and whose user was not told yet that
        the reads stopped; and when each was accepted."""
        accepted = _accepted_actions(conn)
        verified = select(evidence.c.action_id).where(and_(
            evidence.c.source == "verify", evidence.c.verdict == Outcome.ACCEPTED.value))
        told = select(outbox_table.c.id).where(outbox_table.c.id.like("unv\\_%", escape="\\"))
        # Canonical JSON escapes quotes inside strings, so this matches only a top-level "verify" member.
        ids = conn.execute(select(actions_table.c.id).where(and_(
            actions_table.c.id.in_(accepted), actions_table.c.id.not_in(verified),
            actions_table.c.content.like('%"verify":{%'),
            (literal("unv_", String) + actions_table.c.id).not_in(told)))).scalars().all()
        since = accepted_at(conn, ids)
        deadlines = {a: t + self._policy.verify_window for a, t in since.items()}
        return schedule(conn, source="verify", since=since, pacing=self._pacing, deadlines=deadlines), since

    def _verify(self, action: Action) -> None:
        spec = action.content["verify"]
        answer = self._read(action, GrantPurpose.VERIFY, spec)
        holds = answer.readable and done_when_holds(DoneWhen.model_validate(spec["done_when"]), answer.body)
        with write(self._engine) as conn:
            add_evidence(conn, action=action, attempt_id=None, source="verify",
                         verdict=Outcome.ACCEPTED if holds else Outcome.UNKNOWN,
                         observed=observed(spec, answer, holds=holds), now=self._clock.now())

    def complete_due(self) -> int:
        """Tasks whose current version's completion conditions all hold on recorded evidence get their receipt."""
        done = 0
        with read(self._engine) as conn:
            accepted = _accepted_actions(conn)
            if not accepted:
                return 0
            # Only active tasks with conditions, an accepted action in their current version and no receipt yet.
            with_accepted = select(actions_table.c.task_id).where(and_(
                actions_table.c.id.in_(accepted), actions_table.c.task_version == tasks_table.c.current_version))
            candidates = conn.execute(select(tasks_table.c.id).join(
                task_versions, and_(task_versions.c.task_id == tasks_table.c.id,
                                    task_versions.c.version == tasks_table.c.current_version)).where(and_(
                tasks_table.c.state == TaskState.ACTIVE.value, task_versions.c.completion != "[]",
                tasks_table.c.id.in_(with_accepted)))).scalars().all()
        if not candidates:
            return 0
        now = self._clock.now()
        with write(self._engine) as conn:
            verified = set(conn.execute(select(evidence.c.action_id).where(and_(
                evidence.c.source == "verify", evidence.c.verdict == Outcome.ACCEPTED.value))).scalars())
            rows = conn.execute(select(tasks_table, task_versions.c.completion, task_versions.c.goal).join(
                task_versions, and_(task_versions.c.task_id == tasks_table.c.id,
                                    task_versions.c.version == tasks_table.c.current_version)).where(
                tasks_table.c.id.in_(candidates))).all()
            for task in rows:
                conditions = json.loads(task.completion)
                receipt_id = f"rcpt_{task.id}_v{task.current_version}"
                if not conditions or conn.execute(select(outbox_table.c.id).where(
                        outbox_table.c.id == receipt_id)).first() is not None:
                    continue
                proof = _completion_proof(conn, task, conditions, accepted, verified)
                if proof is None:
                    continue
                done += 1
                add_evidence(conn, action=None, task_id=task.id, attempt_id=None, source="completion",
                             verdict=Outcome.ACCEPTED, observed={"version": task.current_version, "proof": proof},
                             now=now)
                outbox.enqueue(conn, user_id=task.user_id, session_id=task.session_id, now=now, message_id=receipt_id,
                               body={"kind": "receipt", "task_id": task.id, "proof": proof,
                                     "text": _receipt_text(task.goal, proof)})
        return done

    def _tell_timed_out(self) -> None:
        """One message for each reconcile wait that timed out: what is still unknown, and what was tried."""
        now = self._clock.now()
        told = select(outbox_table.c.id).where(outbox_table.c.id.like("unk\\_%", escape="\\"))
        untold = select(waits_table.c.match_key, waits_table.c.user_id, waits_table.c.session_id).where(and_(
            waits_table.c.kind == "reconcile", waits_table.c.state == WaitState.TIMED_OUT.value,
            (literal("unk_", String) + func.substr(waits_table.c.match_key, len(reconcile_key("")) + 1)).not_in(told)))
        with read(self._engine) as conn:  # most rounds have nobody to tell: no write transaction for them
            if conn.execute(untold.limit(1)).first() is None:
                return
        with write(self._engine) as conn:
            for w in conn.execute(untold).all():
                tell_unknown(conn, load_action(conn, w.match_key.removeprefix(reconcile_key(""))),
                             session_id=w.session_id, now=now)


def add_evidence(conn: Connection, *, action: Action | None, task_id: str | None = None, attempt_id: str | None,
                 source: str, verdict: Outcome, observed: Mapping[str, Any], now: datetime) -> str:
    evidence_id = new_id("evd")
    conn.execute(evidence.insert().values(
        id=evidence_id, action_id=action.id if action else None, attempt_id=attempt_id,
        task_id=action.task_id if action else task_id, source=source, verdict=verdict.value,
        observed=json.dumps(observed, sort_keys=True, default=str), checked_at=now))
    return evidence_id


def _accepted_actions(conn: Connection) -> set[str]:
    """Actions the remote accepted, by its answer or by reconciliation."""
    by_answer = select(attempts.c.action_id).where(attempts.c.outcome == Outcome.ACCEPTED.value)
    by_reconcile = select(evidence.c.action_id).where(and_(evidence.c.source == "reconcile",
                                                           evidence.c.verdict == Outcome.ACCEPTED.value))
    return set(conn.execute(by_answer.union(by_reconcile)).scalars()) - {None}


def _receipt_text(goal: str, proof: list[dict[str, Any]]) -> str:
    """What the receipt says is exactly what its proof shows: a fresh read of the provider's records, or only the
    provider's acceptance of the request where the task declared no read to verify it with."""
    verified = [p["action_id"] for p in proof if p["verified"]]
    accepted = [p["action_id"] for p in proof if not p["verified"]]
    parts = [f"Done: {goal}."]
    if verified:
        parts.append(f"Verified against the provider's own records ({', '.join(verified)}).")
    if accepted:
        parts.append(f"Accepted by the provider ({', '.join(accepted)}), not verified by a fresh read: the task "
                     "declares no read to check it with.")
    return " ".join(parts)


def _completion_proof(conn: Connection, task: Any, conditions: list[dict[str, Any]], accepted: set[str],
                      verified: set[str]) -> list[dict[str, Any]] | None:
    proof = []
    for condition in conditions:
        candidates = conn.execute(select(actions_table.c.id).where(and_(
            actions_table.c.task_id == task.id, actions_table.c.task_version == task.current_version,
            actions_table.c.tool == condition["effect"]))).scalars().all()
        met = [a for a in candidates if a in accepted and (condition.get("verify") is None or a in verified)]
        if not met:
            return None
        proof.append({"effect": condition["effect"], "action_id": met[0], "verified": met[0] in verified})
    return proof
