"""`db.execute_compiled` (the inbox's hot statements, sent to sqlite3 compiled once) reads and writes what
SQLAlchemy's own execution would, on both databases, and refuses a statement it cannot send as it is."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import Engine, bindparam, select

from wakeful.proxy.clock import FakeClock
from wakeful.server.core import sessions, triage
from wakeful.server.store.db import execute_compiled, read, write
from wakeful.server.store.tables import events, todos

BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)

_TODO = select(todos.c.session_id, todos.c.user_id, todos.c.version).where(
    todos.c.session_id == bindparam("session_id"))


@BOTH
def test_a_compiled_statement_reads_and_writes_what_sqlalchemy_would(engine: Engine, owner: str,
                                                                       clock: FakeClock) -> None:
    with write(engine) as conn:
        session_id = triage.session_of(conn, user_id=owner, now=clock.now())
        assert triage.session_of(conn, user_id=owner, now=clock.now()) == session_id  # found, not made again
        sessions.wake(conn, session_id=session_id, user_id=owner, due_at=clock.now() + timedelta(seconds=5))
        sessions.wake(conn, session_id=session_id, user_id=owner, due_at=clock.now())  # earlier: it stands
        sessions.wake(conn, session_id=session_id, user_id=owner, due_at=clock.now() + timedelta(seconds=9))
        assert execute_compiled(conn, _TODO, {"session_id": session_id}) == [(session_id, owner, 3)]
        assert execute_compiled(conn, _TODO, {"session_id": "nobody"}) == []
    with read(engine) as conn:
        row = conn.execute(select(todos.c.version, todos.c.due_at).where(todos.c.session_id == session_id)).one()
    assert (row.version, row.due_at) == (3, clock.now())  # tz-aware again, exactly as bound


def test_outside_a_transaction_sqlalchemy_executes_it(engine: Engine, owner: str, clock: FakeClock) -> None:
    with write(engine) as conn:
        session_id = triage.session_of(conn, user_id=owner, now=clock.now())
    with engine.connect() as conn:  # no transaction yet: SQLAlchemy begins one, as it would have
        assert execute_compiled(conn, _TODO, {"session_id": session_id}) == []
        assert conn.in_transaction()


def test_a_statement_it_cannot_send_as_it_is_is_refused(engine: Engine, owner: str) -> None:
    with write(engine) as conn:
        with pytest.raises(ValueError, match="expanding"):
            execute_compiled(conn, select(events.c.id).where(events.c.id.in_(bindparam("ids", expanding=True))),
                             {"ids": ["a"]})
        with pytest.raises(ValueError, match="converting"):
            execute_compiled(conn, select(events.c.received_at), {})
        with pytest.raises(ValueError, match="needs a value for 'id'"):
            execute_compiled(conn, select(events.c.source).where(events.c.id == bindparam("id")), {})
