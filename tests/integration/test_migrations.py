"""The schema: created only by migrations, identical to the declared tables, history tables append-only."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, insert, inspect, select, text
from sqlalchemy.exc import DatabaseError

from wakeful.proxy.audit import EgressRecord
from wakeful.proxy.clock import FakeClock
from wakeful.proxy.contract import RefusalCode
from wakeful.server.egress import grants as egress
from wakeful.server.store.db import current_revision, make_engine, migrate, newest_revision, read, write
from wakeful.server.store.tables import (
    control,
    event_attachments,
    events,
    metadata,
    sessions,
    tasks,
    users,
    waits,
)


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
                # By column name, not position: a column a later migration added sits last in a migrated table.
                out[name] = (table, [(seqno, column) for seqno, _cid, column in
                                     conn.exec_driver_sql(f"PRAGMA index_info({name})").all()], sql)
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


def test_the_newest_revision_read_from_the_files_is_alembics_head() -> None:
    config = Config()
    config.set_main_option("script_location", str(Path(migrate.__code__.co_filename).parent / "migrations"))
    assert newest_revision() == ScriptDirectory.from_config(config).get_current_head()


def test_starting_on_a_database_at_the_newest_revision_does_not_load_alembic(tmp_path: Path) -> None:
    # Every `wakeful serve` and CLI start migrates: at the head that must cost one query, not alembic's import.
    url = f"sqlite:///{tmp_path / 'db.db'}"
    migrate(make_engine(url))
    probe = ("import sys; from wakeful.server.store.db import make_engine, migrate; "
             f"migrate(make_engine({url!r})); print('alembic' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_database_behind_the_newest_revision_is_still_migrated_to_it(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.db'}")
    migrate(engine, "0020")
    migrate(engine)
    assert current_revision(engine) == newest_revision() != "0020"


def test_control_history_refuses_update_and_delete(engine: Engine, clock: FakeClock) -> None:
    with write(engine) as conn:
        conn.execute(insert(control).values(id="ctl_1", user_id=None, kind="stop", actor="cli", reason="",
                                            created_at=clock.now()))
    for statement in ("UPDATE control SET kind = 'start'", "DELETE FROM control"):
        with pytest.raises(DatabaseError, match="append-only"), write(engine) as conn:
            conn.execute(text(statement))


def test_the_egress_audit_refuses_update_and_delete_and_a_resent_record_changes_nothing(
        engine: Engine, clock: FakeClock, owner: str) -> None:
    record = EgressRecord(
        request_id="egr_1", at=clock.now(), user_id=owner, client="tool_computer", attempt_id=None, action_id=None,
        method="GET", scheme="https", host="shop.example.com", port=443, path="/cart", verdict="refuse",
        code=RefusalCode.HOST_NOT_ALLOWED, rule="no egress rule allows it", credential=None, bytes_up=0,
        bytes_down=0, upstream_status=None, latency_ms=1.5)
    with write(engine) as conn:
        assert egress.store_audit(conn, [record], now=clock.now()) == 1
    for statement in ("UPDATE egress_audit SET verdict = 'allow', code = NULL", "UPDATE egress_audit SET rule = ''",
                      "DELETE FROM egress_audit"):
        with pytest.raises(DatabaseError, match="append-only"), write(engine) as conn:
            conn.execute(text(statement))
    with write(engine) as conn:  # the proxy sending it again after a reconnect is not an update either
        assert egress.store_audit(conn, [replace(record, verdict="allow", code=None)], now=clock.now()) == 0
    with read(engine) as conn:
        (row,) = egress.audit_rows(conn, user_id=owner)
    assert (row["verdict"], row["code"], row["rule"]) == ("refuse", "host_not_allowed", "no egress rule allows it")


def test_migrating_to_wait_authority_gives_each_record_the_authority_it_had(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.db'}")
    migrate(engine, "0006")
    now = FakeClock().now()
    sent = {  # event ID: (source, kind, trust, corr_key) as 0006 stored them
        "ev_hook": ("hook", "webhook", "user", "thread-1"),
        "ev_forged": ("hook", "webhook", "third_party", "approval:act_1"),
        "ev_approval": ("approval", "control", "user", "approval:act_1"),
        "ev_timer": ("timer", "timer", "system", None),
        "ev_found": ("reconcile", "webhook", "system", "reconcile:act_1"),
    }
    with write(engine) as conn:
        conn.execute(insert(users).values(id="usr_1", name="owner", created_at=now))
        conn.execute(insert(sessions).values(id="ses_1", user_id="usr_1", fencing_token=0, created_at=now))
        for event_id, (source, kind, trust, key) in sent.items():
            conn.execute(insert(events).values(id=event_id, user_id="usr_1", source=source, source_id=event_id,
                                               session_id="ses_1", corr_key=key, kind=kind, trust=trust,
                                               payload="{}", received_at=now))
        for kind in ("approval", "reconcile", "reply"):
            conn.execute(insert(waits).values(id=f"wait_{kind}", user_id="usr_1", session_id="ses_1",
                                              match_key=f"{kind}:act_1", kind=kind, state="pending", created_at=now))
        for key in ("thread-1", "bound-by-nothing-recorded"):  # 0006's table: no authority column yet
            conn.execute(text("INSERT INTO session_keys (user_id, key, session_id) VALUES ('usr_1', :key, 'ses_1')"),
                         {"key": key})
    migrate(engine, "0010")  # session_keys is gone at 0011
    with read(engine) as conn:
        assert dict(conn.execute(select(events.c.id, events.c.authority)).all()) == {
            "ev_hook": "source:hook", "ev_forged": "source:hook", "ev_approval": "user", "ev_timer": "system",
            "ev_found": "system"}  # a source's trust setting never made it the user
        assert dict(conn.execute(select(waits.c.kind, waits.c.authority)).all()) == {
            "approval": "user", "reconcile": "system", "reply": "any_source"}
        assert dict(conn.execute(text("SELECT key, authority FROM session_keys")).all()) == {
            "thread-1": "source:hook", "bound-by-nothing-recorded": "system"}


def test_migrating_to_speaking_gives_queued_messages_their_feed_order_and_the_user_the_last(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.db'}")
    migrate(engine, "0010")
    now = FakeClock().now()
    with write(engine) as conn:
        for user_id in ("usr_1", "usr_2"):
            conn.execute(insert(users).values(id=user_id, name=user_id, created_at=now))
        for row_id, user_id, kind, second in (("msg_b", "usr_1", "user_message", 2), ("msg_a", "usr_1",
                                              "user_message", 1), ("dsp_x", "usr_1", "dispatch", 3),
                                             ("msg_c", "usr_2", "user_message", 1)):
            conn.execute(text("INSERT INTO outbox (id, user_id, kind, body, state, attempts, next_attempt_at, "
                              "created_at) VALUES (:id, :user, :kind, '{}', 'sent', 1, :at, :at)"),
                         {"id": row_id, "user": user_id, "kind": kind, "at": (now + timedelta(seconds=second))
                          .replace(tzinfo=None)})
    migrate(engine)
    with read(engine) as conn:
        assert dict(conn.execute(text("SELECT id, seq FROM outbox")).all()) == {
            "msg_a": 1, "msg_b": 2, "dsp_x": None, "msg_c": 1}
        assert dict(conn.execute(select(users.c.id, users.c.message_seq)).all()) == {"usr_1": 2, "usr_2": 1}
@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
def test_migrating_to_task_keys_drops_session_keys_and_the_attachments_are_append_only(engine: Engine,
                                                                                     clock: FakeClock) -> None:
    with engine.connect() as conn:  # the fixture migrated it to the head: what 0011 made is there, 0009's key is not
        tables = set(inspect(conn).get_table_names())
    assert {"task_keys", "triage_sessions", "event_attachments"} <= tables and "session_keys" not in tables
    now = clock.now()
    with write(engine) as conn:
        conn.execute(insert(users).values(id="usr_1", name="owner", created_at=now))
        conn.execute(insert(sessions).values(id="ses_1", user_id="usr_1", fencing_token=0, created_at=now))
        conn.execute(insert(events).values(id="ev_1", user_id="usr_1", source="hook", source_id="1",
                                           session_id="ses_1", kind="webhook", trust="third_party", payload="{}",
                                           authority="source:hook", received_at=now))
        conn.execute(insert(tasks).values(id="task_1", user_id="usr_1", session_id="ses_1", title="t", state="active",
                                          current_version=1, created_at=now))
        conn.execute(insert(event_attachments).values(id="att_1", user_id="usr_1", event_id="ev_1", task_id="task_1",
                                                      attached_event_id="ev_1", actor="agent", reason="r",
                                                      created_at=now))
    for statement in ("UPDATE event_attachments SET reason = 'other'", "DELETE FROM event_attachments"):
        with pytest.raises(DatabaseError, match="append-only"), write(engine) as conn:
            conn.execute(text(statement))
