"""A user's time zone: stored by IANA name, read back as a zone, an unknown name refused with a stable code."""

from __future__ import annotations

from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import Engine

from wakeful.proxy.clock import FakeClock
from wakeful.server.errors import BadRequest, NotFound
from wakeful.server.store.db import read, write
from wakeful.server.store.users import ensure_user, set_zone, zone


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
def test_a_user_lives_in_utc_until_they_name_a_zone(engine: Engine, clock: FakeClock) -> None:
    with write(engine) as conn:
        user_id, _ = ensure_user(conn, name="zoe", now=clock.now())
    with read(engine) as conn:
        assert zone(conn, user_id) == ZoneInfo("UTC")
    with write(engine) as conn:
        set_zone(conn, user_id=user_id, name="Asia/Hong_Kong")
    with read(engine) as conn:
        assert zone(conn, user_id) == ZoneInfo("Asia/Hong_Kong")


def test_an_unknown_zone_or_user_is_refused(engine: Engine, clock: FakeClock) -> None:
    with write(engine) as conn:
        user_id, _ = ensure_user(conn, name="zoe", now=clock.now())
        with pytest.raises(BadRequest) as bad:
            set_zone(conn, user_id=user_id, name="Mars/Olympus_Mons")
        assert bad.value.code == "unknown_timezone"
        with pytest.raises(BadRequest):
            set_zone(conn, user_id=user_id, name="../../etc/passwd")
        with pytest.raises(NotFound):
            set_zone(conn, user_id="usr_nobody", name="UTC")
