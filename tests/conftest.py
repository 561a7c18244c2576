"""Shared fixtures: a migrated SQLite file per test (or a PostgreSQL database, where a test asks for both), a fake
clock, and a runtime wired to both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from tests.support.postgres import postgres_cluster, postgres_database
from wakeful.proxy.clock import FakeClock
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import make_engine, migrate, write
from wakeful.server.store.users import ensure_user


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path, sources={"hook": {"kind": "generic", "secret": "test-secret"}},
                    poll_interval=0.05, sweep_interval=3600, proxy=False)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A PostgreSQL server on loopback for the whole session (started by the first test that asks for it)."""
    with postgres_cluster() as url:
        yield url


@pytest.fixture
def engine(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Engine]:
    """A migrated SQLite file; a test that must hold on PostgreSQL too parametrizes it:
    `@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)` (a database of its own)."""
    backend = getattr(request, "param", "sqlite")
    url = settings.db_url if backend == "sqlite" else postgres_database(request.getfixturevalue("postgres_server"))
    engine = make_engine(url)
    migrate(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def owner(engine: Engine, clock: FakeClock) -> str:
    with write(engine) as conn:
        user_id, _ = ensure_user(conn, name="owner", now=clock.now())
    return user_id


@pytest.fixture
def runtime(settings: Settings, engine: Engine, clock: FakeClock) -> Runtime:
    """A runtime that is prepared but not started: tests drive its loops one step at a time."""
    rt = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine)
    rt.prepare()
    return rt
