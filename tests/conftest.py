"""Shared fixtures: a migrated SQLite file per test (or a PostgreSQL database, where a test asks for both), a fake
clock, and a runtime wired to both.

The migrations run once per session and backend, into a template each test's database is copied from: migrating
cost half a CPU-second (and a few seconds of fsyncs) per test, more than most tests. The copy is the migrated
database byte for byte; test_migrations.py migrates databases of its own, from nothing and from older revisions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
FIRST = ("guests", "tests/integration/test_crash_recovery.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Two pytest processes share the run (pytest-xdist, `--dist loadgroup` in pyproject.toml). A file's tests stay
    together in one of them: module fixtures (the crash campaigns, a served world) see every selected test of their
    file and are built once. Every test that boots a guest is in one group: the image is built once, and two guests
    under TCG never take both cores from the rest."""
    groups: dict[str, str] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        groups[item.nodeid] = group = "guests" if path.startswith("tests/system/") else path
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: FIRST.index(groups[item.nodeid]) if groups[item.nodeid] in FIRST else len(FIRST))


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
