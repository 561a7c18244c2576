"""Going back: every migration's downgrade undoes its upgrade, on SQLite and PostgreSQL, and `wakeful migrate --to`
takes a database back to an older release's revision, or refuses and changes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, select, text

from tests.support.postgres import postgres_database
from wakeful.proxy.clock import FakeClock
from wakeful.server.audit.seal import seal
from wakeful.server.audit.signing import load_or_create_key
from wakeful.server.core import control, holds, sessions
from wakeful.server.errors import BadRequest, Conflict
from wakeful.server.store import users
from wakeful.server.store.db import current_revision, make_engine, migrate, newest_revision, read, write
from wakeful.server.store.tables import tasks

MIGRATIONS = Path(migrate.__code__.co_filename).parent / "migrations"


def revisions() -> list[tuple[str, str]]:
    """(revision, the one before it or `base`), oldest first."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return [(s.revision, str(s.down_revision or "base"))
            for s in reversed(list(ScriptDirectory.from_config(config).walk_revisions()))]


def schema(engine: Engine) -> dict[str, Any]:
    """Tables, columns, keys, indexes, constraints and triggers, as the database itself reports them."""
    with engine.connect() as conn:
        found = inspect(conn)
        out: dict[str, Any] = {}
        for table in sorted(set(found.get_table_names()) - {"alembic_version"}):
            out[table] = {
                "columns": sorted((c["name"], str(c["type"]), c["nullable"], str(c.get("default")))
                                  for c in found.get_columns(table)),
                "primary": found.get_pk_constraint(table)["constrained_columns"],
                "foreign": sorted((tuple(f["constrained_columns"]), f["referred_table"],
                                   tuple(f["referred_columns"])) for f in found.get_foreign_keys(table)),
                "indexes": sorted((i["name"], tuple(i["column_names"]), i["unique"])
                                  for i in found.get_indexes(table)),
                "uniques": sorted((u["name"], tuple(u["column_names"])) for u in found.get_unique_constraints(table)),
                "checks": sorted((c["name"], " ".join(c["sqltext"].split()))
                                 for c in found.get_check_constraints(table)),
            }
        query = ("SELECT name, tbl_name FROM sqlite_master WHERE type = 'trigger'" if engine.dialect.name == "sqlite"
                 else "SELECT DISTINCT trigger_name, event_object_table FROM information_schema.triggers")
        out["triggers"] = sorted(tuple(row) for row in conn.execute(text(query)))
    return out


@pytest.fixture(params=["sqlite", "postgresql"])
def empty(request: pytest.FixtureRequest, tmp_path: Path) -> Engine:
    """A database with no schema at all."""
    if request.param == "sqlite":
        return make_engine(f"sqlite:///{tmp_path / 'wakeful.db'}")
    return make_engine(postgres_database(request.getfixturevalue("postgres_server")))


def test_every_downgrade_undoes_its_upgrade_and_base_has_no_tables(empty: Engine) -> None:
    for revision, before in revisions():
        migrate(empty, revision)
        upgraded = schema(empty)
        migrate(empty, before)
        assert current_revision(empty) == (None if before == "base" else before)
        migrate(empty, revision)
        assert schema(empty) == upgraded, f"downgrading {revision} and upgrading again changed the schema"
    assert current_revision(empty) == newest_revision()
    migrate(empty, "base")
    assert schema(empty) == {"triggers": []}


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
def test_a_downgrade_keeps_what_the_older_schema_can_hold(engine: Engine, clock: FakeClock, owner: str) -> None:
    with write(engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        task_id = control.create_task(conn, user_id=owner, session_id=session_id, title="rebook", now=clock.now())
    migrate(engine, "0013")
    with read(engine) as conn:
        assert conn.execute(select(tasks.c.id, tasks.c.title)).all() == [(task_id, "rebook")]
        assert users.user_id_by_name(conn, users.OWNER) == owner
    migrate(engine)
    assert current_revision(engine) == newest_revision()


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
def test_a_downgrade_past_history_the_older_schema_cannot_hold_is_refused_and_changes_nothing(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    with write(engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        task_id = control.create_task(conn, user_id=owner, session_id=session_id, title="rebook", now=clock.now())
        holds.say(conn, user_id=owner, task_id=task_id, text="wait, not Thursday", actor="user", now=clock.now())
    before = schema(engine)
    with pytest.raises(Conflict) as refused:
        migrate(engine, "0013")
    assert refused.value.code == "downgrade_refused" and "0014" in refused.value.message
    assert current_revision(engine) == newest_revision()
    assert schema(engine) == before
    with read(engine) as conn:
        assert holds.current_hold(conn, task_id=task_id) is not None


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
def test_a_sealed_ledger_is_not_dropped_by_a_downgrade(engine: Engine, clock: FakeClock, owner: str,
                                                       tmp_path: Path) -> None:
    """Dropped and made again by the upgrade, the chain would be chained anew: an export an auditor kept would no
    longer match, as if the past had been rewritten. A ledger never sealed may still go back."""
    with write(engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        control.create_task(conn, user_id=owner, session_id=session_id, title="rebook", now=clock.now())
    assert seal(engine, load_or_create_key(tmp_path / "ledger.key"), now=clock.now()) > 0
    before = schema(engine)
    with pytest.raises(Conflict) as refused:
        migrate(engine, "0020")
    assert refused.value.code == "downgrade_refused" and "revision 0021" in refused.value.message
    assert "sealed" in refused.value.message
    assert current_revision(engine) == newest_revision() and schema(engine) == before
    migrate(engine, "0021")  # the revisions after the ledger's still go back
    assert current_revision(engine) == "0021"


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
def test_processes_starting_together_on_a_new_database_migrate_it_once(engine: Engine) -> None:
    """The units and serve's children start together, and each migrates: one after the other, the later ones find it
    done (on PostgreSQL, two creating alembic's table at once failed with a unique violation)."""
    migrate(engine, "base")
    script = ("import sys\n"
              "from wakeful.server.store.db import make_engine, migrate\n"
              "engine = make_engine(sys.argv[1])\n"
              "engine.connect().close()\n"
              "print('ready', flush=True)\n"
              "sys.stdin.readline()\n"  # released together, below
              "migrate(engine)\n")
    url = engine.url.render_as_string(hide_password=False)
    starting = [subprocess.Popen([sys.executable, "-c", script, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for process in starting:  # each has imported and connected: the migrations start within a millisecond
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
    for process in starting:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
    outcomes = []
    for process in starting:
        _, err = process.communicate(timeout=120)
        outcomes.append((process.returncode, err.splitlines()[-1:]))  # the error's last line, if any
    assert outcomes == [(0, [])] * len(starting)
    assert current_revision(engine) == newest_revision()


def test_an_unknown_revision_is_refused_by_name(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'wakeful.db'}")
    migrate(engine)
    for wrong in ("9999", "001", "", "xyz"):
        with pytest.raises(BadRequest) as refused:
            migrate(engine, wrong)
        assert refused.value.code == "unknown_revision"
    assert current_revision(engine) == newest_revision()


def _wakeful(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wakeful.server", *args, "--data-dir", str(data_dir)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_wakeful_migrate_to_takes_the_database_back_and_a_newer_database_is_refused_by_older_code(
        tmp_path: Path) -> None:
    assert _wakeful(tmp_path, "migrate").returncode == 0
    back = _wakeful(tmp_path, "migrate", "--to", "0022")  # as docs/deploy.md shows
    assert back.returncode == 0 and "schema is at revision 0022" in back.stdout, back.stderr
    engine = make_engine(f"sqlite:///{tmp_path / 'wakeful.db'}")
    assert current_revision(engine) == "0022"
    wrong = _wakeful(tmp_path, "migrate", "--to", "9999")
    assert wrong.returncode == 2 and "wakeful: unknown_revision:" in wrong.stderr, wrong.stderr
    assert "Traceback" not in wrong.stderr
    assert _wakeful(tmp_path, "migrate").returncode == 0 and current_revision(engine) == newest_revision()

    with write(engine) as conn:  # as a newer release would leave it
        conn.execute(text("UPDATE alembic_version SET version_num = '9000'"))
    for command in (("migrate",), ("status",)):
        newer = _wakeful(tmp_path, *command)
        assert newer.returncode == 2 and "wakeful: schema_too_new:" in newer.stderr, newer.stderr
        assert "Traceback" not in newer.stderr
