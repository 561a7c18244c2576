"""Shared fixtures: a migrated SQLite file per test (or a PostgreSQL database, where a test asks for both), a fake
clock, and a runtime wired to both.

The migrations run once per session and backend, into a template each test's database is copied from: migrating
cost half a CPU-second (and a few seconds of fsyncs) per test, more than most tests. The copy is the migrated
database byte for byte; test_migrations.py migrates databases of its own, from nothing and from older revisions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from tests.support.postgres import postgres_cluster, postgres_database, postgres_template
from tests.support.templates import copy_template, make_template, migrate_url
from wakeful.proxy.clock import FakeClock
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import make_engine, migrate, write
from wakeful.server.store.users import ensure_user

# The longest groups, handed out first (a process takes the next group when it is done with one): the guests' boots
# under TCG (a quarter of the run), then the crash campaigns.
GUESTS = "tests/system/"
FIRST = (GUESTS, "tests/integration/test_crash_recovery.py")


def _group(path: str) -> str:
    """The group of the test file at `path` (relative to the repository): its own, or the guests' one."""
    return GUESTS if path.startswith(GUESTS) else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest groups first (`pytest_xdist_make_scheduler` hands groups out in this order)."""
    def rank(item: pytest.Item) -> int:
        group = _group(item.path.relative_to(config.rootpath).as_posix())
        return FIRST.index(group) if group in FIRST else len(FIRST)

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Two pytest processes share the run (pytest-xdist, `-n 2` in pyproject.toml). A file's tests stay together in
    one of them: module fixtures (the crash campaigns, a served world) see every selected test of their file and are
    built once. Every test that boots a guest is in one group: the image is built once, and two guests under TCG
    never take both cores from the rest. (xdist's own `loadgroup` marks do not reach pytest 9's test ids.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFileGuestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::", 1)[0])

    return ByFileGuestsTogether(config, log)


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


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file to copy (tests/support/templates.py)."""
    return make_template(tmp_path_factory.mktemp("template") / "wakeful.db")


@pytest.fixture(scope="session")
def postgres_template_name(postgres_server: str) -> str:
    return postgres_template(postgres_server, migrate_url)


@pytest.fixture
def engine(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Engine]:
    """A migrated SQLite file; a test that must hold on PostgreSQL too parametrizes it:
    `@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)` (a database of its own)."""
    backend = getattr(request, "param", "sqlite")
    if backend == "sqlite":
        url = settings.db_url
        if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
            copy_template(request.getfixturevalue("sqlite_template"), url)
    else:
        url = postgres_database(request.getfixturevalue("postgres_server"),
                                template=request.getfixturevalue("postgres_template_name"))
    engine = make_engine(url)
    migrate(engine)  # at the head already (one query), unless a test's settings name a database of their own
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
