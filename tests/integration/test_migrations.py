"""The schema: created only by migrations, identical to the declared tables, history tables append-only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, create_engine, insert, text
from sqlalchemy.exc import DatabaseError

from server.clock import FakeClock
from server.db import make_engine, migrate, write
from server.tables import control, metadata


def schema(engine: Engine) -> dict[str, object]:
    """What SQLite itself says about every table, index and trigger, independent of the order DDL listed them in."""
    out: dict[str, object] = {}
    with engine.connect() as conn:
        objects = conn.execute(text("SELECT type, name, tbl_name, sql FROM sqlite_master "
                                    "WHERE name NOT LIKE 'sqlite_%' AND name != 'alembic_version'")).all()
        for kind, name, table, sql in objects:
            if kind == "table":
                out[name] = {
                    "columns": sorted(tuple(c)[1:] for c in conn.exec_driver_sql(f"PRAGMA table_info({name})")),
                    "foreign_keys": sorted(
                        tuple(fk)[2:] for fk in conn.exec_driver_sql(f"PRAGMA foreign_key_list({name})")),
                    "checks": sorted(re.findall(r"CONSTRAINT (\w+) CHECK \((.*?)\)(?=,|\s*\)$|\s*,)", sql)),
                    "uniques": sorted(re.findall(r"CONSTRAINT (\w+) UNIQUE \(([^)]*)\)", sql)),
                }
            elif kind == "index":
                out[name] = (table, conn.exec_driver_sql(f"PRAGMA index_info({name})").all(), sql)
            else:
                out[name] = (kind, table, " ".join(sql.split()))
    return out


def test_a_migrated_database_equals_a_fresh_one(tmp_path: Path) -> None:
    migrated = make_engine(f"sqlite:///{tmp_path / 'migrated.db'}")
    migrate(migrated)
    fresh = create_engine(f"sqlite:///{tmp_path / 'fresh.db'}")
    metadata.create_all(fresh)
    with migrated.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), metadata) == []
    migrated_schema, fresh_schema = schema(migrated), schema(fresh)
    assert sorted(migrated_schema) == sorted(fresh_schema)
    for name, description in fresh_schema.items():
        assert migrated_schema[name] == description, name
    assert any(name.startswith("control_no_") for name in fresh_schema)  # the triggers are part of the comparison


def test_migrating_twice_changes_nothing(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.db'}")
    migrate(engine)
    before = schema(engine)
    migrate(engine)
    assert schema(engine) == before


def test_control_history_refuses_update_and_delete(engine: Engine, clock: FakeClock) -> None:
    with write(engine) as conn:
        conn.execute(insert(control).values(id="ctl_1", user_id=None, kind="stop", actor="cli", reason="",
                                            created_at=clock.now()))
    for statement in ("UPDATE control SET kind = 'start'", "DELETE FROM control"):
        with pytest.raises(DatabaseError, match="append-only"), write(engine) as conn:
            conn.execute(text(statement))
