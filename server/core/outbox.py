"""The transactional outbox, its one drain, and the delivery of messages to the user.

`enqueue` writes a row in the caller's transaction, beside the state change that caused it. One `OutboxDrain`
empties the table for every kind of row: it claims the due rows of each kind (a guarded `UPDATE … WHERE state =
'pending' AND attempts = :seen` that counts the handover; a row another drain claimed first is skipped) and hands
them to the `OutboxHandler` registered for that kind. STOP holds every kind: a user's rows (or everyone's) stay
pending, untouched, until START. A claimed row stays due: a drain that died mid-handling leaves it to the next one,
so handlers must be safe to run again (a message's ID is its idempotency key; an action's open attempt is
reconciled, never re-sent). On PostgreSQL several drains run (one per worker process): a claim there is one
`UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED)` that also moves the rows out of the others' reach for a
hold, after which the rows of a drain that died fall due again.

Handlers here: `MessageDelivery` (kind `message`) delivers each message with its ID as the `Idempotency-Key` and
marks it sent with a guarded update; failures back off exponentially and are marked failed past the attempt cap.
Without a `notify_url` messages go to the local feed (`GET /v1/messages`) and are sent the moment they are drained.
A message to the user passes the speaking gate as it is queued (`core.speaking`): one it holds stays `held`, out of
the drain's reach, until its summary goes out.
The action intents' handler lives with the dispatcher (`egress.dispatch.ActionDispatcher`): the core never imports
it, the runtime registers it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol

import httpx
from sqlalchemy import ColumnElement, Connection, Engine, and_, bindparam, select, true, update

from wakeful.proxy.clock import Clock
from wakeful.server.core import control, faults, speaking
from wakeful.server.core.speaking import Level, Urgency
from wakeful.server.store.db import read, upsert, write
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import OutboxKind, OutboxState, outbox

__all__ = ["MessageDelivery", "OutboxDrain", "OutboxHandler", "enqueue", "linked"]

log = logging.getLogger(__name__)


_ENQUEUE = outbox.insert()  # built once (see `sessions`): a run enqueues while it holds the write lock


def enqueue(conn: Connection, *, user_id: str, body: dict[str, Any], now: datetime,
            kind: OutboxKind = OutboxKind.USER_MESSAGE, session_id: str | None = None, run_id: str | None = None,
            message_id: str | None = None, once: bool = False, level: Level = Level.NOTIFY,
            urgency: Urgency | None = None) -> str:
    """Queue one message; with `once` (and a fixed `message_id`), a row with that ID already queued is kept and this
    one dropped, so a check that runs every round (or on several servers) sends its message once. A message to the
    user passes the speaking gate (`core.speaking`): its level and urgency are stored in its body."""
    message_id = message_id or new_id("msg")
    if once and conn.execute(select(outbox.c.id).where(outbox.c.id == message_id)).first() is not None:
        return message_id  # before the gate, which would take the user's row lock for nothing
    row = {
        "id": message_id, "user_id": user_id, "kind": kind.value, "session_id": session_id, "run_id": run_id,
        "body": json.dumps(body, sort_keys=True), "state": OutboxState.PENDING.value, "attempts": 0,
        "next_attempt_at": now, "created_at": now,
    }
    if kind is OutboxKind.USER_MESSAGE:
        urgent = {"urgent": {"reason": urgency.reason, "deadline": urgency.deadline.isoformat()}} if urgency else {}
        row["body"] = json.dumps({**body, "level": level.value, **urgent}, sort_keys=True)
        row |= speaking.admit(conn, user_id=user_id, now=now, urgency=urgency)
    if once:
        conn.execute(upsert(conn, outbox).values(row).on_conflict_do_nothing())
    else:
        conn.execute(_ENQUEUE, row)
    return message_id


class OutboxHandler(Protocol):
    """What the drain hands one kind of outbox row to."""

    kind: OutboxKind

    def ready(self) -> ColumnElement[bool]:
        """A condition on outbox rows of this kind, beside due and not STOPped: which the handler can take now
        (rows it would only hold are left unclaimed, so they never crowd out the others)."""
        ...

    def handle(self, rows: Sequence[Any]) -> int:
        """Handle claimed rows (their `attempts` already counts this handover); returns how many were settled or
        attempted. Settling a row is the handler's own guarded update; an exception leaves the rest pending."""
        ...


_CLAIM = (update(outbox).where(and_(outbox.c.id == bindparam("row"), outbox.c.state == OutboxState.PENDING.value,
                                    outbox.c.attempts == bindparam("seen")))
          .values(attempts=outbox.c.attempts + 1).returning(*outbox.c))


class OutboxDrain:
    """The one loop body that empties the outbox, kind by kind, through the registered handlers."""

    def __init__(self, engine: Engine, clock: Clock, handlers: Iterable[OutboxHandler] = (), *,
                 hold: timedelta = timedelta(seconds=30)) -> None:
        """`hold` (PostgreSQL, where several drains run): how long a claimed row is out of the other drains' reach
        while its handler works on it; a drain that died with it lets it fall due again after that."""
        self._engine = engine
        self._clock = clock
        self._hold = hold
        self._handlers: dict[OutboxKind, OutboxHandler] = {}
        for handler in handlers:
            self.register(handler)

    def register(self, handler: OutboxHandler) -> None:
        if handler.kind in self._handlers:
            raise ValueError(f"outbox kind {handler.kind} already has a handler")
        self._handlers[handler.kind] = handler

    def drain(self, limit: int = 100) -> int:
        """Claim what is due and hand it over; returns what the handlers report (settled or attempted rows)."""
        done = 0
        for kind, handler in self._handlers.items():
            claimed = self.claim(kind, handler.ready(), limit=limit)
            if claimed:
                done += handler.handle(claimed)
        return done

    def claim(self, kind: OutboxKind, ready: ColumnElement[bool] | None = None, *, limit: int = 100) -> list[Any]:
        """The due, pending rows of `kind` that STOP does not hold and `ready` admits, oldest first, each claimed
        by a guarded update; a row another drain claimed (or settled) since it was read is left out.

        On PostgreSQL, where several drains run at once, one statement claims them (`FOR UPDATE SKIP LOCKED`: rows
        another drain is claiming are skipped, not waited for) and moves them out of reach for `hold`, so no other
        drain takes a row while its handler works on it. On SQLite (one drain) a claimed row stays due."""
        if self._engine.dialect.name == "postgresql":
            return self._claim_skipping_locked(kind, ready, limit=limit)
        return self.take(self.due(kind, ready, limit=limit))

    def _claim_skipping_locked(self, kind: OutboxKind, ready: ColumnElement[bool] | None, *,
                               limit: int) -> list[Any]:
        now = self._clock.now()
        with read(self._engine) as conn:  # an idle drain takes no write transaction
            stop = control.stop_state(conn)
            if stop.everything:
                return []
            if conn.execute(select(outbox.c.id).where(self._due(kind, ready, stop.users, now)).limit(1)).first() \
                    is None:
                return []
        # A CTE, materialized: as an `IN (subquery)` it may run again per row, each run locking more (its own
        # locks are not skipped, its own updates are), and take more than `limit`.
        pick = (select(outbox.c.id).where(self._due(kind, ready, stop.users, now)).order_by(outbox.c.created_at)
                .limit(limit).with_for_update(of=outbox, skip_locked=True).cte("picked").prefix_with("MATERIALIZED"))
        with write(self._engine) as conn:
            claimed = conn.execute(
                update(outbox).where(and_(outbox.c.id == pick.c.id, outbox.c.state == OutboxState.PENDING.value))
                .values(attempts=outbox.c.attempts + 1, next_attempt_at=now + self._hold)
                .returning(*outbox.c)).all()
        return sorted(claimed, key=lambda row: (row.created_at, row.id))

    @staticmethod
    def _due(kind: OutboxKind, ready: ColumnElement[bool] | None, stopped: Iterable[str],
             now: datetime) -> ColumnElement[bool]:
        return and_(outbox.c.kind == kind.value, outbox.c.state == OutboxState.PENDING.value,
                    outbox.c.next_attempt_at <= now, outbox.c.user_id.not_in(list(stopped)),
                    true() if ready is None else ready)

    def due(self, kind: OutboxKind, ready: ColumnElement[bool] | None = None, *, limit: int = 100) -> list[Any]:
        """(id, attempts) of the rows `claim` would take now, read without a write lock (an idle drain takes none)."""
        now = self._clock.now()
        with read(self._engine) as conn:
            stop = control.stop_state(conn)
            if stop.everything:
                return []
            return list(conn.execute(select(outbox.c.id, outbox.c.attempts).where(
                self._due(kind, ready, stop.users, now)).order_by(outbox.c.created_at).limit(limit)).all())

    def take(self, due: Sequence[Any]) -> list[Any]:
        """Claim each of `due` (rows of `due()`) whose attempts have not moved since; returns the claimed rows."""
        if not due:
            return []
        with write(self._engine) as conn:
            claimed = [conn.execute(_CLAIM, {"row": row.id, "seen": row.attempts}).first() for row in due]
        return [row for row in claimed if row is not None]


def linked(body: Any, base_url: str) -> Any:
    """A message body as it leaves: one that names a path on this server to open it (`open`, e.g. an approval
    request's one-time link) gets the full `link` there, under the address people reach the server at
    (`Settings.base_url`, so `public_url` behind a reverse proxy)."""
    if isinstance(body, dict) and isinstance(body.get("open"), str) and body["open"].startswith("/"):
        return {**body, "link": base_url.rstrip("/") + body["open"]}
    return body


class MessageDelivery:
    """The handler for messages to the user: to `notify_url`, or to the local feed when there is none."""

    kind = OutboxKind.USER_MESSAGE

    def __init__(self, engine: Engine, clock: Clock, *, notify_url: str | None, max_attempts: int,
                 backoff: timedelta, transport: httpx.BaseTransport | None = None,
                 base_url: str = "http://127.0.0.1:8787") -> None:
        self._engine = engine
        self._base_url = base_url
        self._clock = clock
        self._notify_url = notify_url
        self._max_attempts = max_attempts
        self._backoff = backoff
        self._http = httpx.Client(transport=transport, timeout=10.0)

    def close(self) -> None:
        self._http.close()

    def ready(self) -> ColumnElement[bool]:
        return true()  # only STOP holds a message

    def handle(self, rows: Sequence[Any]) -> int:
        """Deliver claimed messages; returns how many were attempted."""
        if self._notify_url is None:  # the local feed: nothing leaves, so the lot is marked sent in one transaction
            with write(self._engine) as conn:
                conn.execute(_SETTLE, [self._settled(row, None) for row in rows])
            return len(rows)
        for row in rows:  # each marked sent as soon as it is delivered: a crash re-delivers one message at most
            error = self._deliver(row)
            settled = self._settled(row, error)
            with write(self._engine) as conn:
                conn.execute(_SETTLE, settled)
        return len(rows)

    def _deliver(self, row: Any) -> str | None:
        assert self._notify_url is not None
        body = {"id": row.id, "seq": row.seq, "user_id": row.user_id, "kind": row.kind, "session_id": row.session_id,
                "created_at": row.created_at.isoformat(), "body": linked(json.loads(row.body), self._base_url)}
        try:
            response = self._http.post(self._notify_url, json=body, headers={"Idempotency-Key": row.id})
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if response.is_success:
            faults.crash_point("after_dispatch")  # the receiver has it; we have not marked it sent
            return None
        return f"HTTP {response.status_code}"

    def _settled(self, row: Any, error: str | None) -> dict[str, Any]:
        """The parameters of `_SETTLE` for a delivery of `row` that succeeded, or failed with `error`."""
        now = self._clock.now()
        attempts = row.attempts  # the claim counted this attempt
        if error is None:
            return {"message": row.id, "state": OutboxState.SENT.value, "sent_at": now, "attempts": attempts,
                    "last_error": None, "next_attempt_at": row.next_attempt_at}
        failed = attempts >= self._max_attempts
        log.warning("delivery of %s failed (attempt %d): %s", row.id, attempts, error)
        return {"message": row.id, "state": (OutboxState.FAILED if failed else OutboxState.PENDING).value,
                "sent_at": None, "attempts": attempts, "last_error": error,
                "next_attempt_at": now + self._backoff * (2 ** (attempts - 1))}


# Built once; its parameters name the columns it sets (an executemany needs the same ones in every row).
_SETTLE = update(outbox).where(and_(outbox.c.id == bindparam("message"), outbox.c.state == OutboxState.PENDING.value))
