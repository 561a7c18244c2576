"""The verifiable ledger on a real database: a clean ledger verifies, and each kind of tampering (an edited, deleted,
inserted or reordered row, a forged checkpoint) makes `wakeful ledger verify` exit non-zero naming the row; an
export verifies offline with the public key alone and fails once edited."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Connection, Engine, insert, select, text, update

from tests.support.docs import doc_commands
from wakeful.proxy.audit import EgressRecord
from wakeful.proxy.clock import FakeClock
from wakeful.proxy.contract import RefusalCode
from wakeful.server.audit.seal import seal
from wakeful.server.audit.signing import load_or_create_key
from wakeful.server.audit.verify import snapshot, verify_database
from wakeful.server.core import control
from wakeful.server.egress import grants as egress
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import write
from wakeful.server.store.tables import (
    CHAINED,
    actions,
    attempts,
    ledger_chain,
    ledger_checkpoints,
    sessions,
    tasks,
)

BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
WAKEFUL = str(Path(sys.executable).parent / "wakeful")


def wakeful(engine: Engine | None, data_dir: Path, *args: str, cwd: Path | None = None
            ) -> subprocess.CompletedProcess[str]:
    """The command line as a user runs it, on this test's database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_") and k != "ANTHROPIC_API_KEY"}
    url = [] if engine is None or engine.dialect.name == "sqlite" else [
        "--database-url", engine.url.render_as_string(False)]
    return subprocess.run([WAKEFUL, "ledger", *args, "--data-dir", str(data_dir), *url], env=env,
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def history(engine: Engine, clock: FakeClock, owner: str) -> dict[str, str]:
    """A little of everything the ledger chains: control rows, a task version, an egress audit record (floats and
    big integers), an action and an attempt whose outcome is written after its insert."""
    with write(engine) as conn:
        stop = control.set_stop(conn, stopped=True, user_id=owner, actor="user:owner", reason="holiday",
                                now=clock.now())
        start = control.set_stop(conn, stopped=False, user_id=owner, actor="user:owner", reason="", now=clock.now())
        conn.execute(insert(sessions).values(id="ses_l", user_id=owner, fencing_token=0, created_at=clock.now()))
        task = control.create_task(conn, user_id=owner, session_id="ses_l", title="cancel the gym", now=clock.now())
        egress.store_audit(conn, [EgressRecord(
            request_id="egr_1", at=clock.now(), user_id=owner, client="tool_computer", attempt_id=None,
            action_id=None, method="GET", scheme="https", host="shop.example.com", port=443, path="/cart",
            verdict="refuse", code=RefusalCode.HOST_NOT_ALLOWED, rule="no egress rule allows it", credential=None,
            bytes_up=12, bytes_down=2**40, upstream_status=None, latency_ms=1.25)], now=clock.now())
        conn.execute(insert(actions).values(id="act_1", user_id=owner, task_id=task, task_version=1, tool="cancel",
                                            content="{}", content_hash="0" * 64, risk="ask", created_at=clock.now()))
        conn.execute(insert(attempts).values(id="att_1", action_id="act_1", seq=1, request='{"method": "POST"}',
                                             created_at=clock.now()))
    with write(engine) as conn:
        conn.execute(update(attempts).where(attempts.c.id == "att_1")
                     .values(outcome="accepted", outcome_at=clock.now(), status_code=200, external_ref="c-9"))
    return {"stop": stop, "start": start, "task": task}


def unguard(conn: Connection, table: str) -> None:
    """What someone holding the database can do: take the triggers off a table."""
    if conn.dialect.name == "sqlite":
        for (name,) in conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = :t"),
                                    {"t": table}).all():
            conn.execute(text(f"DROP TRIGGER {name}"))
    else:
        conn.execute(text(f"ALTER TABLE {table} DISABLE TRIGGER USER"))


def first_bad(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    line = result.stdout.splitlines()[0]
    assert "does NOT verify: first bad row: " in line, result.stdout
    return line.split("first bad row: ", 1)[1]


@pytest.fixture
def sealed(engine: Engine, clock: FakeClock, owner: str, tmp_path: Path) -> dict[str, str]:
    """A history, sealed by a first `wakeful ledger verify` that finds it whole."""
    made = history(engine, clock, owner)
    clean = wakeful(engine, tmp_path, "verify")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "the ledger verifies: " in clean.stdout
    return made


def pos_of(engine: Engine, table: str, key: str, part: str = "row") -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(ledger_chain.c.pos).where(
            ledger_chain.c.tbl == table, ledger_chain.c.row_key == key, ledger_chain.c.part == part)).scalar_one())


@BOTH
def test_a_clean_ledger_verifies_and_chains_every_row_with_a_signed_checkpoint(
        engine: Engine, sealed: dict[str, str], tmp_path: Path) -> None:
    result = wakeful(engine, tmp_path, "verify", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["ok"] and report["problems"] == []
    seen = snapshot(engine)
    tables = {(entry.table, entry.part) for entry, _ in seen.entries}
    assert {("control", "row"), ("task_versions", "row"), ("egress_audit", "row"), ("actions", "row"),
            ("attempts", "row"), ("attempts", "outcome")} <= tables
    assert report["entries"] == len(seen.entries) == report["head_pos"]
    assert seen.checkpoints[-1].pos == report["head_pos"]


@BOTH
def test_an_edited_row_is_named(engine: Engine, sealed: dict[str, str], tmp_path: Path) -> None:
    with write(engine) as conn:
        unguard(conn, "control")
        conn.execute(text("UPDATE control SET reason = 'it was never stopped' WHERE id = :id"), {"id": sealed["stop"]})
    bad = first_bad(wakeful(engine, tmp_path, "verify"))
    assert bad.startswith(f"pos {pos_of(engine, 'control', sealed['stop'])}: control {sealed['stop']}: edited")


@BOTH
def test_an_attempts_rewritten_outcome_is_named(engine: Engine, sealed: dict[str, str], tmp_path: Path) -> None:
    with write(engine) as conn:
        unguard(conn, "attempts")
        conn.execute(text("UPDATE attempts SET outcome = 'blocked' WHERE id = 'att_1'"))
    bad = first_bad(wakeful(engine, tmp_path, "verify"))
    assert bad.startswith(f"pos {pos_of(engine, 'attempts', 'att_1', 'outcome')}: attempts att_1 (outcome): edited")


@BOTH
def test_a_deleted_row_is_named(engine: Engine, sealed: dict[str, str], tmp_path: Path) -> None:
    with write(engine) as conn:
        unguard(conn, "egress_audit")
        conn.execute(text("DELETE FROM egress_audit WHERE request_id = 'egr_1'"))
    bad = first_bad(wakeful(engine, tmp_path, "verify"))
    assert bad == f"pos {pos_of(engine, 'egress_audit', 'egr_1')}: egress_audit egr_1: deleted: the row is gone"


@BOTH
def test_a_deleted_row_and_its_entry_are_named_by_the_gap(engine: Engine, sealed: dict[str, str],
                                                         tmp_path: Path) -> None:
    gone = pos_of(engine, "control", sealed["start"])
    with write(engine) as conn:
        unguard(conn, "control")
        unguard(conn, "ledger_chain")
        conn.execute(text("DELETE FROM control WHERE id = :id"), {"id": sealed["start"]})
        conn.execute(text("DELETE FROM ledger_chain WHERE pos = :p"), {"p": gone})
    bad = first_bad(wakeful(engine, tmp_path, "verify"))
    assert bad.startswith(f"pos {gone}: deleted: entries {gone}..{gone} are missing")


@BOTH
def test_a_row_inserted_behind_the_triggers_is_named(engine: Engine, sealed: dict[str, str], owner: str,
                                                    tmp_path: Path) -> None:
    with write(engine) as conn:
        unguard(conn, "control")
        conn.execute(text("INSERT INTO control (id, user_id, kind, actor, reason, created_at) "
                          "VALUES ('ctl_forged', :u, 'approve', 'user:owner', '', '2026-01-01 00:00:00')"),
                     {"u": owner})
    bad = first_bad(wakeful(engine, tmp_path, "verify"))
    assert bad.startswith("control ctl_forged: inserted: the row has no entry in the chain")


@BOTH
def test_reordered_entries_are_named(engine: Engine, sealed: dict[str, str], tmp_path: Path) -> None:
    first, second = pos_of(engine, "control", sealed["stop"]), pos_of(engine, "control", sealed["start"])
    with write(engine) as conn:
        unguard(conn, "ledger_chain")
        for was, now in ((first, -1), (second, first), (-1, second)):
            conn.execute(text("UPDATE ledger_chain SET pos = :now WHERE pos = :was"), {"now": now, "was": was})
    bad = first_bad(wakeful(engine, tmp_path, "verify"))
    assert bad.startswith(f"pos {first}: control {sealed['start']}: reordered")


@BOTH
def test_a_forged_checkpoint_is_named(engine: Engine, sealed: dict[str, str], tmp_path: Path) -> None:
    with engine.connect() as conn:
        head = conn.execute(select(ledger_checkpoints).order_by(ledger_checkpoints.c.pos.desc()).limit(1)).one()
    with write(engine) as conn:
        unguard(conn, "ledger_checkpoints")
        conn.execute(text("UPDATE ledger_checkpoints SET chain_hash = :h WHERE pos = :p"),
                     {"h": "ab" * 32, "p": head.pos})
    bad = first_bad(wakeful(engine, tmp_path, "verify"))
    assert bad.startswith(f"pos {head.pos}: ") and "checkpoint: its checkpoint's signature is not this key's" in bad


@BOTH
def test_a_consistent_rewrite_of_the_chain_is_caught_by_the_signed_checkpoint(
        engine: Engine, sealed: dict[str, str], tmp_path: Path) -> None:
    """Edit a row and recompute every hash after it: only the key's signature tells."""
    from wakeful.server.audit.canonical import GENESIS, chain_link, row_hash

    with write(engine) as conn:
        unguard(conn, "control")
        unguard(conn, "ledger_chain")
        conn.execute(text("UPDATE control SET reason = 'rewritten' WHERE id = :id"), {"id": sealed["stop"]})
    seen = snapshot(engine)
    with write(engine) as conn:
        chain = GENESIS
        for entry, row in seen.entries:
            digest = entry.row_hash if row is None else row_hash(entry.table, entry.part, row)
            chain = chain_link(chain, digest)
            conn.execute(update(ledger_chain).where(ledger_chain.c.pos == entry.pos)
                         .values(row_hash=digest, chain_hash=chain))
    bad = first_bad(wakeful(engine, tmp_path, "verify"))
    assert "checkpoint: the rows up to here do not hash to the chain hash its checkpoint signed" in bad


@BOTH
def test_an_export_verifies_offline_with_the_key_and_fails_once_edited(
        engine: Engine, sealed: dict[str, str], tmp_path: Path) -> None:
    exported = tmp_path / "ledger.jsonl"
    made = wakeful(engine, tmp_path, "export", str(exported))
    assert made.returncode == 0, made.stderr
    key = wakeful(engine, tmp_path, "key").stdout.strip()
    assert key.startswith("ed25519:")
    offline = tmp_path / "auditor"  # no database, no data directory of the server's
    ok = wakeful(engine, offline, "verify", "--export", str(exported), "--key", key)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"{exported} verifies: " in ok.stdout and not (offline / "wakeful.db").exists()

    other = load_or_create_key(tmp_path / "other.key").public.text()
    assert "checkpoint" in first_bad(wakeful(engine, offline, "verify", "--export", str(exported), "--key", other))

    lines = exported.read_text().splitlines()
    for number, line in enumerate(lines):
        item = json.loads(line)
        if item.get("table") == "egress_audit":
            item["row"]["verdict"] = "allow"
            lines[number] = json.dumps(item)
            pos = item["pos"]
    exported.write_text("\n".join(lines) + "\n")
    bad = first_bad(wakeful(engine, offline, "verify", "--export", str(exported), "--key", key))
    assert bad == f"pos {pos}: egress_audit egr_1: edited: the row no longer hashes to the hash sealed for it"


@BOTH
def test_the_same_row_hashes_the_same_on_sqlite_and_postgresql(engine: Engine, tmp_path: Path) -> None:
    at = datetime(2026, 12, 2, 18, 0, 0, 123456, tzinfo=UTC)
    with write(engine) as conn:
        egress.store_audit(conn, [EgressRecord(
            request_id="egr_same", at=at, user_id=None, client="tool_computer", attempt_id=None, action_id=None,
            method="GET", scheme="https", host="shop.example.com", port=443, path="/cart", verdict="allow",
            code=None, rule="shop", credential=None, bytes_up=12, bytes_down=2**40, upstream_status=200,
            latency_ms=0.1 + 0.2)], now=at)
    seal(engine, load_or_create_key(tmp_path / "ledger.key"), now=at)
    (entry, row), = [(e, r) for e, r in snapshot(engine).entries if e.key == "egr_same"]
    assert row == {"request_id": "egr_same", "at": "2026-12-02T18:00:00.123456Z", "user_id": None,
                   "client": "tool_computer", "grant_id": None, "action_id": None, "method": "GET", "scheme": "https",
                   "host": "shop.example.com", "port": 443, "path": "/cart", "verdict": "allow", "code": None,
                   "rule": "shop", "credential": None, "bytes_up": 12, "bytes_down": 2**40, "upstream_status": 200,
                   "latency_ms": 0.30000000000000004, "recorded_at": "2026-12-02T18:00:00.123456Z"}
    assert entry.computed == entry.row_hash == HASH_OF_THE_SAME_ROW


HASH_OF_THE_SAME_ROW = "81013282c82133972ec7fdcb5478be3e8ea3cba0db6f01f19bb92b438f3c3037"


def test_every_chained_table_has_its_insert_trigger(engine: Engine) -> None:
    with engine.connect() as conn:
        triggers = set(conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'")).scalars())
    assert {f"{table}_chain" for table in CHAINED} <= triggers
    assert {"attempts_chain_outcome", "attempts_chain_outcome_set", "ledger_chain_sealed_once"} <= triggers


def test_the_sweeper_seals_and_the_key_is_created_owner_only(runtime: Runtime, settings: Settings, engine: Engine,
                                                              clock: FakeClock, owner: str) -> None:
    history(engine, clock, owner)
    runtime.sweep_once()
    assert stat.S_IMODE(settings.ledger_key_path.stat().st_mode) == 0o600
    with engine.connect() as conn:
        assert conn.execute(select(ledger_chain).where(ledger_chain.c.pos.is_(None))).first() is None
        assert conn.execute(select(tasks)).first() is not None
    verdict = verify_database(engine, load_or_create_key(settings.ledger_key_path).public)
    assert verdict.ok and verdict.entries >= 6 and verdict.pending == 0
    assert runtime.seal_ledger() == 0  # nothing new: nothing sealed, no new checkpoint


def test_the_commands_in_the_audit_doc_verify_export_and_check_offline(engine: Engine, sealed: dict[str, str],
                                                                       tmp_path: Path) -> None:
    commands = doc_commands("audit.md", "ledger")
    assert commands == [["verify"], ["key", ">", "ledger.pub"], ["export", "ledger-export.jsonl"],
                        ["verify", "--export", "ledger-export.jsonl", "--key", "ledger.pub"]]
    work = tmp_path / "work"
    work.mkdir()
    for args in commands:
        target = args[args.index(">") + 1] if ">" in args else None
        result = wakeful(engine, tmp_path, *(args[:args.index(">")] if target else args), cwd=work)
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        if target:
            (work / target).write_text(result.stdout)
    assert "ledger-export.jsonl verifies: " in result.stdout


def test_the_command_line_refuses_what_it_cannot_check_in_one_line(tmp_path: Path) -> None:
    empty = wakeful(None, tmp_path / "nothing", "verify")
    assert empty.returncode == 2 and "wakeful: no_data:" in empty.stderr
    (tmp_path / "x.jsonl").write_text('{"format": "wakeful-ledger-export/1"}\n{"pos": "one"}\n')
    no_key = wakeful(None, tmp_path, "verify", "--export", str(tmp_path / "x.jsonl"))
    assert no_key.returncode == 2 and "wakeful: missing_key:" in no_key.stderr
    bad_key = wakeful(None, tmp_path, "verify", "--export", str(tmp_path / "x.jsonl"), "--key", "ed25519:nope")
    assert bad_key.returncode == 2 and "wakeful: invalid_key:" in bad_key.stderr
    key = load_or_create_key(tmp_path / "k").public.text()
    hostile = wakeful(None, tmp_path, "verify", "--export", str(tmp_path / "x.jsonl"), "--key", key)
    assert hostile.returncode == 2 and "wakeful: invalid_export: line 2 " in hostile.stderr
    missing = wakeful(None, tmp_path, "verify", "--export", str(tmp_path / "none.jsonl"), "--key", key)
    assert missing.returncode == 2 and "wakeful: cannot_read:" in missing.stderr
    (tmp_path / "histories.jsonl").write_text('{"task_id": "task_1", "kind": "task", "at": "2026-12-01T00:00:00"}\n')
    mixed_up = wakeful(None, tmp_path, "verify", "--export", str(tmp_path / "histories.jsonl"), "--key", key)
    assert mixed_up.returncode == 2 and "`wakeful ledger export -o FILE` writes" in mixed_up.stderr
    both = wakeful(None, tmp_path, "export", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "b.jsonl"))
    assert both.returncode == 2 and "wakeful: invalid_parameter:" in both.stderr and "give one" in both.stderr
    assert not (tmp_path / "a.jsonl").exists() and not (tmp_path / "b.jsonl").exists()
    assert "Traceback" not in (empty.stderr + no_key.stderr + bad_key.stderr + hostile.stderr + missing.stderr
                               + mixed_up.stderr + both.stderr)
