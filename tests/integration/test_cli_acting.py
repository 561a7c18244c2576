"""The control commands docs/acting.md shows, run as a user runs them, on a real action waiting for approval."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from tests.integration.test_cli import run
from tests.support.acting import World, world
from tests.support.templates import copy_template
from wakeful.proxy.clock import FakeClock, SystemClock
from wakeful.server.acting.policy import load_policy
from wakeful.server.store.db import make_engine, migrate, write
from wakeful.server.store.tables import Risk
from wakeful.server.store.users import ensure_user

DOC = (Path(__file__).resolve().parents[2] / "docs" / "acting.md").read_text()


@pytest.fixture
def data(tmp_path: Path, sqlite_template: Path) -> Iterator[tuple[Path, World]]:
    copy_template(sqlite_template, tmp_path / "wakeful.db")
    engine: Engine = make_engine(f"sqlite:///{tmp_path / 'wakeful.db'}")
    migrate(engine)
    clock = FakeClock()
    with write(engine) as conn:
        owner, _ = ensure_user(conn, name="owner", now=clock.now())
    with world(engine, clock, owner) as w:
        yield tmp_path, w


def waiting_action(w: World) -> tuple[str, str]:
    task = w.task()
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    return task.task_id, w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]


def test_approve_from_the_cli_admits_the_action_and_the_ledger_shows_why(data: tuple[Path, World]) -> None:
    tmp, w = data
    task_id, action_id = waiting_action(w)
    out = run(tmp, "approve", action_id).stdout
    assert f"{action_id}: admitted (admitted)" in out
    w.clock.set(SystemClock().now())  # the CLI wrote with the real clock
    w.dispatcher.drain()
    assert len(w.merchant.effects) == 1
    ledger = run(tmp, "ledger", task_id).stdout
    for kind in ("action", "verdict", "approval", "attempt", "outcome"):
        assert re.search(rf"^\S+\s+{kind}\s", ledger, re.M), kind
    assert "approved by cli:owner" in ledger
    run(tmp, "ledger", "export", "-o", str(tmp / "ledger.jsonl"))
    entries = [json.loads(line) for line in (tmp / "ledger.jsonl").read_text().splitlines()]
    assert {e["task_id"] for e in entries} == {task_id} and any(e["type"] == "approval" for e in entries)


def test_deny_from_the_cli_refuses_the_action(data: tuple[Path, World]) -> None:
    tmp, w = data
    _, action_id = waiting_action(w)
    assert f"{action_id}: refused (denied)" in run(tmp, "deny", action_id).stdout
    w.dispatcher.drain()
    assert w.merchant.effects == []


def test_pause_resume_revoke_and_close_from_the_cli(data: tuple[Path, World]) -> None:
    tmp, w = data
    task_id, action_id = waiting_action(w)
    assert "is paused" in run(tmp, "pause", task_id).stdout
    assert f"{action_id}: refused (paused)" in run(tmp, "approve", action_id).stdout
    assert "is active" in run(tmp, "resume", task_id).stdout
    assert "is revoked" in run(tmp, "revoke", task_id).stdout
    assert "is closed" in run(tmp, "close", task_id).stdout
    again = run(tmp, "pause", task_id, check=False)
    assert again.returncode == 2 and "invalid_transition" in again.stderr


def test_approving_an_unknown_action_is_a_clear_error(data: tuple[Path, World]) -> None:
    tmp, _ = data
    result = run(tmp, "approve", "act_nope", check=False)
    assert result.returncode == 2 and "unknown_action" in result.stderr


def test_the_policy_file_in_the_docs_loads(tmp_path: Path) -> None:
    block = re.search(r"```toml\n(per_action_cents.*?)```", DOC, re.S)
    assert block
    (tmp_path / "policy.toml").write_text(block.group(1))
    policy = load_policy(tmp_path / "policy.toml")
    assert policy.per_action_cents == 5000 and policy.rules[0].name == "small-orders"
    assert policy.tier("airline__order_flight", declared=Risk.ASK,
                       amount_cents=100)[1] == "small-orders"


def test_a_typo_in_the_policy_file_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "policy.toml").write_text("per_action_cent = 5\n")
    with pytest.raises(Exception) as refused:
        load_policy(tmp_path / "policy.toml")
    assert "per_action_cent" in str(refused.value) and getattr(refused.value, "code", "") == "invalid_policy"


def test_a_cli_write_wakes_a_running_server_at_once(tmp_path: Path) -> None:
    from tests.support.serve import ServeProcess
    from wakeful.server.core.nudge import nudge
    from wakeful.server.settings import Settings

    with ServeProcess({"WAKEFUL_DATA_DIR": str(tmp_path)}, log_path=tmp_path / "serve.log") as server:
        assert nudge(Settings(data_dir=tmp_path, port=server.port)) is True
    assert nudge(Settings(data_dir=tmp_path, port=server.port)) is False  # nobody listening: best effort, no error
