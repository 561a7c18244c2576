"""User names are checked where users are made (`store.users`), so every way of making one refuses the same names
with the same code: the rule of agent names (`store.agents`)."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, func, select

from wakeful.proxy.clock import FakeClock
from wakeful.server.errors import BadRequest
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import users
from wakeful.server.store.users import OWNER, ensure_user


@pytest.mark.parametrize("name", ["", " ", "bad name", "a\nb", "x" * 41, "Owner", "_owner", "ana@example.org", "ü"])
def test_a_user_is_never_made_with_a_name_that_is_not_one(engine: Engine, clock: FakeClock, name: str) -> None:
    with pytest.raises(BadRequest) as refused, write(engine) as conn:
        ensure_user(conn, name=name, now=clock.now())
    assert refused.value.code == "invalid_user_name" and len(refused.value.message) < 300
    with write(engine) as conn:  # the names every deployment and test use stay names
        for good in (OWNER, "alice", "u1", "user-7", "someone-else", "x" * 40):
            assert ensure_user(conn, name=good, now=clock.now())[1] is not None
    with read(engine) as conn:
        assert conn.execute(select(func.count()).select_from(users)).scalar() == 6
