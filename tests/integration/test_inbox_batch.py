"""Group commit writes a batch as `record` would write it delivery by delivery: same rows, same answers."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select

from server.clock import FakeClock
from server.db import make_engine, migrate, read, write
from server.inbox import Delivery, record, record_many
from server.tables import events, sessions, todos
from server.users import ensure_user

deliveries = st.lists(
    st.builds(lambda source, sid, key: (source, sid, key), st.sampled_from(["a", "b"]),
              st.sampled_from([f"d{i}" for i in range(6)]), st.sampled_from([None, None, "thread-1", "thread-2"])),
    min_size=1, max_size=12)


def fresh(path: Path) -> tuple[Engine, str]:
    engine = make_engine(f"sqlite:///{path}")
    migrate(engine)
    with write(engine) as conn:
        user, _ = ensure_user(conn, name="owner", now=FakeClock().now())
    return engine, user


def shape(engine: Engine) -> tuple[int, int, int, list[tuple[str, str, str]]]:
    with read(engine) as conn:
        counts = [conn.execute(select(func.count()).select_from(t)).scalar_one() for t in (events, sessions, todos)]
        rows = [tuple(r) for r in conn.execute(select(events.c.source, events.c.source_id, events.c.status)
                                               .order_by(events.c.source, events.c.source_id))]
    return counts[0], counts[1], counts[2], rows


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=deliveries, batch=deliveries)
def test_a_batch_is_recorded_exactly_as_one_by_one(tmp_path_factory: object, before: list, batch: list) -> None:
    base = tmp_path_factory.mktemp("batch")  # type: ignore[attr-defined]
    clock = FakeClock()
    results = []
    for name, many in (("one.db", False), ("many.db", True)):
        engine, user = fresh(base / name)
        with write(engine) as conn:
            for s, i, k in before:
                record(conn, Delivery(user_id=user, source=s, source_id=i, payload={}, corr_key=k), now=clock.now())
        batch_deliveries = [Delivery(user_id=user, source=s, source_id=i, payload={"x": 1}, corr_key=k)
                            for s, i, k in batch]
        with write(engine) as conn:
            answers = (record_many(conn, batch_deliveries, now=clock.now()) if many else
                       [record(conn, d, now=clock.now()) for d in batch_deliveries])
        results.append(([(a.duplicate, a.status) for a in answers], shape(engine)))
        engine.dispose()
    assert results[0] == results[1]
