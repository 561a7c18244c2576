"""Shared fixtures: a migrated SQLite file per test, a fake clock, and a runtime wired to both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

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


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    engine = make_engine(settings.db_url)
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
