"""The transactional outbox and its dispatcher.

`enqueue` writes a message in the caller's transaction, beside the state change that caused it. The `Dispatcher`
drains pending rows: it re-checks STOP, delivers each message with its ID as the `Idempotency-Key` (so a delivery
repeated after a crash is applied once by the receiver), and marks it sent with a guarded update. Failed deliveries
back off exponentially and are marked failed past the attempt cap. Without a `notify_url` messages go to the local
feed (`GET /v1/messages`) and are sent the moment they are dispatched.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import Connection, Engine, and_, bindparam, select, update

from wakeful.proxy.clock import Clock
from wakeful.server.core import control, faults
from wakeful.server.store.db import read, write
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import OutboxKind, OutboxState, outbox

__all__ = ["Dispatcher", "enqueue"]

log = logging.getLogger(__name__)


_ENQUEUE = outbox.insert()  # built once (see `sessions`): a run enqueues while it holds the write lock


def enqueue(conn: Connection, *, user_id: str, body: dict[str, Any], now: datetime,
            kind: OutboxKind = OutboxKind.USER_MESSAGE, session_id: str | None = None, run_id: str | None = None,
            message_id: str | None = None) -> str:
    message_id = message_id or new_id("msg")
    conn.execute(_ENQUEUE, {
        "id": message_id, "user_id": user_id, "kind": kind.value, "session_id": session_id, "run_id": run_id,
        "body": json.dumps(body, sort_keys=True), "state": OutboxState.PENDING.value, "attempts": 0,
        "next_attempt_at": now, "created_at": now,
    })
    return message_id


class Dispatcher:
    def __init__(self, engine: Engine, clock: Clock, *, notify_url: str | None, max_attempts: int,
                 backoff: timedelta, transport: httpx.BaseTransport | None = None) -> None:
        self._engine = engine
        self._clock = clock
        self._notify_url = notify_url
        self._max_attempts = max_attempts
        self._backoff = backoff
        self._http = httpx.Client(transport=transport, timeout=10.0)

    def close(self) -> None:
        self._http.close()

    def drain(self, limit: int = 100) -> int:
        """Deliver what is due; returns how many messages were attempted."""
        now = self._clock.now()
        with read(self._engine) as conn:
            stop = control.stop_state(conn)
            due = conn.execute(
                select(outbox).where(and_(outbox.c.kind == OutboxKind.USER_MESSAGE.value,
                                          outbox.c.state == OutboxState.PENDING.value,
                                          outbox.c.next_attempt_at <= now))
                .order_by(outbox.c.created_at).limit(limit)
            ).all()
        ready = [row for row in due if not stop.blocks(row.user_id)]
        if self._notify_url is None:  # the local feed: nothing leaves, so the lot is marked sent in one transaction
            if not ready:
                return 0
            with write(self._engine) as conn:
                conn.execute(_SETTLE, [self._settled(row, None) for row in ready])
            return len(ready)
        for row in ready:  # each marked sent as soon as it is delivered: a crash re-delivers one message at most
            error = self._deliver(row)
            settled = self._settled(row, error)
            with write(self._engine) as conn:
                conn.execute(_SETTLE, settled)
        return len(ready)

    def _deliver(self, row: Any) -> str | None:
        assert self._notify_url is not None
        body = {"id": row.id, "user_id": row.user_id, "kind": row.kind, "session_id": row.session_id,
                "created_at": row.created_at.isoformat(), "body": json.loads(row.body)}
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
        attempts = row.attempts + 1
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
