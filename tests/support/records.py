"""Small read helpers for asserting on the database's own records."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Engine, select

from wakeful.server.store.db import read
from wakeful.server.store.tables import events, outbox, runs


def event_rows(engine: Engine) -> list[Any]:
    with read(engine) as conn:
        return conn.execute(select(events).order_by(events.c.received_at, events.c.id)).all()


def run_rows(engine: Engine) -> list[Any]:
    with read(engine) as conn:
        return conn.execute(select(runs).order_by(runs.c.started_at, runs.c.id)).all()


def messages(engine: Engine) -> list[dict[str, Any]]:
    with read(engine) as conn:
        rows = conn.execute(select(outbox).order_by(outbox.c.created_at, outbox.c.id)).all()
    return [{"id": r.id, "state": r.state, **json.loads(r.body)} for r in rows]
